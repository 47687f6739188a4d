// tests/support/naive.hpp - an independent, textbook formulation of every op, to test the reference.
//
// Written apart from src/cpu on purpose: its own fp8/bf16 decoders (from the bit fields, with
// std::ldexp), its own little-endian byte reads, its own walk over a request's pages (page after page
// of the block-table row, rather than a slot per position), and plain softmax attention (scores,
// probabilities, then the weighted sum). Only the float32 product fp8 x scale is shared with the
// kernels, because that is the quantity the cache defines.
//
// Everything returns float64; the comparisons in support/compare.hpp decide what is close enough.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "latentkv/cache.hpp"
#include "support/host_tensor.hpp"
#include "support/paged_fixture.hpp"

namespace latentkv::testing::naive {

inline constexpr double kNegInf = -std::numeric_limits<double>::infinity();

// ---- decoding the bytes ------------------------------------------------------------------------

// FP8 e4m3fn from its bit fields: sign, 4 exponent bits (bias 7), 3 mantissa bits; S.1111.111 is NaN.
inline double fp8_value(std::uint8_t code) {
  const bool negative = (code & 0x80) != 0;
  const int exponent = (code >> 3) & 0xF;
  const int mantissa = code & 0x7;
  if (exponent == 0xF && mantissa == 0x7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = exponent == 0 ? std::ldexp(mantissa, -9)  // subnormal: m/8 * 2^-6
                                         : std::ldexp(8 + mantissa, exponent - 10);  // (1 + m/8) * 2^(e-7)
  return negative ? -magnitude : magnitude;
}

inline std::uint16_t u16_le(const std::uint8_t* p) { return static_cast<std::uint16_t>(p[0] | (p[1] << 8)); }
inline std::uint32_t u32_le(const std::uint8_t* p) {
  return static_cast<std::uint32_t>(p[0]) | (static_cast<std::uint32_t>(p[1]) << 8) |
         (static_cast<std::uint32_t>(p[2]) << 16) | (static_cast<std::uint32_t>(p[3]) << 24);
}
inline double bf16_value(std::uint16_t bits) { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }
inline float f32_le(const std::uint8_t* p) { return std::bit_cast<float>(u32_le(p)); }

inline std::size_t token_bytes(KvDtype dtype) { return dtype == KvDtype::kBf16 ? 1152 : 656; }

// The 576 values of the main-cache token whose bytes start at `token`.
inline void token_values(const std::uint8_t* token, KvDtype dtype, double* out576) {
  if (dtype == KvDtype::kBf16) {
    for (int j = 0; j < 576; ++j) out576[j] = bf16_value(u16_le(token + 2 * j));
    return;
  }
  for (int block = 0; block < 4; ++block) {
    const float scale = f32_le(token + 512 + 4 * block);
    for (int j = block * 128; j < (block + 1) * 128; ++j) {
      const float product = static_cast<float>(fp8_value(token[j])) * scale;  // float32, as the kernels
      out576[j] = product;
    }
  }
  for (int j = 0; j < 64; ++j) out576[512 + j] = bf16_value(u16_le(token + 528 + 2 * j));
}

// A request's first `length` tokens as a dense [length, 576] array, walking its block-table row.
inline std::vector<double> request_tokens(const std::vector<std::uint8_t>& cache_bytes, KvDtype dtype, int page_size,
                                          const std::int32_t* table_row, std::int64_t length) {
  const std::size_t bytes = token_bytes(dtype);
  std::vector<double> out(static_cast<std::size_t>(length) * 576);
  std::int64_t position = 0;
  for (int column = 0; position < length; ++column) {
    const std::uint8_t* page = cache_bytes.data() + static_cast<std::size_t>(table_row[column]) * page_size * bytes;
    for (int offset = 0; offset < page_size && position < length; ++offset, ++position) {
      token_values(page + offset * bytes, dtype, out.data() + position * 576);
    }
  }
  return out;
}

// Query rows [rows, heads, 576] bf16 as doubles.
inline std::vector<double> bf16_rows(const HostTensor& q) {
  std::vector<double> out(static_cast<std::size_t>(q.numel()));
  for (std::int64_t i = 0; i < q.numel(); ++i) out[static_cast<std::size_t>(i)] = bf16_value(q.data<std::uint16_t>()[i]);
  return out;
}

// New token i of n new tokens sits at position length - n + i and sees every position up to its own.
inline std::int64_t causal_visible(std::int64_t length, std::int64_t n_new, std::int64_t i) {
  const std::int64_t own_position = length - n_new + i;
  return own_position < 0 ? 0 : own_position + 1;
}

// ---- attention ---------------------------------------------------------------------------------

struct Attention {
  std::vector<double> o;    // [rows, heads, 512]
  std::vector<double> lse;  // [rows, heads]
};

// Softmax attention of one query token (heads x 576) over the first n rows of keys (n x 576).
inline void softmax_attention(const double* q, int heads, const double* keys, std::int64_t n, double scale,
                              double* o,      // [heads, 512]
                              double* lse) {  // [heads]
  for (int h = 0; h < heads; ++h) {
    if (n == 0) {
      std::fill(o + h * 512, o + (h + 1) * 512, 0.0);
      lse[h] = kNegInf;
      continue;
    }
    std::vector<double> score(static_cast<std::size_t>(n));
    for (std::int64_t t = 0; t < n; ++t) {
      double dot = 0;
      for (int j = 0; j < 576; ++j) dot += q[h * 576 + j] * keys[t * 576 + j];
      score[static_cast<std::size_t>(t)] = scale * dot;
    }
    const double top = *std::max_element(score.begin(), score.end());
    std::vector<double> prob(score.size());
    double z = 0;
    for (std::size_t t = 0; t < score.size(); ++t) z += prob[t] = std::exp(score[t] - top);
    for (double& p : prob) p /= z;
    for (int j = 0; j < 512; ++j) {
      double acc = 0;
      for (std::int64_t t = 0; t < n; ++t) acc += prob[static_cast<std::size_t>(t)] * keys[t * 576 + j];
      o[h * 512 + j] = acc;
    }
    lse[h] = top + std::log(z);
  }
}

// Dense decode: q [B, q_len, H, 576] bf16 against the fixture's cache.
inline Attention mla_decode(const PagedFixture& f, const HostTensor& q, double scale) {
  const std::int64_t batch = q.shape()[0], q_len = q.shape()[1];
  const int heads = static_cast<int>(q.shape()[2]);
  const std::vector<double> qd = bf16_rows(q);
  Attention out{std::vector<double>(static_cast<std::size_t>(batch * q_len * heads * 512)),
                std::vector<double>(static_cast<std::size_t>(batch * q_len * heads))};
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t length = f.seq_lens[static_cast<std::size_t>(b)];
    const std::vector<double> keys =
        request_tokens(f.cache_bytes, f.kv_dtype, f.page_size, f.block_table.data() + b * f.max_pages, length);
    for (std::int64_t i = 0; i < q_len; ++i) {
      const std::int64_t row = b * q_len + i;
      softmax_attention(qd.data() + row * heads * 576, heads, keys.data(), causal_visible(length, q_len, i), scale,
                        out.o.data() + row * heads * 512, out.lse.data() + row * heads);
    }
  }
  return out;
}

// Dense prefill: q [T, H, 576] bf16, request b's new tokens are rows cu[b] .. cu[b+1]-1.
inline Attention mla_prefill(const PagedFixture& f, const HostTensor& q, const std::vector<std::int32_t>& cu,
                             double scale) {
  const std::int64_t rows = q.shape()[0];
  const int heads = static_cast<int>(q.shape()[1]);
  const std::vector<double> qd = bf16_rows(q);
  Attention out{std::vector<double>(static_cast<std::size_t>(rows * heads * 512)),
                std::vector<double>(static_cast<std::size_t>(rows * heads))};
  for (std::size_t b = 0; b + 1 < cu.size(); ++b) {
    const std::int64_t length = f.seq_lens[b];
    const std::int64_t n_new = cu[b + 1] - cu[b];
    const std::vector<double> keys = request_tokens(f.cache_bytes, f.kv_dtype, f.page_size,
                                                    f.block_table.data() + b * static_cast<std::size_t>(f.max_pages), length);
    for (std::int64_t i = 0; i < n_new; ++i) {
      const std::int64_t row = cu[b] + i;
      softmax_attention(qd.data() + row * heads * 576, heads, keys.data(), causal_visible(length, n_new, i), scale,
                        out.o.data() + row * heads * 512, out.lse.data() + row * heads);
    }
  }
  return out;
}

// Sparse attention: q [rows, H, 576] bf16 (decode's [B, q_len, ...] flattened), indices [rows, topk]
// physical slots, -1 skipped, a repeated slot counted as often as it is listed.
inline Attention sparse_attention(const std::vector<std::uint8_t>& cache_bytes, KvDtype dtype, const HostTensor& q,
                                  int heads, const std::vector<std::int32_t>& indices, std::int64_t topk, double scale) {
  const std::int64_t rows = q.numel() / (static_cast<std::int64_t>(heads) * 576);
  const std::vector<double> qd = bf16_rows(q);
  Attention out{std::vector<double>(static_cast<std::size_t>(rows * heads * 512)),
                std::vector<double>(static_cast<std::size_t>(rows * heads))};
  for (std::int64_t r = 0; r < rows; ++r) {
    std::vector<double> keys;
    for (std::int64_t k = 0; k < topk; ++k) {
      const std::int32_t slot = indices[static_cast<std::size_t>(r * topk + k)];
      if (slot == -1) continue;
      keys.resize(keys.size() + 576);
      token_values(cache_bytes.data() + static_cast<std::size_t>(slot) * token_bytes(dtype), dtype,
                   keys.data() + keys.size() - 576);
    }
    softmax_attention(qd.data() + r * heads * 576, heads, keys.data(), static_cast<std::int64_t>(keys.size() / 576),
                      scale, out.o.data() + r * heads * 512, out.lse.data() + r * heads);
  }
  return out;
}

// ---- indexer and top-k -------------------------------------------------------------------------

// Indexer logits [B, q_len, max_len] (-inf where not visible) for q [B, q_len, Hi, 128] fp8 and
// weights [B, q_len, Hi] f32, reading the fixture's page-major indexer cache directly.
inline std::vector<double> indexer_logits(const PagedFixture& f, const HostTensor& q, const HostTensor& weights,
                                          std::int64_t max_len) {
  const std::int64_t batch = q.shape()[0], q_len = q.shape()[1], heads = q.shape()[2];
  const std::size_t page_bytes = static_cast<std::size_t>(f.page_size) * 132;
  std::vector<double> out(static_cast<std::size_t>(batch * q_len * max_len), kNegInf);
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t length = f.seq_lens[static_cast<std::size_t>(b)];
    // keys[t] (128 values) and key_scale[t], page after page.
    std::vector<double> keys(static_cast<std::size_t>(length) * 128), key_scale(static_cast<std::size_t>(length));
    std::int64_t position = 0;
    for (int column = 0; position < length; ++column) {
      const std::uint8_t* page = f.indexer_bytes.data() + f.block_table[static_cast<std::size_t>(b * f.max_pages + column)] * page_bytes;
      for (int offset = 0; offset < f.page_size && position < length; ++offset, ++position) {
        for (int j = 0; j < 128; ++j) keys[static_cast<std::size_t>(position * 128 + j)] = fp8_value(page[offset * 128 + j]);
        key_scale[static_cast<std::size_t>(position)] = f32_le(page + f.page_size * 128 + offset * 4);
      }
    }
    for (std::int64_t i = 0; i < q_len; ++i) {
      const std::int64_t row = b * q_len + i;
      for (std::int64_t t = 0; t < causal_visible(length, q_len, i); ++t) {
        double logit = 0;
        for (std::int64_t h = 0; h < heads; ++h) {
          double dot = 0;
          for (int j = 0; j < 128; ++j) {
            dot += fp8_value(q.data<std::uint8_t>()[(row * heads + h) * 128 + j]) * keys[static_cast<std::size_t>(t * 128 + j)];
          }
          logit += static_cast<double>(weights.data<float>()[row * heads + h]) * std::max(dot, 0.0);
        }
        out[static_cast<std::size_t>(row * max_len + t)] = logit * key_scale[static_cast<std::size_t>(t)];
      }
    }
  }
  return out;
}

// Checks a top-k answer: for every row, exactly min(k, visible) distinct slots of positions the row
// sees, the rest -1, and the chosen logits equal to the min(k, visible) largest visible logits as a
// multiset (so ties may be broken either way). logits [B, q_len, max_len] f32, slots [B, q_len, k] i32.
inline ::testing::AssertionResult check_topk(const std::vector<std::int32_t>& block_table, int max_pages, int page_size,
                                             const std::vector<std::int32_t>& seq_lens, const HostTensor& logits,
                                             const HostTensor& slots) {
  const std::int64_t batch = logits.shape()[0], q_len = logits.shape()[1], max_len = logits.shape()[2];
  const std::int64_t k = slots.shape()[2];
  const float* x = logits.data<float>();
  const std::int32_t* got = slots.data<std::int32_t>();
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t length = seq_lens[static_cast<std::size_t>(b)];
    std::map<std::int64_t, std::int64_t> position_of;  // slot -> position, walking the pages
    for (std::int64_t column = 0; column * page_size < length; ++column) {
      for (int offset = 0; offset < page_size && column * page_size + offset < length; ++offset) {
        position_of[static_cast<std::int64_t>(block_table[static_cast<std::size_t>(b * max_pages + column)]) * page_size + offset] =
            column * page_size + offset;
      }
    }
    for (std::int64_t i = 0; i < q_len; ++i) {
      const std::int64_t row = b * q_len + i;
      const std::int64_t visible = causal_visible(length, q_len, i);
      const std::int64_t want = std::min(k, visible);
      auto where = [&] { return "row [" + std::to_string(b) + ", " + std::to_string(i) + "] (visible " + std::to_string(visible) + ", k " + std::to_string(k) + "): "; };
      std::vector<float> chosen;
      std::set<std::int32_t> seen;
      std::int64_t pads = 0;
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int32_t s = got[row * k + j];
        if (s == -1) {
          ++pads;
          continue;
        }
        const auto it = position_of.find(s);
        if (it == position_of.end()) return ::testing::AssertionFailure() << where() << "entry " << j << " = " << s << " is not a slot of the request";
        if (it->second >= visible) return ::testing::AssertionFailure() << where() << "slot " << s << " is position " << it->second << ", not visible";
        if (!seen.insert(s).second) return ::testing::AssertionFailure() << where() << "slot " << s << " listed twice";
        chosen.push_back(x[row * max_len + it->second]);
      }
      if (static_cast<std::int64_t>(chosen.size()) != want || pads != k - want) {
        return ::testing::AssertionFailure() << where() << chosen.size() << " slots and " << pads << " pads, expected " << want << " and " << k - want;
      }
      std::vector<float> all(x + row * max_len, x + row * max_len + visible);
      std::sort(all.begin(), all.end(), std::greater<>());
      std::sort(chosen.begin(), chosen.end(), std::greater<>());
      for (std::int64_t j = 0; j < want; ++j) {
        if (chosen[static_cast<std::size_t>(j)] != all[static_cast<std::size_t>(j)]) {
          return ::testing::AssertionFailure() << where() << "the " << j << "-th largest chosen logit is " << chosen[static_cast<std::size_t>(j)]
                                               << ", the " << j << "-th largest visible logit is " << all[static_cast<std::size_t>(j)];
        }
      }
    }
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult check_topk(const PagedFixture& f, const HostTensor& logits, const HostTensor& slots) {
  return check_topk(f.block_table, f.max_pages, f.page_size, f.seq_lens, logits, slots);
}

}  // namespace latentkv::testing::naive
