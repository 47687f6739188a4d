// tools/gpu/bench_dsa.cpp - `latentkv bench --op topk` and `--op dsa_decode`: the GPU top-k alone,
// and one layer's whole DSA decode (indexer logits -> top-k -> sparse decode) with the sparse step
// on each named backend. Outputs are checked first; both are timed as CUDA graph replays, the way
// a decode step runs.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <random>
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
#include "latentkv/dsa.hpp"
#include "latentkv/error.hpp"
#include "latentkv/model.hpp"

namespace latentkv::tools {

using namespace gpu;

namespace {

// Host block tables [sets, batch, max_pages] of requests of `length` tokens over a shuffled pool.
struct HostTables {
  int max_pages = 0;
  std::vector<std::int32_t> tables, lens;
};
HostTables host_tables(std::int64_t pool_pages, int page_size, int sets, int batch, std::int64_t length,
                       std::uint64_t seed) {
  PageAllocator allocator(pool_pages, page_size, seed | 1);
  HostTables h;
  h.max_pages = static_cast<int>(std::max<std::int64_t>(1, allocator.pages_for(length)));
  for (int s = 0; s < sets; ++s) {
    std::vector<RequestId> ids;
    for (int b = 0; b < batch; ++b) {
      ids.push_back(allocator.add_request());
      allocator.grow(ids.back(), length);
    }
    const auto t = allocator.block_table_matrix(ids, h.max_pages);
    h.tables.insert(h.tables.end(), t.begin(), t.end());
    for (int b = 0; b < batch; ++b) h.lens.push_back(static_cast<std::int32_t>(length));
  }
  return h;
}

template <typename T>
DeviceMemory upload(const std::vector<T>& v) {
  DeviceMemory d(v.size() * sizeof(T));
  cuda_ok(cudaMemcpy(d.get(), v.data(), d.bytes(), cudaMemcpyHostToDevice), "upload");
  return d;
}

std::int64_t visible_of(std::int64_t length, int q_len, int i) { return std::max<std::int64_t>(0, length - q_len + i + 1); }

}  // namespace

BenchReport run_topk_bench(const BenchOptions& opt) {
  BenchContext ctx;
  cudaStream_t stream = ctx.stream;
  BenchReport& report = ctx.report;
  report.timing = "CUDA graph replays";

  const std::int64_t rows = static_cast<std::int64_t>(opt.batch) * opt.q_len;
  const std::int64_t bytes_per_call = rows * opt.context * 4;
  const std::int64_t pool_pages = (opt.pool + opt.page_size - 1) / opt.page_size;
  // The logits are the top-k's input, a buffer of their own per rotation set; the sets share the block
  // tables of as many sets of requests as the pool holds (a call reads a few kB of them).
  const Rotation rotation = plan_rotation(bytes_per_call, ctx.l2_bytes, opt.warmup + opt.iters, kAnySets);
  report.rotation_sets = rotation.sets;
  report.rotation_cold = rotation.cold;
  const int sets = rotation.sets;
  const int table_sets = static_cast<int>(
      std::clamp<std::int64_t>(request_sets_that_fit(pool_pages * opt.page_size, opt.batch * opt.context, opt.batch,
                                                     opt.page_size),
                               1, sets));
  const HostTables h = host_tables(pool_pages, opt.page_size, table_sets, opt.batch, opt.context, opt.seed);
  const DeviceMemory tables = upload(h.tables), lens = upload(h.lens);

  // Logits like the indexer's: normal values, -inf where a row cannot see (causal rows).
  std::vector<float> logits(static_cast<std::size_t>(sets * rows * opt.context));
  std::mt19937_64 rng(opt.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t r = 0; r < logits.size() / static_cast<std::size_t>(opt.context); ++r) {
    const std::int64_t visible = visible_of(opt.context, opt.q_len, static_cast<int>(r % static_cast<std::size_t>(opt.q_len)));
    for (std::int64_t t = 0; t < opt.context; ++t) {
      logits[r * static_cast<std::size_t>(opt.context) + static_cast<std::size_t>(t)] = t < visible ? normal(rng) : -INFINITY;
    }
  }
  const DeviceMemory d_logits = upload(logits);
  DeviceMemory slots(static_cast<std::size_t>(sets * rows * opt.topk) * 4);

  auto params_for = [&](int set) {
    TopkParams p;
    p.logits = TensorView::contiguous(d_logits.get<float>() + set * rows * opt.context, DType::kF32,
                                      {opt.batch, opt.q_len, opt.context}, Device::cuda());
    const int t = set % table_sets;
    p.block_table = TensorView::contiguous(tables.get<std::int32_t>() + static_cast<std::size_t>(t) * opt.batch * h.max_pages,
                                           DType::kI32, {opt.batch, h.max_pages}, Device::cuda());
    p.seq_lens = TensorView::contiguous(lens.get<std::int32_t>() + t * opt.batch, DType::kI32, {opt.batch}, Device::cuda());
    p.page_size = opt.page_size;
    p.k = opt.topk;
    p.slots = TensorView::contiguous(slots.get<std::int32_t>() + set * rows * opt.topk, DType::kI32,
                                     {opt.batch, opt.q_len, opt.topk}, Device::cuda());
    return p;
  };
  double visible_total = 0;
  for (int i = 0; i < opt.q_len; ++i) visible_total += static_cast<double>(visible_of(opt.context, opt.q_len, i));
  const double bytes = 4.0 * visible_total * opt.batch + 4.0 * static_cast<double>(rows) * opt.topk;

  for (const std::string& name : opt.backends) {
    const TopkParams p0 = params_for(0);
    BackendRow started = start_row(report, name, p0, ctx.device, bytes, 0.0);
    if (!started.selection) continue;
    const Selection& sel = started.selection;
    BenchRow& row = started.row;
    const Plan plan = started.backend->plan(p0, ctx.device);
    DeviceMemory workspace(plan.workspace_bytes);
    auto call = [&](int i) {
      TopkParams p = params_for(i % sets);
      p.workspace = workspace.get();
      p.workspace_bytes = workspace.bytes();
      sel.kernel->launch(p, {stream});
    };
    cuda_ok(cudaMemsetAsync(slots.get(), 0x7F, slots.bytes(), stream), "sentinel");
    call(0);
    cuda_ok(cudaStreamSynchronize(stream), ("run " + name).c_str());
    const int checked = std::min(opt.check_requests, opt.batch);
    std::string failure;
    std::vector<std::int32_t> got(static_cast<std::size_t>(checked) * opt.q_len * opt.topk);
    cuda_ok(cudaMemcpy(got.data(), slots.get(), got.size() * 4, cudaMemcpyDeviceToHost), "slots");
    for (int b = 0; b < checked && failure.empty(); ++b) {
      for (int i = 0; i < opt.q_len && failure.empty(); ++i) {
        const std::size_t r = static_cast<std::size_t>(b) * opt.q_len + i;
        failure = topk_row_problem(logits.data() + r * opt.context, visible_of(opt.context, opt.q_len, i),
                                   h.tables.data() + static_cast<std::size_t>(b) * h.max_pages, opt.page_size,
                                   got.data() + r * opt.topk, opt.topk);
      }
    }
    if (!failure.empty()) {
      row.status = "FAIL: " + failure;
      report.rows.push_back(row);
      continue;
    }
    row.status = checked > 0 ? "pass (" + std::to_string(checked) + " requests, exact sets)" : "unchecked";
    take_timing(row, time_graphs(call, sets, opt.warmup, opt.iters, stream, launch_of(opt)), report, opt);
    report.rows.push_back(row);
  }
  return report;
}

BenchReport run_dsa_bench(const BenchOptions& opt) {
  const ModelShard shard = shard_model(model_preset(opt.model), opt.tp);
  const int heads = opt.heads > 0 ? opt.heads : shard.heads_per_gpu;
  const int hi = shard.model.indexer_heads;
  const auto scale = static_cast<float>(shard.model.softmax_scale);
  if (opt.context < opt.q_len) throw Error("bench", "context", std::to_string(opt.context), ">= q_len");
  BenchContext ctx;
  const DeviceInfo& device = ctx.device;
  cudaStream_t stream = ctx.stream;
  BenchReport& report = ctx.report;
  report.timing = "CUDA graph replays";

  const DevicePool pool(opt.pool, opt.page_size, KvDtype::kFp8E4M3, true, opt.seed, stream);
  double visible = 0, attended = 0, selected = 0;
  for (int i = 0; i < opt.q_len; ++i) {
    const double row_selects = std::min<double>(static_cast<double>(visible_of(opt.context, opt.q_len, i)), opt.topk);
    visible += static_cast<double>(visible_of(opt.context, opt.q_len, i));
    attended += row_selects;
    selected = std::max(selected, row_selects);
  }
  // Cache bytes the layer must read: every indexer key of a request once, and its selected fp8
  // entries once (chosen on the GPU, so counted as the least they can be: the largest row's
  // selection, which the other rows' overlap; exact at q_len 1).
  const double cache_bytes = (static_cast<double>(opt.context) * kIndexerTokenBytes + selected * kFp8TokenBytes) * opt.batch;
  const Rotation rotation =
      plan_rotation(static_cast<std::int64_t>(cache_bytes), ctx.l2_bytes, opt.warmup + opt.iters,
                    request_sets_that_fit(pool.num_pages * pool.page_size, opt.batch * opt.context, opt.batch, opt.page_size));
  report.rotation_sets = rotation.sets;
  report.rotation_cold = rotation.cold;
  const RequestSets sets = make_request_sets(pool, rotation.sets, opt.batch, opt.context, opt.seed);

  const std::size_t rows = static_cast<std::size_t>(opt.batch) * opt.q_len;
  const std::size_t q_elems = rows * heads * 576, o_elems = rows * heads * 512, lse_elems = rows * heads;
  const std::size_t qi_elems = rows * hi * 128, w_elems = rows * hi;
  DeviceMemory q(q_elems * 2 * sets.sets), o(o_elems * 2 * sets.sets), lse(lse_elems * 4 * sets.sets);
  launch_random_bf16(q.get<std::uint16_t>(), q_elems * sets.sets, opt.seed * 7 + 3, 1.0f, stream);
  std::vector<std::uint16_t> host_q(q_elems);
  cuda_ok(cudaMemcpy(host_q.data(), q.get(), q_elems * 2, cudaMemcpyDeviceToHost), "q download");
  std::vector<std::uint8_t> host_qi(qi_elems * sets.sets);
  std::vector<float> host_w(w_elems * sets.sets);
  std::mt19937_64 rng(opt.seed * 3 + 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (auto& c : host_qi) c = fp8_e4m3_encode(normal(rng));
  for (auto& w : host_w) w = normal(rng) / std::sqrt(static_cast<float>(hi * 128));
  const DeviceMemory qi = upload(host_qi), w = upload(host_w);

  auto params_for = [&](int set) {
    DsaDecodeParams p;
    p.q = TensorView::contiguous(q.get<std::uint16_t>() + set * q_elems, DType::kBF16, {opt.batch, opt.q_len, heads, 576},
                                 Device::cuda());
    p.q_idx = TensorView::contiguous(qi.get<std::uint8_t>() + set * qi_elems, DType::kFP8E4M3, {opt.batch, opt.q_len, hi, 128},
                                     Device::cuda());
    p.weights = TensorView::contiguous(w.get<float>() + set * w_elems, DType::kF32, {opt.batch, opt.q_len, hi}, Device::cuda());
    p.cache = pool.cache();
    p.indexer = pool.indexer();
    p.block_table = TensorView::contiguous(const_cast<std::int32_t*>(sets.table(set)), DType::kI32,
                                           {opt.batch, sets.max_pages}, Device::cuda());
    p.seq_lens = TensorView::contiguous(const_cast<std::int32_t*>(sets.lengths(set)), DType::kI32, {opt.batch}, Device::cuda());
    p.o = TensorView::contiguous(o.get<std::uint16_t>() + set * o_elems, DType::kBF16, {opt.batch, opt.q_len, heads, 512},
                                 Device::cuda());
    p.lse = TensorView::contiguous(lse.get<float>() + set * lse_elems, DType::kF32, {opt.batch, opt.q_len, heads},
                                   Device::cuda());
    p.softmax_scale = scale;
    p.topk = opt.topk;
    p.max_len = static_cast<int>(opt.context);
    return p;
  };
  // The layer's bytes: the cache above, its inputs and outputs; the logits and slots its steps pass
  // on stay in the workspace, as a layer done in one kernel would keep them on chip.
  const double bytes = cache_bytes + 2.0 * (q_elems + o_elems) + qi_elems + 4.0 * (w_elems + lse_elems);
  const double flops = (2.0 * hi * 128 * visible + 2.0 * heads * (576 + 512) * attended) * opt.batch;

  const Backend* cuda = find_backend("cuda");
  const int checked = std::min(opt.check_requests, opt.batch);
  for (const std::string& name : opt.backends) {
    BenchRow row;
    row.backend = name;
    row.bytes = bytes;
    row.flops = flops;
    const Backend* sparse = find_backend(name);
    DsaBackends backends{cuda, cuda, sparse};
    const DsaDecodeParams p0 = params_for(0);
    DsaPlan plan;
    Selection sel = Selection::no("no backend named '" + name + "'");
    if (sparse != nullptr) {
      plan = plan_dsa_decode(backends, p0, device);
      SparseMlaDecodeParams shape;  // the sparse step's shapes, for select()
      shape.q = p0.q;
      shape.cache = p0.cache;
      shape.indices = TensorView::contiguous(nullptr, DType::kI32, {opt.batch, opt.q_len, opt.topk}, Device::cuda());
      sel = sparse->select(problem_of(shape, device));
    }
    if (!sel) {
      row.status = "unsupported: " + sel.reason;
      report.rows.push_back(row);
      continue;
    }
    row.kernel = "indexer + topk + " + sel.kernel->name;
    row.num_splits = plan.sparse.num_splits;
    // One workspace for the layer's calls (its logits and slots pass from op to op within a call, as
    // in a decode step); `workspaces[set]` one of its own per set.
    const DeviceMemory workspace = DeviceMemory::zeroed(plan.workspace_bytes);
    const auto on_workspace = [&](int set, const DeviceMemory& w) {
      DsaDecodeParams p = params_for(set % sets.sets);
      p.workspace = w.get();
      p.workspace_bytes = w.bytes();
      p.workspace_cleared = true;
      return p;
    };
    auto with_workspace = [&](int set) { return on_workspace(set, workspace); };
    auto call = [&](int i) { dsa_decode(backends, with_workspace(i), plan, {stream}, device); };

    cuda_ok(cudaMemsetAsync(o.get(), 0xFF, o_elems * 2, stream), "sentinel");
    cuda_ok(cudaMemsetAsync(lse.get(), 0xFF, lse_elems * 4, stream), "sentinel");
    {
      const DsaSteps steps = dsa_steps(with_workspace(0), plan);
      cuda_ok(cudaMemsetAsync(steps.indexer.logits.data, 0xFF, steps.indexer.logits.numel() * 4, stream), "sentinel");
      cuda_ok(cudaMemsetAsync(steps.topk.slots.data, 0xA5, steps.topk.slots.numel() * 4, stream), "sentinel");
    }
    call(0);
    cuda_ok(cudaStreamSynchronize(stream), ("run " + name).c_str());
    if (checked > 0) {
      // The logits must be the reference indexer's, the selection a top-k of them, and o/lse the
      // reference's sparse decode over exactly the slots it selected.
      const DsaSteps steps = dsa_steps(with_workspace(0), plan);
      const std::size_t checked_rows = static_cast<std::size_t>(checked) * opt.q_len;
      std::vector<float> logits(checked_rows * static_cast<std::size_t>(opt.context));
      std::vector<std::int32_t> slots(checked_rows * static_cast<std::size_t>(opt.topk));
      cuda_ok(cudaMemcpy(logits.data(), steps.indexer.logits.data, logits.size() * 4, cudaMemcpyDeviceToHost), "logits");
      cuda_ok(cudaMemcpy(slots.data(), steps.topk.slots.data, slots.size() * 4, cudaMemcpyDeviceToHost), "slots");
      std::string failure = logits_problem(pool, sets, checked, opt.q_len, hi, opt.context, host_qi.data(), host_w.data(),
                                           static_cast<const float*>(steps.indexer.logits.data));
      if (!failure.empty()) failure = "indexer logits " + failure;
      for (std::size_t r = 0; r < checked_rows && failure.empty(); ++r) {
        const int b = static_cast<int>(r / static_cast<std::size_t>(opt.q_len)), i = static_cast<int>(r % static_cast<std::size_t>(opt.q_len));
        failure = topk_row_problem(logits.data() + r * static_cast<std::size_t>(opt.context),
                                   visible_of(opt.context, opt.q_len, i),
                                   sets.host_tables.data() + static_cast<std::size_t>(b) * sets.max_pages,
                                   opt.page_size, slots.data() + r * static_cast<std::size_t>(opt.topk), opt.topk);
      }
      if (failure.empty()) {
        std::vector<std::uint8_t> bytes_host(pool.latent_bytes.bytes());
        cuda_ok(cudaMemcpy(bytes_host.data(), pool.latent_bytes.get(), bytes_host.size(), cudaMemcpyDeviceToHost), "pool");
        std::vector<double> want_o(checked_rows * heads * 512), want_lse(checked_rows * heads);
        SparseMlaDecodeParams r;
        r.q = TensorView::contiguous(host_q.data(), DType::kBF16, {checked, opt.q_len, heads, 576});
        r.cache = pool.cache();
        r.cache.data = bytes_host.data();
        r.cache.device = Device::cpu();
        r.indices = TensorView::contiguous(slots.data(), DType::kI32, {checked, opt.q_len, opt.topk});
        r.o = TensorView::contiguous(want_o.data(), DType::kF64, {checked, opt.q_len, heads, 512});
        r.lse = TensorView::contiguous(want_lse.data(), DType::kF64, {checked, opt.q_len, heads});
        r.softmax_scale = scale;
        cpu::sparse_mla_decode(r);
        std::vector<std::uint16_t> got_o(want_o.size());
        std::vector<float> got_lse(want_lse.size());
        cuda_ok(cudaMemcpy(got_o.data(), o.get(), got_o.size() * 2, cudaMemcpyDeviceToHost), "o");
        cuda_ok(cudaMemcpy(got_lse.data(), lse.get(), got_lse.size() * 4, cudaMemcpyDeviceToHost), "lse");
        failure = check_attention(got_o, got_lse, want_o, want_lse).detail;
      }
      if (!failure.empty()) {
        row.status = "FAIL: " + failure;
        report.rows.push_back(row);
        continue;
      }
      row.status = "pass (" + std::to_string(checked) + " requests: exact top-k of its logits, o and lse)";
    } else {
      row.status = "unchecked";
    }
    take_timing(row, time_graphs(call, sets.sets, opt.warmup, opt.iters, stream, launch_of(opt)), report, opt);
    report.rows.push_back(row);

    if (name == "cuda") {  // each step of the layer on its own
      // Timed alone, the top-k and the sparse decode read what the step before left in the
      // workspace: each set gets a workspace of its own, filled by a whole call, so that no timed
      // call reads another's logits or slots from L2.
      std::vector<DeviceMemory> workspaces;
      for (int set = 0; set < sets.sets; ++set) {
        workspaces.push_back(DeviceMemory::zeroed(plan.workspace_bytes));
        dsa_decode(backends, on_workspace(set, workspaces.back()), plan, {stream}, device);
      }
      cuda_ok(cudaStreamSynchronize(stream), "the parts' inputs");
      const DsaSteps steps0 = dsa_steps(on_workspace(0, workspaces[0]), plan);
      // Each part's bytes as its own bench counts them: what it reads and writes, the logits and
      // slots included.
      const double logit_bytes = 4.0 * visible * opt.batch;
      const double slot_bytes = 4.0 * static_cast<double>(rows) * opt.topk;
      struct Step {
        const char* name;
        OpArgs args;
        double bytes, flops;
      } parts[] = {
          {"  indexer_logits", steps0.indexer,
           static_cast<double>(opt.context) * kIndexerTokenBytes * opt.batch + qi_elems + 4.0 * w_elems + logit_bytes,
           2.0 * hi * 128 * visible * opt.batch},
          {"  topk", steps0.topk, logit_bytes + slot_bytes, 0.0},
          {"  sparse_decode", steps0.sparse,
           selected * kFp8TokenBytes * opt.batch + 2.0 * (q_elems + o_elems) + 4.0 * lse_elems + slot_bytes,
           2.0 * heads * (576 + 512) * attended * opt.batch},
      };
      for (int s = 0; s < 3; ++s) {
        BenchRow part;
        part.backend = parts[s].name;
        part.bytes = parts[s].bytes;
        part.flops = parts[s].flops;
        part.status = "part of the row above";
        const Selection ps = cuda->select(problem_of(parts[s].args, device));
        part.kernel = ps ? ps.kernel->name : ps.reason;
        const auto step_call = [&](int i) {
          DsaSteps st = dsa_steps(on_workspace(i, workspaces[static_cast<std::size_t>(i % sets.sets)]), plan);
          st.topk.workspace_cleared = false;  // alone: no indexer before it clears its state
          const OpArgs args = s == 0 ? OpArgs(st.indexer) : s == 1 ? OpArgs(st.topk) : OpArgs(st.sparse);
          run(*cuda, args, {stream}, device);
        };
        take_timing(part, time_graphs(step_call, sets.sets, opt.warmup, opt.iters, stream, launch_of(opt)), report, opt);
        report.rows.push_back(part);
      }
    }
  }
  set_speedups(report);
  return report;
}

}  // namespace latentkv::tools
