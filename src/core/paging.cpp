#include "latentkv/paging.hpp"

#include <algorithm>
#include <numeric>
#include <random>
#include <string>

#include "latentkv/error.hpp"
#include "latentkv/ops.hpp"

namespace latentkv {

PageAllocator::PageAllocator(std::int64_t num_pages, int page_size, std::uint64_t shuffle_seed)
    : num_pages_(num_pages), page_size_(page_size) {
  // A request's pages form one block-table row, which the ops take up to kMaxTableTokens (2^30) tokens.
  if (page_size < 1 || page_size > kMaxTableTokens) {
    throw Error("page_allocator", "page_size", std::to_string(page_size),
                "1 .. " + std::to_string(kMaxTableTokens) + " (a block-table row holds at most 2^30 tokens)");
  }
  // Slots (page_id * page_size + offset) are int32 in every op, as in a cache (cache.hpp).
  const std::int64_t max_pages = INT32_MAX / page_size;
  if (num_pages < 1 || num_pages > max_pages) {
    throw Error("page_allocator", "num_pages", std::to_string(num_pages),
                "1 .. " + std::to_string(max_pages) + " (num_pages x page_size " + std::to_string(page_size) +
                    " within the int32 slots)");
  }
  free_.resize(static_cast<std::size_t>(num_pages));
  // Stack order: page 0 is handed out first unless shuffled.
  std::iota(free_.rbegin(), free_.rend(), 0);
  if (shuffle_seed != 0) {
    std::mt19937_64 rng(shuffle_seed);
    std::shuffle(free_.begin(), free_.end(), rng);
  }
  allocated_.assign(static_cast<std::size_t>(num_pages), 0);
}

RequestId PageAllocator::add_request() {
  const RequestId id = next_id_++;
  requests_.emplace(id, Request{});
  return id;
}

const PageAllocator::Request& PageAllocator::find(std::string_view op, RequestId request) const {
  const auto it = requests_.find(request);
  if (it == requests_.end()) {
    throw Error(std::string(op), "request", std::to_string(request), "a request id this allocator has live");
  }
  return it->second;
}

void PageAllocator::grow(RequestId request, std::int64_t n_tokens) {
  auto& r = const_cast<Request&>(find("page_allocator.grow", request));
  if (n_tokens < 0) throw Error("page_allocator.grow", "n_tokens", std::to_string(n_tokens), ">= 0");
  // The room left: the free tail of the request's last page, then whole free pages. Computed this way
  // round so that no count can overflow, whatever n_tokens is.
  const std::int64_t tail = static_cast<std::int64_t>(r.pages.size()) * page_size_ - r.length;
  const std::int64_t beyond_tail = std::max<std::int64_t>(n_tokens - tail, 0);
  const std::int64_t needed = beyond_tail / page_size_ + (beyond_tail % page_size_ != 0);
  if (needed > free_pages()) {
    throw Error("page_allocator.grow", "n_tokens", std::to_string(n_tokens),
                "at most " + std::to_string(free_pages() * page_size_ + tail) +
                    " more tokens: the pool is exhausted (" + std::to_string(free_pages()) + " of " +
                    std::to_string(num_pages_) + " pages free, " + std::to_string(needed) + " needed)");
  }
  // The request's pages as one block-table row: at most kMaxTableTokens (2^30) tokens, as the ops
  // take them (the pages hold fewer than 2^31 slots, so the product cannot overflow).
  const std::int64_t table_pages = kMaxTableTokens / page_size_;
  if (static_cast<std::int64_t>(r.pages.size()) + needed > table_pages) {
    throw Error("page_allocator.grow", "n_tokens", std::to_string(n_tokens),
                "at most " + std::to_string(table_pages * page_size_ - r.length) +
                    " more tokens (a request's pages hold at most 2^30 tokens, the ops' block-table limit)");
  }
  for (std::int64_t i = 0; i < needed; ++i) {
    const std::int32_t page = free_.back();
    free_.pop_back();
    allocated_[static_cast<std::size_t>(page)] = 1;
    r.pages.push_back(page);
  }
  r.length += n_tokens;
}

void PageAllocator::release(RequestId request) {
  const Request& r = find("page_allocator.release", request);
  // Push in reverse so that the request's first page is the next one handed out.
  for (auto it = r.pages.rbegin(); it != r.pages.rend(); ++it) {
    allocated_[static_cast<std::size_t>(*it)] = 0;
    free_.push_back(*it);
  }
  requests_.erase(request);
}

std::int64_t PageAllocator::length(RequestId request) const { return find("page_allocator", request).length; }

const std::vector<std::int32_t>& PageAllocator::block_table(RequestId request) const {
  return find("page_allocator", request).pages;
}

std::int64_t PageAllocator::slot(RequestId request, std::int64_t position) const {
  const Request& r = find("page_allocator.slot", request);
  if (position < 0 || position >= r.length) {
    throw Error("page_allocator.slot", "position", std::to_string(position),
                "0 .. " + std::to_string(r.length - 1) + " (request length " + std::to_string(r.length) + ")");
  }
  return static_cast<std::int64_t>(r.pages[static_cast<std::size_t>(position / page_size_)]) * page_size_ +
         position % page_size_;
}

std::vector<std::int32_t> PageAllocator::block_table_matrix(std::span<const RequestId> requests, int max_pages) const {
  if (max_pages < 0) throw Error("page_allocator.block_table_matrix", "max_pages", std::to_string(max_pages), ">= 0");
  std::vector<std::int32_t> table(requests.size() * static_cast<std::size_t>(max_pages), -1);
  for (std::size_t b = 0; b < requests.size(); ++b) {
    const auto& pages = find("page_allocator.block_table_matrix", requests[b]).pages;
    if (static_cast<std::int64_t>(pages.size()) > max_pages) {
      throw Error("page_allocator.block_table_matrix", "max_pages", std::to_string(max_pages),
                  ">= " + std::to_string(pages.size()) + " (pages of request " + std::to_string(requests[b]) + ")");
    }
    std::copy(pages.begin(), pages.end(), table.begin() + static_cast<std::ptrdiff_t>(b * max_pages));
  }
  return table;
}

std::vector<std::int32_t> PageAllocator::lengths(std::span<const RequestId> requests) const {
  std::vector<std::int32_t> out;
  for (RequestId r : requests) out.push_back(static_cast<std::int32_t>(length(r)));
  return out;
}

void PageAllocator::check_block_table(std::string_view op, const std::int32_t* block_table, std::int64_t batch,
                                      int max_pages, const std::int32_t* seq_lens) const {
  // Before a length is held against it: a negative capacity is the table's fault, not a length's.
  if (max_pages < 0) throw Error(std::string(op), "max_pages", std::to_string(max_pages), ">= 0");
  for (std::int64_t b = 0; b < batch; ++b) {
    const std::int64_t used = pages_for(seq_lens[b]);
    if (seq_lens[b] < 0 || used > max_pages) {
      throw Error(std::string(op), "seq_lens[" + std::to_string(b) + "]", std::to_string(seq_lens[b]),
                  "0 .. " + std::to_string(static_cast<std::int64_t>(max_pages) * page_size_) + " (block table capacity: " +
                      std::to_string(max_pages) + " pages x " + std::to_string(page_size_) + " tokens)");
    }
    for (std::int64_t p = 0; p < used; ++p) {
      const std::int32_t page = block_table[b * max_pages + p];
      if (page < 0 || page >= num_pages_ || !allocated_[static_cast<std::size_t>(page)]) {
        throw Error(std::string(op), "block_table[" + std::to_string(b) + "][" + std::to_string(p) + "]",
                    std::to_string(page), "a page allocated from the pool (page ids 0 .. " +
                                              std::to_string(num_pages_ - 1) + ", currently handed out)");
      }
    }
  }
}

}  // namespace latentkv
