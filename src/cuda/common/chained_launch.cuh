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

// kernel<<<grid, block, smem_bytes, stream>>>(args...), chained to the previous kernel of the
// stream where the device supports it; `cooperative` adds the cooperative-launch attribute (grid
// barriers). Launch errors throw latentkv::Error naming `op`.
template <class... Params, class... Args>
void launch_chained(const char* op, void (*kernel)(Params...), dim3 grid, dim3 block, std::size_t smem_bytes,
                    cudaStream_t stream, bool cooperative, Args&&... args) {
  cudaLaunchAttribute attrs[2]{};
  unsigned count = 0;
  if (chained_launch_supported(kernel, op)) {
    attrs[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[count].val.programmaticStreamSerializationAllowed = 1;
    ++count;
  }
  if (cooperative) {
    attrs[count].id = cudaLaunchAttributeCooperative;
    attrs[count].val.cooperative = 1;
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

}  // namespace latentkv::cuda
