// MLA decode over the paged cache, FP8 read natively: the "wide" mma.sync kernel (more than 16 query
// rows per request, and bf16 caches), the split combine, the kernel choice (kernel_for), planning,
// and the launchers of dense and sparse decode (sparse = each query token over its own index row).
// Few rows over fp8 go to decode_narrow.cu; more than 32 over fp8 on sm_90 to decode_wgmma.cu.
// Layout of the work and shared memory: decode_config.hpp. Math: SPEC 4.2, 4.6.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/common/chained_launch.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/common/mma.cuh"
#include "cuda/common/paging_check.hpp"
#include "cuda/common/prefill_rows.hpp"
#include "cuda/mla/decode_common.cuh"
#include "cuda/mla/decode_config.hpp"
#include "cuda/mla/launch.hpp"
#include "latentkv/error.hpp"

namespace latentkv::cuda {
namespace mla {
namespace {

template <bool kFp8>
struct TokenFormat {
  static constexpr int kBytes = kFp8 ? 656 : 1152;
  static constexpr int kChunks = kBytes / 16;  // 41 or 72 sixteen-byte chunks
};

// kHidden: q_len > 1, so the causal mask may hide a request's newest tokens from some rows, whose
// non-finite values the loop then keeps out of those rows (decode_common.cuh); the q_len 1 calls
// run the loop without that code, as decode_wgmma.cu does.
template <bool kFp8, int kGroups, bool kChecks, bool kHidden>
__global__ void __launch_bounds__(kGroups * kWarpsPerGroup * 32)
    decode_kernel(const DecodeArgs a, const FaultSink fault) {
  using Smem = DecodeSmem<kGroups>;
  using Fmt = TokenFormat<kFp8>;
  constexpr int kThreads = kGroups * kWarpsPerGroup * 32;
  constexpr int kTileChunks = kTileTokens * Fmt::kChunks;
  constexpr int kLoads = (kTileChunks + kThreads - 1) / kThreads;

  extern __shared__ __align__(16) unsigned char smem[];
  auto* q_s = reinterpret_cast<std::uint16_t*>(smem + Smem::kQ);
  auto* k_s = reinterpret_cast<std::uint16_t*>(smem + Smem::kK);
  auto* scale_s = reinterpret_cast<float*>(smem + Smem::kScale);
  auto* p_s = reinterpret_cast<float*>(smem + Smem::kP);
  auto* red_max = reinterpret_cast<float*>(smem + Smem::kRedMax);
  auto* red_sum = reinterpret_cast<float*>(smem + Smem::kRedSum);
  auto* slot_s = reinterpret_cast<std::int32_t*>(smem + Smem::kSlots);

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int warp = tid / 32;
  const int g = warp / kWarpsPerGroup;  // row group
  const int w = warp % kWarpsPerGroup;  // token slice for S, scale block / dim slice for O
  const int b = blockIdx.z;
  const int split = blockIdx.y;
  const int row_base = blockIdx.x * kGroups * kRowsPerGroup;

  wait_for_previous_kernels();
  const SplitRange range = split_range<kChecks>(a, fault, b, split, a.num_splits, kTileTokens);
  const int len = range.len, begin = range.begin, end = range.end, num_tiles = range.num_tiles;
  // Queries of this CTA's rows into shared memory (rows past the last are zero).
  for (int c = tid; c < kGroups * kRowsPerGroup * 72; c += kThreads) {
    const int r = c / 72, piece = c % 72;
    const int row = row_base + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < a.rows) {
      v = reinterpret_cast<const uint4*>(a.q + (static_cast<std::int64_t>(b) * a.rows + row) * kDimQk)[piece];
    }
    note_nonfinite_q<kChecks>(a, fault, b, split, row, piece, v);
    *reinterpret_cast<uint4*>(q_s + r * kRowStride + piece * 8) = v;
  }
  int bad_token = -1;  // the last of this thread's tokens with an entry outside the pool (note_bad_entry)
  if (tid < kTileTokens) {
    slot_s[tid] = num_tiles > 0 ? token_slot(a, b, begin + tid, end, bad_token) : -1;
    slot_s[kTileTokens + tid] = num_tiles > 1 ? token_slot(a, b, begin + kTileTokens + tid, end, bad_token) : -1;
  }
  __syncthreads();

  uint4 staged[kLoads];
  auto issue_loads = [&](int tile) {
    const std::int32_t* slots = slot_s + (tile & 1) * kTileTokens;
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = tid + i * kThreads;
      staged[i] = make_uint4(0, 0, 0, 0);
      if (c < kTileChunks) {
        const std::int32_t slot = slots[c / Fmt::kChunks];
        if (slot >= 0) {
          staged[i] = __ldg(reinterpret_cast<const uint4*>(a.cache + static_cast<std::int64_t>(slot) * Fmt::kBytes) +
                            c % Fmt::kChunks);
        }
      }
    }
  };
  auto store_tile = [&]() {
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      const int c = tid + i * kThreads;
      if (c >= kTileChunks) continue;
      const int token = c / Fmt::kChunks, piece = c % Fmt::kChunks;
      std::uint16_t* row = k_s + token * kRowStride;
      if constexpr (kFp8) {
        if (piece < 32) {  // 16 fp8 codes -> 16 bf16 (unscaled, exact)
          const std::uint32_t words[4] = {staged[i].x, staged[i].y, staged[i].z, staged[i].w};
          std::uint32_t out[8];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            out[2 * k] = fp8x2_to_bf16x2(static_cast<std::uint16_t>(words[k] & 0xFFFFu));
            out[2 * k + 1] = fp8x2_to_bf16x2(static_cast<std::uint16_t>(words[k] >> 16));
          }
          reinterpret_cast<uint4*>(row + piece * 16)[0] = make_uint4(out[0], out[1], out[2], out[3]);
          reinterpret_cast<uint4*>(row + piece * 16)[1] = make_uint4(out[4], out[5], out[6], out[7]);
        } else if (piece == 32) {  // the 4 float32 scales, an infinite one NaN
          const uint4 v = staged[i];
          *reinterpret_cast<float4*>(scale_s + token * 4) =
              make_float4(nan_if_infinite(__uint_as_float(v.x)), nan_if_infinite(__uint_as_float(v.y)),
                          nan_if_infinite(__uint_as_float(v.z)), nan_if_infinite(__uint_as_float(v.w)));
        } else {  // rope, bf16 as stored
          *reinterpret_cast<uint4*>(row + kDimV + (piece - 33) * 8) = staged[i];
        }
      } else {
        *reinterpret_cast<uint4*>(row + piece * 8) = staged[i];
      }
    }
  };

  // Running softmax state of this thread's two rows (lane/4 and lane/4 + 8 of its group), log2 domain.
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.0f, 0.0f};
  float acc_o[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) acc_o[n][0] = acc_o[n][1] = acc_o[n][2] = acc_o[n][3] = 0.0f;

  int visible[2];  // tokens visible to each of the thread's rows (causal among the new tokens)
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_base + g * kRowsPerGroup + lane / 4 + 8 * h;
    visible[h] = visible_tokens(a, len, row);
  }
  const int hidden_from = first_hidden_token(visible_tokens(a, len, row_base), a.rows - row_base, len);

  if (num_tiles > 0) issue_loads(0);
  for (int tile = 0; tile < num_tiles; ++tile) {
    __syncthreads();  // (A) the previous tile's K, P and reductions are no longer read
    store_tile();
    if (tile + 1 < num_tiles) issue_loads(tile + 1);
    __syncthreads();  // (B) K tile ready
    // Block-table (or index) entry of token `tid` of tile + 2: loaded now, turned into a slot after
    // this tile's math, so the global read overlaps the tensor-core work instead of stalling warp 0.
    std::int32_t ahead_entry = -1;
    const int ahead_t = begin + (tile + 2) * kTileTokens + tid;
    if (tid < kTileTokens && tile + 2 < num_tiles && ahead_t < end) ahead_entry = load_token_entry(a, b, ahead_t);

    // ---- S = Q K^T for tokens [8w, 8w+8) of the tile ----
    // One accumulator per 128-dim block plus rope: fp8 scales differ per block, and for both
    // formats five shorter fp32 sums keep the scores (and so lse) within SPEC's 1e-5.
    constexpr int kAcc = 5;
    float acc_s[kAcc][4];
#pragma unroll
    for (int j = 0; j < kAcc; ++j) acc_s[j][0] = acc_s[j][1] = acc_s[j][2] = acc_s[j][3] = 0.0f;
    const std::uint16_t* q_rows = q_s + (g * kRowsPerGroup + lane % 16) * kRowStride + (lane / 16) * 8;
    const std::uint16_t* k_rows = k_s + (w * 8 + lane % 8) * kRowStride + (lane / 8) * 8;
#pragma unroll
    for (int ks = 0; ks < kDimQk / 16; ks += 2) {  // two k16 steps per iteration
      std::uint32_t kb[4];
      ldmatrix_x4(kb, k_rows + ks * 16);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        std::uint32_t qa[4];
        ldmatrix_x4(qa, q_rows + (ks + h) * 16);
        const int j = (ks + h) / 8;  // dims [128 j, 128 j + 128); j = 4 is rope
        mma_bf16_16816(acc_s[j], qa, kb[2 * h], kb[2 * h + 1]);
      }
    }
    // Scores in the log2 domain, masked: element e is row lane/4 + 8 (e / 2), token 8w + 2 (lane % 4) + e % 2.
    float s[4];
    const int tile_begin = begin + tile * kTileTokens;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int token = w * 8 + 2 * (lane % 4) + e % 2;
      float v;
      if constexpr (kFp8) {
        const float* sc = scale_s + token * 4;
        v = acc_s[0][e] * sc[0] + acc_s[1][e] * sc[1] + acc_s[2][e] * sc[2] + acc_s[3][e] * sc[3] + acc_s[4][e];
      } else {
        v = ((acc_s[0][e] + acc_s[1][e]) + (acc_s[2][e] + acc_s[3][e])) + acc_s[4][e];
      }
      const int t = tile_begin + token;
      const bool read = slot_s[(tile & 1) * kTileTokens + token] >= 0;  // -1: outside the pool, or no index
      s[e] = (t < end && t < visible[e / 2] && read) ? v * a.scale_log2 : -INFINITY;
    }
    // Row maxima across the tile: 4 lanes per row in this warp, then the group's 4 warps.
    float* my_red_max = red_max + (g * kWarpsPerGroup) * kRowsPerGroup;
    float* my_red_sum = red_sum + (g * kWarpsPerGroup) * kRowsPerGroup;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = fmaxf(s[2 * h], s[2 * h + 1]);
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      if (lane % 4 == 0) my_red_max[w * kRowsPerGroup + lane / 4 + 8 * h] = m;
    }
    __syncthreads();  // (C) the scores are taken: K is read again only as V, after (D)
    if (kHidden && tile_begin + kTileTokens > hidden_from) {  // non-finite V values and scales of hidden tokens zeroed
      const int first = max(hidden_from - tile_begin, 0), count = min(end - tile_begin, kTileTokens) - first;
#pragma unroll 1
      for (int i = tid; i < count * (kDimV / 2); i += kThreads) {
        auto* pair = reinterpret_cast<std::uint32_t*>(k_s + (first + i / (kDimV / 2)) * kRowStride) + i % (kDimV / 2);
        *pair = finite_16x2<0x7F80u>(*pair);
      }
      if constexpr (kFp8) {
#pragma unroll 1
        for (int i = tid; i < count * 4; i += kThreads) scale_s[first * 4 + i] = finite_or_zero(scale_s[first * 4 + i]);
      }
    }
    float alpha[2];
    float* p_rows = p_s + g * kRowsPerGroup * kPStride;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = lane / 4 + 8 * h;
      float tile_max = my_red_max[r];
#pragma unroll
      for (int x = 1; x < kWarpsPerGroup; ++x) tile_max = fmaxf(tile_max, my_red_max[x * kRowsPerGroup + r]);
      const float new_max = fmaxf(row_max[h], tile_max);
      alpha[h] = new_max == -INFINITY ? 1.0f : exp2f(row_max[h] - new_max);
      row_max[h] = new_max;
      const float p0 = s[2 * h] == -INFINITY ? 0.0f : exp2f(s[2 * h] - new_max);
      const float p1 = s[2 * h + 1] == -INFINITY ? 0.0f : exp2f(s[2 * h + 1] - new_max);
      *reinterpret_cast<float2*>(p_rows + r * kPStride + w * 8 + 2 * (lane % 4)) = make_float2(p0, p1);
      float sum = p0 + p1;
      sum += __shfl_xor_sync(0xffffffffu, sum, 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      if (lane % 4 == 0) my_red_sum[w * kRowsPerGroup + r] = sum;
    }
    __syncthreads();  // (D) P and the row sums of the whole tile are in shared memory
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = lane / 4 + 8 * h;
      float tile_sum = 0.0f;
#pragma unroll
      for (int x = 0; x < kWarpsPerGroup; ++x) tile_sum += my_red_sum[x * kRowsPerGroup + r];
      row_sum[h] = row_sum[h] * alpha[h] + tile_sum;
    }
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      acc_o[n][0] *= alpha[0];
      acc_o[n][1] *= alpha[0];
      acc_o[n][2] *= alpha[1];
      acc_o[n][3] *= alpha[1];
    }

    // ---- O += P' V for dims [128w, 128w + 128); P' = P x (the token's scale of block w) ----
    // P' enters the tensor cores as two bf16 parts, hi + lo (relative error 2^-17 instead of the
    // 2^-9 of one bf16): with a peaked softmax over large values, one bf16 P breaks SPEC's
    // per-element tolerance. The second mma costs little where decode is memory bound.
#pragma unroll
    for (int kstep = 0; kstep < kTileTokens / 16; ++kstep) {
      std::uint32_t pa_hi[4], pa_lo[4];
#pragma unroll
      for (int part = 0; part < 4; ++part) {  // a0: (r, k), a1: (r+8, k), a2: (r, k+8), a3: (r+8, k+8)
        const int r = lane / 4 + 8 * (part % 2);
        const int k = kstep * 16 + 2 * (lane % 4) + 8 * (part / 2);
        float2 p = *reinterpret_cast<const float2*>(p_rows + r * kPStride + k);
        if constexpr (kFp8) {
          p.x *= scale_s[k * 4 + w];
          p.y *= scale_s[(k + 1) * 4 + w];
        }
        split_bf16x2(p.x, p.y, pa_hi[part], pa_lo[part]);
      }
      const std::uint16_t* v_rows =
          k_s + (kstep * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kRowStride + w * 128 + (lane / 16) * 8;
#pragma unroll
      for (int n = 0; n < 16; n += 2) {
        std::uint32_t vb[4];
        ldmatrix_x4_trans(vb, v_rows + n * 8);
        mma_bf16_16816(acc_o[n], pa_hi, vb[0], vb[1]);
        mma_bf16_16816(acc_o[n + 1], pa_hi, vb[2], vb[3]);
        mma_bf16_16816(acc_o[n], pa_lo, vb[0], vb[1]);
        mma_bf16_16816(acc_o[n + 1], pa_lo, vb[2], vb[3]);
      }
    }
    if (tid < kTileTokens && tile + 2 < num_tiles) {  // read by issue_loads(tile + 2), after sync (A)
      slot_s[(tile & 1) * kTileTokens + tid] = ahead_t < end ? entry_to_slot(a, ahead_t, ahead_entry, bad_token) : -1;
    }
  }

  // ---- epilogue: normalise and write this split's rows ----
  allow_next_kernel();
  note_bad_entry<kChecks>(a, fault, b, bad_token);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_base + g * kRowsPerGroup + lane / 4 + 8 * h;
    if (row >= a.rows) continue;
    const float inv = row_sum[h] > 0.0f ? 1.0f / row_sum[h] : 0.0f;
    const float lse = row_lse(row_max[h], row_sum[h]);
    const std::int64_t out_row = static_cast<std::int64_t>(b) * a.rows + row;
    if (a.num_splits == 1) {
      std::uint16_t* o = a.o + out_row * kDimV + w * 128 + 2 * (lane % 4);
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<std::uint32_t*>(o + n * 8) = pack_bf16x2(acc_o[n][2 * h] * inv, acc_o[n][2 * h + 1] * inv);
      }
      if (w == 0 && lane % 4 == 0) a.lse[out_row] = lse;
    } else {
      const std::int64_t part_row = static_cast<std::int64_t>(split) * a.batch * a.rows + out_row;
      float* o = a.o_part + part_row * kDimV + w * 128 + 2 * (lane % 4);
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<float2*>(o + n * 8) = make_float2(acc_o[n][2 * h] * inv, acc_o[n][2 * h + 1] * inv);
      }
      if (w == 0 && lane % 4 == 0) a.lse_part[part_row] = lse;
    }
  }
}

// Merges the splits of one output row: lse = log sum_s exp(lse_s), o = sum_s exp(lse_s - lse) o_s.
// One CTA per (output row, kDims of the 512 dims). The critical path is one round trip to memory:
// every thread loads its splits' lse while the warps already load their first splits' partial
// outputs (kBatch each); then two block reductions (the max, then the sum of the weights) and the
// weighted sum. A lane takes 4 dims, so a warp covers 32 / (kDims / 4) splits per load (kDims: see
// launch_combine). Few splits take 128 threads (more CTAs resident, fewer idle warps), many 512.
// kGrouped: a grouped prefill's decode (decode_common.cuh), whose padding rows have no partials and
// whose rows go to their group's rows of o and lse.
template <int kThreads, int kDims, bool kGrouped>
__global__ void __launch_bounds__(kThreads) combine_kernel(const DecodeArgs a, const int2* spans) {
  constexpr int kWarps = kThreads / 32;
  constexpr int kLanesPerSplit = kDims / 4;
  constexpr int kSplitsPerWarp = 32 / kLanesPerSplit;
  constexpr int kGroups = kWarps * kSplitsPerWarp;  // splits loaded at once by the CTA
  constexpr int kLsePerThread = kMaxSplits / kThreads;
  constexpr int kBatch = 8;  // loads per lane issued up front
  __shared__ float weights[kMaxSplits];
  __shared__ float warp_max[kWarps], warp_sum[kWarps];
  __shared__ float4 partial[kWarps][kLanesPerSplit];
  const std::int64_t out_row = blockIdx.x;  // b * rows + row, of the partials
  const int dim0 = blockIdx.y * kDims;
  const std::int64_t stride = static_cast<std::int64_t>(a.batch) * a.rows;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n = a.num_splits;
  const int group = warp * kSplitsPerWarp + lane / kLanesPerSplit, col = lane % kLanesPerSplit;
  const auto part = [&](int s) {
    return reinterpret_cast<const float4*>(a.o_part + (s * stride + out_row) * kDimV + dim0)[col];
  };
  wait_for_previous_kernels();
  std::int64_t dest_row = out_row;  // of o and lse
  if constexpr (kGrouped) {
    const int b = static_cast<int>(out_row / a.rows), row = static_cast<int>(out_row % a.rows);
    const RequestRows rows = request_rows<true>(a, spans, b);
    if (row >= rows.count) return;  // a group's padding row
    dest_row = rows.origin + row;
  }

  float l[kLsePerThread];  // this thread's splits threadIdx.x + e * kThreads
#pragma unroll
  for (int e = 0; e < kLsePerThread; ++e) {
    const int s = threadIdx.x + e * kThreads;
    l[e] = s < n ? a.lse_part[s * stride + out_row] : -INFINITY;
  }
  float4 v[kBatch];
#pragma unroll
  for (int k = 0; k < kBatch; ++k) {
    const int s = group + k * kGroups;
    v[k] = s < n ? part(s) : make_float4(0.f, 0.f, 0.f, 0.f);  // every split wrote its partial (zeros when empty)
  }

  allow_next_kernel();
  float m = -INFINITY;
#pragma unroll
  for (int e = 0; e < kLsePerThread; ++e) m = lse_max(m, l[e]);
  for (int off = 16; off > 0; off /= 2) m = lse_max(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) warp_max[warp] = m;
  __syncthreads();
  m = warp_max[0];
  for (int x = 1; x < kWarps; ++x) m = lse_max(m, warp_max[x]);
  // Split weights relative to the largest lse.
  float t = 0.0f;
#pragma unroll
  for (int e = 0; e < kLsePerThread; ++e) {
    const int s = threadIdx.x + e * kThreads;
    const float w = split_weight(l[e], m);
    if (s < n) weights[s] = w;
    t += w;
  }
  for (int off = 16; off > 0; off /= 2) t += __shfl_xor_sync(0xffffffffu, t, off);
  if (lane == 0) warp_sum[warp] = t;
  __syncthreads();
  float total = 0.0f;
  for (int x = 0; x < kWarps; ++x) total += warp_sum[x];

  float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int k = 0; k < kBatch; ++k) {
    const int s = group + k * kGroups;
    if (s < n) add_scaled(o, weights[s], v[k]);
  }
#pragma unroll 8
  for (int s = group + kBatch * kGroups; s < n; s += kGroups) add_scaled(o, weights[s], part(s));
  // The warp's splits summed by shuffles (lanes kLanesPerSplit apart hold the same dims), then the
  // warps' sums in shared memory: a chain of kWarps adds, not one of kGroups.
#pragma unroll
  for (int off = kLanesPerSplit; off < 32; off *= 2) {
    o.x += __shfl_xor_sync(0xffffffffu, o.x, off);
    o.y += __shfl_xor_sync(0xffffffffu, o.y, off);
    o.z += __shfl_xor_sync(0xffffffffu, o.z, off);
    o.w += __shfl_xor_sync(0xffffffffu, o.w, off);
  }
  if (lane < kLanesPerSplit) partial[warp][col] = o;
  __syncthreads();
  if (threadIdx.x < kLanesPerSplit) {
    float4 sum = partial[0][col];
    for (int x = 1; x < kWarps; ++x) add(sum, partial[x][col]);
    reinterpret_cast<uint2*>(a.o + dest_row * kDimV + dim0)[col] = merged_bf16x4(sum, total);
    // No split saw a token: -inf; a split's lse NaN (a NaN reached its scores): NaN, as its o.
    if (col == 0 && blockIdx.y == 0) a.lse[dest_row] = merged_lse(m, total);
  }
}

// The combine for this call: 32 dims per CTA when few output rows have many splits each (B x rows
// < 128 and more than 128 splits: one long dense request), which spreads each row's partials over
// four times the CTAs; else 128. H200, glm5 tp 8 B 1 x 32K (256 splits): 24.6 -> 23.7 us per call.
template <int kThreads, bool kGrouped>
void launch_combine(const DecodeArgs& a, const int2* spans, const char* op, cudaStream_t stream) {
  const auto rows = static_cast<unsigned>(a.batch * a.rows);
  if (a.batch * a.rows < 128 && a.num_splits > 128) {
    launch_chained(op, combine_kernel<kThreads, 32, kGrouped>, dim3(rows, kDimV / 32), kThreads, 0, stream, false, a,
                   spans);
  } else {
    launch_chained(op, combine_kernel<kThreads, 128, kGrouped>, dim3(rows, kDimV / 128), kThreads, 0, stream, false, a,
                   spans);
  }
}
template <int kThreads>
void launch_combine(const DecodeArgs& a, const int2* spans, const char* op, cudaStream_t stream) {
  if (spans != nullptr) launch_combine<kThreads, true>(a, spans, op, stream);
  else launch_combine<kThreads, false>(a, spans, op, stream);
}

int groups_for(int rows) { return rows <= kRowsPerGroup ? 1 : 2; }

template <bool kFp8, int kGroups, bool kChecks = false, bool kHidden = false>
int configure() {
  constexpr int kSmem = static_cast<int>(DecodeSmem<kGroups>::kBytes);
  return allow_dynamic_smem(decode_kernel<kFp8, kGroups, kChecks, kHidden>, kSmem, "mla_decode");
}

template <bool kFp8, int kGroups, bool kChecks, bool kHidden>
void launch_instance(const char* op, const DecodeArgs& a, const FaultSink& fault, cudaStream_t stream) {
  const int smem_bytes = configure<kFp8, kGroups, kChecks, kHidden>();
  const int row_blocks = (a.rows + kGroups * kRowsPerGroup - 1) / (kGroups * kRowsPerGroup);
  const dim3 grid(static_cast<unsigned>(row_blocks), static_cast<unsigned>(a.num_splits),
                  static_cast<unsigned>(a.batch));
  launch_chained(op, decode_kernel<kFp8, kGroups, kChecks, kHidden>, grid, kGroups * kWarpsPerGroup * 32,
                 smem_bytes, stream, false, a, fault);
}
template <bool kFp8, int kGroups, bool kHidden>
void launch_instance(const char* op, const DecodeArgs& a, const FaultSink& fault, cudaStream_t stream) {
  if (fault.record != nullptr) launch_instance<kFp8, kGroups, true, kHidden>(op, a, fault, stream);
  else launch_instance<kFp8, kGroups, false, kHidden>(op, a, fault, stream);
}
template <bool kFp8, int kGroups>
void launch_instance(const char* op, const DecodeArgs& a, const FaultSink& fault, cudaStream_t stream) {
  if (a.q_len > 1) launch_instance<kFp8, kGroups, true>(op, a, fault, stream);
  else launch_instance<kFp8, kGroups, false>(op, a, fault, stream);
}

template <bool kFp8, int kGroups>
int wide_blocks_per_sm() {
  return resident_ctas_per_sm(decode_kernel<kFp8, kGroups, false, false>, kGroups * kWarpsPerGroup * 32,
                              configure<kFp8, kGroups>(), "mla_decode");
}

// The kernel a call runs, decided in one place for planning, launching and naming.
enum class DecodeKernel { kNarrow, kWide, kWgmma };
// `sm`: the device's compute capability (the current device's for planning and launching).
DecodeKernel kernel_for(bool fp8, int rows, int sm) {
  if (fp8 && rows <= kNarrowMaxRows) return DecodeKernel::kNarrow;
  if (fp8 && rows >= kWgmmaMinRows && wgmma_decode_available(sm)) return DecodeKernel::kWgmma;
  return DecodeKernel::kWide;
}
int tile_tokens(DecodeKernel kernel) { return kernel == DecodeKernel::kWgmma ? kWgmmaTile : kTileTokens; }
int rows_per_cta(DecodeKernel kernel, int rows) {
  switch (kernel) {
    case DecodeKernel::kNarrow: return rows;
    case DecodeKernel::kWgmma: return kWgmmaRows;
    case DecodeKernel::kWide: break;
  }
  return groups_for(rows) * kRowsPerGroup;
}

// CTAs one SM holds at once of `kernel` (kernel_for these shapes).
int blocks_per_sm(DecodeKernel kernel, bool fp8, int rows, int batch) {
  switch (kernel) {
    case DecodeKernel::kNarrow: return narrow_blocks_per_sm(rows, batch);
    case DecodeKernel::kWgmma: return wgmma_blocks_per_sm();
    case DecodeKernel::kWide: break;
  }
  const int groups = groups_for(rows);
  if (fp8) return groups == 1 ? wide_blocks_per_sm<true, 1>() : wide_blocks_per_sm<true, 2>();
  return groups == 1 ? wide_blocks_per_sm<false, 1>() : wide_blocks_per_sm<false, 2>();
}

}  // namespace
}  // namespace mla

namespace mla {
namespace {

// The workspace of a call: the splits' partial rows and their lse (none without splits).
std::size_t partial_bytes(std::int64_t batch, std::int64_t rows, int num_splits) {
  if (num_splits < 2) return 0;
  return sizeof(float) * static_cast<std::size_t>(num_splits) * static_cast<std::size_t>(batch) *
         static_cast<std::size_t>(rows) * (kDimV + 1);
}

// The split-KV schedule for `batch` independent token lists of up to `tokens` tokens, `rows` query
// rows each: `requested` splits when the caller asks for a count, else as many as fill the SMs in
// one wave (never a partial second wave), each split at least min_tokens_per_split tokens unless the
// whole grid is small (kShortSplitGrid).
Plan plan_splits(int batch, int rows, std::int64_t tokens, bool fp8, int multiprocessors, int min_tokens_per_split,
                 int requested, const char* op) {
  if (requested < 0 || requested > kMaxSplits) {
    throw Error(op, "num_splits", std::to_string(requested),
                "0 (the backend's choice) or a count from 1 to " + std::to_string(kMaxSplits));
  }
  const DecodeKernel kernel = kernel_for(fp8, rows, current_device_sm(op));
  const int per_cta = rows_per_cta(kernel, rows);
  const int row_blocks = (rows + per_cta - 1) / per_cta;
  // A split holds whole tiles: fewer tokens than one tile would leave the last splits empty.
  const int tile = tile_tokens(kernel);
  min_tokens_per_split = std::max(min_tokens_per_split, tile);
  const std::int64_t base = std::max<std::int64_t>(1, static_cast<std::int64_t>(batch) * row_blocks);
  const std::int64_t resident = static_cast<std::int64_t>(blocks_per_sm(kernel, fp8, rows, batch)) * multiprocessors;
  const std::int64_t wanted = std::max<std::int64_t>(1, resident / base);
  // Splits of min_tokens_per_split tokens, or shorter ones in a small grid (decode_config.hpp).
  const std::int64_t tiles = (tokens + tile - 1) / tile;
  const std::int64_t useful =
      std::max<std::int64_t>({1, tokens / min_tokens_per_split, short_split_count(base, tiles)});
  Plan plan;
  plan.num_splits = requested > 0 ? requested
                                  : static_cast<int>(std::clamp<std::int64_t>(std::min(wanted, useful), 1, kMaxSplits));
  plan.workspace_bytes = partial_bytes(batch, rows, plan.num_splits);
  return plan;
}

// Checks the schedule and scratch, then runs the kernel these shapes take and the split combine.
// `spans`: a grouped prefill's decode (decode_common.cuh), which the wgmma and narrow kernels serve.
void run_decode(DecodeArgs a, const FaultSink& fault, bool fp8, int num_splits, void* workspace,
                std::size_t workspace_bytes, const char* op, cudaStream_t stream, const int2* spans = nullptr) {
  a.num_splits = num_splits;
  check_decode_call({op, a.batch, a.rows, num_splits, a.q, a.o, a.cache, workspace, workspace_bytes});
  if (a.batch == 0) return;  // nothing to compute, no workspace needed
  if (a.num_splits > 1) {
    a.o_part = static_cast<float*>(workspace);
    a.lse_part = a.o_part + static_cast<std::size_t>(a.num_splits) * a.batch * a.rows * kDimV;
  }
  const int groups = groups_for(a.rows);
  const DecodeKernel kernel = kernel_for(fp8, a.rows, current_device_sm(op));
  if (spans != nullptr && kernel != DecodeKernel::kWgmma && kernel != DecodeKernel::kNarrow) {
    throw Error(op, "q", std::to_string(a.rows) + " rows a group",
                "a group the wgmma or narrow kernel takes (mla_prefill_group_tokens)");
  }
  bool merged = false;  // the splits merged by the kernel itself
  if (kernel == DecodeKernel::kNarrow) merged = launch_decode_narrow(op, a, fault, spans, stream);
  else if (kernel == DecodeKernel::kWgmma) launch_decode_wgmma(op, a, fault, spans, stream);
  else if (fp8 && groups == 1) launch_instance<true, 1>(op, a, fault, stream);
  else if (fp8) launch_instance<true, 2>(op, a, fault, stream);
  else if (groups == 1) launch_instance<false, 1>(op, a, fault, stream);
  else launch_instance<false, 2>(op, a, fault, stream);
  if (a.num_splits > 1 && !merged) {
    if (a.num_splits <= 32) {
      launch_combine<128>(a, spans, op, stream);
    } else {
      launch_combine<512>(a, spans, op, stream);
    }
  }
}

}  // namespace
}  // namespace mla

// Planned for the block table's capacity, not today's lengths (read on the device), so that one plan
// serves a graph replayed as they grow. The price: requests far shorter than the capacity (a 4K
// request in a 160K table) get the capacity's splits, most of them without a tile, whose partials
// the combine still reads; a caller who knows a smaller bound may pass num_splits.
Plan plan_mla_decode(const MlaDecodeParams& p, int multiprocessors, const char* op) {
  const std::int64_t capacity = p.block_table.size(1) * static_cast<std::int64_t>(p.cache.page_size);
  return mla::plan_splits(static_cast<int>(p.q.size(0)), static_cast<int>(p.q.size(1) * p.q.size(2)), capacity,
                          p.cache.dtype == KvDtype::kFp8E4M3, multiprocessors, mla::kMinTokensPerSplit, p.num_splits, op);
}

namespace mla {
namespace {
// A dense decode's kernel arguments: `batch` requests of q_len new tokens and `heads` heads (the
// shape of p.q for a decode; a grouped prefill's groups otherwise, launch_mla_decode_groups).
DecodeArgs dense_args(const MlaDecodeParams& p, int batch, int q_len, int heads) {
  DecodeArgs a{};
  a.q = p.q.as<const std::uint16_t>();
  a.cache = p.cache.data;
  a.block_table = p.block_table.as<const std::int32_t>();
  a.seq_lens = p.seq_lens.as<const std::int32_t>();
  a.o = p.o.as<std::uint16_t>();
  a.lse = p.lse.as<float>();
  a.num_pages = p.cache.num_pages;
  a.page_size = p.cache.page_size;
  a.page_shift = page_shift_of(a.page_size);
  a.max_pages = static_cast<int>(p.block_table.size(1));
  a.batch = batch;
  a.q_len = q_len;
  a.heads = heads;
  a.rows = a.q_len * a.heads;
  a.scale_log2 = p.softmax_scale * kLog2e;
  return a;
}
}  // namespace
}  // namespace mla

void check_decode_call(const DecodeCall& c) {
  if (c.num_splits < 1 || c.num_splits > mla::kMaxSplits) {
    throw Error(c.op, "num_splits", std::to_string(c.num_splits),
                "1 to " + std::to_string(mla::kMaxSplits) + ", from the backend's plan()");
  }
  check_aligned(c.op, "q", c.q, 16);               // read as 16-byte pieces of rows
  check_aligned(c.op, "o", c.o, 8);                // written as 4- to 8-byte pieces
  check_aligned(c.op, "cache.data", c.cache, 16);  // entries read as 16-byte pieces and bulk copies
  if (c.batch == 0) return;  // nothing to compute, no workspace needed
  if (c.num_splits > 1) {
    const std::size_t need = c.table_bytes + mla::partial_bytes(c.batch, c.rows, c.num_splits);
    if (c.workspace == nullptr || c.workspace_bytes < need) {
      throw Error(c.op, "workspace_bytes", std::to_string(c.workspace_bytes),
                  ">= " + std::to_string(need) + " for " + std::to_string(c.num_splits) + " splits" +
                      (c.table_bytes > 0 ? " after the block tables" : "") + " (see plan())");
    }
    check_aligned(c.op, "workspace", c.workspace, 16);  // the partials: 16-byte copies and float4 loads
  }
  if (c.batch > kMaxDecodeBatch) {  // a grid dimension each; prefill slices its tokens below this
    throw Error(c.op, "q", std::to_string(c.batch) + " query tokens",
                "at most " + std::to_string(kMaxDecodeBatch) + " per call (B, or B x q_len for sparse decode)");
  }
}

void check_mla_decode_call(const MlaDecodeParams& p, const char* op) {
  check_fault_record(p.fault, op);
  check_decode_call({op, p.q.size(0), p.q.size(1) * p.q.size(2), p.num_splits, p.q.data, p.o.data,
                     p.cache.data, p.workspace, p.workspace_bytes});
}

void launch_mla_decode(const MlaDecodeParams& p, cudaStream_t stream, const char* op) {
  using namespace mla;
  check_mla_decode_call(p, op);
  const DecodeArgs a = dense_args(p, static_cast<int>(p.q.size(0)), static_cast<int>(p.q.size(1)),
                                  static_cast<int>(p.q.size(2)));
  const FaultSink fault{p.fault, DeviceFaultOp::kMlaDecode};
  run_decode(a, fault, p.cache.dtype == KvDtype::kFp8E4M3, p.num_splits, p.workspace, p.workspace_bytes, op, stream);
}

namespace mla {
namespace {
// The groups a dense prefill on `heads` heads could run in: as many new tokens as fill the rows of
// a CTA of the kernel that takes them, the wgmma kernel's 64 (H <= 32) where it serves fp8, else
// the narrow kernel's 16 (H <= 8, fp8); tokens 1 (per token) where neither does.
struct GroupShape {
  int tokens = 1;
  DecodeKernel kernel = DecodeKernel::kWide;
};
// New tokens from which a prefill runs in groups on the narrow kernel: about four waves of its
// per-token CTAs (H200: 132 SMs x 4 CTAs of 8 rows). H200, LATENTKV_MLA_KERNEL=mma, H 8, us per token
// / in groups: 32 requests of 8 new tokens over 4K 194.6 / 224.0, 4 of 256 over 4K 695.2 / 725.3, a
// 2K prompt 392.8 / 287.6, 8 requests of 512 over 4K 2547.6 / 1988.9.
constexpr std::int64_t kNarrowGroupsFrom = 2048;
GroupShape group_shape(KvDtype dtype, int heads, int sm) {
  const bool fp8 = dtype == KvDtype::kFp8E4M3;
  if (heads <= kWgmmaRows / 2 && kernel_for(fp8, kWgmmaRows / heads * heads, sm) == DecodeKernel::kWgmma) {
    return {kWgmmaRows / heads, DecodeKernel::kWgmma};
  }
  if (fp8 && heads <= kNarrowMaxRows / 2) return {kNarrowMaxRows / heads, DecodeKernel::kNarrow};
  return {};
}
}  // namespace
}  // namespace mla

int mla_prefill_group_tokens(const MlaPrefillParams& p) {
  using namespace mla;
  const std::int64_t t = p.q.size(0), h = p.q.size(1), batch = p.seq_lens.size(0);
  if (t == 0 || batch == 0 || h < 1 || h > kWgmmaRows) return 1;
  const GroupShape shape = group_shape(p.cache.dtype, static_cast<int>(h), current_device_sm("mla_prefill"));
  if (shape.tokens == 1) return 1;
  const std::int64_t slots = group_slots(t, shape.tokens, batch);
  // The wgmma kernel: groups of at least half its 64 rows on average. Against per token (the narrow
  // kernel), H200, us: the groups lose only on tiny prefills in few groups (H 8, 32 requests of 8 new
  // tokens over 4K: 213.0 / 194.2; H 16, 4 of 64: 350.7 / 300.3), win on 13 of the 15 shapes measured
  // (H 8, 4 of 64: 154.0 / 192.4) and on all from 512 new tokens (H 8, 1 of 512: 222.1 / 350.6; H 32,
  // 4 of 256: 1313.0 / 3475.0), so the rule has no floor. The narrow kernel: groups of
  // at least 1.5 new tokens on average, since its 16-row instance, which every group runs, costs
  // about 1.4 times its 8-row one (H200: H 16 against H 8 decode, B 64 x 8K), and prefills of at
  // least kNarrowGroupsFrom new tokens: fewer run in a few waves of per-token CTAs, which the groups'
  // fewer but longer CTAs do not shorten.
  if (shape.kernel == DecodeKernel::kWgmma) return t * h >= slots * (kWgmmaRows / 2) ? shape.tokens : 1;
  return t >= kNarrowGroupsFrom && 2 * t >= 3 * slots ? shape.tokens : 1;
}

Plan plan_mla_decode_groups(const MlaDecodeParams& p, const DecodeGroups& g, int multiprocessors) {
  const std::int64_t capacity = p.block_table.size(1) * static_cast<std::int64_t>(p.cache.page_size);
  return mla::plan_splits(g.groups, g.tokens * static_cast<int>(p.q.size(1)), capacity,
                          p.cache.dtype == KvDtype::kFp8E4M3, multiprocessors, mla::kMinTokensPerSplit, p.num_splits,
                          "mla_prefill");
}

void launch_mla_decode_groups(const MlaDecodeParams& p, const DecodeGroups& g, cudaStream_t stream) {
  const mla::DecodeArgs a = mla::dense_args(p, g.groups, g.tokens, static_cast<int>(p.q.size(1)));
  mla::run_decode(a, FaultSink{}, p.cache.dtype == KvDtype::kFp8E4M3, p.num_splits, p.workspace, p.workspace_bytes,
                  "mla_prefill", stream, g.spans);
}

// Sparse decode is the same kernels over each query token's own index row: the B x q_len query
// tokens become independent "requests" of H rows whose tokens are their index_cols slots.
Plan plan_sparse_mla_decode(const SparseMlaDecodeParams& p, int multiprocessors, const char* op) {
  return mla::plan_splits(static_cast<int>(p.q.size(0) * p.q.size(1)), static_cast<int>(p.q.size(2)),
                          p.indices.size(2), p.cache.dtype == KvDtype::kFp8E4M3, multiprocessors,
                          mla::kMinTokensPerSparseSplit, p.num_splits, op);
}

void check_sparse_mla_decode_call(const SparseMlaDecodeParams& p, const char* op) {
  check_fault_record(p.fault, op);
  check_decode_call({op, p.q.size(0) * p.q.size(1), p.q.size(2), p.num_splits, p.q.data, p.o.data, p.cache.data,
                     p.workspace, p.workspace_bytes});
}

void launch_sparse_mla_decode(const SparseMlaDecodeParams& p, cudaStream_t stream, const SparseDecodeCaller& caller) {
  using namespace mla;
  check_sparse_mla_decode_call(p, caller.op);
  DecodeArgs a{};
  a.q = p.q.as<const std::uint16_t>();
  a.cache = p.cache.data;
  a.indices = p.indices.as<const std::int32_t>();
  a.index_cols = static_cast<int>(p.indices.size(2));
  a.o = p.o.as<std::uint16_t>();
  a.lse = p.lse.as<float>();
  a.num_pages = p.cache.num_pages;
  a.page_size = p.cache.page_size;
  a.batch = static_cast<int>(p.q.size(0) * p.q.size(1));
  a.q_len = 1;
  a.heads = static_cast<int>(p.q.size(2));
  a.rows = a.heads;
  a.scale_log2 = p.softmax_scale * kLog2e;
  FaultSink fault{p.fault, caller.fault_op};
  fault.row_base = caller.first_row;
  run_decode(a, fault, p.cache.dtype == KvDtype::kFp8E4M3, p.num_splits, p.workspace, p.workspace_bytes, caller.op, stream);
}

std::string mla_prefill_kernel_name(KvDtype dtype, int heads, int sm) {
  const std::string per_token = "per-token " + mla_decode_kernel_name(dtype, heads, sm);
  const mla::GroupShape shape = heads <= mla::kWgmmaRows ? mla::group_shape(dtype, heads, sm) : mla::GroupShape{};
  if (shape.tokens == 1) return "mla_prefill = " + per_token;
  const std::string when = shape.kernel == mla::DecodeKernel::kWgmma
                               ? "when the groups would be less than half full on average"
                               : "below " + std::to_string(mla::kNarrowGroupsFrom) +
                                     " new tokens or groups of fewer than 1.5 on average";
  return "mla_prefill = groups of " + std::to_string(shape.tokens) + " new tokens on " +
         mla_decode_kernel_name(dtype, shape.tokens * heads, sm) + " (" + per_token + " " + when + ")";
}

std::string mla_decode_kernel_name(KvDtype dtype, int rows, int sm, bool sparse) {
  const std::string op = sparse ? "sparse_mla_decode" : "mla_decode";
  const bool fp8 = dtype == KvDtype::kFp8E4M3;
  switch (mla::kernel_for(fp8, rows, sm)) {
    case mla::DecodeKernel::kNarrow: return op + "_narrow<fp8, " + std::to_string(rows <= 8 ? 8 : 16) + " rows>";
    case mla::DecodeKernel::kWgmma: return op + "_wgmma<fp8, " + std::to_string(mla::kWgmmaRows) + " rows/cta>";
    case mla::DecodeKernel::kWide: break;
  }
  return op + "<" + (fp8 ? "fp8" : "bf16") + ", " + std::to_string(mla::groups_for(rows) * mla::kRowsPerGroup) +
         " rows/cta>";
}

}  // namespace latentkv::cuda
