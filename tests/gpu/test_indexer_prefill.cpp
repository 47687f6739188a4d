// GPU indexer_prefill (every new token's causal indexer logits, then its top-k, in chunks of new
// tokens) on the `cuda` backend against the float64 reference, per SPEC section 5: ragged batches of
// new tokens over cached prefixes (requests with no new tokens, 1-token prompts, pure prompts),
// shuffled pages, NaN in every indexer slot no row may read, sentinel-filled slots with a guard of
// sentinels after them, a garbage-filled workspace.
//
// The GPU sums the logits in float32 in another order than the reference, so its selection may
// differ at near-ties: each row is checked by check_prefill_slots (support/indexer_prefill.hpp)
// against the reference's logits of that row. Also: chunks of 7 new tokens give the same sets as
// the default chunk; a CUDA graph of the op replays to the same sets and follows new inputs; a
// prefill of more new tokens than a grid's y dimension holds; rejected workspaces.
//
// Sizes are kept small: the reference logits (reference_prefill_logits: each request's keys decoded
// once) cost about 1 ns per (row, visible position, head, dim) on one core of an H200 host; the
// largest case, 300 new tokens over 3000 with 4 heads, about 0.5 s.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <limits>
#include <string>
#include <vector>

#include "gpu/device.hpp"
#include "latentkv/backend.hpp"
#include "support/expect_error.hpp"
#include "support/host_tensor.hpp"
#include "support/indexer_prefill.hpp"
#include "support/paged_fixture.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

constexpr std::int64_t kGuardSlots = 1024;  // sentinel i32s after the slots output
constexpr int kWorkspaceGarbage = 0xA5;     // byte pattern of the workspace before the first call

using Batch = PrefillBatch;

// One prefill on the GPU: device copies of the fixture's indexer cache, tables, cu, q and weights;
// the slots output [T, k] followed by a guard; the planned workspace, garbage-filled once and then
// left as each call leaves it.
class DevicePrefill {
 public:
  DevicePrefill(const PagedFixture& f, const HostTensor& q, const HostTensor& w, const std::vector<std::int32_t>& cu,
                int k, int chunk_tokens = 0)
      : backend_(*find_backend("cuda")),
        device_(detect_device()),
        rows_(q.shape()[0]),
        k_(k),
        cache_(f.indexer_bytes),
        table_(f.block_table),
        lens_(f.seq_lens),
        cu_(cu),
        q_(q.raw(), q.bytes()),
        w_(w.raw(), w.bytes()),
        slots_(static_cast<std::size_t>(rows_ * k + kGuardSlots) * sizeof(std::int32_t)) {
    params.q = q.view_of(q_.get(), Device::cuda());
    params.weights = w.view_of(w_.get(), Device::cuda());
    params.cu_new_tokens =
        TensorView::contiguous(cu_.get(), DType::kI32, {static_cast<std::int64_t>(cu.size())}, Device::cuda());
    params.cache = f.indexer(cache_.get<std::uint8_t>(), Device::cuda());
    params.block_table = f.block_table_view(table_.get<std::int32_t>(), Device::cuda());
    params.seq_lens = f.seq_lens_view(lens_.get<std::int32_t>(), Device::cuda());
    params.k = k;
    params.slots = TensorView::contiguous(slots_.get(), DType::kI32, {rows_, k}, Device::cuda());
    params.chunk_tokens = chunk_tokens;  // 0: the backend's default; else forced, then planned
    plan = backend_.plan(params, device_);
    params.chunk_tokens = plan.chunk_tokens;
    workspace_ = DeviceBuffer(plan.workspace_bytes);
    if (workspace_.bytes() > 0) check_cuda(cudaMemset(workspace_.get(), kWorkspaceGarbage, workspace_.bytes()));
    params.workspace = workspace_.get();
    params.workspace_bytes = workspace_.bytes();
    params.fault = fault_.get();
  }

  // The message of what the calls so far noted in their fault record, "" for nothing.
  std::string fault() const { return fault_.message(); }

  void fill_sentinels() {
    const std::vector<std::int32_t> sentinels(slots_.bytes() / sizeof(std::int32_t), kSentinelI32);
    slots_.upload(sentinels.data(), slots_.bytes());
  }
  void launch(cudaStream_t stream = nullptr) { run(backend_, params, {stream}, device_); }
  // The slots [T, k]; a write past them (into the guard) fails the test.
  HostTensor download() {
    const std::vector<std::int32_t> out = slots_.to_host<std::int32_t>();
    HostTensor slots(DType::kI32, {rows_, k_});
    const auto end = out.begin() + slots.numel();
    std::copy(out.begin(), end, slots.data<std::int32_t>());
    EXPECT_TRUE(std::all_of(end, out.end(), [](std::int32_t s) { return s == kSentinelI32; }))
        << "the op wrote past the end of the slots output";
    return slots;
  }
  // Sentinels, one call on the default stream, the slots.
  HostTensor call() {
    fill_sentinels();
    launch();
    check_cuda(cudaDeviceSynchronize());
    return download();
  }
  void upload_inputs(const HostTensor& q, const HostTensor& w) {
    q_.upload(q.raw(), q.bytes());
    w_.upload(w.raw(), w.bytes());
  }

  IndexerPrefillParams params;
  Plan plan;

 private:
  const Backend& backend_;
  DeviceInfo device_;
  std::int64_t rows_;
  int k_;
  DeviceBuffer cache_, table_, lens_, cu_, q_, w_;
  DeviceBuffer slots_;  // [T, k] i32, then kGuardSlots sentinels
  DeviceBuffer workspace_;
  FaultRecord fault_;
};

// ---- against the reference -------------------------------------------------------------------

struct PrefillCase {
  std::string name;
  int heads;
  int page_size;
  int k;
  Batch batch;
  int chunk_tokens = 0;     // 0: the plan's default; else forced (then planned)
  double w_lo = -1.0;       // weights uniform in [w_lo, 1)
};

std::ostream& operator<<(std::ostream& os, const PrefillCase& c) {
  os << c.name << " (Hi " << c.heads << ", page " << c.page_size << ", k " << c.k << ", new tokens {";
  for (std::size_t b = 0; b < c.batch.new_tokens.size(); ++b) {
    os << (b ? ", " : "") << c.batch.new_tokens[b] << " over " << c.batch.prefixes[b];
  }
  return os << "}" << (c.chunk_tokens ? ", chunks of " + std::to_string(c.chunk_tokens) : std::string()) << ")";
}

struct Inputs {
  PagedFixture f;
  std::vector<std::int32_t> cu;
  HostTensor q, w;  // [T, Hi, 128] fp8, [T, Hi] f32
};

Inputs make_inputs(const Batch& batch, int page_size, int heads, double w_lo, Rng& rng) {
  PagedFixture f = make_prefill_fixture(batch, page_size, rng);
  std::vector<std::int32_t> cu = cumulative(batch.new_tokens);
  HostTensor q = random_fp8(rng, {cu.back(), heads, kIndexerDim}, 2.0);
  HostTensor w = random_f32(rng, {cu.back(), heads}, w_lo, 1.0);
  return {std::move(f), std::move(cu), std::move(q), std::move(w)};
}

class GpuIndexerPrefill : public ::testing::TestWithParam<PrefillCase> {};

TEST_P(GpuIndexerPrefill, MatchesReference) {
  LKV_REQUIRE_GPU();
  const PrefillCase& c = GetParam();
  Rng rng = test_rng();
  Inputs in = make_inputs(c.batch, c.page_size, c.heads, c.w_lo, rng);
  ASSERT_TRUE(unread_slots_poisoned(in.f));
  const std::vector<PrefillRow> rows = prefill_rows(in.f, in.cu);
  const std::vector<std::vector<float>> x = reference_prefill_logits(in.f, in.q, in.w, rows);

  DevicePrefill gpu(in.f, in.q, in.w, in.cu, c.k, c.chunk_tokens);
  const std::int64_t t = in.cu.back();
  if (c.chunk_tokens > 0) {
    ASSERT_EQ(gpu.plan.chunk_tokens, std::min<std::int64_t>(c.chunk_tokens, t)) << "the plan must keep a forced chunk";
  } else {
    ASSERT_GE(gpu.plan.chunk_tokens, 1);
  }
  const HostTensor got = gpu.call();
  EXPECT_TRUE(check_prefill_slots(in.f, rows, x, got))
      << c << ": " << gpu.plan.chunk_tokens << " new tokens per chunk, " << gpu.plan.workspace_bytes
      << " workspace bytes";
  EXPECT_EQ(gpu.fault(), "") << "a fault noted for good input";
}

// A bad page, a bad offset, a NaN query code and an infinite weight, one at a time, with chunks of 7
// new tokens (the requests' check runs with the first chunk and covers every request; q and the
// weights are checked by a kernel of their own, the chunks' indexer running without the record): the
// record throws the reference's own Error.
TEST(GpuIndexerPrefillFaults, RecordTheReferencesError) {
  LKV_REQUIRE_GPU();
  for (const std::string what : {"page", "offset", "query", "weight"}) {
    SCOPED_TRACE(what);
    Rng rng = test_rng();
    Inputs in = make_inputs({{3000, 10, 0}, {20, 30, 5}}, 64, 32, -1.0, rng);
    if (what == "page") {
      in.f.block_table[static_cast<std::size_t>(2 * in.f.max_pages)] = static_cast<std::int32_t>(in.f.num_pages() + 4);
    } else if (what == "offset") {
      in.f.seq_lens[1] = 29;  // request 1 has 30 new tokens
    } else if (what == "query") {
      in.q.raw()[(40 * 32 + 3) * 128 + 9] = 0xFF;
    } else {
      in.w.set(54 * 32 + 31, std::numeric_limits<double>::infinity());
    }
    const std::string expected = error_of([&] { reference_indexer_prefill(in.f, in.q, in.w, in.cu, 2048); });
    ASSERT_NE(expected, "") << "the reference takes the input";
    DevicePrefill gpu(in.f, in.q, in.w, in.cu, 2048, 7);
    gpu.call();
    EXPECT_EQ(gpu.fault(), expected);
  }
}

// A NaN key scale (a cache the append did not write) gives its token a NaN logit, which the indexer
// prefill does not refuse (nor does the reference: docs/operations.md); it ranks below every number,
// so rows that see more than k tokens never select it. Request 0's position 0 is visible to all its
// rows; the other request has no NaN and is checked against the reference.
TEST(GpuIndexerPrefill, NanLogitRanksLast) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  Inputs in = make_inputs({{3000, 2100}, {40, 12}}, 64, 32, -1.0, rng);
  const std::int32_t nan_slot = static_cast<std::int32_t>(in.f.slot(0, 0));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(in.f.indexer().scale_ptr(nan_slot), &nan, sizeof nan);
  const std::string refused = error_of([&] { reference_indexer_prefill(in.f, in.q, in.w, in.cu, 2048); });
  ASSERT_EQ(refused, "") << "the reference takes a NaN logit in a prefill";
  DevicePrefill gpu(in.f, in.q, in.w, in.cu, 2048);
  const HostTensor got = gpu.call();
  EXPECT_EQ(gpu.fault(), "") << "a NaN logit is not a fault in a prefill";
  for (std::int64_t row = 0; row < 40; ++row) {  // request 0's rows see 3001 .. 3040 tokens
    const std::int32_t* chosen = got.data<std::int32_t>() + row * 2048;
    EXPECT_EQ(std::count(chosen, chosen + 2048, nan_slot), 0) << "row " << row << " selected the NaN logit";
    EXPECT_EQ(std::count(chosen, chosen + 2048, -1), 0) << "row " << row;
  }
  // Request 1's rows against the reference's logits (request 0's rows hold a NaN the check does not rank).
  const std::vector<PrefillRow> rows = prefill_rows(in.f, in.cu);
  const std::vector<PrefillRow> others(rows.begin() + 40, rows.end());
  EXPECT_TRUE(check_prefill_slots(in.f, others, reference_prefill_logits(in.f, in.q, in.w, others), got));
}

// The weights' and queries' own check with 3 heads (not a multiple of the 8 a pass pads to): a NaN
// weight in the last element, past the tensor's whole 16 bytes (the check's one-at-a-time tail); a
// NaN query code in the last head of the last token; a NaN weight in weights that start 4 bytes past
// a 16-byte boundary (the check reads them one at a time). Good input with these shapes first.
TEST(GpuIndexerPrefillFaults, FewHeadsAndUnalignedWeights) {
  LKV_REQUIRE_GPU();
  for (const std::string what : {"none", "last weight", "last head's query", "unaligned weights"}) {
    SCOPED_TRACE(what);
    Rng rng = test_rng();
    Inputs in = make_inputs({{100, 0}, {5, 6}}, 64, 3, -1.0, rng);  // weights [11, 3]: 33 floats
    if (what == "last weight") in.w.set(32, std::nan(""));
    if (what == "last head's query") in.q.raw()[(10 * 3 + 2) * 128 + 127] = 0x7F;
    if (what == "unaligned weights") in.w.set(17, -std::numeric_limits<double>::infinity());
    const std::string expected = error_of([&] { reference_indexer_prefill(in.f, in.q, in.w, in.cu, 64); });
    if (what == "none") {
      ASSERT_EQ(expected, "") << "good input";
    } else {
      ASSERT_NE(expected, "") << "the reference takes the input";
    }
    DevicePrefill gpu(in.f, in.q, in.w, in.cu, 64);
    DeviceBuffer shifted;
    if (what == "unaligned weights") {  // the same weights one float into a buffer
      std::vector<float> host(static_cast<std::size_t>(in.w.numel()) + 1, 0.0f);
      std::copy(in.w.data<float>(), in.w.data<float>() + in.w.numel(), host.begin() + 1);
      shifted = DeviceBuffer(host);
      gpu.params.weights = TensorView::contiguous(shifted.get<float>() + 1, DType::kF32, {in.cu.back(), 3}, Device::cuda());
    }
    const HostTensor got = gpu.call();
    EXPECT_EQ(gpu.fault(), expected);
    if (what == "none") {
      const std::vector<PrefillRow> rows = prefill_rows(in.f, in.cu);
      EXPECT_TRUE(check_prefill_slots(in.f, rows, reference_prefill_logits(in.f, in.q, in.w, rows), got));
    }
  }
}

// A prefill of no new tokens checks its offsets too: the record throws the reference's own Error.
TEST(GpuIndexerPrefillFaults, EmptyPrefillsCheckTheirOffsets) {
  LKV_REQUIRE_GPU();
  for (const std::vector<std::int32_t>& cu : {std::vector<std::int32_t>{0, 0, 0}, std::vector<std::int32_t>{0, 1, 0},
                                              std::vector<std::int32_t>{1, 0, 0}}) {
    Rng rng = test_rng();
    Inputs in = make_inputs({{3000, 10}, {0, 0}}, 64, 32, -1.0, rng);
    in.cu = cu;
    const std::string expected = error_of([&] { reference_indexer_prefill(in.f, in.q, in.w, in.cu, 2048); });
    if (cu == std::vector<std::int32_t>{0, 0, 0}) ASSERT_EQ(expected, "") << "no new tokens, good offsets";
    else ASSERT_NE(expected, "") << "the reference takes the input";
    DevicePrefill gpu(in.f, in.q, in.w, in.cu, 2048, 7);
    gpu.call();
    EXPECT_EQ(gpu.fault(), expected) << "cu_new_tokens " << cu[0] << ", " << cu[1] << ", " << cu[2];
  }
}

std::vector<PrefillCase> prefill_cases() {
  // 5 new tokens over 100, none over 7, 37 over 2100 (the last rows see more than 2048).
  const Batch ragged = {{100, 7, 2100}, {5, 0, 37}};
  // Requests with no new tokens first, between and last (the row -> request search), lengths
  // around a page of 17.
  const Batch with_empty = {{4, 30, 0, 9, 16, 50}, {0, 3, 0, 0, 5, 0}};
  // 300 new tokens over 3000: every row sees 3001 .. 3300 > 2048 positions (the radix select).
  const Batch long_prompt = {{3000}, {300}};
  std::vector<PrefillCase> v;
  v.push_back({"ragged_Hi32_k2048", 32, 64, 2048, ragged});
  v.push_back({"ragged_Hi8_k64_page17", 8, 17, 64, ragged});
  v.push_back({"ragged_Hi1_k1_page1", 1, 1, 1, ragged});
  v.push_back({"ragged_chunks7", 8, 64, 64, ragged, 7});  // chunks 7, 14, .. cross into request 2
  v.push_back({"prompts_prefix0_Hi32", 32, 17, 64, {{0, 0, 0}, {1, 40, 129}}});
  v.push_back({"prompts_prefix0_chunks7", 8, 1, 5, {{0, 0, 0}, {1, 40, 129}}, 7});
  v.push_back({"one_token_prompt_Hi64", 64, 64, 2048, {{0}, {1}}});
  v.push_back({"one_token_prompts_k1_page1", 1, 1, 1, {{0, 0, 5}, {1, 1, 1}}});
  v.push_back({"page1_Hi8_k64", 8, 1, 64, {{3, 50, 0}, {9, 20, 33}}});
  v.push_back({"page17_Hi64_k64", 64, 17, 64, {{16, 18, 34}, {2, 1, 17}}});
  v.push_back({"page64_Hi64_k2048", 64, 64, 2048, {{500, 63, 129}, {64, 1, 7}}});
  v.push_back({"with_empty_requests_k7", 8, 17, 7, with_empty});
  v.push_back({"with_empty_requests_chunks7", 8, 17, 7, with_empty, 7});
  // Positive weights and one head: about half the logits are exactly 0 (relu), a mass of ties at
  // the threshold of every row.
  v.push_back({"long_Hi1_k2048_ties", 1, 64, 2048, long_prompt, 0, 0.1});
  v.push_back({"long_Hi4_k2048", 4, 64, 2048, long_prompt});
  v.push_back({"long_Hi4_k2048_chunks7", 4, 17, 2048, long_prompt, 7});
  // Pages larger than a turn: 1000 (no power of two) and 4096 tokens.
  v.push_back({"page1000_Hi32_k2048", 32, 1000, 2048, {{3000, 10}, {40, 5}}});
  // Pages of no multiple of 64 tokens: on sm_90a the wgmma indexer's groups, turns across page ends.
  v.push_back({"page100_Hi32_k64", 32, 100, 64, ragged});
  v.push_back({"page48_Hi16_k2048", 16, 48, 2048, ragged});
  v.push_back({"page16_Hi32_k2048", 32, 16, 2048, ragged});
  v.push_back({"page4096_Hi8_k64", 8, 4096, 64, ragged});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuIndexerPrefill, ::testing::ValuesIn(prefill_cases()),
                         [](const ::testing::TestParamInfo<PrefillCase>& info) { return info.param.name; });

// ---- chunking ----------------------------------------------------------------------------------

// Chunks of 7 new tokens (boundaries inside requests, a last chunk of 6) select exactly the sets of
// the default chunk (here all 343 rows at once): each token's logits and top-k do not depend on the
// chunk it falls in. Eight heads of positive weights keep exact ties away from the threshold, so
// the sets are deterministic.
TEST(GpuIndexerPrefillChunks, SevensEqualTheDefaultChunk) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  Inputs in = make_inputs({{3000, 0, 41}, {300, 1, 42}}, 64, 8, 0.1, rng);
  DevicePrefill whole(in.f, in.q, in.w, in.cu, kMaxTopk);
  DevicePrefill sevens(in.f, in.q, in.w, in.cu, kMaxTopk, 7);
  ASSERT_EQ(whole.plan.chunk_tokens, 343);
  ASSERT_EQ(sevens.plan.chunk_tokens, 7);
  EXPECT_LT(sevens.plan.workspace_bytes, whole.plan.workspace_bytes);
  const std::vector<std::int32_t> a = sorted_rows(whole.call()), b = sorted_rows(sevens.call());
  EXPECT_EQ(first_different_row(a, b, kMaxTopk), -1) << "the sets of chunks of 7 and of the default chunk differ";
  // The same call again on the same (now used) workspace.
  EXPECT_EQ(first_different_row(a, sorted_rows(sevens.call()), kMaxTopk), -1) << "a second call differs";
}

// ---- a CUDA graph ------------------------------------------------------------------------------

// The op captured once on a stream (all its chunks), instantiated and launched twice: both replays
// give the eager call's sets; after new q and weights are uploaded, a replay follows them (the
// graph reads its inputs from device memory).
TEST(GpuIndexerPrefillGraph, ReplaysGiveTheSameSlots) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  const Batch batch = {{100, 7, 2100}, {5, 0, 37}};
  Inputs in = make_inputs(batch, 64, 32, 0.1, rng);
  const std::vector<PrefillRow> rows = prefill_rows(in.f, in.cu);
  DevicePrefill d(in.f, in.q, in.w, in.cu, kMaxTopk, 16);  // 3 chunks in the graph
  const HostTensor eager = d.call();
  ASSERT_TRUE(check_prefill_slots(in.f, rows, reference_prefill_logits(in.f, in.q, in.w, rows), eager));
  const std::vector<std::int32_t> want = sorted_rows(eager);

  cudaStream_t stream;
  LKV_CUDA_OK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  LKV_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  d.launch(stream);
  LKV_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  LKV_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    d.fill_sentinels();
    LKV_CUDA_OK(cudaGraphLaunch(exec, stream));
    LKV_CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_EQ(first_different_row(sorted_rows(d.download()), want, kMaxTopk), -1) << "replay " << replay;
  }
  // New inputs on the device: the next replay selects for them.
  const HostTensor q2 = random_fp8(rng, {in.cu.back(), 32, kIndexerDim}, 2.0);
  const HostTensor w2 = random_f32(rng, {in.cu.back(), 32}, -1.0, 1.0);
  d.upload_inputs(q2, w2);
  d.fill_sentinels();
  LKV_CUDA_OK(cudaGraphLaunch(exec, stream));
  LKV_CUDA_OK(cudaStreamSynchronize(stream));
  EXPECT_TRUE(check_prefill_slots(in.f, rows, reference_prefill_logits(in.f, q2, w2, rows), d.download()))
      << "replay after new inputs";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// ---- many short prompts -----------------------------------------------------------------------

// Block tables of `prompts` requests of `tokens` tokens each (pages shuffled) and an indexer cache
// holding their keys, written directly (fp8 codes from a hash of request and position, scale 2^-4),
// every other slot poisoned; no main cache. make_paged_fixture would quantize every token's 576
// latent values too, seconds for 66,000 tokens.
PagedFixture make_indexer_only_fixture(std::int64_t prompts, std::int64_t tokens, int page_size, Rng& rng) {
  const std::int64_t pages_each = (tokens + page_size - 1) / page_size;
  PagedFixture f(prompts * pages_each + 3, page_size, rng.fork_seed());  // 3 pages no request uses
  f.page_size = page_size;
  f.max_pages = static_cast<int>(pages_each + 1);
  for (std::int64_t b = 0; b < prompts; ++b) f.requests.push_back(f.allocator.add_request());
  for (RequestId r : f.requests) f.allocator.grow(r, tokens);
  f.indexer_bytes.assign(static_cast<std::size_t>(f.num_pages() * page_size) * kIndexerTokenBytes, 0);
  poison_indexer_cache(f.indexer_bytes, page_size);
  const IndexerCache cache = f.indexer();
  for (std::int64_t b = 0; b < prompts; ++b) {
    for (std::int64_t t = 0; t < tokens; ++t) {
      const std::int64_t slot = f.slot(b, t);
      std::uint64_t state = static_cast<std::uint64_t>(b) * 1000003u + static_cast<std::uint64_t>(t);
      std::uint8_t* key = cache.key(slot);
      for (int j = 0; j < kIndexerDim; ++j) {
        const std::uint64_t h = splitmix64(state);
        key[j] = static_cast<std::uint8_t>((h & 0x80) | ((h >> 8) % 0x58));  // |value| < 16, never a NaN code
      }
      const float scale = 0.0625f;
      std::memcpy(cache.scale_ptr(slot), &scale, sizeof scale);
    }
  }
  f.block_table = f.allocator.block_table_matrix(f.requests, f.max_pages);
  f.seq_lens = f.allocator.lengths(f.requests);
  return f;
}

// 1100 prompts of 60 tokens: 66,000 new tokens, and a caller asking for all of them in one chunk -
// more rows than one indexer launch takes (65,535, a grid's y dimension). The plan caps the chunk
// there, and the two chunks give the right answer. Pages of 64 run (on sm_90) the wgmma kernel's
// groups of new tokens, far fewer grid rows; pages of 16 the mma.sync kernel, a grid row a token,
// where the first chunk takes the whole 65,535.
TEST(GpuIndexerPrefillLarge, MoreNewTokensThanAGridColumn) {
  LKV_REQUIRE_GPU();
  constexpr std::int64_t kPrompts = 1100, kPromptTokens = 60, kHeads = 1;
  for (const int page_size : {64, 16}) {
    SCOPED_TRACE("pages of " + std::to_string(page_size));
    Rng rng = test_rng();
    PagedFixture f = make_indexer_only_fixture(kPrompts, kPromptTokens, page_size, rng);
    ASSERT_TRUE(unread_slots_poisoned(f));
    const std::vector<std::int32_t> cu = cumulative(std::vector<std::int64_t>(kPrompts, kPromptTokens));
    const HostTensor q = random_fp8(rng, {cu.back(), kHeads, kIndexerDim}, 2.0);
    const HostTensor w = random_f32(rng, {cu.back(), kHeads}, 0.1, 1.0);
    DevicePrefill gpu(f, q, w, cu, 16, 66000);
    ASSERT_EQ(gpu.plan.chunk_tokens, 65535) << "the plan must cap a chunk at one indexer launch's rows";
    const HostTensor got = gpu.call();
    const std::vector<PrefillRow> rows = prefill_rows(f, cu);
    EXPECT_TRUE(check_prefill_slots(f, rows, reference_prefill_logits(f, q, w, rows), got))
        << gpu.plan.chunk_tokens << " new tokens per chunk";
  }
}

// ---- rejected calls ---------------------------------------------------------------------------

// A workspace smaller than the plan's, or a negative chunk, is refused before anything runs: the
// slots keep their sentinels.
TEST(GpuIndexerPrefillBadInput, WorkspaceAndChunk) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  Inputs in = make_inputs({{20, 0}, {4, 3}}, 17, 8, -1.0, rng);
  DevicePrefill d(in.f, in.q, in.w, in.cu, 64);
  d.fill_sentinels();
  IndexerPrefillParams p = d.params;
  p.workspace_bytes = d.plan.workspace_bytes - 1;
  EXPECT_TRUE(throws_error([&] { run(*find_backend("cuda"), p); }, "indexer_prefill", "workspace_bytes",
                           std::to_string(d.plan.workspace_bytes - 1)));
  p = d.params;
  p.workspace = nullptr;
  EXPECT_TRUE(throws_error([&] { run(*find_backend("cuda"), p); }, "indexer_prefill", "workspace", "null"));
  p = d.params;
  p.chunk_tokens = -1;
  EXPECT_TRUE(throws_error([&] { run(*find_backend("cuda"), p); }, "indexer_prefill", "chunk_tokens", "-1"));
  LKV_CUDA_OK(cudaDeviceSynchronize());
  EXPECT_TRUE(is_sentinel(d.download())) << "a rejected call wrote slots";
  // Smaller chunks than planned need less scratch: accepted; and the default chunk of these shapes
  // is the plan's: accepted too. Each run's slots checked, from sentinels.
  const std::vector<PrefillRow> rows = prefill_rows(in.f, in.cu);
  const std::vector<std::vector<float>> want = reference_prefill_logits(in.f, in.q, in.w, rows);
  for (const int chunk : {1, 0}) {
    SCOPED_TRACE("chunk_tokens " + std::to_string(chunk));
    d.fill_sentinels();
    p = d.params;
    p.chunk_tokens = chunk;
    EXPECT_NO_THROW(run(*find_backend("cuda"), p));
    LKV_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_TRUE(check_prefill_slots(in.f, rows, want, d.download()));
  }
}

}  // namespace
}  // namespace latentkv::testing
