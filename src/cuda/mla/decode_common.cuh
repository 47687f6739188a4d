// src/cuda/mla/decode_common.cuh - what the dense MLA decode kernels share: their arguments, and
// the narrow kernel's entry point (decode_narrow.cu) for the launcher in decode.cu.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace latentkv::cuda::mla {

inline constexpr float kLn2 = 0.6931471805599453f;
inline constexpr float kLog2e = 1.4426950408889634f;

struct DecodeArgs {
  const std::uint16_t* q;            // [B, q_len, H, 576] bf16
  const std::uint8_t* cache;         // [num_pages * page_size, token_bytes]
  const std::int32_t* block_table;   // [B, max_pages]
  const std::int32_t* seq_lens;      // [B]
  std::uint16_t* o;                  // [B, rows, 512] bf16 (rows = q_len * H)
  float* lse;                        // [B, rows]
  float* o_part;                     // [splits, B, rows, 512] f32, when num_splits > 1
  float* lse_part;                   // [splits, B, rows] f32
  std::int64_t num_pages;
  int page_size;
  int max_pages;
  int batch;
  int q_len;
  int heads;
  int rows;
  int num_splits;
  float scale_log2;                  // softmax_scale * log2(e)
};

// Few query rows over an fp8 cache (rows <= kNarrowMaxRows): the transposed kernel of
// decode_narrow.cu. Writes o/lse or, with splits, the partials that decode.cu's combine merges.
inline constexpr int kNarrowMaxRows = 16;
void launch_decode_narrow(const DecodeArgs& a, cudaStream_t stream);

}  // namespace latentkv::cuda::mla
