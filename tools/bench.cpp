// `latentkv bench`: times backends side by side on one shape, next to the bandwidth ceilings
// measured in the same run, after checking each output against the float64 reference. The options,
// their checks and what is printed are in bench_cli.cpp; the timing in tools/gpu/bench_*.cpp.
#include <cstdio>
#include <memory>
#include <string>

#include "bench.hpp"
#include "bench_cli.hpp"
#include "cli_checks.hpp"
#include "commands.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/error.hpp"

namespace latentkv::tools {

void add_bench_command(CLI::App& app) {
  auto opt = std::make_shared<BenchOptions>();
  CLI::App* cmd = app.add_subcommand("bench", "Time backends side by side on one shape (needs a CUDA GPU)");
  add_bench_options(*cmd, *opt);
  cmd->callback([opt, cmd] {
    // What the command line can get wrong, checked before anything runs, then whether there is a GPU
    // to run on: exit code 2 when either is wrong.
    or_usage_error([&] {
      check_bench_options(*opt, given_options(*cmd));
      if (cmd->count("--json") > 0 && opt->json.empty()) throw Error("bench", "--json", "''", "a file name");
      if (!opt->json.empty()) check_output_path("bench", "--json", opt->json);
      if (detect_device().kind != DeviceKind::kCuda) {
        throw Error("bench", why_no_gpu() + ": bench times GPU kernels; `latentkv step --device cpu` and "
                                            "`latentkv demo` run the CPU reference");
      }
    });
    const BenchReport report = opt->op == "indexer_logits"    ? run_indexer_bench(*opt)
                               : opt->op == "indexer_prefill" ? run_indexer_prefill_bench(*opt)
                               : opt->op == "dsa_prefill"     ? run_dsa_prefill_bench(*opt)
                               : opt->op == "topk"            ? run_topk_bench(*opt)
                               : opt->op == "dsa_decode"      ? run_dsa_bench(*opt)
                               : opt->op.ends_with("prefill") ? run_prefill_bench(*opt)
                                                              : run_decode_bench(*opt);
    std::fputs(format_report(*opt, report).c_str(), stdout);
    if (!opt->json.empty()) write_output_file("bench", "--json", opt->json, report_json(*opt, report));
    for (const BenchRow& row : report.rows) {
      if (row.status.rfind("FAIL", 0) == 0) throw CLI::RuntimeError(kExitFailure);
    }
  });
}

#ifndef LKV_WITH_CUDA
BenchReport run_decode_bench(const BenchOptions&) {
  throw Error("bench", "device", "cpu", "a CUDA GPU (this build has no CUDA backends)");
}
BenchReport run_indexer_bench(const BenchOptions& options) { return run_decode_bench(options); }
BenchReport run_topk_bench(const BenchOptions& options) { return run_decode_bench(options); }
BenchReport run_dsa_bench(const BenchOptions& options) { return run_decode_bench(options); }
BenchReport run_prefill_bench(const BenchOptions& options) { return run_decode_bench(options); }
BenchReport run_indexer_prefill_bench(const BenchOptions& options) { return run_decode_bench(options); }
BenchReport run_dsa_prefill_bench(const BenchOptions& options) { return run_decode_bench(options); }
#endif

}  // namespace latentkv::tools
