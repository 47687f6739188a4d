// tools/bench_cli.hpp - the command line of `latentkv bench` and what it prints: its options, the
// checks made of them before a GPU is looked for, the side-by-side table, the JSON and the repro
// line. Plain C++ (no CUDA), shared by the program and its unit tests (tests/cpu/bench_cli_test.cpp).
#pragma once

#include <CLI/CLI.hpp>

#include <set>
#include <string>

#include "bench.hpp"

namespace latentkv::tools {

// Adds bench's options to `cmd`, each writing into `options` (which must outlive the parse), with
// their bounds.
void add_bench_options(CLI::App& cmd, BenchOptions& options);

// The options typed on `cmd`'s parsed command line, by their long names ("--topk").
std::set<std::string> given_options(const CLI::App& cmd);

// What the command line can get wrong, checked before anything runs: throws latentkv::Error naming
// the option, the value and what was expected. That includes an option the op does not read, typed
// (in `given`, even at its default value) or set away from its default (--kv-dtype bf16 with an op
// that reads fp8 caches only, --topk with a dense op, --q-len with a prefill op ...), and a --pool
// that cannot hold one set of --batch requests of --context tokens. A typed --check-requests must
// fit the batch (its default adapts to it).
void check_bench_options(const BenchOptions& options, const std::set<std::string>& given);

// A `latentkv bench ...` line that runs the same measurement again: the options the op reads
// (--q-len or --new-tokens, --topk, --splits and --kv-dtype only for the ops that take them;
// --heads, --context-min and --check-requests only when given), and no --json.
std::string repro_line(const BenchOptions& options);

// The report as printed: the device, the ceilings and least call of the run, the shape, one row per
// backend (dashes and the reason for an untimed one), the share of the matrix rate where measured,
// and the repro line.
std::string format_report(const BenchOptions& options, const BenchReport& report);

// The same report as JSON (pretty-printed, newline-terminated): the repro line as "command", the
// ceilings, the shape, and per row its bytes and FLOPs, and its timing only when it was timed.
std::string report_json(const BenchOptions& options, const BenchReport& report);

}  // namespace latentkv::tools
