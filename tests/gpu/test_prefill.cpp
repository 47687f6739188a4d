// GPU dense and sparse MLA prefill against the float64 CPU reference, per SPEC section 5: ragged
// batches of new tokens over cached prefixes (a prompt of one token, pure prompts, extensions,
// requests with no new tokens), shuffled pages, NaN in every slot a kernel must not read,
// sentinel-filled outputs, page sizes 1, 17 and 64, fp8 and bf16 caches.
//
// The sparse index rows are built per new token like the sparse decode test's (the token's visible
// slots shuffled, cut to topk, one duplicated, -1 padding); rows of only -1 must give o = 0 and
// lse = -inf. With every visible token selected, sparse prefill must equal dense prefill.
//
// Sizes are kept small: the float64 reference takes about 1 us per (query row, head, attended token)
// on one core; the references here took 4.8 s on one core of a 2-core build machine (T = 203 over
// a 1000-token prefix the largest, 0.8 s) before the two cases of over 2048 new tokens that the
// narrow kernel's groups need, about 16 s more at that rate.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "gpu/device.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/environment.hpp"
#include "support/compare.hpp"
#include "support/expect_error.hpp"
#include "support/paged_fixture.hpp"
#include "support/reference_ops.hpp"
#include "support/scoped_env.hpp"

namespace latentkv::testing {
namespace {

constexpr float kScale = 0.0625f;  // glm5's 256^-0.5

// A parameterized case's name with every character gtest rejects replaced by '_'.
template <typename Case>
std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  std::ostringstream os;
  os << info.param;
  std::string s = os.str();
  for (char& ch : s) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return s;
}

using Batch = PrefillBatch;

std::ostream& operator<<(std::ostream& os, const Batch& batch) {
  return os << "B" << batch.prefixes.size() << "_T" << batch.rows();
}

// Sentinel-filled outputs o [T, H, 512] bf16 and lse [T, H] f32, on the host and on the device.
struct DeviceOutputs {
  HostTensor o, lse;
  DeviceBuffer d_o, d_lse;

  DeviceOutputs(std::int64_t rows, std::int64_t heads)
      : o(sentinel_tensor(DType::kBF16, {rows, heads, kLatentDim})),
        lse(sentinel_tensor(DType::kF32, {rows, heads})),
        d_o(o.raw(), o.bytes()),
        d_lse(lse.raw(), lse.bytes()) {}

  TensorView o_view() const { return o.view_of(d_o.get(), Device::cuda()); }
  TensorView lse_view() const { return lse.view_of(d_lse.get(), Device::cuda()); }
  void download() {
    d_o.download(o.raw(), o.bytes());
    d_lse.download(lse.raw(), lse.bytes());
  }
  // Downloads o and lse; whether both still hold their sentinels (a refused call wrote neither).
  bool untouched() {
    download();
    return is_sentinel(o) && is_sentinel(lse);
  }
};

// Plans `p` on `backend_name` (the cuda backend unless a cast baseline is asked for), hands it the
// planned workspace and a fault record, runs it and waits for it; `fault` gets the record's message
// ("" for none).
template <typename Params>
Plan plan_and_run(Params& p, std::string& fault, const std::string& backend_name = "cuda") {
  const Backend* found = find_backend(backend_name);
  if (found == nullptr) throw std::runtime_error("this build has no backend named " + backend_name);
  const Backend& cuda = *found;
  const DeviceInfo device = detect_device();
  const Plan plan = cuda.plan(p, device);
  DeviceBuffer workspace(plan.workspace_bytes);
  p.num_splits = plan.num_splits;
  p.workspace = workspace.get();
  p.workspace_bytes = workspace.bytes();
  FaultRecord record;
  p.fault = record.get();
  run(cuda, p, {}, device);
  if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error(cudaGetErrorString(cudaGetLastError()));
  fault = record.message();
  return plan;
}

struct GpuOutputs {
  HostTensor o, lse;  // what the GPU wrote: o [T, H, 512] bf16, lse [T, H] f32
  Plan plan;
  std::string fault;  // what the call noted in its fault record, "" for nothing
};

// A dense prefill's device side: copies of the fixture's cache and tables, cu and q, sentinel
// outputs, and its parameters over them (no workspace yet).
struct DeviceMlaPrefill {
  DeviceBuffer cache, table, lens, d_cu, d_q;
  DeviceOutputs out;
  MlaPrefillParams p;

  DeviceMlaPrefill(const PagedFixture& f, const HostTensor& q, const std::vector<std::int32_t>& cu)
      : cache(f.cache_bytes), table(f.block_table), lens(f.seq_lens), d_cu(cu), d_q(q.raw(), q.bytes()),
        out(q.shape()[0], q.shape()[1]) {
    p.q = q.view_of(d_q.get(), Device::cuda());
    p.cu_new_tokens =
        TensorView::contiguous(d_cu.get(), DType::kI32, {static_cast<std::int64_t>(cu.size())}, Device::cuda());
    p.cache = f.cache(cache.get<std::uint8_t>(), Device::cuda());
    p.block_table = f.block_table_view(table.get<std::int32_t>(), Device::cuda());
    p.seq_lens = f.seq_lens_view(lens.get<std::int32_t>(), Device::cuda());
    p.o = out.o_view();
    p.lse = out.lse_view();
    p.softmax_scale = kScale;
  }
};

// A sparse prefill of one new token on 8 heads over the index row `indices` [2048]: device copies of
// a random q and the row, a device pool of the fixture's size (its bytes not copied: the calls made
// with it are refused before they read it), sentinel outputs, and its parameters (no workspace yet).
struct DeviceSparseToken {
  HostTensor q;
  DeviceBuffer d_q, d_idx, cache;
  DeviceOutputs out;
  SparseMlaPrefillParams p;

  DeviceSparseToken(const PagedFixture& f, Rng& rng, const std::vector<std::int32_t>& indices)
      : q(random_bf16(rng, {1, 8, kQkDim})), d_q(q.raw(), q.bytes()), d_idx(indices), cache(f.cache_bytes),
        out(1, 8) {
    p.q = q.view_of(d_q.get(), Device::cuda());
    p.cache = f.cache(cache.get<std::uint8_t>(), Device::cuda());
    p.indices = TensorView::contiguous(d_idx.get(), DType::kI32, {1, kMaxTopk}, Device::cuda());
    p.o = out.o_view();
    p.lse = out.lse_view();
    p.softmax_scale = kScale;
  }
};

// Dense prefill of q [T, H, 576] on the GPU over device copies of the fixture.
GpuOutputs gpu_mla_prefill(const PagedFixture& f, const HostTensor& q, const std::vector<std::int32_t>& cu) {
  DeviceMlaPrefill d(f, q, cu);
  std::string fault;
  const Plan plan = plan_and_run(d.p, fault);
  d.out.download();
  return {std::move(d.out.o), std::move(d.out.lse), plan, std::move(fault)};
}

// Sparse prefill of q [T, H, 576] over indices [T, topk] on the GPU.
GpuOutputs gpu_sparse_prefill(const PagedFixture& f, const HostTensor& q, const HostTensor& indices,
                              const std::string& backend = "cuda") {
  DeviceBuffer cache(f.cache_bytes), d_q(q.raw(), q.bytes()), d_idx(indices.raw(), indices.bytes());
  DeviceOutputs out(q.shape()[0], q.shape()[1]);
  SparseMlaPrefillParams p;
  p.q = q.view_of(d_q.get(), Device::cuda());
  p.cache = f.cache(cache.get<std::uint8_t>(), Device::cuda());
  p.indices = indices.view_of(d_idx.get(), Device::cuda());
  p.o = out.o_view();
  p.lse = out.lse_view();
  p.softmax_scale = kScale;
  std::string fault;
  const Plan plan = plan_and_run(p, fault, backend);
  out.download();
  return {std::move(out.o), std::move(out.lse), plan, std::move(fault)};
}

// ---- dense prefill ---------------------------------------------------------------------------

struct DenseCase {
  KvDtype dtype;
  int heads;
  int page_size;
  Batch batch;
  ScaleMode scale_mode = ScaleMode::kPow2;  // of the cache's fp8 scales (kExact: amax / 448)
  std::int64_t pool_pages = 0;  // 0: the pages the requests need; else the pool's (pages_past_2gib)
};

std::ostream& operator<<(std::ostream& os, const DenseCase& c) {
  os << kv_dtype_name(c.dtype) << "_H" << c.heads << "_ps" << c.page_size << "_" << c.batch;
  if (c.scale_mode == ScaleMode::kExact) os << "_exactscales";
  return c.pool_pages > 0 ? os << "_pool" << c.pool_pages : os;
}

class GpuMlaPrefill : public ::testing::TestWithParam<DenseCase> {};

TEST_P(GpuMlaPrefill, MatchesReference) {
  LKV_REQUIRE_GPU();
  const DenseCase& c = GetParam();
  Rng rng = test_rng();
  PagedFixture f = make_prefill_fixture(c.batch, c.page_size, rng, c.dtype, false, c.scale_mode, c.pool_pages);
  if (c.pool_pages > 0) EXPECT_GE(highest_held_offset(f), kTwoGiB) << "no token past 2 GiB of the pool";
  const std::vector<std::int32_t> cu = cumulative(c.batch.new_tokens);
  const HostTensor q = random_bf16(rng, {cu.back(), c.heads, kQkDim});

  const AttentionOutputs ref = reference_mla_prefill(f, q, cu, kScale);
  const GpuOutputs got = gpu_mla_prefill(f, q, cu);
  EXPECT_TRUE(compare("o", got.o, ref.o, Tolerance::bf16_output())) << got.plan.num_splits << " splits";
  EXPECT_TRUE(compare("lse", got.lse, ref.lse, Tolerance::lse())) << got.plan.num_splits << " splits";
  EXPECT_EQ(got.fault, "") << "a fault noted for good input";
}

// Bad offsets, lengths and pages, one at a time: the prefill's own check of its requests notes the
// fault, and the record throws the reference's own Error for the same input. Requests 0 and 1 are
// fresh prompts (their new tokens are their lengths), so that one bad offset breaks two of the
// reference's checks and the record must name the one the reference names first; the block table
// has its spare -1 column, so a length past the capacity must be one fault.
TEST(GpuMlaPrefillFaults, RecordTheReferencesError) {
  LKV_REQUIRE_GPU();
  struct Bad {
    const char* what;
    std::function<void(PagedFixture&, std::vector<std::int32_t>&)> spoil;
  };
  const std::vector<Bad> bad = {
      {"an offset 0 below 0 (request 0's count too)", [](PagedFixture&, std::vector<std::int32_t>& cu) { cu[0] = -1; }},
      {"an offset past the next one (two counts)", [](PagedFixture&, std::vector<std::int32_t>& cu) { cu[1] = cu[2] + 1; }},
      {"more new tokens than a length", [](PagedFixture& f, std::vector<std::int32_t>&) { f.seq_lens[1] -= 1; }},
      {"offsets short of the rows", [](PagedFixture&, std::vector<std::int32_t>& cu) { cu.back() -= 1; }},
      {"a last offset below the one before (a count and the rows)", [](PagedFixture&, std::vector<std::int32_t>& cu) { cu.back() = cu[2] - 1; }},
      {"a page past the pool", [](PagedFixture& f, std::vector<std::int32_t>&) { f.block_table[2 * f.max_pages + 3] = static_cast<std::int32_t>(f.num_pages()); }},
      {"a negative page", [](PagedFixture& f, std::vector<std::int32_t>&) { f.block_table[f.max_pages] = -9; }},
      {"a length past the block table", [](PagedFixture& f, std::vector<std::int32_t>&) { f.seq_lens[2] = f.max_pages * f.page_size + 1; }},
  };
  // 8 heads run in groups of new tokens on sm_90a (their groups' check), 64 per token (the rows'
  // check kernel, prefill_rows.cu).
  for (const int heads : {8, 64}) {
    for (const Bad& b : bad) {
      SCOPED_TRACE(std::string(b.what) + ", H " + std::to_string(heads));
      Rng rng = test_rng();
      const Batch batch = {{0, 0, 900}, {5, 40, 100}};
      PagedFixture f = make_prefill_fixture(batch, 64, rng, KvDtype::kFp8E4M3, false);
      std::vector<std::int32_t> cu = cumulative(batch.new_tokens);
      const HostTensor q = random_bf16(rng, {cu.back(), heads, kQkDim});
      b.spoil(f, cu);
      const std::string expected = error_of([&] { reference_mla_prefill(f, q, cu, kScale); });
      ASSERT_NE(expected, "") << "the reference takes the input";
      EXPECT_EQ(gpu_mla_prefill(f, q, cu).fault, expected);
    }
  }
}

std::vector<DenseCase> dense_cases() {
  const KvDtype fp8 = KvDtype::kFp8E4M3, bf16 = KvDtype::kBf16;
  // A prompt of one token, a short extension, a long extension.
  const Batch ragged = {{0, 40, 300}, {1, 5, 17}};
  // Lengths around a page of 17 (16, 17, 18, 34), a request with no new tokens, an empty request.
  const Batch around17 = {{0, 15, 1, 3, 0, 17}, {16, 2, 17, 0, 0, 17}};
  // Odd everything.
  const Batch odd = {{7, 33, 101, 0}, {3, 11, 29, 13}};
  std::vector<DenseCase> v;
  for (int h : {1, 8, 16}) v.push_back({fp8, h, 64, ragged});
  v.push_back({fp8, 64, 64, {{0, 63, 129}, {20, 1, 7}}});  // prefixes page_size - 1, 2 * page_size + 1
  v.push_back({fp8, 128, 64, {{0, 40, 70}, {1, 5, 17}}});
  v.push_back({fp8, 16, 17, around17});
  v.push_back({fp8, 8, 1, {{0, 3, 50}, {1, 2, 9}}});
  v.push_back({fp8, 16, 64, odd});
  v.push_back({fp8, 8, 64, {{0}, {1}}});          // a prompt of length 1 alone
  v.push_back({fp8, 16, 64, {{0, 0}, {97, 7}}});  // pure prompts: causal among the new tokens only
  v.push_back({fp8, 4, 64, {{1000}, {203}}});     // T around 200 over a long prefix
  v.push_back({fp8, 1, 17, {{0, 501}, {3, 97}}}); // a long extension next to a short prompt
  // On sm_90a, H <= 32 runs the new tokens in groups of 64 / H (prefill.cu) where the groups are
  // at least half full on average, and per token otherwise (the H 8 cases of page size 1 and of one
  // new token above): few groups over a long prefix (many splits, the combine's group rows), and
  // head counts whose groups leave rows of the 64 unused. On the mma.sync kernels (other GPUs, and
  // LATENTKV_MLA_KERNEL=mma) H <= 8 runs in groups of 16 / H on the narrow kernel from 2048 new
  // tokens on: the last two cases here (pairs at H 8 on pages of 64, groups of 5 at H 3 on pages of
  // 17 with requests of one and of odd counts of new tokens).
  v.push_back({fp8, 32, 64, {{3000, 0}, {4, 33}}});
  v.push_back({fp8, 5, 17, {{0, 130, 7}, {25, 3, 40}}});
  v.push_back({fp8, 20, 1, {{9, 0}, {31, 18}}});
  v.push_back({fp8, 8, 64, {{0, 30}, {1500, 561}}});
  v.push_back({fp8, 3, 17, {{5, 200, 0}, {2041, 9, 1}}});
  v.push_back({bf16, 8, 64, ragged});
  v.push_back({bf16, 16, 17, around17});
  v.push_back({bf16, 64, 1, {{0, 20}, {9, 4}}});
  v.push_back({bf16, 128, 64, {{0, 30}, {2, 7}}});
  v.push_back({bf16, 8, 64, {{0}, {1}}});
  // Scales that are no powers of two: per token (H 128), in groups (H 8, H 32) and on the narrow
  // kernel's groups (H 3 from 2048 new tokens, on the mma.sync kernels).
  const ScaleMode exact = ScaleMode::kExact;
  v.push_back({fp8, 128, 64, {{0, 40, 70}, {1, 5, 17}}, exact});
  v.push_back({fp8, 8, 64, {{0, 30}, {1500, 561}}, exact});
  v.push_back({fp8, 32, 64, {{3000, 0}, {4, 33}}, exact});
  v.push_back({fp8, 3, 17, {{5, 200, 0}, {2041, 9, 1}}, exact});
  // Pages larger than a split: 1000 (no power of two) and 4096 tokens, in groups and per token.
  v.push_back({fp8, 8, 1000, {{0, 1500}, {30, 100}}});
  v.push_back({fp8, 64, 4096, {{0, 5000}, {20, 7}}});
  // Pools of 1.5 x 2^31 bytes (test_mla_decode.cpp): prefixes and new tokens past 2 GiB, in groups
  // (H 8) and per token (H 64).
  const ScaleMode pow2 = ScaleMode::kPow2;
  v.push_back({fp8, 8, 64, {{4000, 2500}, {48, 24}}, pow2, pages_past_2gib(64, fp8)});
  v.push_back({fp8, 64, 64, {{3000, 3000}, {8, 4}}, pow2, pages_past_2gib(64, fp8)});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuMlaPrefill, ::testing::ValuesIn(dense_cases()), case_name<DenseCase>);

// All cached latent values equal => every output element equals that value exactly (the softmax
// weights sum to one whatever the scores), for every new token of every request.
TEST(GpuMlaPrefillExact, ConstantValuesGiveThatValue) {
  LKV_REQUIRE_GPU();
  for (KvDtype dtype : {KvDtype::kFp8E4M3, KvDtype::kBf16}) {
    Rng rng = test_rng(kv_dtype_name(dtype));
    PagedFixtureOptions opt;
    opt.page_size = 17;
    opt.kv_dtype = dtype;
    const Batch batch = {{0, 40, 120}, {1, 20, 45}};
    opt.lengths = batch.lengths();
    opt.with_indexer = false;
    opt.token_values = [](std::int64_t, std::int64_t, std::uint16_t* latent, std::uint16_t*) {
      for (int i = 0; i < kLatentDim; ++i) latent[i] = bf16_encode(0.75f);
      for (int i = kLatentDim; i < kQkDim; ++i) latent[i] = bf16_encode(static_cast<float>(i % 7) - 3.0f);
    };
    PagedFixture f = make_paged_fixture(opt, rng);
    const std::vector<std::int32_t> cu = cumulative(batch.new_tokens);
    const HostTensor q = random_bf16(rng, {cu.back(), 8, kQkDim});
    const GpuOutputs got = gpu_mla_prefill(f, q, cu);
    for (std::int64_t i = 0; i < got.o.numel(); ++i) {
      ASSERT_EQ(got.o.get(i), 0.75) << kv_dtype_name(dtype) << ", element " << i;
    }
  }
}

// A NaN code in one new token of a prompt (which the appends refuse, but a cache written by other
// code may hold) is hidden by the causal mask from the new tokens before it: their rows stay
// finite, as in the reference, also where they share a group with the tokens that see it (the
// kernels weigh a hidden token by P = 0, and 0 x NaN would be NaN). Groups: 8 heads and 32 take the
// wgmma kernel's groups (8 and 2 new tokens) on sm_90; one head over 2048 new tokens under
// LATENTKV_MLA_KERNEL=mma the narrow kernel's (16), elsewhere per token.
TEST(GpuMlaPrefillNan, ANanNewTokenStaysOutOfTheEarlierTokensRows) {
  LKV_REQUIRE_GPU();
  struct Case {
    const char* kernel;
    int heads;
    Batch batch;
    std::int64_t token;  // of request 0, with a NaN code in latent dim 5
  };
  const Case cases[] = {{"auto", 8, {{100, 0}, {12, 5}}, 103},
                        {"auto", 32, {{100, 0}, {12, 5}}, 105},
                        {"mma", 8, {{100, 0}, {12, 5}}, 103},
                        {"mma", 1, {{0}, {2048}}, 5}};
  for (const Case& c : cases) {
    Rng rng = test_rng();
    PagedFixture f = make_prefill_fixture(c.batch, 64, rng, KvDtype::kFp8E4M3, false);
    const std::int64_t slot =
        static_cast<std::int64_t>(f.block_table[c.token / f.page_size]) * f.page_size + c.token % f.page_size;
    f.cache_bytes[static_cast<std::size_t>(slot * 656 + 5)] = 0x7F;
    const std::vector<std::int32_t> cu = cumulative(c.batch.new_tokens);
    const HostTensor q = random_bf16(rng, {cu.back(), c.heads, kQkDim});
    const AttentionOutputs ref = reference_mla_prefill(f, q, cu, kScale);
    const GpuOutputs got = [&] {
      const ScopedEnv forced(kMlaKernelVariable, c.kernel);
      return gpu_mla_prefill(f, q, cu);
    }();
    SCOPED_TRACE(std::string(c.kernel) + ", H " + std::to_string(c.heads) + ", NaN in position " + std::to_string(c.token));
    const std::int64_t nan_row = c.token - c.batch.prefixes[0];  // the first new token that sees it
    ASSERT_TRUE(std::isfinite(ref.lse.get((nan_row - 1) * c.heads)));
    ASSERT_TRUE(std::isnan(ref.lse.get(nan_row * c.heads)));
    EXPECT_TRUE(compare("o", got.o, ref.o, Tolerance::bf16_output())) << got.plan.num_splits << " splits";
    EXPECT_TRUE(compare("lse", got.lse, ref.lse, Tolerance::lse())) << got.plan.num_splits << " splits";
  }
}

// ---- sparse prefill --------------------------------------------------------------------------

// Index rows [T, cols], row cu[b] + j for new token j of request b: the slots of the positions that
// token sees (t < L_b - n_b + j + 1) shuffled, at most cols of them, one duplicated where room
// allows, the rest -1, all in random order.
HostTensor make_prefill_indices(const PagedFixture& f, const std::vector<std::int64_t>& new_tokens, int cols,
                                Rng& rng) {
  std::int64_t rows = 0;
  for (std::int64_t n : new_tokens) rows += n;
  HostTensor t(DType::kI32, {rows, cols});
  auto* out = t.data<std::int32_t>();
  std::int64_t r = 0;
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    const std::int64_t length = f.seq_lens[static_cast<std::size_t>(b)];
    const std::int64_t n = new_tokens[static_cast<std::size_t>(b)];
    for (std::int64_t j = 0; j < n; ++j, ++r) {
      const std::int64_t visible = std::max<std::int64_t>(0, length - n + j + 1);
      std::vector<std::int32_t> row = f.slots(b, visible);
      std::shuffle(row.begin(), row.end(), rng);
      if (static_cast<int>(row.size()) > cols) row.resize(static_cast<std::size_t>(cols));
      if (!row.empty() && static_cast<int>(row.size()) < cols) row.push_back(row.front());  // a duplicate
      row.resize(static_cast<std::size_t>(cols), -1);
      std::shuffle(row.begin(), row.end(), rng);
      std::copy(row.begin(), row.end(), out + r * cols);
    }
  }
  return t;
}

struct SparseCase {
  KvDtype dtype;
  int heads;
  int topk;  // index row width
  int page_size;
  Batch batch;
  int empty_every = 0;  // > 0: rows r with r % empty_every == empty_every - 1 become all -1
  std::string backend = "cuda";  // or a cast baseline: gather_cast, cast_full
  ScaleMode scale_mode = ScaleMode::kPow2;  // of the cache's fp8 scales (kExact: amax / 448)
  std::int64_t pool_pages = 0;  // 0: the pages the requests need; else the pool's (pages_past_2gib)
};

std::ostream& operator<<(std::ostream& os, const SparseCase& c) {
  os << kv_dtype_name(c.dtype) << "_H" << c.heads << "_k" << c.topk << "_ps" << c.page_size << "_" << c.batch;
  if (c.empty_every) os << "_empty" << c.empty_every;
  if (c.backend != "cuda") os << "_" << c.backend;
  if (c.scale_mode == ScaleMode::kExact) os << "_exactscales";
  if (c.pool_pages > 0) os << "_pool" << c.pool_pages;
  return os;
}

class GpuSparseMlaPrefill : public ::testing::TestWithParam<SparseCase> {};

TEST_P(GpuSparseMlaPrefill, MatchesReference) {
  LKV_REQUIRE_GPU();
  const SparseCase& c = GetParam();
  Rng rng = test_rng();
  PagedFixture f = make_prefill_fixture(c.batch, c.page_size, rng, c.dtype, false, c.scale_mode, c.pool_pages);
  const std::int64_t rows = c.batch.rows();
  const HostTensor q = random_bf16(rng, {rows, c.heads, kQkDim});
  HostTensor indices = make_prefill_indices(f, c.batch.new_tokens, c.topk, rng);
  if (c.pool_pages > 0) EXPECT_GE(highest_listed_offset(f, indices), kTwoGiB) << "no slot past 2 GiB of the pool listed";
  std::vector<std::int64_t> empty;
  for (std::int64_t r = 0; c.empty_every > 0 && r < rows; ++r) {
    if (r % c.empty_every != c.empty_every - 1) continue;
    std::fill_n(indices.data<std::int32_t>() + r * c.topk, c.topk, -1);
    empty.push_back(r);
  }
  poison_unlisted_slots(f, indices);  // NaN in every slot no row selects

  const AttentionOutputs ref = reference_sparse_prefill(f, q, indices, kScale);
  const GpuOutputs got = gpu_sparse_prefill(f, q, indices, c.backend);
  EXPECT_TRUE(compare("o", got.o, ref.o, Tolerance::bf16_output())) << got.plan.num_splits << " splits";
  EXPECT_TRUE(compare("lse", got.lse, ref.lse, Tolerance::lse())) << got.plan.num_splits << " splits";
  // Empty rows exactly: o = 0 and lse = -inf (not a NaN, not the sentinel, not a tiny number).
  for (std::int64_t r : empty) {
    for (std::int64_t h = 0; h < c.heads; ++h) {
      const double lse = got.lse.get(r * c.heads + h);
      EXPECT_TRUE(std::isinf(lse) && lse < 0) << "empty row " << r << " head " << h << ": lse " << lse;
      for (std::int64_t j = 0; j < kLatentDim; ++j) {
        const double o = got.o.get((r * c.heads + h) * kLatentDim + j);
        ASSERT_EQ(o, 0.0) << "empty row " << r << " head " << h << " element " << j;
      }
    }
  }
}

// A split count asked of a prefill's plan sizes the partials of one launch's slice of new tokens
// (at most 65,535, a grid dimension), not of every new token: past that many, more new tokens ask
// for no more partials (the dense per-token prefill only for its per-token tables). Planned from
// shapes alone: nothing is allocated or run.
TEST(GpuPrefillPlan, SplitsAskedForSizeOneSlice) {
  LKV_REQUIRE_GPU();
  const Backend& cuda = *find_backend("cuda");
  const DeviceInfo device = detect_device();
  int placeholder = 0;  // the views are never read: a plan reads shapes
  const auto shaped = [&](DType dtype, std::initializer_list<std::int64_t> dims) {
    return TensorView::contiguous(&placeholder, dtype, dims, Device::cuda());
  };
  LatentCache cache;
  cache.data = reinterpret_cast<std::uint8_t*>(&placeholder);
  cache.num_pages = 4096;
  cache.device = Device::cuda();
  const auto sparse_plan = [&](std::int64_t t) {
    SparseMlaPrefillParams p;
    p.q = shaped(DType::kBF16, {t, 128, kQkDim});
    p.indices = shaped(DType::kI32, {t, kMaxTopk});
    p.cache = cache;
    p.num_splits = 2;
    return cuda.plan(p, device);
  };
  EXPECT_EQ(sparse_plan(2 * kMaxGpuRequests).workspace_bytes, sparse_plan(kMaxGpuRequests).workspace_bytes);
  EXPECT_LT(sparse_plan(kMaxGpuRequests - 1).workspace_bytes, sparse_plan(kMaxGpuRequests).workspace_bytes);
  const auto dense_plan = [&](std::int64_t t) {
    MlaPrefillParams p;
    p.q = shaped(DType::kBF16, {t, 128, kQkDim});
    p.cu_new_tokens = shaped(DType::kI32, {2});
    p.seq_lens = shaped(DType::kI32, {1});
    p.block_table = shaped(DType::kI32, {1, 4096});
    p.cache = cache;
    p.num_splits = 2;
    return cuda.plan(p, device);
  };
  // Per new token past the slice: its block table (4096 pages) and length, 4 bytes each.
  const std::size_t per_token_tables = 4097 * 4;
  const std::size_t growth =
      dense_plan(2 * kMaxGpuRequests).workspace_bytes - dense_plan(kMaxGpuRequests).workspace_bytes;
  EXPECT_LE(growth, kMaxGpuRequests * per_token_tables + 4096);
}

// 1100 prompts of 60 new tokens: 66,000 query rows, more than one decode launch takes (65,535, a
// grid dimension), so both prefills run in two slices; every row against the reference.
// A workspace one byte short of the plan's is refused before anything is queued, the error giving
// the workspace_bytes the caller passed (not what is left of it after the block tables): a dense
// prefill of a few new tokens over a long prefix, whose plan splits the prefix (per token on 128
// heads; in groups of new tokens on 8 heads where the kernels take them), and a sparse prefill of
// one token. The outputs stay sentinels.
TEST(GpuPrefillBadInput, WorkspaceShortOfThePlanIsRefused) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  const Backend& cuda = *find_backend("cuda");
  const DeviceInfo device = detect_device();
  const auto run_short = [&](auto& p, const char* op) {
    const Plan plan = cuda.plan(p, device);
    ASSERT_GT(plan.num_splits, 1) << "the case should split its tokens";
    DeviceBuffer workspace(plan.workspace_bytes);
    p.num_splits = plan.num_splits;
    p.workspace = workspace.get();
    p.workspace_bytes = plan.workspace_bytes - 1;
    EXPECT_TRUE(throws_error([&] { run(cuda, p, {}, device); }, op, "workspace_bytes",
                             std::to_string(plan.workspace_bytes - 1)));
    LKV_CUDA_OK(cudaDeviceSynchronize());
  };
  const Batch batch{{4096}, {8}};
  PagedFixture f = make_prefill_fixture(batch, 64, rng, KvDtype::kFp8E4M3, false);
  const std::vector<std::int32_t> cu = cumulative(batch.new_tokens);
  for (const std::int64_t heads : {128, 8}) {
    SCOPED_TRACE("mla_prefill, H " + std::to_string(heads));
    const HostTensor q = random_bf16(rng, {cu.back(), heads, kQkDim});
    DeviceMlaPrefill d(f, q, cu);
    run_short(d.p, "mla_prefill");
    EXPECT_TRUE(d.out.untouched());
  }
  {
    SCOPED_TRACE("sparse_mla_prefill");
    std::vector<std::int32_t> slots(kMaxTopk);
    for (int i = 0; i < kMaxTopk; ++i) slots[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(f.slot(0, i));
    DeviceSparseToken d(f, rng, slots);
    run_short(d.p, "sparse_mla_prefill");
    EXPECT_TRUE(d.out.untouched());
  }
}

// A workspace that is not 16-byte aligned (a caller's sub-allocation) is refused before anything is
// queued, naming it: the dense prefill of a 64-token prompt on 8 heads (its tables and groups' spans,
// then the decode's partials) and the sparse prefill of one token over 2048 indices (its split
// partials), which the kernels read and write in 8- and 16-byte pieces. The outputs stay sentinels.
TEST(GpuPrefillBadInput, MisalignedWorkspaceIsRefused) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  const Batch batch{{0}, {64}};
  PagedFixture f = make_prefill_fixture(batch, 64, rng, KvDtype::kFp8E4M3, false);
  const std::vector<std::int32_t> cu = cumulative(batch.new_tokens);
  const HostTensor q = random_bf16(rng, {cu.back(), 8, kQkDim});
  const Backend& cuda = *find_backend("cuda");
  const DeviceInfo device = detect_device();
  // The planned workspace 4 bytes into a buffer of 16 more.
  const auto run_misaligned = [&](auto& p, const char* op) {
    const Plan plan = cuda.plan(p, device);
    DeviceBuffer workspace(plan.workspace_bytes + 16);
    p.num_splits = plan.num_splits;
    p.workspace = workspace.get<std::uint8_t>() + 4;
    p.workspace_bytes = plan.workspace_bytes;
    EXPECT_TRUE(throws_error([&] { run(cuda, p, {}, device); }, op, "workspace", "not 16-byte aligned"));
    LKV_CUDA_OK(cudaDeviceSynchronize());
  };
  {
    SCOPED_TRACE("mla_prefill");
    DeviceMlaPrefill d(f, q, cu);
    run_misaligned(d.p, "mla_prefill");
    EXPECT_TRUE(d.out.untouched());
  }
  {
    SCOPED_TRACE("sparse_mla_prefill");
    DeviceSparseToken d(f, rng, std::vector<std::int32_t>(kMaxTopk, -1));
    run_misaligned(d.p, "sparse_mla_prefill");
    EXPECT_TRUE(d.out.untouched());
  }
}

TEST(GpuPrefillLarge, MoreNewTokensThanAGridColumn) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  const Batch batch = {std::vector<std::int64_t>(1100, 0), std::vector<std::int64_t>(1100, 60)};
  PagedFixture f = make_prefill_fixture(batch, 64, rng, KvDtype::kFp8E4M3, false);
  const HostTensor q = random_bf16(rng, {batch.rows(), 1, kQkDim});
  const std::vector<std::int32_t> cu = cumulative(batch.new_tokens);
  const AttentionOutputs dense_ref = reference_mla_prefill(f, q, cu, kScale);
  const GpuOutputs dense = gpu_mla_prefill(f, q, cu);
  EXPECT_TRUE(compare("dense o", dense.o, dense_ref.o, Tolerance::bf16_output()));
  EXPECT_TRUE(compare("dense lse", dense.lse, dense_ref.lse, Tolerance::lse()));
  const HostTensor indices = make_prefill_indices(f, batch.new_tokens, 8, rng);
  const AttentionOutputs sparse_ref = reference_sparse_prefill(f, q, indices, kScale);
  const GpuOutputs sparse = gpu_sparse_prefill(f, q, indices);
  EXPECT_TRUE(compare("sparse o", sparse.o, sparse_ref.o, Tolerance::bf16_output()));
  EXPECT_TRUE(compare("sparse lse", sparse.lse, sparse_ref.lse, Tolerance::lse()));
  EXPECT_EQ(dense.fault + sparse.fault, "") << "a fault noted for good input";

  // A slot past the pool in the second slice's rows: the record names its element in the caller's
  // [T, topk] indices, as the reference does.
  HostTensor spoiled = indices;
  spoiled.data<std::int32_t>()[65600 * 8 + 3] = static_cast<std::int32_t>(f.num_pages() * f.page_size + 1);
  const std::string expected = error_of([&] { reference_sparse_prefill(f, q, spoiled, kScale); });
  ASSERT_NE(expected, "");
  EXPECT_EQ(gpu_sparse_prefill(f, q, spoiled).fault, expected);

  // An inf in q in the second slice: both prefills name its element in the caller's [T, 1, 576] q.
  HostTensor bad_q = q;
  bad_q.set(65700 * kQkDim + 13, std::numeric_limits<double>::infinity());
  const std::string dense_expected = error_of([&] { reference_mla_prefill(f, bad_q, cu, kScale); });
  const std::string sparse_expected = error_of([&] { reference_sparse_prefill(f, bad_q, indices, kScale); });
  ASSERT_NE(dense_expected, "");
  ASSERT_NE(sparse_expected, "");
  EXPECT_EQ(gpu_mla_prefill(f, bad_q, cu).fault, dense_expected);
  EXPECT_EQ(gpu_sparse_prefill(f, bad_q, indices).fault, sparse_expected);
}

// A NaN in q (a kernel of its own checks the dense prefill's q; the sparse one's kernels check it as
// they stage it), and a prefill of no new tokens whose offsets are wrong: the record throws the
// reference's own Error for the same input.
TEST(GpuMlaPrefillFaults, NonFiniteQueriesAndEmptyPrefillsAreTheReferencesErrors) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  const Batch batch = {{0, 40, 300}, {5, 40, 100}};
  PagedFixture f = make_prefill_fixture(batch, 64, rng, KvDtype::kFp8E4M3, false);
  const std::vector<std::int32_t> cu = cumulative(batch.new_tokens);
  for (const int heads : {8, 128}) {
    SCOPED_TRACE("H " + std::to_string(heads));
    HostTensor q = random_bf16(rng, {cu.back(), heads, kQkDim});
    q.set((100 * heads + heads - 1) * kQkDim + 520, std::nan(""));
    std::string expected = error_of([&] { reference_mla_prefill(f, q, cu, kScale); });
    ASSERT_NE(expected, "") << "the reference takes the input";
    EXPECT_EQ(gpu_mla_prefill(f, q, cu).fault, expected);
    const HostTensor indices = make_prefill_indices(f, batch.new_tokens, 64, rng);
    expected = error_of([&] { reference_sparse_prefill(f, q, indices, kScale); });
    ASSERT_NE(expected, "") << "the reference takes the input";
    EXPECT_EQ(gpu_sparse_prefill(f, q, indices).fault, expected);
  }
  // No new tokens: cu_new_tokens must be all zeros; each bad case breaks one of the reference's checks.
  const HostTensor none = random_bf16(rng, {0, 8, kQkDim});
  EXPECT_EQ(gpu_mla_prefill(f, none, {0, 0, 0, 0}).fault, "") << "a fault noted for good input";
  for (const std::vector<std::int32_t>& bad : {std::vector<std::int32_t>{1, 0, 0, 0}, std::vector<std::int32_t>{0, 0, 2, 0},
                                               std::vector<std::int32_t>{0, 0, 0, 3}}) {
    const std::string expected = error_of([&] { reference_mla_prefill(f, none, bad, kScale); });
    ASSERT_NE(expected, "") << "the reference takes the input";
    EXPECT_EQ(gpu_mla_prefill(f, none, bad).fault, expected);
  }
}

std::vector<SparseCase> sparse_cases() {
  const KvDtype fp8 = KvDtype::kFp8E4M3, bf16 = KvDtype::kBf16;
  const Batch ragged = {{0, 40, 300}, {1, 5, 17}};
  // Rows seeing fewer than 2048 tokens (padding and a duplicate) and more (cut to 2048).
  const Batch long_ragged = {{2044, 0, 30}, {5, 20, 2}};
  std::vector<SparseCase> v;
  for (int h : {8, 16}) v.push_back({fp8, h, 64, 64, ragged});
  v.push_back({fp8, 16, 64, 17, {{0, 15, 1, 3, 0, 17}, {16, 2, 17, 0, 0, 17}}});
  v.push_back({fp8, 8, 64, 1, {{0, 3, 50}, {1, 2, 9}}});
  v.push_back({fp8, 8, 64, 64, ragged, 4});  // every fourth row empty
  v.push_back({fp8, 128, 64, 64, {{0, 100}, {3, 20}}, 5});
  v.push_back({fp8, 8, 2048, 64, long_ragged});
  v.push_back({fp8, 16, 2048, 17, long_ragged, 7});
  v.push_back({fp8, 128, 2048, 64, {{500, 2100}, {1, 1}}});
  v.push_back({fp8, 8, 2048, 1, {{0, 2047}, {5, 4}}});
  v.push_back({bf16, 8, 64, 64, ragged, 6});
  v.push_back({bf16, 8, 2048, 17, long_ragged});
  v.push_back({bf16, 128, 64, 64, {{0, 50}, {3, 9}}});
  // The cast baselines (the selected fp8 tokens, or the whole pool, cast to bf16 first).
  v.push_back({fp8, 8, 64, 64, ragged, 4, "gather_cast"});
  v.push_back({fp8, 16, 2048, 17, long_ragged, 7, "cast_full"});
  v.push_back({fp8, 128, 64, 64, {{0, 100}, {3, 20}}, 5, "gather_cast"});
  // Scales that are no powers of two (the narrow and the wgmma kernels), and odd heads and row widths.
  v.push_back({fp8, 8, 2048, 64, long_ragged, 0, "cuda", ScaleMode::kExact});
  v.push_back({fp8, 128, 2048, 64, {{500, 2100}, {1, 1}}, 0, "cuda", ScaleMode::kExact});
  v.push_back({fp8, 7, 33, 17, ragged, 3});
  v.push_back({fp8, 33, 2047, 64, long_ragged});
  // Pages larger than a split (1000 and 4096 tokens) on the narrow and the wgmma kernels.
  v.push_back({fp8, 8, 2048, 1000, long_ragged});
  v.push_back({fp8, 128, 256, 4096, {{0, 5000}, {4, 3}}});
  // Pools of 1.5 x 2^31 bytes (test_mla_decode.cpp): selected slots past 2 GiB on the narrow and the
  // wgmma kernels.
  v.push_back({fp8, 8, 2048, 64, {{8000, 4000}, {40, 20}}, 0, "cuda", ScaleMode::kPow2, pages_past_2gib(64, fp8)});
  v.push_back({fp8, 128, 2048, 64, {{8000, 4000}, {6, 3}}, 0, "cuda", ScaleMode::kPow2, pages_past_2gib(64, fp8)});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuSparseMlaPrefill, ::testing::ValuesIn(sparse_cases()), case_name<SparseCase>);

// Every index row all -1: o = 0 and lse = -inf everywhere (no row of the batch attends to anything).
TEST(GpuSparseMlaPrefillEmpty, AllRowsEmptyGiveZerosAndMinusInf) {
  LKV_REQUIRE_GPU();
  for (KvDtype dtype : {KvDtype::kFp8E4M3, KvDtype::kBf16}) {
    Rng rng = test_rng(kv_dtype_name(dtype));
    const Batch batch = {{0, 40}, {3, 9}};
    PagedFixture f = make_prefill_fixture(batch, 64, rng, dtype, false);
    const HostTensor q = random_bf16(rng, {batch.rows(), 16, kQkDim});
    HostTensor indices(DType::kI32, {batch.rows(), 64});
    std::fill_n(indices.data<std::int32_t>(), indices.numel(), -1);
    const GpuOutputs got = gpu_sparse_prefill(f, q, indices);
    for (std::int64_t i = 0; i < got.lse.numel(); ++i) {
      const double lse = got.lse.get(i);
      ASSERT_TRUE(std::isinf(lse) && lse < 0) << kv_dtype_name(dtype) << ", lse element " << i << ": " << lse;
    }
    for (std::int64_t i = 0; i < got.o.numel(); ++i) {
      ASSERT_EQ(got.o.get(i), 0.0) << kv_dtype_name(dtype) << ", o element " << i;
    }
  }
}

// ---- sparse = dense ----------------------------------------------------------------------------

// With every position a token sees selected (in shuffled order, -1 scattered among them), sparse
// prefill on the GPU equals the reference dense prefill (SPEC section 4: index_topk >= visible).
struct EqualsDenseCase {
  KvDtype dtype;
  int heads;
  int topk;  // at least the most positions any token sees
  int page_size;
  Batch batch;
};

std::ostream& operator<<(std::ostream& os, const EqualsDenseCase& c) {
  return os << kv_dtype_name(c.dtype) << "_H" << c.heads << "_k" << c.topk << "_ps" << c.page_size << "_" << c.batch;
}

class GpuSparsePrefillEqualsDense : public ::testing::TestWithParam<EqualsDenseCase> {};

TEST_P(GpuSparsePrefillEqualsDense, EverySelectedEqualsDenseReference) {
  LKV_REQUIRE_GPU();
  const EqualsDenseCase& c = GetParam();
  Rng rng = test_rng();
  PagedFixture f = make_prefill_fixture(c.batch, c.page_size, rng, c.dtype, false);
  ASSERT_LE(f.max_len(), c.topk) << "the case's topk must cover every visible position";
  const std::vector<std::int32_t> cu = cumulative(c.batch.new_tokens);
  const HostTensor q = random_bf16(rng, {cu.back(), c.heads, kQkDim});
  const HostTensor indices = all_visible_indices(f, c.batch.new_tokens, c.topk, rng);

  const AttentionOutputs dense = reference_mla_prefill(f, q, cu, kScale);
  const GpuOutputs got = gpu_sparse_prefill(f, q, indices);
  EXPECT_TRUE(compare("o vs dense", got.o, dense.o, Tolerance::bf16_output())) << got.plan.num_splits << " splits";
  EXPECT_TRUE(compare("lse vs dense", got.lse, dense.lse, Tolerance::lse())) << got.plan.num_splits << " splits";
}

std::vector<EqualsDenseCase> equals_dense_cases() {
  const KvDtype fp8 = KvDtype::kFp8E4M3, bf16 = KvDtype::kBf16;
  return {
      {fp8, 8, 64, 64, {{0, 40}, {1, 17}}},
      {fp8, 8, 2048, 64, {{0, 30, 600}, {12, 3, 20}}},
      {fp8, 64, 64, 17, {{0, 16, 20}, {5, 2, 17}}},
      {fp8, 128, 64, 64, {{0, 30}, {1, 9}}},
      {fp8, 8, 2048, 1, {{0, 2040}, {33, 4}}},
      {bf16, 16, 64, 17, {{0, 16, 50}, {1, 18, 9}}},
      {bf16, 8, 2048, 64, {{0, 700}, {9, 31}}},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuSparsePrefillEqualsDense, ::testing::ValuesIn(equals_dense_cases()),
                         case_name<EqualsDenseCase>);

}  // namespace
}  // namespace latentkv::testing
