// MLA decode for many query rows over the fp8 cache on sm_90a: warpgroup tensor cores (wgmma).
// Serves dense decode, sparse decode and both prefills (which run as decode) when a request has more
// than 32 query rows (q_len x H, up to 512; sparse: H): H 64 and 128, or q_len x H above 32.
// SPEC 4.2, 4.6.
//
// One CTA: 64 query rows of one request (rows = (q position, head) pairs; sparse: the heads of one
// query token) over one split of its tokens, 64 tokens per tile, two warpgroups (256 threads).
//   * Queries: the latent part as f16, each row scaled by a power of two so that its largest value
//     lies in [2^12, 2^13) (as in decode_narrow.cu), the rope part as bf16.
//   * K tiles: two buffers, each 9 column blocks of 64 dims (the 128-byte-swizzled K layout of
//     wgmma.cuh): the fp8 codes as f16 (exact, unscaled; one cvt per two codes, NaN codes staying
//     NaN), the rope bf16 as stored. The four per-block scales of each token are kept aside.
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
// A tile moves through the two K buffers in three steps, none of which needs a CTA barrier of its
// own (barrier (A) below publishes the result):
//   * while the tensor cores score tile t (once the rope's and block 2g's groups are issued), the
//     next tile's entries go out by cp.async into the other K buffer: warp w's lanes copy column
//     block w's codes of all 64 tokens into the upper half of that block (64 bytes a token), each
//     warpgroup's warps its half of the rope straight into its swizzled place, lanes 0-7 of warp w
//     the scales of tokens 8w .. 8w + 7 aside. A tile of a dense call whose 64 tokens are 64
//     consecutive slots (inside one page of 64 tokens or more: every whole tile at the usual page
//     sizes) goes out instead as 10 bulk tensor copies (TMA) from thread 0 into the same places,
//     completing on an mbarrier of its buffer. The cp.async path costs every warp about 200
//     instructions a tile, each copy's slot load, address and predicate one after another at 255
//     registers: 17% of the samples of an ncu source profile (H100, H 128 B 16 x 8K). The bulk path
//     took H 128 B 64 decode from 598.2-602.3 to 566.7-567.2 us and dense prefill H 64 over 32K from
//     76.7-76.8 to 71.5-71.9 ms (H100, the same call, fifty-eighth session);
//   * after S(t) each warpgroup's score partials go to the lower halves of the other warpgroup's
//     column blocks in that buffer (free until converted), and are read there by their owner;
//   * once tile t's P V is issued, warp w converts column block w of the next tile in place, 8
//     tokens a step, while the tensor cores run P V (step i reads tokens 8i .. 8i + 7's codes and
//     writes their f16 rows, which never cover the codes of a later step), and its lanes 0-7 store
//     their tokens' scales per block.
// Two CTA barriers per tile: (A) the next K tile converted and this tile's P V done, (B) the score
// partials exchanged. (Two score accumulators, so that block 2g's fold overlaps block 2g + 1's
// products, were measured on an H200: H 128 B 64 decode 611 -> 618 us, sparse prefill H 128 10.07 ->
// 9.99 ms, dense prefill H 64 79.4 -> 78.5 ms, with more spills; not kept - docs/benchmarks.md,
// twentieth session of 2026-12-03. Nor did S of tile t + 1 issued before P V of tile t, on 32-token
// tiles in four K buffers, so that the fold, exchange and softmax of t + 1 and the conversion of
// t + 2 ran beside P V of t: H100, H 128 B 64 decode 598 -> 748-754 us, sparse prefill H 128 9.9 ->
// 12.1 ms; its warps' own instruction chains hold it (6.4 cycles between a warp's instructions, 2
// warps per scheduler, the tensor pipe 27% busy) - fifty-eighth session, commit 8d847a0.) Shared
// memory: 226,372 bytes (with the alignment slack), so sm_90 only; the 99 KB kernels of decode.cu
// serve sm_89, sm_100 and sm_120, and bf16 caches.
#include <cuda.h>  // CUtensorMap: the type only; the encoder comes through the runtime's driver entry point
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/chained_launch.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/common/mma.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/mla/decode_common.cuh"
#include "cuda/mla/decode_config.hpp"
#include "latentkv/environment.hpp"
#include "latentkv/error.hpp"

namespace latentkv::cuda::mla {
namespace {

// [[maybe_unused]] below: names only the kernel body uses, which targets without wgmma compile out.
constexpr int kThreads = 256;       // two warpgroups
constexpr int kRows = kWgmmaRows;   // query rows per CTA
constexpr int kTile = kWgmmaTile;   // tokens per tile
constexpr int kTokenBytes = 656;  // fp8 main-cache entry: 512 codes, 4 scales, 64 bf16 rope dims
constexpr int kColumnBlocks = 9;    // 576 dims in blocks of 64 (128-byte rows)
constexpr int kBlockBytes = 64 * wgmma::kSwizzleRowBytes;  // one column block of 64 rows or tokens
[[maybe_unused]] constexpr int kHalfBlock = kBlockBytes / 2;  // a block's upper half: its codes before conversion
constexpr int kTileBytes = kColumnBlocks * kBlockBytes;    // one K tile (or the queries)
constexpr int kSlotRing = 3;        // tiles whose slots are kept: this one's (masks), the next two's (copies)
// The slot of a token whose V values or scales held a non-finite value that convert_tile zeroed
// (a token some row does not see): the rows that see it score it NaN.
[[maybe_unused]] constexpr std::int32_t kPoisonedSlot = INT32_MIN;

struct WgmmaSmem {
  static constexpr int kQ = 0;                                   // f16/bf16 [9 blocks][64 rows][64], swizzled
  static constexpr int kK = kQ + kTileBytes;                     // f16/bf16 [2 buffers][9 blocks][64 tokens][64]
  static constexpr int kScale = kK + 2 * kTileBytes;             // f32 [2 buffers][4 blocks][64 tokens]
  static constexpr int kScaleIn = kScale + 2 * 4 * 4 * kTile;    // f32 [64 tokens][4]: the next tile's, as copied
  static constexpr int kQScale = kScaleIn + 4 * 4 * kTile;       // f32 [64 rows], 2^-e of the f16 queries
  static constexpr int kSlots = kQScale + 4 * kRows;             // i32 [kSlotRing][64 tokens]
  static constexpr int kAllRead = kSlots + 4 * kSlotRing * kTile;  // i32 [kSlotRing][2 warps]: every slot >= 0
  static constexpr int kRuns = kAllRead + 4 * kSlotRing * 2;     // i32 [kSlotRing][2 warps]: first slot of a run, or -1
  static constexpr int kBars = kRuns + 4 * kSlotRing * 2;        // u64 [2 buffers]: a bulk-copied tile's barrier
  static constexpr int kHiddenFrom = kBars + 8 * 2;              // i32: first_hidden_token (decode_common.cuh)
  static constexpr int kBytes = kHiddenFrom + 4;
  static_assert(kBars % 8 == 0, "mbarriers are 8-byte aligned");
  static constexpr int kAlloc = kBytes + 1024;  // room to align the swizzled blocks to 1024 bytes
  static_assert(kQ % 1024 == 0 && kK % 1024 == 0, "swizzled blocks start on 1024-byte boundaries");
  static_assert(kAlloc <= 227 * 1024, "must fit the 227 KB per block of sm_90");
};

// Tensor maps of the fp8 pool, viewed as [pool tokens][656 bytes], for tiles whose 64 tokens are 64
// consecutive slots (a dense request's tile inside one page of 64 tokens or more): one thread then
// copies the whole tile with 10 bulk tensor copies into the layout the cp.async path builds, instead
// of 256 threads issuing 2-3 cp.async each. Disabled (enabled = 0) where the driver offers no
// encoder or the pool does not fit a map; every tile then takes cp.async.
struct TileMaps {
  CUtensorMap codes;   // box 64 tokens x 64 bytes at byte 64w: column block w's codes
  CUtensorMap rope;    // box 64 tokens x 128 bytes at byte 528, 128-byte swizzle: the rope block as wgmma reads it
  CUtensorMap scales;  // box 64 tokens x 16 bytes at byte 512
  int enabled;
};

// Barrier of one warpgroup's 128 threads (ids 1 and 2; 0 is __syncthreads'), `wg` warp-uniform.
[[maybe_unused]] __device__ __forceinline__ void warpgroup_barrier(int wg) {
  if (wg == 0) asm volatile("bar.sync 1, 128;\n" ::: "memory");
  else asm volatile("bar.sync 2, 128;\n" ::: "memory");
}

// kGrouped: the requests are groups of a dense prefill's new tokens (DecodeGroups): request b's
// query rows are those of its spans[b].y tokens, from row spans[b].x * H of q, o and lse on.
// kHidden: the causal mask may hide a request's newest tokens from some of its rows (q_len > 1, or
// a grouped prefill), whose non-finite values convert_tile then keeps out of those rows. Only
// there: in the tile loop of calls that need none of it (q_len 1: every decode and sparse row, a
// prefill per token) the same code cost 1.5-2.5% (H200, H 128 B 64 x 8K: 614.5 against 604.7 us,
// sparse H 128 173.2 against 169.3, prefill H 64 over 32K 79.6 against 78.5 ms).
// kBulk: the call has tile maps (a dense decode or prefill, whose tiles are mostly runs of
// consecutive slots); sparse calls, whose selected slots rarely are, run without the run bookkeeping
// (it cost them 4% on an H100: H 128 B 64 sparse decode 167.0-167.6 -> 173.7-173.8 us).
template <bool kChecks, bool kGrouped, bool kHidden, bool kBulk>
__global__ void __launch_bounds__(kThreads, 1)
    decode_wgmma_kernel(const DecodeArgs a, const FaultSink fault, const int2* spans,
                        const __grid_constant__ TileMaps maps) {
  static_assert(!(kChecks && kGrouped), "grouped prefills are checked before the decode (prefill_rows.hpp)");
  static_assert(kHidden || !kGrouped, "a group's tokens are causal among themselves");
#if LKV_WGMMA
  using Smem = WgmmaSmem;
  extern __shared__ __align__(16) unsigned char smem_base[];
  unsigned char* smem = smem_base + ((1024u - (smem_addr(smem_base) & 1023u)) & 1023u);
  unsigned char* q_s = smem + Smem::kQ;
  unsigned char* k_base = smem + Smem::kK;                              // [2 buffers][kTileBytes]
  auto* scale_base = reinterpret_cast<float*>(smem + Smem::kScale);      // [2 buffers][4 blocks][64 tokens]
  auto* scale_in_s = reinterpret_cast<float4*>(smem + Smem::kScaleIn);  // [64 tokens]
  auto* q_scale_s = reinterpret_cast<float*>(smem + Smem::kQScale);
  auto* slot_s = reinterpret_cast<std::int32_t*>(smem + Smem::kSlots);
  auto* all_read_s = reinterpret_cast<std::int32_t*>(smem + Smem::kAllRead);
  auto* hidden_from_s = reinterpret_cast<std::int32_t*>(smem + Smem::kHiddenFrom);
  auto* run_s = reinterpret_cast<std::int32_t*>(smem + Smem::kRuns);
  auto* bars = reinterpret_cast<std::uint64_t*>(smem + Smem::kBars);

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
  const SplitRange range = split_range<kChecks>(a, fault, b, split, a.num_splits, kTile);
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
  // Slots of tiles 0 and 1 now (both entries loaded before either is used); the block-table (or
  // index) entries of tile t + 2 are loaded during tile t - 1 and made slots during tile t.
  std::int32_t ahead_entry = -1;
  int bad_token = -1;  // the last of this thread's tokens with an entry outside the pool (note_bad_entry)
  // Warps 0 and 1 (tokens 0-31 and 32-63 of the tile): the warp's first slot if its 32 slots are
  // consecutive and all in the pool, else -1. The tile is one run (bulk_tile) when both are and
  // the second continues the first.
  const auto note_run = [&](int tile, std::int32_t slot) {
    if constexpr (!kBulk) return;
    const std::int32_t first = __shfl_sync(0xffffffffu, slot, 0);
    const bool run = __all_sync(0xffffffffu, slot >= 0 && slot == first + lane);
    if (lane == 0) run_s[(tile % kSlotRing) * 2 + tid / 32] = run ? first : -1;
  };
  const auto bulk_tile = [&](int tile) {
    const std::int32_t* run = run_s + (tile % kSlotRing) * 2;
    return kBulk && run[0] >= 0 && run[1] == run[0] + 32;
  };
  if (tid < kTile) {
    const int t0 = begin + tid, t1 = begin + kTile + tid;
    const std::int32_t e0 = num_tiles > 0 && t0 < end ? load_token_entry(a, b, t0) : -1;
    const std::int32_t e1 = num_tiles > 1 && t1 < end ? load_token_entry(a, b, t1) : -1;
    if (num_tiles > 2 && t1 + kTile < end) ahead_entry = load_token_entry(a, b, t1 + kTile);
    const std::int32_t s0 = num_tiles > 0 && t0 < end ? entry_to_slot(a, t0, e0, bad_token) : -1;
    const std::int32_t s1 = num_tiles > 1 && t1 < end ? entry_to_slot(a, t1, e1, bad_token) : -1;
    slot_s[tid] = s0;
    slot_s[kTile + tid] = s1;
    const bool all_read0 = __all_sync(0xffffffffu, s0 >= 0), all_read1 = __all_sync(0xffffffffu, s1 >= 0);
    if (lane == 0) {
      all_read_s[tid / 32] = all_read0;
      all_read_s[2 + tid / 32] = all_read1;
    }
    note_run(0, s0);
    note_run(1, s1);
  }
  if (kBulk && tid == 0) {
    bulk::init(bars, 1);
    bulk::init(bars + 1, 1);
    bulk::fence_init();
  }
  if (kHidden && tid == 0) {
    *hidden_from_s = first_hidden_token(visible_tokens(a, rows, len, row_base), rows.count - row_base, len);
  }
  wgmma::fence_shared_for_async();
  __syncthreads();  // the queries, the first slots and hidden_from

  const int warp = tid / 32;
  // cp.async of a tile's entries into K buffer tile % 2; a slot of -1 (outside the pool, no index)
  // reads nothing (zeros: an unread token's V meets P = 0, never NaN). Warp w: the codes of column
  // block w, lane l taking piece l % 4 (16 codes) of tokens l / 4 + 8i, into the block's upper half
  // (64 bytes a token); warpgroup g's rope half (pieces 4g .. 4g + 3), 2 pieces a lane; lanes 0-7
  // the scales of tokens 8w .. 8w + 7, which the same threads put in place after the conversion.
  // A tile of 64 consecutive slots instead goes out as 10 bulk tensor copies from thread 0 (the same
  // bytes to the same places, the rope already swizzled), completing on the buffer's barrier; the
  // fence orders the buffer's earlier reads, which barrier (A) made visible to thread 0, before them.
  auto issue_tile = [&](int tile) {
    unsigned char* k_s = k_base + (tile & 1) * kTileBytes;
    if (bulk_tile(tile)) {
      if (tid == 0) {
        const std::int32_t first = run_s[(tile % kSlotRing) * 2];
        std::uint64_t* bar = bars + (tile & 1);
        bulk::fence_for_copy();
        bulk::arrive_expect(bar, kTile * kTokenBytes);
#pragma unroll
        for (int w = 0; w < 8; ++w) {
          bulk::copy_box_2d(k_s + w * kBlockBytes + kHalfBlock, &maps.codes, 64 * w, first, bar);
        }
        bulk::copy_box_2d(k_s + 8 * kBlockBytes, &maps.rope, 528, first, bar);
        bulk::copy_box_2d(scale_in_s, &maps.scales, 512, first, bar);
      }
      return;
    }
    const std::int32_t* slots = slot_s + (tile % kSlotRing) * kTile;
    const auto entry = [&](std::int32_t slot) {
      return a.cache + (slot >= 0 ? static_cast<std::int64_t>(slot) * kTokenBytes : 0);
    };
    unsigned char* codes = k_s + warp * kBlockBytes + kHalfBlock;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int token = 8 * i + lane / 4, piece = lane % 4;
      const std::int32_t slot = slots[token];
      cp_async_16(codes + token * 64 + piece * 16, entry(slot) + warp * 64 + piece * 16, slot >= 0 ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int c = lane + 32 * i;
      const int token = 16 * wg_warp + c / 4, piece = 4 * wg + c % 4;
      const std::int32_t slot = slots[token];
      cp_async_16(k_s + 8 * kBlockBytes + wgmma::swizzled_chunk_offset(token, piece), entry(slot) + 528 + piece * 16,
                  slot >= 0 ? 16 : 0);
    }
    if (lane < 8) {
      const std::int32_t slot = slots[8 * warp + lane];
      cp_async_16(scale_in_s + 8 * warp + lane, entry(slot) + 512, slot >= 0 ? 16 : 0);
    }
    cp_async_commit();
  };
  // Warp w turns column block w of K buffer tile % 2 from the codes in its upper half into f16 rows,
  // in place, 8 tokens a step: lane l converts piece l % 4 of token 8i + l / 4 (the 16 bytes its own
  // copy brought, or the tile's bulk copies once its barrier completes) into its row's 16-byte chunks
  // 2 (l % 4), + 1 (swizzled; the 8 lanes of a store phase then cover 8 different chunks). Step i
  // reads bytes [4096 + 512i, +512) and writes rows 8i .. 8i + 7, bytes [1024i, +1024): the codes of
  // steps 2i - 8 and 2i - 7, never a later step's. So the warp syncs before steps 4 and 6 write, and
  // in step 7 between its reads and its writes. Then the scales copied by lanes 0-7 (or the bulk
  // copies), stored per block.
  std::uint32_t phases = 0;  // bit k: the phase of bars[k] that the next bulk tile of buffer k completes
  auto convert_tile = [&](int tile) {
    if (bulk_tile(tile)) {
      bulk::wait(bars + (tile & 1), (phases >> (tile & 1)) & 1u);
      phases ^= 1u << (tile & 1);
    } else {
      cp_async_wait<0>();  // this lane's copies
    }
    unsigned char* blk = k_base + (tile & 1) * kTileBytes + warp * kBlockBytes;
    const int sub = lane / 4, chunk = 2 * (lane % 4);
    const auto step = [&](int i) {
      const int token = 8 * i + sub;
      const uint4 v = *reinterpret_cast<const uint4*>(blk + kHalfBlock + 512 * i + 16 * lane);
      if (i == 4 || i == 6 || i == 7) __syncwarp();
      const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
      std::uint32_t out[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        out[2 * k] = fp8x2_to_f16x2(words[k]);
        out[2 * k + 1] = fp8x2_hi_to_f16x2(words[k]);
      }
      unsigned char* row = blk + token * wgmma::kSwizzleRowBytes;
      *reinterpret_cast<uint4*>(row + ((chunk ^ sub) * 16)) = make_uint4(out[0], out[1], out[2], out[3]);
      *reinterpret_cast<uint4*>(row + (((chunk + 1) ^ sub) * 16)) = make_uint4(out[4], out[5], out[6], out[7]);
    };
#pragma unroll 2
    for (int i = 0; i < 8; ++i) step(i);
    if (lane < 8) {
      const int token = 8 * warp + lane;
      const float4 v = scale_in_s[token];
      float* sc = scale_base + (tile & 1) * 4 * kTile + token;
      sc[0 * kTile] = nan_if_infinite(v.x);  // an infinite scale NaN (decode_common.cuh)
      sc[1 * kTile] = nan_if_infinite(v.y);
      sc[2 * kTile] = nan_if_infinite(v.z);
      sc[3 * kTile] = nan_if_infinite(v.w);
    }
    // Tokens that some row does not see (decode_common.cuh), from `first` on: their non-finite V
    // values zeroed (lane l takes 4-byte word l of each such row of the warp's block, which another
    // lane of the warp converted: hence the warp sync), their scales by the lanes that stored them,
    // and the token's slot poisoned so that the rows that do see it get a NaN score (the mask below).
    if constexpr (kHidden) {
      __syncwarp();
      const int tile_begin = begin + tile * kTile;
      if (const int first = max(*hidden_from_s - tile_begin, 0); first < kTile) {
        const int last = min(end - tile_begin, kTile);
        std::int32_t* slots = slot_s + (tile % kSlotRing) * kTile;
        const auto poison = [&](int token) {
          atomicMin(slots + token, kPoisonedSlot);
          atomicAnd(all_read_s + (tile % kSlotRing) * 2 + token / 32, 0);
        };
#pragma unroll 1
        for (int t = first; t < last; ++t) {
          auto* pair = reinterpret_cast<std::uint32_t*>(blk + t * wgmma::kSwizzleRowBytes) + lane;
          const std::uint32_t v = *pair, kept = finite_16x2<0x7C00u>(v);
          if (kept != v) {
            *pair = kept;
            poison(t);
          }
        }
        const int token = 8 * warp + lane;
        if (lane < 8 && token >= first && token < last) {
          float* sc = scale_base + (tile & 1) * 4 * kTile + token;
          bool finite = true;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            finite = finite && isfinite(sc[k * kTile]);
            sc[k * kTile] = finite_or_zero(sc[k * kTile]);
          }
          if (!finite) poison(token);
        }
      }
    }
    wgmma::fence_shared_for_async();
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
  const std::uint64_t k_desc0 = wgmma::desc_sw128(k_base, 16, wgmma::kSwizzleAtomBytes);
  const std::uint64_t v_desc0 = wgmma::desc_sw128(k_base, kBlockBytes, wgmma::kSwizzleAtomBytes);

  if (num_tiles > 0) {  // tile 0 into buffer 0
    issue_tile(0);
    convert_tile(0);
  }
  __syncthreads();  // tile 0 converted
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int cur = tile & 1, next = cur ^ 1;
    const float* scale_s = scale_base + cur * 4 * kTile;  // [4 blocks][64 tokens]
    const std::uint64_t k_desc = wgmma::desc_advance(k_desc0, cur * kTileBytes);
    const std::uint64_t v_desc = wgmma::desc_advance(v_desc0, cur * kTileBytes);

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
      // The next tile's copies go out while the tensor cores score this one, into the other
      // buffer, free since barrier (A) (at tile 0: since the prologue's barrier).
      if (tile + 1 < num_tiles) issue_tile(tile + 1);
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
    // They go through the next K buffer, not yet converted: warpgroup g's partial (float4 i of thread
    // t, i = 0 .. 7) to the lower half of column block 4 (1 - g) + i / 2 of the other warpgroup, at
    // float4 128 (i % 2) + t, where the other warpgroup reads it before it converts those blocks.
    const auto partial = [&](int owner, int i) {
      return reinterpret_cast<float4*>(k_base + next * kTileBytes + (4 * owner + i / 2) * kBlockBytes) +
             128 * (i % 2) + tid % 128;
    };
#pragma unroll
    for (int i = 0; i < 8; ++i) *partial(1 - wg, i) = make_float4(s[4 * i], s[4 * i + 1], s[4 * i + 2], s[4 * i + 3]);
    __syncthreads();  // (B) both partials
    {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float4 v = *partial(wg, i);
        s[4 * i] += v.x;
        s[4 * i + 1] += v.y;
        s[4 * i + 2] += v.z;
        s[4 * i + 3] += v.w;
      }
    }
    // Mask (unread: past the split, outside the pool, no index; or not yet visible to the row) and
    // scale into the log2 domain. Whole tiles every row sees skip the per-token tests.
    const int tile_begin = begin + tile * kTile;
    const int ring = tile % kSlotRing;
    const std::int32_t* tile_slots = slot_s + ring * kTile;  // [64]: this tile's slots, -1 unread
    const bool whole = all_read_s[ring * 2] && all_read_s[ring * 2 + 1] &&
                       tile_begin + kTile <= min(visible[0], visible[1]);
    if (whole) {
#pragma unroll
      for (int e = 0; e < 32; ++e) s[e] *= a.scale_log2;
    } else if constexpr (kHidden) {
#pragma unroll
      for (int e = 0; e < 32; ++e) {
        const int token = 8 * (e / 4) + 2 * quad + e % 2;
        const std::int32_t slot = tile_slots[token];
        const bool visible_here = tile_begin + token < visible[(e / 2) % 2];
        s[e] = slot >= 0 && visible_here            ? s[e] * a.scale_log2
               : slot == kPoisonedSlot && visible_here ? NAN
                                                       : -INFINITY;
      }
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

    // ---- while P V runs: the slots of tile + 2, and the next tile converted ----
    if (tid < kTile && tile + 2 < num_tiles) {
      const int t = begin + (tile + 2) * kTile + tid;
      const std::int32_t slot = t < end ? entry_to_slot(a, t, ahead_entry, bad_token) : -1;
      const int ahead = (tile + 2) % kSlotRing;  // tile - 1's, no longer read since barrier (A)
      slot_s[ahead * kTile + tid] = slot;
      const bool all_read = __all_sync(0xffffffffu, slot >= 0);
      if (lane == 0) all_read_s[ahead * 2 + tid / 32] = all_read;
      note_run(tile + 2, slot);
      ahead_entry = -1;
      if (tile + 3 < num_tiles && t + kTile < end) ahead_entry = load_token_entry(a, b, t + kTile);
    }
    if (tile + 1 < num_tiles) {
      warpgroup_barrier(wg);  // the warpgroup has read its partial from the blocks it converts now
      convert_tile(tile + 1);
    }
    wgmma::wait<0>();
    wgmma::fence_registers(o[0]);
    wgmma::fence_registers(o[1]);
    __syncthreads();  // (A) the next tile converted; this tile's K buffer no longer read by P V
  }

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
  __trap();  // launched only where wgmma_decode_available(sm) holds
#endif
}

// cuTensorMapEncodeTiled from the driver the runtime loaded (no link against libcuda), or null (the
// calls then take cp.async); a failed lookup's error is cleared, so that no later check reports it.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const auto encoder = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    const cudaError_t status =
        cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
    if (status != cudaSuccess) (void)cudaGetLastError();
    return status == cudaSuccess && found == cudaDriverEntryPointSuccess
               ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn)
               : nullptr;
  }();
  return encoder;
}

// The three maps of a call's pool (TileMaps), encoded on the host (three driver calls), kept per
// thread for the pools it launches on: a direct-mapped table of kMapSlots, so that a model's layers,
// each with its own pool, find theirs again, and a pool freed and reallocated elsewhere only takes
// a slot over.
constexpr int kMapSlotBits = 7;
constexpr std::size_t kMapSlots = std::size_t{1} << kMapSlotBits;  // 128, indexed by the hash's top bits
TileMaps tile_maps(const DecodeArgs& a) {
  struct Entry {
    const void* cache = nullptr;
    std::int64_t tokens = -1;
    TileMaps maps{};
  };
  thread_local std::vector<Entry> table(kMapSlots);
  const std::int64_t tokens = a.num_pages * a.page_size;
  // Pools start on large alignments (2 MB and up), so the slot comes from a multiplicative hash of
  // the whole address rather than from its low bits.
  const std::uint64_t address = reinterpret_cast<std::uintptr_t>(a.cache);
  const std::uint64_t hash = address * 0x9E3779B97F4A7C15ull;
  Entry& entry = table[static_cast<std::size_t>(hash >> (64 - kMapSlotBits))];
  if (entry.cache == a.cache && entry.tokens == tokens) return entry.maps;
  TileMaps maps{};
  const auto encode = tensor_map_encoder();
  const bool fits = tokens > 0 && tokens <= std::int64_t{INT32_MAX} - kTile &&  // a run's slot + lane stays an int
                    address % 16 == 0;
  if (encode != nullptr && fits) {
    const cuuint64_t dims[2] = {static_cast<cuuint64_t>(kTokenBytes), static_cast<cuuint64_t>(tokens)};
    const cuuint64_t strides[1] = {static_cast<cuuint64_t>(kTokenBytes)};
    const cuuint32_t unit[2] = {1, 1};
    const auto make = [&](CUtensorMap& map, cuuint32_t box_bytes, CUtensorMapSwizzle swizzle) {
      const cuuint32_t box[2] = {box_bytes, static_cast<cuuint32_t>(kTile)};
      return encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<std::uint8_t*>(a.cache), dims, strides, box,
                    unit, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                    CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
    };
    maps.enabled = make(maps.codes, 64, CU_TENSOR_MAP_SWIZZLE_NONE) &&
                   make(maps.rope, 128, CU_TENSOR_MAP_SWIZZLE_128B) && make(maps.scales, 16, CU_TENSOR_MAP_SWIZZLE_NONE);
  }
  entry = Entry{a.cache, tokens, maps};
  return maps;
}

template <bool kChecks = false, bool kGrouped = false, bool kHidden = kGrouped, bool kBulk = false>
int configure() {
  return allow_dynamic_smem(decode_wgmma_kernel<kChecks, kGrouped, kHidden, kBulk>, WgmmaSmem::kAlloc, "mla_decode");
}

// One instance for a call, with the tile maps where it reads a dense cache and they could be made.
template <bool kChecks, bool kGrouped, bool kHidden>
void launch_instance(const char* op, const DecodeArgs& a, const FaultSink& fault, const int2* spans, const dim3 grid,
                     cudaStream_t stream) {
  const TileMaps maps = a.indices == nullptr ? tile_maps(a) : TileMaps{};
  if (maps.enabled) {
    launch_chained(op, decode_wgmma_kernel<kChecks, kGrouped, kHidden, true>, grid, kThreads,
                   configure<kChecks, kGrouped, kHidden, true>(), stream, false, a, fault, spans, maps);
  } else {
    launch_chained(op, decode_wgmma_kernel<kChecks, kGrouped, kHidden, false>, grid, kThreads,
                   configure<kChecks, kGrouped, kHidden, false>(), stream, false, a, fault, spans, maps);
  }
}

// The decode instance for a call: with checks (a fault record) or not, and tokens hidden (q_len > 1) or not.
template <bool kHidden>
void launch_decode(const char* op, const DecodeArgs& a, const FaultSink& fault, const dim3 grid, cudaStream_t stream) {
  if (fault.record != nullptr) {
    launch_instance<true, false, kHidden>(op, a, fault, nullptr, grid, stream);
  } else {
    launch_instance<false, false, kHidden>(op, a, fault, nullptr, grid, stream);
  }
}

}  // namespace

bool wgmma_decode_available(int sm) { return wgmma_kernels_enabled("mla_decode", kMlaKernelVariable, sm); }

int wgmma_blocks_per_sm() {
  return resident_ctas_per_sm(decode_wgmma_kernel<false, false, false, false>, kThreads, configure(), "mla_decode");
}

void launch_decode_wgmma(const char* op, const DecodeArgs& a, const FaultSink& fault, const int2* spans,
                         cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.rows + kRows - 1) / kRows), static_cast<unsigned>(a.num_splits),
                  static_cast<unsigned>(a.batch));
  if (spans != nullptr) {
    if (fault.record != nullptr) throw Error(op, "fault", "a record", "none for the grouped decode");
    launch_instance<false, true, true>(op, a, fault, spans, grid, stream);
  } else if (a.q_len > 1) {
    launch_decode<true>(op, a, fault, grid, stream);
  } else {
    launch_decode<false>(op, a, fault, grid, stream);
  }
}

}  // namespace latentkv::cuda::mla
