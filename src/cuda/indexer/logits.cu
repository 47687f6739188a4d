// Lightning-indexer logits (SPEC 4.4) over the paged fp8 indexer cache (132 B/token, page-major),
// on fp8 tensor cores (mma.sync m16n8k32 e4m3, sm_89 and later).
//
// Per token t and query row: logit_t = kscale_t * sum_h w_h relu(q_h . k_t). The dot products are
// one small matrix product per query row, S[token, head] = K[token, 0:128] . Q[head, 0:128]:
//   * A = 16 tokens x 32 dims of raw fp8 key codes, B = 32 dims x 8 heads of raw fp8 query codes.
//     The 128 dims are visited in a permuted order (the same for keys and queries, so every
//     product still pairs the right codes): lane (g, tig) supplies, for the four k-steps, dims
//     32*tig .. 32*tig + 31 - two 16-byte loads straight from a token's key, no shared memory.
//   * Each warp owns 32 tokens (two row tiles), loads their keys once into registers and reuses
//     them for every query row; a CTA of 4 warps covers 128 consecutive positions of one request.
//   * The queries and weights of a row sit in shared memory; heads are taken 8 at a time (a
//     missing head has zero queries and weight), relu'd, weighted and summed across the 4 lanes of
//     a quad, then scaled by kscale_t and written. Positions a row cannot see get -inf.
// The products of two e4m3 codes are exact; the sums are float32 in tensor-core order.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/cuda_check.hpp"
#include "cuda/common/mma.cuh"
#include "cuda/indexer/launch.hpp"
#include "latentkv/error.hpp"

namespace latentkv::cuda {
namespace {

constexpr int kDim = 128;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kTilesPerWarp = 2;                          // 16-token row tiles
constexpr int kTokensPerCta = kWarps * kTilesPerWarp * 16;  // 128
constexpr int kMaxHeadTiles = 8;                          // 64 indexer heads

struct LogitsArgs {
  const std::uint8_t* q;             // [B, q_len, Hi, 128] fp8
  const float* weights;              // [B, q_len, Hi]
  const std::uint8_t* cache;         // [num_pages, page_size * 132]
  const std::int32_t* block_table;   // [B, max_pages]
  const std::int32_t* seq_lens;      // [B]
  float* logits;                     // [B, q_len, max_len]
  std::int64_t num_pages;
  int page_size;
  int max_pages;
  int q_len;
  int heads;
  int max_len;
};

// One token's 32 key bytes for this lane (dims 32*tig ..) and its scale; false (and zeros) when the
// position is past the request's length or its page is outside the pool.
template <bool kAligned16>
__device__ __forceinline__ bool load_key(const LogitsArgs& a, int b, int t, int len, int tig, uint4 (&k)[2],
                                         float& scale) {
  k[0] = k[1] = make_uint4(0, 0, 0, 0);
  scale = 0.0f;
  if (t >= len) return false;
  const std::int32_t page = a.block_table[static_cast<std::int64_t>(b) * a.max_pages + t / a.page_size];
  if (page < 0 || page >= a.num_pages) return false;
  const std::uint8_t* page_base = a.cache + static_cast<std::int64_t>(page) * a.page_size * 132;
  const int offset = t % a.page_size;
  const std::uint8_t* key = page_base + static_cast<std::int64_t>(offset) * kDim + 32 * tig;
  if constexpr (kAligned16) {
    k[0] = reinterpret_cast<const uint4*>(key)[0];
    k[1] = reinterpret_cast<const uint4*>(key)[1];
  } else {  // pages of 132 x page_size bytes with page_size % 4 != 0: only 4-byte alignment
    const std::uint32_t* w = reinterpret_cast<const std::uint32_t*>(key);
    k[0] = make_uint4(w[0], w[1], w[2], w[3]);
    k[1] = make_uint4(w[4], w[5], w[6], w[7]);
  }
  scale = reinterpret_cast<const float*>(page_base + static_cast<std::int64_t>(a.page_size) * kDim)[offset];
  return true;
}

// Word w (4 codes) of a lane's 32 bytes; k-step s takes words 2s and 2s + 1.
__device__ __forceinline__ std::uint32_t word(const uint4 (&k)[2], int w) {
  const uint4& v = k[w / 4];
  switch (w % 4) {
    case 0: return v.x;
    case 1: return v.y;
    case 2: return v.z;
    default: return v.w;
  }
}

template <bool kAligned16>
__global__ void __launch_bounds__(kThreads) logits_kernel(const LogitsArgs a) {
  __shared__ __align__(16) std::uint8_t q_s[kMaxHeadTiles * 8 * kDim];  // one row's queries, zero-padded heads
  __shared__ float w_s[kMaxHeadTiles * 8];
  const int b = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tig = lane % 4;
  const int head_tiles = (a.heads + 7) / 8;
  const std::int64_t capacity = static_cast<std::int64_t>(a.max_pages) * a.page_size;
  const int len = static_cast<int>(min(static_cast<std::int64_t>(max(a.seq_lens[b], 0)), capacity));
  const int warp_base = blockIdx.x * kTokensPerCta + warp * kTilesPerWarp * 16;

  // This warp's keys: rows g and g + 8 of each tile.
  uint4 keys[kTilesPerWarp][2][2];
  float scales[kTilesPerWarp][2];
  bool cached[kTilesPerWarp][2];
#pragma unroll
  for (int m = 0; m < kTilesPerWarp; ++m) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      cached[m][r] = load_key<kAligned16>(a, b, warp_base + 16 * m + g + 8 * r, len, tig, keys[m][r], scales[m][r]);
    }
  }

  for (int i = 0; i < a.q_len; ++i) {
    const std::int64_t row = static_cast<std::int64_t>(b) * a.q_len + i;
    __syncthreads();  // the previous row's queries are no longer read
    const uint4* q = reinterpret_cast<const uint4*>(a.q + row * a.heads * kDim);
    uint4* q_s4 = reinterpret_cast<uint4*>(q_s);
    for (int j = threadIdx.x; j < head_tiles * 8 * kDim / 16; j += kThreads) {
      q_s4[j] = j < a.heads * kDim / 16 ? q[j] : make_uint4(0, 0, 0, 0);
    }
    for (int j = threadIdx.x; j < head_tiles * 8; j += kThreads) w_s[j] = j < a.heads ? a.weights[row * a.heads + j] : 0.0f;
    __syncthreads();

    float logit[kTilesPerWarp][2] = {};
    for (int n = 0; n < head_tiles; ++n) {
      // Head n*8 + g's 32 codes for this lane, and the weights of the heads this lane accumulates.
      const uint4* qh = reinterpret_cast<const uint4*>(q_s + (n * 8 + g) * kDim + 32 * tig);
      const uint4 qk[2] = {qh[0], qh[1]};
      const float w0 = w_s[n * 8 + 2 * tig], w1 = w_s[n * 8 + 2 * tig + 1];
#pragma unroll
      for (int m = 0; m < kTilesPerWarp; ++m) {
        float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int step = 0; step < 4; ++step) {
          mma_e4m3_16832(s, word(keys[m][0], 2 * step), word(keys[m][1], 2 * step), word(keys[m][0], 2 * step + 1),
                         word(keys[m][1], 2 * step + 1), word(qk, 2 * step), word(qk, 2 * step + 1));
        }
        logit[m][0] = fmaf(w0, fmaxf(s[0], 0.0f), fmaf(w1, fmaxf(s[1], 0.0f), logit[m][0]));
        logit[m][1] = fmaf(w0, fmaxf(s[2], 0.0f), fmaf(w1, fmaxf(s[3], 0.0f), logit[m][1]));
      }
    }
    const int visible = len - a.q_len + i + 1;  // causal among the new tokens
    float* out = a.logits + row * a.max_len;
#pragma unroll
    for (int m = 0; m < kTilesPerWarp; ++m) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float v = logit[m][r];
        v += __shfl_xor_sync(0xffffffffu, v, 1);
        v += __shfl_xor_sync(0xffffffffu, v, 2);
        const int t = warp_base + 16 * m + g + 8 * r;
        if (tig == 0 && t < a.max_len) out[t] = t < visible && cached[m][r] ? v * scales[m][r] : -INFINITY;
      }
    }
  }
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
  a.max_pages = static_cast<int>(p.block_table.size(1));
  a.q_len = static_cast<int>(p.q.size(1));
  a.heads = static_cast<int>(p.q.size(2));
  a.max_len = static_cast<int>(p.logits.size(2));
  const int batch = static_cast<int>(p.q.size(0));
  if (batch == 0 || a.max_len == 0) return;
  if (reinterpret_cast<std::uintptr_t>(a.q) % 16 != 0) {
    throw Error("indexer_logits", "q", "an address not 16-byte aligned", "16-byte aligned device memory");
  }
  const dim3 grid(static_cast<unsigned>((a.max_len + kTokensPerCta - 1) / kTokensPerCta), static_cast<unsigned>(batch));
  if (a.page_size % 4 == 0) {  // 132 x page_size bytes per page: every key 16-byte aligned
    logits_kernel<true><<<grid, kThreads, 0, stream>>>(a);
  } else {
    logits_kernel<false><<<grid, kThreads, 0, stream>>>(a);
  }
  LKV_CUDA_CHECK_LAUNCH("indexer_logits");
}

}  // namespace latentkv::cuda
