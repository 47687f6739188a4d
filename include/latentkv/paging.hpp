// latentkv/paging.hpp - a page allocator over a fixed pool, and the block tables it hands out.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "latentkv/cache.hpp"

namespace latentkv {

using RequestId = std::int64_t;

// Hands out the pages of a pool of `num_pages` pages of `page_size` tokens to requests (a pool whose
// slots fit int32, as every op takes them). Freed pages are reused first (LIFO). With a non-zero
// seed the pool's pages are handed out in a shuffled order, as in a long-running server; tests use
// it so that block tables are never in order.
class PageAllocator {
 public:
  PageAllocator(std::int64_t num_pages, int page_size = kDefaultPageSize, std::uint64_t shuffle_seed = 0);

  RequestId add_request();
  // Makes room for n more tokens of `request`. On an exhausted pool throws Error and leaves the
  // allocator exactly as it was (no page half-allocated).
  void grow(RequestId request, std::int64_t n_tokens);
  // Frees every page of `request`; the id becomes unknown.
  void release(RequestId request);

  std::int64_t length(RequestId request) const;                         // tokens
  // Page ids in order: the allocator's own list, valid until release() of that request; grow() adds
  // to it (its data() may move), so copy it to keep a snapshot.
  const std::vector<std::int32_t>& block_table(RequestId request) const;
  std::int64_t slot(RequestId request, std::int64_t position) const;    // page_id * page_size + offset

  // Block tables of `requests` as one row-major [requests.size(), max_pages] matrix padded with -1.
  std::vector<std::int32_t> block_table_matrix(std::span<const RequestId> requests, int max_pages) const;
  std::vector<std::int32_t> lengths(std::span<const RequestId> requests) const;

  // Throws Error naming `op` unless every page that rows of `block_table` ([batch, max_pages]) use
  // for their `seq_lens` tokens is a page this allocator has handed out.
  void check_block_table(std::string_view op, const std::int32_t* block_table, std::int64_t batch,
                         int max_pages, const std::int32_t* seq_lens) const;

  std::int64_t num_pages() const { return num_pages_; }
  int page_size() const { return page_size_; }
  std::int64_t free_pages() const { return static_cast<std::int64_t>(free_.size()); }
  // Pages that hold `tokens` (>= 0) tokens; no sum that could overflow.
  std::int64_t pages_for(std::int64_t tokens) const { return tokens / page_size_ + (tokens % page_size_ > 0 ? 1 : 0); }

 private:
  struct Request {
    std::int64_t length = 0;
    std::vector<std::int32_t> pages;
  };
  const Request& find(std::string_view op, RequestId request) const;

  std::int64_t num_pages_;
  int page_size_;
  std::vector<std::int32_t> free_;         // stack: back() is handed out next
  std::vector<std::uint8_t> allocated_;    // per page
  std::unordered_map<RequestId, Request> requests_;
  RequestId next_id_ = 0;
};

}  // namespace latentkv
