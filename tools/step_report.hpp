// tools/step_report.hpp - the numbers of `latentkv step`: what each op of one decode step must move
// and compute, and the gap analysis of the measured times against the floors measured in the same
// run (copy bandwidth, bf16 matrix rate, one chained kernel launch). Plain C++ without the GPU, so that the arithmetic is
// unit-tested (tests/cpu/step_report_test.cpp); both the GPU and the CPU runs fill a StepReport with
// times only, and analyze_step() derives everything else.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace latentkv::tools {

// The most requests a step runs (`latentkv step --batch`, and a saved report's shape.batch).
inline constexpr int kMaxStepBatch = 4096;

// One decode step of a model's attention on one GPU: every layer, `batch` requests of `context`
// cached tokens each (their q_len new tokens included).
struct StepShape {
  std::string model = "glm5";
  int tp = 8;
  int layers = 0;         // layers the step runs
  int model_layers = 0;   // layers of the model
  int heads = 0;          // query heads on this GPU
  int indexer_heads = 0;  // replicated on every GPU
  int topk = 2048;        // index_topk
  int batch = 1;
  std::int64_t context = 0;  // L, new tokens included
  int q_len = 1;
  std::int64_t pool_tokens = 0;  // slots of each layer's cache (whole pages)
  int page_size = 64;

  // Tokens query row i (0 .. q_len-1) of a request sees: causal among the new tokens.
  std::int64_t visible(int i) const { return context - q_len + i + 1; }
  // The model's rule: where every row sees at most index_topk tokens, the top-k keeps them all,
  // sparse attention equals dense, and dense decode serves the step.
  bool dense_is_exact() const { return context <= topk; }
};

// The ops of a step, in the order a layer runs them.
enum class StepOp : std::uint8_t { kAppend, kIndexerLogits, kTopk, kSparseDecode, kDenseDecode };
std::string_view step_op_name(StepOp op);     // "append", "indexer_logits", "topk", "sparse_decode", "dense_decode"
StepOp parse_step_op(std::string_view name);  // throws std::invalid_argument on an unknown name
// The ops of one layer: append then indexer_logits, topk, sparse_decode; or append then dense_decode.
std::vector<StepOp> step_ops(bool dense);

// What one op moves (bytes read plus written) and computes in one layer.
struct OpWork {
  double bytes = 0;        // what this strategy's op moves (a cast baseline moves more)
  double floor_bytes = 0;  // what an FP8-native op must move: the same for every strategy
  double flops = 0;
};
// `decode_backend` is the strategy's decode backend ("cuda", "reference", "gather_cast",
// "cast_full"); it changes only the decode op's bytes. The counts are in docs/step.md.
OpWork op_work(StepOp op, std::string_view decode_backend, const StepShape& shape);

// One op of a strategy, summed over the layers of the step.
struct OpResult {
  StepOp op = StepOp::kAppend;
  std::string backend, kernel;
  double us = 0, p10_us = 0, p90_us = 0;  // per step: the op in every layer (median, spread)
  double launches = 0;  // kernels and memsets per layer, counted in the op's graph; 0: not counted
  // Derived by analyze_step():
  OpWork work;       // per step (all layers)
  double share = 0;  // of the whole step's median
  double gbps = 0, tflops = 0;
  double pct_of_copy = 0, pct_of_matrix = 0;
  double floor_us = 0;  // max(floor_bytes / copy bandwidth, flops / matrix rate, layers x launch_us); 0: none
  double gap = 0;       // us / floor_us; 0: no floors
};

// One strategy: a path (sparse or dense) and the backend of its decode op.
struct StrategyResult {
  std::string name;  // as asked: "fp8", "gather_cast", "cast_full", "dense", "sparse", ...
  bool dense = false;
  std::string backend;  // decode backend
  std::string status;   // "pass (...)", "FAIL: ...", "unsupported: ...", "reference (...)"
  bool timed = false;   // never for an output that failed its check
  double step_us = 0, step_p10_us = 0, step_p90_us = 0;
  std::vector<OpResult> ops;
  // Derived by analyze_step():
  double ops_us = 0;                // sum of the ops timed one by one
  double floor_us = 0, gap = 0;     // sum of the ops' floors; step / floor
  double tokens_per_s_stream = 0;   // q_len / step: one request's tokens per second, attention alone
  double tokens_per_s_batch = 0;    // batch x the above
  double speedup_vs_cast_full = 0;  // 0 when cast_full was not timed
};

struct StepReport {
  std::string command;  // the line that reproduces the run
  std::string latentkv;  // the library that ran it: "0.1.0 (CUDA backends for sm_90a)"; "" when unknown
  std::string device;
  bool cpu_reference = false;      // host wall-clock times of the float64 reference
  std::vector<std::string> notes;  // printed above the tables
  StepShape shape;
  double read_gbps = 0, copy_gbps = 0;  // measured in the run; 0 when not measured
  double matrix_tflops = 0;             // bf16 matrix rate measured in the run; 0 when not measured
  std::string matrix_how;               // "cuBLAS bf16 8192^3, fp32 accumulate"
  // One kernel that waits for the one before it, in a graph of such kernels (chained launches, as
  // the library's), measured in the run: what each op of a layer costs at least, as it depends on
  // the op before. 0 when not measured.
  double launch_us = 0;
  int warmup = 0, iters = 0;
  std::uint64_t seed = 0;
  std::vector<StrategyResult> strategies;
};

// The least time `work` can take at these ceilings (µs): the slowest of its bytes at the copy
// bandwidth, its FLOPs at the matrix rate and `launches_us` (the dependent launches it needs at
// least); a ceiling of 0 is left out, and with all left out there is no floor (0).
double floor_us(const OpWork& work, double copy_gbps, double matrix_tflops, double launches_us = 0);

// What one step's FP8-native ops must move in all its layers (the model's path: dense where it is
// exact, else sparse), and a note for the report when that is less than twice `l2_bytes` (the
// replays after the first then find part of their inputs in the L2, and the figures read high);
// "" when it is not, or the L2's size is unknown (0).
double step_floor_bytes(const StepShape& shape);
std::string l2_residency_note(const StepShape& shape, double l2_bytes);

// Fills every derived field from the shape, the ceilings and the measured times.
void analyze_step(StepReport& report);

// The readable tables: the strategies side by side, then each timed strategy's gap table.
std::string format_report(const StepReport& report);

// JSON of the whole report (measured and derived fields; docs/step.md lists them), and back:
// parse_report_json reads the measured fields and derives the rest again. A value never measured
// (the table's "-": no floor without the ceilings, no time for a strategy not timed, ...) is null,
// and reads back as 0. parse_report_json throws std::invalid_argument naming what is missing,
// malformed or inconsistent (the field, its value and what was expected).
std::string report_json(const StepReport& report);
StepReport parse_report_json(std::string_view text);

}  // namespace latentkv::tools
