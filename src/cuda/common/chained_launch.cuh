// src/cuda/common/chained_launch.cuh - kernels that start while the previous kernel in the stream
// finishes (programmatic dependent launch, sm_90 and later).
//
// A decode step is a chain of short kernels (append, indexer, top-k, attention, split combine) that
// each wait for the one before. Launched with launch_chained(), a kernel may be scheduled onto the
// GPU once every CTA of the previous kernel has called allow_next_kernel() (or exited), instead of
// after that kernel has drained: its launch overlaps the previous kernel's tail, in a CUDA graph
// too. The contract, for every kernel launched this way:
//   * wait_for_previous_kernels() comes before its first global-memory access, read or write. It
//     returns once every earlier kernel of the stream has completed and its writes are visible; so
//     the kernel is correct whatever ran before it, ours or the caller's.
//   * allow_next_kernel() comes once the kernel's remaining work is short (its epilogue): the next
//     kernel's CTAs then wait on the GPU rather than in the launch queue. Before that point they
//     would only take SM room from this one.
// Elsewhere (sm_89, or a device without the feature) both calls are no-ops and the launch is an
// ordinary one. So is a launch of code compiled for sm_89 (its PTX compiled at load time for a newer
// GPU, in a build without that GPU's architecture): its calls were compiled out, and a kernel
// launched chained that never waits could read what the previous kernel is still writing.
#pragma once

#include <cuda_runtime.h>

#include <tuple>
#include <utility>

#include "cuda/common/cuda_check.hpp"

namespace latentkv::cuda {

__device__ __forceinline__ void wait_for_previous_kernels() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// Whether `kernel` may start on the current device before the previous kernel ends: the device is
// of compute capability 9.0 or later and the kernel's code was compiled for one (so that it holds
// the wait). Asked once per kernel and device.
template <class Kernel>
bool chained_launch_supported(Kernel* kernel, const char* op) {
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), current_device(op)};
  return once_per_key(key, [&] {
    cudaFuncAttributes attributes{};
    check(cudaFuncGetAttributes(&attributes, kernel), op, "cudaFuncGetAttributes");
    return current_device_sm(op) >= 90 && attributes.ptxVersion >= 90;
  });
}

// How the CTAs of a launch wait for each other, beside the stream order: not at all, every CTA of
// the grid (a cooperative launch: grid barriers), or in thread-block clusters of `cluster_x`
// consecutive CTAs along x (cluster barriers, and each other's shared memory; sm_90 and later).
struct CtaGroups {
  bool whole_grid = false;
  unsigned cluster_x = 1;
};

// Lets `kernel` run in clusters of more than 8 CTAs (the portable size; sm_90 takes 16), once per
// kernel and device.
template <class Kernel>
void allow_large_clusters(Kernel* kernel, const char* op) {
  const std::pair<const void*, int> key{reinterpret_cast<const void*>(kernel), current_device(op)};
  const cudaError_t status = once_per_key(
      key, [&] { return cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1); });
  check(status, op, "cudaFuncSetAttribute (cluster size)");
}

// kernel<<<grid, block, smem_bytes, stream>>>(args...), chained to the previous kernel of the
// stream where the device supports it, its CTAs grouped as `groups` says. Launch errors throw
// latentkv::Error naming `op`.
template <class... Params, class... Args>
void launch_chained(const char* op, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes,
                    cudaStream_t stream, CtaGroups groups, Args&&... args) {
  cudaLaunchAttribute attrs[2]{};
  unsigned count = 0;
  if (chained_launch_supported(kernel, op)) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (groups.whole_grid) {
    attrs[count].id = cudaLaunchAttributeCooperative;
    attrs[count].val.cooperative = 1;
    ++count;
  } else if (groups.cluster_x > 1) {
    if (groups.cluster_x > 8) allow_large_clusters(kernel, op);
    attrs[count].id = cudaLaunchAttributeClusterDimension;
    attrs[count].val.clusterDim.x = groups.cluster_x;
    attrs[count].val.clusterDim.y = 1;
    attrs[count].val.clusterDim.z = 1;
    ++count;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  config.attrs = attrs;
  config.numAttrs = count;
  check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), op, "kernel launch");
}

// The same, `cooperative` adding the cooperative-launch attribute (grid barriers).
template <class... Params, class... Args>
void launch_chained(const char* op, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes,
                    cudaStream_t stream, bool cooperative, Args&&... args) {
  launch_chained(op, kernel, grid, block, smem_bytes, stream, CtaGroups{cooperative, 1}, std::forward<Args>(args)...);
}

// Whether clusters of `cluster_x` CTAs of `kernel` (`threads` threads and `smem` bytes of dynamic
// shared memory each) fit the current device at all: an sm_90 or later device, code compiled for
// one, and a cluster that one GPC holds. Asked once per kernel, device and configuration.
template <class Kernel>
bool clusters_fit(Kernel* kernel, unsigned cluster_x, int threads, std::size_t smem, const char* op) {
  const std::tuple<const void*, int, unsigned, int, std::size_t> key{reinterpret_cast<const void*>(kernel),
                                                                      current_device(op), cluster_x, threads, smem};
  return once_per_key(key, [&] {
    cudaFuncAttributes attributes{};
    check(cudaFuncGetAttributes(&attributes, kernel), op, "cudaFuncGetAttributes");
    if (current_device_sm(op) < 90 || attributes.ptxVersion < 90 || cluster_x > 16) return false;
    if (cluster_x > 8) allow_large_clusters(kernel, op);
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = cluster_x;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cudaLaunchConfig_t config{};
    config.gridDim = dim3(cluster_x);
    config.blockDim = dim3(static_cast<unsigned>(threads));
    config.dynamicSmemBytes = smem;
    config.attrs = &attr;
    config.numAttrs = 1;
    int clusters = 0;
    check(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config), op, "cudaOccupancyMaxActiveClusters");
    return clusters > 0;
  });
}

}  // namespace latentkv::cuda
