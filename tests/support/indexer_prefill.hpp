// tests/support/indexer_prefill.hpp - the reference indexer_prefill on a PagedFixture, and each new
// token's logits computed apart from it, for the CPU and GPU tests of indexer_prefill.
//
// A prefill's new tokens are rows of q [T, Hi, 128]: new token j of request b is row cu[b] + j and
// sees positions t < L_b - n_b + j + 1 (prefill_rows() lists them). reference_row_logits() gives
// one such token's logits by the reference indexer_logits of a one-request, one-token call (the
// token's q and weights, request b's block-table row, seq_lens = the positions it sees): the
// composition indexer_prefill must equal, row by row, before its top-k. (Both reference ops share
// the per-row logit code, so the composition checks causality, the chunk and row bookkeeping and the
// slot mapping; the logit arithmetic itself is checked against naive::indexer_logits elsewhere.)
// reference_prefill_logits() gives the same logits for many tokens at once by the reference's own path.
//
// check_prefill_slots() judges an answer whose logits were summed in another order (float32 on the
// GPU), so that its selection may differ from the reference's at near-ties. Per row:
//  * every entry is -1 or the slot of a position the row sees (the sentinel of an unwritten entry,
//    a slot of a later position or of another request fail);
//  * no slot is listed twice, and min(k, visible) entries are slots, the others -1;
//  * with the reference's logits x of the row (float64 sums rounded once, reference_prefill_logits),
//    every visible position not chosen has x <= (the lowest chosen x) + tol,
//    tol = 1e-5 * max |x| + 1e-6.
//
// sorted_rows() and first_different_row() compare two answers' selected sets row by row.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu/common.hpp"
#include "cpu/reference.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/fp8.hpp"
#include "support/host_tensor.hpp"
#include "support/paged_fixture.hpp"

namespace latentkv::testing {

// The CPU, named where a test plans or calls the reference (a call that names no device selects for
// its tensors' memory: the CPU for host memory too).
inline DeviceInfo reference_device() { return DeviceInfo{}; }

inline const Backend& reference_backend() {
  const Backend* b = find_backend("reference");
  if (b == nullptr) throw std::logic_error("no backend named reference");
  return *b;
}

// One new token of a prefill.
struct PrefillRow {
  std::int64_t b = 0;        // its request
  std::int64_t j = 0;        // its index among the request's new tokens
  std::int64_t row = 0;      // its row of q, weights and slots: cu[b] + j
  std::int64_t visible = 0;  // positions it sees: L_b - n_b + j + 1
};

// Every new token of the fixture's requests, row after row; cu [B + 1] as given to the op.
inline std::vector<PrefillRow> prefill_rows(const PagedFixture& f, const std::vector<std::int32_t>& cu) {
  std::vector<PrefillRow> rows;
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    const std::int64_t length = f.seq_lens[static_cast<std::size_t>(b)];
    const std::int64_t n = cu[static_cast<std::size_t>(b) + 1] - cu[static_cast<std::size_t>(b)];
    for (std::int64_t j = 0; j < n; ++j) {
      rows.push_back({b, j, cu[static_cast<std::size_t>(b)] + j, std::max<std::int64_t>(0, length - n + j + 1)});
    }
  }
  return rows;
}

// The reference indexer_prefill (backend "reference") of q [T, Hi, 128] fp8 and weights [T, Hi] f32;
// returns slots [T, k] i32, sentinel-filled before the call.
inline HostTensor reference_indexer_prefill(PagedFixture& f, const HostTensor& q, const HostTensor& weights,
                                            std::vector<std::int32_t> cu, int k) {
  HostTensor slots = sentinel_tensor(DType::kI32, {q.shape()[0], k});
  IndexerPrefillParams p;
  p.q = const_cast<HostTensor&>(q).view();
  p.weights = const_cast<HostTensor&>(weights).view();
  p.cu_new_tokens = TensorView::contiguous(cu.data(), DType::kI32, {static_cast<std::int64_t>(cu.size())});
  p.cache = f.indexer();
  p.block_table = f.block_table_view();
  p.seq_lens = f.seq_lens_view();
  p.k = k;
  p.slots = slots.view();
  run(reference_backend(), p, {}, reference_device());
  return slots;
}

// The logits [r.visible] of new token r by the reference indexer_logits (backend "reference") of a
// call with B = 1, q_len = 1: row r.row of q [T, Hi, 128] and weights [T, Hi], request r.b's
// block-table row, seq_lens = {r.visible}.
inline std::vector<float> reference_row_logits(const PagedFixture& f, const HostTensor& q, const HostTensor& weights,
                                               const PrefillRow& r) {
  const std::int64_t heads = q.shape()[1];
  HostTensor q1(DType::kFP8E4M3, {1, 1, heads, kIndexerDim});
  std::copy_n(q.data<std::uint8_t>() + r.row * heads * kIndexerDim, heads * kIndexerDim, q1.data<std::uint8_t>());
  HostTensor w1(DType::kF32, {1, 1, heads});
  std::copy_n(weights.data<float>() + r.row * heads, heads, w1.data<float>());
  std::vector<std::int32_t> table(f.block_table.begin() + r.b * f.max_pages,
                                  f.block_table.begin() + (r.b + 1) * f.max_pages);  // [1, max_pages]
  std::vector<std::int32_t> lens = {static_cast<std::int32_t>(r.visible)};          // [1]
  const std::int64_t max_len = r.visible + 1;  // one spare column: never empty, must be -inf
  HostTensor logits = sentinel_tensor(DType::kF32, {1, 1, max_len});
  IndexerLogitsParams p;
  p.q = q1.view();
  p.weights = w1.view();
  p.cache = f.indexer(const_cast<std::uint8_t*>(f.indexer_bytes.data()), Device::cpu());  // read only
  p.block_table = TensorView::contiguous(table.data(), DType::kI32, {1, f.max_pages});
  p.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {1});
  p.logits = logits.view();
  run(reference_backend(), p, {}, reference_device());
  return std::vector<float>(logits.data<float>(), logits.data<float>() + r.visible);
}

// The reference logits of every new token, in the order of `rows`, by the reference's own path (what
// cpu::indexer_prefill does before its top-k): each request's keys dequantized once with
// cpu::dequantize_indexer_key through f.block_table, then cpu::internal::indexer_row per token.
// Equal to reference_row_logits() row for row (a CPU test checks it), and cheaper for long
// prefixes: no keys are decoded again for every token.
inline std::vector<std::vector<float>> reference_prefill_logits(const PagedFixture& f, const HostTensor& q,
                                                                const HostTensor& weights,
                                                                const std::vector<PrefillRow>& rows) {
  const int heads = static_cast<int>(q.shape()[1]);
  const IndexerCache cache = f.indexer(const_cast<std::uint8_t*>(f.indexer_bytes.data()), Device::cpu());
  std::vector<std::vector<float>> logits;
  logits.reserve(rows.size());
  std::vector<double> keys, scales, q_row(static_cast<std::size_t>(heads) * kIndexerDim);
  std::int64_t loaded = -1;  // the request whose keys are in keys / scales
  for (const PrefillRow& r : rows) {
    if (r.b != loaded) {
      const std::int64_t length = f.seq_lens[static_cast<std::size_t>(r.b)];
      keys.resize(static_cast<std::size_t>(length) * kIndexerDim);
      scales.resize(static_cast<std::size_t>(length));
      for (std::int64_t t = 0; t < length; ++t) {
        const std::int64_t slot =
            std::int64_t{f.block_table[static_cast<std::size_t>(r.b * f.max_pages + t / f.page_size)]} * f.page_size +
            t % f.page_size;
        cpu::dequantize_indexer_key(cache, slot, keys.data() + t * kIndexerDim, &scales[static_cast<std::size_t>(t)]);
      }
      loaded = r.b;
    }
    const std::uint8_t* codes = q.data<std::uint8_t>() + r.row * heads * kIndexerDim;  // [Hi, 128]
    for (std::size_t i = 0; i < q_row.size(); ++i) q_row[i] = fp8_e4m3_decode(codes[i]);
    std::vector<float> x(static_cast<std::size_t>(r.visible));
    cpu::internal::indexer_row(q_row.data(), weights.data<float>() + r.row * heads, heads, keys.data(), scales.data(),
                               r.visible, x.data());
    logits.push_back(std::move(x));
  }
  return logits;
}

// One row: `got` [k] entries, `x` [visible] the reference's logits of the row, `position_of(slot)`
// the position of a slot in the row's request (-1 when it is none of the request's slots).
template <typename PositionOf>
::testing::AssertionResult check_prefill_row(const std::int32_t* got, std::int64_t k, const std::vector<float>& x,
                                             PositionOf&& position_of) {
  const auto visible = static_cast<std::int64_t>(x.size());
  const std::int64_t want = std::min(k, visible);
  std::vector<char> chosen(static_cast<std::size_t>(visible), 0);
  std::int64_t slots = 0;
  double lowest = INFINITY, largest = 0.0;
  for (std::int64_t j = 0; j < k; ++j) {
    const std::int32_t s = got[j];
    if (s == -1) continue;
    if (s == kSentinelI32) return ::testing::AssertionFailure() << "entry " << j << " was never written";
    const std::int64_t t = position_of(s);
    if (t < 0) return ::testing::AssertionFailure() << "entry " << j << " = " << s << " is not a slot of the request";
    if (t >= visible) {
      return ::testing::AssertionFailure() << "entry " << j << " = slot " << s << " is position " << t
                                           << ", which the row cannot see";
    }
    if (chosen[static_cast<std::size_t>(t)]) return ::testing::AssertionFailure() << "slot " << s << " listed twice";
    chosen[static_cast<std::size_t>(t)] = 1;
    ++slots;
    lowest = std::min(lowest, static_cast<double>(x[static_cast<std::size_t>(t)]));
  }
  if (slots != want) {
    return ::testing::AssertionFailure() << slots << " entries are slots and " << k - slots << " are -1, expected "
                                         << want << " and " << k - want;
  }
  for (float v : x) largest = std::max(largest, std::fabs(static_cast<double>(v)));
  const double tol = 1e-5 * largest + 1e-6;
  for (std::int64_t t = 0; t < visible; ++t) {
    const double v = x[static_cast<std::size_t>(t)];
    if (!chosen[static_cast<std::size_t>(t)] && !(v <= lowest + tol)) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "position %lld (logit %.9g) is not chosen but the lowest chosen logit is %.9g (tol %.3g)",
                    static_cast<long long>(t), v, lowest, tol);
      return ::testing::AssertionFailure() << buf;
    }
  }
  return ::testing::AssertionSuccess();
}

// Every row of `got` [T, k] i32 against the reference logits `x` (reference_prefill_logits(rows)).
// Slots map back to positions through f.block_table and f.seq_lens, what the op was given.
inline ::testing::AssertionResult check_prefill_slots(const PagedFixture& f, const std::vector<PrefillRow>& rows,
                                                      const std::vector<std::vector<float>>& x, const HostTensor& got) {
  const std::int64_t k = got.shape()[1];
  const std::int64_t num_slots = f.num_pages() * f.page_size;
  std::vector<std::int32_t> position_of(static_cast<std::size_t>(num_slots), -1);  // slot -> position in request b
  const auto slot_of = [&](std::int64_t b, std::int64_t t) {
    return std::int64_t{f.block_table[static_cast<std::size_t>(b * f.max_pages + t / f.page_size)]} * f.page_size +
           t % f.page_size;
  };
  std::int64_t mapped = -1;  // the request position_of holds
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const PrefillRow& r = rows[i];
    if (r.b != mapped) {
      for (std::int64_t t = 0; mapped >= 0 && t < f.seq_lens[static_cast<std::size_t>(mapped)]; ++t) {
        position_of[static_cast<std::size_t>(slot_of(mapped, t))] = -1;
      }
      mapped = r.b;
      for (std::int64_t t = 0; t < f.seq_lens[static_cast<std::size_t>(r.b)]; ++t) {
        position_of[static_cast<std::size_t>(slot_of(r.b, t))] = static_cast<std::int32_t>(t);
      }
    }
    const ::testing::AssertionResult ok =
        check_prefill_row(got.data<std::int32_t>() + r.row * k, k, x[i], [&](std::int32_t s) -> std::int64_t {
          return s >= 0 && s < num_slots ? position_of[static_cast<std::size_t>(s)] : -1;
        });
    if (!ok) {
      return ::testing::AssertionFailure() << "row " << r.row << " (request " << r.b << ", new token " << r.j
                                           << ", visible " << r.visible << ", k " << k << "): " << ok.message();
    }
  }
  return ::testing::AssertionSuccess();
}

// Each row's entries of `slots` [T, k] i32 sorted: the selected sets (and -1 count), whatever order
// the kernel wrote them in.
inline std::vector<std::int32_t> sorted_rows(const HostTensor& slots) {
  const std::int64_t rows = slots.shape()[0], k = slots.shape()[1];
  std::vector<std::int32_t> out(slots.data<std::int32_t>(), slots.data<std::int32_t>() + slots.numel());
  for (std::int64_t r = 0; r < rows; ++r) std::sort(out.begin() + r * k, out.begin() + (r + 1) * k);
  return out;
}

// The first row of `k` entries where two sorted_rows() differ, for a failure message; -1 when none.
inline std::int64_t first_different_row(const std::vector<std::int32_t>& a, const std::vector<std::int32_t>& b,
                                        std::int64_t k) {
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i] != b[i]) return static_cast<std::int64_t>(i) / k;
  }
  return a.size() == b.size() ? -1 : 0;
}

}  // namespace latentkv::testing
