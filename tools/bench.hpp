// tools/bench.hpp - options and result rows of `latentkv bench`.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace latentkv::tools {

struct BenchOptions {
  std::string op = "mla_decode";
  std::string model = "glm5";
  int tp = 8;
  int heads = 0;  // overrides the model's heads per GPU when > 0
  int batch = 1;
  std::int64_t context = 32768;
  std::int64_t context_min = 0;  // mla_decode: lengths drawn in [context_min, context] when > 0 (mixed batch)
  std::int64_t pool = 495000;
  int q_len = 1;
  int new_tokens = 4096;  // prefill: the newest tokens of each request that are queries
  int topk = 2048;  // index row width of sparse_mla_decode, k of topk and dsa_decode
  int page_size = 64;
  int splits = 0;   // split-KV count asked of the backends' plans (decode ops); 0: their own choice
  std::string kv_dtype = "fp8_e4m3";
  std::vector<std::string> backends = {"cuda", "gather_cast", "cast_full"};
  int warmup = 5;
  int iters = 50;
  std::string launch = "queued";  // or "paced": how the timed calls reach the GPU (gpu/measure.hpp)
  int check_requests = 2;  // requests checked against the float64 reference per backend
  std::uint64_t seed = 1;
  std::string json;

  bool operator==(const BenchOptions&) const = default;
};

struct BenchRow {
  std::string backend, kernel, status;  // status: "pass", "FAIL: ...", "unsupported: ..."
  int num_splits = 0;
  double median_us = 0, p10_us = 0, p90_us = 0;
  double bytes = 0, flops = 0;
  double gbps = 0, pct_of_read = 0, pct_of_copy = 0, tflops = 0, speedup = 0;
  double host_us = 0;  // the host's time to make one call (Timing::host_us)
  bool timed = false;
};

// Fills a row's timing columns from its median (row.bytes and row.flops already set), its GB/s
// against the read-only stream and the device copy measured in the same run.
inline void set_timing(BenchRow& row, double median_us, double p10_us, double p90_us, double read_gbps,
                       double copy_gbps) {
  row.timed = true;
  row.median_us = median_us;
  row.p10_us = p10_us;
  row.p90_us = p90_us;
  row.gbps = row.bytes / (median_us * 1e3);
  row.pct_of_read = 100.0 * row.gbps / read_gbps;
  row.pct_of_copy = 100.0 * row.gbps / copy_gbps;
  row.tflops = row.flops / (median_us * 1e6);
}

struct BenchReport {
  std::string device;
  double read_gbps = 0, copy_gbps = 0, gather_gbps = 0;
  double empty_launch_us = 0, empty_graph_us = 0;  // an empty kernel timed as the calls are (measure.hpp)
  int rotation_sets = 0;  // the sets of inputs the timed calls rotate over
  int request_sets = 0;   // the sets of requests they draw on, when fewer (sparse decode); 0: one each
  // false: some timed calls may find their inputs in the L2 (the pool held too few sets, or a
  // prefill's one set moves less than twice the L2; pool.hpp)
  bool rotation_cold = true;
  std::string timing = "stream launches";  // or "CUDA graph replays"
  double matrix_tflops = 0;                 // the matrix rate measured in the run, when the op needs it
  std::string matrix_how;
  std::vector<BenchRow> rows;
};

// Each timed row's speed-up over the table's timed cast_full row, where it has one; rows that time a
// part of the row above them (their backend indented by spaces: a dsa op's steps) get none.
inline void set_speedups(BenchReport& report) {
  const auto base = std::find_if(report.rows.begin(), report.rows.end(),
                                 [](const BenchRow& row) { return row.backend == "cast_full" && row.timed; });
  if (base == report.rows.end()) return;
  const double base_us = base->median_us;
  for (BenchRow& row : report.rows) {
    if (row.timed && !row.backend.starts_with(' ')) row.speedup = base_us / row.median_us;
  }
}

// mla_decode or sparse_mla_decode on the CUDA device; throws latentkv::Error or std::runtime_error.
BenchReport run_decode_bench(const BenchOptions& options);
// indexer_logits on the CUDA device (heads: the model's indexer heads unless --heads).
BenchReport run_indexer_bench(const BenchOptions& options);
// indexer_prefill: logits and top-k of `new_tokens` new tokens per request, next to the fp8 matrix rate.
BenchReport run_indexer_prefill_bench(const BenchOptions& options);
// topk over synthetic logits [batch, q_len, context] on the CUDA device.
BenchReport run_topk_bench(const BenchOptions& options);
// One layer's DSA decode (indexer -> top-k -> sparse decode); --backends names the sparse step's backend.
BenchReport run_dsa_bench(const BenchOptions& options);
// mla_prefill or sparse_mla_prefill: `new_tokens` new tokens per request over its cached prefix.
BenchReport run_prefill_bench(const BenchOptions& options);
// One layer's DSA prefill (indexer prefill on cuda, then sparse prefill on each --backends entry).
BenchReport run_dsa_prefill_bench(const BenchOptions& options);

}  // namespace latentkv::tools
