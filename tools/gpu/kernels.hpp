// tools/gpu/kernels.hpp - device helpers of the benchmarks.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace latentkv::tools::gpu {

// Streams `bytes` (a multiple of 16) through 16-byte loads: the read-only bandwidth ceiling.
void launch_read_only(const void* data, std::size_t bytes, unsigned long long* sink, int multiprocessors,
                      cudaStream_t stream);
// Reads `tokens` entries of `token_bytes` (a multiple of 16) each at pseudo-random slots of a pool of
// `pool_tokens` entries, one warp per entry and 16-byte loads: the gather ceiling of the sparse ops,
// which read their selected tokens' entries at scattered slots.
void launch_gather_read(const void* pool, std::int64_t pool_tokens, int token_bytes, std::int64_t tokens,
                        std::uint64_t seed, unsigned long long* sink, int multiprocessors, cudaStream_t stream);
// One thread that spins until the host sets *release (host-mapped memory) or `timeout_ns` pass on the
// GPU clock, then sets *timed_out when it was the timeout: holds a stream while timed calls are queued
// behind it, so that their events measure the GPU's work and not the host's launches.
void launch_hold(const volatile int* release, int* timed_out, unsigned long long timeout_ns, cudaStream_t stream);
// One CTA that waits for the kernels before it (a chained launch, as the library's kernels are
// launched), adds 1 to *counter (which the kernel before it wrote) and lets the next kernel start: a
// chain of these, captured in a graph, times the least a dependent kernel costs.
void launch_chain_link(int* counter, cudaStream_t stream);
// n bf16 values, roughly N(0, stddev^2), from a counter-based generator.
void launch_random_bf16(std::uint16_t* out, std::size_t n, std::uint64_t seed, float stddev, cudaStream_t stream);
// n random e4m3 codes, every one a finite value.
void launch_random_fp8(std::uint8_t* out, std::size_t n, std::uint64_t seed, cudaStream_t stream);

}  // namespace latentkv::tools::gpu
