// tools/gpu/bench_indexer.cpp - `latentkv bench --op indexer_logits`: the lightning indexer's logits
// over the paged fp8 indexer cache, checked against the reference, then timed; and `--op
// indexer_prefill`: logits and top-k of `new_tokens` new tokens per request, timed next to the fp8
// matrix rate measured in the same run.
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
#include "gpu/matrix_rate.hpp"
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
  const Rotation rotation =
      plan_rotation(bytes_per_call, ctx.l2_bytes, opt.warmup + opt.iters,
                    request_sets_that_fit(pool.num_pages * pool.page_size, opt.batch * opt.context, opt.batch, opt.page_size));
  report.rotation_sets = rotation.sets;
  report.rotation_cold = rotation.cold;
  const RequestSets sets = make_request_sets(pool, report.rotation_sets, opt.batch, opt.context, opt.seed);

  const std::size_t q_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * heads * 128;
  const std::size_t w_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * heads;
  const std::size_t out_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * opt.context;
  std::vector<std::uint8_t> host_q(q_elems * sets.sets);
  std::vector<float> host_w(w_elems * sets.sets);
  random_indexer_queries(opt.seed, heads, host_q, host_w);
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
  // (query row, key) pairs: row i of a request sees L - q_len + i + 1 of its L keys (causal); the
  // logits written past that (-inf) count as bytes, not as products.
  const double visible = static_cast<double>(opt.batch) *
                         (static_cast<double>(opt.q_len) * opt.context - opt.q_len * (opt.q_len - 1) / 2.0);
  const double flops = 2.0 * heads * 128.0 * visible;

  for (const std::string& name : opt.backends) {
    BackendRow started = start_row(report, name, params_for(0), device, bytes, flops);
    if (!started.selection) continue;
    BenchRow& row = started.row;
    const Plan plan = started.backend->plan(params_for(0), device);
    // The backend's scratch (the GPU's claim counters).
    const DeviceMemory workspace = DeviceMemory::zeroed(plan.workspace_bytes);
    auto call = [&](int i) {
      IndexerLogitsParams p = params_for(i % sets.sets);
      p.workspace_cleared = plan.cleared_bytes > 0;
      OpArgs args = p;
      attach_plan(args, plan, workspace);
      run(*started.backend, args, {stream});
    };
    cuda_ok(cudaMemsetAsync(logits.get(), 0xFF, out_elems * 4, stream), "sentinel");  // NaN: unwritten logits fail
    call(0);
    cuda_ok(cudaStreamSynchronize(stream), ("run " + name).c_str());
    const int checked = std::min(opt.check_requests, opt.batch);
    std::string failure;
    if (checked > 0) {
      failure = logits_problem(pool, sets, checked, opt.q_len, heads, opt.context, host_q.data(), host_w.data(),
                               logits.get<float>());
    }
    finish_row(report, row, failure, checked > 0 ? "pass (" + std::to_string(checked) + " requests)" : "unchecked",
               call, opt, stream);
  }
  return report;
}

BenchReport run_indexer_prefill_bench(const BenchOptions& opt) {
  const ModelPreset& model = model_preset(opt.model);
  const int heads = opt.heads > 0 ? opt.heads : model.indexer_heads;
  const int n = opt.new_tokens;
  if (n < 1 || n > opt.context) {
    throw Error("bench", "new_tokens", std::to_string(n), "1 .. context (" + std::to_string(opt.context) + ")");
  }
  BenchContext ctx;
  cudaStream_t stream = ctx.stream;
  BenchReport& report = ctx.report;
  report.rotation_sets = 1;  // compute-bound: one set of requests, read by every call (below)
  constexpr int kMatrixN = 8192;
  const MatrixRate matrix = measure_fp8_matrix_rate(kMatrixN, stream);
  report.matrix_tflops = matrix.tflops;
  report.matrix_how = matrix.how;

  const DevicePool pool(opt.pool, opt.page_size, KvDtype::kFp8E4M3, true, opt.seed, stream);
  const RequestSets sets = make_request_sets(pool, 1, opt.batch, opt.context, opt.seed);
  const std::int64_t t_total = static_cast<std::int64_t>(opt.batch) * n;
  std::vector<std::uint8_t> host_q(static_cast<std::size_t>(t_total) * heads * 128);
  std::vector<float> host_w(static_cast<std::size_t>(t_total) * heads);
  random_indexer_queries(opt.seed, heads, host_q, host_w);
  std::vector<std::int32_t> cu(static_cast<std::size_t>(opt.batch) + 1);
  for (int b = 0; b <= opt.batch; ++b) cu[static_cast<std::size_t>(b)] = b * n;
  DeviceMemory q(host_q.size()), w(host_w.size() * 4), d_cu(cu.size() * 4),
      slots(static_cast<std::size_t>(t_total) * opt.topk * 4);
  cuda_ok(cudaMemcpy(q.get(), host_q.data(), host_q.size(), cudaMemcpyHostToDevice), "q");
  cuda_ok(cudaMemcpy(w.get(), host_w.data(), host_w.size() * 4, cudaMemcpyHostToDevice), "w");
  cuda_ok(cudaMemcpy(d_cu.get(), cu.data(), cu.size() * 4, cudaMemcpyHostToDevice), "cu");

  const Device gpu = Device::cuda();
  IndexerPrefillParams p;
  p.q = TensorView::contiguous(q.get(), DType::kFP8E4M3, {t_total, heads, 128}, gpu);
  p.weights = TensorView::contiguous(w.get(), DType::kF32, {t_total, heads}, gpu);
  p.cu_new_tokens = TensorView::contiguous(d_cu.get(), DType::kI32, {opt.batch + 1}, gpu);
  p.cache = pool.indexer();
  p.block_table = TensorView::contiguous(const_cast<std::int32_t*>(sets.table(0)), DType::kI32,
                                         {opt.batch, sets.max_pages}, gpu);
  p.seq_lens = TensorView::contiguous(const_cast<std::int32_t*>(sets.lengths(0)), DType::kI32, {opt.batch}, gpu);
  p.k = opt.topk;
  p.slots = TensorView::contiguous(slots.get(), DType::kI32, {t_total, opt.topk}, gpu);

  double pairs = 0;  // (new token, visible cached token) pairs
  for (int j = 0; j < n; ++j) pairs += static_cast<double>(opt.context - n + j + 1);
  pairs *= opt.batch;
  // Each request's keys read once, q, w and the slots written; the logits stay in the workspace.
  const double bytes = static_cast<double>(opt.batch) * opt.context * kIndexerTokenBytes + host_q.size() +
                       4.0 * host_w.size() + 4.0 * static_cast<double>(t_total) * opt.topk;
  report.rotation_cold = bytes >= 2.0 * static_cast<double>(ctx.l2_bytes);  // else some of it stays in the L2
  const double flops = 2.0 * heads * 128.0 * pairs;

  // The reference's logits of the last two new tokens of request 0, each over what it sees.
  const int checked_tokens = std::min(2, n);
  std::vector<std::vector<float>> want(static_cast<std::size_t>(checked_tokens));
  const std::vector<std::int32_t> table(sets.host_tables.begin(), sets.host_tables.begin() + sets.max_pages);
  if (opt.check_requests > 0) {
    std::vector<std::uint8_t> cache(pool.indexer_bytes.bytes());
    cuda_ok(cudaMemcpy(cache.data(), pool.indexer_bytes.get(), cache.size(), cudaMemcpyDeviceToHost), "indexer");
    IndexerCache host_cache = pool.indexer();
    host_cache.data = cache.data();
    host_cache.device = Device::cpu();
    for (int c = 0; c < checked_tokens; ++c) {
      const std::int64_t row = n - checked_tokens + c;
      want[static_cast<std::size_t>(c)] =
          reference_token_logits(host_cache, table.data(), sets.max_pages, host_q.data() + row * heads * 128,
                                 host_w.data() + row * heads, heads, static_cast<std::int32_t>(opt.context - n + row + 1));
    }
  }

  for (const std::string& name : opt.backends) {
    BackendRow started = start_row(report, name, p, ctx.device, bytes, flops);
    if (!started.selection) continue;
    BenchRow& row = started.row;
    OpArgs planned = p;
    const Plan plan = started.backend->plan(planned, ctx.device);
    DeviceMemory workspace(plan.workspace_bytes);
    attach_plan(planned, plan, workspace);
    row.kernel += ", chunks of " + std::to_string(plan.chunk_tokens) + " new tokens in " +
                  std::to_string(plan.workspace_bytes >> 20) + " MiB of workspace";
    const auto call = [&](int) { run(*started.backend, planned, {stream}); };
    cuda_ok(cudaMemsetAsync(slots.get(), 0x80, slots.bytes(), stream), "sentinel");
    call(0);
    cuda_ok(cudaStreamSynchronize(stream), ("run " + name).c_str());
    std::string failure;
    if (opt.check_requests > 0) {
      std::vector<std::int32_t> got(static_cast<std::size_t>(checked_tokens) * opt.topk);
      const std::size_t first_row = static_cast<std::size_t>(n - checked_tokens);
      cuda_ok(cudaMemcpy(got.data(), slots.get<std::int32_t>() + first_row * opt.topk, got.size() * 4,
                         cudaMemcpyDeviceToHost), "slots");
      for (int c = 0; c < checked_tokens && failure.empty(); ++c) {
        failure = topk_row_problem_near(want[static_cast<std::size_t>(c)], table.data(), opt.page_size,
                                        got.data() + static_cast<std::size_t>(c) * opt.topk, opt.topk);
        if (!failure.empty()) failure = "new token " + std::to_string(first_row + c) + ": " + failure;
      }
    }
    finish_row(report, row, failure,
               opt.check_requests > 0 ? "pass (the last " + std::to_string(checked_tokens) + " new tokens of request 0)"
                                      : "unchecked",
               call, opt, stream);
  }
  return report;
}

}  // namespace latentkv::tools
