// What a backend's select() is asked about a call: problem_of reads each op's shape off its
// parameters (descriptors only; no data is read).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

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

// Every field of the call's problem as `want` has it (fields want leaves at 0 are 0: not read off
// the call).
void expect_problem(const OpArgs& args, const Problem& want) {
  const Problem got = problem(args);
  SCOPED_TRACE(std::string(op_name(want.op)));
  EXPECT_EQ(got.op, want.op);
  EXPECT_EQ(got.kv_dtype, want.kv_dtype);
  EXPECT_EQ(got.heads, want.heads);
  EXPECT_EQ(got.page_size, want.page_size);
  EXPECT_EQ(got.q_len, want.q_len);
  EXPECT_EQ(got.topk, want.topk);
}

TEST(ProblemOf, EachOpsFieldsComeFromItsCall) {
  constexpr KvDtype kBf16 = KvDtype::kBf16;
  AppendParams append;
  append.cache = bf16_cache(16);
  expect_problem(append, {.op = Op::kAppend, .kv_dtype = kBf16, .page_size = 16});

  MlaDecodeParams decode;
  decode.q = shaped(DType::kBF16, {5, 3, 7, 576});
  decode.cache = bf16_cache(32);
  expect_problem(decode, {.op = Op::kMlaDecode, .kv_dtype = kBf16, .heads = 7, .page_size = 32, .q_len = 3});

  MlaPrefillParams prefill;
  prefill.q = shaped(DType::kBF16, {40, 9, 576});
  prefill.cache = bf16_cache(8);
  expect_problem(prefill, {.op = Op::kMlaPrefill, .kv_dtype = kBf16, .heads = 9, .page_size = 8});

  IndexerLogitsParams indexer;  // no latent cache: the problem's kv_dtype stays the default
  indexer.q = shaped(DType::kFP8E4M3, {6, 2, 11, 128});
  indexer.cache = indexer_cache(64);
  expect_problem(indexer, {.op = Op::kIndexerLogits, .heads = 11, .page_size = 64, .q_len = 2});

  TopkParams topk;
  topk.logits = shaped(DType::kF32, {6, 4, 1000});
  topk.page_size = 2;
  topk.k = 300;
  expect_problem(topk, {.op = Op::kTopk, .page_size = 2, .q_len = 4, .topk = 300});

  SparseMlaDecodeParams sparse;
  sparse.q = shaped(DType::kBF16, {5, 2, 13, 576});
  sparse.indices = shaped(DType::kI32, {5, 2, 700});
  sparse.cache = bf16_cache(1);
  expect_problem(sparse,
                 {.op = Op::kSparseMlaDecode, .kv_dtype = kBf16, .heads = 13, .page_size = 1, .q_len = 2, .topk = 700});

  SparseMlaPrefillParams sparse_prefill;  // rows of T new tokens: topk is the index rows' width
  sparse_prefill.q = shaped(DType::kBF16, {5, 8, 576});
  sparse_prefill.indices = shaped(DType::kI32, {5, 2048});
  sparse_prefill.cache = bf16_cache(4);
  expect_problem(sparse_prefill,
                 {.op = Op::kSparseMlaPrefill, .kv_dtype = kBf16, .heads = 8, .page_size = 4, .topk = 2048});

  IndexerPrefillParams indexer_prefill;
  indexer_prefill.q = shaped(DType::kFP8E4M3, {30, 17, 128});
  indexer_prefill.cache = indexer_cache(128);
  indexer_prefill.k = 99;
  expect_problem(indexer_prefill, {.op = Op::kIndexerPrefill, .heads = 17, .page_size = 128, .topk = 99});
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

// A view's extents: dims past its rank read 0 (selection reads a wrongly ranked q before validation
// names it); a dim outside the four a view can hold is an error, not a read past the shape.
TEST(TensorViewSize, DimsPastTheRankReadZeroOthersAreRefused) {
  const TensorView q = shaped(DType::kBF16, {2, 576});
  EXPECT_EQ(q.size(0), 2);
  EXPECT_EQ(q.size(1), 576);
  EXPECT_EQ(q.size(3), 0);
  TensorView stale = q;  // an extent left behind past the rank reads 0 too, not as a third dim
  stale.shape[2] = 300;
  EXPECT_EQ(stale.size(2), 0);
  EXPECT_TRUE(throws_error([&] { (void)q.size(4); }, "TensorView", "dim", "4"));
  EXPECT_TRUE(throws_error([&] { (void)q.size(-1); }, "TensorView", "dim", "-1"));
}

// Where a call names no device, it runs where its tensors are: its cache's memory (the top-k's: its
// logits'), the CPU for host memory and the current CUDA device for device memory. On a machine
// without a GPU both are the CPU; where the CPU tests run on a GPU (scripts/gpu_run.sh) the two differ.
TEST(DeviceOf, ACallRunsWhereItsCacheIs) {
  const DeviceInfo gpu = detect_device();
  const auto expect_on = [](const OpArgs& args, const DeviceInfo& want) {
    SCOPED_TRACE(std::string(op_name(op_of(args))));
    const DeviceInfo got = device_of(args);
    EXPECT_EQ(got.kind, want.kind);
    EXPECT_EQ(got.index, want.index);
    EXPECT_EQ(got.name, want.name);
  };
  const auto each_op = [&](Device cache, Device others, const DeviceInfo& want) {
    const auto on = [&](DType t, std::initializer_list<std::int64_t> shape) {
      TensorView v = shaped(t, shape);
      v.device = others;
      return v;
    };
    LatentCache latent = bf16_cache(16);
    latent.device = cache;
    IndexerCache indexer = indexer_cache(16);
    indexer.device = cache;
    AppendParams append;
    append.cache = latent;
    append.latent = on(DType::kBF16, {1, 576});
    expect_on(append, want);
    MlaDecodeParams decode;
    decode.cache = latent;
    decode.q = on(DType::kBF16, {1, 1, 8, 576});
    expect_on(decode, want);
    MlaPrefillParams prefill;
    prefill.cache = latent;
    prefill.q = on(DType::kBF16, {1, 8, 576});
    expect_on(prefill, want);
    IndexerLogitsParams logits;
    logits.cache = indexer;
    logits.q = on(DType::kFP8E4M3, {1, 1, 8, 128});
    expect_on(logits, want);
    TopkParams topk;  // no cache: its logits
    topk.logits = on(DType::kF32, {1, 1, 100});
    topk.logits.device = cache;
    topk.slots = on(DType::kI32, {1, 1, 10});
    expect_on(topk, want);
    SparseMlaDecodeParams sparse;
    sparse.cache = latent;
    sparse.q = on(DType::kBF16, {1, 1, 8, 576});
    expect_on(sparse, want);
    SparseMlaPrefillParams sparse_prefill;
    sparse_prefill.cache = latent;
    sparse_prefill.q = on(DType::kBF16, {1, 8, 576});
    expect_on(sparse_prefill, want);
    IndexerPrefillParams indexer_prefill;
    indexer_prefill.cache = indexer;
    indexer_prefill.q = on(DType::kFP8E4M3, {1, 8, 128});
    expect_on(indexer_prefill, want);
  };
  each_op(Device::cpu(), Device::cpu(), DeviceInfo{});
  each_op(Device::cpu(), Device::cuda(0), DeviceInfo{});  // the other views do not decide it
  each_op(Device::cuda(0), Device::cpu(), gpu);
  EXPECT_EQ(device_info_for(Device::cpu()).name, "cpu");
  EXPECT_EQ(device_info_for(Device::cuda(3)).index, gpu.index);  // the current device, which validation holds views to
}

// A kernel is its op's: the reference's kernel selected for mla_decode, kept and handed an append's
// parameters (or a top-k's), refuses them in its launch and its check, naming the op it was selected
// for, before it touches anything (the cache here would be written at slot 0 by an append).
TEST(SelectedKernel, RefusesTheParametersOfAnotherOp) {
  const Backend* reference = find_backend("reference");
  ASSERT_NE(reference, nullptr);
  Problem problem;
  problem.op = Op::kMlaDecode;
  const Selection s = reference->select(problem);
  ASSERT_TRUE(s);
  ASSERT_TRUE(s.kernel->check) << "the op check is always there";
  std::vector<std::uint8_t> pool(kFp8TokenBytes * 16, 0x5A);
  std::vector<std::uint16_t> latent(576, 0x3F80);  // bf16 1.0
  std::int32_t slot = 0;
  AppendParams append;
  append.cache.data = pool.data();
  append.cache.num_pages = 1;
  append.cache.page_size = 16;
  append.latent = TensorView::contiguous(latent.data(), DType::kBF16, {1, 576});
  append.slots = TensorView::contiguous(&slot, DType::kI32, {1});
  EXPECT_TRUE(throws_error([&] { s.kernel->launch(append, {}); }, "mla_decode", "args", "append's parameters"));
  EXPECT_NE(error_of([&] { s.kernel->check(append); }).find("expected mla_decode's parameters (kernel "
                                                             "'reference.mla_decode' was selected for mla_decode)"),
            std::string::npos);
  EXPECT_TRUE(throws_error([&] { s.kernel->check(TopkParams{}); }, "mla_decode", "args", "topk's parameters"));
  EXPECT_EQ(pool, std::vector<std::uint8_t>(kFp8TokenBytes * 16, 0x5A)) << "the cache was written";
  // The same parameters through run() on the backend selected for them: the append runs.
  run(*reference, append, {}, DeviceInfo{});
  EXPECT_NE(pool, std::vector<std::uint8_t>(kFp8TokenBytes * 16, 0x5A));
}

// make_kernel passes its op's parameters on to the launch and the check it was given, once each.
TEST(SelectedKernel, PassesItsOwnOpsParametersOn) {
  int launched = 0, checked = 0;
  const Kernel k = make_kernel(
      Op::kTopk, "counting", [&](const OpArgs&, const ExecContext&) { ++launched; },
      [&](const OpArgs&) { ++checked; });
  k.check(TopkParams{});
  k.launch(TopkParams{}, {});
  EXPECT_EQ(launched, 1);
  EXPECT_EQ(checked, 1);
  const Kernel unchecked = make_kernel(Op::kTopk, "unchecked", [&](const OpArgs&, const ExecContext&) { ++launched; });
  EXPECT_NO_THROW(unchecked.check(TopkParams{}));
  EXPECT_TRUE(throws_error([&] { unchecked.launch(AppendParams{}, {}); }, "topk", "args", "append's parameters"));
  EXPECT_EQ(launched, 1);
}

}  // namespace
}  // namespace latentkv::testing
