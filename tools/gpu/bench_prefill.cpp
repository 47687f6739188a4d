// tools/gpu/bench_prefill.cpp - `latentkv bench --op mla_prefill` and `--op sparse_mla_prefill`:
// B requests of `context` tokens whose last `new_tokens` are the new ones (already appended), over
// the paged cache. The last two new tokens of the first request are checked against the float64
// reference before timing (the reference over every new token would take hours on a CPU).
#include <cuda_runtime_api.h>

#include <algorithm>
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
  report.rotation_sets = 1;  // compute-bound: one set of requests

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
    host_indices = random_index_rows(sets, n, opt.topk, opt.context, opt.page_size, opt.seed * 13 + 5);
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
  // The bytes an FP8-native prefill must read: each request's cached tokens once (dense) or each
  // token's selected entries (sparse: they differ per token), q, o and lse.
  const double token_bytes = static_cast<double>(kv_token_bytes(dtype));
  const double cache_bytes = sparse ? attended * token_bytes : static_cast<double>(opt.context) * opt.batch * token_bytes;
  const double bytes = cache_bytes + 2.0 * q_elems + 2.0 * o_elems + 4.0 * lse_elems;
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
    const Selection& sel = started.selection;
    BenchRow& row = started.row;
    const Plan plan = started.backend->plan(args, ctx.device);
    row.num_splits = plan.num_splits;
    DeviceMemory workspace(plan.workspace_bytes);
    OpArgs planned = args;
    attach_plan(planned, plan, workspace);
    const auto call = [&](int) { sel.kernel->launch(planned, {stream}); };
    cuda_ok(cudaMemsetAsync(o.get(), 0xFF, o.bytes(), stream), "sentinel");
    cuda_ok(cudaMemsetAsync(lse.get(), 0xFF, lse.bytes(), stream), "sentinel");
    call(0);
    cuda_ok(cudaStreamSynchronize(stream), ("run " + name).c_str());
    std::string failure;
    if (opt.check_requests > 0) {
      std::vector<std::uint16_t> got_o(want_o.size());
      std::vector<float> got_lse(want_lse.size());
      cuda_ok(cudaMemcpy(got_o.data(), o.get<std::uint16_t>() + first_row * heads * 512, got_o.size() * 2,
                         cudaMemcpyDeviceToHost), "o");
      cuda_ok(cudaMemcpy(got_lse.data(), lse.get<float>() + first_row * heads, got_lse.size() * 4,
                         cudaMemcpyDeviceToHost), "lse");
      const AttentionCheck c = check_attention(got_o, got_lse, want_o, want_lse);
      failure = c.ok ? "" : c.detail;
    }
    finish_row(report, row, failure,
               opt.check_requests > 0 ? "pass (the last " + std::to_string(checked_tokens) + " new tokens of request 0)"
                                      : "unchecked",
               call, opt, stream);
  }
  return report;
}

}  // namespace latentkv::tools
