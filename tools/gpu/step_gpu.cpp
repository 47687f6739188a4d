// tools/gpu/step_gpu.cpp - `latentkv step` on the GPU: every layer of the model gets its own main
// and indexer cache (a shuffled page pool filled by the library's append) and its own inputs; one
// step (for every layer: append the new tokens, then indexer -> top-k -> sparse decode, or dense
// decode) is captured once per strategy in a CUDA graph, checked against the float64 reference,
// then replayed and timed. Each op is also captured alone across all layers and timed, which gives
// the per-op sums of the gap analysis. The floors (copy bandwidth, bf16 matrix rate) are measured
// at the start of the same run.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "check.hpp"
#include "cpu/reference.hpp"
#include "gpu/bench_context.hpp"
#include "gpu/graph.hpp"
#include "gpu/kernels.hpp"
#include "gpu/matrix_rate.hpp"
#include "gpu/measure.hpp"
#include "gpu/pool.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/device_fault.hpp"
#include "latentkv/dsa.hpp"
#include "latentkv/error.hpp"
#include "latentkv/model.hpp"
#include "step.hpp"
#include "step_check.hpp"

namespace latentkv::tools {

using namespace gpu;

namespace {

constexpr int kMatrixN = 8192;                                // the bf16 GEMM of the matrix-rate floor
constexpr std::size_t kHeadroomBytes = std::size_t{1} << 30;  // graphs, the CUDA context, fill scratch
constexpr int kLogitsSentinel = 0xFF;                         // NaN in every float32 logit
constexpr int kSlotsSentinel = 0xA5;                          // 0xA5A5A5A5: neither -1 nor a slot
constexpr int kOutputSentinel = 0xFF;                         // NaN in o (bf16) and lse (f32)

// Where a layer's element `offset` lives in a buffer that may not exist yet (shape-only views for
// selection and planning carry null data).
template <typename T>
T* at(const DeviceMemory& m, std::size_t offset) {
  return m.get() == nullptr ? nullptr : m.get<T>() + offset;
}

// Every layer's inputs and outputs of the step, one allocation per kind, layer-major, and the block
// table, lengths and new-token slots that every layer shares (one page table, as in an engine).
class StepBuffers {
 public:
  StepBuffers(const StepShape& s, int max_pages, bool allocate)
      : s_(s), b_(s.batch), q_len_(s.q_len), rows_(static_cast<std::size_t>(s.batch) * s.q_len), max_pages_(max_pages) {
    if (!allocate) return;
    const std::size_t layers = static_cast<std::size_t>(s.layers);
    latent_ = DeviceMemory(layers * rows_ * kQkDim * 2);
    keys_ = DeviceMemory(layers * rows_ * kIndexerDim * 2);
    q_ = DeviceMemory(layers * q_elems() * 2);
    q_idx_ = DeviceMemory(layers * q_idx_elems());
    weights_ = DeviceMemory(layers * weight_elems() * 4);
    o_ = DeviceMemory(layers * o_elems() * 2);
    lse_ = DeviceMemory(layers * lse_elems() * 4);
    table_ = DeviceMemory(static_cast<std::size_t>(s.batch) * max_pages * 4);
    lens_ = DeviceMemory(static_cast<std::size_t>(s.batch) * 4);
    slots_ = DeviceMemory(rows_ * 4);
  }

  // Device bytes of all of it, for the memory check before anything is allocated.
  static std::size_t bytes_for(const StepShape& s, int max_pages) {
    const StepBuffers shape(s, max_pages, false);
    const std::size_t per_layer = shape.rows_ * (kQkDim + kIndexerDim) * 2 + shape.q_elems() * 2 + shape.q_idx_elems() +
                                  shape.weight_elems() * 4 + shape.o_elems() * 2 + shape.lse_elems() * 4;
    return static_cast<std::size_t>(s.layers) * per_layer + static_cast<std::size_t>(s.batch) * (max_pages + 1) * 4 +
           shape.rows_ * 4;
  }

  std::size_t q_elems() const { return rows_ * s_.heads * kQkDim; }
  std::size_t q_idx_elems() const { return rows_ * s_.indexer_heads * kIndexerDim; }
  std::size_t weight_elems() const { return rows_ * s_.indexer_heads; }
  std::size_t o_elems() const { return rows_ * s_.heads * kLatentDim; }
  std::size_t lse_elems() const { return rows_ * s_.heads; }

  TensorView latent(int l) const {
    return view(at<std::uint16_t>(latent_, l * rows_ * kQkDim), DType::kBF16, {n(), kQkDim});
  }
  TensorView keys(int l) const {
    return view(at<std::uint16_t>(keys_, l * rows_ * kIndexerDim), DType::kBF16, {n(), kIndexerDim});
  }
  TensorView q(int l) const {
    return view(at<std::uint16_t>(q_, l * q_elems()), DType::kBF16, {b_, q_len_, s_.heads, kQkDim});
  }
  TensorView q_idx(int l) const {
    return view(at<std::uint8_t>(q_idx_, l * q_idx_elems()), DType::kFP8E4M3,
                {b_, q_len_, s_.indexer_heads, kIndexerDim});
  }
  TensorView weights(int l) const {
    return view(at<float>(weights_, l * weight_elems()), DType::kF32, {b_, q_len_, s_.indexer_heads});
  }
  TensorView o(int l) const {
    return view(at<std::uint16_t>(o_, l * o_elems()), DType::kBF16, {b_, q_len_, s_.heads, kLatentDim});
  }
  TensorView lse(int l) const { return view(at<float>(lse_, l * lse_elems()), DType::kF32, {b_, q_len_, s_.heads}); }
  TensorView block_table() const { return view(at<std::int32_t>(table_, 0), DType::kI32, {b_, max_pages_}); }
  TensorView seq_lens() const { return view(at<std::int32_t>(lens_, 0), DType::kI32, {b_}); }
  TensorView new_slots() const { return view(at<std::int32_t>(slots_, 0), DType::kI32, {n()}); }
  // The DSA intermediates' shapes (data lives in the workspace): logits over the table's capacity.
  TensorView logits_shape() const {
    return view(nullptr, DType::kF32, {b_, q_len_, std::int64_t{max_pages_} * s_.page_size});
  }
  TensorView slots_shape() const { return view(nullptr, DType::kI32, {b_, q_len_, s_.topk}); }

  const DeviceMemory& latent_memory() const { return latent_; }
  const DeviceMemory& keys_memory() const { return keys_; }
  const DeviceMemory& q_memory() const { return q_; }
  const DeviceMemory& q_idx_memory() const { return q_idx_; }
  const DeviceMemory& weights_memory() const { return weights_; }
  const DeviceMemory& table_memory() const { return table_; }
  const DeviceMemory& lens_memory() const { return lens_; }
  const DeviceMemory& slots_memory() const { return slots_; }

 private:
  std::int64_t n() const { return static_cast<std::int64_t>(rows_); }
  static TensorView view(void* data, DType dtype, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(data, dtype, shape, Device::cuda());
  }

  StepShape s_;
  std::int64_t b_, q_len_;
  std::size_t rows_;
  int max_pages_;
  DeviceMemory latent_;   // [layers, B * q_len, 576] bf16: the step's new tokens
  DeviceMemory keys_;     // [layers, B * q_len, 128] bf16: their indexer keys
  DeviceMemory q_;        // [layers, B, q_len, H, 576] bf16
  DeviceMemory q_idx_;    // [layers, B, q_len, Hi, 128] fp8
  DeviceMemory weights_;  // [layers, B, q_len, Hi] f32
  DeviceMemory o_;        // [layers, B, q_len, H, 512] bf16
  DeviceMemory lse_;      // [layers, B, q_len, H] f32
  DeviceMemory table_;    // [B, max_pages] i32
  DeviceMemory lens_;     // [B] i32
  DeviceMemory slots_;    // [B * q_len] i32
};

// A cache pair's descriptors over `num_pages` pages (null data while planning).
LatentCache latent_cache(std::uint8_t* data, std::int64_t num_pages, int page_size) {
  return {data, KvDtype::kFp8E4M3, num_pages, page_size, Device::cuda()};
}
IndexerCache indexer_cache(std::uint8_t* data, std::int64_t num_pages, int page_size) {
  return {data, num_pages, page_size, Device::cuda()};
}

// One strategy's ops for every layer, their backends and kernels, and its shared workspace.
class StrategyOps {
 public:
  // Resolves the backends and kernels on shape-only arguments; status() says why when they cannot run.
  StrategyOps(const StrategySpec& spec, const StepShape& s, const StepBuffers& shapes, std::int64_t num_pages,
              const DeviceInfo& device)
      : spec_(spec), s_(s), device_(device), ops_(step_ops(spec.dense)) {
    native_ = find_backend("cuda");
    decode_ = find_backend(spec.backend);
    if (native_ == nullptr || decode_ == nullptr) {
      fail("no backend named '" + std::string(native_ == nullptr ? "cuda" : spec.backend) + "' in this build");
      return;
    }
    dsa_ = {native_, native_, decode_};
    const LatentCache cache = latent_cache(nullptr, num_pages, s.page_size);
    const IndexerCache indexer = indexer_cache(nullptr, num_pages, s.page_size);
    for (StepOp op : ops_) {
      const Backend& backend = backend_of(op);
      const Selection sel = backend.select(problem_of(shape_args(op, shapes, cache, indexer), device));
      if (!sel) {
        fail(std::string(step_op_name(op)) + " on " + std::string(backend.name()) + ": " + sel.reason);
        return;
      }
      kernels_.push_back(sel.kernel->name);
    }
    try {
      if (spec.dense) {
        dense_plan_ = decode_->plan(shape_args(StepOp::kDenseDecode, shapes, cache, indexer), device);
        workspace_bytes_ = dense_plan_.workspace_bytes;
      } else {
        dsa_plan_ = plan_dsa_decode(dsa_, dsa_params(shapes, 0, cache, indexer, nullptr, 0), device);
        workspace_bytes_ = dsa_plan_.workspace_bytes;
      }
    } catch (const Error& e) {
      fail(std::string("planning: ") + e.what());
    }
  }

  bool runnable() const { return status_.empty(); }
  const std::string& status() const { return status_; }
  std::size_t workspace_bytes() const { return workspace_bytes_; }
  const std::vector<StepOp>& ops() const { return ops_; }
  const std::vector<std::string>& kernels() const { return kernels_; }
  const Backend& backend_of(StepOp op) const {
    return op == StepOp::kSparseDecode || op == StepOp::kDenseDecode ? *decode_ : *native_;
  }
  int num_splits() const { return spec_.dense ? dense_plan_.num_splits : dsa_plan_.sparse.num_splits; }
  // Throws the Error of the first bad value the layers' ops noted since bind() (a token an append
  // refused, a length or page outside the block table or pool, a slot outside the pool); returns
  // when there was none.
  void throw_fault() const {
    DeviceFault f;
    cuda_ok(cudaMemcpy(&f, fault_.get(), sizeof f, cudaMemcpyDeviceToHost), "the step's fault record");
    throw_device_fault(f);
  }

  // Binds every layer's ops to its caches and the buffers, with a workspace of workspace_bytes().
  // `fault_checks`: every op gets the fault record, not only the appends.
  void bind(const StepBuffers& buffers, const std::vector<std::unique_ptr<DevicePool>>& pools, bool fault_checks) {
    workspace_ = DeviceMemory::zeroed(workspace_bytes_);
    fault_ = DeviceMemory::zeroed(sizeof(DeviceFault));
    DeviceFault* const checked = fault_checks ? fault_.get<DeviceFault>() : nullptr;
    for (int l = 0; l < s_.layers; ++l) {
      const DevicePool& pool = *pools[static_cast<std::size_t>(l)];
      AppendParams a;
      a.cache = pool.cache();
      a.indexer = pool.indexer();
      a.latent = buffers.latent(l);
      a.indexer_keys = buffers.keys(l);
      a.slots = buffers.new_slots();
      a.fault = fault_.get<DeviceFault>();
      appends_.push_back(a);
      if (spec_.dense) {
        MlaDecodeParams d = dense_args(buffers, l, pool.cache());
        d.num_splits = dense_plan_.num_splits;
        d.workspace = workspace_.get();
        d.workspace_bytes = workspace_.bytes();
        d.fault = checked;
        dense_.push_back(d);
      } else {
        DsaDecodeParams p = dsa_params(buffers, l, pool.cache(), pool.indexer(), workspace_.get(), workspace_.bytes());
        p.fault = checked;
        sparse_.push_back(dsa_steps(p, dsa_plan_));
      }
    }
  }

  // `alone`: the op without the ones before it in the layer (timing each op on its own), so that the
  // top-k clears its own state instead of counting on the indexer's clear.
  void launch(StepOp op, int l, cudaStream_t stream, bool alone = false) const {
    const ExecContext context{stream};
    const auto i = static_cast<std::size_t>(l);
    switch (op) {
      case StepOp::kAppend:
        run(*native_, appends_[i], context, device_);
        break;
      case StepOp::kIndexerLogits:
        run(*dsa_.indexer_logits, sparse_[i].indexer, context, device_);
        break;
      case StepOp::kTopk: {
        TopkParams topk = sparse_[i].topk;
        topk.workspace_cleared = topk.workspace_cleared && !alone;
        run(*dsa_.topk, topk, context, device_);
        break;
      }
      case StepOp::kSparseDecode:
        run(*dsa_.sparse_decode, sparse_[i].sparse, context, device_);
        break;
      case StepOp::kDenseDecode:
        run(*decode_, dense_[i], context, device_);
        break;
    }
  }
  void launch_step(cudaStream_t stream) const {
    for (int l = 0; l < s_.layers; ++l) {
      for (StepOp op : ops_) launch(op, l, stream);
    }
  }
  const DsaSteps& steps(int l) const { return sparse_[static_cast<std::size_t>(l)]; }

 private:
  void fail(std::string why) { status_ = "unsupported: " + std::move(why); }

  DsaDecodeParams dsa_params(const StepBuffers& b, int l, const LatentCache& cache, const IndexerCache& indexer,
                             void* workspace, std::size_t workspace_bytes) const {
    DsaDecodeParams p;
    p.q = b.q(l);
    p.q_idx = b.q_idx(l);
    p.weights = b.weights(l);
    p.cache = cache;
    p.indexer = indexer;
    p.block_table = b.block_table();
    p.seq_lens = b.seq_lens();
    p.o = b.o(l);
    p.lse = b.lse(l);
    p.softmax_scale = scale();
    p.topk = s_.topk;
    p.workspace = workspace;
    p.workspace_bytes = workspace_bytes;
    p.workspace_cleared = true;  // zeroed in bind()
    return p;
  }
  MlaDecodeParams dense_args(const StepBuffers& b, int l, const LatentCache& cache) const {
    MlaDecodeParams d;
    d.q = b.q(l);
    d.cache = cache;
    d.block_table = b.block_table();
    d.seq_lens = b.seq_lens();
    d.o = b.o(l);
    d.lse = b.lse(l);
    d.softmax_scale = scale();
    return d;
  }
  // An op's arguments with shapes only (null data): enough for select() and plan().
  OpArgs shape_args(StepOp op, const StepBuffers& b, const LatentCache& cache, const IndexerCache& indexer) const {
    switch (op) {
      case StepOp::kAppend: {
        AppendParams a;
        a.cache = cache;
        a.indexer = indexer;
        a.latent = b.latent(0);
        a.indexer_keys = b.keys(0);
        a.slots = b.new_slots();
        return a;
      }
      case StepOp::kIndexerLogits: {
        IndexerLogitsParams p;
        p.q = b.q_idx(0);
        p.weights = b.weights(0);
        p.cache = indexer;
        p.block_table = b.block_table();
        p.seq_lens = b.seq_lens();
        p.logits = b.logits_shape();
        return p;
      }
      case StepOp::kTopk: {
        TopkParams p;
        p.logits = b.logits_shape();
        p.block_table = b.block_table();
        p.seq_lens = b.seq_lens();
        p.page_size = s_.page_size;
        p.k = s_.topk;
        p.slots = b.slots_shape();
        return p;
      }
      case StepOp::kSparseDecode: {
        SparseMlaDecodeParams p;
        p.q = b.q(0);
        p.cache = cache;
        p.indices = b.slots_shape();
        p.o = b.o(0);
        p.lse = b.lse(0);
        p.softmax_scale = scale();
        return p;
      }
      case StepOp::kDenseDecode:
        return dense_args(b, 0, cache);
    }
    throw Error("step", "op", std::string(step_op_name(op)), "a step op");
  }
  float scale() const { return static_cast<float>(model_preset(s_.model).softmax_scale); }

  StrategySpec spec_;
  StepShape s_;
  DeviceInfo device_;
  std::vector<StepOp> ops_;
  std::vector<std::string> kernels_;  // per op of ops_
  std::string status_;
  const Backend* native_ = nullptr;  // append, indexer and top-k: the FP8-native backend
  const Backend* decode_ = nullptr;  // the strategy's decode backend
  DsaBackends dsa_;
  DsaPlan dsa_plan_;
  Plan dense_plan_;
  std::size_t workspace_bytes_ = 0;
  DeviceMemory workspace_;              // shared by the layers: they run one after another
  DeviceMemory fault_;                  // the step's fault record: the appends', and with --fault-checks every op's
  std::vector<AppendParams> appends_;   // per layer
  std::vector<DsaSteps> sparse_;        // per layer (sparse path), views into workspace_
  std::vector<MlaDecodeParams> dense_;  // per layer (dense path)
};

// ---- the check ------------------------------------------------------------------------------------

// Host copies of what the checked layer read: its caches, and the first `checked` requests' inputs.
struct CheckedLayer {
  int layer = 0, checked = 0;
  std::vector<std::uint8_t> cache, indexer;  // [num_pages, page_size, 656], [num_pages, page_size * 132]
  std::vector<std::uint16_t> q;              // [checked, q_len, H, 576] bf16
  std::vector<std::uint8_t> q_idx;           // [checked, q_len, Hi, 128] fp8
  std::vector<float> weights;                // [checked, q_len, Hi]
  std::vector<float> ref_logits;             // [checked, q_len, max_len]: the reference indexer's, once
  bool loaded = false;
};

template <typename T>
std::vector<T> download(const void* device, std::size_t count) {
  std::vector<T> host(count);
  cuda_ok(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost), "download for the check");
  return host;
}

// Reads the checked layer back after a step has run (the step's append writes the same bytes every
// time, so one copy serves every strategy).
void load_checked_layer(CheckedLayer& c, const StepShape& s, const DevicePool& pool, const StepBuffers& b) {
  if (c.loaded) return;
  const std::size_t l = static_cast<std::size_t>(c.layer), rows = static_cast<std::size_t>(c.checked) * s.q_len;
  c.cache = download<std::uint8_t>(pool.latent_bytes.get(), pool.latent_bytes.bytes());
  c.indexer = download<std::uint8_t>(pool.indexer_bytes.get(), pool.indexer_bytes.bytes());
  c.q = download<std::uint16_t>(b.q_memory().get<std::uint16_t>() + l * b.q_elems(), rows * s.heads * kQkDim);
  c.q_idx = download<std::uint8_t>(b.q_idx_memory().get<std::uint8_t>() + l * b.q_idx_elems(),
                                   rows * s.indexer_heads * kIndexerDim);
  c.weights = download<float>(b.weights_memory().get<float>() + l * b.weight_elems(), rows * s.indexer_heads);
  c.loaded = true;
}

// Replays the step once over sentinels and checks the checked layer's outputs: for the sparse
// path (a) the logits against the reference indexer, (b) the slots as a top-k of the GPU's own
// logits, (c) o and lse against the reference sparse decode over the GPU's own slots; for the
// dense path o and lse against the reference dense decode. Returns "pass (...)" or "FAIL: ...".
std::string check_step(const StrategyOps& ops, const Graph& graph, CheckedLayer& c, const StepShape& s,
                       const StepTables& t, const StepBuffers& b, const DevicePool& pool, bool dense,
                       cudaStream_t stream) {
  const int l = c.layer;
  const std::size_t rows = static_cast<std::size_t>(c.checked) * s.q_len;
  const TensorView o = b.o(l), lse = b.lse(l);
  cuda_ok(cudaMemsetAsync(o.data, kOutputSentinel, b.o_elems() * 2, stream), "sentinel o");
  cuda_ok(cudaMemsetAsync(lse.data, kOutputSentinel, b.lse_elems() * 4, stream), "sentinel lse");
  const std::int64_t max_len = std::int64_t{t.max_pages} * s.page_size;
  if (!dense) {
    const DsaSteps& st = ops.steps(l);
    cuda_ok(cudaMemsetAsync(st.indexer.logits.data, kLogitsSentinel, st.indexer.logits.numel() * 4, stream),
            "sentinel logits");
    cuda_ok(cudaMemsetAsync(st.topk.slots.data, kSlotsSentinel, st.topk.slots.numel() * 4, stream), "sentinel slots");
  }
  graph.launch(stream);
  cuda_ok(cudaStreamSynchronize(stream), "the checked step");
  load_checked_layer(c, s, pool, b);

  const std::int64_t checked = c.checked, q_len = s.q_len;
  LatentCache cache = pool.cache();
  cache.data = c.cache.data();
  cache.device = Device::cpu();
  IndexerCache indexer = pool.indexer();
  indexer.data = c.indexer.data();
  indexer.device = Device::cpu();
  std::vector<std::int32_t> table(t.block_table.begin(), t.block_table.begin() + checked * t.max_pages);
  std::vector<std::int32_t> lens(t.seq_lens.begin(), t.seq_lens.begin() + checked);
  const auto host = [](auto& v, DType dtype, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(v.data(), dtype, shape);
  };
  std::vector<double> want_o(rows * s.heads * kLatentDim), want_lse(rows * s.heads);
  std::string stages;
  try {
    if (dense) {
      MlaDecodeParams p;
      p.q = host(c.q, DType::kBF16, {checked, q_len, s.heads, kQkDim});
      p.cache = cache;
      p.block_table = host(table, DType::kI32, {checked, t.max_pages});
      p.seq_lens = host(lens, DType::kI32, {checked});
      p.o = host(want_o, DType::kF64, {checked, q_len, s.heads, kLatentDim});
      p.lse = host(want_lse, DType::kF64, {checked, q_len, s.heads});
      p.softmax_scale = static_cast<float>(model_preset(s.model).softmax_scale);
      cpu::mla_decode(p);
    } else {
      const DsaSteps& st = ops.steps(l);
      const std::vector<float> logits =
          download<float>(st.indexer.logits.data, rows * static_cast<std::size_t>(max_len));
      const std::vector<std::int32_t> slots = download<std::int32_t>(st.topk.slots.data, rows * s.topk);
      if (c.ref_logits.empty()) {
        c.ref_logits.resize(logits.size());
        IndexerLogitsParams p;
        p.q = host(c.q_idx, DType::kFP8E4M3, {checked, q_len, s.indexer_heads, kIndexerDim});
        p.weights = host(c.weights, DType::kF32, {checked, q_len, s.indexer_heads});
        p.cache = indexer;
        p.block_table = host(table, DType::kI32, {checked, t.max_pages});
        p.seq_lens = host(lens, DType::kI32, {checked});
        p.logits = host(c.ref_logits, DType::kF32, {checked, q_len, max_len});
        cpu::indexer_logits(p);
      }
      // test_indexer_logits.cpp's bound: float32 sums of exact fp8 products in another order.
      const CheckResult cl = check_close(
          logits.size(), [&](std::size_t i) { return static_cast<double>(logits[i]); },
          [&](std::size_t i) { return static_cast<double>(c.ref_logits[i]); }, 1e-4, 1e-5, 1e-9);
      if (!cl.ok) return "FAIL: layer " + std::to_string(l) + " indexer logits " + cl.detail;
      if (std::string why = topk_problem(logits, slots, s, t, c.checked, max_len); !why.empty()) {
        return "FAIL: layer " + std::to_string(l) + " " + why;
      }
      std::vector<std::int32_t> rows_slots(slots);
      SparseMlaDecodeParams p;
      p.q = host(c.q, DType::kBF16, {checked, q_len, s.heads, kQkDim});
      p.cache = cache;
      p.indices = host(rows_slots, DType::kI32, {checked, q_len, s.topk});
      p.o = host(want_o, DType::kF64, {checked, q_len, s.heads, kLatentDim});
      p.lse = host(want_lse, DType::kF64, {checked, q_len, s.heads});
      p.softmax_scale = static_cast<float>(model_preset(s.model).softmax_scale);
      cpu::sparse_mla_decode(p);
      stages = "logits, top-k, ";
    }
  } catch (const Error& e) {
    return std::string("FAIL: layer ") + std::to_string(l) + " reference rejected the GPU's data: " + e.what();
  }
  const std::vector<std::uint16_t> got_o = download<std::uint16_t>(o.data, want_o.size());
  const std::vector<float> got_lse = download<float>(lse.data, want_lse.size());
  const AttentionCheck outputs = check_attention(got_o, got_lse, want_o, want_lse);
  if (!outputs.ok) return "FAIL: layer " + std::to_string(l) + " " + outputs.detail;
  char buf[160];
  std::snprintf(buf, sizeof buf, "pass (layer %d, %d requests: %so/lse; o 1-cos %.1e)", l, c.checked, stages.c_str(),
                outputs.one_minus_cos);
  return buf;
}

// What every strategy shares: the run, its requests, buffers and caches, and the checked layer.
struct StepSetup {
  const StepRun& job;
  const StepTables& tables;
  const StepBuffers& buffers;
  const std::vector<std::unique_ptr<DevicePool>>& pools;
  CheckedLayer& checked;
  cudaStream_t stream;
  Progress& progress;
};

// A strategy's row before it runs: its ops, their backends and kernels, or why it cannot run.
StrategyResult describe_strategy(const StrategySpec& spec, const StrategyOps& ops) {
  StrategyResult result;
  result.name = spec.name;
  result.dense = spec.dense;
  result.backend = spec.backend;
  for (std::size_t i = 0; i < ops.ops().size(); ++i) {
    OpResult op;
    op.op = ops.ops()[i];
    const bool decode = op.op == StepOp::kSparseDecode || op.op == StepOp::kDenseDecode;
    op.backend = decode ? spec.backend : "cuda";
    op.kernel = i < ops.kernels().size() ? ops.kernels()[i] : "";
    result.ops.push_back(op);
  }
  if (!ops.runnable()) result.status = ops.status();
  return result;
}

// Binds, captures, checks and times one strategy: the whole step's graph, then each op's graph
// across all layers. No time is taken for an output that failed its check.
void run_strategy(StrategyResult& result, StrategyOps& ops, const StepSetup& setup) {
  const StepShape& s = setup.job.shape;
  cudaStream_t stream = setup.stream;
  const std::string what = result.name + ": ";
  setup.progress.update(what + "capturing the step");
  ops.bind(setup.buffers, setup.pools, setup.job.fault_checks);
  ops.launch_step(stream);  // once eagerly: errors surface here, outside any capture
  cuda_ok(cudaStreamSynchronize(stream), ("the step of " + result.name).c_str());
  try {
    ops.throw_fault();
  } catch (const Error& e) {
    result.status = std::string("FAIL: ") + e.what();
    return;
  }
  const Graph step(stream, [&] { ops.launch_step(stream); });

  if (setup.job.check_requests > 0) {
    setup.progress.update(what + "checking against the float64 reference");
    result.status = check_step(ops, step, setup.checked, s, setup.tables, setup.buffers,
                               *setup.pools[static_cast<std::size_t>(setup.checked.layer)], result.dense, stream);
    if (result.status.rfind("FAIL", 0) == 0) return;
  } else {
    result.status = "unchecked";
  }

  setup.progress.update(what + "timing the step");
  const Timing whole = time_calls([&](int) { step.launch(stream); }, setup.job.warmup, setup.job.iters, stream);
  result.timed = true;
  result.step_us = whole.median_us;
  result.step_p10_us = whole.p10_us;
  result.step_p90_us = whole.p90_us;
  std::string paced;  // which timings' holds timed out
  if (!whole.queued) paced = "the step";
  for (std::size_t i = 0; i < result.ops.size(); ++i) {
    setup.progress.update(what + "timing each op alone", static_cast<int>(i + 1), static_cast<int>(result.ops.size()));
    const StepOp op = result.ops[i].op;
    // Alone, the top-k runs another path (it clears its own row state): its slots are checked
    // after its timed replays, from sentinels.
    const bool check_alone = op == StepOp::kTopk && setup.job.check_requests > 0;
    const int last = s.layers - 1;
    if (check_alone) {
      const TensorView& slots = ops.steps(last).topk.slots;
      cuda_ok(cudaMemsetAsync(slots.data, kSlotsSentinel, slots.numel() * 4, stream), "sentinel slots");
      cuda_ok(cudaStreamSynchronize(stream), "sentinel slots");  // the stream idle before the capture
    }
    int launches = 0;
    const Timing t = time_graphs(
        [&](int) {
          for (int l = 0; l < s.layers; ++l) ops.launch(op, l, stream, true);
        },
        1, setup.job.warmup, setup.job.iters, stream, Launch::kQueued, &launches);
    result.ops[i].launches = static_cast<double>(launches) / std::max(s.layers, 1);
    result.ops[i].us = t.median_us;
    result.ops[i].p10_us = t.p10_us;
    result.ops[i].p90_us = t.p90_us;
    if (!t.queued) paced += (paced.empty() ? "" : ", ") + std::string(step_op_name(op));
    if (check_alone) {
      const DsaSteps& st = ops.steps(last);
      const std::int64_t max_len = std::int64_t{setup.tables.max_pages} * s.page_size;
      const std::size_t rows = static_cast<std::size_t>(setup.checked.checked) * s.q_len;
      const std::vector<float> logits =
          download<float>(st.indexer.logits.data, rows * static_cast<std::size_t>(max_len));
      const std::vector<std::int32_t> slots = download<std::int32_t>(st.topk.slots.data, rows * s.topk);
      const std::string why = topk_problem(logits, slots, s, setup.tables, setup.checked.checked, max_len);
      if (!why.empty()) {
        result.timed = false;
        result.status = "FAIL: the top-k timed alone, layer " + std::to_string(last) + " " + why;
        return;
      }
    }
  }
  result.status += "; " + std::to_string(ops.num_splits()) + " decode splits";
  if (!paced.empty()) result.status += "; partly paced by the host (the hold timed out): " + paced;
}

std::string gigabytes(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GB", bytes / 1e9);
  return buf;
}

}  // namespace

StepReport run_step_gpu(const StepRun& job) {
  const StepShape& s = job.shape;
  Progress progress("step", job.progress);
  progress.update("measuring the copy bandwidth, the bf16 matrix rate and a chained launch");
  BenchContext ctx;  // the device, a stream, and the bandwidth ceilings of this run
  const DeviceInfo& device = ctx.device;
  cudaStream_t stream = ctx.stream;
  const MatrixRate matrix = measure_bf16_matrix_rate(kMatrixN, stream);

  StepReport report;
  report.device = ctx.report.device;
  report.read_gbps = ctx.report.read_gbps;
  report.copy_gbps = ctx.report.copy_gbps;
  report.launch_us = measure_chained_launch_us(stream);
  report.matrix_tflops = matrix.tflops;
  report.matrix_how = matrix.how;
  report.shape = s;
  report.warmup = job.warmup;
  report.iters = job.iters;
  report.seed = job.seed;
  if (const std::string note = l2_residency_note(s, static_cast<double>(ctx.l2_bytes)); !note.empty()) {
    report.notes.push_back(note);
  }

  // Backends, kernels and workspaces from shapes alone, then the memory check, before any cache.
  const StepTables tables = make_step_tables(s, job.seed);
  const StepBuffers shapes(s, tables.max_pages, false);
  std::vector<std::unique_ptr<StrategyOps>> strategies;
  std::size_t largest_workspace = 0;
  for (const StrategySpec& spec : job.strategies) {
    strategies.push_back(std::make_unique<StrategyOps>(spec, s, shapes, tables.num_pages, device));
    largest_workspace = std::max(largest_workspace, strategies.back()->workspace_bytes());
  }
  const double cache_bytes = static_cast<double>(s.layers) * static_cast<double>(tables.num_pages * s.page_size) *
                             static_cast<double>(kFp8TokenBytes + kIndexerTokenBytes);
  const double input_bytes = static_cast<double>(StepBuffers::bytes_for(s, tables.max_pages));
  const double needed = cache_bytes + input_bytes + static_cast<double>(largest_workspace + kHeadroomBytes);
  std::size_t free_bytes = 0, total_bytes = 0;
  cuda_ok(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  if (needed > static_cast<double>(free_bytes)) {
    throw Error("step", std::to_string(s.layers) + " layers x " + std::to_string(s.pool_tokens) +
                            " slots of cache need " + gigabytes(cache_bytes) +
                            " (788 B a slot: main + indexer); with the inputs (" + gigabytes(input_bytes) +
                            "), the largest workspace (" + gigabytes(static_cast<double>(largest_workspace)) +
                            ") and " + gigabytes(static_cast<double>(kHeadroomBytes)) + " of headroom, " +
                            gigabytes(needed) + "; the GPU has " + gigabytes(static_cast<double>(free_bytes)) +
                            " free of " + gigabytes(static_cast<double>(total_bytes)) +
                            ": lower --pool, --layers or --batch");
  }

  // Every layer's caches, filled with random tokens through the library's append.
  std::vector<std::unique_ptr<DevicePool>> pools;
  for (int l = 0; l < s.layers; ++l) {
    progress.update("filling layer caches", l + 1, s.layers);
    pools.push_back(std::make_unique<DevicePool>(s.pool_tokens, s.page_size, KvDtype::kFp8E4M3, true,
                                                 job.seed * 1000003 + static_cast<std::uint64_t>(l), stream));
  }

  // Inputs: bf16 on the device; the fp8 indexer queries and their weights from the host generator.
  StepBuffers buffers(s, tables.max_pages, true);
  const std::size_t layers = static_cast<std::size_t>(s.layers), rows = static_cast<std::size_t>(s.batch) * s.q_len;
  launch_random_bf16(buffers.latent_memory().get<std::uint16_t>(), layers * rows * kQkDim, job.seed * 31 + 1, 1.0f,
                     stream);
  launch_random_bf16(buffers.keys_memory().get<std::uint16_t>(), layers * rows * kIndexerDim, job.seed * 31 + 2, 1.0f,
                     stream);
  launch_random_bf16(buffers.q_memory().get<std::uint16_t>(), layers * buffers.q_elems(), job.seed * 31 + 3, 1.0f,
                     stream);
  {
    std::vector<std::uint8_t> q_idx(layers * buffers.q_idx_elems());
    std::vector<float> weights(layers * buffers.weight_elems());
    fill_random_fp8(q_idx.data(), q_idx.size(), job.seed * 31 + 4);
    fill_random_f32(weights.data(), weights.size(), job.seed * 31 + 5,
                    1.0f / std::sqrt(static_cast<float>(s.indexer_heads * kIndexerDim)));
    cuda_ok(cudaMemcpy(buffers.q_idx_memory().get(), q_idx.data(), q_idx.size(), cudaMemcpyHostToDevice),
            "q_idx upload");
    cuda_ok(cudaMemcpy(buffers.weights_memory().get(), weights.data(), weights.size() * 4, cudaMemcpyHostToDevice),
            "weights upload");
  }
  cuda_ok(cudaMemcpy(buffers.table_memory().get(), tables.block_table.data(), tables.block_table.size() * 4,
                     cudaMemcpyHostToDevice),
          "table upload");
  cuda_ok(cudaMemcpy(buffers.lens_memory().get(), tables.seq_lens.data(), tables.seq_lens.size() * 4,
                     cudaMemcpyHostToDevice),
          "lengths upload");
  cuda_ok(cudaMemcpy(buffers.slots_memory().get(), tables.new_slots.data(), tables.new_slots.size() * 4,
                     cudaMemcpyHostToDevice),
          "slots upload");
  cuda_ok(cudaStreamSynchronize(stream), "inputs");

  CheckedLayer checked;
  checked.layer = s.layers - 1;  // the last layer: the shared workspace still holds its logits and slots
  checked.checked = job.check_requests;
  const StepSetup setup{job, tables, buffers, pools, checked, stream, progress};
  for (std::size_t k = 0; k < strategies.size(); ++k) {
    StrategyResult result = describe_strategy(job.strategies[k], *strategies[k]);
    try {
      if (strategies[k]->runnable()) run_strategy(result, *strategies[k], setup);
    } catch (const std::exception& e) {  // an op rejected its arguments, or CUDA failed: the others still run
      result.timed = false;
      result.status = std::string("FAIL: ") + e.what();
      // A failed runtime call leaves its error for the next cudaGetLastError(), which the next
      // strategy's launch checks would report as their own: cleared here. (An error the context
      // keeps fails every later call anyway, under its own name.)
      cudaGetLastError();
    }
    strategies[k].reset();  // its workspace and graphs: the next strategy gets the memory
    report.strategies.push_back(std::move(result));
  }
  progress.finish();
  return report;
}

}  // namespace latentkv::tools
