// src/cuda/kv_cache/launch.hpp - launchers of the cache kernels (append, and the casts the baseline
// backends perform).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "latentkv/ops.hpp"

namespace latentkv::cuda {

// Quantizes and writes p.latent (and p.indexer_keys) at p.slots; slots of -1 or outside the pool
// are skipped on the device. Arguments must already be validated. check_append_call throws what the
// launch refuses before it queues anything (the pointers' alignment), and queues nothing itself.
void check_append_call(const AppendParams& p);
void launch_append(const AppendParams& p, cudaStream_t stream);

// Dequantizes every slot of an fp8 cache into a bf16 cache of the same geometry:
// dst [num_pages, page_size, 1152] bytes.
void launch_cast_pool(const LatentCache& src, std::uint8_t* dst, cudaStream_t stream);

// Gathers and dequantizes request b's tokens t < seq_lens[b] into dst [batch, capacity, 1152] bytes,
// capacity = max_pages * page_size, and writes an identity block table [batch, max_pages] so that
// dst reads as a bf16 cache of batch * max_pages pages (-1 for a page outside the source pool, which
// the decode then leaves unread, as the fp8 decode does).
void launch_gather_cast(const LatentCache& src, const std::int32_t* block_table, const std::int32_t* seq_lens,
                        int batch, int max_pages, std::uint8_t* dst, std::int32_t* dst_block_table,
                        cudaStream_t stream);

// Gathers and dequantizes the `entries` selected slots of an index tensor into dst [entries, 1152]
// bytes, and writes dst_indices [entries]: entry e -> e, or -1 where the slot is -1 or outside the pool.
void launch_gather_cast_indices(const LatentCache& src, const std::int32_t* indices, std::int64_t entries,
                                std::uint8_t* dst, std::int32_t* dst_indices, cudaStream_t stream);

}  // namespace latentkv::cuda
