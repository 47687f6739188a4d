// examples/dsa_layer.cpp - one DSA attention layer through its requests' lives, driven as an engine
// drives latentkv, through the installed library's public API alone:
//   1. resolve the configuration (LATENTKV_* variables, a LATENTKV_CONFIG file, defaults) into a
//      backend per op, refused up front with a readable error when it cannot run here;
//   2. page a pool, and append the prompts' earlier chunks (latents and indexer keys, quantized on
//      the way);
//   3. prefill each prompt's last chunk: append it, then indexer -> top-k -> sparse MLA for every
//      new token as one dsa_prefill call; the rows that see at most index_topk tokens are also run
//      through the dense_prefill slot, as the configuration's DSA rule allows, and must agree;
//   4. plan the decode (indexer -> top-k -> sparse decode) once, for fixed shapes, and decode a few
//      tokens: each step appends every request's newest token and runs the layer.
// On a GPU the decode step (append + dsa_decode) runs once as plain calls, is then captured in a CUDA
// graph, and the later steps replay it while the lengths, slots and block table change in device
// memory; the last step is checked against the CPU reference over the GPU's own top-k selection.
// Without a GPU the same calls run on the CPU reference.
//
//   cmake -S examples -B build-example -DCMAKE_PREFIX_PATH=<where latentkv is installed>
//   cmake --build build-example && build-example/dsa_layer
//   LATENTKV_TP=4 build-example/dsa_layer        # 16 heads per GPU instead of 8
//   build-example/dsa_layer --require-gpu         # fail rather than run on the CPU reference
#include <latentkv/backend.hpp>
#include <latentkv/config.hpp>
#include <latentkv/dsa.hpp>
#include <latentkv/environment.hpp>
#include <latentkv/paging.hpp>
#include <latentkv/version.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#ifdef LKV_WITH_CUDA  // defined by the latentkv package when the library holds the CUDA backends
#include <cuda_runtime.h>
#define CUDA_OK(call)                                                                                    \
  do {                                                                                                   \
    const cudaError_t err_ = (call);                                                                     \
    if (err_ != cudaSuccess) throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(err_)); \
  } while (0)
#endif

namespace {

using namespace latentkv;

const std::vector<std::int64_t> kPromptLengths = {2500, 1200};  // one past index_topk, one within it
constexpr int kChunk = 16;  // new tokens per request in the prefill shown (a prompt's last chunk)
constexpr int kSteps = 3;   // tokens decoded per request

// Memory where the ops run: the GPU's when there is one, the host's otherwise.
struct Memory {
  bool gpu = false;
  void* stream = nullptr;  // cudaStream_t on the GPU

  void* allocate(std::size_t bytes) const {
#ifdef LKV_WITH_CUDA
    if (gpu) {
      void* p = nullptr;
      CUDA_OK(cudaMalloc(&p, bytes));
      CUDA_OK(cudaMemset(p, 0, bytes));
      return p;
    }
#endif
    return std::calloc(bytes, 1);
  }
  void release(void* p) const {
#ifdef LKV_WITH_CUDA
    if (gpu) {
      cudaFree(p);
      return;
    }
#endif
    std::free(p);
  }
  // Queued on the stream on the GPU (an engine's own kernels would write these in place).
  void upload(void* dst, const void* src, std::size_t bytes) const {
#ifdef LKV_WITH_CUDA
    if (gpu) {
      CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, static_cast<cudaStream_t>(stream)));
      return;
    }
#endif
    std::memcpy(dst, src, bytes);
  }
  // Waits for the stream first on the GPU.
  void download(void* dst, const void* src, std::size_t bytes) const {
#ifdef LKV_WITH_CUDA
    if (gpu) {
      CUDA_OK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, static_cast<cudaStream_t>(stream)));
      CUDA_OK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
      return;
    }
#endif
    std::memcpy(dst, src, bytes);
  }
};

// A buffer of `count` elements of T where the ops run, with a host copy to fill and read back.
template <typename T>
struct Buffer {
  const Memory* memory;
  std::vector<T> host;
  void* data;
  Buffer(const Memory& m, std::size_t count) : memory(&m), host(count), data(m.allocate(count * sizeof(T))) {}
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { memory->release(data); }
  void upload() { memory->upload(data, host.data(), host.size() * sizeof(T)); }
  void download() { memory->download(host.data(), data, host.size() * sizeof(T)); }
};

void fill_normal(std::mt19937_64& rng, std::vector<std::uint16_t>& bf16) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& x : bf16) x = bf16_encode(normal(rng));
}

// Indexer queries (fp8) and head weights (q scale and constants folded in), at random.
void fill_indexer_queries(std::mt19937_64& rng, std::vector<std::uint8_t>& q_idx, std::vector<float>& weights,
                          int indexer_heads) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& c : q_idx) c = fp8_e4m3_encode(normal(rng));
  for (auto& w : weights) w = normal(rng) / std::sqrt(static_cast<float>(indexer_heads * kIndexerDim));
}

// Largest |a - b| over bf16 pairs; `bad` counts pairs further apart than `slack` times SPEC's bf16
// output bound (taken at the larger of the two magnitudes).
double largest_bf16_difference(const std::uint16_t* a, const std::uint16_t* b, std::size_t n, double slack,
                               std::int64_t& bad) {
  double worst = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = bf16_decode(a[i]), y = bf16_decode(b[i]), d = std::fabs(x - y);
    worst = std::max(worst, d);
    bad += !(d <= slack * std::max(1e-3, 2.0 / 128.0 * std::max(std::fabs(x), std::fabs(y))));
  }
  return worst;
}

int run_example(bool require_gpu) {
  // 1. The configuration, resolved for this machine's device (the GPU when there is one); a misspelt
  // LATENTKV_* variable is said, not ignored.
  for (const std::string& line : unread_environment_warnings(process_environment_names())) {
    std::fprintf(stderr, "warning: %s\n", line.c_str());
  }
  const AttentionConfig config = load_config({{}, process_environment()});
  const ResolvedConfig rc = resolve_config(config);
  if (require_gpu && rc.device.kind != DeviceKind::kCuda) {
    throw std::runtime_error("--require-gpu: no CUDA device is usable here (device: " + describe_device(rc.device) +
                             "), or this latentkv was built without its CUDA backends");
  }
  const ModelPreset& model = rc.shard.model;
  const int heads = rc.shard.heads_per_gpu, indexer_heads = model.indexer_heads, page_size = config.page_size.value;
  const KvDtype kv_dtype = config.kv_dtype.value;
  const Backend& append_backend = *rc.supporting_op(Op::kAppend).backend;
  const DsaBackends backends = rc.dsa_backends();  // what dsa_prefill and dsa_decode run, step by step
  std::printf("%s at tp %d on %s: %d heads, %s cache, page size %d; backends: append %s, indexer %s, top-k %s, "
              "indexer prefill %s, sparse prefill %s, sparse decode %s\n",
              model.name.c_str(), rc.shard.tp, describe_device(rc.device).c_str(), heads,
              std::string(kv_dtype_name(kv_dtype)).c_str(), page_size, std::string(append_backend.name()).c_str(),
              std::string(backends.indexer_logits->name()).c_str(), std::string(backends.topk->name()).c_str(),
              std::string(backends.indexer_prefill->name()).c_str(),
              std::string(backends.sparse_prefill->name()).c_str(),
              std::string(backends.sparse_decode->name()).c_str());

  Memory memory;
  memory.gpu = rc.device.kind == DeviceKind::kCuda;
  const Device device = memory.gpu ? Device::cuda(rc.device.index) : Device::cpu();
#ifdef LKV_WITH_CUDA
  cudaStream_t stream = nullptr;
  if (memory.gpu) CUDA_OK(cudaStreamCreate(&stream));
  const std::unique_ptr<std::remove_pointer_t<cudaStream_t>, decltype(&cudaStreamDestroy)> stream_owner(
      stream, &cudaStreamDestroy);
  memory.stream = stream;
#endif
  const ExecContext context{memory.stream};
  const auto view = [&](void* data, DType dtype, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(data, dtype, shape, device);
  };

  // 2. A shuffled pool with room for every request's last token, its caches, and the prompts.
  const auto batch = static_cast<std::int64_t>(kPromptLengths.size());
  const std::int64_t longest = *std::max_element(kPromptLengths.begin(), kPromptLengths.end()) + kSteps;
  const auto pages_for = [&](std::int64_t tokens) { return (tokens + page_size - 1) / page_size; };
  std::int64_t num_pages = 4;  // a few to spare
  for (std::int64_t len : kPromptLengths) num_pages += pages_for(len + kSteps);
  PageAllocator pool(num_pages, page_size, /*shuffle_seed=*/7);
  const int max_pages = static_cast<int>(pages_for(longest));
  Buffer<std::uint8_t> cache_bytes(memory, static_cast<std::size_t>(num_pages * page_size) * kv_token_bytes(kv_dtype));
  Buffer<std::uint8_t> indexer_bytes(memory, static_cast<std::size_t>(num_pages * page_size) * kIndexerTokenBytes);
  const LatentCache cache{.data = static_cast<std::uint8_t*>(cache_bytes.data), .dtype = kv_dtype,
                          .num_pages = num_pages, .page_size = page_size, .device = device};
  const IndexerCache indexer{.data = static_cast<std::uint8_t*>(indexer_bytes.data), .num_pages = num_pages,
                             .page_size = page_size, .device = device};
  // Where the GPU kernels note a bad value they skipped (latentkv/device_fault.hpp); the reference throws.
  Buffer<DeviceFault> fault(memory, 1);  // zeroed: no fault
  DeviceFault* const fault_record = memory.gpu ? static_cast<DeviceFault*>(fault.data) : nullptr;
  const auto throw_recorded_fault = [&] {
    if (!memory.gpu) return;
    fault.download();
    throw_device_fault(fault.host[0]);  // the Error the reference raises for that value
  };
  // n tokens' latents [n, 576] bf16 and indexer keys [n, 128] bf16 into both caches at slots [n] i32.
  const auto append_of = [&](void* latents, void* keys, void* slots, std::int64_t n) {
    AppendParams p;
    p.cache = cache;
    p.indexer = indexer;
    p.latent = view(latents, DType::kBF16, {n, kQkDim});
    p.indexer_keys = view(keys, DType::kBF16, {n, kIndexerDim});
    p.slots = view(slots, DType::kI32, {n});
    p.fault = fault_record;
    return p;
  };

  // The requests' pages and lengths, as the ops read them: [B, max_pages] and [B] i32.
  Buffer<std::int32_t> block_table(memory, static_cast<std::size_t>(batch * max_pages));
  Buffer<std::int32_t> seq_lens(memory, static_cast<std::size_t>(batch));
  std::vector<RequestId> requests;
  for (std::size_t b = 0; b < kPromptLengths.size(); ++b) requests.push_back(pool.add_request());
  const auto upload_pages = [&] {
    block_table.host = pool.block_table_matrix(requests, max_pages);
    seq_lens.host = pool.lengths(requests);
    block_table.upload();
    seq_lens.upload();
  };
  // Appends `count[b]` new tokens (random latents and keys) to each request b, in one call.
  std::mt19937_64 rng(1);
  const auto append_new_tokens = [&](const std::vector<std::int64_t>& count) {
    std::int64_t n = 0;
    for (std::int64_t c : count) n += c;
    Buffer<std::uint16_t> latents(memory, static_cast<std::size_t>(n) * kQkDim);
    Buffer<std::uint16_t> keys(memory, static_cast<std::size_t>(n) * kIndexerDim);
    Buffer<std::int32_t> slots(memory, static_cast<std::size_t>(n));
    fill_normal(rng, latents.host);
    fill_normal(rng, keys.host);
    std::size_t i = 0;
    for (std::size_t b = 0; b < requests.size(); ++b) {
      const std::int64_t first = pool.length(requests[b]);
      pool.grow(requests[b], count[b]);
      for (std::int64_t t = first; t < first + count[b]; ++t) {
        slots.host[i++] = static_cast<std::int32_t>(pool.slot(requests[b], t));
      }
    }
    latents.upload();
    keys.upload();
    slots.upload();
    run(append_backend, append_of(latents.data, keys.data, slots.data, n), context, rc.device);
    latents.download();  // waits for the append before the buffers go
    throw_recorded_fault();
  };
  // The prompts' earlier chunks, whose attention an engine ran before (not shown).
  std::vector<std::int64_t> earlier;
  for (std::int64_t len : kPromptLengths) earlier.push_back(len - kChunk);
  append_new_tokens(earlier);

  // 3. Prefill the last chunk: its tokens appended, then one dsa_prefill over all its rows
  // (T = B x kChunk new tokens, request b's rows [cu[b], cu[b + 1])).
  append_new_tokens(std::vector<std::int64_t>(kPromptLengths.size(), kChunk));
  upload_pages();
  const std::int64_t new_tokens = batch * kChunk;
  Buffer<std::uint16_t> chunk_q(memory, static_cast<std::size_t>(new_tokens * heads) * kQkDim);  // [T, H, 576] bf16
  Buffer<std::uint8_t> chunk_q_idx(memory, static_cast<std::size_t>(new_tokens * indexer_heads) * kIndexerDim);
  Buffer<float> chunk_weights(memory, static_cast<std::size_t>(new_tokens * indexer_heads));  // [T, Hi]
  Buffer<std::int32_t> cu_new_tokens(memory, static_cast<std::size_t>(batch + 1));             // [B + 1]
  Buffer<std::uint16_t> chunk_o(memory, static_cast<std::size_t>(new_tokens * heads) * kLatentDim);  // [T, H, 512]
  Buffer<float> chunk_lse(memory, static_cast<std::size_t>(new_tokens * heads));                     // [T, H]
  fill_normal(rng, chunk_q.host);
  fill_indexer_queries(rng, chunk_q_idx.host, chunk_weights.host, indexer_heads);
  for (std::size_t b = 0; b < cu_new_tokens.host.size(); ++b) {
    cu_new_tokens.host[b] = static_cast<std::int32_t>(b * kChunk);
  }
  chunk_q.upload();
  chunk_q_idx.upload();
  chunk_weights.upload();
  cu_new_tokens.upload();
  DsaPrefillParams prefill;
  prefill.q = view(chunk_q.data, DType::kBF16, {new_tokens, heads, kQkDim});
  prefill.q_idx = view(chunk_q_idx.data, DType::kFP8E4M3, {new_tokens, indexer_heads, kIndexerDim});
  prefill.weights = view(chunk_weights.data, DType::kF32, {new_tokens, indexer_heads});
  prefill.cu_new_tokens = view(cu_new_tokens.data, DType::kI32, {batch + 1});
  prefill.cache = cache;
  prefill.indexer = indexer;
  prefill.block_table = view(block_table.data, DType::kI32, {batch, max_pages});
  prefill.seq_lens = view(seq_lens.data, DType::kI32, {batch});
  prefill.o = view(chunk_o.data, DType::kBF16, {new_tokens, heads, kLatentDim});
  prefill.lse = view(chunk_lse.data, DType::kF32, {new_tokens, heads});
  prefill.softmax_scale = static_cast<float>(model.softmax_scale);
  prefill.topk = model.index_topk;
  prefill.fault = fault_record;
  const DsaPrefillPlan prefill_plan = plan_dsa_prefill(backends, prefill, rc.device);
  Buffer<std::uint8_t> prefill_workspace(memory, prefill_plan.workspace_bytes);
  prefill.workspace = prefill_workspace.data;
  prefill.workspace_bytes = prefill_plan.workspace_bytes;
  dsa_prefill(backends, prefill, prefill_plan, context, rc.device);
  chunk_o.download();
  chunk_lse.download();
  throw_recorded_fault();
  for (std::size_t b = 0; b < requests.size(); ++b) {
    const std::int64_t last_row = (static_cast<std::int64_t>(b) + 1) * kChunk - 1;
    std::printf("prefill of request %zu's last %d tokens: its rows see %lld .. %lld tokens (the model's rule: %s); "
                "lse of its last row, head 0: %.5f\n",
                b, kChunk, static_cast<long long>(kPromptLengths[b] - kChunk + 1),
                static_cast<long long>(kPromptLengths[b]),
                std::string(slot_name(rc.route(Phase::kPrefill, kPromptLengths[b]))).c_str(),
                chunk_lse.host[static_cast<std::size_t>(last_row * heads)]);
  }

  // The DSA rule: rows that see at most index_topk tokens keep every token in their top-k, so the
  // dense_prefill slot serves them exactly. Request 1's chunk through that slot's backend must give
  // its dsa_prefill rows again (two computations, each within SPEC's bound: twice the bound apart).
  {
    const std::size_t request = 1;  // rc.route(Phase::kPrefill, 1200) is Slot::kDensePrefill
    const Backend& dense_backend = *rc.slot(Slot::kDensePrefill).backend;
    Buffer<std::int32_t> one_request(memory, 2);  // cu_new_tokens of a one-request call
    one_request.host = {0, kChunk};
    one_request.upload();
    Buffer<std::uint16_t> dense_o(memory, static_cast<std::size_t>(kChunk * heads) * kLatentDim);
    Buffer<float> dense_lse(memory, static_cast<std::size_t>(kChunk * heads));
    const std::size_t first_row = request * kChunk * static_cast<std::size_t>(heads);
    MlaPrefillParams dense;
    auto* const request_q = static_cast<std::uint16_t*>(chunk_q.data) + first_row * kQkDim;
    dense.q = view(request_q, DType::kBF16, {kChunk, heads, kQkDim});
    dense.cu_new_tokens = view(one_request.data, DType::kI32, {2});
    dense.cache = cache;
    auto* const request_pages = static_cast<std::int32_t*>(block_table.data) + request * max_pages;
    dense.block_table = view(request_pages, DType::kI32, {1, max_pages});
    dense.seq_lens = view(static_cast<std::int32_t*>(seq_lens.data) + request, DType::kI32, {1});
    dense.o = view(dense_o.data, DType::kBF16, {kChunk, heads, kLatentDim});
    dense.lse = view(dense_lse.data, DType::kF32, {kChunk, heads});
    dense.softmax_scale = prefill.softmax_scale;
    dense.fault = fault_record;
    const Plan dense_plan = dense_backend.plan(dense, rc.device);
    Buffer<std::uint8_t> dense_workspace(memory, dense_plan.workspace_bytes);
    dense.num_splits = dense_plan.num_splits;
    dense.workspace = dense_workspace.data;
    dense.workspace_bytes = dense_plan.workspace_bytes;
    run(dense_backend, dense, context, rc.device);
    dense_o.download();
    dense_lse.download();
    throw_recorded_fault();
    std::int64_t bad = 0;
    const double o_gap = largest_bf16_difference(dense_o.host.data(), chunk_o.host.data() + first_row * kLatentDim,
                                                 dense_o.host.size(), 2.0, bad);
    double lse_gap = 0;
    for (std::size_t i = 0; i < dense_lse.host.size(); ++i) {
      lse_gap = std::max(lse_gap, std::fabs(static_cast<double>(dense_lse.host[i]) - chunk_lse.host[first_row + i]));
    }
    bad += !(lse_gap <= 2e-5);
    std::printf("request %zu's chunk again through dense_prefill (backend %s): largest |o difference| %.3g, "
                "|lse difference| %.3g from its dsa_prefill rows: %s\n",
                request, std::string(dense_backend.name()).c_str(), o_gap, lse_gap, bad == 0 ? "ok" : "FAILED");
    if (bad != 0) return 1;
  }

  // 4. Decode: one step's inputs and outputs, and the layer's plan and workspace (fixed shapes:
  // planned once).
  Buffer<std::uint16_t> new_latents(memory, static_cast<std::size_t>(batch) * kQkDim);
  Buffer<std::uint16_t> new_keys(memory, static_cast<std::size_t>(batch) * kIndexerDim);
  Buffer<std::int32_t> new_slots(memory, static_cast<std::size_t>(batch));
  Buffer<std::uint16_t> q(memory, static_cast<std::size_t>(batch * heads) * kQkDim);  // [B, 1, H, 576] bf16
  // [B, 1, Hi, 128] fp8
  Buffer<std::uint8_t> q_idx(memory, static_cast<std::size_t>(batch * indexer_heads) * kIndexerDim);
  Buffer<float> weights(memory, static_cast<std::size_t>(batch * indexer_heads));  // [B, 1, Hi]
  Buffer<std::uint16_t> o(memory, static_cast<std::size_t>(batch * heads) * kLatentDim);  // [B, 1, H, 512] bf16
  Buffer<float> lse(memory, static_cast<std::size_t>(batch * heads));                     // [B, 1, H]

  AppendParams append = append_of(new_latents.data, new_keys.data, new_slots.data, batch);
  DsaDecodeParams layer;
  layer.q = view(q.data, DType::kBF16, {batch, 1, heads, kQkDim});
  layer.q_idx = view(q_idx.data, DType::kFP8E4M3, {batch, 1, indexer_heads, kIndexerDim});
  layer.weights = view(weights.data, DType::kF32, {batch, 1, indexer_heads});
  layer.cache = cache;
  layer.indexer = indexer;
  layer.block_table = view(block_table.data, DType::kI32, {batch, max_pages});
  layer.seq_lens = view(seq_lens.data, DType::kI32, {batch});
  layer.o = view(o.data, DType::kBF16, {batch, 1, heads, kLatentDim});
  layer.lse = view(lse.data, DType::kF32, {batch, 1, heads});
  layer.softmax_scale = static_cast<float>(model.softmax_scale);
  layer.topk = model.index_topk;
  layer.fault = fault_record;
  const DsaPlan plan = plan_dsa_decode(backends, layer, rc.device);
  Buffer<std::uint8_t> workspace(memory, plan.workspace_bytes);  // allocated zeroed, and kept so by the calls
  layer.workspace = workspace.data;
  layer.workspace_bytes = plan.workspace_bytes;
  layer.workspace_cleared = true;
  std::printf("dsa_decode plan: %zu workspace bytes (logits, top-k slots, scratch); sparse decode splits: %d\n",
              plan.workspace_bytes, plan.sparse.num_splits);

  const auto run_step = [&] {
    run(append_backend, append, context, rc.device);
    dsa_decode(backends, layer, plan, context, rc.device);
  };
#ifdef LKV_WITH_CUDA
  // On the GPU the first step runs as plain calls (their first launches set the kernels up, which
  // is not for a capture), then the step is captured once: later steps replay it, and each replay
  // reads what the buffers hold by then.
  cudaGraphExec_t graph_exec = nullptr;
  std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, decltype(&cudaGraphExecDestroy)> graph_owner(
      nullptr, &cudaGraphExecDestroy);
  const auto capture_step = [&] {
    cudaGraph_t graph = nullptr;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    try {
      run_step();
    } catch (...) {  // end the capture so that the stream (and the memory frees) work again
      cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      cudaGetLastError();
      throw;
    }
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    const cudaError_t instantiated = cudaGraphInstantiate(&graph_exec, graph, 0);
    cudaGraphDestroy(graph);
    CUDA_OK(instantiated);
    graph_owner.reset(graph_exec);
  };
#endif

  // Each step every request's newest token is appended, then the layer attends over it all. (A row
  // that sees at most index_topk tokens, like request 1's, could go to the dense_decode slot instead,
  // as in the prefill above.)
  for (int step = 1; step <= kSteps; ++step) {
    for (std::size_t b = 0; b < requests.size(); ++b) {
      pool.grow(requests[b], 1);  // may take a new page: the block table below changes with it
      new_slots.host[b] = static_cast<std::int32_t>(pool.slot(requests[b], pool.length(requests[b]) - 1));
    }
    upload_pages();
    fill_normal(rng, new_latents.host);
    fill_normal(rng, new_keys.host);
    fill_normal(rng, q.host);
    fill_indexer_queries(rng, q_idx.host, weights.host, indexer_heads);
    for (auto* b : {&new_latents, &new_keys, &q}) b->upload();
    new_slots.upload();
    q_idx.upload();
    weights.upload();
    bool replayed = false;
#ifdef LKV_WITH_CUDA
    if (graph_exec) {
      CUDA_OK(cudaGraphLaunch(graph_exec, stream));
      replayed = true;
    }
#endif
    if (!replayed) run_step();
    o.download();  // on the GPU, after the step
    lse.download();
    throw_recorded_fault();
    double mean_abs = 0;
    for (std::uint16_t x : o.host) mean_abs += std::fabs(bf16_decode(x));
    std::printf("step %d (%s): lengths %d and %d; lse of request 0, head 0: %.5f; mean |o| %.5f\n", step,
                replayed ? "graph replay" : "calls",
                seq_lens.host[0], seq_lens.host[1], lse.host[0], mean_abs / static_cast<double>(o.host.size()));
#ifdef LKV_WITH_CUDA
    if (memory.gpu && !graph_exec) capture_step();
#endif
  }

  int status = 0;
  if (memory.gpu) {
    // The last step again on the CPU reference, over the slots the GPU's top-k chose (in the workspace):
    // o within SPEC's bounds for bf16 outputs (per element, and 1 - cos over the tensor), lse within 1e-5.
    const DsaSteps steps = dsa_steps(layer, plan);
    std::vector<std::int32_t> chosen(static_cast<std::size_t>(batch) * model.index_topk);  // [B, 1, topk]
    memory.download(chosen.data(), steps.sparse.indices.data, chosen.size() * sizeof(std::int32_t));
    cache_bytes.download();
    std::vector<double> o_ref(o.host.size()), lse_ref(lse.host.size());
    SparseMlaDecodeParams check;
    check.q = TensorView::contiguous(q.host.data(), DType::kBF16, {batch, 1, heads, kQkDim});
    check.cache = LatentCache{.data = cache_bytes.host.data(), .dtype = kv_dtype, .num_pages = num_pages,
                              .page_size = page_size, .device = Device::cpu()};
    check.indices = TensorView::contiguous(chosen.data(), DType::kI32, {batch, 1, model.index_topk});
    check.o = TensorView::contiguous(o_ref.data(), DType::kF64, {batch, 1, heads, kLatentDim});  // the reference
    check.lse = TensorView::contiguous(lse_ref.data(), DType::kF64, {batch, 1, heads});          // writes f64 too
    check.softmax_scale = layer.softmax_scale;
    run(*find_backend("reference"), check);  // on the CPU, where its tensors are
    std::int64_t bad = 0;
    double worst_o = 0, worst_lse = 0, dot = 0, got_norm = 0, want_norm = 0;
    for (std::size_t i = 0; i < o_ref.size(); ++i) {
      const double got = bf16_decode(o.host[i]), want = o_ref[i], err = std::fabs(got - want);
      worst_o = std::max(worst_o, err);
      bad += !(err <= std::max(1e-3, 2.0 / 128.0 * std::fabs(want)));
      dot += got * want;
      got_norm += got * got;
      want_norm += want * want;
    }
    const double one_minus_cos = got_norm > 0 && want_norm > 0 ? 1.0 - dot / std::sqrt(got_norm * want_norm) : 1.0;
    bad += !(one_minus_cos <= 5e-6);
    for (std::size_t i = 0; i < lse_ref.size(); ++i) {
      const double err = std::fabs(lse.host[i] - lse_ref[i]);
      worst_lse = std::max(worst_lse, err);
      bad += !(err <= 1e-5);
    }
    std::printf("check of the last step against the CPU reference over the same slots: largest |o error| %.3g, "
                "1 - cos(o) %.3g, largest |lse error| %.3g: %s\n",
                worst_o, one_minus_cos, worst_lse, bad == 0 ? "ok" : "FAILED");
    status = bad == 0 ? 0 : 1;
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  bool require_gpu = false;
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--require-gpu") {
      require_gpu = true;
    } else {
      std::fprintf(stderr, "usage: %s [--require-gpu]\n", argv[0]);
      return 2;
    }
  }
  // The library loaded must be one these headers describe, up to its patch level (the package's
  // promise: the same major and minor version); a shared library found elsewhere on the loader's
  // path may not be.
  const std::string minor = std::to_string(LATENTKV_VERSION_MAJOR) + "." + std::to_string(LATENTKV_VERSION_MINOR) + ".";
  if (!std::string_view(latentkv::library_version()).starts_with(minor)) {
    std::fprintf(stderr, "error: built against latentkv %s's headers, but the library loaded is %s\n", LATENTKV_VERSION,
                 latentkv::library_version());
    return 1;
  }
  try {
    return run_example(require_gpu);
  } catch (const latentkv::ConfigError& e) {  // the configuration cannot run here: what to change, and why
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
