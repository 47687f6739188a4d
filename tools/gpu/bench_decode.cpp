// tools/gpu/bench_decode.cpp - `latentkv bench`: dense (or sparse) MLA decode of the backends side by
// side on the same pool, same requests, same queries, each output checked before it is timed.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <random>
#include <span>
#include <stdexcept>
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
#include "latentkv/error.hpp"
#include "latentkv/model.hpp"

namespace latentkv::tools {

using namespace gpu;

namespace {

// Host copy of the pool's bytes for the pages of the checked requests, and the reference outputs.
struct Reference {
  std::vector<double> o, lse;  // [checked, q_len, H, 512], [checked, q_len, H]
};

// The float64 reference of the first `checked` requests, from a host copy of the whole pool (the very
// bytes the GPU read); `indices` (sparse) holds set 0's index rows [B, q_len, topk], else empty.
Reference reference_for(const DevicePool& pool, const RequestSets& sets, int checked, const std::vector<std::uint16_t>& q,
                        int q_len, int heads, float scale, const std::vector<std::int32_t>& indices, int topk) {
  std::vector<std::uint8_t> bytes(pool.latent_bytes.bytes());
  cuda_ok(cudaMemcpy(bytes.data(), pool.latent_bytes.get(), bytes.size(), cudaMemcpyDeviceToHost), "pool download");
  LatentCache cache = pool.cache();
  cache.data = bytes.data();
  cache.device = Device::cpu();
  std::vector<std::uint16_t> q_checked(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(checked) * q_len * heads * 576);
  Reference r;
  r.o.resize(static_cast<std::size_t>(checked) * q_len * heads * 512);
  r.lse.resize(static_cast<std::size_t>(checked) * q_len * heads);
  const TensorView q_view = TensorView::contiguous(q_checked.data(), DType::kBF16, {checked, q_len, heads, 576});
  const TensorView o_view = TensorView::contiguous(r.o.data(), DType::kF64, {checked, q_len, heads, 512});
  const TensorView lse_view = TensorView::contiguous(r.lse.data(), DType::kF64, {checked, q_len, heads});
  if (!indices.empty()) {
    std::vector<std::int32_t> rows(indices.begin(), indices.begin() + static_cast<std::ptrdiff_t>(checked) * q_len * topk);
    SparseMlaDecodeParams p;
    p.q = q_view;
    p.cache = cache;
    p.indices = TensorView::contiguous(rows.data(), DType::kI32, {checked, q_len, topk});
    p.o = o_view;
    p.lse = lse_view;
    p.softmax_scale = scale;
    cpu::sparse_mla_decode(p);
    return r;
  }
  std::vector<std::int32_t> table(sets.host_tables.begin(), sets.host_tables.begin() + static_cast<std::ptrdiff_t>(checked) * sets.max_pages);
  std::vector<std::int32_t> lens(sets.host_lens.begin(), sets.host_lens.begin() + checked);
  MlaDecodeParams p;
  p.q = q_view;
  p.cache = cache;
  p.block_table = TensorView::contiguous(table.data(), DType::kI32, {checked, sets.max_pages});
  p.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {checked});
  p.o = o_view;
  p.lse = lse_view;
  p.softmax_scale = scale;
  cpu::mla_decode(p);
  return r;
}

}  // namespace

BenchReport run_decode_bench(const BenchOptions& opt) {
  const ModelShard shard = shard_model(model_preset(opt.model), opt.tp);
  const int heads = opt.heads > 0 ? opt.heads : shard.heads_per_gpu;
  const auto scale = static_cast<float>(shard.model.softmax_scale);
  const KvDtype dtype = parse_kv_dtype(opt.kv_dtype);
  if (opt.context < opt.q_len) throw Error("bench", "context", std::to_string(opt.context), ">= q_len");

  BenchContext ctx;
  const DeviceInfo& device = ctx.device;
  cudaStream_t stream = ctx.stream;
  BenchReport& report = ctx.report;

  const bool sparse = opt.op == "sparse_mla_decode";
  const DevicePool pool(opt.pool, opt.page_size, dtype, false, opt.seed, stream);
  const std::int64_t token_bytes = static_cast<std::int64_t>(kv_token_bytes(dtype));
  // Each request's length: the context, or (--context-min, a mixed batch) drawn uniformly from
  // [context_min, context], the same draw in every rotation set.
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(opt.batch), opt.context);
  if (opt.context_min > 0) {
    if (opt.context_min < opt.q_len) throw Error("bench", "context_min", std::to_string(opt.context_min), ">= q_len");
    std::mt19937_64 rng(opt.seed * 31 + 7);
    std::uniform_int_distribution<std::int64_t> draw(opt.context_min, opt.context);
    for (std::int64_t& length : lengths) length = draw(rng);
  }
  // (query row, token) pairs: every visible token (dense) or every selected one (sparse) of each row.
  double attended = 0;
  for (const std::int64_t length : lengths) {
    for (int i = 0; i < opt.q_len; ++i) {
      const double visible = static_cast<double>(length - opt.q_len + i + 1);
      attended += sparse ? std::min<double>(visible, opt.topk) : visible;
    }
  }
  // Entries each call reads: a dense request's tokens once (its q_len rows share them); for the
  // rotation, at most each sparse row's selected ones (the bytes credited below count those of a
  // request once).
  const std::int64_t cached = std::accumulate(lengths.begin(), lengths.end(), std::int64_t{0});
  const std::int64_t bytes_per_call = (sparse ? static_cast<std::int64_t>(attended) : cached) * token_bytes;
  // A set of requests per rotation for dense calls, which read all of them; sparse ones read only
  // their index rows, so their rotations share fewer sets of requests (pool.hpp).
  const std::int64_t fits = request_sets_that_fit(pool.num_pages * pool.page_size, cached, opt.batch, opt.page_size);
  const Rotation rotation = plan_rotation(bytes_per_call, ctx.l2_bytes, opt.warmup + opt.iters, sparse ? kAnySets : fits);
  const int variants = rotation.sets;
  const RequestSets sets =
      make_request_sets(pool, static_cast<int>(std::clamp<std::int64_t>(fits, 1, variants)), lengths, opt.seed);
  report.rotation_sets = variants;
  // Sparse variants over the same requests share the tokens both select: few when each selects at
  // most an eighth of them, and those requests' entries together hold at least twice the L2 (else
  // they all stay in it).
  const double shared_bytes = static_cast<double>(std::min(sets.sets, variants)) * cached * token_bytes;
  report.rotation_cold = rotation.cold && (sets.sets == variants || (8 * opt.topk <= opt.context &&
                                                                      shared_bytes >= 2.0 * ctx.l2_bytes));
  if (sets.sets < variants) report.request_sets = sets.sets;

  // Queries, outputs (and index rows), one set per rotation.
  const std::size_t q_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * heads * 576;
  const std::size_t o_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * heads * 512;
  const std::size_t lse_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * heads;
  const std::size_t index_elems = sparse ? static_cast<std::size_t>(opt.batch) * opt.q_len * opt.topk : 0;
  DeviceMemory q(q_elems * 2 * variants), o(o_elems * 2 * variants), lse(lse_elems * 4 * variants);
  launch_random_bf16(q.get<std::uint16_t>(), q_elems * variants, opt.seed * 7 + 3, 1.0f, stream);
  std::vector<std::uint16_t> host_q(q_elems);
  cuda_ok(cudaMemcpy(host_q.data(), q.get(), q_elems * 2, cudaMemcpyDeviceToHost), "q download");
  std::vector<std::int32_t> host_indices;
  DeviceMemory indices;
  if (sparse) {
    host_indices = random_index_rows(sets, variants, opt.q_len, opt.topk, opt.context, opt.page_size, opt.seed * 13 + 5);
    indices = DeviceMemory(host_indices.size() * 4);
    cuda_ok(cudaMemcpy(indices.get(), host_indices.data(), host_indices.size() * 4, cudaMemcpyHostToDevice), "indices");
  }

  auto params_for = [&](int set) -> OpArgs {
    const TensorView qv = TensorView::contiguous(q.get<std::uint16_t>() + set * q_elems, DType::kBF16,
                                                 {opt.batch, opt.q_len, heads, 576}, Device::cuda());
    const TensorView ov = TensorView::contiguous(o.get<std::uint16_t>() + set * o_elems, DType::kBF16,
                                                 {opt.batch, opt.q_len, heads, 512}, Device::cuda());
    const TensorView lv = TensorView::contiguous(lse.get<float>() + set * lse_elems, DType::kF32,
                                                 {opt.batch, opt.q_len, heads}, Device::cuda());
    if (sparse) {
      SparseMlaDecodeParams p;
      p.q = qv;
      p.cache = pool.cache();
      p.indices = TensorView::contiguous(indices.get<std::int32_t>() + set * index_elems, DType::kI32,
                                         {opt.batch, opt.q_len, opt.topk}, Device::cuda());
      p.o = ov;
      p.lse = lv;
      p.softmax_scale = scale;
      p.num_splits = opt.splits;  // asked of the plan (0: its own choice)
      return p;
    }
    MlaDecodeParams p;
    p.q = qv;
    p.cache = pool.cache();
    p.block_table = TensorView::contiguous(const_cast<std::int32_t*>(sets.table(set % sets.sets)), DType::kI32,
                                           {opt.batch, sets.max_pages}, Device::cuda());
    p.seq_lens = TensorView::contiguous(const_cast<std::int32_t*>(sets.lengths(set % sets.sets)), DType::kI32,
                                        {opt.batch}, Device::cuda());
    p.o = ov;
    p.lse = lv;
    p.softmax_scale = scale;
    p.num_splits = opt.splits;
    return p;
  };

  // Work the op must do: each entry a request's rows read once (a dense request's tokens, the
  // distinct ones a sparse request's rows select: set 0's), the queries, index rows and outputs;
  // 2 H (576 + 512) FLOP per (query row, token) pair.
  const double entries = sparse ? static_cast<double>(distinct_selected_entries(
                                      std::span(host_indices).first(index_elems), opt.q_len, opt.topk,
                                      pool.num_pages * pool.page_size))
                                : static_cast<double>(cached);
  const double flops = 2.0 * heads * (576 + 512) * attended;
  const double bytes = entries * token_bytes + 2.0 * q_elems + 2.0 * o_elems + 4.0 * lse_elems +
                       4.0 * static_cast<double>(index_elems);

  const int checked = std::min(opt.check_requests, opt.batch);
  Reference ref;
  bool have_ref = false;

  for (const std::string& name : opt.backends) {
    BenchRow row;
    row.backend = name;
    row.bytes = bytes;
    row.flops = flops;
    const Backend* backend = find_backend(name);
    if (backend == nullptr) {
      row.status = "unsupported: no backend named '" + name + "'";
      report.rows.push_back(row);
      continue;
    }
    const OpArgs p0 = params_for(0);
    const Selection sel = backend->select(problem_of(p0, device));
    if (!sel) {
      row.status = "unsupported: " + sel.reason;
      report.rows.push_back(row);
      continue;
    }
    row.kernel = sel.kernel->name;
    const Plan plan = backend->plan(p0, device);
    row.num_splits = plan.num_splits;
    DeviceMemory workspace(plan.workspace_bytes);
    auto call = [&](int i) {
      OpArgs args = params_for(i % variants);
      attach_plan(args, plan, workspace);
      run(*backend, args, {stream});  // as a caller of the library launches it (the row's host time)
    };

    // Check first: the outputs of set 0 against the float64 reference.
    cuda_ok(cudaMemsetAsync(o.get(), 0xFF, o_elems * 2, stream), "sentinel");
    cuda_ok(cudaMemsetAsync(lse.get(), 0xFF, lse_elems * 4, stream), "sentinel");
    call(0);
    cuda_ok(cudaStreamSynchronize(stream), ("run " + name).c_str());
    if (checked > 0) {
      if (!have_ref) {
        ref = reference_for(pool, sets, checked, host_q, opt.q_len, heads, scale, host_indices, opt.topk);
        have_ref = true;
      }
      std::vector<std::uint16_t> got_o(ref.o.size());
      std::vector<float> got_lse(ref.lse.size());
      cuda_ok(cudaMemcpy(got_o.data(), o.get(), got_o.size() * 2, cudaMemcpyDeviceToHost), "o download");
      cuda_ok(cudaMemcpy(got_lse.data(), lse.get(), got_lse.size() * 4, cudaMemcpyDeviceToHost), "lse download");
      const AttentionCheck c = check_attention(got_o, got_lse, ref.o, ref.lse);
      if (!c.ok) {
        row.status = "FAIL: " + c.detail;
        report.rows.push_back(row);
        continue;  // no timing for an output that failed its check
      }
      char status[96];
      std::snprintf(status, sizeof status, "pass (%d requests; o 1-cos %.1e)", checked, c.one_minus_cos);
      row.status = status;
    } else {
      row.status = "unchecked";
    }

    take_timing(row, time_calls(call, opt.warmup, opt.iters, stream, launch_of(opt)), report, opt);
    report.rows.push_back(row);
  }
  set_speedups(report);
  return report;
}

}  // namespace latentkv::tools
