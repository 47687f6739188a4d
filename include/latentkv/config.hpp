// latentkv/config.hpp - the one attention configuration: its sources, their precedence, and its
// resolution into one backend and kernel per slot, validated before any kernel runs.
//
// Sources, highest first: command-line flags > environment variables > a configuration file
// (TOML, or JSON when the path ends in ".json") > defaults. Every value remembers where it came
// from. resolve_config() then asks each backend's select() - the same function dispatch uses - for
// every slot, so a configuration that resolves is one that runs, and one that cannot run stops
// here with a ConfigError naming the slot, the backend, the reason and the backends that would work.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "latentkv/backend.hpp"
#include "latentkv/cache.hpp"
#include "latentkv/dsa.hpp"
#include "latentkv/error.hpp"
#include "latentkv/model.hpp"

namespace latentkv {

// ---- where a value came from ------------------------------------------------------------------

enum class SourceKind : std::uint8_t { kDefault, kFile, kEnvironment, kFlag };
std::string_view source_kind_name(SourceKind kind);  // "default", "file", "environment", "flag"

struct Provenance {
  SourceKind kind = SourceKind::kDefault;
  std::string where;  // "cfg.toml:3" (file:line; path alone for JSON), "LATENTKV_TP", "--tp"; empty for a default

  // "default", "file cfg.toml:3", "environment LATENTKV_TP", "flag --tp"
  std::string describe() const;
};

// A configuration value and its provenance.
template <typename T>
struct Sourced {
  T value{};
  Provenance source;
};

// ---- the configuration ------------------------------------------------------------------------

// The four attention slots. Each names a backend, or "auto".
enum class Slot : std::uint8_t { kDensePrefill, kDenseDecode, kSparsePrefill, kSparseDecode };
inline constexpr Slot kAllSlots[] = {Slot::kDensePrefill, Slot::kDenseDecode, Slot::kSparsePrefill,
                                     Slot::kSparseDecode};
std::string_view slot_name(Slot slot);  // "dense_prefill", "dense_decode", "sparse_prefill", "sparse_decode"
Op slot_op(Slot slot);                   // kMlaPrefill, kMlaDecode, kSparseMlaPrefill, kSparseMlaDecode
// The slot's place in kAllSlots (and in the per-slot arrays below); a value that is not a Slot
// throws ConfigError.
std::size_t slot_index(Slot slot);
bool slot_is_sparse(Slot slot);
bool slot_is_decode(Slot slot);
// Which half of serving a query row belongs to: the new tokens of a prompt, or a decode step's.
enum class Phase : std::uint8_t { kPrefill, kDecode };

inline constexpr std::string_view kAutoBackend = "auto";
inline constexpr std::string_view kDefaultModel = "glm5";
inline constexpr int kDefaultTp = 8;

struct AttentionConfig {
  Sourced<std::string> model{std::string(kDefaultModel), {}};  // a preset name (model_preset_names())
  Sourced<int> tp{kDefaultTp, {}};                              // tensor parallelism; divides the heads
  Sourced<KvDtype> kv_dtype{KvDtype::kFp8E4M3, {}};              // main latent cache format
  Sourced<int> page_size{kDefaultPageSize, {}};                 // tokens per page, 1 .. 2^30
  Sourced<int> q_len{1, {}};  // the most new tokens per request in decode: 1, or 2..4 with speculative decoding
  // One per Slot, in kAllSlots order: a backend name or "auto".
  std::array<Sourced<std::string>, 4> backends{{{std::string(kAutoBackend), {}},
                                                {std::string(kAutoBackend), {}},
                                                {std::string(kAutoBackend), {}},
                                                {std::string(kAutoBackend), {}}}};
  // The configuration file that was read, and which source named it; empty when none was.
  std::optional<Sourced<std::string>> config_file;

  Sourced<std::string>& backend(Slot slot) { return backends[slot_index(slot)]; }
  const Sourced<std::string>& backend(Slot slot) const { return backends[slot_index(slot)]; }
};

// The keys of a configuration file, in printing order: model, tp, kv_dtype, page_size, q_len,
// dense_prefill, dense_decode, sparse_prefill, sparse_decode. Key k is read from the environment
// variable LATENTKV_<K> and from the flag --k (underscores become dashes).
const std::vector<std::string_view>& config_keys();
inline constexpr std::string_view kConfigFileKey = "config";  // flag --config, variable LATENTKV_CONFIG
std::string environment_variable(std::string_view key);  // "tp" -> "LATENTKV_TP"
std::string flag_name(std::string_view key);             // "page_size" -> "--page-size"

// Every configuration problem: an unreadable or malformed source, a bad value, a backend that cannot
// run a slot. what() reads "config: ..." and names the key (or slot), the value, its source and what
// would be accepted.
class ConfigError : public Error {
 public:
  // "config: <key> = <value> (<source>): expected <expected>"
  ConfigError(std::string key, std::string value, const Provenance& source, std::string expected);
  // "config: <message>"
  ConfigError(std::string key, std::string message);

  // A config key (an unknown one as it was given), a slot name or "slot", a supporting op's name
  // ("append", "indexer_logits", "topk", "indexer_prefill"), or "config".
  const std::string& key() const noexcept { return key_; }

 private:
  std::string key_;
};

// ---- sources ----------------------------------------------------------------------------------

// Reads an environment variable: nullopt when it is not set. An empty value counts as not set.
using Environment = std::function<std::optional<std::string>(std::string_view name)>;
Environment process_environment();                                       // std::getenv
Environment environment_from(std::map<std::string, std::string> variables);  // for tests and embedding

// One command-line value as typed: key is a config key or kConfigFileKey.
struct FlagValue {
  std::string key;
  std::string value;
};

struct ConfigSources {
  std::vector<FlagValue> flags;
  Environment environment;  // empty: no environment
};

enum class ConfigFormat : std::uint8_t { kToml, kJson };
ConfigFormat config_format_for(std::string_view path);  // JSON when the path ends in ".json", else TOML

// Each apply_* layers one source over `config`, checking every value it sets (type, range, known
// model and cache dtype names) and recording its provenance; unknown keys, wrong types, malformed text
// throw ConfigError naming the source. Cross-key checks wait for check_config().
void apply_config_text(AttentionConfig& config, std::string_view text, std::string_view path, ConfigFormat format);
void apply_config_file(AttentionConfig& config, const Sourced<std::string>& path);
void apply_environment(AttentionConfig& config, const Environment& environment);
void apply_flags(AttentionConfig& config, const std::vector<FlagValue>& flags);  // kConfigFileKey is skipped

// Checks what needs several keys: the model is a preset and tp divides its attention heads.
void check_config(const AttentionConfig& config);

// Defaults < the file named by --config or LATENTKV_CONFIG < environment < flags, then check_config().
AttentionConfig load_config(const ConfigSources& sources);

// ---- resolution -------------------------------------------------------------------------------

// One backend's answer for one op of the configuration.
struct Candidate {
  std::string backend;
  int preference = 0;
  bool accepted = false;
  std::string kernel;  // Selection::kernel->name when accepted
  std::string reason;  // Selection::reason: how it was chosen, or why not
};

// The backend and kernel that run one op of the configuration, and why.
struct OpResolution {
  std::string role;        // a slot name, or a supporting op: "append", "indexer_logits", "topk", "indexer_prefill"
  Problem problem;         // what was asked of select(); for decode ops q_len is the largest asked
  std::string requested;   // "auto" or a backend name
  Provenance source;       // of `requested`
  const Backend* backend = nullptr;
  Kernel kernel;           // select()'s answer for `problem`
  std::string why;         // the rule that chose it
  std::vector<Candidate> candidates;  // every backend's answer, highest preference first
};

struct ResolvedConfig {
  AttentionConfig config;
  ModelShard shard;
  DeviceInfo device;
  std::array<OpResolution, 4> slots;    // in kAllSlots order
  std::vector<OpResolution> supporting;  // what the sparse path also needs: append, indexer_logits, topk, indexer_prefill
  // DSA rule: a dense slot serves a query row only when the row sees at most this many tokens
  // (index_topk), where the top-k keeps every visible token and sparse attention equals dense.
  int dense_max_visible_tokens = 0;

  const OpResolution& slot(Slot s) const { return slots[slot_index(s)]; }
  // The resolution of a supporting op (Op::kAppend, kIndexerLogits, kTopk, kIndexerPrefill); throws
  // Error naming the op for any other (the attention ops are slots: slot()).
  const OpResolution& supporting_op(Op op) const;
  // What dsa_decode and dsa_prefill run: the indexer and top-k ops resolved here and the sparse slots.
  DsaBackends dsa_backends() const;
  // The slot that serves a query row of `phase` seeing `visible_tokens` tokens: dense only where
  // that is exact; throws Error for a negative count. (A phase, not a bool: route(visible, true)
  // would compile and route wrongly.)
  Slot route(Phase phase, std::int64_t visible_tokens) const;
  Slot route(bool, std::int64_t) const = delete;
  // The rule above in words, for printing.
  std::string dense_rule() const;
};

// "sparse_mla_decode: fp8_e4m3 cache, 8 heads, page size 64, q_len 1, topk 2048, on cpu" (0 fields left out)
std::string describe_problem(const Problem& problem);
std::string describe_device(const DeviceInfo& device);  // "cpu", "NVIDIA H200 (sm_90)"

// The Problem of a slot under a configuration: heads per GPU, kv dtype, page size, q_len for decode
// slots, index_topk for sparse slots.
Problem slot_problem(const AttentionConfig& config, Slot slot, const DeviceInfo& device);

// Resolves every slot and supporting op. "auto" takes the backend of highest preference() (the first
// registered on a tie) whose select() accepts; a name must be in `backends` and accepted. Decode ops
// must be accepted for every q_len from 1 to config.q_len. Throws ConfigError on the first op that
// cannot run, naming the slot, the backend, the reason and the backends that would run it.
ResolvedConfig resolve_config(const AttentionConfig& config, const DeviceInfo& device = detect_device(),
                              const std::vector<const Backend*>& backends = registered_backends());

// ---- capability matrix ------------------------------------------------------------------------

// The points --explain probes: every op's own Problem fields over these values, on these devices.
struct ProbeGrid {
  std::vector<DeviceInfo> devices;  // cpu, sm_89, sm_90, sm_100, sm_120
  std::vector<KvDtype> kv_dtypes;
  std::vector<int> heads;
  std::vector<int> page_sizes;
  std::vector<int> q_lens;
  std::vector<int> topks;
};
ProbeGrid default_probe_grid();

// What one backend accepts for one op on a group of devices that answered alike, read off select().
// A value list is empty when the op's Problem does not carry that field (e.g. heads for topk) or when
// nothing was accepted.
struct CapabilityRow {
  Op op = Op::kMlaDecode;
  std::vector<std::string> devices;  // DeviceInfo::name of each probed device in the group
  bool supported = false;            // some point was accepted
  bool every_combination = true;     // the accepted points are the full product of the lists below
  std::vector<KvDtype> kv_dtypes;
  std::vector<int> heads, page_sizes, q_lens, topks;
  std::vector<std::string> kernels;  // distinct kernel names selected
  std::string rejection;             // a reason select() gave for a rejected point, if any
};
std::vector<CapabilityRow> probe_capabilities(const Backend& backend, const ProbeGrid& grid = default_probe_grid());

}  // namespace latentkv
