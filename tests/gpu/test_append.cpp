// GPU append: the cache bytes it writes equal the CPU reference's, byte for byte.
#include <gtest/gtest.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "cpu/reference.hpp"
#include "gpu/device.hpp"
#include "latentkv/backend.hpp"
#include "support/paged_fixture.hpp"

namespace latentkv::testing {
namespace {

using AppendCase = std::tuple<KvDtype, ScaleMode, int /*page_size*/>;

class GpuAppend : public ::testing::TestWithParam<AppendCase> {};

TEST_P(GpuAppend, BytesEqualTheReference) {
  LKV_REQUIRE_GPU();
  const auto [dtype, mode, page_size] = GetParam();
  Rng rng = test_rng();
  PagedFixtureOptions o;
  o.page_size = page_size;
  o.lengths = {0, 1, page_size + 1, 77, 3 * page_size - 1};
  o.kv_dtype = dtype;
  o.scale_mode = mode;
  PagedFixture f = make_paged_fixture(o, rng);

  // The same tokens appended on the GPU into freshly poisoned caches.
  std::vector<std::uint8_t> fresh_cache(f.cache_bytes.size());
  poison_latent_cache(fresh_cache, dtype);
  std::vector<std::uint8_t> fresh_indexer(f.indexer_bytes.size());
  poison_indexer_cache(fresh_indexer, page_size);
  DeviceBuffer d_cache(fresh_cache), d_indexer(fresh_indexer);

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

  AppendParams p;
  p.cache = f.cache(d_cache.get<std::uint8_t>(), Device::cuda());
  p.indexer = f.indexer(d_indexer.get<std::uint8_t>(), Device::cuda());
  p.latent = TensorView::contiguous(d_latents.get(), DType::kBF16, {n + 1, 576}, Device::cuda());
  p.indexer_keys = TensorView::contiguous(d_keys.get(), DType::kBF16, {n + 1, 128}, Device::cuda());
  p.slots = TensorView::contiguous(d_slots.get(), DType::kI32, {n + 1}, Device::cuda());
  p.scale_mode = mode;
  run(*find_backend("cuda"), p);
  LKV_CUDA_OK(cudaDeviceSynchronize());

  const auto cache = d_cache.to_host<std::uint8_t>();
  const auto indexer = d_indexer.to_host<std::uint8_t>();
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
                         ::testing::Values(AppendCase{KvDtype::kFp8E4M3, ScaleMode::kPow2, 64},
                                           AppendCase{KvDtype::kFp8E4M3, ScaleMode::kExact, 64},
                                           AppendCase{KvDtype::kFp8E4M3, ScaleMode::kPow2, 1},
                                           AppendCase{KvDtype::kFp8E4M3, ScaleMode::kExact, 17},
                                           AppendCase{KvDtype::kBf16, ScaleMode::kPow2, 64},
                                           AppendCase{KvDtype::kBf16, ScaleMode::kPow2, 3}));

}  // namespace
}  // namespace latentkv::testing
