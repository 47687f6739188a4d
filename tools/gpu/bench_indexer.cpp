// tools/gpu/bench_indexer.cpp - `latentkv bench --op indexer_logits`: the lightning indexer's logits
// over the paged fp8 indexer cache, checked against the reference, then timed.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "bench.hpp"
#include "check.hpp"
#include "cpu/reference.hpp"
#include "gpu/bench_context.hpp"
#include "gpu/kernels.hpp"
#include "gpu/measure.hpp"
#include "gpu/pool.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/error.hpp"
#include "latentkv/model.hpp"

namespace latentkv::tools {

using namespace gpu;

BenchReport run_indexer_bench(const BenchOptions& opt) {
  const ModelPreset& model = model_preset(opt.model);
  const int heads = opt.heads > 0 ? opt.heads : model.indexer_heads;
  BenchContext ctx;
  const DeviceInfo& device = ctx.device;
  cudaStream_t stream = ctx.stream;
  BenchReport& report = ctx.report;

  const DevicePool pool(opt.pool, opt.page_size, KvDtype::kFp8E4M3, true, opt.seed, stream);
  const std::int64_t bytes_per_call = opt.batch * opt.context * static_cast<std::int64_t>(kIndexerTokenBytes);
  report.rotation_sets = rotation_sets(bytes_per_call, ctx.l2_bytes, pool.num_pages * pool.page_size,
                                       opt.batch * (opt.context + opt.page_size));
  const RequestSets sets = make_request_sets(pool, report.rotation_sets, opt.batch, opt.context, opt.seed);

  const std::size_t q_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * heads * 128;
  const std::size_t w_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * heads;
  const std::size_t out_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * opt.context;
  // Queries: fp8 codes of roughly N(0, 1) values; weights around 1/sqrt(heads * 128).
  std::vector<std::uint8_t> host_q(q_elems * sets.sets);
  std::vector<float> host_w(w_elems * sets.sets);
  std::uint64_t state = opt.seed * 0x9E3779B97F4A7C15ull + 1;
  auto next = [&] {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(state >> 11) * 0x1p-53;
  };
  for (auto& c : host_q) c = fp8_e4m3_encode(static_cast<float>((next() + next() + next() - 1.5) * 2.0));
  for (auto& w : host_w) w = static_cast<float>((next() - 0.5) * 2.0 / std::sqrt(heads * 128.0));
  DeviceMemory q(host_q.size()), w(host_w.size() * 4), logits(out_elems * 4 * sets.sets);
  cuda_ok(cudaMemcpy(q.get(), host_q.data(), host_q.size(), cudaMemcpyHostToDevice), "q");
  cuda_ok(cudaMemcpy(w.get(), host_w.data(), host_w.size() * 4, cudaMemcpyHostToDevice), "w");

  auto params_for = [&](int set) {
    IndexerLogitsParams p;
    p.q = TensorView::contiguous(q.get<std::uint8_t>() + set * q_elems, DType::kFP8E4M3,
                                 {opt.batch, opt.q_len, heads, 128}, Device::cuda());
    p.weights = TensorView::contiguous(w.get<float>() + set * w_elems, DType::kF32, {opt.batch, opt.q_len, heads},
                                       Device::cuda());
    p.cache = pool.indexer();
    p.block_table = TensorView::contiguous(const_cast<std::int32_t*>(sets.table(set)), DType::kI32,
                                           {opt.batch, sets.max_pages}, Device::cuda());
    p.seq_lens = TensorView::contiguous(const_cast<std::int32_t*>(sets.lengths(set)), DType::kI32, {opt.batch},
                                        Device::cuda());
    p.logits = TensorView::contiguous(logits.get<float>() + set * out_elems, DType::kF32,
                                      {opt.batch, opt.q_len, opt.context}, Device::cuda());
    return p;
  };
  const double bytes = static_cast<double>(bytes_per_call) + q_elems + 4.0 * w_elems + 4.0 * out_elems;
  const double flops = 2.0 * heads * 128.0 * static_cast<double>(out_elems);

  for (const std::string& name : opt.backends) {
    BenchRow row;
    row.backend = name;
    row.bytes = bytes;
    row.flops = flops;
    const Backend* backend = find_backend(name);
    const IndexerLogitsParams p0 = params_for(0);
    const Selection sel = backend ? backend->select(problem_of(p0, device)) : Selection::no("no such backend");
    if (!sel) {
      row.status = "unsupported: " + sel.reason;
      report.rows.push_back(row);
      continue;
    }
    row.kernel = sel.kernel->name;
    auto call = [&](int i) { sel.kernel->launch(params_for(i % sets.sets), {stream}); };
    call(0);
    cuda_ok(cudaStreamSynchronize(stream), ("run " + name).c_str());
    const int checked = std::min(opt.check_requests, opt.batch);
    if (checked > 0) {
      std::vector<std::uint8_t> cache(pool.indexer_bytes.bytes());
      cuda_ok(cudaMemcpy(cache.data(), pool.indexer_bytes.get(), cache.size(), cudaMemcpyDeviceToHost), "indexer");
      std::vector<float> got(static_cast<std::size_t>(checked) * opt.q_len * opt.context), want(got.size());
      cuda_ok(cudaMemcpy(got.data(), logits.get(), got.size() * 4, cudaMemcpyDeviceToHost), "logits");
      std::vector<std::int32_t> table(sets.host_tables.begin(), sets.host_tables.begin() + checked * sets.max_pages);
      std::vector<std::int32_t> lens(sets.host_lens.begin(), sets.host_lens.begin() + checked);
      IndexerLogitsParams r;
      r.q = TensorView::contiguous(host_q.data(), DType::kFP8E4M3, {checked, opt.q_len, heads, 128});
      r.weights = TensorView::contiguous(host_w.data(), DType::kF32, {checked, opt.q_len, heads});
      r.cache = pool.indexer();
      r.cache.data = cache.data();
      r.cache.device = Device::cpu();
      r.block_table = TensorView::contiguous(table.data(), DType::kI32, {checked, sets.max_pages});
      r.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {checked});
      r.logits = TensorView::contiguous(want.data(), DType::kF32, {checked, opt.q_len, opt.context});
      cpu::indexer_logits(r);
      const CheckResult c = check_close(
          got.size(), [&](std::size_t i) { return static_cast<double>(got[i]); },
          [&](std::size_t i) { return static_cast<double>(want[i]); }, 1e-4, 1e-5, 1e-9);
      if (!c.ok) {
        row.status = "FAIL: " + c.detail;
        report.rows.push_back(row);
        continue;
      }
      row.status = "pass (" + std::to_string(checked) + " requests)";
    } else {
      row.status = "unchecked";
    }
    const Timing t = time_calls(call, opt.warmup, opt.iters, stream);
    set_timing(row, t.median_us, t.p10_us, t.p90_us, report.read_gbps);
    report.rows.push_back(row);
  }
  return report;
}

}  // namespace latentkv::tools
