// latentkv/dsa.hpp - one layer's DeepSeek Sparse Attention as one call, every step reading the FP8
// caches natively: decode (indexer logits -> top-k -> sparse MLA decode) and prefill (indexer
// prefill, the logits and top-k of every new token -> sparse MLA prefill).
//
// The three ops run back to back on the caller's stream through the chosen backends, with their
// intermediate results (logits, selected slots) and scratch in one caller-owned workspace. Nothing
// is allocated and nothing waits for the host, so on a GPU a whole layer (or a whole model's step)
// can be captured once in a CUDA graph and replayed as the lengths in seq_lens grow. Capture a call
// only after one call of the same shapes has run outside the capture on that device: each kernel's
// first launch on a device sets it up (its shared-memory limit, its occupancy, asked of the runtime
// once), which is not for a capture (examples/dsa_layer.cpp does so).
#pragma once

#include <cstddef>

#include "latentkv/backend.hpp"
#include "latentkv/cache.hpp"
#include "latentkv/ops.hpp"
#include "latentkv/tensor.hpp"

namespace latentkv {

struct DsaDecodeParams {
  TensorView q;            // [B, q_len, H, 576] bf16, absorbed queries (as MlaDecodeParams::q: RoPE applied)
  TensorView q_idx;        // [B, q_len, Hi, 128] fp8 e4m3, indexer queries
  TensorView weights;      // [B, q_len, Hi] f32, indexer head weights (as IndexerLogitsParams::weights)
  LatentCache cache;       // main cache, read only
  IndexerCache indexer;    // indexer key cache, read only; same page size and pool as `cache`
  TensorView block_table;  // [B, max_pages] i32, shared by both caches
  TensorView seq_lens;     // [B] i32, L_b (new tokens included)
  TensorView o;            // [B, q_len, H, 512] bf16
  TensorView lse;          // [B, q_len, H] f32
  float softmax_scale = 0.0f;
  int topk = kMaxTopk;     // index_topk: slots each query row attends to (rows seeing fewer take all)
  // Logits columns, >= every L_b, at most 2^30; 0 = the block table's capacity. For a graph replayed
  // as lengths grow, leave it 0 (or at the largest length the graph will see): a length above it at
  // run time is read on the device, where it cannot be refused, so that row's newest tokens go
  // unscored and unselected; `fault`, when given, records it (DeviceFaultCode::kSeqLenColumns).
  int max_len = 0;
  void* workspace = nullptr;  // plan_dsa_decode(...).workspace_bytes of scratch on the op's device
  std::size_t workspace_bytes = 0;
  // True when the workspace was zeroed once after it was allocated and has been used since only by
  // dsa_decode calls (of any batch size, each under a plan_dsa_decode plan for its shapes, graphs
  // included): the indexer's counters, first in the workspace and planned for the most requests a
  // call takes, then stay zero from call to call, and the indexer step takes them cleared
  // (IndexerLogitsParams::workspace_cleared). False: any content. (Two calls in flight at once, on
  // two streams, need two workspaces.)
  bool workspace_cleared = false;
  // Optional, device memory on a GPU backend (latentkv/device_fault.hpp): given to all three steps,
  // so that the record notes what the reference's dsa_decode refuses, a NaN logit included (the
  // top-k's check: one more small kernel).
  DeviceFault* fault = nullptr;
};

// The backend of each step, normally from the resolved configuration (indexer, topk, sparse_decode;
// indexer_prefill, sparse_prefill). Decode uses the first three, prefill the last two.
struct DsaBackends {
  const Backend* indexer_logits = nullptr;
  const Backend* topk = nullptr;
  const Backend* sparse_decode = nullptr;
  const Backend* indexer_prefill = nullptr;
  const Backend* sparse_prefill = nullptr;
};
DsaBackends same_backend(const Backend& backend);

// The three ops of one call, with views into the workspace. Their schedules (split counts,
// scratch) are filled in when they come from plan_dsa_decode / dsa_steps.
struct DsaSteps {
  IndexerLogitsParams indexer;
  TopkParams topk;
  SparseMlaDecodeParams sparse;
};

struct DsaPlan {
  std::size_t workspace_bytes = 0;  // all of it: the indexer's scratch, logits, slots, the other two plans' scratch
  Plan indexer;                     // the indexer's scratch (claim counters on the GPU), for kMaxGpuRequests requests
  Plan topk;                        // the top-k backend's own schedule and scratch
  Plan sparse;                      // the sparse decode's split schedule and scratch
  // The indexer step clears the top-k's row state (IndexerLogitsParams::clear), so that the top-k
  // step skips that pass (TopkParams::workspace_cleared): when one backend runs both and its top-k
  // can take cleared scratch (plan.topk.cleared_bytes > 0).
  bool topk_cleared_by_indexer = false;
};

// The schedule and scratch of a call with these shapes (tensor data may still be null). Depends on
// shapes and the device only, never on the current lengths, and is made only for a device on which
// every step's backend selects a kernel (else Error, naming the step, as run() would). Here and in
// the calls below, the device is `device`, or without it the device of p's main cache
// (device_info_for(p.cache.device): the CPU for host memory, else the current CUDA device), as
// run() takes it.
DsaPlan plan_dsa_decode(const DsaBackends& backends, const DsaDecodeParams& p);
DsaPlan plan_dsa_decode(const DsaBackends& backends, const DsaDecodeParams& p, const DeviceInfo& device);

// The three ops a call runs, carved out of p.workspace (which must hold plan.workspace_bytes).
// For timing or inspecting the steps one by one; dsa_decode runs exactly these, in this order. With
// plan.topk_cleared_by_indexer the top-k step counts on the indexer step just before it: to run the
// top-k on its own, set its workspace_cleared to false. Checks what dsa_decode checks of the
// arguments before it queues anything: each step's, and the whole workspace (p.workspace_bytes of
// it) apart from p's other arguments. (dsa_decode also has each step's kernel check its call,
// Kernel::check, before the first step is queued; run() does so step by step.)
DsaSteps dsa_steps(const DsaDecodeParams& p, const DsaPlan& plan);

// Runs the layer: logits into the workspace, top-k slots into the workspace, sparse decode into
// o and lse. Throws Error on bad input, naming the step and its argument (dsa_decode and the
// argument, for the call's own shapes, workspace and memory shared with the workspace, and for what
// the indexer step refuses of q_idx and the indexer cache, its q and cache). A call that
// a step refuses without reading the data queues nothing: every step's backend selects a kernel and
// that kernel's own checks pass (Kernel::check: alignment, grid limits, the planned splits) before
// the first step is queued. Bad values are each step's to find as it runs (on the GPU, in the
// fault record).
void dsa_decode(const DsaBackends& backends, const DsaDecodeParams& p, const DsaPlan& plan,
                const ExecContext& context = {});
void dsa_decode(const DsaBackends& backends, const DsaDecodeParams& p, const DsaPlan& plan,
                const ExecContext& context, const DeviceInfo& device);

// ---- Prefill ------------------------------------------------------------------------------------
// T new tokens in all, ragged over requests (cu_new_tokens), their latents and indexer keys already
// appended: each new token's index row (indexer_prefill, in chunks of new tokens) into the
// workspace, then sparse MLA prefill over those rows into o and lse.
struct DsaPrefillParams {
  TensorView q;              // [T, H, 576] bf16, absorbed queries of the new tokens
  TensorView q_idx;          // [T, Hi, 128] fp8 e4m3, indexer queries
  TensorView weights;        // [T, Hi] f32, indexer head weights
  TensorView cu_new_tokens;  // [B + 1] i32, request b's new tokens are rows [cu[b], cu[b+1])
  LatentCache cache;         // main cache, read only
  IndexerCache indexer;      // indexer key cache, read only; same page size and pool as `cache`
  TensorView block_table;    // [B, max_pages] i32, shared by both caches
  TensorView seq_lens;       // [B] i32, L_b (prefix plus new tokens)
  TensorView o;              // [T, H, 512] bf16
  TensorView lse;            // [T, H] f32
  float softmax_scale = 0.0f;
  int topk = kMaxTopk;       // index_topk
  int chunk_tokens = 0;      // new tokens per indexer chunk; 0 = the indexer backend's default
  void* workspace = nullptr;  // plan_dsa_prefill(...).workspace_bytes of scratch on the op's device
  std::size_t workspace_bytes = 0;
  DeviceFault* fault = nullptr;  // optional, given to both steps (latentkv/device_fault.hpp)
};

struct DsaPrefillSteps {
  IndexerPrefillParams indexer;  // its slots are the sparse step's indices
  SparseMlaPrefillParams sparse;
};

struct DsaPrefillPlan {
  std::size_t workspace_bytes = 0;  // all of it: the index rows, then the larger plan's scratch (the
                                    // steps take it in turn)
  Plan indexer;                     // the indexer prefill's chunk and scratch
  Plan sparse;                      // the sparse prefill's split schedule and scratch
};

// As plan_dsa_decode: for a device both steps' backends run on, by default the cache's.
DsaPrefillPlan plan_dsa_prefill(const DsaBackends& backends, const DsaPrefillParams& p);
DsaPrefillPlan plan_dsa_prefill(const DsaBackends& backends, const DsaPrefillParams& p, const DeviceInfo& device);
// The two steps, carved out of p.workspace, checked as dsa_steps checks decode's.
DsaPrefillSteps dsa_prefill_steps(const DsaPrefillParams& p, const DsaPrefillPlan& plan);
// Runs both steps; like dsa_decode, queues nothing for a call either step refuses without reading
// the data.
void dsa_prefill(const DsaBackends& backends, const DsaPrefillParams& p, const DsaPrefillPlan& plan,
                 const ExecContext& context = {});
void dsa_prefill(const DsaBackends& backends, const DsaPrefillParams& p, const DsaPrefillPlan& plan,
                 const ExecContext& context, const DeviceInfo& device);

}  // namespace latentkv
