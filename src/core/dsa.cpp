// One layer's DSA as one call (include/latentkv/dsa.hpp): decode (indexer logits -> top-k -> sparse
// MLA decode) and prefill (indexer prefill -> sparse MLA prefill), over one workspace each.
#include "latentkv/dsa.hpp"

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "core/selection.hpp"
#include "core/validate.hpp"
#include "core/workspace.hpp"
#include "latentkv/error.hpp"

namespace latentkv {
namespace {

constexpr std::string_view kOp = "dsa_decode";
using detail::align_up;
using detail::kWorkspaceAlign;

void check_backends(const DsaBackends& b) {
  if (b.indexer_logits == nullptr) throw Error(std::string(kOp), "backends.indexer_logits", "null", "a backend");
  if (b.topk == nullptr) throw Error(std::string(kOp), "backends.topk", "null", "a backend");
  if (b.sparse_decode == nullptr) throw Error(std::string(kOp), "backends.sparse_decode", "null", "a backend");
}

// The whole workspace of a DSA call, where its steps' views lie, and the fault record apart from
// the caller's arguments (a step's own check sees only its views; the caller's workspace_bytes count,
// not the plan's). `extra`: an argument only one of the two calls has.
template <typename Params>
void check_workspace_apart(std::string_view op, const Params& p, detail::MemorySpan extra = {}) {
  detail::expect_apart(op, {{"workspace", p.workspace, p.workspace_bytes, true},
                            {"fault", p.fault, sizeof(DeviceFault), true},
                            detail::span_of("o", p.o, true), detail::span_of("lse", p.lse, true),
                            detail::span_of("q", p.q, false), detail::span_of("q_idx", p.q_idx, false),
                            detail::span_of("weights", p.weights, false),
                            detail::span_of("cache.data", p.cache, false),
                            detail::span_of("indexer.data", p.indexer, false),
                            detail::span_of("block_table", p.block_table, false),
                            detail::span_of("seq_lens", p.seq_lens, false), extra});
}

// The indexer step's q and cache are the call's q_idx and indexer: the step's refusal of either
// (null data, strides, device, the pool) is named as the caller gave it, under the call's name, not
// as "indexer_logits: argument 'q'". Its other arguments share the call's names and keep the step's.
template <typename Check>
void named_as_given(std::string_view op, const Check& check) {
  try {
    check();
  } catch (const Error& e) {
    static constexpr std::pair<std::string_view, std::string_view> kRenamed[] = {{"q", "q_idx"}, {"cache", "indexer"}};
    const std::string_view arg = e.argument();
    for (const auto& [step, caller] : kRenamed) {
      // "q", "q.shape[2] (indexer heads)", "cache.data"; not "q_len"
      const std::string_view rest = arg.substr(std::min(arg.size(), step.size()));
      if (arg.starts_with(step) && (rest.empty() || rest.front() == '.' || rest.front() == '[' || rest.front() == ' ')) {
        throw Error(std::string(op), std::string(caller) + std::string(rest), e.value(), e.expected());
      }
    }
    throw;
  }
}

// Where each intermediate lives in the workspace. The indexer's scratch comes first: it is the one
// piece that keeps state from call to call (its claim counters, which workspace_cleared takes as
// zero), and it is planned for the most requests an indexer call takes (plan_dsa_decode), so it
// lies at the same bytes under every plan, whatever the batch: calls of different batch sizes, or
// graphs captured each with its own plan, may share one workspace, and no step's logits, slots or
// scratch ever cover those counters.
struct Layout {
  std::size_t indexer = 0, logits = 0, slots = 0, topk = 0, sparse = 0, end = 0;
};

std::int64_t logits_columns(const DsaDecodeParams& p) {
  if (p.max_len > 0) return p.max_len;
  return p.block_table.size(1) * static_cast<std::int64_t>(p.cache.page_size);
}

// One block table serves both caches, so the indexer cache must have the main cache's pages; and
// index_topk in range. Shared by decode and prefill.
void check_caches_and_topk(std::string_view op, const IndexerCache& indexer, const LatentCache& cache, int topk) {
  if (indexer.page_size != cache.page_size || indexer.num_pages != cache.num_pages) {
    throw Error(std::string(op), "indexer",
                "page_size " + std::to_string(indexer.page_size) + ", " + std::to_string(indexer.num_pages) + " pages",
                "the main cache's page_size " + std::to_string(cache.page_size) + " and " +
                    std::to_string(cache.num_pages) + " pages (one block table serves both)");
  }
  if (topk < 1 || topk > kMaxTopk) {
    throw Error(std::string(op), "topk", std::to_string(topk), "1 .. " + std::to_string(kMaxTopk));
  }
}

// The output dtypes a step on `device` takes: bf16 o and f32 lse on a GPU, also f32/f64 on the CPU.
detail::Outputs outputs_on(Device device) {
  return device.kind == DeviceKind::kCuda ? detail::Outputs::kDeviceTypes : detail::Outputs::kReferenceTypes;
}

// The caller's workspace against the `need` bytes the planner (named in messages) asked for, and
// against the alignment its steps want of the pieces carved from it at 256-byte offsets, refused
// here under the call's own name rather than by the step that would meet it: on a GPU what the
// kernels want (`align`: 16 for dsa_decode's, 256 for dsa_prefill's indexer prefill); on the CPU 16
// bytes, what operator new and malloc give, enough for the steps' float, int32 and double views.
void check_workspace(std::string_view op, std::string_view planner, const void* workspace, std::size_t bytes,
                     std::size_t need, Device device, std::size_t align) {
  if (workspace == nullptr && need > 0) {
    throw Error(std::string(op), "workspace", "null",
                std::to_string(need) + " bytes (" + std::string(planner) + "'s workspace_bytes)");
  }
  if (bytes < need) {
    throw Error(std::string(op), "workspace_bytes", std::to_string(bytes),
                ">= " + std::to_string(need) + " (" + std::string(planner) + "'s workspace_bytes for these shapes)");
  }
  const bool gpu = device.kind == DeviceKind::kCuda;
  const std::size_t want = gpu ? align : std::min<std::size_t>(align, 16);
  if (reinterpret_cast<std::uintptr_t>(workspace) % want != 0) {
    throw Error(std::string(op), "workspace", detail::misaligned_address(workspace, want),
                std::to_string(want) + "-byte aligned " +
                    (gpu ? "device memory (cudaMalloc gives 256)" : "memory (operator new and malloc give 16)"));
  }
}

// q's rows each take `row_bytes` of the workspace (`what`): refused, naming q, where all of them
// would pass 64 bits though q's own bytes fit.
void check_rows_fit(std::string_view op, const TensorView& q, std::int64_t rows, std::int64_t row_bytes,
                    const std::string& what) {
  std::int64_t bytes = 0;
  if (__builtin_mul_overflow(rows, row_bytes, &bytes)) {
    throw Error(std::string(op), "q", q.shape_string(),
                "rows whose " + what + " (" + std::to_string(row_bytes) + " bytes a row) fit 64 bits of workspace");
  }
}

// A block table [B, max_pages] of at most 2^30 tokens, as every step checks it, before planning: not
// planned as gigabytes of logits or scratch that a step then refuses. page_size >= 1 checked before.
void check_table_capacity(std::string_view op, const TensorView& block_table, std::int64_t page_size) {
  if (block_table.size(1) > kMaxTableTokens / page_size) {
    throw Error(std::string(op), "block_table", block_table.shape_string(),
                "max_pages * page_size <= 2^30 (page_size " + std::to_string(page_size) + ")");
  }
}

// The step views agree on [B, q_len] with q (each step checks the rest), so that a mismatch is
// named here after the caller's argument, not after a workspace view of a later step. And what the
// workspace is counted from (q's rows, the logits' columns) is checked before it is counted.
void check_shapes(const DsaDecodeParams& p) {
  if (p.q.rank != 4) throw Error(std::string(kOp), "q", p.q.shape_string(), "[B, q_len, H, 576] bf16");
  detail::expect_descriptor(kOp, "q", p.q);
  // Its dtype before the workspace is checked apart from it (its bytes counted in it).
  if (p.q.dtype != DType::kBF16) throw Error(std::string(kOp), "q", detail::describe(p.q), "[B, q_len, H, 576] bf16");
  detail::expect_range(kOp, "q.shape[2] (heads)", p.q.size(2), 1, kMaxHeads);  // the plans count rows of H
  const std::int64_t b = p.q.size(0), q_len = p.q.size(1);
  const std::string rows = " with B = " + std::to_string(b) + ", q_len = " + std::to_string(q_len) + " (q's)";
  if (p.q_idx.rank != 4 || p.q_idx.size(0) != b || p.q_idx.size(1) != q_len) {
    throw Error(std::string(kOp), "q_idx", p.q_idx.shape_string(), "[B, q_len, Hi, 128] fp8" + rows);
  }
  // The indexer step names q_idx "q": what it asks of q_idx is asked here first, under the caller's name.
  if (p.q_idx.dtype != DType::kFP8E4M3 || p.q_idx.size(3) != kIndexerDim) {
    throw Error(std::string(kOp), "q_idx", detail::describe(p.q_idx), "[B, q_len, Hi, 128] fp8" + rows);
  }
  detail::expect_range(kOp, "q_idx.shape[2] (indexer heads)", p.q_idx.size(2), 1, kMaxIndexerHeads);
  if (p.weights.rank != 3 || p.weights.size(0) != b || p.weights.size(1) != q_len || p.weights.dtype != DType::kF32) {
    throw Error(std::string(kOp), "weights", detail::describe(p.weights), "[B, q_len, Hi] f32" + rows);
  }
  if (p.block_table.rank != 2 || p.block_table.size(0) != b) {
    throw Error(std::string(kOp), "block_table", p.block_table.shape_string(),
                "[B, max_pages] i32 with B = " + std::to_string(b) + " (q's)");
  }
  detail::expect_descriptor(kOp, "block_table", p.block_table);
  if (p.seq_lens.rank != 1 || p.seq_lens.size(0) != b) {
    throw Error(std::string(kOp), "seq_lens", p.seq_lens.shape_string(),
                "[B] i32 with B = " + std::to_string(b) + " (q's)");
  }
  check_caches_and_topk(kOp, p.indexer, p.cache, p.topk);
  if (p.max_len < 0) throw Error(std::string(kOp), "max_len", std::to_string(p.max_len), ">= 0 (0: table capacity)");
  if (p.cache.page_size < 1) {  // the table's capacity below counts in it
    throw Error(std::string(kOp), "cache.page_size", std::to_string(p.cache.page_size), ">= 1");
  }
  // At most the columns the indexer and top-k take, named as the caller gave them: not planned as a
  // workspace of gigabytes whose logits view the indexer step then refuses.
  if (p.max_len > kMaxLogitsColumns) {
    throw Error(std::string(kOp), "max_len", std::to_string(p.max_len),
                "0 .. 2^30 (the logits' columns, as the indexer and top-k take them; 0: table capacity)");
  }
  check_table_capacity(kOp, p.block_table, p.cache.page_size);
  check_rows_fit(kOp, p.q, b * q_len, (logits_columns(p) + p.topk) * 4, "f32 logits and i32 top-k slots");
}

Layout layout_of(const DsaDecodeParams& p, const DsaPlan& plan) {
  const auto rows = static_cast<std::size_t>(p.q.size(0) * p.q.size(1));
  Layout l;
  l.indexer = 0;
  l.logits = align_up(l.indexer + plan.indexer.workspace_bytes);
  l.slots = align_up(l.logits + rows * static_cast<std::size_t>(logits_columns(p)) * sizeof(float));
  l.topk = align_up(l.slots + rows * static_cast<std::size_t>(p.topk) * sizeof(std::int32_t));
  l.sparse = align_up(l.topk + plan.topk.workspace_bytes);
  l.end = align_up(l.sparse + plan.sparse.workspace_bytes);
  return l;
}

// The steps with views at `base` (null while planning).
DsaSteps steps_at(const DsaDecodeParams& p, const Layout& l, std::uint8_t* base) {
  const std::int64_t b = p.q.size(0), q_len = p.q.size(1);
  const Device device = p.cache.device;  // the call's, as run() takes it (by_cache)
  const auto at = [base](std::size_t offset) -> void* { return base ? base + offset : nullptr; };

  DsaSteps s;
  s.indexer.q = p.q_idx;
  s.indexer.weights = p.weights;
  s.indexer.cache = p.indexer;
  s.indexer.block_table = p.block_table;
  s.indexer.seq_lens = p.seq_lens;
  s.indexer.logits = TensorView::contiguous(at(l.logits), DType::kF32, {b, q_len, logits_columns(p)}, device);

  s.topk.logits = s.indexer.logits;
  s.topk.block_table = p.block_table;
  s.topk.seq_lens = p.seq_lens;
  s.topk.page_size = p.cache.page_size;
  s.topk.k = p.topk;
  s.topk.slots = TensorView::contiguous(at(l.slots), DType::kI32, {b, q_len, p.topk}, device);

  s.sparse.q = p.q;
  s.sparse.cache = p.cache;
  s.sparse.indices = s.topk.slots;
  s.sparse.o = p.o;
  s.sparse.lse = p.lse;
  s.sparse.softmax_scale = p.softmax_scale;
  // Every step notes what the reference's would refuse. The top-k's own check adds one small kernel:
  // its lengths and pages are the indexer's, already checked, but a NaN logit (from a key scale that
  // is NaN, or infinite over a zero sum, in a cache the append did not write) is found only there.
  s.indexer.fault = p.fault;
  s.topk.fault = p.fault;
  s.sparse.fault = p.fault;
  return s;
}

}  // namespace

DsaBackends same_backend(const Backend& backend) { return {&backend, &backend, &backend, &backend, &backend}; }

namespace {

// The indexer step's views with `requests` rows and no data: what its scratch is planned for.
IndexerLogitsParams with_requests(IndexerLogitsParams s, std::int64_t requests) {
  for (TensorView* v : {&s.q, &s.weights, &s.block_table, &s.seq_lens, &s.logits}) {
    v->shape[0] = requests;  // row-major: the strides stay those of the other dims
    v->data = nullptr;
  }
  return s;
}

// Where a DSA call names no device: its main cache's (as run() takes a step's).
detail::DeviceChoice by_cache(const LatentCache& cache) { return detail::chosen_by("cache.device", cache.device); }

// plan_dsa_decode for `device`; `chosen` ends a refusal's message (DeviceChoice::why) where the
// caller named no device.
DsaPlan plan_decode(const DsaBackends& backends, const DsaDecodeParams& p, const DeviceInfo& device,
                    std::string_view chosen) {
  check_backends(backends);
  check_shapes(p);
  DsaPlan plan;
  DsaSteps s = steps_at(p, layout_of(p, plan), nullptr);
  // Each step's backend runs it on this device: a plan is never made for a device it cannot run on.
  detail::select_or_throw(*backends.indexer_logits, s.indexer, device, chosen);
  detail::select_or_throw(*backends.topk, s.topk, device, chosen);
  detail::select_or_throw(*backends.sparse_decode, s.sparse, device, chosen);
  // For the most requests a call takes, not this call's B (Layout says why).
  named_as_given(kOp, [&] {
    plan.indexer =
        backends.indexer_logits->plan(with_requests(s.indexer, std::max(p.q.size(0), kMaxGpuRequests)), device);
  });
  plan.topk = backends.topk->plan(s.topk, device);
  plan.sparse = backends.sparse_decode->plan(s.sparse, device);
  plan.workspace_bytes = layout_of(p, plan).end;
  // One backend for both: its indexer clears what its top-k would otherwise clear first.
  plan.topk_cleared_by_indexer = plan.topk.cleared_bytes > 0 && backends.indexer_logits == backends.topk;
  return plan;
}

}  // namespace

DsaPlan plan_dsa_decode(const DsaBackends& backends, const DsaDecodeParams& p) {
  const detail::DeviceChoice chosen = by_cache(p.cache);
  return plan_decode(backends, p, chosen.device, chosen.why);
}

DsaPlan plan_dsa_decode(const DsaBackends& backends, const DsaDecodeParams& p, const DeviceInfo& device) {
  return plan_decode(backends, p, device, {});
}

namespace {

// A step's scratch in a plan the caller hands back: at most 2^60 bytes, so that the layout's sum of
// a few such terms and the logits (which check_rows_fit keeps within int64) cannot wrap.
void check_plan_scratch(std::string_view op, const char* field, std::size_t bytes) {
  constexpr std::size_t kMostScratch = std::size_t{1} << 60;
  if (bytes > kMostScratch) {
    throw Error(std::string(op), field, std::to_string(bytes), "<= 2^60 bytes (as the plan call gives it)");
  }
}

}  // namespace

DsaSteps dsa_steps(const DsaDecodeParams& p, const DsaPlan& plan) {
  check_shapes(p);
  check_plan_scratch(kOp, "plan.indexer.workspace_bytes", plan.indexer.workspace_bytes);
  check_plan_scratch(kOp, "plan.topk.workspace_bytes", plan.topk.workspace_bytes);
  check_plan_scratch(kOp, "plan.sparse.workspace_bytes", plan.sparse.workspace_bytes);
  // The indexer step zeroes this much from the start of the top-k's scratch: no more than there is,
  // and something (the plan sets topk_cleared_by_indexer only for a top-k that takes cleared scratch).
  if (plan.topk_cleared_by_indexer &&
      (plan.topk.cleared_bytes == 0 || plan.topk.cleared_bytes > plan.topk.workspace_bytes)) {
    throw Error(std::string(kOp), "plan.topk.cleared_bytes", std::to_string(plan.topk.cleared_bytes),
                "1 .. plan.topk.workspace_bytes (" + std::to_string(plan.topk.workspace_bytes) +
                    "): with topk_cleared_by_indexer the indexer step clears that much of the top-k's scratch");
  }
  const Layout l = layout_of(p, plan);
  check_workspace(kOp, "plan_dsa_decode", p.workspace, p.workspace_bytes, l.end, p.cache.device, 16);
  auto* base = static_cast<std::uint8_t*>(p.workspace);
  DsaSteps s = steps_at(p, l, base);
  s.indexer.workspace = plan.indexer.workspace_bytes ? base + l.indexer : nullptr;
  s.indexer.workspace_bytes = plan.indexer.workspace_bytes;
  s.indexer.workspace_cleared = p.workspace_cleared && plan.indexer.cleared_bytes > 0;
  s.topk.workspace = plan.topk.workspace_bytes ? base + l.topk : nullptr;
  s.topk.workspace_bytes = plan.topk.workspace_bytes;
  if (plan.topk_cleared_by_indexer) {
    s.indexer.clear = s.topk.workspace;
    s.indexer.clear_bytes = plan.topk.cleared_bytes;
    s.topk.workspace_cleared = true;
  }
  s.sparse.num_splits = plan.sparse.num_splits;
  s.sparse.workspace = plan.sparse.workspace_bytes ? base + l.sparse : nullptr;
  s.sparse.workspace_bytes = plan.sparse.workspace_bytes;
  // The workspace apart from the caller's arguments, then every step's arguments: for dsa_decode,
  // before it queues any step, and for callers that run the steps one by one. In that order, an
  // argument inside the workspace is named as the caller passed it (a step would name the view of
  // its own it meets there: logits, slots, indices).
  check_workspace_apart(kOp, p);
  named_as_given(kOp, [&] { detail::validate_shapes(s.indexer, p.cache.device); });
  detail::validate_shapes(s.topk, p.cache.device);
  detail::validate_shapes(s.sparse, p.cache.device, outputs_on(p.cache.device));
  return s;
}

namespace {

void run_decode(const DsaBackends& backends, const DsaDecodeParams& p, const DsaPlan& plan, const ExecContext& context,
                const DeviceInfo& device, std::string_view chosen) {
  check_backends(backends);
  const DsaSteps s = dsa_steps(p, plan);  // every step's arguments checked
  // Every backend's consent to its step, and every kernel's checks of its call, before any step is
  // queued: a bad o must not leave the first steps queued.
  Kernel indexer;  // its refusals of q and cache named as the caller's q_idx and indexer, as dsa_steps does
  named_as_given(kOp, [&] { indexer = detail::checked_kernel(*backends.indexer_logits, s.indexer, device, chosen); });
  const Kernel topk = detail::checked_kernel(*backends.topk, s.topk, device, chosen);
  const Kernel sparse = detail::checked_kernel(*backends.sparse_decode, s.sparse, device, chosen);
  indexer.launch(s.indexer, context);
  topk.launch(s.topk, context);
  sparse.launch(s.sparse, context);
}

}  // namespace

void dsa_decode(const DsaBackends& backends, const DsaDecodeParams& p, const DsaPlan& plan,
                const ExecContext& context) {
  const detail::DeviceChoice chosen = by_cache(p.cache);
  run_decode(backends, p, plan, context, chosen.device, chosen.why);
}

void dsa_decode(const DsaBackends& backends, const DsaDecodeParams& p, const DsaPlan& plan,
                const ExecContext& context, const DeviceInfo& device) {
  run_decode(backends, p, plan, context, device, {});
}

// ---- Prefill ------------------------------------------------------------------------------------

namespace {

constexpr std::string_view kPrefillOp = "dsa_prefill";

void check_prefill_backends(const DsaBackends& b) {
  if (b.indexer_prefill == nullptr) {
    throw Error(std::string(kPrefillOp), "backends.indexer_prefill", "null", "a backend");
  }
  if (b.sparse_prefill == nullptr) throw Error(std::string(kPrefillOp), "backends.sparse_prefill", "null", "a backend");
}

void check_prefill_shapes(const DsaPrefillParams& p) {
  if (p.q.rank != 3) throw Error(std::string(kPrefillOp), "q", p.q.shape_string(), "[T, H, 576] bf16");
  detail::expect_descriptor(kPrefillOp, "q", p.q);  // its rows size the workspace
  if (p.q.dtype != DType::kBF16) throw Error(std::string(kPrefillOp), "q", detail::describe(p.q), "[T, H, 576] bf16");
  detail::expect_range(kPrefillOp, "q.shape[1] (heads)", p.q.size(1), 1, kMaxHeads);  // the plans count rows of H
  if (p.q_idx.rank != 3 || p.q_idx.size(0) != p.q.size(0)) {
    throw Error(std::string(kPrefillOp), "q_idx", p.q_idx.shape_string(),
                "[T, Hi, 128] fp8 with T = " + std::to_string(p.q.size(0)) + " (the rows of q)");
  }
  if (p.q_idx.dtype != DType::kFP8E4M3 || p.q_idx.size(2) != kIndexerDim) {  // as check_shapes
    throw Error(std::string(kPrefillOp), "q_idx", detail::describe(p.q_idx),
                "[T, Hi, 128] fp8 with T = " + std::to_string(p.q.size(0)) + " (the rows of q)");
  }
  detail::expect_range(kPrefillOp, "q_idx.shape[1] (indexer heads)", p.q_idx.size(1), 1, kMaxIndexerHeads);
  if (p.weights.rank != 2 || p.weights.size(0) != p.q.size(0) || p.weights.dtype != DType::kF32) {
    throw Error(std::string(kPrefillOp), "weights", detail::describe(p.weights),
                "[T, Hi] f32 with T = " + std::to_string(p.q.size(0)) + " (the rows of q)");
  }
  check_caches_and_topk(kPrefillOp, p.indexer, p.cache, p.topk);
  if (p.cache.page_size < 1) {  // as check_shapes: named here, not by the step whose plan meets it
    throw Error(std::string(kPrefillOp), "cache.page_size", std::to_string(p.cache.page_size), ">= 1");
  }
  detail::expect_descriptor(kPrefillOp, "block_table", p.block_table);
  check_rows_fit(kPrefillOp, p.q, p.q.size(0), std::int64_t{p.topk} * 4, "i32 top-k slots");
  // The indexer step names a block table of another rank; its capacity, which the plan's chunk of
  // logits is counted from, is refused here first, as dsa_decode refuses it.
  if (p.block_table.rank == 2) check_table_capacity(kPrefillOp, p.block_table, p.cache.page_size);
  // Here, before a plan's chunk (which a backend may fill in for any value it takes as its default)
  // stands in for it: refused on every backend alike, as indexer_prefill refuses it.
  detail::expect_chunk_tokens(kPrefillOp, p.chunk_tokens);
}

// The index rows [T, topk], then one scratch region that the two steps use in turn (they run one
// after the other on one stream): the larger of their plans.
struct PrefillLayout {
  std::size_t slots = 0, scratch = 0, end = 0;
};

PrefillLayout prefill_layout_of(const DsaPrefillParams& p, const DsaPrefillPlan& plan) {
  PrefillLayout l;
  l.scratch = align_up(static_cast<std::size_t>(p.q.size(0)) * static_cast<std::size_t>(p.topk) * sizeof(std::int32_t));
  l.end = align_up(l.scratch + std::max(plan.indexer.workspace_bytes, plan.sparse.workspace_bytes));
  return l;
}

DsaPrefillSteps prefill_steps_at(const DsaPrefillParams& p, std::uint8_t* base) {
  const std::int64_t t = p.q.size(0);
  DsaPrefillSteps s;
  s.indexer.q = p.q_idx;
  s.indexer.weights = p.weights;
  s.indexer.cu_new_tokens = p.cu_new_tokens;
  s.indexer.cache = p.indexer;
  s.indexer.block_table = p.block_table;
  s.indexer.seq_lens = p.seq_lens;
  s.indexer.k = p.topk;
  s.indexer.slots = TensorView::contiguous(base, DType::kI32, {t, p.topk}, p.cache.device);  // layout offset 0
  s.indexer.chunk_tokens = p.chunk_tokens;

  s.sparse.q = p.q;
  s.sparse.cache = p.cache;
  s.sparse.indices = s.indexer.slots;
  s.sparse.o = p.o;
  s.sparse.lse = p.lse;
  s.sparse.softmax_scale = p.softmax_scale;
  s.indexer.fault = p.fault;
  s.sparse.fault = p.fault;
  return s;
}

}  // namespace

namespace {

// plan_dsa_prefill for `device`, as plan_decode.
DsaPrefillPlan plan_prefill(const DsaBackends& backends, const DsaPrefillParams& p, const DeviceInfo& device,
                            std::string_view chosen) {
  check_prefill_backends(backends);
  check_prefill_shapes(p);
  const DsaPrefillSteps s = prefill_steps_at(p, nullptr);
  detail::select_or_throw(*backends.indexer_prefill, s.indexer, device, chosen);  // as plan_decode
  detail::select_or_throw(*backends.sparse_prefill, s.sparse, device, chosen);
  DsaPrefillPlan plan;
  named_as_given(kPrefillOp, [&] { plan.indexer = backends.indexer_prefill->plan(s.indexer, device); });
  plan.sparse = backends.sparse_prefill->plan(s.sparse, device);
  plan.workspace_bytes = prefill_layout_of(p, plan).end;
  return plan;
}

}  // namespace

DsaPrefillPlan plan_dsa_prefill(const DsaBackends& backends, const DsaPrefillParams& p) {
  const detail::DeviceChoice chosen = by_cache(p.cache);
  return plan_prefill(backends, p, chosen.device, chosen.why);
}

DsaPrefillPlan plan_dsa_prefill(const DsaBackends& backends, const DsaPrefillParams& p, const DeviceInfo& device) {
  return plan_prefill(backends, p, device, {});
}

DsaPrefillSteps dsa_prefill_steps(const DsaPrefillParams& p, const DsaPrefillPlan& plan) {
  check_prefill_shapes(p);
  check_plan_scratch(kPrefillOp, "plan.indexer.workspace_bytes", plan.indexer.workspace_bytes);
  check_plan_scratch(kPrefillOp, "plan.sparse.workspace_bytes", plan.sparse.workspace_bytes);
  const PrefillLayout l = prefill_layout_of(p, plan);
  check_workspace(kPrefillOp, "plan_dsa_prefill", p.workspace, p.workspace_bytes, l.end, p.cache.device,
                  kWorkspaceAlign);
  auto* base = static_cast<std::uint8_t*>(p.workspace);
  DsaPrefillSteps s = prefill_steps_at(p, base);
  if (plan.indexer.chunk_tokens > 0) s.indexer.chunk_tokens = plan.indexer.chunk_tokens;
  s.indexer.workspace = plan.indexer.workspace_bytes ? base + l.scratch : nullptr;
  s.indexer.workspace_bytes = plan.indexer.workspace_bytes;
  s.sparse.num_splits = plan.sparse.num_splits;
  s.sparse.workspace = plan.sparse.workspace_bytes ? base + l.scratch : nullptr;
  s.sparse.workspace_bytes = plan.sparse.workspace_bytes;
  // The workspace apart from the caller's arguments, then both steps' arguments (as dsa_steps). Both
  // steps run without new tokens too: nothing to compute, but their offsets, lengths and pages are
  // checked.
  check_workspace_apart(kPrefillOp, p, detail::span_of("cu_new_tokens", p.cu_new_tokens, false));
  named_as_given(kPrefillOp, [&] { detail::validate_shapes(s.indexer, p.cache.device); });
  detail::validate_shapes(s.sparse, p.cache.device, outputs_on(p.cache.device));
  return s;
}

namespace {

void run_prefill(const DsaBackends& backends, const DsaPrefillParams& p, const DsaPrefillPlan& plan,
                 const ExecContext& context, const DeviceInfo& device, std::string_view chosen) {
  check_prefill_backends(backends);
  const DsaPrefillSteps s = dsa_prefill_steps(p, plan);  // both steps' arguments checked
  // Both backends' consent, and both kernels' checks of their calls, before either step is queued:
  // a bad o must not leave the indexer step queued.
  Kernel indexer;  // named as in run_decode
  named_as_given(kPrefillOp,
                 [&] { indexer = detail::checked_kernel(*backends.indexer_prefill, s.indexer, device, chosen); });
  const Kernel sparse = detail::checked_kernel(*backends.sparse_prefill, s.sparse, device, chosen);
  indexer.launch(s.indexer, context);
  sparse.launch(s.sparse, context);
}

}  // namespace

void dsa_prefill(const DsaBackends& backends, const DsaPrefillParams& p, const DsaPrefillPlan& plan,
                 const ExecContext& context) {
  const detail::DeviceChoice chosen = by_cache(p.cache);
  run_prefill(backends, p, plan, context, chosen.device, chosen.why);
}

void dsa_prefill(const DsaBackends& backends, const DsaPrefillParams& p, const DsaPrefillPlan& plan,
                 const ExecContext& context, const DeviceInfo& device) {
  run_prefill(backends, p, plan, context, device, {});
}

}  // namespace latentkv
