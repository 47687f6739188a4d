// Indexer prefill (ops.hpp IndexerPrefillParams): every new token's causal indexer logits, then its
// top-k, on the decode kernels, a chunk of new tokens at a time.
//
// Each new token becomes a one-token "request" with its own visible length and block-table row
// (launch_prefill_rows), so the decode indexer computes exactly its causal logits and the decode
// top-k selects from them. Per chunk of C new tokens the workspace holds:
//   logits      C x capacity floats (capacity = max_pages x page_size, the block table's reach)
//   row tables  C x max_pages i32, and C lengths
//   top-k       the selection's per-row scratch for C rows (plan_topk); the chunk's indexer launch
//               clears its row state, so the top-k need not
//   groups      on sm_90a (the wgmma indexer), the chunk's new tokens in groups of up to 4
//               (group_tokens), each group one indexer "request" that reads its keys once for all
//               its tokens, causal among them (launch_prefill_groups): per group slot a length, a
//               block-table row and a span; the top-k still takes each new token as a row
// The default C keeps all of it within about 256 MiB (about 190 KB per new token for a 32K + 4K-token
// table, capacity 36,864: about 1,400 new tokens per chunk), and at most 65,535. Prompts of any length run in
// ceil(T / C) chunks on the one stream; nothing waits for the host.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/workspace.hpp"
#include "cuda/common/cuda_check.hpp"
#include "cuda/common/prefill_rows.hpp"
#include "cuda/common/value_check.hpp"
#include "cuda/indexer/launch.hpp"
#include "cuda/topk/launch.hpp"
#include "latentkv/error.hpp"

namespace latentkv::cuda {
namespace {

using detail::align_up;
using detail::kWorkspaceAlign;

constexpr const char* kOp = "indexer_prefill";
constexpr std::size_t kDefaultWorkspaceBytes = std::size_t{256} << 20;

// New tokens per group on the wgmma indexer: the most query rows a request of it stages (decode's
// q_len bound). H200, glm5 Hi 32, 4K new tokens over 32K (docs/benchmarks.md, fourteenth session):
// groups of 1 / 2 / 4 took 5473.8 / 5361.2 / 4704.7 us.
constexpr int kGroupTokens = kMaxDecodeQLen;

// The chunks' logits columns: at most kMaxTableTokens (validated), which is kMaxLogitsColumns.
static_assert(kMaxTableTokens <= kMaxLogitsColumns, "a chunk's logits rows span the table's capacity");
std::int64_t capacity_of(const IndexerPrefillParams& p) {
  return p.block_table.size(1) * static_cast<std::int64_t>(p.cache.page_size);
}

// Workspace bytes per new token of a chunk: its logits, block-table row and length, top-k scratch
// (and, on the wgmma indexer, its share of a group's row, length and span; a chunk also holds one
// group slot per request, not counted here).
std::size_t bytes_per_token(const IndexerPrefillParams& p) {
  TopkParams one;
  one.logits = TensorView::contiguous(nullptr, DType::kF32, {1, 1, capacity_of(p)}, p.q.device);
  const std::size_t group = indexer_uses_wgmma(p.cache.page_size, current_device_sm("indexer_prefill"))
                                ? static_cast<std::size_t>(p.block_table.size(1) + 3) * sizeof(float) / kGroupTokens
                                : 0;
  return static_cast<std::size_t>(capacity_of(p) + p.block_table.size(1) + 1) * sizeof(float) +
         plan_topk(one).workspace_bytes + group;
}

// The new tokens per chunk: the caller's, else as many as keep the workspace within the default
// bound; never more than one indexer launch takes.
std::int64_t chunk_of(const IndexerPrefillParams& p) {
  const std::int64_t most = std::clamp<std::int64_t>(p.q.size(0), 1, kMaxIndexerBatch);
  if (p.chunk_tokens > 0) return std::min<std::int64_t>(p.chunk_tokens, most);
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(kDefaultWorkspaceBytes / bytes_per_token(p)), 1, most);
}

// New tokens per group: kGroupTokens on the wgmma indexer where a full chunk's groups are at least
// half full on average and fit one launch's grid; else 1 (per token).
int group_tokens(const IndexerPrefillParams& p) {
  if (!indexer_uses_wgmma(p.cache.page_size, current_device_sm("indexer_prefill"))) return 1;
  const std::int64_t rows = std::min<std::int64_t>(p.q.size(0), chunk_of(p));
  const std::int64_t slots = group_slots(rows, kGroupTokens, p.seq_lens.size(0));
  return 2 * rows >= slots * kGroupTokens && slots <= kMaxIndexerBatch ? kGroupTokens : 1;
}

// One chunk's ops with views at `scratch` (null while planning), for new tokens [first, first + rows).
struct Chunk {
  IndexerLogitsParams logits;
  TopkParams topk;
  IndexerGroups groups;          // tokens 1: per token
  IndexerLogitsParams grouped;   // the logits params of the groups (block table and lengths the groups')
  std::size_t table = 0, lens = 0, group_lens = 0, group_table = 0, spans = 0, topk_scratch = 0, end = 0;  // offsets in the workspace
};

Chunk chunk_views(const IndexerPrefillParams& p, std::int64_t first, std::int64_t rows, std::uint8_t* scratch) {
  const std::int64_t hi = p.q.size(1), capacity = capacity_of(p), max_pages = p.block_table.size(1);
  const Device device = p.q.device;
  const auto at = [scratch](std::size_t offset) { return scratch ? scratch + offset : nullptr; };
  const std::int64_t chunk = chunk_of(p);
  Chunk c;
  const int group = group_tokens(p);
  const std::int64_t slots = group > 1 ? group_slots(chunk, group, p.seq_lens.size(0)) : 0;
  c.table = align_up(static_cast<std::size_t>(chunk * capacity) * sizeof(float));
  c.lens = align_up(c.table + static_cast<std::size_t>(chunk * max_pages) * sizeof(std::int32_t));
  c.group_lens = align_up(c.lens + static_cast<std::size_t>(chunk) * sizeof(std::int32_t));
  c.group_table = align_up(c.group_lens + static_cast<std::size_t>(slots) * sizeof(std::int32_t));
  c.spans = align_up(c.group_table + static_cast<std::size_t>(slots * max_pages) * sizeof(std::int32_t));
  c.topk_scratch = align_up(c.spans + static_cast<std::size_t>(slots) * 2 * sizeof(std::int32_t));

  IndexerLogitsParams& l = c.logits;
  l.q = TensorView::contiguous(static_cast<std::uint8_t*>(p.q.data) + first * hi * kIndexerDim, DType::kFP8E4M3,
                               {rows, 1, hi, kIndexerDim}, device);
  l.weights = TensorView::contiguous(p.weights.as<float>() + first * hi, DType::kF32, {rows, 1, hi}, device);
  l.cache = p.cache;
  l.block_table = TensorView::contiguous(at(c.table), DType::kI32, {rows, max_pages}, device);
  l.seq_lens = TensorView::contiguous(at(c.lens), DType::kI32, {rows}, device);
  l.logits = TensorView::contiguous(at(0), DType::kF32, {rows, 1, capacity}, device);
  c.groups.tokens = group;
  if (group > 1) {
    const std::int64_t n = group_slots(rows, group, p.seq_lens.size(0));
    c.groups.groups = static_cast<int>(n);
    c.groups.spans = reinterpret_cast<const int2*>(at(c.spans));
    c.grouped = l;
    c.grouped.block_table = TensorView::contiguous(at(c.group_table), DType::kI32, {n, max_pages}, device);
    c.grouped.seq_lens = TensorView::contiguous(at(c.group_lens), DType::kI32, {n}, device);
  }

  TopkParams& k = c.topk;
  k.logits = l.logits;
  k.block_table = l.block_table;
  k.seq_lens = l.seq_lens;
  k.page_size = p.cache.page_size;
  k.k = p.k;
  k.slots = TensorView::contiguous(p.slots.as<std::int32_t>() + first * p.k, DType::kI32, {rows, 1, p.k}, device);
  // The largest chunk's top-k scratch serves every chunk.
  TopkParams largest = k;
  largest.logits = TensorView::contiguous(nullptr, DType::kF32, {chunk, 1, capacity}, device);
  c.end = align_up(c.topk_scratch + plan_topk(largest).workspace_bytes);
  k.workspace = at(c.topk_scratch);
  k.workspace_bytes = c.end - c.topk_scratch;
  if (scratch != nullptr) {  // the chunk's indexer clears its top-k's row state
    l.clear = k.workspace;
    l.clear_bytes = plan_topk(k).cleared_bytes;
    k.workspace_cleared = true;
    c.grouped.clear = l.clear;
    c.grouped.clear_bytes = l.clear_bytes;
  }
  return c;
}

}  // namespace

std::string indexer_prefill_kernel_name(int page_size, int sm) {
  const std::string topk = " + topk<radix select, 12+10+10 bits>";
  const std::string per_token = "per-token " + indexer_logits_kernel_name(page_size, sm);
  const std::string groups = "groups of " + std::to_string(kGroupTokens) + " new tokens on ";
  if (page_size > 0 && indexer_uses_wgmma(page_size, sm)) {
    return "indexer_prefill = " + groups + indexer_logits_kernel_name(page_size, sm) + topk +
           " (per token when the groups would be less than half full)";
  }
  if (page_size == 0 && indexer_uses_wgmma(kIndexerWgmmaPageSize, sm)) {  // pages not known yet
    return "indexer_prefill = " + groups + indexer_logits_kernel_name(kIndexerWgmmaPageSize, sm) + " for " +
           kIndexerWgmmaPages + ", else " + per_token + topk;
  }
  return "indexer_prefill = " + per_token + topk;
}

Plan plan_indexer_prefill(const IndexerPrefillParams& p) {
  Plan plan;
  if (p.q.size(0) == 0) return plan;  // no new tokens: nothing to select, no scratch
  plan.chunk_tokens = static_cast<int>(std::min<std::int64_t>(chunk_of(p), INT32_MAX));
  plan.workspace_bytes = chunk_views(p, 0, plan.chunk_tokens, nullptr).end;
  return plan;
}

namespace {
// The requests of the call, as launch_prefill_rows takes them.
PrefillRows requests_of(const IndexerPrefillParams& p) {
  return prefill_rows_of(kOp, p.cu_new_tokens, p.seq_lens, p.block_table, p.cache.page_size,
                         p.cache.num_pages, p.q.size(0), FaultSink{p.fault, DeviceFaultOp::kIndexerPrefill});
}

}  // namespace

void check_indexer_prefill_call(const IndexerPrefillParams& p) {
  check_fault_record(p.fault, kOp);
  if (p.q.size(0) == 0) return;  // nothing to select, no scratch needed
  check_has_requests(requests_of(p), kOp);
  check_aligned(kOp, "q", p.q.data, 16);  // the indexer reads 16-byte rows
  // The chunks' indexer launches read the keys as 16-byte pieces, or 4-byte words on pages of a size
  // not a multiple of 4 (check_indexer_logits_call).
  check_aligned(kOp, "cache", p.cache.data, p.cache.page_size % 4 == 0 ? 16 : 4);
  const std::int64_t chunk = chunk_of(p);
  const std::size_t need = chunk_views(p, 0, chunk, nullptr).end;
  if (p.workspace == nullptr) throw Error(kOp, "workspace", "null", std::to_string(need) + " bytes (Backend::plan)");
  if (p.workspace_bytes < need) {
    throw Error(kOp, "workspace_bytes", std::to_string(p.workspace_bytes),
                ">= " + std::to_string(need) + " for chunks of " + std::to_string(chunk) +
                    " new tokens (Backend::plan for these shapes and chunk_tokens)");
  }
  check_aligned(kOp, "workspace", p.workspace, kWorkspaceAlign);
  // And what the first chunk's (the largest: chunk_of is at most T) indexer and top-k launches check
  // of their own views in the workspace.
  const Chunk c = chunk_views(p, 0, chunk, static_cast<std::uint8_t*>(p.workspace));
  check_indexer_logits_call(c.groups.tokens > 1 ? c.grouped : c.logits);
  check_topk_call(c.topk);
}

void launch_indexer_prefill(const IndexerPrefillParams& p, cudaStream_t stream) {
  check_indexer_prefill_call(p);
  const std::int64_t t = p.q.size(0), chunk = chunk_of(p);
  const PrefillRows requests = requests_of(p);
  const FaultSink& fault = requests.fault;
  if (t == 0) {  // the offsets', lengths' and pages' checks on their own
    launch_prefill_checks(requests, stream, kOp);
    return;
  }
  // The chunks' indexer and top-k launches run without the record (prefill_rows checks the
  // requests; the top-k reads what the indexer wrote), so q and the weights are checked by kernels of
  // their own.
  launch_value_check(value_check_of(p.q, DeviceFaultCode::kIndexerQuery, fault), stream, kOp);
  launch_value_check(value_check_of(p.weights, DeviceFaultCode::kWeight, fault), stream, kOp);
  auto* scratch = static_cast<std::uint8_t*>(p.workspace);
  for (std::int64_t first = 0; first < t; first += chunk) {
    const std::int64_t rows = std::min(chunk, t - first);
    const Chunk c = chunk_views(p, first, rows, scratch);
    launch_prefill_rows(requests, first, rows, c.logits.seq_lens.as<std::int32_t>(),
                        c.logits.block_table.as<std::int32_t>(), stream, kOp);
    if (c.groups.tokens > 1) {
      PrefillRows unchecked = requests;  // launch_prefill_rows checks the requests
      unchecked.fault.record = nullptr;
      launch_prefill_groups(unchecked, first, rows, c.groups.tokens, c.grouped.seq_lens.as<std::int32_t>(),
                            c.grouped.block_table.as<std::int32_t>(), const_cast<int2*>(c.groups.spans), stream, kOp);
      launch_indexer_logits_groups(c.grouped, c.groups, stream);
    } else {
      launch_indexer_logits(c.logits, stream);
    }
    launch_topk(c.topk, stream);
  }
}

}  // namespace latentkv::cuda
