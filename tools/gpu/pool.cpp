#include "gpu/pool.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>

#include "check.hpp"
#include "cpu/reference.hpp"
#include "gpu/kernels.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/device_fault.hpp"
#include "latentkv/ops.hpp"

namespace latentkv::tools::gpu {

DevicePool::DevicePool(std::int64_t pool_tokens, int page_size_, KvDtype dtype_, bool with_indexer,
                       std::uint64_t seed, cudaStream_t stream)
    : num_pages((pool_tokens + page_size_ - 1) / page_size_), page_size(page_size_), dtype(dtype_) {
  const std::int64_t slots = num_pages * page_size;
  latent_bytes = DeviceMemory(static_cast<std::size_t>(slots) * kv_token_bytes(dtype));
  if (with_indexer) indexer_bytes = DeviceMemory(static_cast<std::size_t>(slots) * kIndexerTokenBytes);

  // Fill every slot through the library's own append, in chunks.
  constexpr std::int64_t kChunk = 1 << 16;
  DeviceMemory latents(static_cast<std::size_t>(kChunk) * 576 * 2);
  DeviceMemory keys(static_cast<std::size_t>(kChunk) * 128 * 2);
  DeviceMemory slot_ids(static_cast<std::size_t>(kChunk) * 4);
  std::vector<std::int32_t> host_slots(static_cast<std::size_t>(kChunk));
  const Backend* cuda = find_backend("cuda");
  if (cuda == nullptr) throw std::runtime_error("the cuda backend is not registered");
  const DeviceMemory fault = DeviceMemory::zeroed(sizeof(DeviceFault));  // a token the append refused
  for (std::int64_t first = 0; first < slots; first += kChunk) {
    const std::int64_t n = std::min(kChunk, slots - first);
    launch_random_bf16(latents.get<std::uint16_t>(), static_cast<std::size_t>(n) * 576, seed + first, 1.0f, stream);
    launch_random_bf16(keys.get<std::uint16_t>(), static_cast<std::size_t>(n) * 128, ~seed + first, 1.0f, stream);
    for (std::int64_t i = 0; i < n; ++i) host_slots[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(first + i);
    cuda_ok(cudaMemcpyAsync(slot_ids.get(), host_slots.data(), static_cast<std::size_t>(n) * 4,
                            cudaMemcpyHostToDevice, stream), "slots upload");
    AppendParams p;
    p.cache = cache();
    p.latent = TensorView::contiguous(latents.get(), DType::kBF16, {n, 576}, Device::cuda());
    p.slots = TensorView::contiguous(slot_ids.get(), DType::kI32, {n}, Device::cuda());
    if (with_indexer) {
      p.indexer = indexer();
      p.indexer_keys = TensorView::contiguous(keys.get(), DType::kBF16, {n, 128}, Device::cuda());
    }
    p.fault = fault.get<DeviceFault>();
    run(*cuda, p, {stream});
    cuda_ok(cudaStreamSynchronize(stream), "pool fill");
  }
  DeviceFault first_fault;
  cuda_ok(cudaMemcpy(&first_fault, fault.get(), sizeof first_fault, cudaMemcpyDeviceToHost), "the fill's fault record");
  throw_device_fault(first_fault);
}

LatentCache DevicePool::cache() const {
  LatentCache c;
  c.data = latent_bytes.get<std::uint8_t>();
  c.dtype = dtype;
  c.num_pages = num_pages;
  c.page_size = page_size;
  c.device = Device::cuda();
  return c;
}

IndexerCache DevicePool::indexer() const {
  IndexerCache c;
  c.data = indexer_bytes.get<std::uint8_t>();
  c.num_pages = num_pages;
  c.page_size = page_size;
  c.device = Device::cuda();
  return c;
}

RequestSets make_request_sets(const DevicePool& pool, int sets, int batch, std::int64_t length, std::uint64_t seed) {
  return make_request_sets(pool, sets, std::vector<std::int64_t>(static_cast<std::size_t>(batch), length), seed);
}

RequestSets make_request_sets(const DevicePool& pool, int sets, const std::vector<std::int64_t>& lengths,
                              std::uint64_t seed) {
  PageAllocator allocator(pool.num_pages, pool.page_size, seed | 1);
  RequestSets r;
  r.sets = sets;
  r.batch = static_cast<int>(lengths.size());
  const std::int64_t longest = lengths.empty() ? 0 : *std::max_element(lengths.begin(), lengths.end());
  r.max_pages = static_cast<int>(std::max<std::int64_t>(1, allocator.pages_for(longest)));
  for (int s = 0; s < sets; ++s) {
    std::vector<RequestId> ids;
    for (const std::int64_t length : lengths) {
      ids.push_back(allocator.add_request());
      allocator.grow(ids.back(), length);
    }
    const auto table = allocator.block_table_matrix(ids, r.max_pages);
    r.host_tables.insert(r.host_tables.end(), table.begin(), table.end());
    for (const std::int64_t length : lengths) r.host_lens.push_back(static_cast<std::int32_t>(length));
  }
  r.tables = DeviceMemory(r.host_tables.size() * 4);
  r.lens = DeviceMemory(r.host_lens.size() * 4);
  cuda_ok(cudaMemcpy(r.tables.get(), r.host_tables.data(), r.host_tables.size() * 4, cudaMemcpyHostToDevice), "tables");
  cuda_ok(cudaMemcpy(r.lens.get(), r.host_lens.data(), r.host_lens.size() * 4, cudaMemcpyHostToDevice), "lens");
  return r;
}

std::vector<std::int32_t> random_index_rows(const RequestSets& sets, int variants, int q_len, int topk,
                                            std::int64_t context, int page_size, std::uint64_t seed) {
  std::vector<std::int32_t> out;
  std::mt19937_64 rng(seed);
  std::vector<std::int64_t> positions;
  for (int v = 0; v < variants; ++v) {
    const int s = v % sets.sets;
    for (int b = 0; b < sets.batch; ++b) {
      const std::int32_t* table = sets.host_tables.data() + (static_cast<std::size_t>(s) * sets.batch + b) * sets.max_pages;
      for (int i = 0; i < q_len; ++i) {
        const std::int64_t visible = context - q_len + i + 1;
        positions.resize(static_cast<std::size_t>(visible));
        std::iota(positions.begin(), positions.end(), 0);
        const std::int64_t take = std::min<std::int64_t>(topk, visible);
        for (std::int64_t k = 0; k < take; ++k) {  // partial Fisher-Yates: the first `take` are a random subset
          std::swap(positions[static_cast<std::size_t>(k)],
                    positions[static_cast<std::size_t>(k + static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(visible - k)))]);
          const std::int64_t t = positions[static_cast<std::size_t>(k)];
          out.push_back(table[t / page_size] * page_size + static_cast<std::int32_t>(t % page_size));
        }
        for (std::int64_t k = take; k < topk; ++k) out.push_back(-1);
      }
    }
  }
  return out;
}


void random_indexer_queries(std::uint64_t seed, int heads, std::vector<std::uint8_t>& q, std::vector<float>& w) {
  std::uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(state >> 11) * 0x1p-53;
  };
  for (auto& c : q) c = fp8_e4m3_encode(static_cast<float>((next() + next() + next() - 1.5) * 2.0));
  for (auto& x : w) x = static_cast<float>((next() - 0.5) * 2.0 / std::sqrt(heads * 128.0));
}

std::vector<float> reference_token_logits(const IndexerCache& host_cache, const std::int32_t* table_row, int max_pages,
                                          const std::uint8_t* q_row, const float* w_row, int heads,
                                          std::int32_t visible) {
  std::vector<float> logits(static_cast<std::size_t>(std::max(visible, 1)));
  std::int32_t length = visible;
  IndexerLogitsParams r;
  r.q = TensorView::contiguous(const_cast<std::uint8_t*>(q_row), DType::kFP8E4M3, {1, 1, heads, kIndexerDim});
  r.weights = TensorView::contiguous(const_cast<float*>(w_row), DType::kF32, {1, 1, heads});
  r.cache = host_cache;
  r.block_table = TensorView::contiguous(const_cast<std::int32_t*>(table_row), DType::kI32, {1, max_pages});
  r.seq_lens = TensorView::contiguous(&length, DType::kI32, {1});
  r.logits = TensorView::contiguous(logits.data(), DType::kF32, {1, 1, static_cast<std::int64_t>(logits.size())});
  cpu::indexer_logits(r);
  logits.resize(static_cast<std::size_t>(visible));
  return logits;
}

std::string logits_problem(const DevicePool& pool, const RequestSets& sets, int checked, int q_len, int heads,
                           std::int64_t columns, const std::uint8_t* q, const float* weights, const float* device_logits) {
  std::vector<std::uint8_t> cache(pool.indexer_bytes.bytes());
  cuda_ok(cudaMemcpy(cache.data(), pool.indexer_bytes.get(), cache.size(), cudaMemcpyDeviceToHost), "indexer cache");
  std::vector<float> got(static_cast<std::size_t>(checked) * q_len * columns), want(got.size());
  cuda_ok(cudaMemcpy(got.data(), device_logits, got.size() * 4, cudaMemcpyDeviceToHost), "logits");
  std::vector<std::int32_t> table(sets.host_tables.begin(), sets.host_tables.begin() + checked * sets.max_pages);
  std::vector<std::int32_t> lens(sets.host_lens.begin(), sets.host_lens.begin() + checked);
  IndexerLogitsParams r;
  r.q = TensorView::contiguous(const_cast<std::uint8_t*>(q), DType::kFP8E4M3, {checked, q_len, heads, kIndexerDim});
  r.weights = TensorView::contiguous(const_cast<float*>(weights), DType::kF32, {checked, q_len, heads});
  r.cache = pool.indexer();
  r.cache.data = cache.data();
  r.cache.device = Device::cpu();
  r.block_table = TensorView::contiguous(table.data(), DType::kI32, {checked, sets.max_pages});
  r.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {checked});
  r.logits = TensorView::contiguous(want.data(), DType::kF32, {checked, q_len, columns});
  cpu::indexer_logits(r);
  const CheckResult c = check_close(
      got.size(), [&](std::size_t i) { return static_cast<double>(got[i]); },
      [&](std::size_t i) { return static_cast<double>(want[i]); }, 1e-4, 1e-5, 1e-9);
  return c.ok ? "" : c.detail;
}

}  // namespace latentkv::tools::gpu
