// Top-k (SPEC 4.5) on the GPU: a radix select over the bits of each row's visible logits.
//
// Keys are the logits' float bits mapped to unsigned integers of the same order. The k-th largest
// key K* is found a digit at a time - the top 12 bits over the whole row, the other 20 bits only
// among the candidates that share K*'s top digit - in three phases over CTAs of 512 to 4096 logits
// (kPer below):
//   1. each CTA counts its chunk's top digits in shared memory and adds them into the row's
//      histogram; the row's threshold digit T (where the k-th largest key falls) follows from it;
//   2. each key above T is selected on the spot (its slot written to the output); keys in T's bin
//      are listed, with their slots, as candidates;
//   3. one CTA of the row resolves the remaining bits among the candidates (a histogram of the next
//      10 bits in shared memory, then a direct ranking of the few keys left in that bin, or a
//      histogram of the last 10 bits when it holds many) and selects the rest: the candidates
//      above K*, then as many ties as needed, placed by block scans.
// The phases run in one of two ways:
//   * one cooperative kernel, when its whole grid fits on the GPU at once: grid barriers before
//     and after phase 1, the logits read once, and every CTA finding T itself from the row's
//     histogram;
//   * two chained kernels (chained_launch.cuh), after a memset of the row states: phase 1 in the
//     first; in the second every CTA reads its logits again and finds T itself. The kernel boundary
//     stands in for the second grid barrier. This path serves grids too large to be resident at
//     once, and grids of at most one CTA per SM (the decode of one layer at a small batch): there a
//     chained boundary (about 0.5 us on an H200) costs less than a grid barrier (about 1.0 us) -
//     docs/benchmarks.md, tenth session of 2026-12-01.
// On both paths the row's last CTA to finish phase 2 does phase 3; its arrival is one 64-bit atomic
// that also tells it how many candidates the row listed. When the call before cleared the row
// states (TopkParams::workspace_cleared: the indexer does it inside dsa_decode), the first barrier,
// or the memset, is left out. (Phase 1 counted by the indexer as it writes the logits, one atomic per
// logit, was tried: the atomics serialise on the crowded bins, and the indexer lost more than the
// top-k gained - docs/benchmarks.md, ninth session of 2026-12-01. One thread-block cluster of 16
// CTAs per row, its phases through distributed shared memory and three cluster barriers, was tried
// too: each cluster barrier cost about what a kernel boundary does, and B 1 x 32K went from 11.6 to
// 12.6 us, glm5's B 1 step from 1764 to 1904 us - twenty-first session of 2026-12-03. One CTA of
// 1024 threads per row of up to 8K logits, the row in registers, three passes of 11, 11 and 10 bits
// with warp-aggregated shared-memory atomics and no workspace, was tried as well: B 64 x 8K 18.8
// against 16.3 us; at 4K it won alone, B 64 11.1 against 14.0 us, but not inside a chain of kernels
// (dsa_decode B 64 x 4K 65.3 against 65.5 us, glm5's B 64 x 4K step 5145 against 5137), and it lost
// in the indexer prefill of 2K new tokens over 2K, 324 against 283 us - thirty-fourth session of
// 2026-12-04.) Rows that see k tokens or fewer skip the selection: every visible slot, then -1s. A
// row with more candidates than the list holds (masses of equal logits) re-reads its logits
// instead; slower, same answer.
#include <cooperative_groups.h>
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>
#include <limits>
#include <string>

#include "cuda/common/chained_launch.cuh"
#include "cuda/common/cuda_check.hpp"
#include "cuda/common/paging_check.hpp"
#include "cuda/common/register_cap.cuh"
#include "cuda/topk/launch.hpp"
#include "latentkv/error.hpp"

namespace latentkv::cuda {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
// Logits per thread (kPer, a template parameter: 2, 4, 8 or 16): 2 when that grid has at most one
// CTA per SM, else the smallest of 4, 8, 16 whose grid has at most two CTAs per SM, else 16. Few
// rows run fastest on many small chunks (more SMs share the passes); many rows on few large ones
// (fewer CTAs, and the grid resident at once). H200, k 2048: B 1 x 128K 16.0 / 16.4 / 18.3 us with
// 4 / 8 / 16, and 16.9 with 2 (256 CTAs); B 64 x 32K 37.2 / 30.8 / 26.5 us; B 1 x 32K inside
// dsa_decode 13.2 us with 4 (32 CTAs), 12.7 with 2 (64).
constexpr int kMaxCtasPerSm = 2;
// Digits of the key: 12 top bits (sign, exponent, 3 mantissa bits: eighths of an octave), 10, 10.
constexpr int kTopBits = 12, kMidBits = 10, kLowBits = 10;
constexpr int kTopShift = kMidBits + kLowBits;  // 20
constexpr int kTopBins = 1 << kTopBits;         // 4096
constexpr int kMidBins = 1 << kMidBits;         // 1024
constexpr int kLowBins = 1 << kLowBits;         // 1024
constexpr int kCandidates = 3072;               // listed candidates per row
constexpr std::uint32_t kShortBin = 64;         // the finisher ranks a bin of this many keys directly

// A row's state in the workspace (32-bit words); zero at the start of phase 1 (cleared by this call,
// or by the call before: TopkArgs::cleared).
enum StateWord : int {
  kHist = 0,                  // [kTopBins] counts of top digits
  kSelected = kTopBins,       // keys above T written so far
  kListed,                    // candidates found so far (may exceed kCandidates)
  kSelectDone,                // 64 bits: CTAs done selecting (high word), the candidates they listed (low)
  kStateWords = kSelectDone + 2,
};

using Scan = cub::BlockScan<std::uint32_t, kThreads>;
using Scan64 = cub::BlockScan<unsigned long long, kThreads>;

struct TopkArgs {
  const float* logits;              // [rows, max_len]
  const std::int32_t* block_table;  // [B, max_pages]
  const std::int32_t* seq_lens;     // [B]
  std::int32_t* slots;              // [rows, k]
  std::uint32_t* state;             // [rows, kStateWords]
  uint2* candidates;                // [rows, kCandidates] {slot, key}
  std::int64_t capacity;            // max_pages * page_size
  int max_len;
  int max_pages;
  int page_size;
  int q_len;
  int k;
  int chunks;                       // CTAs per row: ceil(max_len / chunk_len), at least 1
  int chunk_len;                    // logits per CTA: kThreads x kPer
  bool cleared;                     // the row states are zero on entry
  std::int32_t page_bound;          // pages whose slots fit int32: INT32_MAX / page_size
};

// Negative floats flipped whole, positive ones their sign bit. A NaN (which only the indexer prefill
// lets through: a NaN key scale in a cache the append did not write) ranks below every number, as in
// the reference: one of sign 1 lands below -inf's key 0x007FFFFF by itself, one of sign 0 (the GPU's
// own, 0x7FFFFFFF) would land above +inf's 0xFF800000 and is sent to 0.
__device__ __forceinline__ std::uint32_t order_key(float x) {
  const std::uint32_t u = __float_as_uint(x);
  const std::uint32_t key = u ^ (static_cast<std::uint32_t>(static_cast<std::int32_t>(u) >> 31) | 0x80000000u);
  return key > 0xFF800000u ? 0u : key;
}

// Positions row (b, i) sees: L_b - q_len + i + 1, L_b clamped to what the logits and table hold.
__device__ __forceinline__ int visible_count(const TopkArgs& a, int b, int i) {
  const std::int64_t len = min(static_cast<std::int64_t>(max(a.seq_lens[b], 0)),
                               min(static_cast<std::int64_t>(a.max_len), a.capacity));
  return static_cast<int>(max(len - a.q_len + i + 1, std::int64_t{0}));
}

// (Divisions by the page size, not paging_check.cuh's shifts: with shifts the top-k alone ran faster
// on an H200, B 64 x 32K 24.6 -> 21.4 us, but glm5's B 1 step lost 1.4 us a layer between its chained
// ops, 1757 -> 1866 us, not explained - docs/benchmarks.md, eighteenth session of 2026-12-02.)
__device__ __forceinline__ std::int32_t slot_of(const TopkArgs& a, int b, int t) {
  const std::int32_t page = a.block_table[static_cast<std::int64_t>(b) * a.max_pages + t / a.page_size];
  return page < 0 || page >= a.page_bound ? -1 : page * a.page_size + t % a.page_size;
}

// The bin (counting down from the top) where the need-th largest key falls, and the keys above it,
// from each thread's kPer bins counting down: counts[e] of bin kBins - 1 - (threadIdx.x * kPer + e).
// Every thread gets the answer; the bins must hold at least `need` keys.
template <int kPer>
__device__ void find_threshold_in(const std::uint32_t (&counts)[kPer], std::uint32_t need, Scan::TempStorage& scan,
                                  std::uint32_t (&result)[2], std::uint32_t& bin, std::uint32_t& above) {
  constexpr int kBins = kPer * kThreads;
  std::uint32_t local = 0;
#pragma unroll
  for (int e = 0; e < kPer; ++e) local += counts[e];
  std::uint32_t before;
  Scan(scan).ExclusiveSum(local, before);
  if (before < need && need <= before + local) {  // exactly one thread
    std::uint32_t running = before;
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      if (running < need && need <= running + counts[e]) {
        result[0] = kBins - 1 - (threadIdx.x * kPer + e);
        result[1] = running;
      }
      running += counts[e];
    }
  }
  __syncthreads();
  bin = result[0];
  above = result[1];
  __syncthreads();  // result may be reused
}

// The same over a histogram in shared memory.
template <int kBins>
__device__ void find_threshold(const std::uint32_t* hist, std::uint32_t need, Scan::TempStorage& scan,
                               std::uint32_t (&result)[2], std::uint32_t& bin, std::uint32_t& above) {
  constexpr int kPer = kBins / kThreads;
  std::uint32_t counts[kPer];
#pragma unroll
  for (int e = 0; e < kPer; ++e) counts[e] = hist[kBins - 1 - (threadIdx.x * kPer + e)];
  find_threshold_in(counts, need, scan, result, bin, above);
}

// True in the one CTA of the row that arrives last at the 64-bit kSelectDone word (after all others
// are done selecting), where each CTA also adds the candidates it listed: the last CTA learns from
// its own atomic how many the row listed, with no further round trip. Returns that count in the last
// CTA, else UINT32_MAX.
__device__ std::uint32_t arrive_last_listing(std::uint32_t* state, std::uint32_t ctas, std::uint32_t listed,
                                             std::uint32_t& shared) {
  static_assert(kSelectDone % 2 == 0 && kStateWords % 2 == 0, "a 64-bit word, 8-byte aligned in every row");
  static_assert(kStateWords * 4 % 16 == 0, "the row states are cleared in 16-byte pieces (IndexerLogitsParams::clear)");
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long before =
        atomicAdd(reinterpret_cast<unsigned long long*>(&state[kSelectDone]), (1ull << 32) | listed);
    shared = static_cast<std::uint32_t>(before >> 32) == ctas - 1 ? static_cast<std::uint32_t>(before) + listed : UINT32_MAX;
  }
  __syncthreads();
  const std::uint32_t found = shared;
  if (found != UINT32_MAX) __threadfence();
  return found;
}

// Shared memory of every kernel here: the top-digit histogram (the finisher reuses its first 1024
// bins), the listed candidates, and block-scan scratch.
struct TopkShared {
  std::uint32_t hist[kTopBins];
  uint2 cands[kCandidates];
  union {
    Scan::TempStorage scan;
    Scan64::TempStorage scan64;
  };
  std::uint32_t result[2];
  std::uint32_t in_bin, found;
};

// This CTA's chunk of a row: positions base + j * kThreads + threadIdx.x, j < kPer.
struct Chunk {
  int row, b, n, base;
  __device__ bool has(int j) const { return base + j * kThreads + static_cast<int>(threadIdx.x) < n; }
  __device__ int position(int j) const { return base + j * kThreads + static_cast<int>(threadIdx.x); }
};

__device__ Chunk chunk_of(const TopkArgs& a, int cta) {
  Chunk c;
  c.row = cta / a.chunks;
  c.b = c.row / a.q_len;
  c.n = visible_count(a, c.b, c.row % a.q_len);
  c.base = (cta % a.chunks) * a.chunk_len;
  return c;
}

// The chunk's logits, every position below max_len (c.has decides later which count): the loads
// do not wait for the row's length, so that its round trip and theirs overlap.
template <int kPer>
__device__ void load_chunk(const TopkArgs& a, const Chunk& c, float (&v)[kPer]) {
  const float* x = a.logits + static_cast<std::int64_t>(c.row) * a.max_len;
#pragma unroll
  for (int j = 0; j < kPer; ++j) v[j] = c.position(j) < a.max_len ? x[c.position(j)] : 0.0f;
}

// Where the slots of the kept keys come from, by keys per thread:
//   * up to 4 (few long rows: one layer's decode at a small batch, where latency counts): the
//     block-table entries of all the chunk's positions, loaded with the logits (load_pages), so that
//     no round trip to the table is left between the threshold and the writes;
//   * 8: the entries of the kept keys, loaded once T is known and before the scan, so that their
//     round trip overlaps the scan and the atomics;
//   * 16: looked up as they are written. Registers held any longer would cost the cooperative kernel
//     its fourth CTA per SM (80 registers instead of 64).
template <int kPer>
constexpr bool kPagesAhead = kPer <= 4;
template <int kPer>
constexpr bool kSlotsAfterThreshold = kPer == 8;
template <int kPer>
using ChunkPages = std::int32_t[kPagesAhead<kPer> ? kPer : 1];

template <int kPer>
__device__ void load_pages(const TopkArgs& a, const Chunk& c, ChunkPages<kPer>& pages) {
  if constexpr (kPagesAhead<kPer>) {
    const std::int32_t* table = a.block_table + static_cast<std::int64_t>(c.b) * a.max_pages;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int t = c.position(j);
      pages[j] = t < a.capacity ? table[t / a.page_size] : -1;
    }
  }
}

// Rows that see k tokens or fewer: every visible slot, then -1 padding (by the row's first CTA).
template <int kPer>
__device__ void take_all(const TopkArgs& a, const Chunk& c) {
  std::int32_t* out = a.slots + static_cast<std::int64_t>(c.row) * a.k;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (c.has(j)) out[c.position(j)] = slot_of(a, c.b, c.position(j));
  }
  if (c.base == 0) {
    for (int t = c.n + threadIdx.x; t < a.k; t += kThreads) out[t] = -1;
  }
}

// Phase 1: the chunk's top digits counted in shared memory (count_top_digits), then added into the
// row's histogram (publish_top_digits).
template <int kPer>
__device__ void count_top_digits(const Chunk& c, const float (&v)[kPer], TopkShared& s) {
  for (int d = threadIdx.x; d < kTopBins; d += kThreads) s.hist[d] = 0;
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (c.has(j)) atomicAdd(&s.hist[order_key(v[j]) >> kTopShift], 1u);
  }
  __syncthreads();
}
__device__ void publish_top_digits(const TopkShared& s, std::uint32_t* state) {
  for (int d = threadIdx.x; d < kTopBins; d += kThreads) {
    if (s.hist[d] != 0) atomicAdd(&state[kHist + d], s.hist[d]);
  }
}

// The row's whole histogram of top digits, all loads in flight at once, straight into the order
// find_threshold_in takes (thread t: the 16 bins below kTopBins - 16 t, counting down; four 16-byte
// loads). Then top_threshold.
using RowHistogram = std::uint32_t[kTopBins / kThreads];
__device__ void load_histogram(const std::uint32_t* state, RowHistogram& counts) {
  constexpr int kPer = kTopBins / kThreads;
  static_assert(kHist == 0 && kPer % 4 == 0, "16-byte pieces of the histogram at the row state's start");
  const uint4* words = reinterpret_cast<const uint4*>(state + kHist + kTopBins - kPer * (threadIdx.x + 1));
#pragma unroll
  for (int q = 0; q < kPer / 4; ++q) {
    const uint4 w = __ldcg(words + q);  // bins kTopBins - kPer (t + 1) + 4 q .. + 3
    counts[kPer - 1 - 4 * q] = w.x;
    counts[kPer - 2 - 4 * q] = w.y;
    counts[kPer - 3 - 4 * q] = w.z;
    counts[kPer - 4 - 4 * q] = w.w;
  }
}

// The digit T holding the k-th largest key, and the keys above it, from the row's whole histogram.
__device__ void top_threshold(const TopkArgs& a, TopkShared& s, const RowHistogram& counts, std::uint32_t& top,
                              std::uint32_t& above) {
  find_threshold_in(counts, static_cast<std::uint32_t>(a.k), s.scan, s.result, top, above);
}

// Phase 2: keys above T are selected on the spot, keys in T's bin listed as candidates with their
// slots. Room for the CTA's share of both lists comes from one scan of both counts (packed in 16-bit
// halves) and one atomic per list; the slots as kPagesAhead above says. Returns the number of
// candidates the CTA listed.
template <int kPer>
__device__ std::uint32_t select_above(const TopkArgs& a, const Chunk& c, const float (&v)[kPer],
                                      const ChunkPages<kPer>& pages, std::uint32_t top, TopkShared& s,
                                      std::uint32_t* state, uint2* listed) {
  std::int32_t* out = a.slots + static_cast<std::int64_t>(c.row) * a.k;
  std::uint32_t counts = 0;
  std::int32_t early[kSlotsAfterThreshold<kPer> ? kPer : 1];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const std::uint32_t digit = order_key(v[j]) >> kTopShift;
    const bool kept = c.has(j) && digit >= top;
    if constexpr (kSlotsAfterThreshold<kPer>) early[j] = kept ? slot_of(a, c.b, c.position(j)) : -1;
    if (kept) counts += digit > top ? 1u : 0x10000u;
  }
  std::uint32_t before, total;
  Scan(s.scan).ExclusiveSum(counts, before, total);
  if (threadIdx.x == 0) {
    s.result[0] = (total & 0xFFFFu) ? atomicAdd(&state[kSelected], total & 0xFFFFu) : 0u;
    s.result[1] = (total >> 16) ? atomicAdd(&state[kListed], total >> 16) : 0u;
  }
  __syncthreads();
  std::uint32_t at = s.result[0] + (before & 0xFFFFu), listed_at = s.result[1] + (before >> 16);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (!c.has(j)) continue;
    const std::uint32_t key = order_key(v[j]);
    const std::uint32_t digit = key >> kTopShift;
    if (digit < top) continue;
    std::int32_t slot;
    if constexpr (kPagesAhead<kPer>) {
      slot = pages[j] < 0 || pages[j] >= a.page_bound ? -1 : pages[j] * a.page_size + c.position(j) % a.page_size;
    } else if constexpr (kSlotsAfterThreshold<kPer>) {
      slot = early[j];
    } else {
      slot = slot_of(a, c.b, c.position(j));
    }
    if (digit > top && at < static_cast<std::uint32_t>(a.k)) out[at++] = slot;  // below k unless the state was dirty
    if (digit == top) {
      if (listed_at < kCandidates) listed[listed_at] = make_uint2(static_cast<std::uint32_t>(slot), key);
      ++listed_at;
    }
  }
  return total >> 16;  // the candidates this CTA listed
}

// Phase 3, by one CTA of the row: the low 20 bits of K* among the `found` candidates (the keys in
// T's bin), then the rest of the selection, every output position from a block scan or a rank (no
// counter that all the selected keys would take turns at):
//   * the candidates' next 10 bits (digit M) are counted, and the bin where the need-th largest
//     falls found; the candidates above that bin are selected, placed after one scan;
//   * the bin's own keys are listed. About one candidate in a thousand lies in it, so the list is
//     short but for masses of near-equal logits, and each entry's rank in it (keys descending, then
//     list order) is its place: those ranked below what is still needed are taken;
//   * a longer bin counts its last 10 bits instead, and its keys above K*, then the ties needed, are
//     placed after a second scan.
__device__ void finish_row(const TopkArgs& a, TopkShared& s, const Chunk& c, std::uint32_t top,
                           std::uint32_t above, std::uint32_t found, const uint2* listed) {
  const float* x = a.logits + static_cast<std::int64_t>(c.row) * a.max_len;
  std::int32_t* out = a.slots + static_cast<std::int64_t>(c.row) * a.k;
  const auto k = static_cast<std::uint32_t>(a.k);
  const bool cached = found <= kCandidates;
  const int count = static_cast<int>(min(found, static_cast<std::uint32_t>(kCandidates)));
  if (cached) {  // all loads in flight at once, then to shared memory
    constexpr int kPer = kCandidates / kThreads;
    uint2 mine[kPer];
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int i = e * kThreads + threadIdx.x;
      if (i < count) mine[e] = __ldcg(&listed[i]);
    }
#pragma unroll
    for (int e = 0; e < kPer; ++e) {
      const int i = e * kThreads + threadIdx.x;
      if (i < count) s.cands[i] = mine[e];
    }
  }
  // Calls f(key, slot) for every candidate, slot() giving its slot: from shared memory, or the row's
  // logits on overflow (the slot looked up only when f asks for it). A thread visits the same
  // candidates in the same order every time, so a count in one pass places its keys in the next.
  const auto for_each = [&](auto&& f) {
    if (cached) {
      for (int i = threadIdx.x; i < count; i += kThreads) {
        const uint2 cand = s.cands[i];
        f(cand.y, [&] { return static_cast<std::int32_t>(cand.x); });
      }
    } else {
      for (int t = threadIdx.x; t < c.n; t += kThreads) {
        const std::uint32_t key = order_key(x[t]);
        if (key >> kTopShift == top) f(key, [&] { return slot_of(a, c.b, t); });
      }
    }
  };
  const auto mid_of = [](std::uint32_t key) { return (key >> kLowBits) & (kMidBins - 1); };
  // Output positions are checked against k: they stay below it unless the row state was dirty.
  const auto put = [&](std::uint32_t at, std::int32_t slot) {
    if (at < k) out[at] = slot;
  };

  std::uint32_t need = k - above;
  for (int d = threadIdx.x; d < kMidBins; d += kThreads) s.hist[d] = 0;
  if (threadIdx.x == 0) s.in_bin = 0;
  __syncthreads();
  for_each([&](std::uint32_t key, auto) { atomicAdd(&s.hist[mid_of(key)], 1u); });
  __syncthreads();
  std::uint32_t mid, mid_above;
  find_threshold<kMidBins>(s.hist, need, s.scan, s.result, mid, mid_above);
  need -= mid_above;  // still to take from M's bin, placed from above + mid_above on

  // The candidates above M's bin, counted, then placed; the bin's keys listed (the first kShortBin)
  // over the histogram, free again.
  uint2* bin_list = reinterpret_cast<uint2*>(s.hist);
  std::uint32_t higher = 0;
  for_each([&](std::uint32_t key, auto slot) {
    const std::uint32_t digit = mid_of(key);
    if (digit > mid) {
      ++higher;
    } else if (digit == mid) {
      const std::uint32_t at = atomicAdd(&s.in_bin, 1u);
      if (at < kShortBin) bin_list[at] = make_uint2(static_cast<std::uint32_t>(slot()), key);
    }
  });
  __syncthreads();  // the list complete
  std::uint32_t at;
  Scan(s.scan).ExclusiveSum(higher, at);
  at += above;
  for_each([&](std::uint32_t key, auto slot) {
    if (mid_of(key) > mid) put(at++, slot());
  });
  const std::uint32_t base = above + mid_above;  // where M's bin's share starts
  const std::uint32_t in_bin = s.in_bin;
  if (in_bin <= kShortBin) {
    if (threadIdx.x < in_bin) {
      const uint2 mine = bin_list[threadIdx.x];
      std::uint32_t rank = 0;
      for (std::uint32_t i = 0; i < in_bin; ++i) {
        const std::uint32_t other = bin_list[i].y;
        rank += other > mine.y || (other == mine.y && i < threadIdx.x) ? 1u : 0u;
      }
      if (rank < need) put(base + rank, static_cast<std::int32_t>(mine.x));
    }
    return;
  }

  // A long bin: its low digits counted, then its keys above K* and the ties needed placed by a scan
  // of both counts (ties in the high word: masses of equal logits may hold more than 2^16).
  __syncthreads();  // every thread has read in_bin before the list's words become bins again
  for (int d = threadIdx.x; d < kLowBins; d += kThreads) s.hist[d] = 0;
  __syncthreads();
  for_each([&](std::uint32_t key, auto) {
    if (mid_of(key) == mid) atomicAdd(&s.hist[key & (kLowBins - 1)], 1u);
  });
  __syncthreads();
  std::uint32_t low, low_above;
  find_threshold<kLowBins>(s.hist, need, s.scan, s.result, low, low_above);
  const std::uint32_t ties = need - low_above;  // ties at K* to take
  const std::uint32_t kth = (top << kTopShift) | (mid << kLowBits) | low;
  unsigned long long counts = 0;
  for_each([&](std::uint32_t key, auto) {
    if (mid_of(key) == mid && key >= kth) counts += key > kth ? 1ull : 1ull << 32;
  });
  unsigned long long before;
  Scan64(s.scan64).ExclusiveSum(counts, before);
  std::uint32_t gt_at = base + static_cast<std::uint32_t>(before), tie = static_cast<std::uint32_t>(before >> 32);
  for_each([&](std::uint32_t key, auto slot) {
    if (mid_of(key) != mid || key < kth) return;
    if (key > kth) {
      put(gt_at++, slot());
    } else {
      if (tie < ties) put(base + low_above + tie, slot());
      ++tie;
    }
  });
}

// Two chained kernels, after a memset of the row states unless they came zeroed: the first counts
// the top digits, the kernel boundary stands for the grid barrier, and every CTA of the second finds
// the row's threshold itself from the whole histogram.
template <int kPer>
__global__ void __launch_bounds__(kThreads) topk_count_kernel(const TopkArgs a) {
  __shared__ TopkShared s;
  wait_for_previous_kernels();
  const Chunk c = chunk_of(a, blockIdx.x);
  float v[kPer];
  load_chunk(a, c, v);
  if (c.n <= a.k || c.base >= c.n) return;
  count_top_digits(c, v, s);
  allow_next_kernel();
  publish_top_digits(s, a.state + static_cast<std::int64_t>(c.row) * kStateWords);
}

// Three CTAs per SM from 8 keys per thread (the many-row grids): without the bound, ptxas gave kPer
// 16 118 registers (two CTAs); at it, kPer 8 and 16 spill a few words (the histogram loads kept in
// flight with the logits). Fewer keys serve few rows (grids of at most two CTAs per SM), and keep
// every load in registers. Where an SM has 100 KB of shared memory (sm_89, sm_120), two of these
// CTAs (42.3 KB each) are all it holds, and the cap asks for two (register_cap.cuh): at three, ptxas
// held sm_120a's kPer 16 to 80 registers and spilled 124 bytes.
template <int kPer>
__global__ void __launch_bounds__(kThreads, kPer >= 8 ? ctas_per_sm_cap(3, sizeof(TopkShared)) : 1)
    topk_select_kernel(const TopkArgs a) {
  __shared__ TopkShared s;
  wait_for_previous_kernels();
  allow_next_kernel();  // the next kernel's CTAs may queue behind the row finishers
  const Chunk c = chunk_of(a, blockIdx.x);
  std::uint32_t* state = a.state + static_cast<std::int64_t>(c.row) * kStateWords;
  uint2* listed = a.candidates + static_cast<std::int64_t>(c.row) * kCandidates;
  // The length, the logits, the table entries and the histogram: one round trip for all.
  float v[kPer];
  load_chunk(a, c, v);
  ChunkPages<kPer> pages;
  load_pages<kPer>(a, c, pages);
  RowHistogram counts;
  load_histogram(state, counts);
  if (c.n <= a.k) return take_all<kPer>(a, c);
  if (c.base >= c.n) return;
  std::uint32_t top, above;
  top_threshold(a, s, counts, top, above);
  const std::uint32_t mine = select_above(a, c, v, pages, top, s, state, listed);
  const std::uint32_t found = arrive_last_listing(state, (c.n + a.chunk_len - 1) / a.chunk_len, mine, s.found);
  if (found == UINT32_MAX) return;
  finish_row(a, s, c, top, above, found, listed);
}

// The same three phases in one cooperative kernel, for grids that fit on the GPU at once: two grid
// barriers (the row states zeroed; the histograms complete) instead of the memset and the kernel
// boundary, and the logits read once; only the second when the states came zeroed. Every CTA of a
// row computes the row's threshold itself from the row's histogram; the last of the row's CTAs to
// finish selecting finishes the row.
// At 64 registers (kPer 16, sm_90a) four CTAs fit per SM, so that B 64 x 32K (512 CTAs of 4096
// logits) is one resident grid; a cap by __launch_bounds__ makes ptxas spill, so it is left uncapped.
template <int kPer>
__global__ void __launch_bounds__(kThreads) topk_cooperative_kernel(const TopkArgs a) {
  __shared__ TopkShared s;
  cg::grid_group grid = cg::this_grid();
  wait_for_previous_kernels();
  const Chunk c = chunk_of(a, blockIdx.x);
  const bool select = c.n > a.k && c.base < c.n;
  std::uint32_t* state = a.state + static_cast<std::int64_t>(c.row) * kStateWords;
  uint2* listed = a.candidates + static_cast<std::int64_t>(c.row) * kCandidates;
  if (c.base == 0 && !a.cleared) {
    for (int w = threadIdx.x; w < kStateWords; w += kThreads) state[w] = 0;
  }
  float v[kPer];
  ChunkPages<kPer> pages;
  if constexpr (kPagesAhead<kPer>) {  // every load at once (registers to spare at these sizes)
    load_chunk(a, c, v);
    load_pages<kPer>(a, c, pages);
  } else if (select) {
    load_chunk(a, c, v);
  }
  if (select) count_top_digits(c, v, s);  // the chunk's own histogram while the row's state is being zeroed
  if (!a.cleared) grid.sync();  // the same answer in every CTA
  if (select) publish_top_digits(s, state);
  grid.sync();
  std::uint32_t top = 0, above = 0, mine = 0;
  if (select) {
    RowHistogram counts;
    load_histogram(state, counts);
    top_threshold(a, s, counts, top, above);
    mine = select_above(a, c, v, pages, top, s, state, listed);
  } else if (c.n <= a.k) {
    take_all<kPer>(a, c);
  }
  allow_next_kernel();  // what is left: one CTA per row finishing it
  // The row's last CTA to be done selecting finishes it: one atomic round trip, not a grid barrier.
  if (select) {
    const std::uint32_t found = arrive_last_listing(state, (c.n + a.chunk_len - 1) / a.chunk_len, mine, s.found);
    if (found != UINT32_MAX) finish_row(a, s, c, top, above, found, listed);
  }
}

std::int64_t rows_of(const TopkParams& p) { return p.logits.size(0) * p.logits.size(1); }
std::size_t state_bytes(const TopkParams& p) {
  return static_cast<std::size_t>(rows_of(p)) * kStateWords * sizeof(std::uint32_t);
}

// Whether a grid of `ctas` CTAs of the cooperative kernel is resident at once on this device (the
// condition for its grid barriers).
template <int kPer>
bool fits_at_once(std::int64_t ctas) {
  const DeviceLimits& device = current_device_limits("topk");
  const int per_sm = resident_ctas_per_sm(topk_cooperative_kernel<kPer>, kThreads, 0, "topk");
  return device.cooperative && ctas <= static_cast<std::int64_t>(device.multiprocessors) * per_sm;
}

// The grid of `rows` rows in chunks of kThreads x kPer logits: the cooperative kernel when its grid
// is resident at once, else the memset (unless cleared) and the two chained kernels; always the
// latter at 2 logits per thread, which the launch picks only for grids of at most one CTA per SM (a
// few long rows: one layer's decode at a small batch), where a kernel boundary costs less than a
// grid barrier. H200, glm5 B 1 x 32K: dsa_decode 23.6 us against 24.7, the top-k alone (memset and
// all) 9.6 us against 9.9.
template <int kPer>
void launch_with(TopkArgs a, std::int64_t rows, const TopkParams& p, cudaStream_t stream) {
  a.chunk_len = kThreads * kPer;
  a.chunks = a.max_len > 0 ? (a.max_len + a.chunk_len - 1) / a.chunk_len : 1;
  const std::int64_t ctas = rows * a.chunks;  // below 2^31: check_topk_call
  if constexpr (kPer > 2) {
    if (fits_at_once<kPer>(ctas)) {
      launch_chained("topk", topk_cooperative_kernel<kPer>, static_cast<unsigned>(ctas), kThreads, 0, stream, true, a);
      return;
    }
  }
  if (!a.cleared) LKV_CUDA_CHECK("topk", cudaMemsetAsync(p.workspace, 0, state_bytes(p), stream));
  launch_chained("topk", topk_count_kernel<kPer>, static_cast<unsigned>(ctas), kThreads, 0, stream, false, a);
  launch_chained("topk", topk_select_kernel<kPer>, static_cast<unsigned>(ctas), kThreads, 0, stream, false, a);
}

// The logits per thread (kPer: the rule at kMaxCtasPerSm) of a call of `rows` rows of up to `max_len`
// logits on `sms` SMs, and its grid's CTAs.
struct Grid {
  int per;
  std::int64_t ctas;
};
Grid grid_for(std::int64_t rows, std::int64_t max_len, int sms) {
  const auto ctas_with = [&](int per) {
    const std::int64_t chunk = kThreads * per;
    return rows * (max_len > 0 ? (max_len + chunk - 1) / chunk : 1);
  };
  const std::int64_t most = static_cast<std::int64_t>(kMaxCtasPerSm) * sms;
  for (const int per : {2, 4, 8}) {
    if (ctas_with(per) <= (per == 2 ? sms : most)) return {per, ctas_with(per)};
  }
  return {16, ctas_with(16)};
}

}  // namespace

Plan plan_topk(const TopkParams& p) {
  // Each row's state and candidate list; rows whose workspace has no 64-bit size (logits of no
  // columns pass the view checks at any row count) are refused rather than planned wrapped.
  constexpr std::size_t kRowBytes = kStateWords * sizeof(std::uint32_t) + kCandidates * sizeof(uint2);
  if (static_cast<std::uint64_t>(rows_of(p)) > std::numeric_limits<std::size_t>::max() / kRowBytes) {
    throw Error("topk", "logits", p.logits.shape_string(),
                "fewer rows (B x q_len) than 2^64 bytes of workspace hold at " + std::to_string(kRowBytes) + " a row");
  }
  Plan plan;
  plan.workspace_bytes = state_bytes(p) + static_cast<std::size_t>(rows_of(p)) * kCandidates * sizeof(uint2);
  plan.cleared_bytes = state_bytes(p);  // the row states, at the start
  return plan;
}

void check_topk_call(const TopkParams& p) {
  const std::size_t need = plan_topk(p).workspace_bytes;
  if (p.workspace == nullptr && need > 0) {  // no rows need none
    throw Error("topk", "workspace", "null", std::to_string(need) + " bytes (Backend::plan)");
  }
  if (p.workspace_bytes < need) {
    throw Error("topk", "workspace_bytes", std::to_string(p.workspace_bytes),
                ">= " + std::to_string(need) + " (Backend::plan for these shapes)");
  }
  check_aligned("topk", "workspace", p.workspace, 16);
  check_fault_record(p.fault, "topk");
  const std::int64_t rows = rows_of(p);
  if (rows == 0) return;
  const Grid grid = grid_for(rows, p.logits.size(2), current_device_limits("topk").multiprocessors);
  if (grid.ctas > INT32_MAX) {
    throw Error("topk", "logits", p.logits.shape_string(),
                "fewer than 2^31 chunks of " + std::to_string(kThreads * grid.per) + " logits");
  }
}

void launch_topk(const TopkParams& p, cudaStream_t stream) {
  check_topk_call(p);
  if (p.fault != nullptr) {  // the reference's checks of the lengths, pages and logits, a kernel of their own
    PagingCheck check = paging_check_of(p.block_table, p.seq_lens, p.page_size, INT32_MAX / p.page_size,
                                        p.logits.size(2), FaultSink{p.fault, DeviceFaultOp::kTopk});
    check.logits = p.logits.as<const float>();
    check.q_len = static_cast<int>(p.logits.size(1));
    launch_paging_check(check, stream, "topk");
  }
  const std::int64_t rows = rows_of(p);
  if (rows == 0) return;
  TopkArgs a{};
  a.logits = p.logits.as<const float>();
  a.block_table = p.block_table.as<const std::int32_t>();
  a.seq_lens = p.seq_lens.as<const std::int32_t>();
  a.slots = p.slots.as<std::int32_t>();
  a.state = static_cast<std::uint32_t*>(p.workspace);
  a.candidates = reinterpret_cast<uint2*>(static_cast<std::uint8_t*>(p.workspace) + state_bytes(p));
  a.max_len = static_cast<int>(p.logits.size(2));
  a.max_pages = static_cast<int>(p.block_table.size(1));
  a.page_size = p.page_size;
  a.capacity = static_cast<std::int64_t>(a.max_pages) * a.page_size;
  a.q_len = static_cast<int>(p.logits.size(1));
  a.k = p.k;
  a.cleared = p.workspace_cleared;
  a.page_bound = INT32_MAX / a.page_size;
  switch (grid_for(rows, a.max_len, current_device_limits("topk").multiprocessors).per) {
    case 2: return launch_with<2>(a, rows, p, stream);
    case 4: return launch_with<4>(a, rows, p, stream);
    case 8: return launch_with<8>(a, rows, p, stream);
    default: return launch_with<16>(a, rows, p, stream);
  }
}

}  // namespace latentkv::cuda
