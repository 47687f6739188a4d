// tools/step_report.cpp - the work model, gap arithmetic, tables and JSON of `latentkv step`.
#include "step_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "latentkv/error.hpp"
#include "latentkv/model.hpp"
#include "latentkv/ops.hpp"
#include "text.hpp"

namespace latentkv::tools {
namespace {

// Bytes per token of the cache layouts (SPEC section 3) and of the bf16 inputs.
constexpr double kFp8Token = 656;      // main cache entry, fp8 e4m3
constexpr double kBf16Token = 1152;    // main cache entry, bf16 (what the cast baselines write)
constexpr double kIndexerToken = 132;  // indexer key: 128 fp8 codes and a float32 scale
constexpr double kLatentIn = 576 * 2;  // a new token's latent and rope, bf16
constexpr double kKeyIn = 128 * 2;     // a new token's indexer key, bf16
constexpr double kQkDim = 576, kVDim = 512;

// Token counts of one layer's step.
struct Counts {
  double rows = 0;      // query rows, batch x q_len
  double cached = 0;    // every request's tokens once: batch x context
  double visible = 0;   // tokens seen, summed over rows
  double selected = 0;  // tokens attended by the sparse decode, summed over rows: min(visible, topk)
  // Entries the sparse decode must read: each request's selected ones once. The top-k picks them on
  // the GPU, so this is the least there can be: its largest row's selection (its rows' selections
  // overlap, the more the closer its new tokens; at q_len 1 the count is exact).
  double selected_entries = 0;
};

Counts counts_of(const StepShape& s) {
  Counts c;
  c.rows = static_cast<double>(s.batch) * s.q_len;
  c.cached = static_cast<double>(s.batch) * static_cast<double>(s.context);
  double largest_row = 0;
  for (int i = 0; i < s.q_len; ++i) {
    const double v = static_cast<double>(std::max<std::int64_t>(s.visible(i), 0));
    c.visible += s.batch * v;
    c.selected += s.batch * std::min<double>(v, s.topk);
    largest_row = std::max(largest_row, std::min<double>(v, s.topk));
  }
  c.selected_entries = s.batch * largest_row;
  return c;
}

// "70.5 GB", "1.31 MB", "880 kB", "512 B"
std::string human_bytes(double bytes) {
  const char* units[] = {"B", "kB", "MB", "GB", "TB"};
  int u = 0;
  while (bytes >= 1000 && u < 4) {
    bytes /= 1000;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, bytes >= 100 || u == 0 ? "%.0f %s" : "%.3g %s", bytes, units[u]);
  return buf;
}

// A rate with three significant digits at most, whole numbers above 100.
std::string rate(double x) {
  char buf[32];
  if (x <= 0) return "-";
  std::snprintf(buf, sizeof buf, x >= 100 ? "%.0f" : "%.3g", x);
  return buf;
}

std::string percent(double x, bool known) {
  if (!known) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, x >= 10 ? "%.0f%%" : "%.1f%%", x);
  return buf;
}

// An op's share of its step, or "-" where the op was not measured.
std::string share_text(double share, bool known) {
  if (!known) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f%%", 100.0 * share);
  return buf;
}

std::string times(double gap) {
  if (gap <= 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, gap >= 100 ? "%.0fx" : "%.1fx", gap);
  return buf;
}

std::string time_text(double us) {
  char buf[32];
  std::snprintf(buf, sizeof buf, us >= 1e5 ? "%.0f" : us >= 1 || us == 0 ? "%.1f" : "%.3f", us);
  return buf;
}

// Kernels per layer: "2", "1.5" (a count that differs between layers), "-" when not counted.
std::string launch_count(double launches) {
  if (launches <= 0) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", launches);
  return buf;
}

// The cast_full strategy's run: the cast_full backend on the path the model's rule picks, however
// --strategies named it (a sparse_cast_full listed before cast_full runs it, and cast_full is left out).
const StrategyResult* find_cast_full(const StepReport& r) {
  for (const StrategyResult& s : r.strategies) {
    if (s.backend == "cast_full" && s.dense == r.shape.dense_is_exact() && s.timed) return &s;
  }
  return nullptr;
}

}  // namespace

std::string_view step_op_name(StepOp op) {
  switch (op) {
    case StepOp::kAppend:
      return "append";
    case StepOp::kIndexerLogits:
      return "indexer_logits";
    case StepOp::kTopk:
      return "topk";
    case StepOp::kSparseDecode:
      return "sparse_decode";
    case StepOp::kDenseDecode:
      return "dense_decode";
  }
  return "?";
}

StepOp parse_step_op(std::string_view name) {
  for (StepOp op :
       {StepOp::kAppend, StepOp::kIndexerLogits, StepOp::kTopk, StepOp::kSparseDecode, StepOp::kDenseDecode}) {
    if (step_op_name(op) == name) return op;
  }
  throw std::invalid_argument("unknown step op '" + std::string(name) +
                              "' (expected append, indexer_logits, topk, sparse_decode or dense_decode)");
}

std::vector<StepOp> step_ops(bool dense) {
  if (dense) return {StepOp::kAppend, StepOp::kDenseDecode};
  return {StepOp::kAppend, StepOp::kIndexerLogits, StepOp::kTopk, StepOp::kSparseDecode};
}

OpWork op_work(StepOp op, std::string_view decode_backend, const StepShape& s) {
  const Counts c = counts_of(s);
  const double heads = s.heads, indexer_heads = s.indexer_heads, pool = static_cast<double>(s.pool_tokens);
  // Queries in, outputs out: q [rows, H, 576] bf16, o [rows, H, 512] bf16, lse [rows, H] f32.
  const double q_o_lse = c.rows * heads * (kQkDim * 2 + kVDim * 2 + 4);
  const double index_rows = c.rows * s.topk * 4.0;  // [rows, topk] i32 slots
  OpWork w;
  switch (op) {
    case StepOp::kAppend:  // bf16 latent and key and an i32 slot in; one fp8 entry of each cache out
      w.bytes = c.rows * (kLatentIn + kKeyIn + 4 + kFp8Token + kIndexerToken);
      break;
    case StepOp::kIndexerLogits:  // each cached key once, the fp8 queries and f32 weights, f32 logits out
      w.bytes = c.cached * kIndexerToken + c.rows * indexer_heads * (128 + 4) + 4.0 * c.visible;
      w.flops = 2.0 * indexer_heads * 128 * c.visible;
      break;
    case StepOp::kTopk:  // every visible logit read once, the selected slots written
      w.bytes = 4.0 * c.visible + index_rows;
      break;
    case StepOp::kSparseDecode:
      w.floor_bytes = kFp8Token * c.selected_entries + q_o_lse + index_rows;
      w.flops = 2.0 * heads * (kQkDim + kVDim) * c.selected;
      if (decode_backend == "cast_full") {  // the whole pool cast to bf16, then the bf16 decode
        w.bytes = pool * (kFp8Token + kBf16Token) + kBf16Token * c.selected + q_o_lse + index_rows;
      } else if (decode_backend == "gather_cast") {  // the selected tokens gathered and cast, then read back
        w.bytes = (kFp8Token + 2 * kBf16Token) * c.selected + q_o_lse + index_rows;
      }
      break;
    case StepOp::kDenseDecode:  // each request's tokens read once: its q_len rows share them
      w.floor_bytes = kFp8Token * c.cached + q_o_lse;
      w.flops = 2.0 * heads * (kQkDim + kVDim) * c.visible;
      if (decode_backend == "cast_full") {
        w.bytes = pool * (kFp8Token + kBf16Token) + kBf16Token * c.cached + q_o_lse;
      } else if (decode_backend == "gather_cast") {  // each request's tokens gathered and cast once
        w.bytes = c.cached * (kFp8Token + 2 * kBf16Token) + q_o_lse;
      }
      break;
  }
  if (w.floor_bytes == 0) w.floor_bytes = w.bytes;
  if (w.bytes == 0) w.bytes = w.floor_bytes;
  return w;
}

double step_floor_bytes(const StepShape& shape) {
  double bytes = 0;
  for (const StepOp op : step_ops(shape.dense_is_exact())) bytes += op_work(op, "cuda", shape).floor_bytes;
  return bytes * shape.layers;
}

std::string l2_residency_note(const StepShape& shape, double l2_bytes) {
  const double moved = step_floor_bytes(shape);
  if (l2_bytes <= 0 || moved >= 2 * l2_bytes) return "";
  return "an FP8-native step moves " + human_bytes(moved) + ", less than twice the L2 (" +
         human_bytes(l2_bytes) +
         "): its timed replays find part of their inputs there, and its figures read high; more --layers, "
         "--batch or --context move more";
}

double floor_us(const OpWork& work, double copy_gbps, double matrix_tflops, double launches_us) {
  double us = std::max(launches_us, 0.0);
  if (copy_gbps > 0) us = std::max(us, work.floor_bytes / (copy_gbps * 1e3));
  if (matrix_tflops > 0) us = std::max(us, work.flops / (matrix_tflops * 1e6));
  return us;
}

void analyze_step(StepReport& r) {
  const double layers = r.shape.layers;
  for (StrategyResult& s : r.strategies) {
    s.ops_us = s.floor_us = s.gap = s.tokens_per_s_stream = s.tokens_per_s_batch = 0;
    for (OpResult& op : s.ops) {
      const OpWork one = op_work(op.op, s.backend, r.shape);
      op.work = {one.bytes * layers, one.floor_bytes * layers, one.flops * layers};
      const bool measured = s.timed && op.us > 0;
      op.gbps = measured ? op.work.bytes / (op.us * 1e3) : 0;
      op.tflops = measured ? op.work.flops / (op.us * 1e6) : 0;
      op.pct_of_copy = measured && r.copy_gbps > 0 ? 100.0 * op.gbps / r.copy_gbps : 0;
      op.pct_of_matrix = measured && r.matrix_tflops > 0 ? 100.0 * op.tflops / r.matrix_tflops : 0;
      // Each op of each layer waits for the op before it: one dependent launch a layer at least.
      op.floor_us = floor_us(op.work, r.copy_gbps, r.matrix_tflops, layers * r.launch_us);
      op.gap = measured && op.floor_us > 0 ? op.us / op.floor_us : 0;
      op.share = measured && s.step_us > 0 ? op.us / s.step_us : 0;
      s.ops_us += measured ? op.us : 0;
      s.floor_us += op.floor_us;
    }
    if (s.timed && s.step_us > 0) {
      s.gap = s.floor_us > 0 ? s.step_us / s.floor_us : 0;
      s.tokens_per_s_stream = r.shape.q_len * 1e6 / s.step_us;
      s.tokens_per_s_batch = r.shape.batch * s.tokens_per_s_stream;
    }
  }
  const StrategyResult* cast_full = find_cast_full(r);
  for (StrategyResult& s : r.strategies) {
    s.speedup_vs_cast_full = cast_full && s.timed && s.step_us > 0 ? cast_full->step_us / s.step_us : 0;
  }
}

std::string format_report(const StepReport& r) {
  const StepShape& sh = r.shape;
  const bool floors = r.copy_gbps > 0 || r.matrix_tflops > 0 || r.launch_us > 0;
  // Times in µs; the CPU reference's in ms.
  const std::string unit = r.cpu_reference ? "ms" : "us";
  const auto t = [&](double us) { return time_text(r.cpu_reference ? us / 1000 : us); };
  std::string out;
  appendf(out, "latentkv step: %s at tp %d (%d heads, %d indexer heads, index_topk %d), %d of %d layers\n",
      sh.model.c_str(), sh.tp, sh.heads, sh.indexer_heads, sh.topk, sh.layers, sh.model_layers);
  appendf(out,
      "  batch %d x q_len %d, context %lld, pool %lld tokens per layer (page %d), seed %llu, %d warm-up + %d timed\n",
      sh.batch, sh.q_len, static_cast<long long>(sh.context), static_cast<long long>(sh.pool_tokens), sh.page_size,
      static_cast<unsigned long long>(r.seed), r.warmup, r.iters);
  appendf(out, "device: %s\n", r.device.c_str());
  if (floors) {
    appendf(out,
        "floors (this run): copy %.0f GB/s (bytes read + written; read-only stream %.0f GB/s), bf16 matrix %.0f "
        "TFLOP/s (%s)\n",
        r.copy_gbps, r.read_gbps, r.matrix_tflops, r.matrix_how.c_str());
    if (r.launch_us > 0) {
      appendf(out,
              "  one chained launch %.2f us (a kernel waiting for the one before it, in a graph of such kernels)\n",
              r.launch_us);
    }
  } else {
    appendf(out, "floors: none measured (host wall-clock times of the float64 reference: no speed claim)\n");
  }
  if (sh.dense_is_exact()) {
    appendf(out,
        "model's rule: every row sees <= %lld tokens <= index_topk %d, so dense decode is exact and serves the step\n",
        static_cast<long long>(sh.context), sh.topk);
  } else {
    appendf(out,
        "model's rule: rows see up to %lld tokens > index_topk %d: indexer -> top-k -> sparse decode "
        "(dense here is a comparison, not the model's attention)\n",
        static_cast<long long>(sh.context), sh.topk);
  }
  for (const std::string& note : r.notes) appendf(out, "note: %s\n", note.c_str());

  // The CPU reference's tables leave out the columns only a GPU run fills (floor, gap, the speed-up over
  // cast_full, % copy, % bf16, launches): there they would be dashes and widen the tables past 140
  // columns.
  const bool gpu_columns = !r.cpu_reference;
  const auto strategy_row = [&](const std::string& name, const char* path, const std::string& backend,
                                const std::string& step, const std::string& spread, const std::string& rate_text,
                                const std::string& floor, const std::string& gap, const std::string& vs_cast,
                                const std::string& check) {
    appendf(out, "%-18s %-6s %-11s %10s %19s %12s", name.c_str(), path, backend.c_str(), step.c_str(), spread.c_str(),
            rate_text.c_str());
    if (gpu_columns) appendf(out, " %10s %7s %8s", floor.c_str(), gap.c_str(), vs_cast.c_str());
    appendf(out, "  %s\n", check.c_str());
  };
  out += "\n";
  strategy_row("strategy", "path", "decode", "step " + unit, "p10..p90 " + unit, "tok/s/stream", "floor " + unit, "gap",
               "vs cast", "check");
  for (const StrategyResult& s : r.strategies) {
    const char* path = s.dense ? (sh.dense_is_exact() ? "dense" : "dense*") : "sparse";
    if (!s.timed) {
      strategy_row(s.name, path, s.backend, "-", "-", "-", "-", "-", "-", s.status);
      continue;
    }
    char per_stream[32];
    std::snprintf(per_stream, sizeof per_stream, "%.1f", s.tokens_per_s_stream);
    strategy_row(s.name, path, s.backend, t(s.step_us), t(s.step_p10_us) + ".." + t(s.step_p90_us), per_stream,
                 s.floor_us > 0 ? t(s.floor_us) : "-", times(s.gap), times(s.speedup_vs_cast_full), s.status);
  }
  if (!sh.dense_is_exact()) {
    for (const StrategyResult& s : r.strategies) {
      if (s.dense) {
        appendf(out, "dense*: every visible token, where the model attends to index_topk of them (for comparison)\n");
        break;
      }
    }
  }

  for (const StrategyResult& s : r.strategies) {
    if (!s.timed) continue;
    appendf(out,
        "\n%s (%s, decode backend %s): step %s %s, %d layer%s of %s %s; %.1f tokens/s for one stream, %.1f for the "
        "batch\n",
        s.name.c_str(), s.dense ? "dense" : "sparse", s.backend.c_str(), t(s.step_us).c_str(), unit.c_str(), sh.layers,
        sh.layers == 1 ? "" : "s", t(s.step_us / std::max(sh.layers, 1)).c_str(), unit.c_str(), s.tokens_per_s_stream,
        s.tokens_per_s_batch);
    // op, time, share, moved, GB/s, [% copy], TFLOP/s, [% bf16, floor, gap, launches], kernel
    const auto op_row = [&](const std::string& name, const std::string& time, const std::string& share,
                            const std::string& moved, const std::string& gbps, const std::string& pct_copy,
                            const std::string& tflops, const std::string& pct_bf16, const std::string& floor,
                            const std::string& gap, const std::string& launches, const std::string& kernel) {
      appendf(out, "  %-16s %10s %7s %9s %8s", name.c_str(), time.c_str(), share.c_str(), moved.c_str(), gbps.c_str());
      if (gpu_columns) appendf(out, " %7s", pct_copy.c_str());
      appendf(out, " %8s", tflops.c_str());
      if (gpu_columns) {
        appendf(out, " %7s %10s %8s %8s", pct_bf16.c_str(), floor.c_str(), gap.c_str(), launches.c_str());
      }
      appendf(out, "  %s\n", kernel.c_str());
    };
    op_row("op", unit + "/step", "share", "moved", "GB/s", "% copy", "TFLOP/s", "% bf16", "floor " + unit, "gap",
           "launches", "kernel");
    for (const OpResult& op : s.ops) {
      const bool measured = op.us > 0;  // as analyze_step and report_json have it
      op_row(std::string(step_op_name(op.op)), measured ? t(op.us) : "-", share_text(op.share, measured && s.step_us > 0),
             human_bytes(op.work.bytes), rate(op.gbps), percent(op.pct_of_copy, measured && r.copy_gbps > 0),
             rate(op.tflops), percent(op.pct_of_matrix, measured && r.matrix_tflops > 0 && op.work.flops > 0),
             op.floor_us > 0 ? t(op.floor_us) : "-", times(op.gap), launch_count(op.launches), op.kernel);
    }
    const double rest = s.step_us - s.ops_us;
    char signed_rest[40];
    std::snprintf(signed_rest, sizeof signed_rest, "%s%s", rest >= 0 ? "+" : "-", t(std::fabs(rest)).c_str());
    appendf(out, "  %-16s %10s %6.1f%%   (the whole step minus its ops timed one by one)\n", "between ops", signed_rest,
        s.step_us > 0 ? 100.0 * rest / s.step_us : 0.0);
  }
  if (floors) {
    appendf(out,
        "\nfloor = max(bytes an FP8-native op must move / copy bandwidth, FLOPs / bf16 matrix rate, layers x one "
        "chained launch); gap = time / floor.\n"
        "'moved' counts what the strategy's op moves (the cast baselines move more than the floor's bytes); "
        "'launches' are the op's kernels and memsets per layer.\n");
  }
  if (sh.q_len > 1) appendf(out, "tokens/s counts every one of the q_len = %d new tokens as accepted.\n", sh.q_len);
  appendf(out, "repro: %s\n", r.command.c_str());
  return out;
}

// ---- JSON ---------------------------------------------------------------------------------------

std::string report_json(const StepReport& r) {
  using nlohmann::json;
  // A value the report has, or null for one never measured.
  const auto known = [](double x, bool measured) { return measured ? json(x) : json(nullptr); };
  const auto positive = [&](double x) { return known(x, x > 0); };
  const StepShape& s = r.shape;
  json j;
  j["command"] = r.command;
  j["latentkv"] = r.latentkv.empty() ? json(nullptr) : json(r.latentkv);
  j["device"] = r.device;
  j["cpu_reference"] = r.cpu_reference;
  j["notes"] = r.notes;
  j["shape"] = {{"model", s.model},
                {"tp", s.tp},
                {"layers", s.layers},
                {"model_layers", s.model_layers},
                {"heads", s.heads},
                {"indexer_heads", s.indexer_heads},
                {"topk", s.topk},
                {"batch", s.batch},
                {"context", s.context},
                {"q_len", s.q_len},
                {"pool_tokens", s.pool_tokens},
                {"page_size", s.page_size},
                {"dense_is_exact", s.dense_is_exact()}};
  j["read_gbps"] = positive(r.read_gbps);
  j["copy_gbps"] = positive(r.copy_gbps);
  j["matrix_tflops"] = positive(r.matrix_tflops);
  j["matrix_how"] = r.matrix_how.empty() ? json(nullptr) : json(r.matrix_how);
  j["launch_us"] = positive(r.launch_us);
  j["warmup"] = r.warmup;
  j["iters"] = r.iters;
  j["seed"] = r.seed;
  j["strategies"] = json::array();
  for (const StrategyResult& x : r.strategies) {
    json st = {{"name", x.name},
               {"path", x.dense ? "dense" : "sparse"},
               {"backend", x.backend},
               {"status", x.status},
               {"timed", x.timed},
               {"step_us", known(x.step_us, x.timed)},
               {"step_p10_us", known(x.step_p10_us, x.timed)},
               {"step_p90_us", known(x.step_p90_us, x.timed)},
               {"ops_us", known(x.ops_us, x.timed)},
               {"floor_us", positive(x.floor_us)},
               {"gap", positive(x.gap)},
               {"tokens_per_s_stream", positive(x.tokens_per_s_stream)},
               {"tokens_per_s_batch", positive(x.tokens_per_s_batch)},
               {"speedup_vs_cast_full", positive(x.speedup_vs_cast_full)}};
    st["ops"] = json::array();
    for (const OpResult& op : x.ops) {
      const bool measured = x.timed && op.us > 0;  // as analyze_step has it; null where the table has "-"
      st["ops"].push_back({{"op", step_op_name(op.op)},
                           {"backend", op.backend},
                           {"kernel", op.kernel},
                           {"us", known(op.us, measured)},
                           {"p10_us", known(op.p10_us, measured)},
                           {"p90_us", known(op.p90_us, measured)},
                           {"launches", positive(op.launches)},
                           {"bytes", op.work.bytes},
                           {"floor_bytes", op.work.floor_bytes},
                           {"flops", op.work.flops},
                           {"share", known(op.share, measured && x.step_us > 0)},
                           {"gbps", known(op.gbps, measured)},
                           {"tflops", known(op.tflops, measured && op.work.flops > 0)},
                           {"pct_of_copy", known(op.pct_of_copy, measured && r.copy_gbps > 0)},
                           {"pct_of_matrix",
                            known(op.pct_of_matrix, measured && r.matrix_tflops > 0 && op.work.flops > 0)},
                           {"floor_us", positive(op.floor_us)},
                           {"gap", positive(op.gap)}});
    }
    j["strategies"].push_back(std::move(st));
  }
  return j.dump(2) + "\n";
}

namespace {

// "shape.batch = 0: expected >= 1"
[[noreturn]] void bad_field(const std::string& field, const nlohmann::json& value, const std::string& expected) {
  // ASCII only (\uXXXX beyond it): the value is the report's, and its C1 controls are not shown raw.
  throw std::invalid_argument(field + " = " + value.dump(-1, ' ', true) + ": expected " + expected);
}

// A number of the report that may be null (never measured: 0), and is never negative.
double non_negative(const nlohmann::json& parent, const char* key, const std::string& where) {
  const nlohmann::json& v = parent.at(key);
  if (v.is_null()) return 0;
  const auto x = v.get<double>();
  if (!(x >= 0)) bad_field(where + key, v, ">= 0 (or null: not measured)");
  return x;
}

// An integer field from `least` to `most` (at most what T holds), `where` + key in messages: a
// fraction, or a value past the bounds, is refused rather than truncated or wrapped.
template <typename T>
T in_range(const nlohmann::json& parent, const char* key, std::int64_t least,
           std::int64_t most = std::numeric_limits<T>::max(), const std::string& where = "shape.") {
  const nlohmann::json& v = parent.at(key);
  most = std::min<std::int64_t>(most, std::numeric_limits<T>::max());
  std::int64_t x = 0;
  bool below_most = false;
  if (v.is_number_unsigned()) {  // JSON's non-negative integers, up to 2^64 - 1
    const auto u = v.get<std::uint64_t>();
    below_most = u <= static_cast<std::uint64_t>(most);
    x = below_most ? static_cast<std::int64_t>(u) : 0;
  } else if (v.is_number_integer()) {
    x = v.get<std::int64_t>();
    below_most = x <= most;
  }
  if (!below_most || x < least) {
    bad_field(where + key, v, "an integer in " + std::to_string(least) + " .. " + std::to_string(most));
  }
  return static_cast<T>(x);
}

// A text field of the report, which is printed as it is: no control characters (a crafted report's
// escape sequences or carriage returns would reach the terminal), the C1 ones (U+0080 .. U+009F,
// "\xC2\x80" .. "\xC2\x9F" in the UTF-8 the parser has checked) included.
std::string plain_text(const nlohmann::json& v, const std::string& field) {
  const auto text = v.get<std::string>();
  for (std::size_t i = 0; i < text.size(); ++i) {
    const auto u = static_cast<unsigned char>(text[i]);
    const bool c1 = u == 0xC2 && i + 1 < text.size() && static_cast<unsigned char>(text[i + 1]) <= 0x9F;
    if (u < 0x20 || u == 0x7f || c1) bad_field(field, v, "text without control characters");
  }
  return text;
}
std::string plain_text(const nlohmann::json& parent, const char* key, const std::string& where) {
  return plain_text(parent.at(key), where + key);
}

// "append, indexer_logits, topk, sparse_decode"
std::string op_names(const std::vector<StepOp>& ops) {
  std::string s;
  for (StepOp op : ops) s += (s.empty() ? "" : ", ") + std::string(step_op_name(op));
  return s.empty() ? "none" : s;
}

}  // namespace

StepReport parse_report_json(std::string_view text) {
  using nlohmann::json;
  StepReport r;
  try {
    const json j = json::parse(text);
    if (!j.is_object()) throw std::invalid_argument("a JSON object at the top, not " + std::string(j.type_name()));
    r.command = plain_text(j, "command", "");
    if (j.contains("latentkv") && !j.at("latentkv").is_null()) r.latentkv = plain_text(j, "latentkv", "");
    r.device = plain_text(j, "device", "");
    r.cpu_reference = j.at("cpu_reference").get<bool>();
    const json& notes = j.at("notes");
    if (!notes.is_array()) bad_field("notes", notes, "a list of texts");
    for (std::size_t i = 0; i < notes.size(); ++i) {
      r.notes.push_back(plain_text(notes[i], "notes[" + std::to_string(i) + "]"));
    }
    const json& s = j.at("shape");
    r.shape.model = plain_text(s, "model", "shape.");
    try {
      (void)model_preset(r.shape.model);
    } catch (const Error& e) {
      bad_field("shape.model", s.at("model"), e.expected());
    }
    // The bounds a run's own options and the ops hold it to (`latentkv step --help`).
    r.shape.tp = in_range<int>(s, "tp", 1);
    r.shape.layers = in_range<int>(s, "layers", 1);
    r.shape.model_layers = in_range<int>(s, "model_layers", r.shape.layers);
    r.shape.heads = in_range<int>(s, "heads", 1, kMaxHeads);
    r.shape.indexer_heads = in_range<int>(s, "indexer_heads", 1, kMaxIndexerHeads);
    r.shape.topk = in_range<int>(s, "topk", 1, kMaxTopk);
    r.shape.batch = in_range<int>(s, "batch", 1, kMaxStepBatch);
    r.shape.q_len = in_range<int>(s, "q_len", 1, kMaxDecodeQLen);
    r.shape.context = in_range<std::int64_t>(s, "context", r.shape.q_len, std::numeric_limits<std::int32_t>::max());
    r.shape.page_size = in_range<int>(s, "page_size", 1, kMaxTableTokens);
    r.shape.pool_tokens = in_range<std::int64_t>(s, "pool_tokens", 1, std::numeric_limits<std::int32_t>::max());
    r.read_gbps = non_negative(j, "read_gbps", "");
    r.copy_gbps = non_negative(j, "copy_gbps", "");
    r.matrix_tflops = non_negative(j, "matrix_tflops", "");
    r.matrix_how = j.at("matrix_how").is_null() ? "" : plain_text(j, "matrix_how", "");
    // Absent from reports written before it was measured.
    r.launch_us = j.contains("launch_us") ? non_negative(j, "launch_us", "") : 0.0;
    r.warmup = in_range<int>(j, "warmup", 0, std::numeric_limits<int>::max(), "");
    r.iters = in_range<int>(j, "iters", 1, std::numeric_limits<int>::max(), "");
    if (!j.at("seed").is_number_unsigned()) bad_field("seed", j.at("seed"), "an integer >= 0");
    r.seed = j.at("seed").get<std::uint64_t>();
    const json& strategies = j.at("strategies");
    if (!strategies.is_array() || strategies.empty()) {
      bad_field("strategies", strategies, "a list of one or more strategies");
    }
    for (std::size_t i = 0; i < strategies.size(); ++i) {
      const json& x = strategies[i];
      const std::string where = "strategies[" + std::to_string(i) + "].";
      StrategyResult st;
      st.name = plain_text(x, "name", where);
      if (st.name.empty()) bad_field(where + "name", x.at("name"), "a strategy's name");
      const std::string path = plain_text(x, "path", where);
      if (path != "dense" && path != "sparse") bad_field(where + "path", x.at("path"), "\"dense\" or \"sparse\"");
      st.dense = path == "dense";
      st.backend = plain_text(x, "backend", where);
      st.status = plain_text(x, "status", where);
      st.timed = x.at("timed").get<bool>();
      st.step_us = non_negative(x, "step_us", where);
      st.step_p10_us = non_negative(x, "step_p10_us", where);
      st.step_p90_us = non_negative(x, "step_p90_us", where);
      if (st.timed && !(st.step_p10_us <= st.step_us && st.step_us <= st.step_p90_us)) {
        bad_field(where + "step_us", x.at("step_us"),
                  "a timed step within its p10 .. p90 (" + x.at("step_p10_us").dump() + " .. " +
                      x.at("step_p90_us").dump() + ")");
      }
      const json& ops = x.at("ops");
      for (std::size_t k = 0; k < ops.size(); ++k) {
        const json& o = ops[k];
        const std::string at = where + "ops[" + std::to_string(k) + "].";
        OpResult op;
        op.op = parse_step_op(o.at("op").get<std::string>());
        op.backend = plain_text(o, "backend", at);
        op.kernel = plain_text(o, "kernel", at);
        op.us = non_negative(o, "us", at);
        op.p10_us = non_negative(o, "p10_us", at);
        op.p90_us = non_negative(o, "p90_us", at);
        // Absent from reports written before they were counted.
        op.launches = o.contains("launches") ? non_negative(o, "launches", at) : 0.0;
        st.ops.push_back(std::move(op));
      }
      // The ops of its path, in the order a layer runs them.
      std::vector<StepOp> kinds;
      for (const OpResult& op : st.ops) kinds.push_back(op.op);
      if (kinds != step_ops(st.dense)) {
        throw std::invalid_argument(where + "ops = " + op_names(kinds) + ": expected " +
                                    op_names(step_ops(st.dense)) + " (the " + path + " path)");
      }
      r.strategies.push_back(std::move(st));
    }
  } catch (const json::exception& e) {
    // nlohmann's text, which names the key or the position, without its "[json.exception...] ". Built
    // with JSON_DIAGNOSTICS it starts with the value's path, "(/shape/batch) type must be number, but
    // is string", said here as "/shape/batch: type must be number, but is string".
    std::string what = e.what();
    if (what.rfind("[json.exception.", 0) == 0 && what.find("] ") != std::string::npos) {
      what = what.substr(what.find("] ") + 2);
    }
    if (what.rfind("(/", 0) == 0 && what.find(") ") != std::string::npos) {
      what = what.substr(1, what.find(") ") - 1) + ": " + what.substr(what.find(") ") + 2);
    }
    throw std::invalid_argument(what);
  }
  analyze_step(r);
  return r;
}

}  // namespace latentkv::tools
