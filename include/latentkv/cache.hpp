// latentkv/cache.hpp - byte-exact paged cache layouts (SPEC section 3) and their descriptors.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "latentkv/dtype.hpp"

namespace latentkv {

inline constexpr int kLatentDim = 512;        // kv_lora_rank, the value width
inline constexpr int kRopeDim = 64;           // qk_rope_head_dim
inline constexpr int kQkDim = 576;            // latent + rope
inline constexpr int kIndexerDim = 128;       // indexer key width
inline constexpr int kFp8ScaleBlock = 128;    // latent values per float32 scale
inline constexpr int kFp8ScalesPerToken = kLatentDim / kFp8ScaleBlock;  // 4
inline constexpr int kDefaultPageSize = 64;

// fp8_e4m3 main cache, per token: [0,512) fp8 latent, [512,528) 4 x f32 scales, [528,656) 64 x bf16 rope
inline constexpr std::size_t kFp8TokenBytes = 656;
inline constexpr std::size_t kFp8ScaleOffset = 512;
inline constexpr std::size_t kFp8RopeOffset = 528;
// bf16 main cache, per token: 576 bf16 values (512 latent, then 64 rope)
inline constexpr std::size_t kBf16TokenBytes = 1152;
// indexer key cache, per token (page-major: a page's fp8 keys, then the page's f32 scales)
inline constexpr std::size_t kIndexerTokenBytes = 132;

enum class KvDtype : std::uint8_t { kFp8E4M3, kBf16 };

std::string_view kv_dtype_name(KvDtype dtype);           // "fp8_e4m3", "bf16"
KvDtype parse_kv_dtype(std::string_view name);            // throws Error on an unknown name
std::size_t kv_token_bytes(KvDtype dtype);                // 656 or 1152

// num_pages x page_size, the slots of a pool; INT64_MAX where the product would not fit (a descriptor
// no call accepts: every op refuses pools of 2^31 slots or more).
inline std::int64_t pool_slots(std::int64_t num_pages, int page_size) {
  std::int64_t slots = 0;
  return __builtin_mul_overflow(num_pages, page_size, &slots) ? INT64_MAX : slots;
}

// The main latent cache: num_pages pages of page_size tokens, token-major inside a page.
struct LatentCache {
  std::uint8_t* data = nullptr;  // [num_pages, page_size, token_bytes] bytes
  KvDtype dtype = KvDtype::kFp8E4M3;
  std::int64_t num_pages = 0;
  int page_size = kDefaultPageSize;
  Device device{};

  std::size_t token_bytes() const { return kv_token_bytes(dtype); }
  std::int64_t num_slots() const { return pool_slots(num_pages, page_size); }
  std::size_t bytes() const { return static_cast<std::size_t>(num_slots()) * token_bytes(); }
  std::uint8_t* token(std::int64_t slot) const { return data + static_cast<std::size_t>(slot) * token_bytes(); }
};

// The indexer key cache: per page, page_size x 128 fp8 bytes, then page_size float32 scales.
struct IndexerCache {
  std::uint8_t* data = nullptr;  // [num_pages, page_size * 132] bytes
  std::int64_t num_pages = 0;
  int page_size = kDefaultPageSize;
  Device device{};

  std::int64_t num_slots() const { return pool_slots(num_pages, page_size); }
  std::size_t page_bytes() const { return static_cast<std::size_t>(page_size) * kIndexerTokenBytes; }
  std::size_t bytes() const { return static_cast<std::size_t>(num_pages) * page_bytes(); }
  std::uint8_t* key(std::int64_t slot) const {  // 128 fp8 codes
    return data + static_cast<std::size_t>(slot / page_size) * page_bytes() +
           static_cast<std::size_t>(slot % page_size) * kIndexerDim;
  }
  float* scale_ptr(std::int64_t slot) const {  // may be unaligned only if data is
    return reinterpret_cast<float*>(data + static_cast<std::size_t>(slot / page_size) * page_bytes() +
                                    static_cast<std::size_t>(page_size) * kIndexerDim) +
           slot % page_size;
  }
};

}  // namespace latentkv
