// tests/support/paged_fixture.hpp - paged caches filled the way a server fills them.
//
// make_paged_fixture() builds, on the host:
//  * a PageAllocator over `num_pages` pages whose order is shuffled (block tables are never in order)
//    and whose requests grow in interleaved chunks, so consecutive pages of a request are scattered;
//  * the main cache and the indexer cache as byte buffers, every slot first poisoned with NaN
//    (fp8 codes 0x7F, scales NaN, rope bf16 NaN; bf16 caches all NaN; indexer codes 0x7F and NaN
//    scales), then the requests' tokens appended with cpu::append into their slots only - so a
//    kernel that reads a slot it must not read produces NaN;
//  * the block table matrix [B, max_pages] padded with -1 (with spare -1 columns), and seq_lens;
//  * the bf16 values that were appended, for tests that need the unquantized inputs.
//
// unread_slots_poisoned() checks that every slot no request holds still holds the poison.
//
// GPU tests copy cache_bytes / indexer_bytes / block_table / seq_lens to the device and build the
// descriptors with cache(device_pointer, Device::cuda()) and friends.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <thread>
#include <vector>

#include "cpu/reference.hpp"
#include "latentkv/cache.hpp"
#include "latentkv/fp8.hpp"
#include "latentkv/paging.hpp"
#include "support/host_tensor.hpp"
#include "support/rng.hpp"

namespace latentkv::testing {

inline constexpr std::uint8_t kPoisonFp8 = 0x7F;      // fp8 e4m3fn NaN
inline constexpr std::uint16_t kPoisonBf16 = 0x7FC1;  // a bf16 quiet NaN
inline constexpr std::uint32_t kPoisonF32Bits = 0x7FC00BADu;

// Fills a token's values: latent576 gets 512 latent then 64 rope bf16 values, key128 the 128
// indexer key bf16 values (already rotated).
using TokenValuesFn = std::function<void(std::int64_t request, std::int64_t position,
                                         std::uint16_t* latent576, std::uint16_t* key128)>;

struct PagedFixtureOptions {
  int page_size = kDefaultPageSize;
  std::vector<std::int64_t> lengths;      // tokens per request (B = lengths.size()); 0 allowed
  std::int64_t num_pages = 0;             // 0: the pages the lengths need plus spare_pages
  std::int64_t spare_pages = 3;           // never handed out: stay poisoned
  int spare_columns = 1;                  // extra -1 columns of the block table
  KvDtype kv_dtype = KvDtype::kFp8E4M3;
  bool with_indexer = true;
  ScaleMode scale_mode = ScaleMode::kPow2;
  std::uint64_t shuffle_seed = 0;         // 0: drawn from the Rng (never unshuffled)
  double latent_stddev = 1.0;             // random values: N(0, stddev^2) per element, and each
  double rope_stddev = 1.0;               //   128-block of the latent gets its own magnitude so the
  double key_stddev = 1.0;                //   four scales of a token differ
  TokenValuesFn token_values;             // when set, replaces the random values
};

struct PagedFixture {
  PagedFixture(std::int64_t num_pages, int page_size, std::uint64_t shuffle_seed)
      : allocator(num_pages, page_size, shuffle_seed) {}

  PageAllocator allocator;
  std::vector<RequestId> requests;       // [B]
  int page_size = kDefaultPageSize;
  int max_pages = 0;                     // block-table columns
  KvDtype kv_dtype = KvDtype::kFp8E4M3;
  std::vector<std::uint8_t> cache_bytes;    // [num_pages, page_size, token_bytes]
  std::vector<std::uint8_t> indexer_bytes;  // [num_pages, page_size * 132]; empty without an indexer
  std::vector<std::int32_t> block_table;    // [B, max_pages], -1 padded
  std::vector<std::int32_t> seq_lens;       // [B]
  std::vector<std::uint16_t> latents;       // [total tokens, 576] bf16 appended, request after request
  std::vector<std::uint16_t> keys;          // [total tokens, 128] bf16 appended
  std::vector<std::int64_t> first_token;    // [B + 1] row of request b's position 0 in latents / keys

  std::int64_t batch() const { return static_cast<std::int64_t>(requests.size()); }
  std::int64_t num_pages() const { return allocator.num_pages(); }
  std::int64_t max_len() const {
    std::int64_t m = 0;
    for (std::int32_t l : seq_lens) m = std::max<std::int64_t>(m, l);
    return m;
  }
  std::int64_t slot(std::int64_t b, std::int64_t position) const {
    return allocator.slot(requests[static_cast<std::size_t>(b)], position);
  }
  // The slots of request b's positions 0 .. count-1.
  std::vector<std::int32_t> slots(std::int64_t b, std::int64_t count) const {
    std::vector<std::int32_t> s;
    for (std::int64_t t = 0; t < count; ++t) s.push_back(static_cast<std::int32_t>(slot(b, t)));
    return s;
  }
  const std::uint16_t* latent_of(std::int64_t b, std::int64_t position) const {  // [576] bf16
    return latents.data() + (first_token[static_cast<std::size_t>(b)] + position) * kQkDim;
  }
  const std::uint16_t* key_of(std::int64_t b, std::int64_t position) const {  // [128] bf16
    return keys.data() + (first_token[static_cast<std::size_t>(b)] + position) * kIndexerDim;
  }

  // Descriptors over the host buffers, or over device copies of them.
  LatentCache cache() { return cache(cache_bytes.data(), Device::cpu()); }
  LatentCache cache(std::uint8_t* data, Device device) const {
    LatentCache c;
    c.data = data;
    c.dtype = kv_dtype;
    c.num_pages = num_pages();
    c.page_size = page_size;
    c.device = device;
    return c;
  }
  IndexerCache indexer() { return indexer(indexer_bytes.data(), Device::cpu()); }
  IndexerCache indexer(std::uint8_t* data, Device device) const {
    IndexerCache c;
    c.data = data;
    c.num_pages = num_pages();
    c.page_size = page_size;
    c.device = device;
    return c;
  }
  TensorView block_table_view() { return block_table_view(block_table.data(), Device::cpu()); }
  TensorView block_table_view(std::int32_t* data, Device device) const {
    return TensorView::contiguous(data, DType::kI32, {batch(), max_pages}, device);
  }
  TensorView seq_lens_view() { return seq_lens_view(seq_lens.data(), Device::cpu()); }
  TensorView seq_lens_view(std::int32_t* data, Device device) const {
    return TensorView::contiguous(data, DType::kI32, {batch()}, device);
  }
};

// Poisons one main-cache entry `t` (see the file comment).
inline void poison_latent_token(std::uint8_t* t, KvDtype dtype) {
  if (dtype == KvDtype::kBf16) {
    for (int j = 0; j < kQkDim; ++j) std::memcpy(t + 2 * j, &kPoisonBf16, 2);
  } else {
    std::memset(t, kPoisonFp8, kLatentDim);
    for (int s = 0; s < kFp8ScalesPerToken; ++s) std::memcpy(t + kFp8ScaleOffset + 4 * s, &kPoisonF32Bits, 4);
    for (int j = 0; j < kRopeDim; ++j) std::memcpy(t + kFp8RopeOffset + 2 * j, &kPoisonBf16, 2);
  }
}

// Poisons every slot of a main cache.
inline void poison_latent_cache(std::vector<std::uint8_t>& bytes, KvDtype dtype) {
  const std::size_t token_bytes = kv_token_bytes(dtype);
  for (std::size_t base = 0; base + token_bytes <= bytes.size(); base += token_bytes) {
    poison_latent_token(bytes.data() + base, dtype);
  }
}

// Poisons every main-cache slot of `f` that no entry of `indices` (int32 slots or -1, any shape)
// lists: a sparse op reads only its rows' slots, and one that read another slot a request holds
// would otherwise find a plausible value there and might still pass. Returns how many it poisoned.
inline std::int64_t poison_unlisted_slots(PagedFixture& f, const HostTensor& indices) {
  const std::size_t token_bytes = kv_token_bytes(f.kv_dtype);
  const std::size_t num_slots = f.cache_bytes.size() / token_bytes;
  std::vector<bool> listed(num_slots, false);
  const auto* idx = indices.data<std::int32_t>();
  for (std::int64_t i = 0; i < indices.numel(); ++i) {
    if (idx[i] >= 0 && static_cast<std::size_t>(idx[i]) < num_slots) listed[static_cast<std::size_t>(idx[i])] = true;
  }
  std::int64_t poisoned = 0;
  for (std::size_t s = 0; s < num_slots; ++s) {
    if (listed[s]) continue;
    poison_latent_token(f.cache_bytes.data() + s * token_bytes, f.kv_dtype);
    ++poisoned;
  }
  return poisoned;
}

// Poisons every slot of an indexer cache: fp8 codes 0x7F, scales NaN.
inline void poison_indexer_cache(std::vector<std::uint8_t>& bytes, int page_size) {
  const std::size_t page_bytes = static_cast<std::size_t>(page_size) * kIndexerTokenBytes;
  for (std::size_t page = 0; page + page_bytes <= bytes.size(); page += page_bytes) {
    std::memset(bytes.data() + page, kPoisonFp8, static_cast<std::size_t>(page_size) * kIndexerDim);
    for (int o = 0; o < page_size; ++o) {
      std::memcpy(bytes.data() + page + static_cast<std::size_t>(page_size) * kIndexerDim + 4 * o, &kPoisonF32Bits, 4);
    }
  }
}

// Random values of one token: each 128-block of the latent with its own magnitude (so the four
// scales differ), rope and key from N(0, stddev^2).
inline void random_token_values(Rng& rng, const PagedFixtureOptions& o, std::uint16_t* latent576,
                                std::uint16_t* key128) {
  for (int blk = 0; blk < kFp8ScalesPerToken; ++blk) {
    const double magnitude = o.latent_stddev * std::exp2(rng.uniform(-3.0, 3.0));
    for (int j = 0; j < kFp8ScaleBlock; ++j) {
      latent576[blk * kFp8ScaleBlock + j] = bf16_encode(static_cast<float>(rng.normal(0.0, magnitude)));
    }
  }
  for (int j = 0; j < kRopeDim; ++j) latent576[kLatentDim + j] = bf16_encode(static_cast<float>(rng.normal(0.0, o.rope_stddev)));
  for (int j = 0; j < kIndexerDim; ++j) key128[j] = bf16_encode(static_cast<float>(rng.normal(0.0, o.key_stddev)));
}

// work(w) for w = 0 .. workers - 1 at once, worker 0 on the calling thread and each other on a thread
// of its own; returns when all are done. `work` keeps its own errors (it must not throw).
inline void on_threads(std::size_t workers, const std::function<void(std::size_t)>& work) {
  std::vector<std::thread> pool;
  for (std::size_t w = 1; w < workers; ++w) pool.emplace_back(work, w);
  work(0);
  for (std::thread& t : pool) t.join();
}

// The generator's draws random_token_values takes per token: one per block's magnitude, two per
// normal value.
inline constexpr std::uint64_t kDrawsPerRandomToken = kFp8ScalesPerToken + 2 * (kQkDim + kIndexerDim);

// random_token_values of `count` tokens back to back (latents [count, 576], keys [count, 128]), on up
// to `threads` threads: each thread draws its tokens from a copy of the generator skipped ahead to
// where one loop over all of them would draw them, so the values, and the generator after, are the
// same for any thread count. (A million tokens' values take tens of seconds on one core.)
inline void random_tokens(Rng& rng, const PagedFixtureOptions& o, std::int64_t count, std::uint16_t* latents,
                          std::uint16_t* keys, unsigned threads) {
  constexpr std::int64_t kLeastTokensPerThread = 8192;
  const std::int64_t workers = std::clamp<std::int64_t>(count / kLeastTokensPerThread, 1, std::max(1u, threads));
  on_threads(static_cast<std::size_t>(workers), [&](std::size_t w) {  // worker w: an even share, in order
    const std::int64_t first = count * static_cast<std::int64_t>(w) / workers;
    const std::int64_t last = count * static_cast<std::int64_t>(w + 1) / workers;
    Rng r = rng;
    r.discard(static_cast<std::uint64_t>(first) * kDrawsPerRandomToken);
    for (std::int64_t t = first; t < last; ++t) random_token_values(r, o, latents + t * kQkDim, keys + t * kIndexerDim);
  });
  rng.discard(static_cast<std::uint64_t>(count) * kDrawsPerRandomToken);
}

// Every slot of the pool that no request holds (past seq_lens in a request's last page, and pages no
// request uses) still holds the poison, in the main cache and in the indexer cache (each where the
// fixture has one), and there is at least one such slot.
inline ::testing::AssertionResult unread_slots_poisoned(const PagedFixture& f) {
  const std::int64_t num_slots = f.num_pages() * f.page_size;
  std::vector<char> held(static_cast<std::size_t>(num_slots), 0);
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    for (std::int32_t s : f.slots(b, f.seq_lens[static_cast<std::size_t>(b)])) held[static_cast<std::size_t>(s)] = 1;
  }
  const std::size_t token_bytes = kv_token_bytes(f.kv_dtype);
  std::vector<std::uint8_t> poisoned_token(token_bytes);  // [token_bytes] one poisoned main-cache token
  poison_latent_cache(poisoned_token, f.kv_dtype);
  const IndexerCache indexer = f.indexer(const_cast<std::uint8_t*>(f.indexer_bytes.data()), Device::cpu());
  std::int64_t poisoned = 0;
  for (std::int64_t s = 0; s < num_slots; ++s) {
    if (held[static_cast<std::size_t>(s)]) continue;
    if (!f.cache_bytes.empty() &&
        !std::equal(poisoned_token.begin(), poisoned_token.end(), f.cache_bytes.begin() + s * token_bytes)) {
      return ::testing::AssertionFailure() << "main-cache slot " << s << " is held by no request but not poisoned";
    }
    if (!f.indexer_bytes.empty()) {
      const std::uint8_t* key = indexer.key(s);
      std::uint32_t scale_bits = 0;
      std::memcpy(&scale_bits, indexer.scale_ptr(s), 4);
      if (std::any_of(key, key + kIndexerDim, [](std::uint8_t c) { return c != kPoisonFp8; }) ||
          scale_bits != kPoisonF32Bits) {
        return ::testing::AssertionFailure() << "indexer slot " << s << " is held by no request but not poisoned";
      }
    }
    ++poisoned;
  }
  if (poisoned == 0) return ::testing::AssertionFailure() << "no poisoned slot in the pool";
  return ::testing::AssertionSuccess() << poisoned << " poisoned slots";
}

// Pools past 2 GiB, whose slots past the mark have byte offsets that do not fit 32 bits:
// pages_past_2gib() sizes a pool at 1.5 x 2^31 bytes, a third of its pages past the mark, so that a
// batch holding a hundred pages or more holds some there all but surely (its test checks that it
// does, with highest_held_offset or highest_listed_offset).
inline constexpr std::int64_t kTwoGiB = std::int64_t{1} << 31;
inline std::int64_t pages_past_2gib(int page_size, KvDtype dtype) {
  const std::int64_t slots = 3 * (kTwoGiB / 2) / static_cast<std::int64_t>(kv_token_bytes(dtype)) + 1;
  return (slots + page_size - 1) / page_size;
}

// The main-cache byte offset of the highest slot a request of `f` holds; -1 when none holds any.
inline std::int64_t highest_held_offset(const PagedFixture& f) {
  std::int64_t most = -1;
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    for (std::int64_t t = 0; t < f.seq_lens[static_cast<std::size_t>(b)]; ++t) most = std::max(most, f.slot(b, t));
  }
  return most < 0 ? -1 : most * static_cast<std::int64_t>(kv_token_bytes(f.kv_dtype));
}

// The main-cache byte offset of the highest slot `indices` (int32 slots or -1, any shape) lists; -1
// when it lists none.
inline std::int64_t highest_listed_offset(const PagedFixture& f, const HostTensor& indices) {
  const auto* idx = indices.data<std::int32_t>();
  const std::int32_t most = indices.numel() > 0 ? *std::max_element(idx, idx + indices.numel()) : -1;
  return most < 0 ? -1 : std::int64_t{most} * static_cast<std::int64_t>(kv_token_bytes(f.kv_dtype));
}

inline PagedFixture make_paged_fixture(const PagedFixtureOptions& o, Rng& rng) {
  const std::int64_t batch = static_cast<std::int64_t>(o.lengths.size());
  std::int64_t needed = 0, most_pages = 0;
  for (std::int64_t len : o.lengths) {
    const std::int64_t pages = (len + o.page_size - 1) / o.page_size;
    needed += pages;
    most_pages = std::max(most_pages, pages);
  }
  const std::int64_t num_pages = o.num_pages > 0 ? o.num_pages : std::max<std::int64_t>(1, needed + o.spare_pages);
  PagedFixture f(num_pages, o.page_size, o.shuffle_seed != 0 ? o.shuffle_seed : rng.fork_seed());
  f.page_size = o.page_size;
  f.kv_dtype = o.kv_dtype;
  f.max_pages = static_cast<int>(most_pages + o.spare_columns);
  for (std::int64_t b = 0; b < batch; ++b) f.requests.push_back(f.allocator.add_request());

  // Grow the requests in interleaved chunks, as a server does step after step.
  std::vector<std::int64_t> grown(static_cast<std::size_t>(batch), 0);
  for (bool more = true; more;) {
    more = false;
    for (std::int64_t b = 0; b < batch; ++b) {
      const auto bi = static_cast<std::size_t>(b);
      const std::int64_t left = o.lengths[bi] - grown[bi];
      if (left <= 0) continue;
      const std::int64_t chunk = std::min(left, rng.uniform_int(1, 2 * o.page_size));
      f.allocator.grow(f.requests[bi], chunk);
      grown[bi] += chunk;
      more = true;
    }
  }

  f.cache_bytes.assign(static_cast<std::size_t>(num_pages * o.page_size) * kv_token_bytes(o.kv_dtype), 0);
  poison_latent_cache(f.cache_bytes, o.kv_dtype);
  if (o.with_indexer) {
    f.indexer_bytes.assign(static_cast<std::size_t>(num_pages * o.page_size) * kIndexerTokenBytes, 0);
    poison_indexer_cache(f.indexer_bytes, o.page_size);
  }

  // The tokens' values, then one append per request over its slots.
  f.first_token.push_back(0);
  for (std::int64_t len : o.lengths) f.first_token.push_back(f.first_token.back() + len);
  const std::int64_t total = f.first_token.back();
  f.latents.assign(static_cast<std::size_t>(total * kQkDim), 0);
  f.keys.assign(static_cast<std::size_t>(total * kIndexerDim), 0);
  const unsigned threads = std::max(1u, std::thread::hardware_concurrency());
  if (o.token_values) {
    for (std::int64_t b = 0; b < batch; ++b) {
      for (std::int64_t t = 0; t < o.lengths[static_cast<std::size_t>(b)]; ++t) {
        const std::int64_t row = f.first_token[static_cast<std::size_t>(b)] + t;
        o.token_values(b, t, f.latents.data() + row * kQkDim, f.keys.data() + row * kIndexerDim);
      }
    }
  } else {
    random_tokens(rng, o, total, f.latents.data(), f.keys.data(), threads);
  }
  // The requests' appends write disjoint slots and pages: up to `threads` at once.
  std::vector<AppendParams> appends;
  std::vector<std::vector<std::int32_t>> slots;  // each request's, read by its AppendParams
  slots.reserve(static_cast<std::size_t>(batch));
  for (std::int64_t b = 0; b < batch; ++b) {
    const auto bi = static_cast<std::size_t>(b);
    const std::int64_t n = o.lengths[bi];
    if (n == 0) continue;
    slots.push_back(f.slots(b, n));
    AppendParams p;
    p.cache = f.cache();
    p.latent = TensorView::contiguous(f.latents.data() + f.first_token[bi] * kQkDim, DType::kBF16, {n, kQkDim});
    p.slots = TensorView::contiguous(slots.back().data(), DType::kI32, {n});
    if (o.with_indexer) {
      p.indexer = f.indexer();
      p.indexer_keys = TensorView::contiguous(f.keys.data() + f.first_token[bi] * kIndexerDim, DType::kBF16, {n, kIndexerDim});
    }
    p.scale_mode = o.scale_mode;
    appends.push_back(p);
  }
  std::atomic<std::size_t> next{0};  // the requests' lengths differ: each worker takes the next one
  std::vector<std::exception_ptr> errors(appends.size());
  on_threads(std::min<std::size_t>(threads, appends.size()), [&](std::size_t) {
    for (std::size_t i = next++; i < appends.size(); i = next++) {
      try {
        cpu::append(appends[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    }
  });
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }

  f.block_table = f.allocator.block_table_matrix(f.requests, f.max_pages);
  f.seq_lens = f.allocator.lengths(f.requests);
  return f;
}

// The fp8 cache `f` as the cast baselines turn it into a bf16 one: every value fp8 x scale in
// float32, rounded to bf16 (the rope dims as stored). The reference over it is what those baselines
// compute; with scales that are no powers of two it differs from the fp8 reference by that rounding.
inline PagedFixture cast_to_bf16(const PagedFixture& f) {
  if (f.kv_dtype != KvDtype::kFp8E4M3) throw std::invalid_argument("cast_to_bf16: the fixture's cache is not fp8");
  PagedFixture c = f;
  c.kv_dtype = KvDtype::kBf16;
  const std::int64_t slots = f.num_pages() * f.page_size;
  c.cache_bytes.assign(static_cast<std::size_t>(slots) * kBf16TokenBytes, 0);
  for (std::int64_t s = 0; s < slots; ++s) {
    const std::uint8_t* src = f.cache_bytes.data() + s * static_cast<std::int64_t>(kFp8TokenBytes);
    std::uint8_t* dst = c.cache_bytes.data() + s * static_cast<std::int64_t>(kBf16TokenBytes);
    float scales[kFp8ScalesPerToken];
    std::memcpy(scales, src + kFp8ScaleOffset, sizeof scales);
    for (int j = 0; j < kLatentDim; ++j) {
      const std::uint16_t bits = bf16_encode(fp8_e4m3_decode(src[j]) * scales[j / kFp8ScaleBlock]);
      std::memcpy(dst + 2 * j, &bits, sizeof bits);
    }
    std::memcpy(dst + 2 * kLatentDim, src + kFp8RopeOffset, 2 * kRopeDim);
  }
  return c;
}

// What a `backend`'s output over `f` is checked against, where that is not `f` itself: a cast
// baseline (any backend but cuda) on scales that are no powers of two attends over the bf16 cast.
inline std::optional<PagedFixture> cast_seen_by(std::string_view backend, ScaleMode scale_mode, const PagedFixture& f) {
  if (backend == "cuda" || scale_mode != ScaleMode::kExact) return std::nullopt;
  return cast_to_bf16(f);
}

}  // namespace latentkv::testing
