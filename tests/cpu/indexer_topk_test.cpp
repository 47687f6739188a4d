// Indexer logits against the naive formulation; top-k against a sort-based check.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "support/compare.hpp"
#include "support/naive.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

class IndexerLogits : public ::testing::TestWithParam<std::tuple<int /*page_size*/, int /*heads*/>> {};

TEST_P(IndexerLogits, MatchesNaive) {
  const auto [page_size, heads] = GetParam();
  for (int q_len = 1; q_len <= 4; ++q_len) {
    // Exact key scales too: there a logit rounded twice (the sum, then its product with the scale)
    // can miss float's nearest by an ulp, which f32_output's tolerance would let pass.
    for (ScaleMode mode : {ScaleMode::kPow2, ScaleMode::kExact}) {
      Rng rng = test_rng("q_len " + std::to_string(q_len) + (mode == ScaleMode::kExact ? " exact" : ""));
      PagedFixtureOptions o;
      o.page_size = page_size;
      o.lengths = {0, 1, page_size - 1, page_size + 1, 29, 2 * page_size + 3};
      o.scale_mode = mode;
      PagedFixture f = make_paged_fixture(o, rng);
      const HostTensor q = random_fp8(rng, {f.batch(), q_len, heads, kIndexerDim}, 2.0);
      const HostTensor w = random_f32(rng, {f.batch(), q_len, heads}, -1.0, 1.0);
      const std::int64_t max_len = f.max_len() + 5;  // spare columns must be -inf too
      const HostTensor got = reference_indexer_logits(f, q, w, max_len);
      const std::vector<double> want = naive::indexer_logits(f, q, w, max_len);
      const std::string what = "logits q_len " + std::to_string(q_len) + (mode == ScaleMode::kExact ? " (exact scales)" : "");
      EXPECT_TRUE(compare(what, got, want, Tolerance::f32_output()));
      // Rounded once from float64: a slack of 3e-17 relative, at most 1e-9 of the half ulp.
      EXPECT_TRUE(rounded_to_nearest(what, got, want, 3e-17));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(PageSizesHeads, IndexerLogits,
                         ::testing::Combine(::testing::Values(1, 3, 64), ::testing::Values(1, 8)),
                         [](const auto& info) {
                           return "ps" + std::to_string(std::get<0>(info.param)) + "_heads" +
                                  std::to_string(std::get<1>(info.param));
                         });

TEST(IndexerLogitsWide, SixtyFourHeads) {
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 64;
  o.lengths = {130, 7};
  PagedFixture f = make_paged_fixture(o, rng);
  const HostTensor q = random_fp8(rng, {2, 2, 64, kIndexerDim});
  const HostTensor w = random_f32(rng, {2, 2, 64}, 0.0, 0.5);
  const HostTensor got = reference_indexer_logits(f, q, w, 130);
  EXPECT_TRUE(compare("logits", got, naive::indexer_logits(f, q, w, 130), Tolerance::f32_output()));
}

TEST(IndexerLogitsExact, ReluDropsNegativeDots) {
  // Keys all 1 (scale 2^-8, codes 256), query of head 0 all +1 and head 1 all -1: head 1's dot is
  // negative and contributes nothing; logit = w0 * 128 * 256 * 2^-8 = 128 * w0 exactly.
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 4;
  o.lengths = {6};
  o.token_values = [](std::int64_t, std::int64_t, std::uint16_t* latent, std::uint16_t* key) {
    for (int j = 0; j < kQkDim; ++j) latent[j] = bf16_encode(1.0f);
    for (int j = 0; j < kIndexerDim; ++j) key[j] = bf16_encode(1.0f);
  };
  PagedFixture f = make_paged_fixture(o, rng);
  HostTensor q(DType::kFP8E4M3, {1, 1, 2, kIndexerDim});
  for (int j = 0; j < kIndexerDim; ++j) q.set(j, 1.0), q.set(kIndexerDim + j, -1.0);
  HostTensor w(DType::kF32, {1, 1, 2});
  w.set(0, 0.75);
  w.set(1, 3.0);
  const HostTensor got = reference_indexer_logits(f, q, w, 8);
  for (int t = 0; t < 6; ++t) EXPECT_EQ(got.get(t), 96.0) << t;
  EXPECT_EQ(got.get(6), -INFINITY);
  EXPECT_EQ(got.get(7), -INFINITY);
}

// ---- top-k -------------------------------------------------------------------------------------

class Topk : public ::testing::TestWithParam<int /*k*/> {};

TEST_P(Topk, IndexerOutputMatchesSortBasedCheck) {
  const int k = GetParam();
  for (int q_len : {1, 3}) {
    Rng rng = test_rng("q_len " + std::to_string(q_len));
    PagedFixtureOptions o;
    o.page_size = 16;
    o.lengths = {0, 1, 15, 17, 100, 37};
    PagedFixture f = make_paged_fixture(o, rng);
    const HostTensor q = random_fp8(rng, {f.batch(), q_len, 4, kIndexerDim});
    const HostTensor w = random_f32(rng, {f.batch(), q_len, 4}, -1.0, 1.0);
    const HostTensor logits = reference_indexer_logits(f, q, w, f.max_len() + 3);
    const HostTensor slots = reference_topk(f, logits, k);
    EXPECT_TRUE(naive::check_topk(f, logits, slots)) << "q_len " << q_len;
  }
}

INSTANTIATE_TEST_SUITE_P(Ks, Topk, ::testing::Values(1, 7, 16, 36, 99, 100, 2048),
                         [](const auto& info) { return std::string("k") + std::to_string(info.param); });

TEST(TopkTies, ManyEqualLogitsAreComparedByValue) {
  for (int page_size : {1, 3, 64}) {
    Rng rng = test_rng("page_size " + std::to_string(page_size));
    PagedFixtureOptions o;
    o.page_size = page_size;
    o.lengths = {page_size + 1, 90, 2};
    o.with_indexer = false;
    PagedFixture f = make_paged_fixture(o, rng);
    const int q_len = 2;
    HostTensor logits(DType::kF32, {f.batch(), q_len, 95});
    for (std::int64_t i = 0; i < logits.numel(); ++i) logits.set(i, static_cast<double>(rng.uniform_int(-3, 3)));
    for (int k : {1, 5, 40, 2048}) {
      const HostTensor slots = reference_topk(f, logits, k);
      EXPECT_TRUE(naive::check_topk(f, logits, slots)) << "page_size " << page_size << " k " << k;
    }
  }
}

// The reference's own order (SPEC allows any tie-break; the GPU's tests compare sets): largest
// first, equal logits by position, so its rows are reproducible whatever the sort's implementation.
TEST(TopkTies, TheReferenceListsLargestFirstThenEarlierPositions) {
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 2;
  o.lengths = {5};
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  HostTensor logits(DType::kF32, {1, 1, 5});
  for (std::int64_t i = 0; i < 5; ++i) logits.set(i, 0.0);
  logits.set(3, 1.0);
  const HostTensor slots = reference_topk(f, logits, 3);
  const std::vector<std::int32_t> all = f.slots(0, 5);
  EXPECT_EQ(std::vector<std::int32_t>(slots.data<std::int32_t>(), slots.data<std::int32_t>() + 3),
            (std::vector<std::int32_t>{all[3], all[0], all[1]}));
}

TEST(TopkPadding, FewerVisibleThanKPadsWithMinusOne) {
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 4;
  o.lengths = {3, 0};
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  HostTensor logits = random_f32(rng, {2, 2, 6}, -5, 5);
  // Visible: request 0 rows see 2 and 3 positions; request 1 sees nothing.
  const HostTensor slots = reference_topk(f, logits, 5);
  EXPECT_TRUE(naive::check_topk(f, logits, slots));
  const std::int32_t* s = slots.data<std::int32_t>();
  std::vector<std::int32_t> row1(s + 5, s + 10);
  std::sort(row1.begin(), row1.end());
  std::vector<std::int32_t> want = f.slots(0, 3);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(std::vector<std::int32_t>(row1.begin() + 2, row1.end()), want);
  for (int j = 10; j < 20; ++j) EXPECT_EQ(s[j], -1);
}

TEST(TopkSlots, AreThePhysicalSlotsOfThePageTable) {
  // Logits decreasing with position, so the top 3 are positions 0, 1, 2: the answer must be the slots
  // of those positions through the shuffled page table, not the positions themselves.
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 2;
  o.lengths = {10};
  o.num_pages = 16;
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  HostTensor logits(DType::kF32, {1, 1, 10});
  for (int t = 0; t < 10; ++t) logits.set(t, 10.0 - t);
  const HostTensor slots = reference_topk(f, logits, 3);
  std::vector<std::int32_t> got(slots.data<std::int32_t>(), slots.data<std::int32_t>() + 3);
  std::sort(got.begin(), got.end());
  std::vector<std::int32_t> want = f.slots(0, 3);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(got, want);
  EXPECT_TRUE(naive::check_topk(f, logits, slots));
}

}  // namespace
}  // namespace latentkv::testing
