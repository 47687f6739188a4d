// Lightning-indexer logits (SPEC 4.4) over the paged fp8 indexer cache (132 B/token, page-major),
// on the tensor cores: fp8 codes converted exactly to f16 on chip, f32 sums.
//
// Per token t and query row: logit_t = kscale_t * sum_h w_h relu(q_h . k_t). The dot products are
// one small matrix product per query row, S[token, head] = K[token, 0:128] . Q[head, 0:128]:
//   * A = 16 tokens x 16 dims of keys per warp and k-step, in the mma.m16n8k16 fragment layout. The
//     128 dims are visited in a permuted order (the same for keys and queries, so every product still
//     pairs the right values): lane (g, tig) supplies, over the eight k-steps, dims 16*tig .. 16*tig +
//     15 and 64 + 16*tig .. 64 + 16*tig + 15 - two 16-byte pieces of a token's key, converted to f16
//     once per tile.
//   * All query rows and weights of the request sit in shared memory as f16, heads padded with zero
//     queries and weights to a multiple of the heads one pass takes. A CTA owns a span of one
//     request's positions; the grid is one wave of resident CTAs (one CTA per request beyond that).
//   * Two kernels:
//       - sm_90 (logits_wgmma_kernel, pages of a multiple of 4 tokens): the CTA is one warpgroup
//         and takes 64 positions a turn (inside one page, across one page's end, or over several
//         pages: TurnWalk). One thread (over several pages, warp 0) streams the turns through a 3-stage
//         ring in shared memory with bulk copies (the copy engine, an mbarrier per stage); per query row
//         and pass of 8, 16 or 32 heads, eight m64nNk16 wgmma with the keys from registers (each warp
//         its 16 tokens) and the queries from shared memory (K-major, 128-byte swizzle, dims permuted
//         the same way);
//       - every other target, page size or LATENTKV_INDEXER_KERNEL=mma (logits_kernel): 4 warps take
//         16-token tiles in turn, each loading its next two tiles' keys into registers while it
//         computes the current one (the tiles rotate through registers by unrolling, not by copies);
//         per 8 heads eight m16n8k16 mma.sync steps, even and odd k-steps in two independent chains.
//     The sums are relu'd, weighted and summed across the 4 lanes of a quad, then scaled by kscale_t
//     and written. Positions a row cannot see get -inf.
//   * An indexer prefill on sm_90a runs its new tokens in groups of up to 4 (launch.hpp,
//     IndexerGroups): each group a request of the wgmma kernel whose query rows are its tokens',
//     so the keys of a turn are read and converted once for all of them.
//   * A call may also clear the next op's scratch (IndexerLogitsParams::clear: the top-k's row state
//     inside dsa_decode), spread over the whole grid while the first keys are loading. (Doing the
//     layer's append here as well, to save its kernel, was tried in five ways and never won: at one
//     request every CTA is on the critical path, so the append's fetch delays the kernel by about
//     what the append kernel costs, and its code slowed the turn loop - docs/benchmarks.md, ninth
//     session of 2026-12-01.)
// f16 holds every e4m3 value exactly, so each product is exact; the sums are float32 in tensor-core
// order. (mma.sync on raw e4m3 codes was tried first: sm_90 converts them to f16 inside every
// instruction, for every 8 heads again, which ran the kernel instruction-bound. The fp8 wgmma is not
// used: sm_90's fp8 tensor cores are reported to keep about 14 bits in their sums, far from float32.)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <string>

#include "cuda/common/bulk_copy.cuh"
#include "cuda/common/chained_launch.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/common/paging_check.cuh"
#include "cuda/common/paging_check.hpp"
#include "cuda/common/value_check.cuh"
#include "cuda/common/value_check.hpp"
#include "cuda/common/mma.cuh"
#include "cuda/common/wgmma.cuh"
#include "cuda/indexer/launch.hpp"
#include "latentkv/environment.hpp"
#include "latentkv/error.hpp"

namespace latentkv::cuda {
namespace {

constexpr int kDim = 128;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kHeadGroup = 8;  // heads per pass of the mma.sync head loop (one mma n-tile)

// Heads per pass of the wgmma head loop: the instruction's N, 8, 16 or 32 (more heads: passes of 32).
constexpr int wgmma_pass_heads(int heads) { return heads <= 8 ? 8 : heads <= 16 ? 16 : 32; }
// Heads rounded up to whole passes of `pass` heads.
__host__ __device__ constexpr int padded_heads(int heads, int pass) { return (heads + pass - 1) / pass * pass; }

struct LogitsArgs {
  const std::uint8_t* q;             // [B, q_len, Hi, 128] fp8
  const float* weights;              // [B, q_len, Hi]
  const std::uint8_t* cache;         // [num_pages, page_size * 132]
  const std::int32_t* block_table;   // [B, max_pages]
  const std::int32_t* seq_lens;      // [B]
  float* logits;                     // [B, q_len, max_len]
  uint4* clear;                      // [clear_pieces] set to zero on the way (another op's scratch)
  std::int64_t clear_pieces;
  unsigned* claimed;                 // wgmma: [B] turns claimed past the static spans (zero on entry and exit), or null
  int claim_from;                    // wgmma: the first claimed turn (past every CTA's span; turns when none)
  std::int64_t num_pages;
  int page_size;
  int page_shift;                    // log2(page_size) when a power of two, else -1
  int max_pages;
  int q_len;
  int heads;
  int max_len;
  int span;                          // one CTA's positions: 16-token tiles (mma.sync) or 64-token turns (wgmma)
};

// The request's length, clamped to [0, capacity of its block-table row] (check_request notes one
// outside it).
__device__ __forceinline__ int request_length(const LogitsArgs& a, int b) {
  const std::int64_t capacity = static_cast<std::int64_t>(a.max_pages) * a.page_size;
  return static_cast<int>(min(static_cast<std::int64_t>(max(a.seq_lens[b], 0)), capacity));
}

// Request b's query rows: `count` of them (its new tokens) from row `first` of q, weights and
// logits. A grouped prefill's request is a group of at most q_len new tokens (launch.hpp,
// IndexerGroups), the causal offset its own count: row i sees len - count + i + 1 positions.
struct QueryRows {
  std::int64_t first;
  int count;
};
template <bool kGrouped>
__device__ __forceinline__ QueryRows query_rows(const LogitsArgs& a, const int2* spans, int b) {
  if constexpr (kGrouped) {
    const int2 span = spans[b];
    return {span.x, span.y};
  } else {
    return {static_cast<std::int64_t>(b) * a.q_len, a.q_len};
  }
}

// Position t's page index in the block-table row, and its place in the page.
__device__ __forceinline__ int page_index(const LogitsArgs& a, int t) {
  return position_page(t, a.page_size, a.page_shift);
}
__device__ __forceinline__ int page_offset(const LogitsArgs& a, int t, int index) { return t - index * a.page_size; }

// The base of page `page` of the pool; null when the entry is outside the pool.
__device__ __forceinline__ const std::uint8_t* page_base(const LogitsArgs& a, std::int32_t page) {
  if (page < 0 || page >= a.num_pages) return nullptr;
  return a.cache + static_cast<std::int64_t>(page) * a.page_size * 132;
}

// The reference's checks of request b's length and of the pages it uses (validate.cpp), shared out
// over the request's CTAs: CTA c's thread i looks at pages c x kThreads + i + k x (all the request's
// threads), the first round's entry loaded ahead (one round covers every request whose pages are no
// more than its CTAs' threads). The kernels load it right after their first loads go out (the
// entries are those the first turns need, or near them) and compare after staging the queries; a
// fault goes to the call's record. The kernels themselves only skip a page outside the pool. Each
// kernel comes in two instances, with these checks (a call given a fault record) and without.
struct RequestCheck {
  static constexpr int kAhead = 1;
  std::int32_t len;
  std::int32_t entry[kAhead];
};
__device__ __forceinline__ RequestCheck load_request_check(const LogitsArgs& a, int b) {
  RequestCheck c{};
  c.len = a.seq_lens[b];
  const std::int64_t used = pages_to_check(c.len, a.max_pages, a.page_size);
  const std::int32_t* row = a.block_table + static_cast<std::int64_t>(b) * a.max_pages;
#pragma unroll
  for (int k = 0; k < RequestCheck::kAhead; ++k) {
    const int p = (k * gridDim.x + blockIdx.x) * kThreads + threadIdx.x;
    c.entry[k] = p < used ? row[p] : 0;
  }
  return c;
}
__device__ __forceinline__ void check_request(const LogitsArgs& a, const FaultSink& fault, int b,
                                              const RequestCheck& c) {
  if (blockIdx.x == 0 && threadIdx.x == 0) check_length(fault, b, c.len, a.max_pages, a.page_size, a.max_len);
  const std::int64_t used = pages_to_check(c.len, a.max_pages, a.page_size);
  const std::int32_t* row = a.block_table + static_cast<std::int64_t>(b) * a.max_pages;
  for (int k = 0;; ++k) {
    const int p = (k * gridDim.x + blockIdx.x) * kThreads + threadIdx.x;
    if (p >= used) break;
    const std::int32_t page = k < RequestCheck::kAhead ? c.entry[k] : row[p];
    check_page(fault, b, p, page, a.num_pages, c.len, a.page_size);
  }
}

// One token's 32 key bytes for this lane (dims 16*tig .. and 64 + 16*tig ..) and its scale; false
// (and zeros) when the position is past the request's length or its page is outside the pool.
template <bool kAligned16>
__device__ __forceinline__ bool load_key(const LogitsArgs& a, int b, int t, int len, int tig, uint4 (&k)[2],
                                         float& scale) {
  k[0] = k[1] = make_uint4(0, 0, 0, 0);
  scale = 0.0f;
  if (t >= len) return false;
  const int index = page_index(a, t), offset = page_offset(a, t, index);
  const std::uint8_t* page = page_base(a, a.block_table[static_cast<std::int64_t>(b) * a.max_pages + index]);
  if (page == nullptr) return false;
  const std::uint8_t* key = page + static_cast<std::int64_t>(offset) * kDim + 16 * tig;
  if constexpr (kAligned16) {
    k[0] = *reinterpret_cast<const uint4*>(key);
    k[1] = *reinterpret_cast<const uint4*>(key + kDim / 2);
  } else {  // pages of 132 x page_size bytes with page_size % 4 != 0: only 4-byte alignment
    const std::uint32_t* w = reinterpret_cast<const std::uint32_t*>(key);
    k[0] = make_uint4(w[0], w[1], w[2], w[3]);
    k[1] = make_uint4(w[16], w[17], w[18], w[19]);
  }
  scale = reinterpret_cast<const float*>(page + static_cast<std::int64_t>(a.page_size) * kDim)[offset];
  return true;
}

// Word w (4 codes) of a lane's 32 bytes.
__device__ __forceinline__ std::uint32_t word(const uint4 (&k)[2], int w) {
  const uint4& v = k[w / 4];
  switch (w % 4) {
    case 0: return v.x;
    case 1: return v.y;
    case 2: return v.z;
    default: return v.w;
  }
}

// A 16-token row tile: this lane's 32 key bytes of tokens g and g + 8, their scales and presence.
struct Tile {
  uint4 keys[2][2];
  float scales[2];
  bool cached[2];
};

template <bool kAligned16>
__device__ __forceinline__ void load_tile(const LogitsArgs& a, int b, int first, int len, int g, int tig, Tile& t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) t.cached[r] = load_key<kAligned16>(a, b, first + g + 8 * r, len, tig, t.keys[r], t.scales[r]);
}

// What a lane keeps for its whole walk.
struct Lane {
  int b, len;             // its request and the request's length
  QueryRows rows;         // the request's query rows
  int g, tig;             // its place in the warp (mma row group, thread in group)
  int padded;             // heads padded to whole passes
  const std::uint8_t* q;  // mma.sync: its f16 queries of head g, row 0 (its quarter tig), in shared memory
  int sw;                 // mma.sync: q_offset's swizzle of its pieces (the same for heads n + g, n a multiple of 8)
  const float* w;         // the weights [q_len, padded] in shared memory
  std::uint64_t q_desc;   // wgmma: the descriptor of the queries' first column block (row 0, heads 0 ..)
};

// One tile against every query row: S = K Q^T per pass of heads on the tensor cores, relu, weights,
// the sum over heads across the quad, kscale; -inf where the row cannot see. kWgmmaHeads = 0: per
// warp on mma.sync; else per warpgroup on wgmma, kWgmmaHeads heads a pass (all 4 warps call it
// together, each with its own tile).
template <int kWgmmaHeads>
__device__ __forceinline__ void tile_logits(const LogitsArgs& a, const Tile& t, int first, const Lane& l) {
  // A fragments of the 8 k-steps: step s covers this lane's word s (4 dims) of both rows.
  std::uint32_t frag[8][4];
#pragma unroll
  for (int s = 0; s < 8; ++s) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const std::uint32_t w = word(t.keys[r], s);
      frag[s][r] = fp8x2_to_f16x2(w);  // dims + 0, + 1
      frag[s][2 + r] = fp8x2_hi_to_f16x2(w);  // dims + 2, + 3
    }
  }
  for (int i = 0; i < l.rows.count; ++i) {
    float logit[2] = {0.0f, 0.0f};
    if constexpr (kWgmmaHeads == 0) {
#pragma unroll 1
      for (int n = 0; n < l.padded; n += kHeadGroup) {
        // Head n + g's 32 f16 queries of this lane's dims (pieces 0..3), and the weights of the heads
        // whose sums it holds (n + 2 tig, + 1).
        const std::uint8_t* q_head = l.q + (i * l.padded + n) * kDim * 2;
        uint4 q[4];
#pragma unroll
        for (int piece = 0; piece < 4; ++piece) q[piece] = *reinterpret_cast<const uint4*>(q_head + ((piece ^ l.sw) * 16));
        // Two independent chains: even and odd k-steps.
        float s[2][4] = {};
#pragma unroll
        for (int step = 0; step < 8; ++step) {
          const uint4 (&pair)[2] = *reinterpret_cast<const uint4(*)[2]>(&q[step / 4 * 2]);
          mma_f16_16816(s[step % 2], frag[step][0], frag[step][1], frag[step][2], frag[step][3], word(pair, 2 * (step % 4)),
                        word(pair, 2 * (step % 4) + 1));
        }
        const float2 w = *reinterpret_cast<const float2*>(l.w + i * l.padded + n + 2 * l.tig);
        logit[0] = fmaf(w.x, fmaxf(s[0][0] + s[1][0], 0.0f), fmaf(w.y, fmaxf(s[0][1] + s[1][1], 0.0f), logit[0]));
        logit[1] = fmaf(w.x, fmaxf(s[0][2] + s[1][2], 0.0f), fmaf(w.y, fmaxf(s[0][3] + s[1][3], 0.0f), logit[1]));
      }
    } else {
#pragma unroll 1
      for (int n = 0; n < l.padded; n += kWgmmaHeads) {
        // Query row i's heads n .. n + kWgmmaHeads - 1: two column blocks of 64 k positions (wgmma_q_offset).
        const std::uint64_t desc = wgmma::desc_advance(l.q_desc, (i * l.padded + n) * kDim * 2);
        float d[kWgmmaHeads / 2];
        wgmma::fence();
#pragma unroll
        for (int step = 0; step < 8; ++step) {
          wgmma::mma_m64nNk16_rs_f16<kWgmmaHeads>(
              d, frag[step], wgmma::desc_advance(desc, step / 4 * kWgmmaHeads * wgmma::kSwizzleRowBytes + step % 4 * 32),
              step > 0);
        }
        wgmma::commit();
        wgmma::wait<0>();
        wgmma::fence_registers(d);
        // d[4j ..]: heads n + 8j + 2 tig, + 1 of rows g and g + 8.
#pragma unroll
        for (int j = 0; j < kWgmmaHeads / 8; ++j) {
          const float2 w = *reinterpret_cast<const float2*>(l.w + i * l.padded + n + 8 * j + 2 * l.tig);
          logit[0] = fmaf(w.x, fmaxf(d[4 * j], 0.0f), fmaf(w.y, fmaxf(d[4 * j + 1], 0.0f), logit[0]));
          logit[1] = fmaf(w.x, fmaxf(d[4 * j + 2], 0.0f), fmaf(w.y, fmaxf(d[4 * j + 3], 0.0f), logit[1]));
        }
      }
    }
    const int visible = l.len - l.rows.count + i + 1;  // causal among the new tokens
    float* out = a.logits + (l.rows.first + i) * a.max_len;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float v = logit[r];
      v += __shfl_xor_sync(0xffffffffu, v, 1);
      v += __shfl_xor_sync(0xffffffffu, v, 2);
      const int pos = first + l.g + 8 * r;
      if (l.tig == 0 && pos < a.max_len) out[pos] = pos < visible && t.cached[r] ? v * t.scales[r] : -INFINITY;
    }
  }
}

// The next op's scratch, cleared by the whole grid (while a CTA's first keys are loading).
__device__ __forceinline__ void clear_scratch(const LogitsArgs& a) {
  const std::int64_t ctas = static_cast<std::int64_t>(gridDim.x) * gridDim.y;
  for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kThreads + threadIdx.x;
       i < a.clear_pieces; i += ctas * kThreads) {
    a.clear[i] = make_uint4(0, 0, 0, 0);
  }
}

// The first element of head h's query (row i of request b) in q, and its weight's in weights.
__device__ __forceinline__ std::int64_t weight_element(const LogitsArgs& a, int b, int i, int h) {
  return (static_cast<std::int64_t>(b) * a.q_len + i) * a.heads + h;
}
__device__ __forceinline__ std::int64_t query_element(const LogitsArgs& a, int b, int i, int h) {
  return weight_element(a, b, i, h) * kDim;
}
// The reference also refuses NaN query codes and non-finite weights: the first CTA of each request
// checks them as it stages them (the instances with checks only), each value once. The staging only
// remembers the last bad value a thread met; the kernel notes it once, after the staging.
struct BadValue {
  std::int64_t element = -1;  // -1: none
  std::uint32_t bits = 0;     // the fp8 code or the float's bits
  DeviceFaultCode code = DeviceFaultCode::kNone;
};
template <bool kChecks>
__device__ __forceinline__ void look_at_query_codes(const LogitsArgs& a, int b, int i, int h, int chunk,
                                                    const uint4& codes, BadValue& bad) {
  if constexpr (kChecks) {
    std::uint32_t code = 0;
    const int e = first_nan_fp8x16(codes, code);
    if (e >= 0 && blockIdx.x == 0 && h < a.heads) {
      bad = {query_element(a, b, i, h) + 16 * chunk + e, code, DeviceFaultCode::kIndexerQuery};
    }
  }
}
template <bool kChecks>
__device__ __forceinline__ void look_at_weight(const LogitsArgs& a, int b, int i, int h, float w, BadValue& bad) {
  if constexpr (kChecks) {
    if (nonfinite_f32(w) && blockIdx.x == 0 && h < a.heads) {
      bad = {weight_element(a, b, i, h), __float_as_uint(w), DeviceFaultCode::kWeight};
    }
  }
}
template <bool kChecks>
__device__ __forceinline__ void note_bad_value(const FaultSink& fault, const BadValue& bad) {
  if constexpr (kChecks) {
    if (bad.element >= 0) record_fault(fault, bad.code, {.index = bad.element, .value = bad.bits});
  }
}

// Request b's weights [q_len, padded] in shared memory, zeros for padded heads.
template <bool kChecks>
__device__ __forceinline__ void stage_weights(const LogitsArgs& a, int b, int padded, float* w_s, BadValue& bad) {
  const float* w = a.weights + static_cast<std::int64_t>(b) * a.q_len * a.heads;
  for (int j = threadIdx.x; j < a.q_len * padded; j += kThreads) {
    const int i = j / padded, h = j % padded;
    const float x = h < a.heads ? w[i * a.heads + h] : 0.0f;
    look_at_weight<kChecks>(a, b, i, h, x, bad);
    w_s[j] = x;
  }
}

// -inf at positions [from, to) of every query row of a request (past the length), by the whole CTA;
// with `share` of `shares`, only its share of them (every CTA of the request writing one).
__device__ __forceinline__ void write_unseen(const LogitsArgs& a, const QueryRows& rows, int from, int to,
                                             int share = 0, int shares = 1) {
  to = min(to, a.max_len);
  for (int i = 0; i < rows.count; ++i) {
    float* out = a.logits + (rows.first + i) * a.max_len;
    for (int pos = from + share * kThreads + static_cast<int>(threadIdx.x); pos < to; pos += shares * kThreads) {
      out[pos] = -INFINITY;
    }
  }
}

// ---- mma.sync: every target --------------------------------------------------------------------

// Shared-memory byte offset of 16-byte piece `piece` (0..3) of quarter `quarter` (0..3: the dims
// lane tig = quarter supplies) of head `head`'s f16 queries. The XOR swizzle spreads the 8 lanes of a
// load phase (heads g, g+1 of one 8-head tile, quarters 0..3) over all 8 16-byte bank groups.
__device__ __forceinline__ int q_offset(int row_head, int head, int quarter, int piece) {
  return row_head * kDim * 2 + quarter * 64 + ((piece ^ ((quarter >> 1) | ((head & 1) << 1))) * 16);
}

// One turn of a warp's walk: compute tile `tile` (its keys in `current`) after sending for the keys of
// the tile two turns ahead into `refill`; false (doing nothing) past the live tiles.
template <bool kAligned16>
__device__ __forceinline__ bool walk(const LogitsArgs& a, int tile, int live_end, const Lane& l, const Tile& current,
                                     Tile& refill) {
  if (tile >= live_end) return false;
  if (tile + 2 * kWarps < live_end) load_tile<kAligned16>(a, l.b, 16 * (tile + 2 * kWarps), l.len, l.g, l.tig, refill);
  tile_logits<0>(a, current, 16 * tile, l);
  return true;
}

// Grid (CTAs per request, B). A CTA stages every query row of its request in shared memory once (as
// f16), then its warps walk the CTA's span of tiles, each loading its next tile while computing this one.
// At most 128 registers (4 CTAs, 16 warps per SM): the kernel fits them without spilling.
template <bool kAligned16, bool kChecks>
__global__ void __launch_bounds__(kThreads, 4) logits_kernel(const LogitsArgs a, const FaultSink fault) {
  extern __shared__ __align__(16) std::uint8_t q_s[];  // [q_len, padded heads, 128] f16, then [q_len, padded] weights
  const int b = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
  const int padded = padded_heads(a.heads, kHeadGroup);
  float* w_s = reinterpret_cast<float*>(q_s + a.q_len * padded * kDim * 2);
  wait_for_previous_kernels();
  const int len = request_length(a, b);
  const int tiles = (a.max_len + 15) / 16;
  const int end = min(tiles, (blockIdx.x + 1) * a.span);
  const int live_end = min(end, (len + 15) / 16);  // tiles holding positions below the length
  // Two tiles in flight per warp while it computes a third; the first two go out before the queries
  // are staged, so that their loads overlap.
  int tile = blockIdx.x * a.span + warp;
  Tile t0, t1, t2;
  if (tile < live_end) load_tile<kAligned16>(a, b, 16 * tile, len, g, tig, t0);
  if (tile + kWarps < live_end) load_tile<kAligned16>(a, b, 16 * (tile + kWarps), len, g, tig, t1);
  RequestCheck check{};
  if constexpr (kChecks) check = load_request_check(a, b);
  clear_scratch(a);
  BadValue bad;
  {
    // 16 codes (8 f16 pairs: two 16-byte pieces) per thread and step; zeros for padded heads.
    const uint4* q = reinterpret_cast<const uint4*>(a.q) + static_cast<std::int64_t>(b) * a.q_len * a.heads * (kDim / 16);
    constexpr int kChunks = kDim / 16;
    for (int j = threadIdx.x; j < a.q_len * padded * kChunks; j += kThreads) {
      const int i = j / (padded * kChunks), h = j / kChunks % padded, c = j % kChunks;
      const uint4 codes = h < a.heads ? q[(i * a.heads + h) * kChunks + c] : make_uint4(0, 0, 0, 0);
      look_at_query_codes<kChecks>(a, b, i, h, c, codes, bad);
      const std::uint32_t words[4] = {codes.x, codes.y, codes.z, codes.w};
      std::uint32_t halves[8];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        halves[2 * k] = fp8x2_to_f16x2(words[k]);
        halves[2 * k + 1] = fp8x2_hi_to_f16x2(words[k]);
      }
      // Codes 16c .. 16c + 15 are dims of quarter c % 4 (the lane that loads them), pieces 2 (c / 4)
      // and 2 (c / 4) + 1.
      const int row_head = i * padded + h, quarter = c % 4, piece = 2 * (c / 4);
      *reinterpret_cast<uint4*>(q_s + q_offset(row_head, h, quarter, piece)) = make_uint4(halves[0], halves[1], halves[2], halves[3]);
      *reinterpret_cast<uint4*>(q_s + q_offset(row_head, h, quarter, piece + 1)) = make_uint4(halves[4], halves[5], halves[6], halves[7]);
    }
  }
  stage_weights<kChecks>(a, b, padded, w_s, bad);
  note_bad_value<kChecks>(fault, bad);
  if constexpr (kChecks) check_request(a, fault, b, check);
  __syncthreads();

  const QueryRows rows = query_rows<false>(a, nullptr, b);
  const Lane l{b, len, rows, g, tig, padded, q_s + g * kDim * 2 + tig * 64, (tig >> 1) | ((g & 1) << 1), w_s, 0};
  for (;;) {  // unrolled by three so that the tiles rotate through t0, t1, t2 without copies
    if (!walk<kAligned16>(a, tile, live_end, l, t0, t2)) break;
    tile += kWarps;
    if (!walk<kAligned16>(a, tile, live_end, l, t1, t0)) break;
    tile += kWarps;
    if (!walk<kAligned16>(a, tile, live_end, l, t2, t1)) break;
    tile += kWarps;
  }
  allow_next_kernel();
  // Tiles past the length (a block table wider than the request): no keys, no products, -inf.
  write_unseen(a, rows, 16 * max(live_end, static_cast<int>(blockIdx.x) * a.span), 16 * end);
}

// ---- wgmma: sm_90a -----------------------------------------------------------------------------

constexpr int kTurnTokens = 64;                  // tokens per warpgroup turn (the instruction's M)
// Turns in the ring: all 3 sent at the start, then 2 in flight while one is computed. Deeper rings
// (4 and 5 stages, fewer CTAs per SM) measured slower at one request and at 16: the turns' latency
// chains, not the bytes in flight, set the pace, so more CTAs per SM (6) win.
constexpr int kStages = 3;
constexpr int kStageKeyBytes = kTurnTokens * kDim;
constexpr int kStageBytes = kStageKeyBytes + kTurnTokens * 4;  // keys, then scales
static_assert(kStageBytes % 16 == 0);

// Shared-memory byte offset, in the wgmma layout, of the 8 f16 queries of head `head` of query row
// `row` at k positions 8 c .. 8 c + 7 of the permuted dims (c = 0..15). A pass of kPass heads is two
// K-major column blocks of 64 k positions (128-byte swizzle); k-step s is positions 16 s .. 16 s + 15,
// the keys' dims word_s(tig) + 0, 1 at positions 16 s + 2 tig, + 1 and + 2, + 3 at 16 s + 8 + 2 tig, + 1.
__device__ __forceinline__ int wgmma_q_offset(int row, int padded, int pass, int head, int c) {
  return (row * padded + head / pass * pass) * kDim * 2 + (c / 8) * pass * wgmma::kSwizzleRowBytes +
         wgmma::swizzled_chunk_offset(head % pass, c % 8);
}

// How a turn of 64 positions meets the pages (indexer_uses_wgmma): inside one page (pages of a
// multiple of 64 tokens); across one page's end at most (kTwoPages: pages of 32, 48, 56, 60, and
// every other multiple of 4 from 64); across several (kManyPages: the other multiples of 4, down to
// 4, whose turns touch up to 16 pages, each looked up and copied by its own lane of warp 0).
enum class TurnWalk { kOnePage, kTwoPages, kManyPages };

// The block-table entries of turn `turn`: of the page holding its first position, and with
// kTwoPages of the page holding its last (the next page where the turn crosses one). With
// kManyPages `first` is the entry of this lane's page of the turn: the turn's lane-th page, -1 past
// its last. With kOnePage a turn lies inside one page, and `last` is not used.
// Needs no length: the caller keeps the turn's first position below the row's capacity, and its last
// is taken no further than the capacity's last.
struct TurnPages {
  std::int32_t first = -1;
  std::int32_t last = -1;
};
template <TurnWalk kWalk>
__device__ __forceinline__ TurnPages turn_pages(const LogitsArgs& a, int b, int turn) {
  const std::int32_t* row = a.block_table + static_cast<std::int64_t>(b) * a.max_pages;
  const int t = kTurnTokens * turn;
  const int first = page_index(a, t);
  TurnPages p;
  if constexpr (kWalk != TurnWalk::kManyPages) p.first = row[first];
  if constexpr (kWalk != TurnWalk::kOnePage) {
    const std::int64_t capacity = static_cast<std::int64_t>(a.max_pages) * a.page_size;
    const int last = page_index(a, static_cast<int>(min(static_cast<std::int64_t>(t) + kTurnTokens - 1, capacity - 1)));
    if constexpr (kWalk == TurnWalk::kTwoPages) {
      p.last = last == first ? p.first : row[last];
    } else {
      const int mine = first + static_cast<int>(threadIdx.x % 32);
      p.first = mine <= last ? row[mine] : -1;
    }
  }
  return p;
}

// A stage's presence word: with kOnePage whether the turn's page is inside the pool; with
// kTwoPages bit 0 whether the turn's first page is, bit 1 whether its second is (and copied), and the
// turn's tokens in its first page from bit 2 on; with kManyPages bit i whether the turn's position
// i lies in a part that was copied (its page inside the pool and holding a position below the
// length; positions at or past the length in such a part have their scales copied, not their keys,
// and are written -inf by tile_logits as every position past the length is).
template <TurnWalk kWalk>
using PresenceWord = std::conditional_t<kWalk == TurnWalk::kManyPages, std::uint64_t, int>;
__device__ __forceinline__ int presence(bool first, bool second, int in_first) {
  return static_cast<int>(first) | static_cast<int>(second) << 1 | in_first << 2;
}
template <TurnWalk kWalk>
__device__ __forceinline__ bool token_present(PresenceWord<kWalk> word, int token) {
  if constexpr (kWalk == TurnWalk::kManyPages) return (word >> token & 1u) != 0;
  if constexpr (kWalk == TurnWalk::kTwoPages) return (word & (token < (word >> 2) ? 1 : 2)) != 0;
  return word != 0;
}

// Run by one thread (kManyPages: by the 32 lanes of warp 0 together, each its own page's part): the
// copies of turn `turn`'s keys (up to the length) and scales from its pages into `stage`, delivered
// to `full`; `present` gets the stage's presence word. A page outside the pool is not copied (its
// tokens are not present, and with no page copied `full` completes at once); a turn's part in a
// page after its first is copied only when it holds a position below the length. Every piece is a
// whole number of 16-byte units at 16-byte boundaries: pages of a multiple of 4 tokens, turns
// starting at multiples of 64.
template <TurnWalk kWalk>
__device__ __forceinline__ void send_turn(const LogitsArgs& a, int len, int turn, TurnPages pages, std::uint8_t* stage,
                                          std::uint64_t* full, PresenceWord<kWalk>* present) {
  const std::int64_t scales_at = static_cast<std::int64_t>(a.page_size) * kDim;  // a page's scales, after its keys
  if constexpr (kWalk == TurnWalk::kManyPages) {
    // This lane's page of the turn: the turn's positions [lo, hi) in it.
    const int t = kTurnTokens * turn, lane = static_cast<int>(threadIdx.x % 32);
    const std::int64_t start = static_cast<std::int64_t>(page_index(a, t) + lane) * a.page_size;  // the page's first
    const int lo = static_cast<int>(min(max(static_cast<std::int64_t>(t), start), static_cast<std::int64_t>(t) + kTurnTokens));
    const int hi = static_cast<int>(min(static_cast<std::int64_t>(t) + kTurnTokens, start + a.page_size));
    const std::uint8_t* base = lo < hi && lo < len ? page_base(a, pages.first) : nullptr;
    const int keys = base != nullptr ? min(hi, len) - lo : 0;
    const std::uint32_t bytes = base != nullptr ? static_cast<std::uint32_t>(keys * kDim + (hi - lo) * 4) : 0u;
    const std::uint64_t mine = base != nullptr ? (~0ull >> (kTurnTokens - (hi - lo))) << (lo - t) : 0ull;
    const std::uint32_t total = __reduce_add_sync(0xffffffffu, bytes);
    const std::uint64_t word = static_cast<std::uint64_t>(__reduce_or_sync(0xffffffffu, static_cast<std::uint32_t>(mine))) |
                               static_cast<std::uint64_t>(__reduce_or_sync(0xffffffffu, static_cast<std::uint32_t>(mine >> 32)))
                                   << 32;
    if (lane == 0) {
      *present = word;
      if (total == 0) {
        bulk::arrive(full);
      } else {
        bulk::arrive_expect(full, total);
      }
    }
    __syncwarp();  // the expected bytes before any lane's copy can complete them
    if (base != nullptr) {
      const int offset = static_cast<int>(lo - start);
      bulk::copy(stage + (lo - t) * kDim, base + static_cast<std::int64_t>(offset) * kDim,
                 static_cast<std::uint32_t>(keys * kDim), full);
      bulk::copy(stage + kStageKeyBytes + 4 * (lo - t), base + scales_at + 4 * offset, static_cast<std::uint32_t>((hi - lo) * 4),
                 full);
    }
    return;
  }
  if constexpr (kWalk == TurnWalk::kOnePage) {  // the page's keys up to the length, and its 64 scales
    const std::uint8_t* base = page_base(a, pages.first);
    *present = base != nullptr;
    if (base == nullptr) {
      bulk::arrive(full);
      return;
    }
    const int t = kTurnTokens * turn, offset = page_offset(a, t, page_index(a, t));
    const int tokens = min(kTurnTokens, len - t);  // >= 1: a live turn
    bulk::arrive_expect(full, static_cast<std::uint32_t>(tokens * kDim + kTurnTokens * 4));
    bulk::copy(stage, base + static_cast<std::int64_t>(offset) * kDim, static_cast<std::uint32_t>(tokens * kDim), full);
    bulk::copy(stage + kStageKeyBytes, base + scales_at + 4 * offset, kTurnTokens * 4, full);
    return;
  }
  const int t = kTurnTokens * turn, offset = page_offset(a, t, page_index(a, t));
  const int tokens = min(kTurnTokens, len - t);                 // >= 1: a live turn
  const int in_first = min(kTurnTokens, a.page_size - offset);  // the turn's tokens in its first page
  const std::uint8_t* first = page_base(a, pages.first);
  const std::uint8_t* second = tokens > in_first ? page_base(a, pages.last) : nullptr;
  const int keys_first = min(tokens, in_first), keys_second = tokens - keys_first;
  *present = presence(first != nullptr, second != nullptr, in_first);
  const std::uint32_t bytes = (first != nullptr ? keys_first * kDim + in_first * 4 : 0) +
                              (second != nullptr ? keys_second * kDim + (kTurnTokens - in_first) * 4 : 0);
  if (bytes == 0) {
    bulk::arrive(full);
    return;
  }
  bulk::arrive_expect(full, bytes);
  if (first != nullptr) {
    bulk::copy(stage, first + static_cast<std::int64_t>(offset) * kDim, static_cast<std::uint32_t>(keys_first * kDim),
               full);
    bulk::copy(stage + kStageKeyBytes, first + scales_at + 4 * offset, static_cast<std::uint32_t>(in_first * 4), full);
  }
  if (second != nullptr) {
    bulk::copy(stage + in_first * kDim, second, static_cast<std::uint32_t>(keys_second * kDim), full);
    bulk::copy(stage + kStageKeyBytes + 4 * in_first, second + scales_at,
               static_cast<std::uint32_t>((kTurnTokens - in_first) * 4), full);
  }
}

// Warp `warp`'s 16 tokens of a landed stage as this lane's tile (rows past the copied tokens hold
// stale bytes: positions past the length or in a page outside the pool, written -inf).
template <TurnWalk kWalk>
__device__ __forceinline__ void tile_from_stage(const std::uint8_t* stage, PresenceWord<kWalk> present, int warp, int g,
                                                int tig, Tile& t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int token = 16 * warp + g + 8 * r;
    const std::uint8_t* key = stage + token * kDim + 16 * tig;
    t.keys[r][0] = *reinterpret_cast<const uint4*>(key);
    t.keys[r][1] = *reinterpret_cast<const uint4*>(key + kDim / 2);
    t.scales[r] = reinterpret_cast<const float*>(stage + kStageKeyBytes)[token];
    t.cached[r] = token_present<kWalk>(present, token);
  }
}

// The request's f16 queries in shared memory for the wgmma kernel, staged from 16-byte chunks of
// codes (dims 16 c .. 16 c + 15 of one head, c = 0..7) in batches of kQueryBatch chunks per thread:
// a batch's loads all go out before any of them is used. Word w of chunk c holds the dims lane
// tig = c % 4 supplies at k-step 4 (c / 4) + w (wgmma_q_offset); zeros for padded heads.
constexpr int kQueryBatch = 4;
struct QueryBatch {
  uint4 codes[kQueryBatch];
};

__device__ __forceinline__ void load_query_batch(const LogitsArgs& a, const QueryRows& rows, int padded, int from,
                                                 QueryBatch& batch) {
  const uint4* q = reinterpret_cast<const uint4*>(a.q) + rows.first * a.heads * (kDim / 16);
  const int chunks = rows.count * padded * (kDim / 16);
#pragma unroll
  for (int e = 0; e < kQueryBatch; ++e) {
    const int j = from + e * kThreads + static_cast<int>(threadIdx.x);
    const int row_head = j / (kDim / 16), i = row_head / padded, h = row_head - i * padded;
    batch.codes[e] = j < chunks && h < a.heads ? q[(i * a.heads + h) * (kDim / 16) + j % (kDim / 16)] : make_uint4(0, 0, 0, 0);
  }
}

template <bool kChecks>
__device__ __forceinline__ void look_at_query_batch(const LogitsArgs& a, int b, int padded, int from,
                                                    const QueryBatch& batch, BadValue& bad) {
  const int chunks = a.q_len * padded * (kDim / 16);
#pragma unroll
  for (int e = 0; e < kQueryBatch; ++e) {
    const int j = from + e * kThreads + static_cast<int>(threadIdx.x);
    const int row_head = j / (kDim / 16), i = row_head / padded, h = row_head - i * padded;
    if (j < chunks) look_at_query_codes<kChecks>(a, b, i, h, j % (kDim / 16), batch.codes[e], bad);
  }
}

template <int kPass>
__device__ __forceinline__ void store_query_batch(const QueryRows& rows, int padded, int from, const QueryBatch& batch,
                                                  std::uint8_t* q_s) {
  const int chunks = rows.count * padded * (kDim / 16);
#pragma unroll
  for (int e = 0; e < kQueryBatch; ++e) {
    const int j = from + e * kThreads + static_cast<int>(threadIdx.x);
    if (j >= chunks) continue;
    const int row_head = j / (kDim / 16), c = j % (kDim / 16), i = row_head / padded, h = row_head - i * padded;
    const std::uint32_t words[4] = {batch.codes[e].x, batch.codes[e].y, batch.codes[e].z, batch.codes[e].w};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int step = 4 * (c / 4) + w, quarter = c % 4;
      *reinterpret_cast<std::uint32_t*>(q_s + wgmma_q_offset(i, padded, kPass, h, 2 * step) + 4 * quarter) =
          fp8x2_to_f16x2(words[w]);
      *reinterpret_cast<std::uint32_t*>(q_s + wgmma_q_offset(i, padded, kPass, h, 2 * step + 1) + 4 * quarter) =
          fp8x2_hi_to_f16x2(words[w]);
    }
  }
}

// Grid (CTAs per request, B), one warpgroup per CTA, pages as indexer_uses_wgmma takes them.
// Thread 0 copies whole turns (64 positions' keys and scales: two bulk copies from each page the
// turn touches, one or two; with kManyPages the 32 lanes of warp 0, a page each) through a ring of
// kStages stages, each completing on its own mbarrier.
// The prologue puts every independent load in flight at once (the length, the block-table entries
// of the first kStages + 1 turns, the queries and weights), then sends the first kStages turns, so
// that at one turn per CTA (one request over the whole GPU) the CTA waits for two round trips, the
// block table and then the keys. Each later turn goes out at the top of a turn, after the CTA
// barrier that says every warp is done with the stage the turn before read; its block-table entries
// were looked up a turn earlier. The 4 warps compute each turn together (tile_logits). (Per-stage
// "empty" mbarriers in place of that CTA barrier, one arrival per thread, measured slower: B 16 x
// 128K 83.9 us against 80.9.)
// With claims (a.claimed), a CTA's static span is only part of its share: once it is done, the
// copier claims turns past every static span ([claim_from, min(the length, max_len))) one at a time
// from the request's counter, three turns before it sends them, so that CTAs on SMs that stream
// faster take more turns. A claim's answer is first read a turn after the claim (checked), so the
// copier, a thread of warp 0, does not wait for the atomic's round trip (unless it takes longer
// than a turn's compute; with kManyPages the copier warp walks the same turns, thread 0 claiming,
// and its answer reaches the other lanes when it is checked). Each stage carries its turn
// (turn_s); -1 ends the CTA's walk. Every CTA of the request ends its claims with exactly one claim
// past the claimable turns; the CTA whose claim is the last of those sets the counter back to zero,
// so that every call leaves the counters as it needs them.
// kGrouped: the requests are groups of an indexer prefill's new tokens (spans, launch.hpp).
// kWalk: how a turn meets the pages (TurnWalk, turn_pages, send_turn). The pages of a multiple of
// 64 take kOnePage: the crossing code in their instance slowed them by 2-6% (H100, glm5 Hi 32, B 1
// and 16 x 128K, seventy-first session).
template <int kPass, bool kChecks, bool kGrouped, TurnWalk kWalk>
__global__ void __launch_bounds__(kThreads, 6)
    logits_wgmma_kernel(const LogitsArgs a, const FaultSink fault, const int2* spans) {
  static_assert(!(kChecks && kGrouped), "grouped prefills are checked before the indexer (prefill_rows.hpp)");
  // [q_len, padded, 128] f16 queries from a 1024-byte boundary, [q_len, padded] weights, the ring,
  // its barriers, its stages' presence flags and turns.
  extern __shared__ __align__(16) std::uint8_t smem[];
  std::uint8_t* q_s = smem + ((1024u - (smem_addr(smem) & 1023u)) & 1023u);
  const int padded = padded_heads(a.heads, kPass);
  float* w_s = reinterpret_cast<float*>(q_s + a.q_len * padded * kDim * 2);
  std::uint8_t* ring = reinterpret_cast<std::uint8_t*>(w_s + a.q_len * padded);  // 16-byte aligned: padded % 8 == 0
  auto* full = reinterpret_cast<std::uint64_t*>(ring + kStages * kStageBytes);
  auto* present = reinterpret_cast<PresenceWord<kWalk>*>(full + kStages);
  auto* turn_s = reinterpret_cast<int*>(present + kStages);
  const int b = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
  const bool copier = threadIdx.x == 0;
  constexpr bool kWarpSends = kWalk == TurnWalk::kManyPages;
  const bool sender = kWarpSends ? warp == 0 : copier;  // the threads that look up pages and send turns
  wait_for_previous_kernels();
  const QueryRows rows = query_rows<kGrouped>(a, spans, b);
  const int len = request_length(a, b);
  const int turns = (a.max_len + kTurnTokens - 1) / kTurnTokens;
  const int first = blockIdx.x * a.span;
  const int end = min(turns, first + a.span);
  const int live = (len + kTurnTokens - 1) / kTurnTokens;  // turns holding positions below the length
  const int live_end = min(end, live);                     // this CTA's static turns: [first, live_end)
  // The copier's block-table entries of the first kStages + 1 turns (the last: the first refill's).
  TurnPages pages[kStages + 1];
  if (copier) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) bulk::init(&full[s], 1);
    bulk::fence_init();
  }
  if constexpr (kWarpSends) __syncwarp();  // the barriers' inits before the other lanes' copies
  if (sender) {
    const std::int64_t capacity = static_cast<std::int64_t>(a.max_pages) * a.page_size;
#pragma unroll
    for (int k = 0; k <= kStages; ++k) {
      if (first + k < end && kTurnTokens * (first + k) < capacity) pages[k] = turn_pages<kWalk>(a, b, first + k);
    }
  }
  QueryBatch batch;
  load_query_batch(a, rows, padded, 0, batch);
  RequestCheck check{};
  if constexpr (kChecks) check = load_request_check(a, b);
  constexpr int kWeightsPerThread = kMaxDecodeQLen * kMaxIndexerHeads / kThreads;  // q_len x padded at most
  static_assert(kWeightsPerThread * kThreads == kMaxDecodeQLen * kMaxIndexerHeads);
  const int weight_count = rows.count * padded;
  float weight[kWeightsPerThread];
#pragma unroll
  for (int e = 0; e < kWeightsPerThread; ++e) {
    const int j = e * kThreads + static_cast<int>(threadIdx.x), i = j / padded, h = j - i * padded;
    weight[e] = j < weight_count && h < a.heads ? a.weights[(rows.first + i) * a.heads + h] : 0.0f;
  }
  // The copier's walk: its static turns, then (claims) turns claimed past every static span, then -1
  // for good. The host gives claims only to spans of at least kStages + 3 turns, so that the turns
  // the prologue takes (sent, looked up, claimed ahead) are all static ones.
  int next_static = first;
  const int claim_end = min(live, turns);  // past it, turns hold no position below the length or no column
  // With claims every CTA's static span is live (claim_from is past them all), so all of them claim.
  const bool claims = a.claimed != nullptr && claim_end > a.claim_from;
  bool exhausted = false;
  // The claims a request's CTAs make in all: one per claimable turn, then one each past them.
  const unsigned claims_made = claims ? static_cast<unsigned>(claim_end - a.claim_from) + gridDim.x : 0u;
  // The walk's next turn, unchecked: a claim's answer is only read by `checked`, a turn later. A
  // counter that was not zero on entry (a workspace said to be cleared that was not) can only end
  // the claims early (wrong logits), never give a turn outside [claim_from, claim_end].
  const auto next_turn = [&]() -> int {
    if (next_static < live_end) return next_static++;
    if (claims && !exhausted) {  // with kWarpSends the other lanes' answer is taken from thread 0's when checked
      const unsigned claim = !kWarpSends || copier ? atomicAdd(&a.claimed[b], 1u) : 0u;
      return a.claim_from + static_cast<int>(min(claim, claims_made));
    }
    exhausted = true;
    return -1;
  };
  // A turn from next_turn, or -1 once the claims are past the claimable turns. The request's CTAs
  // make gridDim.x claims past them in all, one each: the last (claim_end + gridDim.x - 1) is the
  // counter's last change in this call, and its CTA sets the counter back to zero.
  const auto checked = [&](int turn) -> int {
    if (turn < claim_end) return turn;  // static turns and -1 too
    exhausted = true;
    if ((!kWarpSends || copier) && turn == a.claim_from + static_cast<int>(claims_made) - 1) atomicExch(&a.claimed[b], 0u);
    return -1;
  };
  // Stage `stage` gets turn `turn` (its block-table entries), or with -1 the end of the walk.
  const auto fill = [&](int stage, int turn, TurnPages entries) {
    if (!kWarpSends || copier) turn_s[stage] = turn;
    if (turn >= 0) {
      send_turn<kWalk>(a, len, turn, entries, ring + stage * kStageBytes, &full[stage], &present[stage]);
    } else if (!kWarpSends || copier) {
      bulk::arrive(&full[stage]);
    }
  };
  // The walk's three turns after those in the ring: the next to send (its pages known), the next
  // whose pages are looked up, and the next claimed (unchecked).
  int send_next = -1, look_next = -1, claim_next = -1;
  TurnPages send_pages;
  bool ended = false;  // the copier has filled a stage with -1
  if (sender && first < live_end) {
#pragma unroll
    for (int k = 0; k < kStages; ++k) {
      if (ended) break;
      const int turn = checked(next_turn());
      fill(k, turn, pages[k]);
      ended = turn < 0;
    }
    send_next = checked(next_turn());
    if (send_next >= 0) send_pages = pages[kStages];
    look_next = checked(next_turn());
    claim_next = next_turn();
  }
  clear_scratch(a);
  const int chunks = rows.count * padded * (kDim / 16);
  BadValue bad;
  look_at_query_batch<kChecks>(a, b, padded, 0, batch, bad);
  store_query_batch<kPass>(rows, padded, 0, batch, q_s);
  for (int from = kQueryBatch * kThreads; from < chunks; from += kQueryBatch * kThreads) {  // more than 64 row-heads
    load_query_batch(a, rows, padded, from, batch);
    look_at_query_batch<kChecks>(a, b, padded, from, batch, bad);
    store_query_batch<kPass>(rows, padded, from, batch, q_s);
  }
#pragma unroll
  for (int e = 0; e < kWeightsPerThread; ++e) {
    const int j = e * kThreads + static_cast<int>(threadIdx.x);
    if (j < weight_count) {
      look_at_weight<kChecks>(a, b, j / padded, j % padded, weight[e], bad);
      w_s[j] = weight[e];
    }
  }
  note_bad_value<kChecks>(fault, bad);
  if constexpr (kChecks) check_request(a, fault, b, check);
  wgmma::fence_shared_for_async();
  __syncthreads();  // the queries, weights, barriers and first stages' turns and presence flags published

  const Lane l{b, len, rows, g, tig, padded, nullptr, 0, w_s, wgmma::desc_sw128(q_s, 16, wgmma::kSwizzleAtomBytes)};
  int stage = 0;
  std::uint32_t phase = 0;  // of the stage's current use
  for (int k = 0; first < live_end; ++k) {
    if (k > 0) {
      __syncthreads();  // every warp is done with the stage the turn before read
      // The walk's turn k + kStages - 1 into that stage.
      if (sender && !ended) {
        const int refill = stage == 0 ? kStages - 1 : stage - 1;
        bulk::fence_for_copy();  // the stage's reads before the copy engine's writes
        fill(refill, send_next, send_pages);
        ended = send_next < 0;
        send_next = look_next;
        send_pages = look_next >= 0 ? turn_pages<kWalk>(a, b, look_next) : TurnPages{};
        if constexpr (kWarpSends) claim_next = __shfl_sync(0xffffffffu, claim_next, 0);  // thread 0's claim
        look_next = checked(claim_next);  // the claim made a turn ago has long come back
        claim_next = next_turn();
      }
    }
    bulk::wait(&full[stage], phase);
    const int turn = turn_s[stage];
    if (turn < 0) break;
    Tile t;
    tile_from_stage<kWalk>(ring + stage * kStageBytes, present[stage], warp, g, tig, t);
    tile_logits<kPass>(a, t, kTurnTokens * turn + 16 * warp, l);
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1u;
    }
  }
  allow_next_kernel();
  write_unseen(a, rows, kTurnTokens * max(live_end, first), kTurnTokens * end);
  // The claimable turns past the length: every CTA of the request writes its share.
  write_unseen(a, rows, kTurnTokens * max(live, a.claim_from), kTurnTokens * turns, blockIdx.x, gridDim.x);
}

// ---- launchers ---------------------------------------------------------------------------------

// CTAs per request and positions per CTA (`units` of the kernel's span): one wave of resident CTAs
// up to a batch as large as the GPU's resident CTAs (then one CTA per request), so that a single
// request spreads over the whole GPU and large batches give every CTA a long span to stream.
// Spans shorter than `balance_below` are then lengthened where that puts fewer units on the busiest
// SM (the CTAs spread evenly over the SMs: ceil(CTAs / SMs) spans), the shortest such span, as long
// as the busiest SMs keep 4 CTAs (the configuration measured): at one request over 128K tokens (2048
// turns) 683 CTAs of 3 turns put 18 turns on the SMs that hold 6 CTAs, 512 CTAs of 4 only 16. H200,
// glm5 Hi 32 (wgmma): B 1 x 128K 12.8 -> 11.9 us, B 64 x 8K (16 turns instead of 11) 26.3-26.9 ->
// 25.2 us; B 1 x 32K keeps 512 CTAs of one turn. Returns the CTAs per request; sets a.span.
template <class Kernel>
int spread(Kernel* kernel, LogitsArgs& a, int batch, int units, int most_per_request, std::size_t smem,
           int balance_below = 0) {
  const int sms = current_device_limits("indexer_logits").multiprocessors;
  const int per_sm = std::max(resident_ctas_per_sm(kernel, kThreads, smem, "indexer_logits"), 1);
  // Rounded down: one more CTA per request would start a second wave.
  const int per_request = std::clamp(sms * per_sm / batch, 1, most_per_request);
  a.span = (units + per_request - 1) / per_request;
  const auto busiest_ctas = [&](int span) {  // CTAs on the busiest SM
    return (static_cast<std::int64_t>(batch) * ((units + span - 1) / span) + sms - 1) / sms;
  };
  const std::int64_t fewest_ctas = std::min<std::int64_t>(4, busiest_ctas(a.span));
  for (int span = a.span + 1; span < std::min(balance_below, units + 1) && busiest_ctas(span) >= fewest_ctas; ++span) {
    if (busiest_ctas(span) * span < busiest_ctas(a.span) * a.span) a.span = span;
  }
  return (units + a.span - 1) / a.span;
}

constexpr int kBytesPerHead = 2 * kDim + static_cast<int>(sizeof(float));  // f16 queries and the weight

template <bool kAligned16, bool kChecks>
void launch_mma(LogitsArgs a, const FaultSink& fault, int batch, cudaStream_t stream) {
  const auto kernel = logits_kernel<kAligned16, kChecks>;
  const std::size_t smem = static_cast<std::size_t>(a.q_len) * padded_heads(a.heads, kHeadGroup) * kBytesPerHead;
  // The most any call takes (64 heads x 4 rows: 66.5 KB, within the 99 KB every target allows),
  // allowed once per device the first time a call needs more than the default 48 KB.
  static_assert(padded_heads(kMaxIndexerHeads, kHeadGroup) == kMaxIndexerHeads);
  constexpr int kMaxSmem = kMaxDecodeQLen * kMaxIndexerHeads * kBytesPerHead;
  static_assert(kMaxSmem <= 99 * 1024, "must fit the 99 KB per block of sm_89 and sm_120");
  if (smem > 48 * 1024) allow_dynamic_smem(kernel, kMaxSmem, "indexer_logits");
  const int tiles = (a.max_len + 15) / 16;
  const int ctas = spread(kernel, a, batch, tiles, (tiles + kWarps - 1) / kWarps, smem);
  launch_chained("indexer_logits", kernel, dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(batch)), kThreads, smem,
                 stream, false, a, fault);
}

// Claims (logits_wgmma_kernel) from spans of this many turns: each CTA streams 3/4 of its span, then
// claims; shorter spans keep their static spans, since the claims win nothing there. H200, glm5
// Hi 32, claims from 8 turns against 24, the counters taken cleared (no memset): B 16 x 128K (spans
// of 42 turns) 77.8 / 77.6 us; dsa_decode's indexer at B 64 x 8K (11) 26.4 / 26.3. (With the memset,
// which also breaks the chained launch: B 64 x 8K 27.9 / 28.0 against 27.0 / 27.0 without claims.)
// The prologue's turns must be static ones for two reasons: the claims' bookkeeping, and with
// TurnWalk::kManyPages the copier warp's lanes, which take those turns straight from next_turn (only
// thread 0 claims; the others learn a claim's answer from it when the claim is checked, a turn later).
constexpr int kClaimFromSpan = 24;
static_assert(kClaimFromSpan * 3 / 4 >= kStages + 3, "the turns the kernel's prologue takes are static ones");

// Whether every turn on pages of `page_size` tokens (a multiple of 4) touches two pages at most
// (TurnWalk::kTwoPages). Turns start at multiples of 64, so their offsets in a page are the
// multiples of gcd(64, page_size) below it; the largest leaves 64 - gcd tokens of the turn past the
// page's end, which the next page holds when page_size >= 64 - gcd: every page of 64 or more, and of
// 32, 48, 56 and 60 below it. (Pages of 4 tokens: 16 a turn; of 12 up to 6.)
constexpr bool turn_touches_two_pages_at_most(int page_size) {
  return page_size >= kTurnTokens - std::gcd(kTurnTokens, page_size);
}
// The rule against a walk over the turns: whether some turn (from a multiple of 64; their offsets in
// a page repeat after page_size turns) touches three pages or more.
constexpr bool some_turn_touches_three_pages(int page_size) {
  for (int t = 0; t < kTurnTokens * page_size; t += kTurnTokens) {
    if ((t + kTurnTokens - 1) / page_size - t / page_size >= 2) return true;
  }
  return false;
}
constexpr bool rule_matches_the_walk(int largest_page) {
  for (int page_size = 4; page_size <= largest_page; page_size += 4) {
    if (turn_touches_two_pages_at_most(page_size) == some_turn_touches_three_pages(page_size)) return false;
  }
  return true;
}
static_assert(rule_matches_the_walk(512) && turn_touches_two_pages_at_most(32) && !turn_touches_two_pages_at_most(52));

// `claimed`: a counter per request, or null; `cleared`: they are zero on entry, else a launch that
// claims zeroes them first with a memset (a kernel that claims leaves them zero, one that does not
// leaves them alone).
// `spans`: a grouped prefill's requests (kGrouped).
template <int kPass, bool kChecks, bool kGrouped = false>
void launch_wgmma(LogitsArgs a, const FaultSink& fault, int batch, unsigned* claimed, bool cleared,
                  cudaStream_t stream, const int2* spans = nullptr) {
  const auto kernel = a.page_size % kTurnTokens == 0       ? logits_wgmma_kernel<kPass, kChecks, kGrouped, TurnWalk::kOnePage>
                      : turn_touches_two_pages_at_most(a.page_size) ? logits_wgmma_kernel<kPass, kChecks, kGrouped, TurnWalk::kTwoPages>
                                                                  : logits_wgmma_kernel<kPass, kChecks, kGrouped, TurnWalk::kManyPages>;
  // Alignment slack, the ring, its barriers, presence words (8 bytes with kManyPages) and turns.
  constexpr int kFixed = 1024 + kStages * (kStageBytes + 8 + 8 + 4);
  const std::size_t smem = static_cast<std::size_t>(a.q_len) * padded_heads(a.heads, kPass) * kBytesPerHead + kFixed;
  static_assert(padded_heads(kMaxIndexerHeads, kPass) == kMaxIndexerHeads);
  constexpr int kMaxSmem = kMaxDecodeQLen * kMaxIndexerHeads * kBytesPerHead + kFixed;  // 90.8 KB
  static_assert(kMaxSmem <= 227 * 1024, "must fit the 227 KB per block of sm_90");
  if (smem > 48 * 1024) allow_dynamic_smem(kernel, kMaxSmem, "indexer_logits");
  const int turns = (a.max_len + kTurnTokens - 1) / kTurnTokens;
  const int ctas = spread(kernel, a, batch, turns, turns, smem, kClaimFromSpan);
  a.claimed = nullptr;
  a.claim_from = turns;
  if (claimed != nullptr && ctas > 1 && a.span >= kClaimFromSpan) {
    a.span = a.span * 3 / 4;
    a.claim_from = ctas * a.span;
    a.claimed = claimed;
    if (!cleared) {
      LKV_CUDA_CHECK("indexer_logits",
                     cudaMemsetAsync(claimed, 0, static_cast<std::size_t>(batch) * sizeof(unsigned), stream));
    }
  }
  launch_chained("indexer_logits", kernel, dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(batch)), kThreads, smem,
                 stream, false, a, fault, spans);
}

// The wgmma kernel where it applies (indexer_uses_wgmma), else the mma.sync one; `claimed` (a counter
// per request, or null; zero on entry when `cleared`) lets the wgmma kernel balance long spans.
// The instance with checks when the call has a fault record.
template <bool kChecks>
void launch_for_device(const LogitsArgs& a, const FaultSink& fault, int batch, unsigned* claimed, bool cleared,
                       cudaStream_t stream) {
  if (!indexer_uses_wgmma(a.page_size, current_device_sm("indexer_logits"))) {
    // 132 x page_size bytes: keys 16-byte aligned
    if (a.page_size % 4 == 0) return launch_mma<true, kChecks>(a, fault, batch, stream);
    return launch_mma<false, kChecks>(a, fault, batch, stream);
  }
  switch (wgmma_pass_heads(a.heads)) {
    case 8: return launch_wgmma<8, kChecks>(a, fault, batch, claimed, cleared, stream);
    case 16: return launch_wgmma<16, kChecks>(a, fault, batch, claimed, cleared, stream);
    default: return launch_wgmma<32, kChecks>(a, fault, batch, claimed, cleared, stream);
  }
}

}  // namespace

bool indexer_uses_wgmma(int page_size, int sm) {
  // Pages of a multiple of 4 tokens (132 x page_size bytes, a multiple of 16), so that every bulk
  // copy is of whole 16-byte units.
  return page_size > 0 && page_size % 4 == 0 && wgmma_kernels_enabled("indexer_logits", kIndexerKernelVariable, sm);
}

std::string indexer_logits_kernel_name(int page_size, int sm) {
  if (page_size == 0 && indexer_uses_wgmma(kIndexerWgmmaPageSize, sm)) {  // pages not known yet
    return std::string("indexer_logits<f16 wgmma m64nNk16, bulk-copy ring, for ") + kIndexerWgmmaPages +
           "; else f16 mma m16n8k16>";
  }
  return page_size > 0 && indexer_uses_wgmma(page_size, sm) ? "indexer_logits<f16 wgmma m64nNk16, bulk-copy ring>"
                                                            : "indexer_logits<f16 mma m16n8k16>";
}

Plan plan_indexer_logits(const IndexerLogitsParams& p) {
  Plan plan;
  const auto counters = static_cast<std::size_t>(std::max<std::int64_t>(p.q.size(0), 0));  // one per request
  plan.workspace_bytes = (counters * sizeof(unsigned) + 15) / 16 * 16;
  plan.cleared_bytes = plan.workspace_bytes;  // see IndexerLogitsParams::workspace_cleared
  return plan;
}

namespace {
LogitsArgs logits_args(const IndexerLogitsParams& p) {
  LogitsArgs a{};
  a.q = p.q.as<const std::uint8_t>();
  a.weights = p.weights.as<const float>();
  a.cache = p.cache.data;
  a.block_table = p.block_table.as<const std::int32_t>();
  a.seq_lens = p.seq_lens.as<const std::int32_t>();
  a.logits = p.logits.as<float>();
  a.num_pages = p.cache.num_pages;
  a.page_size = p.cache.page_size;
  a.page_shift = page_shift_of(a.page_size);
  a.max_pages = static_cast<int>(p.block_table.size(1));
  a.q_len = static_cast<int>(p.q.size(1));
  a.heads = static_cast<int>(p.q.size(2));
  a.max_len = static_cast<int>(p.logits.size(2));
  a.clear = static_cast<uint4*>(p.clear);
  a.clear_pieces = static_cast<std::int64_t>(p.clear_bytes / sizeof(uint4));  // validated: a multiple of 16
  return a;
}
}  // namespace

void launch_indexer_logits_groups(const IndexerLogitsParams& p, const IndexerGroups& g, cudaStream_t stream) {
  LogitsArgs a = logits_args(p);
  a.q_len = g.tokens;
  if (!indexer_uses_wgmma(a.page_size, current_device_sm("indexer_logits")) || g.tokens < 1 ||
      g.tokens > kMaxDecodeQLen) {
    throw Error("indexer_prefill", "groups", std::to_string(g.tokens) + " new tokens a group",
                "1 to " + std::to_string(kMaxDecodeQLen) + ", on the wgmma kernel (indexer/prefill.cpp)");
  }
  if (g.groups > kMaxIndexerBatch) {  // one grid row per group
    throw Error("indexer_prefill", "groups", std::to_string(g.groups),
                "at most " + std::to_string(kMaxIndexerBatch) + " per launch (indexer/prefill.cpp)");
  }
  if (g.groups == 0 || a.max_len == 0) {  // no kernel: the clear on its own
    if (p.clear_bytes > 0) LKV_CUDA_CHECK("indexer_prefill", cudaMemsetAsync(p.clear, 0, p.clear_bytes, stream));
    return;
  }
  check_aligned("indexer_prefill", "q", a.q, 16);
  check_aligned("indexer_prefill", "cache", a.cache, 16);
  switch (wgmma_pass_heads(a.heads)) {
    case 8: return launch_wgmma<8, false, true>(a, FaultSink{}, g.groups, nullptr, false, stream, g.spans);
    case 16: return launch_wgmma<16, false, true>(a, FaultSink{}, g.groups, nullptr, false, stream, g.spans);
    default: return launch_wgmma<32, false, true>(a, FaultSink{}, g.groups, nullptr, false, stream, g.spans);
  }
}

void check_indexer_logits_call(const IndexerLogitsParams& p) {
  check_fault_record(p.fault, "indexer_logits");
  if (p.q.size(0) == 0 || p.logits.size(2) == 0) return;  // no kernel
  if (p.q.size(0) > kMaxIndexerBatch) {  // one grid row per request
    throw Error("indexer_logits", "q", p.q.shape_string(),
                "at most " + std::to_string(kMaxIndexerBatch) + " requests (B) per call");
  }
  check_aligned("indexer_logits", "q", p.q.data, 16);
  // Keys read as (or copied in) 16-byte pieces, or 4-byte words on pages of a size not a multiple of 4.
  check_aligned("indexer_logits", "cache", p.cache.data, p.cache.page_size % 4 == 0 ? 16 : 4);
  if (p.workspace != nullptr) {
    const std::size_t need = plan_indexer_logits(p).workspace_bytes;
    if (p.workspace_bytes < need) {
      throw Error("indexer_logits", "workspace_bytes", std::to_string(p.workspace_bytes),
                  ">= " + std::to_string(need) + " (Backend::plan for these shapes), or no workspace");
    }
    check_aligned("indexer_logits", "workspace", p.workspace, 4);
  }
}

void launch_indexer_logits(const IndexerLogitsParams& p, cudaStream_t stream) {
  check_indexer_logits_call(p);
  LogitsArgs a = logits_args(p);
  const int batch = static_cast<int>(p.q.size(0));
  const FaultSink fault{p.fault, DeviceFaultOp::kIndexerLogits};
  if (batch == 0 || a.max_len == 0) {  // no kernel: the clear on its own, and the checks a kernel would make
    if (p.clear_bytes > 0) LKV_CUDA_CHECK("indexer_logits", cudaMemsetAsync(p.clear, 0, p.clear_bytes, stream));
    launch_paging_check(paging_check_of(p.block_table, p.seq_lens, a.page_size, a.num_pages, a.max_len, fault), stream,
                        "indexer_logits");
    launch_value_check(value_check_of(p.q, DeviceFaultCode::kIndexerQuery, fault), stream, "indexer_logits");
    launch_value_check(value_check_of(p.weights, DeviceFaultCode::kWeight, fault), stream, "indexer_logits");
    return;
  }
  auto* claimed = static_cast<unsigned*>(p.workspace);  // may be null: no claims
  if (fault.record != nullptr) launch_for_device<true>(a, fault, batch, claimed, p.workspace_cleared, stream);
  else launch_for_device<false>(a, fault, batch, claimed, p.workspace_cleared, stream);
}

}  // namespace latentkv::cuda
