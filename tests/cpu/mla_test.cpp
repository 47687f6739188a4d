// Dense MLA decode and prefill: the reference against the independent naive formulation.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "latentkv/model.hpp"
#include "support/compare.hpp"
#include "support/naive.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

constexpr float kGlmScale = 0.0625f;

// The lengths SPEC section 5 asks for at a page size: 0, 1, page_size - 1, page_size + 1, and odd
// values that are multiples of nothing in particular.
std::vector<std::int64_t> awkward_lengths(int page_size) {
  return {0, 1, page_size - 1, page_size + 1, 37, 2 * page_size + 5};
}

// Compares reference outputs with the naive ones: float64 outputs tightly, and the spec tolerance for
// bf16 o / f32 lse written by a second reference run.
void expect_matches(const AttentionOutputs& f64, const AttentionOutputs& low, const naive::Attention& want,
                    const std::string& what) {
  EXPECT_TRUE(compare(what + " o (f64)", f64.o, want.o, Tolerance::float64()));
  EXPECT_TRUE(compare(what + " lse (f64)", f64.lse, want.lse, Tolerance::float64()));
  EXPECT_TRUE(compare(what + " o (bf16)", low.o, want.o, Tolerance::bf16_output()));
  EXPECT_TRUE(rounded_to_nearest(what + " o (bf16)", low.o, want.o));
  EXPECT_TRUE(compare(what + " lse (f32)", low.lse, want.lse, Tolerance::lse()));
}

using DecodeCase = std::tuple<int /*page_size*/, int /*q_len*/, KvDtype>;

class DenseDecode : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(DenseDecode, MatchesNaive) {
  const auto [page_size, q_len, dtype] = GetParam();
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = page_size;
  o.lengths = awkward_lengths(page_size);
  o.kv_dtype = dtype;
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  const int heads = 5;
  const HostTensor q = random_bf16(rng, {f.batch(), q_len, heads, kQkDim});

  const AttentionOutputs f64 = reference_mla_decode(f, q, kGlmScale);
  const AttentionOutputs low = reference_mla_decode(f, q, kGlmScale, DType::kBF16, DType::kF32);
  const naive::Attention want = naive::mla_decode(f, q, kGlmScale);
  expect_matches(f64, low, want, "mla_decode");

  // The request of length 0 sees nothing: zeros and -inf, whatever the query.
  for (std::int64_t i = 0; i < q_len * heads; ++i) {
    EXPECT_EQ(f64.lse.get(i), -INFINITY);
    for (int j = 0; j < kLatentDim; ++j) ASSERT_EQ(f64.o.get(i * kLatentDim + j), 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(PageSizesQLens, DenseDecode,
                         ::testing::Combine(::testing::Values(1, 3, 16, 64), ::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(KvDtype::kFp8E4M3, KvDtype::kBf16)),
                         [](const auto& info) {
                           return "ps" + std::to_string(std::get<0>(info.param)) + "_qlen" +
                                  std::to_string(std::get<1>(info.param)) + "_" +
                                  std::string(kv_dtype_name(std::get<2>(info.param)));
                         });

TEST(DenseDecodeWide, DeepseekHeads128ShortContext) {
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 64;
  o.lengths = {70, 3};
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  const auto scale = static_cast<float>(model_preset("deepseek-v3.2").softmax_scale);
  const HostTensor q = random_bf16(rng, {2, 2, 128, kQkDim});
  expect_matches(reference_mla_decode(f, q, scale), reference_mla_decode(f, q, scale, DType::kBF16, DType::kF32),
                 naive::mla_decode(f, q, scale), "mla_decode H=128");
}

TEST(DenseDecodeWide, LargeScoresStayFinite) {
  // Large queries make the scores span hundreds: the max subtraction must keep exp finite.
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 16;
  o.lengths = {40, 17};
  o.latent_stddev = 30.0;
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  const HostTensor q = random_bf16(rng, {2, 3, 4, kQkDim}, 20.0);
  const AttentionOutputs got = reference_mla_decode(f, q, kGlmScale);
  for (double v : got.o.to_doubles()) ASSERT_TRUE(std::isfinite(v));
  const naive::Attention want = naive::mla_decode(f, q, kGlmScale);
  EXPECT_TRUE(compare("o (f64)", got.o, want.o, Tolerance::float64()));
  // lse is in the thousands here: compare relative to it (float32 could not hold 1e-5 absolute).
  EXPECT_TRUE(compare("lse (f64)", got.lse, want.lse, Tolerance{0.0, 1e-12, -1}));
  const AttentionOutputs low = reference_mla_decode(f, q, kGlmScale, DType::kBF16, DType::kF32);
  EXPECT_TRUE(compare("o (bf16)", low.o, want.o, Tolerance::bf16_output()));
  EXPECT_TRUE(rounded_to_nearest("o (bf16)", low.o, want.o));
  EXPECT_TRUE(compare("lse (f32)", low.lse, want.lse, Tolerance{0.0, 0x1p-24, -1}));
}

// All cached latent values equal: every query attends to copies of one vector, so o is that vector
// exactly, whatever the softmax weights.
TEST(DenseDecodeExact, AllValuesEqualGiveThatValue) {
  for (KvDtype dtype : {KvDtype::kFp8E4M3, KvDtype::kBf16}) {
    for (float value : {0.375f, -0.5f}) {
      Rng rng = test_rng(std::string(kv_dtype_name(dtype)) + std::to_string(value));
      PagedFixtureOptions o;
      o.page_size = 7;
      o.lengths = {1, 20, 65};
      o.kv_dtype = dtype;
      o.with_indexer = false;
      o.token_values = [value](std::int64_t, std::int64_t, std::uint16_t* latent, std::uint16_t* key) {
        for (int j = 0; j < kLatentDim; ++j) latent[j] = bf16_encode(value);
        for (int j = kLatentDim; j < kQkDim; ++j) latent[j] = bf16_encode(0.25f);
        for (int j = 0; j < kIndexerDim; ++j) key[j] = bf16_encode(1.0f);
      };
      PagedFixture f = make_paged_fixture(o, rng);
      const HostTensor q = random_bf16(rng, {3, 4, 6, kQkDim});
      const AttentionOutputs bf = reference_mla_decode(f, q, kGlmScale, DType::kBF16, DType::kF32);
      const AttentionOutputs f32 = reference_mla_decode(f, q, kGlmScale, DType::kF32, DType::kF64);
      const AttentionOutputs f64 = reference_mla_decode(f, q, kGlmScale);
      for (std::int64_t i = 0; i < bf.o.numel(); ++i) {
        const std::int64_t b = i / (4 * 6 * kLatentDim), row = i / (6 * kLatentDim) % 4;
        // Rows that see nothing (request 0 has one token, four queries) output zeros.
        const float want = f.seq_lens[static_cast<std::size_t>(b)] - 4 + row + 1 > 0 ? value : 0.0f;
        ASSERT_EQ(bf.o.data<std::uint16_t>()[i], bf16_encode(want)) << "element " << i;
        ASSERT_EQ(f32.o.data<float>()[i], want) << "element " << i;
        // A power of two times each weight sums and divides back exactly in float64.
        if (value == -0.5f) {
          ASSERT_EQ(f64.o.data<double>()[i], want) << "element " << i;
        }
      }
      // lse = s + log(visible) with the one score s.
      for (std::int64_t b = 0; b < 3; ++b) {
        for (std::int64_t i = 0; i < 4; ++i) {
          const std::int64_t visible = std::max<std::int64_t>(0, f.seq_lens[static_cast<std::size_t>(b)] - 4 + i + 1);
          for (std::int64_t h = 0; h < 6; ++h) {
            double dot = 0;
            for (int j = 0; j < kQkDim; ++j) {
              dot += q.get(((b * 4 + i) * 6 + h) * kQkDim + j) * (j < kLatentDim ? value : 0.25);
            }
            const double got = f64.lse.get((b * 4 + i) * 6 + h);
            if (visible == 0) {
              ASSERT_EQ(got, -INFINITY);
            } else {
              ASSERT_NEAR(got, kGlmScale * dot + std::log(static_cast<double>(visible)), 1e-9);
            }
          }
        }
      }
    }
  }
}

// Every score far below exp's range (-1300 here): the running max must start from the scores, not
// from 0, or every weight underflows to 0 and o becomes 0/0. o is the one latent value exactly, lse
// the score plus log(visible).
TEST(DenseDecodeExact, AllScoresFarBelowZero) {
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 16;
  o.lengths = {20};
  o.with_indexer = false;
  o.token_values = [](std::int64_t, std::int64_t, std::uint16_t* latent, std::uint16_t* key) {
    for (int j = 0; j < kLatentDim; ++j) latent[j] = bf16_encode(0.375f);  // 384 x 2^-10 in fp8: exact
    for (int j = kLatentDim; j < kQkDim; ++j) latent[j] = bf16_encode(0.25f);
    for (int j = 0; j < kIndexerDim; ++j) key[j] = bf16_encode(1.0f);
  };
  PagedFixture f = make_paged_fixture(o, rng);
  const int heads = 3;
  HostTensor q(DType::kBF16, {1, 1, heads, kQkDim});
  for (std::int64_t i = 0; i < q.numel(); ++i) q.data<std::uint16_t>()[i] = bf16_encode(-100.0f);
  // score = 0.0625 x -100 x (512 x 0.375 + 64 x 0.25) = -1300
  const AttentionOutputs got = reference_mla_decode(f, q, kGlmScale);
  for (std::int64_t i = 0; i < got.o.numel(); ++i) ASSERT_EQ(got.o.get(i), 0.375) << "element " << i;
  for (int h = 0; h < heads; ++h) EXPECT_NEAR(got.lse.get(h), -1300.0 + std::log(20.0), 1e-9) << "head " << h;
}

// ---- prefill ---------------------------------------------------------------------------------

class DensePrefill : public ::testing::TestWithParam<std::tuple<int, KvDtype>> {};

TEST_P(DensePrefill, RaggedRequestsMatchNaive) {
  const auto [page_size, dtype] = GetParam();
  Rng rng = test_rng();
  // (prefix, new tokens): a prompt of one token, a whole prompt, an extension, a page-boundary
  // prefix, a request with no new tokens, and page_size + 1 on both sides.
  const std::vector<std::pair<std::int64_t, std::int64_t>> requests = {
      {0, 1}, {0, 37}, {50, 20}, {page_size - 1, 2}, {3, 0}, {page_size + 1, page_size + 1}};
  PagedFixtureOptions o;
  o.page_size = page_size;
  o.kv_dtype = dtype;
  o.with_indexer = false;
  std::vector<std::int64_t> new_tokens;
  for (auto [prefix, n] : requests) {
    o.lengths.push_back(prefix + n);
    new_tokens.push_back(n);
  }
  PagedFixture f = make_paged_fixture(o, rng);
  const std::vector<std::int32_t> cu = cumulative(new_tokens);
  const int heads = 3;
  const HostTensor q = random_bf16(rng, {cu.back(), heads, kQkDim});
  expect_matches(reference_mla_prefill(f, q, cu, kGlmScale),
                 reference_mla_prefill(f, q, cu, kGlmScale, DType::kBF16, DType::kF32),
                 naive::mla_prefill(f, q, cu, kGlmScale), "mla_prefill");
}

INSTANTIATE_TEST_SUITE_P(PageSizes, DensePrefill,
                         ::testing::Combine(::testing::Values(1, 3, 16, 64),
                                            ::testing::Values(KvDtype::kFp8E4M3, KvDtype::kBf16)),
                         [](const auto& info) {
                           return "ps" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::string(kv_dtype_name(std::get<1>(info.param)));
                         });

TEST(DensePrefillConsistency, EqualsDecodeWithTheSameNewTokens) {
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 8;
  o.lengths = {3, 9, 30};
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  const int q_len = 3, heads = 4;
  const HostTensor q = random_bf16(rng, {3, q_len, heads, kQkDim});
  HostTensor q_flat(DType::kBF16, {3 * q_len, heads, kQkDim});
  std::copy(q.raw(), q.raw() + q.bytes(), q_flat.raw());
  const AttentionOutputs dec = reference_mla_decode(f, q, kGlmScale);
  const AttentionOutputs pre = reference_mla_prefill(f, q_flat, cumulative({q_len, q_len, q_len}), kGlmScale);
  EXPECT_EQ(dec.o.byte_vector(), pre.o.byte_vector());
  EXPECT_EQ(dec.lse.byte_vector(), pre.lse.byte_vector());
}

TEST(DensePrefillWide, Heads128) {
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 64;
  o.lengths = {24, 5};
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  const std::vector<std::int32_t> cu = cumulative({10, 5});
  const HostTensor q = random_bf16(rng, {15, 128, kQkDim});
  expect_matches(reference_mla_prefill(f, q, cu, kGlmScale),
                 reference_mla_prefill(f, q, cu, kGlmScale, DType::kBF16, DType::kF32),
                 naive::mla_prefill(f, q, cu, kGlmScale), "mla_prefill H=128");
}

}  // namespace
}  // namespace latentkv::testing
