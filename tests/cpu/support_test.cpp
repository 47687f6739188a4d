// The test support itself: comparisons catch what they must, sentinels and poison are in place,
// seeds are reproducible.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <set>
#include <vector>

#include "support/compare.hpp"
#include "support/naive.hpp"
#include "support/paged_fixture.hpp"
#include "support/scoped_env.hpp"

namespace latentkv::testing {
namespace {

TEST(Compare, AcceptsWithinToleranceAndNamesTheWorstElement) {
  const std::vector<double> want = {1.0, -2.0, 0.0, 100.0, -INFINITY};
  std::vector<double> got = {1.0005, -2.02, 0.0009, 101.5, -INFINITY};  // all within atol or rtol
  const Comparison ok = compare("o", got, want, {5}, Tolerance::bf16_output());
  EXPECT_TRUE(ok.ok) << ok.report();

  got[3] = 102.0;  // 2% off: outside rtol 2/128 = 1.56%
  const Comparison bad = compare("o", got, want, {5}, Tolerance{1e-3, 2.0 / 128, -1});
  EXPECT_FALSE(bad.ok);
  EXPECT_EQ(bad.failures, 1);
  EXPECT_EQ(bad.worst_index, 3);
  EXPECT_NE(bad.report().find("worst at [3]"), std::string::npos) << bad.report();
  EXPECT_NE(bad.report().find("got 102"), std::string::npos) << bad.report();
}

TEST(Compare, NanAndInfPositionsMustMatch) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  EXPECT_TRUE(compare("x", std::vector<double>{nan, INFINITY}, std::vector<double>{nan, INFINITY}, {2}, Tolerance::lse()).ok);
  EXPECT_FALSE(compare("x", std::vector<double>{nan}, std::vector<double>{0.0}, {1}, Tolerance::lse()).ok);
  EXPECT_FALSE(compare("x", std::vector<double>{0.0}, std::vector<double>{nan}, {1}, Tolerance::lse()).ok);
  EXPECT_FALSE(compare("x", std::vector<double>{INFINITY}, std::vector<double>{-INFINITY}, {1}, Tolerance::lse()).ok);
  EXPECT_FALSE(compare("x", std::vector<double>{-1e30}, std::vector<double>{-INFINITY}, {1}, Tolerance::lse()).ok);
  const Comparison c = compare("lse", std::vector<double>{0, 0, nan, 0}, std::vector<double>{0, 0, -INFINITY, 0}, {2, 2},
                               Tolerance::lse());
  EXPECT_EQ(c.special_failures, 1);
  EXPECT_NE(c.report().find("worst at [1, 0]"), std::string::npos) << c.report();
}

TEST(Compare, CosineBoundCatchesSmallSystematicErrors) {
  // Every element within rtol, but alternating +-1% errors: 1 - cos is about 5e-5 > 5e-6.
  std::vector<double> want(1000), got(1000);
  for (int i = 0; i < 1000; ++i) {
    want[static_cast<std::size_t>(i)] = 1.0 + (i % 7);
    got[static_cast<std::size_t>(i)] = want[static_cast<std::size_t>(i)] * (i % 2 ? 1.01 : 0.99);
  }
  const Comparison c = compare("o", got, want, {1000}, Tolerance::bf16_output());
  EXPECT_EQ(c.failures, 0);
  EXPECT_TRUE(c.cos_failed);
  EXPECT_FALSE(c.ok);
  // An all-zero answer against a non-zero expectation fails the cosine bound too.
  EXPECT_FALSE(compare("o", std::vector<double>(3, 0.0), std::vector<double>(3, 1e-4), {3}, Tolerance::bf16_output()).ok);
}

TEST(Sentinel, UnwrittenElementsFailComparison) {
  HostTensor o = sentinel_tensor(DType::kBF16, {2, 3});
  EXPECT_TRUE(is_sentinel(o));
  for (std::int64_t i = 0; i < 5; ++i) o.set(i, 0.5);  // one element left unwritten
  EXPECT_FALSE(is_sentinel(o));
  const Comparison c = compare("o", o, std::vector<double>(6, 0.5), Tolerance::bf16_output());
  EXPECT_FALSE(c.ok);
  EXPECT_EQ(c.worst_index, 5);
  for (DType t : {DType::kF32, DType::kF64, DType::kI32}) {
    HostTensor x = sentinel_tensor(t, {4});
    EXPECT_TRUE(is_sentinel(x));
    if (t != DType::kI32) {
      EXPECT_TRUE(std::isnan(x.get(0)));
    }
    x.set(2, 0.0);
    EXPECT_FALSE(is_sentinel(x));
  }
}

// The sentinels are NaN: where NaN is expected (a row that sees a NaN in the cache), an element the
// op never wrote must still fail, while a NaN the op wrote passes.
TEST(Sentinel, UnwrittenElementsFailWhereNanIsExpected) {
  const std::vector<double> nan_expected(4, std::numeric_limits<double>::quiet_NaN());
  for (DType t : {DType::kBF16, DType::kF32, DType::kF64}) {
    HostTensor x = sentinel_tensor(t, {4});
    for (std::int64_t i = 0; i < 4; ++i) {
      if (i != 1) x.set(i, std::numeric_limits<double>::quiet_NaN());
    }
    const Comparison unwritten = compare("x", x, nan_expected, Tolerance::bf16_output());
    EXPECT_FALSE(unwritten.ok);
    EXPECT_EQ(unwritten.unwritten, 1);
    EXPECT_EQ(unwritten.first_unwritten, 1);
    EXPECT_NE(unwritten.report().find("1 elements still hold the sentinel (first at [1])"), std::string::npos)
        << unwritten.report();
    x.set(1, std::numeric_limits<double>::quiet_NaN());
    EXPECT_TRUE(compare("x", x, nan_expected, Tolerance::bf16_output()).ok);
  }
}

TEST(PagedFixture, PoisonsEverySlotNoRequestHolds) {
  for (KvDtype dtype : {KvDtype::kFp8E4M3, KvDtype::kBf16}) {
    Rng rng = test_rng(std::string(kv_dtype_name(dtype)));
    PagedFixtureOptions o;
    o.page_size = 3;
    o.lengths = {0, 1, 2, 4, 10};
    o.kv_dtype = dtype;
    PagedFixture f = make_paged_fixture(o, rng);
    EXPECT_EQ(f.seq_lens, (std::vector<std::int32_t>{0, 1, 2, 4, 10}));
    EXPECT_EQ(f.max_pages, 4 + 1);
    EXPECT_EQ(f.num_pages(), 1 + 1 + 2 + 4 + 3);
    std::set<std::int64_t> used;
    for (std::int64_t b = 0; b < f.batch(); ++b) {
      for (std::int64_t t = 0; t < f.seq_lens[static_cast<std::size_t>(b)]; ++t) used.insert(f.slot(b, t));
      // -1 beyond the request's pages.
      for (int c = static_cast<int>((f.seq_lens[static_cast<std::size_t>(b)] + 2) / 3); c < f.max_pages; ++c) {
        EXPECT_EQ(f.block_table[static_cast<std::size_t>(b * f.max_pages + c)], -1);
      }
    }
    for (std::int64_t s = 0; s < f.num_pages() * f.page_size; ++s) {
      double v[kQkDim];
      naive::token_values(f.cache_bytes.data() + s * naive::token_bytes(dtype), dtype, v);
      const std::uint8_t* key = f.indexer_bytes.data() + (s / 3) * 3 * 132 + (s % 3) * 128;
      const float kscale = naive::f32_le(f.indexer_bytes.data() + (s / 3) * 3 * 132 + 3 * 128 + (s % 3) * 4);
      if (used.count(s)) {
        for (double x : v) ASSERT_TRUE(std::isfinite(x)) << "slot " << s;
        ASSERT_TRUE(std::isfinite(kscale));
        for (int j = 0; j < kIndexerDim; ++j) ASSERT_FALSE(std::isnan(naive::fp8_value(key[j])));
      } else {
        for (double x : v) ASSERT_TRUE(std::isnan(x)) << "slot " << s;
        ASSERT_TRUE(std::isnan(kscale));
        for (int j = 0; j < kIndexerDim; ++j) ASSERT_TRUE(std::isnan(naive::fp8_value(key[j])));
      }
    }
  }
}

TEST(PagedFixture, PagesAreShuffled) {
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 2;
  o.lengths = {40};
  PagedFixture f = make_paged_fixture(o, rng);
  const std::vector<std::int32_t> pages(f.block_table.begin(), f.block_table.begin() + 20);
  EXPECT_FALSE(std::is_sorted(pages.begin(), pages.end()));
}

TEST(Rng, SeedsAreReproducibleAndOverridable) {
  {
    const ScopedEnv base("LKV_TEST_SEED", "42");
    Rng a = test_rng("s"), b = test_rng("s"), c = test_rng("t");
    EXPECT_EQ(a.seed(), b.seed());
    EXPECT_NE(a.seed(), c.seed());
    EXPECT_EQ(a.next_u64(), b.next_u64());
    {
      const ScopedEnv other("LKV_TEST_SEED", "0x2b");  // 43
      EXPECT_NE(test_rng("s").seed(), a.seed());
    }
    EXPECT_EQ(test_rng("s").seed(), a.seed());
  }
  // Distributions: sane moments.
  Rng r(7);
  double sum = 0, sq = 0;
  for (int i = 0; i < 20000; ++i) {
    const double x = r.normal();
    sum += x;
    sq += x * x;
  }
  EXPECT_NEAR(sum / 20000, 0.0, 0.05);
  EXPECT_NEAR(sq / 20000, 1.0, 0.05);
  for (int i = 0; i < 1000; ++i) {
    const std::int64_t k = r.uniform_int(-2, 3);
    ASSERT_TRUE(k >= -2 && k <= 3);
  }
}

TEST(Rng, DiscardSkipsTheDrawsItNames) {
  Rng a(11), b(11);
  for (int i = 0; i < 1000; ++i) a.next_u64();
  b.discard(1000);
  EXPECT_EQ(a.next_u64(), b.next_u64());
}

// The fixture's values drawn on several threads are the values one loop draws, token after token,
// and leave the generator where that loop leaves it (so the draws after them are the same too).
TEST(PagedFixture, TokenValuesOnSeveralThreadsAreThoseOfOneLoop) {
  constexpr std::int64_t kTokens = 40000;  // 4 threads of at least 8192 tokens
  const PagedFixtureOptions o;
  Rng one(5), several(5);
  std::vector<std::uint16_t> latents(kTokens * kQkDim), keys(kTokens * kIndexerDim);
  for (std::int64_t t = 0; t < kTokens; ++t) {
    random_token_values(one, o, latents.data() + t * kQkDim, keys.data() + t * kIndexerDim);
  }
  std::vector<std::uint16_t> latents4(latents.size()), keys4(keys.size());
  random_tokens(several, o, kTokens, latents4.data(), keys4.data(), 4);
  EXPECT_TRUE(latents == latents4);
  EXPECT_TRUE(keys == keys4);
  EXPECT_EQ(one.next_u64(), several.next_u64()) << "kDrawsPerRandomToken is not what random_token_values draws";
}

}  // namespace
}  // namespace latentkv::testing
