// GPU sparse MLA decode against the float64 CPU reference: index rows in any order, padded with -1,
// with a duplicated slot, empty rows, NaN in every slot that is not selected.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/device.hpp"
#include "latentkv/backend.hpp"
#include "support/compare.hpp"
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
};

std::ostream& operator<<(std::ostream& os, const SparseCase& c) {
  return os << c.backend << "_" << kv_dtype_name(c.dtype) << "_H" << c.heads << "_q" << c.q_len << "_k" << c.cols << "_ps" << c.page_size
            << "_B" << c.lengths.size() << (c.splits ? "_splits" + std::to_string(c.splits) : std::string());
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
  PagedFixture f = make_paged_fixture(opt, rng);
  const std::int64_t batch = f.batch();
  HostTensor q = random_bf16(rng, {batch, c.q_len, c.heads, 576});
  HostTensor indices = make_indices(f, c.q_len, c.cols, rng);
  const float scale = 0.0625f;

  const AttentionOutputs ref = reference_sparse_decode(f, q, indices, scale);

  HostTensor o = sentinel_tensor(DType::kBF16, {batch, c.q_len, c.heads, 512});
  HostTensor lse = sentinel_tensor(DType::kF32, {batch, c.q_len, c.heads});
  DeviceBuffer d_cache(f.cache_bytes), d_q(q.raw(), q.bytes()), d_idx(indices.raw(), indices.bytes());
  DeviceBuffer d_o(o.raw(), o.bytes()), d_lse(lse.raw(), lse.bytes());
  SparseMlaDecodeParams p;
  p.q = q.view_of(d_q.get(), Device::cuda());
  p.cache = f.cache(d_cache.get<std::uint8_t>(), Device::cuda());
  p.indices = indices.view_of(d_idx.get(), Device::cuda());
  p.o = o.view_of(d_o.get(), Device::cuda());
  p.lse = lse.view_of(d_lse.get(), Device::cuda());
  p.softmax_scale = scale;
  const Backend& backend = *find_backend(c.backend);
  const DeviceInfo device = detect_device();
  p.num_splits = c.splits;
  const Plan plan = backend.plan(p, device);
  if (c.splits > 0) EXPECT_EQ(plan.num_splits, c.splits) << "the plan keeps an asked count";
  DeviceBuffer workspace(plan.workspace_bytes);
  p.num_splits = plan.num_splits;
  p.workspace = workspace.get();
  p.workspace_bytes = workspace.bytes();
  run(backend, p, {}, device);
  LKV_CUDA_OK(cudaDeviceSynchronize());
  d_o.download(o.raw(), o.bytes());
  d_lse.download(lse.raw(), lse.bytes());
  EXPECT_TRUE(compare("o", o, ref.o, Tolerance::bf16_output())) << plan.num_splits << " splits";
  EXPECT_TRUE(compare("lse", lse, ref.lse, Tolerance::lse()));
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
