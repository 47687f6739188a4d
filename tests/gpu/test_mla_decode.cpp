// GPU dense MLA decode (the fp8-native kernels and the two cast baselines) against the float64 CPU
// reference, per SPEC section 5: shuffled pages, NaN in every slot a kernel must not read,
// sentinel-filled outputs, lengths 0, 1, page_size +- 1 and odd ones.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <limits>
#include <optional>
#include <ostream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpu/reference.hpp"
#include "gpu/device.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/environment.hpp"
#include "latentkv/error.hpp"
#include "latentkv/version.hpp"
#include "support/compare.hpp"
#include "support/expect_error.hpp"
#include "support/paged_fixture.hpp"
#include "support/reference_ops.hpp"
#include "support/scoped_env.hpp"

namespace latentkv::testing {
namespace {

struct DecodeCase {
  std::string backend;
  KvDtype dtype;
  int heads;
  int q_len;
  int page_size;
  std::vector<std::int64_t> lengths;
  int splits = 0;            // 0: the backend's plan
  bool fault_record = true;  // false: the kernels' instances without checks (a call given no record)
  ScaleMode scale_mode = ScaleMode::kPow2;  // of the cache's fp8 scales (kExact: amax / 448, no power of two)
  std::int64_t pool_pages = 0;  // 0: the pages the lengths need; else the pool's (pages_past_2gib)
};

std::ostream& operator<<(std::ostream& os, const DecodeCase& c) {
  os << c.backend << "_" << kv_dtype_name(c.dtype) << "_H" << c.heads << "_q" << c.q_len << "_ps" << c.page_size
     << "_B" << c.lengths.size();
  if (c.splits) os << "_splits" << c.splits;
  if (!c.fault_record) os << "_norecord";
  if (c.scale_mode == ScaleMode::kExact) os << "_exactscales";
  if (c.pool_pages > 0) os << "_pool" << c.pool_pages;
  return os;
}

struct DecodeRun {
  HostTensor o, lse;            // what the GPU wrote
  HostTensor ref_o, ref_lse;    // float64 reference
};

// One decode call's device side: the fixture's cache and tables, the queries, sentinel-filled
// outputs and the backend's planned workspace. `lens` replaces the fixture's lengths when given.
struct DeviceDecode {
  GuardedBuffer cache;  // between poisoned guards: a page outside the pool read anyway shows
  DeviceBuffer table, lens, q, o, lse, workspace;
  HostTensor o_host, lse_host;
  FaultRecord fault;  // given to the call: good input must leave it empty
  MlaDecodeParams params;

  DeviceDecode(PagedFixture& f, const HostTensor& queries, float scale, const std::vector<std::int32_t>& lengths = {})
      : cache(f.cache_bytes, kPoisonFp8), table(f.block_table), lens(lengths.empty() ? f.seq_lens : lengths),
        q(queries.raw(), queries.bytes()) {
    const auto& shape = queries.shape();  // [B, q_len, H, 576]
    o_host = sentinel_tensor(DType::kBF16, {shape[0], shape[1], shape[2], 512});
    lse_host = sentinel_tensor(DType::kF32, {shape[0], shape[1], shape[2]});
    o = DeviceBuffer(o_host.raw(), o_host.bytes());
    lse = DeviceBuffer(lse_host.raw(), lse_host.bytes());
    params.q = queries.view_of(q.get(), Device::cuda());
    params.cache = f.cache(cache.get<std::uint8_t>(), Device::cuda());
    params.block_table = f.block_table_view(table.get<std::int32_t>(), Device::cuda());
    params.seq_lens = f.seq_lens_view(lens.get<std::int32_t>(), Device::cuda());
    params.o = o_host.view_of(o.get(), Device::cuda());
    params.lse = lse_host.view_of(lse.get(), Device::cuda());
    params.softmax_scale = scale;
    params.fault = fault.get();
  }

  // The backend's schedule (for a forced split count when one is given) and its workspace.
  Plan plan(const Backend& backend, const DeviceInfo& device, int forced_splits = 0) {
    params.num_splits = forced_splits;
    const Plan plan = backend.plan(params, device);
    if (forced_splits > 0) EXPECT_EQ(plan.num_splits, forced_splits) << "the plan keeps an asked count";
    params.num_splits = plan.num_splits;
    workspace = DeviceBuffer(plan.workspace_bytes);
    params.workspace = workspace.get();
    params.workspace_bytes = workspace.bytes();
    return plan;
  }

  void download() {
    o.download(o_host.raw(), o_host.bytes());
    lse.download(lse_host.raw(), lse_host.bytes());
  }

  // Sentinels in o and lse again (SPEC section 5: before each run), so that an element a later run
  // does not write fails rather than keeping an earlier run's value.
  void fill_sentinels() {
    const HostTensor o_fill = sentinel_tensor(o_host.dtype(), o_host.shape());
    const HostTensor lse_fill = sentinel_tensor(lse_host.dtype(), lse_host.shape());
    o.upload(o_fill.raw(), o_fill.bytes());
    lse.upload(lse_fill.raw(), lse_fill.bytes());
  }
};

// Builds the case, runs the reference and the backend, downloads the outputs.
DecodeRun run_case(const DecodeCase& c, Rng& rng) {
  PagedFixtureOptions opt;
  opt.page_size = c.page_size;
  opt.lengths = c.lengths;
  opt.kv_dtype = c.dtype;
  opt.with_indexer = false;
  opt.scale_mode = c.scale_mode;
  opt.num_pages = c.pool_pages;
  PagedFixture f = make_paged_fixture(opt, rng);
  if (c.pool_pages > 0) EXPECT_GE(highest_held_offset(f), kTwoGiB) << "no token past 2 GiB of the pool to read";
  HostTensor q = random_bf16(rng, {f.batch(), c.q_len, c.heads, 576});
  const float scale = 0.0625f;
  DecodeRun r;
  // A cast baseline attends over bf16 values (fp8 x scale rounded), exactly the fp8 ones only when
  // the scales are powers of two: with others it is checked against the reference over that cast.
  std::optional<PagedFixture> cast = cast_seen_by(c.backend, c.scale_mode, f);
  AttentionOutputs ref = reference_mla_decode(cast ? *cast : f, q, scale);
  r.ref_o = std::move(ref.o);
  r.ref_lse = std::move(ref.lse);

  DeviceDecode d(f, q, scale);
  if (!c.fault_record) d.params.fault = nullptr;
  const Backend& backend = *find_backend(c.backend);
  const DeviceInfo device = detect_device();
  d.plan(backend, device, c.splits);
  run(backend, d.params, {}, device);
  if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error(cudaGetErrorString(cudaGetLastError()));
  if (c.fault_record) EXPECT_EQ(d.fault.message(), "") << "a fault noted for good input";
  d.download();
  r.o = std::move(d.o_host);
  r.lse = std::move(d.lse_host);
  return r;
}

class GpuMlaDecode : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(GpuMlaDecode, MatchesReference) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  const DecodeRun r = run_case(GetParam(), rng);
  EXPECT_TRUE(compare("o", r.o, r.ref_o, Tolerance::bf16_output()));
  EXPECT_TRUE(compare("lse", r.lse, r.ref_lse, Tolerance::lse()));
}

std::vector<DecodeCase> cases() {
  const KvDtype fp8 = KvDtype::kFp8E4M3, bf16 = KvDtype::kBf16;
  std::vector<DecodeCase> v;
  const std::vector<std::int64_t> mixed = {0, 1, 63, 65, 1000, 333};
  for (int h : {1, 8, 16, 20, 64}) v.push_back({"cuda", fp8, h, 1, 64, mixed});
  v.push_back({"cuda", fp8, 128, 1, 64, {1, 200, 65}});
  for (int q : {2, 3, 4}) v.push_back({"cuda", fp8, 8, q, 64, {1, 2, 5, 130, 777}});
  v.push_back({"cuda", fp8, 16, 4, 64, {4, 129, 511}});
  v.push_back({"cuda", fp8, 32, 2, 17, {2, 16, 18, 300}});
  v.push_back({"cuda", fp8, 8, 1, 1, {0, 1, 2, 97}});
  v.push_back({"cuda", fp8, 8, 2, 3, {2, 3, 4, 101}});
  // Forced split counts: up to 16 the narrow kernel merges them itself (its grid is resident at
  // once), handing a batch's CTAs out by length (the balanced grid); 40 go to the combine kernel...
  for (int s : {1, 3, 7, 40}) v.push_back({"cuda", fp8, 8, 1, 64, {0, 1, 500, 2049}, s});
  // ... one request's splits merged in the kernel on the even grid, 8 and 16 rows.
  v.push_back({"cuda", fp8, 8, 1, 64, {2049}, 7});
  v.push_back({"cuda", fp8, 16, 1, 64, {2049}, 5});
  // ... but not 40 requests x 16 splits, more CTAs than the GPU holds at once: the combine kernel.
  std::vector<std::int64_t> forty;
  for (int b = 0; b < 40; ++b) forty.push_back(300 + 37 * b);
  v.push_back({"cuda", fp8, 8, 1, 64, forty, 16});
  // Batches the narrow kernel merges itself, of mixed lengths: its CTAs go to the requests by length
  // (the balanced grid), one long request among short and empty ones taking the most pieces a
  // request may, and CTAs left without work; 8 and 16 rows, on bulk copies and (pages of 17) cp.async.
  std::vector<std::int64_t> ragged;
  for (int b = 0; b < 40; ++b) ragged.push_back(b == 7 ? 20000 : b % 5 == 0 ? 0 : 1 + (97 * b) % 1500);
  v.push_back({"cuda", fp8, 8, 1, 64, ragged});
  v.push_back({"cuda", fp8, 16, 1, 64, ragged});
  v.push_back({"cuda", fp8, 8, 2, 17, ragged});
  // ... and lengths close to one another, each request taking one to a few more pieces than another.
  std::vector<std::int64_t> close;
  for (int b = 0; b < 36; ++b) close.push_back(2500 + 211 * b);
  v.push_back({"cuda", fp8, 8, 1, 64, close});
  // One head (128 units of the merge a request) over 3 forced splits: the balanced grid's 12 CTAs go
  // 1, 1, 2 and 7 to the four requests, so a CTA merges 128, 64 or 18-19 units (fewer than its 128
  // threads: the merge's groups of threads sharing a unit).
  v.push_back({"cuda", fp8, 1, 1, 64, {0, 1, 500, 2049}, 3});
  // 8 rows on pages that are not a power of two: the division path of position_page.
  v.push_back({"cuda", fp8, 8, 1, 17, {0, 1, 16, 18, 700}});
  v.push_back({"cuda", fp8, 8, 1, 64, {6000}});
  // One or two long requests: more than 128 splits, the combine of 32 dims per CTA.
  v.push_back({"cuda", fp8, 8, 1, 64, {40000, 0}});
  v.push_back({"cuda", fp8, 8, 2, 64, {17000, 21001}});
  // 256 rows of one request (four 64-row blocks on the wgmma kernel), its splits merged by the combine.
  v.push_back({"cuda", fp8, 128, 2, 64, {1300}});
  v.push_back({"cuda", bf16, 8, 1, 64, mixed});
  v.push_back({"cuda", bf16, 16, 4, 17, {4, 100, 257}});
  v.push_back({"cuda", bf16, 128, 1, 64, {0, 150}});
  for (const char* baseline : {"cast_full", "gather_cast"}) {
    v.push_back({baseline, fp8, 8, 1, 64, mixed});
    v.push_back({baseline, fp8, 16, 2, 5, {2, 9, 301}});
  }
  // No requests: nothing to read or write; no workspace needed, but the pool's for cast_full.
  for (const char* backend : {"cuda", "gather_cast", "cast_full"}) v.push_back({backend, fp8, 8, 1, 64, {}});
  // Rows that do not fill the kernels' row blocks: the narrow kernel's 16-row instance with 12 rows
  // (H 12; H 4 x q_len 3) and q_len 4 of 4 heads; the wgmma kernel's 64-row blocks with 40, 48 and
  // 96 rows (H 40; H 24 x q_len 2; H 16 x q_len 3; H 96); the bf16 kernel with 24 rows.
  v.push_back({"cuda", fp8, 12, 1, 64, mixed});
  v.push_back({"cuda", fp8, 4, 3, 64, {3, 70, 500}});
  v.push_back({"cuda", fp8, 4, 4, 17, {4, 65, 900}});
  v.push_back({"cuda", fp8, 40, 1, 64, mixed});
  v.push_back({"cuda", fp8, 24, 2, 64, {2, 130, 777}});
  v.push_back({"cuda", fp8, 16, 3, 64, {3, 300}});
  v.push_back({"cuda", fp8, 96, 1, 64, {1, 200, 65}});
  v.push_back({"cuda", bf16, 24, 1, 64, mixed});
  // Pages that a 32-token tile crosses (48, 96) or that hold several tiles (32, 128): the narrow
  // kernel's bulk copies split a tile into runs of consecutive slots at page ends.
  v.push_back({"cuda", fp8, 8, 1, 48, mixed});
  v.push_back({"cuda", fp8, 16, 1, 96, {5, 95, 97, 2000}});
  v.push_back({"cuda", fp8, 8, 1, 32, {0, 31, 33, 1000}});
  v.push_back({"cuda", fp8, 8, 2, 128, {2, 127, 129, 3000}});
  // The same for the wgmma kernel's 64-token tiles: whole tiles inside pages of 128 go out as bulk
  // tensor copies; with pages of 96 and 32 some or all tiles cross a page end and take cp.async
  // (unless the two pages are neighbours in the pool), the last partial tile always.
  v.push_back({"cuda", fp8, 64, 1, 128, {2, 127, 129, 3000}});
  v.push_back({"cuda", fp8, 64, 1, 96, {5, 95, 97, 2000}});
  v.push_back({"cuda", fp8, 128, 1, 32, {0, 31, 33, 1000}});
  // Pages larger than a split: 256, 1000 (no power of two, so that 64-token tiles cross its ends),
  // 1024 and 4096 tokens, on the narrow, wgmma and bf16 kernels and a baseline.
  v.push_back({"cuda", fp8, 8, 1, 4096, {0, 1, 4095, 4097, 9000}});
  v.push_back({"cuda", fp8, 16, 2, 1000, {2, 999, 1001, 5000}});
  v.push_back({"cuda", fp8, 128, 1, 256, {1, 255, 257, 3000}});
  v.push_back({"cuda", fp8, 64, 1, 1000, {5, 999, 2001}});
  v.push_back({"cuda", bf16, 8, 1, 1024, {0, 1025, 3000}});
  v.push_back({"gather_cast", fp8, 8, 1, 1000, {5, 999, 2001}});
  // Calls given no fault record run the kernels' instances without checks (and, in the narrow
  // kernel, with their own residency): each kernel family once, the combine kernel too.
  v.push_back({"cuda", fp8, 8, 1, 64, mixed, 0, false});
  // 16 rows on the narrow kernel: the planned splits (the combine kernel's), and 8 forced ones merged
  // in the kernel on the balanced grid.
  v.push_back({"cuda", fp8, 8, 2, 64, {2, 9, 301, 5000}, 0, false});
  v.push_back({"cuda", fp8, 16, 1, 64, {1, 9, 301, 5000}, 8, false});
  v.push_back({"cuda", fp8, 32, 1, 17, mixed, 0, false});
  v.push_back({"cuda", fp8, 128, 1, 64, {1, 200, 65}, 0, false});
  v.push_back({"cuda", fp8, 64, 2, 64, {2, 700}, 0, false});
  v.push_back({"cuda", fp8, 8, 1, 64, forty, 16, false});
  v.push_back({"cuda", fp8, 8, 1, 64, {40000, 0}, 0, false});
  v.push_back({"cuda", fp8, 8, 1, 64, ragged, 0, false});
  v.push_back({"cuda", bf16, 8, 1, 64, mixed, 0, false});
  v.push_back({"cuda", bf16, 128, 1, 64, {0, 150}, 0, false});
  // Scales that are no powers of two (the cache's exact mode, amax / 448): the kernels weigh each
  // block's products by its float32 scale, and the narrow and wgmma kernels fold it into P' over the
  // largest scale so far, all of which is exact only for powers of two. Each fp8 kernel family, its
  // in-kernel merge and the combine, and the two baselines (against the reference over their bf16
  // cast, run_case).
  const ScaleMode exact = ScaleMode::kExact;
  v.push_back({"cuda", fp8, 8, 1, 64, mixed, 0, true, exact});
  v.push_back({"cuda", fp8, 16, 1, 64, ragged, 0, true, exact});
  v.push_back({"cuda", fp8, 8, 2, 64, {17000, 21001}, 0, true, exact});
  v.push_back({"cuda", fp8, 32, 1, 17, mixed, 0, true, exact});
  v.push_back({"cuda", fp8, 64, 2, 64, {2, 700}, 0, true, exact});
  v.push_back({"cuda", fp8, 128, 1, 64, {1, 200, 65}, 0, true, exact});
  for (const char* baseline : {"cast_full", "gather_cast"}) {
    v.push_back({baseline, fp8, 8, 1, 64, mixed, 0, true, exact});
  }
  // Odd head counts, so that rows pair up with no other row's: alone (H 7), under q_len 2 and 3 (the
  // narrow kernel's 6 and 15 rows), on the wide kernel (22 rows) and the wgmma kernel (33, 127 rows),
  // and on a bf16 cache.
  v.push_back({"cuda", fp8, 7, 1, 64, mixed});
  v.push_back({"cuda", fp8, 3, 2, 64, {2, 63, 65, 700}});
  v.push_back({"cuda", fp8, 5, 3, 17, {3, 16, 18, 500}});
  v.push_back({"cuda", fp8, 11, 2, 64, {2, 300, 1001}});
  v.push_back({"cuda", fp8, 33, 1, 64, mixed});
  v.push_back({"cuda", fp8, 127, 1, 64, {1, 200, 65}});
  v.push_back({"cuda", bf16, 5, 1, 64, mixed});
  // Pools of 1.5 x 2^31 bytes, a third of their pages past 2 GiB, where an entry's byte offset needs
  // 64 bits: the narrow kernel on bulk copies (pages of 64), a batch of 36 merged in the kernel (as
  // `close` above) and one long request through the combine, and on cp.async (pages of 17); the
  // wgmma kernel on bulk tensor copies (its tensor maps span the pool) and, pages of 32, cp.async;
  // the bf16 kernel; both baselines (cast_full casts the whole pool).
  const ScaleMode pow2 = ScaleMode::kPow2;
  const auto past_2gib = [&](const char* backend, KvDtype dtype, int h, int q, int ps, std::vector<std::int64_t> lens) {
    v.push_back({backend, dtype, h, q, ps, std::move(lens), 0, true, pow2, pages_past_2gib(ps, dtype)});
  };
  std::vector<std::int64_t> batch36;
  for (int b = 0; b < 36; ++b) batch36.push_back(b == 5 ? 0 : 600 + 97 * b);
  past_2gib("cuda", fp8, 8, 1, 64, batch36);
  past_2gib("cuda", fp8, 16, 1, 64, {40000});
  past_2gib("cuda", fp8, 8, 2, 17, {3000, 1700, 2});
  past_2gib("cuda", fp8, 128, 1, 64, {6000, 100});
  past_2gib("cuda", fp8, 64, 1, 32, {5000, 33});
  past_2gib("cuda", bf16, 8, 1, 64, {9000, 5000});
  past_2gib("cast_full", fp8, 8, 1, 64, {9000, 5000});
  past_2gib("gather_cast", fp8, 8, 1, 64, {9000, 5000});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuMlaDecode, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<DecodeCase>& info) {
                           std::ostringstream os;
                           os << info.param;
                           std::string s = os.str();
                           for (char& ch : s) {
                             if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return s;
                         });

// Request 0's slot of its token t.
std::int64_t request0_slot(const PagedFixture& f, std::int64_t t) {
  return static_cast<std::int64_t>(f.block_table[static_cast<std::size_t>(t / f.page_size)]) * f.page_size + t % f.page_size;
}

// Plans and runs d on the cuda backend with LATENTKV_MLA_KERNEL=kernel ("auto" or "mma"), then
// downloads its outputs.
void run_on_kernel(DeviceDecode& d, const char* kernel) {
  {
    const ScopedEnv forced(kMlaKernelVariable, kernel);
    const Backend& backend = *find_backend("cuda");
    d.plan(backend, detect_device());
    run(backend, d.params);
    LKV_CUDA_OK(cudaDeviceSynchronize());
  }
  d.download();
}

// A NaN code (0x7F, which a cache written by other code may hold: the appends refuse NaN) in a
// visible token makes that request's outputs NaN, as in the reference, on every kernel: the wgmma
// kernel's integer conversion must not turn it into a finite value. 64 heads take the wgmma kernel on sm_90, 8 the narrow one;
// LATENTKV_MLA_KERNEL=mma reruns 64 heads on the mma.sync kernel.
// Two batches: {300, 100} with the NaN at request 0's token 150 (other splits of the row hold tokens
// too), and {20, 20} with it at token 5 (the plan's splits cover the 128-token capacity, so the NaN
// split is the only one with tokens and the merge must not take the empty ones' -inf as the row's
// largest lse).
TEST(GpuMlaDecodeNan, NanCodeInAVisibleTokenGivesNanRows) {
  LKV_REQUIRE_GPU();
  for (const auto& [lengths, t] : {std::pair{std::vector<std::int64_t>{300, 100}, std::int64_t{150}},
                                   std::pair{std::vector<std::int64_t>{20, 20}, std::int64_t{5}}}) {
    for (const char* kernel : {"auto", "mma"}) {
      for (int heads : {8, 64}) {
        Rng rng = test_rng();
        PagedFixtureOptions opt;
        opt.lengths = lengths;
        opt.with_indexer = false;
        PagedFixture f = make_paged_fixture(opt, rng);
        f.cache_bytes[static_cast<std::size_t>(request0_slot(f, t) * 656 + 5)] = 0x7F;  // latent dim 5
        HostTensor q = random_bf16(rng, {f.batch(), 1, heads, 576});
        const AttentionOutputs ref = reference_mla_decode(f, q, 0.0625f);
        ASSERT_TRUE(std::isnan(ref.lse.get(0)));
        DeviceDecode d(f, q, 0.0625f);
        run_on_kernel(d, kernel);
        SCOPED_TRACE(std::string(kernel) + ", H " + std::to_string(heads) + ", lengths " + std::to_string(lengths[0]) +
                     ", NaN at token " + std::to_string(t) + ", " + std::to_string(d.params.num_splits) + " splits");
        EXPECT_TRUE(compare("o", d.o_host, ref.o, Tolerance::bf16_output()));
        EXPECT_TRUE(compare("lse", d.lse_host, ref.lse, Tolerance::lse()));
      }
    }
  }
}

// Request `request`'s o and lse rows of its first `positions` query positions, as [positions, H, 512]
// and [positions, H], byte for byte (sentinels stay sentinels): rows of a decode output
// [B, q_len, H, ...] that a test compares on their own.
std::pair<HostTensor, HostTensor> request_rows(const HostTensor& o, const HostTensor& lse, int request, int positions) {
  const std::int64_t q_len = o.shape()[1], heads = o.shape()[2];
  HostTensor o_rows(o.dtype(), {positions, heads, 512}), lse_rows(lse.dtype(), {positions, heads});
  const std::int64_t first = request * q_len * heads;  // the request's first (position, head) row
  std::memcpy(o_rows.raw(), o.raw() + first * 512 * static_cast<std::int64_t>(dtype_size(o.dtype())), o_rows.bytes());
  std::memcpy(lse_rows.raw(), lse.raw() + first * static_cast<std::int64_t>(dtype_size(lse.dtype())), lse_rows.bytes());
  return {std::move(o_rows), std::move(lse_rows)};
}

// A non-finite value among a request's newest tokens, which the causal mask hides from its earlier
// query rows (q_len 2 to 4), must not reach those rows: the output product weighs a hidden token by
// P = 0, and 0 x NaN is NaN, so the kernels zero such values once the scores are taken. The rows
// that see the token are NaN (from its score), as in the reference. Request 0 (300 tokens, so that
// the token shares its tile and split with visible ones) gets the value; request 1 stays clean.
// Kernels: 4 and 8 heads at q_len 2 and 4 heads at q_len 4 (at most 16 rows) the narrow one, 8 at
// q_len 4 (32 rows) the wide mma.sync one, 64 wgmma on sm_90 (the wide one under
// LATENTKV_MLA_KERNEL=mma), bf16 caches the wide one.
// Every case compares all rows but the two infinite ones', whose seeing rows are left out (request 0's
// positions from hidden_positions on; request 1 is compared whole): there the reference's sums of
// infinite terms (code x inf per dim; -inf x q) need not match the kernels'. Those rows must still be
// written, and their lse not finite where the reference's is not (an infinite scale, which the
// kernels weigh a block's dot product by, would otherwise give a -inf score and drop the token).
TEST(GpuMlaDecodeNan, ANonFiniteNewerTokenStaysOutOfTheRowsThatDoNotSeeIt) {
  LKV_REQUIRE_GPU();
  struct Poison {
    const char* what;
    KvDtype dtype;
    int q_len;
    int back;            // the token: request 0's length - back
    int byte;            // in its cache entry
    std::uint32_t bits;  // written there: one fp8 code, or a little-endian bf16 or float
    int bytes;
    int hidden_positions;  // query positions that do not see it (0: compare every row)
  };
  const Poison cases[] = {
      {"fp8 NaN code in block 0 of the newest token", KvDtype::kFp8E4M3, 2, 1, 5, 0x7Fu, 1, 0},
      {"fp8 NaN code (0xFF) in block 2 of the newest token", KvDtype::kFp8E4M3, 4, 1, 300, 0xFFu, 1, 0},
      {"fp8 NaN scale of block 1, third newest token", KvDtype::kFp8E4M3, 4, 3, 512 + 4, 0x7FC00000u, 4, 0},
      {"fp8 +inf scale of block 3, second newest token", KvDtype::kFp8E4M3, 4, 2, 512 + 12, 0x7F800000u, 4, 2},
      {"bf16 NaN in dim 7 of the newest token", KvDtype::kBf16, 4, 1, 14, 0x7FC0u, 2, 0},
      {"bf16 -inf in dim 400 of the second newest token", KvDtype::kBf16, 4, 2, 800, 0xFF80u, 2, 2},
  };
  for (const Poison& c : cases) {
    for (const char* kernel : {"auto", "mma"}) {
      for (int heads : {4, 8, 64}) {
        Rng rng = test_rng();
        PagedFixtureOptions opt;
        opt.lengths = {300, 100};
        opt.kv_dtype = c.dtype;
        opt.with_indexer = false;
        PagedFixture f = make_paged_fixture(opt, rng);
        const std::int64_t slot = request0_slot(f, opt.lengths[0] - c.back);
        const std::int64_t entry = slot * (c.dtype == KvDtype::kBf16 ? 1152 : 656) + c.byte;
        for (int i = 0; i < c.bytes; ++i) f.cache_bytes[static_cast<std::size_t>(entry + i)] = (c.bits >> (8 * i)) & 0xFFu;
        HostTensor q = random_bf16(rng, {f.batch(), c.q_len, heads, 576});
        const AttentionOutputs ref = reference_mla_decode(f, q, 0.0625f);
        DeviceDecode d(f, q, 0.0625f);
        run_on_kernel(d, kernel);
        SCOPED_TRACE(std::string(c.what) + ", q_len " + std::to_string(c.q_len) + ", " + kernel + ", H " +
                     std::to_string(heads) + ", " + std::to_string(d.params.num_splits) + " splits");
        // The reference: the last row sees the value, the first does not.
        ASSERT_TRUE(std::isnan(ref.lse.get((c.q_len - 1) * heads)) || c.hidden_positions > 0);
        ASSERT_TRUE(std::isfinite(ref.o.get(0)));
        if (c.hidden_positions == 0) {
          EXPECT_TRUE(compare("o", d.o_host, ref.o, Tolerance::bf16_output()));
          EXPECT_TRUE(compare("lse", d.lse_host, ref.lse, Tolerance::lse()));
        } else {
          const auto [got_o, got_lse] = request_rows(d.o_host, d.lse_host, 0, c.hidden_positions);
          const auto [ref_o, ref_lse] = request_rows(ref.o, ref.lse, 0, c.hidden_positions);
          EXPECT_TRUE(compare("o of the rows that do not see it", got_o, ref_o, Tolerance::bf16_output()));
          EXPECT_TRUE(compare("lse of the rows that do not see it", got_lse, ref_lse, Tolerance::lse()));
          const auto [clean_o, clean_lse] = request_rows(d.o_host, d.lse_host, 1, c.q_len);
          const auto [ref_clean_o, ref_clean_lse] = request_rows(ref.o, ref.lse, 1, c.q_len);
          EXPECT_TRUE(compare("o of request 1", clean_o, ref_clean_o, Tolerance::bf16_output()));
          EXPECT_TRUE(compare("lse of request 1", clean_lse, ref_clean_lse, Tolerance::lse()));
          const auto [seen_o, seen_lse] = request_rows(d.o_host, d.lse_host, 0, c.q_len);
          const auto [ref_seen_o, ref_seen_lse] = request_rows(ref.o, ref.lse, 0, c.q_len);
          const std::int64_t first = static_cast<std::int64_t>(c.hidden_positions) * heads;  // rows that see it
          const std::int64_t seeing = (c.q_len - c.hidden_positions) * static_cast<std::int64_t>(heads);
          EXPECT_EQ(sentinel_elements(seen_o, first * 512, seeing * 512), 0) << "o of the rows that see the token";
          EXPECT_EQ(sentinel_elements(seen_lse, first, seeing), 0) << "lse of the rows that see the token";
          for (std::int64_t r = first; r < first + seeing; ++r) {
            if (!std::isfinite(ref_seen_lse.get(r))) {
              EXPECT_FALSE(std::isfinite(seen_lse.get(r))) << "lse of row " << r << ", which sees the token";
            }
          }
        }
      }
    }
  }
}

// The fault tests' cache: three requests (300, 1000 and 129 tokens) of `dtype`, and with `requests`
// above 3 more of mixed lengths, which the narrow kernel merges itself in its balanced grid.
PagedFixture fault_fixture(KvDtype dtype, Rng& rng, int requests = 3) {
  PagedFixtureOptions opt;
  opt.lengths = {300, 1000, 129};
  for (int b = 3; b < requests; ++b) opt.lengths.push_back(40 + 173 * b);
  opt.kv_dtype = dtype;
  opt.with_indexer = false;
  return make_paged_fixture(opt, rng);
}

// What decode of q over f on the cuda backend, with the plan's splits, leaves in its fault record.
std::string gpu_decode_fault(PagedFixture& f, const HostTensor& q) {
  DeviceDecode d(f, q, 0.0625f);
  const Backend& backend = *find_backend("cuda");
  d.plan(backend, detect_device());
  run(backend, d.params);
  if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error(cudaGetErrorString(cudaGetLastError()));
  return d.fault.message();
}

// Bad lengths and pages in device memory, one at a time, on the narrow kernel (also in its balanced
// grid, 40 requests), the many-heads one (wgmma on sm_90) and the bf16 one: the kernels skip what
// they cannot read and note the fault, and the record throws the reference's own Error for the same
// input. The block table has its spare -1 column: a length past the capacity is one fault, whatever
// the pages past it hold.
TEST(GpuMlaDecodeFaults, RecordTheReferencesError) {
  LKV_REQUIRE_GPU();
  struct Kernel {
    KvDtype dtype;
    int heads;
    int requests = 3;
  };
  struct Bad {
    const char* what;
    std::function<void(PagedFixture&)> spoil;
  };
  const std::vector<Bad> bad = {
      {"a page past the pool", [](PagedFixture& f) { f.block_table[f.max_pages + 5] = static_cast<std::int32_t>(f.num_pages() + 2); }},
      {"a negative page", [](PagedFixture& f) { f.block_table[4] = -3; }},
      {"the last page of a length", [](PagedFixture& f) { f.block_table[2 * f.max_pages + 2] = static_cast<std::int32_t>(f.num_pages()); }},
      {"a length past the block table", [](PagedFixture& f) { f.seq_lens[1] = f.max_pages * f.page_size + 1; }},
      {"a negative length", [](PagedFixture& f) { f.seq_lens[2] = -1; }},
  };
  for (const Kernel k : {Kernel{KvDtype::kFp8E4M3, 8}, Kernel{KvDtype::kFp8E4M3, 8, 40}, Kernel{KvDtype::kFp8E4M3, 64},
                         Kernel{KvDtype::kBf16, 8}}) {
    for (const Bad& b : bad) {
      SCOPED_TRACE(std::string(kv_dtype_name(k.dtype)) + ", H " + std::to_string(k.heads) + ", " +
                   std::to_string(k.requests) + " requests: " + b.what);
      Rng rng = test_rng();
      PagedFixture f = fault_fixture(k.dtype, rng, k.requests);
      HostTensor q = random_bf16(rng, {f.batch(), 1, k.heads, 576});
      b.spoil(f);
      const std::string expected = error_of([&] { reference_mla_decode(f, q, 0.0625f); });
      ASSERT_NE(expected, "") << "the reference takes the input";
      EXPECT_EQ(gpu_decode_fault(f, q), expected);
    }
  }
}

// A query value that is not finite, one at a time (a NaN in a latent dim of the last row, inf and
// -inf in rope dims of other rows and requests), on the narrow (also in its balanced grid), wgmma
// and bf16 kernels, with the splits of the plan: the kernels stage q as before and note the value,
// and the record throws the reference's own Error for the same q.
TEST(GpuMlaDecodeFaults, NonFiniteQueriesAreTheReferencesError) {
  LKV_REQUIRE_GPU();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  struct Kernel {
    KvDtype dtype;
    int heads;
    int requests = 3;
  };
  for (const auto& [dtype, heads, requests] : {Kernel{KvDtype::kFp8E4M3, 8}, Kernel{KvDtype::kFp8E4M3, 8, 40},
                                               Kernel{KvDtype::kFp8E4M3, 64}, Kernel{KvDtype::kBf16, 8}}) {
    const std::int64_t row = 576, last_row = (1 * 2 + 1) * heads + heads - 1;  // request 1, q position 1, last head
    for (const auto& [element, value] : {std::pair{last_row * row + 300, std::nan("")},
                                         std::pair{(2 * 2 * heads + 3) * row + 570, kInf},
                                         std::pair{std::int64_t{5} * row + 512, -kInf}}) {
      SCOPED_TRACE(std::string(kv_dtype_name(dtype)) + ", H " + std::to_string(heads) + ", " +
                   std::to_string(requests) + " requests, element " + std::to_string(element) + " = " +
                   std::to_string(value));
      Rng rng = test_rng();
      PagedFixture f = fault_fixture(dtype, rng, requests);
      HostTensor q = random_bf16(rng, {f.batch(), 2, heads, 576});
      q.set(element, value);
      const std::string expected = error_of([&] { reference_mla_decode(f, q, 0.0625f); });
      ASSERT_NE(expected, "") << "the reference takes the input";
      EXPECT_EQ(gpu_decode_fault(f, q), expected);
    }
  }
}

// All cached latent values equal => every output element equals that value exactly (the softmax
// weights sum to one whatever the scores), whichever tokens are attended.
TEST(GpuMlaDecodeExact, ConstantValuesGiveThatValue) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixtureOptions opt;
  opt.lengths = {2, 70, 900};  // >= q_len: every row sees at least one token
  opt.with_indexer = false;
  opt.token_values = [](std::int64_t, std::int64_t, std::uint16_t* latent, std::uint16_t*) {
    for (int i = 0; i < 512; ++i) latent[i] = bf16_encode(0.75f);
    for (int i = 512; i < 576; ++i) latent[i] = bf16_encode(static_cast<float>(i % 7) - 3.0f);
  };
  PagedFixture f = make_paged_fixture(opt, rng);
  HostTensor q = random_bf16(rng, {f.batch(), 2, 8, 576});
  DeviceDecode d(f, q, 0.0625f);
  const Backend& backend = *find_backend("cuda");
  d.plan(backend, detect_device());
  run(backend, d.params);
  LKV_CUDA_OK(cudaDeviceSynchronize());
  d.download();
  const HostTensor& o = d.o_host;
  for (std::int64_t i = 0; i < o.numel(); ++i) ASSERT_EQ(o.get(i), 0.75) << "element " << i;
}

// Queries far below one (largest |value| about 1e-36) attend as in the reference (almost uniformly):
// the kernels that lift a query row into f16 by a power of two (8 heads: narrow; 64 on sm_90: wgmma)
// must not lift it by an infinite one; 32 heads take bf16 queries as they are.
TEST(GpuMlaDecodeExact, TinyQueriesAttendAsInTheReference) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixtureOptions opt;
  opt.lengths = {1, 70, 900};
  opt.with_indexer = false;
  PagedFixture f = make_paged_fixture(opt, rng);
  for (int heads : {8, 32, 64}) {
    SCOPED_TRACE("H " + std::to_string(heads));
    HostTensor q = random_bf16(rng, {f.batch(), 1, heads, 576}, 1e-36);
    const AttentionOutputs ref = reference_mla_decode(f, q, 0.0625f);
    DeviceDecode d(f, q, 0.0625f);
    run_on_kernel(d, "auto");
    EXPECT_EQ(d.fault.message(), "") << "a fault noted for good input";
    EXPECT_TRUE(compare("o", d.o_host, ref.o, Tolerance::bf16_output()));
    EXPECT_TRUE(compare("lse", d.lse_host, ref.lse, Tolerance::lse()));
  }
}

// Two requests of `lengths` tokens, 8 heads, on the GPU: the plan tests' call.
struct PlanCase {
  Rng rng = test_rng();
  PagedFixture f;
  HostTensor q;
  DeviceDecode d;
  const Backend& backend = *find_backend("cuda");
  const DeviceInfo device = detect_device();

  explicit PlanCase(std::vector<std::int64_t> lengths)
      : f(fixture(rng, std::move(lengths))), q(random_bf16(rng, {f.batch(), 1, 8, 576})), d(f, q, 0.0625f) {}
  static PagedFixture fixture(Rng& rng, std::vector<std::int64_t> lengths) {
    PagedFixtureOptions opt;
    opt.lengths = std::move(lengths);
    opt.with_indexer = false;
    return make_paged_fixture(opt, rng);
  }
};

// plan() runs before a call's checks: q without heads, of a q_len outside 1 .. 4 or of a negative
// extent, a page size below one token, a block table or index rows of negative extent or too many
// bytes, lengths of a rank or dtype no view has are refused there, naming them, rather than divided
// or counted with: by the cuda backend and by both cast baselines (whose scratch is sized
// from the same shapes).
TEST(GpuMlaDecodePlan, ShapesThePlannersCountWithAreCheckedFirst) {
  LKV_REQUIRE_GPU();
  PlanCase c({70, 150});
  for (const char* name : {"cuda", "cast_full", "gather_cast"}) {
    SCOPED_TRACE(name);
    const Backend& backend = *find_backend(name);
    const auto plan = [&](const OpArgs& args) { (void)backend.plan(args, c.device); };
    MlaDecodeParams p = c.d.params;
    p.q = TensorView::contiguous(p.q.data, DType::kBF16, {c.f.batch(), 1, 0, 576}, p.q.device);
    EXPECT_TRUE(throws_error([&] { plan(p); }, "mla_decode", "q.shape[2] (heads)", "0"));
    // q_len x heads are the planner's query rows, which it divides by: 2^28 x 16 would wrap to 0.
    for (const std::int64_t q_len : {std::int64_t{0}, std::int64_t{kMaxDecodeQLen + 1}, std::int64_t{1} << 28}) {
      MlaDecodeParams rows = c.d.params;
      rows.q = TensorView::contiguous(rows.q.data, DType::kBF16, {c.f.batch(), q_len, 16, 576}, rows.q.device);
      EXPECT_TRUE(throws_error([&] { plan(rows); }, "mla_decode", "q.shape[1] (q_len)", std::to_string(q_len)));
    }
    SparseMlaDecodeParams sparse;
    sparse.q = p.q;
    sparse.cache = p.cache;
    sparse.indices = TensorView::contiguous(nullptr, DType::kI32, {c.f.batch(), 1, 64}, p.q.device);
    EXPECT_TRUE(throws_error([&] { plan(sparse); }, "sparse_mla_decode", "q.shape[2] (heads)", "0"));
    sparse.q = TensorView::contiguous(p.q.data, DType::kBF16, {c.f.batch(), 0, 8, 576}, p.q.device);
    EXPECT_TRUE(throws_error([&] { plan(sparse); }, "sparse_mla_decode", "q.shape[1] (q_len)", "0"));
    sparse.q = c.d.params.q;
    sparse.indices.shape[0] = -2;
    EXPECT_TRUE(throws_error([&] { plan(sparse); }, "sparse_mla_decode", "indices", "-2"));
    p = c.d.params;
    p.q.shape[0] = -1;
    EXPECT_TRUE(throws_error([&] { plan(p); }, "mla_decode", "q", "-1"));
    p = c.d.params;
    p.cache.page_size = 0;
    EXPECT_TRUE(throws_error([&] { plan(p); }, "mla_decode", "cache.page_size", "0"));
    p = c.d.params;
    p.block_table.shape[1] = -3;
    EXPECT_TRUE(throws_error([&] { plan(p); }, "mla_decode", "block_table", "-3"));
    p = c.d.params;
    p.block_table.shape[0] = std::int64_t{1} << 62;  // 2^64 bytes of i32
    EXPECT_TRUE(throws_error([&] { plan(p); }, "mla_decode", "block_table", "4611686018427387904"));
    p = c.d.params;
    p.seq_lens.rank = TensorView::kMaxRank + 1;
    EXPECT_TRUE(throws_error([&] { plan(p); }, "mla_decode", "seq_lens", "rank"));
    p = c.d.params;
    p.seq_lens.dtype = static_cast<DType>(99);
    EXPECT_TRUE(throws_error([&] { plan(p); }, "mla_decode", "seq_lens", "dtype 99"));
    EXPECT_NO_THROW(plan(c.d.params));
  }
  MlaPrefillParams prefill;
  prefill.q = TensorView::contiguous(c.d.params.q.data, DType::kBF16, {4, 0, 576}, c.d.params.q.device);
  prefill.cache = c.d.params.cache;
  EXPECT_TRUE(throws_error([&] { (void)c.backend.plan(prefill, c.device); }, "mla_prefill", "q.shape[1] (heads)", "0"));
}

// The requests a call takes at most kMaxGpuRequests of (a grid dimension each; a sparse decode's
// query tokens), and a prefill's requests past INT32_MAX, are refused by plan() as by the call,
// rather than planned with a count cut down to an int (shapes only: the views hold no data). The
// refusals come before any device is asked, so they run without a GPU; the plans at the limit run on one.
TEST(GpuMlaDecodePlan, RequestsPastWhatACallTakesAreRefused) {
  if (find_backend("cuda") == nullptr) GTEST_SKIP() << "this build has no CUDA backends";
  const Backend& cuda = *find_backend("cuda");
  const bool on_gpu = detect_device().kind == DeviceKind::kCuda;
  const DeviceInfo device = on_gpu ? detect_device()
                                   : DeviceInfo{.kind = DeviceKind::kCuda, .sm = 90, .name = "sm_90 by description",
                                                .multiprocessors = 132};
  const Device gpu = Device::cuda(device.index);
  const auto shaped = [&](DType dtype, std::initializer_list<std::int64_t> dims) {
    return TensorView::contiguous(nullptr, dtype, dims, gpu);
  };
  const LatentCache cache{nullptr, KvDtype::kFp8E4M3, 1024, 64, gpu};
  const IndexerCache indexer{nullptr, 1024, 64, gpu};
  const auto plan = [&](const OpArgs& args) { (void)cuda.plan(args, device); };
  const auto plans = [&](const OpArgs& args) { return !on_gpu || (plan(args), true); };  // at the limit
  constexpr std::int64_t most = kMaxGpuRequests;

  const auto decode = [&](std::int64_t b) {
    MlaDecodeParams p;
    p.q = shaped(DType::kBF16, {b, 1, 8, kQkDim});
    p.cache = cache;
    p.block_table = shaped(DType::kI32, {b, 4});
    p.seq_lens = shaped(DType::kI32, {b});
    return p;
  };
  EXPECT_TRUE(plans(decode(most)));
  EXPECT_TRUE(throws_error([&] { plan(decode(most + 1)); }, "mla_decode", "q", "65536 requests (B)"));

  const auto sparse = [&](std::int64_t b, std::int64_t q_len) {
    SparseMlaDecodeParams p;
    p.q = shaped(DType::kBF16, {b, q_len, 8, kQkDim});
    p.cache = cache;
    p.indices = shaped(DType::kI32, {b, q_len, 64});
    return p;
  };
  EXPECT_TRUE(plans(sparse(most / 3, 3)));
  EXPECT_TRUE(throws_error([&] { plan(sparse(most / 2 + 1, 2)); }, "sparse_mla_decode", "q",
                           "65536 query tokens (B x q_len)"));

  const auto logits = [&](std::int64_t b) {
    IndexerLogitsParams p;
    p.q = shaped(DType::kFP8E4M3, {b, 1, 32, kIndexerDim});
    p.weights = shaped(DType::kF32, {b, 1, 32});
    p.cache = indexer;
    p.block_table = shaped(DType::kI32, {b, 4});
    p.seq_lens = shaped(DType::kI32, {b});
    p.logits = shaped(DType::kF32, {b, 1, 256});
    return p;
  };
  EXPECT_TRUE(plans(logits(most)));
  EXPECT_TRUE(throws_error([&] { plan(logits(most + 1)); }, "indexer_logits", "q", "65536 requests (B)"));

  const std::int64_t past_int = std::int64_t{1} << 31;  // lengths alone 8 GiB: never allocated here
  MlaPrefillParams prefill;
  prefill.q = shaped(DType::kBF16, {4, 8, kQkDim});
  prefill.cache = cache;
  prefill.cu_new_tokens = shaped(DType::kI32, {past_int + 1});
  prefill.seq_lens = shaped(DType::kI32, {past_int});
  prefill.block_table = shaped(DType::kI32, {past_int, 1});
  EXPECT_TRUE(throws_error([&] { plan(prefill); }, "mla_prefill", "seq_lens", "2147483648 requests (B)"));
  IndexerPrefillParams scores;
  scores.q = shaped(DType::kFP8E4M3, {4, 32, kIndexerDim});
  scores.weights = shaped(DType::kF32, {4, 32});
  scores.cache = indexer;
  scores.cu_new_tokens = prefill.cu_new_tokens;
  scores.seq_lens = prefill.seq_lens;
  scores.block_table = prefill.block_table;
  scores.k = 64;
  EXPECT_TRUE(throws_error([&] { plan(scores); }, "indexer_prefill", "seq_lens", "2147483648 requests (B)"));
}

// A split count asked of the plan is kept and the workspace sized for it; counts outside 1 to 1024
// are refused, by plan() and by the call; so is a workspace that is not 16-byte aligned (a caller's
// sub-allocation: the split partials are read and written in 16-byte pieces), before anything is
// queued, naming it, the outputs left sentinels.
TEST(GpuMlaDecodePlan, AskedSplitCountsAreKeptOrRefused) {
  LKV_REQUIRE_GPU();
  PlanCase c({700, 1500});
  const Backend& backend = c.backend;
  const DeviceInfo& device = c.device;
  DeviceDecode& d = c.d;
  const PagedFixture& f = c.f;
  const Plan plan = d.plan(backend, device, 3);
  EXPECT_EQ(plan.num_splits, 3);
  EXPECT_EQ(plan.workspace_bytes, sizeof(float) * 3 * static_cast<std::size_t>(f.batch()) * 8 * 513);
  for (const int bad : {-1, 1025}) {
    MlaDecodeParams p = d.params;
    p.num_splits = bad;
    EXPECT_THROW(backend.plan(p, device), Error) << bad << " splits asked of the plan";
  }
  MlaDecodeParams p = d.params;
  p.num_splits = 1025;
  EXPECT_THROW(run(backend, p, {}, device), Error) << "1025 splits at the call";
  DeviceBuffer shifted(plan.workspace_bytes + 16);
  d.params.workspace = shifted.get<std::uint8_t>() + 4;
  EXPECT_TRUE(throws_error([&] { run(backend, d.params, {}, device); }, "mla_decode", "workspace", "not 16-byte aligned"));
  LKV_CUDA_OK(cudaDeviceSynchronize());
  d.download();
  EXPECT_TRUE(is_sentinel(d.o_host));
  EXPECT_TRUE(is_sentinel(d.lse_host));
}

// The cast baselines read the caller's fp8 cache and write their bf16 copy into the workspace in
// 16-byte pieces, and their inner decode sees only the copy: so each baseline checks these itself.
// A cache or a workspace that is not 16-byte aligned, or a null workspace, is refused naming it (not
// the copy standing for it) before anything is queued, and the outputs stay sentinels.
TEST(GpuMlaDecodePlan, CastBaselinesCheckWhatTheyCast) {
  LKV_REQUIRE_GPU();
  PlanCase c({70, 150});
  for (const char* name : {"cast_full", "gather_cast"}) {
    SCOPED_TRACE(name);
    const Backend& backend = *find_backend(name);
    const Plan plan = c.d.plan(backend, c.device);
    const MlaDecodeParams good = c.d.params;
    // Views only: a refused call reads and writes none of these bytes.
    DeviceBuffer cache(static_cast<std::size_t>(good.cache.num_slots()) * kFp8TokenBytes + 16);
    DeviceBuffer workspace(plan.workspace_bytes + 16);
    MlaDecodeParams p = good;
    p.cache.data = cache.get<std::uint8_t>() + 8;
    EXPECT_TRUE(
        throws_error([&] { run(backend, p, {}, c.device); }, "mla_decode", "cache.data", "not 16-byte aligned (0x"));
    p = good;
    p.workspace = workspace.get<std::uint8_t>() + 8;
    EXPECT_TRUE(throws_error([&] { run(backend, p, {}, c.device); }, "mla_decode", "workspace", "not 16-byte aligned"));
    p = good;
    p.workspace = nullptr;
    EXPECT_TRUE(throws_error([&] { run(backend, p, {}, c.device); }, "mla_decode", "workspace", "null"));
    LKV_CUDA_OK(cudaDeviceSynchronize());
    c.d.download();
    EXPECT_TRUE(is_sentinel(c.d.o_host));
    EXPECT_TRUE(is_sentinel(c.d.lse_host));
    // The call as planned runs.
    run(backend, good, {}, c.device);
    LKV_CUDA_OK(cudaDeviceSynchronize());
    c.d.download();
    EXPECT_FALSE(is_sentinel(c.d.o_host));
    c.d.fill_sentinels();
  }
}

// The cast baselines size their bf16 copy from the pool (cast_full), the block table (gather_cast,
// dense) or the index entries (gather_cast, sparse and sparse prefill). A copy of 2^64 bytes or more
// is refused by plan(), naming the argument it comes from, rather than planned as a wrapped size; the
// views are never read, and the refusal comes before any device is asked, so this runs without a GPU.
TEST(GpuMlaDecodePlan, CastBaselinesRefuseCopiesWithoutA64BitSize) {
  if (find_backend("cast_full") == nullptr) GTEST_SKIP() << "this build has no CUDA backends";
  const Device gpu = Device::cuda();
  const DeviceInfo device{.kind = DeviceKind::kCuda, .sm = 90, .name = "sm_90 by description", .multiprocessors = 132};
  MlaDecodeParams dense;
  dense.q = TensorView::contiguous(nullptr, DType::kBF16, {1, 1, 8, 576}, gpu);
  dense.cache.num_pages = std::int64_t{1} << 50;  // 2^56 slots: 1152 x 2^56 bytes as bf16
  dense.cache.page_size = 64;
  dense.cache.device = gpu;
  dense.block_table = TensorView::contiguous(nullptr, DType::kI32, {1, 4}, gpu);
  dense.seq_lens = TensorView::contiguous(nullptr, DType::kI32, {1}, gpu);
  const Backend& cast_full = *find_backend("cast_full");
  const Backend& gather_cast = *find_backend("gather_cast");
  EXPECT_TRUE(throws_error([&] { (void)cast_full.plan(dense, device); }, "mla_decode", "cache",
                           "1125899906842624 pages of 64 slots"));
  // gather_cast copies the requests' tables, not the pool: 65,535 requests (the most a call takes)
  // of 2^20 pages of 2^20 tokens.
  MlaDecodeParams tables = dense;
  tables.cache.num_pages = 1000;
  tables.cache.page_size = 1 << 20;
  tables.q = TensorView::contiguous(nullptr, DType::kBF16, {kMaxGpuRequests, 1, 8, 576}, gpu);
  tables.block_table = TensorView::contiguous(nullptr, DType::kI32, {kMaxGpuRequests, 1 << 20}, gpu);
  EXPECT_TRUE(throws_error([&] { (void)gather_cast.plan(tables, device); }, "mla_decode", "block_table",
                           "65535 requests of 1048576 pages of 1048576 tokens"));
  // A table of no rows holds no bytes whatever its columns, but the copy is sized by the requests:
  // 65,535 of 2^60 pages of 2^30 tokens, about 2^117 bytes (a count held to 2^64 - 1 as it grows).
  tables.cache.page_size = 1 << 30;
  tables.block_table = TensorView::contiguous(nullptr, DType::kI32, {0, 1409126630525324803}, gpu);
  EXPECT_TRUE(throws_error([&] { (void)gather_cast.plan(tables, device); }, "mla_decode", "block_table",
                           "65535 requests of 1409126630525324803 pages of 1073741824 tokens"));
  // More requests than a call takes are refused first, by q.
  tables.q = TensorView::contiguous(nullptr, DType::kBF16, {kMaxGpuRequests + 1, 1, 8, 576}, gpu);
  EXPECT_TRUE(throws_error([&] { (void)gather_cast.plan(tables, device); }, "mla_decode", "q", "65536 requests (B)"));
  // 2^57 index entries (each extent below 2^31): 2^59 bytes of i32, 1152 x 2^57 bytes as bf16 tokens.
  SparseMlaDecodeParams sparse;
  sparse.q = dense.q;
  sparse.cache = tables.cache;
  sparse.indices = TensorView::contiguous(nullptr, DType::kI32, {1 << 28, 2, 1 << 28}, gpu);
  EXPECT_TRUE(throws_error([&] { (void)gather_cast.plan(sparse, device); }, "sparse_mla_decode", "indices",
                           "144115188075855872 entries"));
  SparseMlaPrefillParams prefill;
  prefill.q = TensorView::contiguous(nullptr, DType::kBF16, {1 << 30, 8, 576}, gpu);
  prefill.cache = tables.cache;
  prefill.indices = TensorView::contiguous(nullptr, DType::kI32, {1 << 30, 1 << 27}, gpu);
  EXPECT_TRUE(throws_error([&] { (void)gather_cast.plan(prefill, device); }, "sparse_mla_prefill", "indices",
                           "144115188075855872 entries"));
  if (detect_device().kind != DeviceKind::kCuda) return;
  // On a GPU: a pool whose copy, 1024 bytes short of 2^64, fits alone but not with the decode's
  // split partials after it (2 splits of 8 rows: 32,832 bytes).
  MlaDecodeParams split = dense;
  split.cache.page_size = 8;
  split.cache.num_pages = ((std::int64_t{1} << 54) - 1) / 9;
  split.num_splits = 2;
  EXPECT_TRUE(throws_error([&] { (void)cast_full.plan(split, detect_device()); }, "mla_decode", "cache",
                           "2001599834386887 pages of 8 slots"));
}

// A block table of no pages (every length 0, which the validation and the reference accept): the
// plan and the call run, and every row comes out empty (o 0, lse -inf), on the narrow and the
// many-heads kernel. (The plan's short-split rule once divided by a split count of 0 here.)
TEST(GpuMlaDecodePlan, NoPagesGiveEmptyRows) {
  LKV_REQUIRE_GPU();
  for (int heads : {8, 64}) {
    SCOPED_TRACE("H " + std::to_string(heads));
    Rng rng = test_rng();
    PagedFixtureOptions opt;
    opt.lengths = {0, 0};
    opt.with_indexer = false;
    PagedFixture f = make_paged_fixture(opt, rng);
    f.max_pages = 0;
    f.block_table.clear();
    HostTensor q = random_bf16(rng, {f.batch(), 1, heads, 576});
    const AttentionOutputs ref = reference_mla_decode(f, q, 0.0625f);
    DeviceDecode d(f, q, 0.0625f);
    const Backend& backend = *find_backend("cuda");
    const Plan plan = d.plan(backend, detect_device());
    EXPECT_GE(plan.num_splits, 1);
    run(backend, d.params);
    LKV_CUDA_OK(cudaDeviceSynchronize());
    EXPECT_EQ(d.fault.message(), "") << "a fault noted for good input";
    d.download();
    EXPECT_TRUE(compare("o", d.o_host, ref.o, Tolerance::bf16_output()));
    EXPECT_TRUE(compare("lse", d.lse_host, ref.lse, Tolerance::lse()));
  }
}

// The row counts the cases above pick to reach each kernel do reach it on this GPU: up to 16 fp8 rows
// the narrow kernel (8 or 16 rows), then the mma.sync kernel of 32 rows a CTA, and from 33 rows the
// wgmma kernel where the library holds sm_90a code, the GPU is an sm_90 and LATENTKV_MLA_KERNEL
// leaves it on; bf16 caches the mma.sync kernel. (So that a suite run on another GPU or build says
// which paths it did not run, rather than passing without them.)
TEST(GpuMlaDecodeKernels, RowCountsTakeTheirKernels) {
  LKV_REQUIRE_GPU();
  const DeviceInfo device = detect_device();
  const char* forced = std::getenv(kMlaKernelVariable);
  const bool wgmma = device.sm == 90 && std::string(library_build()).find("sm_90a") != std::string::npos &&
                     (forced == nullptr || std::string(forced).empty() || std::string(forced) == "auto");
  const auto kernel = [&](int heads, int q_len, KvDtype dtype, Op op = Op::kMlaDecode) {
    Problem p;
    p.op = op;
    p.kv_dtype = dtype;
    p.heads = heads;
    p.q_len = q_len;
    p.page_size = 64;
    p.topk = 2048;
    p.device = device;
    const Selection s = find_backend("cuda")->select(p);
    return s ? s.kernel->name : "refused: " + s.reason;
  };
  const KvDtype fp8 = KvDtype::kFp8E4M3, bf16 = KvDtype::kBf16;
  EXPECT_EQ(kernel(8, 1, fp8), "mla_decode_narrow<fp8, 8 rows>");
  EXPECT_EQ(kernel(12, 1, fp8), "mla_decode_narrow<fp8, 16 rows>");
  EXPECT_EQ(kernel(4, 4, fp8), "mla_decode_narrow<fp8, 16 rows>");
  EXPECT_EQ(kernel(32, 1, fp8), "mla_decode<fp8, 32 rows/cta>");
  EXPECT_EQ(kernel(24, 2, fp8), wgmma ? "mla_decode_wgmma<fp8, 64 rows/cta>" : "mla_decode<fp8, 32 rows/cta>");
  EXPECT_EQ(kernel(128, 1, fp8), wgmma ? "mla_decode_wgmma<fp8, 64 rows/cta>" : "mla_decode<fp8, 32 rows/cta>");
  EXPECT_EQ(kernel(8, 1, bf16), "mla_decode<bf16, 16 rows/cta>");
  EXPECT_EQ(kernel(24, 1, bf16), "mla_decode<bf16, 32 rows/cta>");
  EXPECT_EQ(kernel(96, 1, fp8, Op::kSparseMlaDecode),
            wgmma ? "sparse_mla_decode_wgmma<fp8, 64 rows/cta>" : "sparse_mla_decode<fp8, 32 rows/cta>");
  if (!wgmma) GTEST_SKIP() << "the wgmma kernel is not this run's (sm_" << device.sm << ", " << library_build() << ")";
}

// A block-table page outside the pool (bad device data the call cannot refuse) is not read: its
// tokens drop out of the softmax, on the fp8 kernels with and without a fault record (which then
// names the page) and in both cast baselines (the dense gather_cast marks such a page unread in its
// own table), so the result is the reference's sparse attention over the request's other tokens.
TEST(GpuMlaDecodeBadTable, AnOutOfPoolPageIsSkippedByEveryBackend) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixtureOptions opt;
  opt.lengths = {300, 1000};
  opt.with_indexer = false;
  PagedFixture f = make_paged_fixture(opt, rng);
  constexpr std::int64_t kBadPage = 3, kCols = 1000;  // request 1's tokens 192 .. 255
  HostTensor indices(DType::kI32, {f.batch(), 1, kCols});
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    std::vector<std::int32_t> row = f.slots(b, f.seq_lens[static_cast<std::size_t>(b)]);
    if (b == 1) row.erase(row.begin() + kBadPage * f.page_size, row.begin() + (kBadPage + 1) * f.page_size);
    row.resize(kCols, -1);
    std::copy(row.begin(), row.end(), indices.data<std::int32_t>() + b * kCols);
  }
  // The bad page is the first past the pool, in memory the device buffer holds and NaN-poisons (a
  // kernel that read it would meet NaN, not the zeros of fresh memory or the end of the buffer).
  const std::int32_t bad = static_cast<std::int32_t>(f.num_pages());
  f.block_table[static_cast<std::size_t>(f.max_pages + kBadPage)] = bad;
  std::vector<std::uint8_t> beyond(2 * static_cast<std::size_t>(f.page_size) * kv_token_bytes(f.kv_dtype));
  poison_latent_cache(beyond, f.kv_dtype);
  std::vector<std::uint8_t> past_pool = f.cache_bytes;
  past_pool.insert(past_pool.end(), beyond.begin(), beyond.end());
  for (const int heads : {8, 64}) {
    HostTensor q = random_bf16(rng, {f.batch(), 1, heads, 576});
    const AttentionOutputs ref = reference_sparse_decode(f, q, indices, 0.0625f);
    const std::string expected = error_of([&] { reference_mla_decode(f, q, 0.0625f); });
    ASSERT_NE(expected, "") << "the reference takes the bad page";
    // The cuda kernels twice: their instances without checks, then with them (given a record, which
    // must name the page as the reference does); the baselines without a record.
    for (const auto& [name, record] : {std::pair{"cuda", false}, std::pair{"cuda", true}, std::pair{"gather_cast", false},
                                       std::pair{"cast_full", false}}) {
      SCOPED_TRACE(std::string(name) + ", H " + std::to_string(heads) + (record ? ", fault record" : ""));
      DeviceDecode d(f, q, 0.0625f);
      d.cache = GuardedBuffer(past_pool, kPoisonFp8);
      d.params.cache = f.cache(d.cache.get<std::uint8_t>(), Device::cuda());  // the pool: f.num_pages() pages
      if (!record) d.params.fault = nullptr;
      const Backend& backend = *find_backend(name);
      const DeviceInfo device = detect_device();
      d.plan(backend, device);
      // NaN in the workspace (bf16 and f32 0xFF..): gather_cast's rows of the page it skips must not
      // be read either.
      LKV_CUDA_OK(cudaMemset(d.workspace.get(), 0xFF, d.workspace.bytes()));
      run(backend, d.params, {}, device);
      LKV_CUDA_OK(cudaDeviceSynchronize());
      d.download();
      EXPECT_TRUE(compare("o", d.o_host, ref.o, Tolerance::bf16_output()));
      EXPECT_TRUE(compare("lse", d.lse_host, ref.lse, Tolerance::lse()));
      if (record) EXPECT_EQ(d.fault.message(), expected);
    }
  }
}

// One decode step captured once in a CUDA graph and replayed as the lengths grow: the kernels read
// the lengths from device memory, never from the host. On each kernel family: 16 heads (narrow; its
// splits merged by the combine kernel, or, 8 forced, in the kernel), 32 (mma.sync, 32 rows), 64 and
// 128 (wgmma on sm_90, the combine kernel), and given no fault record (the instances without
// checks) 8 x q_len 2 (narrow, merged in the kernel) and 16 x q_len 2 (mma.sync).
TEST(GpuMlaDecodeGraph, ReplaysFollowDeviceLengths) {
  LKV_REQUIRE_GPU();
  struct Config {
    int heads, q_len;
    bool fault_record;
    int splits = 0;  // 0: the plan's
  };
  // The plan (by capacity: 1600 tokens, 50 splits) leaves the merge to the combine kernel; 8 forced
  // splits are merged in the narrow kernel, launched cooperatively on the balanced grid.
  for (const Config c : {Config{16, 1, true}, Config{16, 1, true, 8}, Config{32, 1, true}, Config{64, 1, true},
                         Config{128, 1, true}, Config{8, 2, false, 8}, Config{16, 2, false}}) {
    SCOPED_TRACE("H " + std::to_string(c.heads) + ", q_len " + std::to_string(c.q_len) +
                 (c.fault_record ? "" : ", no fault record") +
                 (c.splits > 0 ? ", " + std::to_string(c.splits) + " splits" : std::string()));
    Rng rng = test_rng();
    PagedFixtureOptions opt;
    opt.lengths = {700, 1500};  // the cache holds the final lengths; the step starts shorter
    opt.with_indexer = false;
    PagedFixture f = make_paged_fixture(opt, rng);
    HostTensor q = random_bf16(rng, {f.batch(), c.q_len, c.heads, 576});
    DeviceDecode d(f, q, 0.0625f, {300, 2});
    if (!c.fault_record) d.params.fault = nullptr;
    const Backend& backend = *find_backend("cuda");
    const DeviceInfo device = detect_device();
    d.plan(backend, device, c.splits);
    const MlaDecodeParams& p = d.params;

    cudaStream_t stream;
    LKV_CUDA_OK(cudaStreamCreate(&stream));
    run(backend, p, {stream}, device);  // warm-up outside the capture (first-call attribute set-up)
    LKV_CUDA_OK(cudaStreamSynchronize(stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    LKV_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    run(backend, p, {stream}, device);
    LKV_CUDA_OK(cudaStreamEndCapture(stream, &graph));
    LKV_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

    for (const std::vector<std::int32_t>& step : {std::vector<std::int32_t>{300, 2}, {301, 3}, {699, 1499}, {700, 1500}}) {
      d.lens.upload(step.data(), step.size() * sizeof(std::int32_t));
      d.fill_sentinels();
      LKV_CUDA_OK(cudaGraphLaunch(exec, stream));
      LKV_CUDA_OK(cudaStreamSynchronize(stream));
      d.download();
      f.seq_lens = step;  // the host side of the reference follows the same lengths
      const AttentionOutputs ref = reference_mla_decode(f, q, 0.0625f);
      EXPECT_TRUE(compare("o", d.o_host, ref.o, Tolerance::bf16_output())) << "lengths " << step[0] << ", " << step[1];
      EXPECT_TRUE(compare("lse", d.lse_host, ref.lse, Tolerance::lse()));
    }
    if (c.fault_record) EXPECT_EQ(d.fault.message(), "") << "a fault noted for good input";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

}  // namespace
}  // namespace latentkv::testing
