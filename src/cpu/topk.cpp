// Top-k over the indexer logits, returned as physical slots (SPEC section 4.5).
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/validate.hpp"
#include "cpu/common.hpp"
#include "cpu/reference.hpp"

namespace latentkv::cpu {

namespace internal {

void topk_row(const float* x, std::int64_t visible, std::int64_t k, const std::vector<std::int64_t>& slots,
              std::vector<std::int64_t>& positions, std::int32_t* out) {
  positions.resize(static_cast<std::size_t>(visible));
  std::iota(positions.begin(), positions.end(), 0);
  const std::int64_t chosen = std::min(k, visible);
  // Largest logit first; ties go to the earlier position (any choice is allowed). A NaN, which only
  // indexer_prefill lets through (from a NaN key scale in a cache the append did not write), ranks
  // below every number, so that the order stays a strict weak ordering.
  const auto before = [x](std::int64_t a, std::int64_t c) {
    const bool a_nan = std::isnan(x[a]), c_nan = std::isnan(x[c]);
    if (a_nan != c_nan) return c_nan;
    if (!a_nan && x[a] != x[c]) return x[a] > x[c];
    return a < c;
  };
  std::partial_sort(positions.begin(), positions.begin() + chosen, positions.end(), before);
  for (std::int64_t j = 0; j < chosen; ++j) {
    out[j] = static_cast<std::int32_t>(slots[static_cast<std::size_t>(positions[static_cast<std::size_t>(j)])]);
  }
  std::fill(out + chosen, out + k, -1);
}

}  // namespace internal

void topk(const TopkParams& p) {
  latentkv::detail::validate_shapes(p, Device::cpu());
  latentkv::detail::validate_values(p);

  const std::int64_t batch = p.logits.size(0), q_len = p.logits.size(1), max_len = p.logits.size(2);
  const auto* logits = p.logits.as<const float>();         // [B, q_len, max_len]
  const auto* lens = p.seq_lens.as<const std::int32_t>();  // [B]
  auto* out = p.slots.as<std::int32_t>();                  // [B, q_len, k]

  std::vector<std::int64_t> slots, positions;  // [length] each
  internal::reserve_for_longest("topk", p.seq_lens, 2 * sizeof(std::int64_t), [&](std::int64_t n) {
    slots.reserve(static_cast<std::size_t>(n));
    positions.reserve(static_cast<std::size_t>(n));
  });
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t length = lens[b];
    internal::request_slots(p.block_table, b, length, p.page_size, slots);
    for (std::int64_t i = 0; i < q_len; ++i) {
      const std::int64_t row = b * q_len + i;
      const std::int64_t visible = std::min(length, internal::visible_positions(length, q_len, i));
      internal::topk_row(logits + row * max_len, visible, p.k, slots, positions, out + row * p.k);
    }
  }
}

}  // namespace latentkv::cpu
