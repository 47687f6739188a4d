#include "gpu/measure.hpp"

#include <chrono>
#include <memory>

#include "gpu/kernels.hpp"
#include "latentkv/cache.hpp"
#include "spread.hpp"

namespace latentkv::tools::gpu {

namespace {

// The host-mapped flags of the hold kernel (kernels.hpp): [0] release, [1] timed out.
class Hold {
 public:
  Hold() {
    void* host = nullptr;
    void* device = nullptr;
    cuda_ok(cudaHostAlloc(&host, 2 * sizeof(int), cudaHostAllocMapped), "cudaHostAlloc");
    const cudaError_t mapped = cudaHostGetDevicePointer(&device, host, 0);
    if (mapped != cudaSuccess) cudaFreeHost(host);
    cuda_ok(mapped, "cudaHostGetDevicePointer");
    flags_ = static_cast<volatile int*>(host);
    device_ = static_cast<int*>(device);
  }
  Hold(const Hold&) = delete;
  Hold& operator=(const Hold&) = delete;
  ~Hold() {  // a hold left by an exception is released and drained before its flags are freed
    release();
    cudaDeviceSynchronize();
    cudaFreeHost(const_cast<int*>(flags_));
  }

  void hold(cudaStream_t stream) {  // the stream must be idle
    flags_[0] = 0;
    flags_[1] = 0;
    launch_hold(device_, device_ + 1, kTimeoutNs, stream);
    cuda_ok(cudaGetLastError(), "hold kernel");
  }
  void release() { flags_[0] = 1; }
  bool timed_out() const { return flags_[1] != 0; }  // after the stream has synchronized

 private:
  // Far longer than queuing a batch takes; only a host stalled for that long lets the GPU go early.
  static constexpr unsigned long long kTimeoutNs = 2'000'000'000ull;
  volatile int* flags_ = nullptr;
  int* device_ = nullptr;
};

// Calls queued behind one hold: few enough that the stream's queue of pending work never fills
// (which would block the host while the GPU waits for it).
constexpr int kQueuedBatch = 64;

// Reads a buffer twice the L2's size (a read, so that the L2 is left holding clean lines that the
// calls' misses evict without writing back), so that nothing the set-up and the warm-up left there
// serves the timed calls.
void flush_l2(cudaStream_t stream) {
  int device = 0, l2_bytes = 0, multiprocessors = 0;
  cuda_ok(cudaGetDevice(&device), "cudaGetDevice");
  cuda_ok(cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device), "L2 size");
  cuda_ok(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device), "multiprocessors");
  DeviceMemory scratch(2 * static_cast<std::size_t>(l2_bytes)), sink(sizeof(unsigned long long));
  launch_read_only(scratch.get(), scratch.bytes(), sink.get<unsigned long long>(), multiprocessors, stream);
  cuda_ok(cudaGetLastError(), "L2 flush");
  cuda_ok(cudaStreamSynchronize(stream), "L2 flush");
}

}  // namespace

Timing time_calls(const std::function<void(int)>& call, int warmup, int iters, cudaStream_t stream, Launch launch) {
  for (int i = 0; i < warmup; ++i) call(i);
  cuda_ok(cudaStreamSynchronize(stream), "warm-up");
  flush_l2(stream);
  std::vector<cudaEvent_t> events(static_cast<std::size_t>(2 * iters), nullptr);
  struct Destroy {
    std::vector<cudaEvent_t>& events;
    ~Destroy() {
      for (cudaEvent_t e : events) {
        if (e != nullptr) cudaEventDestroy(e);
      }
    }
  } destroy{events};
  for (auto& e : events) cuda_ok(cudaEventCreate(&e), "cudaEventCreate");
  std::unique_ptr<Hold> hold;
  if (launch == Launch::kQueued) hold = std::make_unique<Hold>();
  bool queued = launch == Launch::kQueued;
  std::vector<double> host_us(static_cast<std::size_t>(iters));
  for (int first = 0; first < iters; first += kQueuedBatch) {
    if (hold) hold->hold(stream);
    for (int i = first; i < std::min(iters, first + kQueuedBatch); ++i) {
      cuda_ok(cudaEventRecord(events[2 * i], stream), "cudaEventRecord");
      const auto start = std::chrono::steady_clock::now();
      call(warmup + i);
      host_us[static_cast<std::size_t>(i)] =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count();
      cuda_ok(cudaEventRecord(events[2 * i + 1], stream), "cudaEventRecord");
    }
    if (hold) hold->release();
    cuda_ok(cudaStreamSynchronize(stream), "timed calls");
    if (hold && hold->timed_out()) queued = false;
  }
  std::vector<double> us;
  for (int i = 0; i < iters; ++i) {
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, events[2 * i], events[2 * i + 1]), "cudaEventElapsedTime");
    us.push_back(ms * 1000.0);
  }
  Timing t;
  t.samples = iters;
  t.queued = queued;
  const Spread spread = spread_of(us);
  t.median_us = spread.median;
  t.p10_us = spread.p10;
  t.p90_us = spread.p90;
  t.min_us = spread.min;
  t.host_us = spread_of(host_us).median;
  return t;
}

namespace {

// Kernel and memset nodes of a captured graph.
int launch_nodes(cudaGraph_t graph) {
  std::size_t count = 0;
  cuda_ok(cudaGraphGetNodes(graph, nullptr, &count), "graph nodes");
  std::vector<cudaGraphNode_t> nodes(count);
  cuda_ok(cudaGraphGetNodes(graph, nodes.data(), &count), "graph nodes");
  int launches = 0;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type{};
    cuda_ok(cudaGraphNodeGetType(node, &type), "graph node type");
    launches += type == cudaGraphNodeTypeKernel || type == cudaGraphNodeTypeMemset ? 1 : 0;
  }
  return launches;
}

}  // namespace

Timing time_graphs(const std::function<void(int)>& call, int variants, int warmup, int iters, cudaStream_t stream,
                   Launch launch, int* launches) {
  std::vector<cudaGraphExec_t> execs;
  struct Release {
    std::vector<cudaGraphExec_t>& execs;
    ~Release() {
      for (cudaGraphExec_t e : execs) cudaGraphExecDestroy(e);
    }
  } release{execs};
  for (int v = 0; v < variants; ++v) {
    cudaGraph_t graph = nullptr;
    cuda_ok(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "graph capture");
    try {
      call(v);
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    cuda_ok(cudaStreamEndCapture(stream, &graph), "graph capture");
    if (launches != nullptr && v == 0) {
      try {
        *launches = launch_nodes(graph);
      } catch (...) {
        cudaGraphDestroy(graph);
        throw;
      }
    }
    cudaGraphExec_t exec = nullptr;
    const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    cuda_ok(status, "graph instantiate");
    execs.push_back(exec);
    // Uploaded now: a graph's first launch otherwise uploads it in stream order, and the variants
    // past the warm-up would first launch inside a timed call.
    cuda_ok(cudaGraphUpload(exec, stream), "graph upload");
  }
  cuda_ok(cudaStreamSynchronize(stream), "graph upload");
  return time_calls(
      [&](int i) { cuda_ok(cudaGraphLaunch(execs[static_cast<std::size_t>(i % variants)], stream), "graph launch"); },
      warmup, iters, stream, launch);
}

double measure_chained_launch_us(cudaStream_t stream) {
  constexpr int kLinks = 256;
  DeviceMemory counter = DeviceMemory::zeroed(sizeof(int));
  const Timing t = time_graphs(
      [&](int) {
        for (int i = 0; i < kLinks; ++i) launch_chain_link(counter.get<int>(), stream);
      },
      1, 3, 20, stream);
  return t.median_us / kLinks;
}

Ceilings measure_ceilings(std::size_t bytes, int multiprocessors, cudaStream_t stream) {
  Ceilings c;
  c.bytes = bytes;
  DeviceMemory buffer(2 * bytes);
  DeviceMemory sink(sizeof(unsigned long long));
  cuda_ok(cudaMemsetAsync(buffer.get(), 1, 2 * bytes, stream), "memset");
  const Timing read = time_calls(
      [&](int) { launch_read_only(buffer.get(), bytes, sink.get<unsigned long long>(), multiprocessors, stream); }, 2,
      7, stream);
  cuda_ok(cudaGetLastError(), "read-only kernel");
  const Timing copy = time_calls(
      [&](int) {
        cuda_ok(cudaMemcpyAsync(buffer.get<char>() + bytes, buffer.get(), bytes, cudaMemcpyDeviceToDevice, stream),
                "copy");
      },
      2, 7, stream);
  // The gather: 4M fp8 entries (656 bytes, 2.6 GB) per call over the buffer as a pool, other slots each call.
  constexpr int kEntryBytes = static_cast<int>(kFp8TokenBytes);
  constexpr std::int64_t kEntries = std::int64_t{1} << 22;
  const auto pool_tokens = static_cast<std::int64_t>(2 * bytes / kEntryBytes);
  const Timing gather = time_calls(
      [&](int i) {
        launch_gather_read(buffer.get(), pool_tokens, kEntryBytes, kEntries, static_cast<std::uint64_t>(i) * kEntries,
                           sink.get<unsigned long long>(), multiprocessors, stream);
      },
      2, 7, stream);
  cuda_ok(cudaGetLastError(), "gather kernel");
  DeviceMemory counter = DeviceMemory::zeroed(sizeof(int));
  c.empty_launch_us = time_calls([&](int) { launch_chain_link(counter.get<int>(), stream); }, 5, 50, stream).median_us;
  c.empty_graph_us =
      time_graphs([&](int) { launch_chain_link(counter.get<int>(), stream); }, 1, 5, 50, stream).median_us;
  c.read_gbps = static_cast<double>(bytes) / (read.median_us * 1e3);
  c.copy_gbps = 2.0 * static_cast<double>(bytes) / (copy.median_us * 1e3);
  c.gather_gbps = static_cast<double>(kEntries * kEntryBytes) / (gather.median_us * 1e3);
  return c;
}

}  // namespace latentkv::tools::gpu
