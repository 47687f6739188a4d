// src/cpu/common.hpp - helpers shared by the reference ops (not part of the library's API).
//
// Dequantized cache values are float32 products (fp8 value x float32 scale, computed in float32 as
// the kernels do) or bf16 values, so holding them in float is exact; all arithmetic on them is in
// double.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "latentkv/ops.hpp"

namespace latentkv::cpu::internal {

// The 576 values of one main-cache slot exactly as a kernel reads them: 512 latent, then 64 rope.
void dequantize_token_f32(const LatentCache& cache, std::int64_t slot, float* out576);

// Dequantizes the listed slots of the main cache into `keys`, one row each (duplicates give
// duplicate rows).
void gather_tokens(const LatentCache& cache, const std::vector<std::int64_t>& slots,
                   std::vector<float>& keys);  // keys: [n, 576]

// The physical slots of logical positions 0 .. length-1 of request `b`, into `slots`.
void request_slots(const TensorView& block_table, std::int64_t b, std::int64_t length, int page_size,
                   std::vector<std::int64_t>& slots);

// The reference holds a request's dequantized tokens at once, in scratch that grows with its length.
// An op takes that scratch for its longest request (`reserve(length)` reserves every vector it
// needs; `bytes_per_token` says how much that is) before it writes anything, so that a length the
// host cannot hold scratch for is an Error naming it (op, seq_lens[b]) and every output is as it
// was. Vectors filled later within the reserved capacity are not reallocated.
void reserve_for_longest(std::string_view op, const TensorView& seq_lens, double bytes_per_token,
                         const std::function<void(std::int64_t)>& reserve);

// Positions a new token sees: new token i of a request with n new tokens and `length` tokens in all
// sees logical positions t < length - n + i + 1 (never fewer than 0).
inline std::int64_t visible_positions(std::int64_t length, std::int64_t n_new, std::int64_t i) {
  const std::int64_t v = length - n_new + i + 1;
  return v < 0 ? 0 : v;
}

// One query row's indexer logits over keys [n, 128] (without scale) and their scales [n]:
// out[t] = sum_h w_h relu(q_h . k_t) * scale_t for t < visible (visible <= n), in double, stored as float.
void indexer_row(const double* q,  // [heads, 128]
                 const float* w,   // [heads]
                 int heads, const double* keys, const double* key_scales, std::int64_t visible, float* out);

// One row's top-k: the slots of the k largest of x[0 .. visible), ties to the earlier position,
// then -1 padding. out: [k]; `positions` is scratch (visible elements).
void topk_row(const float* x, std::int64_t visible, std::int64_t k, const std::vector<std::int64_t>& slots,
              std::vector<std::int64_t>& positions, std::int32_t* out);

// Softmax attention of one query token's heads over n keys, in double:
// s_t = scale * q.k_t, o = sum_t softmax(s)_t v_t (v = the first 512 key values), lse = log sum_t exp(s_t).
// With n == 0: o = 0 and lse = -inf.
void attend(const double* q,     // [heads, 576]
            int heads,
            const float* keys,   // [n, 576] dequantized entries
            std::int64_t n,
            double scale,
            double* o,           // [heads, 512]
            double* lse);        // [heads]

// Row `row` of a query tensor ([rows, heads, 576] bf16, any leading dims flattened) as doubles.
void load_query(const TensorView& q, std::int64_t row, int heads, double* out);  // out: [heads, 576]

// Writes one query token's outputs into o ([rows, heads, 512] bf16/f32/f64) and lse ([rows, heads]
// f32/f64), converting from double according to each view's dtype.
void store_outputs(const TensorView& o, const TensorView& lse, std::int64_t row, int heads,
                   const double* o_row,     // [heads, 512]
                   const double* lse_row);  // [heads]

}  // namespace latentkv::cpu::internal
