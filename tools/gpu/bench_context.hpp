// tools/gpu/bench_context.hpp - what every GPU benchmark starts with: the device (a CUDA GPU or an
// error), a stream, the L2 size, and the bandwidth ceilings measured at the start of the run.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <string>
#include <variant>

#include "bench.hpp"
#include "gpu/measure.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/error.hpp"

namespace latentkv::tools::gpu {

struct BenchContext {
  DeviceInfo device;
  cudaStream_t stream = nullptr;
  std::int64_t l2_bytes = 0;
  BenchReport report;  // device name and ceilings filled in

  BenchContext() {
    device = detect_device();
    if (device.kind != DeviceKind::kCuda) throw Error("bench", "device", "cpu", "a CUDA GPU (bench times GPU kernels)");
    cudaDeviceProp prop{};
    cuda_ok(cudaGetDeviceProperties(&prop, device.index), "properties");
    l2_bytes = prop.l2CacheSize;
    report.device = device.name + " (sm_" + std::to_string(device.sm) + ", " +
                    std::to_string(device.multiprocessors) + " SMs)";
    cuda_ok(cudaStreamCreate(&stream), "stream");
    Ceilings c;
    try {
      c = measure_ceilings(std::size_t{4} << 30, device.multiprocessors, stream);
    } catch (...) {  // the destructor does not run for a constructor that throws
      cudaStreamDestroy(stream);
      throw;
    }
    report.read_gbps = c.read_gbps;
    report.copy_gbps = c.copy_gbps;
    report.gather_gbps = c.gather_gbps;
    report.empty_launch_us = c.empty_launch_us;
    report.empty_graph_us = c.empty_graph_us;
  }
  BenchContext(const BenchContext&) = delete;
  BenchContext& operator=(const BenchContext&) = delete;
  ~BenchContext() {
    if (stream) cudaStreamDestroy(stream);
  }
};

// The start of backend `name`'s row for the op `args` holds: the row's backend, bytes and FLOPs,
// and the kernel the backend selects. When there is none (no such backend, or it rejects the
// shape) the row says why, goes into the report, and the returned selection is empty.
struct BackendRow {
  const Backend* backend = nullptr;
  Selection selection;
  BenchRow row;
};
inline BackendRow start_row(BenchReport& report, const std::string& name, const OpArgs& args, const DeviceInfo& device,
                            double bytes, double flops) {
  BackendRow r;
  r.row.backend = name;
  r.row.bytes = bytes;
  r.row.flops = flops;
  r.backend = find_backend(name);
  r.selection = r.backend ? r.backend->select(problem_of(args, device)) : Selection::no("no such backend");
  if (!r.selection) {
    r.row.status = "unsupported: " + r.selection.reason;
    report.rows.push_back(r.row);
  } else {
    r.row.kernel = r.selection.kernel->name;
  }
  return r;
}

// The launch mode the options ask for.
inline Launch launch_of(const BenchOptions& opt) { return opt.launch == "paced" ? Launch::kPaced : Launch::kQueued; }

// Fills a row's timing columns from `t`; notes in its status when queued calls ran before all of a
// batch were queued (the hold timed out: those calls were paced by the host).
inline void take_timing(BenchRow& row, const Timing& t, const BenchReport& report, const BenchOptions& opt) {
  set_timing(row, t.median_us, t.p10_us, t.p90_us, report.read_gbps, report.copy_gbps);
  row.host_us = t.host_us;
  row.status += pacing_note(t, launch_of(opt));
}

// Ends a row and adds it to the report: with a failed check (`failure` not empty) it says so and is
// not timed; otherwise `status` becomes its status and it is timed (opt.warmup calls, then opt.iters).
template <typename Call>
void finish_row(BenchReport& report, BenchRow row, const std::string& failure, const std::string& status, Call&& call,
                const BenchOptions& opt, cudaStream_t stream) {
  if (!failure.empty()) {
    row.status = "FAIL: " + failure;
  } else {
    row.status = status;
    take_timing(row, time_calls(call, opt.warmup, opt.iters, stream, launch_of(opt)), report, opt);
  }
  report.rows.push_back(row);
}

// Copies a plan's split count, chunk size and workspace into the op `args` holds (ops without a
// schedule ignore it).
inline void attach_plan(OpArgs& args, const Plan& plan, const DeviceMemory& workspace) {
  std::visit(
      [&](auto& p) {
        if constexpr (requires { p.num_splits; }) p.num_splits = plan.num_splits;
        if constexpr (requires { p.chunk_tokens; }) p.chunk_tokens = plan.chunk_tokens;
        if constexpr (requires { p.workspace; }) {
          p.workspace = workspace.get();
          p.workspace_bytes = workspace.bytes();
        }
      },
      args);
}

}  // namespace latentkv::tools::gpu
