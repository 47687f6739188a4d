// tools/step.hpp - `latentkv step`: one decode step of a whole model's attention, and where its time
// goes. What the GPU run (tools/gpu/step_gpu.cpp) and the CPU run (tools/step_cpu.cpp) share: the
// resolved run, the strategies, the synthetic requests and the random inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "progress.hpp"
#include "step_report.hpp"

namespace latentkv::tools {

// A strategy: the path of every layer (sparse: indexer -> top-k -> sparse decode; dense: dense
// decode) and the backend of its decode op. The indexer, top-k and append always run on the
// FP8-native backend ("cuda"; "reference" on the CPU).
struct StrategySpec {
  std::string name;  // as asked: "fp8", "gather_cast", "cast_full", "dense", "sparse", "dense_cast_full", ...
  bool dense = false;
  bool by_rule = false;  // the path is the model's rule (fp8, gather_cast, cast_full), not forced
  std::string backend;   // decode backend: "cuda", "gather_cast", "cast_full"
};

// Parses a strategy name: [dense_|sparse_](fp8|gather_cast|cast_full), or "dense" / "sparse" for
// the FP8-native backend on that path; without a prefix the path is the model's rule for `shape`.
// Throws latentkv::Error naming the value and the accepted names.
StrategySpec parse_strategy(const std::string& name, const StepShape& shape);

// What a run is asked to do, with every default resolved for the device it runs on.
struct StepRun {
  StepShape shape;
  std::vector<StrategySpec> strategies;
  int warmup = 0, iters = 0;
  int check_requests = 2;  // requests checked against the float64 reference (GPU run)
  bool fault_checks = false;  // GPU: every op given the step's fault record, not only the appends
  std::uint64_t seed = 1;
  bool progress = true;
  std::vector<std::string> notes;  // copied into the report
};

// `batch` requests of `context` tokens each, their pages drawn from a shuffled pool of
// shape.pool_tokens slots (one block table serves every layer, as in an engine), and the slots of
// each request's q_len new tokens (positions context - q_len .. context - 1), which the step's
// append writes.
struct StepTables {
  std::int64_t num_pages = 0;
  int max_pages = 0;
  std::vector<std::int32_t> block_table;  // [batch, max_pages] page ids, -1 padded
  std::vector<std::int32_t> seq_lens;     // [batch], all = context
  std::vector<std::int32_t> new_slots;    // [batch * q_len] physical slots
};
StepTables make_step_tables(const StepShape& shape, std::uint64_t seed);

// Approximately normal values (a sum of four uniforms, variance matched) from a counter-based
// generator: value i of stream `seed` is always the same, and filling is fast on one core.
float approx_normal(std::uint64_t seed, std::uint64_t i);
void fill_random_bf16(std::uint16_t* out, std::size_t n, std::uint64_t seed, float stddev = 1.0f);
void fill_random_fp8(std::uint8_t* out, std::size_t n, std::uint64_t seed, float stddev = 1.0f);
void fill_random_f32(float* out, std::size_t n, std::uint64_t seed, float stddev = 1.0f);

// The two runs. Both time the step of every strategy and fill the report's measured fields (the
// caller derives the rest with analyze_step). The GPU run throws latentkv::Error in a build without CUDA.
StepReport run_step_gpu(const StepRun& job);
StepReport run_step_cpu(const StepRun& job);

}  // namespace latentkv::tools
