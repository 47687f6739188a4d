// src/cuda/common/register_cap.cuh - how many CTAs per SM a kernel's register cap
// (__launch_bounds__' second argument) plans for, on the architecture its device code is compiled for.
//
// A cap of n CTAs per SM holds each thread to 64K / (n x threads) registers, and ptxas spills what
// does not fit. Where the kernel's shared memory lets fewer than n CTAs share an SM, the cap buys no
// occupancy and costs the spills: sm_89 and sm_120 have 100 KB of shared memory per SM, against
// 228 KB on sm_90 and sm_100, so a kernel sized for three or four CTAs of sm_90 fits one or two there.
#pragma once

namespace latentkv::cuda {

// Shared memory per SM of the device code being compiled. (The host pass, where __launch_bounds__
// binds nothing, sees sm_90's.)
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ < 900 || __CUDA_ARCH__ >= 1200)
inline constexpr int kSharedPerSm = 100 * 1024;
#else
inline constexpr int kSharedPerSm = 228 * 1024;
#endif
inline constexpr int kSharedReservedPerCta = 1024;  // what the hardware keeps of it per CTA

// `wanted` CTAs per SM, or as many as fit in the SM's shared memory at `shared_bytes` a CTA where
// that is fewer; at least one.
constexpr int ctas_per_sm_cap(int wanted, int shared_bytes) {
  const int fit = kSharedPerSm / (shared_bytes + kSharedReservedPerCta);
  return fit < 1 ? 1 : (fit < wanted ? fit : wanted);
}

}  // namespace latentkv::cuda
