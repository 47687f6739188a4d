// Lightning-indexer logits (SPEC 4.4) over the paged fp8 indexer cache (132 B/token, page-major).
//
// One thread per cached token and request: it reads the token's 128 fp8 codes and scale once, then
// for each of the request's q_len query rows (one row's queries in shared memory as floats, read as
// broadcasts) computes relu(q_h . k) for every indexer head in float32 - the fp8 products are exact -
// weights them and writes the row's logit. Positions a row cannot see get -inf.
// A plain CUDA-core kernel: correct on every architecture; the tensor-core version is future work.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/common/convert.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/indexer/launch.hpp"

namespace latentkv::cuda {
namespace {

constexpr int kThreads = 256;  // tokens per CTA
constexpr int kDim = 128;
constexpr int kMaxHeads = 64;   // indexer heads (validated: 1 .. 64)

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

__global__ void __launch_bounds__(kThreads) logits_kernel(const LogitsArgs a) {
  extern __shared__ float q_s[];  // one query row: [Hi, 128] as float, then its weights [Hi]
  float* w_s = q_s + a.heads * kDim;
  const int b = blockIdx.y;
  const int t = blockIdx.x * kThreads + threadIdx.x;

  // This thread's token: its slot's 128 codes and scale, or nothing (past the end, or a page
  // outside the pool: not visible to any row).
  const std::int64_t capacity = static_cast<std::int64_t>(a.max_pages) * a.page_size;
  const int len = static_cast<int>(min(static_cast<std::int64_t>(max(a.seq_lens[b], 0)), capacity));
  std::int32_t page = -1;
  if (t < len) page = a.block_table[static_cast<std::int64_t>(b) * a.max_pages + t / a.page_size];
  const bool have_token = page >= 0 && page < a.num_pages;
  uint4 codes[kDim / 16] = {};  // registers: indexed only inside fully unrolled loops
  float kscale = 0.0f;
  if (have_token) {
    const std::uint8_t* page_base = a.cache + static_cast<std::int64_t>(page) * a.page_size * 132;
    const int offset = t % a.page_size;
    kscale = reinterpret_cast<const float*>(page_base + static_cast<std::int64_t>(a.page_size) * kDim)[offset];
    const std::uint8_t* key = page_base + static_cast<std::int64_t>(offset) * kDim;
    if (a.page_size % 4 == 0) {  // pages of 132 x page_size bytes: 16-byte aligned keys
#pragma unroll
      for (int c = 0; c < kDim / 16; ++c) codes[c] = reinterpret_cast<const uint4*>(key)[c];
    } else {  // only 4-byte alignment is guaranteed
      const std::uint32_t* k32 = reinterpret_cast<const std::uint32_t*>(key);
#pragma unroll
      for (int c = 0; c < kDim / 16; ++c) codes[c] = make_uint4(k32[4 * c], k32[4 * c + 1], k32[4 * c + 2], k32[4 * c + 3]);
    }
  }

  for (int i = 0; i < a.q_len; ++i) {
    __syncthreads();  // the previous row's queries are no longer read
    const std::int64_t row = static_cast<std::int64_t>(b) * a.q_len + i;
    const std::uint8_t* q = a.q + row * a.heads * kDim;
    for (int j = threadIdx.x; j < a.heads * kDim; j += kThreads) q_s[j] = fp8_to_float(q[j]);
    for (int j = threadIdx.x; j < a.heads; j += kThreads) w_s[j] = a.weights[row * a.heads + j];
    __syncthreads();
    if (t >= a.max_len) continue;
    float* out = a.logits + row * a.max_len + t;
    if (!have_token || t >= len - a.q_len + i + 1) {  // not cached, or not visible to this row (causal)
      *out = -INFINITY;
      continue;
    }
    float acc[kMaxHeads];  // q_h . k for every head; k converted 4 codes at a time
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) acc[h] = 0.0f;
#pragma unroll
    for (int c = 0; c < kDim / 16; ++c) {
      const std::uint32_t words[4] = {codes[c].x, codes[c].y, codes[c].z, codes[c].w};
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) {
        const std::uint32_t lo = fp8x2_to_f16x2(words[wd]), hi = fp8x2_to_f16x2(words[wd] >> 16);
        const float2 k01 = __half22float2(*reinterpret_cast<const __half2*>(&lo));
        const float2 k23 = __half22float2(*reinterpret_cast<const __half2*>(&hi));
        const int d = 16 * c + 4 * wd;
#pragma unroll
        for (int h = 0; h < kMaxHeads; ++h) {
          if (h < a.heads) {
            const float4 qv = *reinterpret_cast<const float4*>(q_s + h * kDim + d);  // a broadcast
            acc[h] = fmaf(qv.w, k23.y, fmaf(qv.z, k23.x, fmaf(qv.y, k01.y, fmaf(qv.x, k01.x, acc[h]))));
          }
        }
      }
    }
    float logit = 0.0f;
#pragma unroll
    for (int h = 0; h < kMaxHeads; ++h) {
      if (h < a.heads) logit = fmaf(w_s[h], fmaxf(acc[h], 0.0f), logit);
    }
    *out = logit * kscale;
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
  const int smem = static_cast<int>(sizeof(float)) * a.heads * (kDim + 1);  // <= 33 KB for 64 heads
  const dim3 grid(static_cast<unsigned>((a.max_len + kThreads - 1) / kThreads), static_cast<unsigned>(batch));
  logits_kernel<<<grid, kThreads, smem, stream>>>(a);
  LKV_CUDA_CHECK_LAUNCH("indexer_logits");
}

}  // namespace latentkv::cuda
