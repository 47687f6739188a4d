// What a backend's select() is asked about a call: problem_of reads each op's shape off its
// parameters (descriptors only; no data is read).
#include <gtest/gtest.h>

#include <cstdint>

#include "latentkv/backend.hpp"
#include "support/expect_error.hpp"

namespace latentkv::testing {
namespace {

TensorView shaped(DType dtype, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(nullptr, dtype, shape);
}

LatentCache bf16_cache(int page_size) {
  LatentCache c;
  c.dtype = KvDtype::kBf16;
  c.page_size = page_size;
  return c;
}

IndexerCache indexer_cache(int page_size) {
  IndexerCache c;
  c.page_size = page_size;
  return c;
}

Problem problem(const OpArgs& args) { return problem_of(args, DeviceInfo{}); }

TEST(ProblemOf, EachOpsFieldsComeFromItsCall) {
  AppendParams append;
  append.cache = bf16_cache(16);
  Problem p = problem(append);
  EXPECT_EQ(p.op, Op::kAppend);
  EXPECT_EQ(p.kv_dtype, KvDtype::kBf16);
  EXPECT_EQ(p.page_size, 16);

  MlaDecodeParams decode;
  decode.q = shaped(DType::kBF16, {5, 3, 7, 576});
  decode.cache = bf16_cache(32);
  p = problem(decode);
  EXPECT_EQ(p.op, Op::kMlaDecode);
  EXPECT_EQ(p.kv_dtype, KvDtype::kBf16);
  EXPECT_EQ(p.page_size, 32);
  EXPECT_EQ(p.heads, 7);
  EXPECT_EQ(p.q_len, 3);

  MlaPrefillParams prefill;
  prefill.q = shaped(DType::kBF16, {40, 9, 576});
  prefill.cache = bf16_cache(8);
  p = problem(prefill);
  EXPECT_EQ(p.op, Op::kMlaPrefill);
  EXPECT_EQ(p.kv_dtype, KvDtype::kBf16);
  EXPECT_EQ(p.page_size, 8);
  EXPECT_EQ(p.heads, 9);

  IndexerLogitsParams indexer;
  indexer.q = shaped(DType::kFP8E4M3, {6, 2, 11, 128});
  indexer.cache = indexer_cache(64);
  p = problem(indexer);
  EXPECT_EQ(p.op, Op::kIndexerLogits);
  EXPECT_EQ(p.page_size, 64);
  EXPECT_EQ(p.heads, 11);
  EXPECT_EQ(p.q_len, 2);

  TopkParams topk;
  topk.logits = shaped(DType::kF32, {6, 4, 1000});
  topk.page_size = 2;
  topk.k = 300;
  p = problem(topk);
  EXPECT_EQ(p.op, Op::kTopk);
  EXPECT_EQ(p.page_size, 2);
  EXPECT_EQ(p.q_len, 4);
  EXPECT_EQ(p.topk, 300);

  SparseMlaDecodeParams sparse;
  sparse.q = shaped(DType::kBF16, {5, 2, 13, 576});
  sparse.indices = shaped(DType::kI32, {5, 2, 700});
  sparse.cache = bf16_cache(1);
  p = problem(sparse);
  EXPECT_EQ(p.op, Op::kSparseMlaDecode);
  EXPECT_EQ(p.kv_dtype, KvDtype::kBf16);
  EXPECT_EQ(p.page_size, 1);
  EXPECT_EQ(p.heads, 13);
  EXPECT_EQ(p.q_len, 2);
  EXPECT_EQ(p.topk, 700);

  SparseMlaPrefillParams sparse_prefill;  // rows of T new tokens: topk is the index rows' width
  sparse_prefill.q = shaped(DType::kBF16, {5, 8, 576});
  sparse_prefill.indices = shaped(DType::kI32, {5, 2048});
  sparse_prefill.cache = bf16_cache(4);
  p = problem(sparse_prefill);
  EXPECT_EQ(p.op, Op::kSparseMlaPrefill);
  EXPECT_EQ(p.kv_dtype, KvDtype::kBf16);
  EXPECT_EQ(p.page_size, 4);
  EXPECT_EQ(p.heads, 8);
  EXPECT_EQ(p.topk, 2048);

  IndexerPrefillParams indexer_prefill;
  indexer_prefill.q = shaped(DType::kFP8E4M3, {30, 17, 128});
  indexer_prefill.cache = indexer_cache(128);
  indexer_prefill.k = 99;
  p = problem(indexer_prefill);
  EXPECT_EQ(p.op, Op::kIndexerPrefill);
  EXPECT_EQ(p.page_size, 128);
  EXPECT_EQ(p.heads, 17);
  EXPECT_EQ(p.topk, 99);
}

// An extent the selection reads as an int: 2^31 - 1 is read as it is, one more is refused by name.
TEST(ProblemOf, ExtentsUpToInt32) {
  MlaDecodeParams decode;
  decode.cache = bf16_cache(64);
  decode.q = shaped(DType::kBF16, {1, 1, INT32_MAX, 576});
  EXPECT_EQ(problem(decode).heads, INT32_MAX);
  const std::int64_t past = std::int64_t{INT32_MAX} + 1;
  decode.q = shaped(DType::kBF16, {1, 1, past, 576});
  EXPECT_TRUE(throws_error([&] { problem(decode); }, "mla_decode", "q", std::to_string(past)));
  SparseMlaPrefillParams sparse;
  sparse.q = shaped(DType::kBF16, {1, 8, 576});
  sparse.indices = shaped(DType::kI32, {1, past});
  EXPECT_TRUE(throws_error([&] { problem(sparse); }, "sparse_mla_prefill", "indices", std::to_string(past)));
}

}  // namespace
}  // namespace latentkv::testing
