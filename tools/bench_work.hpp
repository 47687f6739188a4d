// tools/bench_work.hpp - what a sparse op must read, counted on the host from its index rows: the
// distinct cache entries each request's rows select. Rows of one request that select the same
// entry (the q_len rows of a decode, the new tokens of a prefill) need it read once, so the bytes a
// bench row credits its op with count it once. Plain C++, tested without a GPU
// (tests/cpu/bench_cli_test.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

namespace latentkv::tools {

// Entries selected by index rows laid out [requests][rows_per_request][topk], counted once per
// request (-1 padding and other negative slots not at all), summed over the requests. One pass over
// the rows with a bitmap of the slots (cleared where a request set it), so that a prefill's
// new_tokens x topk slots a request cost no sort: linear in the rows, a bit per slot of the pool.
inline std::int64_t distinct_selected_entries(std::span<const std::int32_t> rows, std::int64_t rows_per_request,
                                              std::int64_t topk) {
  const std::int64_t per_request = rows_per_request * topk;
  const auto size = static_cast<std::int64_t>(rows.size());
  if (per_request <= 0 || size == 0) return 0;
  const std::int32_t largest = *std::max_element(rows.begin(), rows.end());
  if (largest < 0) return 0;
  std::vector<std::uint64_t> seen(static_cast<std::size_t>(largest) / 64 + 1, 0);
  std::int64_t total = 0;
  for (std::int64_t start = 0; start < size; start += per_request) {
    const auto request = rows.subspan(static_cast<std::size_t>(start),
                                      static_cast<std::size_t>(std::min(per_request, size - start)));
    for (const std::int32_t slot : request) {
      if (slot < 0) continue;
      std::uint64_t& word = seen[static_cast<std::size_t>(slot) / 64];
      const std::uint64_t bit = std::uint64_t{1} << (slot % 64);
      total += (word & bit) == 0;
      word |= bit;
    }
    for (const std::int32_t slot : request) {
      if (slot >= 0) seen[static_cast<std::size_t>(slot) / 64] = 0;
    }
  }
  return total;
}

}  // namespace latentkv::tools
