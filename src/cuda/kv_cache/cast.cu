// The casts that engines perform today, kept for the baseline backends cast_full and gather_cast:
// fp8 tokens (656 bytes) dequantized into bf16 tokens (1152 bytes), value = fp8 x scale rounded to bf16.
#include <cstdint>

#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/kv_cache/launch.hpp"

namespace latentkv::cuda {
namespace {

// Each token is 36 pieces of 32 output bytes: 32 pieces of 16 latent values, 4 pieces of 16 rope values.
constexpr int kPiecesPerToken = 36;
constexpr int kThreads = 256;

__device__ __forceinline__ void cast_piece(const std::uint8_t* src, std::uint8_t* dst, int piece) {
  uint4* out = reinterpret_cast<uint4*>(dst + piece * 32);
  if (piece < 32) {
    const uint4 codes = reinterpret_cast<const uint4*>(src)[piece];
    const float scale = reinterpret_cast<const float*>(src + 512)[piece / 8];
    const std::uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
    std::uint32_t packed[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const std::uint32_t two = fp8x2_to_bf16x2(static_cast<std::uint16_t>(words[i] >> (16 * h)));
        const float lo = __uint_as_float(two << 16) * scale;
        const float hi = __uint_as_float(two & 0xFFFF0000u) * scale;
        packed[2 * i + h] = pack_bf16x2(lo, hi);
      }
    }
    out[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    out[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
  } else {
    const uint4* rope = reinterpret_cast<const uint4*>(src + 528) + (piece - 32) * 2;
    out[0] = rope[0];
    out[1] = rope[1];
  }
}

__global__ void __launch_bounds__(kThreads) cast_pool_kernel(const std::uint8_t* src, std::uint8_t* dst,
                                                             std::int64_t num_slots) {
  const std::int64_t total = num_slots * kPiecesPerToken;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    const std::int64_t slot = i / kPiecesPerToken;
    cast_piece(src + slot * 656, dst + slot * 1152, static_cast<int>(i % kPiecesPerToken));
  }
}

__global__ void __launch_bounds__(kThreads) gather_cast_kernel(const std::uint8_t* src, std::int64_t num_pages,
                                                               int page_size, const std::int32_t* block_table,
                                                               const std::int32_t* seq_lens, int max_pages,
                                                               std::uint8_t* dst, std::int32_t* dst_block_table) {
  const int b = blockIdx.y;
  const std::int64_t capacity = static_cast<std::int64_t>(max_pages) * page_size;
  if (blockIdx.x == 0) {  // identity, but -1 (unread, as in the fp8 decode) where the source page is outside the pool
    for (int p = threadIdx.x; p < max_pages; p += kThreads) {
      const std::int32_t page = block_table[b * max_pages + p];
      dst_block_table[b * max_pages + p] = page >= 0 && page < num_pages ? b * max_pages + p : -1;
    }
  }
  const std::int64_t len = min(static_cast<std::int64_t>(seq_lens[b]), capacity);
  const std::int64_t total = len * kPiecesPerToken;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    const std::int64_t t = i / kPiecesPerToken;
    const std::int32_t page = block_table[b * max_pages + t / page_size];
    if (page < 0 || page >= num_pages) continue;
    const std::int64_t slot = static_cast<std::int64_t>(page) * page_size + t % page_size;
    cast_piece(src + slot * 656, dst + (b * capacity + t) * 1152, static_cast<int>(i % kPiecesPerToken));
  }
}

__global__ void __launch_bounds__(kThreads) gather_cast_indices_kernel(const std::uint8_t* src, std::int64_t num_slots,
                                                                       const std::int32_t* indices, std::int64_t entries,
                                                                       std::uint8_t* dst, std::int32_t* dst_indices) {
  const std::int64_t total = entries * kPiecesPerToken;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(kThreads) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(gridDim.x) * kThreads) {
    const std::int64_t e = i / kPiecesPerToken;
    const int piece = static_cast<int>(i % kPiecesPerToken);
    const std::int32_t slot = indices[e];
    const bool valid = slot >= 0 && slot < num_slots;
    if (piece == 0) dst_indices[e] = valid ? static_cast<std::int32_t>(e) : -1;
    if (valid) cast_piece(src + static_cast<std::int64_t>(slot) * 656, dst + e * 1152, piece);
  }
}

int grid_for(std::int64_t work) {
  const std::int64_t blocks = (work + kThreads - 1) / kThreads;
  return static_cast<int>(blocks < 4096 ? (blocks > 0 ? blocks : 1) : 4096);  // grid-stride beyond
}

}  // namespace

void launch_cast_pool(const LatentCache& src, std::uint8_t* dst, cudaStream_t stream) {
  const std::int64_t slots = src.num_slots();
  cast_pool_kernel<<<grid_for(slots * kPiecesPerToken), kThreads, 0, stream>>>(src.data, dst, slots);
  LKV_CUDA_CHECK_LAUNCH("cast_full");
}

void launch_gather_cast(const LatentCache& src, const std::int32_t* block_table, const std::int32_t* seq_lens,
                        int batch, int max_pages, std::uint8_t* dst, std::int32_t* dst_block_table,
                        cudaStream_t stream) {
  if (batch == 0) return;
  // Lengths live on the device: size the grid for the capacity, blocks past a request's end exit early.
  const std::int64_t capacity = static_cast<std::int64_t>(max_pages) * src.page_size;
  const int blocks_x = grid_for(capacity * kPiecesPerToken);
  gather_cast_kernel<<<dim3(static_cast<unsigned>(blocks_x), static_cast<unsigned>(batch)), kThreads, 0, stream>>>(
      src.data, src.num_pages, src.page_size, block_table, seq_lens, max_pages, dst, dst_block_table);
  LKV_CUDA_CHECK_LAUNCH("gather_cast");
}

void launch_gather_cast_indices(const LatentCache& src, const std::int32_t* indices, std::int64_t entries,
                                std::uint8_t* dst, std::int32_t* dst_indices, cudaStream_t stream) {
  if (entries == 0) return;
  gather_cast_indices_kernel<<<grid_for(entries * kPiecesPerToken), kThreads, 0, stream>>>(
      src.data, src.num_slots(), indices, entries, dst, dst_indices);
  LKV_CUDA_CHECK_LAUNCH("gather_cast");
}

}  // namespace latentkv::cuda
