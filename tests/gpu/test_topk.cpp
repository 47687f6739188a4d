// GPU top-k against the CPU reference (SPEC section 4.5): per query row, the physical slots of the
// k largest visible logits in any order, ties broken either way (checked as in topk_check.hpp).
// Logits past each row's visible positions are +inf, or NaN in a few cases (the kernel may load
// them, never use them), the slots are sentinel-filled with a guard of sentinels after them, the
// workspace starts as garbage (the kernel must not count on zeroed scratch), page tables are
// shuffled. Every case runs twice: on that workspace, then with the row state cleared beforehand and
// TopkParams::workspace_cleared set (as dsa_decode's indexer leaves it), the rest of the workspace
// still garbage.
//
// Cases: a 128K-token row, a batch of 64 x 32K (the cooperative kernel; with spare columns, the
// two-kernel path), 160 rows of up to 32K (a grid that is not resident at once: the two-kernel
// path), lengths around k, causal rows (q_len 2-4), page sizes 1, 17 and 64, k 1, 7 and 2048, masses
// of ties, -inf logits among the visible ones, more equal logits at the threshold than the kernel's
// candidate list holds, and spare logits columns.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <ostream>
#include <string>
#include <tuple>
#include <vector>

#include "gpu/device.hpp"
#include "gpu/topk_check.hpp"
#include "latentkv/backend.hpp"
#include "support/expect_error.hpp"
#include "support/host_tensor.hpp"
#include "support/paged_fixture.hpp"
#include "support/reference_ops.hpp"

namespace latentkv::testing {
namespace {

// How the visible logits of a row are drawn (then shuffled into random positions).
enum class Fill {
  kNormal,            // N(0, 1)
  kWideRange,         // random sign, magnitude 2^u with u uniform in [-120, 120] (exponents far apart)
  kAllEqual,          // every logit 0.5
  kThreeValues,       // -1.5, 0 or 3
  kBlockAtThreshold,  // k-1 logits in [2, 3), the rest 1.0 (three in four) or below 0
  kSomeMinusInf,      // N(0, 1), or -inf with probability 0.6
  kMostlyMinusInf,    // -inf but for 100 N(0, 1) logits: a row takes -inf logits to fill its k
  kOverflowEqual,     // 1000 logits in [2, 3), then up to 110000 equal to 1.0, the rest below 0
  kOverflowNarrow,    // as kOverflowEqual, the 110000 within 4096 ulps above 1.0 (one top radix digit)
};

struct TopkCase {
  std::string name;
  std::vector<std::int64_t> lengths;
  int k = kMaxTopk;
  int q_len = 1;
  int page_size = kDefaultPageSize;
  Fill fill = Fill::kNormal;
  std::int64_t extra_columns = 3;  // logits columns past the longest request
  // The logits no row sees (past each row's visible positions, and the extra columns): +inf in most
  // cases, which a kernel that ranked any of them would pick first (NaN, the poison of the other
  // cases, ranks last of all and would stay unpicked in rows that see more than k).
  float hidden = std::numeric_limits<float>::infinity();
};

std::ostream& operator<<(std::ostream& os, const TopkCase& c) {
  return os << c.name << " (B " << c.lengths.size() << ", k " << c.k << ", q_len " << c.q_len << ", page "
            << c.page_size << ")";
}

const float kPoisonLogit = std::bit_cast<float>(kPoisonF32Bits);  // a NaN
constexpr std::int64_t kGuardSlots = 1024;  // sentinel i32s after the slots output
constexpr int kWorkspaceGarbage = 0xA5;     // byte pattern of the workspace before the first call

// Block tables and lengths only, grown in interleaved chunks as make_paged_fixture grows them.
// Top-k reads no cache, so the cache bytes stay empty (quantizing 2M tokens would take minutes).
PagedFixture make_tables(int page_size, const std::vector<std::int64_t>& lengths, Rng& rng) {
  std::int64_t pages = 3, most_pages = 0;  // 3 spare pages no request uses
  for (std::int64_t len : lengths) {
    pages += (len + page_size - 1) / page_size;
    most_pages = std::max(most_pages, (len + page_size - 1) / page_size);
  }
  PagedFixture f(pages, page_size, rng.fork_seed());
  f.page_size = page_size;
  f.max_pages = static_cast<int>(most_pages + 1);
  for (std::size_t b = 0; b < lengths.size(); ++b) f.requests.push_back(f.allocator.add_request());
  std::vector<std::int64_t> grown(lengths.size(), 0);
  for (bool more = true; more;) {
    more = false;
    for (std::size_t b = 0; b < lengths.size(); ++b) {
      const std::int64_t left = lengths[b] - grown[b];
      if (left <= 0) continue;
      const std::int64_t chunk = std::min(left, rng.uniform_int(1, 2 * page_size));
      f.allocator.grow(f.requests[b], chunk);
      grown[b] += chunk;
      more = true;
    }
  }
  f.block_table = f.allocator.block_table_matrix(f.requests, f.max_pages);
  f.seq_lens = f.allocator.lengths(f.requests);
  return f;
}

// The `visible` logits of one row, drawn as `fill` says and shuffled into place.
void fill_row(Fill fill, int k, Rng& rng, float* row, std::int64_t visible) {
  const auto n = static_cast<std::size_t>(visible);
  const auto top = static_cast<std::size_t>(k - 1);
  const float inf = std::numeric_limits<float>::infinity();
  const auto above_two = [&rng] { return static_cast<float>(rng.uniform(2.0, 3.0)); };
  const auto below_zero = [&rng] { return static_cast<float>(rng.uniform(-2.0, 0.0)); };
  std::vector<float> v(n);
  switch (fill) {
    case Fill::kNormal:
      for (float& x : v) x = static_cast<float>(rng.normal());
      break;
    case Fill::kWideRange:
      for (float& x : v) x = static_cast<float>((rng.coin() ? -1.0 : 1.0) * std::exp2(rng.uniform(-120.0, 120.0)));
      break;
    case Fill::kAllEqual:
      std::fill(v.begin(), v.end(), 0.5f);
      break;
    case Fill::kThreeValues: {
      constexpr float kValues[] = {-1.5f, 0.0f, 3.0f};
      for (float& x : v) x = kValues[rng.uniform_int(0, 2)];
      break;
    }
    case Fill::kBlockAtThreshold:
      for (std::size_t j = 0; j < n; ++j) v[j] = j < top ? above_two() : rng.coin(0.75) ? 1.0f : below_zero();
      break;
    case Fill::kSomeMinusInf:
      for (float& x : v) x = rng.coin(0.6) ? -inf : static_cast<float>(rng.normal());
      break;
    case Fill::kMostlyMinusInf:
      for (std::size_t j = 0; j < n; ++j) v[j] = j < 100 ? static_cast<float>(rng.normal()) : -inf;
      break;
    case Fill::kOverflowEqual:
    case Fill::kOverflowNarrow: {
      const std::uint32_t one = std::bit_cast<std::uint32_t>(1.0f);
      for (std::size_t j = 0; j < n; ++j) {
        if (j < 1000) {
          v[j] = above_two();
        } else if (j < 111000) {
          v[j] = fill == Fill::kOverflowEqual ? 1.0f
                                              : std::bit_cast<float>(one + static_cast<std::uint32_t>(rng.uniform_int(0, 4095)));
        } else {
          v[j] = below_zero();
        }
      }
      break;
    }
  }
  std::shuffle(v.begin(), v.end(), rng);
  std::copy(v.begin(), v.end(), row);
}

// Logits [B, q_len, max_len] f32 for the fixture's current lengths: each row's visible positions
// drawn by `fill`, every other column `hidden` (NaN unless given).
HostTensor make_logits(const PagedFixture& f, int q_len, std::int64_t max_len, Fill fill, int k, Rng& rng,
                       float hidden = kPoisonLogit) {
  HostTensor logits(DType::kF32, {f.batch(), q_len, max_len});
  float* x = logits.data<float>();  // [B, q_len, max_len]
  std::fill(x, x + logits.numel(), hidden);
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    const std::int64_t length = f.seq_lens[static_cast<std::size_t>(b)];
    for (int i = 0; i < q_len; ++i) {
      const std::int64_t visible = std::max<std::int64_t>(0, length - q_len + i + 1);
      fill_row(fill, k, rng, x + (b * q_len + i) * max_len, visible);
    }
  }
  return logits;
}

// Top-k calls of one shape on the GPU: the fixture's tables, device logits, the slots output
// followed by a guard, and the backend's planned workspace (garbage-filled once, then left as each
// call leaves it, as a captured graph replaying the op leaves it).
class DeviceTopk {
 public:
  DeviceTopk(const PagedFixture& f, int q_len, std::int64_t max_len, int k)
      : backend_(*find_backend("cuda")),
        device_(detect_device()),
        slots_shape_({f.batch(), q_len, k}),
        table_(f.block_table),
        lens_(f.seq_lens),
        logits_(static_cast<std::size_t>(f.batch() * q_len * max_len) * sizeof(float)),
        slots_(static_cast<std::size_t>(f.batch() * q_len * k + kGuardSlots) * sizeof(std::int32_t)) {
    params_.logits = TensorView::contiguous(logits_.get(), DType::kF32, {f.batch(), q_len, max_len}, Device::cuda());
    params_.block_table = f.block_table_view(table_.get<std::int32_t>(), Device::cuda());
    params_.seq_lens = f.seq_lens_view(lens_.get<std::int32_t>(), Device::cuda());
    params_.page_size = f.page_size;
    params_.k = k;
    params_.slots = TensorView::contiguous(slots_.get(), DType::kI32, {f.batch(), q_len, k}, Device::cuda());
    const Plan plan = backend_.plan(params_, device_);
    cleared_bytes_ = plan.cleared_bytes;
    workspace_ = DeviceBuffer(plan.workspace_bytes);
    if (workspace_.bytes() > 0) check_cuda(cudaMemset(workspace_.get(), kWorkspaceGarbage, workspace_.bytes()));
    params_.workspace = workspace_.get();
    params_.workspace_bytes = workspace_.bytes();
    params_.fault = fault_.get();
  }

  // One call on `logits` with `seq_lens`; returns the slots [B, q_len, k]. A write past the slots
  // output (into the guard) fails the test. `cleared`: the plan's cleared_bytes of the workspace
  // zeroed before the call, and the call told so.
  HostTensor call(const HostTensor& logits, const std::vector<std::int32_t>& seq_lens, bool cleared = false) {
    fault_.clear();
    if (cleared) {
      EXPECT_GT(cleared_bytes_, 0u) << "the GPU top-k should take its row state cleared";
      check_cuda(cudaMemset(workspace_.get(), 0, cleared_bytes_));
    }
    params_.workspace_cleared = cleared;
    logits_.upload(logits.raw(), logits.bytes());
    lens_.upload(seq_lens.data(), seq_lens.size() * sizeof(std::int32_t));
    const std::vector<std::int32_t> sentinels(slots_.bytes() / sizeof(std::int32_t), kSentinelI32);
    slots_.upload(sentinels.data(), slots_.bytes());
    run(backend_, params_, {}, device_);
    check_cuda(cudaDeviceSynchronize());
    const std::vector<std::int32_t> out = slots_.to_host<std::int32_t>();
    HostTensor slots(DType::kI32, slots_shape_);
    const auto end = out.begin() + slots.numel();
    std::copy(out.begin(), end, slots.data<std::int32_t>());
    EXPECT_TRUE(std::all_of(end, out.end(), [](std::int32_t s) { return s == kSentinelI32; }))
        << "the kernel wrote past the end of the slots output";
    return slots;
  }
  // The message of the fault the last call noted, "" for none.
  std::string fault() const { return fault_.message(); }

 private:
  const Backend& backend_;
  DeviceInfo device_;
  std::vector<std::int64_t> slots_shape_;  // [B, q_len, k]
  DeviceBuffer table_, lens_;
  DeviceBuffer logits_;  // [B, q_len, max_len] f32
  DeviceBuffer slots_;   // [B, q_len, k] i32, then kGuardSlots sentinels
  DeviceBuffer workspace_;
  std::size_t cleared_bytes_ = 0;
  FaultRecord fault_;
  TopkParams params_;
};

class GpuTopk : public ::testing::TestWithParam<TopkCase> {};

TEST_P(GpuTopk, MatchesReference) {
  LKV_REQUIRE_GPU();
  const TopkCase& c = GetParam();
  Rng rng = test_rng();
  PagedFixture f = make_tables(c.page_size, c.lengths, rng);
  const std::int64_t max_len = f.max_len() + c.extra_columns;
  const HostTensor logits = make_logits(f, c.q_len, max_len, c.fill, c.k, rng, c.hidden);
  const HostTensor want = reference_topk(f, logits, c.k);

  DeviceTopk gpu(f, c.q_len, max_len, c.k);
  const HostTensor got = gpu.call(logits, f.seq_lens);
  EXPECT_TRUE(check_topk_rows(f, logits, got, want)) << c;
  EXPECT_EQ(gpu.fault(), "") << "a fault noted for good input";
  const HostTensor got_cleared = gpu.call(logits, f.seq_lens, true);
  EXPECT_TRUE(check_topk_rows(f, logits, got_cleared, want)) << c << ", row state cleared before the call";
}

// 64 requests of 32K tokens, every other one somewhat shorter (a length not a multiple of anything).
std::vector<std::int64_t> wide_batch_lengths() {
  std::vector<std::int64_t> lengths;
  for (int b = 0; b < 64; ++b) lengths.push_back(b % 2 == 0 ? 32768 : 32768 - (b * 977) % 3001);
  return lengths;
}

// 48 rows of up to 8192 logits: on 132 SMs too many CTAs for chunks of 1024 logits, few enough for
// 2048 (the middle of the three chunk sizes the kernels choose from).
std::vector<std::int64_t> middle_batch_lengths() {
  std::vector<std::int64_t> lengths;
  for (int b = 0; b < 48; ++b) lengths.push_back(b % 3 == 0 ? 8192 : 8192 - (b * 613) % 4001);
  return lengths;
}

// 160 rows of up to 32K logits: 1280 CTAs of 4096 logits, more than the cooperative kernel keeps
// resident on any current GPU, so the memset and the two chained kernels serve them.
std::vector<std::int64_t> huge_batch_lengths() {
  std::vector<std::int64_t> lengths;
  for (int b = 0; b < 160; ++b) lengths.push_back(b % 4 == 0 ? 32768 : 32768 - (b * 1231) % 30001);
  return lengths;
}

std::vector<TopkCase> topk_cases() {
  const std::vector<std::int64_t> around_k = {0, 1, 2, 2047, 2048, 2049, 2050, 2051, 7000};
  std::vector<TopkCase> v;
  // NaN where no row sees, in a few cases of each path.
  const auto nan_hidden = [](TopkCase c) {
    c.hidden = kPoisonLogit;
    c.name += "_nan_hidden";
    return c;
  };
  v.push_back(nan_hidden({"long_row_128k", {131072}}));
  // No spare columns: 8 chunks of 4096 a row, 512 CTAs, the cooperative kernel on 132 SMs (4 a SM);
  // with spare columns a row takes 9 chunks and the grid (576) the memset and two kernels.
  v.push_back({"batch64_32k", wide_batch_lengths(), kMaxTopk, 1, 64, Fill::kNormal, 0});
  v.push_back({"batch48_8k", middle_batch_lengths()});
  v.push_back(nan_hidden({"batch160_32k", huge_batch_lengths()}));
  v.push_back({"batch48_8k_all_equal", middle_batch_lengths(), kMaxTopk, 1, 64, Fill::kAllEqual});
  v.push_back({"batch64_32k_all_equal", wide_batch_lengths(), kMaxTopk, 1, 64, Fill::kAllEqual, 0});
  v.push_back({"batch64_32k_overflow_equal", wide_batch_lengths(), kMaxTopk, 1, 64, Fill::kOverflowEqual, 0});
  v.push_back({"batch64_32k_spare_columns", wide_batch_lengths()});
  v.push_back({"lengths_around_k", {0, 1, 2047, 2048, 2049, 5000}});
  for (int q_len : {2, 3, 4}) {
    const TopkCase c{"causal_q" + std::to_string(q_len), around_k, kMaxTopk, q_len};
    v.push_back(q_len == 3 ? nan_hidden(c) : c);
  }
  for (int page : {1, 17, 64, 1000, 4096}) {
    const TopkCase c{"page" + std::to_string(page), {0, 1, 16, 18, 63, 65, 2049, 9000}, kMaxTopk, 1, page};
    v.push_back(page == 17 ? nan_hidden(c) : c);
  }
  for (int k : {1, 7, 2048}) {
    v.push_back({"k" + std::to_string(k), {0, 1, 6, 7, 8, 9, 100, 2047, 2049, 5000}, k, 2, 17});
  }
  v.push_back({"all_equal", {1, 2047, 2048, 2049, 10000}, kMaxTopk, 1, 64, Fill::kAllEqual});
  v.push_back({"all_equal_k7_causal", {3, 7, 8, 500}, 7, 3, 64, Fill::kAllEqual});
  v.push_back({"three_values", {5, 3000, 20000}, kMaxTopk, 2, 17, Fill::kThreeValues});
  v.push_back({"three_values_k7", {5, 8, 3000}, 7, 1, 64, Fill::kThreeValues});
  v.push_back({"block_at_threshold", {2048, 2049, 2050, 4096, 30000}, kMaxTopk, 2, 64, Fill::kBlockAtThreshold});
  v.push_back({"block_at_threshold_k7", {7, 8, 5000}, 7, 1, 64, Fill::kBlockAtThreshold});
  v.push_back({"block_at_threshold_k1", {1, 2, 5000}, 1, 1, 64, Fill::kBlockAtThreshold});
  v.push_back({"some_minus_inf", {1, 100, 2049, 6000}, kMaxTopk, 2, 64, Fill::kSomeMinusInf});
  v.push_back({"mostly_minus_inf", {1, 100, 2049, 6000}, kMaxTopk, 1, 64, Fill::kMostlyMinusInf});
  v.push_back({"overflow_equal", {131072, 120000}, kMaxTopk, 1, 64, Fill::kOverflowEqual});
  v.push_back({"overflow_narrow", {131072}, kMaxTopk, 2, 64, Fill::kOverflowNarrow});
  v.push_back({"wide_range", {3000, 50000}, kMaxTopk, 1, 64, Fill::kWideRange});
  v.push_back(nan_hidden({"max_len_beyond_lengths", {0, 100, 3000}, kMaxTopk, 1, 64, Fill::kNormal, 40000}));
  v.push_back({"max_len_beyond_lengths_page17", {2049, 1}, kMaxTopk, 2, 17, Fill::kNormal, 12345});
  return v;
}

INSTANTIATE_TEST_SUITE_P(Cases, GpuTopk, ::testing::ValuesIn(topk_cases()),
                         [](const ::testing::TestParamInfo<TopkCase>& info) { return info.param.name; });

// One planned workspace reused by calls whose lengths grow and whose logits change, as a replayed
// graph reuses it: whatever a call leaves in the scratch must not change the next call's answer. On
// 132 SMs the first tables' 6 rows of about 6K logits take chunks of 512 (72 CTAs: the memset and
// two kernels), the second's of about 30K chunks of 1024 (180 CTAs: the cooperative kernel, which
// clears its own row state).
TEST(GpuTopkReuse, WorkspaceReusedAsLengthsGrow) {
  LKV_REQUIRE_GPU();
  const int q_len = 2;
  struct Growth {
    std::vector<std::int64_t> final_lengths;  // what the tables hold
    std::vector<std::vector<std::int32_t>> steps;
  };
  const Growth growths[] = {
      {{6000, 2100, 40}, {{300, 1, 0}, {2049, 2048, 2}, {2050, 2049, 3}, {4000, 2050, 40}, {6000, 2100, 40}}},
      {{30000, 20000, 9000}, {{300, 1, 0}, {2049, 2048, 2}, {9000, 2050, 40}, {20000, 15000, 9000}, {30000, 20000, 9000}}},
  };
  for (const Growth& g : growths) {
    SCOPED_TRACE("up to " + std::to_string(g.final_lengths[0]) + " tokens");
    Rng rng = test_rng();
    PagedFixture f = make_tables(64, g.final_lengths, rng);
    const std::int64_t max_len = f.max_len() + 64;
    DeviceTopk gpu(f, q_len, max_len, kMaxTopk);
    for (std::size_t s = 0; s < g.steps.size(); ++s) {
      f.seq_lens = g.steps[s];  // the reference and the check follow the lengths the kernel sees
      const Fill fill = s % 2 == 0 ? Fill::kNormal : Fill::kThreeValues;
      const HostTensor logits = make_logits(f, q_len, max_len, fill, kMaxTopk, rng);
      const HostTensor want = reference_topk(f, logits, kMaxTopk);
      const HostTensor got = gpu.call(logits, f.seq_lens);
      EXPECT_TRUE(check_topk_rows(f, logits, got, want))
          << "call " << s << ": lengths " << g.steps[s][0] << ", " << g.steps[s][1] << ", " << g.steps[s][2];
    }
  }
}

// Logits of no columns pass the view checks at any row count; rows whose workspace (about 40 KB a
// row) has no 64-bit size are refused by plan(), naming the logits, rather than planned wrapped.
TEST(GpuTopkPlan, RowsPastA64BitWorkspaceAreRefused) {
  LKV_REQUIRE_GPU();
  const Device gpu = Device::cuda();
  TopkParams p;
  p.page_size = 64;
  p.logits = TensorView::contiguous(nullptr, DType::kF32, {std::int64_t{1} << 30, std::int64_t{1} << 30, 0}, gpu);
  p.block_table = TensorView::contiguous(nullptr, DType::kI32, {std::int64_t{1} << 30, 1}, gpu);
  p.seq_lens = TensorView::contiguous(nullptr, DType::kI32, {std::int64_t{1} << 30}, gpu);
  p.slots = TensorView::contiguous(nullptr, DType::kI32, {std::int64_t{1} << 30, std::int64_t{1} << 30, 0}, gpu);
  const Backend& backend = *find_backend("cuda");
  EXPECT_TRUE(throws_error([&] { (void)backend.plan(p, detect_device()); }, "topk", "logits",
                           "[1073741824, 1073741824, 0]"));
  p.logits.shape[1] = 4;  // 2^32 rows: 176 TB, a size (no GPU holds it; the call refuses that)
  EXPECT_NO_THROW((void)backend.plan(p, detect_device()));
}

// Bad lengths and pages, one at a time: given a fault record, the top-k checks them (a kernel of its
// own) and the record throws the reference's own Error for the same input. Its pages may be any id
// whose slots fit int32 (the top-k knows no pool). The block tables keep their spare -1 column: a
// length past the capacity is one fault, whatever the pages past it hold.
TEST(GpuTopkFaults, RecordTheReferencesError) {
  LKV_REQUIRE_GPU();
  struct Bad {
    const char* what;
    std::function<void(PagedFixture&, std::int64_t&)> spoil;  // the tables and max_len
  };
  const std::vector<Bad> bad = {
      {"a negative page", [](PagedFixture& f, std::int64_t&) { f.block_table[1] = -3; }},
      {"a page whose slots pass int32", [](PagedFixture& f, std::int64_t&) {
         f.block_table[f.max_pages + 2] = INT32_MAX / f.page_size;
       }},
      {"a length past the block table", [](PagedFixture& f, std::int64_t& max_len) {
         f.seq_lens[1] = f.max_pages * f.page_size + 1;
         max_len = f.seq_lens[1];
       }},
      {"a length past the logits' columns", [](PagedFixture& f, std::int64_t& max_len) { max_len = f.seq_lens[1] - 1; }},
      {"a negative length", [](PagedFixture& f, std::int64_t&) { f.seq_lens[0] = -1; }},
  };
  for (const Bad& b : bad) {
    SCOPED_TRACE(b.what);
    Rng rng = test_rng();
    PagedFixture f = make_tables(64, {3000, 9000}, rng);
    std::int64_t max_len = f.max_len();
    b.spoil(f, max_len);
    const std::vector<std::int32_t> spoiled = f.seq_lens;
    for (std::int32_t& l : f.seq_lens) l = static_cast<std::int32_t>(std::clamp<std::int64_t>(l, 0, max_len));  // the logits' rows
    const HostTensor logits = make_logits(f, 1, max_len, Fill::kNormal, kMaxTopk, rng);
    f.seq_lens = spoiled;
    const std::string expected = error_of([&] { reference_topk(f, logits, kMaxTopk); });
    ASSERT_NE(expected, "") << "the reference takes the input";
    DeviceTopk gpu(f, 1, max_len, kMaxTopk);
    const HostTensor got = gpu.call(logits, f.seq_lens);
    EXPECT_EQ(gpu.fault(), expected);
    // Whatever the record says, no slot comes from a page outside the tables' pool: a bad page
    // gives -1 on every path (the 2 rows here take the chunks of 2 logits a thread, whose pages
    // are loaded with the logits).
    const std::int64_t pool_slots = f.num_pages() * f.page_size;
    const std::int32_t* s = got.data<std::int32_t>();
    const std::int64_t outside = std::count_if(s, s + got.numel(), [&](std::int32_t x) { return x < -1 || x >= pool_slots; });
    EXPECT_EQ(outside, 0) << "slots outside -1 .. " << pool_slots - 1;
  }
}

// A NaN logit (which only the indexer prefill lets through; the record notes it here) ranks below
// every number, as in the reference: rows that see more than k tokens never select it, rows that see
// k or fewer take it with the rest. One NaN in every row, of both signs and the GPU's own 0x7FFFFFFF,
// at batches that take each chunk size (2, 4, 8 and 16 logits a thread); the expected sets are the
// reference's with the NaN as -inf, which ranks the same way among these numbers.
TEST(GpuTopkNan, ANanLogitRanksBelowEveryNumber) {
  LKV_REQUIRE_GPU();
  const std::vector<std::vector<std::int64_t>> batches = {
      {3000, 9000, 2048, 17}, {131072}, middle_batch_lengths(), wide_batch_lengths()};
  constexpr std::uint32_t kNans[] = {0x7FFFFFFFu, 0x7FC00000u, 0xFFC00000u};
  for (const std::vector<std::int64_t>& lengths : batches) {
    SCOPED_TRACE("B " + std::to_string(lengths.size()) + ", first length " + std::to_string(lengths[0]));
    Rng rng = test_rng();
    PagedFixture f = make_tables(64, lengths, rng);
    const std::int64_t max_len = f.max_len();
    HostTensor logits = make_logits(f, 1, max_len, Fill::kNormal, kMaxTopk, rng);
    HostTensor as_minus_inf = logits;
    for (std::int64_t b = 0; b < f.batch(); ++b) {
      const std::int64_t visible = f.seq_lens[static_cast<std::size_t>(b)];
      if (visible == 0) continue;
      const std::int64_t at = b * max_len + rng.uniform_int(0, visible - 1);
      logits.data<float>()[at] = std::bit_cast<float>(kNans[b % 3]);
      as_minus_inf.data<float>()[at] = -std::numeric_limits<float>::infinity();
    }
    const HostTensor want = reference_topk(f, as_minus_inf, kMaxTopk);
    DeviceTopk gpu(f, 1, max_len, kMaxTopk);
    EXPECT_TRUE(check_topk_rows(f, as_minus_inf, gpu.call(logits, f.seq_lens), want));
    EXPECT_TRUE(check_topk_rows(f, as_minus_inf, gpu.call(logits, f.seq_lens, true), want)) << "row state cleared";
  }
}

// A NaN logit at a position its row sees (the first, one in the middle, the last of a causal row),
// one at a time: given a fault record, the top-k's check names it as the reference does. The columns
// no row sees are NaN in every case (make_logits), and must not be noted.
TEST(GpuTopkFaults, ANanLogitARowSeesIsTheReferencesError) {
  LKV_REQUIRE_GPU();
  Rng rng = test_rng();
  PagedFixture f = make_tables(64, {3000, 9000}, rng);
  const std::int64_t max_len = f.max_len();
  for (const auto& [b, i, t] : {std::tuple{0, 0, 0}, std::tuple{1, 1, 4500}, std::tuple{1, 0, 8998}, std::tuple{0, 1, 2999}}) {
    SCOPED_TRACE("logits[" + std::to_string(b) + "][" + std::to_string(i) + "][" + std::to_string(t) + "]");
    HostTensor logits = make_logits(f, 2, max_len, Fill::kNormal, kMaxTopk, rng);
    logits.data<float>()[(b * 2 + i) * max_len + t] = std::numeric_limits<float>::quiet_NaN();
    const std::string expected = error_of([&] { reference_topk(f, logits, kMaxTopk); });
    ASSERT_NE(expected, "") << "the reference takes the input";
    DeviceTopk gpu(f, 2, max_len, kMaxTopk);
    gpu.call(logits, f.seq_lens);
    EXPECT_EQ(gpu.fault(), expected);
  }
}

}  // namespace
}  // namespace latentkv::testing
