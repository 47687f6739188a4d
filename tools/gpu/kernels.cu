// tools/gpu/kernels.cu - device helpers of the benchmarks: the read-only bandwidth probe, the
// chained-launch probe and synthetic inputs generated on the GPU.
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/chained_launch.cuh"
#include "gpu/kernels.hpp"

namespace latentkv::tools::gpu {
namespace {

__global__ void read_only_kernel(const uint4* data, std::size_t n, unsigned long long* sink) {
  std::uint32_t acc = 0;
  const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
  std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  // Four independent 16-byte loads in flight per thread.
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldg(data + i), b = __ldg(data + i + stride), c = __ldg(data + i + 2 * stride),
                d = __ldg(data + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w ^ c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n; i += stride) {
    const uint4 a = __ldg(data + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9E3779B9u) atomicAdd(sink, 1ull);  // keeps the loads alive; practically never taken
}

__device__ __forceinline__ std::uint64_t mix(std::uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// A pseudo-random slot in [0, pool_tokens), pool_tokens < 2^32: the high half of a 32-bit hash times it.
__device__ __forceinline__ std::uint32_t slot_of(std::uint64_t key, std::int64_t pool_tokens) {
  return __umulhi(static_cast<std::uint32_t>(mix(key)), static_cast<std::uint32_t>(pool_tokens));
}

// Warp w of the grid reads entries w, w + warps, ...: entry i at slot slot_of(seed + i), its
// 16-byte chunks spread over the lanes (a 656-byte entry: 41 chunks, lanes 0-8 take two).
__global__ void gather_read_kernel(const uint4* pool, std::int64_t pool_tokens, int chunks, std::int64_t tokens,
                                   std::uint64_t seed, unsigned long long* sink) {
  const int lane = threadIdx.x % 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * blockDim.x / 32;
  std::uint32_t acc = 0;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32; i < tokens;
       i += 2 * warps) {
    // Two entries per warp and turn, all their loads in flight before any is used.
    const std::int64_t j = i + warps;
    const uint4* a = pool + static_cast<std::int64_t>(slot_of(seed + static_cast<std::uint64_t>(i), pool_tokens)) * chunks;
    const uint4* b = pool + static_cast<std::int64_t>(slot_of(seed + static_cast<std::uint64_t>(j), pool_tokens)) * chunks;
    const bool has_b = j < tokens;
    uint4 x[2] = {}, y[2] = {};
    for (int k = 0; k < 2; ++k) {
      const int c = lane + 32 * k;
      if (c < chunks) {
        x[k] = __ldg(a + c);
        if (has_b) y[k] = __ldg(b + c);
      }
    }
    for (int k = 0; k < 2; ++k) acc ^= x[k].x ^ x[k].y ^ x[k].z ^ x[k].w ^ y[k].x ^ y[k].y ^ y[k].z ^ y[k].w;
  }
  if (acc == 0x9E3779B9u) atomicAdd(sink, 1ull);  // keeps the loads alive; practically never taken
}

__global__ void hold_kernel(const volatile int* release, int* timed_out, unsigned long long timeout_ns) {
  unsigned long long start, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  do {
    if (*release != 0) return;
    __nanosleep(1000);
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  } while (now - start < timeout_ns);
  *timed_out = 1;
}

// One link of a chain of kernels, each waiting for the one before it (chained_launch.cuh).
__global__ void chain_link_kernel(int* counter) {
  latentkv::cuda::wait_for_previous_kernels();
  if (threadIdx.x == 0) *counter += 1;
  latentkv::cuda::allow_next_kernel();
}

// Approximately normal values (sum of four uniforms, variance-matched), as bf16.
__global__ void random_bf16_kernel(std::uint16_t* out, std::size_t n, std::uint64_t seed, float stddev) {
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const std::uint64_t r = mix(seed + 0x9E3779B97F4A7C15ull * (i + 1));
    float s = 0.0f;
    for (int k = 0; k < 4; ++k) s += static_cast<float>((r >> (16 * k)) & 0xFFFF) * (1.0f / 65536.0f);
    const float x = (s - 2.0f) * 1.7320508f * stddev;  // var of a sum of 4 U(0,1) is 1/3
    out[i] = static_cast<std::uint16_t>(__float_as_uint(x) >> 16);
  }
}

// Random e4m3 codes of finite values (the NaN codes 0x7f and 0xff become 0x7e and 0xfe).
__global__ void random_fp8_kernel(std::uint8_t* out, std::size_t n, std::uint64_t seed) {
  for (std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::size_t>(gridDim.x) * blockDim.x) {
    const auto code = static_cast<std::uint8_t>(mix(seed + 0x9E3779B97F4A7C15ull * (i + 1)) >> 56);
    out[i] = (code & 0x7F) == 0x7F ? static_cast<std::uint8_t>(code - 1) : code;
  }
}

int grid_for(std::size_t n, int threads) {
  const std::size_t blocks = (n + threads - 1) / threads;
  return static_cast<int>(blocks < 8192 ? (blocks ? blocks : 1) : 8192);
}

}  // namespace

void launch_read_only(const void* data, std::size_t bytes, unsigned long long* sink, int multiprocessors,
                      cudaStream_t stream) {
  read_only_kernel<<<multiprocessors * 8, 256, 0, stream>>>(static_cast<const uint4*>(data), bytes / 16, sink);
}

void launch_gather_read(const void* pool, std::int64_t pool_tokens, int token_bytes, std::int64_t tokens,
                        std::uint64_t seed, unsigned long long* sink, int multiprocessors, cudaStream_t stream) {
  gather_read_kernel<<<multiprocessors * 8, 256, 0, stream>>>(static_cast<const uint4*>(pool), pool_tokens,
                                                              token_bytes / 16, tokens, seed, sink);
}

void launch_hold(const volatile int* release, int* timed_out, unsigned long long timeout_ns, cudaStream_t stream) {
  hold_kernel<<<1, 1, 0, stream>>>(release, timed_out, timeout_ns);
}

void launch_chain_link(int* counter, cudaStream_t stream) {
  latentkv::cuda::launch_chained("step", chain_link_kernel, 1, 32, 0, stream, false, counter);
}

void launch_random_bf16(std::uint16_t* out, std::size_t n, std::uint64_t seed, float stddev, cudaStream_t stream) {
  random_bf16_kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, n, seed, stddev);
}

void launch_random_fp8(std::uint8_t* out, std::size_t n, std::uint64_t seed, cudaStream_t stream) {
  random_fp8_kernel<<<grid_for(n, 256), 256, 0, stream>>>(out, n, seed);
}

}  // namespace latentkv::tools::gpu
