// tools/bench_work.hpp - the host arithmetic of a bench row, plain C++ tested without a GPU
// (tests/cpu/bench_cli_test.cpp): what a sparse op must read, counted from its index rows (the
// distinct cache entries each request's rows select: rows of one request that select the same entry,
// the q_len rows of a decode or the new tokens of a prefill, need it read once, so the bytes a bench
// row credits its op with count it once), and how many sets of inputs its timed calls rotate through.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace latentkv::tools {

// Entries selected by index rows laid out [requests][rows_per_request][topk], counted once per
// request (-1 padding and other negative slots not at all), summed over the requests. One pass over
// the rows with a bitmap of the pool's `pool_slots` slots (cleared where a request set it), so that
// a prefill's new_tokens x topk slots a request cost no sort. A slot at or past pool_slots is not
// the pool's: std::invalid_argument.
inline std::int64_t distinct_selected_entries(std::span<const std::int32_t> rows, std::int64_t rows_per_request,
                                              std::int64_t topk, std::int64_t pool_slots) {
  const std::int64_t per_request = rows_per_request * topk;
  const auto size = static_cast<std::int64_t>(rows.size());
  if (per_request <= 0 || size == 0) return 0;
  const std::int32_t largest = *std::max_element(rows.begin(), rows.end());
  if (largest >= pool_slots) {
    throw std::invalid_argument("distinct_selected_entries: slot " + std::to_string(largest) + " past the pool's " +
                                std::to_string(pool_slots) + " slots");
  }
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

// The sets of inputs a timed loop rotates through, so that no timed call finds its inputs in L2
// (the GPU bench's time_calls empties the L2 after the warm-up): enough that the sets read in one
// round of the rotation come to twice the L2's size or more (one set when a call alone reads that
// much), but no more than the loop's calls (warm-up and timed: beyond that no set is used twice),
// and within `fits`, the sets the pool has room for (the ops that read every token of their
// requests need requests of their own per set). `cold` is false when `fits` held the sets below
// that: the bench then says that some calls may read their inputs from L2. A device that reports no
// L2 gets one set.
struct Rotation {
  int sets = 1;
  bool cold = true;
};
inline constexpr std::int64_t kAnySets = std::int64_t{1} << 40;  // `fits` of inputs the pool does not bound
inline Rotation plan_rotation(std::int64_t bytes_per_call, std::int64_t l2_bytes, int calls, std::int64_t fits) {
  const std::int64_t bytes = std::max<std::int64_t>(bytes_per_call, 1);
  const std::int64_t wanted =
      std::clamp<std::int64_t>((2 * std::max<std::int64_t>(l2_bytes, 0) + bytes - 1) / bytes, 1, std::max(calls, 1));
  Rotation r;
  r.sets = static_cast<int>(std::clamp<std::int64_t>(std::min(wanted, fits), 1, wanted));
  r.cold = r.sets >= wanted;
  return r;
}

// The sets of `batch` requests of `tokens` tokens in all that a pool of `pool_tokens` tokens has room
// for, each request's pages apart (a page of slack per request): `fits` above (kAnySets for sets
// that hold nothing).
inline std::int64_t request_sets_that_fit(std::int64_t pool_tokens, std::int64_t tokens, int batch, int page_size) {
  const std::int64_t per_set = tokens + static_cast<std::int64_t>(batch) * page_size;
  return per_set > 0 ? pool_tokens / per_set : kAnySets;
}

}  // namespace latentkv::tools
