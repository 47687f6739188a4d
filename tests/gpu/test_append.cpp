// GPU append: the cache bytes it writes equal the CPU reference's, byte for byte; a token the
// reference refuses (a slot outside the pool, a NaN or inf in its latent or key, a value pow2 scales
// cannot hold) is left unwritten and noted in the call's fault record, as the Error the reference throws.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "cpu/reference.hpp"
#include "support/expect_error.hpp"
#include "gpu/device.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/fp8.hpp"
#include "support/paged_fixture.hpp"

namespace latentkv::testing {
namespace {

// pool_pages: 0 for the pages the lengths need; else the pool's (pages_past_2gib), with a request of
// 20,000 tokens more, so that some land past 2 GiB of the main cache.
using AppendCase = std::tuple<KvDtype, ScaleMode, int /*page_size*/, std::int64_t /*pool_pages*/>;

// An append of n tokens (latents [n, 576], keys [n, 128], slots [n], all on the device) into the
// fixture's caches held at `cache` and `indexer`.
AppendParams device_append(const PagedFixture& f, const GuardedBuffer& cache, const GuardedBuffer& indexer,
                           const DeviceBuffer& latents, const DeviceBuffer& keys, const DeviceBuffer& slots,
                           std::int64_t n) {
  AppendParams p;
  p.cache = f.cache(cache.get<std::uint8_t>(), Device::cuda());
  p.indexer = f.indexer(indexer.get<std::uint8_t>(), Device::cuda());
  p.latent = TensorView::contiguous(latents.get(), DType::kBF16, {n, 576}, Device::cuda());
  p.indexer_keys = TensorView::contiguous(keys.get(), DType::kBF16, {n, 128}, Device::cuda());
  p.slots = TensorView::contiguous(slots.get(), DType::kI32, {n}, Device::cuda());
  return p;
}

std::string append_case_name(const ::testing::TestParamInfo<AppendCase>& info) {
  const auto& [dtype, mode, page_size, pool_pages] = info.param;
  std::string name = std::string(kv_dtype_name(dtype)) + (mode == ScaleMode::kExact ? "_exactscales" : "") + "_ps" +
                     std::to_string(page_size);
  if (pool_pages > 0) name += "_pool" + std::to_string(pool_pages);
  return name;
}

class GpuAppend : public ::testing::TestWithParam<AppendCase> {};

TEST_P(GpuAppend, BytesEqualTheReference) {
  LKV_REQUIRE_GPU();
  const auto [dtype, mode, page_size, pool_pages] = GetParam();
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = page_size;
  o.lengths = {0, 1, page_size + 1, 77, 3 * page_size - 1};
  if (pool_pages > 0) o.lengths.push_back(20000);
  o.kv_dtype = dtype;
  o.scale_mode = mode;
  o.num_pages = pool_pages;
  PagedFixture f = make_paged_fixture(o, rng);
  if (pool_pages > 0) EXPECT_GE(highest_held_offset(f), kTwoGiB) << "no token to write past 2 GiB of the pool";

  // The same tokens appended on the GPU into freshly poisoned caches.
  std::vector<std::uint8_t> fresh_cache(f.cache_bytes.size());
  poison_latent_cache(fresh_cache, dtype);
  std::vector<std::uint8_t> fresh_indexer(f.indexer_bytes.size());
  poison_indexer_cache(fresh_indexer, page_size);
  GuardedBuffer d_cache(fresh_cache), d_indexer(fresh_indexer);

  std::vector<std::int32_t> slots;
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    const auto s = f.slots(b, f.seq_lens[static_cast<std::size_t>(b)]);
    slots.insert(slots.end(), s.begin(), s.end());
  }
  const auto n = static_cast<std::int64_t>(slots.size());
  // One extra token with slot -1 must be skipped.
  slots.push_back(-1);
  std::vector<std::uint16_t> latents(f.latents.begin(), f.latents.begin() + n * 576);
  latents.resize(static_cast<std::size_t>(n + 1) * 576, 0x3F80);
  std::vector<std::uint16_t> keys(f.keys.begin(), f.keys.begin() + n * 128);
  keys.resize(static_cast<std::size_t>(n + 1) * 128, 0x3F80);
  DeviceBuffer d_latents(latents), d_keys(keys), d_slots(slots);

  AppendParams p = device_append(f, d_cache, d_indexer, d_latents, d_keys, d_slots, n + 1);
  p.scale_mode = mode;
  run(*find_backend("cuda"), p);
  LKV_CUDA_OK(cudaDeviceSynchronize());

  const auto cache = d_cache.to_host();
  const auto indexer = d_indexer.to_host();
  EXPECT_TRUE(d_cache.guards_intact()) << "the append wrote outside the main cache (the slot -1 token?)";
  EXPECT_TRUE(d_indexer.guards_intact()) << "the append wrote outside the indexer cache (the slot -1 token?)";
  ASSERT_EQ(cache.size(), f.cache_bytes.size());
  std::size_t first_diff = cache.size();
  for (std::size_t i = 0; i < cache.size() && first_diff == cache.size(); ++i) {
    if (cache[i] != f.cache_bytes[i]) first_diff = i;
  }
  EXPECT_EQ(first_diff, cache.size()) << "main cache differs first at byte " << first_diff << " (slot "
                                      << first_diff / kv_token_bytes(dtype) << ", byte "
                                      << first_diff % kv_token_bytes(dtype) << ")";
  EXPECT_TRUE(indexer == f.indexer_bytes) << "indexer cache differs";
}

INSTANTIATE_TEST_SUITE_P(Layouts, GpuAppend,
                         ::testing::Values(AppendCase{KvDtype::kFp8E4M3, ScaleMode::kPow2, 64, 0},
                                           AppendCase{KvDtype::kFp8E4M3, ScaleMode::kExact, 64, 0},
                                           AppendCase{KvDtype::kFp8E4M3, ScaleMode::kPow2, 1, 0},
                                           AppendCase{KvDtype::kFp8E4M3, ScaleMode::kExact, 17, 0},
                                           AppendCase{KvDtype::kBf16, ScaleMode::kPow2, 64, 0},
                                           AppendCase{KvDtype::kBf16, ScaleMode::kPow2, 3, 0},
                                           AppendCase{KvDtype::kFp8E4M3, ScaleMode::kPow2, 1000, 0},
                                           AppendCase{KvDtype::kBf16, ScaleMode::kPow2, 4096, 0},
                                           AppendCase{KvDtype::kFp8E4M3, ScaleMode::kPow2, 64,
                                                      pages_past_2gib(64, KvDtype::kFp8E4M3)},
                                           AppendCase{KvDtype::kBf16, ScaleMode::kPow2, 17,
                                                      pages_past_2gib(17, KvDtype::kBf16)}),
                         append_case_name);

// Each bad token goes with the fixture's good ones, into a slot no request uses (or outside the
// pool): the caches must come out as the reference writes the good tokens alone, and the record
// must name the bad element as the reference's Error does.
class GpuAppendFaults : public ::testing::TestWithParam<KvDtype> {};

TEST_P(GpuAppendFaults, RefusedTokensAreLeftUnwrittenAndRecorded) {
  LKV_REQUIRE_GPU();
  const KvDtype dtype = GetParam();
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 16;
  o.lengths = {5, 40};
  o.spare_pages = 2;
  o.kv_dtype = dtype;
  PagedFixture f = make_paged_fixture(o, rng);
  std::vector<std::int32_t> good;
  for (std::int64_t b = 0; b < f.batch(); ++b) {
    const auto s = f.slots(b, f.seq_lens[static_cast<std::size_t>(b)]);
    good.insert(good.end(), s.begin(), s.end());
  }
  std::int32_t free_slot = 0;
  while (std::find(good.begin(), good.end(), free_slot) != good.end()) ++free_slot;
  const auto n = static_cast<std::int64_t>(good.size());
  const std::int64_t num_slots = f.num_pages() * f.page_size;

  std::vector<std::uint8_t> cache(f.cache_bytes.size());
  poison_latent_cache(cache, dtype);
  std::vector<std::uint8_t> indexer(f.indexer_bytes.size());
  poison_indexer_cache(indexer, o.page_size);
  DeviceBuffer d_fault(sizeof(DeviceFault));

  struct Bad {
    const char* what;
    std::int32_t slot;
    int latent_nan[3];  // elements of the bad token's latent set to NaN (-1: none)
    int latent_inf;
    int key_nan;
    const char* named;  // the argument the record names: "slots", "latent" (its lowest bad element), "indexer_keys"
    std::string value;
  };
  const Bad cases[] = {
      // fp8 cache: 98 and 105 in one lane's two chunks, 300 in another lane's; bf16: three lanes
      {"three NaNs in the latent", free_slot, {300, 105, 98}, -1, -1, "latent", "nan"},
      {"inf in the rope", free_slot, {-1, -1, -1}, 570, -1, "latent", "inf"},
      {"NaN in the key", free_slot, {-1, -1, -1}, -1, 7, "indexer_keys", "nan"},
      {"NaN in the latent and the key", free_slot, {200, -1, -1}, -1, 5, "latent", "nan"},
      {"NaN in a token without a slot", -1, {40, -1, -1}, -1, -1, "latent", "nan"},
      {"a slot past the pool", static_cast<std::int32_t>(num_slots), {-1, -1, -1}, -1, -1, "slots",
       std::to_string(num_slots)},
      {"a slot below -1", -2, {-1, -1, -1}, -1, -1, "slots", "-2"},
      {"a slot below -1 and a NaN", -2, {3, -1, -1}, -1, -1, "slots", "-2"},
  };
  for (const Bad& bad : cases) {
    SCOPED_TRACE(bad.what);
    std::vector<std::int32_t> slots = good;
    slots.push_back(bad.slot);
    std::vector<std::uint16_t> latents(f.latents.begin(), f.latents.begin() + n * 576);
    latents.resize(static_cast<std::size_t>(n + 1) * 576, 0x3F80);
    std::vector<std::uint16_t> keys(f.keys.begin(), f.keys.begin() + n * 128);
    keys.resize(static_cast<std::size_t>(n + 1) * 128, 0x3F80);
    std::int64_t lowest_latent = 576;  // of the bad token's latent elements
    for (int e : bad.latent_nan) {
      if (e < 0) continue;
      latents[static_cast<std::size_t>(n * 576 + e)] = 0x7FC0;
      lowest_latent = std::min<std::int64_t>(lowest_latent, e);
    }
    if (bad.latent_inf >= 0) {
      latents[static_cast<std::size_t>(n * 576 + bad.latent_inf)] = 0x7F80;
      lowest_latent = std::min<std::int64_t>(lowest_latent, bad.latent_inf);
    }
    if (bad.key_nan >= 0) keys[static_cast<std::size_t>(n * 128 + bad.key_nan)] = 0xFFC1;
    const std::string named = bad.named;
    const std::int64_t index = named == "slots" ? n : named == "latent" ? n * 576 + lowest_latent : n * 128 + bad.key_nan;
    // Freshly poisoned caches for each case: the good tokens must be written by this call.
    GuardedBuffer d_cache(cache), d_indexer(indexer);
    DeviceBuffer d_latents(latents), d_keys(keys), d_slots(slots);
    LKV_CUDA_OK(cudaMemset(d_fault.get(), 0, sizeof(DeviceFault)));

    AppendParams p = device_append(f, d_cache, d_indexer, d_latents, d_keys, d_slots, n + 1);
    p.fault = d_fault.get<DeviceFault>();
    run(*find_backend("cuda"), p);
    LKV_CUDA_OK(cudaDeviceSynchronize());

    DeviceFault fault;
    d_fault.download(&fault, sizeof fault);
    EXPECT_TRUE(throws_error([&] { throw_device_fault(fault); }, "append", named + " element " + std::to_string(index),
                             bad.value));
    if (named == "slots") EXPECT_EQ(fault.bound, num_slots);
    EXPECT_TRUE(d_cache.to_host() == f.cache_bytes) << "the main cache is not the good tokens' alone";
    EXPECT_TRUE(d_indexer.to_host() == f.indexer_bytes) << "the indexer cache is not the good tokens' alone";
    EXPECT_TRUE(d_cache.guards_intact()) << "the append wrote outside the main cache";
    EXPECT_TRUE(d_indexer.guards_intact()) << "the append wrote outside the indexer cache";
  }

  // Good tokens alone leave the record empty.
  GuardedBuffer d_cache(cache), d_indexer(indexer);
  DeviceBuffer d_latents(std::vector<std::uint16_t>(f.latents.begin(), f.latents.begin() + n * 576));
  DeviceBuffer d_keys(std::vector<std::uint16_t>(f.keys.begin(), f.keys.begin() + n * 128)), d_slots(good);
  LKV_CUDA_OK(cudaMemset(d_fault.get(), 0, sizeof(DeviceFault)));
  AppendParams p = device_append(f, d_cache, d_indexer, d_latents, d_keys, d_slots, n);
  p.fault = d_fault.get<DeviceFault>();
  run(*find_backend("cuda"), p);
  LKV_CUDA_OK(cudaDeviceSynchronize());
  DeviceFault fault;
  d_fault.download(&fault, sizeof fault);
  EXPECT_EQ(fault.code, 0);
  EXPECT_NO_THROW(throw_device_fault(fault));
  EXPECT_TRUE(d_cache.to_host() == f.cache_bytes) << "the main cache is not the good tokens'";
  EXPECT_TRUE(d_indexer.to_host() == f.indexer_bytes) << "the indexer cache is not the good tokens'";
}

INSTANTIATE_TEST_SUITE_P(Dtypes, GpuAppendFaults, ::testing::Values(KvDtype::kFp8E4M3, KvDtype::kBf16),
                         [](const ::testing::TestParamInfo<KvDtype>& info) {
                           return std::string(kv_dtype_name(info.param));
                         });


// Values at the limit of pow2 scales (SPEC section 3: a block holding 248 x 2^120 or more in
// magnitude reads back as inf): one token appended by both backends into poisoned caches. Where the
// reference refuses it (the quantized latent or key under pow2 scales) the GPU leaves it unwritten
// and its record reads as the reference's Error; elsewhere both write the same bytes.
class GpuAppendLargeValues : public ::testing::TestWithParam<std::tuple<KvDtype, ScaleMode>> {};

TEST_P(GpuAppendLargeValues, AsTheReference) {
  LKV_REQUIRE_GPU();
  const auto [dtype, mode] = GetParam();
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = 16;
  o.lengths = {1};
  o.kv_dtype = dtype;
  o.scale_mode = mode;
  const PagedFixture f = make_paged_fixture(o, rng);
  constexpr std::uint16_t kTooLarge = kPow2StorableMagnitudeBits, kLargest = kPow2StorableMagnitudeBits - 1;
  struct Large {
    const char* what;
    int latent_element;  // -1: none
    std::uint16_t latent_bits;
    int key_element;
    std::uint16_t key_bits;
  };
  const Large cases[] = {
      {"the largest a pow2 block holds, latent and key", 5, kLargest, 0, static_cast<std::uint16_t>(0x8000u | kLargest)},
      {"a larger one in the rope", 513, kTooLarge, -1, 0},
      {"a larger negative one in the latent's third block", 300, static_cast<std::uint16_t>(0x8000u | kTooLarge), -1, 0},
      {"a larger one in the key", -1, 0, 77, kTooLarge},
      {"larger ones in the latent's last element and the key", 511, 0x7F7F, 3, 0x7F7F},
  };
  std::vector<std::uint8_t> poisoned_cache(f.cache_bytes.size()), poisoned_indexer(f.indexer_bytes.size());
  poison_latent_cache(poisoned_cache, dtype);
  poison_indexer_cache(poisoned_indexer, o.page_size);
  const std::vector<std::int32_t> slots = {f.slots(0, 1)[0]};
  for (const Large& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<std::uint16_t> latent(576), key(128);
    for (int i = 0; i < 576; ++i) latent[static_cast<std::size_t>(i)] = bf16_encode(static_cast<float>(i % 19) - 9.0f);
    for (int i = 0; i < 128; ++i) key[static_cast<std::size_t>(i)] = bf16_encode(static_cast<float>(i % 7) - 3.0f);
    if (c.latent_element >= 0) latent[static_cast<std::size_t>(c.latent_element)] = c.latent_bits;
    if (c.key_element >= 0) key[static_cast<std::size_t>(c.key_element)] = c.key_bits;

    std::vector<std::uint8_t> host_cache = poisoned_cache, host_indexer = poisoned_indexer;
    std::vector<std::int32_t> host_slots = slots;
    AppendParams h;
    h.cache = f.cache(host_cache.data(), Device::cpu());
    h.indexer = f.indexer(host_indexer.data(), Device::cpu());
    h.latent = TensorView::contiguous(latent.data(), DType::kBF16, {1, 576});
    h.indexer_keys = TensorView::contiguous(key.data(), DType::kBF16, {1, 128});
    h.slots = TensorView::contiguous(host_slots.data(), DType::kI32, {1});
    h.scale_mode = mode;
    std::string refused;
    try {
      cpu::append(h);
    } catch (const Error& e) {
      refused = e.what();
    }

    GuardedBuffer d_cache(poisoned_cache), d_indexer(poisoned_indexer);
    DeviceBuffer d_latents(latent), d_keys(key), d_slots(slots);
    DeviceBuffer d_fault(sizeof(DeviceFault));
    LKV_CUDA_OK(cudaMemset(d_fault.get(), 0, sizeof(DeviceFault)));
    AppendParams p = device_append(f, d_cache, d_indexer, d_latents, d_keys, d_slots, 1);
    p.scale_mode = mode;
    p.fault = d_fault.get<DeviceFault>();
    run(*find_backend("cuda"), p);
    LKV_CUDA_OK(cudaDeviceSynchronize());
    DeviceFault fault;
    d_fault.download(&fault, sizeof fault);
    EXPECT_EQ(error_of([&] { throw_device_fault(fault); }), refused);
    EXPECT_TRUE(d_cache.to_host() == host_cache) << "main cache differs from the reference's";
    EXPECT_TRUE(d_indexer.to_host() == host_indexer) << "indexer cache differs from the reference's";
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, GpuAppendLargeValues,
                         ::testing::Values(std::tuple{KvDtype::kFp8E4M3, ScaleMode::kPow2},
                                           std::tuple{KvDtype::kFp8E4M3, ScaleMode::kExact},
                                           std::tuple{KvDtype::kBf16, ScaleMode::kPow2}),
                         [](const ::testing::TestParamInfo<std::tuple<KvDtype, ScaleMode>>& info) {
                           return std::string(kv_dtype_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) == ScaleMode::kPow2 ? "_pow2" : "_exact");
                         });

}  // namespace
}  // namespace latentkv::testing
