// GPU dense MLA decode (the fp8-native kernels and the two cast baselines) against the float64 CPU
// reference, per SPEC section 5: shuffled pages, NaN in every slot a kernel must not read,
// sentinel-filled outputs, lengths 0, 1, page_size +- 1 and odd ones.
#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "cpu/reference.hpp"
#include "gpu/device.hpp"
#include "latentkv/backend.hpp"
#include "support/compare.hpp"
#include "support/paged_fixture.hpp"

namespace latentkv::testing {
namespace {

struct DecodeCase {
  std::string backend;
  KvDtype dtype;
  int heads;
  int q_len;
  int page_size;
  std::vector<std::int64_t> lengths;
  int splits = 0;  // 0: the backend's plan
};

std::ostream& operator<<(std::ostream& os, const DecodeCase& c) {
  os << c.backend << "_" << kv_dtype_name(c.dtype) << "_H" << c.heads << "_q" << c.q_len << "_ps" << c.page_size
     << "_B" << c.lengths.size();
  if (c.splits) os << "_splits" << c.splits;
  return os;
}

struct DecodeRun {
  HostTensor o, lse;            // what the GPU wrote
  HostTensor ref_o, ref_lse;    // float64 reference
};

// Builds the case, runs the reference and the backend, downloads the outputs.
DecodeRun run_case(const DecodeCase& c, Rng& rng) {
  PagedFixtureOptions opt;
  opt.page_size = c.page_size;
  opt.lengths = c.lengths;
  opt.kv_dtype = c.dtype;
  opt.with_indexer = false;
  PagedFixture f = make_paged_fixture(opt, rng);
  const std::int64_t batch = f.batch();
  HostTensor q = random_bf16(rng, {batch, c.q_len, c.heads, 576});
  const float scale = 0.0625f;

  DecodeRun r;
  r.ref_o = HostTensor(DType::kF64, {batch, c.q_len, c.heads, 512});
  r.ref_lse = HostTensor(DType::kF64, {batch, c.q_len, c.heads});
  MlaDecodeParams ref;
  ref.q = q.view();
  ref.cache = f.cache();
  ref.block_table = f.block_table_view();
  ref.seq_lens = f.seq_lens_view();
  ref.o = r.ref_o.view();
  ref.lse = r.ref_lse.view();
  ref.softmax_scale = scale;
  cpu::mla_decode(ref);

  DeviceBuffer d_cache(f.cache_bytes), d_table(f.block_table), d_lens(f.seq_lens), d_q(q.raw(), q.bytes());
  r.o = sentinel_tensor(DType::kBF16, {batch, c.q_len, c.heads, 512});
  r.lse = sentinel_tensor(DType::kF32, {batch, c.q_len, c.heads});
  DeviceBuffer d_o(r.o.raw(), r.o.bytes()), d_lse(r.lse.raw(), r.lse.bytes());

  MlaDecodeParams p;
  p.q = q.view_of(d_q.get(), Device::cuda());
  p.cache = f.cache(d_cache.get<std::uint8_t>(), Device::cuda());
  p.block_table = f.block_table_view(d_table.get<std::int32_t>(), Device::cuda());
  p.seq_lens = f.seq_lens_view(d_lens.get<std::int32_t>(), Device::cuda());
  p.o = r.o.view_of(d_o.get(), Device::cuda());
  p.lse = r.lse.view_of(d_lse.get(), Device::cuda());
  p.softmax_scale = scale;

  const Backend& backend = *find_backend(c.backend);
  const DeviceInfo device = detect_device();
  Plan plan = backend.plan(p, device);
  p.num_splits = plan.num_splits;
  if (c.splits > 0) {  // a forced split count: room for its partial results too
    p.num_splits = c.splits;
    plan.workspace_bytes += sizeof(float) * static_cast<std::size_t>(c.splits) * batch * c.q_len * c.heads * 513;
  }
  DeviceBuffer workspace(plan.workspace_bytes);
  p.workspace = workspace.get();
  p.workspace_bytes = workspace.bytes();
  run(backend, p, {}, device);
  if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error(cudaGetErrorString(cudaGetLastError()));
  d_o.download(r.o.raw(), r.o.bytes());
  d_lse.download(r.lse.raw(), r.lse.bytes());
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
  for (int s : {1, 3, 7, 40}) v.push_back({"cuda", fp8, 8, 1, 64, {0, 1, 500, 2049}, s});
  v.push_back({"cuda", fp8, 8, 1, 64, {6000}});
  v.push_back({"cuda", fp8, 128, 2, 64, {1300}});
  v.push_back({"cuda", bf16, 8, 1, 64, mixed});
  v.push_back({"cuda", bf16, 16, 4, 17, {4, 100, 257}});
  v.push_back({"cuda", bf16, 128, 1, 64, {0, 150}});
  for (const char* baseline : {"cast_full", "gather_cast"}) {
    v.push_back({baseline, fp8, 8, 1, 64, mixed});
    v.push_back({baseline, fp8, 16, 2, 5, {2, 9, 301}});
  }
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
  const std::int64_t batch = f.batch();
  HostTensor q = random_bf16(rng, {batch, 2, 8, 576});
  DeviceBuffer d_cache(f.cache_bytes), d_table(f.block_table), d_lens(f.seq_lens), d_q(q.raw(), q.bytes());
  HostTensor o = sentinel_tensor(DType::kBF16, {batch, 2, 8, 512});
  HostTensor lse = sentinel_tensor(DType::kF32, {batch, 2, 8});
  DeviceBuffer d_o(o.raw(), o.bytes()), d_lse(lse.raw(), lse.bytes());
  MlaDecodeParams p;
  p.q = q.view_of(d_q.get(), Device::cuda());
  p.cache = f.cache(d_cache.get<std::uint8_t>(), Device::cuda());
  p.block_table = f.block_table_view(d_table.get<std::int32_t>(), Device::cuda());
  p.seq_lens = f.seq_lens_view(d_lens.get<std::int32_t>(), Device::cuda());
  p.o = o.view_of(d_o.get(), Device::cuda());
  p.lse = lse.view_of(d_lse.get(), Device::cuda());
  p.softmax_scale = 0.0625f;
  const Backend& backend = *find_backend("cuda");
  const Plan plan = backend.plan(p, detect_device());
  DeviceBuffer ws(plan.workspace_bytes);
  p.num_splits = plan.num_splits;
  p.workspace = ws.get();
  p.workspace_bytes = ws.bytes();
  run(backend, p);
  LKV_CUDA_OK(cudaDeviceSynchronize());
  d_o.download(o.raw(), o.bytes());
  for (std::int64_t i = 0; i < o.numel(); ++i) ASSERT_EQ(o.get(i), 0.75) << "element " << i;
}

// One decode step captured once in a CUDA graph and replayed as the lengths grow: the kernels read
// the lengths from device memory, never from the host.
TEST(GpuMlaDecodeGraph, ReplaysFollowDeviceLengths) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixtureOptions opt;
  opt.lengths = {700, 1500};  // the cache holds the final lengths; the step starts shorter
  opt.with_indexer = false;
  PagedFixture f = make_paged_fixture(opt, rng);
  const std::int64_t batch = f.batch();
  const int heads = 16;
  HostTensor q = random_bf16(rng, {batch, 1, heads, 576});
  std::vector<std::int32_t> lens = {300, 1};
  DeviceBuffer d_cache(f.cache_bytes), d_table(f.block_table), d_lens(lens), d_q(q.raw(), q.bytes());
  HostTensor o = sentinel_tensor(DType::kBF16, {batch, 1, heads, 512});
  HostTensor lse = sentinel_tensor(DType::kF32, {batch, 1, heads});
  DeviceBuffer d_o(o.raw(), o.bytes()), d_lse(lse.raw(), lse.bytes());
  MlaDecodeParams p;
  p.q = q.view_of(d_q.get(), Device::cuda());
  p.cache = f.cache(d_cache.get<std::uint8_t>(), Device::cuda());
  p.block_table = f.block_table_view(d_table.get<std::int32_t>(), Device::cuda());
  p.seq_lens = f.seq_lens_view(d_lens.get<std::int32_t>(), Device::cuda());
  p.o = o.view_of(d_o.get(), Device::cuda());
  p.lse = lse.view_of(d_lse.get(), Device::cuda());
  p.softmax_scale = 0.0625f;
  const Backend& backend = *find_backend("cuda");
  const DeviceInfo device = detect_device();
  const Plan plan = backend.plan(p, device);
  DeviceBuffer ws(plan.workspace_bytes);
  p.num_splits = plan.num_splits;
  p.workspace = ws.get();
  p.workspace_bytes = ws.bytes();

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

  for (const std::vector<std::int32_t>& step : {std::vector<std::int32_t>{300, 1}, {301, 2}, {699, 1499}, {700, 1500}}) {
    d_lens.upload(step.data(), step.size() * sizeof(std::int32_t));
    LKV_CUDA_OK(cudaGraphLaunch(exec, stream));
    LKV_CUDA_OK(cudaStreamSynchronize(stream));
    d_o.download(o.raw(), o.bytes());
    d_lse.download(lse.raw(), lse.bytes());

    std::vector<std::int32_t> host_lens = step;
    HostTensor ref_o(DType::kF64, {batch, 1, heads, 512}), ref_lse(DType::kF64, {batch, 1, heads});
    MlaDecodeParams ref;
    ref.q = q.view();
    ref.cache = f.cache();
    ref.block_table = f.block_table_view();
    ref.seq_lens = TensorView::contiguous(host_lens.data(), DType::kI32, {batch});
    ref.o = ref_o.view();
    ref.lse = ref_lse.view();
    ref.softmax_scale = 0.0625f;
    cpu::mla_decode(ref);
    EXPECT_TRUE(compare("o", o, ref_o, Tolerance::bf16_output())) << "lengths " << step[0] << ", " << step[1];
    EXPECT_TRUE(compare("lse", lse, ref_lse, Tolerance::lse()));
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace latentkv::testing
