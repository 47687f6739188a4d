// Sparse MLA decode and prefill: equal to dense when every visible token is selected, equal to the
// naive formulation on random selections, zeros and -inf for empty rows, duplicates counted twice.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "support/compare.hpp"
#include "support/naive.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

constexpr float kScale = 0.0625f;

std::vector<std::int32_t> as_vector(const HostTensor& t) {
  return {t.data<std::int32_t>(), t.data<std::int32_t>() + t.numel()};
}

class SparseEqualsDense : public ::testing::TestWithParam<int /*page_size*/> {};

TEST_P(SparseEqualsDense, Decode) {
  const int page_size = GetParam();
  for (int q_len = 1; q_len <= 4; ++q_len) {
    Rng rng = test_rng("q_len " + std::to_string(q_len));
    PagedFixtureOptions o;
    o.page_size = page_size;
    o.lengths = {0, 1, page_size - 1, page_size + 1, 45};
    o.with_indexer = false;
    PagedFixture f = make_paged_fixture(o, rng);
    const int heads = 4;
    const HostTensor q = random_bf16(rng, {f.batch(), q_len, heads, kQkDim});
    const std::int64_t topk = f.max_len() + 7;
    HostTensor indices = all_visible_indices(f, std::vector<std::int64_t>(static_cast<std::size_t>(f.batch()), q_len), topk, rng);
    HostTensor indices3(DType::kI32, {f.batch(), q_len, topk});
    std::copy(indices.raw(), indices.raw() + indices.bytes(), indices3.raw());

    const AttentionOutputs dense = reference_mla_decode(f, q, kScale);
    const AttentionOutputs sparse = reference_sparse_decode(f, q, indices3, kScale);
    const std::string what = "q_len " + std::to_string(q_len);
    // The order of the selected tokens changes the summation order only.
    EXPECT_TRUE(compare(what + " sparse o vs dense", sparse.o, dense.o, Tolerance::float64(1e-12)));
    EXPECT_TRUE(compare(what + " sparse lse vs dense", sparse.lse, dense.lse, Tolerance::float64(1e-12)));
    const naive::Attention want = naive::mla_decode(f, q, kScale);
    EXPECT_TRUE(compare(what + " sparse o vs naive dense", sparse.o, want.o, Tolerance::float64()));
    EXPECT_TRUE(compare(what + " sparse lse vs naive dense", sparse.lse, want.lse, Tolerance::float64()));
  }
}

TEST_P(SparseEqualsDense, Prefill) {
  const int page_size = GetParam();
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = page_size;
  o.lengths = {1, 30, page_size + 1, 2 * page_size + 3};
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  const std::vector<std::int64_t> new_tokens = {1, 30, 2, page_size + 2};  // prompt of 1, whole prompt, extensions
  const std::vector<std::int32_t> cu = cumulative(new_tokens);
  const int heads = 3;
  const HostTensor q = random_bf16(rng, {cu.back(), heads, kQkDim});
  const HostTensor indices = all_visible_indices(f, new_tokens, f.max_len() + 1, rng);
  const AttentionOutputs dense = reference_mla_prefill(f, q, cu, kScale);
  const AttentionOutputs sparse = reference_sparse_prefill(f, q, indices, kScale);
  EXPECT_TRUE(compare("sparse prefill o vs dense", sparse.o, dense.o, Tolerance::float64(1e-12)));
  EXPECT_TRUE(compare("sparse prefill lse vs dense", sparse.lse, dense.lse, Tolerance::float64(1e-12)));
  const naive::Attention want = naive::mla_prefill(f, q, cu, kScale);
  EXPECT_TRUE(compare("sparse prefill o vs naive dense", sparse.o, want.o, Tolerance::float64()));
  EXPECT_TRUE(compare("sparse prefill lse vs naive dense", sparse.lse, want.lse, Tolerance::float64()));
}

INSTANTIATE_TEST_SUITE_P(PageSizes, SparseEqualsDense, ::testing::Values(1, 3, 64),
                         [](const auto& info) { return std::string("ps") + std::to_string(info.param); });

// Random selections of allocated slots (any request's), -1 scattered, some rows empty.
HostTensor random_indices(Rng& rng, const PagedFixture& f, std::vector<std::int64_t> shape) {
  std::vector<std::int32_t> pool;
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    const std::vector<std::int32_t> s = f.slots(b, f.seq_lens[static_cast<std::size_t>(b)]);
    pool.insert(pool.end(), s.begin(), s.end());
  }
  HostTensor t(DType::kI32, std::move(shape));
  const std::int64_t topk = t.shape().back();
  for (std::int64_t r = 0; r < t.numel() / topk; ++r) {
    const bool empty = rng.coin(0.15);
    for (std::int64_t k = 0; k < topk; ++k) {
      t.data<std::int32_t>()[r * topk + k] =
          empty || rng.coin(0.3) ? -1 : pool[static_cast<std::size_t>(rng.uniform_int(0, static_cast<std::int64_t>(pool.size()) - 1))];
    }
  }
  return t;
}

TEST(SparseMla, RandomSelectionsMatchNaive) {
  for (KvDtype dtype : {KvDtype::kFp8E4M3, KvDtype::kBf16}) {
    Rng rng = test_rng(std::string(kv_dtype_name(dtype)));
    PagedFixtureOptions o;
    o.page_size = 5;
    o.lengths = {12, 40, 7};
    o.kv_dtype = dtype;
    o.with_indexer = false;
    PagedFixture f = make_paged_fixture(o, rng);
    const int heads = 16;

    const HostTensor q = random_bf16(rng, {3, 4, heads, kQkDim});
    const HostTensor idx = random_indices(rng, f, {3, 4, 24});
    const naive::Attention want = naive::sparse_attention(f.cache_bytes, dtype, q, heads, as_vector(idx), 24, kScale);
    const AttentionOutputs f64 = reference_sparse_decode(f, q, idx, kScale);
    const AttentionOutputs low = reference_sparse_decode(f, q, idx, kScale, DType::kBF16, DType::kF32);
    EXPECT_TRUE(compare("sparse decode o (f64)", f64.o, want.o, Tolerance::float64()));
    EXPECT_TRUE(compare("sparse decode lse (f64)", f64.lse, want.lse, Tolerance::float64()));
    EXPECT_TRUE(compare("sparse decode o (bf16)", low.o, want.o, Tolerance::bf16_output()));
    EXPECT_TRUE(rounded_to_nearest("sparse decode o (bf16)", low.o, want.o));
    EXPECT_TRUE(compare("sparse decode lse (f32)", low.lse, want.lse, Tolerance::lse()));

    const HostTensor qp = random_bf16(rng, {21, heads, kQkDim});
    const HostTensor idxp = random_indices(rng, f, {21, 33});
    const naive::Attention wantp = naive::sparse_attention(f.cache_bytes, dtype, qp, heads, as_vector(idxp), 33, kScale);
    const AttentionOutputs gotp = reference_sparse_prefill(f, qp, idxp, kScale, DType::kF32, DType::kF64);
    EXPECT_TRUE(compare("sparse prefill o (f32)", gotp.o, wantp.o, Tolerance{1e-6, 1e-6, 1e-9}));
    EXPECT_TRUE(compare("sparse prefill lse (f64)", gotp.lse, wantp.lse, Tolerance::float64()));
  }
}

TEST(SparseMla, EmptyRowsGiveZerosAndMinusInf) {
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 4;
  o.lengths = {9};
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  const HostTensor q = random_bf16(rng, {1, 2, 3, kQkDim});
  HostTensor idx = i32_tensor({1, 2, 4}, {-1, -1, -1, -1, static_cast<std::int32_t>(f.slot(0, 2)), -1, -1, -1});
  for (DType o_dtype : {DType::kBF16, DType::kF32, DType::kF64}) {
    const AttentionOutputs got = reference_sparse_decode(f, q, idx, kScale, o_dtype, DType::kF32);
    for (std::int64_t h = 0; h < 3; ++h) {
      EXPECT_EQ(got.lse.get(h), -INFINITY);
      for (int j = 0; j < kLatentDim; ++j) ASSERT_EQ(got.o.get(h * kLatentDim + j), 0.0);
      EXPECT_TRUE(std::isfinite(got.lse.get(3 + h)));
    }
  }
  HostTensor idxp = i32_tensor({2, 1}, {-1, -1});
  const HostTensor qp = random_bf16(rng, {2, 3, kQkDim});
  const AttentionOutputs gotp = reference_sparse_prefill(f, qp, idxp, kScale);
  for (std::int64_t i = 0; i < gotp.lse.numel(); ++i) EXPECT_EQ(gotp.lse.get(i), -INFINITY);
  for (std::int64_t i = 0; i < gotp.o.numel(); ++i) ASSERT_EQ(gotp.o.get(i), 0.0);
}

TEST(SparseMla, DuplicateSlotsCountTwice) {
  // A slot listed twice gets twice the weight: [s, s, t] is the softmax over {s, s, t}; [s, s] gives
  // the same o as [s] and an lse larger by log 2.
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 3;
  o.lengths = {8};
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  const auto s = static_cast<std::int32_t>(f.slot(0, 4)), t = static_cast<std::int32_t>(f.slot(0, 6));
  const HostTensor q = random_bf16(rng, {1, 3, 2, kQkDim});
  const HostTensor idx = i32_tensor({1, 3, 3}, {s, -1, -1, s, s, -1, s, t, s});
  const AttentionOutputs got = reference_sparse_decode(f, q, idx, kScale);
  // Row 1 against row 0 needs the same query: compare each against its own naive instead, and check
  // the log-2 relation with a shared query below.
  const naive::Attention want = naive::sparse_attention(f.cache_bytes, f.kv_dtype, q, 2, as_vector(idx), 3, kScale);
  EXPECT_TRUE(compare("o", got.o, want.o, Tolerance::float64()));
  EXPECT_TRUE(compare("lse", got.lse, want.lse, Tolerance::float64()));

  HostTensor q_same(DType::kBF16, {1, 2, 2, kQkDim});
  for (std::int64_t j = 0; j < 2 * kQkDim; ++j) {
    q_same.data<std::uint16_t>()[j] = q.data<std::uint16_t>()[j];
    q_same.data<std::uint16_t>()[2 * kQkDim + j] = q.data<std::uint16_t>()[j];
  }
  const HostTensor idx2 = i32_tensor({1, 2, 2}, {s, -1, s, s});
  const AttentionOutputs twice = reference_sparse_decode(f, q_same, idx2, kScale);
  for (int h = 0; h < 2; ++h) {
    EXPECT_NEAR(twice.lse.get(2 + h) - twice.lse.get(h), std::log(2.0), 1e-12);
    for (int j = 0; j < kLatentDim; ++j) {
      ASSERT_EQ(twice.o.get((2 + h) * kLatentDim + j), twice.o.get(h * kLatentDim + j));
    }
  }
}

TEST(SparseMla, ExactAnswerWhenAllValuesEqual) {
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 16;
  o.lengths = {50, 3};
  o.with_indexer = false;
  o.token_values = [](std::int64_t, std::int64_t, std::uint16_t* latent, std::uint16_t*) {
    for (int j = 0; j < kQkDim; ++j) latent[j] = bf16_encode(j < kLatentDim ? -1.75f : 0.5f);
  };
  PagedFixture f = make_paged_fixture(o, rng);
  const HostTensor q = random_bf16(rng, {2, 1, 8, kQkDim});
  const HostTensor idx = all_visible_indices(f, {1, 1}, 64, rng);
  HostTensor idx3(DType::kI32, {2, 1, 64});
  std::copy(idx.raw(), idx.raw() + idx.bytes(), idx3.raw());
  const AttentionOutputs got = reference_sparse_decode(f, q, idx3, kScale, DType::kBF16, DType::kF32);
  for (std::int64_t i = 0; i < got.o.numel(); ++i) ASSERT_EQ(got.o.data<std::uint16_t>()[i], bf16_encode(-1.75f)) << i;
}

TEST(SparseMla, Heads128) {
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 64;
  o.lengths = {100};
  o.with_indexer = false;
  PagedFixture f = make_paged_fixture(o, rng);
  const HostTensor q = random_bf16(rng, {6, 128, kQkDim});
  const HostTensor idx = random_indices(rng, f, {6, 40});
  const naive::Attention want = naive::sparse_attention(f.cache_bytes, f.kv_dtype, q, 128, as_vector(idx), 40, kScale);
  const AttentionOutputs got = reference_sparse_prefill(f, q, idx, kScale, DType::kBF16, DType::kF32);
  EXPECT_TRUE(compare("o", got.o, want.o, Tolerance::bf16_output()));
  EXPECT_TRUE(rounded_to_nearest("o", got.o, want.o));
  EXPECT_TRUE(compare("lse", got.lse, want.lse, Tolerance::lse()));
}

}  // namespace
}  // namespace latentkv::testing
