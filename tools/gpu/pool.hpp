// tools/gpu/pool.hpp - a device cache pool filled with synthetic tokens, and request sets over it.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bench_work.hpp"  // plan_rotation, request_sets_that_fit
#include "gpu/measure.hpp"
#include "latentkv/cache.hpp"
#include "latentkv/fp8.hpp"
#include "latentkv/paging.hpp"

namespace latentkv::tools::gpu {

// A main latent cache (and optionally an indexer cache) of `pool_tokens` tokens rounded up to
// whole pages; every slot holds a real token, quantized by the library's append (SPEC section 3).
struct DevicePool {
  DevicePool(std::int64_t pool_tokens, int page_size, KvDtype dtype, bool with_indexer, std::uint64_t seed,
             cudaStream_t stream);

  LatentCache cache() const;
  IndexerCache indexer() const;
  std::int64_t num_pages = 0;
  int page_size = 0;
  KvDtype dtype;
  DeviceMemory latent_bytes;   // [num_pages, page_size, token_bytes]
  DeviceMemory indexer_bytes;  // [num_pages, page_size * 132] or empty
};

// `sets` groups of `batch` requests of `length` tokens each (or of lengths[b] tokens, the same in
// every set), pages drawn shuffled from the pool. Timed loops rotate through the sets so that
// repeated calls do not read from L2.
struct RequestSets {
  int sets = 0;
  int batch = 0;
  int max_pages = 0;
  std::vector<std::int32_t> host_tables;  // [sets, batch, max_pages]
  std::vector<std::int32_t> host_lens;    // [sets, batch]
  DeviceMemory tables, lens;
  const std::int32_t* table(int set) const { return tables.get<std::int32_t>() + static_cast<std::size_t>(set) * batch * max_pages; }
  const std::int32_t* lengths(int set) const { return lens.get<std::int32_t>() + static_cast<std::size_t>(set) * batch; }
};
RequestSets make_request_sets(const DevicePool& pool, int sets, int batch, std::int64_t length, std::uint64_t seed);
RequestSets make_request_sets(const DevicePool& pool, int sets, const std::vector<std::int64_t>& lengths,
                              std::uint64_t seed);

// Index rows [variants, B, q_len, topk], variant v over the requests of set v % sets.sets: for each
// of a request's q_len newest tokens (token i sees positions t < context - q_len + i + 1), topk
// distinct visible positions (all of them when fewer) as physical slots, in random order, padded
// with -1. q_len is the decode q_len, or a prefill's new tokens per request.
std::vector<std::int32_t> random_index_rows(const RequestSets& sets, int variants, int q_len, int topk,
                                            std::int64_t context, int page_size, std::uint64_t seed);

// Indexer queries q (fp8 codes of roughly N(0, 1) values) and weights w (around 1/sqrt(heads * 128)),
// any number of rows of `heads` heads; q.size() = 128 w.size().
void random_indexer_queries(std::uint64_t seed, int heads, std::vector<std::uint8_t>& q, std::vector<float>& w);

// The reference's logits of one query token (q_row [heads, 128] fp8, w_row [heads]) over the first
// `visible` positions of a request (its block-table row of max_pages pages), from a host copy of
// the indexer cache.
std::vector<float> reference_token_logits(const IndexerCache& host_cache, const std::int32_t* table_row, int max_pages,
                                          const std::uint8_t* q_row, const float* w_row, int heads,
                                          std::int32_t visible);

// What is wrong with the logits a GPU indexer wrote (`device_logits` [checked, q_len, columns]) for
// the first `checked` requests of set 0, against the reference indexer's over a host copy of the
// pool's indexer cache (q [checked, q_len, heads, 128] fp8 and weights [checked, q_len, heads] on
// the host); "" when they agree within float32 sums of exact fp8 products in another order.
std::string logits_problem(const DevicePool& pool, const RequestSets& sets, int checked, int q_len, int heads,
                           std::int64_t columns, const std::uint8_t* q, const float* weights, const float* device_logits);

}  // namespace latentkv::tools::gpu
