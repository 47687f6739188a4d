// tools/gpu/bench_decode.cpp - `latentkv bench --op mla_decode`: the FP8-native decode against the
// cast baselines on the same pool, same requests, same queries.
#include <cuda_runtime_api.h>

#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench.hpp"
#include "check.hpp"
#include "cpu/reference.hpp"
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

Reference reference_for(const DevicePool& pool, const RequestSets& sets, int checked, const std::vector<std::uint16_t>& q,
                        int q_len, int heads, float scale) {
  // The whole pool is brought to the host once: the reference reads the very bytes the GPU read.
  std::vector<std::uint8_t> bytes(pool.latent_bytes.bytes());
  cuda_ok(cudaMemcpy(bytes.data(), pool.latent_bytes.get(), bytes.size(), cudaMemcpyDeviceToHost), "pool download");
  LatentCache cache = pool.cache();
  cache.data = bytes.data();
  cache.device = Device::cpu();
  std::vector<std::int32_t> table(sets.host_tables.begin(), sets.host_tables.begin() + static_cast<std::ptrdiff_t>(checked) * sets.max_pages);
  std::vector<std::int32_t> lens(sets.host_lens.begin(), sets.host_lens.begin() + checked);
  std::vector<std::uint16_t> q_checked(q.begin(), q.begin() + static_cast<std::ptrdiff_t>(checked) * q_len * heads * 576);
  Reference r;
  r.o.resize(static_cast<std::size_t>(checked) * q_len * heads * 512);
  r.lse.resize(static_cast<std::size_t>(checked) * q_len * heads);
  MlaDecodeParams p;
  p.q = TensorView::contiguous(q_checked.data(), DType::kBF16, {checked, q_len, heads, 576});
  p.cache = cache;
  p.block_table = TensorView::contiguous(table.data(), DType::kI32, {checked, sets.max_pages});
  p.seq_lens = TensorView::contiguous(lens.data(), DType::kI32, {checked});
  p.o = TensorView::contiguous(r.o.data(), DType::kF64, {checked, q_len, heads, 512});
  p.lse = TensorView::contiguous(r.lse.data(), DType::kF64, {checked, q_len, heads});
  p.softmax_scale = scale;
  cpu::mla_decode(p);
  return r;
}

}  // namespace

BenchReport run_decode_bench(const BenchOptions& opt) {
  const DeviceInfo device = detect_device();
  if (device.kind != DeviceKind::kCuda) throw Error("bench", "device", "cpu", "a CUDA GPU (bench times GPU kernels)");
  const ModelShard shard = shard_model(model_preset(opt.model), opt.tp);
  const int heads = opt.heads > 0 ? opt.heads : shard.heads_per_gpu;
  const auto scale = static_cast<float>(shard.model.softmax_scale);
  const KvDtype dtype = parse_kv_dtype(opt.kv_dtype);
  if (opt.context < opt.q_len) throw Error("bench", "context", std::to_string(opt.context), ">= q_len");

  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "stream");
  cudaDeviceProp prop{};
  cuda_ok(cudaGetDeviceProperties(&prop, device.index), "properties");

  BenchReport report;
  report.device = device.name + " (sm_" + std::to_string(device.sm) + ", " + std::to_string(device.multiprocessors) + " SMs)";
  {
    const Ceilings c = measure_ceilings(std::size_t{4} << 30, device.multiprocessors, stream);
    report.read_gbps = c.read_gbps;
    report.copy_gbps = c.copy_gbps;
  }

  const DevicePool pool(opt.pool, opt.page_size, dtype, false, opt.seed, stream);
  const std::int64_t token_bytes = static_cast<std::int64_t>(kv_token_bytes(dtype));
  const std::int64_t bytes_per_call = opt.batch * opt.context * token_bytes;
  report.rotation_sets = rotation_sets(bytes_per_call, prop.l2CacheSize, pool.num_pages * pool.page_size,
                                       opt.batch * (opt.context + opt.page_size));
  const RequestSets sets = make_request_sets(pool, report.rotation_sets, opt.batch, opt.context, opt.seed);

  // Queries and outputs, one set per rotation.
  const std::size_t q_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * heads * 576;
  const std::size_t o_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * heads * 512;
  const std::size_t lse_elems = static_cast<std::size_t>(opt.batch) * opt.q_len * heads;
  DeviceMemory q(q_elems * 2 * sets.sets), o(o_elems * 2 * sets.sets), lse(lse_elems * 4 * sets.sets);
  launch_random_bf16(q.get<std::uint16_t>(), q_elems * sets.sets, opt.seed * 7 + 3, 1.0f, stream);
  std::vector<std::uint16_t> host_q(q_elems);
  cuda_ok(cudaMemcpy(host_q.data(), q.get(), q_elems * 2, cudaMemcpyDeviceToHost), "q download");

  auto params_for = [&](int set) {
    MlaDecodeParams p;
    p.q = TensorView::contiguous(q.get<std::uint16_t>() + set * q_elems, DType::kBF16,
                                 {opt.batch, opt.q_len, heads, 576}, Device::cuda());
    p.cache = pool.cache();
    p.block_table = TensorView::contiguous(const_cast<std::int32_t*>(sets.table(set)), DType::kI32,
                                           {opt.batch, sets.max_pages}, Device::cuda());
    p.seq_lens = TensorView::contiguous(const_cast<std::int32_t*>(sets.lengths(set)), DType::kI32, {opt.batch},
                                        Device::cuda());
    p.o = TensorView::contiguous(o.get<std::uint16_t>() + set * o_elems, DType::kBF16,
                                 {opt.batch, opt.q_len, heads, 512}, Device::cuda());
    p.lse = TensorView::contiguous(lse.get<float>() + set * lse_elems, DType::kF32, {opt.batch, opt.q_len, heads},
                                   Device::cuda());
    p.softmax_scale = scale;
    return p;
  };

  // Work the op must do: every visible token's bytes once, the queries and outputs; 2 H (576 + 512)
  // FLOP per attended token and query row.
  double attended = 0;
  for (int i = 0; i < opt.q_len; ++i) attended += static_cast<double>(opt.context - opt.q_len + i + 1);
  const double flops = 2.0 * heads * (576 + 512) * attended * opt.batch;
  const double bytes = static_cast<double>(bytes_per_call) + 2.0 * q_elems + 2.0 * o_elems + 4.0 * lse_elems;

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
    MlaDecodeParams p0 = params_for(0);
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
      MlaDecodeParams p = params_for(i % sets.sets);
      p.num_splits = plan.num_splits;
      p.workspace = workspace.get();
      p.workspace_bytes = workspace.bytes();
      sel.kernel->launch(p, {stream});
    };

    // Check first: the outputs of set 0 against the float64 reference.
    cuda_ok(cudaMemsetAsync(o.get(), 0xFF, o_elems * 2, stream), "sentinel");
    cuda_ok(cudaMemsetAsync(lse.get(), 0xFF, lse_elems * 4, stream), "sentinel");
    call(0);
    cuda_ok(cudaStreamSynchronize(stream), ("run " + name).c_str());
    if (checked > 0) {
      if (!have_ref) {
        ref = reference_for(pool, sets, checked, host_q, opt.q_len, heads, scale);
        have_ref = true;
      }
      std::vector<std::uint16_t> got_o(ref.o.size());
      std::vector<float> got_lse(ref.lse.size());
      cuda_ok(cudaMemcpy(got_o.data(), o.get(), got_o.size() * 2, cudaMemcpyDeviceToHost), "o download");
      cuda_ok(cudaMemcpy(got_lse.data(), lse.get(), got_lse.size() * 4, cudaMemcpyDeviceToHost), "lse download");
      const CheckResult co = check_close(
          got_o.size(), [&](std::size_t i) { return static_cast<double>(bf16_decode(got_o[i])); },
          [&](std::size_t i) { return ref.o[i]; }, 1e-3, 2.0 / 128.0, 5e-6);
      const CheckResult cl = check_close(
          got_lse.size(), [&](std::size_t i) { return static_cast<double>(got_lse[i]); },
          [&](std::size_t i) { return ref.lse[i]; }, 1e-5, 0.0, -1.0);
      if (!co.ok || !cl.ok) {
        row.status = "FAIL: o " + co.detail + "; lse " + cl.detail;
        report.rows.push_back(row);
        continue;  // no timing for an output that failed its check
      }
      row.status = "pass (" + std::to_string(checked) + " requests; o 1-cos " + std::to_string(co.one_minus_cos) + ")";
    } else {
      row.status = "unchecked";
    }

    const Timing t = time_calls(call, opt.warmup, opt.iters, stream);
    row.timed = true;
    row.median_us = t.median_us;
    row.p10_us = t.p10_us;
    row.p90_us = t.p90_us;
    row.gbps = bytes / (t.median_us * 1e3);
    row.pct_of_read = 100.0 * row.gbps / report.read_gbps;
    row.tflops = flops / (t.median_us * 1e6);
    report.rows.push_back(row);
  }
  for (BenchRow& row : report.rows) {
    for (const BenchRow& base : report.rows) {
      if (base.backend == "cast_full" && base.timed && row.timed) row.speedup = base.median_us / row.median_us;
    }
  }
  cudaStreamDestroy(stream);
  return report;
}

}  // namespace latentkv::tools
