// Lightning-indexer logits (SPEC section 4.4).
#include <algorithm>
#include <limits>
#include <vector>

#include "core/validate.hpp"
#include "cpu/common.hpp"
#include "cpu/reference.hpp"
#include "latentkv/fp8.hpp"

namespace latentkv::cpu {

void indexer_logits(const IndexerLogitsParams& p) {
  latentkv::detail::validate_shapes(p, Device::cpu());
  latentkv::detail::validate_values(p);

  const std::int64_t batch = p.q.size(0), q_len = p.q.size(1), max_len = p.logits.size(2);
  const int heads = static_cast<int>(p.q.size(2));
  const auto* q = p.q.as<const std::uint8_t>();            // [B, q_len, Hi, 128] fp8
  const auto* weights = p.weights.as<const float>();       // [B, q_len, Hi]
  const auto* lens = p.seq_lens.as<const std::int32_t>();  // [B]
  auto* logits = p.logits.as<float>();                     // [B, q_len, max_len]

  std::vector<double> q_row(static_cast<std::size_t>(heads) * kIndexerDim);  // [Hi, 128]
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t length = lens[b];
    const std::vector<std::int64_t> slots = internal::request_slots(p.block_table, b, length, p.cache.page_size);
    std::vector<double> keys(static_cast<std::size_t>(length) * kIndexerDim);  // [length, 128], without scale
    std::vector<double> key_scales(static_cast<std::size_t>(length));          // [length]
    for (std::int64_t t = 0; t < length; ++t) {
      dequantize_indexer_key(p.cache, slots[static_cast<std::size_t>(t)], keys.data() + t * kIndexerDim,
                             &key_scales[static_cast<std::size_t>(t)]);
    }
    for (std::int64_t i = 0; i < q_len; ++i) {
      const std::int64_t row = b * q_len + i;
      for (std::int64_t j = 0; j < static_cast<std::int64_t>(q_row.size()); ++j) {
        q_row[static_cast<std::size_t>(j)] = fp8_e4m3_decode(q[row * heads * kIndexerDim + j]);
      }
      const float* w = weights + row * heads;  // [Hi]
      const std::int64_t visible = std::min(length, internal::visible_positions(length, q_len, i));
      float* out = logits + row * max_len;  // [max_len]
      for (std::int64_t t = 0; t < visible; ++t) {
        const double* k = keys.data() + t * kIndexerDim;  // [128]
        double sum = 0.0;
        for (int h = 0; h < heads; ++h) {
          const double* qh = q_row.data() + static_cast<std::ptrdiff_t>(h) * kIndexerDim;
          double dot = 0.0;
          for (int j = 0; j < kIndexerDim; ++j) dot += qh[j] * k[j];
          if (dot > 0.0) sum += static_cast<double>(w[h]) * dot;
        }
        out[t] = static_cast<float>(sum * key_scales[static_cast<std::size_t>(t)]);
      }
      for (std::int64_t t = visible; t < max_len; ++t) out[t] = -std::numeric_limits<float>::infinity();
    }
  }
}

}  // namespace latentkv::cpu
