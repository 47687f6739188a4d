// src/cuda/mla/decode_config.hpp - tile sizes and the shared-memory plan of dense MLA decode.
//
// One CTA computes kGroups x 16 query rows (rows are (q position, head) pairs of one request) over
// one KV chunk of that request, 32 tokens per tile. Four warps per row group:
//   scores  S = Q K^T: warp w owns tokens [8w, 8w + 8) of the tile, all 576 dims;
//   output  O += P V: warp w owns output dims [128w, 128w + 128), i.e. exactly fp8 scale block w,
//                    so the per-token scale of its block folds into P (no per-element scaling).
// The fp8 codes are converted to bf16 unscaled (exact) in shared memory; the four per-block scales
// multiply the four partial score accumulators.
//
// Sizes (bytes): kGroups = 1: 59,904; kGroups = 2: 81,664 - both under the 99 KB a block may use on
// sm_120 (and sm_89), so one plan serves every architecture.
#pragma once

#include <cstddef>
#include <cstdint>

#include "latentkv/ops.hpp"

namespace latentkv::cuda::mla {

inline constexpr int kTileTokens = 32;
inline constexpr int kRowsPerGroup = 16;
inline constexpr int kWarpsPerGroup = 4;
inline constexpr int kDimQk = 576;
inline constexpr int kDimV = 512;
inline constexpr int kRowStride = kDimQk + 8;  // bf16 elements; +16 bytes keeps ldmatrix rows off one bank
inline constexpr int kPStride = 40;            // floats; conflict-free float2 reads of P per half-warp

template <int kGroups>
struct DecodeSmem {
  static constexpr std::size_t kQ = 0;                                                   // bf16 [kGroups*16][kRowStride]
  static constexpr std::size_t kK = kQ + sizeof(short) * kGroups * kRowsPerGroup * kRowStride;  // bf16 [32][kRowStride]
  static constexpr std::size_t kScale = kK + sizeof(short) * kTileTokens * kRowStride;           // f32 [32][4]
  static constexpr std::size_t kP = kScale + sizeof(float) * kTileTokens * 4;                    // f32 [kGroups][16][kPStride]
  static constexpr std::size_t kRedMax = kP + sizeof(float) * kGroups * kRowsPerGroup * kPStride;  // f32 [kGroups][4][16]
  static constexpr std::size_t kRedSum = kRedMax + sizeof(float) * kGroups * kWarpsPerGroup * kRowsPerGroup;
  static constexpr std::size_t kSlots = kRedSum + sizeof(float) * kGroups * kWarpsPerGroup * kRowsPerGroup;  // i32 [2][32]
  static constexpr std::size_t kBytes = kSlots + sizeof(int) * 2 * kTileTokens;
  static_assert(kBytes <= 99 * 1024, "must fit the 99 KB per block of sm_89 and sm_120");
};

// Split-KV: plan_mla_decode() fills one wave of resident CTAs (the occupancy API's count) and gives
// each split at least kMinTokensPerSplit tokens. On the H200 (2026-11-29, docs/benchmarks.md): 256
// tokens per split ran glm5 B 1 L 32K in 41.2 us with the first kernel, 128 in 27.2 us with the
// narrow one. B 64 L 8K with a fixed 3 CTAs/SM target ran 448 CTAs on 396 slots (a partial second
// wave): 232.7 us; one full wave (6 splits, 384 CTAs): 161.2 us.
inline constexpr int kMinTokensPerSplit = 128;
// Short requests take shorter splits: one tile a split while batch x row blocks x splits stays
// within kShortSplitGrid CTAs, else two tiles while it stays within twice that, never more than
// kShortSplitsMost splits a request; each CTA then streams fewer tiles one after another, and the
// combine costs less than the tiles saved. Larger grids keep kMinTokensPerSplit. On the H200 (glm5
// tp 8, 8 rows, 32-token tiles; docs/benchmarks.md, thirty-third session), against 128-token splits:
// B 1 L 2K 14.2 -> 10.8 us (16 -> 64 splits), L 4K 13.4 -> 11.2, L 8K 13.9 -> 12.8 (64 -> 128 of two
// tiles), B 2 L 2K 15.5 -> 11.5, B 8 L 2K 16.3 -> 14.7 (16 -> 32 of two tiles), B 2 L 8K 15.2 -> 14.8,
// bf16 B 8 L 2K 21.6 -> 19.0; deepseek tp 1 (wgmma, 64-token tiles) B 1 L 2K 27.1 -> 23.0. Lost: B 4
// L 4K 14.9 -> 15.3 (32 -> 64 of two tiles); B 5 L 2K read 13.3 with the one-tile rule alone (25
// splits of three tiles, 125 CTAs) and 14.1 with this one (32 of two); B 1 L 16K would read
// 14.8 -> 15.4 (128 -> 256 of two tiles, hence kShortSplitsMost) and B 8 L 2K 16.3 -> 16.9 with 49
// one-tile splits (392 CTAs).
inline constexpr int kShortSplitGrid = 128;
inline constexpr int kShortSplitTilesMost = 2;
inline constexpr int kShortSplitsMost = 128;
// The split count of that rule for a request of `tiles` tiles in a grid of `grid_base` CTAs a split
// (requests x row blocks), or 0 when the grid is too large for short splits or there are no tiles
// (a block table of no pages).
constexpr std::int64_t short_split_count(std::int64_t grid_base, std::int64_t tiles) {
  if (tiles <= 0) return 0;
  for (std::int64_t per = 1; per <= kShortSplitTilesMost; ++per) {
    const std::int64_t splits = (tiles + per - 1) / per;
    const std::int64_t longest = (tiles + splits - 1) / splits;  // per, or less for a request of one tile
    if (splits <= kShortSplitsMost && grid_base * splits <= kShortSplitGrid * longest) return splits;
  }
  return 0;
}
// Sparse rows hold at most 2048 tokens: with 128 per split one request ran on 16 CTAs (19.0 us for
// top-k 2048 at B 1 on the H200); one tile per split spreads it over 64 CTAs: 13.2 us.
inline constexpr int kMinTokensPerSparseSplit = 32;
inline constexpr int kMaxSplits = ::latentkv::kMaxSplits;  // the combine step keeps one weight per split in shared memory

}  // namespace latentkv::cuda::mla
