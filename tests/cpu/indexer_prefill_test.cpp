// indexer_prefill on the reference backend.
//  * Row by row it is the composition it is defined as: the reference indexer_logits of the new
//    token as a one-token request (its own visible count, its request's block-table row) followed by
//    a sort-based top-k of those logits. The selected slot sets must be equal; where logits tie at
//    the k-th largest value, any choice among the tied positions is accepted (SPEC 4.5).
//  * Requests that all have q_len <= 4 new tokens are decode-shaped: the op must then equal the
//    reference indexer_logits + topk exactly, entry for entry.
//  * An exact-answer case: logits that grow with the position, so a token's top-k is its last k
//    visible positions, through the shuffled page table.
//  * Rejected inputs throw latentkv::Error naming indexer_prefill and the argument, and write nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/reference.hpp"
#include "support/expect_error.hpp"
#include "support/indexer_prefill.hpp"
#include "support/paged_fixture.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

using Batch = PrefillBatch;

// Checks the reference's answer for one row against the composition: `got` [k] (the op's row),
// `logits` [visible] (the row's reference indexer_logits), `visible_slots` [visible] (the slots of
// positions 0 .. visible-1, from the allocator, not from the block table the op walks).
::testing::AssertionResult row_matches_composition(const std::int32_t* got, std::int64_t k,
                                                   const std::vector<float>& logits,
                                                   const std::vector<std::int32_t>& visible_slots) {
  const auto visible = static_cast<std::int64_t>(logits.size());
  const std::int64_t want = std::min(k, visible);
  // The sort-based top-k: positions by logit, largest first (earlier position first among equals).
  std::vector<std::int64_t> order(static_cast<std::size_t>(visible));
  for (std::int64_t t = 0; t < visible; ++t) order[static_cast<std::size_t>(t)] = t;
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return logits[static_cast<std::size_t>(a)] > logits[static_cast<std::size_t>(b)];
  });
  std::set<std::int32_t> expected;
  for (std::int64_t i = 0; i < want; ++i) {
    expected.insert(visible_slots[static_cast<std::size_t>(order[static_cast<std::size_t>(i)])]);
  }
  const float threshold = want > 0 ? logits[static_cast<std::size_t>(order[static_cast<std::size_t>(want - 1)])] : 0.0f;

  std::map<std::int32_t, std::int64_t> position_of;  // slot -> position
  for (std::int64_t t = 0; t < visible; ++t) position_of[visible_slots[static_cast<std::size_t>(t)]] = t;
  std::set<std::int32_t> chosen;
  std::int64_t pads = 0;
  for (std::int64_t i = 0; i < k; ++i) {
    const std::int32_t s = got[i];
    if (s == -1) {
      ++pads;
      continue;
    }
    if (s == kSentinelI32) return ::testing::AssertionFailure() << "entry " << i << " was never written";
    if (position_of.find(s) == position_of.end()) {
      return ::testing::AssertionFailure() << "entry " << i << " = " << s << " is not the slot of a visible position";
    }
    if (!chosen.insert(s).second) return ::testing::AssertionFailure() << "slot " << s << " listed twice";
  }
  if (static_cast<std::int64_t>(chosen.size()) != want || pads != k - want) {
    return ::testing::AssertionFailure() << chosen.size() << " slots and " << pads << " pads, expected " << want
                                         << " and " << k - want;
  }
  if (chosen == expected) return ::testing::AssertionSuccess();
  // Different sets: only a different choice among logits equal to the k-th largest is allowed.
  for (std::int32_t s : chosen) {
    const float x = logits[static_cast<std::size_t>(position_of[s])];
    if (x < threshold) {
      return ::testing::AssertionFailure() << "slot " << s << " (position " << position_of[s] << ", logit " << x
                                           << ") is chosen below the k-th largest logit " << threshold;
    }
  }
  for (std::int64_t t = 0; t < visible; ++t) {
    const float x = logits[static_cast<std::size_t>(t)];
    if (x > threshold && chosen.count(visible_slots[static_cast<std::size_t>(t)]) == 0) {
      return ::testing::AssertionFailure() << "position " << t << " (logit " << x
                                           << ") is above the k-th largest logit " << threshold << " but not chosen";
    }
  }
  return ::testing::AssertionSuccess();
}

// ---- the composition -----------------------------------------------------------------------

class IndexerPrefill : public ::testing::TestWithParam<std::tuple<int /*page_size*/, int /*heads*/>> {};

TEST_P(IndexerPrefill, EqualsLogitsOfEachTokenThenTopk) {
  const auto [page_size, heads] = GetParam();
  Rng rng = test_rng();
  // A 23-token prompt (k = 23 equals its last token's visible count), a request with no new
  // tokens, a 1-token prompt, an odd extension of 9 over 45 (k = 54 equals its last token's
  // count), 5 new tokens over 2 pages + 3, an empty request.
  const Batch batch = {{0, 12, 0, 45, 2 * page_size + 3, 0}, {23, 0, 1, 9, 5, 0}};
  PagedFixture f = make_prefill_fixture(batch, page_size, rng);
  const std::vector<std::int32_t> cu = cumulative(batch.new_tokens);
  const std::int64_t rows = cu.back();
  const HostTensor q = random_fp8(rng, {rows, heads, kIndexerDim}, 2.0);
  const HostTensor w = random_f32(rng, {rows, heads}, -1.0, 1.0);

  const std::vector<PrefillRow> tokens = prefill_rows(f, cu);
  ASSERT_EQ(static_cast<std::int64_t>(tokens.size()), rows);
  std::vector<std::vector<float>> logits;
  for (const PrefillRow& r : tokens) logits.push_back(reference_row_logits(f, q, w, r));
  // The GPU tests' shortcut to the same logits (keys decoded once per request) gives them exactly.
  EXPECT_EQ(reference_prefill_logits(f, q, w, tokens), logits);

  for (int k : {1, 5, 23, 54, 2048}) {
    const HostTensor slots = reference_indexer_prefill(f, q, w, cu, k);
    int below = 0, equal = 0, above = 0;  // rows seeing fewer than, exactly and more than k positions
    for (const PrefillRow& r : tokens) {
      below += r.visible < k;
      equal += r.visible == k;
      above += r.visible > k;
      EXPECT_TRUE(row_matches_composition(slots.data<std::int32_t>() + r.row * k, k,
                                          logits[static_cast<std::size_t>(r.row)], f.slots(r.b, r.visible)))
          << "k " << k << ", row " << r.row << " (request " << r.b << ", new token " << r.j << ", visible "
          << r.visible << ")";
    }
    if (k != 2048) {
      EXPECT_GT(equal, 0) << "k " << k << ": no row sees exactly k positions";
    }
    if (k > 1) {
      EXPECT_GT(below, 0) << "k " << k;
    }
    if (k < 54) {
      EXPECT_GT(above, 0) << "k " << k;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(PageSizesHeads, IndexerPrefill,
                         ::testing::Combine(::testing::Values(1, 3, 64), ::testing::Values(1, 8, 32)),
                         [](const auto& info) {
                           return "ps" + std::to_string(std::get<0>(info.param)) + "_Hi" +
                                  std::to_string(std::get<1>(info.param));
                         });

// Every request with the same q_len <= 4 new tokens: the prefill is the decode-shaped
// indexer_logits [B, q_len, max_len] then topk, entry for entry (the same tie rule).
TEST(IndexerPrefillDecodeShaped, EqualsIndexerLogitsThenTopkExactly) {
  for (int q_len = 1; q_len <= 4; ++q_len) {
    Rng rng = test_rng("q_len " + std::to_string(q_len));
    PagedFixtureOptions o;
    o.page_size = 3;
    o.lengths = {q_len, 7, static_cast<std::int64_t>(q_len) + 1, 40, 64};
    PagedFixture f = make_paged_fixture(o, rng);
    const std::int64_t batch = f.batch(), heads = 8;
    const HostTensor q = random_fp8(rng, {batch, q_len, heads, kIndexerDim}, 2.0);
    const HostTensor w = random_f32(rng, {batch, q_len, heads}, -1.0, 1.0);
    // The same bytes as prefill rows: [B * q_len, Hi, 128] and [B * q_len, Hi].
    HostTensor q_rows(DType::kFP8E4M3, {batch * q_len, heads, kIndexerDim});
    std::copy_n(q.raw(), q.bytes(), q_rows.raw());
    HostTensor w_rows(DType::kF32, {batch * q_len, heads});
    std::copy_n(w.raw(), w.bytes(), w_rows.raw());
    const std::vector<std::int32_t> cu = cumulative(std::vector<std::int64_t>(static_cast<std::size_t>(batch), q_len));
    const HostTensor logits = reference_indexer_logits(f, q, w, f.max_len());
    for (int k : {1, 6, 39, 2048}) {
      const HostTensor want = reference_topk(f, logits, k);
      const HostTensor got = reference_indexer_prefill(f, q_rows, w_rows, cu, k);
      ASSERT_EQ(got.numel(), want.numel());
      const std::vector<std::int32_t> g(got.data<std::int32_t>(), got.data<std::int32_t>() + got.numel());
      const std::vector<std::int32_t> e(want.data<std::int32_t>(), want.data<std::int32_t>() + want.numel());
      EXPECT_EQ(g, e) << "q_len " << q_len << ", k " << k;
    }
  }
}

// Keys 2^(t - 13) at position t (every key value equal, one fp8 code, a power-of-two scale), queries
// all 1 and positive weights: the logits grow strictly with the position and are exact, so a new
// token's top-k is its last min(k, visible) visible positions - a token that saw one position past
// its own would pick it.
TEST(IndexerPrefillExact, TopkIsTheLastVisiblePositions) {
  for (int page_size : {1, 3, 64}) {
    Rng rng = test_rng("page_size " + std::to_string(page_size));
    const Batch batch = {{0, 5, 0, page_size + 1}, {17, 0, 1, 6}};  // positions < 72: logits stay finite
    PagedFixtureOptions o;
    o.page_size = page_size;
    o.lengths = batch.lengths();
    o.token_values = [](std::int64_t, std::int64_t position, std::uint16_t* latent, std::uint16_t* key) {
      for (int j = 0; j < kQkDim; ++j) latent[j] = bf16_encode(1.0f);
      const float value = std::ldexp(1.0f, static_cast<int>(position) - 13);  // >= 1e-4, the scales' floor
      for (int j = 0; j < kIndexerDim; ++j) key[j] = bf16_encode(value);
    };
    PagedFixture f = make_paged_fixture(o, rng);
    const std::vector<std::int32_t> cu = cumulative(batch.new_tokens);
    const std::int64_t rows = cu.back(), heads = 4;
    HostTensor q(DType::kFP8E4M3, {rows, heads, kIndexerDim});
    for (std::int64_t i = 0; i < q.numel(); ++i) q.set(i, 1.0);
    const HostTensor w = random_f32(rng, {rows, heads}, 0.25, 1.0);
    for (int k : {1, 4, 17, 2048}) {
      const HostTensor slots = reference_indexer_prefill(f, q, w, cu, k);
      for (const PrefillRow& r : prefill_rows(f, cu)) {
        const std::int32_t* row = slots.data<std::int32_t>() + r.row * k;
        std::vector<std::int32_t> got(row, row + k);
        std::sort(got.begin(), got.end());
        const std::int64_t chosen = std::min<std::int64_t>(k, r.visible);
        std::vector<std::int32_t> want(static_cast<std::size_t>(k - chosen), -1);
        const std::vector<std::int32_t> visible = f.slots(r.b, r.visible);
        want.insert(want.end(), visible.end() - chosen, visible.end());
        std::sort(want.begin(), want.end());
        EXPECT_EQ(got, want) << "page size " << page_size << ", k " << k << ", row " << r.row << " (visible "
                             << r.visible << ")";
      }
    }
  }
}

// The near-tie check the GPU tests use (support/indexer_prefill.hpp): the reference's own answer
// passes it, and each kind of wrong answer fails it.
TEST(IndexerPrefillCheck, PassesTheReferenceAndCatchesWrongAnswers) {
  Rng rng = test_rng();
  const Batch batch = {{30, 0, 4}, {12, 5, 0}};
  PagedFixture f = make_prefill_fixture(batch, 3, rng);
  const std::vector<std::int32_t> cu = cumulative(batch.new_tokens);
  const HostTensor q = random_fp8(rng, {cu.back(), 8, kIndexerDim}, 2.0);
  const HostTensor w = random_f32(rng, {cu.back(), 8}, 0.1, 1.0);
  const std::vector<PrefillRow> rows = prefill_rows(f, cu);
  const std::vector<std::vector<float>> x = reference_prefill_logits(f, q, w, rows);
  const int k = 20;
  const HostTensor good = reference_indexer_prefill(f, q, w, cu, k);
  ASSERT_TRUE(check_prefill_slots(f, rows, x, good));

  // Row 0 (request 0, new token 0) sees 31 positions, more than k; row 12 (request 1's first) sees 1.
  ASSERT_EQ(rows[0].visible, 31);
  ASSERT_EQ(rows[12].row, 12);
  ASSERT_EQ(rows[12].visible, 1);
  const std::vector<std::int32_t> slots0 = f.slots(0, 42);
  const std::vector<float>& x0 = x[0];
  auto spoiled = [&](auto&& spoil) {
    HostTensor bad = good;
    spoil(bad.data<std::int32_t>());
    return check_prefill_slots(f, rows, x, bad);
  };
  // The lowest visible position not chosen by row 0, chosen in place of the row's largest.
  std::int64_t lowest = -1, largest = 0;
  for (std::int64_t t = 0; t < 31; ++t) {
    if (lowest < 0 || x0[static_cast<std::size_t>(t)] < x0[static_cast<std::size_t>(lowest)]) lowest = t;
    if (x0[static_cast<std::size_t>(t)] > x0[static_cast<std::size_t>(largest)]) largest = t;
  }
  const std::int32_t* row0 = good.data<std::int32_t>();
  const std::int64_t at_largest = std::find(row0, row0 + k, slots0[static_cast<std::size_t>(largest)]) - row0;
  ASSERT_LT(at_largest, k);
  EXPECT_FALSE(spoiled([&](std::int32_t* s) { s[at_largest] = slots0[static_cast<std::size_t>(lowest)]; }));
  EXPECT_FALSE(spoiled([&](std::int32_t* s) { s[3] = kSentinelI32; }));                  // never written
  EXPECT_FALSE(spoiled([&](std::int32_t* s) { s[3] = slots0[31]; }));                    // a later position
  EXPECT_FALSE(spoiled([&](std::int32_t* s) { s[3] = s[4]; }));                          // listed twice
  EXPECT_FALSE(spoiled([&](std::int32_t* s) { s[3] = -1; }));                            // one slot short
  EXPECT_FALSE(spoiled([&](std::int32_t* s) { s[12 * k + 1] = f.slots(1, 1)[0]; }));     // listed twice
  EXPECT_FALSE(spoiled([&](std::int32_t* s) { s[12 * k + 1] = slots0[0]; }));            // another request's
  EXPECT_FALSE(spoiled([&](std::int32_t* s) { s[12 * k + 1] = static_cast<std::int32_t>(f.num_pages() * 3); }));
}

// ---- rejected inputs -------------------------------------------------------------------------

// A valid small prefill (request 0: 4 new tokens of 9, request 1: 2 of 3) whose parts a test spoils
// one at a time; slots are sentinel-filled and must stay so.
struct PrefillCase {
  static constexpr std::int64_t kRows = 6, kHeads = 4;
  Rng rng;
  PagedFixture f;
  HostTensor q, w, slots;
  std::vector<std::int32_t> cu, table, lens;
  int k = 5;

  PrefillCase()
      : rng(test_rng()),
        f(make_paged_fixture(options(), rng)),
        q(random_fp8(rng, {kRows, kHeads, kIndexerDim})),
        w(random_f32(rng, {kRows, kHeads}, -1.0, 1.0)),
        slots(sentinel_tensor(DType::kI32, {kRows, 5})),
        cu({0, 4, 6}),
        table(f.block_table),
        lens(f.seq_lens) {}
  static PagedFixtureOptions options() {
    PagedFixtureOptions o;
    o.page_size = 4;
    o.lengths = {9, 3};
    return o;
  }
  IndexerPrefillParams params() {
    IndexerPrefillParams p;
    p.q = q.view();
    p.weights = w.view();
    p.cu_new_tokens = TensorView::contiguous(cu.data(), DType::kI32, {static_cast<std::int64_t>(cu.size())});
    p.cache = f.indexer();
    p.block_table = TensorView::contiguous(table.data(), DType::kI32, {f.batch(), f.max_pages});
    p.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {f.batch()});
    p.k = k;
    p.slots = slots.view();
    return p;
  }
  // The call throws the error both directly and through the backend "reference", writing nothing.
  ::testing::AssertionResult rejects(const IndexerPrefillParams& p, const std::string& argument, const std::string& value) {
    const std::vector<std::uint8_t> cache_before = f.indexer_bytes;
    ::testing::AssertionResult direct = throws_error([&] { cpu::indexer_prefill(p); }, "indexer_prefill", argument, value);
    if (!direct) return direct;
    ::testing::AssertionResult backend =
        throws_error([&] { run(reference_backend(), p, {}, reference_device()); }, "indexer_prefill", argument, value);
    if (!backend) return backend << " (through the backend \"reference\")";
    if (!is_sentinel(slots)) return ::testing::AssertionFailure() << "slots were written";
    if (f.indexer_bytes != cache_before) return ::testing::AssertionFailure() << "the indexer cache changed";
    return ::testing::AssertionSuccess() << direct.message();
  }
};

TEST(IndexerPrefillBadInput, TheCaseItselfIsValid) {
  PrefillCase c;
  EXPECT_NO_THROW(cpu::indexer_prefill(c.params()));
  EXPECT_FALSE(is_sentinel(c.slots));
  const std::int32_t* s = c.slots.data<std::int32_t>();
  for (std::int64_t i = 0; i < c.slots.numel(); ++i) EXPECT_NE(s[i], kSentinelI32) << "entry " << i;
}

TEST(IndexerPrefillBadInput, NewTokenOffsets) {
  PrefillCase c;
  c.cu = {1, 4, 6};  // not starting at 0
  EXPECT_TRUE(c.rejects(c.params(), "cu_new_tokens[0]", "1"));
  c.cu = {0, 4, 5};  // ends short of T = 6
  EXPECT_TRUE(c.rejects(c.params(), "cu_new_tokens[2]", "5"));
  c.cu = {0, 3, 7};  // ends past T = 6 (and request 1 would have 4 new tokens of 3)
  EXPECT_TRUE(c.rejects(c.params(), "cu_new_tokens[2]", "7"));
  c.cu = {0, 2, 6};  // request 1: 4 new tokens, but 3 tokens in all
  EXPECT_TRUE(c.rejects(c.params(), "cu_new_tokens[2]", "6"));
  c.cu = {0, 6, 4};  // descending
  EXPECT_TRUE(c.rejects(c.params(), "cu_new_tokens[2]", "4"));
  IndexerPrefillParams p = c.params();  // no offsets at all: B + 1 = 0
  p.cu_new_tokens = TensorView::contiguous(nullptr, DType::kI32, {0});
  EXPECT_TRUE(c.rejects(p, "cu_new_tokens", "i32 [0]"));
}

TEST(IndexerPrefillBadInput, MoreNewTokensThanTheRequestHolds) {
  PrefillCase c;
  c.lens[0] = 3;  // request 0 has 4 new tokens
  EXPECT_TRUE(c.rejects(c.params(), "cu_new_tokens[1]", "4"));
}

TEST(IndexerPrefillBadInput, LengthBeyondTheBlockTable) {
  PrefillCase c;
  const std::int64_t capacity = static_cast<std::int64_t>(c.f.max_pages) * c.f.page_size;
  c.lens[1] = static_cast<std::int32_t>(capacity + 1);
  EXPECT_TRUE(c.rejects(c.params(), "seq_lens[1]", std::to_string(capacity + 1)));
}

TEST(IndexerPrefillBadInput, PageOutsideThePool) {
  PrefillCase c;
  c.table[2] = static_cast<std::int32_t>(c.f.num_pages());  // request 0's third page
  EXPECT_TRUE(c.rejects(c.params(), "block_table[0][2]", std::to_string(c.f.num_pages())));
  c.table[2] = -1;
  EXPECT_TRUE(c.rejects(c.params(), "block_table[0][2]", "-1"));
}

TEST(IndexerPrefillBadInput, KOutOfRange) {
  for (int k : {0, 2049}) {
    PrefillCase c;
    c.k = k;
    c.slots = sentinel_tensor(DType::kI32, {PrefillCase::kRows, std::max(k, 1)});
    EXPECT_TRUE(c.rejects(c.params(), "k", std::to_string(k)));
  }
}

TEST(IndexerPrefillBadInput, SlotsShapedWrong) {
  PrefillCase c;
  for (const std::vector<std::int64_t>& shape :
       {std::vector<std::int64_t>{PrefillCase::kRows, 6}, {PrefillCase::kRows + 1, 5}, {PrefillCase::kRows - 1, 5},
        {1, PrefillCase::kRows, 5}}) {
    c.slots = sentinel_tensor(DType::kI32, shape);
    EXPECT_TRUE(c.rejects(c.params(), "slots", "i32")) << c.slots.shape().size() << "-d slots";
  }
  c.slots = sentinel_tensor(DType::kF32, {PrefillCase::kRows, 5});
  EXPECT_TRUE(c.rejects(c.params(), "slots", "f32"));
}

TEST(IndexerPrefillBadInput, NanQueryCode) {
  PrefillCase c;
  const std::int64_t element = 3 * PrefillCase::kHeads * kIndexerDim + 77;
  c.q.data<std::uint8_t>()[element] = 0x7F;
  EXPECT_TRUE(c.rejects(c.params(), "q element " + std::to_string(element), "nan"));
  c.q.data<std::uint8_t>()[element] = 0xFF;  // the negative NaN
  EXPECT_TRUE(c.rejects(c.params(), "q element " + std::to_string(element), "nan"));
}

TEST(IndexerPrefillBadInput, NonFiniteWeight) {
  PrefillCase c;
  c.w.data<float>()[13] = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(c.rejects(c.params(), "weights element 13", "inf"));
  c.w.data<float>()[13] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(c.rejects(c.params(), "weights element 13", "nan"));
}

TEST(IndexerPrefillBadInput, NegativeChunkTokens) {
  PrefillCase c;
  IndexerPrefillParams p = c.params();
  p.chunk_tokens = -1;
  EXPECT_TRUE(c.rejects(p, "chunk_tokens", "-1"));
}

// A NaN key scale (a cache the append did not write) gives that token a NaN logit, which the indexer
// prefill does not refuse; it ranks below every number, so a row with k numbers never selects it.
TEST(IndexerPrefill, NanLogitRanksLast) {
  PrefillCase c;
  const std::int32_t nan_slot = c.f.slots(0, 9)[0];  // request 0, position 0: visible to all its rows
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(c.f.indexer().scale_ptr(nan_slot), &nan, sizeof nan);
  ASSERT_NO_THROW(cpu::indexer_prefill(c.params()));
  for (std::int64_t row = 0; row < 4; ++row) {  // request 0's rows see 6 .. 9 tokens, k = 5
    const std::int32_t* chosen = c.slots.data<std::int32_t>() + row * c.k;
    EXPECT_EQ(std::count(chosen, chosen + c.k, nan_slot), 0) << "row " << row;
    EXPECT_EQ(std::count(chosen, chosen + c.k, -1), 0) << "row " << row;
  }
}

TEST(IndexerPrefillBadInput, TooManyIndexerHeads) {
  PrefillCase c;
  c.q = random_fp8(c.rng, {PrefillCase::kRows, kMaxIndexerHeads + 1, kIndexerDim});
  c.w = random_f32(c.rng, {PrefillCase::kRows, kMaxIndexerHeads + 1}, -1.0, 1.0);
  const std::vector<std::uint8_t> cache_before = c.f.indexer_bytes;
  EXPECT_TRUE(throws_error([&] { cpu::indexer_prefill(c.params()); }, "indexer_prefill", "indexer heads",
                           std::to_string(kMaxIndexerHeads + 1)));
  // Through the registry the backend's select() refuses it first, naming the limit.
  EXPECT_EQ(error_of([&] { run(reference_backend(), c.params(), {}, reference_device()); }),
            "indexer_prefill: backend 'reference' cannot run this call: indexer heads " +
                std::to_string(kMaxIndexerHeads + 1) + " outside 1 .. " + std::to_string(kMaxIndexerHeads));
  EXPECT_TRUE(is_sentinel(c.slots));
  EXPECT_EQ(c.f.indexer_bytes, cache_before);
}

TEST(IndexerPrefillBadInput, NoIndexerHeads) {
  PrefillCase c;
  c.q = HostTensor(DType::kFP8E4M3, {PrefillCase::kRows, 0, kIndexerDim});
  c.w = HostTensor(DType::kF32, {PrefillCase::kRows, 0});
  EXPECT_TRUE(throws_error([&] { cpu::indexer_prefill(c.params()); }, "indexer_prefill", "q.shape[1] (indexer heads)",
                           "0"));
  EXPECT_TRUE(is_sentinel(c.slots));
}

}  // namespace
}  // namespace latentkv::testing
