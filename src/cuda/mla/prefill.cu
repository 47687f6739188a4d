// MLA prefill / extend over the paged cache (SPEC 4.3, 4.6), FP8 read natively, on the decode
// kernels: every new token is a query row of its own.
//
//   * Dense: new token j of request b (n_b new tokens, L_b in all) sees positions t < L_b - n_b + j + 1
//     of request b's pages. launch_prefill_rows gives each new token its own length and its own copy
//     of the request's block-table row (in the workspace); the T tokens then run as T decode
//     "requests" of one query token each. Causality among the new tokens is exactly each token's
//     length, so no mask is needed.
//     On few heads (H <= 32, sm_90a, fp8 cache) the new tokens go in groups instead, so that one CTA
//     of the wgmma decode kernel takes 64 query rows (8 new tokens x 8 heads at glm5 tp 8) over
//     tiles every row of the group shares: group tokens j0 .. j0 + c - 1 of request b (c <= G, fewer
//     in a request's last group) are a decode "request" of q_len c whose length is what token
//     j0 + c - 1 sees, causal among the c exactly as the decode's q_len new tokens (launch_prefill_groups builds the groups, DecodeGroups in
//     launch.hpp says how the kernel finds their rows). Per token, each row would read every tile
//     of its prefix by itself. Where the wgmma kernel does not serve them (sm_89, sm_100, sm_120, or
//     LATENTKV_MLA_KERNEL=mma), H <= 8 over fp8 runs in groups of 16 / H on the narrow kernel's 16
//     rows the same way, for prefills of 2048 new tokens or more whose groups would average 1.5
//     new tokens (mla_prefill_group_tokens).
//   * Sparse: each new token over its own index row is sparse decode with B = T, q_len = 1; the
//     tensors already have that layout.
// Correct for any H 1-128 and any page size; the kernels are the decode ones (split-KV, FP8 tiles
// dequantized on chip), not yet kernels built for many query tokens per request. The decode kernels'
// batch is a grid dimension, so prompts of more new tokens (or groups) than it holds run in slices.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "core/workspace.hpp"
#include "cuda/common/cuda_check.hpp"
#include "cuda/common/prefill_rows.hpp"
#include "cuda/common/value_check.hpp"
#include "cuda/mla/launch.hpp"
#include "latentkv/error.hpp"

namespace latentkv::cuda {
namespace {

using detail::align_up;

// Rows [first, first + rows) of a contiguous view (its leading dimension).
TensorView leading_rows(TensorView v, std::int64_t first, std::int64_t rows) {
  std::int64_t inner = 1;
  for (int d = 1; d < v.rank; ++d) inner *= v.shape[static_cast<std::size_t>(d)];
  v.data = static_cast<std::uint8_t*>(v.data) + first * inner * static_cast<std::int64_t>(dtype_size(v.dtype));
  v.shape[0] = rows;
  return v;
}

// The dense prefill as per-token decode, with views at `scratch` (null while planning).
struct PerToken {
  MlaDecodeParams decode;
  std::size_t table_bytes = 0;  // per-token block tables and lengths, before the decode's scratch
};

PerToken per_token(const MlaPrefillParams& p, std::uint8_t* scratch) {
  const std::int64_t t = p.q.size(0), h = p.q.size(1), max_pages = p.block_table.size(1);
  const Device device = p.q.device;
  const std::size_t table = align_up(static_cast<std::size_t>(t * max_pages) * sizeof(std::int32_t));
  PerToken r;
  r.table_bytes = table + align_up(static_cast<std::size_t>(t) * sizeof(std::int32_t));
  MlaDecodeParams& d = r.decode;
  d.q = TensorView::contiguous(p.q.data, DType::kBF16, {t, 1, h, kQkDim}, device);
  d.cache = p.cache;
  d.block_table = TensorView::contiguous(scratch, DType::kI32, {t, max_pages}, device);
  d.seq_lens = TensorView::contiguous(scratch ? scratch + table : nullptr, DType::kI32, {t}, device);
  d.o = TensorView::contiguous(p.o.data, DType::kBF16, {t, 1, h, kLatentDim}, device);
  d.lse = TensorView::contiguous(p.lse.data, DType::kF32, {t, 1, h}, device);
  d.softmax_scale = p.softmax_scale;
  return r;
}

// The dense prefill in groups of `tokens` new tokens (G > 1), with views at `scratch` (null while
// planning): per group slot its length, block-table row and span, then the decode's scratch.
struct Grouped {
  MlaDecodeParams decode;  // q, o, lse the prefill's; block_table, seq_lens the groups'
  DecodeGroups groups;
  std::size_t table_bytes = 0;
};

Grouped grouped(const MlaPrefillParams& p, int tokens, std::uint8_t* scratch) {
  const std::int64_t slots = group_slots(p.q.size(0), tokens, p.seq_lens.size(0)), max_pages = p.block_table.size(1);
  const Device device = p.q.device;
  const std::size_t lens = align_up(static_cast<std::size_t>(slots) * sizeof(std::int32_t));
  const std::size_t table = align_up(static_cast<std::size_t>(slots * max_pages) * sizeof(std::int32_t));
  Grouped r;
  r.table_bytes = lens + table + align_up(static_cast<std::size_t>(slots) * sizeof(int2));
  MlaDecodeParams& d = r.decode;
  d.q = p.q;
  d.cache = p.cache;
  d.seq_lens = TensorView::contiguous(scratch, DType::kI32, {slots}, device);
  d.block_table = TensorView::contiguous(scratch ? scratch + lens : nullptr, DType::kI32, {slots, max_pages}, device);
  d.o = p.o;
  d.lse = p.lse;
  d.softmax_scale = p.softmax_scale;
  d.num_splits = p.num_splits;
  r.groups.spans = scratch ? reinterpret_cast<const int2*>(scratch + lens + table) : nullptr;
  r.groups.groups = static_cast<int>(std::min<std::int64_t>(slots, kMaxDecodeBatch));
  r.groups.tokens = tokens;
  return r;
}

void check_table_workspace(const MlaPrefillParams& p, std::size_t table_bytes, const char* what) {
  if (p.workspace == nullptr || p.workspace_bytes < table_bytes) {
    throw Error("mla_prefill", "workspace_bytes", std::to_string(p.workspace_bytes),
                ">= " + std::to_string(table_bytes) + " for the " + what + " (see plan())");
  }
  // The groups' spans are int2, the decode's partials after the tables float4 (table_bytes keeps it).
  check_aligned("mla_prefill", "workspace", p.workspace, 16);
}

// The requests of the call, as launch_prefill_rows and launch_prefill_groups take them.
PrefillRows requests_of(const MlaPrefillParams& p) {
  return prefill_rows_of("mla_prefill", p.cu_new_tokens, p.seq_lens, p.block_table, p.cache.page_size,
                         p.cache.num_pages, p.q.size(0), FaultSink{p.fault, DeviceFaultOp::kMlaPrefill});
}

// Checked by check_mla_prefill_call.
void launch_grouped(const MlaPrefillParams& p, const PrefillRows& rows, int tokens, const FaultSink& fault,
                    cudaStream_t stream) {
  const std::int64_t slots = group_slots(p.q.size(0), tokens, p.seq_lens.size(0));
  auto* scratch = static_cast<std::uint8_t*>(p.workspace);
  const Grouped r = grouped(p, tokens, scratch);
  launch_value_check(value_check_of(p.q, DeviceFaultCode::kQuery, fault), stream, "mla_prefill");
  auto* spans = const_cast<int2*>(r.groups.spans);
  launch_prefill_groups(rows, 0, p.q.size(0), tokens, r.decode.seq_lens.as<std::int32_t>(),
                        r.decode.block_table.as<std::int32_t>(), spans, stream, "mla_prefill");
  for (std::int64_t first = 0; first < slots; first += kMaxDecodeBatch) {
    const std::int64_t n = std::min<std::int64_t>(kMaxDecodeBatch, slots - first);
    MlaDecodeParams d = r.decode;
    d.block_table = leading_rows(d.block_table, first, n);
    d.seq_lens = leading_rows(d.seq_lens, first, n);
    d.workspace = scratch + r.table_bytes;
    d.workspace_bytes = p.workspace_bytes - r.table_bytes;
    launch_mla_decode_groups(d, DecodeGroups{spans + first, static_cast<int>(n), tokens}, stream);
  }
}

}  // namespace

SparseMlaDecodeParams as_sparse_decode(const SparseMlaPrefillParams& p) {
  const std::int64_t t = p.q.size(0), h = p.q.size(1), topk = p.indices.size(1);
  const Device device = p.q.device;
  SparseMlaDecodeParams d;
  d.q = TensorView::contiguous(p.q.data, DType::kBF16, {t, 1, h, kQkDim}, device);
  d.cache = p.cache;
  d.indices = TensorView::contiguous(p.indices.data, DType::kI32, {t, 1, topk}, device);
  d.o = TensorView::contiguous(p.o.data, DType::kBF16, {t, 1, h, kLatentDim}, device);
  d.lse = TensorView::contiguous(p.lse.data, DType::kF32, {t, 1, h}, device);
  d.softmax_scale = p.softmax_scale;
  d.num_splits = p.num_splits;
  d.workspace = p.workspace;
  d.workspace_bytes = p.workspace_bytes;
  d.fault = p.fault;
  return d;
}

Plan plan_mla_prefill(const MlaPrefillParams& p, int multiprocessors) {
  if (const int tokens = mla_prefill_group_tokens(p); tokens > 1) {
    const Grouped g = grouped(p, tokens, nullptr);
    Plan plan = plan_mla_decode_groups(g.decode, g.groups, multiprocessors);
    plan.workspace_bytes += g.table_bytes;
    return plan;
  }
  PerToken r = per_token(p, nullptr);
  r.decode.num_splits = p.num_splits;  // a count asked for is kept, as in decode
  // For the first slice of new tokens, the largest a launch decodes at once (launch_mla_prefill): a
  // split count asked for then sizes partials for that slice, not for every new token.
  const std::int64_t n = std::min<std::int64_t>(p.q.size(0), kMaxDecodeBatch);
  r.decode.q = leading_rows(r.decode.q, 0, n);
  r.decode.block_table = leading_rows(r.decode.block_table, 0, n);
  r.decode.seq_lens = leading_rows(r.decode.seq_lens, 0, n);
  Plan plan = plan_mla_decode(r.decode, multiprocessors, "mla_prefill");
  plan.workspace_bytes += r.table_bytes;
  return plan;
}

void check_mla_prefill_call(const MlaPrefillParams& p) {
  check_fault_record(p.fault, "mla_prefill");
  const std::int64_t t = p.q.size(0);
  if (t == 0) return;  // no rows to build, no workspace needed
  // What the row and decode launches would refuse: requests for the new tokens, the block tables in
  // the workspace, and the decode of the first slice of new tokens (or groups), the largest.
  check_has_requests(requests_of(p), "mla_prefill");
  const int tokens = mla_prefill_group_tokens(p);
  const std::size_t table_bytes =
      tokens > 1 ? grouped(p, tokens, nullptr).table_bytes : per_token(p, nullptr).table_bytes;
  check_table_workspace(p, table_bytes, tokens > 1 ? "groups' block tables" : "per-token block tables");
  const std::int64_t launches = tokens > 1 ? group_slots(t, tokens, p.seq_lens.size(0)) : t;
  check_decode_call({"mla_prefill", std::min<std::int64_t>(launches, kMaxDecodeBatch), tokens * p.q.size(1),
                     p.num_splits, p.q.data, p.o.data, p.cache.data, p.workspace, p.workspace_bytes, table_bytes});
}

void launch_mla_prefill(const MlaPrefillParams& p, cudaStream_t stream) {
  check_mla_prefill_call(p);
  const std::int64_t t = p.q.size(0);
  const PrefillRows rows = requests_of(p);
  const FaultSink& fault = rows.fault;
  if (t == 0) {  // the offsets', lengths' and pages' checks on their own
    launch_prefill_checks(rows, stream, "mla_prefill");
    return;
  }
  if (const int tokens = mla_prefill_group_tokens(p); tokens > 1) {
    launch_grouped(p, rows, tokens, fault, stream);
    return;
  }
  auto* scratch = static_cast<std::uint8_t*>(p.workspace);
  PerToken r = per_token(p, scratch);
  r.decode.num_splits = p.num_splits;
  r.decode.workspace = scratch + r.table_bytes;
  r.decode.workspace_bytes = p.workspace_bytes - r.table_bytes;
  // The per-token decode runs without the record (prefill_rows checks the requests), so q's values
  // are checked by a kernel of their own.
  launch_value_check(value_check_of(p.q, DeviceFaultCode::kQuery, fault), stream, "mla_prefill");
  launch_prefill_rows(rows, 0, t, r.decode.seq_lens.as<std::int32_t>(), r.decode.block_table.as<std::int32_t>(), stream,
                      "mla_prefill");
  for (std::int64_t first = 0; first < t; first += kMaxDecodeBatch) {
    const std::int64_t n = std::min<std::int64_t>(kMaxDecodeBatch, t - first);
    MlaDecodeParams d = r.decode;
    d.q = leading_rows(d.q, first, n);
    d.block_table = leading_rows(d.block_table, first, n);
    d.seq_lens = leading_rows(d.seq_lens, first, n);
    d.o = leading_rows(d.o, first, n);
    d.lse = leading_rows(d.lse, first, n);
    launch_mla_decode(d, stream, "mla_prefill");
  }
}

Plan plan_sparse_mla_prefill(const SparseMlaPrefillParams& p, int multiprocessors) {
  // For the first slice of new tokens, the largest a launch decodes at once (as plan_mla_prefill).
  SparseMlaDecodeParams first = as_sparse_decode(p);
  first.q = leading_rows(first.q, 0, std::min<std::int64_t>(p.q.size(0), kMaxDecodeBatch));
  return plan_sparse_mla_decode(first, multiprocessors, "sparse_mla_prefill");
}

void check_sparse_mla_prefill_call(const SparseMlaPrefillParams& p) {
  check_fault_record(p.fault, "sparse_mla_prefill");
  if (p.q.size(0) == 0) return;  // no slices to launch
  // The slices' decodes ask the same of the call but its length, and the first slice is the largest.
  SparseMlaDecodeParams first = as_sparse_decode(p);
  const std::int64_t n = std::min<std::int64_t>(p.q.size(0), kMaxDecodeBatch);
  first.q = leading_rows(first.q, 0, n);
  first.o = leading_rows(first.o, 0, n);
  check_sparse_mla_decode_call(first, "sparse_mla_prefill");
}

void launch_sparse_mla_prefill(const SparseMlaPrefillParams& p, cudaStream_t stream) {
  check_sparse_mla_prefill_call(p);
  const SparseMlaDecodeParams whole = as_sparse_decode(p);
  const std::int64_t t = p.q.size(0);
  for (std::int64_t first = 0; first < t; first += kMaxDecodeBatch) {
    const std::int64_t n = std::min<std::int64_t>(kMaxDecodeBatch, t - first);
    SparseMlaDecodeParams d = whole;
    d.q = leading_rows(d.q, first, n);
    d.indices = leading_rows(d.indices, first, n);
    d.o = leading_rows(d.o, first, n);
    d.lse = leading_rows(d.lse, first, n);
    launch_sparse_mla_decode(d, stream, {"sparse_mla_prefill", DeviceFaultOp::kSparseMlaPrefill, first});
  }
}

}  // namespace latentkv::cuda
