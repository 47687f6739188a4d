// GPU dsa_decode (indexer logits -> top-k -> sparse MLA decode, every step on the `cuda` backend)
// over paged FP8 main and indexer caches: shuffled pages, NaN in every slot that is not cached,
// sentinels in o, lse and the workspace's logits and slots, garbage in the steps' scratch.
//
// The GPU's float32 logits may differ from the float64 reference in their last bits, and so pick
// the other of two nearly equal logits; one call is therefore checked in three stages:
//  (a) the logits left in the workspace match the reference indexer logits (the tolerance of
//      test_indexer_logits.cpp);
//  (b) the selected slots are a top-k of the GPU's own logits (topk_check.hpp, against the
//      reference top-k of the downloaded logits);
//  (c) o and lse match the reference sparse decode over the GPU's selected slots.
// Also: with topk >= every length, o and lse equal dense decode; and one call captured in a CUDA
// graph and replayed as the lengths on the device grow; long requests (the indexer claims turns)
// on a workspace taken cleared, call after call; and calls from four host threads at once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <latch>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "gpu/device.hpp"
#include "support/expect_error.hpp"
#include "gpu/topk_check.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/dsa.hpp"
#include "support/compare.hpp"
#include "support/host_tensor.hpp"
#include "support/paged_fixture.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

constexpr float kScale = 0.0625f;  // glm5's softmax scale
// test_indexer_logits.cpp's bound: float32 sums of exact fp8 products in another order.
const Tolerance kLogitsTolerance{1e-4, 1e-5, 1e-9};
constexpr int kWorkspaceGarbage = 0xA5;  // the steps' scratch before every call

struct DsaInputs {
  HostTensor q;        // [B, q_len, H, 576] bf16
  HostTensor q_idx;    // [B, q_len, Hi, 128] fp8
  HostTensor weights;  // [B, q_len, Hi] f32
};

DsaInputs random_inputs(Rng& rng, std::int64_t batch, int q_len, int heads, int indexer_heads) {
  return {random_bf16(rng, {batch, q_len, heads, kQkDim}), random_fp8(rng, {batch, q_len, indexer_heads, kIndexerDim}),
          random_f32(rng, {batch, q_len, indexer_heads}, -1.0, 1.0)};
}

// What one call left on the device.
struct DsaResult {
  HostTensor logits;  // [B, q_len, max_len] f32, from the workspace
  HostTensor slots;   // [B, q_len, topk] i32, from the workspace
  HostTensor o;       // [B, q_len, H, 512] bf16
  HostTensor lse;     // [B, q_len, H] f32
};

// One dsa_decode call's device side: the fixture's caches and tables, the inputs, o and lse, and
// the workspace of plan_dsa_decode. `lengths` replaces the fixture's lengths on the device;
// `sparse` names the sparse step's backend (the others are `cuda`).
class DeviceDsa {
 public:
  DeviceDsa(PagedFixture& f, const DsaInputs& in, int topk, int max_len, const std::vector<std::int32_t>& lengths = {},
            std::string_view sparse = "cuda")
      : backends_(same_backend(*find_backend("cuda"))),
        device_(detect_device()),
        cache_(f.cache_bytes),
        indexer_(f.indexer_bytes),
        table_(f.block_table),
        lens_(lengths.empty() ? f.seq_lens : lengths),
        q_(in.q.raw(), in.q.bytes()),
        q_idx_(in.q_idx.raw(), in.q_idx.bytes()),
        weights_(in.weights.raw(), in.weights.bytes()) {
    backends_.sparse_decode = find_backend(sparse);
    const std::int64_t batch = in.q.shape()[0], q_len = in.q.shape()[1], heads = in.q.shape()[2];
    o_host_ = sentinel_tensor(DType::kBF16, {batch, q_len, heads, kLatentDim});
    lse_host_ = sentinel_tensor(DType::kF32, {batch, q_len, heads});
    o_ = DeviceBuffer(o_host_.bytes());
    lse_ = DeviceBuffer(lse_host_.bytes());
    params_.q = in.q.view_of(q_.get(), Device::cuda());
    params_.q_idx = in.q_idx.view_of(q_idx_.get(), Device::cuda());
    params_.weights = in.weights.view_of(weights_.get(), Device::cuda());
    params_.cache = f.cache(cache_.get<std::uint8_t>(), Device::cuda());
    params_.indexer = f.indexer(indexer_.get<std::uint8_t>(), Device::cuda());
    params_.block_table = f.block_table_view(table_.get<std::int32_t>(), Device::cuda());
    params_.seq_lens = f.seq_lens_view(lens_.get<std::int32_t>(), Device::cuda());
    params_.o = o_host_.view_of(o_.get(), Device::cuda());
    params_.lse = lse_host_.view_of(lse_.get(), Device::cuda());
    params_.softmax_scale = kScale;
    params_.topk = topk;
    params_.max_len = max_len;
    params_.fault = fault_.get();
    plan_ = plan_dsa_decode(backends_, params_, device_);
    workspace_ = DeviceBuffer(plan_.workspace_bytes);
    params_.workspace = workspace_.get();
    params_.workspace_bytes = workspace_.bytes();
    steps_ = dsa_steps(params_, plan_);
  }

  const DsaSteps& steps() const { return steps_; }
  const DsaPlan& plan() const { return plan_; }
  // The message of what the calls so far noted in their fault record, "" for nothing.
  std::string fault() const { return fault_.message(); }

  void set_lengths(const std::vector<std::int32_t>& lengths) {
    lens_.upload(lengths.data(), lengths.size() * sizeof(std::int32_t));
  }

  // The workspace zeroed, as when it was allocated, and taken cleared from now on
  // (DsaDecodeParams::workspace_cleared).
  void clear_workspace() {
    check_cuda(cudaMemset(workspace_.get(), 0, workspace_.bytes()));
    params_.workspace_cleared = true;
    steps_ = dsa_steps(params_, plan_);
  }
  // Calls from now on in `other`'s workspace, taken cleared as `other` takes it (a workspace shared
  // by calls of two batch sizes, each under its own plan, as graphs captured per batch size share
  // one); it must hold this call's plan.
  void share_workspace(const DeviceDsa& other) {
    ASSERT_LE(plan_.workspace_bytes, other.workspace_.bytes());
    params_.workspace = other.workspace_.get();
    params_.workspace_bytes = other.workspace_.bytes();
    params_.workspace_cleared = other.params_.workspace_cleared;
    steps_ = dsa_steps(params_, plan_);
  }
  // o moved to `data` (for a call that must be refused: the steps' views follow).
  void move_o(void* data) {
    params_.o.data = data;
    steps_ = dsa_steps(params_, plan_);
  }
  std::size_t o_bytes() const { return o_host_.bytes(); }
  // Calls from now on over the planned workspace's size at `data` (for a call that must be refused:
  // the steps' views stay where they were).
  void move_workspace(void* data) { params_.workspace = data; }
  std::vector<std::uint8_t> workspace_contents() const { return workspace_bytes(workspace_.get(), workspace_.bytes()); }

  std::vector<std::uint8_t> workspace_bytes(const void* from, std::size_t bytes) const {
    std::vector<std::uint8_t> host(bytes);
    check_cuda(cudaMemcpy(host.data(), from, bytes, cudaMemcpyDeviceToHost));
    return host;
  }

  // Sentinels in o, lse and the workspace's logits and slots; garbage in the rest of the workspace,
  // unless it is taken cleared.
  void fill_sentinels() {
    o_.upload(o_host_.raw(), o_host_.bytes());
    lse_.upload(lse_host_.raw(), lse_host_.bytes());
    if (!params_.workspace_cleared) check_cuda(cudaMemset(workspace_.get(), kWorkspaceGarbage, workspace_.bytes()));
    const HostTensor logits = sentinel_tensor(DType::kF32, shape_of(steps_.indexer.logits));
    const HostTensor slots = sentinel_tensor(DType::kI32, shape_of(steps_.topk.slots));
    check_cuda(cudaMemcpy(steps_.indexer.logits.data, logits.raw(), logits.bytes(), cudaMemcpyHostToDevice));
    check_cuda(cudaMemcpy(steps_.topk.slots.data, slots.raw(), slots.bytes(), cudaMemcpyHostToDevice));
  }

  void run(const ExecContext& context = {}) { dsa_decode(backends_, params_, plan_, context, device_); }

  DsaResult download() const {
    DsaResult r{HostTensor(DType::kF32, shape_of(steps_.indexer.logits)),
                HostTensor(DType::kI32, shape_of(steps_.topk.slots)), o_host_, lse_host_};
    check_cuda(cudaMemcpy(r.logits.raw(), steps_.indexer.logits.data, r.logits.bytes(), cudaMemcpyDeviceToHost));
    check_cuda(cudaMemcpy(r.slots.raw(), steps_.topk.slots.data, r.slots.bytes(), cudaMemcpyDeviceToHost));
    o_.download(r.o.raw(), r.o.bytes());
    lse_.download(r.lse.raw(), r.lse.bytes());
    return r;
  }

 private:
  static std::vector<std::int64_t> shape_of(const TensorView& v) {
    return std::vector<std::int64_t>(v.shape.begin(), v.shape.begin() + v.rank);
  }

  DsaBackends backends_;
  DeviceInfo device_;
  FaultRecord fault_;
  DeviceBuffer cache_, indexer_, table_, lens_, q_, q_idx_, weights_, o_, lse_, workspace_;
  HostTensor o_host_, lse_host_;  // sentinel-filled, shaped as the outputs
  DsaDecodeParams params_;
  DsaPlan plan_;
  DsaSteps steps_;  // views into workspace_
};

// Checks one call in the three stages of the file comment, for the fixture's current lengths.
void check_stages(PagedFixture& f, const DsaInputs& in, const DsaResult& got, int topk) {
  const HostTensor want_logits = reference_indexer_logits(f, in.q_idx, in.weights, got.logits.shape()[2]);
  const Comparison logits = compare("logits", got.logits, want_logits, kLogitsTolerance);
  EXPECT_TRUE(logits) << "stage (a)";
  ASSERT_EQ(logits.special_failures, 0) << "NaN or inf logits unlike the reference's: top-k not checked";

  const HostTensor want_slots = reference_topk(f, got.logits, topk);
  ASSERT_TRUE(check_topk_rows(f, got.logits, got.slots, want_slots)) << "stage (b)";

  const AttentionOutputs want = reference_sparse_decode(f, in.q, got.slots, kScale);
  EXPECT_TRUE(compare("o", got.o, want.o, Tolerance::bf16_output())) << "stage (c)";
  EXPECT_TRUE(compare("lse", got.lse, want.lse, Tolerance::lse())) << "stage (c)";
}

PagedFixture make_fixture(int page_size, const std::vector<std::int64_t>& lengths, Rng& rng,
                          KvDtype kv_dtype = KvDtype::kFp8E4M3, ScaleMode scale_mode = ScaleMode::kPow2,
                          std::int64_t num_pages = 0) {
  PagedFixtureOptions opt;
  opt.page_size = page_size;
  opt.lengths = lengths;
  opt.kv_dtype = kv_dtype;
  opt.scale_mode = scale_mode;
  opt.num_pages = num_pages;
  return make_paged_fixture(opt, rng);
}

// ---- one call, three stages ---------------------------------------------------------------------

struct DsaCase {
  int heads;
  int q_len;
  int indexer_heads;
  int page_size;
  int topk;
  std::vector<std::int64_t> lengths;
  int spare_columns = -1;  // logits columns past the longest request; -1: max_len 0 (the table's capacity)
  KvDtype kv_dtype = KvDtype::kFp8E4M3;  // the main cache's (the indexer cache is always fp8)
  ScaleMode scale_mode = ScaleMode::kPow2;  // both caches' fp8 scales (kExact: amax / 448)
  std::int64_t pool_pages = 0;  // 0: the pages the lengths need; else the pool's (pages_past_2gib)
};

std::ostream& operator<<(std::ostream& os, const DsaCase& c) {
  os << "H" << c.heads << "_q" << c.q_len << "_Hi" << c.indexer_heads << "_ps" << c.page_size << "_k" << c.topk << "_B"
     << c.lengths.size();
  if (c.spare_columns >= 0) os << "_spare" << c.spare_columns;
  if (c.kv_dtype == KvDtype::kBf16) os << "_bf16";
  if (c.scale_mode == ScaleMode::kExact) os << "_exactscales";
  if (c.pool_pages > 0) os << "_pool" << c.pool_pages;
  return os;
}

class GpuDsaDecode : public ::testing::TestWithParam<DsaCase> {};

TEST_P(GpuDsaDecode, StagesMatchReference) {
  LKV_REQUIRE_GPU();
  const DsaCase& c = GetParam();
  Rng rng = test_rng();
  PagedFixture f = make_fixture(c.page_size, c.lengths, rng, c.kv_dtype, c.scale_mode, c.pool_pages);
  if (c.pool_pages > 0) EXPECT_GE(highest_held_offset(f), kTwoGiB) << "no token past 2 GiB of the pool";
  const DsaInputs in = random_inputs(rng, f.batch(), c.q_len, c.heads, c.indexer_heads);
  const int max_len = c.spare_columns < 0 ? 0 : static_cast<int>(f.max_len()) + c.spare_columns;

  DeviceDsa d(f, in, c.topk, max_len);
  const std::int64_t columns = max_len > 0 ? max_len : std::int64_t{f.max_pages} * f.page_size;
  ASSERT_EQ(d.steps().indexer.logits.size(2), columns) << "logits columns of max_len " << max_len;
  // One backend: the indexer clears the top-k's row state, which is part of the garbage-filled
  // workspace (fill_sentinels).
  EXPECT_TRUE(d.steps().topk.workspace_cleared);
  EXPECT_EQ(d.steps().indexer.clear, d.steps().topk.workspace);
  EXPECT_GT(d.steps().indexer.clear_bytes, 0u);
  d.fill_sentinels();
  d.run();
  check_cuda(cudaDeviceSynchronize());
  check_stages(f, in, d.download(), c.topk);
  EXPECT_EQ(d.fault(), "") << "a fault noted for good input";
  EXPECT_NE(d.steps().topk.fault, nullptr) << "the top-k is given the fault record (ANanLogitIsTheTopksError checks its use)";
}

// No requests: nothing to compute or refuse; every step returns before it launches anything.
TEST(GpuDsaDecodeEmpty, NoRequests) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixtureOptions options;
  options.page_size = 64;
  options.lengths = {100};
  options.with_indexer = true;
  PagedFixture f = make_paged_fixture(options, rng);
  DeviceBuffer cache(f.cache_bytes), indexer(f.indexer_bytes);
  const Device gpu = Device::cuda();
  DsaDecodeParams p;
  p.q = TensorView::contiguous(nullptr, DType::kBF16, {0, 1, 8, kQkDim}, gpu);
  p.q_idx = TensorView::contiguous(nullptr, DType::kFP8E4M3, {0, 1, 32, kIndexerDim}, gpu);
  p.weights = TensorView::contiguous(nullptr, DType::kF32, {0, 1, 32}, gpu);
  p.cache = f.cache(cache.get<std::uint8_t>(), gpu);
  p.indexer = f.indexer(indexer.get<std::uint8_t>(), gpu);
  p.block_table = TensorView::contiguous(nullptr, DType::kI32, {0, f.max_pages}, gpu);
  p.seq_lens = TensorView::contiguous(nullptr, DType::kI32, {0}, gpu);
  p.o = TensorView::contiguous(nullptr, DType::kBF16, {0, 1, 8, kLatentDim}, gpu);
  p.lse = TensorView::contiguous(nullptr, DType::kF32, {0, 1, 8}, gpu);
  p.softmax_scale = kScale;
  p.topk = 2048;
  const DsaBackends backends = same_backend(*find_backend("cuda"));
  const DeviceInfo device = detect_device();
  const DsaPlan plan = plan_dsa_decode(backends, p, device);
  DeviceBuffer workspace(std::max<std::size_t>(plan.workspace_bytes, 16));
  p.workspace = workspace.get();
  p.workspace_bytes = plan.workspace_bytes;
  EXPECT_EQ(error_of([&] { dsa_decode(backends, p, plan, {}, device); }), "");
  LKV_CUDA_OK(cudaDeviceSynchronize());
}

// Planned without a device, over views of device memory: the plan is the current GPU's, the one
// planned with detect_device() (shapes only: the views hold no data), and with the cache's
// descriptor left in host memory the cuda backend refuses the plan, saying which view chose the CPU.
TEST(GpuDsaDecodeDevice, APlanWithoutADeviceIsTheCurrentGpus) {
  LKV_REQUIRE_GPU();
  const Device gpu = Device::cuda(detect_device().index);
  DsaDecodeParams p;
  p.q = TensorView::contiguous(nullptr, DType::kBF16, {1, 1, 8, kQkDim}, gpu);
  p.q_idx = TensorView::contiguous(nullptr, DType::kFP8E4M3, {1, 1, 32, kIndexerDim}, gpu);
  p.weights = TensorView::contiguous(nullptr, DType::kF32, {1, 1, 32}, gpu);
  p.cache = LatentCache{nullptr, KvDtype::kFp8E4M3, 1024, 64, gpu};
  p.indexer = IndexerCache{nullptr, 1024, 64, gpu};
  p.block_table = TensorView::contiguous(nullptr, DType::kI32, {1, 512}, gpu);
  p.seq_lens = TensorView::contiguous(nullptr, DType::kI32, {1}, gpu);
  p.o = TensorView::contiguous(nullptr, DType::kBF16, {1, 1, 8, kLatentDim}, gpu);
  p.lse = TensorView::contiguous(nullptr, DType::kF32, {1, 1, 8}, gpu);
  p.softmax_scale = kScale;
  const DsaBackends backends = same_backend(*find_backend("cuda"));
  const DsaPlan named = plan_dsa_decode(backends, p, detect_device()), unnamed = plan_dsa_decode(backends, p);
  EXPECT_GT(named.sparse.num_splits, 1) << "one request's 2048 selected tokens are split over the GPU";
  EXPECT_EQ(unnamed.sparse.num_splits, named.sparse.num_splits);
  EXPECT_EQ(unnamed.workspace_bytes, named.workspace_bytes);
  EXPECT_EQ(unnamed.indexer.workspace_bytes, named.indexer.workspace_bytes);
  EXPECT_EQ(unnamed.topk.workspace_bytes, named.topk.workspace_bytes);
  EXPECT_EQ(unnamed.topk_cleared_by_indexer, named.topk_cleared_by_indexer);
  p.cache.device = Device::cpu();
  EXPECT_EQ(error_of([&] { plan_dsa_decode(backends, p); }),
            "indexer_logits: backend 'cuda' cannot run this call: needs a CUDA GPU (device is cpu); a call that names "
            "no device runs where its cache.device is (cpu)");
}

// More requests than an indexer call takes are refused by the plan, naming the caller's q_idx under
// dsa_decode as the call's check of its indexer step does (shapes only: the views hold no data; no
// device is asked, so this runs without a GPU).
TEST(GpuDsaDecodeDevice, RequestsPastWhatACallTakesAreRefusedByThePlan) {
  if (find_backend("cuda") == nullptr) GTEST_SKIP() << "this build has no CUDA backends";
  const DeviceInfo device{.kind = DeviceKind::kCuda, .sm = 90, .name = "sm_90 by description", .multiprocessors = 132};
  const Device gpu = Device::cuda();
  const std::int64_t b = kMaxGpuRequests + 1;
  DsaDecodeParams p;
  p.q = TensorView::contiguous(nullptr, DType::kBF16, {b, 1, 8, kQkDim}, gpu);
  p.q_idx = TensorView::contiguous(nullptr, DType::kFP8E4M3, {b, 1, 32, kIndexerDim}, gpu);
  p.weights = TensorView::contiguous(nullptr, DType::kF32, {b, 1, 32}, gpu);
  p.cache = LatentCache{nullptr, KvDtype::kFp8E4M3, 1024, 64, gpu};
  p.indexer = IndexerCache{nullptr, 1024, 64, gpu};
  p.block_table = TensorView::contiguous(nullptr, DType::kI32, {b, 4}, gpu);
  p.seq_lens = TensorView::contiguous(nullptr, DType::kI32, {b}, gpu);
  p.o = TensorView::contiguous(nullptr, DType::kBF16, {b, 1, 8, kLatentDim}, gpu);
  p.lse = TensorView::contiguous(nullptr, DType::kF32, {b, 1, 8}, gpu);
  p.softmax_scale = kScale;
  const DsaBackends backends = same_backend(*find_backend("cuda"));
  EXPECT_TRUE(throws_error([&] { plan_dsa_decode(backends, p, device); }, "dsa_decode", "q_idx",
                           "65536 requests (B)"));
}

// A page outside the pool in the block table that all three steps read: the indexer notes it first,
// and the record throws the reference indexer's own Error (the reference's dsa_decode runs it first).
TEST(GpuDsaDecodeFaults, ABadPageIsTheIndexersError) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixture f = make_fixture(64, {5000, 40}, rng);
  const DsaInputs in = random_inputs(rng, f.batch(), 1, 8, 32);
  f.block_table[60] = static_cast<std::int32_t>(f.num_pages() + 1);
  const std::string expected = error_of([&] { reference_indexer_logits(f, in.q_idx, in.weights, f.max_len()); });
  ASSERT_NE(expected, "");
  DeviceDsa d(f, in, 2048, static_cast<int>(f.max_len()));
  d.fill_sentinels();
  d.run();
  check_cuda(cudaDeviceSynchronize());
  EXPECT_EQ(d.fault(), expected);
}

// A NaN key scale in the indexer cache (which the append never writes: a cache filled by other
// code) at a position request 1's row sees: its logit there is NaN, which the reference's top-k
// refuses. The record must say the same, from the top-k's check (no other step looks at the logits).
TEST(GpuDsaDecodeFaults, ANanLogitIsTheTopksError) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixture f = make_fixture(64, {300, 3000}, rng);
  const DsaInputs in = random_inputs(rng, f.batch(), 1, 8, 32);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(f.indexer().scale_ptr(f.slot(1, 1234)), &nan, sizeof(nan));
  const HostTensor logits = reference_indexer_logits(f, in.q_idx, in.weights, f.max_len());
  const std::string expected = error_of([&] { reference_topk(f, logits, 2048); });
  ASSERT_NE(expected.find("nan"), std::string::npos) << expected;
  DeviceDsa d(f, in, 2048, static_cast<int>(f.max_len()));
  d.fill_sentinels();
  d.run();
  check_cuda(cudaDeviceSynchronize());
  EXPECT_EQ(d.fault(), expected);
}

// An o the sparse kernels cannot write (4 bytes past an 8-byte boundary; shapes, sizes and
// placement all valid): the sparse step's own checks refuse it, before the indexer and top-k steps
// (and a baseline's cast) are queued, so the workspace keeps its garbage and sentinels, lse its
// sentinels, and the record stays empty. The cuda kernels and both baselines as the sparse step.
TEST(GpuDsaDecodeChecks, AMisalignedOutputQueuesNoStep) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixture f = make_fixture(64, {300, 3000}, rng);
  const DsaInputs in = random_inputs(rng, f.batch(), 1, 8, 32);
  for (const char* sparse : {"cuda", "gather_cast", "cast_full"}) {
    SCOPED_TRACE(std::string("the sparse step on ") + sparse);
    DeviceDsa d(f, in, 2048, static_cast<int>(f.max_len()), {}, sparse);
    expect_misaligned_o_queues_nothing(d, "sparse_mla_decode");
  }
}

// A workspace 4 bytes past a 16-byte boundary (of the planned size; valid otherwise), which the
// top-k and sparse steps' scratch cannot take: the call refuses it under dsa_decode's own name
// (dsa_steps' check) before any step is queued (o and lse keep their sentinels, the record stays
// empty).
TEST(GpuDsaDecodeChecks, AMisalignedWorkspaceIsNamedAsTheCallers) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixture f = make_fixture(64, {300, 3000}, rng);
  const DsaInputs in = random_inputs(rng, f.batch(), 1, 8, 32);
  DeviceDsa d(f, in, 2048, static_cast<int>(f.max_len()));
  expect_misaligned_workspace_refused(d, "dsa_decode", 4, 16);
}

// 16 requests long enough that on sm_90 the indexer's spans (24 turns and more) claim turns from the
// counters in the workspace.
std::vector<std::int64_t> claiming_lengths() {
  std::vector<std::int64_t> lengths;
  for (int b = 0; b < 16; ++b) lengths.push_back(70000 + 2001 * b);
  return lengths;
}

// One call on a workspace taken cleared: it passes the three stages and leaves the indexer's
// counters zero, as the next call counts on.
void run_on_cleared_workspace(DeviceDsa& d, PagedFixture& f, const DsaInputs& in) {
  d.fill_sentinels();
  d.run();
  check_cuda(cudaDeviceSynchronize());
  check_stages(f, in, d.download(), kMaxTopk);
  const std::vector<std::uint8_t> counters =
      d.workspace_bytes(d.steps().indexer.workspace, d.steps().indexer.workspace_bytes);
  EXPECT_TRUE(std::all_of(counters.begin(), counters.end(), [](std::uint8_t x) { return x == 0; }))
      << "the indexer's counters were left nonzero";
}

// Zeroed once and taken cleared, the workspace serves call after call: the second counts on the
// first to leave the counters zero, and it must too.
TEST(GpuDsaDecodeClaims, ClearedWorkspaceServesCallAfterCall) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixture f = make_fixture(64, claiming_lengths(), rng);
  const DsaInputs in = random_inputs(rng, f.batch(), 1, 8, 8);
  DeviceDsa d(f, in, kMaxTopk, 0);
  d.clear_workspace();
  ASSERT_TRUE(d.steps().indexer.workspace_cleared);
  for (int call = 1; call <= 2; ++call) {
    SCOPED_TRACE("call " + std::to_string(call) + " on the cleared workspace");
    run_on_cleared_workspace(d, f, in);
  }
}

// The sparse step reads only the slots the top-k chose. Every main-cache slot a request holds whose
// reference logit lies clearly below each of its rows' k-th largest (by twice the logits' bound
// twice over, so that no near tie can bring it back) is poisoned with NaN: the call must pass its
// three stages with every output finite (a poisoned slot read would be NaN in the reference too).
TEST(GpuDsaDecodeStages, TokensNoRowSelectsAreNotRead) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixture f = make_fixture(64, {9000, 2900, 100}, rng);  // about 5,600 tokens no row may choose
  constexpr int kQLen = 2;
  const DsaInputs in = random_inputs(rng, f.batch(), kQLen, 8, 32);
  const std::int64_t columns = static_cast<std::int64_t>(f.max_pages) * f.page_size;
  const HostTensor logits = reference_indexer_logits(f, in.q_idx, in.weights, columns);
  HostTensor kept(DType::kI32, {f.batch(), kQLen, columns});  // each row's slots that may be chosen
  std::fill_n(kept.data<std::int32_t>(), kept.numel(), -1);
  std::int64_t held_not_kept = 0;
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    const std::int64_t length = f.seq_lens[static_cast<std::size_t>(b)];
    std::vector<bool> kept_by_a_row(static_cast<std::size_t>(length), false);
    for (int i = 0; i < kQLen; ++i) {
      const std::int64_t visible = length - kQLen + i + 1, row = b * kQLen + i;
      std::vector<float> values(static_cast<std::size_t>(visible));
      double largest = 0;
      for (std::int64_t t = 0; t < visible; ++t) {
        values[static_cast<std::size_t>(t)] = logits.data<float>()[row * columns + t];
        largest = std::max(largest, std::abs(static_cast<double>(values[static_cast<std::size_t>(t)])));
      }
      double floor = -std::numeric_limits<double>::infinity();  // rows seeing at most k tokens keep them all
      if (visible > kMaxTopk) {
        std::vector<float> sorted = values;
        std::nth_element(sorted.begin(), sorted.begin() + (kMaxTopk - 1), sorted.end(), std::greater<float>());
        floor = sorted[kMaxTopk - 1] - 4.0 * (1e-4 + 1e-5 * largest);
      }
      for (std::int64_t t = 0; t < visible; ++t) {
        if (values[static_cast<std::size_t>(t)] < floor) continue;
        kept.data<std::int32_t>()[row * columns + t] = static_cast<std::int32_t>(f.slot(b, t));
        kept_by_a_row[static_cast<std::size_t>(t)] = true;
      }
    }
    held_not_kept += std::count(kept_by_a_row.begin(), kept_by_a_row.end(), false);
  }
  ASSERT_GT(held_not_kept, 3000) << "tokens the requests hold and no row may choose";
  poison_unlisted_slots(f, kept);

  DeviceDsa d(f, in, kMaxTopk, 0);
  d.fill_sentinels();
  d.run();
  check_cuda(cudaDeviceSynchronize());
  const DsaResult got = d.download();
  check_stages(f, in, got, kMaxTopk);
  for (std::int64_t e = 0; e < got.o.numel(); ++e) ASSERT_TRUE(std::isfinite(got.o.get(e))) << "o element " << e;
  for (std::int64_t e = 0; e < got.lse.numel(); ++e) ASSERT_TRUE(std::isfinite(got.lse.get(e))) << "lse element " << e;
  EXPECT_EQ(d.fault(), "");
}

// Calls of two batch sizes (16 and 4 requests, each under its own plan) in one workspace zeroed once:
// the indexer's counters lie first and are planned for the most requests, so that neither call's
// logits land on them (dsa.cpp, Layout), and each call passes the three stages and leaves them zero.
TEST(GpuDsaDecodeClaims, BatchesOfTwoSizesShareOneClearedWorkspace) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixture big_f = make_fixture(64, claiming_lengths(), rng);
  PagedFixture small_f = make_fixture(64, {90000, 71000, 80500, 99000}, rng);
  const DsaInputs big_in = random_inputs(rng, big_f.batch(), 1, 8, 8);
  const DsaInputs small_in = random_inputs(rng, small_f.batch(), 1, 8, 8);
  DeviceDsa big(big_f, big_in, kMaxTopk, 0), small(small_f, small_in, kMaxTopk, 0);
  big.clear_workspace();
  small.share_workspace(big);
  ASSERT_TRUE(small.steps().indexer.workspace_cleared);
  ASSERT_EQ(small.steps().indexer.workspace, big.steps().indexer.workspace) << "the counters at one place";
  // Planned for the most requests whatever the call's batch: per call (16 and 4 requests) the two
  // would differ, though rounding up to the workspace's alignment could still hide it below.
  ASSERT_EQ(small.plan().indexer.workspace_bytes, big.plan().indexer.workspace_bytes);
  ASSERT_EQ(small.steps().indexer.logits.data, big.steps().indexer.logits.data) << "the logits after the counters";
  {
    SCOPED_TRACE("16 requests");
    run_on_cleared_workspace(big, big_f, big_in);
  }
  {
    SCOPED_TRACE("4 requests, after 16");
    run_on_cleared_workspace(small, small_f, small_in);
  }
  {
    SCOPED_TRACE("16 requests, after 4");
    run_on_cleared_workspace(big, big_f, big_in);
  }
}

// Calls from several host threads at once (docs/operations.md, "Calls from several threads"): each
// thread plans and runs its own call (its own buffers and workspace) on a stream of its own, the
// threads released together, so that their plans and the first launches of the process's kernels
// (the once_per_key queries and attributes) race. Each call must pass the three stages. (The
// kernels themselves overlap little: the other threads' synchronous copies wait on every blocking
// stream.)
TEST(GpuDsaDecodeThreads, CallsFromFourThreadsEachPassTheStages) {
  LKV_REQUIRE_GPU();
  constexpr int kThreads = 4;
  Rng rng = test_rng();
  PagedFixture f = make_fixture(64, {0, 1, 300, 2500, 4100}, rng);
  std::vector<DsaInputs> inputs;
  for (int t = 0; t < kThreads; ++t) inputs.push_back(random_inputs(rng, f.batch(), 1, 8, 32));
  std::vector<DsaResult> results(kThreads);
  std::vector<std::string> errors(kThreads);
  std::latch start(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      const auto i = static_cast<std::size_t>(t);
      cudaStream_t stream = nullptr;
      try {
        start.arrive_and_wait();
        DeviceDsa d(f, inputs[i], kMaxTopk, 0);
        d.fill_sentinels();  // on the legacy default stream, which a blocking stream waits for
        check_cuda(cudaStreamCreate(&stream));
        d.run(ExecContext{stream});
        check_cuda(cudaStreamSynchronize(stream));
        results[i] = d.download();
        if (const std::string fault = d.fault(); !fault.empty()) errors[i] = "fault noted: " + fault;
      } catch (const std::exception& e) {
        errors[i] = e.what();
      }
      if (stream != nullptr) cudaStreamDestroy(stream);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int t = 0; t < kThreads; ++t) {
    SCOPED_TRACE("thread " + std::to_string(t));
    const auto i = static_cast<std::size_t>(t);
    ASSERT_EQ(errors[i], "");
    check_stages(f, inputs[i], results[i], kMaxTopk);
  }
}

std::vector<DsaCase> dsa_cases() {
  return {
      {8, 1, 32, 64, 2048, {0, 1, 63, 65, 2047, 2049, 5000}, 7},  // glm5 at tp 8
      {16, 2, 64, 64, 2048, {1, 2, 2048, 2049, 3001}},
      {128, 1, 64, 64, 2048, {1, 4100}},                          // deepseek-v3.2, one GPU
      {128, 2, 32, 64, 2048, {2, 2500}, 0},
      {16, 1, 32, 64, 2048, {0, 1, 2, 700, 2048}},                // every row sees at most topk
      {8, 2, 32, 17, 100, {0, 2, 18, 333}},
      {16, 1, 32, 1, 64, {1, 65, 200}, 3},
      {8, 4, 32, 64, 256, {3, 4, 700}},
      // A bf16 main cache (1152 B a token) under the same fp8 indexer: the sparse step's bf16 kernels.
      {8, 1, 32, 64, 2048, {0, 1, 65, 2049, 5000}, -1, KvDtype::kBf16},
      {128, 2, 64, 17, 256, {3, 300}, 2, KvDtype::kBf16},
      // Odd head counts over caches whose scales are no powers of two: 7 heads of 2 new tokens (the
      // narrow kernels), 33 heads (the sparse step on the wgmma kernel) under 31 indexer heads.
      {7, 2, 32, 64, 2048, {2, 63, 65, 3001}, -1, KvDtype::kFp8E4M3, ScaleMode::kExact},
      {33, 1, 31, 64, 2048, {1, 4100}, -1, KvDtype::kFp8E4M3, ScaleMode::kExact},
      // Pages larger than a split: 4096 and 1000 tokens (no power of two).
      {8, 1, 32, 4096, 2048, {1, 4097, 9000}},
      {16, 2, 32, 1000, 2048, {2, 1001, 3000}},
      // A main pool of 1.5 x 2^31 bytes (test_mla_decode.cpp): the top-k's slots past 2 GiB read by
      // the sparse step, glm5 at tp 8 and a 128-head layer.
      {8, 1, 32, 64, 2048, {9000, 5000, 1}, -1, KvDtype::kFp8E4M3, ScaleMode::kPow2,
       pages_past_2gib(64, KvDtype::kFp8E4M3)},
      {128, 1, 64, 64, 2048, {7000, 2100}, -1, KvDtype::kFp8E4M3, ScaleMode::kPow2,
       pages_past_2gib(64, KvDtype::kFp8E4M3)},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuDsaDecode, ::testing::ValuesIn(dsa_cases()),
                         [](const ::testing::TestParamInfo<DsaCase>& info) {
                           std::ostringstream os;
                           os << info.param;
                           return os.str();
                         });

// ---- sparse with every visible token selected equals dense --------------------------------------

struct DenseCase {
  int q_len;
  int topk;
  std::vector<std::int64_t> lengths;  // none above topk
};

std::ostream& operator<<(std::ostream& os, const DenseCase& c) {
  return os << "q" << c.q_len << "_k" << c.topk;
}

class GpuDsaDecodeDense : public ::testing::TestWithParam<DenseCase> {};

TEST_P(GpuDsaDecodeDense, TopkCoveringEveryTokenEqualsDense) {
  LKV_REQUIRE_GPU();
  const DenseCase& c = GetParam();
  Rng rng = test_rng();
  PagedFixture f = make_fixture(64, c.lengths, rng);
  const DsaInputs in = random_inputs(rng, f.batch(), c.q_len, 16, 32);
  DeviceDsa d(f, in, c.topk, 0);
  d.fill_sentinels();
  d.run();
  check_cuda(cudaDeviceSynchronize());
  const DsaResult got = d.download();
  // Every visible slot selected (the pads counted as the reference's), then attention over them.
  ASSERT_TRUE(check_topk_rows(f, got.logits, got.slots, reference_topk(f, got.logits, c.topk)));
  const AttentionOutputs dense = reference_mla_decode(f, in.q, kScale);
  EXPECT_TRUE(compare("o", got.o, dense.o, Tolerance::bf16_output()));
  EXPECT_TRUE(compare("lse", got.lse, dense.lse, Tolerance::lse()));
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuDsaDecodeDense,
                         ::testing::Values(DenseCase{1, 2048, {0, 1, 2, 63, 65, 700, 2048}},
                                           DenseCase{2, 2048, {0, 1, 2, 63, 65, 700, 2048}},
                                           DenseCase{2, 700, {0, 1, 2, 65, 699, 700}}),
                         [](const ::testing::TestParamInfo<DenseCase>& info) {
                           std::ostringstream os;
                           os << info.param;
                           return os.str();
                         });

// ---- a CUDA graph replayed as the lengths grow --------------------------------------------------

// One dsa_decode captured once and replayed after the lengths on the device grow: every step reads
// the lengths from device memory, and the workspace layout fixed by the plan serves every replay.
TEST(GpuDsaDecodeGraph, ReplaysFollowDeviceLengths) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixture f = make_fixture(64, {2500, 4100}, rng);  // the caches hold the final lengths
  const DsaInputs in = random_inputs(rng, f.batch(), 1, 16, 32);
  const std::vector<std::vector<std::int32_t>> steps = {{300, 1}, {301, 2}, {2048, 2049}, {2049, 3000}, {2500, 4100}};
  DeviceDsa d(f, in, kMaxTopk, 0, steps.front());

  cudaStream_t stream;
  LKV_CUDA_OK(cudaStreamCreate(&stream));
  d.fill_sentinels();
  d.run({stream});  // warm-up outside the capture (first-call attribute set-up)
  LKV_CUDA_OK(cudaStreamSynchronize(stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  LKV_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  d.run({stream});
  LKV_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  LKV_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));

  for (const std::vector<std::int32_t>& step : steps) {
    SCOPED_TRACE("lengths " + std::to_string(step[0]) + ", " + std::to_string(step[1]));
    d.set_lengths(step);
    d.fill_sentinels();
    LKV_CUDA_OK(cudaGraphLaunch(exec, stream));
    LKV_CUDA_OK(cudaStreamSynchronize(stream));
    f.seq_lens = step;  // the host side of the references follows the same lengths
    check_stages(f, in, d.download(), kMaxTopk);
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace latentkv::testing
