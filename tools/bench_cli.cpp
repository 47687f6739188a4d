// `latentkv bench`'s command line and what it prints (bench_cli.hpp); the timing itself is in
// tools/gpu/bench_*.cpp.
#include "bench_cli.hpp"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "cli_checks.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/error.hpp"
#include "latentkv/ops.hpp"
#include "latentkv/version.hpp"
#include "text.hpp"

namespace latentkv::tools {
namespace {

using nlohmann::json;

// The backends a build with CUDA registers (src/cuda/sources.cmake, LKV_BACKENDS): names --backends
// may give on a build or machine that lacks them, which then says that a GPU is missing.
const std::vector<std::string> kCudaBackends = {"cuda", "gather_cast", "cast_full"};

// Throws latentkv::Error naming the first --backends entry that names no backend.
void check_backend_names(const std::vector<std::string>& names) {
  std::vector<std::string> known = kCudaBackends;
  for (const Backend* b : registered_backends()) {
    if (std::find(known.begin(), known.end(), b->name()) == known.end()) known.emplace_back(b->name());
  }
  if (names.empty()) throw Error("bench", "--backends", "''", "one or more of " + join(known, ", "));
  for (const std::string& name : names) {
    if (std::find(known.begin(), known.end(), name) == known.end()) {
      throw Error("bench", "--backends", quoted_value(name), "one of " + join(known, ", ") + " (comma separated)");
    }
  }
}

const std::vector<std::string> kOps = {"mla_decode",         "sparse_mla_decode", "indexer_logits",
                                       "topk",               "dsa_decode",        "mla_prefill",
                                       "sparse_mla_prefill", "indexer_prefill",   "dsa_prefill"};

// Which ops read the options only some take. The others refuse them (check_bench_options), and the
// repro line leaves them out.
bool is_prefill(const std::string& op) { return op.ends_with("prefill"); }
bool is_decode(const std::string& op) { return !is_prefill(op); }
bool reads_topk(const std::string& op) { return op != "mla_decode" && op != "indexer_logits" && op != "mla_prefill"; }
bool reads_splits(const std::string& op) { return op == "mla_decode" || op == "sparse_mla_decode"; }
bool reads_context_min(const std::string& op) { return op == "mla_decode"; }
bool reads_heads(const std::string& op) { return op != "topk"; }
// The ops whose --heads are indexer heads (1 .. kMaxIndexerHeads) rather than query heads.
bool reads_indexer_heads(const std::string& op) { return op == "indexer_logits" || op == "indexer_prefill"; }
// The ops whose main cache may be bf16; the indexer ops read only the fp8 indexer cache, topk none,
// and dsa_decode (and its cast baselines) the fp8 main cache.
bool reads_kv_dtype(const std::string& op) {
  return op == "mla_decode" || op == "sparse_mla_decode" || op == "mla_prefill" || op == "sparse_mla_prefill" ||
         op == "dsa_prefill";
}

// Throws latentkv::Error naming `option` and its `value` unless the op reads it: "bench: argument
// '--splits' = 4: expected only with --op mla_decode or sparse_mla_decode (topk does not read it)".
void refuse_unless_read(const std::string& op, bool (*reads)(const std::string&), const std::string& option,
                        const std::string& value) {
  if (reads(op)) return;
  std::vector<std::string> readers;
  for (const std::string& other : kOps) {
    if (reads(other)) readers.push_back(other);
  }
  const std::string last = readers.back();
  readers.pop_back();
  const std::string ops = readers.empty() ? last : join(readers, ", ") + " or " + last;
  throw Error("bench", option, value, "only with --op " + ops + " (" + op + " does not read it)");
}

// Refuses what the op does not read: the options only some ops take, typed (even at their default
// values) or set away from their defaults.
void check_op_reads(const BenchOptions& o, const std::set<std::string>& given) {
  const BenchOptions defaults;
  const auto typed_or_set = [&](const char* option, bool away_from_default) {
    return away_from_default || given.contains(option);
  };
  if (typed_or_set("--splits", o.splits > 0)) {
    refuse_unless_read(o.op, reads_splits, "--splits", std::to_string(o.splits));
  }
  if (typed_or_set("--context-min", o.context_min > 0)) {
    refuse_unless_read(o.op, reads_context_min, "--context-min", std::to_string(o.context_min));
  }
  if (typed_or_set("--heads", o.heads > 0)) refuse_unless_read(o.op, reads_heads, "--heads", std::to_string(o.heads));
  if (o.heads > kMaxIndexerHeads && reads_indexer_heads(o.op)) {
    throw Error("bench", "--heads", std::to_string(o.heads),
                "1 .. " + std::to_string(kMaxIndexerHeads) + " for " + o.op + " (indexer heads)");
  }
  if (typed_or_set("--topk", o.topk != defaults.topk)) {
    refuse_unless_read(o.op, reads_topk, "--topk", std::to_string(o.topk));
  }
  if (typed_or_set("--q-len", o.q_len != defaults.q_len)) {
    refuse_unless_read(o.op, is_decode, "--q-len", std::to_string(o.q_len));
  }
  if (typed_or_set("--new-tokens", o.new_tokens != defaults.new_tokens)) {
    refuse_unless_read(o.op, is_prefill, "--new-tokens", std::to_string(o.new_tokens));
  }
  if (typed_or_set("--kv-dtype", o.kv_dtype != defaults.kv_dtype)) {
    refuse_unless_read(o.op, reads_kv_dtype, "--kv-dtype", o.kv_dtype);
  }
}

// What an op's shape asks of the lengths, checked before the GPU is looked for.
void check_lengths(const BenchOptions& o, const std::set<std::string>& given) {
  const std::string context = std::to_string(o.context);
  if (is_prefill(o.op)) {
    if (o.new_tokens > o.context) {
      throw Error("bench", "--new-tokens",
                  std::to_string(o.new_tokens) + (given.contains("--new-tokens") ? "" : " (its default)"),
                  "at most --context (" + context + ")" +
                      (given.contains("--new-tokens") ? "" : ": give --new-tokens, or a larger --context"));
    }
    return;
  }
  if (o.context < o.q_len) {
    throw Error("bench", "--context", context, ">= --q-len (" + std::to_string(o.q_len) + ")");
  }
  if (o.context_min > 0 && o.context_min < o.q_len) {
    throw Error("bench", "--context-min", std::to_string(o.context_min),
                ">= --q-len (" + std::to_string(o.q_len) + ")");
  }
}

}  // namespace

void add_bench_options(CLI::App& cmd, BenchOptions& o) {
  cmd.add_option("--op", o.op, "Operation to time")
      ->capture_default_str()
      ->check(CLI::IsMember(kOps));
  cmd.add_option("--model", o.model, "Model preset (glm5, deepseek-v3.2)")->capture_default_str();
  cmd.add_option("--tp", o.tp, "Tensor parallelism (divides the heads)")
      ->capture_default_str()
      ->transform(integer_in(1, kIntMax));
  cmd.add_option("--heads", o.heads,
                 "Query heads per GPU (default: the model's over --tp; indexer_logits, indexer_prefill: indexer "
                 "heads, default the model's; not topk)")
      ->transform(integer_in(1, 128));
  cmd.add_option("--batch", o.batch, "Requests")->capture_default_str()->transform(integer_in(1, 4096));
  cmd.add_option("--context", o.context, "Tokens per request")
      ->capture_default_str()
      ->transform(integer_in(1, kIntMax));
  cmd.add_option("--context-min", o.context_min,
                 "mla_decode: a batch of mixed lengths, each request's drawn uniformly from [this, --context]")
      ->transform(integer_in(1, kIntMax));
  cmd.add_option("--pool", o.pool,
                 "Tokens in the cache pool; the timed calls rotate over as many sets of requests as it holds, "
                 "and the bench warns when that is too few to keep their inputs out of the L2")
      ->capture_default_str()
      ->transform(integer_in(1, kMaxSlots, " (slots are int32)"));
  cmd.add_option("--q-len", o.q_len, "New tokens per request (1-4; decode ops)")
      ->capture_default_str()
      ->transform(integer_in(1, 4));
  cmd.add_option("--new-tokens", o.new_tokens, "New tokens per request (prefill ops)")
      ->capture_default_str()
      ->transform(integer_in(1, kIntMax));
  cmd.add_option("--page-size", o.page_size, "Tokens per page")
      ->capture_default_str()
      ->transform(integer_in(1, kMaxTableTokens, kPageSizeWhy));
  cmd.add_option("--topk", o.topk,
                 "Selected tokens per query (sparse ops, topk, indexer_prefill, dsa_decode, dsa_prefill)")
      ->capture_default_str()
      ->transform(integer_in(1, 2048));
  cmd.add_option("--splits", o.splits,
                 "Split-KV count asked of each backend's plan (mla_decode, sparse_mla_decode; default: its own)")
      ->transform(integer_in(1, 1024));
  cmd.add_option("--kv-dtype", o.kv_dtype,
                 "Main cache dtype (mla_decode, sparse_mla_decode, mla_prefill, sparse_mla_prefill, dsa_prefill; "
                 "the other ops read fp8 caches only)")
      ->capture_default_str()
      ->transform(CLI::Transformer({{"fp8", "fp8_e4m3"}}))
      ->check(CLI::IsMember({"fp8_e4m3", "bf16"}));
  add_name_list(cmd, "--backends", o.backends, "Backends to time, comma separated");
  cmd.add_option("--warmup", o.warmup, "Untimed calls first")->capture_default_str()->transform(integer_in(0, 100000));
  cmd.add_option("--iters", o.iters, "Timed calls")->capture_default_str()->transform(integer_in(1, 100000));
  cmd.add_option("--launch", o.launch,
                 "queued: the timed calls are queued behind a held GPU, then run back to back (each call's "
                 "GPU time); paced: the host launches each as it goes (its launch latency included)")
      ->capture_default_str()
      ->check(CLI::IsMember({"queued", "paced"}));
  cmd.add_option("--check-requests", o.check_requests,
                 "Requests checked against the reference, 0 .. the batch (default 2, or the batch when smaller; "
                 "0: none)")
      ->transform(integer_in(0, kIntMax));
  cmd.add_option("--seed", o.seed, "Seed of the synthetic inputs")->capture_default_str()->transform(seed_in_range());
  cmd.add_option("--json", o.json, "Also write the rows as JSON to this file");
}

std::set<std::string> given_options(const CLI::App& cmd) {
  std::set<std::string> given;
  for (const CLI::Option* option : cmd.get_options()) {
    if (option->count() > 0 && !option->get_lnames().empty()) given.insert("--" + option->get_lnames().front());
  }
  return given;
}

void check_bench_options(const BenchOptions& o, const std::set<std::string>& given) {
  check_backend_names(o.backends);
  check_op_reads(o, given);
  if (o.context_min > o.context) {
    throw Error("bench", "--context-min", std::to_string(o.context_min),
                "at most --context (" + std::to_string(o.context) + ")");
  }
  check_lengths(o, given);
  // One set of requests must fit in the pool (the timed calls rotate over as many as it holds).
  try {
    check_pool("bench", o.pool, o.batch, o.context, o.page_size);
  } catch (const Error& e) {
    if (given.contains("--pool") || e.argument() != "--pool") throw;
    throw Error("bench", "--pool", e.value() + " (its default)",
                e.expected() + ": give a larger --pool, or lower --batch, --context or --page-size");
  }
  if (given.contains("--check-requests") && o.check_requests > o.batch) {
    throw Error("bench", "--check-requests", std::to_string(o.check_requests),
                "at most the batch, " + std::to_string(o.batch) +
                    (given.contains("--batch") ? " (--batch)" : " (--batch, its default)"));
  }
  shard_from_flags("bench", o.model, o.tp);
}

std::string repro_line(const BenchOptions& o) {
  std::ostringstream os;
  os << "latentkv bench --op " << o.op << " --model " << o.model << " --tp " << o.tp;
  if (o.heads > 0) os << " --heads " << o.heads;
  os << " --batch " << o.batch << " --context " << o.context;
  if (o.context_min > 0) os << " --context-min " << o.context_min;
  os << " --pool " << o.pool;
  if (is_prefill(o.op)) os << " --new-tokens " << o.new_tokens;
  else os << " --q-len " << o.q_len;
  os << " --page-size " << o.page_size;
  if (o.splits > 0) os << " --splits " << o.splits;
  if (reads_topk(o.op)) os << " --topk " << o.topk;
  if (reads_kv_dtype(o.op)) os << " --kv-dtype " << o.kv_dtype;
  os << " --backends " << join(o.backends) << " --iters " << o.iters << " --warmup "
     << o.warmup << " --launch " << o.launch << " --seed " << o.seed;
  if (o.check_requests != BenchOptions{}.check_requests) os << " --check-requests " << o.check_requests;
  return os.str();
}

std::string format_report(const BenchOptions& o, const BenchReport& r) {
  std::string out;
  appendf(out, "device: %s\n", r.device.c_str());
  appendf(out,
          "ceilings (this run): read-only stream %.0f GB/s, device copy %.0f GB/s (read + write), 656-byte entries "
          "at random slots %.0f GB/s\n",
          r.read_gbps, r.copy_gbps, r.gather_gbps);
  const bool graphs = r.timing == "CUDA graph replays";
  appendf(out, "least call (this run): %.1f us, an empty one-CTA kernel as %s, queued behind a held GPU%s\n",
          graphs ? r.empty_graph_us : r.empty_launch_us, graphs ? "a one-kernel graph" : "one launch",
          o.launch == "paced" ? " (the calls below are paced by the host)" : ", as the calls below");
  const bool prefill = is_prefill(o.op);
  const bool sparse = reads_topk(o.op);
  const std::string queries =
      prefill ? "new tokens " + std::to_string(o.new_tokens) : "q_len " + std::to_string(o.q_len);
  const std::string context =
      o.context_min > 0
          ? std::to_string(o.context_min) + ".." + std::to_string(o.context) + " (each request's drawn uniformly)"
          : std::to_string(o.context);
  const std::string topk = sparse ? ", topk " + std::to_string(o.topk) : "";
  appendf(out,
          "shape: %s, %s tp %d, batch %d, context %s, %s%s, page %d, %s cache, pool %lld tokens, %d rotation sets\n",
          o.op.c_str(), o.model.c_str(), o.tp, o.batch, context.c_str(), queries.c_str(), topk.c_str(), o.page_size,
          o.kv_dtype.c_str(), static_cast<long long>(o.pool), r.rotation_sets);
  if (!r.rotation_cold && prefill) {
    appendf(out,
            "note: every call reads the same requests (the prefill ops are timed on one set), and what a call moves "
            "is less than twice the L2: some of its inputs come from the L2\n");
  } else if (!r.rotation_cold && r.request_sets > 0) {
    appendf(out,
            "warning: the pool holds %d set(s) of requests for the %d rotation sets of index rows, too few for every "
            "timed call to find its inputs outside the L2; a larger --pool gives more\n",
            r.request_sets, r.rotation_sets);
  } else if (!r.rotation_cold) {
    appendf(out,
            "warning: the pool holds %d rotation sets, too few for every timed call to find its inputs outside the "
            "L2; a larger --pool gives more\n",
            r.rotation_sets);
  }
  if (r.matrix_tflops > 0) {
    appendf(out, "matrix rate (this run): %.0f TFLOP/s, %s\n", r.matrix_tflops, r.matrix_how.c_str());
  }
  appendf(out, "timing: %s, %s\n", r.timing.c_str(),
          o.launch == "paced" ? "launched by the host as it goes"
                              : "queued behind a held GPU, then run back to back (no host launch latency)");
  appendf(out, "\n%-12s %10s %17s %9s %7s %7s %9s %9s  %-s\n", "backend", "median us", "p10..p90 us", "GB/s",
          "% copy", "% read", "TFLOP/s", "vs cast", "check / kernel");
  for (const BenchRow& row : r.rows) {
    if (!row.timed) {
      appendf(out, "%-12s %10s %17s %9s %7s %7s %9s %9s  %s\n", row.backend.c_str(), "-", "-", "-", "-", "-", "-",
              "-", row.status.c_str());
      continue;
    }
    std::string spread, tflops = "-", speed = "-";
    appendf(spread, "%.1f..%.1f", row.p10_us, row.p90_us);
    if (row.flops > 0) appendf(tflops = "", "%.1f", row.tflops);
    if (row.speedup > 0) appendf(speed = "", "%.1fx", row.speedup);
    appendf(out, "%-12s %10.1f %17s %9.0f %6.1f%% %6.1f%% %9s %9s  %s; %s, %d splits; host %.1f us a call\n",
            row.backend.c_str(), row.median_us, spread.c_str(), row.gbps, row.pct_of_copy, row.pct_of_read,
            tflops.c_str(), speed.c_str(), row.status.c_str(), row.kernel.c_str(), row.num_splits, row.host_us);
  }
  for (const BenchRow& row : r.rows) {
    if (row.timed && r.matrix_tflops > 0 && row.flops > 0) {
      appendf(out, "%s: %.1f TFLOP/s is %.1f%% of the matrix rate above\n", row.backend.c_str(), row.tflops,
              100.0 * row.tflops / r.matrix_tflops);
    }
  }
  appendf(out,
          "\nGB/s counts the bytes the op must read and write: each cache entry it attends to once per request "
          "(a sparse op's selected ones), its inputs (q, index rows) and outputs (o, lse, logits, slots), not what "
          "a layer's steps pass each other; %% copy is against the device copy above, %% read against the "
          "read-only stream.\n");
  appendf(out, "repro: %s\n", repro_line(o).c_str());
  return out;
}

std::string report_json(const BenchOptions& o, const BenchReport& r) {
  json j;
  j["command"] = repro_line(o);
  j["latentkv"] = library_description();
  j["device"] = r.device;
  j["read_gbps"] = r.read_gbps;
  j["copy_gbps"] = r.copy_gbps;
  j["gather_gbps"] = r.gather_gbps;
  j["empty_launch_us"] = r.empty_launch_us;
  j["empty_graph_us"] = r.empty_graph_us;
  j["shape"] = {{"op", o.op},           {"model", o.model},         {"tp", o.tp},
                {"batch", o.batch},     {"context", o.context},     {"context_min", o.context_min},
                {"q_len", o.q_len},     {"page_size", o.page_size}, {"kv_dtype", o.kv_dtype},
                {"pool", o.pool},       {"heads", o.heads},         {"topk", o.topk},
                {"new_tokens", o.new_tokens}};
  j["rotation_sets"] = r.rotation_sets;
  j["request_sets"] = r.request_sets > 0 ? r.request_sets : r.rotation_sets;
  j["rotation_cold"] = r.rotation_cold;
  j["timing"] = r.timing;
  j["launch"] = o.launch;
  if (r.matrix_tflops > 0) {
    j["matrix_tflops"] = r.matrix_tflops;
    j["matrix_how"] = r.matrix_how;
  }
  for (const BenchRow& row : r.rows) {
    json x = {{"backend", row.backend}, {"kernel", row.kernel},         {"status", row.status},
              {"timed", row.timed},     {"num_splits", row.num_splits}, {"bytes", row.bytes},
              {"flops", row.flops}};
    if (row.timed) {
      // null where the table has "-": no FLOPs counted for the op, no cast_full row timed beside it
      const auto known = [](double value, bool measured) { return measured ? json(value) : json(nullptr); };
      x["median_us"] = row.median_us;
      x["p10_us"] = row.p10_us;
      x["p90_us"] = row.p90_us;
      x["host_us"] = row.host_us;
      x["gbps"] = row.gbps;
      x["pct_of_copy"] = row.pct_of_copy;
      x["pct_of_read"] = row.pct_of_read;
      x["tflops"] = known(row.tflops, row.flops > 0);
      x["speedup_vs_cast_full"] = known(row.speedup, row.speedup > 0);
    }
    j["rows"].push_back(x);
  }
  return j.dump(2) + "\n";
}

}  // namespace latentkv::tools
