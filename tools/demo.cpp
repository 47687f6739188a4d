// `latentkv demo`: one layer's DSA decode on the CPU reference, step by step, with the bytes each
// step reads: fill a paged FP8 cache (append), lightning-indexer logits, top-k, sparse MLA decode.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "cli_checks.hpp"
#include "commands.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/fp8.hpp"
#include "latentkv/model.hpp"
#include "latentkv/ops.hpp"
#include "latentkv/paging.hpp"

namespace latentkv::tools {
namespace {

struct DemoOptions {
  std::string model = "glm5";
  int tp = 8;
  int batch = 2;
  std::int64_t context = 3000;
  int page_size = kDefaultPageSize;
  std::uint64_t seed = 1;
};

std::vector<std::uint16_t> random_bf16(std::mt19937_64& rng, std::size_t n) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::uint16_t> v(n);
  for (auto& x : v) x = bf16_encode(normal(rng));
  return v;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// One step's line, out at once (a long demo piped to a file shows each step as it ends).
void print_step(const char* step, const std::string& what, double bytes_read, double seconds) {
  std::printf("  %-18s %-66s read %9.2f MB  (%.3f s on the CPU reference)\n", step, what.c_str(), bytes_read / 1e6,
              seconds);
  std::fflush(stdout);
}

// Fails before anything is allocated when the demo cannot fit in host memory: the caches of the
// pool, every token's bf16 inputs, slot and logit, the page tables, and the small per-request rest.
void check_memory(const DemoOptions& o, std::int64_t num_pages, const ModelShard& shard) {
  const double slots = static_cast<double>(num_pages) * o.page_size;
  const double cache = slots * static_cast<double>(kFp8TokenBytes + kIndexerTokenBytes);
  const double inputs = static_cast<double>(o.batch) * static_cast<double>(o.context) * (2.0 * (576 + 128) + 4 + 4);
  const double rest = 9.0 * static_cast<double>(num_pages) +
                      o.batch * (shard.heads_per_gpu * (2.0 * (576 + 512) + 4) +
                                 shard.model.indexer_heads * (128 + 4.0) + 4.0 * shard.model.index_topk);
  constexpr double kHeadroomBytes = 256e6;  // the reference's own scratch and the program itself
  check_host_memory("demo", cache + inputs + rest + kHeadroomBytes,
                    std::to_string(num_pages * o.page_size) + " cache slots take " + gigabytes(cache) +
                        " and the inputs of " + std::to_string(o.batch) + " x " + std::to_string(o.context) +
                        " tokens " + gigabytes(inputs) + "; with the rest and " + gigabytes(kHeadroomBytes) +
                        " of headroom",
                    "--batch, --context or --page-size");
}

void run_demo(const DemoOptions& o) {
  const ModelShard shard = or_usage_error([&] { return shard_from_flags("demo", o.model, o.tp); });
  const ModelPreset& m = shard.model;
  or_usage_error([&] { check_context_in_model("demo", o.context, m); });  // as `latentkv step` refuses it
  const int heads = shard.heads_per_gpu, hi = m.indexer_heads, topk = m.index_topk;
  const Backend& ref = *find_backend("reference");
  // Pages for every request from a shuffled pool, with a few pages to spare.
  const std::int64_t num_pages = (o.context + o.page_size - 1) / o.page_size * o.batch + 4;
  check_memory(o, num_pages, shard);
  std::mt19937_64 rng(o.seed);
  std::printf("latentkv demo: one layer of %s at tp %d (%d heads here, %d indexer heads, top-%d), "
              "%d requests x %lld tokens, page size %d, seed %llu\n",
              m.name.c_str(), o.tp, heads, hi, topk, o.batch, static_cast<long long>(o.context), o.page_size,
              static_cast<unsigned long long>(o.seed));

  PageAllocator pool(num_pages, o.page_size, o.seed);
  std::vector<RequestId> requests;
  for (int b = 0; b < o.batch; ++b) {
    requests.push_back(pool.add_request());
    pool.grow(requests.back(), o.context);
  }
  const int max_pages = static_cast<int>(pool.pages_for(o.context));
  std::vector<std::int32_t> table = pool.block_table_matrix(requests, max_pages);
  std::vector<std::int32_t> lens = pool.lengths(requests);
  std::vector<std::uint8_t> cache_bytes(static_cast<std::size_t>(pool.num_pages() * o.page_size) * kFp8TokenBytes);
  std::vector<std::uint8_t> indexer_bytes(static_cast<std::size_t>(pool.num_pages() * o.page_size) * kIndexerTokenBytes);
  LatentCache cache{cache_bytes.data(), KvDtype::kFp8E4M3, pool.num_pages(), o.page_size, Device::cpu()};
  IndexerCache indexer{indexer_bytes.data(), pool.num_pages(), o.page_size, Device::cpu()};
  const auto tv = [](auto* data, DType t, std::initializer_list<std::int64_t> shape) {
    return TensorView::contiguous(const_cast<void*>(static_cast<const void*>(data)), t, shape);
  };

  // 1. append: every request's tokens, quantized into the FP8 caches.
  const std::int64_t n = static_cast<std::int64_t>(o.batch) * o.context;
  std::vector<std::uint16_t> latents = random_bf16(rng, static_cast<std::size_t>(n) * 576);
  std::vector<std::uint16_t> keys = random_bf16(rng, static_cast<std::size_t>(n) * 128);
  std::vector<std::int32_t> slots;
  for (RequestId r : requests) {
    for (std::int64_t t = 0; t < o.context; ++t) slots.push_back(static_cast<std::int32_t>(pool.slot(r, t)));
  }
  AppendParams append;
  append.cache = cache;
  append.indexer = indexer;
  append.latent = tv(latents.data(), DType::kBF16, {n, 576});
  append.indexer_keys = tv(keys.data(), DType::kBF16, {n, 128});
  append.slots = tv(slots.data(), DType::kI32, {n});
  std::printf("\nsteps:\n");
  std::fflush(stdout);
  auto t0 = std::chrono::steady_clock::now();
  run(ref, append);  // on the CPU, where its tensors are (also on a machine with a GPU)
  print_step("append", std::to_string(n) + " tokens -> " + std::to_string(kFp8TokenBytes) + " + " +
                           std::to_string(kIndexerTokenBytes) + " B/token (fp8 e4m3, pow2 scales)",
             static_cast<double>(n) * (576 + 128) * 2, seconds_since(t0));

  // 2. indexer logits of each request's newest token over its whole context.
  std::vector<std::uint8_t> q_idx(static_cast<std::size_t>(o.batch) * hi * 128);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& c : q_idx) c = fp8_e4m3_encode(normal(rng));
  std::vector<float> weights(static_cast<std::size_t>(o.batch) * hi);
  for (auto& w : weights) w = normal(rng) / std::sqrt(static_cast<float>(hi * 128));
  std::vector<float> logits(static_cast<std::size_t>(o.batch) * o.context);
  IndexerLogitsParams idx;
  idx.q = tv(q_idx.data(), DType::kFP8E4M3, {o.batch, 1, hi, 128});
  idx.weights = tv(weights.data(), DType::kF32, {o.batch, 1, hi});
  idx.cache = indexer;
  idx.block_table = tv(table.data(), DType::kI32, {o.batch, max_pages});
  idx.seq_lens = tv(lens.data(), DType::kI32, {o.batch});
  idx.logits = tv(logits.data(), DType::kF32, {o.batch, 1, o.context});
  t0 = std::chrono::steady_clock::now();
  run(ref, idx);
  print_step("indexer_logits", std::to_string(hi) + " heads x 128 over " + std::to_string(n) + " cached keys",
             static_cast<double>(n) * kIndexerTokenBytes + static_cast<double>(q_idx.size()) + 4.0 * weights.size(),
             seconds_since(t0));

  // 3. top-k: the index_topk best positions of each request, as physical slots.
  std::vector<std::int32_t> selected(static_cast<std::size_t>(o.batch) * topk);
  TopkParams top;
  top.logits = idx.logits;
  top.block_table = idx.block_table;
  top.seq_lens = idx.seq_lens;
  top.page_size = o.page_size;
  top.k = topk;
  top.slots = tv(selected.data(), DType::kI32, {o.batch, 1, topk});
  t0 = std::chrono::steady_clock::now();
  run(ref, top);
  std::int64_t valid = 0;
  for (std::int32_t s : selected) valid += s >= 0;
  // Rows of requests shorter than index_topk keep every token and pad the rest with -1.
  const std::int64_t padded = static_cast<std::int64_t>(selected.size()) - valid;
  print_step("topk", "top-" + std::to_string(topk) + " of " + std::to_string(o.context) + " per request (" +
                         std::to_string(valid) + " slots" +
                         (padded > 0 ? ", " + std::to_string(padded) + " padded with -1" : "") + ")",
             4.0 * static_cast<double>(n), seconds_since(t0));

  // 4. sparse MLA decode over the selected FP8 tokens only.
  std::vector<std::uint16_t> q = random_bf16(rng, static_cast<std::size_t>(o.batch) * heads * 576);
  std::vector<std::uint16_t> out(static_cast<std::size_t>(o.batch) * heads * 512);
  std::vector<float> lse(static_cast<std::size_t>(o.batch) * heads);
  SparseMlaDecodeParams sparse;
  sparse.q = tv(q.data(), DType::kBF16, {o.batch, 1, heads, 576});
  sparse.cache = cache;
  sparse.indices = top.slots;
  sparse.o = tv(out.data(), DType::kBF16, {o.batch, 1, heads, 512});
  sparse.lse = tv(lse.data(), DType::kF32, {o.batch, 1, heads});
  sparse.softmax_scale = static_cast<float>(m.softmax_scale);
  t0 = std::chrono::steady_clock::now();
  run(ref, sparse);
  // What each decode reads: the cache entries of the tokens it attends to, and q; the sparse one also
  // its slots, the dense one the page table and lengths.
  const double q_bytes = 2.0 * static_cast<double>(q.size());
  const double sparse_read =
      static_cast<double>(valid) * kFp8TokenBytes + q_bytes + 4.0 * static_cast<double>(selected.size());
  const double dense_read =
      static_cast<double>(n) * kFp8TokenBytes + q_bytes + 4.0 * static_cast<double>(table.size() + lens.size());
  print_step("sparse_mla_decode", std::to_string(heads) + " heads over " + std::to_string(valid) +
                                      " selected FP8 tokens, dequantized on the fly",
             sparse_read, seconds_since(t0));

  double checksum = 0;
  for (std::uint16_t x : out) checksum += std::fabs(bf16_decode(x));
  std::printf("\nresult: o [%d, 1, %d, 512] bf16, mean |o| %.5f, lse[0][0] %.4f\n", o.batch, heads,
              checksum / static_cast<double>(out.size()), lse[0]);
  std::printf("a dense decode would read %.2f MB for this step (every cached token's FP8 entry, q, the page table);\n"
              "the sparse decode read %.2f MB (the selected tokens' entries, q, their slots).\n",
              dense_read / 1e6, sparse_read / 1e6);
  std::printf("(engines that cast the pool to bf16 first would also write %.2f MB per layer per step)\n",
              static_cast<double>(pool.num_pages() * o.page_size) * kBf16TokenBytes / 1e6);
}

}  // namespace

void add_demo_command(CLI::App& app) {
  auto opt = std::make_shared<DemoOptions>();
  CLI::App* cmd = app.add_subcommand("demo", "One layer's DSA decode on the CPU reference, step by step");
  cmd->option_defaults()->always_capture_default();  // the help shows each option's default
  cmd->add_option("--model", opt->model, "Model preset (glm5, deepseek-v3.2)");
  cmd->add_option("--tp", opt->tp, "Tensor parallelism (divides the heads)")->transform(integer_in(1, kIntMax));
  cmd->add_option("--batch", opt->batch, "Requests")->transform(integer_in(1, 64));
  cmd->add_option("--context", opt->context, "Tokens per request (at most the model's max positions)")
      ->transform(integer_in(1, kIntMax));
  cmd->add_option("--page-size", opt->page_size, "Tokens per page")
      ->transform(integer_in(1, kMaxTableTokens, kPageSizeWhy));
  cmd->add_option("--seed", opt->seed, "Random seed")->transform(seed_in_range());
  cmd->callback([opt] { run_demo(*opt); });
}

}  // namespace latentkv::tools
