// GPU indexer logits against the CPU reference: shuffled pages, NaN in every indexer slot that is
// not cached, sentinel-filled logits (every column up to max_len must be written: -inf past the
// visible positions), causal rows for q_len > 1. Every call also clears a garbage-filled range for
// the next op (IndexerLogitsParams::clear, larger than one pass of the grid), and must leave the
// guard after it alone. Calls run with the plan's workspace (on sm_90 long spans claim turns from its
// counters: the B 16 cases of 70K tokens and more), once garbage-filled, then three times in a row on
// one zeroed once and taken cleared (IndexerLogitsParams::workspace_cleared: each call counts on the
// one before to leave the counters zero, and the last must too; each writes its own logits, and all
// are checked), and once without a workspace (every CTA its static span); all must match.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "gpu/device.hpp"
#include "latentkv/backend.hpp"
#include "support/compare.hpp"
#include "support/expect_error.hpp"
#include "support/paged_fixture.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

struct LogitsCase {
  int heads;
  int q_len;
  int page_size;
  std::vector<std::int64_t> lengths;
  ScaleMode scale_mode = ScaleMode::kPow2;  // of the keys' scales (kExact: amax / 448, no power of two)
};

// float32 sums of exact fp8 products in another order than the float64 reference: relative error
// of a few float32 ulps of the sum of |terms|; -inf positions must match exactly.
const Tolerance kLogitsTolerance{1e-4, 1e-5, 1e-9};

enum class Workspace {
  kGarbage,  // the plan's, garbage-filled: one call
  kCleared,  // the plan's, zeroed once and taken cleared: three calls in a row, then it must be zero
  kNone,     // none: one call
};
std::string to_string(Workspace w) {
  switch (w) {
    case Workspace::kGarbage: return "garbage-filled workspace";
    case Workspace::kCleared: return "3 calls on one cleared workspace";
    case Workspace::kNone: break;
  }
  return "no workspace";
}

// The CUDA backend's logits [B, q_len, max_len] over the fixture's indexer cache, one tensor per call
// in `logits`: each call writes its own sentinel-filled buffer, and the calls run back to back on
// one stream, so that a call that counts on the one before (its counters) is checked on its own
// output. `clear` / `clear_bytes` are passed through. The calls share a fault record: with `fault`
// its message goes there, else it must be empty.
void gpu_logits(PagedFixture& f, HostTensor& q, HostTensor& w, std::int64_t max_len, std::vector<HostTensor>& logits,
                void* clear = nullptr, std::size_t clear_bytes = 0, Workspace workspace = Workspace::kGarbage,
                std::string* fault = nullptr) {
  const int calls = workspace == Workspace::kCleared ? 3 : 1;
  const HostTensor sentinel = sentinel_tensor(DType::kF32, {f.batch(), q.shape()[1], max_len});
  GuardedBuffer d_cache(f.indexer_bytes, kPoisonFp8);  // a page outside the pool read anyway shows
  DeviceBuffer d_table(f.block_table), d_lens(f.seq_lens);
  DeviceBuffer d_q(q.raw(), q.bytes()), d_w(w.raw(), w.bytes());
  std::vector<DeviceBuffer> d_logits;
  for (int i = 0; i < calls; ++i) d_logits.emplace_back(sentinel.raw(), sentinel.bytes());
  IndexerLogitsParams p;
  p.q = q.view_of(d_q.get(), Device::cuda());
  p.weights = w.view_of(d_w.get(), Device::cuda());
  p.cache = f.indexer(d_cache.get<std::uint8_t>(), Device::cuda());
  p.block_table = f.block_table_view(d_table.get<std::int32_t>(), Device::cuda());
  p.seq_lens = f.seq_lens_view(d_lens.get<std::int32_t>(), Device::cuda());
  p.logits = sentinel.view_of(d_logits[0].get(), Device::cuda());
  p.clear = clear;
  p.clear_bytes = clear_bytes;
  FaultRecord record;
  p.fault = record.get();
  const Backend& cuda = *find_backend("cuda");
  DeviceBuffer d_workspace;
  const Plan plan = cuda.plan(p, detect_device());
  if (workspace != Workspace::kNone) {
    const bool cleared = workspace == Workspace::kCleared;
    if (cleared) EXPECT_EQ(plan.cleared_bytes, plan.workspace_bytes) << "the GPU indexer takes its counters cleared";
    d_workspace = DeviceBuffer(std::vector<std::uint8_t>(plan.workspace_bytes, cleared ? 0x00 : 0xA5));
    p.workspace = d_workspace.get();
    p.workspace_bytes = plan.workspace_bytes;
    p.workspace_cleared = cleared;
  }
  for (int i = 0; i < calls; ++i) {
    p.logits = sentinel.view_of(d_logits[static_cast<std::size_t>(i)].get(), Device::cuda());
    run(cuda, p);
  }
  LKV_CUDA_OK(cudaDeviceSynchronize());
  if (fault != nullptr) *fault = record.message();
  else EXPECT_EQ(record.message(), "") << "a fault noted for good input";
  logits.assign(static_cast<std::size_t>(calls), sentinel);
  for (int i = 0; i < calls; ++i) {
    const auto k = static_cast<std::size_t>(i);
    d_logits[k].download(logits[k].raw(), logits[k].bytes());
  }
  if (workspace == Workspace::kCleared) {
    const std::vector<std::uint8_t> left = d_workspace.to_host<std::uint8_t>();
    EXPECT_TRUE(std::all_of(left.begin(), left.end(), [](std::uint8_t x) { return x == 0; }))
        << "the calls left the workspace's counters nonzero";
  }
}

// Bad input the reference refuses: the GPU call's fault record must throw the reference's own Error.
void expect_the_references_error(PagedFixture& f, HostTensor& q, HostTensor& w, std::int64_t max_len) {
  const std::string expected = error_of([&] { reference_indexer_logits(f, q, w, max_len); });
  ASSERT_NE(expected, "") << "the reference takes the input";
  std::vector<HostTensor> logits;
  std::string fault;
  ASSERT_NO_FATAL_FAILURE(gpu_logits(f, q, w, max_len, logits, nullptr, 0, Workspace::kGarbage, &fault));
  EXPECT_EQ(fault, expected);
}

class GpuIndexerLogits : public ::testing::TestWithParam<LogitsCase> {};

TEST_P(GpuIndexerLogits, MatchesReference) {
  LKV_REQUIRE_GPU();
  const LogitsCase& c = GetParam();
  Rng rng = test_rng();
  PagedFixtureOptions opt;
  opt.page_size = c.page_size;
  opt.lengths = c.lengths;
  opt.scale_mode = c.scale_mode;
  PagedFixture f = make_paged_fixture(opt, rng);
  const std::int64_t batch = f.batch();
  const std::int64_t max_len = f.max_len() + 5;  // extra columns: -inf
  HostTensor q = random_fp8(rng, {batch, c.q_len, c.heads, 128});
  HostTensor w = random_f32(rng, {batch, c.q_len, c.heads}, -1.0, 1.0);
  const HostTensor expected = reference_indexer_logits(f, q, w, max_len);

  constexpr std::size_t kClearBytes = 16 * 100003, kGuardBytes = 4096;
  constexpr std::uint8_t kGarbage = 0xA5;
  const std::vector<std::uint8_t> garbage(kClearBytes + kGuardBytes, kGarbage);
  for (const Workspace workspace : {Workspace::kGarbage, Workspace::kCleared, Workspace::kNone}) {
    DeviceBuffer d_clear(garbage);
    std::vector<HostTensor> logits;
    ASSERT_NO_FATAL_FAILURE(gpu_logits(f, q, w, max_len, logits, d_clear.get(), kClearBytes, workspace));
    const std::string what = "logits, " + to_string(workspace);
    const std::vector<std::uint8_t> cleared = d_clear.to_host<std::uint8_t>();
    EXPECT_TRUE(std::all_of(cleared.begin(), cleared.begin() + kClearBytes, [](std::uint8_t x) { return x == 0; }))
        << what << ": the clear range is not all zero";
    EXPECT_TRUE(std::all_of(cleared.begin() + kClearBytes, cleared.end(), [](std::uint8_t x) { return x == kGarbage; }))
        << what << ": the call wrote past the clear range";
    for (std::size_t i = 0; i < logits.size(); ++i) {
      EXPECT_TRUE(compare(what + ", call " + std::to_string(i + 1), logits[i], expected, kLogitsTolerance));
    }
  }
}

// A block-table entry outside the pool below the length (which the host cannot check: the table lives
// on the device) reads nothing: its positions get -inf, the rest match the reference. Pages of 64
// (on sm_90 the wgmma kernel, whose copier then copies nothing), of 100 (the wgmma kernel's turns
// across a page's end, with one of their two pages out, either one; 48 likewise, below a turn; 16,
// a turn over four pages with its second or fourth out; 4, 12, 20, 28, 44 and 52, turns over several
// pages whose parts are not whole pages, where a presence mask that reaches past a part's end shows)
// and of 17 (the mma.sync kernel).
TEST(GpuIndexerLogitsBadPage, PositionsOfAPageOutsideThePoolAreMinusInf) {
  LKV_REQUIRE_GPU();
  for (const int page_size : {64, 100, 48, 16, 4, 12, 20, 28, 44, 52, 17}) {
    Rng rng = test_rng();
    PagedFixtureOptions opt;
    opt.page_size = page_size;
    opt.lengths = {5 * page_size + 3, 2 * page_size};
    PagedFixture f = make_paged_fixture(opt, rng);
    const std::int64_t batch = f.batch(), max_len = f.max_len();
    HostTensor q = random_fp8(rng, {batch, 1, 32, 128});
    HostTensor w = random_f32(rng, {batch, 1, 32}, -1.0, 1.0);
    HostTensor expected = reference_indexer_logits(f, q, w, max_len);
    // Request 0's pages 1 (past the pool) and 3 (negative) are out; their positions get -inf.
    f.block_table[static_cast<std::size_t>(1)] = static_cast<std::int32_t>(f.num_pages());
    f.block_table[static_cast<std::size_t>(3)] = -7;
    float* want = expected.data<float>();
    for (const int page : {1, 3}) {
      std::fill(want + page * page_size, want + (page + 1) * page_size, -std::numeric_limits<float>::infinity());
    }

    std::vector<HostTensor> logits;
    std::string fault;
    ASSERT_NO_FATAL_FAILURE(gpu_logits(f, q, w, max_len, logits, nullptr, 0, Workspace::kGarbage, &fault));
    EXPECT_TRUE(compare("logits, page size " + std::to_string(page_size), logits.at(0), expected, kLogitsTolerance));
    EXPECT_EQ(fault.rfind("indexer_logits: argument 'block_table[0][", 0), 0u) << "noted: " << fault;  // either page
  }
}

// Bad lengths and pages, one at a time, on pages of 64, 100, 48 and 16 (on sm_90 the wgmma kernel) and 17
// (the mma.sync kernel): the record throws the reference's own Error for the same input. The block table
// has its spare -1 column: a length past the capacity is one fault, whatever the pages past it hold.
// A request's pages are checked 128 to a CTA (CTA c of its grid takes pages 128 c .. 128 c + 127,
// then those a grid further on): request 3's 300 pages span three CTAs' shares, and its bad page
// (200) is the second's.
TEST(GpuIndexerLogitsFaults, RecordTheReferencesError) {
  LKV_REQUIRE_GPU();
  struct Bad {
    const char* what;
    std::function<void(PagedFixture&, std::int64_t&)> spoil;  // the fixture and max_len
  };
  const std::vector<Bad> bad = {
      {"a page past the pool", [](PagedFixture& f, std::int64_t&) { f.block_table[f.max_pages + 39] = static_cast<std::int32_t>(f.num_pages()); }},
      {"a negative page", [](PagedFixture& f, std::int64_t&) { f.block_table[2] = -5; }},
      {"a page past the pool, 200th of 300", [](PagedFixture& f, std::int64_t&) {
         f.block_table[3 * f.max_pages + 200] = static_cast<std::int32_t>(f.num_pages() + 2);
       }},
      {"a length past the block table", [](PagedFixture& f, std::int64_t& max_len) {
         f.seq_lens[1] = f.max_pages * f.page_size + 1;
         max_len = f.seq_lens[1];
       }},
      {"a negative length", [](PagedFixture& f, std::int64_t&) { f.seq_lens[0] = -2; }},
      // (one past the longest request's length: the others' fit, so the record holds one fault)
      {"a length past the logits' columns", [](PagedFixture& f, std::int64_t& max_len) { max_len = f.max_len() - 1; }},
  };
  for (const int page_size : {64, 100, 48, 16, 17}) {
    for (const Bad& b : bad) {
      SCOPED_TRACE("page size " + std::to_string(page_size) + ": " + b.what);
      Rng rng = test_rng();
      PagedFixtureOptions opt;
      opt.page_size = page_size;
      opt.lengths = {5 * page_size + 3, 40 * page_size, 7, 300 * page_size - 5};
      PagedFixture f = make_paged_fixture(opt, rng);
      HostTensor q = random_fp8(rng, {f.batch(), 1, 32, 128});
      HostTensor w = random_f32(rng, {f.batch(), 1, 32}, -1.0, 1.0);
      std::int64_t max_len = f.max_len();
      b.spoil(f, max_len);
      ASSERT_NO_FATAL_FAILURE(expect_the_references_error(f, q, w, max_len));
    }
  }
}

// A NaN query code (0x7F, 0xFF) or a weight that is not finite, one at a time, on both kernels (pages
// of 64 and 17), in a request's last query row and head; and with no logits columns at all (max_len
// 0, lengths 0: no indexer kernel, the values checked by a kernel of their own): the record throws
// the reference's own Error.
TEST(GpuIndexerLogitsFaults, NonFiniteQueriesAndWeightsAreTheReferencesError) {
  LKV_REQUIRE_GPU();
  struct Bad {
    const char* what;
    // q [B, 2, h, 128] fp8 and weights [B, 2, h]: the last head of request 1's row 1, head 5 % h of
    // request 1's row 0, element 7
    std::function<void(HostTensor&, HostTensor&, int h)> spoil;
  };
  const std::vector<Bad> bad = {
      {"a query code 0x7f", [](HostTensor& q, HostTensor&, int h) { q.raw()[((1 * 2 + 1) * h + h - 1) * 128 + 127] = 0x7F; }},
      {"a query code 0xff", [](HostTensor& q, HostTensor&, int h) { q.raw()[(2 * h + 5 % h) * 128 + 64] = 0xFF; }},
      {"a NaN weight", [](HostTensor&, HostTensor& w, int h) { w.set((1 * 2 + 1) * h + h - 1, std::nan("")); }},
      {"an infinite weight", [](HostTensor&, HostTensor& w, int) { w.set(7, -std::numeric_limits<double>::infinity()); }},
  };
  // 3 heads: not a multiple of the 8 a pass pads to (the staging must not look at the padding).
  for (const int heads : {32, 3}) {
    for (const int page_size : {64, 17, 0}) {  // 0: no columns
      for (const Bad& b : bad) {
        SCOPED_TRACE((page_size > 0 ? "page size " + std::to_string(page_size) : std::string("no columns")) + ", " +
                     std::to_string(heads) + " heads: " + b.what);
        Rng rng = test_rng();
        PagedFixtureOptions opt;
        opt.page_size = page_size > 0 ? page_size : 64;
        opt.lengths = page_size > 0 ? std::vector<std::int64_t>{5 * opt.page_size + 3, 300, 7} : std::vector<std::int64_t>{0, 0, 0};
        PagedFixture f = make_paged_fixture(opt, rng);
        HostTensor q = random_fp8(rng, {f.batch(), 2, heads, 128});
        HostTensor w = random_f32(rng, {f.batch(), 2, heads}, -1.0, 1.0);
        b.spoil(q, w, heads);
        const std::int64_t max_len = page_size > 0 ? f.max_len() : 0;
        ASSERT_NO_FATAL_FAILURE(expect_the_references_error(f, q, w, max_len));
      }
    }
  }
}

// A claiming batch (on sm_90 with the H200's SMs: 16 requests of up to 100K tokens, spans of 24 turns
// and more) that mixes in what the claims must get right: requests of 0, 1 and 3 tokens, ones that
// end inside their static spans, ones that end inside the claimed turns, four longer than max_len
// (the device cannot be told: only max_len columns exist, and the claims stop there), and a page
// outside the pool inside the claimed turns of request 0 (its positions get -inf). On a garbage-
// filled workspace, then three calls on a cleared one.
TEST(GpuIndexerLogitsClaims, MixedBatchMatchesReference) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixtureOptions opt;
  opt.lengths = {100000, 0, 1, 99999, 76001, 50000, 100000, 88000, 64, 97999, 95000, 3, 99000, 77000, 30000, 81000};
  PagedFixture f = make_paged_fixture(opt, rng);
  const std::int64_t batch = f.batch(), max_len = 98000;
  HostTensor q = random_fp8(rng, {batch, 1, 8, 128});
  HostTensor w = random_f32(rng, {batch, 1, 8}, -1.0, 1.0);
  // The reference over the first max_len positions (q_len 1: the same columns as the longer lengths).
  const std::vector<std::int32_t> lengths = f.seq_lens;
  for (std::int32_t& l : f.seq_lens) l = std::min<std::int32_t>(l, static_cast<std::int32_t>(max_len));
  HostTensor expected = reference_indexer_logits(f, q, w, max_len);
  f.seq_lens = lengths;
  constexpr int kBadPage = 1450;  // positions 92800 .. 92863 of request 0, past 3/4 of its turns
  f.block_table[kBadPage] = static_cast<std::int32_t>(f.num_pages());
  std::fill(expected.data<float>() + kBadPage * f.page_size, expected.data<float>() + (kBadPage + 1) * f.page_size,
            -std::numeric_limits<float>::infinity());
  for (const Workspace workspace : {Workspace::kGarbage, Workspace::kCleared}) {
    std::vector<HostTensor> logits;
    std::string fault;  // four lengths past max_len and the page: any of them
    ASSERT_NO_FATAL_FAILURE(gpu_logits(f, q, w, max_len, logits, nullptr, 0, workspace, &fault));
    EXPECT_EQ(fault.rfind("indexer_logits: argument '", 0), 0u) << "noted: " << fault;
    for (std::size_t i = 0; i < logits.size(); ++i) {
      EXPECT_TRUE(compare("logits, " + to_string(workspace) + ", call " + std::to_string(i + 1), logits[i], expected,
                          kLogitsTolerance));
    }
  }
}

// Many long requests: each warp streams more tiles than its ring holds (the steady state of the
// pipeline, not only its first tiles); with page size 17, the 4-byte copies of unaligned pages.
std::vector<std::int64_t> long_lengths(int count, std::int64_t first, std::int64_t step) {
  std::vector<std::int64_t> lengths;
  for (int i = 0; i < count; ++i) lengths.push_back(first + step * i);
  return lengths;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuIndexerLogits,
                         ::testing::Values(LogitsCase{32, 1, 64, {0, 1, 63, 65, 1000}},
                                           LogitsCase{8, 1, 64, long_lengths(48, 4000, 97)},
                                           LogitsCase{4, 2, 17, long_lengths(24, 3001, 131)},
                                           LogitsCase{64, 2, 17, {2, 300, 40}},
                                           // pages of a multiple of 4 tokens on which a turn of 64
                                           // touches more than two pages (on sm_90 the wgmma kernel,
                                           // a lane of the copier warp per page; elsewhere the
                                           // mma.sync kernel's 16-byte-aligned instance): 16 (four
                                           // whole pages a turn), 4 (sixteen), 12 (six), 20 (four),
                                           // 28 (three or four), 40, 44, 52 (two or three)
                                           LogitsCase{32, 2, 16, {2, 17, 300, 1001}},
                                           LogitsCase{8, 1, 40, {3, 39, 41, 1000}},
                                           LogitsCase{16, 1, 4, {0, 1, 3, 5, 63, 64, 65, 2001}},
                                           LogitsCase{8, 2, 12, long_lengths(24, 3001, 131)},
                                           LogitsCase{64, 4, 20, {3, 19, 21, 500}},
                                           LogitsCase{32, 1, 28, {27, 29, 63, 65, 1000}},
                                           LogitsCase{4, 3, 44, {43, 45, 129, 700}},
                                           LogitsCase{32, 1, 52, {0, 51, 53, 104, 105, 2000}},
                                           LogitsCase{32, 1, 16, {70001}},
                                           LogitsCase{8, 1, 16, long_lengths(16, 70000, 2001)},
                                           LogitsCase{8, 1, 52, long_lengths(16, 70000, 2001)},
                                           LogitsCase{8, 1, 12, long_lengths(16, 70000, 2001)},
                                           LogitsCase{32, 1, 12, {1, 11, 13, 1000}, ScaleMode::kExact},
                                           LogitsCase{1, 4, 1, {4, 50}}, LogitsCase{7, 3, 64, {3, 129, 700}},
                                           // on sm_90 the wgmma kernel (pages of 64 or 128): passes of 16 heads,
                                           // two of 32 with padded heads in the second, the largest queries
                                           LogitsCase{12, 3, 64, {5, 200, 1000}},
                                           LogitsCase{40, 1, 64, long_lengths(20, 2000, 77)},
                                           LogitsCase{64, 4, 128, {3, 500, 130}},
                                           // one long request over every CTA of the grid
                                           LogitsCase{32, 1, 64, {70001}},
                                           // on sm_90, spans of 24 turns and more claim their last quarter
                                           // (the shorter requests end inside their static spans)
                                           LogitsCase{8, 1, 64, long_lengths(16, 70000, 2001)},
                                           LogitsCase{8, 2, 64, long_lengths(16, 75000, 1601)},
                                           // key scales that are no powers of two, on both kernels
                                           LogitsCase{32, 1, 64, {0, 1, 63, 65, 1000}, ScaleMode::kExact},
                                           LogitsCase{4, 2, 17, {2, 16, 18, 3001}, ScaleMode::kExact},
                                           // pages larger than a turn: 256, 1000 and 4096 tokens
                                           LogitsCase{8, 1, 256, long_lengths(8, 3000, 77)},
                                           LogitsCase{64, 2, 1000, {2, 1001, 3000}},
                                           LogitsCase{32, 1, 4096, {0, 1, 4097, 9000}},
                                           // on sm_90 the wgmma kernel's turns across a page's end
                                           // (pages of 100, 68, 96: no multiple of 64), lengths
                                           // ending before, at and after a page's end, in either part
                                           // of such a turn; the ring's steady state; one request
                                           // over the grid; claims; key scales no powers of two
                                           LogitsCase{32, 1, 100, {0, 1, 99, 100, 101, 127, 128, 129, 163, 2000}},
                                           LogitsCase{8, 2, 68, long_lengths(24, 3001, 131)},
                                           LogitsCase{64, 4, 96, {3, 95, 97, 500}},
                                           LogitsCase{16, 1, 68, {70001}},
                                           LogitsCase{8, 1, 100, long_lengths(16, 70000, 2001)},
                                           LogitsCase{32, 1, 100, {1, 99, 101, 1000}, ScaleMode::kExact},
                                           // pages below a turn on which a turn touches two pages at
                                           // most (on sm_90 the wgmma kernel): 32 (every turn two
                                           // whole pages), 48 (turns from 0, 16 and 32 tokens into a
                                           // page), 56 and 60 (every offset a multiple of 8, of 4)
                                           LogitsCase{8, 1, 32, long_lengths(8, 3000, 77)},
                                           LogitsCase{32, 1, 48, {0, 1, 47, 48, 49, 63, 64, 65, 95, 96, 97, 143, 144, 2000}},
                                           LogitsCase{16, 2, 56, long_lengths(24, 3001, 131)},
                                           LogitsCase{64, 4, 60, {3, 59, 61, 500}},
                                           LogitsCase{32, 1, 48, {70001}},
                                           LogitsCase{8, 1, 60, long_lengths(16, 70000, 2001)},
                                           LogitsCase{32, 1, 56, {1, 55, 57, 1000}, ScaleMode::kExact}),
                         [](const ::testing::TestParamInfo<LogitsCase>& info) {
                           std::ostringstream os;
                           os << "Hi" << info.param.heads << "_q" << info.param.q_len << "_ps" << info.param.page_size << "_B"
                              << info.param.lengths.size()
                              << (info.param.scale_mode == ScaleMode::kExact ? "_exactscales" : "");
                           return os.str();
                         });

}  // namespace
}  // namespace latentkv::testing
