// Dequantization of the cache bytes, exactly as the kernels read them (SPEC section 3).
#include <cstdio>
#include <cstring>
#include <new>
#include <stdexcept>
#include <string>

#include "cpu/common.hpp"
#include "cpu/reference.hpp"
#include "latentkv/error.hpp"
#include "latentkv/fp8.hpp"

namespace latentkv::cpu {
namespace {

void check_slot(std::string_view op, std::int64_t slot, std::int64_t num_slots) {
  if (slot < 0 || slot >= num_slots) {
    throw Error(std::string(op), "slot", std::to_string(slot), "0 .. " + std::to_string(num_slots - 1));
  }
}

[[noreturn]] void fail_scratch(std::string_view op, std::int64_t request, std::int64_t length, double bytes_per_token) {
  char size[32];
  std::snprintf(size, sizeof size, "%.1f GB", static_cast<double>(length) * bytes_per_token / 1e9);
  throw Error(std::string(op), "seq_lens[" + std::to_string(request) + "]", std::to_string(length),
              std::string("a length whose scratch the host can allocate (the CPU reference holds a request's "
                          "dequantized tokens at once: ") +
                  size + " for this one could not be allocated)");
}

}  // namespace

namespace internal {

void dequantize_token_f32(const LatentCache& cache, std::int64_t slot, float* out576) {
  const std::uint8_t* token = cache.token(slot);  // [token_bytes] bytes
  if (cache.dtype == KvDtype::kBf16) {
    for (int j = 0; j < kQkDim; ++j) {
      std::uint16_t bits;
      std::memcpy(&bits, token + 2 * j, sizeof bits);
      out576[j] = bf16_decode(bits);
    }
    return;
  }
  float scales[kFp8ScalesPerToken];
  std::memcpy(scales, token + kFp8ScaleOffset, sizeof scales);
  for (int j = 0; j < kLatentDim; ++j) {
    // The product in float32, as the kernels compute it.
    const float v = fp8_e4m3_decode(token[j]) * scales[j / kFp8ScaleBlock];
    out576[j] = v;
  }
  for (int j = 0; j < kRopeDim; ++j) {
    std::uint16_t bits;
    std::memcpy(&bits, token + kFp8RopeOffset + 2 * j, sizeof bits);
    out576[kLatentDim + j] = bf16_decode(bits);
  }
}

void gather_tokens(const LatentCache& cache, const std::vector<std::int64_t>& slots, std::vector<float>& keys) {
  keys.resize(slots.size() * kQkDim);  // [n, 576]
  for (std::size_t t = 0; t < slots.size(); ++t) dequantize_token_f32(cache, slots[t], keys.data() + t * kQkDim);
}

void request_slots(const TensorView& block_table, std::int64_t b, std::int64_t length, int page_size,
                   std::vector<std::int64_t>& slots) {
  const std::int64_t max_pages = block_table.size(1);
  const auto* row = block_table.as<const std::int32_t>() + b * max_pages;  // [max_pages] page ids
  slots.resize(static_cast<std::size_t>(length));
  for (std::int64_t t = 0; t < length; ++t) {
    slots[static_cast<std::size_t>(t)] = static_cast<std::int64_t>(row[t / page_size]) * page_size + t % page_size;
  }
}

void reserve_for_longest(std::string_view op, const TensorView& seq_lens, double bytes_per_token,
                         const std::function<void(std::int64_t)>& reserve) {
  const auto* lens = seq_lens.as<const std::int32_t>();  // [B], validated: 0 .. capacity
  std::int64_t longest = -1;
  for (std::int64_t b = 0; b < seq_lens.size(0); ++b) {
    if (longest < 0 || lens[b] > lens[longest]) longest = b;
  }
  if (longest < 0) return;
  try {
    reserve(lens[longest]);
  } catch (const std::bad_alloc&) {
    fail_scratch(op, longest, lens[longest], bytes_per_token);
  } catch (const std::length_error&) {
    fail_scratch(op, longest, lens[longest], bytes_per_token);
  }
}

}  // namespace internal

void dequantize_token(const LatentCache& cache, std::int64_t slot, double* out576) {
  check_slot("dequantize_token", slot, cache.num_slots());
  float values[kQkDim];
  internal::dequantize_token_f32(cache, slot, values);
  for (int j = 0; j < kQkDim; ++j) out576[j] = values[j];
}

void dequantize_indexer_key(const IndexerCache& cache, std::int64_t slot, double* out128, double* scale) {
  check_slot("dequantize_indexer_key", slot, cache.num_slots());
  const std::uint8_t* key = cache.key(slot);  // [128] fp8 codes
  for (int j = 0; j < kIndexerDim; ++j) out128[j] = fp8_e4m3_decode(key[j]);
  float s;
  std::memcpy(&s, cache.scale_ptr(slot), sizeof s);
  *scale = s;
}

}  // namespace latentkv::cpu
