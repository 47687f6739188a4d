// tools/step_check.hpp - the check of a top-k answer that `latentkv step` applies to the GPU's
// selected slots before it times a strategy (host code, unit-tested in tests/cpu/step_report_test.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "check.hpp"
#include "step.hpp"

namespace latentkv::tools {

// Whether `slots` ([checked, q_len, k]) is a top-k of the GPU's own `logits` ([checked, q_len,
// max_len]) as SPEC section 4.5 defines it, whatever the tie-break: every entry -1 or the slot of a
// position the row sees, none twice, min(k, visible) of them, and no unselected visible logit above
// a selected one. Empty when it is; else what is wrong.
inline std::string topk_problem(const std::vector<float>& logits, const std::vector<std::int32_t>& slots,
                                const StepShape& s, const StepTables& t, int checked, std::int64_t max_len) {
  for (int b = 0; b < checked; ++b) {
    const std::int32_t* pages = t.block_table.data() + static_cast<std::size_t>(b) * t.max_pages;
    const std::int64_t length = t.seq_lens[static_cast<std::size_t>(b)];
    for (int i = 0; i < s.q_len; ++i) {
      const std::int64_t row = std::int64_t{b} * s.q_len + i;
      const std::int64_t visible = std::max<std::int64_t>(0, std::min(length, length - s.q_len + i + 1));
      const std::string why = topk_row_problem(logits.data() + row * max_len, visible, pages, s.page_size,
                                               slots.data() + row * s.topk, s.topk);
      if (!why.empty()) return "top-k row [" + std::to_string(b) + ", " + std::to_string(i) + "]: " + why;
    }
  }
  return {};
}

}  // namespace latentkv::tools
