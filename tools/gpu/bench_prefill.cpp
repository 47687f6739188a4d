// tools/gpu/bench_prefill.cpp - `latentkv bench --op mla_prefill`, `--op sparse_mla_prefill` and
// `--op dsa_prefill` (one layer's indexer prefill then sparse prefill): B requests of `context`
// tokens whose last `new_tokens` are the new ones (already appended), over the paged cache. The last
// two new tokens of the first request are checked against the float64 reference before timing (the
// reference over every new token would take hours on a CPU).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <vector>

#include "bench.hpp"
#include "bench_work.hpp"
#include "check.hpp"
#include "cpu/reference.hpp"
#include "gpu/bench_context.hpp"
#include "gpu/kernels.hpp"
#include "gpu/measure.hpp"
#include "gpu/pool.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/dsa.hpp"
#include "latentkv/error.hpp"
#include "latentkv/model.hpp"

namespace latentkv::tools {

using namespace gpu;

namespace {

// The GPU's o and lse of the checked rows (from first_row on, as many as the reference has) against
// the reference's: empty when they agree, else what differs.
std::string checked_rows_problem(const DeviceMemory& o, const DeviceMemory& lse, std::size_t first_row, int heads,
                                 const std::vector<double>& want_o, const std::vector<double>& want_lse) {
  std::vector<std::uint16_t> got_o(want_o.size());
  std::vector<float> got_lse(want_lse.size());
  cuda_ok(cudaMemcpy(got_o.data(), o.get<std::uint16_t>() + first_row * heads * 512, got_o.size() * 2,
                     cudaMemcpyDeviceToHost), "o");
  cuda_ok(cudaMemcpy(got_lse.data(), lse.get<float>() + first_row * heads, got_lse.size() * 4,
                     cudaMemcpyDeviceToHost), "lse");
  const AttentionCheck c = check_attention(got_o, got_lse, want_o, want_lse);
  return c.ok ? "" : c.detail;
}

}  // namespace

BenchReport run_prefill_bench(const BenchOptions& opt) {
  const ModelShard shard = shard_model(model_preset(opt.model), opt.tp);
  const int heads = opt.heads > 0 ? opt.heads : shard.heads_per_gpu;
  const auto scale = static_cast<float>(shard.model.softmax_scale);
  const KvDtype dtype = parse_kv_dtype(opt.kv_dtype);
  const bool sparse = opt.op == "sparse_mla_prefill";
  const int n = opt.new_tokens;
  if (n < 1 || n > opt.context) {
    throw Error("bench", "new_tokens", std::to_string(n), "1 .. context (" + std::to_string(opt.context) + ")");
  }
  BenchContext ctx;
  cudaStream_t stream = ctx.stream;
  BenchReport& report = ctx.report;
  report.rotation_sets = 1;  // compute-bound: one set of requests, read by every call (below)

  const DevicePool pool(opt.pool, opt.page_size, dtype, false, opt.seed, stream);
  const RequestSets sets = make_request_sets(pool, 1, opt.batch, opt.context, opt.seed);
  const std::int64_t t_total = static_cast<std::int64_t>(opt.batch) * n;
  const std::size_t q_elems = static_cast<std::size_t>(t_total) * heads * 576;
  const std::size_t o_elems = static_cast<std::size_t>(t_total) * heads * 512;
  const std::size_t lse_elems = static_cast<std::size_t>(t_total) * heads;
  DeviceMemory q(q_elems * 2), o(o_elems * 2), lse(lse_elems * 4);
  launch_random_bf16(q.get<std::uint16_t>(), q_elems, opt.seed * 7 + 3, 1.0f, stream);
  std::vector<std::int32_t> cu(static_cast<std::size_t>(opt.batch) + 1);
  for (int b = 0; b <= opt.batch; ++b) cu[static_cast<std::size_t>(b)] = b * n;
  DeviceMemory d_cu(cu.size() * 4);
  cuda_ok(cudaMemcpy(d_cu.get(), cu.data(), cu.size() * 4, cudaMemcpyHostToDevice), "cu");
  std::vector<std::int32_t> host_indices;
  DeviceMemory indices;
  if (sparse) {  // [B, n, topk] = [T, topk]: token j of a request sees t < context - n + j + 1
    host_indices = random_index_rows(sets, 1, n, opt.topk, opt.context, opt.page_size, opt.seed * 13 + 5);
    indices = DeviceMemory(host_indices.size() * 4);
    cuda_ok(cudaMemcpy(indices.get(), host_indices.data(), host_indices.size() * 4, cudaMemcpyHostToDevice), "indices");
  }

  const Device gpu = Device::cuda();
  const auto q_view = TensorView::contiguous(q.get(), DType::kBF16, {t_total, heads, 576}, gpu);
  const auto o_view = TensorView::contiguous(o.get(), DType::kBF16, {t_total, heads, 512}, gpu);
  const auto lse_view = TensorView::contiguous(lse.get(), DType::kF32, {t_total, heads}, gpu);
  OpArgs args;
  double attended = 0;  // (query token, cached token) pairs
  for (int j = 0; j < n; ++j) {
    const double visible = static_cast<double>(opt.context - n + j + 1);
    attended += sparse ? std::min<double>(visible, opt.topk) : visible;
  }
  attended *= opt.batch;
  if (sparse) {
    SparseMlaPrefillParams p;
    p.q = q_view;
    p.cache = pool.cache();
    p.indices = TensorView::contiguous(indices.get(), DType::kI32, {t_total, opt.topk}, gpu);
    p.o = o_view;
    p.lse = lse_view;
    p.softmax_scale = scale;
    args = p;
  } else {
    MlaPrefillParams p;
    p.q = q_view;
    p.cu_new_tokens = TensorView::contiguous(d_cu.get(), DType::kI32, {opt.batch + 1}, gpu);
    p.cache = pool.cache();
    p.block_table = TensorView::contiguous(const_cast<std::int32_t*>(sets.table(0)), DType::kI32,
                                           {opt.batch, sets.max_pages}, gpu);
    p.seq_lens = TensorView::contiguous(const_cast<std::int32_t*>(sets.lengths(0)), DType::kI32, {opt.batch}, gpu);
    p.o = o_view;
    p.lse = lse_view;
    p.softmax_scale = scale;
    args = p;
  }
  // The bytes an FP8-native prefill must read and write: each cache entry a request's new tokens
  // attend to, once (dense: all its tokens; sparse: the distinct ones its index rows select, which
  // the new tokens largely share), q (and the index rows), o and lse.
  const double token_bytes = static_cast<double>(kv_token_bytes(dtype));
  const double entries =
      sparse ? static_cast<double>(distinct_selected_entries(host_indices, n, opt.topk, pool.num_pages * pool.page_size))
             : static_cast<double>(opt.context) * opt.batch;
  const double bytes = entries * token_bytes + 2.0 * q_elems + 4.0 * static_cast<double>(host_indices.size()) +
                       2.0 * o_elems + 4.0 * lse_elems;
  report.rotation_cold = bytes >= 2.0 * static_cast<double>(ctx.l2_bytes);  // else some of it stays in the L2
  const double flops = 2.0 * heads * (576 + 512) * attended;

  // The reference for the last two new tokens of request 0, from a host copy of the pool.
  const int checked_tokens = std::min(2, n);
  std::vector<double> want_o, want_lse;
  std::vector<std::uint16_t> host_q(static_cast<std::size_t>(checked_tokens) * heads * 576);
  const std::size_t first_row = static_cast<std::size_t>(n - checked_tokens);
  if (opt.check_requests > 0) {
    cuda_ok(cudaMemcpy(host_q.data(), q.get<std::uint16_t>() + first_row * heads * 576, host_q.size() * 2,
                       cudaMemcpyDeviceToHost), "q");
    std::vector<std::uint8_t> bytes_host(pool.latent_bytes.bytes());
    cuda_ok(cudaMemcpy(bytes_host.data(), pool.latent_bytes.get(), bytes_host.size(), cudaMemcpyDeviceToHost), "pool");
    LatentCache cache = pool.cache();
    cache.data = bytes_host.data();
    cache.device = Device::cpu();
    want_o.resize(static_cast<std::size_t>(checked_tokens) * heads * 512);
    want_lse.resize(static_cast<std::size_t>(checked_tokens) * heads);
    const auto qv = TensorView::contiguous(host_q.data(), DType::kBF16, {checked_tokens, heads, 576});
    const auto ov = TensorView::contiguous(want_o.data(), DType::kF64, {checked_tokens, heads, 512});
    const auto lv = TensorView::contiguous(want_lse.data(), DType::kF64, {checked_tokens, heads});
    if (sparse) {
      std::vector<std::int32_t> rows(host_indices.begin() + static_cast<std::ptrdiff_t>(first_row * opt.topk),
                                     host_indices.begin() + static_cast<std::ptrdiff_t>(n) * opt.topk);
      SparseMlaPrefillParams r;
      r.q = qv;
      r.cache = cache;
      r.indices = TensorView::contiguous(rows.data(), DType::kI32, {checked_tokens, opt.topk});
      r.o = ov;
      r.lse = lv;
      r.softmax_scale = scale;
      cpu::sparse_mla_prefill(r);
    } else {  // the last checked_tokens new tokens of request 0 see exactly what they see in the batch
      std::vector<std::int32_t> r_cu = {0, checked_tokens};
      std::vector<std::int32_t> table(sets.host_tables.begin(), sets.host_tables.begin() + sets.max_pages);
      std::vector<std::int32_t> lens = {sets.host_lens[0]};
      MlaPrefillParams r;
      r.q = qv;
      r.cu_new_tokens = TensorView::contiguous(r_cu.data(), DType::kI32, {2});
      r.cache = cache;
      r.block_table = TensorView::contiguous(table.data(), DType::kI32, {1, sets.max_pages});
      r.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {1});
      r.o = ov;
      r.lse = lv;
      r.softmax_scale = scale;
      cpu::mla_prefill(r);
    }
  }

  for (const std::string& name : opt.backends) {
    BackendRow started = start_row(report, name, args, ctx.device, bytes, flops);
    if (!started.selection) continue;
    BenchRow& row = started.row;
    const Plan plan = started.backend->plan(args, ctx.device);
    row.num_splits = plan.num_splits;
    DeviceMemory workspace(plan.workspace_bytes);
    OpArgs planned = args;
    attach_plan(planned, plan, workspace);
    const auto call = [&](int) { run(*started.backend, planned, {stream}); };
    cuda_ok(cudaMemsetAsync(o.get(), 0xFF, o.bytes(), stream), "sentinel");
    cuda_ok(cudaMemsetAsync(lse.get(), 0xFF, lse.bytes(), stream), "sentinel");
    call(0);
    cuda_ok(cudaStreamSynchronize(stream), ("run " + name).c_str());
    std::string failure;
    if (opt.check_requests > 0) {
      failure = checked_rows_problem(o, lse, first_row, heads, want_o, want_lse);
    }
    finish_row(report, row, failure,
               opt.check_requests > 0 ? "pass (the last " + std::to_string(checked_tokens) + " new tokens of request 0)"
                                      : "unchecked",
               call, opt, stream);
  }
  set_speedups(report);
  return report;
}

BenchReport run_dsa_prefill_bench(const BenchOptions& opt) {
  const ModelShard shard = shard_model(model_preset(opt.model), opt.tp);
  const int heads = opt.heads > 0 ? opt.heads : shard.heads_per_gpu, hi = shard.model.indexer_heads;
  const auto scale = static_cast<float>(shard.model.softmax_scale);
  const KvDtype dtype = parse_kv_dtype(opt.kv_dtype);
  const int n = opt.new_tokens;
  if (n < 1 || n > opt.context) {
    throw Error("bench", "new_tokens", std::to_string(n), "1 .. context (" + std::to_string(opt.context) + ")");
  }
  BenchContext ctx;
  cudaStream_t stream = ctx.stream;
  const DeviceInfo& device = ctx.device;
  BenchReport& report = ctx.report;
  report.rotation_sets = 1;  // compute-bound: one set of requests, read by every call (below)

  const DevicePool pool(opt.pool, opt.page_size, dtype, true, opt.seed, stream);
  const RequestSets sets = make_request_sets(pool, 1, opt.batch, opt.context, opt.seed);
  const std::int64_t t_total = static_cast<std::int64_t>(opt.batch) * n;
  const std::size_t q_elems = static_cast<std::size_t>(t_total) * heads * 576;
  const std::size_t o_elems = static_cast<std::size_t>(t_total) * heads * 512;
  const std::size_t lse_elems = static_cast<std::size_t>(t_total) * heads;
  std::vector<std::uint8_t> host_qi(static_cast<std::size_t>(t_total) * hi * 128);
  std::vector<float> host_w(static_cast<std::size_t>(t_total) * hi);
  random_indexer_queries(opt.seed, hi, host_qi, host_w);
  std::vector<std::int32_t> cu(static_cast<std::size_t>(opt.batch) + 1);
  for (int b = 0; b <= opt.batch; ++b) cu[static_cast<std::size_t>(b)] = b * n;
  DeviceMemory q(q_elems * 2), o(o_elems * 2), lse(lse_elems * 4), qi(host_qi.size()), w(host_w.size() * 4),
      d_cu(cu.size() * 4);
  launch_random_bf16(q.get<std::uint16_t>(), q_elems, opt.seed * 7 + 3, 1.0f, stream);
  cuda_ok(cudaMemcpy(qi.get(), host_qi.data(), host_qi.size(), cudaMemcpyHostToDevice), "q_idx");
  cuda_ok(cudaMemcpy(w.get(), host_w.data(), host_w.size() * 4, cudaMemcpyHostToDevice), "weights");
  cuda_ok(cudaMemcpy(d_cu.get(), cu.data(), cu.size() * 4, cudaMemcpyHostToDevice), "cu");

  const Device gpu = Device::cuda();
  DsaPrefillParams p;
  p.q = TensorView::contiguous(q.get(), DType::kBF16, {t_total, heads, 576}, gpu);
  p.q_idx = TensorView::contiguous(qi.get(), DType::kFP8E4M3, {t_total, hi, 128}, gpu);
  p.weights = TensorView::contiguous(w.get(), DType::kF32, {t_total, hi}, gpu);
  p.cu_new_tokens = TensorView::contiguous(d_cu.get(), DType::kI32, {opt.batch + 1}, gpu);
  p.cache = pool.cache();
  p.indexer = pool.indexer();
  p.block_table = TensorView::contiguous(const_cast<std::int32_t*>(sets.table(0)), DType::kI32,
                                         {opt.batch, sets.max_pages}, gpu);
  p.seq_lens = TensorView::contiguous(const_cast<std::int32_t*>(sets.lengths(0)), DType::kI32, {opt.batch}, gpu);
  p.o = TensorView::contiguous(o.get(), DType::kBF16, {t_total, heads, 512}, gpu);
  p.lse = TensorView::contiguous(lse.get(), DType::kF32, {t_total, heads}, gpu);
  p.softmax_scale = scale;
  p.topk = opt.topk;

  double pairs = 0, attended = 0;  // (new token, visible token) and (new token, selected token) pairs
  for (int j = 0; j < n; ++j) {
    const double visible = static_cast<double>(opt.context - n + j + 1);
    pairs += visible;
    attended += std::min<double>(visible, opt.topk);
  }
  pairs *= opt.batch;
  attended *= opt.batch;
  // Each request's indexer keys once; of its main cache entries, those the new tokens select, each
  // once: the selection is made on the GPU, so this counts the least that can be, the largest new
  // token's selection (min(context, topk)); q, q_idx, w, o and lse. The logits and the slots stay in
  // the workspace.
  const double selected_entries = std::min<double>(static_cast<double>(opt.context), opt.topk) * opt.batch;
  const double bytes = static_cast<double>(opt.batch) * opt.context * kIndexerTokenBytes +
                       selected_entries * static_cast<double>(kv_token_bytes(dtype)) + 2.0 * q_elems +
                       static_cast<double>(host_qi.size()) + 4.0 * host_w.size() + 2.0 * o_elems + 4.0 * lse_elems;
  report.rotation_cold = bytes >= 2.0 * static_cast<double>(ctx.l2_bytes);  // else some of it stays in the L2
  const double flops = 2.0 * hi * 128.0 * pairs + 2.0 * heads * (576 + 512) * attended;

  // Host copies for the reference: both caches, request 0's table, the checked tokens' queries.
  const int checked_tokens = opt.check_requests > 0 ? std::min(2, n) : 0;
  const std::size_t first_row = static_cast<std::size_t>(n - checked_tokens);
  const std::vector<std::int32_t> table(sets.host_tables.begin(), sets.host_tables.begin() + sets.max_pages);
  std::vector<std::uint8_t> host_latent, host_indexer;
  std::vector<std::uint16_t> host_q(static_cast<std::size_t>(checked_tokens) * heads * 576);
  std::vector<std::vector<float>> want_logits;
  if (checked_tokens > 0) {
    host_latent.resize(pool.latent_bytes.bytes());
    host_indexer.resize(pool.indexer_bytes.bytes());
    cuda_ok(cudaMemcpy(host_latent.data(), pool.latent_bytes.get(), host_latent.size(), cudaMemcpyDeviceToHost), "pool");
    cuda_ok(cudaMemcpy(host_indexer.data(), pool.indexer_bytes.get(), host_indexer.size(), cudaMemcpyDeviceToHost),
            "indexer");
    cuda_ok(cudaMemcpy(host_q.data(), q.get<std::uint16_t>() + first_row * heads * 576, host_q.size() * 2,
                       cudaMemcpyDeviceToHost), "q");
    IndexerCache host_cache = pool.indexer();
    host_cache.data = host_indexer.data();
    host_cache.device = Device::cpu();
    for (int c = 0; c < checked_tokens; ++c) {
      const std::size_t row = first_row + static_cast<std::size_t>(c);
      want_logits.push_back(reference_token_logits(host_cache, table.data(), sets.max_pages,
                                                   host_qi.data() + row * hi * 128, host_w.data() + row * hi, hi,
                                                   static_cast<std::int32_t>(opt.context - n + row + 1)));
    }
  }

  const Backend* cuda = find_backend("cuda");
  SparseMlaPrefillParams shape;  // the sparse step's shapes, for select()
  shape.q = p.q;
  shape.cache = p.cache;
  shape.indices = TensorView::contiguous(nullptr, DType::kI32, {t_total, opt.topk}, gpu);
  for (const std::string& name : opt.backends) {
    // The indexer prefill on cuda, the sparse step on the named backend (cuda or a cast baseline).
    BackendRow started = start_row(report, name, shape, device, bytes, flops);
    if (!started.selection) continue;
    BenchRow& row = started.row;
    DsaBackends backends = same_backend(*cuda);
    backends.sparse_prefill = started.backend;
    const DsaPrefillPlan plan = plan_dsa_prefill(backends, p, device);
    row.kernel = "indexer_prefill + " + row.kernel;
    row.num_splits = plan.sparse.num_splits;
    DeviceMemory workspace(plan.workspace_bytes);
    DsaPrefillParams planned = p;
    planned.workspace = workspace.get();
    planned.workspace_bytes = workspace.bytes();
    const auto call = [&](int) { dsa_prefill(backends, planned, plan, {stream}, device); };
    cuda_ok(cudaMemsetAsync(o.get(), 0xFF, o.bytes(), stream), "sentinel");
    cuda_ok(cudaMemsetAsync(lse.get(), 0xFF, lse.bytes(), stream), "sentinel");
    call(0);
    cuda_ok(cudaStreamSynchronize(stream), ("run " + name).c_str());
    std::string failure;
    if (checked_tokens > 0) {
      // The checked tokens' index rows must be a top-k of the reference's logits (up to near ties),
      // and o/lse the reference's sparse prefill over exactly those rows.
      const DsaPrefillSteps steps = dsa_prefill_steps(planned, plan);
      std::vector<std::int32_t> slots(static_cast<std::size_t>(checked_tokens) * opt.topk);
      cuda_ok(cudaMemcpy(slots.data(), steps.indexer.slots.as<std::int32_t>() + first_row * opt.topk,
                         slots.size() * 4, cudaMemcpyDeviceToHost), "slots");
      for (int c = 0; c < checked_tokens && failure.empty(); ++c) {
        failure = topk_row_problem_near(want_logits[static_cast<std::size_t>(c)], table.data(), opt.page_size,
                                        slots.data() + static_cast<std::size_t>(c) * opt.topk, opt.topk);
        if (!failure.empty()) failure = "index row of new token " + std::to_string(first_row + c) + ": " + failure;
      }
      if (failure.empty()) {
        std::vector<double> want_o(static_cast<std::size_t>(checked_tokens) * heads * 512),
            want_lse(static_cast<std::size_t>(checked_tokens) * heads);
        SparseMlaPrefillParams r;
        r.q = TensorView::contiguous(host_q.data(), DType::kBF16, {checked_tokens, heads, 576});
        r.cache = pool.cache();
        r.cache.data = host_latent.data();
        r.cache.device = Device::cpu();
        r.indices = TensorView::contiguous(slots.data(), DType::kI32, {checked_tokens, opt.topk});
        r.o = TensorView::contiguous(want_o.data(), DType::kF64, {checked_tokens, heads, 512});
        r.lse = TensorView::contiguous(want_lse.data(), DType::kF64, {checked_tokens, heads});
        r.softmax_scale = scale;
        cpu::sparse_mla_prefill(r);
        failure = checked_rows_problem(o, lse, first_row, heads, want_o, want_lse);
      }
    }
    finish_row(report, row, failure,
               checked_tokens > 0 ? "pass (the last " + std::to_string(checked_tokens) +
                                        " new tokens of request 0: index rows, o and lse)"
                                  : "unchecked",
               call, opt, stream);
  }
  set_speedups(report);
  return report;
}

}  // namespace latentkv::tools
