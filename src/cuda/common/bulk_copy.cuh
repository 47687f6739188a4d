// src/cuda/common/bulk_copy.cuh - bulk copies from global to shared memory (the copy engine's
// cp.async.bulk, sm_90 and later), each issued by one thread and completing on a shared-memory
// mbarrier that the consumers wait on.
//
// Use: one thread inits the barriers (count 1) and fences them; per fill of a buffer one thread
// announces the bytes (arrive_expect), then it or others issue the copies (or, with nothing to
// copy, it arrives plainly); every consumer
// waits for the barrier's phase, which alternates 0, 1, 0, ... with each use. A buffer that ordinary
// loads read before a copy refills it takes fence_for_copy in the issuing thread first (the same
// fence wgmma::fence_shared_for_async puts before the tensor cores read what threads stored).
//
// On targets before sm_90 the copies, arrivals and waits compile to a trap and the fences to
// nothing: a launcher picks a kernel that uses them only on sm_90 and later (the wgmma kernels,
// which need sm_90a anyway; the narrow decode's bulk instances, decode_narrow.cu).
#pragma once

#include <cstdint>

#include "cuda/common/mma.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define LKV_BULK_COPY 1
#else
#define LKV_BULK_COPY 0
#endif

namespace latentkv::cuda::bulk {

__device__ __forceinline__ void init(std::uint64_t* bar, int arrivals) {
#if LKV_BULK_COPY
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
#else
  (void)bar, (void)arrivals;
  __trap();
#endif
}

// Makes this thread's barrier inits visible to the copy engine and to the other threads (after a
// CTA barrier).
__device__ __forceinline__ void fence_init() {
#if LKV_BULK_COPY
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}

// This thread's arrival on `bar`, announcing `bytes` that copies will still deliver to it.
__device__ __forceinline__ void arrive_expect(std::uint64_t* bar, std::uint32_t bytes) {
#if LKV_BULK_COPY
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
#else
  (void)bar, (void)bytes;
  __trap();
#endif
}

// This thread's arrival on `bar` with no bytes to wait for.
__device__ __forceinline__ void arrive(std::uint64_t* bar) {
#if LKV_BULK_COPY
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#else
  (void)bar;
  __trap();
#endif
}

// The L2 policy of a copy's lines: the default, or evict-first for data read once (a decode's stream
// of cache entries), so that it does not push out what the kernel reads back soon (its partials).
enum class L2Hint { kDefault, kEvictFirst };

// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global `src` to shared `dst`,
// delivered to `bar`.
template <L2Hint kHint = L2Hint::kDefault>
__device__ __forceinline__ void copy(void* dst, const void* src, std::uint32_t bytes, std::uint64_t* bar) {
#if LKV_BULK_COPY
  if constexpr (kHint == L2Hint::kEvictFirst) {
    asm volatile(
        "{\n.reg .b64 policy;\n"
        "createpolicy.fractional.L2::evict_first.b64 policy, 1.0;\n"
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], policy;\n"
        "}\n" ::"r"(smem_addr(dst)),
        "l"(src), "r"(bytes), "r"(smem_addr(bar))
        : "memory");
  } else {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(smem_addr(bar))
                 : "memory");
  }
#else
  (void)dst, (void)src, (void)bytes, (void)bar;
  __trap();
#endif
}

// The box of a 2D tensor map (cuTensorMapEncodeTiled) at element coordinates (x, y), from global
// to shared `dst` (aligned as the map's swizzle asks: 128 bytes, 1024 for the 128-byte swizzle),
// delivered to `bar`. `map` is the map's generic address: a __grid_constant__ kernel parameter.
__device__ __forceinline__ void copy_box_2d(void* dst, const void* map, int x, int y, std::uint64_t* bar) {
#if LKV_BULK_COPY
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(dst)),
      "l"(map), "r"(x), "r"(y), "r"(smem_addr(bar))
      : "memory");
#else
  (void)dst, (void)map, (void)x, (void)y, (void)bar;
  __trap();
#endif
}

// Orders this thread's generic shared-memory accesses (and those a CTA barrier made visible to it)
// before the copies it issues next.
__device__ __forceinline__ void fence_for_copy() {
#if LKV_BULK_COPY
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Waits until phase `parity` (0 or 1) of `bar` has completed.
__device__ __forceinline__ void wait(std::uint64_t* bar, std::uint32_t parity) {
#if LKV_BULK_COPY
  asm volatile(
      "{\n.reg .pred done;\n"
      "retry:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra retry;\n"
      "}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#else
  (void)bar, (void)parity;
  __trap();
#endif
}

}  // namespace latentkv::cuda::bulk
