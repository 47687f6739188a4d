// `latentkv config`: the effective attention configuration, where each value came from, the device,
// and the backend and kernel chosen for every slot and why. --explain adds the capability matrix of
// every registered backend (probed through select(), so it cannot disagree with dispatch); --json
// prints the same as JSON (--json FILE: into that file). An impossible configuration prints one error
// and exits with code 2.
#include <algorithm>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_checks.hpp"
#include "commands.hpp"
#include "config_cmd.hpp"
#include "latentkv/backend.hpp"
#include "latentkv/config.hpp"
#include "latentkv/error.hpp"
#include "latentkv/model.hpp"
#include "text.hpp"

namespace latentkv::tools {

namespace {

constexpr std::size_t kWrapColumns = 110;
constexpr std::size_t kMaxKernelsShown = 3;

struct ConfigCommandState {
  std::map<std::string, std::string> values;     // key -> value as typed
  std::map<std::string, CLI::Option*> options;   // key -> its option
  bool explain = false;
  CLI::Option* json = nullptr;  // --json: given (count() > 0), with json_file empty or "-" for standard output
  std::string json_file;
  // "auto": the detected device; "cpu": resolve for the CPU whatever the machine has; "cuda": the
  // detected GPU.
  std::string device = "auto";

  bool as_json() const { return json != nullptr && json->count() > 0; }
  bool json_to_file() const { return as_json() && !json_file.empty() && json_file != "-"; }
};

std::string pad(std::string text, std::size_t width) {
  if (text.size() < width) text.append(width - text.size(), ' ');
  return text;
}

// Wraps `text` at word boundaries within kWrapColumns; continuation lines start with `indent`.
std::string wrap(const std::string& text, std::size_t first_column, const std::string& indent) {
  return wrap_words(text, first_column, indent, kWrapColumns);
}

std::string ints_text(const std::vector<int>& values) {
  std::vector<std::string> parts;
  for (int v : values) parts.push_back(std::to_string(v));
  return join(parts, ",");
}

std::vector<int> missing(const std::vector<int>& probed, const std::vector<int>& accepted) {
  std::vector<int> out;
  for (int v : probed) {
    if (std::find(accepted.begin(), accepted.end(), v) == accepted.end()) out.push_back(v);
  }
  return out;
}

// The accepted values of one probed dimension: "all" (every probed value), "all but X,Y" when fewer
// were rejected than accepted, else the accepted values.
std::string dimension_text(std::string_view label, const std::vector<int>& probed, const std::vector<int>& accepted) {
  const std::vector<int> rejected = missing(probed, accepted);
  std::string values = ints_text(accepted);
  if (rejected.empty()) {
    values = "all";
  } else if (rejected.size() < accepted.size()) {
    values = "all but " + ints_text(rejected);
  }
  return std::string(label) + " " + values;
}

std::string kernels_text(const std::vector<std::string>& kernels) {
  std::vector<std::string> shown(kernels.begin(), kernels.begin() + std::min(kernels.size(), kMaxKernelsShown));
  std::string text = join(shown, ", ");
  if (kernels.size() > kMaxKernelsShown) text += " +" + std::to_string(kernels.size() - kMaxKernelsShown) + " more";
  return text;
}

std::string row_text(const CapabilityRow& row, const ProbeGrid& grid) {
  if (!row.supported) return "no: " + row.rejection;
  std::vector<std::string> parts;
  if (!row.kv_dtypes.empty()) {
    std::vector<std::string> names;
    for (KvDtype d : row.kv_dtypes) names.emplace_back(kv_dtype_name(d));
    parts.push_back(join(names, ","));
  }
  if (!row.heads.empty()) parts.push_back(dimension_text("heads", grid.heads, row.heads));
  parts.push_back(dimension_text("page", grid.page_sizes, row.page_sizes));
  if (!row.q_lens.empty()) parts.push_back(dimension_text("q_len", grid.q_lens, row.q_lens));
  if (!row.topks.empty()) parts.push_back(dimension_text("topk", grid.topks, row.topks));
  std::string text = join(parts, " | ");
  if (!row.every_combination) text += " | not every combination (e.g. " + row.rejection + ")";
  return text + " | kernel " + kernels_text(row.kernels);
}

void print_matrix(std::ostream& out, const std::vector<const Backend*>& backends) {
  const ProbeGrid grid = default_probe_grid();
  std::vector<std::string> devices;
  for (const DeviceInfo& d : grid.devices) devices.push_back(describe_device(d));
  out << "capability matrix, probed through each backend's select() (what dispatch runs) over\n"
      << "  kv_dtype {fp8_e4m3,bf16} x heads {" << ints_text(grid.heads) << "} x page {" << ints_text(grid.page_sizes)
      << "}\n  x q_len {" << ints_text(grid.q_lens) << "} x topk {" << ints_text(grid.topks) << "} x device {"
      << join(devices, ", ") << "};\n  each op shows the fields it has; \"all\" means every probed value\n";
  // Every backend probed first, so that the device column is as wide as its widest entry.
  std::vector<std::vector<CapabilityRow>> rows_of;
  std::size_t device_column = 0;
  for (const Backend* b : backends) {
    rows_of.push_back(probe_capabilities(*b, grid));
    for (const CapabilityRow& row : rows_of.back()) {
      device_column = std::max(device_column, join(row.devices, ",").size());
    }
  }
  device_column = std::max<std::size_t>(device_column + 2, 27);
  for (std::size_t i = 0; i < backends.size(); ++i) {
    const Backend* b = backends[i];
    const std::string traffic = b->extra_traffic().empty() ? "none" : std::string(b->extra_traffic());
    out << "\n" << b->name() << "  (preference " << b->preference() << "; extra traffic: " << traffic << ")\n"
        << "  " << wrap(std::string(b->description()), 2, "  ") << "\n";
    Op last = Op::kAppend;
    bool first = true;
    for (const CapabilityRow& row : rows_of[i]) {
      const std::string op = (first || row.op != last) ? std::string(op_name(row.op)) : "";
      first = false;
      last = row.op;
      const std::string lead = "  " + pad(op, 20) + pad(join(row.devices, ","), device_column);
      out << lead << wrap(row_text(row, grid), lead.size(), std::string(lead.size(), ' ')) << "\n";
    }
  }
}

void print_resolution(std::ostream& out, const OpResolution& r) {
  const std::string indent(22, ' ');
  out << "  " << pad(r.role, 16) << "-> " << pad(std::string(r.backend->name()), 12) << "kernel " << r.kernel.name
      << "\n";
  out << indent << wrap("for " + describe_problem(r.problem), indent.size() + 0, indent + "    ") << "\n";
  out << indent << wrap("why: " + r.why, indent.size(), indent + "    ") << "\n";
  for (const Candidate& c : r.candidates) {
    const std::string verdict = c.accepted ? "accepts (" + c.kernel + ")" : "rejects: " + c.reason;
    out << indent << wrap("considered " + c.backend + " (preference " + std::to_string(c.preference) + "): " + verdict,
                          indent.size(), indent + "    ")
        << "\n";
  }
}

void print_config(std::ostream& out, const ResolvedConfig& r) {
  const AttentionConfig& c = r.config;
  out << "latentkv attention configuration (precedence: flags > environment > config file > defaults)\n";
  auto line = [&](std::string_view key, const std::string& value, const Provenance& source) {
    out << "  " << pad(std::string(key), 16) << pad(value, 16) << source.describe() << "\n";
  };
  line("model", c.model.value, c.model.source);
  line("tp", std::to_string(c.tp.value), c.tp.source);
  line("kv_dtype", std::string(kv_dtype_name(c.kv_dtype.value)), c.kv_dtype.source);
  line("page_size", std::to_string(c.page_size.value), c.page_size.source);
  line("q_len", std::to_string(c.q_len.value), c.q_len.source);
  for (Slot slot : kAllSlots) line(slot_name(slot), c.backend(slot).value, c.backend(slot).source);
  if (c.config_file) {
    out << "  " << pad("config file", 16) << c.config_file->value << "  (" << c.config_file->source.describe()
        << ")\n";
  } else {
    out << "  " << pad("config file", 16) << "none (--config or LATENTKV_CONFIG)\n";
  }

  const ModelShard& s = r.shard;
  out << "\nmodel: " << s.model.name << " at tp " << s.tp << ": " << s.heads_per_gpu << " of " << s.model.heads
      << " attention heads per GPU; " << s.model.layers << " layers, all DSA\n"
      << "indexer: " << s.model.indexer_heads << " heads x " << s.model.indexer_dim
      << " on every GPU (replicated); index_topk " << s.model.index_topk << "\n";
  out << "device: " << describe_device(r.device) << "\n";

  out << "\nslots:\n";
  for (const OpResolution& op : r.slots) print_resolution(out, op);
  out << "supporting ops of the sparse path (auto):\n";
  for (const OpResolution& op : r.supporting) print_resolution(out, op);
  out << "\nDSA rule: " << wrap(r.dense_rule(), 10, "  ") << "\n";
}

nlohmann::ordered_json source_json(const Provenance& p) {
  return {{"kind", std::string(source_kind_name(p.kind))}, {"where", p.where}, {"text", p.describe()}};
}

nlohmann::ordered_json device_json(const DeviceInfo& d) {
  return {{"kind", std::string(device_kind_name(d.kind))},
          {"sm", d.sm},
          {"index", d.index},
          {"name", d.name},
          {"multiprocessors", d.multiprocessors}};
}

nlohmann::ordered_json resolution_json(const OpResolution& r) {
  nlohmann::ordered_json candidates = nlohmann::ordered_json::array();
  for (const Candidate& c : r.candidates) {
    candidates.push_back({{"backend", c.backend},
                          {"preference", c.preference},
                          {"accepted", c.accepted},
                          {"kernel", c.kernel},
                          {"reason", c.reason}});
  }
  const Problem& p = r.problem;
  return {{"requested", r.requested},
          {"source", source_json(r.source)},
          {"backend", std::string(r.backend->name())},
          {"kernel", r.kernel.name},
          {"why", r.why},
          {"problem",
           {{"op", std::string(op_name(p.op))},
            {"kv_dtype", std::string(kv_dtype_name(p.kv_dtype))},
            {"heads", p.heads},
            {"page_size", p.page_size},
            {"q_len", p.q_len},
            {"topk", p.topk},
            {"text", describe_problem(p)}}},
          {"candidates", candidates}};
}

nlohmann::ordered_json matrix_json(const std::vector<const Backend*>& backends) {
  nlohmann::ordered_json all = nlohmann::ordered_json::array();
  for (const Backend* b : backends) {
    nlohmann::ordered_json rows = nlohmann::ordered_json::array();
    for (const CapabilityRow& row : probe_capabilities(*b)) {
      std::vector<std::string> dtypes;
      for (KvDtype d : row.kv_dtypes) dtypes.emplace_back(kv_dtype_name(d));
      rows.push_back({{"op", std::string(op_name(row.op))},
                      {"devices", row.devices},
                      {"supported", row.supported},
                      {"every_combination", row.every_combination},
                      {"kv_dtypes", dtypes},
                      {"heads", row.heads},
                      {"page_sizes", row.page_sizes},
                      {"q_lens", row.q_lens},
                      {"topks", row.topks},
                      {"kernels", row.kernels},
                      {"rejection", row.rejection}});
    }
    all.push_back({{"backend", std::string(b->name())},
                   {"description", std::string(b->description())},
                   {"preference", b->preference()},
                   {"extra_traffic", std::string(b->extra_traffic())},
                   {"ops", rows}});
  }
  return all;
}

nlohmann::ordered_json config_json(const ResolvedConfig& r) {
  const AttentionConfig& c = r.config;
  auto setting = [](const auto& value, const Provenance& source) {
    return nlohmann::ordered_json{{"value", value}, {"source", source_json(source)}};
  };
  nlohmann::ordered_json settings = {{"model", setting(c.model.value, c.model.source)},
                             {"tp", setting(c.tp.value, c.tp.source)},
                             {"kv_dtype", setting(std::string(kv_dtype_name(c.kv_dtype.value)), c.kv_dtype.source)},
                             {"page_size", setting(c.page_size.value, c.page_size.source)},
                             {"q_len", setting(c.q_len.value, c.q_len.source)}};
  nlohmann::ordered_json slots = nlohmann::ordered_json::object();
  for (Slot slot : kAllSlots) {
    const std::string name(slot_name(slot));
    settings[name] = setting(c.backend(slot).value, c.backend(slot).source);
    slots[name] = resolution_json(r.slot(slot));
  }
  nlohmann::ordered_json supporting = nlohmann::ordered_json::object();
  for (const OpResolution& op : r.supporting) supporting[op.role] = resolution_json(op);
  const ModelShard& s = r.shard;
  return {{"settings", settings},
          {"config_file", c.config_file ? setting(c.config_file->value, c.config_file->source) : nlohmann::ordered_json()},
          {"device", device_json(r.device)},
          {"shard",
           {{"model", s.model.name},
            {"tp", s.tp},
            {"heads", s.model.heads},
            {"heads_per_gpu", s.heads_per_gpu},
            {"indexer_heads", s.model.indexer_heads},
            {"index_topk", s.model.index_topk},
            {"layers", s.model.layers}}},
          {"slots", slots},
          {"supporting", supporting},
          {"dense_rule", {{"dense_max_visible_tokens", r.dense_max_visible_tokens}, {"text", r.dense_rule()}}}};
}

std::string dump(const nlohmann::ordered_json& j) { return j.dump(2, ' ', false, nlohmann::ordered_json::error_handler_t::replace); }

void run_config_command(const ConfigCommandState& state, const ConfigCommandIo& io) {
  std::ostream& out = *io.out;
  std::ostream& err = *io.err;
  if (state.json_to_file()) {  // before anything resolves, as bench and step check theirs
    or_usage_error([&] { check_output_path("config", "--json", state.json_file); }, &err);
  }
  ConfigSources sources;
  for (const auto& [key, option] : state.options) {
    if (option->count() > 0) sources.flags.push_back(FlagValue{key, state.values.at(key)});
  }
  sources.environment = io.environment;
  const std::vector<const Backend*> backends = io.backends();

  std::optional<ResolvedConfig> resolved;
  std::string error;
  // The matrix first: a setting every backend refuses whatever the problem (a kernel override such
  // as LATENTKV_MLA_KERNEL=bogus) is then the error, not a matrix narrowed by it.
  std::ostringstream matrix_text;
  nlohmann::ordered_json capabilities;
  bool matrix_ok = false;
  try {
    if (state.explain) {
      if (state.as_json()) capabilities = matrix_json(backends);
      else print_matrix(matrix_text, backends);
    }
    matrix_ok = true;
    const AttentionConfig config = load_config(sources);
    const DeviceInfo device = state.device == "cpu" ? DeviceInfo{} : io.device();
    if (state.device == "cuda" && device.kind != DeviceKind::kCuda) {
      throw Error("config", "--device", "cuda",
                  "a CUDA GPU: " + why_no_gpu() + "; --device cpu or auto resolves for the CPU");
    }
    resolved = resolve_config(config, device, backends);
  } catch (const Error& e) {
    error = e.what();
  }

  if (state.explain && !state.as_json() && matrix_ok) out << matrix_text.str() << "\n";
  if (!resolved) {
    err << "error: " << controls_escaped(error) << "\n"
        << "(configuration rejected before any kernel ran; `latentkv config --explain` prints what every backend "
           "supports)\n";
    err.flush();
    throw CLI::RuntimeError(kExitUsage);
  }
  if (state.as_json()) {
    nlohmann::ordered_json j = config_json(*resolved);
    if (state.explain) j["capabilities"] = std::move(capabilities);
    if (state.json_to_file()) write_output_file("config", "--json", state.json_file, dump(j) + "\n");
    else out << dump(j) << "\n";
  } else {
    print_config(out, *resolved);
  }
  out.flush();
}

}  // namespace

CLI::App* add_config_command(CLI::App& app, ConfigCommandIo io) {
  CLI::App* cmd = app.add_subcommand(
      "config",
      "Resolve and print the attention configuration: each value with its source (flags > environment LATENTKV_* > "
      "config file > defaults), the device, and the backend and kernel of every slot; exit 2 when it cannot run");
  auto state = std::make_shared<ConfigCommandState>();
  struct OptionText {
    std::string_view key;
    std::string_view help;
  };
  static constexpr OptionText kOptions[] = {
      {"model", "model preset: glm5 or deepseek-v3.2"},
      {"tp", "tensor parallelism (divides the attention heads)"},
      {"kv_dtype", "main cache format: fp8_e4m3 or bf16"},
      {"page_size", "tokens per cache page (1 .. 2^30)"},
      {"q_len", "most new tokens per request in decode: 1..4"},
      {"dense_prefill", "backend for dense prefill, or auto"},
      {"dense_decode", "backend for dense decode, or auto"},
      {"sparse_prefill", "backend for sparse prefill, or auto"},
      {"sparse_decode", "backend for sparse decode, or auto"},
      {"config", "TOML file (JSON when it ends in .json)"},
  };
  for (const OptionText& o : kOptions) {
    const std::string key(o.key);
    state->options[key] = cmd->add_option(flag_name(key), state->values[key],
                                          std::string(o.help) + " [env " + environment_variable(key) + "]");
  }
  cmd->add_flag("--explain", state->explain, "also print the capability matrix of every registered backend");
  state->json = cmd->add_option("--json", state->json_file,
                                 "print the resolved configuration as JSON; with FILE, write it there instead (as "
                                 "bench and step do)")
                    ->expected(0, 1)
                    ->type_name("[FILE]");
  cmd->add_option("--device", state->device,
                  "resolve for the detected device (auto), for the cpu, or for the detected GPU (cuda: an error "
                  "where there is none)")
      ->transform(CLI::Transformer({{"detected", "auto"}}))  // as `latentkv step --device` reads it
      ->check(CLI::IsMember({"auto", "cpu", "cuda"}))
      ->capture_default_str();
  cmd->callback([state, io = std::move(io)] { run_config_command(*state, io); });
  return cmd;
}

void add_config_command(CLI::App& app) { add_config_command(app, ConfigCommandIo{}); }

}  // namespace latentkv::tools
