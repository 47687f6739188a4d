// GPU sparse MLA decode against the float64 CPU reference: index rows in any order, padded with -1,
// with a duplicated slot, empty rows, NaN in every slot that is not selected (the slots no request
// holds, and those a request holds that no index row lists).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "gpu/device.hpp"
#include "latentkv/backend.hpp"
#include "support/compare.hpp"
#include "support/expect_error.hpp"
#include "support/paged_fixture.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

struct SparseCase {
  KvDtype dtype;
  int heads;
  int q_len;
  int cols;  // index row width (topk)
  int page_size;
  std::vector<std::int64_t> lengths;
  std::string backend = "cuda";  // or a cast baseline: cast_full, gather_cast
  int splits = 0;                // 0: the backend's plan
  bool fault_record = true;      // false: the kernels' instances without checks (a call given no record)
  ScaleMode scale_mode = ScaleMode::kPow2;  // of the cache's fp8 scales (kExact: amax / 448)
  std::int64_t pool_pages = 0;   // 0: the pages the lengths need; else the pool's (pages_past_2gib)
};

std::ostream& operator<<(std::ostream& os, const SparseCase& c) {
  return os << c.backend << "_" << kv_dtype_name(c.dtype) << "_H" << c.heads << "_q" << c.q_len << "_k" << c.cols << "_ps" << c.page_size
            << "_B" << c.lengths.size() << (c.splits ? "_splits" + std::to_string(c.splits) : std::string())
            << (c.fault_record ? "" : "_norecord")
            << (c.scale_mode == ScaleMode::kExact ? "_exactscales" : "")
            << (c.pool_pages > 0 ? "_pool" + std::to_string(c.pool_pages) : std::string());
}

// Index rows [B, q_len, cols]: each query token's visible slots shuffled, at most cols of them, one
// duplicated where room allows, the rest -1, all in random order.
HostTensor make_indices(const PagedFixture& f, int q_len, int cols, Rng& rng) {
  HostTensor t(DType::kI32, {f.batch(), q_len, cols});
  auto* out = t.data<std::int32_t>();
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    for (int i = 0; i < q_len; ++i) {
      const std::int64_t visible = std::max<std::int64_t>(0, f.seq_lens[static_cast<std::size_t>(b)] - q_len + i + 1);
      std::vector<std::int32_t> row = f.slots(b, visible);
      std::shuffle(row.begin(), row.end(), rng);
      if (static_cast<int>(row.size()) > cols) row.resize(static_cast<std::size_t>(cols));
      if (!row.empty() && static_cast<int>(row.size()) < cols) row.push_back(row.front());  // a duplicate
      row.resize(static_cast<std::size_t>(cols), -1);
      std::shuffle(row.begin(), row.end(), rng);
      std::copy(row.begin(), row.end(), out + (b * q_len + i) * cols);
    }
  }
  return t;
}

// One GPU call over device copies of the fixture's cache, q and indices, with sentinel outputs and
// a fault record: its outputs, its split count and what it left in the record.
struct SparseRun {
  HostTensor o, lse;
  int num_splits = 0;
  std::string fault;  // the record's message, "" when it holds none
};
SparseRun gpu_sparse(const std::string& backend_name, PagedFixture& f, const HostTensor& q, const HostTensor& indices,
                     int splits = 0, bool fault_record = true) {
  const auto& shape = q.shape();  // [B, q_len, H, 576]
  SparseRun r;
  r.o = sentinel_tensor(DType::kBF16, {shape[0], shape[1], shape[2], 512});
  r.lse = sentinel_tensor(DType::kF32, {shape[0], shape[1], shape[2]});
  // Between poisoned guards: a slot past the pool or below -1 that a kernel read anyway shows.
  GuardedBuffer d_cache(f.cache_bytes, kPoisonFp8);
  DeviceBuffer d_q(q.raw(), q.bytes()), d_idx(indices.raw(), indices.bytes());
  DeviceBuffer d_o(r.o.raw(), r.o.bytes()), d_lse(r.lse.raw(), r.lse.bytes());
  FaultRecord fault;
  SparseMlaDecodeParams p;
  p.q = q.view_of(d_q.get(), Device::cuda());
  p.cache = f.cache(d_cache.get<std::uint8_t>(), Device::cuda());
  p.indices = indices.view_of(d_idx.get(), Device::cuda());
  p.o = r.o.view_of(d_o.get(), Device::cuda());
  p.lse = r.lse.view_of(d_lse.get(), Device::cuda());
  p.softmax_scale = 0.0625f;
  p.fault = fault_record ? fault.get() : nullptr;
  const Backend& backend = *find_backend(backend_name);
  const DeviceInfo device = detect_device();
  p.num_splits = splits;
  const Plan plan = backend.plan(p, device);
  if (splits > 0) EXPECT_EQ(plan.num_splits, splits) << "the plan keeps an asked count";
  DeviceBuffer workspace(plan.workspace_bytes);
  p.num_splits = r.num_splits = plan.num_splits;
  p.workspace = workspace.get();
  p.workspace_bytes = workspace.bytes();
  run(backend, p, {}, device);
  if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error(cudaGetErrorString(cudaGetLastError()));
  d_o.download(r.o.raw(), r.o.bytes());
  d_lse.download(r.lse.raw(), r.lse.bytes());
  r.fault = fault.message();
  return r;
}

class GpuSparseMlaDecode : public ::testing::TestWithParam<SparseCase> {};

TEST_P(GpuSparseMlaDecode, MatchesReference) {
  LKV_REQUIRE_GPU();
  const SparseCase& c = GetParam();
  Rng rng = test_rng();
  PagedFixtureOptions opt;
  opt.page_size = c.page_size;
  opt.lengths = c.lengths;
  opt.kv_dtype = c.dtype;
  opt.with_indexer = false;
  opt.scale_mode = c.scale_mode;
  opt.num_pages = c.pool_pages;
  PagedFixture f = make_paged_fixture(opt, rng);
  HostTensor q = random_bf16(rng, {f.batch(), c.q_len, c.heads, 576});
  HostTensor indices = make_indices(f, c.q_len, c.cols, rng);
  if (c.pool_pages > 0) EXPECT_GE(highest_listed_offset(f, indices), kTwoGiB) << "no slot past 2 GiB of the pool listed";
  poison_unlisted_slots(f, indices);
  // A cast baseline with scales that are no powers of two: against the reference over its bf16 cast
  // (test_mla_decode.cpp).
  std::optional<PagedFixture> cast = cast_seen_by(c.backend, c.scale_mode, f);
  const AttentionOutputs ref = reference_sparse_decode(cast ? *cast : f, q, indices, 0.0625f);
  const SparseRun r = gpu_sparse(c.backend, f, q, indices, c.splits, c.fault_record);
  EXPECT_TRUE(compare("o", r.o, ref.o, Tolerance::bf16_output())) << r.num_splits << " splits";
  EXPECT_TRUE(compare("lse", r.lse, ref.lse, Tolerance::lse()));
  if (c.backend == "cuda" && c.fault_record)
    EXPECT_EQ(r.fault, "") << "a fault noted for good input (-1 entries, a duplicate)";
}

// The fault tests' cache: two requests (300 and 1000 tokens) of `dtype`.
PagedFixture fault_fixture(KvDtype dtype, Rng& rng) {
  PagedFixtureOptions opt;
  opt.lengths = {300, 1000};
  opt.kv_dtype = dtype;
  opt.with_indexer = false;
  return make_paged_fixture(opt, rng);
}

// An index outside the pool (past it, or below -1), one at a time, in the last query token's row,
// on the narrow, the many-heads and the bf16 kernels: the kernels skip it and note it, the record
// throws the reference's own Error for the same indices, and the outputs are the reference's with
// that index ignored.
TEST(GpuSparseMlaDecodeFaults, RecordTheReferencesError) {
  LKV_REQUIRE_GPU();
  for (const auto& [dtype, heads] : {std::pair{KvDtype::kFp8E4M3, 8}, std::pair{KvDtype::kFp8E4M3, 64},
                                     std::pair{KvDtype::kBf16, 8}}) {
    Rng rng = test_rng();
    PagedFixture f = fault_fixture(dtype, rng);
    HostTensor q = random_bf16(rng, {f.batch(), 2, heads, 576});
    const std::int64_t num_slots = f.num_pages() * f.page_size, element = (1 * 2 + 1) * 256 + 200;
    for (const std::int32_t slot : {static_cast<std::int32_t>(num_slots), static_cast<std::int32_t>(num_slots + 9), -2}) {
      SCOPED_TRACE(std::string(kv_dtype_name(dtype)) + ", H " + std::to_string(heads) + ", slot " + std::to_string(slot));
      HostTensor indices = make_indices(f, 2, 256, rng);
      indices.data<std::int32_t>()[element] = slot;
      const std::string expected = error_of([&] { reference_sparse_decode(f, q, indices, 0.0625f); });
      ASSERT_NE(expected, "") << "the reference takes the input";
      const SparseRun r = gpu_sparse("cuda", f, q, indices);
      EXPECT_EQ(r.fault, expected);
      // Skipped: every row attends as the reference's over the same indices with that one ignored
      // (a kernel that noted it and read it anyway would meet the poisoned guards past the cache, or
      // before it: gpu_sparse).
      indices.data<std::int32_t>()[element] = -1;
      const AttentionOutputs ref = reference_sparse_decode(f, q, indices, 0.0625f);
      EXPECT_TRUE(compare("o", r.o, ref.o, Tolerance::bf16_output()));
      EXPECT_TRUE(compare("lse", r.lse, ref.lse, Tolerance::lse()));
    }
  }
}

// A query value that is not finite (NaN in the last query token's last head, inf in a rope dim of
// the first), one at a time, on the narrow, the many-heads and the bf16 kernels: the record throws
// the reference's own Error for the same q.
TEST(GpuSparseMlaDecodeFaults, NonFiniteQueriesAreTheReferencesError) {
  LKV_REQUIRE_GPU();
  for (const auto& [dtype, heads] : {std::pair{KvDtype::kFp8E4M3, 8}, std::pair{KvDtype::kFp8E4M3, 64},
                                     std::pair{KvDtype::kBf16, 8}}) {
    for (const auto& [element, value] : {std::pair{std::int64_t{(3 * heads + heads - 1) * 576 + 17}, std::nan("")},
                                         std::pair{std::int64_t{2 * 576 + 575}, std::numeric_limits<double>::infinity()}}) {
      SCOPED_TRACE(std::string(kv_dtype_name(dtype)) + ", H " + std::to_string(heads) + ", element " + std::to_string(element));
      Rng rng = test_rng();
      PagedFixture f = fault_fixture(dtype, rng);
      HostTensor q = random_bf16(rng, {f.batch(), 2, heads, 576});
      q.set(element, value);
      const HostTensor indices = make_indices(f, 2, 256, rng);
      const std::string expected = error_of([&] { reference_sparse_decode(f, q, indices, 0.0625f); });
      ASSERT_NE(expected, "") << "the reference takes the input";
      EXPECT_EQ(gpu_sparse("cuda", f, q, indices).fault, expected);
    }
  }
}

std::vector<SparseCase> sparse_cases() {
  const KvDtype fp8 = KvDtype::kFp8E4M3, bf16 = KvDtype::kBf16;
  return {
      {fp8, 8, 1, 64, 64, {0, 5, 300, 1000}},
      {fp8, 1, 1, 2048, 64, {3000, 1}},
      {fp8, 16, 2, 200, 17, {2, 150, 700}},
      {fp8, 8, 4, 96, 1, {4, 90, 333}},
      {fp8, 32, 2, 100, 64, {2, 257}},
      {fp8, 128, 1, 256, 64, {500, 20}},
      {fp8, 8, 1, 2048, 64, {5000, 2100}},
      // Forced split counts (merged in the kernel); the 40-token rows are mostly -1.
      {fp8, 8, 1, 2048, 64, {5000, 2100, 40}, "cuda", 4},
      {fp8, 8, 2, 2048, 17, {3000, 900}, "cuda", 3},
      {bf16, 8, 1, 128, 64, {0, 77, 400}},
      {bf16, 64, 2, 64, 3, {2, 100}},
      // The baselines: the same attention after casting the pool, or the selected slots, to bf16.
      {fp8, 8, 1, 64, 64, {0, 5, 300, 1000}, "gather_cast"},
      {fp8, 8, 1, 2048, 64, {5000, 2100}, "gather_cast"},
      {fp8, 16, 2, 200, 17, {2, 150, 700}, "cast_full"},
      {fp8, 128, 1, 256, 64, {500, 20}, "cast_full"},
      // No requests: nothing to read or write, and no workspace needed but the pool's for cast_full.
      {fp8, 8, 1, 64, 64, {}},
      {fp8, 8, 1, 64, 64, {}, "gather_cast"},
      {fp8, 8, 1, 64, 64, {}, "cast_full"},
      // Rows that do not fill the wgmma kernel's 64-row blocks (a sparse row block is one query
      // token's heads): 40 and 96 heads.
      {fp8, 40, 1, 128, 64, {3, 300}},
      {fp8, 96, 2, 256, 17, {2, 600}},
      // Calls given no fault record: the kernels' instances without checks.
      {fp8, 8, 1, 2048, 64, {5000, 2100, 40}, "cuda", 0, false},
      {fp8, 16, 2, 200, 17, {2, 150, 700}, "cuda", 0, false},
      {fp8, 128, 1, 256, 64, {500, 20}, "cuda", 0, false},
      {fp8, 8, 1, 2048, 64, {5000, 2100, 40}, "cuda", 4, false},
      {bf16, 8, 1, 128, 64, {0, 77, 400}, "cuda", 0, false},
      // Scales that are no powers of two (as in test_mla_decode.cpp): the narrow kernel, its
      // in-kernel merge, the wgmma kernel and a baseline.
      {fp8, 8, 1, 2048, 64, {5000, 2100, 40}, "cuda", 0, true, ScaleMode::kExact},
      {fp8, 8, 1, 2048, 64, {5000, 2100, 40}, "cuda", 4, true, ScaleMode::kExact},
      {fp8, 128, 1, 256, 64, {500, 20}, "cuda", 0, true, ScaleMode::kExact},
      {fp8, 8, 1, 64, 64, {0, 5, 300, 1000}, "gather_cast", 0, true, ScaleMode::kExact},
      // Odd head counts and index rows of odd widths: 7 heads, 5 heads of 3 new tokens on rows of
      // 33 slots, 33 heads (the wgmma kernel) on rows of 2047, and one slot a row.
      {fp8, 7, 1, 100, 64, {0, 5, 300, 1000}},
      {fp8, 5, 3, 33, 17, {3, 16, 18, 500}},
      {fp8, 33, 1, 2047, 64, {2500, 63, 65}},
      {fp8, 8, 2, 1, 64, {2, 300}},
      // Pages larger than a split (test_mla_decode.cpp): 4096, 1000 and 1024 tokens.
      {fp8, 8, 1, 2048, 4096, {9000, 4097}},
      {fp8, 128, 1, 256, 1000, {3000, 20}},
      {bf16, 8, 1, 128, 1024, {77, 2000}},
      // Pools of 1.5 x 2^31 bytes (test_mla_decode.cpp): index rows whose slots lie past 2 GiB on
      // the narrow kernel (its gathered entries), the wgmma kernel, a bf16 cache and gather_cast.
      {fp8, 8, 1, 2048, 64, {9000, 5000}, "cuda", 0, true, ScaleMode::kPow2, pages_past_2gib(64, fp8)},
      {fp8, 128, 1, 2048, 17, {6000, 3000}, "cuda", 0, true, ScaleMode::kPow2, pages_past_2gib(17, fp8)},
      {bf16, 8, 2, 512, 64, {9000, 5000}, "cuda", 0, true, ScaleMode::kPow2, pages_past_2gib(64, bf16)},
      {fp8, 8, 1, 2048, 64, {9000, 5000}, "gather_cast", 0, true, ScaleMode::kPow2, pages_past_2gib(64, fp8)},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuSparseMlaDecode, ::testing::ValuesIn(sparse_cases()),
                         [](const ::testing::TestParamInfo<SparseCase>& info) {
                           std::ostringstream os;
                           os << info.param;
                           return os.str();
                         });

}  // namespace
}  // namespace latentkv::testing
