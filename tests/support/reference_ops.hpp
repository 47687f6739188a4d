// tests/support/reference_ops.hpp - the CPU reference run on a PagedFixture, outputs sentinel-filled
// first, and index helpers for the sparse ops.
//
// GPU tests call these for the expected side of a comparison; CPU tests compare them with
// support/naive.hpp. Outputs default to float64 so nothing is lost before the comparison.
#pragma once

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "cpu/reference.hpp"
#include "latentkv/dsa.hpp"
#include "support/host_tensor.hpp"
#include "support/paged_fixture.hpp"
#include "support/rng.hpp"

namespace latentkv::testing {

struct AttentionOutputs {
  HostTensor o;    // [B, q_len, H, 512] or [T, H, 512]
  HostTensor lse;  // [B, q_len, H] or [T, H]
};

// A read-only input's view (the ops never write through it).
inline TensorView input_view(const HostTensor& t) { return const_cast<HostTensor&>(t).view(); }

// dsa_decode's arguments over f (both caches, the block table, the lengths) without a workspace: q
// [B, q_len, H, 576] bf16, q_idx [B, q_len, Hi, 128] fp8 and weights [B, q_len, Hi] f32, into o and lse.
inline DsaDecodeParams dsa_decode_args(PagedFixture& f, const HostTensor& q, const HostTensor& q_idx,
                                       const HostTensor& weights, HostTensor& o, HostTensor& lse, float softmax_scale,
                                       int topk, int max_len = 0) {
  DsaDecodeParams p;
  p.q = input_view(q);
  p.q_idx = input_view(q_idx);
  p.weights = input_view(weights);
  p.cache = f.cache();
  p.indexer = f.indexer();
  p.block_table = f.block_table_view();
  p.seq_lens = f.seq_lens_view();
  p.o = o.view();
  p.lse = lse.view();
  p.softmax_scale = softmax_scale;
  p.topk = topk;
  p.max_len = max_len;
  return p;
}

// Dense decode of q [B, q_len, H, 576] bf16.
inline AttentionOutputs reference_mla_decode(PagedFixture& f, const HostTensor& q, float softmax_scale,
                                             DType o_dtype = DType::kF64, DType lse_dtype = DType::kF64) {
  const std::int64_t b = q.shape()[0], q_len = q.shape()[1], h = q.shape()[2];
  AttentionOutputs out{sentinel_tensor(o_dtype, {b, q_len, h, kLatentDim}), sentinel_tensor(lse_dtype, {b, q_len, h})};
  MlaDecodeParams p;
  p.q = input_view(q);
  p.cache = f.cache();
  p.block_table = f.block_table_view();
  p.seq_lens = f.seq_lens_view();
  p.o = out.o.view();
  p.lse = out.lse.view();
  p.softmax_scale = softmax_scale;
  cpu::mla_decode(p);
  return out;
}

// A ragged prefill batch: request b holds prefixes[b] cached tokens and new_tokens[b] new ones after
// them (seq_lens[b] = prefixes[b] + new_tokens[b]; the new tokens are in the caches too).
struct PrefillBatch {
  std::vector<std::int64_t> prefixes;
  std::vector<std::int64_t> new_tokens;

  std::vector<std::int64_t> lengths() const {
    std::vector<std::int64_t> l;
    for (std::size_t b = 0; b < prefixes.size(); ++b) l.push_back(prefixes[b] + new_tokens[b]);
    return l;
  }
  std::int64_t rows() const {
    std::int64_t t = 0;
    for (std::int64_t n : new_tokens) t += n;
    return t;
  }
};

// A fixture holding the batch's requests (prefix and new tokens, all appended) in shuffled pages of
// `page_size`, with an indexer cache unless asked otherwise, its fp8 scales chosen by `scale_mode`,
// in a pool of `num_pages` (0: the pages the requests need).
inline PagedFixture make_prefill_fixture(const PrefillBatch& batch, int page_size, Rng& rng,
                                         KvDtype kv_dtype = KvDtype::kFp8E4M3, bool with_indexer = true,
                                         ScaleMode scale_mode = ScaleMode::kPow2, std::int64_t num_pages = 0) {
  PagedFixtureOptions o;
  o.page_size = page_size;
  o.lengths = batch.lengths();
  o.kv_dtype = kv_dtype;
  o.with_indexer = with_indexer;
  o.scale_mode = scale_mode;
  o.num_pages = num_pages;
  return make_paged_fixture(o, rng);
}

// cu_new_tokens of requests with `new_tokens[b]` new tokens each.
inline std::vector<std::int32_t> cumulative(const std::vector<std::int64_t>& new_tokens) {
  std::vector<std::int32_t> cu = {0};
  for (std::int64_t n : new_tokens) cu.push_back(cu.back() + static_cast<std::int32_t>(n));
  return cu;
}

// Dense prefill of q [T, H, 576] bf16; request b's new tokens are rows cu[b] .. cu[b+1]-1 and the
// fixture's seq_lens count them.
inline AttentionOutputs reference_mla_prefill(PagedFixture& f, const HostTensor& q, std::vector<std::int32_t> cu,
                                              float softmax_scale, DType o_dtype = DType::kF64,
                                              DType lse_dtype = DType::kF64) {
  const std::int64_t t = q.shape()[0], h = q.shape()[1];
  AttentionOutputs out{sentinel_tensor(o_dtype, {t, h, kLatentDim}), sentinel_tensor(lse_dtype, {t, h})};
  MlaPrefillParams p;
  p.q = input_view(q);
  p.cu_new_tokens = TensorView::contiguous(cu.data(), DType::kI32, {static_cast<std::int64_t>(cu.size())});
  p.cache = f.cache();
  p.block_table = f.block_table_view();
  p.seq_lens = f.seq_lens_view();
  p.o = out.o.view();
  p.lse = out.lse.view();
  p.softmax_scale = softmax_scale;
  cpu::mla_prefill(p);
  return out;
}

// Sparse decode of q [B, q_len, H, 576] over indices [B, q_len, topk].
inline AttentionOutputs reference_sparse_decode(PagedFixture& f, const HostTensor& q, const HostTensor& indices,
                                                float softmax_scale, DType o_dtype = DType::kF64,
                                                DType lse_dtype = DType::kF64) {
  const std::int64_t b = q.shape()[0], q_len = q.shape()[1], h = q.shape()[2];
  AttentionOutputs out{sentinel_tensor(o_dtype, {b, q_len, h, kLatentDim}), sentinel_tensor(lse_dtype, {b, q_len, h})};
  SparseMlaDecodeParams p;
  p.q = input_view(q);
  p.cache = f.cache();
  p.indices = input_view(indices);
  p.o = out.o.view();
  p.lse = out.lse.view();
  p.softmax_scale = softmax_scale;
  cpu::sparse_mla_decode(p);
  return out;
}

// Sparse prefill of q [T, H, 576] over indices [T, topk].
inline AttentionOutputs reference_sparse_prefill(PagedFixture& f, const HostTensor& q, const HostTensor& indices,
                                                 float softmax_scale, DType o_dtype = DType::kF64,
                                                 DType lse_dtype = DType::kF64) {
  const std::int64_t t = q.shape()[0], h = q.shape()[1];
  AttentionOutputs out{sentinel_tensor(o_dtype, {t, h, kLatentDim}), sentinel_tensor(lse_dtype, {t, h})};
  SparseMlaPrefillParams p;
  p.q = input_view(q);
  p.cache = f.cache();
  p.indices = input_view(indices);
  p.o = out.o.view();
  p.lse = out.lse.view();
  p.softmax_scale = softmax_scale;
  cpu::sparse_mla_prefill(p);
  return out;
}

// Indexer logits [B, q_len, max_len] f32 of q [B, q_len, Hi, 128] fp8 and weights [B, q_len, Hi].
inline HostTensor reference_indexer_logits(PagedFixture& f, const HostTensor& q, const HostTensor& weights,
                                           std::int64_t max_len) {
  HostTensor logits = sentinel_tensor(DType::kF32, {q.shape()[0], q.shape()[1], max_len});
  IndexerLogitsParams p;
  p.q = input_view(q);
  p.weights = input_view(weights);
  p.cache = f.indexer();
  p.block_table = f.block_table_view();
  p.seq_lens = f.seq_lens_view();
  p.logits = logits.view();
  cpu::indexer_logits(p);
  return logits;
}

// Top-k slots [B, q_len, k] i32 of logits [B, q_len, max_len].
inline HostTensor reference_topk(PagedFixture& f, const HostTensor& logits, int k) {
  HostTensor slots = sentinel_tensor(DType::kI32, {logits.shape()[0], logits.shape()[1], k});
  TopkParams p;
  p.logits = input_view(logits);
  p.block_table = f.block_table_view();
  p.seq_lens = f.seq_lens_view();
  p.page_size = f.page_size;
  p.k = k;
  p.slots = slots.view();
  cpu::topk(p);
  return slots;
}

// Index rows selecting every position each query row sees, in shuffled order, -1 entries scattered
// among them; `topk` columns (at least the most visible positions). Rows are request b's new
// tokens i = 0 .. new_tokens[b]-1 back to back ([B * q_len] for decode, [T] for prefill).
inline HostTensor all_visible_indices(const PagedFixture& f, const std::vector<std::int64_t>& new_tokens,
                                      std::int64_t topk, Rng& rng) {
  std::int64_t rows = 0;
  for (std::int64_t n : new_tokens) rows += n;
  HostTensor indices(DType::kI32, {rows, topk});
  std::int32_t* out = indices.data<std::int32_t>();
  std::int64_t row = 0;
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    const std::int64_t length = f.seq_lens[static_cast<std::size_t>(b)];
    const std::int64_t n = new_tokens[static_cast<std::size_t>(b)];
    for (std::int64_t i = 0; i < n; ++i, ++row) {
      const std::int64_t visible = std::max<std::int64_t>(0, length - n + i + 1);
      std::vector<std::int32_t> entries = f.slots(b, visible);
      if (static_cast<std::int64_t>(entries.size()) > topk) throw std::logic_error("all_visible_indices: topk too small");
      entries.resize(static_cast<std::size_t>(topk), -1);
      std::shuffle(entries.begin(), entries.end(), rng);
      std::copy(entries.begin(), entries.end(), out + row * topk);
    }
  }
  return indices;
}

}  // namespace latentkv::testing
