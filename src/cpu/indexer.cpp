// Lightning-indexer logits (SPEC section 4.4), and the indexer prefill: logits then top-k of every
// new token of a prompt.
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

#include "core/validate.hpp"
#include "cpu/common.hpp"
#include "cpu/reference.hpp"
#include "latentkv/fp8.hpp"

namespace latentkv::cpu {

namespace internal {

void indexer_row(const double* q, const float* w, int heads, const double* keys, const double* key_scales,
                 std::int64_t visible, float* out) {
  for (std::int64_t t = 0; t < visible; ++t) {
    const double* k = keys + t * kIndexerDim;  // [128]
    double sum = 0.0;
    for (int h = 0; h < heads; ++h) {
      const double* qh = q + static_cast<std::ptrdiff_t>(h) * kIndexerDim;
      double dot = 0.0;
      for (int j = 0; j < kIndexerDim; ++j) dot += qh[j] * k[j];
      if (dot > 0.0) sum += static_cast<double>(w[h]) * dot;
    }
    out[t] = static_cast<float>(sum * key_scales[t]);
  }
}

}  // namespace internal

namespace {

// Scratch per token of a request: its slot, its 128 key values and its scale.
constexpr double kKeyScratchBytes = sizeof(std::int64_t) + (kIndexerDim + 1) * sizeof(double);

void reserve_keys(std::int64_t n, std::vector<std::int64_t>& slots, std::vector<double>& keys,
                  std::vector<double>& scales) {
  slots.reserve(static_cast<std::size_t>(n));
  keys.reserve(static_cast<std::size_t>(n) * kIndexerDim);
  scales.reserve(static_cast<std::size_t>(n));
}

// The keys at `slots`, dequantized: keys [n, 128] without scale, scales [n].
void load_keys(const IndexerCache& cache, const std::vector<std::int64_t>& slots, std::vector<double>& keys,
               std::vector<double>& scales) {
  const auto length = static_cast<std::int64_t>(slots.size());
  keys.resize(static_cast<std::size_t>(length) * kIndexerDim);
  scales.resize(static_cast<std::size_t>(length));
  for (std::int64_t t = 0; t < length; ++t) {
    dequantize_indexer_key(cache, slots[static_cast<std::size_t>(t)], keys.data() + t * kIndexerDim,
                           &scales[static_cast<std::size_t>(t)]);
  }
}

// Query row `row` of an fp8 tensor of [rows, heads, 128] codes (leading dims flattened) as doubles.
void load_indexer_query(const TensorView& q, std::int64_t row, int heads, std::vector<double>& out) {
  const auto* codes = q.as<const std::uint8_t>() + row * heads * kIndexerDim;
  out.resize(static_cast<std::size_t>(heads) * kIndexerDim);
  for (std::size_t j = 0; j < out.size(); ++j) out[j] = fp8_e4m3_decode(codes[j]);
}

}  // namespace

void indexer_logits(const IndexerLogitsParams& p) {
  latentkv::detail::validate_shapes(p, Device::cpu());
  latentkv::detail::validate_values(p);

  const std::int64_t batch = p.q.size(0), q_len = p.q.size(1), max_len = p.logits.size(2);
  const int heads = static_cast<int>(p.q.size(2));
  const auto* weights = p.weights.as<const float>();       // [B, q_len, Hi]
  const auto* lens = p.seq_lens.as<const std::int32_t>();  // [B]
  auto* logits = p.logits.as<float>();                     // [B, q_len, max_len]
  std::vector<double> q_row, keys, key_scales;  // keys [length, 128], key_scales [length]
  std::vector<std::int64_t> slots;              // [length]
  internal::reserve_for_longest("indexer_logits", p.seq_lens, kKeyScratchBytes, [&](std::int64_t n) {
    reserve_keys(n, slots, keys, key_scales);
  });
  if (p.clear_bytes > 0) std::memset(p.clear, 0, p.clear_bytes);

  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t length = lens[b];
    internal::request_slots(p.block_table, b, length, p.cache.page_size, slots);
    load_keys(p.cache, slots, keys, key_scales);
    for (std::int64_t i = 0; i < q_len; ++i) {
      const std::int64_t row = b * q_len + i;
      load_indexer_query(p.q, row, heads, q_row);
      const std::int64_t visible = std::min(length, internal::visible_positions(length, q_len, i));
      float* out = logits + row * max_len;  // [max_len]
      internal::indexer_row(q_row.data(), weights + row * heads, heads, keys.data(), key_scales.data(), visible, out);
      std::fill(out + visible, out + max_len, -std::numeric_limits<float>::infinity());
    }
  }
}

void indexer_prefill(const IndexerPrefillParams& p) {
  latentkv::detail::validate_shapes(p, Device::cpu());
  latentkv::detail::validate_values(p);

  const std::int64_t batch = p.seq_lens.size(0), k = p.k;
  const int heads = static_cast<int>(p.q.size(1));
  const auto* cu = p.cu_new_tokens.as<const std::int32_t>();  // [B + 1]
  const auto* weights = p.weights.as<const float>();          // [T, Hi]
  const auto* lens = p.seq_lens.as<const std::int32_t>();     // [B]
  auto* out = p.slots.as<std::int32_t>();                     // [T, k]

  std::vector<double> q_row, keys, key_scales;  // keys [length, 128], key_scales [length]
  std::vector<std::int64_t> slots, positions;   // [length] each
  std::vector<float> row_logits;                // [length]
  internal::reserve_for_longest(
      "indexer_prefill", p.seq_lens, kKeyScratchBytes + sizeof(std::int64_t) + sizeof(float), [&](std::int64_t n) {
        reserve_keys(n, slots, keys, key_scales);
        positions.reserve(static_cast<std::size_t>(n));
        row_logits.reserve(static_cast<std::size_t>(n));
      });
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t length = lens[b], n_new = cu[b + 1] - cu[b];
    internal::request_slots(p.block_table, b, length, p.cache.page_size, slots);
    load_keys(p.cache, slots, keys, key_scales);
    row_logits.resize(static_cast<std::size_t>(length));
    for (std::int64_t j = 0; j < n_new; ++j) {
      const std::int64_t row = cu[b] + j;
      load_indexer_query(p.q, row, heads, q_row);
      const std::int64_t visible = std::min(length, internal::visible_positions(length, n_new, j));
      internal::indexer_row(q_row.data(), weights + row * heads, heads, keys.data(), key_scales.data(), visible,
                            row_logits.data());
      internal::topk_row(row_logits.data(), visible, k, slots, positions, out + row * k);
    }
  }
}

}  // namespace latentkv::cpu
