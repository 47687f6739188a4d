// tools/step_check.hpp - the check of a top-k answer that `latentkv step` applies to the GPU's
// selected slots before it times a strategy (host code, unit-tested in tests/cpu/step_report_test.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "step.hpp"

namespace latentkv::tools {

// Whether `slots` ([checked, q_len, k]) is a top-k of the GPU's own `logits` ([checked, q_len,
// max_len]) as SPEC section 4.5 defines it, whatever the tie-break: every entry -1 or the slot of a
// position the row sees, none twice, min(k, visible) of them, and no unselected visible logit above
// a selected one. Empty when it is; else what is wrong.
inline std::string topk_problem(const std::vector<float>& logits, const std::vector<std::int32_t>& slots,
                                const StepShape& s, const StepTables& t, int checked, std::int64_t max_len) {
  const std::int64_t k = s.topk, num_slots = t.num_pages * s.page_size;
  std::vector<std::int32_t> position_of(static_cast<std::size_t>(num_slots), -1);
  std::vector<std::uint8_t> chosen;  // per position of the request: selected
  for (int b = 0; b < checked; ++b) {
    const std::int32_t* pages = t.block_table.data() + static_cast<std::size_t>(b) * t.max_pages;
    const std::int64_t length = t.seq_lens[static_cast<std::size_t>(b)];
    std::fill(position_of.begin(), position_of.end(), -1);
    chosen.resize(static_cast<std::size_t>(length));
    for (std::int64_t pos = 0; pos < length; ++pos) {
      position_of[static_cast<std::size_t>(std::int64_t{pages[pos / s.page_size]} * s.page_size + pos % s.page_size)] =
          static_cast<std::int32_t>(pos);
    }
    for (int i = 0; i < s.q_len; ++i) {
      const std::int64_t row = std::int64_t{b} * s.q_len + i, visible = std::min(length, length - s.q_len + i + 1);
      const std::string where = "top-k row [" + std::to_string(b) + ", " + std::to_string(i) + "]: ";
      const float* x = logits.data() + row * max_len;
      std::fill(chosen.begin(), chosen.end(), 0);
      std::int64_t count = 0;
      float lowest_chosen = std::numeric_limits<float>::infinity();
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int32_t slot = slots[static_cast<std::size_t>(row * k + j)];
        if (slot == -1) continue;
        const std::int32_t pos = slot >= 0 && slot < num_slots ? position_of[static_cast<std::size_t>(slot)] : -1;
        if (pos < 0 || pos >= visible) {
          return where + "entry " + std::to_string(j) + " = " + std::to_string(slot) + " is not a slot the row sees";
        }
        if (chosen[static_cast<std::size_t>(pos)]) return where + "slot " + std::to_string(slot) + " listed twice";
        chosen[static_cast<std::size_t>(pos)] = 1;
        lowest_chosen = std::min(lowest_chosen, x[pos]);
        ++count;
      }
      if (count != std::min(k, visible)) {
        return where + std::to_string(count) +
               " slots, expected min(k, visible) = " + std::to_string(std::min(k, visible));
      }
      for (std::int64_t pos = 0; pos < visible; ++pos) {
        if (!chosen[static_cast<std::size_t>(pos)] && x[pos] > lowest_chosen) {
          return where + "position " + std::to_string(pos) + " (logit " + std::to_string(x[pos]) +
                 ") left out for a lower one (" + std::to_string(lowest_chosen) + ")";
        }
      }
    }
  }
  return {};
}

}  // namespace latentkv::tools
