// PageAllocator: growth, release and reuse, block tables, slots, exhaustion, check_block_table.
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <set>
#include <vector>

#include "latentkv/error.hpp"
#include "latentkv/paging.hpp"
#include "support/expect_error.hpp"
#include "support/rng.hpp"

namespace latentkv::testing {
namespace {

TEST(PageAllocator, GrowReleaseReuse) {
  PageAllocator a(8, 4);  // unshuffled: pages 0, 1, 2, ... in order
  const RequestId r0 = a.add_request(), r1 = a.add_request();
  a.grow(r0, 5);
  EXPECT_EQ(a.length(r0), 5);
  EXPECT_EQ(a.block_table(r0), (std::vector<std::int32_t>{0, 1}));
  EXPECT_EQ(a.free_pages(), 6);
  a.grow(r0, 3);  // fills page 1 exactly: no new page
  EXPECT_EQ(a.block_table(r0).size(), 2u);
  EXPECT_EQ(a.free_pages(), 6);
  a.grow(r1, 4);
  EXPECT_EQ(a.block_table(r1), (std::vector<std::int32_t>{2}));
  a.grow(r0, 0);
  EXPECT_EQ(a.length(r0), 8);

  a.release(r0);
  EXPECT_EQ(a.free_pages(), 7);
  EXPECT_THROW(a.length(r0), Error);  // the id is gone
  const RequestId r2 = a.add_request();
  a.grow(r2, 6);
  // Freed pages come back first, the released request's first page first.
  EXPECT_EQ(a.block_table(r2), (std::vector<std::int32_t>{0, 1}));
}

TEST(PageAllocator, SlotsFollowTheBlockTable) {
  for (int page_size : {1, 3, 64}) {
    Rng rng = test_rng("page_size " + std::to_string(page_size));
    PageAllocator a(40, page_size, rng.fork_seed());
    std::vector<RequestId> reqs;
    for (int i = 0; i < 4; ++i) reqs.push_back(a.add_request());
    std::vector<std::int64_t> want(reqs.size(), 0);
    // Interleaved growth until the pool is nearly used.
    for (int step = 0; step < 40; ++step) {
      const std::size_t r = static_cast<std::size_t>(rng.uniform_int(0, 3));
      const std::int64_t n = rng.uniform_int(0, page_size + 1);
      if (a.pages_for(want[r] + n) - a.pages_for(want[r]) > a.free_pages()) continue;
      a.grow(reqs[r], n);
      want[r] += n;
    }
    std::set<std::int32_t> pages_seen;
    for (std::size_t r = 0; r < reqs.size(); ++r) {
      ASSERT_EQ(a.length(reqs[r]), want[r]);
      const auto& table = a.block_table(reqs[r]);
      ASSERT_EQ(static_cast<std::int64_t>(table.size()), a.pages_for(want[r]));
      for (std::int32_t p : table) {
        ASSERT_TRUE(p >= 0 && p < 40);
        ASSERT_TRUE(pages_seen.insert(p).second) << "page " << p << " handed out twice";
      }
      for (std::int64_t t = 0; t < want[r]; ++t) {
        ASSERT_EQ(a.slot(reqs[r], t), static_cast<std::int64_t>(table[static_cast<std::size_t>(t / page_size)]) * page_size + t % page_size);
      }
      EXPECT_TRUE(throws_error([&] { a.slot(reqs[r], want[r]); }, "page_allocator.slot", "position", std::to_string(want[r])));
      EXPECT_THROW(a.slot(reqs[r], -1), Error);
    }
    EXPECT_EQ(a.free_pages(), 40 - static_cast<std::int64_t>(pages_seen.size()));
  }
}

TEST(PageAllocator, ShuffledPoolIsNotInOrder) {
  PageAllocator a(32, 2, 12345);
  const RequestId r = a.add_request();
  a.grow(r, 64);
  const auto& table = a.block_table(r);
  EXPECT_FALSE(std::is_sorted(table.begin(), table.end()));
  std::vector<std::int32_t> sorted = table;
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 32; ++i) EXPECT_EQ(sorted[static_cast<std::size_t>(i)], i);
}

TEST(PageAllocator, ExhaustionThrowsAndChangesNothing) {
  PageAllocator a(6, 3, 99);
  const RequestId r0 = a.add_request(), r1 = a.add_request();
  a.grow(r0, 7);  // 3 pages
  a.grow(r1, 2);  // 1 page
  const PageAllocator before = a;
  const std::vector<RequestId> reqs = {r0, r1};
  // r0 has 2 free tokens in its last page, the pool 2 pages = 6 tokens: 8 fit, 9 do not.
  EXPECT_TRUE(throws_error([&] { a.grow(r0, 9); }, "page_allocator.grow", "n_tokens", "9"));
  EXPECT_EQ(a.free_pages(), before.free_pages());
  EXPECT_EQ(a.lengths(reqs), before.lengths(reqs));
  EXPECT_EQ(a.block_table(r0), before.block_table(r0));
  EXPECT_EQ(a.block_table(r1), before.block_table(r1));
  // The pool hands out the same pages next as it would have.
  PageAllocator copy = before;
  a.grow(r1, 7);
  copy.grow(r1, 7);
  EXPECT_EQ(a.block_table(r1), copy.block_table(r1));
  // The rest fits exactly; one more token does not.
  PageAllocator c2 = before;
  c2.grow(r0, 8);
  EXPECT_EQ(c2.free_pages(), 0);
  EXPECT_THROW(c2.grow(r1, 2), Error);
  EXPECT_EQ(c2.length(r1), 2);
}

// Counts near int64's limit are refused as the exhausted pool they are, not wrapped into lengths.
TEST(PageAllocator, HugeGrowthIsRefusedWithoutOverflow) {
  PageAllocator a(6, 3);
  const RequestId r0 = a.add_request(), r1 = a.add_request();
  a.grow(r0, 10);
  const std::int64_t huge = std::numeric_limits<std::int64_t>::max();
  EXPECT_TRUE(throws_error([&] { a.grow(r0, huge - 5); }, "page_allocator.grow", "n_tokens", std::to_string(huge - 5)));
  EXPECT_TRUE(throws_error([&] { a.grow(r1, huge); }, "page_allocator.grow", "n_tokens", std::to_string(huge)));
  EXPECT_EQ(a.length(r0), 10);
  EXPECT_EQ(a.length(r1), 0);
  EXPECT_TRUE(throws_error([&] { a.slot(r1, 1000000); }, "page_allocator.slot", "position", "1000000"));

  // A request's pages hold at most 2^30 tokens, the ops' block-table limit, however many are free:
  // 3 pages of 2^29 tokens, of which one request takes 2.
  PageAllocator big(3, 1 << 29);
  const RequestId r = big.add_request();
  big.grow(r, (std::int64_t{1} << 30) - 5);
  EXPECT_TRUE(throws_error([&] { big.grow(r, 6); }, "page_allocator.grow", "n_tokens", "6"));
  EXPECT_NE(error_of([&] { big.grow(r, 6); }).find("at most 5 more tokens (a request's pages hold at most 2^30 tokens"),
            std::string::npos);
  big.grow(r, 5);
  EXPECT_EQ(big.length(r), std::int64_t{1} << 30);
  EXPECT_EQ(big.free_pages(), 1);
}

TEST(PageAllocator, BlockTableMatrixPadsWithMinusOne) {
  PageAllocator a(10, 4, 7);
  const RequestId r0 = a.add_request(), r1 = a.add_request(), r2 = a.add_request();
  a.grow(r0, 9);  // 3 pages
  a.grow(r2, 1);  // 1 page; r1 empty
  const std::vector<RequestId> reqs = {r0, r1, r2};
  const std::vector<std::int32_t> m = a.block_table_matrix(reqs, 4);
  ASSERT_EQ(m.size(), 12u);
  for (int c = 0; c < 3; ++c) EXPECT_EQ(m[static_cast<std::size_t>(c)], a.block_table(r0)[static_cast<std::size_t>(c)]);
  EXPECT_EQ(m[3], -1);
  for (int c = 4; c < 8; ++c) EXPECT_EQ(m[static_cast<std::size_t>(c)], -1);
  EXPECT_EQ(m[8], a.block_table(r2)[0]);
  EXPECT_EQ(a.lengths(reqs), (std::vector<std::int32_t>{9, 0, 1}));
  EXPECT_TRUE(throws_error([&] { a.block_table_matrix(reqs, 2); }, "page_allocator.block_table_matrix", "max_pages", "2"));
}

TEST(PageAllocator, CheckBlockTable) {
  PageAllocator a(8, 4, 3);
  const RequestId r0 = a.add_request(), r1 = a.add_request();
  a.grow(r0, 6);
  a.grow(r1, 4);
  const std::vector<RequestId> reqs = {r0, r1};
  std::vector<std::int32_t> table = a.block_table_matrix(reqs, 3);
  std::vector<std::int32_t> lens = a.lengths(reqs);
  EXPECT_NO_THROW(a.check_block_table("mla_decode", table.data(), 2, 3, lens.data()));

  // A page the pool never handed out.
  std::int32_t unallocated = -1;
  for (std::int32_t p = 0; p < 8; ++p) {
    const auto& t0 = a.block_table(r0);
    const auto& t1 = a.block_table(r1);
    if (std::find(t0.begin(), t0.end(), p) == t0.end() && std::find(t1.begin(), t1.end(), p) == t1.end()) unallocated = p;
  }
  ASSERT_GE(unallocated, 0);
  std::vector<std::int32_t> bad = table;
  bad[1] = unallocated;
  EXPECT_TRUE(throws_error([&] { a.check_block_table("mla_decode", bad.data(), 2, 3, lens.data()); }, "mla_decode",
                           "block_table[0][1]", std::to_string(unallocated)));
  bad = table;
  bad[3] = 8;  // outside the pool
  EXPECT_TRUE(throws_error([&] { a.check_block_table("mla_decode", bad.data(), 2, 3, lens.data()); }, "mla_decode",
                           "block_table[1][0]", "8"));
  bad = table;
  bad[0] = -1;
  EXPECT_THROW(a.check_block_table("mla_decode", bad.data(), 2, 3, lens.data()), Error);
  // Columns past a request's length are not looked at.
  bad = table;
  bad[2] = 12345;
  EXPECT_NO_THROW(a.check_block_table("mla_decode", bad.data(), 2, 3, lens.data()));

  // A length the table's columns cannot hold (its pages cannot be checked).
  std::vector<std::int32_t> long_lens = {13, 4};  // 4 pages > 3 columns
  EXPECT_TRUE(throws_error([&] { a.check_block_table("mla_decode", table.data(), 2, 3, long_lens.data()); }, "mla_decode",
                           "seq_lens[0]", "13"));
  long_lens = {-1, 4};
  EXPECT_TRUE(throws_error([&] { a.check_block_table("mla_decode", table.data(), 2, 3, long_lens.data()); }, "mla_decode",
                           "seq_lens[0]", "-1"));

  // A released request's pages are no longer valid.
  a.release(r1);
  EXPECT_THROW(a.check_block_table("mla_decode", table.data(), 2, 3, lens.data()), Error);
}

// A negative column count is refused by name before it sizes a matrix or bounds a length.
TEST(PageAllocator, NegativeMaxPages) {
  PageAllocator a(8, 4);
  const std::vector<RequestId> reqs = {a.add_request()};
  EXPECT_TRUE(
      throws_error([&] { a.block_table_matrix(reqs, -1); }, "page_allocator.block_table_matrix", "max_pages", "-1"));
  const std::int32_t table = 0, len = 0;
  EXPECT_TRUE(throws_error([&] { a.check_block_table("mla_decode", &table, 1, -1, &len); }, "mla_decode", "max_pages",
                           "-1"));
}

TEST(PageAllocator, RejectsBadConstruction) {
  EXPECT_TRUE(throws_error([] { PageAllocator(0, 4); }, "page_allocator", "num_pages", "0"));
  EXPECT_TRUE(throws_error([] { PageAllocator(4, 0); }, "page_allocator", "page_size", "0"));
  // A page past 2^30 tokens would make every request's block-table row one the ops refuse.
  EXPECT_TRUE(throws_error([] { PageAllocator(1, (1 << 30) + 1); }, "page_allocator", "page_size", "1073741825"));
  EXPECT_TRUE(throws_error([] { PageAllocator(1, std::numeric_limits<std::int32_t>::max()); }, "page_allocator",
                           "page_size", "2147483647"));
  // Slots past int32 would wrap when handed to an op: 2 pages of 2^30 tokens are one too many.
  EXPECT_TRUE(throws_error([] { PageAllocator(2, 1 << 30); }, "page_allocator", "num_pages", "2"));
  EXPECT_EQ(PageAllocator(1, 1 << 30).pages_for(INT64_MAX), INT64_MAX / (1 << 30) + 1);
  PageAllocator a(2, 1);
  EXPECT_TRUE(throws_error([&] { a.grow(77, 1); }, "page_allocator.grow", "request", "77"));
  const RequestId r = a.add_request();
  EXPECT_TRUE(throws_error([&] { a.grow(r, -1); }, "page_allocator.grow", "n_tokens", "-1"));
}

}  // namespace
}  // namespace latentkv::testing
