// src/cuda/mla/decode_common.cuh - what the MLA decode kernels share: their arguments, and the
// entry points of the narrow (decode_narrow.cu) and wgmma (decode_wgmma.cu) kernels for the
// launcher in decode.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/convert.cuh"
#include "cuda/common/paging_check.cuh"
#include "cuda/common/value_check.cuh"

namespace latentkv::cuda::mla {

inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kLog2e = 1.4426950408889634f;

// 2^x with the special-function unit (ex2.approx: relative error about 2^-22; 2^-inf = 0), without
// exp2f's fix-up for results below 2^-126 (softmax weights that small are zeros here).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// 1/x with the special-function unit (rcp.approx: within one ulp), without a division's slow path.
__device__ __forceinline__ float fast_rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A row's lse (natural log) from its running maximum (log2 domain) and softmax sum: -inf when the
// row saw no token (sum 0), NaN when a NaN reached its scores (sum NaN), as in the reference.
__device__ __forceinline__ float row_lse(float max_log2, float sum) {
  return sum == 0.0f ? -INFINITY : (max_log2 + log2f(sum)) * kLn2;
}

// The split combine's weight of a split with lse `l` (natural log) in a row whose largest split lse
// is `m`, and the row's merged lse from m and the weights' sum: splits that saw no token weigh 0, a
// row that saw none gets -inf, and a NaN lse (a NaN reached that split's scores) makes the row NaN.
// The row's largest split lse takes lse_max, which keeps a NaN (fmaxf would drop it): with a NaN
// split and every other split empty the largest would otherwise stay -inf and weigh the NaN split 0.
__device__ __forceinline__ float lse_max(float a, float b) { return (a != a || b != b) ? NAN : fmaxf(a, b); }
__device__ __forceinline__ float split_weight(float l, float m) {
  return (m == -INFINITY || l == -INFINITY) ? 0.0f : exp2f((l - m) * kLog2e);
}
__device__ __forceinline__ float merged_lse(float m, float total) { return total == 0.0f ? -INFINITY : m + logf(total); }
// The combines' sums over splits: acc += w v, acc += v, per component; and four dims of a merged row
// as bf16, acc over the weights' sum (0 where no split saw a token).
__device__ __forceinline__ void add_scaled(float4& acc, float w, const float4& v) {
  acc.x += w * v.x;
  acc.y += w * v.y;
  acc.z += w * v.z;
  acc.w += w * v.w;
}
__device__ __forceinline__ void add(float4& acc, const float4& v) {
  acc.x += v.x;
  acc.y += v.y;
  acc.z += v.z;
  acc.w += v.w;
}
__device__ __forceinline__ uint2 merged_bf16x4(const float4& acc, float total) {
  const float inv = total > 0.0f ? 1.0f / total : 0.0f;
  return make_uint2(pack_bf16x2(acc.x * inv, acc.y * inv), pack_bf16x2(acc.z * inv, acc.w * inv));
}

// One query row's 512 latent dims held 16 per lane across a warp (w0, w1: 16 bf16) as f16 in
// `packed`, the whole row scaled by a power of two so that its largest magnitude lies in [2^12,
// 2^13), or by 2^126 at most (a row whose largest magnitude is below 2^-114 stays below 2^12: a
// larger factor would be infinite, and the row's zeros would turn into NaN); returns the factor that
// undoes the scaling (0 for an all-zero row). The kernels that take f16 queries (decode_narrow.cu,
// decode_wgmma.cu) multiply their latent scores by it.
__device__ __forceinline__ float latent_row_to_f16(const uint4& w0, const uint4& w1, std::uint32_t (&packed)[8]) {
  float v[16];
  float amax = unpack_bf16x16(w0, w1, v);
#pragma unroll
  for (int off = 16; off > 0; off /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  int shift = 0;
  if (amax > 0.0f) {
    int e = 0;
    frexpf(amax, &e);
    shift = min(13 - e, 126);
  }
  const float up = ldexpf(1.0f, shift);  // exact power of two
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const __half2 h = __floats2half2_rn(v[2 * k] * up, v[2 * k + 1] * up);
    packed[k] = *reinterpret_cast<const std::uint32_t*>(&h);
  }
  return amax > 0.0f ? ldexpf(1.0f, -shift) : 0.0f;
}

struct DecodeArgs {
  const std::uint16_t* q;            // [B, q_len, H, 576] bf16
  const std::uint8_t* cache;         // [num_pages * page_size, token_bytes]
  const std::int32_t* block_table;   // [B, max_pages]
  const std::int32_t* seq_lens;      // [B] (dense)
  const std::int32_t* indices;       // [B, index_cols] physical slots, -1 ignored (sparse); null for dense
  int index_cols;
  std::uint16_t* o;                  // [B, rows, 512] bf16 (rows = q_len * H)
  float* lse;                        // [B, rows]
  float* o_part;                     // [splits, B, rows, 512] f32, when num_splits > 1
  float* lse_part;                   // [splits, B, rows] f32
  std::int64_t num_pages;
  int page_size;
  int page_shift = -1;               // page_shift_of(page_size) (dense), or -1
  int max_pages;
  int batch;
  int q_len;
  int heads;
  int rows;
  int num_splits;
  bool merge_splits;                 // the kernel merges the splits itself (narrow kernel, cooperative launch)
  float scale_log2;                  // softmax_scale * log2(e)
};

// The tokens [begin, end) of request b that split `split` of `splits` covers: the request's length
// (clamped to its block table's capacity; a length outside it is noted by split 0's first thread)
// cut into `splits` chunks of whole tiles (a.num_splits, or the request's own count in the narrow
// kernel's balanced grid, which passes the length it read as known_len). Read on the device, so a
// captured step follows the lengths as they grow.
// Sparse decode has no lengths: a row's tokens are the index_cols entries of its index row.
struct SplitRange {
  int len, begin, end, num_tiles;
};
__device__ __forceinline__ int request_length(const DecodeArgs& a, int b) {
  const std::int64_t capacity = static_cast<std::int64_t>(a.max_pages) * a.page_size;
  return static_cast<int>(min(static_cast<std::int64_t>(max(a.seq_lens[b], 0)), capacity));
}
template <bool kChecks>
__device__ __forceinline__ SplitRange split_range(const DecodeArgs& a, const FaultSink& fault, int b, int split,
                                                  int splits, int tile_tokens, int known_len = -1) {
  SplitRange s;
  s.len = a.indices != nullptr ? a.index_cols : known_len >= 0 ? known_len : request_length(a, b);
  if constexpr (kChecks) {
    if (a.indices == nullptr && split == 0 && threadIdx.x == 0) {
      check_length(fault, b, a.seq_lens[b], a.max_pages, a.page_size);
    }
  }
  int chunk = (s.len + splits - 1) / splits;
  chunk = (chunk + tile_tokens - 1) / tile_tokens * tile_tokens;
  s.begin = min(split * chunk, s.len);
  s.end = min(s.begin + chunk, s.len);
  s.num_tiles = (s.end - s.begin + tile_tokens - 1) / tile_tokens;
  return s;
}

// Tokens query row `row` (q_len x heads rows, new token row / heads) of a request of length `len`
// sees, causal among the request's q_len new tokens; 0 for the padding rows past a.rows.
__device__ __forceinline__ int visible_tokens(const DecodeArgs& a, int len, int row) {
  return row < a.rows ? len - a.q_len + row / a.heads + 1 : 0;
}

// A grouped prefill's decode (launch_mla_decode_groups in launch.hpp) takes each group of new tokens
// as a request: group b is new tokens [spans[b].x, spans[b].x + spans[b].y) of the prefill, at most
// q_len of them.
//
// Request b's query rows: `count` of them (q_len x heads, fewer in a group), row r at row origin + r
// of q, o and lse, its new tokens `q_len` (the causal offset: row r sees len - q_len + r / heads + 1).
struct RequestRows {
  std::int64_t origin;
  int count;
  int q_len;
};
template <bool kGrouped>
__device__ __forceinline__ RequestRows request_rows(const DecodeArgs& a, const int2* spans, int b) {
  if constexpr (kGrouped) {
    const int2 span = spans[b];
    return {static_cast<std::int64_t>(span.x) * a.heads, span.y * a.heads, span.y};
  } else {
    return {static_cast<std::int64_t>(b) * a.rows, a.rows, a.q_len};
  }
}
__device__ __forceinline__ int visible_tokens(const DecodeArgs& a, const RequestRows& rows, int len, int row) {
  return row < rows.count ? len - rows.q_len + row / a.heads + 1 : 0;
}

// Tokens hidden by the causal mask. The output product weighs every staged token of a tile, and a
// token hidden from a row gets P' = 0 there, but 0 x NaN is NaN: a NaN in a newer token (which a
// cache written by other code may hold) would reach the rows that must not see it. So the kernels
// zero the non-finite V values and scales of a tile's tokens from `hidden_from` on (the first token
// that some row of the CTA does not see: its first row's visible count, the rows' counts rising with
// the row; `len`, nothing hidden, for a CTA without rows): once the tile's scores are taken, or (the
// wgmma kernel) as the tile is converted, marking the token so that its score is NaN. A row that
// sees such a token has a NaN score, hence a NaN output and lse, as in the reference; a row that
// does not gets 0 x 0. Only a request's newest q_len - 1 tokens (a grouped prefill's group - 1) can
// be hidden, so whole tiles before them skip this (and the wgmma and wide kernels run calls of q_len
// 1 on instances without it).
__device__ __forceinline__ int first_hidden_token(int visible_of_first_row, int row_count, int len) {
  return row_count > 0 ? visible_of_first_row : len;
}
// Four fp8 e4m3 codes with the NaN ones (0x7F, 0xFF) zeroed.
__device__ __forceinline__ std::uint32_t finite_fp8x4(std::uint32_t codes) {
  return codes & ~__vcmpeq4(codes & 0x7F7F7F7Fu, 0x7F7F7F7Fu);
}
// Two f16 (kExponent 0x7C00) or bf16 (0x7F80) values with the infinite and NaN ones zeroed.
template <std::uint32_t kExponent>
__device__ __forceinline__ std::uint32_t finite_16x2(std::uint32_t values) {
  constexpr std::uint32_t kBoth = kExponent | (kExponent << 16);
  return values & ~__vcmpeq2(values & kBoth, kBoth);
}
__device__ __forceinline__ float finite_or_zero(float x) { return isfinite(x) ? x : 0.0f; }
// A token's fp8 scale as the kernels take it: itself when finite, NaN when infinite (s x 0 + s, one
// FMA). The reference dequantizes each value, code x inf being +-inf and 0 x inf NaN, so a row that
// sees a token with an infinite scale gets a NaN score from it; the kernels weigh each block's dot
// product by its scale, which would give +-inf, and a -inf score would drop the token unnoticed.
__device__ __forceinline__ float nan_if_infinite(float s) { return __fmaf_rn(s, 0.0f, s); }

// Token t of request b comes from its block table (dense: page t / page_size) or its index row
// (sparse: the slot itself). Loading the entry and turning it into a slot are separate so that the
// global load can be issued early and used late. A slot outside the pool, or -1, gives -1: the
// kernels read nothing for it and mask it out of the softmax.
//
// An entry outside the pool (but -1 in an index row) is a fault. The tile loops only remember the
// last such token of each thread in `bad` (-1: none; a register and a select, nothing that would
// disturb the loop's scheduling); the kernel notes it in the call's record after the loop. Every
// kernel comes in two instances, with these checks (a call given a fault record) and without, so
// that a call without a record runs exactly the unchecked code.
// (entry_row and row_entry split it further, for a loop over one request's tokens that keeps one
// pointer; load_token_entry stays in its own form, which the narrow kernel's even-grid loop was
// measured with: through the two, its code changed.)
__device__ __forceinline__ const std::int32_t* entry_row(const DecodeArgs& a, int b) {
  return a.indices != nullptr ? a.indices + static_cast<std::int64_t>(b) * a.index_cols
                              : a.block_table + static_cast<std::int64_t>(b) * a.max_pages;
}
__device__ __forceinline__ std::int32_t row_entry(const DecodeArgs& a, const std::int32_t* row, int t) {
  return row[a.indices != nullptr ? t : position_page(t, a.page_size, a.page_shift)];
}
__device__ __forceinline__ std::int32_t load_token_entry(const DecodeArgs& a, int b, int t) {
  if (a.indices != nullptr) return a.indices[static_cast<std::int64_t>(b) * a.index_cols + t];
  return a.block_table[static_cast<std::int64_t>(b) * a.max_pages + position_page(t, a.page_size, a.page_shift)];
}
__device__ __forceinline__ std::int32_t entry_to_slot(const DecodeArgs& a, int t, std::int32_t entry, int& bad) {
  std::int32_t slot;
  if (a.indices != nullptr) slot = entry >= 0 && entry < a.num_pages * a.page_size ? entry : -1;
  else if (entry < 0 || entry >= a.num_pages) slot = -1;
  else slot = entry * a.page_size + position_in_page(t, a.page_size, a.page_shift);
  if (slot < 0 && (a.indices == nullptr || entry != -1)) bad = t;
  return slot;
}
__device__ __forceinline__ std::int32_t token_slot(const DecodeArgs& a, int b, int t, int end, int& bad) {
  return t < end ? entry_to_slot(a, t, load_token_entry(a, b, t), bad) : -1;
}
// Notes token `bad` of request b (-1: none), its entry loaded again. Nothing in a kernel instance
// without checks (kChecks false: no fault record given), where `bad` and its selects then compile
// away.
template <bool kChecks>
__device__ __forceinline__ void note_bad_entry(const DecodeArgs& a, const FaultSink& fault, int b, int bad) {
  if (!kChecks || bad < 0) return;
  const std::int32_t entry = load_token_entry(a, b, bad);
  if (a.indices != nullptr) {
    const std::int64_t element = (fault.row_base + b) * a.index_cols + bad;
    record_fault(fault, DeviceFaultCode::kSlot, {.index = element, .value = entry, .bound = a.num_pages * a.page_size});
  } else {
    const std::int32_t len = a.seq_lens[b];  // a page past what a bad length would use is not a fault of its own
    if (bad / a.page_size < pages_to_check(len, a.max_pages, a.page_size)) {
      check_page(fault, b, bad / a.page_size, entry, a.num_pages, len, a.page_size);
    }
  }
}

// Notes a non-finite query value (the reference refuses q with one) among the 8 bf16 of 16-byte
// piece `piece` (0 .. 71) of query row `row` of request b, as the kernels stage it: in the CTAs of
// split 0 only, so that each element is looked at once. Nothing in an instance without checks.
template <bool kChecks>
__device__ __forceinline__ void note_nonfinite_q(const DecodeArgs& a, const FaultSink& fault, int b, int split, int row,
                                                 int piece, const uint4& v) {
  if constexpr (kChecks) {
    if (split != 0 || row >= a.rows) return;
    note_nonfinite_bf16x8(fault, DeviceFaultCode::kQuery, ((fault.row_base + b) * a.rows + row) * 576 + piece * 8, v);
  }
}

// Few query rows over an fp8 cache (rows <= kNarrowMaxRows): the transposed kernel of
// decode_narrow.cu. Writes o/lse or, with splits, the partials, which it merges itself when its grid
// is resident at once (returns true), else decode.cu's combine merges them (returns false).
// `spans` non-null: a grouped prefill's decode (DecodeGroups), without a fault record, never merged
// in the kernel. `op` names the call in a launch's errors (mla_decode, sparse_mla_decode, ...).
inline constexpr int kNarrowMaxRows = 16;
bool launch_decode_narrow(const char* op, const DecodeArgs& a, const FaultSink& fault, const int2* spans,
                          cudaStream_t stream);
// CTAs of the narrow kernel for `rows` and `batch` (which picks the pipeline depth) that one SM
// holds at once (the occupancy API's answer).
int narrow_blocks_per_sm(int rows, int batch);

// More than 32 query rows over an fp8 cache on sm_90: the warpgroup tensor-core kernel of
// decode_wgmma.cu, 64 rows per CTA, 64 tokens per tile. Available when the library holds sm_90a
// code and the device (compute capability `sm`) is sm_90, unless the environment sets
// LATENTKV_MLA_KERNEL=mma (which keeps the mma.sync kernels, for comparison; any value but "mma" or
// "auto" is an error).
inline constexpr int kWgmmaRows = 64;
inline constexpr int kWgmmaTile = 64;
inline constexpr int kWgmmaMinRows = 33;
bool wgmma_decode_available(int sm);
// `spans` non-null: a grouped prefill's decode (DecodeGroups), without a fault record. `op` as above.
void launch_decode_wgmma(const char* op, const DecodeArgs& a, const FaultSink& fault, const int2* spans,
                         cudaStream_t stream);
int wgmma_blocks_per_sm();

}  // namespace latentkv::cuda::mla
