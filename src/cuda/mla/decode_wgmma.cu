// MLA decode for many query rows over the fp8 cache on sm_90a: warpgroup tensor cores (wgmma).
// Serves dense decode, sparse decode and both prefills (which run as decode) when a request has more
// than 32 query rows (q_len x H, up to 512; sparse: H): H 64 and 128, or q_len x H above 32.
// SPEC 4.2, 4.6.
//
// One CTA: 64 query rows of one request (rows = (q position, head) pairs; sparse: the heads of one
// query token) over one split of its tokens, 64 tokens per tile, two warpgroups (256 threads).
//   * Loads: the next tile's 656-byte entries are copied raw by cp.async while this tile computes;
//     at the top of a tile the codes become f16 (exact, unscaled; one cvt per two codes, NaN codes
//     staying NaN) in the 128-byte-swizzled K layout of wgmma.cuh, the rope stays bf16 as stored,
//     and the four per-block scales are kept aside.
//   * Queries: the latent part as f16, each row scaled by a power of two so that its largest value
//     lies in [2^12, 2^13) (as in decode_narrow.cu), the rope part as bf16.
//   * S = Q K^T: both warpgroups score all 64 tokens of the tile for all 64 rows (m64n64k16, Q and
//     K from shared memory, f16 for the latent blocks, bf16 for the rope), warpgroup g over fp8 blocks
//     2g and 2g + 1 and rope dims [32g, 32g + 32): the rope straight into the scores, each block's
//     product (one accumulator, the blocks in turn) weighted by its token's block scale and the
//     row's query scale (the scores stay within SPEC's lse bound, as in decode.cu). The two partial
//     sums meet in shared memory; both warpgroups then hold the same scores (a + b = b + a exactly)
//     and run the same softmax, so P stays in registers, already in the A-fragment layout of the
//     P V product.
//   * O += P' V: warpgroup g owns output dims [256g, 256g + 256) = fp8 blocks 2g and 2g + 1. P' = P x
//     the token's scale of that block / the block's unit (the largest scale seen so far, so P' <= 1)
//     enters as A from registers in two f16 parts (hi + lo, as in decode.cu: one f16 P' breaks SPEC's
//     per-element tolerance on the GPU tests); V is the same K tile read N-major (m64n128k16). O is
//     rescaled when a unit grows and multiplied by it at the end.
// Three CTA barriers per tile: the raw tile is complete, the K tile converted, the score partials
// exchanged. Shared memory: 225,040 bytes (with the alignment slack), so sm_90 only; the 99 KB
// kernels of decode.cu serve sm_89, sm_100 and sm_120, and bf16 caches.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/chained_launch.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/common/mma.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/mla/decode_common.cuh"
#include "cuda/mla/decode_config.hpp"
#include "latentkv/error.hpp"

namespace latentkv::cuda::mla {
namespace {

constexpr int kThreads = 256;       // two warpgroups
constexpr int kRows = kWgmmaRows;   // query rows per CTA
constexpr int kTile = kWgmmaTile;   // tokens per tile
constexpr int kTokenBytes = 656;    // fp8 main-cache entry
[[maybe_unused]] constexpr int kTokenChunks = kTokenBytes / 16;
constexpr int kColumnBlocks = 9;    // 576 dims in blocks of 64 (128-byte rows)
constexpr int kBlockBytes = 64 * wgmma::kSwizzleRowBytes;  // one column block of 64 rows or tokens

struct WgmmaSmem {
  static constexpr int kQ = 0;                                        // bf16 [9 blocks][64 rows][64], swizzled
  static constexpr int kK = kQ + kColumnBlocks * kBlockBytes;          // bf16 [9 blocks][64 tokens][64], swizzled
  static constexpr int kRaw = kK + kColumnBlocks * kBlockBytes;        // u8  [64 tokens][656], the next tile
  static constexpr int kPartial = kRaw + kTile * kTokenBytes;          // f32 [2 warpgroups][8][128 threads][4]: S partials
  static constexpr int kScale = kPartial + 4 * 2 * kRows * kTile;      // f32 [4 blocks][64 tokens]
  static constexpr int kQScale = kScale + 4 * 4 * kTile;               // f32 [64 rows], 2^-e of the f16 queries
  static constexpr int kSlots = kQScale + 4 * kRows;                   // i32 [2][64 tokens]
  static constexpr int kAllRead = kSlots + 4 * 2 * kTile;             // i32 [2 tiles][2 warps]: every slot >= 0
  static constexpr int kBytes = kAllRead + 4 * 2 * 2;
  static constexpr int kAlloc = kBytes + 1024;  // room to align the swizzled blocks to 1024 bytes
  static_assert(kQ % 1024 == 0 && kK % 1024 == 0, "swizzled blocks start on 1024-byte boundaries");
  static_assert(kAlloc <= 227 * 1024, "must fit the 227 KB per block of sm_90");
};

// kGrouped: the requests are groups of a dense prefill's new tokens (DecodeGroups): request b's
// query rows are those of its spans[b].y tokens, from row spans[b].x * H of q, o and lse on.
template <bool kChecks, bool kGrouped>
__global__ void __launch_bounds__(kThreads, 1)
    decode_wgmma_kernel(const DecodeArgs a, const FaultSink fault, const int2* spans) {
  static_assert(!(kChecks && kGrouped), "grouped prefills are checked before the decode (prefill_rows.hpp)");
#if LKV_WGMMA
  using Smem = WgmmaSmem;
  extern __shared__ __align__(16) unsigned char smem_base[];
  unsigned char* smem = smem_base + ((1024u - (smem_addr(smem_base) & 1023u)) & 1023u);
  unsigned char* q_s = smem + Smem::kQ;
  unsigned char* k_s = smem + Smem::kK;
  unsigned char* raw_s = smem + Smem::kRaw;
  auto* x_s = reinterpret_cast<float4*>(smem + Smem::kPartial);
  auto* scale_s = reinterpret_cast<float*>(smem + Smem::kScale);
  auto* q_scale_s = reinterpret_cast<float*>(smem + Smem::kQScale);
  auto* slot_s = reinterpret_cast<std::int32_t*>(smem + Smem::kSlots);
  auto* all_read_s = reinterpret_cast<std::int32_t*>(smem + Smem::kAllRead);

  const int tid = threadIdx.x;
  const int lane = tid % 32;
  const int quad = lane % 4;
  // Warpgroup: S over fp8 blocks 2 wg, 2 wg + 1 and half the rope, O for dims [256 wg, +256).
  // Broadcast from lane 0 so that the compiler sees a warp-uniform value: the wgmma descriptors built
  // from it then stay in uniform registers instead of being rebuilt per instruction (8 instructions
  // each, in the SASS).
  const int wg = __shfl_sync(0xffffffffu, tid / 128, 0);
  const int wg_warp = (tid / 32) % 4;  // warp in the warpgroup: rows [16 wg_warp, +16)
  const int b = blockIdx.z;
  const int split = blockIdx.y;
  const int row_base = blockIdx.x * kRows;
  wait_for_previous_kernels();
  const RequestRows rows = request_rows<kGrouped>(a, spans, b);
  const SplitRange range = split_range<kChecks>(a, fault, b, split, kTile);
  const int len = range.len, begin = range.begin, end = range.end, num_tiles = range.num_tiles;

  // Queries into the swizzled layout (rows past the last are zero): warp w takes rows 8w .. 8w + 7,
  // lane l the latent pieces 2l, 2l + 1 (16 dims) of each, lanes 0-7 the rope pieces.
  for (int i = 0; i < kRows / 8; ++i) {
    const int r = 8 * (tid / 32) + i;
    const int row = row_base + r;
    uint4 w0 = make_uint4(0, 0, 0, 0), w1 = w0, rope = w0;
    if (row < rows.count) {
      const uint4* src = reinterpret_cast<const uint4*>(a.q + (rows.origin + row) * kDimQk);
      w0 = __ldg(src + 2 * lane);
      w1 = __ldg(src + 2 * lane + 1);
      if (lane < 8) rope = __ldg(src + 64 + lane);
    }
    note_nonfinite_q<kChecks>(a, fault, b, split, row, 2 * lane, w0);
    note_nonfinite_q<kChecks>(a, fault, b, split, row, 2 * lane + 1, w1);
    if (lane < 8) note_nonfinite_q<kChecks>(a, fault, b, split, row, 64 + lane, rope);
    std::uint32_t h[8];
    const float undo = latent_row_to_f16(w0, w1, h);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int piece = 2 * lane + half;
      *reinterpret_cast<uint4*>(q_s + (piece / 8) * kBlockBytes + wgmma::swizzled_chunk_offset(r, piece % 8)) =
          make_uint4(h[4 * half], h[4 * half + 1], h[4 * half + 2], h[4 * half + 3]);
    }
    if (lane < 8) *reinterpret_cast<uint4*>(q_s + 8 * kBlockBytes + wgmma::swizzled_chunk_offset(r, lane)) = rope;
    if (lane == 0) q_scale_s[r] = undo;
  }
  // Slots of tile 0 now; the block-table (or index) entry of tile 1 is loaded a tile ahead.
  std::int32_t ahead_entry = -1;
  int bad_token = -1;  // the last of this thread's tokens with an entry outside the pool (note_bad_entry)
  if (tid < kTile) {
    const std::int32_t slot = num_tiles > 0 ? token_slot(a, b, begin + tid, end, bad_token) : -1;
    slot_s[tid] = slot;
    const bool all_read = __all_sync(0xffffffffu, slot >= 0);
    if (lane == 0) all_read_s[tid / 32] = all_read;
    if (num_tiles > 1 && begin + kTile + tid < end) ahead_entry = load_token_entry(a, b, begin + kTile + tid);
  }
  wgmma::fence_shared_for_async();
  __syncthreads();

  // Moving a tile: warp `warp` takes tokens [8 warp, 8 warp + 8); lane l copies 16-byte chunk l of
  // each (16 codes), and the warp's 8 x 9 tail chunks (scales, then rope) go 32 at a time.
  const int warp = tid / 32;
  constexpr int kTail = kTokenChunks - 32;  // 9 tail chunks per token
  // cp.async of a tile's raw entries; a slot of -1 (outside the pool, no index) reads nothing.
  auto issue_raw = [&](int tile) {
    const std::int32_t* slots = slot_s + (tile & 1) * kTile + 8 * warp;  // [8]: this warp's tokens
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const std::int32_t slot = slots[i];
      const std::uint8_t* src = a.cache + (slot >= 0 ? static_cast<std::int64_t>(slot) * kTokenBytes : 0) + lane * 16;
      unsigned char* dst = raw_s + (8 * warp + i) * kTokenBytes + lane * 16;
      const int bytes = slot >= 0 ? 16 : 0;
      cp_async_16(dst, src, bytes);
    }
#pragma unroll
    for (int c = lane; c < 8 * kTail; c += 32) {
      const int i = c / kTail, piece = 32 + c % kTail;
      const std::int32_t slot = slots[i];
      const std::uint8_t* src = a.cache + (slot >= 0 ? static_cast<std::int64_t>(slot) * kTokenBytes : 0) + piece * 16;
      cp_async_16(raw_s + (8 * warp + i) * kTokenBytes + piece * 16, src, slot >= 0 ? 16 : 0);
    }
    cp_async_commit();
  };
  // The raw tile into f16 codes (K layout) and scales. For the codes, lane l converts chunk l of
  // token 8 warp + (i + l / 4) % 8 at step i: the 8 lanes writing one 16-byte column of the swizzled
  // blocks then hold 8 different tokens (rows), so neither the reads nor the writes share banks.
  auto convert_tile = [&]() {
    const int blk = lane / 4;                  // column block of this lane's 16 dims
    const int chunk = 2 * (lane % 4);          // its first 16-byte chunk in the block's 128-byte row
#pragma unroll 2
    for (int i = 0; i < 8; ++i) {
      const int sub = (i + blk) % 8;           // token % 8: the row's swizzle
      const int token = 8 * warp + sub;
      const uint4 v = *reinterpret_cast<const uint4*>(raw_s + token * kTokenBytes + lane * 16);
      const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
      std::uint32_t out[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        out[2 * k] = fp8x2_to_f16x2(words[k]);
        out[2 * k + 1] = fp8x2_hi_to_f16x2(words[k]);
      }
      unsigned char* row = k_s + blk * kBlockBytes + token * wgmma::kSwizzleRowBytes;
      *reinterpret_cast<uint4*>(row + ((chunk ^ sub) * 16)) = make_uint4(out[0], out[1], out[2], out[3]);
      *reinterpret_cast<uint4*>(row + (((chunk + 1) ^ sub) * 16)) = make_uint4(out[4], out[5], out[6], out[7]);
    }
#pragma unroll
    for (int c = lane; c < 8 * kTail; c += 32) {
      const int token = 8 * warp + c / kTail, piece = c % kTail;
      const uint4 v = *reinterpret_cast<const uint4*>(raw_s + token * kTokenBytes + (32 + piece) * 16);
      if (piece == 0) {  // the four scales, stored per block
        scale_s[0 * kTile + token] = __uint_as_float(v.x);
        scale_s[1 * kTile + token] = __uint_as_float(v.y);
        scale_s[2 * kTile + token] = __uint_as_float(v.z);
        scale_s[3 * kTile + token] = __uint_as_float(v.w);
      } else {  // rope, bf16 as stored: block 8
        *reinterpret_cast<uint4*>(k_s + 8 * kBlockBytes + wgmma::swizzled_chunk_offset(token, piece - 1)) = v;
      }
    }
  };

  // This thread's rows (the accumulator layout): r0 = 16 wg_warp + lane / 4, and r0 + 8.
  const int r_of[2] = {16 * wg_warp + lane / 4, 16 * wg_warp + lane / 4 + 8};
  int visible[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_base + r_of[h];
    visible[h] = visible_tokens(a, rows, len, row);
  }
  const float q_scale[2] = {q_scale_s[r_of[0]], q_scale_s[r_of[1]]};
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 domain, equal in both warpgroups
  float row_sum[2] = {0.0f, 0.0f};            // this thread's tokens only; summed over the quad at the end
  float unit[2] = {0.0f, 0.0f};               // largest scale seen of blocks 2 wg, 2 wg + 1 (equal in the warpgroup)
  float o[2][64];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int i = 0; i < 64; ++i) o[j][i] = 0.0f;
  }
  const std::uint64_t q_desc = wgmma::desc_sw128(q_s, 16, wgmma::kSwizzleAtomBytes);
  const std::uint64_t k_desc = wgmma::desc_sw128(k_s, 16, wgmma::kSwizzleAtomBytes);
  const std::uint64_t v_desc = wgmma::desc_sw128(k_s, kBlockBytes, wgmma::kSwizzleAtomBytes);

  if (num_tiles > 0) issue_raw(0);
  for (int tile = 0; tile < num_tiles; ++tile) {
    wgmma::wait<0>();  // this warpgroup's P V of the last tile no longer reads K
    wgmma::fence_registers(o[0]);
    wgmma::fence_registers(o[1]);
    cp_async_wait<0>();
    __syncthreads();  // (A) raw tile complete; K, scales, slots free
    convert_tile();
    if (tid < kTile && tile + 1 < num_tiles) {
      const int t = begin + (tile + 1) * kTile + tid;
      const std::int32_t slot = t < end ? entry_to_slot(a, t, ahead_entry, bad_token) : -1;
      slot_s[((tile + 1) & 1) * kTile + tid] = slot;
      const bool all_read = __all_sync(0xffffffffu, slot >= 0);
      if (lane == 0) all_read_s[((tile + 1) & 1) * 2 + tid / 32] = all_read;
      ahead_entry = -1;
      if (tile + 2 < num_tiles && t + kTile < end) ahead_entry = load_token_entry(a, b, t + kTile);
    }
    wgmma::fence_shared_for_async();
    __syncthreads();  // (B) K tile and the next tile's slots ready; raw free
    if (tile + 1 < num_tiles) issue_raw(tile + 1);

    // ---- this warpgroup's part of S for all 64 tokens: rope dims [32 wg, +32), then fp8 blocks 2 wg
    // and 2 wg + 1, each weighted by its token's block scale and the row's query scale ----
    float s[32];
    {
      float acc[32];
      auto issue_block = [&](int blk) {  // latent dims [128 blk, +128), f16, into acc
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
          const std::uint32_t off = (2 * blk + kk / 4) * kBlockBytes + (kk % 4) * 32;
          wgmma::mma_m64n64k16_ss<wgmma::Type::kF16>(acc, wgmma::desc_advance(q_desc, off), wgmma::desc_advance(k_desc, off),
                                                     kk > 0);
        }
        wgmma::commit();
      };
      // s += acc x the token's scale of block blk x the row's query scale.
      auto fold = [&](int blk) {
        wgmma::fence_registers(acc);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const float2 sc = *reinterpret_cast<const float2*>(scale_s + blk * kTile + 8 * i + 2 * quad);
#pragma unroll
          for (int e = 4 * i; e < 4 * i + 4; ++e) {
            s[e] = fmaf(acc[e], (e % 2 == 0 ? sc.x : sc.y) * q_scale[(e / 2) % 2], s[e]);
          }
        }
      };
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {  // rope, bf16, into s
        const std::uint32_t off = 8 * kBlockBytes + (2 * wg + kk) * 32;
        wgmma::mma_m64n64k16_ss<wgmma::Type::kBf16>(s, wgmma::desc_advance(q_desc, off), wgmma::desc_advance(k_desc, off),
                                                    kk > 0);
      }
      wgmma::commit();
      issue_block(2 * wg);
      wgmma::wait<0>();
      wgmma::fence_registers(s);
      fold(2 * wg);
      wgmma::fence();
      issue_block(2 * wg + 1);
      wgmma::wait<0>();
      fold(2 * wg + 1);
    }
    // The partials meet: thread t of one warpgroup holds the same (row, token) elements as thread t
    // of the other, and both add them in the same order (a + b = b + a), so both warpgroups hold the
    // same scores and run the same softmax: P stays in registers.
    {
      float4* mine = x_s + wg * 8 * 128 + (tid % 128);
#pragma unroll
      for (int i = 0; i < 8; ++i) mine[i * 128] = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
    }
    __syncthreads();  // (C) both partials
    {
      const float4* other = x_s + (1 - wg) * 8 * 128 + (tid % 128);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float4 v = other[i * 128];
        s[4 * i] += v.x;
        s[4 * i + 1] += v.y;
        s[4 * i + 2] += v.z;
        s[4 * i + 3] += v.w;
      }
    }
    // Mask (unread: past the split, outside the pool, no index; or not yet visible to the row) and
    // scale into the log2 domain. Whole tiles every row sees skip the per-token tests.
    const int tile_begin = begin + tile * kTile;
    const std::int32_t* tile_slots = slot_s + (tile & 1) * kTile;  // [64]: this tile's slots, -1 unread
    const bool whole = all_read_s[(tile & 1) * 2] && all_read_s[(tile & 1) * 2 + 1] &&
                       tile_begin + kTile <= min(visible[0], visible[1]);
    if (whole) {
#pragma unroll
      for (int e = 0; e < 32; ++e) s[e] *= a.scale_log2;
    } else {
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const int token = 8 * (e / 4) + 2 * quad + e % 2;
        const bool seen = tile_slots[token] >= 0 && tile_begin + token < visible[(e / 2) % 2];
        s[e] = seen ? s[e] * a.scale_log2 : -INFINITY;
      }
    }
    // Softmax over the tile, the same in both warpgroups; s becomes P.
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float m = -INFINITY;
#pragma unroll
      for (int i = 0; i < 8; ++i) m = fmaxf(m, fmaxf(s[4 * i + 2 * h], s[4 * i + 2 * h + 1]));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
      const float new_max = fmaxf(row_max[h], m);
      const float base = new_max == -INFINITY ? 0.0f : new_max;  // all scores -inf so far: p = 0
      alpha[h] = new_max == -INFINITY ? 1.0f : fast_exp2(row_max[h] - base);
      row_max[h] = new_max;
      float sum = 0.0f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        s[4 * i + 2 * h] = fast_exp2(s[4 * i + 2 * h] - base);
        s[4 * i + 2 * h + 1] = fast_exp2(s[4 * i + 2 * h + 1] - base);
        sum += s[4 * i + 2 * h] + s[4 * i + 2 * h + 1];
      }
      row_sum[h] = row_sum[h] * alpha[h] + sum;
    }
    // Rescale O only when a row's maximum moved (after the first tiles it rarely does).
    if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          o[j][4 * i + 0] *= alpha[0];
          o[j][4 * i + 1] *= alpha[0];
          o[j][4 * i + 2] *= alpha[1];
          o[j][4 * i + 3] *= alpha[1];
        }
      }
    }

    // ---- O += P' V for blocks 2 wg and 2 wg + 1 ----
    // First each block's unit: the scales this thread's fragments take (k = 16 kk + 2 quad + 8 half,
    // + 1) cover the tile's 64 between the quad's four lanes, so two shuffles give the tile's largest.
    // When a unit grows, O is rescaled here, before any P V group is in flight (the same in the
    // whole warpgroup).
    float inv_unit[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const float* sc = scale_s + (2 * wg + j) * kTile + 2 * quad;
      float mx = unit[j];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 v = *reinterpret_cast<const float2*>(sc + 8 * i);
        mx = fmaxf(mx, fmaxf(v.x, v.y));
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      inv_unit[j] = mx > 0.0f ? fast_rcp(mx) : 0.0f;
      if (mx != unit[j]) {
        const float gamma = mx > 0.0f ? unit[j] * inv_unit[j] : 1.0f;
#pragma unroll
        for (int i = 0; i < 64; ++i) o[j][i] *= gamma;
        unit[j] = mx;
      }
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int blk = 2 * wg + j;
      std::uint32_t a_hi[4][4], a_lo[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int part = 0; part < 4; ++part) {  // a0: (r, k), a1: (r + 8, k), a2: (r, k + 8), a3: (r + 8, k + 8)
          const int e = 4 * (2 * kk + part / 2) + 2 * (part % 2);  // P's accumulator elements (e, e + 1)
          const int k = 16 * kk + 2 * quad + 8 * (part / 2);
          const float2 sc = *reinterpret_cast<const float2*>(scale_s + blk * kTile + k);
          split_f16x2(s[e] * (sc.x * inv_unit[j]), s[e + 1] * (sc.y * inv_unit[j]), a_hi[kk][part], a_lo[kk][part]);
        }
      }
      wgmma::fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const std::uint64_t desc = wgmma::desc_advance(v_desc, 2 * blk * kBlockBytes + 16 * kk * wgmma::kSwizzleRowBytes);
        wgmma::mma_m64n128k16_rs<wgmma::Type::kF16>(o[j], a_hi[kk], desc);
        wgmma::mma_m64n128k16_rs<wgmma::Type::kF16>(o[j], a_lo[kk], desc);
      }
      wgmma::commit();
    }
  }
  wgmma::wait<0>();
  wgmma::fence_registers(o[0]);
  wgmma::fence_registers(o[1]);

  // ---- epilogue: row sums over the quad (each warpgroup saw every token), then this warpgroup's 256 dims ----
  allow_next_kernel();
  note_bad_entry<kChecks>(a, fault, b, bad_token);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = row_base + r_of[h];
    float total = row_sum[h];
    total += __shfl_xor_sync(0xffffffffu, total, 1);
    total += __shfl_xor_sync(0xffffffffu, total, 2);
    if (row >= rows.count) continue;
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    const float lse = row_lse(row_max[h], total);
    const std::int64_t out_row = rows.origin + row;                                // of o and lse
    const std::int64_t part_row = (static_cast<std::int64_t>(split) * a.batch + b) * a.rows + row;  // of the partials
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int dim0 = (2 * wg + j) * 128 + 2 * quad;
      const float f = inv * unit[j];
      if (a.num_splits == 1) {
        std::uint16_t* out = a.o + out_row * kDimV + dim0;  // bf16 [16 groups of 8 dims], 2 per thread
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          *reinterpret_cast<std::uint32_t*>(out + 8 * i) = pack_bf16x2(o[j][4 * i + 2 * h] * f, o[j][4 * i + 2 * h + 1] * f);
        }
      } else {
        float* out = a.o_part + part_row * kDimV + dim0;  // f32 [16 groups of 8 dims], 2 per thread
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          *reinterpret_cast<float2*>(out + 8 * i) = make_float2(o[j][4 * i + 2 * h] * f, o[j][4 * i + 2 * h + 1] * f);
        }
      }
    }
    if (wg == 0 && quad == 0) {
      if (a.num_splits == 1) a.lse[out_row] = lse;
      else a.lse_part[part_row] = lse;
    }
  }
#else
  (void)a;
  (void)spans;
  __trap();  // launched only where wgmma_decode_available() holds
#endif
}

template <bool kChecks = false, bool kGrouped = false>
int configure() {
  return allow_dynamic_smem(decode_wgmma_kernel<kChecks, kGrouped>, WgmmaSmem::kAlloc, "mla_decode");
}

}  // namespace

bool wgmma_decode_available() { return wgmma_kernels_enabled("mla_decode", "LATENTKV_MLA_KERNEL"); }

int wgmma_blocks_per_sm() {
  return resident_ctas_per_sm(decode_wgmma_kernel<false, false>, kThreads, configure(), "mla_decode");
}

void launch_decode_wgmma(const DecodeArgs& a, const FaultSink& fault, const int2* spans, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.rows + kRows - 1) / kRows), static_cast<unsigned>(a.num_splits),
                  static_cast<unsigned>(a.batch));
  if (spans != nullptr) {
    if (fault.record != nullptr) throw Error("mla_prefill", "fault", "a record", "none for the grouped decode");
    const int smem_bytes = configure<false, true>();
    launch_chained("mla_prefill", decode_wgmma_kernel<false, true>, grid, kThreads, smem_bytes, stream, false, a, fault,
                   spans);
  } else if (fault.record != nullptr) {
    launch_chained("mla_decode", decode_wgmma_kernel<true, false>, grid, kThreads, configure<true>(), stream, false, a,
                   fault, spans);
  } else {
    launch_chained("mla_decode", decode_wgmma_kernel<false, false>, grid, kThreads, configure<false>(), stream, false, a,
                   fault, spans);
  }
}

}  // namespace latentkv::cuda::mla
