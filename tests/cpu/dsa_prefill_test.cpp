// dsa_prefill on the reference backend (host memory, the workspace sized by plan_dsa_prefill): it is
// the reference indexer_prefill then sparse_mla_prefill run by hand, with the index rows left at the
// start of the caller's workspace where dsa_prefill_steps says; with topk >= every new token's
// visible count it is dense prefill; and a rejected call names dsa_prefill (or the step that
// failed) and the argument, and writes nothing to o and lse.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "latentkv/backend.hpp"
#include "latentkv/dsa.hpp"
#include "support/checks_refuse.hpp"
#include "support/compare.hpp"
#include "support/expect_error.hpp"
#include "support/gpu_only.hpp"
#include "support/host_tensor.hpp"
#include "support/indexer_prefill.hpp"
#include "support/paged_fixture.hpp"
#include "support/planned_reference.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

constexpr float kScale = 0.0625f;
constexpr std::uint8_t kWorkspaceGarbage = 0xA5;

// One dsa_prefill call over host memory: a fixture holding the batch in both caches, random inputs,
// sentinel o and lse (f64 unless asked otherwise), and a garbage-filled planned workspace.
struct HostDsaPrefill {
  Rng rng;
  PagedFixture f;
  std::vector<std::int32_t> cu;  // [B + 1]
  HostTensor q, q_idx, weights, o, lse;
  DsaPrefillParams params;
  DsaPrefillPlan plan;
  std::vector<std::uint8_t> workspace;

  HostDsaPrefill(Rng r, const PrefillBatch& batch, int page_size, int heads, int indexer_heads, int topk,
                 DType o_dtype = DType::kF64, DType lse_dtype = DType::kF64, int chunk_tokens = 0)
      : rng(r),
        f(make_prefill_fixture(batch, page_size, rng)),
        cu(cumulative(batch.new_tokens)),
        q(random_bf16(rng, {cu.back(), heads, kQkDim})),
        q_idx(random_fp8(rng, {cu.back(), indexer_heads, kIndexerDim}, 2.0)),
        weights(random_f32(rng, {cu.back(), indexer_heads}, -1.0, 1.0)),
        o(sentinel_tensor(o_dtype, {cu.back(), heads, kLatentDim})),
        lse(sentinel_tensor(lse_dtype, {cu.back(), heads})) {
    params.q = q.view();
    params.q_idx = q_idx.view();
    params.weights = weights.view();
    params.cu_new_tokens = TensorView::contiguous(cu.data(), DType::kI32, {static_cast<std::int64_t>(cu.size())});
    params.cache = f.cache();
    params.indexer = f.indexer();
    params.block_table = f.block_table_view();
    params.seq_lens = f.seq_lens_view();
    params.o = o.view();
    params.lse = lse.view();
    params.softmax_scale = kScale;
    params.topk = topk;
    params.chunk_tokens = chunk_tokens;
    plan = plan_dsa_prefill(same_backend(reference_backend()), params, reference_device());
    workspace.assign(plan.workspace_bytes, kWorkspaceGarbage);
    params.workspace = workspace.data();
    params.workspace_bytes = workspace.size();
  }

  void run() { dsa_prefill(same_backend(reference_backend()), params, plan, {}, reference_device()); }

  // Planned again by `backends`, with a garbage-filled workspace of that plan's size.
  void replan(const DsaBackends& backends) {
    plan = plan_dsa_prefill(backends, params, reference_device());
    workspace.assign(plan.workspace_bytes, kWorkspaceGarbage);
    params.workspace = workspace.data();
    params.workspace_bytes = workspace.size();
  }

  ::testing::AssertionResult outputs_untouched() const {
    if (!is_sentinel(o)) return ::testing::AssertionFailure() << "o was written";
    if (!is_sentinel(lse)) return ::testing::AssertionFailure() << "lse was written";
    return ::testing::AssertionSuccess();
  }
  ::testing::AssertionResult untouched() const {
    ::testing::AssertionResult outputs = outputs_untouched();
    if (!outputs) return outputs;
    for (std::uint8_t byte : workspace) {
      if (byte != kWorkspaceGarbage) return ::testing::AssertionFailure() << "the workspace was written";
    }
    return ::testing::AssertionSuccess();
  }
};

// ---- the two steps by hand ---------------------------------------------------------------------

struct StepsCase {
  std::string name;
  int page_size;
  int heads;
  int indexer_heads;
  int topk;
  PrefillBatch batch;
  int chunk_tokens = 0;  // the reference works through all rows at once whatever the chunk
};

std::ostream& operator<<(std::ostream& os, const StepsCase& c) {
  return os << c.name << " (page " << c.page_size << ", H " << c.heads << ", Hi " << c.indexer_heads << ", topk "
            << c.topk << ", T " << c.batch.rows() << ")";
}

class DsaPrefill : public ::testing::TestWithParam<StepsCase> {};

TEST_P(DsaPrefill, EqualsTheStepsByHand) {
  const StepsCase& c = GetParam();
  HostDsaPrefill d(test_rng(), c.batch, c.page_size, c.heads, c.indexer_heads, c.topk, DType::kF64, DType::kF64,
                   c.chunk_tokens);
  if (c.topk < kMaxTopk) {
    bool selects = false;  // some new token sees more positions than topk: the indexer really selects
    for (const PrefillRow& r : prefill_rows(d.f, d.cu)) selects = selects || r.visible > c.topk;
    ASSERT_TRUE(selects) << c;
  }
  d.run();

  const HostTensor slots = reference_indexer_prefill(d.f, d.q_idx, d.weights, d.cu, c.topk);
  const AttentionOutputs want = reference_sparse_prefill(d.f, d.q, slots, kScale);
  const DsaPrefillSteps steps = dsa_prefill_steps(d.params, d.plan);
  EXPECT_EQ(copy_of(steps.indexer.slots).byte_vector(), slots.byte_vector()) << "workspace slots, " << c;
  EXPECT_TRUE(compare("o", d.o, want.o, Tolerance::exact())) << c;
  EXPECT_TRUE(compare("lse", d.lse, want.lse, Tolerance::exact())) << c;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, DsaPrefill,
    ::testing::Values(
        // A 23-token prompt, a request with no new tokens, a 1-token prompt, 9 new over 45, 5 over 35.
        StepsCase{"ragged_page16_k20", 16, 8, 4, 20, {{0, 12, 0, 45, 35}, {23, 0, 1, 9, 5}}},
        StepsCase{"page3_k7", 3, 4, 8, 7, {{1, 0, 40}, {2, 5, 3}}},
        StepsCase{"page1_k2048", 1, 2, 2, kMaxTopk, {{4, 0}, {3, 90}}},
        StepsCase{"page64_Hi64_k100_chunks7", 64, 16, 64, 100, {{3, 64, 150}, {2, 1, 40}}, 7},
        StepsCase{"page17_H128_k1", 17, 128, 1, 1, {{0, 2, 30}, {1, 3, 5}}}),
    [](const ::testing::TestParamInfo<StepsCase>& info) { return info.param.name; });

// Where the plan puts the two steps: the index rows [T, topk] at the start of the workspace, read by
// the sparse step as its indices; every other view is the caller's.
TEST(DsaPrefillSteps, IndexRowsAtTheStartOfTheWorkspace) {
  HostDsaPrefill d(test_rng(), {{5, 0, 30}, {4, 3, 2}}, 4, 8, 16, 6);
  const std::int64_t t = d.cu.back();
  ASSERT_GE(d.plan.workspace_bytes, static_cast<std::size_t>(t * 6) * sizeof(std::int32_t));
  const DsaPrefillSteps s = dsa_prefill_steps(d.params, d.plan);

  const TensorView& slots = s.indexer.slots;
  EXPECT_EQ(slots.data, d.workspace.data());
  EXPECT_EQ(slots.dtype, DType::kI32);
  EXPECT_EQ(slots.shape_string(), "[" + std::to_string(t) + ", 6]");
  EXPECT_TRUE(slots.is_contiguous());
  EXPECT_EQ(s.sparse.indices.data, slots.data);
  EXPECT_EQ(s.sparse.indices.shape_string(), slots.shape_string());
  EXPECT_EQ(s.indexer.k, 6);

  EXPECT_EQ(s.indexer.q.data, d.params.q_idx.data);
  EXPECT_EQ(s.indexer.weights.data, d.params.weights.data);
  EXPECT_EQ(s.indexer.cu_new_tokens.data, d.params.cu_new_tokens.data);
  EXPECT_EQ(s.indexer.cache.data, d.params.indexer.data);
  EXPECT_EQ(s.indexer.block_table.data, d.params.block_table.data);
  EXPECT_EQ(s.indexer.seq_lens.data, d.params.seq_lens.data);
  EXPECT_EQ(s.sparse.q.data, d.params.q.data);
  EXPECT_EQ(s.sparse.cache.data, d.params.cache.data);
  EXPECT_EQ(s.sparse.o.data, d.params.o.data);
  EXPECT_EQ(s.sparse.lse.data, d.params.lse.data);
  EXPECT_EQ(s.sparse.softmax_scale, kScale);
  EXPECT_TRUE(d.untouched()) << "dsa_prefill_steps runs nothing";
}

// ---- sparse = dense --------------------------------------------------------------------------

// With topk >= every new token's visible count, each row selects everything it sees: sparse
// attention equals dense prefill. A 1-token prompt, a request with no new tokens, a 13-token
// prompt, 7 new over 33, 29 new over 101 (130 positions at most), in pages of 1 and 64.
TEST(DsaPrefillDense, TopkCoveringEveryTokenEqualsDense) {
  const PrefillBatch batch = {{0, 17, 0, 33, 101}, {1, 0, 13, 7, 29}};
  for (int page_size : {1, 64}) {
    for (int topk : {130, kMaxTopk}) {
      const std::string label = "page_size " + std::to_string(page_size) + ", topk " + std::to_string(topk);
      HostDsaPrefill d(test_rng(label), batch, page_size, 4, 8, topk);
      ASSERT_EQ(d.f.max_len(), 130);
      d.run();
      const AttentionOutputs dense = reference_mla_prefill(d.f, d.q, d.cu, kScale);
      // Another order of the same float64 sums.
      EXPECT_TRUE(compare("o " + label, d.o, dense.o, Tolerance::float64(1e-12)));
      EXPECT_TRUE(compare("lse " + label, d.lse, dense.lse, Tolerance::float64(1e-12)));
    }
  }
}

// Planned and run without a device, the call selects for its cache's memory, the CPU here (also
// where a GPU is): the same plan and the same bytes as the calls that name the CPU.
TEST(DsaPrefillDevice, WithoutADeviceRunsWhereTheCacheIs) {
  const PrefillBatch batch = {{0, 17, 40}, {3, 0, 9}};
  HostDsaPrefill named(test_rng(), batch, 16, 4, 4, 16), unnamed(test_rng(), batch, 16, 4, 4, 16);
  const DsaBackends backends = same_backend(reference_backend());
  const DsaPrefillPlan plan = plan_dsa_prefill(backends, unnamed.params);
  EXPECT_EQ(plan.workspace_bytes, named.plan.workspace_bytes);
  EXPECT_EQ(plan.indexer.chunk_tokens, named.plan.indexer.chunk_tokens);
  named.run();
  dsa_prefill(backends, unnamed.params, plan);
  ASSERT_FALSE(is_sentinel(unnamed.o));
  EXPECT_EQ(std::memcmp(unnamed.o.raw(), named.o.raw(), named.o.bytes()), 0);
  EXPECT_EQ(std::memcmp(unnamed.lse.raw(), named.lse.raw(), named.lse.bytes()), 0);
}

// As DsaDecodeDevice.APlanIsMadeOnlyForADeviceItsBackendsRun: the plan and the call refuse a step
// whose backend cannot run on the device, by the step's name, writing nothing.
TEST(DsaPrefillDevice, APlanIsMadeOnlyForADeviceItsBackendsRun) {
  HostDsaPrefill d(test_rng(), {{0, 17}, {3, 9}}, 16, 4, 4, 16);
  const GpuOnly gpu_only;
  DsaBackends last_on_gpu = same_backend(reference_backend());
  last_on_gpu.sparse_prefill = &gpu_only;
  const std::string sparse = "sparse_mla_prefill: backend 'gpu_only' cannot run this call: needs a GPU (device is cpu)";
  const std::string chosen = "; a call that names no device runs where its cache.device is (cpu)";
  EXPECT_EQ(error_of([&] { plan_dsa_prefill(last_on_gpu, d.params); }), sparse + chosen);
  EXPECT_EQ(error_of([&] { plan_dsa_prefill(last_on_gpu, d.params, reference_device()); }), sparse);
  EXPECT_EQ(error_of([&] { plan_dsa_prefill(same_backend(reference_backend()), d.params, test_gpu()); }),
            "indexer_prefill: backend 'reference' cannot run this call: runs on the CPU only (device is test gpu)");
  EXPECT_EQ(error_of([&] { dsa_prefill(last_on_gpu, d.params, d.plan); }), sparse + chosen);
  EXPECT_TRUE(is_sentinel(d.o));
  EXPECT_TRUE(is_sentinel(d.lse));
}

// No new tokens (every prompt already cached): no workspace to plan, nothing to run or write.
TEST(DsaPrefillEmpty, NoNewTokensNeedNoWorkspace) {
  HostDsaPrefill d(test_rng(), {{5, 3}, {0, 0}}, 4, 4, 4, 3, DType::kBF16, DType::kF32);
  EXPECT_EQ(d.plan.workspace_bytes, 0u);
  d.params.workspace = nullptr;
  d.params.workspace_bytes = 0;
  EXPECT_NO_THROW(d.run());
  EXPECT_NO_THROW(dsa_prefill_steps(d.params, d.plan));
}

// Without new tokens both steps still check what they would check with some: offsets, lengths, o.
TEST(DsaPrefillEmpty, NoNewTokensAreStillChecked) {
  HostDsaPrefill d(test_rng(), {{5, 3}, {0, 0}}, 4, 4, 4, 3, DType::kBF16, DType::kF32);
  d.params.workspace = nullptr;
  d.params.workspace_bytes = 0;
  d.cu[0] = 1;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "indexer_prefill", "cu_new_tokens[0]", "1"));
  d.cu[0] = 0;
  std::vector<std::int32_t> lens = {5, 1000};
  d.params.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {2});
  EXPECT_TRUE(throws_error([&] { d.run(); }, "indexer_prefill", "seq_lens[1]", "1000"));
  d.params.seq_lens = d.f.seq_lens_view();
  d.params.softmax_scale = -1.0f;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "sparse_mla_prefill", "softmax_scale", "-1"));
}

// ---- rejected inputs ---------------------------------------------------------------------------

// Requests of 4 new tokens over 5, 2 over 1 and 1 over 1 (T = 7) in pages of 4, topk 3; bf16 o and
// f32 lse as on the GPU.
HostDsaPrefill small_case() {
  return HostDsaPrefill(test_rng(), {{5, 1, 1}, {4, 2, 1}}, 4, 4, 4, 3, DType::kBF16, DType::kF32);
}

TEST(DsaPrefillBadInput, TheCaseItselfIsValid) {
  HostDsaPrefill d = small_case();
  EXPECT_NO_THROW(d.run());
  EXPECT_FALSE(is_sentinel(d.o));
  EXPECT_FALSE(is_sentinel(d.lse));
  for (std::int64_t i = 0; i < d.lse.numel(); ++i) ASSERT_TRUE(std::isfinite(d.lse.get(i))) << "lse element " << i;
}

TEST(DsaPrefillBadInput, NullBackend) {
  HostDsaPrefill d = small_case();
  DsaBackends backends = same_backend(reference_backend());
  backends.indexer_prefill = nullptr;
  EXPECT_TRUE(throws_error([&] { dsa_prefill(backends, d.params, d.plan, {}, reference_device()); }, "dsa_prefill",
                           "backends.indexer_prefill", "null"));
  EXPECT_TRUE(throws_error([&] { plan_dsa_prefill(backends, d.params, reference_device()); }, "dsa_prefill",
                           "backends.indexer_prefill", "null"));
  backends = same_backend(reference_backend());
  backends.sparse_prefill = nullptr;
  EXPECT_TRUE(throws_error([&] { dsa_prefill(backends, d.params, d.plan, {}, reference_device()); }, "dsa_prefill",
                           "backends.sparse_prefill", "null"));
  EXPECT_TRUE(throws_error([&] { plan_dsa_prefill(backends, d.params, reference_device()); }, "dsa_prefill",
                           "backends.sparse_prefill", "null"));
  EXPECT_TRUE(d.untouched());

  // Prefill needs only its two backends: the decode steps' may be missing.
  backends = DsaBackends{};
  backends.indexer_prefill = &reference_backend();
  backends.sparse_prefill = &reference_backend();
  EXPECT_NO_THROW(plan_dsa_prefill(backends, d.params, reference_device()));
  EXPECT_NO_THROW(dsa_prefill(backends, d.params, d.plan, {}, reference_device()));
  EXPECT_FALSE(d.outputs_untouched());
}

// The sparse step's kernel accepts the call's shapes but its own checks refuse it (Kernel::check,
// as the cuda kernels refuse a misaligned o): refused before the indexer step is queued.
TEST(DsaPrefillBadInput, AStepsKernelChecksRefuseBeforeAnyStepRuns) {
  HostDsaPrefill d = small_case();
  const ChecksRefuse refuses;
  DsaBackends backends = same_backend(reference_backend());
  backends.sparse_prefill = &refuses;
  EXPECT_TRUE(throws_error([&] { dsa_prefill(backends, d.params, d.plan, {}, reference_device()); },
                           "sparse_mla_prefill", "o", "not 8-byte aligned"));
  EXPECT_TRUE(d.untouched());
}

TEST(DsaPrefillBadInput, NullWorkspace) {
  HostDsaPrefill d = small_case();
  d.params.workspace = nullptr;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_prefill", "workspace", "null"));
  EXPECT_TRUE(throws_error([&] { dsa_prefill_steps(d.params, d.plan); }, "dsa_prefill", "workspace", "null"));
  EXPECT_TRUE(d.untouched());
}

// q_idx is the indexer step's q: its dtype and indexer heads are refused under the caller's name.
TEST(DsaPrefillBadInput, IndexerQueriesNamedAsTheCallerGaveThem) {
  HostDsaPrefill d = small_case();
  const TensorView given = d.q_idx.view();
  const std::int64_t t = given.size(0), hi = given.size(1);
  const TensorView bytes = TensorView::contiguous(given.data, DType::kU8, {t, hi, kIndexerDim});
  const TensorView no_heads = TensorView::contiguous(given.data, DType::kFP8E4M3, {t, 0, kIndexerDim});
  HostTensor wide = random_fp8(d.rng, {t, kMaxIndexerHeads + 1, kIndexerDim});
  const std::vector<std::pair<TensorView, std::pair<std::string, std::string>>> cases = {
      {bytes, {"q_idx", "u8 " + bytes.shape_string()}},
      {no_heads, {"q_idx.shape[1] (indexer heads)", "0"}},
      {wide.view(), {"q_idx.shape[1] (indexer heads)", "65"}},
  };
  for (const auto& [q_idx, named] : cases) {
    d.params.q_idx = q_idx;
    EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_prefill", named.first, named.second));
    EXPECT_TRUE(d.untouched());
  }
}

// As dsa_decode: what only the indexer step checks of q_idx and the indexer cache is named as the
// caller gave it, a q or weights of another dtype is refused before the workspace is checked apart
// from them, and a q on another device than the main cache against the cache's.
TEST(DsaPrefillBadInput, ArgumentsTheStepsCheckNamedAsTheCallerGaveThem) {
  HostDsaPrefill d = small_case();
  const DsaPrefillParams good = d.params;
  const auto refused = [&](const char* op, const char* argument, const std::string& value) {
    const ::testing::AssertionResult run = throws_error([&] { d.run(); }, op, argument, value);
    const ::testing::AssertionResult steps =
        throws_error([&] { dsa_prefill_steps(d.params, d.plan); }, op, argument, value);
    d.params = good;
    return run && steps && d.untouched();
  };
  d.params.q_idx.data = nullptr;
  EXPECT_TRUE(refused("dsa_prefill", "q_idx", "absent"));
  d.params.q_idx.device = Device::cuda(0);
  EXPECT_TRUE(refused("dsa_prefill", "q_idx", "on cuda:0"));
  d.params.indexer.data = nullptr;
  EXPECT_TRUE(refused("dsa_prefill", "indexer.data", "null"));
  d.params.q.dtype = DType::kF32;
  EXPECT_TRUE(refused("dsa_prefill", "q", "f32"));
  d.params.weights.dtype = DType::kF64;
  EXPECT_TRUE(refused("dsa_prefill", "weights", "f64"));
  d.params.q.device = Device::cuda(1);
  EXPECT_TRUE(refused("sparse_mla_prefill", "q", "on cuda:1"));
}

// A workspace (as long as the caller says) that also holds q at its start, where the index rows go:
// q is read by the sparse step alone and the rows are written by the indexer step, so only the
// call's own check sees both; it refuses before either step runs, and so do the steps run one by one.
TEST(DsaPrefillBadInput, QueriesInsideTheWorkspace) {
  HostDsaPrefill d = small_case();
  std::vector<std::uint8_t> arena(d.q.bytes() + d.plan.workspace_bytes, kWorkspaceGarbage);
  std::copy(d.q.raw(), d.q.raw() + d.q.bytes(), arena.begin());
  const std::vector<std::uint8_t> before = arena;
  d.params.q.data = arena.data();
  d.params.workspace = arena.data();
  d.params.workspace_bytes = arena.size();
  for (const std::string& what : {error_of([&] { d.run(); }), error_of([&] { dsa_prefill_steps(d.params, d.plan); })}) {
    EXPECT_EQ(what.find("dsa_prefill: argument 'workspace'"), 0u) << what;
    EXPECT_NE(what.find("apart from q ("), std::string::npos) << what;
  }
  EXPECT_EQ(arena, before);
  EXPECT_TRUE(d.outputs_untouched());
}

TEST(DsaPrefillBadInput, WorkspaceOneByteShort) {
  HostDsaPrefill d = small_case();
  ASSERT_GT(d.plan.workspace_bytes, 0u);
  const std::string short_by_one = std::to_string(d.plan.workspace_bytes - 1);
  d.params.workspace_bytes = d.plan.workspace_bytes - 1;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_prefill", "workspace_bytes", short_by_one));
  EXPECT_TRUE(throws_error([&] { dsa_prefill_steps(d.params, d.plan); }, "dsa_prefill", "workspace_bytes", short_by_one));
  EXPECT_TRUE(d.untouched());

  d.params.workspace_bytes = d.plan.workspace_bytes;  // the planned size is enough
  EXPECT_NO_THROW(d.run());
  EXPECT_FALSE(d.untouched());
}

// The 256-byte alignment a GPU's indexer prefill wants of the workspace is asked only of a call on
// a GPU (the main cache's device, where the call runs), under dsa_prefill's own name (the cache here
// is host memory marked as a GPU's, which the shape checks after it would refuse;
// tests/gpu/test_dsa_prefill.cpp makes the real call). The reference takes a workspace 16 bytes past
// a 256-byte boundary and gives the same outputs; one 20 bytes past it is refused on the CPU too.
TEST(DsaPrefillBadInput, OnlyAGpuCallWantsA256ByteAlignedWorkspace) {
  HostDsaPrefill d = small_case();
  d.run();
  const HostTensor o = d.o, lse = d.lse;
  std::vector<std::uint8_t> arena(d.plan.workspace_bytes + 512, kWorkspaceGarbage);
  auto* at = arena.data() + (256 - reinterpret_cast<std::uintptr_t>(arena.data()) % 256) % 256 + 16;
  d.params.workspace = at;
  fill_sentinel(d.o);
  fill_sentinel(d.lse);
  d.run();
  EXPECT_EQ(d.o.byte_vector(), o.byte_vector());
  EXPECT_EQ(d.lse.byte_vector(), lse.byte_vector());

  // On the CPU 16 bytes are asked for: the steps' float and int32 views are carved from it. The
  // message gives the address.
  d.params.workspace = at + 4;
  char address[32];
  std::snprintf(address, sizeof address, "%p", static_cast<void*>(at + 4));
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_prefill", "workspace",
                           std::string("an address not 16-byte aligned (") + address + ")"));

  d.params.workspace = at;
  d.params.cache.device = Device::cuda();
  EXPECT_TRUE(throws_error([&] { dsa_prefill_steps(d.params, d.plan); }, "dsa_prefill", "workspace",
                           "not 256-byte aligned"));
}

TEST(DsaPrefillBadInput, IndexerPageSizeUnlikeTheMainCache) {
  HostDsaPrefill d = small_case();
  // The same indexer bytes described as pages of 2 tokens: one block table cannot serve both.
  d.params.indexer.page_size = 2;
  d.params.indexer.num_pages *= 2;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_prefill", "indexer", "page_size 2"));
  EXPECT_TRUE(throws_error([&] { plan_dsa_prefill(same_backend(reference_backend()), d.params, reference_device()); },
                           "dsa_prefill", "indexer", "page_size 2"));
  EXPECT_TRUE(d.untouched());
}

TEST(DsaPrefillBadInput, IndexerPoolUnlikeTheMainCache) {
  HostDsaPrefill d = small_case();
  const std::string pages = std::to_string(d.f.num_pages() - 1) + " pages";
  d.params.indexer.num_pages -= 1;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_prefill", "indexer", pages));
  EXPECT_TRUE(throws_error([&] { plan_dsa_prefill(same_backend(reference_backend()), d.params, reference_device()); },
                           "dsa_prefill", "indexer", pages));
  EXPECT_TRUE(d.untouched());
}

TEST(DsaPrefillBadInput, TopkOutsideOneTo2048) {
  HostDsaPrefill d = small_case();
  for (int topk : {0, kMaxTopk + 1}) {
    d.params.topk = topk;
    EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_prefill", "topk", std::to_string(topk)));
    EXPECT_TRUE(throws_error([&] { plan_dsa_prefill(same_backend(reference_backend()), d.params, reference_device()); },
                             "dsa_prefill", "topk", std::to_string(topk)));
    EXPECT_TRUE(throws_error([&] { dsa_prefill_steps(d.params, d.plan); }, "dsa_prefill", "topk", std::to_string(topk)));
    EXPECT_TRUE(d.untouched());
  }
}

// A block table of more than 2^30 tokens (max_pages x page_size) is refused under the call's name
// when the call is planned, as dsa_decode refuses it: not planned as a chunk's logits of gigabytes
// that the indexer step then refuses. The view only describes the pages; nothing reads them.
TEST(DsaPrefillBadInput, BlockTablePastTheLimit) {
  HostDsaPrefill d = small_case();
  const DsaPrefillParams good = d.params;
  const std::int64_t batch = good.block_table.size(0);
  const std::int64_t pages = kMaxTableTokens / d.f.page_size + 1;
  d.params.block_table = TensorView::contiguous(good.block_table.data, DType::kI32, {batch, pages});
  EXPECT_TRUE(throws_error([&] { plan_dsa_prefill(same_backend(reference_backend()), d.params, reference_device()); },
                           "dsa_prefill", "block_table", std::to_string(pages)));
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_prefill", "block_table", std::to_string(pages)));
  EXPECT_TRUE(d.untouched());
}

// cu_new_tokens ending at 6 of T = 7 rows fails in the indexer step (dsa.hpp: the error names the
// step), before anything reaches the workspace, o or lse.
TEST(DsaPrefillBadInput, NewTokensNotEndingAtTFailInTheIndexerStep) {
  HostDsaPrefill d = small_case();
  ASSERT_EQ(d.cu, (std::vector<std::int32_t>{0, 4, 6, 7}));
  d.cu[3] = 6;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "indexer_prefill", "cu_new_tokens[3]", "6"));
  EXPECT_TRUE(d.untouched());
}

// A NaN query of the attention fails in the sparse step, after the indexer wrote the index rows:
// the error names sparse_mla_prefill, and o and lse keep their sentinels.
TEST(DsaPrefillBadInput, NanQueryFailsInTheSparseStep) {
  HostDsaPrefill d = small_case();
  const std::int64_t element = 2 * 4 * kQkDim + 300;  // row 2, head 0
  d.q.data<std::uint16_t>()[element] = kPoisonBf16;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "sparse_mla_prefill", "q element " + std::to_string(element), "nan"));
  EXPECT_TRUE(d.outputs_untouched());
}

// ---- the layout of planned scratch -------------------------------------------------------------

// The reference plans no scratch. These plans give both steps some, and the indexer a chunk, for
// PlannedReference to run the reference's kernels with.
std::map<Op, Plan> prefill_plans(std::size_t indexer_bytes, std::size_t sparse_bytes, int chunk_tokens = 7) {
  Plan indexer, sparse;
  indexer.workspace_bytes = indexer_bytes;
  indexer.chunk_tokens = chunk_tokens;
  sparse.workspace_bytes = sparse_bytes;
  sparse.num_splits = 2;
  return {{Op::kIndexerPrefill, indexer}, {Op::kSparseMlaPrefill, sparse}};
}

// The index rows, then one scratch region that the steps take in turn (dsa.hpp): the larger plan's.
// Both scratches lie at an aligned offset inside the planned workspace, apart from the index rows.
TEST(DsaPrefillLayout, IndexRowsThenTheLargerStepsScratch) {
  HostDsaPrefill d = small_case();
  const std::size_t rows = static_cast<std::size_t>(d.cu.back()) * 3 * sizeof(std::int32_t);
  const std::size_t aligned_rows = (rows + kDsaWorkspaceAlign - 1) / kDsaWorkspaceAlign * kDsaWorkspaceAlign;
  for (const auto& [indexer_bytes, sparse_bytes] : {std::pair<std::size_t, std::size_t>{300, 200}, {200, 300}}) {
    SCOPED_TRACE("indexer scratch " + std::to_string(indexer_bytes) + ", sparse " + std::to_string(sparse_bytes));
    const PlannedReference planned(prefill_plans(indexer_bytes, sparse_bytes));
    d.replan(same_backend(planned));
    EXPECT_GE(d.plan.workspace_bytes, aligned_rows + std::max(indexer_bytes, sparse_bytes));
    const DsaPrefillSteps s = dsa_prefill_steps(d.params, d.plan);
    EXPECT_EQ(s.indexer.workspace_bytes, indexer_bytes);
    EXPECT_EQ(s.sparse.workspace_bytes, sparse_bytes);
    EXPECT_EQ(s.sparse.num_splits, 2);
    const void* base = d.workspace.data();
    const WorkspaceRange slots = range_in(base, "slots", s.indexer.slots.data, rows);
    const WorkspaceRange indexer = range_in(base, "indexer scratch", s.indexer.workspace, s.indexer.workspace_bytes);
    const WorkspaceRange sparse = range_in(base, "sparse scratch", s.sparse.workspace, s.sparse.workspace_bytes);
    EXPECT_TRUE(inside_and_aligned({slots, indexer, sparse}, d.plan.workspace_bytes, kDsaWorkspaceAlign));
    EXPECT_TRUE(disjoint({slots, indexer}));
    EXPECT_TRUE(disjoint({slots, sparse}));
  }
}

// The indexer step works in the plan's chunks (the backend plans them from the caller's
// chunk_tokens); a plan without one leaves the caller's.
TEST(DsaPrefillLayout, IndexerChunkFromThePlan) {
  HostDsaPrefill d = small_case();
  ASSERT_EQ(d.params.chunk_tokens, 0);
  const PlannedReference chunks_of_7(prefill_plans(300, 200));
  d.replan(same_backend(chunks_of_7));
  EXPECT_EQ(d.plan.indexer.chunk_tokens, 7);
  EXPECT_EQ(dsa_prefill_steps(d.params, d.plan).indexer.chunk_tokens, 7);

  const PlannedReference no_chunk(prefill_plans(300, 200, 0));
  d.params.chunk_tokens = 5;
  d.replan(same_backend(no_chunk));
  EXPECT_EQ(dsa_prefill_steps(d.params, d.plan).indexer.chunk_tokens, 5);
}

// A negative chunk is refused by the call itself, whatever chunk the plan holds (a backend's plan
// may give its default chunk for it, which would otherwise stand in for the caller's value).
TEST(DsaPrefillBadInput, NegativeChunkTokens) {
  HostDsaPrefill d = small_case();
  const PlannedReference chunks_of_7(prefill_plans(300, 200));
  d.replan(same_backend(chunks_of_7));
  d.params.chunk_tokens = -5;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_prefill", "chunk_tokens", "-5"));
  EXPECT_TRUE(throws_error([&] { dsa_prefill_steps(d.params, d.plan); }, "dsa_prefill", "chunk_tokens", "-5"));
  EXPECT_TRUE(throws_error([&] { plan_dsa_prefill(same_backend(chunks_of_7), d.params, reference_device()); },
                           "dsa_prefill", "chunk_tokens", "-5"));
  EXPECT_TRUE(d.untouched());
}

// The call runs with that layout as the reference does by hand; it writes only the index rows of
// the workspace (the reference's kernels use no scratch), the rest keeps its garbage.
TEST(DsaPrefillLayout, RunsAsTheStepsByHandWritingOnlyTheIndexRows) {
  HostDsaPrefill d = small_case();
  const PlannedReference planned(prefill_plans(300, 200));
  d.replan(same_backend(planned));
  dsa_prefill(same_backend(planned), d.params, d.plan, {}, reference_device());

  const HostTensor slots = reference_indexer_prefill(d.f, d.q_idx, d.weights, d.cu, 3);
  const AttentionOutputs want = reference_sparse_prefill(d.f, d.q, slots, kScale, DType::kBF16, DType::kF32);
  EXPECT_EQ(copy_of(dsa_prefill_steps(d.params, d.plan).indexer.slots).byte_vector(), slots.byte_vector());
  EXPECT_TRUE(compare("o", d.o, want.o, Tolerance::exact()));
  EXPECT_TRUE(compare("lse", d.lse, want.lse, Tolerance::exact()));
  const std::size_t rows = slots.bytes();
  for (std::size_t i = rows; i < d.workspace.size(); ++i) {
    ASSERT_EQ(d.workspace[i], kWorkspaceGarbage) << "workspace byte " << i;
  }
}

}  // namespace
}  // namespace latentkv::testing
