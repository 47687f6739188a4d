// tools/bench_work.hpp - what a sparse op must read, counted on the host from its index rows: the
// distinct cache entries each request's rows select. Rows of one request that select the same
// entry (the q_len rows of a decode, the new tokens of a prefill) need it read once, so the bytes a
// bench row credits its op with count it once. Plain C++, tested without a GPU
// (tests/cpu/bench_cli_test.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <span>
#include <vector>

namespace latentkv::tools {

// Entries selected by index rows laid out [requests][rows_per_request][topk], counted once per
// request (-1 padding and other negative slots not at all), summed over the requests.
inline std::int64_t distinct_selected_entries(std::span<const std::int32_t> rows, std::int64_t rows_per_request,
                                              std::int64_t topk) {
  const std::int64_t per_request = rows_per_request * topk;
  std::int64_t total = 0;
  std::vector<std::int32_t> slots;
  const auto size = static_cast<std::int64_t>(rows.size());
  for (std::int64_t start = 0; per_request > 0 && start < size; start += per_request) {
    const auto first = rows.begin() + start;
    const auto last = rows.begin() + std::min(start + per_request, size);
    slots.clear();
    std::copy_if(first, last, std::back_inserter(slots), [](std::int32_t slot) { return slot >= 0; });
    std::sort(slots.begin(), slots.end());
    total += std::unique(slots.begin(), slots.end()) - slots.begin();
  }
  return total;
}

}  // namespace latentkv::tools
