// append: quantize new tokens and write them into the main latent cache and the indexer key cache.
// One warp per token. Bit-identical to the CPU reference (src/cpu/append.cpp). A token the reference
// would refuse (a slot outside the pool; a NaN or inf in its latent or key, or under pow2 scales a
// value the fp8 blocks cannot hold, kPow2StorableMagnitudeBits) is left unwritten, and noted in the
// call's fault record when it has one (latentkv/device_fault.hpp).
#include <cstdint>

#include "cuda/common/chained_launch.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/common/device_fault.cuh"
#include "cuda/kv_cache/launch.hpp"
#include "latentkv/fp8.hpp"

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
  FaultSink fault;
};

__device__ __forceinline__ float abs_max_over(float v, int width) {
  for (int offset = width / 2; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Magnitudes (bf16 bits & 0x7FFF) from which a value is refused: the non-finite ones (0x7F80), and
// where it goes into an fp8 block under a pow2 scale also the finite ones that block cannot hold.
constexpr std::uint32_t kNonFiniteBits = 0x7F80u;
__device__ __forceinline__ std::uint32_t refused_from(bool quantized_pow2) {
  return quantized_pow2 ? kPow2StorableMagnitudeBits : kNonFiniteBits;
}

// Whether both bf16 of `w` lie below magnitude `limit` (<= 0x8000): a half's magnitude plus
// 0x8000 - limit carries into its top bit exactly when it is at least `limit`, and never into the
// other half (magnitudes are below 0x8000), so one add per word tells; `bias` is that addend in both halves.
__device__ __forceinline__ std::uint32_t limit_bias(std::uint32_t limit) { return (0x8000u - limit) * 0x00010001u; }
__device__ __forceinline__ std::uint32_t carries_of(std::uint32_t w, std::uint32_t bias) {
  return (w & 0x7FFF7FFFu) + bias;
}

// Whether every bf16 of the lane's latent chunks and key words may be stored (the unloaded ones
// being zero): chunks 0 and 1 below `latent_limit` (an fp8 cache's quantized latent, or a bf16
// cache's verbatim one), chunk 2 finite (the rope, or a bf16 cache's last chunk), the key below `key_limit`.
__device__ __forceinline__ bool all_storable(const uint4 (&chunk)[3], const uint2& key, std::uint32_t latent_limit,
                                             std::uint32_t key_limit) {
  const std::uint32_t latent_bias = limit_bias(latent_limit), finite_bias = limit_bias(kNonFiniteBits),
                      key_bias = limit_bias(key_limit);
  std::uint32_t carries = carries_of(key.x, key_bias) | carries_of(key.y, key_bias);
#pragma unroll
  for (int c = 0; c < 3; ++c) {
    const std::uint32_t bias = c < 2 ? latent_bias : finite_bias;
    carries |= carries_of(chunk[c].x, bias) | carries_of(chunk[c].y, bias) | carries_of(chunk[c].z, bias) |
               carries_of(chunk[c].w, bias);
  }
  return (carries & 0x80008000u) == 0;
}

// The first element (0-7) of the eight bf16 in `c` whose magnitude is at least `limit`, or -1;
// `bits` gets its bits.
__device__ int first_refused(const uint4& c, std::uint32_t limit, std::uint32_t& bits) {
  const std::uint32_t words[4] = {c.x, c.y, c.z, c.w};
  for (int i = 0; i < 8; ++i) {
    const std::uint32_t b = (words[i / 2] >> (16 * (i % 2))) & 0xFFFFu;
    if ((b & 0x7FFFu) >= limit) {
      bits = b;
      return i;
    }
  }
  return -1;
}

// A token with a refused value: its lowest such element over the warp (each lane's candidate
// `element`, -1 for none, with its bits) recorded with `code` by the lane that holds it. True when
// there is one.
__device__ bool record_refused(const AppendArgs& a, DeviceFaultCode code, std::int64_t row, int width, int element,
                                 std::uint32_t bits) {
  if (__ballot_sync(0xffffffffu, element >= 0) == 0) return false;
  int lowest = element >= 0 ? element : INT32_MAX;
  for (int off = 16; off > 0; off /= 2) lowest = min(lowest, __shfl_xor_sync(0xffffffffu, lowest, off));
  if (element == lowest) record_fault(a.fault, code, {.index = row * width + element, .value = bits});
  return true;
}

// The fault of a refused token (the whole warp): the lowest refused latent element, else the
// lowest refused key element. Lane l holds latent chunks 2l, 2l + 1 and rope chunk 64 + l on an
// fp8 cache, chunks l, l + 32 and l + 64 on a bf16 one (8 elements each), and key elements 4l .. 4l + 3.
__device__ void refuse(const AppendArgs& a, std::int64_t token, int lane, const uint4 (&chunk)[3], const uint2& key,
                       std::uint32_t latent_limit, std::uint32_t key_limit) {
  const int at[3] = {a.fp8 ? 2 * lane : lane, a.fp8 ? 2 * lane + 1 : lane + 32, a.fp8 ? 64 + lane : lane + 64};
  int element = -1;
  std::uint32_t bits = 0;
  for (int c = 2; c >= 0; --c) {  // falling order: the last found is the lowest
    std::uint32_t b = 0;
    const int i = first_refused(chunk[c], c < 2 ? latent_limit : kNonFiniteBits, b);
    if (i >= 0) {
      element = 8 * at[c] + i;
      bits = b;
    }
  }
  if (record_refused(a, DeviceFaultCode::kLatent, token, 576, element, bits)) return;
  const int i = first_refused(make_uint4(key.x, key.y, 0u, 0u), key_limit, bits);
  record_refused(a, DeviceFaultCode::kIndexerKey, token, 128, i >= 0 ? 4 * lane + i : -1, bits);
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
  // Refused (as the reference refuses the whole call): a non-finite latent or key value, or under
  // pow2 scales one its fp8 block cannot hold. The test and its vote go out with the conversion
  // below (nothing there depends on them) and are read only before the first store.
  const std::uint32_t latent_limit = refused_from(a.fp8 && a.pow2), key_limit = refused_from(a.pow2);
  const bool storable = __all_sync(0xffffffffu, all_storable(chunk, key, latent_limit, key_limit));

  // fp8 latent: lane l holds values [16 l, 16 l + 16), in scale block l / 8.
  std::uint32_t codes[4] = {0, 0, 0, 0};
  float scale = 0.0f;
  if (a.fp8) {
    float v[16];
    const float amax = abs_max_over(unpack_bf16x16(chunk[0], chunk[1], v), 8);
    scale = block_scale(amax, a.pow2);
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      codes[i / 4] |= static_cast<std::uint32_t>(encode_fp8(__fdiv_rn(v[i], scale))) << (8 * (i % 4));
    }
  }
  if (slot < -1 || slot >= a.num_slots) {
    if (lane == 0) record_fault(a.fault, DeviceFaultCode::kSlot, {.index = token, .value = slot, .bound = a.num_slots});
    return;
  }
  if (!storable) {  // noted whatever the slot, -1 too: the reference checks every token's values
    refuse(a, token, lane, chunk, key, latent_limit, key_limit);
    return;
  }
  if (slot == -1) return;

  if (!a.fp8) {  // bf16 cache: 1152 bytes verbatim, 72 chunks of 16 bytes
    uint4* d = reinterpret_cast<uint4*>(a.cache + slot * 1152);
    for (int c = 0; c < 3; ++c) {
      if (lane + 32 * c < 72) d[lane + 32 * c] = chunk[c];
    }
  } else {
    std::uint8_t* dst = a.cache + slot * 656;
    reinterpret_cast<uint4*>(dst)[lane] = make_uint4(codes[0], codes[1], codes[2], codes[3]);
    if (lane % 8 == 0) reinterpret_cast<float*>(dst + 512)[lane / 8] = scale;
    if (lane < 8) reinterpret_cast<uint4*>(dst + 528)[lane] = chunk[2];
  }

  if (a.indexer != nullptr) {
    // Lane l holds key values [4 l, 4 l + 4); one scale for all 128.
    const float k[4] = {bf16_bits_to_float(key.x & 0xFFFFu), bf16_bits_to_float(key.x >> 16),
                        bf16_bits_to_float(key.y & 0xFFFFu), bf16_bits_to_float(key.y >> 16)};
    const float amax = abs_max_over(fmaxf(fmaxf(fabsf(k[0]), fabsf(k[1])), fmaxf(fabsf(k[2]), fabsf(k[3]))), 32);
    const float key_scale = block_scale(amax, a.pow2);
    std::uint32_t packed = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) packed |= static_cast<std::uint32_t>(encode_fp8(__fdiv_rn(k[i], key_scale))) << (8 * i);
    const std::int64_t page = slot / a.page_size, offset = slot % a.page_size;
    std::uint8_t* page_base = a.indexer + page * static_cast<std::int64_t>(a.page_size) * 132;
    reinterpret_cast<std::uint32_t*>(page_base + offset * 128)[lane] = packed;
    if (lane == 0) {
      // The scale area may sit at any 4-byte boundary (page_size * 128 is a multiple of 4).
      reinterpret_cast<float*>(page_base + static_cast<std::int64_t>(a.page_size) * 128)[offset] = key_scale;
    }
  }
}

}  // namespace

void check_append_call(const AppendParams& p) {
  check_fault_record(p.fault, "append");
  if (p.latent.size(0) == 0) return;
  check_aligned("append", "latent", p.latent.data, 16);     // read as 16-byte chunks
  check_aligned("append", "cache.data", p.cache.data, 16);  // written as 16-byte chunks
  if (p.indexer.data != nullptr) {
    check_aligned("append", "indexer_keys", p.indexer_keys.data, 8);  // read as 8-byte pieces
    check_aligned("append", "indexer.data", p.indexer.data, 4);       // written as 4-byte words
  }
}

void launch_append(const AppendParams& p, cudaStream_t stream) {
  check_append_call(p);
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
  a.fault = FaultSink{p.fault, DeviceFaultOp::kAppend};
  if (a.n == 0) return;
  const auto blocks = static_cast<unsigned>((a.n + kWarpsPerBlock - 1) / kWarpsPerBlock);
  launch_chained("append", append_kernel, blocks, kWarpsPerBlock * 32, 0, stream, false, a);
}

}  // namespace latentkv::cuda
