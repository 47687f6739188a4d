// GPU dsa_prefill (indexer_prefill -> sparse MLA prefill, both steps on the `cuda` backend) over paged
// FP8 main and indexer caches, per SPEC section 5: ragged batches of new tokens over cached prefixes
// (requests with no new tokens, 1-token prompts, pure prompts), shuffled pages, NaN in every slot no
// request holds, sentinels in o, lse and the workspace's index rows, garbage in the steps' scratch.
//
// The GPU sums the indexer logits in float32 in another order than the float64 reference, so it may
// pick the other of two nearly equal logits; a call is therefore checked in two stages:
//  (1) the index rows it left in the workspace (dsa_prefill_steps(p, plan).indexer.slots) pass
//      check_prefill_slots (support/indexer_prefill.hpp) against the reference logits of each row;
//  (2) o and lse match the reference sparse_mla_prefill over exactly those index rows.
// Also: with topk >= every new token's visible count, o and lse equal the reference dense prefill;
// chunks of 7 new tokens give the default chunk's sets, o and lse, and so do the replays of a CUDA
// graph of the call against the eager call - bit for bit in the rows that see at most topk
// positions; a row that selects may differ by a rounding, since the GPU top-k lists its slots in an
// order that is not fixed from run to run and the attention sums them in that order.
//
// Sizes are kept small: on one core the reference sparse prefill costs about 1 us per (row, head,
// selected token) and the reference logits about 1 ns per (row, visible position, indexer head,
// dim).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <ostream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "gpu/device.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/dsa.hpp"
#include "support/compare.hpp"
#include "support/expect_error.hpp"
#include "support/host_tensor.hpp"
#include "support/indexer_prefill.hpp"
#include "support/paged_fixture.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

constexpr float kScale = 0.0625f;        // glm5's softmax scale
constexpr int kWorkspaceGarbage = 0xA5;  // the steps' scratch before every call

const Backend& cuda_backend() {
  const Backend* b = find_backend("cuda");
  if (b == nullptr) throw std::runtime_error("this build has no backend named cuda");
  return *b;
}

std::vector<std::int64_t> shape_of(const TensorView& v) {
  return std::vector<std::int64_t>(v.shape.begin(), v.shape.begin() + v.rank);
}

struct DsaPrefillInputs {
  PagedFixture f;                // both caches hold every request's prefix and new tokens
  std::vector<std::int32_t> cu;  // [B + 1]
  HostTensor q;                  // [T, H, 576] bf16
  HostTensor q_idx;              // [T, Hi, 128] fp8
  HostTensor weights;            // [T, Hi] f32, uniform in [w_lo, 1)
};

DsaPrefillInputs make_inputs(const PrefillBatch& batch, int page_size, int heads, int indexer_heads, Rng& rng,
                             double w_lo = -1.0, KvDtype kv_dtype = KvDtype::kFp8E4M3) {
  PagedFixture f = make_prefill_fixture(batch, page_size, rng, kv_dtype);
  std::vector<std::int32_t> cu = cumulative(batch.new_tokens);
  HostTensor q = random_bf16(rng, {cu.back(), heads, kQkDim});
  HostTensor q_idx = random_fp8(rng, {cu.back(), indexer_heads, kIndexerDim}, 2.0);
  HostTensor weights = random_f32(rng, {cu.back(), indexer_heads}, w_lo, 1.0);
  return {std::move(f), std::move(cu), std::move(q), std::move(q_idx), std::move(weights)};
}

// What one call left on the device.
struct DsaPrefillResult {
  HostTensor slots;  // [T, topk] i32, the index rows in the workspace
  HostTensor o;      // [T, H, 512] bf16
  HostTensor lse;    // [T, H] f32
};

// One dsa_prefill call's device side: the fixture's caches and tables, the inputs, o and lse, and
// the workspace of plan_dsa_prefill (planned with p.chunk_tokens = chunk_tokens); `sparse` names
// the sparse step's backend (the indexer's is `cuda`).
class DeviceDsaPrefill {
 public:
  DeviceDsaPrefill(const DsaPrefillInputs& in, int topk, int chunk_tokens = 0, std::string_view sparse = "cuda")
      : backends_(same_backend(cuda_backend())),
        device_(detect_device()),
        cache_(in.f.cache_bytes),
        indexer_(in.f.indexer_bytes),
        table_(in.f.block_table),
        lens_(in.f.seq_lens),
        cu_(in.cu),
        q_(in.q.raw(), in.q.bytes()),
        q_idx_(in.q_idx.raw(), in.q_idx.bytes()),
        weights_(in.weights.raw(), in.weights.bytes()),
        o_host_(sentinel_tensor(DType::kBF16, {in.q.shape()[0], in.q.shape()[1], kLatentDim})),
        lse_host_(sentinel_tensor(DType::kF32, {in.q.shape()[0], in.q.shape()[1]})),
        o_(o_host_.bytes()),
        lse_(lse_host_.bytes()) {
    backends_.sparse_prefill = find_backend(sparse);
    params_.q = in.q.view_of(q_.get(), Device::cuda());
    params_.q_idx = in.q_idx.view_of(q_idx_.get(), Device::cuda());
    params_.weights = in.weights.view_of(weights_.get(), Device::cuda());
    params_.cu_new_tokens =
        TensorView::contiguous(cu_.get(), DType::kI32, {static_cast<std::int64_t>(in.cu.size())}, Device::cuda());
    params_.cache = in.f.cache(cache_.get<std::uint8_t>(), Device::cuda());
    params_.indexer = in.f.indexer(indexer_.get<std::uint8_t>(), Device::cuda());
    params_.block_table = in.f.block_table_view(table_.get<std::int32_t>(), Device::cuda());
    params_.seq_lens = in.f.seq_lens_view(lens_.get<std::int32_t>(), Device::cuda());
    params_.o = o_host_.view_of(o_.get(), Device::cuda());
    params_.lse = lse_host_.view_of(lse_.get(), Device::cuda());
    params_.softmax_scale = kScale;
    params_.topk = topk;
    params_.chunk_tokens = chunk_tokens;
    params_.fault = fault_.get();
    plan_ = plan_dsa_prefill(backends_, params_, device_);
    workspace_ = DeviceBuffer(plan_.workspace_bytes);
    params_.workspace = workspace_.get();
    params_.workspace_bytes = workspace_.bytes();
    steps_ = dsa_prefill_steps(params_, plan_);
  }

  const DsaPrefillPlan& plan() const { return plan_; }
  // The message of what the calls so far noted in their fault record, "" for nothing.
  std::string fault() const { return fault_.message(); }

  // o moved to `data` (for a call that must be refused: the steps' views follow).
  void move_o(void* data) {
    params_.o.data = data;
    steps_ = dsa_prefill_steps(params_, plan_);
  }
  std::size_t o_bytes() const { return o_host_.bytes(); }
  // Calls from now on over the planned workspace's size at `data` (for a call that must be refused:
  // the steps' views stay where they were).
  void move_workspace(void* data) { params_.workspace = data; }
  std::vector<std::uint8_t> workspace_contents() const {
    std::vector<std::uint8_t> host(workspace_.bytes());
    check_cuda(cudaMemcpy(host.data(), workspace_.get(), host.size(), cudaMemcpyDeviceToHost));
    return host;
  }

  // Sentinels in o, lse and the workspace's index rows; garbage in the rest of the workspace.
  void fill_sentinels() {
    o_.upload(o_host_.raw(), o_host_.bytes());
    lse_.upload(lse_host_.raw(), lse_host_.bytes());
    check_cuda(cudaMemset(workspace_.get(), kWorkspaceGarbage, workspace_.bytes()));
    const HostTensor slots = sentinel_tensor(DType::kI32, shape_of(steps_.indexer.slots));
    check_cuda(cudaMemcpy(steps_.indexer.slots.data, slots.raw(), slots.bytes(), cudaMemcpyHostToDevice));
  }

  void run(const ExecContext& context = {}) { dsa_prefill(backends_, params_, plan_, context, device_); }

  DsaPrefillResult download() const {
    DsaPrefillResult r{HostTensor(DType::kI32, shape_of(steps_.indexer.slots)), o_host_, lse_host_};
    check_cuda(cudaMemcpy(r.slots.raw(), steps_.indexer.slots.data, r.slots.bytes(), cudaMemcpyDeviceToHost));
    o_.download(r.o.raw(), r.o.bytes());
    lse_.download(r.lse.raw(), r.lse.bytes());
    return r;
  }

  // Sentinels, one call on the default stream, what it left; good input must leave the fault
  // record empty.
  DsaPrefillResult call() {
    fill_sentinels();
    run();
    check_cuda(cudaDeviceSynchronize());
    EXPECT_EQ(fault_.message(), "") << "a fault noted for good input";
    return download();
  }

 private:
  DsaBackends backends_;
  DeviceInfo device_;
  FaultRecord fault_;
  DeviceBuffer cache_, indexer_, table_, lens_, cu_, q_, q_idx_, weights_;
  HostTensor o_host_, lse_host_;  // sentinel-filled, shaped as the outputs
  DeviceBuffer o_, lse_, workspace_;
  DsaPrefillParams params_;
  DsaPrefillPlan plan_;
  DsaPrefillSteps steps_;  // views into workspace_
};

// Rows `rows` of `t` (along its first dimension), in that order.
HostTensor rows_of(const HostTensor& t, const std::vector<std::int64_t>& rows) {
  std::vector<std::int64_t> shape = t.shape();
  const std::size_t row_bytes = t.bytes() / static_cast<std::size_t>(shape[0]);
  shape[0] = static_cast<std::int64_t>(rows.size());
  HostTensor out(t.dtype(), shape);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(out.raw() + i * row_bytes, t.raw() + static_cast<std::size_t>(rows[i]) * row_bytes, row_bytes);
  }
  return out;
}

// Checks one call in the two stages of the file comment: stage (1) on every row, stage (2) on every
// `row_step`-th row and the last (each row's attention is its own; long prompts keep the reference
// short this way), and that every row of o and lse was written.
void check_stages(DsaPrefillInputs& in, const DsaPrefillResult& got, std::int64_t row_step = 1) {
  const std::vector<PrefillRow> rows = prefill_rows(in.f, in.cu);
  const std::vector<std::vector<float>> x = reference_prefill_logits(in.f, in.q_idx, in.weights, rows);
  ASSERT_TRUE(check_prefill_slots(in.f, rows, x, got.slots)) << "stage (1): the index rows in the workspace";
  std::vector<std::int64_t> picked;
  const std::int64_t t = got.slots.shape()[0];
  for (std::int64_t r = 0; r < t; r += row_step) picked.push_back(r);
  if (picked.back() != t - 1) picked.push_back(t - 1);
  const AttentionOutputs want = reference_sparse_prefill(in.f, rows_of(in.q, picked), rows_of(got.slots, picked), kScale);
  const std::string which = row_step == 1 ? "stage (2)" : "stage (2), every " + std::to_string(row_step) + "th row";
  EXPECT_TRUE(compare("o", rows_of(got.o, picked), want.o, Tolerance::bf16_output())) << which;
  EXPECT_TRUE(compare("lse", rows_of(got.lse, picked), want.lse, Tolerance::lse())) << which;
  EXPECT_EQ(sentinel_elements(got.o), 0) << "elements of o still hold the sentinel";
  EXPECT_EQ(sentinel_elements(got.lse), 0) << "elements of lse still hold the sentinel";
}

// Two calls over the same inputs: the same index sets; the same o and lse bits in every row that
// sees at most topk positions (it takes them all, in position order). A row that selects gets its
// slots in the order the top-k's CTAs happen to finish, which is not fixed from run to run, and the
// attention sums in index order: its o and lse may differ as float32 sums of the same terms in
// another order do (seen on an H200: o up to 1e-5 apart where it nearly cancels, 1 - cos 2.5e-9;
// lse one float32 ulp), then rounded to bf16.
void check_same_outputs(const DsaPrefillInputs& in, const DsaPrefillResult& got, const DsaPrefillResult& want,
                        int topk) {
  EXPECT_EQ(first_different_row(sorted_rows(got.slots), sorted_rows(want.slots), topk), -1) << "index sets differ";
  const std::int64_t heads = got.lse.shape()[1];
  const std::size_t o_row = static_cast<std::size_t>(heads) * kLatentDim * sizeof(std::uint16_t);  // bytes
  const std::size_t lse_row = static_cast<std::size_t>(heads) * sizeof(float);
  std::int64_t exact_rows = 0;
  for (const PrefillRow& r : prefill_rows(in.f, in.cu)) {
    if (r.visible > topk) continue;
    ++exact_rows;
    const auto row = static_cast<std::size_t>(r.row);
    EXPECT_TRUE(std::equal(got.o.raw() + row * o_row, got.o.raw() + (row + 1) * o_row, want.o.raw() + row * o_row))
        << "o of row " << r.row << " (visible " << r.visible << ") differs in its bits";
    EXPECT_TRUE(std::equal(got.lse.raw() + row * lse_row, got.lse.raw() + (row + 1) * lse_row,
                           want.lse.raw() + row * lse_row))
        << "lse of row " << r.row << " (visible " << r.visible << ") differs in its bits";
  }
  EXPECT_GT(exact_rows, 0) << "no row sees at most topk positions";
  EXPECT_TRUE(compare("o", got.o, want.o, Tolerance{2.5e-4, 2.0 / 128.0, 1e-7}));
  EXPECT_TRUE(compare("lse", got.lse, want.lse, Tolerance::lse()));
}

struct DsaPrefillCase {
  std::string name;
  int heads;
  int indexer_heads;
  int page_size;
  int topk;
  PrefillBatch batch;
  std::int64_t row_step = 1;  // the attention of every row_step-th row checked against the reference
  KvDtype kv_dtype = KvDtype::kFp8E4M3;  // the main cache's (the indexer cache is always fp8)
};

std::ostream& operator<<(std::ostream& os, const DsaPrefillCase& c) {
  os << c.name << " (H " << c.heads << ", Hi " << c.indexer_heads << ", page " << c.page_size << ", topk " << c.topk
     << (c.kv_dtype == KvDtype::kBf16 ? ", bf16 cache" : "") << ", new tokens {";
  for (std::size_t b = 0; b < c.batch.new_tokens.size(); ++b) {
    os << (b ? ", " : "") << c.batch.new_tokens[b] << " over " << c.batch.prefixes[b];
  }
  return os << "})";
}

std::string case_name(const ::testing::TestParamInfo<DsaPrefillCase>& info) { return info.param.name; }

// ---- sparse with every visible token selected equals dense ----------------------------------------

class GpuDsaPrefillDense : public ::testing::TestWithParam<DsaPrefillCase> {};

TEST_P(GpuDsaPrefillDense, TopkCoveringEveryTokenEqualsDense) {
  LKV_REQUIRE_GPU();
  const DsaPrefillCase& c = GetParam();
  Rng rng = test_rng();
  DsaPrefillInputs in = make_inputs(c.batch, c.page_size, c.heads, c.indexer_heads, rng);
  ASSERT_LE(in.f.max_len(), c.topk) << "the case's topk must cover every visible position";
  ASSERT_TRUE(unread_slots_poisoned(in.f));

  DeviceDsaPrefill d(in, c.topk);
  const DsaPrefillResult got = d.call();
  // Every visible slot selected, the rest -1 (check_prefill_slots: min(topk, visible) slots).
  const std::vector<PrefillRow> rows = prefill_rows(in.f, in.cu);
  ASSERT_TRUE(check_prefill_slots(in.f, rows, reference_prefill_logits(in.f, in.q_idx, in.weights, rows), got.slots))
      << c;
  const AttentionOutputs dense = reference_mla_prefill(in.f, in.q, in.cu, kScale);
  EXPECT_TRUE(compare("o vs dense", got.o, dense.o, Tolerance::bf16_output())) << c;
  EXPECT_TRUE(compare("lse vs dense", got.lse, dense.lse, Tolerance::lse())) << c;
}

std::vector<DsaPrefillCase> dense_cases() {
  // A 1-token prompt, a request with no new tokens, a 13-token prompt, 5 new over 40, 17 over 300.
  const PrefillBatch ragged = {{0, 17, 0, 40, 300}, {1, 0, 13, 5, 17}};
  // Lengths around a page of 17 (16, 17, 18, 34), a request with no new tokens, an empty request.
  const PrefillBatch around17 = {{0, 15, 1, 3, 0, 17}, {16, 2, 17, 0, 0, 17}};
  return {
      {"glm5_tp8_ragged_k2048", 8, 32, 64, kMaxTopk, ragged},
      {"page17_k34", 16, 32, 17, 34, around17},  // the longest rows see exactly topk
      {"page1_k64", 8, 8, 1, 64, {{0, 3, 50}, {1, 2, 9}}},
      {"H64_Hi64_k136", 64, 64, 64, 136, {{0, 63, 129}, {20, 1, 7}}},  // exactly topk again
      {"H128_Hi64_k2048", 128, 64, 64, kMaxTopk, {{0, 30}, {2, 7}}},
      {"page1000_k2048", 8, 32, 1000, kMaxTopk, {{0, 1500}, {30, 20}}},  // pages larger than a split
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuDsaPrefillDense, ::testing::ValuesIn(dense_cases()), case_name);

// ---- the indexer selects: two stages -------------------------------------------------------------

class GpuDsaPrefill : public ::testing::TestWithParam<DsaPrefillCase> {};

TEST_P(GpuDsaPrefill, StagesMatchReference) {
  LKV_REQUIRE_GPU();
  const DsaPrefillCase& c = GetParam();
  Rng rng = test_rng();
  DsaPrefillInputs in = make_inputs(c.batch, c.page_size, c.heads, c.indexer_heads, rng, -1.0, c.kv_dtype);
  ASSERT_GT(in.f.max_len(), c.topk) << "the case's indexer must select";
  ASSERT_TRUE(unread_slots_poisoned(in.f));

  DeviceDsaPrefill d(in, c.topk);
  SCOPED_TRACE(::testing::PrintToString(c) + ", chunks of " + std::to_string(d.plan().indexer.chunk_tokens) + ", " +
               std::to_string(d.plan().sparse.num_splits) + " splits");
  check_stages(in, d.call(), c.row_step);
}

std::vector<DsaPrefillCase> selection_cases() {
  return {
      // Every row sees 3001 .. 3300 positions, more than 2048 (the radix select). The attention of
      // every 20th row is checked (all 300 rows x 2048 selected tokens take the reference 4 s).
      {"long_prompt_k2048", 8, 4, 64, kMaxTopk, {{3000}, {300}}, 20},
      // An empty request, a 1-token prompt, 37 new over 90, 5 over 16, 21 over 200; some rows see
      // fewer than 64 positions, most more.
      {"glm5_tp8_ragged_k64_page17", 8, 32, 17, 64, {{0, 0, 90, 16, 200}, {0, 1, 37, 5, 21}}},
      {"H64_Hi64_k128", 64, 64, 64, 128, {{300, 0, 63}, {12, 30, 9}}},
      // deepseek-v3.2 on one GPU: rows over 2100 cached tokens next to a short prompt.
      {"H128_Hi64_k2048", 128, 64, 64, kMaxTopk, {{2100, 0}, {2, 3}}},
      // A bf16 main cache (1152 B a token) under the same fp8 indexer: the sparse step's bf16 kernels.
      {"glm5_tp8_ragged_k64_page17_bf16", 8, 32, 17, 64, {{0, 90, 200}, {1, 37, 21}}, 1, KvDtype::kBf16},
      {"H128_Hi64_k256_bf16", 128, 64, 64, 256, {{300, 0}, {4, 9}}, 1, KvDtype::kBf16},
  };
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuDsaPrefill, ::testing::ValuesIn(selection_cases()), case_name);

// ---- chunking ------------------------------------------------------------------------------------

// Chunks of 7 new tokens (boundaries inside requests) select the default chunk's sets (here all 343
// rows at once), and the attention over them gives the same o and lse (check_same_outputs: bit for
// bit where no selection happens). Eight heads of positive weights keep exact ties away from the
// threshold, so the sets are deterministic.
TEST(GpuDsaPrefillChunks, SevensEqualTheDefaultChunk) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  DsaPrefillInputs in = make_inputs({{3000, 0, 41}, {300, 1, 42}}, 64, 8, 8, rng, 0.1);
  DeviceDsaPrefill whole(in, kMaxTopk);
  DeviceDsaPrefill sevens(in, kMaxTopk, 7);
  ASSERT_EQ(whole.plan().indexer.chunk_tokens, 343);
  ASSERT_EQ(sevens.plan().indexer.chunk_tokens, 7);
  EXPECT_LT(sevens.plan().workspace_bytes, whole.plan().workspace_bytes);
  check_same_outputs(in, sevens.call(), whole.call(), kMaxTopk);
}

// An o the sparse kernels cannot write (4 bytes past an 8-byte boundary; shapes, sizes and
// placement all valid): the sparse step's own checks refuse it, before the indexer step (its value
// checks, rows and chunks) is queued, so the workspace keeps its garbage and sentinels and lse its
// sentinels. The cuda kernels and both baselines as the sparse step.
TEST(GpuDsaPrefillChecks, AMisalignedOutputQueuesNoStep) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  DsaPrefillInputs in = make_inputs({{100, 7, 2100}, {5, 0, 37}}, 64, 8, 8, rng);
  for (const char* sparse : {"cuda", "gather_cast", "cast_full"}) {
    SCOPED_TRACE(std::string("the sparse step on ") + sparse);
    DeviceDsaPrefill d(in, kMaxTopk, 0, sparse);
    expect_misaligned_o_queues_nothing(d, "sparse_mla_prefill");
  }
}

// A workspace 16 bytes past a 256-byte boundary (of the planned size; valid otherwise), which the
// indexer prefill step's scratch cannot take: the call refuses it under dsa_prefill's own name
// (dsa_prefill_steps' check) before any step is queued (o and lse keep their sentinels).
TEST(GpuDsaPrefillChecks, AMisalignedWorkspaceIsNamedAsTheCallers) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  DsaPrefillInputs in = make_inputs({{100, 7, 2100}, {5, 0, 37}}, 64, 8, 8, rng);
  DeviceDsaPrefill d(in, kMaxTopk);
  expect_misaligned_workspace_refused(d, "dsa_prefill", 16, 256);
}

// ---- a CUDA graph --------------------------------------------------------------------------------

// dsa_prefill captured once on a stream (the indexer's three chunks, then the sparse prefill),
// instantiated and launched twice: both replays give the eager call's index sets, o and lse
// (check_same_outputs).
TEST(GpuDsaPrefillGraph, ReplaysGiveTheEagerOutputs) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  DsaPrefillInputs in = make_inputs({{100, 7, 2100}, {5, 0, 37}}, 64, 8, 8, rng, 0.1);
  DeviceDsaPrefill d(in, 256, 16);
  ASSERT_EQ(d.plan().indexer.chunk_tokens, 16);
  const DsaPrefillResult eager = d.call();  // also the warm-up outside the capture
  check_stages(in, eager);

  cudaStream_t stream;
  LKV_CUDA_OK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  LKV_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  d.run({stream});
  LKV_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  LKV_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    SCOPED_TRACE("replay " + std::to_string(replay));
    d.fill_sentinels();
    LKV_CUDA_OK(cudaGraphLaunch(exec, stream));
    LKV_CUDA_OK(cudaStreamSynchronize(stream));
    check_same_outputs(in, d.download(), eager, 256);
  }
  EXPECT_EQ(d.fault(), "") << "a fault noted for good input";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

}  // namespace
}  // namespace latentkv::testing
