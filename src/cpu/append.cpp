// append: quantize new tokens into the main and indexer caches (SPEC sections 3 and 4.1).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/validate.hpp"
#include "cpu/reference.hpp"
#include "latentkv/fp8.hpp"

namespace latentkv::cpu {
namespace {

// Quantizes n bf16 values with one scale: amax over the values as float, the scale from the mode,
// code = fp8(x / scale) with the division in float32. Returns the scale.
float quantize_block(const std::uint16_t* x,  // [n] bf16
                     int n, ScaleMode mode,
                     std::uint8_t* codes) {    // [n] fp8
  float amax = 0.0f;
  for (int j = 0; j < n; ++j) amax = std::max(amax, std::fabs(bf16_decode(x[j])));
  const float scale = fp8_block_scale(amax, mode);
  for (int j = 0; j < n; ++j) codes[j] = fp8_e4m3_encode(bf16_decode(x[j]) / scale);
  return scale;
}

void write_latent(const LatentCache& cache, std::int64_t slot,
                  const std::uint16_t* latent,  // [576] bf16
                  ScaleMode mode) {
  std::uint8_t* token = cache.token(slot);  // [token_bytes] bytes
  if (cache.dtype == KvDtype::kBf16) {
    std::memcpy(token, latent, kBf16TokenBytes);
    return;
  }
  float scales[kFp8ScalesPerToken];
  for (int blk = 0; blk < kFp8ScalesPerToken; ++blk) {
    scales[blk] = quantize_block(latent + blk * kFp8ScaleBlock, kFp8ScaleBlock, mode, token + blk * kFp8ScaleBlock);
  }
  std::memcpy(token + kFp8ScaleOffset, scales, sizeof scales);
  std::memcpy(token + kFp8RopeOffset, latent + kLatentDim, kRopeDim * sizeof(std::uint16_t));
}

void write_indexer_key(const IndexerCache& cache, std::int64_t slot,
                       const std::uint16_t* key,  // [128] bf16
                       ScaleMode mode) {
  const float scale = quantize_block(key, kIndexerDim, mode, cache.key(slot));
  std::memcpy(cache.scale_ptr(slot), &scale, sizeof scale);  // the float may be unaligned
}

}  // namespace

void append(const AppendParams& p) {
  latentkv::detail::validate_shapes(p, Device::cpu());
  latentkv::detail::validate_values(p);

  const std::int64_t n = p.latent.size(0);
  const auto* latent = p.latent.as<const std::uint16_t>();  // [n, 576] bf16
  const auto* slots = p.slots.as<const std::int32_t>();     // [n]
  const std::uint16_t* keys =                               // [n, 128] bf16, or null
      p.indexer.data != nullptr ? p.indexer_keys.as<const std::uint16_t>() : nullptr;
  for (std::int64_t i = 0; i < n; ++i) {
    if (slots[i] < 0) continue;  // -1: not stored
    write_latent(p.cache, slots[i], latent + i * kQkDim, p.scale_mode);
    if (keys != nullptr) write_indexer_key(p.indexer, slots[i], keys + i * kIndexerDim, p.scale_mode);
  }
}

}  // namespace latentkv::cpu
