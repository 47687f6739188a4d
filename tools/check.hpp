// tools/check.hpp - the SPEC section 5 check of an output against the float64 reference, for the
// benchmarks (no speed figure is reported for an output that fails it).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <unordered_map>
#include <vector>

#include "latentkv/fp8.hpp"

namespace latentkv::tools {

struct CheckResult {
  bool ok = true;
  std::size_t failures = 0;
  double max_abs_error = 0;
  double one_minus_cos = 0;
  std::string detail;
};

// Per element |a - b| <= atol or <= rtol |b|; NaN/inf positions equal; over the whole tensor
// 1 - cos <= max_one_minus_cos (skipped when negative).
template <typename GetA, typename GetB>
CheckResult check_close(std::size_t n, GetA a, GetB b, double atol, double rtol, double max_one_minus_cos) {
  CheckResult r;
  double dot = 0, na = 0, nb = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const double x = a(i), y = b(i);
    if (!std::isfinite(x) || !std::isfinite(y)) {
      const bool same = (std::isnan(x) && std::isnan(y)) || x == y;
      if (!same) ++r.failures;
      continue;
    }
    const double err = std::fabs(x - y);
    r.max_abs_error = std::max(r.max_abs_error, err);
    if (err > atol && err > rtol * std::fabs(y)) ++r.failures;
    dot += x * y;
    na += x * x;
    nb += y * y;
  }
  r.one_minus_cos = (na > 0 && nb > 0) ? 1.0 - dot / std::sqrt(na * nb) : 0.0;
  r.ok = r.failures == 0 && (max_one_minus_cos < 0 || r.one_minus_cos <= max_one_minus_cos);
  char buf[160];
  std::snprintf(buf, sizeof buf, "%zu of %zu out of tolerance, max |err| %.3g, 1-cos %.2g", r.failures, n,
                r.max_abs_error, r.one_minus_cos);
  r.detail = buf;
  return r;
}

// An attention op's outputs against the float64 reference: o (bf16) per SPEC section 5 (atol 1e-3,
// rtol 2/128, 1 - cos <= 5e-6) and lse within 1e-5 absolute. `detail` says what failed.
struct AttentionCheck {
  bool ok = true;
  double one_minus_cos = 0;
  std::string detail;
};
inline AttentionCheck check_attention(const std::vector<std::uint16_t>& o, const std::vector<float>& lse,
                                      const std::vector<double>& want_o, const std::vector<double>& want_lse) {
  const CheckResult co = check_close(
      o.size(), [&](std::size_t i) { return static_cast<double>(bf16_decode(o[i])); },
      [&](std::size_t i) { return want_o[i]; }, 1e-3, 2.0 / 128.0, 5e-6);
  const CheckResult cl = check_close(
      lse.size(), [&](std::size_t i) { return static_cast<double>(lse[i]); },
      [&](std::size_t i) { return want_lse[i]; }, 1e-5, 0.0, -1.0);
  AttentionCheck r;
  r.ok = co.ok && cl.ok;
  r.one_minus_cos = co.one_minus_cos;
  if (!r.ok) r.detail = "o " + co.detail + "; lse " + cl.detail;
  return r;
}

// One query row's top-k answer against the logits it was chosen from (SPEC 4.5, whatever the
// tie-break): every entry -1 or the slot of a position the row sees (t < visible, through the
// request's block table), none twice, min(k, visible) of them, and no unselected visible logit above
// a selected one by more than `tolerance` (0 when the answer was chosen from these very logits; more
// when they are the reference's and the answer came from float32 logits of its own). Empty when it
// holds; else what is wrong.
inline std::string topk_row_problem(const float* logits, std::int64_t visible, const std::int32_t* table, int page_size,
                                    const std::int32_t* slots, std::int64_t k, double tolerance = 0.0) {
  std::unordered_map<std::int32_t, std::int64_t> position_of;
  position_of.reserve(static_cast<std::size_t>(visible));
  for (std::int64_t t = 0; t < visible; ++t) {
    position_of[table[t / page_size] * page_size + static_cast<std::int32_t>(t % page_size)] = t;
  }
  std::vector<bool> chosen(static_cast<std::size_t>(visible), false);
  std::int64_t count = 0;
  float lowest = std::numeric_limits<float>::infinity();
  for (std::int64_t j = 0; j < k; ++j) {
    if (slots[j] == -1) continue;
    const auto it = position_of.find(slots[j]);
    if (it == position_of.end()) {
      return "entry " + std::to_string(j) + " = " + std::to_string(slots[j]) + " is not a slot the row sees";
    }
    if (chosen[static_cast<std::size_t>(it->second)]) return "slot " + std::to_string(slots[j]) + " listed twice";
    chosen[static_cast<std::size_t>(it->second)] = true;
    lowest = std::min(lowest, logits[it->second]);
    ++count;
  }
  const std::int64_t expected = std::min(k, visible);
  if (count != expected) {
    return std::to_string(count) + " slots, expected min(k, visible) = " + std::to_string(expected);
  }
  for (std::int64_t t = 0; t < visible; ++t) {
    if (!chosen[static_cast<std::size_t>(t)] && logits[t] > lowest + tolerance) {
      return "position " + std::to_string(t) + " (logit " + std::to_string(logits[t]) + ") left out for a lower one (" +
             std::to_string(lowest) + ")";
    }
  }
  return {};
}

// topk_row_problem against the reference's logits of a row (all `visible` of them) whose answer
// the GPU chose from float32 logits of its own: a near tie may go either way within twice the
// indexer check's bound on a logit (1e-4 absolute or 1e-5 relative; here 1e-4 + 1e-5 x the row's
// largest |logit|, which covers either).
inline std::string topk_row_problem_near(const std::vector<float>& want, const std::int32_t* table, int page_size,
                                         const std::int32_t* slots, std::int64_t k) {
  double largest = 0;
  for (float v : want) largest = std::max(largest, std::abs(static_cast<double>(v)));
  return topk_row_problem(want.data(), static_cast<std::int64_t>(want.size()), table, page_size, slots, k,
                          2.0 * (1e-4 + 1e-5 * largest));
}

}  // namespace latentkv::tools
