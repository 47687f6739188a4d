// append and the byte layouts of SPEC section 3, checked against hand-computed bytes.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/reference.hpp"
#include "latentkv/cache.hpp"
#include "latentkv/fp8.hpp"
#include "support/paged_fixture.hpp"

namespace latentkv::testing {
namespace {

// One token's 576 bf16 values and its 128 indexer key values, chosen so every code and scale can
// be worked out by hand (pow2 scales):
//   block 0: amax 448      -> scale 1      = 0x3F800000; 448 -> 0x7E, 1 -> 0x38, -2 -> 0xC0, 3 -> 0x44, 1.125 -> 0x39
//   block 1: amax 1        -> scale 2^-8   = 0x3B800000; 1 -> 256 -> 0x78, 0.5 -> 128 -> 0x70,
//                                            -0.25 -> -64 -> 0xE8, bf16(0.3) = 0.30078125 -> 77 -> 80 -> 0x6A
//   block 2: all zero      -> amax clamped to 1e-4 -> scale 2^-22 = 0x34800000; codes 0x00
//   block 3: amax 6, at the block's last element -> scale 2^-6 = 0x3C800000; 3 -> 192 -> 0x74,
//            -1 -> -64 -> 0xE8, -6 -> -384 -> 0xFC
//   rope j: bf16 bits 0x3F80 + j (1.0, 1.0078125, ...)
// The amax of block 3 and of the indexer key sits at their last element, so that an amax that
// skipped it would show in the scale.
struct GoldenToken {
  std::vector<std::uint16_t> latent = std::vector<std::uint16_t>(kQkDim, 0);  // [576] bf16
  std::vector<std::uint16_t> key = std::vector<std::uint16_t>(kIndexerDim, 0);  // [128] bf16

  GoldenToken() {
    auto set = [&](int j, float v) { latent[static_cast<std::size_t>(j)] = bf16_encode(v); };
    set(0, 448.0f), set(1, 1.0f), set(2, -2.0f), set(3, 3.0f), set(127, 1.125f);
    set(128, 1.0f), set(129, 0.5f), set(130, -0.25f), set(255, 0.3f);
    set(384, 3.0f), set(385, -1.0f), set(511, -6.0f);
    for (int j = 0; j < kRopeDim; ++j) latent[static_cast<std::size_t>(kLatentDim + j)] = static_cast<std::uint16_t>(0x3F80 + j);
    // Indexer key: amax 4 -> scale 2^ceil(log2(4/448)) = 2^-6 = 0x3C800000; 2 -> 128 -> 0x70,
    // -0.5 -> -32 -> 0xE0, -4 -> -256 -> 0xF8.
    key[0] = bf16_encode(2.0f);
    key[1] = bf16_encode(-0.5f);
    key[127] = bf16_encode(-4.0f);
  }
};

std::vector<std::uint8_t> le32(std::uint32_t bits) {
  return {static_cast<std::uint8_t>(bits), static_cast<std::uint8_t>(bits >> 8), static_cast<std::uint8_t>(bits >> 16),
          static_cast<std::uint8_t>(bits >> 24)};
}

struct Pool {
  int page_size;
  std::int64_t num_pages;
  KvDtype dtype;
  std::vector<std::uint8_t> cache;    // [num_pages, page_size, token_bytes]
  std::vector<std::uint8_t> indexer;  // [num_pages, page_size * 132]

  Pool(int ps, std::int64_t pages, KvDtype d) : page_size(ps), num_pages(pages), dtype(d) {
    cache.assign(static_cast<std::size_t>(pages * ps) * kv_token_bytes(d), 0);
    indexer.assign(static_cast<std::size_t>(pages * ps) * kIndexerTokenBytes, 0);
    poison_latent_cache(cache, d);
    poison_indexer_cache(indexer, ps);
  }
  LatentCache latent_cache() {
    LatentCache c;
    c.data = cache.data();
    c.dtype = dtype;
    c.num_pages = num_pages;
    c.page_size = page_size;
    return c;
  }
  IndexerCache indexer_cache() {
    IndexerCache c;
    c.data = indexer.data();
    c.num_pages = num_pages;
    c.page_size = page_size;
    return c;
  }
  void append(std::vector<std::uint16_t>& latent, std::vector<std::uint16_t>& keys, std::vector<std::int32_t>& slots,
              ScaleMode mode = ScaleMode::kPow2) {
    AppendParams p;
    const auto n = static_cast<std::int64_t>(slots.size());
    p.cache = latent_cache();
    p.latent = TensorView::contiguous(latent.data(), DType::kBF16, {n, kQkDim});
    p.slots = TensorView::contiguous(slots.data(), DType::kI32, {n});
    p.indexer = indexer_cache();
    p.indexer_keys = TensorView::contiguous(keys.data(), DType::kBF16, {n, kIndexerDim});
    p.scale_mode = mode;
    cpu::append(p);
  }
};

// Bytes of `after` that differ from `before` lie in [lo, hi) only.
::testing::AssertionResult only_changed_in(const std::vector<std::uint8_t>& before, const std::vector<std::uint8_t>& after,
                                           std::vector<std::pair<std::size_t, std::size_t>> ranges) {
  for (std::size_t i = 0; i < before.size(); ++i) {
    bool inside = false;
    for (auto [lo, hi] : ranges) inside |= i >= lo && i < hi;
    if (!inside && before[i] != after[i]) return ::testing::AssertionFailure() << "byte " << i << " changed";
  }
  return ::testing::AssertionSuccess();
}

// A pool's slot count is num_pages x page_size, or INT64_MAX where that product would wrap (a
// descriptor every op refuses, which must not read as a small or negative pool on the way).
TEST(CacheLayout, SlotCountsDoNotWrap) {
  LatentCache latent;
  latent.num_pages = 1000;
  latent.page_size = 64;
  IndexerCache indexer;
  indexer.num_pages = 1000;
  indexer.page_size = 64;
  EXPECT_EQ(latent.num_slots(), 64000);
  EXPECT_EQ(indexer.num_slots(), 64000);
  latent.num_pages = indexer.num_pages = INT64_MAX / 32;
  EXPECT_EQ(latent.num_slots(), INT64_MAX);
  EXPECT_EQ(indexer.num_slots(), INT64_MAX);
  EXPECT_EQ(pool_slots(INT64_MAX / 64, 64), INT64_MAX / 64 * 64);
}

TEST(CacheLayout, Fp8TokenGoldenBytes) {
  Pool pool(4, 3, KvDtype::kFp8E4M3);  // slot 5 = page 1, offset 1: bytes 5 * 656 = 3280 .. 3936
  const std::vector<std::uint8_t> cache_before = pool.cache, indexer_before = pool.indexer;
  GoldenToken g;
  std::vector<std::int32_t> slots = {5};
  pool.append(g.latent, g.key, slots);

  const std::uint8_t* t = pool.cache.data() + 3280;
  const std::pair<int, int> codes[] = {{0, 0x7E},   {1, 0x38},   {2, 0xC0},   {3, 0x44},   {4, 0x00},   {127, 0x39},
                                       {128, 0x78}, {129, 0x70}, {130, 0xE8}, {255, 0x6A}, {131, 0x00}, {256, 0x00},
                                       {300, 0x00}, {383, 0x00}, {384, 0x74}, {385, 0xE8}, {511, 0xFC}};
  for (auto [j, code] : codes) EXPECT_EQ(t[j], code) << "latent byte " << j;
  const std::uint32_t scales[] = {0x3F800000u, 0x3B800000u, 0x34800000u, 0x3C800000u};
  for (int s = 0; s < 4; ++s) {
    const std::vector<std::uint8_t> want = le32(scales[s]);
    for (int k = 0; k < 4; ++k) EXPECT_EQ(t[512 + 4 * s + k], want[static_cast<std::size_t>(k)]) << "scale " << s << " byte " << k;
  }
  for (int j = 0; j < kRopeDim; ++j) {
    EXPECT_EQ(t[528 + 2 * j], static_cast<std::uint8_t>(0x80 + j)) << "rope " << j << " low byte";
    EXPECT_EQ(t[529 + 2 * j], 0x3F) << "rope " << j << " high byte";
  }
  EXPECT_TRUE(only_changed_in(cache_before, pool.cache, {{3280, 3280 + 656}}));

  // The indexer key, page-major: page 1 starts at 1 * 4 * 132 = 528; the key of offset 1 at
  // 528 + 1 * 128 = 656, its scale at 528 + 4 * 128 + 1 * 4 = 1044.
  const std::uint8_t* key = pool.indexer.data() + 656;
  EXPECT_EQ(key[0], 0x70);
  EXPECT_EQ(key[1], 0xE0);
  EXPECT_EQ(key[2], 0x00);
  EXPECT_EQ(key[127], 0xF8);
  const std::vector<std::uint8_t> key_scale = le32(0x3C800000u);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(pool.indexer[1044 + static_cast<std::size_t>(k)], key_scale[static_cast<std::size_t>(k)]);
  EXPECT_TRUE(only_changed_in(indexer_before, pool.indexer, {{656, 656 + 128}, {1044, 1048}}));

  // The reference reads back what the bytes say.
  double values[kQkDim];
  cpu::dequantize_token(pool.latent_cache(), 5, values);
  EXPECT_EQ(values[0], 448.0);
  EXPECT_EQ(values[255], 80.0 / 256.0);  // 0.3 quantized
  EXPECT_EQ(values[385], -1.0);
  EXPECT_EQ(values[511], -6.0);
  EXPECT_EQ(values[kLatentDim + 1], bf16_decode(0x3F81));
  double k128[kIndexerDim], kscale = 0;
  cpu::dequantize_indexer_key(pool.indexer_cache(), 5, k128, &kscale);
  EXPECT_EQ(k128[0], 128.0);
  EXPECT_EQ(k128[127], -256.0);
  EXPECT_EQ(kscale, 0.015625);
}

TEST(CacheLayout, IndexerPageMajorAtOddPageSize) {
  // page_size 3: slot 7 = page 2, offset 1. Page 2 starts at 2 * 3 * 132 = 792; key at 792 + 128 = 920;
  // scale at 792 + 3 * 128 + 4 = 1180 (not 4-byte aligned relative to a float array of the page).
  Pool pool(3, 4, KvDtype::kFp8E4M3);
  const std::vector<std::uint8_t> before = pool.indexer;
  GoldenToken g;
  std::vector<std::int32_t> slots = {7};
  pool.append(g.latent, g.key, slots);
  EXPECT_EQ(pool.indexer[920], 0x70);
  EXPECT_EQ(pool.indexer[921], 0xE0);
  EXPECT_EQ(pool.indexer[920 + 127], 0xF8);
  const std::vector<std::uint8_t> want = le32(0x3C800000u);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(pool.indexer[1180 + static_cast<std::size_t>(k)], want[static_cast<std::size_t>(k)]);
  EXPECT_TRUE(only_changed_in(before, pool.indexer, {{920, 920 + 128}, {1180, 1184}}));
  // The descriptor agrees with the hand arithmetic.
  EXPECT_EQ(pool.indexer_cache().key(7) - pool.indexer.data(), 920);
  EXPECT_EQ(reinterpret_cast<std::uint8_t*>(pool.indexer_cache().scale_ptr(7)) - pool.indexer.data(), 1180);
}

TEST(CacheLayout, Bf16TokenIsVerbatim) {
  Pool pool(4, 2, KvDtype::kBf16);  // slot 6: bytes 6 * 1152 = 6912 .. 8064
  const std::vector<std::uint8_t> before = pool.cache;
  GoldenToken g;
  for (int j = 0; j < kQkDim; ++j) g.latent[static_cast<std::size_t>(j)] = static_cast<std::uint16_t>(0x3C00 + j * 7);
  std::vector<std::int32_t> slots = {6};
  pool.append(g.latent, g.key, slots);
  for (int j = 0; j < kQkDim; ++j) {
    const std::uint16_t bits = static_cast<std::uint16_t>(0x3C00 + j * 7);
    ASSERT_EQ(pool.cache[6912 + 2 * static_cast<std::size_t>(j)], static_cast<std::uint8_t>(bits & 0xFF)) << j;
    ASSERT_EQ(pool.cache[6913 + 2 * static_cast<std::size_t>(j)], static_cast<std::uint8_t>(bits >> 8)) << j;
  }
  EXPECT_TRUE(only_changed_in(before, pool.cache, {{6912, 6912 + 1152}}));
}

TEST(CacheLayout, ExactScaleMode) {
  Pool pool(2, 2, KvDtype::kFp8E4M3);
  GoldenToken g;
  std::vector<std::int32_t> slots = {0};
  pool.append(g.latent, g.key, slots, ScaleMode::kExact);
  const std::uint8_t* t = pool.cache.data();
  // Block 3 (amax 6, its last element): scale 6/448 as float32; -6 / scale rounds to -448 -> 0xFE.
  float s3;
  std::memcpy(&s3, t + 512 + 12, 4);
  EXPECT_EQ(s3, 6.0f / 448.0f);
  EXPECT_EQ(t[511], 0xFE);
  EXPECT_EQ(t[384], fp8_e4m3_encode(3.0f / s3));
  EXPECT_EQ(t[385], fp8_e4m3_encode(-1.0f / s3));
  float s2;
  std::memcpy(&s2, t + 512 + 8, 4);
  EXPECT_EQ(s2, 1e-4f / 448.0f);  // all-zero block: the clamp
  // The indexer key (slot 0: page 0, offset 0) in the same mode: amax 4 -> 4/448; -4 -> -448.
  float key_scale;
  std::memcpy(&key_scale, pool.indexer.data() + 2 * 128, 4);
  EXPECT_EQ(key_scale, 4.0f / 448.0f);
  EXPECT_EQ(pool.indexer[127], 0xFE);
  EXPECT_EQ(pool.indexer[0], fp8_e4m3_encode(2.0f / key_scale));
  EXPECT_EQ(pool.indexer[1], fp8_e4m3_encode(-0.5f / key_scale));
}

// SPEC's code is e4m3(value / scale). Multiplying by the scale's reciprocal instead gives the same
// code except where value / scale sits on an fp8 rounding midpoint; such a value and block amax are
// searched for (exact scales, amax / 448, rarely a power of two), then appended.
TEST(CacheLayout, ExactScaleCodesDivideByTheScale) {
  float amax = 0, x = 0;
  for (std::uint32_t a = 0x3F80; a < 0x4100 && x == 0; ++a) {  // amax over [1, 8) in bf16
    const float amax_a = bf16_decode(static_cast<std::uint16_t>(a));
    const float scale = fp8_block_scale(amax_a, ScaleMode::kExact);
    for (std::uint32_t b = 0x3C00; b < a; ++b) {  // values below it
      const float v = bf16_decode(static_cast<std::uint16_t>(b));
      if (fp8_e4m3_encode(v / scale) != fp8_e4m3_encode(v * (1.0f / scale))) {
        amax = amax_a, x = v;
        break;
      }
    }
  }
  ASSERT_NE(x, 0.0f) << "no value whose code tells division from a reciprocal: the search needs widening";
  Pool pool(2, 1, KvDtype::kFp8E4M3);
  GoldenToken g;
  std::fill(g.latent.begin(), g.latent.begin() + 128, std::uint16_t{0});  // block 0: the two values alone
  g.latent[0] = bf16_encode(amax);
  g.latent[1] = bf16_encode(x);
  std::vector<std::int32_t> slots = {0};
  pool.append(g.latent, g.key, slots, ScaleMode::kExact);
  const float scale = fp8_block_scale(amax, ScaleMode::kExact);
  EXPECT_EQ(pool.cache[1], fp8_e4m3_encode(x / scale)) << "value " << x << " in a block of amax " << amax;
}

TEST(CacheLayout, SlotMinusOneIsSkippedAndOtherSlotsUntouched) {
  Pool pool(5, 3, KvDtype::kFp8E4M3);
  const std::vector<std::uint8_t> cache_before = pool.cache, indexer_before = pool.indexer;
  GoldenToken g;
  std::vector<std::uint16_t> latent = g.latent, keys = g.key;
  latent.insert(latent.end(), g.latent.begin(), g.latent.end());
  keys.insert(keys.end(), g.key.begin(), g.key.end());
  std::vector<std::int32_t> slots = {-1, 14};  // the last slot of the pool
  pool.append(latent, keys, slots);
  EXPECT_TRUE(only_changed_in(cache_before, pool.cache, {{14 * 656, 15 * 656}}));
  // Page 2 (offset 4): key at 2 * 660 + 4 * 128 = 1832, scale at 2 * 660 + 640 + 16 = 1976.
  EXPECT_TRUE(only_changed_in(indexer_before, pool.indexer, {{1832, 1832 + 128}, {1976, 1980}}));
  EXPECT_EQ(pool.indexer[1832], 0x70);
}

TEST(CacheLayout, AppendWithoutIndexerLeavesItAlone) {
  Pool pool(4, 2, KvDtype::kFp8E4M3);
  const std::vector<std::uint8_t> indexer_before = pool.indexer;
  GoldenToken g;
  std::vector<std::int32_t> slots = {3};
  AppendParams p;
  p.cache = pool.latent_cache();
  p.latent = TensorView::contiguous(g.latent.data(), DType::kBF16, {1, kQkDim});
  p.slots = TensorView::contiguous(slots.data(), DType::kI32, {1});
  cpu::append(p);
  EXPECT_EQ(pool.cache[3 * 656], 0x7E);
  EXPECT_EQ(pool.indexer, indexer_before);
}

// SPEC section 3 for one block of bf16 values as stored: its scale is fp8_block_scale of the block's
// own amax, each code the e4m3 of value / scale. `what` names the block in a failure.
::testing::AssertionResult stored_as_spec_says(const std::uint16_t* in, int n, const std::uint8_t* codes, float scale,
                                               ScaleMode mode, const std::string& what) {
  float amax = 0;
  for (int j = 0; j < n; ++j) amax = std::max(amax, std::fabs(bf16_decode(in[j])));
  const float want = fp8_block_scale(amax, mode);
  if (scale != want) return ::testing::AssertionFailure() << what << ": scale " << scale << ", expected " << want;
  for (int j = 0; j < n; ++j) {
    const std::uint8_t code = fp8_e4m3_encode(bf16_decode(in[j]) / want);
    if (codes[j] != code) {
      return ::testing::AssertionFailure() << what << " element " << j << ": code " << int{codes[j]} << ", expected "
                                           << int{code};
    }
  }
  return ::testing::AssertionSuccess();
}

TEST(CacheLayout, RandomTokensRoundTripWithinFp8Precision) {
  // Every dequantized latent value is within half an fp8 step (relative 2^-4, or the subnormal
  // step times the scale) of the bf16 input; rope is exact. And the bytes are SPEC's: each block's
  // scale from its own amax, each code value / scale, the latent's and the indexer key's, in both
  // scale modes.
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 5;
  o.lengths = {7, 11};
  for (ScaleMode mode : {ScaleMode::kExact, ScaleMode::kPow2}) {
    o.scale_mode = mode;
    PagedFixture g = make_paged_fixture(o, rng);
    const std::string name = mode == ScaleMode::kPow2 ? "pow2" : "exact";
    for (std::int64_t b = 0; b < g.batch(); ++b) {
      for (std::int64_t t = 0; t < g.seq_lens[static_cast<std::size_t>(b)]; ++t) {
        const std::int64_t slot = g.slot(b, t);
        const std::uint8_t* token = g.cache_bytes.data() + slot * kFp8TokenBytes;
        for (int blk = 0; blk < 4; ++blk) {
          float scale;
          std::memcpy(&scale, token + kFp8ScaleOffset + 4 * blk, 4);
          ASSERT_TRUE(stored_as_spec_says(g.latent_of(b, t) + blk * 128, 128, token + blk * 128, scale, mode,
                                          name + " latent block " + std::to_string(blk) + " of slot " + std::to_string(slot)));
        }
        const IndexerCache ic = g.indexer();
        float key_scale;
        std::memcpy(&key_scale, ic.scale_ptr(slot), 4);
        ASSERT_TRUE(stored_as_spec_says(g.key_of(b, t), kIndexerDim, ic.key(slot), key_scale, mode,
                                        name + " indexer key of slot " + std::to_string(slot)));
      }
    }
  }
  o.scale_mode = ScaleMode::kPow2;
  PagedFixture f = make_paged_fixture(o, rng);
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    for (std::int64_t t = 0; t < f.seq_lens[static_cast<std::size_t>(b)]; ++t) {
      double v[kQkDim];
      cpu::dequantize_token(f.cache(), f.slot(b, t), v);
      const std::uint16_t* in = f.latent_of(b, t);
      for (int blk = 0; blk < 4; ++blk) {
        float amax = 0;
        for (int j = 0; j < 128; ++j) amax = std::max(amax, std::fabs(bf16_decode(in[blk * 128 + j])));
        const double scale = fp8_block_scale(amax, ScaleMode::kPow2);
        for (int j = blk * 128; j < (blk + 1) * 128; ++j) {
          const double x = bf16_decode(in[j]);
          ASSERT_LE(std::fabs(v[j] - x), std::max(std::fabs(x) / 16.0, scale * 0x1p-10) * 1.0000001)
              << "request " << b << " position " << t << " value " << j;
        }
      }
      for (int j = kLatentDim; j < kQkDim; ++j) ASSERT_EQ(v[j], bf16_decode(in[j]));
    }
  }
}

}  // namespace
}  // namespace latentkv::testing
