// tools/gpu/measure.hpp - honest GPU timing for the benchmarks: device events, warm-up, median and
// spread, and the bandwidth ceilings measured in the same run.
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace latentkv::tools::gpu {

inline void cuda_ok(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

struct Timing {
  double median_us = 0, p10_us = 0, p90_us = 0, min_us = 0;
  int samples = 0;
  bool queued = false;  // every timed call was queued before the GPU ran it (Launch::kQueued held)
  // The host's time to make one call (from the call to its return: for an op through run(), its
  // selection, validation and launches), median over the timed calls. Queued, the GPU is held
  // meanwhile, so that this is the caller's cost alone, as in an engine that launches eagerly.
  double host_us = 0;
};

// How the timed calls reach the GPU.
//   kQueued: the calls are queued, a batch at a time, behind a one-thread kernel that holds the stream
//     until the host has enqueued the whole batch, then run back to back: each call's two events
//     time its work on the GPU, as it runs inside a captured decode step, and none of the host's launch
//     latency (a few microseconds per launch, which a call shorter than that would otherwise include).
//   kPaced: the host launches each call as it goes, the GPU idle whenever the host is behind.
enum class Launch { kQueued, kPaced };

// What a status says of a queued timing whose hold timed out (some calls ran as the host launched
// them); empty when every call was queued, or when `launch` was kPaced.
inline std::string pacing_note(const Timing& t, Launch launch = Launch::kQueued) {
  return launch == Launch::kQueued && !t.queued ? " (partly paced by the host: the hold timed out)" : "";
}

// Times `call(warmup + i)` for i = 0 .. iters-1, each between two events, after `warmup` untimed
// calls (call(0) .. call(warmup - 1)) and a read of twice the L2's size: what the set-up and the
// warm-up left in the L2 serves no timed call. (What one timed call leaves may serve the next: the
// callers keep them apart by rotating inputs, or say that they do not.)
Timing time_calls(const std::function<void(int)>& call, int warmup, int iters, cudaStream_t stream,
                  Launch launch = Launch::kQueued);

// Captures `call(v)` for v = 0 .. variants-1 into one CUDA graph each, then times graph launches
// (variant i % variants for call i) as time_calls does: what a decode step captured once and
// replayed costs, without per-kernel launch overhead.
// `launches`, when given, receives the kernel and memset nodes of variant 0's graph.
Timing time_graphs(const std::function<void(int)>& call, int variants, int warmup, int iters, cudaStream_t stream,
                   Launch launch = Launch::kQueued, int* launches = nullptr);

// What one dependent kernel costs in a graph with no work in it: the median time of a graph of
// chained one-CTA kernels (launch_chain_link), over its length. µs.
double measure_chained_launch_us(cudaStream_t stream);

struct Ceilings {
  double read_gbps = 0;   // read-only streaming kernel, 16-byte loads
  double copy_gbps = 0;   // device-to-device copy, bytes read plus written
  double gather_gbps = 0; // 656-byte entries read at random slots (the sparse ops' access), one warp each
  std::size_t bytes = 0;  // bytes streamed per measurement
  // The least a timed call costs: one one-CTA kernel that does next to nothing (launch_chain_link),
  // queued behind a held GPU as the benchmarks' calls are by default, launched into the stream
  // (empty_launch_us) or as a one-kernel graph (empty_graph_us). µs, median.
  double empty_launch_us = 0, empty_graph_us = 0;
};
Ceilings measure_ceilings(std::size_t bytes, int multiprocessors, cudaStream_t stream);

// RAII device allocation.
class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(std::size_t bytes) : bytes_(bytes) {
    if (bytes_) cuda_ok(cudaMalloc(&ptr_, bytes_), ("cudaMalloc " + std::to_string(bytes_) + " bytes").c_str());
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  DeviceMemory(DeviceMemory&& o) noexcept { *this = std::move(o); }
  DeviceMemory& operator=(DeviceMemory&& o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  ~DeviceMemory() {
    if (ptr_) cudaFree(ptr_);
  }
  // An allocation of `bytes` set to zero, as an engine zeroes a workspace once when it allocates
  // it (the GPU indexer's claim counters then stay zero from call to call: workspace_cleared).
  static DeviceMemory zeroed(std::size_t bytes) {
    DeviceMemory m(bytes);
    if (bytes) cuda_ok(cudaMemset(m.ptr_, 0, bytes), "cudaMemset of a zeroed allocation");
    return m;
  }
  template <typename T = void>
  T* get() const { return static_cast<T*>(ptr_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
};

}  // namespace latentkv::tools::gpu
