// The attention configuration: reading its sources in precedence order, checking every value, and
// resolving each slot to a backend and kernel through Backend::select().
#include "latentkv/config.hpp"

#include <algorithm>
#include <charconv>
#include <climits>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iterator>
#include <set>
#include <sstream>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

// toml++ checks its internal preconditions with TOML_ASSERT, compiled out under NDEBUG, where some
// become assumptions the optimizer may exploit. toml++ 3.3 (the Debian 12 package) breaks some of them
// on malformed input (found by ConfigFuzz with assertions on: "tp =2024-01-01 8", "[%["). Here a broken
// precondition throws instead, and apply_toml() reports the input as malformed. The parser's own
// functions may throw (parse_error), so the exception propagates to us. A few checks sit in noexcept
// functions (stepping back through the reader's history, the UTF-8 decoder, toml::path, which this
// file does not use): a broken one there ends the process deterministically rather than running on
// into undefined behaviour; the fuzz tests have never reached one. -Wterminate says exactly that.
namespace latentkv::detail {
struct TomlCheckFailed {
  const char* check;
};
}  // namespace latentkv::detail
#pragma push_macro("NDEBUG")
#undef NDEBUG
#define TOML_ASSERT(expr) ((expr) ? static_cast<void>(0) : throw ::latentkv::detail::TomlCheckFailed{#expr})
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wterminate"
#include <toml++/toml.h>
#pragma GCC diagnostic pop
#pragma pop_macro("NDEBUG")

#include "core/read_file.hpp"
#include "latentkv/environment.hpp"
#include "latentkv/ops.hpp"

namespace latentkv {
namespace {

// ---- keys ---------------------------------------------------------------------------------------

enum class ValueKind : std::uint8_t { kString, kInteger };

struct KeySpec {
  std::string_view key;
  ValueKind kind;
};

constexpr KeySpec kKeySpecs[] = {
    {"model", ValueKind::kString},          {"tp", ValueKind::kInteger},
    {"kv_dtype", ValueKind::kString},       {"page_size", ValueKind::kInteger},
    {"q_len", ValueKind::kInteger},         {"dense_prefill", ValueKind::kString},
    {"dense_decode", ValueKind::kString},   {"sparse_prefill", ValueKind::kString},
    {"sparse_decode", ValueKind::kString},
};

// A configuration file larger than this is not a configuration file.
constexpr std::uintmax_t kMaxConfigFileBytes = 1 << 20;
// Backend names are short identifiers; anything longer is a typo or garbage.
constexpr std::size_t kMaxBackendNameLength = 64;

const KeySpec* find_key(std::string_view key) {
  for (const KeySpec& spec : kKeySpecs) {
    if (spec.key == key) return &spec;
  }
  return nullptr;
}

std::string join(const std::vector<std::string>& items, std::string_view separator = ", ") {
  std::string out;
  for (const std::string& item : items) {
    if (!out.empty()) out += separator;
    out += item;
  }
  return out;
}

std::string known_keys_text() {
  std::vector<std::string> keys;
  for (const KeySpec& spec : kKeySpecs) keys.emplace_back(spec.key);
  return join(keys);
}

std::optional<Slot> slot_of_key(std::string_view key) {
  for (Slot slot : kAllSlots) {
    if (slot_name(slot) == key) return slot;
  }
  return std::nullopt;
}

std::string registered_names_text() {
  std::vector<std::string> names;
  for (const Backend* b : registered_backends()) names.emplace_back(b->name());
  return names.empty() ? "none" : join(names);
}

std::string expected_text(std::string_view key) {
  if (key == "model") return "one of: " + join(model_preset_names());
  if (key == "tp") return "a positive integer that divides the model's attention heads";
  if (key == "kv_dtype") return "fp8_e4m3 or bf16";
  if (key == "page_size") {
    return "an integer from 1 to " + std::to_string(kMaxTableTokens) +
           " (tokens per page; a block-table row holds at most 2^30 tokens)";
  }
  if (key == "q_len") {
    return "an integer from 1 to " + std::to_string(kMaxDecodeQLen) + " (new tokens per request in decode)";
  }
  return "auto or a backend name of letters, digits, '_', '-' or '.' (registered: " + registered_names_text() + ")";
}

bool is_backend_name(std::string_view name) {
  if (name.empty() || name.size() > kMaxBackendNameLength) return false;
  return std::all_of(name.begin(), name.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
           ch == '-' || ch == '.';
  });
}

// ---- setting one value --------------------------------------------------------------------------

void set_integer(AttentionConfig& config, std::string_view key, std::int64_t value, const Provenance& source) {
  const std::string shown = std::to_string(value);
  auto checked = [&](std::int64_t low, std::int64_t high) {
    if (value < low || value > high) throw ConfigError(std::string(key), shown, source, expected_text(key));
    return static_cast<int>(value);
  };
  if (key == "tp") {
    config.tp = {checked(1, INT_MAX), source};
  } else if (key == "page_size") {
    config.page_size = {checked(1, kMaxTableTokens), source};
  } else if (key == "q_len") {
    config.q_len = {checked(1, kMaxDecodeQLen), source};
  } else {
    throw ConfigError(std::string(key), "key '" + std::string(key) + "' does not take an integer");
  }
}

void set_string(AttentionConfig& config, std::string_view key, const std::string& value, const Provenance& source) {
  if (key == "model") {
    const std::vector<std::string> names = model_preset_names();
    if (std::find(names.begin(), names.end(), value) == names.end()) {
      throw ConfigError("model", quoted_value(value), source, expected_text(key));
    }
    config.model = {value, source};
  } else if (key == "kv_dtype") {
    KvDtype dtype{};
    try {
      dtype = parse_kv_dtype(value);
    } catch (const Error&) {
      throw ConfigError("kv_dtype", quoted_value(value), source, expected_text(key));
    }
    config.kv_dtype = {dtype, source};
  } else if (const std::optional<Slot> slot = slot_of_key(key)) {
    if (!is_backend_name(value)) throw ConfigError(std::string(key), quoted_value(value), source, expected_text(key));
    config.backend(*slot) = {value, source};
  } else {
    throw ConfigError(std::string(key), "key '" + std::string(key) + "' does not take a string");
  }
}

// A decimal integer, with an optional leading '+' as the commands' own integer options take it
// ("+8" as 8; "+-8" and "+" are not integers).
std::optional<std::int64_t> parse_integer(std::string_view text) {
  if (text.starts_with('+') && !text.starts_with("+-")) text.remove_prefix(1);
  std::int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [ptr, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec != std::errc() || ptr != end) return std::nullopt;
  return value;
}

// A value typed as text (a flag or an environment variable).
void set_from_text(AttentionConfig& config, const KeySpec& spec, const std::string& text, const Provenance& source) {
  if (spec.kind == ValueKind::kString) {
    set_string(config, spec.key, text, source);
    return;
  }
  const std::optional<std::int64_t> value = parse_integer(text);
  if (!value) throw ConfigError(std::string(spec.key), quoted_value(text), source, expected_text(spec.key));
  set_integer(config, spec.key, *value, source);
}

// ", got a string", ", got an array", ", got null": what a setting's value was instead.
std::string got(std::string_view type) {
  if (type == "null") return ", got null";
  const bool vowel = !type.empty() && std::string_view("aeiou").find(type.front()) != std::string_view::npos;
  return std::string(vowel ? ", got an " : ", got a ") + std::string(type);
}

// ---- TOML ---------------------------------------------------------------------------------------

std::string_view toml_type_name(toml::node_type type) {
  switch (type) {
    case toml::node_type::none: return "nothing";
    case toml::node_type::table: return "table";
    case toml::node_type::array: return "array";
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "floating-point number";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
  }
  return "value";
}

std::string toml_shown(const toml::node& node) {
  if (const auto* s = node.as_string()) return quoted_value(s->get());
  if (const auto* i = node.as_integer()) return std::to_string(i->get());
  if (const auto* b = node.as_boolean()) return b->get() ? "true" : "false";
  if (const auto* f = node.as_floating_point()) {
    std::ostringstream out;
    out << f->get();
    std::string text = out.str();
    // A whole float shown as one (8.0, not 8): the message goes on to say it is no integer.
    if (text.find_first_not_of("-0123456789") == std::string::npos) text += ".0";
    return text;
  }
  return "<" + std::string(toml_type_name(node.type())) + ">";
}

std::string with_line(std::string_view path, const toml::source_region& region) {
  std::string where(path);
  if (region.begin.line > 0) where += ":" + std::to_string(region.begin.line);
  return where;
}

// Input that toml++ 3.3 (the Debian 12 package) does not turn into a parse_error, refused before it
// reaches the parser. Found by ConfigFuzz under UBSan and toml++'s own assertions, and known upstream:
//  * non-ASCII text can reach __builtin_unreachable() in its Unicode whitespace test (a non-ASCII
//    character after a line-ending backslash in a multi-line string, malformed UTF-8 such as
//    "\xcc\xaa"; marzer/tomlplusplus issues 190 and 295);
//  * a malformed table header ("[%[", "[[[1]]]") breaks a precondition of its key parser, an abort
//    with assertions on and an assumption the optimizer may exploit without (pull request 301).
// Neither is needed: every key and value of a configuration is ASCII, and all keys are top level.
void screen_toml(std::string_view text, std::string_view path) {
  constexpr std::string_view kUtf8Bom = "\xef\xbb\xbf";  // editors may write one; toml++ skips it
  if (text.substr(0, kUtf8Bom.size()) == kUtf8Bom) text.remove_prefix(kUtf8Bom.size());
  int line = 1, column = 1;
  bool line_start = true;  // only spaces and tabs so far on this line
  for (char ch : text) {
    const auto byte = static_cast<unsigned char>(ch);
    auto where = [&] { return "file " + std::string(path) + ":" + std::to_string(line) + ":" + std::to_string(column); };
    if (byte >= 0x80) {
      static constexpr char kHex[] = "0123456789abcdef";
      throw ConfigError("config", where() + ": non-ASCII byte 0x" + kHex[byte >> 4] + kHex[byte & 0xF] +
                                      "; a TOML configuration file must be ASCII, comments included (or use JSON)");
    }
    if (line_start && ch == '[') {
      throw ConfigError("config", where() + ": a table header; a latentkv configuration has no tables: write every "
                                          "key at the top level, one 'key = value' per line (expected keys: " +
                                          known_keys_text() + ")");
    }
    if (ch == '\n') {
      ++line;
      column = 1;
      line_start = true;
    } else {
      ++column;
      if (ch != ' ' && ch != '\t') line_start = false;
    }
  }
}

void apply_toml(AttentionConfig& config, std::string_view text, std::string_view path) {
  screen_toml(text, path);
  toml::table table;
  try {
    table = toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    std::string where = "file " + std::string(path);
    if (e.source().begin.line > 0) {
      where += ":" + std::to_string(e.source().begin.line) + ":" + std::to_string(e.source().begin.column);
    }
    throw ConfigError("config", where + ": malformed TOML: " + std::string(e.description()));
  } catch (const detail::TomlCheckFailed& e) {
    throw ConfigError("config", "file " + std::string(path) + ": malformed TOML (the parser stopped at its internal "
                                "check '" + e.check + "')");
  }
  for (auto&& [key, node] : table) {
    const std::string name(key.str());
    const Provenance source{SourceKind::kFile, with_line(path, key.source())};
    const KeySpec* spec = find_key(name);
    if (spec == nullptr) {
      throw ConfigError(name, "unknown key " + quoted_value(name) + " (" + source.describe() + "); expected one of: " +
                                  known_keys_text());
    }
    if (spec->kind == ValueKind::kInteger) {
      const auto* value = node.as_integer();
      if (value == nullptr) {
        throw ConfigError(name, toml_shown(node), source,
                          expected_text(name) + got(toml_type_name(node.type())));
      }
      set_integer(config, name, value->get(), source);
    } else {
      const auto* value = node.as_string();
      if (value == nullptr) {
        throw ConfigError(name, toml_shown(node), source,
                          "a string: " + expected_text(name) + got(toml_type_name(node.type())));
      }
      set_string(config, name, value->get(), source);
    }
  }
}

// ---- JSON ---------------------------------------------------------------------------------------

std::string json_shown(const nlohmann::json& value) {
  if (value.is_string()) return quoted_value(value.get_ref<const std::string&>());
  if (value.is_object()) return "<object>";
  if (value.is_array()) return "<array>";
  return value.dump(-1, ' ', true, nlohmann::json::error_handler_t::replace);
}

std::string json_type_name(const nlohmann::json& value) {
  if (value.is_number_float()) return "floating-point number";
  if (value.is_number()) return "integer";
  return value.type_name();
}

// nlohmann's messages start with "[json.exception.parse_error.101] "; the rest is for people.
std::string json_message(const nlohmann::json::exception& e) {
  std::string_view what = e.what();
  if (const std::size_t close = what.find("] "); !what.empty() && what.front() == '[' && close != std::string::npos) {
    what.remove_prefix(close + 2);
  }
  return std::string(what);
}

void apply_json(AttentionConfig& config, std::string_view text, std::string_view path) {
  const std::string file = "file " + std::string(path);
  std::optional<std::string> duplicate;
  std::set<std::string> seen;
  nlohmann::json document;
  try {
    document = nlohmann::json::parse(
        text.begin(), text.end(),
        [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
          if (depth == 1 && event == nlohmann::json::parse_event_t::key && parsed.is_string()) {
            const std::string& key = parsed.get_ref<const std::string&>();
            if (!seen.insert(key).second && !duplicate) duplicate = key;
          }
          return true;
        });
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError("config", file + ": malformed JSON: " + json_message(e));
  }
  if (!document.is_object()) {
    throw ConfigError("config", file + ": expected a JSON object of settings at the top level, got " +
                                    std::string(document.type_name()));
  }
  if (duplicate) {
    throw ConfigError(*duplicate, file + ": key " + quoted_value(*duplicate) + " appears more than once");
  }
  const Provenance source{SourceKind::kFile, std::string(path)};
  for (const auto& [name, value] : document.items()) {
    const KeySpec* spec = find_key(name);
    if (spec == nullptr) {
      throw ConfigError(name, "unknown key " + quoted_value(name) + " (" + source.describe() + "); expected one of: " +
                                  known_keys_text());
    }
    if (spec->kind == ValueKind::kInteger) {
      if (value.is_number_unsigned()) {
        const auto u = value.get<std::uint64_t>();
        if (u > static_cast<std::uint64_t>(INT64_MAX)) {
          throw ConfigError(name, json_shown(value), source, expected_text(name));
        }
        set_integer(config, name, static_cast<std::int64_t>(u), source);
      } else if (value.is_number_integer()) {
        set_integer(config, name, value.get<std::int64_t>(), source);
      } else {
        throw ConfigError(name, json_shown(value), source, expected_text(name) + got(json_type_name(value)));
      }
    } else {
      if (!value.is_string()) {
        throw ConfigError(name, json_shown(value), source,
                          "a string: " + expected_text(name) + got(json_type_name(value)));
      }
      set_string(config, name, value.get_ref<const std::string&>(), source);
    }
  }
}

// ---- resolution helpers -------------------------------------------------------------------------

// Which Problem fields an op carries (as problem_of() fills them); page_size is always carried.
struct Fields {
  bool kv_dtype = false;
  bool heads = false;
  bool q_len = false;
  bool topk = false;
};

Fields fields_of(Op op) {
  switch (op) {
    case Op::kAppend: return {true, false, false, false};
    case Op::kMlaDecode: return {true, true, true, false};
    case Op::kMlaPrefill: return {true, true, false, false};
    case Op::kIndexerLogits: return {false, true, true, false};
    case Op::kTopk: return {false, false, true, true};
    case Op::kSparseMlaDecode: return {true, true, true, true};
    case Op::kSparseMlaPrefill: return {true, true, false, true};
    case Op::kIndexerPrefill: return {false, true, false, true};
  }
  return {};
}

// select(), guarded: a backend that throws from select() has rejected the problem. But an Error
// about an environment variable (a kernel override such as LATENTKV_MLA_KERNEL=bogus) is the
// process's setting, wrong for every problem: it goes to the caller, which reports it as the error
// it is, instead of a capability matrix quietly narrowed by it.
Selection ask(const Backend& backend, const Problem& problem) {
  try {
    return backend.select(problem);
  } catch (const std::exception& e) {
    if (const auto* error = dynamic_cast<const Error*>(&e); error && error->argument().starts_with("LATENTKV_")) throw;
    return Selection::no(std::string("select() threw: ") + e.what());
  }
}

// select() for the problem and, where the op carries q_len, for every smaller q_len as well: a
// decode slot configured for q_len 3 also runs steps of 1 and 2 new tokens.
Selection ask_all_q_len(const Backend& backend, const Problem& problem) {
  Selection selection = ask(backend, problem);
  if (!selection || !fields_of(problem.op).q_len) return selection;
  for (int q = 1; q < problem.q_len; ++q) {
    Problem smaller = problem;
    smaller.q_len = q;
    const Selection other = ask(backend, smaller);
    if (!other) return Selection::no("at q_len " + std::to_string(q) + ": " + other.reason);
  }
  return selection;
}

std::vector<const Backend*> by_preference(const std::vector<const Backend*>& backends) {
  std::vector<const Backend*> sorted;
  for (const Backend* b : backends) {
    if (b != nullptr) sorted.push_back(b);
  }
  std::stable_sort(sorted.begin(), sorted.end(),
                   [](const Backend* a, const Backend* b) { return a->preference() > b->preference(); });
  return sorted;
}

// Every backend's answer, in the order given (callers pass by_preference()).
std::vector<Candidate> ask_every_backend(const std::vector<const Backend*>& sorted, const Problem& problem) {
  std::vector<Candidate> candidates;
  for (const Backend* b : sorted) {
    const Selection selection = ask_all_q_len(*b, problem);
    Candidate c;
    c.backend = std::string(b->name());
    c.preference = b->preference();
    c.accepted = static_cast<bool>(selection);
    if (selection) c.kernel = selection.kernel->name;
    c.reason = selection.reason;
    candidates.push_back(std::move(c));
  }
  return candidates;
}

std::string accepted_names(const std::vector<Candidate>& candidates, std::string_view except = {}) {
  std::vector<std::string> names;
  for (const Candidate& c : candidates) {
    if (c.accepted && c.backend != except) names.push_back(c.backend);
  }
  return join(names);
}

std::string all_names(const std::vector<const Backend*>& backends) {
  std::vector<std::string> names;
  for (const Backend* b : backends) {
    if (b != nullptr) names.emplace_back(b->name());
  }
  return names.empty() ? "none" : join(names);
}

const Backend* find_in(const std::vector<const Backend*>& backends, std::string_view name) {
  for (const Backend* b : backends) {
    if (b != nullptr && b->name() == name) return b;
  }
  return nullptr;
}

std::string would_work_text(const std::string& role, const std::vector<Candidate>& candidates,
                            std::string_view except = {}) {
  const std::string names = accepted_names(candidates, except);
  if (names.empty()) return "No registered backend would run " + role + " here.";
  return "Backends that would run " + role + " here: " + names + " (or auto).";
}

// Why a named backend that rejects a slot's problem is the wrong kind for it, in plain words, plus the
// settings under which it would run: the other cache dtype, or another probed device.
std::string rejection_hints(const Backend& backend, const Problem& problem, const ModelShard& shard) {
  std::string hints;
  const std::string name = quoted_value(backend.name());
  const bool sparse = problem.op == Op::kSparseMlaDecode || problem.op == Op::kSparseMlaPrefill;
  const bool dense = problem.op == Op::kMlaDecode || problem.op == Op::kMlaPrefill;
  if (sparse || dense) {
    Problem other = problem;
    if (sparse) {
      other.op = problem.op == Op::kSparseMlaDecode ? Op::kMlaDecode : Op::kMlaPrefill;
      other.topk = 0;
    } else {
      other.op = problem.op == Op::kMlaDecode ? Op::kSparseMlaDecode : Op::kSparseMlaPrefill;
      other.topk = shard.model.index_topk;
    }
    if (ask_all_q_len(backend, other)) {
      if (sparse) {
        hints += " " + name + " is a dense backend: it runs " + std::string(op_name(other.op)) + " but not " +
                 std::string(op_name(problem.op)) + ", and a dense backend in a sparse slot would attend to every "
                 "token where " + shard.model.name + " attends only to the index_topk = " +
                 std::to_string(shard.model.index_topk) + " tokens its indexer selects.";
      } else {
        hints += " " + name + " is a sparse backend: it runs " + std::string(op_name(other.op)) + " but not " +
                 std::string(op_name(problem.op)) + "; a dense slot needs a dense kernel.";
      }
    }
  }
  if (fields_of(problem.op).kv_dtype) {
    Problem other = problem;
    other.kv_dtype = problem.kv_dtype == KvDtype::kFp8E4M3 ? KvDtype::kBf16 : KvDtype::kFp8E4M3;
    if (ask_all_q_len(backend, other)) {
      hints += " " + name + " would run it with kv_dtype " + std::string(kv_dtype_name(other.kv_dtype)) +
               " but not " + std::string(kv_dtype_name(problem.kv_dtype)) + ".";
    }
  }
  std::vector<std::string> devices;
  for (const DeviceInfo& device : default_probe_grid().devices) {
    if (device.kind == problem.device.kind && device.sm == problem.device.sm) continue;
    Problem other = problem;
    other.device = device;
    if (ask_all_q_len(backend, other)) devices.push_back(describe_device(device));
  }
  if (!devices.empty()) {
    hints += " " + name + " would run it on: " + join(devices) + " (this device: " + describe_device(problem.device) +
             ").";
  }
  return hints;
}

OpResolution resolve_op(std::string role, const Problem& problem, const Sourced<std::string>& requested,
                        const std::vector<const Backend*>& backends, const ModelShard& shard) {
  OpResolution r;
  r.role = std::move(role);
  r.problem = problem;
  r.requested = requested.value;
  r.source = requested.source;
  const std::vector<const Backend*> sorted = by_preference(backends);
  r.candidates = ask_every_backend(sorted, problem);
  const std::string what = r.role + " [" + describe_problem(problem) + "]";

  if (requested.value == kAutoBackend) {
    std::vector<std::string> passed_over;
    for (std::size_t i = 0; i < r.candidates.size(); ++i) {
      const Candidate& c = r.candidates[i];
      if (!c.accepted) {
        passed_over.push_back(c.backend + " (" + c.reason + ")");
        continue;
      }
      r.backend = sorted[i];
      r.why = "auto: the accepted backend of highest preference (" + std::to_string(c.preference) + ")";
      if (!c.reason.empty()) r.why += "; " + c.reason;
      if (!passed_over.empty()) r.why += "; passed over: " + join(passed_over, "; ");
      break;
    }
    if (r.backend == nullptr) {
      std::vector<std::string> reasons;
      for (const Candidate& c : r.candidates) reasons.push_back(c.backend + ": " + c.reason);
      std::string message = r.role + " = auto (" + r.source.describe() + "): no registered backend can run " + what;
      if (reasons.empty()) {
        message += ": no backend is registered.";
      } else {
        message += ". " + join(reasons, "; ") +
                   ". Change kv_dtype, tp, page_size or q_len, or run on a device one of these backends supports.";
      }
      throw ConfigError(r.role, message);
    }
  } else {
    const Backend* backend = find_in(backends, requested.value);
    const std::string head = r.role + " = " + quoted_value(requested.value) + " (" + r.source.describe() + "): ";
    if (backend == nullptr) {
      throw ConfigError(r.role, head + "no backend is named " + quoted_value(requested.value) + " (registered: " +
                                    all_names(backends) + "). " + would_work_text(what, r.candidates));
    }
    const Candidate& mine = *std::find_if(r.candidates.begin(), r.candidates.end(),
                                          [&](const Candidate& c) { return c.backend == requested.value; });
    if (!mine.accepted) {
      throw ConfigError(r.role, head + "backend " + quoted_value(requested.value) + " cannot run " + what + ": " +
                                    mine.reason + "." + rejection_hints(*backend, problem, shard) + " " +
                                    would_work_text(r.role, r.candidates, requested.value));
    }
    r.backend = backend;
    r.why = "named by " + r.source.describe();
    if (!mine.reason.empty()) r.why += "; " + mine.reason;
  }
  // The kernel is select()'s own answer for the problem as configured.
  Selection selection = ask(*r.backend, problem);
  if (!selection) {
    throw ConfigError(r.role, r.role + ": backend " + quoted_value(r.backend->name()) + " accepted " + what +
                                  " once and then rejected it: " + selection.reason);
  }
  r.kernel = std::move(*selection.kernel);
  return r;
}

std::string divisors_text(int n) {
  std::vector<std::string> divisors;
  for (int d = 1; d <= n; ++d) {
    if (n % d == 0) divisors.push_back(std::to_string(d));
  }
  return join(divisors);
}

}  // namespace

// ---- names and provenance -----------------------------------------------------------------------

std::string_view source_kind_name(SourceKind kind) {
  switch (kind) {
    case SourceKind::kDefault: return "default";
    case SourceKind::kFile: return "file";
    case SourceKind::kEnvironment: return "environment";
    case SourceKind::kFlag: return "flag";
  }
  return "?";
}

std::string Provenance::describe() const {
  if (kind == SourceKind::kDefault || where.empty()) return std::string(source_kind_name(kind));
  return std::string(source_kind_name(kind)) + " " + where;
}

std::string_view slot_name(Slot slot) {
  switch (slot) {
    case Slot::kDensePrefill: return "dense_prefill";
    case Slot::kDenseDecode: return "dense_decode";
    case Slot::kSparsePrefill: return "sparse_prefill";
    case Slot::kSparseDecode: return "sparse_decode";
  }
  return "?";
}

Op slot_op(Slot slot) {
  constexpr Op kOps[] = {Op::kMlaPrefill, Op::kMlaDecode, Op::kSparseMlaPrefill, Op::kSparseMlaDecode};
  return kOps[slot_index(slot)];
}

std::size_t slot_index(Slot slot) {
  const auto i = static_cast<std::size_t>(slot);
  if (i >= std::size(kAllSlots)) {
    throw ConfigError("slot", "slot " + std::to_string(i) + " is not a Slot (expected dense_prefill, dense_decode, "
                                                            "sparse_prefill or sparse_decode)");
  }
  return i;
}

bool slot_is_sparse(Slot slot) { return slot == Slot::kSparsePrefill || slot == Slot::kSparseDecode; }
bool slot_is_decode(Slot slot) { return slot == Slot::kDenseDecode || slot == Slot::kSparseDecode; }

const std::vector<std::string_view>& config_keys() {
  static const std::vector<std::string_view> keys = [] {
    std::vector<std::string_view> v;
    for (const KeySpec& spec : kKeySpecs) v.push_back(spec.key);
    return v;
  }();
  return keys;
}

std::string environment_variable(std::string_view key) {
  std::string name = kEnvironmentPrefix;
  for (char ch : key) name += (ch >= 'a' && ch <= 'z') ? static_cast<char>(ch - 'a' + 'A') : ch;
  return name;
}

std::string flag_name(std::string_view key) {
  std::string name = "--";
  for (char ch : key) name += ch == '_' ? '-' : ch;
  return name;
}

ConfigError::ConfigError(std::string key, std::string value, const Provenance& source, std::string expected)
    : Error("config", key + " = " + value + " (" + source.describe() + "): expected " + expected),
      key_(std::move(key)) {}

ConfigError::ConfigError(std::string key, std::string message) : Error("config", std::move(message)), key_(std::move(key)) {}

// ---- sources ------------------------------------------------------------------------------------

Environment process_environment() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* value = std::getenv(std::string(name).c_str());
    if (value == nullptr) return std::nullopt;
    return std::string(value);
  };
}

Environment environment_from(std::map<std::string, std::string> variables) {
  return [variables = std::move(variables)](std::string_view name) -> std::optional<std::string> {
    const auto it = variables.find(std::string(name));
    if (it == variables.end()) return std::nullopt;
    return it->second;
  };
}

ConfigFormat config_format_for(std::string_view path) {
  constexpr std::string_view kJsonSuffix = ".json";
  if (path.size() >= kJsonSuffix.size() && path.substr(path.size() - kJsonSuffix.size()) == kJsonSuffix) {
    return ConfigFormat::kJson;
  }
  return ConfigFormat::kToml;
}

void apply_config_text(AttentionConfig& config, std::string_view text, std::string_view path, ConfigFormat format) {
  // Work on a copy so a rejected file changes nothing.
  AttentionConfig updated = config;
  if (format == ConfigFormat::kJson) {
    apply_json(updated, text, path);
  } else {
    apply_toml(updated, text, path);
  }
  config = std::move(updated);
}

void apply_config_file(AttentionConfig& config, const Sourced<std::string>& path) {
  const std::string shown = quoted_value(path.value);
  if (path.value.empty()) throw ConfigError("config", shown, path.source, "the path of a TOML or JSON file");
  std::error_code ec;
  const std::filesystem::path file(path.value);
  const auto status = std::filesystem::status(file, ec);
  if (ec || !std::filesystem::exists(status)) {
    throw ConfigError("config", shown, path.source,
                      "an existing TOML or JSON file (" + (ec ? ec.message() : std::string("no such file")) + ")");
  }
  if (!std::filesystem::is_regular_file(status)) {
    throw ConfigError("config", shown, path.source, "a regular file, not a directory or device");
  }
  const auto too_large = [&] {
    return ConfigError("config", shown, path.source,
                       "a configuration file of at most " + std::to_string(kMaxConfigFileBytes) + " bytes");
  };
  const std::uintmax_t size = std::filesystem::file_size(file, ec);
  if (ec || size > kMaxConfigFileBytes) throw too_large();
  // Held to the limit as it is read too: a file whose size the file system does not report (procfs).
  using Read = detail::BoundedRead::Status;
  const detail::BoundedRead read = detail::read_at_most(file, kMaxConfigFileBytes);
  if (read.status == Read::kCannotOpen) {
    throw ConfigError("config", shown, path.source, "a readable file (it could not be opened)");
  }
  if (read.status == Read::kReadFailed) {
    throw ConfigError("config", shown, path.source, "a readable file (the read failed)");
  }
  if (read.status == Read::kTooLarge) throw too_large();
  apply_config_text(config, read.text, path.value, config_format_for(path.value));
  config.config_file = path;
}

void apply_environment(AttentionConfig& config, const Environment& environment) {
  if (!environment) return;
  AttentionConfig updated = config;
  for (const KeySpec& spec : kKeySpecs) {
    const std::string name = environment_variable(spec.key);
    const std::optional<std::string> value = environment(name);
    if (!value || value->empty()) continue;
    set_from_text(updated, spec, *value, Provenance{SourceKind::kEnvironment, name});
  }
  config = std::move(updated);
}

void apply_flags(AttentionConfig& config, const std::vector<FlagValue>& flags) {
  AttentionConfig updated = config;
  for (const FlagValue& flag : flags) {
    if (flag.key == kConfigFileKey) continue;
    const KeySpec* spec = find_key(flag.key);
    if (spec == nullptr) {
      throw ConfigError(flag.key, "unknown setting " + quoted_value(flag.key) + " (a flag); expected one of: " +
                                      known_keys_text());
    }
    set_from_text(updated, *spec, flag.value, Provenance{SourceKind::kFlag, flag_name(flag.key)});
  }
  config = std::move(updated);
}

void check_config(const AttentionConfig& config) {
  const std::vector<std::string> names = model_preset_names();
  if (std::find(names.begin(), names.end(), config.model.value) == names.end()) {
    throw ConfigError("model", quoted_value(config.model.value), config.model.source, expected_text("model"));
  }
  const ModelPreset& model = model_preset(config.model.value);
  if (config.tp.value < 1 || model.heads % config.tp.value != 0) {
    throw ConfigError("tp", std::to_string(config.tp.value), config.tp.source,
                      "a divisor of the " + std::to_string(model.heads) + " attention heads of " + model.name +
                          " (model from " + config.model.source.describe() + "): " + divisors_text(model.heads));
  }
  if (config.kv_dtype.value != KvDtype::kFp8E4M3 && config.kv_dtype.value != KvDtype::kBf16) {
    throw ConfigError("kv_dtype", std::to_string(static_cast<int>(config.kv_dtype.value)), config.kv_dtype.source,
                      expected_text("kv_dtype"));
  }
  if (config.page_size.value < 1 || config.page_size.value > kMaxTableTokens) {
    throw ConfigError("page_size", std::to_string(config.page_size.value), config.page_size.source,
                      expected_text("page_size"));
  }
  if (config.q_len.value < 1 || config.q_len.value > kMaxDecodeQLen) {
    throw ConfigError("q_len", std::to_string(config.q_len.value), config.q_len.source, expected_text("q_len"));
  }
  for (Slot slot : kAllSlots) {
    const Sourced<std::string>& b = config.backend(slot);
    if (!is_backend_name(b.value)) {
      throw ConfigError(std::string(slot_name(slot)), quoted_value(b.value), b.source, expected_text(slot_name(slot)));
    }
  }
}

AttentionConfig load_config(const ConfigSources& sources) {
  AttentionConfig config;
  std::optional<Sourced<std::string>> file;
  for (const FlagValue& flag : sources.flags) {
    if (flag.key == kConfigFileKey) file = Sourced<std::string>{flag.value, {SourceKind::kFlag, flag_name(flag.key)}};
  }
  if (!file && sources.environment) {
    const std::string name = environment_variable(kConfigFileKey);
    if (std::optional<std::string> path = sources.environment(name); path && !path->empty()) {
      file = Sourced<std::string>{*path, {SourceKind::kEnvironment, name}};
    }
  }
  if (file) apply_config_file(config, *file);
  apply_environment(config, sources.environment);
  apply_flags(config, sources.flags);
  check_config(config);
  return config;
}

// ---- resolution ---------------------------------------------------------------------------------

std::string describe_device(const DeviceInfo& device) {
  if (device.kind == DeviceKind::kCpu) return "cpu";
  const std::string arch = "sm_" + std::to_string(device.sm);
  if (device.name.empty() || device.name == arch) return arch;
  return device.name + " (" + arch + ")";
}

std::string describe_problem(const Problem& problem) {
  const Fields fields = fields_of(problem.op);
  std::vector<std::string> parts;
  if (fields.kv_dtype) parts.push_back(std::string(kv_dtype_name(problem.kv_dtype)) + " cache");
  if (problem.heads > 0) {
    parts.push_back(std::to_string(problem.heads) + (problem.op == Op::kIndexerLogits || problem.op == Op::kIndexerPrefill ? " indexer heads" : " heads"));
  }
  if (problem.page_size > 0) parts.push_back("page size " + std::to_string(problem.page_size));
  if (problem.q_len > 0) parts.push_back("q_len " + std::to_string(problem.q_len));
  if (problem.topk > 0) parts.push_back("topk " + std::to_string(problem.topk));
  parts.push_back("on " + describe_device(problem.device));
  return std::string(op_name(problem.op)) + ": " + join(parts);
}

Problem slot_problem(const AttentionConfig& config, Slot slot, const DeviceInfo& device) {
  check_config(config);
  const ModelShard shard = shard_model(model_preset(config.model.value), config.tp.value);
  Problem p;
  p.op = slot_op(slot);
  p.kv_dtype = config.kv_dtype.value;
  p.heads = shard.heads_per_gpu;
  p.page_size = config.page_size.value;
  p.q_len = slot_is_decode(slot) ? config.q_len.value : 0;
  p.topk = slot_is_sparse(slot) ? shard.model.index_topk : 0;
  p.device = device;
  return p;
}

Slot ResolvedConfig::route(Phase phase, std::int64_t visible_tokens) const {
  if (visible_tokens < 0) {
    throw Error("ResolvedConfig::route", "visible_tokens", std::to_string(visible_tokens), ">= 0 (tokens a row sees)");
  }
  const bool prefill = phase == Phase::kPrefill;
  if (visible_tokens <= dense_max_visible_tokens) return prefill ? Slot::kDensePrefill : Slot::kDenseDecode;
  return prefill ? Slot::kSparsePrefill : Slot::kSparseDecode;
}

const OpResolution& ResolvedConfig::supporting_op(Op op) const {
  for (const OpResolution& r : supporting) {
    if (r.role == op_name(op)) return r;
  }
  throw Error("ResolvedConfig::supporting_op", "op", std::string(op_name(op)),
              "append, indexer_logits, topk or indexer_prefill (the attention ops are slots: slot())");
}

DsaBackends ResolvedConfig::dsa_backends() const {
  DsaBackends b;
  b.indexer_logits = supporting_op(Op::kIndexerLogits).backend;
  b.topk = supporting_op(Op::kTopk).backend;
  b.sparse_decode = slot(Slot::kSparseDecode).backend;
  b.indexer_prefill = supporting_op(Op::kIndexerPrefill).backend;
  b.sparse_prefill = slot(Slot::kSparsePrefill).backend;
  return b;
}

std::string ResolvedConfig::dense_rule() const {
  const ModelPreset& m = shard.model;
  const std::string k = std::to_string(dense_max_visible_tokens);
  return m.name + " is a DSA model: in all " + std::to_string(m.layers) + " layers each query row attends to the " +
         "index_topk = " + k + " tokens its indexer selects. The dense slots (dense_prefill, dense_decode) serve "
         "only rows that see at most " + k + " tokens, where the top-k keeps every visible token and sparse "
         "attention equals dense attention; every longer row goes to the sparse slots (sparse_prefill, "
         "sparse_decode).";
}

ResolvedConfig resolve_config(const AttentionConfig& config, const DeviceInfo& device,
                              const std::vector<const Backend*>& backends) {
  check_config(config);
  ResolvedConfig r;
  r.config = config;
  r.device = device;
  r.shard = shard_model(model_preset(config.model.value), config.tp.value);
  r.dense_max_visible_tokens = r.shard.model.index_topk;
  for (Slot slot : kAllSlots) {
    r.slots[slot_index(slot)] = resolve_op(std::string(slot_name(slot)), slot_problem(config, slot, device),
                                           config.backend(slot), backends, r.shard);
  }
  // What the sparse path needs besides attention, chosen by the same rule as an `auto` slot.
  const Sourced<std::string> automatic{std::string(kAutoBackend), {}};
  Problem append;
  append.op = Op::kAppend;
  append.kv_dtype = config.kv_dtype.value;
  append.page_size = config.page_size.value;
  append.device = device;
  Problem logits;  // the indexer cache is always FP8; kv_dtype is not part of this problem
  logits.op = Op::kIndexerLogits;
  logits.heads = r.shard.model.indexer_heads;
  logits.page_size = config.page_size.value;
  logits.q_len = config.q_len.value;
  logits.device = device;
  Problem topk;
  topk.op = Op::kTopk;
  topk.page_size = config.page_size.value;
  topk.q_len = config.q_len.value;
  topk.topk = r.shard.model.index_topk;
  topk.device = device;
  Problem indexer_prefill;  // the sparse prefill's selection: logits and top-k of every new token
  indexer_prefill.op = Op::kIndexerPrefill;
  indexer_prefill.heads = r.shard.model.indexer_heads;
  indexer_prefill.page_size = config.page_size.value;
  indexer_prefill.topk = r.shard.model.index_topk;
  indexer_prefill.device = device;
  for (const Problem& p : {append, logits, topk, indexer_prefill}) {
    r.supporting.push_back(resolve_op(std::string(op_name(p.op)), p, automatic, backends, r.shard));
  }
  return r;
}

// ---- capability matrix --------------------------------------------------------------------------

ProbeGrid default_probe_grid() {
  ProbeGrid grid;
  grid.devices.push_back(DeviceInfo{});
  for (int sm : {89, 90, 100, 120}) {
    DeviceInfo d;
    d.kind = DeviceKind::kCuda;
    d.sm = sm;
    d.name = "sm_" + std::to_string(sm);
    grid.devices.push_back(d);
  }
  grid.kv_dtypes = {KvDtype::kFp8E4M3, KvDtype::kBf16};
  grid.heads = {1, 2, 4, 8, 16, 32, 64, 128, 129};
  grid.page_sizes = {1, 16, 63, 64, 128, 1024};
  grid.q_lens = {1, 2, 3, 4};
  grid.topks = {512, 2048};
  return grid;
}

std::vector<CapabilityRow> probe_capabilities(const Backend& backend, const ProbeGrid& grid) {
  std::vector<CapabilityRow> rows;
  for (Op op : kAllOps) {
    const Fields f = fields_of(op);
    const std::vector<KvDtype> dtypes = f.kv_dtype ? grid.kv_dtypes : std::vector<KvDtype>{KvDtype::kFp8E4M3};
    const std::vector<int> heads = f.heads ? grid.heads : std::vector<int>{0};
    const std::vector<int> q_lens = f.q_len ? grid.q_lens : std::vector<int>{0};
    const std::vector<int> topks = f.topk ? grid.topks : std::vector<int>{0};
    const std::vector<int>& pages = grid.page_sizes;

    struct Answer {
      std::vector<bool> accepted;  // per point, in loop order
      std::set<std::string> kernels;
      std::string rejection;
    };
    std::vector<Answer> answers;
    for (const DeviceInfo& device : grid.devices) {
      Answer a;
      for (KvDtype dt : dtypes) {
        for (int h : heads) {
          for (int ps : pages) {
            for (int q : q_lens) {
              for (int k : topks) {
                Problem p;
                p.op = op;
                p.kv_dtype = dt;
                p.heads = h;
                p.page_size = ps;
                p.q_len = q;
                p.topk = k;
                p.device = device;
                const Selection s = ask(backend, p);
                a.accepted.push_back(static_cast<bool>(s));
                if (s) {
                  a.kernels.insert(s.kernel->name);
                } else if (a.rejection.empty()) {
                  a.rejection = s.reason;
                }
              }
            }
          }
        }
      }
      answers.push_back(std::move(a));
    }

    // Devices share a line when they answer alike: the same points, kernels and reason for a refusal
    // (read with the device's own name left out, which a reason may quote).
    const auto reason_of = [&](std::size_t d) {
      std::string reason = answers[d].rejection;
      const std::string name = grid.devices[d].kind == DeviceKind::kCpu ? "cpu" : describe_device(grid.devices[d]);
      for (std::size_t at = reason.find(name); at != std::string::npos; at = reason.find(name, at + 1)) {
        reason.replace(at, name.size(), 1, '\x01');
      }
      return reason;
    };
    std::vector<bool> grouped(grid.devices.size(), false);
    for (std::size_t i = 0; i < grid.devices.size(); ++i) {
      if (grouped[i]) continue;
      CapabilityRow row;
      row.op = op;
      for (std::size_t j = i; j < grid.devices.size(); ++j) {
        if (!grouped[j] && answers[j].accepted == answers[i].accepted && answers[j].kernels == answers[i].kernels &&
            reason_of(j) == reason_of(i)) {
          grouped[j] = true;
          row.devices.push_back(grid.devices[j].kind == DeviceKind::kCpu ? "cpu" : describe_device(grid.devices[j]));
        }
      }
      const Answer& a = answers[i];
      row.kernels.assign(a.kernels.begin(), a.kernels.end());
      row.rejection = a.rejection;
      if (row.devices.size() > 1) {  // a reason that quotes its device speaks for the whole line: "sm_89 or sm_120"
        std::string all;
        for (std::size_t d = 0; d < row.devices.size(); ++d) {
          all += (d == 0 ? "" : d + 1 == row.devices.size() ? " or " : ", ") + row.devices[d];
        }
        const std::size_t at = row.rejection.find(row.devices.front());
        if (at != std::string::npos) row.rejection.replace(at, row.devices.front().size(), all);
      }
      // Project the accepted points onto each dimension.
      std::set<int> dt_seen, h_seen, ps_seen, q_seen, k_seen;
      std::size_t index = 0, accepted = 0;
      for (std::size_t di = 0; di < dtypes.size(); ++di) {
        for (int h : heads) {
          for (int ps : pages) {
            for (int q : q_lens) {
              for (int k : topks) {
                if (a.accepted[index++]) {
                  ++accepted;
                  dt_seen.insert(static_cast<int>(di));
                  h_seen.insert(h);
                  ps_seen.insert(ps);
                  q_seen.insert(q);
                  k_seen.insert(k);
                }
              }
            }
          }
        }
      }
      row.supported = accepted > 0;
      if (row.supported) {
        auto in_order = [](const std::vector<int>& all, const std::set<int>& seen) {
          std::vector<int> out;
          for (int v : all) {
            if (seen.count(v) != 0) out.push_back(v);
          }
          return out;
        };
        for (std::size_t di = 0; di < dtypes.size(); ++di) {
          if (dt_seen.count(static_cast<int>(di)) != 0 && f.kv_dtype) row.kv_dtypes.push_back(dtypes[di]);
        }
        if (f.heads) row.heads = in_order(heads, h_seen);
        row.page_sizes = in_order(pages, ps_seen);
        if (f.q_len) row.q_lens = in_order(q_lens, q_seen);
        if (f.topk) row.topks = in_order(topks, k_seen);
        row.every_combination =
            accepted == dt_seen.size() * h_seen.size() * ps_seen.size() * q_seen.size() * k_seen.size();
      }
      rows.push_back(std::move(row));
    }
  }
  return rows;
}

}  // namespace latentkv
