// Dense MLA decode and prefill (SPEC sections 4.2 and 4.3), and the attention core the sparse ops share.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "core/validate.hpp"
#include "cpu/common.hpp"
#include "cpu/reference.hpp"
#include "latentkv/fp8.hpp"

namespace latentkv::cpu {

namespace internal {

void attend(const double* q, int heads, const float* keys, std::int64_t n, double scale, double* o, double* lse) {
  std::vector<double> s(static_cast<std::size_t>(n));
  for (int h = 0; h < heads; ++h) {
    const double* qh = q + static_cast<std::ptrdiff_t>(h) * kQkDim;  // [576]
    double* oh = o + static_cast<std::ptrdiff_t>(h) * kLatentDim;      // [512]
    std::fill(oh, oh + kLatentDim, 0.0);
    if (n == 0) {
      lse[h] = -std::numeric_limits<double>::infinity();
      continue;
    }
    double m = -std::numeric_limits<double>::infinity();
    for (std::int64_t t = 0; t < n; ++t) {
      const float* k = keys + t * kQkDim;  // [576]
      double dot = 0.0;
      for (int j = 0; j < kQkDim; ++j) dot += qh[j] * static_cast<double>(k[j]);
      s[static_cast<std::size_t>(t)] = scale * dot;
      m = std::max(m, s[static_cast<std::size_t>(t)]);
    }
    double sum = 0.0;
    for (std::int64_t t = 0; t < n; ++t) {
      const double e = std::exp(s[static_cast<std::size_t>(t)] - m);
      sum += e;
      const float* v = keys + t * kQkDim;  // the first 512 values of the entry
      for (int j = 0; j < kLatentDim; ++j) oh[j] += e * static_cast<double>(v[j]);
    }
    for (int j = 0; j < kLatentDim; ++j) oh[j] /= sum;
    lse[h] = m + std::log(sum);
  }
}

void load_query(const TensorView& q, std::int64_t row, int heads, double* out) {
  const auto* bits = q.as<const std::uint16_t>() + row * heads * kQkDim;  // [heads, 576] bf16
  for (std::int64_t j = 0; j < static_cast<std::int64_t>(heads) * kQkDim; ++j) out[j] = bf16_decode(bits[j]);
}

void store_outputs(const TensorView& o, const TensorView& lse, std::int64_t row, int heads, const double* o_row,
                   const double* lse_row) {
  const std::int64_t o_base = row * heads * kLatentDim;
  const std::int64_t o_count = static_cast<std::int64_t>(heads) * kLatentDim;
  switch (o.dtype) {
    case DType::kBF16: {
      auto* out = o.as<std::uint16_t>() + o_base;  // [heads, 512]
      for (std::int64_t j = 0; j < o_count; ++j) out[j] = bf16_encode_double(o_row[j]);
      break;
    }
    case DType::kF32: {
      auto* out = o.as<float>() + o_base;
      for (std::int64_t j = 0; j < o_count; ++j) out[j] = static_cast<float>(o_row[j]);
      break;
    }
    default: {  // f64, the only other type validate_shapes lets through
      auto* out = o.as<double>() + o_base;
      std::copy(o_row, o_row + o_count, out);
      break;
    }
  }
  if (lse.dtype == DType::kF32) {
    auto* out = lse.as<float>() + row * heads;  // [heads]
    for (int h = 0; h < heads; ++h) out[h] = static_cast<float>(lse_row[h]);
  } else {
    auto* out = lse.as<double>() + row * heads;
    std::copy(lse_row, lse_row + heads, out);
  }
}

}  // namespace internal

namespace {

// Scratch for one request's positions and their dequantized entries.
struct RequestScratch {
  std::vector<std::int64_t> slots;  // [length]
  std::vector<float> keys;          // [length, 576]
};

// Takes the scratch of the longest request before anything is written (reserve_for_longest).
RequestScratch scratch_for_longest(std::string_view op, const TensorView& seq_lens) {
  RequestScratch s;
  internal::reserve_for_longest(op, seq_lens, sizeof(std::int64_t) + kQkDim * sizeof(float), [&](std::int64_t n) {
    s.slots.reserve(static_cast<std::size_t>(n));
    s.keys.reserve(static_cast<std::size_t>(n) * kQkDim);
  });
  return s;
}

// Attention of request b's new tokens (query rows first_row .. first_row + n_new - 1) over its
// `length` cached tokens, causal among the new ones.
void attend_request(const TensorView& q, const LatentCache& cache, const TensorView& block_table, std::int64_t b,
                    std::int64_t length, std::int64_t first_row, std::int64_t n_new, int heads, double scale,
                    const TensorView& o, const TensorView& lse, RequestScratch& scratch) {
  // Each query row sees a prefix of the request's positions, so dequantize them once.
  internal::request_slots(block_table, b, length, cache.page_size, scratch.slots);
  internal::gather_tokens(cache, scratch.slots, scratch.keys);  // [length, 576]
  const std::vector<float>& keys = scratch.keys;
  std::vector<double> q_row(static_cast<std::size_t>(heads) * kQkDim);   // [heads, 576]
  std::vector<double> o_row(static_cast<std::size_t>(heads) * kLatentDim);  // [heads, 512]
  std::vector<double> lse_row(static_cast<std::size_t>(heads));             // [heads]
  for (std::int64_t i = 0; i < n_new; ++i) {
    const std::int64_t row = first_row + i;
    const std::int64_t visible = std::min(length, internal::visible_positions(length, n_new, i));
    internal::load_query(q, row, heads, q_row.data());
    internal::attend(q_row.data(), heads, keys.data(), visible, scale, o_row.data(), lse_row.data());
    internal::store_outputs(o, lse, row, heads, o_row.data(), lse_row.data());
  }
}

}  // namespace

void mla_decode(const MlaDecodeParams& p) {
  latentkv::detail::validate_shapes(p, Device::cpu(), latentkv::detail::Outputs::kReferenceTypes);
  latentkv::detail::validate_values(p);

  const std::int64_t batch = p.q.size(0), q_len = p.q.size(1);
  const int heads = static_cast<int>(p.q.size(2));
  const auto* lens = p.seq_lens.as<const std::int32_t>();  // [B]
  RequestScratch scratch = scratch_for_longest("mla_decode", p.seq_lens);
  for (std::int64_t b = 0; b < batch; ++b) {
    attend_request(p.q, p.cache, p.block_table, b, lens[b], b * q_len, q_len, heads, p.softmax_scale, p.o, p.lse,
                   scratch);
  }
}

void mla_prefill(const MlaPrefillParams& p) {
  latentkv::detail::validate_shapes(p, Device::cpu(), latentkv::detail::Outputs::kReferenceTypes);
  latentkv::detail::validate_values(p);

  const std::int64_t batch = p.seq_lens.size(0);
  const int heads = static_cast<int>(p.q.size(1));
  const auto* cu = p.cu_new_tokens.as<const std::int32_t>();  // [B + 1]
  const auto* lens = p.seq_lens.as<const std::int32_t>();     // [B]
  RequestScratch scratch = scratch_for_longest("mla_prefill", p.seq_lens);
  for (std::int64_t b = 0; b < batch; ++b) {
    attend_request(p.q, p.cache, p.block_table, b, lens[b], cu[b], cu[b + 1] - cu[b], heads, p.softmax_scale, p.o,
                   p.lse, scratch);
  }
}

}  // namespace latentkv::cpu
