// Lightning-indexer logits (SPEC 4.4) over the paged fp8 indexer cache (132 B/token, page-major),
// on the tensor cores: fp8 codes converted exactly to f16 on chip, mma.sync m16n8k16, f32 sums.
//
// Per token t and query row: logit_t = kscale_t * sum_h w_h relu(q_h . k_t). The dot products are
// one small matrix product per query row, S[token, head] = K[token, 0:128] . Q[head, 0:128]:
//   * A = 16 tokens x 16 dims of keys, B = 16 dims x 8 heads of queries, per k-step. The 128 dims
//     are visited in a permuted order (the same for keys and queries, so every product still pairs
//     the right values): lane (g, tig) supplies, over the eight k-steps, dims 16*tig .. 16*tig + 15
//     and 64 + 16*tig .. 64 + 16*tig + 15 - two 16-byte loads straight from a token's key (each load
//     instruction of the warp reads whole 64-byte halves of 8 keys), converted to f16 once per tile.
//   * A CTA owns a span of one request's positions; its 4 warps take 16-token tiles in turn, each
//     loading its next two tiles' keys into registers while it computes the current one, which serves
//     every query row. The three tiles rotate through registers by unrolling, not by copies. The
//     grid is one wave of resident CTAs whatever the batch.
//   * All query rows and weights of the request sit in shared memory, heads padded to a multiple of
//     8 with zero queries and weights. Heads are taken 8 at a time, their products summed over even
//     and odd k-steps apart: two independent mma chains per warp instead of one of eight. The sums are
//     relu'd, weighted and summed across the 4 lanes of a quad, then scaled by kscale_t and written.
//     Positions a row cannot see get -inf.
//   * A call may also clear the next op's scratch (IndexerLogitsParams::clear: the top-k's row state
//     inside dsa_decode), spread over the whole grid while the first keys are loading.
// f16 holds every e4m3 value exactly, so each product is exact; the sums are float32 in tensor-core
// order. (mma.sync on raw e4m3 codes was tried first: on sm_90 it converts to f16 inside every
// instruction, for every 8 heads again, and ran the kernel instruction-bound.)
#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

#include "cuda/common/chained_launch.cuh"
#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/common/mma.cuh"
#include "cuda/indexer/launch.hpp"
#include "latentkv/error.hpp"

namespace latentkv::cuda {
namespace {

constexpr int kDim = 128;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kHeadGroup = 8;  // heads per pass of the head loop (one mma n-tile)

__host__ __device__ constexpr int padded_heads(int heads) { return (heads + kHeadGroup - 1) / kHeadGroup * kHeadGroup; }

struct LogitsArgs {
  const std::uint8_t* q;             // [B, q_len, Hi, 128] fp8
  const float* weights;              // [B, q_len, Hi]
  const std::uint8_t* cache;         // [num_pages, page_size * 132]
  const std::int32_t* block_table;   // [B, max_pages]
  const std::int32_t* seq_lens;      // [B]
  float* logits;                     // [B, q_len, max_len]
  uint4* clear;                      // [clear_pieces] set to zero on the way (another op's scratch)
  std::int64_t clear_pieces;
  std::int64_t num_pages;
  int page_size;
  int page_shift;                    // log2(page_size) when a power of two, else -1
  int max_pages;
  int q_len;
  int heads;
  int max_len;
  int tiles_per_cta;                 // 16-token tiles of one CTA's span of positions
};

// One token's 32 key bytes for this lane (dims 16*tig .. and 64 + 16*tig ..) and its scale; false
// (and zeros) when the position is past the request's length or its page is outside the pool.
template <bool kAligned16>
__device__ __forceinline__ bool load_key(const LogitsArgs& a, int b, int t, int len, int tig, uint4 (&k)[2],
                                         float& scale) {
  k[0] = k[1] = make_uint4(0, 0, 0, 0);
  scale = 0.0f;
  if (t >= len) return false;
  int index, offset;  // page index in the table, position in the page
  if (a.page_shift >= 0) {
    index = t >> a.page_shift;
    offset = t & (a.page_size - 1);
  } else {
    index = t / a.page_size;
    offset = t - index * a.page_size;
  }
  const std::int32_t page = a.block_table[static_cast<std::int64_t>(b) * a.max_pages + index];
  if (page < 0 || page >= a.num_pages) return false;
  const std::uint8_t* page_base = a.cache + static_cast<std::int64_t>(page) * a.page_size * 132;
  const std::uint8_t* key = page_base + static_cast<std::int64_t>(offset) * kDim + 16 * tig;
  if constexpr (kAligned16) {
    k[0] = *reinterpret_cast<const uint4*>(key);
    k[1] = *reinterpret_cast<const uint4*>(key + kDim / 2);
  } else {  // pages of 132 x page_size bytes with page_size % 4 != 0: only 4-byte alignment
    const std::uint32_t* w = reinterpret_cast<const std::uint32_t*>(key);
    k[0] = make_uint4(w[0], w[1], w[2], w[3]);
    k[1] = make_uint4(w[16], w[17], w[18], w[19]);
  }
  scale = reinterpret_cast<const float*>(page_base + static_cast<std::int64_t>(a.page_size) * kDim)[offset];
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

// Shared-memory byte offset of 16-byte piece `piece` (0..3) of quarter `quarter` (0..3: the dims
// lane tig = quarter supplies) of head `head`'s f16 queries. The XOR swizzle spreads the 8 lanes of a
// load phase (heads g, g+1 of one 8-head tile, quarters 0..3) over all 8 16-byte bank groups.
__device__ __forceinline__ int q_offset(int row_head, int head, int quarter, int piece) {
  return row_head * kDim * 2 + quarter * 64 + ((piece ^ ((quarter >> 1) | ((head & 1) << 1))) * 16);
}

// What a lane keeps for its whole walk.
struct Lane {
  int b, len;             // its request and the request's length
  int g, tig;             // its place in the warp (mma row group, thread in group)
  int padded;             // heads padded to a multiple of kHeadGroup
  const std::uint8_t* q;  // its f16 queries of head g, row 0 (its quarter tig), in shared memory
  int sw;                 // q_offset's swizzle of its pieces (the same for heads n + g, n a multiple of 8)
  const float* w;         // the weights [q_len, padded] in shared memory
};

// One tile against every query row: S = K Q^T per 8 heads on the tensor cores, relu, weights, the
// sum over heads across the quad, kscale; -inf where the row cannot see.
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
  for (int i = 0; i < a.q_len; ++i) {
    float logit[2] = {0.0f, 0.0f};
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
    const int visible = l.len - a.q_len + i + 1;  // causal among the new tokens
    float* out = a.logits + (static_cast<std::int64_t>(l.b) * a.q_len + i) * a.max_len;
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

// One turn of a warp's walk: compute tile `tile` (its keys in `current`) after sending for the keys of
// the tile two turns ahead into `refill`; false (doing nothing) past the live tiles.
template <bool kAligned16>
__device__ __forceinline__ bool walk(const LogitsArgs& a, int tile, int live_end, const Lane& l, const Tile& current,
                                     Tile& refill) {
  if (tile >= live_end) return false;
  if (tile + 2 * kWarps < live_end) load_tile<kAligned16>(a, l.b, 16 * (tile + 2 * kWarps), l.len, l.g, l.tig, refill);
  tile_logits(a, current, 16 * tile, l);
  return true;
}

// Grid (CTAs per request, B). A CTA stages every query row of its request in shared memory once (as
// f16), then its warps walk the CTA's span of tiles, each loading its next tile while computing this one.
// At most 128 registers (4 CTAs, 16 warps per SM): the kernel fits them without spilling.
template <bool kAligned16>
__global__ void __launch_bounds__(kThreads, 4) logits_kernel(const LogitsArgs a) {
  extern __shared__ __align__(16) std::uint8_t q_s[];  // [q_len, padded heads, 128] f16, then [q_len, padded] weights
  const int b = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
  const int padded = padded_heads(a.heads);
  float* w_s = reinterpret_cast<float*>(q_s + a.q_len * padded * kDim * 2);
  wait_for_previous_kernels();
  const std::int64_t capacity = static_cast<std::int64_t>(a.max_pages) * a.page_size;
  const int len = static_cast<int>(min(static_cast<std::int64_t>(max(a.seq_lens[b], 0)), capacity));
  const int tiles = (a.max_len + 15) / 16;
  const int end = min(tiles, (blockIdx.x + 1) * a.tiles_per_cta);
  const int live_end = min(end, (len + 15) / 16);  // tiles holding positions below the length
  // Two tiles in flight per warp while it computes a third; the first two go out before the queries
  // are staged, so that their loads overlap.
  int tile = blockIdx.x * a.tiles_per_cta + warp;
  Tile t0, t1, t2;
  if (tile < live_end) load_tile<kAligned16>(a, b, 16 * tile, len, g, tig, t0);
  if (tile + kWarps < live_end) load_tile<kAligned16>(a, b, 16 * (tile + kWarps), len, g, tig, t1);
  // The next op's scratch, cleared by the whole grid while those loads are out.
  {
    const std::int64_t ctas = static_cast<std::int64_t>(gridDim.x) * gridDim.y;
    for (std::int64_t i = (static_cast<std::int64_t>(blockIdx.y) * gridDim.x + blockIdx.x) * kThreads + threadIdx.x;
         i < a.clear_pieces; i += ctas * kThreads) {
      a.clear[i] = make_uint4(0, 0, 0, 0);
    }
  }
  {
    // 16 codes (8 f16 pairs: two 16-byte pieces) per thread and step; zeros for padded heads.
    const uint4* q = reinterpret_cast<const uint4*>(a.q) + static_cast<std::int64_t>(b) * a.q_len * a.heads * (kDim / 16);
    constexpr int kChunks = kDim / 16;
    for (int j = threadIdx.x; j < a.q_len * padded * kChunks; j += kThreads) {
      const int i = j / (padded * kChunks), h = j / kChunks % padded, c = j % kChunks;
      const uint4 codes = h < a.heads ? q[(i * a.heads + h) * kChunks + c] : make_uint4(0, 0, 0, 0);
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
    const float* w = a.weights + static_cast<std::int64_t>(b) * a.q_len * a.heads;
    for (int j = threadIdx.x; j < a.q_len * padded; j += kThreads) {
      const int i = j / padded, h = j % padded;
      w_s[j] = h < a.heads ? w[i * a.heads + h] : 0.0f;
    }
  }
  __syncthreads();

  const Lane l{b, len, g, tig, padded, q_s + g * kDim * 2 + tig * 64, (tig >> 1) | ((g & 1) << 1), w_s};
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
  for (; tile < end; tile += kWarps) {
    for (int j = lane; j < 16 * a.q_len; j += 32) {
      const int i = j / 16, pos = 16 * tile + j % 16;
      if (pos < a.max_len) a.logits[(static_cast<std::int64_t>(b) * a.q_len + i) * a.max_len + pos] = -INFINITY;
    }
  }
}

// The grid fills one wave of resident CTAs whatever the batch: a single request spreads over the
// whole GPU, and large batches give every CTA a long span to stream.
template <bool kAligned16>
void launch(LogitsArgs a, int batch, std::size_t smem, cudaStream_t stream) {
  const auto kernel = logits_kernel<kAligned16>;
  // The most any call takes (64 heads x 4 rows: 66.5 KB, within the 99 KB every target allows),
  // allowed once per device the first time a call needs more than the default 48 KB.
  static_assert(padded_heads(kMaxIndexerHeads) == kMaxIndexerHeads);
  constexpr int kMaxSmem = kMaxDecodeQLen * kMaxIndexerHeads * (2 * kDim + static_cast<int>(sizeof(float)));
  static_assert(kMaxSmem <= 99 * 1024, "must fit the 99 KB per block of sm_89 and sm_120");
  if (smem > 48 * 1024) allow_dynamic_smem(kernel, kMaxSmem, "indexer_logits");
  const int sms = current_device_limits("indexer_logits").multiprocessors;
  const int per_sm = resident_ctas_per_sm(kernel, kThreads, smem, "indexer_logits");
  const int tiles = (a.max_len + 15) / 16;
  const int per_request = std::clamp((sms * std::max(per_sm, 1) + batch - 1) / batch, 1, (tiles + kWarps - 1) / kWarps);
  a.tiles_per_cta = (tiles + per_request - 1) / per_request;
  const int ctas = (tiles + a.tiles_per_cta - 1) / a.tiles_per_cta;
  launch_chained("indexer_logits", kernel, dim3(static_cast<unsigned>(ctas), static_cast<unsigned>(batch)), kThreads, smem,
                 stream, false, a);
}

}  // namespace

void launch_indexer_logits(const IndexerLogitsParams& p, cudaStream_t stream) {
  LogitsArgs a{};
  a.q = p.q.as<const std::uint8_t>();
  a.weights = p.weights.as<const float>();
  a.cache = p.cache.data;
  a.block_table = p.block_table.as<const std::int32_t>();
  a.seq_lens = p.seq_lens.as<const std::int32_t>();
  a.logits = p.logits.as<float>();
  a.num_pages = p.cache.num_pages;
  a.page_size = p.cache.page_size;
  const auto page_size = static_cast<unsigned>(a.page_size);  // >= 1 (validated)
  a.page_shift = std::has_single_bit(page_size) ? std::countr_zero(page_size) : -1;
  a.max_pages = static_cast<int>(p.block_table.size(1));
  a.q_len = static_cast<int>(p.q.size(1));
  a.heads = static_cast<int>(p.q.size(2));
  a.max_len = static_cast<int>(p.logits.size(2));
  a.clear = static_cast<uint4*>(p.clear);
  a.clear_pieces = static_cast<std::int64_t>(p.clear_bytes / sizeof(uint4));  // validated: a multiple of 16
  const int batch = static_cast<int>(p.q.size(0));
  if (batch == 0 || a.max_len == 0) {  // no kernel: the clear on its own
    if (p.clear_bytes > 0) LKV_CUDA_CHECK("indexer_logits", cudaMemsetAsync(p.clear, 0, p.clear_bytes, stream));
    return;
  }
  if (batch > kMaxIndexerBatch) {  // one grid row per request
    throw Error("indexer_logits", "q", p.q.shape_string(),
                "at most " + std::to_string(kMaxIndexerBatch) + " requests (B) per call");
  }
  check_aligned("indexer_logits", "q", a.q, 16);
  const int padded = padded_heads(a.heads);
  const auto smem = static_cast<std::size_t>(a.q_len) * padded * (2 * kDim + sizeof(float));
  if (a.page_size % 4 == 0) {  // 132 x page_size bytes per page: every key 16-byte aligned
    launch<true>(a, batch, smem, stream);
  } else {
    launch<false>(a, batch, smem, stream);
  }
}

}  // namespace latentkv::cuda
