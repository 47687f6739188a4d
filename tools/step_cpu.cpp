// tools/step_cpu.cpp - `latentkv step` without a GPU: every layer's step on the CPU reference
// backend (float64 over the dequantized FP8 bytes), each op timed with the host clock inside the
// step. The same tables as on a GPU, without floors: these are not speed figures, they show the
// step's structure (which ops run, what each must move) on any machine.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "latentkv/backend.hpp"
#include "latentkv/dsa.hpp"
#include "latentkv/error.hpp"
#include "cli_checks.hpp"
#include "latentkv/model.hpp"
#include "spread.hpp"
#include "step.hpp"

namespace latentkv::tools {
namespace {

using Clock = std::chrono::steady_clock;

double micros_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// One layer's caches and inputs in host memory.
struct HostLayer {
  std::vector<std::uint8_t> cache;    // [num_pages, page_size, 656] bytes
  std::vector<std::uint8_t> indexer;  // [num_pages, page_size * 132] bytes
  std::vector<std::uint16_t> latent;  // [B * q_len, 576] bf16: the step's new tokens
  std::vector<std::uint16_t> keys;    // [B * q_len, 128] bf16, their indexer keys
  std::vector<std::uint16_t> q;       // [B, q_len, H, 576] bf16
  std::vector<std::uint8_t> q_idx;    // [B, q_len, Hi, 128] fp8
  std::vector<float> weights;         // [B, q_len, Hi]
  std::vector<std::uint16_t> o;       // [B, q_len, H, 512] bf16
  std::vector<float> lse;             // [B, q_len, H]
};

template <typename T>
TensorView host_view(std::vector<T>& v, DType dtype, std::initializer_list<std::int64_t> shape) {
  return TensorView::contiguous(v.data(), dtype, shape);
}

// The library op that runs a step op: the kernel names are those the reference's select() gives.
Op library_op(StepOp op) {
  switch (op) {
    case StepOp::kAppend:
      return Op::kAppend;
    case StepOp::kIndexerLogits:
      return Op::kIndexerLogits;
    case StepOp::kTopk:
      return Op::kTopk;
    case StepOp::kSparseDecode:
      return Op::kSparseMlaDecode;
    case StepOp::kDenseDecode:
      return Op::kMlaDecode;
  }
  return Op::kAppend;
}

// Fills every slot of the layer's caches with a random token through the reference append, then
// draws the step's inputs.
void fill_layer(HostLayer& layer, const StepShape& s, std::int64_t num_pages, std::uint64_t seed, const Backend& ref,
                const DeviceInfo& cpu) {
  const std::int64_t slots = num_pages * s.page_size;
  layer.cache.assign(static_cast<std::size_t>(slots) * kFp8TokenBytes, 0);
  layer.indexer.assign(static_cast<std::size_t>(slots) * kIndexerTokenBytes, 0);
  const LatentCache cache{layer.cache.data(), KvDtype::kFp8E4M3, num_pages, s.page_size, Device::cpu()};
  const IndexerCache indexer{layer.indexer.data(), num_pages, s.page_size, Device::cpu()};
  constexpr std::int64_t kChunk = 4096;
  std::vector<std::uint16_t> latent(static_cast<std::size_t>(kChunk) * kQkDim),
      keys(static_cast<std::size_t>(kChunk) * kIndexerDim);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(kChunk));
  for (std::int64_t first = 0; first < slots; first += kChunk) {
    const std::int64_t n = std::min(kChunk, slots - first);
    fill_random_bf16(latent.data(), static_cast<std::size_t>(n) * kQkDim, seed + 2 * static_cast<std::uint64_t>(first));
    fill_random_bf16(keys.data(), static_cast<std::size_t>(n) * kIndexerDim,
                     ~seed + 2 * static_cast<std::uint64_t>(first));
    for (std::int64_t i = 0; i < n; ++i) ids[static_cast<std::size_t>(i)] = static_cast<std::int32_t>(first + i);
    AppendParams a;
    a.cache = cache;
    a.indexer = indexer;
    a.latent = host_view(latent, DType::kBF16, {n, kQkDim});
    a.indexer_keys = host_view(keys, DType::kBF16, {n, kIndexerDim});
    a.slots = host_view(ids, DType::kI32, {n});
    run(ref, a, {}, cpu);
  }
  const std::size_t rows = static_cast<std::size_t>(s.batch) * s.q_len;
  layer.latent.resize(rows * kQkDim);
  layer.keys.resize(rows * kIndexerDim);
  layer.q.resize(rows * s.heads * kQkDim);
  layer.q_idx.resize(rows * s.indexer_heads * kIndexerDim);
  layer.weights.resize(rows * s.indexer_heads);
  layer.o.resize(rows * s.heads * kLatentDim);
  layer.lse.resize(rows * s.heads);
  fill_random_bf16(layer.latent.data(), layer.latent.size(), seed ^ 0x1111);
  fill_random_bf16(layer.keys.data(), layer.keys.size(), seed ^ 0x2222);
  fill_random_bf16(layer.q.data(), layer.q.size(), seed ^ 0x3333);
  fill_random_fp8(layer.q_idx.data(), layer.q_idx.size(), seed ^ 0x4444);
  // Indexer weights carry the q scale and 1/sqrt(Hi * 128), as a model's do.
  fill_random_f32(layer.weights.data(), layer.weights.size(), seed ^ 0x5555,
                  1.0f / std::sqrt(static_cast<float>(s.indexer_heads * kIndexerDim)));
}

// Room for the reference's own scratch and the program itself.
constexpr double kHostHeadroomBytes = 256e6;

// Fails before anything is allocated when the run cannot fit in host memory: every layer's caches,
// inputs and outputs (HostLayer), the page tables, and the DSA workspace (every row's logits and slots).
void check_memory(const StepShape& s) {
  const double slots = static_cast<double>(s.pool_tokens), rows = static_cast<double>(s.batch) * s.q_len;
  const double max_pages = std::ceil(static_cast<double>(s.context) / s.page_size);
  const double cache = s.layers * slots * static_cast<double>(kFp8TokenBytes + kIndexerTokenBytes);
  const double inputs = s.layers * rows *
                        (2.0 * (kQkDim + kIndexerDim) + s.heads * (2.0 * (kQkDim + kLatentDim) + 4) +
                         s.indexer_heads * (kIndexerDim + 4.0));
  const double tables = 5.0 * slots / s.page_size + 8.0 * s.batch * max_pages;
  const double workspace = 4.0 * rows * (max_pages * s.page_size + s.topk);
  const double rest = inputs + tables + workspace;
  check_host_memory("step", cache + rest + kHostHeadroomBytes,
                    std::to_string(s.layers) + (s.layers == 1 ? " layer x " : " layers x ") +
                        std::to_string(s.pool_tokens) + " slots of cache take " + gigabytes(cache) + " (" +
                        std::to_string(kFp8TokenBytes + kIndexerTokenBytes) +
                        " B a slot: main + indexer); with the inputs, page tables and workspace (" + gigabytes(rest) +
                        ") and " + gigabytes(kHostHeadroomBytes) + " of headroom",
                    "--pool, --page-size, --layers, --batch or --context");
}

}  // namespace

StepReport run_step_cpu(const StepRun& job) {
  const StepShape& s = job.shape;
  const DeviceInfo cpu;  // the CPU, whatever else the machine has
  const Backend* ref = find_backend("reference");
  if (ref == nullptr) throw Error("step", "the reference backend is not registered");
  const auto scale = static_cast<float>(model_preset(s.model).softmax_scale);
  Progress progress("step", job.progress);

  StepReport report;
  report.device = "cpu (the float64 reference backend)";
  report.cpu_reference = true;
  report.shape = s;
  report.warmup = job.warmup;
  report.iters = job.iters;
  report.seed = job.seed;

  check_memory(s);
  StepTables tables = make_step_tables(s, job.seed);
  const std::int64_t b = s.batch, q_len = s.q_len, n_new = b * q_len;
  const TensorView block_table = host_view(tables.block_table, DType::kI32, {b, tables.max_pages});
  const TensorView seq_lens = host_view(tables.seq_lens, DType::kI32, {b});
  const TensorView new_slots = host_view(tables.new_slots, DType::kI32, {n_new});

  std::vector<HostLayer> layers(static_cast<std::size_t>(s.layers));
  for (int l = 0; l < s.layers; ++l) {
    progress.update("filling layer caches", l + 1, s.layers);
    fill_layer(layers[static_cast<std::size_t>(l)], s, tables.num_pages,
               job.seed * 1000003 + static_cast<std::uint64_t>(l), *ref, cpu);
  }

  for (const StrategySpec& spec : job.strategies) {
    StrategyResult result;
    result.name = spec.name;
    result.dense = spec.dense;
    result.backend = spec.backend == "cuda" ? "reference" : spec.backend;
    const std::vector<StepOp> ops = step_ops(spec.dense);
    for (StepOp op : ops) {
      OpResult r;
      r.op = op;
      r.backend = "reference";
      r.kernel = "reference." + std::string(op_name(library_op(op)));
      result.ops.push_back(r);
    }
    if (spec.backend != "cuda") {
      result.status =
          "unsupported: " + spec.backend + " is a CUDA baseline; the CPU run has the reference backend only";
      report.strategies.push_back(result);
      continue;
    }

    // Every layer's ops, with views into its own caches and inputs; one workspace serves every
    // layer since layers run one after another.
    std::vector<AppendParams> appends;
    std::vector<DsaSteps> sparse;
    std::vector<MlaDecodeParams> dense;
    std::vector<std::uint8_t> workspace;
    for (HostLayer& layer : layers) {
      const LatentCache cache{layer.cache.data(), KvDtype::kFp8E4M3, tables.num_pages, s.page_size, Device::cpu()};
      const IndexerCache indexer{layer.indexer.data(), tables.num_pages, s.page_size, Device::cpu()};
      AppendParams a;
      a.cache = cache;
      a.indexer = indexer;
      a.latent = host_view(layer.latent, DType::kBF16, {n_new, kQkDim});
      a.indexer_keys = host_view(layer.keys, DType::kBF16, {n_new, kIndexerDim});
      a.slots = new_slots;
      appends.push_back(a);
      const TensorView q = host_view(layer.q, DType::kBF16, {b, q_len, s.heads, kQkDim});
      const TensorView o = host_view(layer.o, DType::kBF16, {b, q_len, s.heads, kLatentDim});
      const TensorView lse = host_view(layer.lse, DType::kF32, {b, q_len, s.heads});
      if (spec.dense) {
        MlaDecodeParams d;
        d.q = q;
        d.cache = cache;
        d.block_table = block_table;
        d.seq_lens = seq_lens;
        d.o = o;
        d.lse = lse;
        d.softmax_scale = scale;
        dense.push_back(d);
        continue;
      }
      DsaDecodeParams p;
      p.q = q;
      p.q_idx = host_view(layer.q_idx, DType::kFP8E4M3, {b, q_len, s.indexer_heads, kIndexerDim});
      p.weights = host_view(layer.weights, DType::kF32, {b, q_len, s.indexer_heads});
      p.cache = cache;
      p.indexer = indexer;
      p.block_table = block_table;
      p.seq_lens = seq_lens;
      p.o = o;
      p.lse = lse;
      p.softmax_scale = scale;
      p.topk = s.topk;
      const DsaPlan plan = plan_dsa_decode(same_backend(*ref), p, cpu);
      if (workspace.empty()) workspace.resize(plan.workspace_bytes);
      p.workspace = workspace.data();
      p.workspace_bytes = workspace.size();
      sparse.push_back(dsa_steps(p, plan));
    }
    const auto launch = [&](StepOp op, std::size_t l) {
      switch (op) {
        case StepOp::kAppend:
          run(*ref, appends[l], {}, cpu);
          break;
        case StepOp::kIndexerLogits:
          run(*ref, sparse[l].indexer, {}, cpu);
          break;
        case StepOp::kTopk:
          run(*ref, sparse[l].topk, {}, cpu);
          break;
        case StepOp::kSparseDecode:
          run(*ref, sparse[l].sparse, {}, cpu);
          break;
        case StepOp::kDenseDecode:
          run(*ref, dense[l], {}, cpu);
          break;
      }
    };

    std::vector<double> steps;
    std::vector<std::vector<double>> per_op(ops.size());
    const int total = job.warmup + job.iters;
    for (int it = 0; it < total; ++it) {
      progress.update("timing " + spec.name + " (host clock)", it + 1, total);
      std::vector<double> op_us(ops.size(), 0.0);
      const Clock::time_point t0 = Clock::now();
      for (std::size_t l = 0; l < layers.size(); ++l) {
        for (std::size_t k = 0; k < ops.size(); ++k) {
          const Clock::time_point t = Clock::now();
          launch(ops[k], l);
          op_us[k] += micros_since(t);
        }
      }
      const double step_us = micros_since(t0);
      if (it < job.warmup) continue;
      steps.push_back(step_us);
      for (std::size_t k = 0; k < ops.size(); ++k) per_op[k].push_back(op_us[k]);
    }
    const Spread step = spread_of(steps);
    result.timed = true;
    result.step_us = step.median;
    result.step_p10_us = step.p10;
    result.step_p90_us = step.p90;
    for (std::size_t k = 0; k < ops.size(); ++k) {
      const Spread t = spread_of(per_op[k]);
      result.ops[k].us = t.median;
      result.ops[k].p10_us = t.p10;
      result.ops[k].p90_us = t.p90;
    }
    result.status = "reference (float64: the check itself)";
    report.strategies.push_back(std::move(result));
  }
  progress.finish();
  return report;
}

}  // namespace latentkv::tools
