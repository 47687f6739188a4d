// dsa_decode on the reference backend (host memory, the workspace sized by plan_dsa_decode): it is
// the reference indexer_logits -> topk -> sparse_mla_decode run by hand, with the intermediates
// left in the caller's workspace where dsa_steps says; with topk >= every length it is dense
// decode; and a rejected call names dsa_decode and the argument and writes nothing.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <ostream>
#include <sstream>
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
#include "support/paged_fixture.hpp"
#include "support/planned_reference.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

constexpr float kScale = 0.0625f;
constexpr std::uint8_t kWorkspaceGarbage = 0xA5;

// The CPU, named: the calls below select for it as the calls that name no device do for host memory
// (DsaDecodeDevice checks the two alike).
const DeviceInfo kCpu{};

const Backend& reference() { return *find_backend("reference"); }

// One dsa_decode call over host memory: a fixture with both caches, random inputs, sentinel o and
// lse (bf16 / f32 as on the GPU unless asked otherwise), and a garbage-filled planned workspace.
struct HostDsa {
  Rng rng;
  PagedFixture f;
  HostTensor q, q_idx, weights, o, lse;
  DsaDecodeParams params;
  DsaPlan plan;
  std::vector<std::uint8_t> workspace;

  HostDsa(Rng r, int page_size, std::vector<std::int64_t> lengths, int q_len, int heads, int indexer_heads, int topk,
          int max_len = 0, DType o_dtype = DType::kBF16, DType lse_dtype = DType::kF32)
      : rng(r),
        f(make_paged_fixture(options(page_size, std::move(lengths)), rng)),
        q(random_bf16(rng, {f.batch(), q_len, heads, kQkDim})),
        q_idx(random_fp8(rng, {f.batch(), q_len, indexer_heads, kIndexerDim})),
        weights(random_f32(rng, {f.batch(), q_len, indexer_heads}, -1.0, 1.0)),
        o(sentinel_tensor(o_dtype, {f.batch(), q_len, heads, kLatentDim})),
        lse(sentinel_tensor(lse_dtype, {f.batch(), q_len, heads})) {
    params = dsa_decode_args(f, q, q_idx, weights, o, lse, kScale, topk, max_len);
    plan = plan_dsa_decode(same_backend(reference()), params, kCpu);
    workspace.assign(plan.workspace_bytes, kWorkspaceGarbage);
    params.workspace = workspace.data();
    params.workspace_bytes = workspace.size();
  }

  static PagedFixtureOptions options(int page_size, std::vector<std::int64_t> lengths) {
    PagedFixtureOptions o;
    o.page_size = page_size;
    o.lengths = std::move(lengths);
    return o;
  }

  void run() { dsa_decode(same_backend(reference()), params, plan, {}, kCpu); }

  // Planned again by `backends`, with a garbage-filled workspace of that plan's size.
  void replan(const DsaBackends& backends) {
    plan = plan_dsa_decode(backends, params, kCpu);
    workspace.assign(plan.workspace_bytes, kWorkspaceGarbage);
    params.workspace = workspace.data();
    params.workspace_bytes = workspace.size();
  }

  ::testing::AssertionResult untouched() const {
    if (!is_sentinel(o)) return ::testing::AssertionFailure() << "o was written";
    if (!is_sentinel(lse)) return ::testing::AssertionFailure() << "lse was written";
    for (std::uint8_t byte : workspace) {
      if (byte != kWorkspaceGarbage) return ::testing::AssertionFailure() << "the workspace was written";
    }
    return ::testing::AssertionSuccess();
  }
};

// ---- the three steps by hand -----------------------------------------------------------------------

struct StepsCase {
  int page_size;
  int q_len;
  int heads;
  int indexer_heads;
  int topk;
  int max_len;  // 0: the block table's capacity
  std::vector<std::int64_t> lengths;
};

std::ostream& operator<<(std::ostream& os, const StepsCase& c) {
  return os << "ps" << c.page_size << "_q" << c.q_len << "_H" << c.heads << "_Hi" << c.indexer_heads << "_k" << c.topk
            << "_maxlen" << c.max_len;
}

class DsaDecode : public ::testing::TestWithParam<StepsCase> {};

TEST_P(DsaDecode, EqualsTheStepsByHand) {
  const StepsCase& c = GetParam();
  HostDsa d(test_rng(), c.page_size, c.lengths, c.q_len, c.heads, c.indexer_heads, c.topk, c.max_len);
  d.run();

  const std::int64_t columns = c.max_len > 0 ? c.max_len : std::int64_t{d.f.max_pages} * d.f.page_size;
  const HostTensor logits = reference_indexer_logits(d.f, d.q_idx, d.weights, columns);
  const HostTensor slots = reference_topk(d.f, logits, c.topk);
  const AttentionOutputs want = reference_sparse_decode(d.f, d.q, slots, kScale, DType::kBF16, DType::kF32);

  const DsaSteps steps = dsa_steps(d.params, d.plan);
  EXPECT_FALSE(d.plan.topk_cleared_by_indexer) << "the reference top-k keeps no state to clear";
  EXPECT_EQ(steps.indexer.clear_bytes, 0u);
  EXPECT_TRUE(compare("workspace logits", copy_of(steps.indexer.logits), logits, Tolerance::exact()));
  EXPECT_EQ(copy_of(steps.topk.slots).byte_vector(), slots.byte_vector()) << "workspace slots";
  EXPECT_TRUE(compare("o", d.o, want.o, Tolerance::exact()));
  EXPECT_TRUE(compare("lse", d.lse, want.lse, Tolerance::exact()));
}

INSTANTIATE_TEST_SUITE_P(Cases, DsaDecode,
                         ::testing::Values(StepsCase{16, 1, 8, 4, 64, 0, {0, 1, 15, 17, 100, 301}},
                                           StepsCase{3, 2, 4, 8, 7, 0, {1, 2, 3, 4, 40}},
                                           StepsCase{1, 4, 2, 2, 2048, 0, {4, 5, 90}},
                                           StepsCase{64, 3, 16, 64, 100, 333, {3, 64, 65, 250}},
                                           StepsCase{17, 1, 128, 1, 1, 0, {0, 2, 35}}),
                         [](const ::testing::TestParamInfo<StepsCase>& info) {
                           std::ostringstream os;
                           os << info.param;
                           return os.str();
                         });

// With topk >= every length, each row selects everything it sees: sparse attention equals dense.
TEST(DsaDecodeDense, TopkCoveringEveryTokenEqualsDense) {
  for (int q_len : {1, 2, 4}) {
    HostDsa d(test_rng("q_len " + std::to_string(q_len)), 16, {0, 1, 15, 17, 120}, q_len, 4, 4, 120, 0, DType::kF64,
              DType::kF64);
    d.run();
    const AttentionOutputs dense = reference_mla_decode(d.f, d.q, kScale);
    // Another order of the same float64 sums.
    EXPECT_TRUE(compare("o q_len " + std::to_string(q_len), d.o, dense.o, Tolerance::float64(1e-12)));
    EXPECT_TRUE(compare("lse q_len " + std::to_string(q_len), d.lse, dense.lse, Tolerance::float64(1e-12)));
  }
}

// Planned and run without a device, the call selects for its cache's memory, the CPU here (also
// where a GPU is, as the CPU tests run in scripts/gpu_run.sh): the same plan and the same bytes.
TEST(DsaDecodeDevice, WithoutADeviceRunsWhereTheCacheIs) {
  HostDsa named(test_rng(), 16, {0, 5, 40}, 2, 4, 4, 16), unnamed(test_rng(), 16, {0, 5, 40}, 2, 4, 4, 16);
  const DsaBackends backends = same_backend(reference());
  const DsaPlan plan = plan_dsa_decode(backends, unnamed.params);
  EXPECT_EQ(plan.workspace_bytes, named.plan.workspace_bytes);
  EXPECT_EQ(plan.sparse.num_splits, named.plan.sparse.num_splits);
  named.run();
  dsa_decode(backends, unnamed.params, plan);
  ASSERT_FALSE(is_sentinel(unnamed.o));
  EXPECT_EQ(std::memcmp(unnamed.o.raw(), named.o.raw(), named.o.bytes()), 0);
  EXPECT_EQ(std::memcmp(unnamed.lse.raw(), named.lse.raw(), named.lse.bytes()), 0);
}

// A plan is made only for a device every step's backend runs on: planned for the CPU (named, or
// chosen by the cache's memory) a backend that runs only on a GPU is refused by its step's name, and
// the reference is refused a GPU, where it would otherwise have planned without a word. The calls
// refuse alike, writing nothing.
TEST(DsaDecodeDevice, APlanIsMadeOnlyForADeviceItsBackendsRun) {
  HostDsa d = HostDsa(test_rng(), 4, {9, 3, 0}, 2, 4, 4, 8);
  const GpuOnly gpu_only;
  const std::string chosen = "; a call that names no device runs where its cache.device is (cpu)";
  const std::string indexer = "indexer_logits: backend 'gpu_only' cannot run this call: needs a GPU (device is cpu)";
  EXPECT_EQ(error_of([&] { plan_dsa_decode(same_backend(gpu_only), d.params); }), indexer + chosen);
  EXPECT_EQ(error_of([&] { plan_dsa_decode(same_backend(gpu_only), d.params, kCpu); }), indexer);
  DsaBackends last_on_gpu = same_backend(reference());
  last_on_gpu.sparse_decode = &gpu_only;
  EXPECT_EQ(error_of([&] { plan_dsa_decode(last_on_gpu, d.params); }),
            "sparse_mla_decode: backend 'gpu_only' cannot run this call: needs a GPU (device is cpu)" + chosen);
  EXPECT_EQ(error_of([&] { plan_dsa_decode(same_backend(reference()), d.params, test_gpu()); }),
            "indexer_logits: backend 'reference' cannot run this call: runs on the CPU only (device is test gpu)");
  EXPECT_EQ(error_of([&] { dsa_decode(last_on_gpu, d.params, d.plan); }),
            "sparse_mla_decode: backend 'gpu_only' cannot run this call: needs a GPU (device is cpu)" + chosen);
  EXPECT_TRUE(d.untouched());
}

// ---- rejected inputs ---------------------------------------------------------------------------

HostDsa small_case() { return HostDsa(test_rng(), 4, {9, 3, 0}, 2, 4, 4, 8); }

TEST(DsaDecodeBadInput, NullBackend) {
  HostDsa d = small_case();
  DsaBackends backends = same_backend(reference());
  backends.indexer_logits = nullptr;
  EXPECT_TRUE(throws_error([&] { dsa_decode(backends, d.params, d.plan, {}, kCpu); }, "dsa_decode",
                           "backends.indexer_logits", "null"));
  EXPECT_TRUE(throws_error([&] { plan_dsa_decode(backends, d.params, kCpu); }, "dsa_decode", "backends.indexer_logits",
                           "null"));
  backends = same_backend(reference());
  backends.topk = nullptr;
  EXPECT_TRUE(throws_error([&] { dsa_decode(backends, d.params, d.plan, {}, kCpu); }, "dsa_decode", "backends.topk", "null"));
  backends = same_backend(reference());
  backends.sparse_decode = nullptr;
  EXPECT_TRUE(throws_error([&] { dsa_decode(backends, d.params, d.plan, {}, kCpu); }, "dsa_decode",
                           "backends.sparse_decode", "null"));
  EXPECT_TRUE(d.untouched());
}

TEST(DsaDecodeBadInput, WorkspaceTooSmall) {
  HostDsa d = small_case();
  ASSERT_GT(d.plan.workspace_bytes, 0u);
  d.params.workspace_bytes = d.plan.workspace_bytes - 1;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "workspace_bytes", std::to_string(d.plan.workspace_bytes - 1)));
  EXPECT_TRUE(throws_error([&] { dsa_steps(d.params, d.plan); }, "dsa_decode", "workspace_bytes",
                           std::to_string(d.plan.workspace_bytes - 1)));
  EXPECT_TRUE(d.untouched());

  d.params.workspace_bytes = d.plan.workspace_bytes;  // the case itself is valid
  EXPECT_NO_THROW(d.run());
  EXPECT_FALSE(d.untouched());
}

// Whether `call` threw dsa_decode's Error for the workspace, naming `other` as what it overlaps.
template <typename F>
::testing::AssertionResult workspace_overlaps(F&& call, const std::string& other) {
  const std::string what = error_of(call);
  if (what.find("dsa_decode: argument 'workspace'") != 0 ||
      what.find("apart from " + other + " (") == std::string::npos) {
    return ::testing::AssertionFailure() << "threw \"" << what << "\"";
  }
  return ::testing::AssertionSuccess() << what;
}

// The steps' views lie in the workspace, so the caller's arguments must lie outside it. lse over the
// logits' bytes, or the weights over the top-k's slots, is seen by no step's own check (the indexer
// does not see lse, nor the top-k the weights): the call refuses it before any step runs, and so do
// the steps run one by one.
TEST(DsaDecodeBadInput, ArgumentsInsideTheWorkspace) {
  HostDsa d = small_case();
  const DsaSteps steps = dsa_steps(d.params, d.plan);
  ASSERT_GE(static_cast<std::size_t>(steps.indexer.logits.numel()) * 4, d.lse.bytes());
  ASSERT_GE(static_cast<std::size_t>(steps.topk.slots.numel()) * 4, d.weights.bytes());
  DsaDecodeParams good = d.params;

  d.params.lse.data = d.workspace.data();
  EXPECT_TRUE(workspace_overlaps([&] { d.run(); }, "lse"));
  EXPECT_TRUE(workspace_overlaps([&] { dsa_steps(d.params, d.plan); }, "lse"));
  EXPECT_TRUE(d.untouched());

  d.params = good;
  d.params.weights.data = steps.topk.slots.data;
  EXPECT_TRUE(workspace_overlaps([&] { d.run(); }, "weights"));
  EXPECT_TRUE(d.untouched());

  // Arguments a step does see are named as the caller passed them too, not as the step's own view
  // they meet there (the indexer's logits, the top-k's slots, the sparse step's indices).
  d.params = good;
  d.params.q_idx.data = steps.indexer.logits.data;
  EXPECT_TRUE(workspace_overlaps([&] { d.run(); }, "q_idx"));
  d.params = good;
  d.params.block_table.data = steps.topk.slots.data;
  EXPECT_TRUE(workspace_overlaps([&] { dsa_steps(d.params, d.plan); }, "block_table"));
  d.params = good;
  d.params.o.data = steps.topk.slots.data;
  EXPECT_TRUE(workspace_overlaps([&] { d.run(); }, "o"));
  EXPECT_TRUE(d.untouched());
}

TEST(DsaDecodeBadInput, IndexerPageSizeUnlikeTheMainCache) {
  HostDsa d = small_case();
  // The same indexer bytes described as pages of 2 tokens: one block table cannot serve both.
  d.params.indexer.page_size = 2;
  d.params.indexer.num_pages *= 2;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "indexer", "page_size 2"));
  EXPECT_TRUE(throws_error([&] { plan_dsa_decode(same_backend(reference()), d.params, kCpu); }, "dsa_decode", "indexer",
                           "page_size 2"));
  EXPECT_TRUE(d.untouched());
}

TEST(DsaDecodeBadInput, TopkOutsideOneTo2048) {
  HostDsa d = small_case();
  for (int topk : {0, kMaxTopk + 1}) {
    d.params.topk = topk;
    EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "topk", std::to_string(topk)));
    EXPECT_TRUE(throws_error([&] { plan_dsa_decode(same_backend(reference()), d.params, kCpu); }, "dsa_decode", "topk",
                             std::to_string(topk)));
    EXPECT_TRUE(d.untouched());
  }
}

// q_idx is the indexer step's q: its dtype and indexer heads are refused under the caller's name,
// by the call and by its planning alike.
TEST(DsaDecodeBadInput, IndexerQueriesNamedAsTheCallerGaveThem) {
  HostDsa d = small_case();
  const TensorView given = d.q_idx.view();
  const std::int64_t b = given.size(0), q_len = given.size(1), hi = given.size(2);
  const TensorView bytes = TensorView::contiguous(given.data, DType::kU8, {b, q_len, hi, kIndexerDim});
  const TensorView no_heads = TensorView::contiguous(given.data, DType::kFP8E4M3, {b, q_len, 0, kIndexerDim});
  HostTensor wide = random_fp8(d.rng, {b, q_len, kMaxIndexerHeads + 1, kIndexerDim});
  const std::vector<std::pair<TensorView, std::pair<std::string, std::string>>> cases = {
      {bytes, {"q_idx", "u8 " + bytes.shape_string()}},
      {no_heads, {"q_idx.shape[2] (indexer heads)", "0"}},
      {wide.view(), {"q_idx.shape[2] (indexer heads)", "65"}},
  };
  for (const auto& [q_idx, named] : cases) {
    d.params.q_idx = q_idx;
    EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", named.first, named.second));
    EXPECT_TRUE(throws_error([&] { plan_dsa_decode(same_backend(reference()), d.params, kCpu); }, "dsa_decode",
                             named.first, named.second));
    EXPECT_TRUE(d.untouched());
  }
}

// What only the indexer step checks of q_idx and the indexer cache (null data, strides, the
// device, the pool's memory) is named as the caller gave it too, under the call's name; a q of
// another dtype is refused as q before the workspace is checked apart from it (its bytes counted
// by its dtype), and so are weights; a q on another device than the main cache, where the call
// runs, is refused as q against the cache's device.
TEST(DsaDecodeBadInput, ArgumentsTheStepsCheckNamedAsTheCallerGaveThem) {
  HostDsa d = small_case();
  const DsaDecodeParams good = d.params;
  const auto refused = [&](const char* op, const char* argument, const std::string& value) {
    const ::testing::AssertionResult run = throws_error([&] { d.run(); }, op, argument, value);
    const ::testing::AssertionResult steps = throws_error([&] { dsa_steps(d.params, d.plan); }, op, argument, value);
    d.params = good;
    return run && steps && d.untouched();
  };
  d.params.q_idx.data = nullptr;
  EXPECT_TRUE(refused("dsa_decode", "q_idx", "absent"));
  d.params.q_idx.strides[0] = 1;
  EXPECT_TRUE(refused("dsa_decode", "q_idx", "(strided)"));
  d.params.q_idx.device = Device::cuda(0);
  EXPECT_TRUE(refused("dsa_decode", "q_idx", "on cuda:0"));
  d.params.indexer.data = nullptr;
  EXPECT_TRUE(refused("dsa_decode", "indexer.data", "null"));
  d.params.indexer.device = Device::cuda(0);
  EXPECT_TRUE(refused("dsa_decode", "indexer.device", "cuda:0"));
  d.params.q.dtype = DType::kF32;
  EXPECT_TRUE(refused("dsa_decode", "q", "f32"));
  d.params.weights.dtype = DType::kF64;
  EXPECT_TRUE(refused("dsa_decode", "weights", "f64"));
  d.params.q.device = Device::cuda(1);
  const std::string message = error_of([&] { d.run(); });
  EXPECT_NE(message.find("on cuda:1: expected bf16 [B, q_len, H, 576] on cpu"), std::string::npos) << message;
  EXPECT_TRUE(refused("sparse_mla_decode", "q", "on cuda:1"));
}

// q without heads (or with more than 128) is refused by the plan as by the call: a GPU plan counts
// the rows of H it schedules (and divided by them).
TEST(DsaDecodeBadInput, QueriesWithoutHeads) {
  HostDsa d = small_case();
  const TensorView given = d.q.view();
  for (const std::int64_t heads : {std::int64_t{0}, std::int64_t{kMaxHeads + 1}}) {
    d.params.q = TensorView::contiguous(given.data, DType::kBF16, {given.size(0), given.size(1), heads, kQkDim});
    EXPECT_TRUE(throws_error([&] { plan_dsa_decode(same_backend(reference()), d.params, kCpu); }, "dsa_decode",
                             "q.shape[2] (heads)", std::to_string(heads)));
    EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "q.shape[2] (heads)", std::to_string(heads)));
    EXPECT_TRUE(d.untouched());
  }
  DsaPrefillParams p;
  p.q = TensorView::contiguous(given.data, DType::kBF16, {1, 0, kQkDim});
  p.q_idx = TensorView::contiguous(d.params.q_idx.data, DType::kFP8E4M3, {1, 1, kIndexerDim});
  p.weights = TensorView::contiguous(d.params.weights.data, DType::kF32, {1, 1});
  p.cache = d.params.cache;
  p.indexer = d.params.indexer;
  EXPECT_TRUE(throws_error([&] { plan_dsa_prefill(same_backend(reference()), p, kCpu); }, "dsa_prefill",
                           "q.shape[1] (heads)", "0"));
  // So is a page size below one token, under dsa_prefill's name rather than a step's.
  p.q = TensorView::contiguous(given.data, DType::kBF16, {1, given.size(2), kQkDim});
  p.cache.page_size = 0;
  p.indexer.page_size = 0;
  EXPECT_TRUE(throws_error([&] { plan_dsa_prefill(same_backend(reference()), p, kCpu); }, "dsa_prefill",
                           "cache.page_size", "0"));
}

// Arguments whose batch or q_len disagree with q are named as the caller passed them, not as the
// workspace views of a later step.
TEST(DsaDecodeBadInput, BatchUnlikeTheQueries) {
  HostDsa d = small_case();
  HostTensor q_idx = random_fp8(d.rng, {d.f.batch() + 1, 1, 4, kIndexerDim});
  d.params.q_idx = q_idx.view();
  EXPECT_TRUE(
      throws_error([&] { d.run(); }, "dsa_decode", "q_idx", "[" + std::to_string(d.f.batch() + 1) + ", 1, 4, 128]"));
  d.params.q_idx = d.q_idx.view();
  HostTensor weights = random_f32(d.rng, {d.f.batch(), 3, 4}, -1.0, 1.0);
  d.params.weights = weights.view();
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "weights", "[" + std::to_string(d.f.batch()) + ", 3, 4]"));
  d.params.weights = d.weights.view();
  std::vector<std::int32_t> lens(static_cast<std::size_t>(d.f.batch() - 1), 1);
  d.params.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {d.f.batch() - 1});
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "seq_lens", "[" + std::to_string(d.f.batch() - 1) + "]"));
  EXPECT_TRUE(d.untouched());
}

// A sparse-step backend that refuses the call: found before the indexer and top-k steps run (their
// logits and slots stay the workspace's garbage), not after they are queued.
class RefusesSparse final : public Backend {
 public:
  std::string_view name() const override { return "refuses_sparse"; }
  std::string_view description() const override { return "test-only: no sparse decode"; }
  int preference() const override { return 0; }
  Selection select(const Problem&) const override { return Selection::no("no sparse decode here"); }
};

TEST(DsaDecodeBadInput, AStepsBackendRefusesBeforeAnyStepRuns) {
  HostDsa d = small_case();
  const RefusesSparse refuses;
  DsaBackends backends = same_backend(reference());
  backends.sparse_decode = &refuses;
  EXPECT_EQ(error_of([&] { dsa_decode(backends, d.params, d.plan, {}, kCpu); }),
            "sparse_mla_decode: backend 'refuses_sparse' cannot run this call: no sparse decode here");
  EXPECT_TRUE(std::all_of(d.workspace.begin(), d.workspace.end(), [](std::uint8_t b) { return b == kWorkspaceGarbage; }));
  EXPECT_TRUE(d.untouched());
}

// The sparse step's kernel accepts the call's shapes but its own checks refuse it (Kernel::check,
// as the cuda kernels refuse a misaligned o): refused before the indexer and top-k steps are queued.
TEST(DsaDecodeBadInput, AStepsKernelChecksRefuseBeforeAnyStepRuns) {
  HostDsa d = small_case();
  const ChecksRefuse refuses;
  DsaBackends backends = same_backend(reference());
  backends.sparse_decode = &refuses;
  EXPECT_TRUE(throws_error([&] { dsa_decode(backends, d.params, d.plan, {}, kCpu); }, "sparse_mla_decode", "o",
                           "not 8-byte aligned"));
  EXPECT_TRUE(d.untouched());
}

TEST(DsaDecodeBadInput, NegativeMaxLen) {
  HostDsa d = small_case();
  d.params.max_len = -1;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "max_len", "-1"));
  EXPECT_TRUE(d.untouched());
}

// The logits' columns (max_len, or with max_len 0 the block table's capacity) are at most
// kMaxLogitsColumns, as the indexer and top-k take them: refused by name when the call is planned,
// not planned as a workspace of gigabytes that a step's view of it then fails.
TEST(DsaDecodeBadInput, LogitsColumnsPastTheLimit) {
  HostDsa d = small_case();
  const DsaDecodeParams good = d.params;
  for (int max_len : {static_cast<int>(kMaxLogitsColumns) + 1, std::numeric_limits<int>::max()}) {
    d.params.max_len = max_len;
    EXPECT_TRUE(throws_error([&] { plan_dsa_decode(same_backend(reference()), d.params, kCpu); }, "dsa_decode",
                             "max_len", std::to_string(max_len)));
    EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "max_len", std::to_string(max_len)));
  }
  // 2^30 + 4 tokens of pages: the view only describes them (nothing reads past the fixture's rows).
  d.params = good;
  const std::int64_t pages = kMaxLogitsColumns / d.f.page_size + 1;
  d.params.block_table = TensorView::contiguous(good.block_table.data, DType::kI32, {d.f.batch(), pages});
  EXPECT_TRUE(throws_error([&] { plan_dsa_decode(same_backend(reference()), d.params, kCpu); }, "dsa_decode",
                           "block_table", std::to_string(pages)));
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "block_table", std::to_string(pages)));
  EXPECT_TRUE(d.untouched());

  d.params = good;
  d.params.max_len = static_cast<int>(kMaxLogitsColumns);  // the limit itself is planned
  EXPECT_NO_THROW(plan_dsa_decode(same_backend(reference()), d.params, kCpu));
  // So is a table of exactly 2^30 tokens with max_len 0 (planning reads no page of it).
  d.params = good;
  d.params.block_table =
      TensorView::contiguous(good.block_table.data, DType::kI32, {d.f.batch(), kMaxLogitsColumns / d.f.page_size});
  EXPECT_NO_THROW(plan_dsa_decode(same_backend(reference()), d.params, kCpu));
}

// The workspace is counted from q's rows only after the shapes are checked: a q whose bytes do not
// fit 64 bits, or whose rows' logits and slots would not, is refused naming q, by the plan call too
// (not counted in wrapped arithmetic, nor then reported as a workspace_bytes too small).
TEST(DsaDecodeBadInput, ShapesTooLargeForAWorkspace) {
  HostDsa d = small_case();
  // The call's views over the fixture's memory with `b` x `q_len` rows; nothing reads their data.
  const auto with_rows = [&d](std::int64_t b, std::int64_t q_len, int max_len) {
    DsaDecodeParams p = d.params;
    p.q = TensorView::contiguous(d.params.q.data, DType::kBF16, {b, q_len, 2, kQkDim});
    p.q_idx = TensorView::contiguous(d.params.q_idx.data, DType::kFP8E4M3, {b, q_len, 1, kIndexerDim});
    p.weights = TensorView::contiguous(d.params.weights.data, DType::kF32, {b, q_len, 1});
    p.block_table = TensorView::contiguous(d.params.block_table.data, DType::kI32, {b, 1});
    p.seq_lens = TensorView::contiguous(d.params.seq_lens.data, DType::kI32, {b});
    p.max_len = max_len;
    return p;
  };
  const std::int64_t huge = std::int64_t{1} << 40;
  // q of 2^81 elements; then q of 2^51 bytes whose rows' logits take 2^72.
  for (const DsaDecodeParams& p : {with_rows(huge, huge, 0), with_rows(huge, 1, static_cast<int>(kMaxLogitsColumns))}) {
    EXPECT_TRUE(throws_error([&] { plan_dsa_decode(same_backend(reference()), p, kCpu); }, "dsa_decode", "q",
                             std::to_string(huge)));
    EXPECT_TRUE(throws_error([&] { dsa_decode(same_backend(reference()), p, d.plan, {}, kCpu); }, "dsa_decode", "q",
                             std::to_string(huge)));
  }
  // q of 2^62.2 bytes with 1 logits column: the rows fit only without their 2048 top-k slots.
  DsaDecodeParams wide = with_rows(std::int64_t{1} << 51, 1, 1);
  wide.topk = kMaxTopk;
  const std::string wide_refused = "dsa_decode: argument 'q' = [2251799813685248, 1, 2, 576]: expected rows whose f32 "
                                   "logits and i32 top-k slots (8196 bytes a row) fit 64 bits of workspace";
  EXPECT_EQ(error_of([&] { plan_dsa_decode(same_backend(reference()), wide, kCpu); }), wide_refused);
  EXPECT_EQ(error_of([&] { dsa_decode(same_backend(reference()), wide, d.plan, {}, kCpu); }), wide_refused);
  // A dtype outside DType has no size to count the bytes by: refused as such, before its rows are.
  DsaDecodeParams p = with_rows(huge, huge, 0);
  p.q.dtype = static_cast<DType>(9);
  EXPECT_TRUE(throws_error([&] { plan_dsa_decode(same_backend(reference()), p, kCpu); }, "dsa_decode", "q", "dtype 9"));
  EXPECT_TRUE(d.untouched());
}

// With topk_cleared_by_indexer the indexer step zeroes plan.topk.cleared_bytes of the top-k's
// scratch: a plan that clears more than that scratch is refused by name before any step runs, not
// cleared past it.
TEST(DsaDecodeBadInput, PlanClearingPastTheTopksScratch) {
  HostDsa d = small_case();
  d.plan.topk.workspace_bytes = 256;
  d.plan.topk.cleared_bytes = 512;
  d.plan.topk_cleared_by_indexer = true;
  // Room for the top-k's scratch and for what an unchecked clear would reach past it (it stays in
  // this vector, so that a call that clears shows as a written workspace).
  d.workspace.assign(d.plan.workspace_bytes + 1024, kWorkspaceGarbage);
  d.params.workspace = d.workspace.data();
  d.params.workspace_bytes = d.workspace.size();
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "plan.topk.cleared_bytes", "512"));
  EXPECT_TRUE(throws_error([&] { dsa_steps(d.params, d.plan); }, "dsa_decode", "plan.topk.cleared_bytes", "512"));
  EXPECT_TRUE(d.untouched());

  // Nothing to clear is no plan's word either: the top-k would count on scratch nobody zeroed.
  d.plan.topk.cleared_bytes = 0;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "plan.topk.cleared_bytes", "0"));
  EXPECT_TRUE(d.untouched());

  d.plan.topk.cleared_bytes = 256;  // all of its scratch
  EXPECT_EQ(dsa_steps(d.params, d.plan).indexer.clear_bytes, 256u);
}

// A plan whose scratch would wrap the layout's offsets (a hand-made one: the plan call never gives
// one) is refused before any offset is counted from it, not laid out into a small workspace.
TEST(DsaDecodeBadInput, PlanScratchPastTheLayout) {
  HostDsa d = small_case();
  d.plan.sparse.workspace_bytes = std::numeric_limits<std::size_t>::max() - 8;
  EXPECT_TRUE(throws_error([&] { d.run(); }, "dsa_decode", "plan.sparse.workspace_bytes",
                           std::to_string(d.plan.sparse.workspace_bytes)));
  EXPECT_TRUE(d.untouched());
}

// dsa_prefill counts its workspace (the index rows) from q's rows likewise.
TEST(DsaPrefillBadInput, ShapesTooLargeForAWorkspace) {
  HostDsa d = small_case();
  const auto with_rows = [&d](std::int64_t t, int topk) {
    DsaPrefillParams p;
    p.q = TensorView::contiguous(d.params.q.data, DType::kBF16, {t, 1, kQkDim});
    p.q_idx = TensorView::contiguous(d.params.q_idx.data, DType::kFP8E4M3, {t, 1, kIndexerDim});
    p.weights = TensorView::contiguous(d.params.weights.data, DType::kF32, {t, 1});
    p.cache = d.params.cache;
    p.indexer = d.params.indexer;
    p.topk = topk;
    return p;
  };
  // q of 2^70 bytes; then q of 2^62.2 bytes whose index rows take 2^65.
  const std::int64_t huge = std::int64_t{1} << 60, rows = std::int64_t{1} << 52;
  EXPECT_TRUE(throws_error([&] { plan_dsa_prefill(same_backend(reference()), with_rows(huge, 8), kCpu); },
                           "dsa_prefill", "q", std::to_string(huge)));
  EXPECT_TRUE(throws_error([&] { plan_dsa_prefill(same_backend(reference()), with_rows(rows, kMaxTopk), kCpu); },
                           "dsa_prefill", "q", std::to_string(rows)));
  // 3 x 2^49 rows of 2048 slots take 3 x 2^62 bytes (q itself 2^61.8).
  EXPECT_EQ(error_of([&] { plan_dsa_prefill(same_backend(reference()), with_rows(3 * (rows >> 3), kMaxTopk), kCpu); }),
            "dsa_prefill: argument 'q' = [1688849860263936, 1, 576]: expected rows whose i32 top-k slots (8192 bytes "
            "a row) fit 64 bits of workspace");
}

// A max_len below a request's length fails in the indexer step (dsa.hpp: the error names the step),
// before anything reaches o or lse.
TEST(DsaDecodeBadInput, MaxLenBelowALength) {
  HostDsa d(test_rng(), 4, {9, 3, 0}, 1, 4, 4, 8, 8);
  EXPECT_TRUE(throws_error([&] { d.run(); }, "indexer_logits", "seq_lens[0]", "9"));
  EXPECT_TRUE(is_sentinel(d.o));
  EXPECT_TRUE(is_sentinel(d.lse));
}

// ---- the layout of planned scratch -------------------------------------------------------------

// The reference plans no scratch. These plans give every step some (a top-k that can take its row
// state cleared, an indexer that can take its counters cleared), for PlannedReference to run the
// reference's kernels with.
std::map<Op, Plan> decode_plans(std::size_t topk_cleared_bytes = 512) {
  Plan indexer, topk, sparse;
  indexer.workspace_bytes = 100;
  indexer.cleared_bytes = 64;
  topk.workspace_bytes = 1000;
  topk.cleared_bytes = topk_cleared_bytes;
  sparse.workspace_bytes = 500;
  sparse.num_splits = 3;
  return {{Op::kIndexerLogits, indexer}, {Op::kTopk, topk}, {Op::kSparseMlaDecode, sparse}};
}

// The logits, the slots and each step's scratch as dsa_steps carves them out of d's workspace.
std::vector<WorkspaceRange> decode_ranges(const HostDsa& d, const DsaSteps& s) {
  const void* base = d.workspace.data();
  return {range_in(base, "logits", s.indexer.logits.data, static_cast<std::size_t>(s.indexer.logits.numel()) * 4),
          range_in(base, "slots", s.topk.slots.data, static_cast<std::size_t>(s.topk.slots.numel()) * 4),
          range_in(base, "indexer scratch", s.indexer.workspace, s.indexer.workspace_bytes),
          range_in(base, "top-k scratch", s.topk.workspace, s.topk.workspace_bytes),
          range_in(base, "sparse scratch", s.sparse.workspace, s.sparse.workspace_bytes)};
}

// Each step gets its plan's scratch, splits and clears, at an aligned offset inside the planned
// workspace, sharing no byte with the logits, the slots or another step's scratch.
TEST(DsaDecodeLayout, EveryStepsScratchInsideThePlanAndApart) {
  HostDsa d = small_case();
  const PlannedReference planned(decode_plans());
  d.replan(same_backend(planned));
  const DsaSteps s = dsa_steps(d.params, d.plan);
  EXPECT_EQ(s.indexer.workspace_bytes, 100u);
  EXPECT_EQ(s.topk.workspace_bytes, 1000u);
  EXPECT_EQ(s.sparse.workspace_bytes, 500u);
  EXPECT_EQ(s.sparse.num_splits, 3);
  const std::vector<WorkspaceRange> ranges = decode_ranges(d, s);
  EXPECT_TRUE(inside_and_aligned(ranges, d.plan.workspace_bytes, kDsaWorkspaceAlign));
  EXPECT_TRUE(disjoint(ranges));

  // One backend runs the indexer and the top-k: the indexer clears the top-k's row state for it.
  EXPECT_TRUE(d.plan.topk_cleared_by_indexer);
  EXPECT_EQ(s.indexer.clear, s.topk.workspace);
  EXPECT_EQ(s.indexer.clear_bytes, 512u);
  EXPECT_TRUE(s.topk.workspace_cleared);
}

// An indexer whose scratch grows with the batch (a counter per request, as on the GPU), otherwise
// the reference.
class PerRequestIndexer final : public Backend {
 public:
  std::string_view name() const override { return "per_request_indexer"; }
  std::string_view description() const override { return "test-only: the reference, 16 bytes of indexer scratch a request"; }
  int preference() const override { return 0; }
  Selection select(const Problem& problem) const override { return reference().select(problem); }
  Plan plan(const OpArgs& args, const DeviceInfo&) const override {
    Plan plan;
    if (const auto* indexer = std::get_if<IndexerLogitsParams>(&args)) {
      plan.workspace_bytes = plan.cleared_bytes = 16 * static_cast<std::size_t>(indexer->q.size(0));
    }
    return plan;
  }
};

// The indexer's scratch (the one piece kept from call to call) comes first in the workspace and is
// planned for the most requests a call takes, so that calls of any batch size, each under its own
// plan, find the counters at the same bytes and never write logits, slots or scratch over them.
TEST(DsaDecodeLayout, IndexerScratchComesFirstSizedForTheMostRequests) {
  const PerRequestIndexer backend;
  HostDsa three(test_rng(), 4, {9, 3, 5}, 1, 4, 4, 8), one(test_rng(), 4, {7}, 1, 4, 4, 8);
  const std::size_t counters = 16 * static_cast<std::size_t>(kMaxGpuRequests);
  for (HostDsa* d : {&three, &one}) {
    d->replan(same_backend(backend));
    EXPECT_EQ(d->plan.indexer.workspace_bytes, counters);
    const DsaSteps s = dsa_steps(d->params, d->plan);
    EXPECT_EQ(s.indexer.workspace, d->workspace.data());
    EXPECT_EQ(s.indexer.workspace_bytes, counters);
    std::vector<WorkspaceRange> ranges = decode_ranges(*d, s);
    ranges.erase(ranges.begin() + 2);  // the indexer's own
    for (const WorkspaceRange& r : ranges) {
      if (r.bytes > 0) EXPECT_GE(r.offset, counters) << r.name;  // (the top-k and the sparse step plan none)
    }
    EXPECT_TRUE(disjoint(decode_ranges(*d, s)));
    d->params.workspace_cleared = true;
    EXPECT_NO_THROW(dsa_decode(same_backend(backend), d->params, d->plan, {}, kCpu));
  }
}

// The indexer takes its counters cleared only when the caller says the workspace is, and only when
// its plan can take them so (cleared_bytes > 0).
TEST(DsaDecodeLayout, IndexerTakesItsCountersClearedOnlyWhenTheCallerSays) {
  HostDsa d = small_case();
  const PlannedReference planned(decode_plans());
  d.replan(same_backend(planned));
  d.params.workspace_cleared = false;
  EXPECT_FALSE(dsa_steps(d.params, d.plan).indexer.workspace_cleared);
  d.params.workspace_cleared = true;
  EXPECT_TRUE(dsa_steps(d.params, d.plan).indexer.workspace_cleared);
  d.plan.indexer.cleared_bytes = 0;
  EXPECT_FALSE(dsa_steps(d.params, d.plan).indexer.workspace_cleared);
}

// The indexer clears the top-k's row state only for a top-k of the same backend object, and only
// for one that takes it cleared (dsa.hpp); otherwise the top-k clears it itself.
TEST(DsaDecodeLayout, TopkClearedByTheIndexerOnlyWithOneBackendForBoth) {
  HostDsa d = small_case();
  const PlannedReference indexer(decode_plans()), topk(decode_plans());
  DsaBackends two = same_backend(indexer);
  two.topk = &topk;
  d.replan(two);
  EXPECT_FALSE(d.plan.topk_cleared_by_indexer);
  DsaSteps s = dsa_steps(d.params, d.plan);
  EXPECT_EQ(s.indexer.clear, nullptr);
  EXPECT_EQ(s.indexer.clear_bytes, 0u);
  EXPECT_FALSE(s.topk.workspace_cleared);
  EXPECT_NO_THROW(dsa_decode(two, d.params, d.plan, {}, kCpu));

  const PlannedReference clears_nothing(decode_plans(0));
  d.replan(same_backend(clears_nothing));
  EXPECT_FALSE(d.plan.topk_cleared_by_indexer);
  s = dsa_steps(d.params, d.plan);
  EXPECT_EQ(s.indexer.clear_bytes, 0u);
  EXPECT_FALSE(s.topk.workspace_cleared);

  d.replan(same_backend(indexer));
  EXPECT_TRUE(d.plan.topk_cleared_by_indexer);
}

// The call runs with that layout as the reference does by hand; the steps write only the logits,
// the slots and the cleared start of the top-k's scratch (the reference's kernels use no scratch),
// and the rest of the workspace keeps its garbage.
TEST(DsaDecodeLayout, RunsAsTheStepsByHandWritingOnlyItsViews) {
  HostDsa d = small_case();
  const PlannedReference planned(decode_plans());
  d.replan(same_backend(planned));
  dsa_decode(same_backend(planned), d.params, d.plan, {}, kCpu);

  const std::int64_t columns = std::int64_t{d.f.max_pages} * d.f.page_size;
  const HostTensor logits = reference_indexer_logits(d.f, d.q_idx, d.weights, columns);
  const HostTensor slots = reference_topk(d.f, logits, 8);
  const AttentionOutputs want = reference_sparse_decode(d.f, d.q, slots, kScale, DType::kBF16, DType::kF32);
  const DsaSteps s = dsa_steps(d.params, d.plan);
  EXPECT_TRUE(compare("workspace logits", copy_of(s.indexer.logits), logits, Tolerance::exact()));
  EXPECT_EQ(copy_of(s.topk.slots).byte_vector(), slots.byte_vector()) << "workspace slots";
  EXPECT_TRUE(compare("o", d.o, want.o, Tolerance::exact()));
  EXPECT_TRUE(compare("lse", d.lse, want.lse, Tolerance::exact()));

  const std::vector<WorkspaceRange> ranges = decode_ranges(d, s);
  const WorkspaceRange &logits_range = ranges[0], &slots_range = ranges[1], &topk_range = ranges[3];
  const auto in = [](const WorkspaceRange& r, std::size_t i) { return i >= r.offset && i - r.offset < r.bytes; };
  for (std::size_t i = 0; i < d.workspace.size(); ++i) {
    if (in(logits_range, i) || in(slots_range, i)) continue;
    const bool cleared = i >= topk_range.offset && i - topk_range.offset < d.plan.topk.cleared_bytes;
    ASSERT_EQ(d.workspace[i], cleared ? 0 : kWorkspaceGarbage) << "workspace byte " << i;
  }
}

}  // namespace
}  // namespace latentkv::testing
