// append: quantize new tokens and write them into the main latent cache and the indexer key cache.
// One warp per token. Bit-identical to the CPU reference (src/cpu/append.cpp).
#include <cstdint>

#include "cuda/common/chained_launch.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/kv_cache/launch.hpp"

namespace latentkv::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

struct AppendArgs {
  const std::uint16_t* latent;        // [n, 576] bf16
  const std::int32_t* slots;          // [n]
  const std::uint16_t* indexer_keys;  // [n, 128] bf16 or null
  std::uint8_t* cache;                // [num_slots, token_bytes]
  std::uint8_t* indexer;              // [num_pages, page_size * 132] or null
  std::int64_t n;
  std::int64_t num_slots;
  int page_size;
  bool fp8;
  bool pow2;
};

__device__ __forceinline__ float abs_max_over(float v, int width) {
  for (int offset = width / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

__global__ void __launch_bounds__(kWarpsPerBlock * 32) append_kernel(AppendArgs a) {
  wait_for_previous_kernels();
  allow_next_kernel();  // one short pass: the next kernel may take its place as soon as it ends
  const int lane = threadIdx.x % 32;
  const std::int64_t token = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  if (token >= a.n) return;
  // The token's slot, latent and indexer key all in flight at once (the inputs are there whatever
  // the slot): one round trip to memory before the stores, not two.
  const std::int64_t slot = a.slots[token];
  const std::uint16_t* src = a.latent + token * 576;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  // fp8: lane l's latent values [16 l, 16 l + 16) and rope chunk l (l < 8); bf16: chunks l, l + 32,
  // l + 64 of the 72.
  uint4 chunk[3] = {};
  if (a.fp8) {
    chunk[0] = s[2 * lane];
    chunk[1] = s[2 * lane + 1];
    if (lane < 8) chunk[2] = s[64 + lane];
  } else {
    for (int c = 0; c < 3; ++c) {
      if (lane + 32 * c < 72) chunk[c] = s[lane + 32 * c];
    }
  }
  uint2 key = {};
  if (a.indexer != nullptr) key = reinterpret_cast<const uint2*>(a.indexer_keys + token * 128)[lane];
  if (slot < 0 || slot >= a.num_slots) return;

  if (!a.fp8) {  // bf16 cache: 1152 bytes verbatim, 72 chunks of 16 bytes
    uint4* d = reinterpret_cast<uint4*>(a.cache + slot * 1152);
    for (int c = 0; c < 3; ++c) {
      if (lane + 32 * c < 72) d[lane + 32 * c] = chunk[c];
    }
  } else {
    std::uint8_t* dst = a.cache + slot * 656;
    // Lane l holds latent values [16 l, 16 l + 16), in scale block l / 8.
    float v[16];
    const float amax = abs_max_over(unpack_bf16x16(chunk[0], chunk[1], v), 8);
    const float scale = block_scale(amax, a.pow2);
    std::uint32_t packed[4] = {0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      packed[i / 4] |= static_cast<std::uint32_t>(encode_fp8(__fdiv_rn(v[i], scale))) << (8 * (i % 4));
    }
    reinterpret_cast<uint4*>(dst)[lane] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    if (lane % 8 == 0) reinterpret_cast<float*>(dst + 512)[lane / 8] = scale;
    if (lane < 8) reinterpret_cast<uint4*>(dst + 528)[lane] = chunk[2];
  }

  if (a.indexer != nullptr) {
    // Lane l holds key values [4 l, 4 l + 4); one scale for all 128.
    const uint2 w = key;
    const float k[4] = {bf16_bits_to_float(w.x & 0xFFFFu), bf16_bits_to_float(w.x >> 16),
                        bf16_bits_to_float(w.y & 0xFFFFu), bf16_bits_to_float(w.y >> 16)};
    const float amax = abs_max_over(fmaxf(fmaxf(fabsf(k[0]), fabsf(k[1])), fmaxf(fabsf(k[2]), fabsf(k[3]))), 32);
    const float scale = block_scale(amax, a.pow2);
    std::uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) packed |= static_cast<std::uint32_t>(encode_fp8(__fdiv_rn(k[i], scale))) << (8 * i);
    const std::int64_t page = slot / a.page_size, offset = slot % a.page_size;
    std::uint8_t* page_base = a.indexer + page * static_cast<std::int64_t>(a.page_size) * 132;
    reinterpret_cast<std::uint32_t*>(page_base + offset * 128)[lane] = packed;
    if (lane == 0) {
      // The scale area may sit at any 4-byte boundary (page_size * 128 is a multiple of 4).
      reinterpret_cast<float*>(page_base + static_cast<std::int64_t>(a.page_size) * 128)[offset] = scale;
    }
  }
}

}  // namespace

void launch_append(const AppendParams& p, cudaStream_t stream) {
  AppendArgs a{};
  a.latent = p.latent.as<const std::uint16_t>();
  a.slots = p.slots.as<const std::int32_t>();
  a.indexer_keys = p.indexer.data ? p.indexer_keys.as<const std::uint16_t>() : nullptr;
  a.cache = p.cache.data;
  a.indexer = p.indexer.data;
  a.n = p.latent.size(0);
  a.num_slots = p.cache.num_slots();
  a.page_size = p.cache.page_size;
  a.fp8 = p.cache.dtype == KvDtype::kFp8E4M3;
  a.pow2 = p.scale_mode == ScaleMode::kPow2;
  if (a.n == 0) return;
  const auto blocks = static_cast<unsigned>((a.n + kWarpsPerBlock - 1) / kWarpsPerBlock);
  launch_chained("append", append_kernel, blocks, kWarpsPerBlock * 32, 0, stream, false, a);
}

}  // namespace latentkv::cuda
