// tests/gpu/topk_check.hpp - checking a top-k answer against the reference's when ties may be
// broken either way (SPEC section 4.5).
//
// For every query row (b, i), which sees positions t < max(0, L_b - q_len + i + 1):
//  * every entry is -1 or a slot of the row's page table at a visible position (the sentinel of an
//    unwritten entry, a position the row cannot see, or a slot of another request all fail);
//  * no slot is listed twice;
//  * there are as many -1 entries as in the reference's row;
//  * the selected logits, sorted, equal the reference's selected logits, sorted, exactly.
// So any tie-break passes, and nothing else does.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "support/host_tensor.hpp"
#include "support/paged_fixture.hpp"

namespace latentkv::testing {

// A float with the digits that tell any two floats apart.
inline std::string float_text(float v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.9g", static_cast<double>(v));
  return buf;
}

// logits [B, q_len, max_len] f32; got and want [B, q_len, k] i32. Slots are mapped back through
// f.block_table for f.seq_lens (what the kernel was given), not through the allocator.
inline ::testing::AssertionResult check_topk_rows(const PagedFixture& f, const HostTensor& logits,
                                                  const HostTensor& got, const HostTensor& want) {
  const std::int64_t batch = logits.shape()[0], q_len = logits.shape()[1], max_len = logits.shape()[2];
  const std::int64_t k = got.shape()[2];
  if (got.shape() != want.shape() || got.shape()[0] != batch || got.shape()[1] != q_len) {
    return ::testing::AssertionFailure() << "slots shaped unlike the reference's";
  }
  const int page_size = f.page_size;
  const std::int64_t num_slots = f.num_pages() * page_size;
  const float* x = logits.data<float>();           // [B, q_len, max_len]
  const std::int32_t* g = got.data<std::int32_t>();   // [B, q_len, k]
  const std::int32_t* w = want.data<std::int32_t>();  // [B, q_len, k]

  std::vector<std::int32_t> position_of(static_cast<std::size_t>(num_slots), -1);  // slot -> position in request b
  std::vector<std::int32_t> row_slots;
  std::vector<float> got_values, want_values;
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t length = f.seq_lens[static_cast<std::size_t>(b)];
    const std::int32_t* pages = f.block_table.data() + b * f.max_pages;  // [max_pages]
    const auto slot_of = [&](std::int64_t t) { return std::int64_t{pages[t / page_size]} * page_size + t % page_size; };
    for (std::int64_t t = 0; t < length; ++t) position_of[static_cast<std::size_t>(slot_of(t))] = static_cast<std::int32_t>(t);

    for (std::int64_t i = 0; i < q_len; ++i) {
      const std::int64_t row = b * q_len + i;
      const std::int64_t visible = std::max<std::int64_t>(0, length - q_len + i + 1);
      const auto where = [&] {
        return "row [" + std::to_string(b) + ", " + std::to_string(i) + "] (length " + std::to_string(length) +
               ", visible " + std::to_string(visible) + ", k " + std::to_string(k) + "): ";
      };
      // The answer's entries: valid slots of visible positions, or -1.
      got_values.clear();
      row_slots.clear();
      std::int64_t got_pads = 0;
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int32_t s = g[row * k + j];
        if (s == -1) {
          ++got_pads;
          continue;
        }
        if (s == kSentinelI32) return ::testing::AssertionFailure() << where() << "entry " << j << " was never written";
        const std::int32_t t = s >= 0 && s < num_slots ? position_of[static_cast<std::size_t>(s)] : -1;
        if (t < 0) return ::testing::AssertionFailure() << where() << "entry " << j << " = " << s << " is not a slot of the request";
        if (t >= visible) {
          return ::testing::AssertionFailure() << where() << "entry " << j << " = slot " << s << " is position " << t
                                               << ", which the row cannot see";
        }
        row_slots.push_back(s);
        got_values.push_back(x[row * max_len + t]);
      }
      std::sort(row_slots.begin(), row_slots.end());
      const auto twice = std::adjacent_find(row_slots.begin(), row_slots.end());
      if (twice != row_slots.end()) return ::testing::AssertionFailure() << where() << "slot " << *twice << " listed twice";

      // The reference's row, the same way.
      want_values.clear();
      std::int64_t want_pads = 0;
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int32_t s = w[row * k + j];
        if (s == -1) ++want_pads;
        else want_values.push_back(x[row * max_len + position_of[static_cast<std::size_t>(s)]]);
      }
      if (got_pads != want_pads) {
        return ::testing::AssertionFailure() << where() << got_pads << " entries are -1, the reference has " << want_pads;
      }
      std::sort(got_values.begin(), got_values.end(), std::greater<>());
      std::sort(want_values.begin(), want_values.end(), std::greater<>());
      for (std::size_t j = 0; j < want_values.size(); ++j) {
        if (!(got_values[j] == want_values[j])) {
          return ::testing::AssertionFailure() << where() << "the " << j << "-th largest selected logit is "
                                               << float_text(got_values[j]) << ", the reference's is "
                                               << float_text(want_values[j]);
        }
      }
    }
    for (std::int64_t t = 0; t < length; ++t) position_of[static_cast<std::size_t>(slot_of(t))] = -1;
  }
  return ::testing::AssertionSuccess();
}

}  // namespace latentkv::testing
