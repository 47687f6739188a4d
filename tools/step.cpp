// `latentkv step`: the attention side of one decode step of a whole model on one GPU - every
// layer's append, indexer logits, top-k and sparse (or dense) decode, captured once in a CUDA graph
// and replayed - for several strategies side by side, with the gap of every op to the floors
// measured in the same run. Without a GPU it runs the CPU reference at a small default size.
// docs/step.md explains the command and the analysis.
#include "step.hpp"

#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "cli_checks.hpp"
#include "commands.hpp"
#include "core/read_file.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/environment.hpp"
#include "latentkv/error.hpp"
#include "latentkv/fp8.hpp"
#include "latentkv/model.hpp"
#include "latentkv/ops.hpp"
#include "latentkv/paging.hpp"
#include "latentkv/version.hpp"

namespace latentkv::tools {

extern const char kStepPlotScript[];  // tools/plot/step_plot.py, embedded at build time

namespace {

struct StepOptions {
  std::string model = "glm5";
  int tp = 8;
  int batch = 0;             // 0: 1 on a GPU, 2 on the CPU
  std::int64_t context = 0;  // 0: 32768 on a GPU, 3000 on the CPU
  std::int64_t pool = 0;     // tokens per layer; 0: 495000 on a GPU (more when the batch needs it)
  int q_len = 1;
  int page_size = kDefaultPageSize;
  int layers = 0;                       // 0: every layer of the model on a GPU, 4 on the CPU
  std::vector<std::string> strategies;  // empty: the default list of the device
  int warmup = -1;                      // -1: 3 on a GPU, 1 on the CPU
  int iters = 0;                        // 0: 20 on a GPU, 3 on the CPU
  int check_requests = -1;  // -1: 2, or the batch when smaller
  bool fault_checks = false;
  std::string device = "auto";
  std::uint64_t seed = 1;
  bool progress = true;
  std::string json, plot, from_json;
};

// Defaults: the yardstick shape on a GPU; on the CPU a size the float64 reference runs in a few
// seconds on two cores.
constexpr int kGpuBatch = 1, kCpuBatch = 2;
constexpr std::int64_t kGpuContext = 32768, kCpuContext = 3000;
constexpr std::int64_t kGpuPool = 495000;  // the 495K-token pool of SPEC section 6
constexpr int kCpuLayers = 4;
constexpr int kGpuWarmup = 3, kGpuIters = 20, kCpuWarmup = 1, kCpuIters = 3;
constexpr int kCheckRequests = 2;
const std::vector<std::string> kGpuStrategies = {"fp8", "gather_cast", "cast_full", "dense", "sparse"};
const std::vector<std::string> kCpuStrategies = {"fp8", "dense", "sparse"};

std::int64_t round_up(std::int64_t n, std::int64_t to) { return (n + to - 1) / to * to; }

std::string repro_line(const StepRun& run, bool cpu) {
  const StepShape& s = run.shape;
  std::vector<std::string> names;
  for (const StrategySpec& x : run.strategies) names.push_back(x.name);
  std::ostringstream os;
  os << "latentkv step --model " << s.model << " --tp " << s.tp << " --batch " << s.batch << " --context " << s.context
     << " --q-len " << s.q_len << " --pool " << s.pool_tokens << " --page-size " << s.page_size << " --layers "
     << s.layers << " --strategies " << join(names) << " --warmup " << run.warmup << " --iters " << run.iters
     << " --check-requests " << run.check_requests << (run.fault_checks ? " --fault-checks" : "") << " --seed "
     << run.seed << (cpu ? " --device cpu" : "");
  return os.str();
}

// Every default filled in for the device the run lands on, every value checked.
StepRun resolve_run(const StepOptions& o, bool cpu, bool cpu_by_default) {
  const ModelShard shard = shard_from_flags("step", o.model, o.tp);
  const ModelPreset& m = shard.model;
  if (m.layers < 1) throw Error("step", "--model", m.name, "a preset with its layer count (model.hpp: layers)");
  StepRun run;
  StepShape& s = run.shape;
  s.model = m.name;
  s.tp = o.tp;
  s.model_layers = m.layers;
  s.layers = o.layers > 0 ? o.layers : (cpu ? std::min(kCpuLayers, m.layers) : m.layers);
  s.heads = shard.heads_per_gpu;
  s.indexer_heads = m.indexer_heads;
  s.topk = m.index_topk;
  s.batch = o.batch > 0 ? o.batch : (cpu ? kCpuBatch : kGpuBatch);
  s.context = o.context > 0 ? o.context : (cpu ? kCpuContext : kGpuContext);
  s.q_len = o.q_len;
  s.page_size = o.page_size;
  if (s.layers > m.layers) {
    throw Error("step", "--layers", std::to_string(s.layers),
                "1 .. " + std::to_string(m.layers) + " (the layers of " + m.name + ")");
  }
  if (s.context < s.q_len) {
    throw Error("step", "--context", std::to_string(s.context), ">= q_len " + std::to_string(s.q_len));
  }
  check_context_in_model("step", s.context, m);
  // The pool must hold every request's pages, in whole pages of int32 slots; the default leaves
  // room as a server would.
  std::int64_t pool = o.pool;
  if (pool == 0) {
    const std::int64_t needed = pool_tokens_needed("step", s.batch, s.context, s.page_size);
    pool = std::min(max_pool_tokens(s.page_size),
                    cpu ? 2 * needed : std::max<std::int64_t>(kGpuPool, needed + needed / 8));
  } else {
    check_pool("step", pool, s.batch, s.context, s.page_size);
  }
  s.pool_tokens = round_up(pool, s.page_size);
  if (o.pool == 0 && !cpu && pool != kGpuPool) {  // in whole pages, as the header gives it
    run.notes.push_back("pool grown to " + std::to_string(s.pool_tokens) + " tokens per layer to hold the batch");
  }

  run.warmup = o.warmup >= 0 ? o.warmup : (cpu ? kCpuWarmup : kGpuWarmup);
  run.iters = o.iters > 0 ? o.iters : (cpu ? kCpuIters : kGpuIters);
  if (o.check_requests > s.batch) {
    throw Error("step", "--check-requests", std::to_string(o.check_requests),
                "at most the batch, " + std::to_string(s.batch) + " (--batch" +
                    (o.batch > 0 ? "" : std::string(", its default on the ") + (cpu ? "CPU" : "GPU")) + ")");
  }
  run.check_requests = o.check_requests >= 0 ? o.check_requests : std::min(kCheckRequests, s.batch);
  run.fault_checks = o.fault_checks;
  if (o.fault_checks) {
    run.notes.push_back(cpu ? "--fault-checks: the CPU reference checks every value anyway"
                            : "--fault-checks: every op given a fault record (its kernels' checks of lengths, pages, "
                              "slots and values timed too)");
  }
  run.seed = o.seed;
  run.progress = o.progress;

  // Strategies, in the order asked; one that runs exactly what an earlier one runs is dropped.
  const std::vector<std::string>& names = o.strategies.empty() ? (cpu ? kCpuStrategies : kGpuStrategies) : o.strategies;
  for (const std::string& name : names) {
    const StrategySpec spec = parse_strategy(name, s);
    const auto same = std::find_if(run.strategies.begin(), run.strategies.end(), [&](const StrategySpec& x) {
      return x.dense == spec.dense && x.backend == spec.backend;
    });
    if (same != run.strategies.end()) {
      if (name == same->name) {
        const std::string note = name + " is listed more than once in --strategies: the repeats are left out";
        if (std::find(run.notes.begin(), run.notes.end(), note) == run.notes.end()) run.notes.push_back(note);
      } else if (!o.strategies.empty()) {
        const std::string why =
            spec.by_rule || same->by_rule
                ? std::string(" (the model's rule picks ") + (spec.dense ? "dense" : "sparse") + " at this context)"
                : "";
        run.notes.push_back(name + " runs what " + same->name + " runs here" + why + ": left out");
      }
      continue;
    }
    run.strategies.push_back(spec);
  }

  if (cpu) {
    char buf[256];
    std::snprintf(buf, sizeof buf,
                  "%s: CPU reference (float64), %s: batch %d, context %lld, %d of %d layers; times are host wall-clock",
                  cpu_by_default ? "no GPU" : "--device cpu",
                  o.batch == 0 && o.context == 0 && o.layers == 0 ? "small default" : "size as asked", s.batch,
                  static_cast<long long>(s.context), s.layers, m.layers);
    run.notes.insert(run.notes.begin(), buf);
  }
  return run;
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Exit codes of tools/plot/step_plot.py beyond 0 (drawn) and 1 (failed).
constexpr int kPlotNoMatplotlib = 3;
constexpr int kShellNotFound = 127;

// The interpreter LATENTKV_PYTHON names; empty when it is not set (or set to nothing).
std::string chosen_python() {
  const char* chosen = std::getenv(kPythonVariable);
  return chosen ? chosen : "";
}

// Why `program` (a path, or a name looked up on the PATH as the shell would) cannot be run; empty
// when it can.
std::string not_runnable(const std::string& program) {
  namespace fs = std::filesystem;
  const auto why_not = [](const fs::path& file) -> std::string {
    std::error_code ec;
    const fs::file_status status = fs::status(file, ec);
    if (!fs::exists(status)) return "no such file";
    if (fs::is_directory(status)) return "a directory";
    if (access(file.c_str(), X_OK) != 0) return std::string("not executable: ") + std::strerror(errno);
    return "";
  };
  if (program.find('/') != std::string::npos) return why_not(program);
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (why_not(fs::path(dir.empty() ? "." : dir) / program).empty()) return "";
  }
  return "not found on the PATH";
}

// LATENTKV_PYTHON=... and what it should be, after `problem`: the user asked for that interpreter,
// so no other one is tried in its place.
std::string chosen_python_error(const std::string& python, const std::string& problem) {
  return "--plot: LATENTKV_PYTHON=" + python + " " + problem +
         "; expected a python3 with matplotlib, as a path or a command on the PATH (or unset LATENTKV_PYTHON to "
         "try python3 on the PATH, then /usr/bin/python3)";
}

// Before a run with --plot: a LATENTKV_PYTHON that cannot be run is a usage error (and then
// check_plot_python: whether an interpreter imports matplotlib).
void check_chosen_python() {
  const std::string python = chosen_python();
  if (python.empty()) return;
  if (const std::string why = not_runnable(python); !why.empty()) {
    throw Error("step", chosen_python_error(python, "cannot be run (" + why + ")"));
  }
}

// The interpreters --plot tries, in order: $LATENTKV_PYTHON alone when set, else python3 on the
// PATH, then the system's /usr/bin/python3.
std::vector<std::string> plot_pythons() {
  const std::string chosen = chosen_python();
  if (!chosen.empty()) return {chosen};
  std::vector<std::string> pythons = {"python3"};
  if (access("/usr/bin/python3", X_OK) == 0) pythons.push_back("/usr/bin/python3");
  return pythons;
}

// Before a run with --plot: one of the interpreters imports matplotlib, or the run would end with
// its data and no picture. (A saved report, --from-json, is drawn at once and says so there.)
void check_plot_python(const std::string& plot) {
  for (const std::string& python : plot_pythons()) {
    const std::string probe = "command -v " + shell_quote(python) + " >/dev/null 2>&1 && " + shell_quote(python) +
                              " -c 'import matplotlib' </dev/null >/dev/null 2>&1";
    const int status = std::system(probe.c_str());
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return;
  }
  throw Error("step", "--plot", plot,
              "a python3 that imports matplotlib (tried " + join(plot_pythons(), ", ") +
                  "): install python3-matplotlib or `python3 -m pip install matplotlib`, set LATENTKV_PYTHON, or "
                  "run with --json alone and draw later with --from-json");
}

// Runs the embedded plotting script as `python - <json> <out>` with each candidate interpreter until
// one has matplotlib: $LATENTKV_PYTHON alone when set, else python3 on the PATH, then the system's
// /usr/bin/python3 (Debian's python3-matplotlib lives there when the PATH's python3 is another one).
// Returns false after saying why and how to fix it; `kept` is the file of the run's data to redraw.
bool draw_plot(const std::string& json_path, const std::string& out_path, const std::string& kept) {
  const std::string chosen = chosen_python();
  const std::vector<std::string> pythons = plot_pythons();
  bool any_python = false;
  // The picture is drawn into a file beside out_path and renamed onto it once drawn (OutputFile), so
  // that a failed drawing leaves neither a partial picture nor an earlier run's passing for this one's.
  OutputFile out("step", "--plot", out_path, 4);
  namespace fs = std::filesystem;
  std::error_code ec;
  if (out.write_path() == out_path && fs::is_regular_file(out_path, ec)) fs::remove(out_path, ec);
  const auto drawn = [&] {
    const std::string& path = out.write_path();
    return fs::is_regular_file(path, ec) ? fs::file_size(path, ec) > 0 && !ec : fs::exists(path, ec);
  };
  for (const std::string& python : pythons) {
    const std::string command = "command -v " + shell_quote(python) + " >/dev/null 2>&1 || exit 127; exec " +
                                shell_quote(python) + " - " + shell_quote(json_path) + " " +
                                shell_quote(out.write_path());
    const int status = run_shell_with_input(command, kStepPlotScript);
    if (status == -1) continue;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (code == 0 && drawn()) {
      out.commit();
      return true;
    }
    if (code == kShellNotFound) continue;
    any_python = true;
    if (code == kPlotNoMatplotlib) continue;
    std::fprintf(stderr, "error: the plot script failed (%s, %s); the data is in %s\n", python.c_str(),
                 code == 0 ? ("exit 0 without writing " + out_path).c_str() : ("exit " + std::to_string(code)).c_str(),
                 kept.c_str());
    return false;
  }
  if (!chosen.empty()) {
    const std::string problem = any_python ? "cannot import matplotlib" : "cannot be run";
    std::fprintf(stderr, "error: step: %s\n", chosen_python_error(chosen, problem).c_str());
    if (any_python) {
      std::fprintf(stderr, "  install: %s -m pip install matplotlib (or apt-get install python3-matplotlib for the "
                   "system's python3)\n", chosen.c_str());
    }
  } else if (!any_python) {
    std::fprintf(stderr,
                 "error: --plot needs python3 with matplotlib, and no python3 was found (on the PATH, or as "
                 "/usr/bin/python3).\n"
                 "  install: apt-get install python3 python3-matplotlib (or set LATENTKV_PYTHON)\n");
  } else {
    std::fprintf(stderr,
                 "error: --plot needs matplotlib, which %s cannot import.\n"
                 "  install: apt-get install python3-matplotlib, or python3 -m pip install matplotlib\n"
                 "  (LATENTKV_PYTHON=/path/to/python picks the interpreter)\n",
                 join(pythons, " and ").c_str());
  }
  std::fprintf(stderr, "  the run's data is kept in %s; redraw it with: latentkv step --from-json %s --plot %s\n",
               kept.c_str(), kept.c_str(), out_path.c_str());
  return false;
}

// Draws the report. The script reads it from a temporary file; when drawing fails, the run's data
// stays in `json_path` (--json, or the --from-json it came from), else in that file, for a redraw.
bool plot_report(const StepReport& report, const std::string& json_path, const std::string& out_path) {
  const auto timed = [](const StrategyResult& r) { return r.timed; };
  if (std::none_of(report.strategies.begin(), report.strategies.end(), timed)) {
    std::fprintf(stderr, "error: step: --plot %s: no strategy was timed (see the table), so there is nothing to draw\n",
                 out_path.c_str());
    return false;
  }
  char name[] = "/tmp/latentkv-step-XXXXXX.json";
  const int fd = mkstemps(name, 5);
  if (fd < 0) throw Error("step", "--plot", out_path, "a writable /tmp for the run's JSON");
  close(fd);
  const std::string path = name;
  write_output_file("step", "--plot", path, report_json(report));
  const bool drawn = draw_plot(path, out_path, json_path.empty() ? path : json_path);
  if (drawn || !json_path.empty()) std::remove(path.c_str());
  if (drawn) std::printf("plot: %s\n", out_path.c_str());
  return drawn;
}

// Whether two paths name one file (which need not exist yet).
bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec_a, ec_b;
  const std::filesystem::path pa = std::filesystem::weakly_canonical(std::filesystem::absolute(a, ec_a), ec_a);
  const std::filesystem::path pb = std::filesystem::weakly_canonical(std::filesystem::absolute(b, ec_b), ec_b);
  return ec_a || ec_b ? a == b : pa == pb;
}

bool any_failed(const StepReport& r) {
  for (const StrategyResult& s : r.strategies) {
    if (s.status.rfind("FAIL", 0) == 0) return true;
  }
  return false;
}

// A saved report is a few kilobytes; a file past this is not one (and /dev/zero never ends).
constexpr std::size_t kMaxReportBytes = 16 << 20;

// Reads a saved report; what is not one is a usage error. A file without an end (/dev/zero) is
// refused rather than read until memory runs out; a pipe (/dev/stdin) is read as a file is.
StepReport load_report(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) throw Error("step", "--from-json", path, "a file (this is a directory)");
  using Read = detail::BoundedRead::Status;
  const detail::BoundedRead read = detail::read_at_most(path, kMaxReportBytes);
  if (read.status == Read::kCannotOpen) throw Error("step", "--from-json", path, "a readable file");
  if (read.status == Read::kReadFailed) throw Error("step", "--from-json", path, "a readable file (the read failed)");
  if (read.status == Read::kTooLarge) {
    throw Error("step", "--from-json", path,
                "a saved report of at most " + std::to_string(kMaxReportBytes) + " bytes (`latentkv step --json`)");
  }
  try {
    return parse_report_json(read.text);
  } catch (const std::invalid_argument& e) {
    throw Error("step", "--from-json", path, std::string("a report of `latentkv step --json` (") + e.what() + ")");
  }
}

// The options given that shape a run, which a saved report (--from-json) cannot honour.
std::vector<std::string> run_options_given(const CLI::App& cmd) {
  const std::vector<std::string> report_options = {"--from-json", "--json", "--plot", "--no-progress"};
  std::vector<std::string> given;
  for (const CLI::Option* option : cmd.get_options()) {
    const std::string name = option->get_name();
    if (option->count() > 0 && std::find(report_options.begin(), report_options.end(), name) == report_options.end()) {
      given.push_back(name);
    }
  }
  return given;
}

void run_step_command(const StepOptions& o, const CLI::App& cmd) {
  StepReport report;
  bool cpu = false;
  StepRun run;
  // Everything about the command line that can be wrong, the output files included, checked before
  // anything runs: exit code 2 when it is.
  or_usage_error([&] {
    const std::pair<const char*, const std::string*> files[] = {
        {"--json", &o.json}, {"--plot", &o.plot}, {"--from-json", &o.from_json}};
    for (const auto& [option, file] : files) {
      if (cmd.count(option) > 0 && file->empty()) throw Error("step", option, "''", "a file name");
    }
    if (!o.json.empty() && !o.plot.empty() && same_file(o.json, o.plot)) {
      throw Error("step", "--plot", o.plot, "another file than --json's (the picture would overwrite the report)");
    }
    if (!o.plot.empty()) {
      const std::string ext = o.plot.size() >= 4 ? o.plot.substr(o.plot.size() - 4) : "";
      if (ext != ".png" && ext != ".svg") throw Error("step", "--plot", o.plot, "a file name ending in .png or .svg");
      check_output_path("step", "--plot", o.plot);
      if (standard_stream_named(o.plot) >= 0) {
        throw Error("step", "--plot", o.plot, "a file other than the standard output or error (the text goes there)");
      }
      check_chosen_python();
      if (o.from_json.empty()) check_plot_python(o.plot);
    }
    if (!o.json.empty()) check_output_path("step", "--json", o.json);
    if (!o.from_json.empty()) {
      const std::vector<std::string> given = run_options_given(cmd);
      if (!given.empty()) {
        throw Error("step", "--from-json", o.from_json,
                    "no option of a run beside it (it prints a saved report; only --json, --plot and --no-progress are "
                    "taken with it), but " +
                        join(given, ", ") + (given.size() == 1 ? " was" : " were") + " given");
      }
      report = load_report(o.from_json);
      return;
    }
    const bool have_gpu = detect_device().kind == DeviceKind::kCuda;
    if (o.device == "cuda" && !have_gpu) {
      throw Error("step", "--device", "cuda", "a CUDA GPU: " + why_no_gpu());
    }
    cpu = o.device == "cpu" || !have_gpu;
    run = resolve_run(o, cpu, o.device != "cpu");
    const auto reference_runs = [](const StrategySpec& x) { return x.backend == "cuda"; };
    if (!o.plot.empty() && cpu && std::none_of(run.strategies.begin(), run.strategies.end(), reference_runs)) {
      throw Error("step", "--plot", o.plot,
                  "a run with a strategy the CPU reference times (fp8, dense or sparse): the ones asked are CUDA "
                  "baselines, which a CPU run lists as unsupported, leaving nothing to draw");
    }
  });
  if (o.from_json.empty()) {
    report = cpu ? run_step_cpu(run) : run_step_gpu(run);
    report.command = repro_line(run, cpu);
    report.latentkv = library_description();
    report.notes.insert(report.notes.begin(), run.notes.begin(), run.notes.end());
    analyze_step(report);
  }
  std::fputs(format_report(report).c_str(), stdout);
  std::fflush(stdout);
  // A saved report is written (and drawn) again, with every derived field recomputed.
  if (!o.json.empty()) {
    write_output_file("step", "--json", o.json, report_json(report));
    std::printf("json: %s\n", o.json.c_str());
  }
  bool ok = !any_failed(report);
  if (!o.plot.empty()) ok = plot_report(report, o.json.empty() ? o.from_json : o.json, o.plot) && ok;
  if (!ok) throw CLI::RuntimeError(kExitFailure);
}

}  // namespace

StrategySpec parse_strategy(const std::string& name, const StepShape& shape) {
  StrategySpec s;
  s.name = name;
  std::string backend = name;
  if (name == "dense" || name == "sparse") {
    backend = "fp8";
    s.dense = name == "dense";
  } else if (name.rfind("dense_", 0) == 0) {
    backend = name.substr(6);
    s.dense = true;
  } else if (name.rfind("sparse_", 0) == 0) {
    backend = name.substr(7);
  } else {
    s.by_rule = true;
    s.dense = shape.dense_is_exact();
  }
  if (backend == "fp8") {
    s.backend = "cuda";
  } else if (backend == "gather_cast" || backend == "cast_full") {
    s.backend = backend;
  } else {
    throw Error("step", "--strategies", quoted_value(name),
                "fp8, gather_cast, cast_full (the path by the model's rule), dense, sparse, or dense_/sparse_ "
                "followed by fp8, gather_cast or cast_full");
  }
  return s;
}

StepTables make_step_tables(const StepShape& s, std::uint64_t seed) {
  PageAllocator pool(s.pool_tokens / s.page_size, s.page_size, seed | 1);
  std::vector<RequestId> requests;
  for (int b = 0; b < s.batch; ++b) {
    requests.push_back(pool.add_request());
    pool.grow(requests.back(), s.context);
  }
  StepTables t;
  t.num_pages = pool.num_pages();
  t.max_pages = static_cast<int>(pool.pages_for(s.context));
  t.block_table = pool.block_table_matrix(requests, t.max_pages);
  t.seq_lens = pool.lengths(requests);
  for (RequestId r : requests) {
    for (std::int64_t t_pos = s.context - s.q_len; t_pos < s.context; ++t_pos) {
      t.new_slots.push_back(static_cast<std::int32_t>(pool.slot(r, t_pos)));
    }
  }
  return t;
}

float approx_normal(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed + 0x9E3779B97F4A7C15ull * (i + 1);  // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  float sum = 0.0f;
  for (int k = 0; k < 4; ++k) sum += static_cast<float>((z >> (16 * k)) & 0xFFFF) * (1.0f / 65536.0f);
  return (sum - 2.0f) * 1.7320508f;  // the variance of a sum of four U(0,1) is 1/3
}

void fill_random_bf16(std::uint16_t* out, std::size_t n, std::uint64_t seed, float stddev) {
  for (std::size_t i = 0; i < n; ++i) out[i] = bf16_encode(stddev * approx_normal(seed, i));
}

void fill_random_fp8(std::uint8_t* out, std::size_t n, std::uint64_t seed, float stddev) {
  for (std::size_t i = 0; i < n; ++i) out[i] = fp8_e4m3_encode(stddev * approx_normal(seed, i));
}

void fill_random_f32(float* out, std::size_t n, std::uint64_t seed, float stddev) {
  for (std::size_t i = 0; i < n; ++i) out[i] = stddev * approx_normal(seed, i);
}

void add_step_command(CLI::App& app) {
  auto opt = std::make_shared<StepOptions>();
  CLI::App* cmd = app.add_subcommand(
      "step", "One decode step of a whole model's attention, strategies side by side, with the gap to the floors");
  cmd->add_option("--model", opt->model, "Model preset (glm5, deepseek-v3.2)")->capture_default_str();
  cmd->add_option("--tp", opt->tp, "Tensor parallelism (divides the heads)")
      ->capture_default_str()->transform(integer_in(1, kIntMax));
  cmd->add_option("--batch", opt->batch, "Requests (default 1; 2 on the CPU)")->transform(integer_in(1, kMaxStepBatch));
  cmd->add_option("--context", opt->context, "Tokens per request, new ones included (default 32768; 3000 on the CPU)")
      ->transform(integer_in(1, kIntMax));
  cmd->add_option("--pool", opt->pool,
                  "Cache slots per layer, at least the batch's pages, rounded up to whole pages (default 495000, or "
                  "what the batch needs with 1/8 to spare; on the CPU twice the batch's pages)")
      ->transform(integer_in(1, kMaxSlots, " (slots are int32)"));
  cmd->add_option("--q-len", opt->q_len, "New tokens per request (1-4)")
      ->capture_default_str()->transform(integer_in(1, kMaxDecodeQLen));
  cmd->add_option("--page-size", opt->page_size, "Tokens per page")
      ->capture_default_str()->transform(integer_in(1, kMaxTableTokens, kPageSizeWhy));
  cmd->add_option("--layers", opt->layers, "Layers in the step (default: all of the model; 4 on the CPU)")
      ->transform(integer_in(1, kIntMax));
  add_name_list(*cmd, "--strategies", opt->strategies,
                "Comma separated: fp8, gather_cast, cast_full (path by the model's rule), dense, sparse (the "
                "fp8 backend on that path), or dense_/sparse_ followed by fp8, gather_cast or cast_full "
                "(default fp8,gather_cast,cast_full,dense,sparse; fp8,dense,sparse on the CPU)");
  cmd->add_option("--warmup", opt->warmup, "Untimed replays first (default 3; 1 on the CPU)")
      ->transform(integer_in(0, 100000));
  cmd->add_option("--iters", opt->iters, "Timed replays (default 20; 3 on the CPU)")->transform(integer_in(1, 100000));
  cmd->add_option("--check-requests", opt->check_requests,
                  "Requests checked against the float64 reference, 0 .. the batch (default 2, or the batch when "
                  "smaller; 0: none)")
      ->transform(integer_in(0, kIntMax));
  cmd->add_flag("--fault-checks", opt->fault_checks,
                "Give every op, not only the appends, the step's fault record: the kernels then check the lengths, "
                "pages, slots and values (q, weights) they read (latentkv/device_fault.hpp), and the step fails "
                "on a bad one");
  cmd->add_option("--device", opt->device, "auto (a GPU when there is one; also 'detected'), cuda or cpu")
      ->transform(CLI::Transformer({{"detected", "auto"}}))
      ->check(CLI::IsMember({"auto", "cuda", "cpu"}));
  cmd->add_option("--seed", opt->seed, "Seed of the synthetic inputs and page tables (default 1)")
      ->transform(seed_in_range());
  cmd->add_option("--json", opt->json, "Also write the report as JSON to this file");
  cmd->add_option("--plot", opt->plot,
                  "Draw the step per strategy and each op against its floor (.png or .svg; python3 with "
                  "matplotlib, LATENTKV_PYTHON picks it)");
  cmd->add_option("--from-json", opt->from_json,
                  "Print a saved report instead of running (--json writes it again, --plot draws it)");
  cmd->add_flag_callback("--no-progress", [opt] { opt->progress = false; }, "No progress line on stderr");
  cmd->callback([opt, cmd] { run_step_command(*opt, *cmd); });
}

#ifndef LKV_WITH_CUDA
StepReport run_step_gpu(const StepRun&) {
  throw Error("step", "--device", "cuda", "a build with CUDA (this one has the CPU reference only: --device cpu)");
}
#endif

}  // namespace latentkv::tools
