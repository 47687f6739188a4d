// latentkv/ops.hpp - one parameter struct per operation of SPEC section 4.
//
// Conventions shared by every op:
//  * B requests; q_len new query tokens per request in decode (1, or 2-4 with speculative decoding);
//    H query heads on this GPU; L_b = seq_lens[b] cached tokens of request b, its new tokens included.
//  * New token i of a request with n new tokens sees logical positions t < L_b - n + i + 1 (causal
//    among the new tokens; everything cached before them is visible).
//  * Logical position t of request b lives at physical slot
//    block_table[b][t / page_size] * page_size + t % page_size.
//  * bf16 tensors hold uint16_t bit patterns, fp8 tensors uint8_t e4m3fn codes.
//  * Limits every backend checks before it runs (src/core/validate.cpp): H 1 .. kMaxHeads (128),
//    indexer heads 1 .. kMaxIndexerHeads (64), q_len 1 .. kMaxDecodeQLen (4), k and index columns
//    1 .. kMaxTopk (2048), softmax_scale finite and > 0 (the default 0 is refused: set it), views
//    contiguous, on the call's device and at addresses aligned to their element size (a DSA call's
//    workspace, on the CPU, 16-byte aligned), fewer than 2^31 slots in a pool, at most kMaxTableTokens
//    (2^30) tokens in a block table and kMaxLogitsColumns (2^30) logits columns. On a GPU a dense
//    decode or an indexer call takes at most kMaxGpuRequests (65,535) requests and a sparse decode
//    65,535 query tokens (B x q_len), a prefill 2^31 - 1 requests
//    (the prefills run in slices of 65,535 new tokens; the top-k has no such limit), and a call
//    wants q 16-byte, o 8-byte, the caches and the workspace 16-byte aligned, an append's latent
//    16-byte and indexer_keys 8-byte, and a fault record 8-byte (cudaMalloc gives 256; the indexer
//    prefill and dsa_prefill want their workspace 256-byte aligned). What a
//    call writes (outputs, the caches of an append, workspace and clear, fault; the workspace as
//    workspace_bytes long) shares no byte with any other of its arguments.
//  * num_splits and workspace come from Backend::plan() for the call's shapes: a GPU call refuses
//    num_splits 0 (plan() fills it in) and a workspace smaller than the plan's; every backend
//    refuses a num_splits outside 0 .. kMaxSplits.
//  * o is bf16 in the GPU backends; the reference also writes f32 or f64 outputs for testing.
//  * lse is the natural log of sum_t exp(s_t) over the attended tokens; -inf when none.
//  * Bad values (a slot, page or length outside what the pool and block table hold, a NaN or inf
//    where the op needs a number): the reference throws before it writes anything. A GPU backend
//    cannot see device-resident values before its kernels run: they skip what is out of range (a
//    length is clamped to the block table's capacity, a page or slot outside the pool is not read,
//    the append leaves a bad token unwritten), so that nothing outside the given buffers is read or
//    written, and note such a fault in `fault` when one is given (latentkv/device_fault.hpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "latentkv/cache.hpp"
#include "latentkv/device_fault.hpp"
#include "latentkv/fp8.hpp"
#include "latentkv/tensor.hpp"

namespace latentkv {

inline constexpr int kMaxHeads = 128;
inline constexpr int kMaxDecodeQLen = 4;
inline constexpr int kMaxIndexerHeads = 64;
inline constexpr int kMaxTopk = 2048;
inline constexpr std::int64_t kMaxLogitsColumns = std::int64_t{1} << 30;  // indexer logits and top-k: max_len
// The most KV splits a decode or prefill call takes (num_splits).
inline constexpr int kMaxSplits = 1024;
// The most requests a GPU dense decode or indexer call takes (one grid row each).
inline constexpr std::int64_t kMaxGpuRequests = 65535;
// A block table's capacity (max_pages x page_size tokens): the GPU kernels hold token positions and
// lengths in int32, and round them up by a split's or a tile's tokens on the way.
inline constexpr std::int64_t kMaxTableTokens = std::int64_t{1} << 30;

// Quantize n new tokens and write them at their slots (a slot of -1 skips the token). A GPU backend
// leaves a token with a slot outside the pool or a NaN or inf in its latent or key unwritten in both
// caches and writes the others. The slots of one call must be distinct: the reference refuses a slot
// given twice; a GPU backend does not look, and may leave such a slot with bytes of both tokens.
struct AppendParams {
  LatentCache cache;            // written at `slots`
  TensorView latent;            // [n, 576] bf16: 512 latent values, then 64 rope values (RoPE already applied)
  TensorView slots;             // [n] i32: physical slot of each token, or -1
  IndexerCache indexer;         // optional (data == nullptr skips it); same page_size and pool size
  TensorView indexer_keys;      // [n, 128] bf16, already rotated; required with `indexer`
  ScaleMode scale_mode = ScaleMode::kPow2;
  DeviceFault* fault = nullptr; // optional, device memory on a GPU backend (latentkv/device_fault.hpp)
};

// Dense MLA decode: each query token attends to every cached token it can see.
struct MlaDecodeParams {
  // [B, q_len, H, 576] bf16, absorbed queries: the latent part (W_UK folded in), then the 64 rope
  // dims with RoPE already applied, as the cache's rope dims are. The op applies no rotation.
  TensorView q;
  LatentCache cache;            // read only
  TensorView block_table;       // [B, max_pages] i32 page ids
  TensorView seq_lens;          // [B] i32, L_b (new tokens included)
  TensorView o;                 // [B, q_len, H, 512] bf16 (reference: also f32/f64)
  TensorView lse;               // [B, q_len, H] f32 (reference: also f64)
  float softmax_scale = 0.0f;
  // Split-KV schedule and scratch, from Backend::plan() before the step (decode never allocates).
  // KV chunks per request. Set before plan() to ask a GPU backend for a count (1 to 1024), which
  // its plan keeps (the reference runs unsplit and plans 1); 0 lets the backend choose for these
  // shapes. The call runs the plan's count. (Parameters that hold an earlier plan's count keep it
  // when planned again: set 0 to have new shapes planned.)
  int num_splits = 0;
  void* workspace = nullptr;    // device scratch of at least workspace_bytes
  std::size_t workspace_bytes = 0;
  DeviceFault* fault = nullptr; // optional, device memory on a GPU backend (latentkv/device_fault.hpp)
};

// Dense MLA prefill / extend: T new tokens in all, ragged over requests, over a cached prefix.
struct MlaPrefillParams {
  TensorView q;                 // [T, H, 576] bf16, the requests' new tokens back to back
  TensorView cu_new_tokens;     // [B + 1] i32, request b's new tokens are rows [cu[b], cu[b+1])
  LatentCache cache;            // read only; the new tokens' latents are already appended
  TensorView block_table;       // [B, max_pages] i32
  TensorView seq_lens;          // [B] i32, L_b (prefix plus new tokens)
  TensorView o;                 // [T, H, 512] bf16 (reference: also f32/f64)
  TensorView lse;               // [T, H] f32 (reference: also f64)
  float softmax_scale = 0.0f;
  // Schedule and scratch from Backend::plan() (the GPU keeps each new token's view of its request's
  // pages there); the reference needs none. num_splits as in MlaDecodeParams.
  int num_splits = 0;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  DeviceFault* fault = nullptr; // optional, device memory on a GPU backend (latentkv/device_fault.hpp)
};

// Lightning-indexer logits: logit_t = sum_h w_h * relu(q_h . k_t) * kscale_t over visible t.
struct IndexerLogitsParams {
  TensorView q;                 // [B, q_len, Hi, 128] fp8 e4m3
  // [B, q_len, Hi] f32, each head's weight w_h of logit_t = sum_h w_h relu(q_h . k_t) kscale_t, with
  // everything else the model multiplies a head's term by folded in (q_idx's fp8 scale, the model's
  // constant factors): the op multiplies by nothing more.
  TensorView weights;
  IndexerCache cache;           // read only
  TensorView block_table;       // [B, max_pages] i32
  TensorView seq_lens;          // [B] i32
  TensorView logits;            // [B, q_len, max_len] f32; column t is logical position t, -inf where not visible
  // Optional: bytes of another op's scratch that this call sets to zero on the way, for the op that
  // reads these logits next on the same stream (dsa_decode clears the top-k's row state here, see
  // TopkParams::workspace_cleared). 16-byte aligned, a multiple of 16 bytes; none by default.
  void* clear = nullptr;
  std::size_t clear_bytes = 0;
  // Optional device scratch from Backend::plan(). With it, the GPU kernel on sm_90 balances long
  // spans over its CTAs: each CTA streams a fixed share of its request's positions, then claims the
  // rest a 64-token turn at a time from a per-request counter here, so that CTAs on faster SMs take
  // more. Without it every CTA streams a fixed span. Calls that may run at the same time (on
  // different streams) need their own workspaces.
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  // True when the first plan().cleared_bytes of the workspace are zero on entry. A GPU call that
  // claims sets the counters back to zero at its end, and one that does not leaves them alone, so a
  // workspace zeroed once when it was allocated, and used since by these calls only, stays zero.
  // The call then skips the memset that otherwise zeroes the counters before a kernel that claims
  // (and breaks the chained launch after the op before it). False: any content. (Counters that are
  // not zero when this says they are give wrong logits, never reads or writes outside the tensors.)
  bool workspace_cleared = false;
  DeviceFault* fault = nullptr; // optional, device memory on a GPU backend (latentkv/device_fault.hpp)
};

// Top-k per query row over its visible logits, returned as physical slots.
struct TopkParams {
  TensorView logits;            // [B, q_len, max_len] f32, as written by the indexer
  TensorView block_table;       // [B, max_pages] i32
  TensorView seq_lens;          // [B] i32
  // The caches' page size, which turns positions into slots. No default: the top-k sees no cache to
  // take it from, and a wrong one would give wrong slots without an error (0 is refused).
  int page_size = 0;
  int k = kMaxTopk;             // 1 .. 2048
  TensorView slots;             // [B, q_len, k] i32 physical slots; -1 pads rows with fewer than k visible
  // Device scratch from Backend::plan() (the GPU selection keeps per-row histograms there).
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  // True when the first plan().cleared_bytes of the workspace are zero on entry, because the call
  // before it on the stream cleared them (IndexerLogitsParams::clear): the selection then skips
  // clearing its row state itself (on the GPU, a memset or a grid-wide barrier fewer). Only for a
  // call that follows such a clear: the selection's own calls leave the state dirty.
  bool workspace_cleared = false;
  DeviceFault* fault = nullptr; // optional, device memory on a GPU backend (latentkv/device_fault.hpp)
};

// Indexer prefill: every new token's causal indexer logits over its request's key cache, then its
// top-k, a chunk of new tokens at a time (SPEC 4.4 and 4.5 for many new tokens). New token j of
// request b sees positions t < L_b - n_b + j + 1. Only one chunk's logits exist at once, in the
// workspace: chunk_tokens x max_pages x page_size floats, plus per-token block tables and the top-k
// scratch of a chunk (Backend::plan says how much).
struct IndexerPrefillParams {
  TensorView q;                 // [T, Hi, 128] fp8 e4m3, the requests' new tokens back to back
  TensorView weights;           // [T, Hi] f32, as IndexerLogitsParams::weights
  TensorView cu_new_tokens;     // [B + 1] i32, request b's new tokens are rows [cu[b], cu[b+1])
  IndexerCache cache;           // read only; the new tokens' keys already appended
  TensorView block_table;       // [B, max_pages] i32
  TensorView seq_lens;          // [B] i32, L_b (prefix plus new tokens)
  int k = kMaxTopk;             // 1 .. 2048
  TensorView slots;             // [T, k] i32 physical slots; -1 pads tokens that see fewer than k
  // Chunking and scratch from Backend::plan(); the reference needs none.
  int chunk_tokens = 0;         // new tokens per chunk; 0 = the backend's default for these shapes
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  DeviceFault* fault = nullptr; // optional, device memory on a GPU backend (latentkv/device_fault.hpp)
};

// Sparse MLA decode: each query row attends only to the slots of its index row.
struct SparseMlaDecodeParams {
  TensorView q;                 // [B, q_len, H, 576] bf16
  LatentCache cache;            // read only
  TensorView indices;           // [B, q_len, topk] i32 physical slots, -1 ignored
  TensorView o;                 // [B, q_len, H, 512] bf16 (reference: also f32/f64); zeros for an empty row
  TensorView lse;               // [B, q_len, H] f32 (reference: also f64); -inf for an empty row
  float softmax_scale = 0.0f;
  // Split schedule and scratch, from Backend::plan() (as in MlaDecodeParams).
  int num_splits = 0;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  DeviceFault* fault = nullptr; // optional, device memory on a GPU backend (latentkv/device_fault.hpp)
};

// Sparse MLA prefill: every new token attends to its own selected slots.
struct SparseMlaPrefillParams {
  TensorView q;                 // [T, H, 576] bf16
  LatentCache cache;            // read only
  TensorView indices;           // [T, topk] i32 physical slots, -1 ignored
  TensorView o;                 // [T, H, 512] bf16 (reference: also f32/f64)
  TensorView lse;               // [T, H] f32 (reference: also f64)
  float softmax_scale = 0.0f;
  // Split schedule and scratch, from Backend::plan() (as in SparseMlaDecodeParams).
  int num_splits = 0;
  void* workspace = nullptr;
  std::size_t workspace_bytes = 0;
  DeviceFault* fault = nullptr; // optional, device memory on a GPU backend (latentkv/device_fault.hpp)
};

}  // namespace latentkv
