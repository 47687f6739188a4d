// The attention configuration: defaults, precedence and provenance, resolution of every slot, every
// rejection path and what its message says, the DSA routing rule, and the probed capability matrix.
#include <gtest/gtest.h>
#include <gmock/gmock.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "latentkv/config.hpp"
#include "latentkv/environment.hpp"
#include "support/expect_error.hpp"

namespace latentkv {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing::throws_error;

// ---- test-only backends (never registered globally) ---------------------------------------------

// A backend whose select() accepts a problem when `rule` returns an empty reason.
class FakeBackend final : public Backend {
 public:
  FakeBackend(std::string name, int preference, std::function<std::string(const Problem&)> rule)
      : name_(std::move(name)), preference_(preference), rule_(std::move(rule)) {}
  std::string_view name() const override { return name_; }
  std::string_view description() const override { return "test-only fake backend"; }
  int preference() const override { return preference_; }
  std::string_view extra_traffic() const override { return name_ == "casting" ? "casts the whole pool" : ""; }
  Selection select(const Problem& p) const override {
    const std::string why = rule_(p);
    if (!why.empty()) return Selection::no(why);
    return Selection::yes(Kernel{name_ + "." + std::string(op_name(p.op)), {}}, "fake " + name_);
  }

 private:
  std::string name_;
  int preference_;
  std::function<std::string(const Problem&)> rule_;
};

bool is_attention(Op op) {
  return op == Op::kMlaDecode || op == Op::kMlaPrefill || op == Op::kSparseMlaDecode || op == Op::kSparseMlaPrefill;
}
bool is_sparse(Op op) { return op == Op::kSparseMlaDecode || op == Op::kSparseMlaPrefill; }

// Like the 16-bit-only kernels engines use: a bf16 cache or nothing.
const FakeBackend kBf16Only("bf16only", 10, [](const Problem& p) -> std::string {
  if (p.op == Op::kIndexerLogits || p.op == Op::kTopk) return "no indexer ops";
  if (p.kv_dtype != KvDtype::kBf16) return "bf16 caches only (cache is " + std::string(kv_dtype_name(p.kv_dtype)) + ")";
  return "";
});
// A GPU backend built for sm_90 and sm_100 only.
const FakeBackend kHopper("hopper", 20, [](const Problem& p) -> std::string {
  if (p.device.kind != DeviceKind::kCuda) return "needs a CUDA device (device is " + p.device.name + ")";
  if (p.device.sm != 90 && p.device.sm != 100) return "built for sm_90 and sm_100 (device is sm_" + std::to_string(p.device.sm) + ")";
  return "";
});
// Sparse kernels that accept only 64 or 128 heads (what forces padding 8 heads up to 64 elsewhere).
const FakeBackend kWideHeads("wideheads", 5, [](const Problem& p) -> std::string {
  if (is_attention(p.op) && p.heads != 64 && p.heads != 128) {
    return "heads " + std::to_string(p.heads) + " not in {64, 128}";
  }
  return "";
});
const FakeBackend kPage64("page64", 5, [](const Problem& p) -> std::string {
  if (p.page_size != 64) return "page size " + std::to_string(p.page_size) + " != 64";
  return "";
});
const FakeBackend kDenseOnly("denseonly", 5, [](const Problem& p) -> std::string {
  if (p.op != Op::kMlaDecode && p.op != Op::kMlaPrefill) return "dense MLA only";
  return "";
});
// Sparse kernels tiled for k = 2048 only, as real ones are.
const FakeBackend kSparseOnly("sparseonly", 5, [](const Problem& p) -> std::string {
  if (!is_sparse(p.op)) return "sparse MLA only";
  if (p.topk != 2048) return "topk " + std::to_string(p.topk) + " != 2048";
  return "";
});
const FakeBackend kQLen2("qlen2", 5, [](const Problem& p) -> std::string {
  if (p.q_len == 2) return "q_len 2 not instantiated";
  return "";
});

const Backend& reference() {
  const Backend* b = find_backend("reference");
  EXPECT_NE(b, nullptr);
  return *b;
}

DeviceInfo cpu() { return DeviceInfo{}; }
DeviceInfo gpu(int sm) {
  DeviceInfo d;
  d.kind = DeviceKind::kCuda;
  d.sm = sm;
  d.name = "test GPU";
  return d;
}

AttentionConfig with_flags(std::vector<FlagValue> flags, std::map<std::string, std::string> env = {}) {
  return load_config(ConfigSources{std::move(flags), environment_from(std::move(env))});
}

// The ConfigError thrown by `f`, or a failure.
template <typename F>
ConfigError config_error(F&& f) {
  try {
    f();
  } catch (const ConfigError& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected ConfigError, got: " << e.what();
    return ConfigError("none", "wrong exception");
  }
  ADD_FAILURE() << "expected ConfigError, nothing was thrown";
  return ConfigError("none", "nothing thrown");
}

std::string message_of_resolve(const AttentionConfig& c, const DeviceInfo& d, std::vector<const Backend*> backends) {
  return config_error([&] { resolve_config(c, d, backends); }).what();
}

// A file under the test's temporary directory, removed at the end of the test.
class TempFile {
 public:
  TempFile(const std::string& name, const std::string& text)
      : path_(std::filesystem::path(::testing::TempDir()) / ("lkv_config_" + name)) {
    std::ofstream(path_, std::ios::binary) << text;
  }
  ~TempFile() { std::filesystem::remove(path_); }
  std::string path() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// ---- defaults and resolution on the CPU ---------------------------------------------------------

TEST(Config, DefaultsAreGlm5Tp8Fp8Page64QLen1AllAuto) {
  const AttentionConfig c = with_flags({});
  EXPECT_EQ(c.model.value, "glm5");
  EXPECT_EQ(c.tp.value, 8);
  EXPECT_EQ(c.kv_dtype.value, KvDtype::kFp8E4M3);
  EXPECT_EQ(c.page_size.value, 64);
  EXPECT_EQ(c.q_len.value, 1);
  for (Slot slot : kAllSlots) {
    EXPECT_EQ(c.backend(slot).value, "auto");
    EXPECT_EQ(c.backend(slot).source.kind, SourceKind::kDefault);
  }
  EXPECT_EQ(c.model.source.describe(), "default");
  EXPECT_FALSE(c.config_file.has_value());
}

TEST(Config, AutoOnCpuPicksReferenceForEverySlotAndSupportingOp) {
  const ResolvedConfig r = resolve_config(with_flags({}), cpu());
  EXPECT_EQ(r.shard.heads_per_gpu, 8);
  for (Slot slot : kAllSlots) {
    const OpResolution& op = r.slot(slot);
    ASSERT_NE(op.backend, nullptr);
    EXPECT_EQ(op.backend->name(), "reference");
    EXPECT_EQ(op.role, slot_name(slot));
    EXPECT_EQ(op.problem.op, slot_op(slot));
    EXPECT_EQ(op.kernel.name, "reference." + std::string(op_name(slot_op(slot))));
    EXPECT_TRUE(static_cast<bool>(op.kernel.launch));
    EXPECT_EQ(op.problem.heads, 8);
    EXPECT_EQ(op.problem.page_size, 64);
    EXPECT_EQ(op.problem.kv_dtype, KvDtype::kFp8E4M3);
    EXPECT_EQ(op.problem.topk, slot_is_sparse(slot) ? 2048 : 0);
    EXPECT_EQ(op.problem.q_len, slot_is_decode(slot) ? 1 : 0);
    EXPECT_THAT(op.why, HasSubstr("auto"));
    ASSERT_EQ(op.candidates.size(), registered_backends().size());
  }
  ASSERT_EQ(r.supporting.size(), 4u);
  EXPECT_EQ(r.supporting[0].role, "append");
  EXPECT_EQ(r.supporting[0].problem.page_size, 64);
  EXPECT_EQ(r.supporting[1].role, "indexer_logits");
  EXPECT_EQ(r.supporting[1].problem.heads, 32);  // the indexer is replicated: all 32 heads on every GPU
  EXPECT_EQ(r.supporting[2].role, "topk");
  EXPECT_EQ(r.supporting[2].problem.topk, 2048);
  EXPECT_EQ(r.supporting[3].role, "indexer_prefill");
  EXPECT_EQ(r.supporting[3].problem.heads, 32);
  EXPECT_EQ(r.supporting[3].problem.topk, 2048);
  for (const OpResolution& op : r.supporting) EXPECT_EQ(op.backend->name(), "reference");
}

TEST(Config, DsaBackendsAreTheSupportingOpsAndSparseSlots) {
  const std::vector<const Backend*> backends = {&reference(), &kBf16Only};
  const ResolvedConfig r =
      resolve_config(with_flags({{"kv_dtype", "bf16"}, {"sparse_decode", "reference"}}), cpu(), backends);
  EXPECT_EQ(&r.supporting_op(Op::kAppend), &r.supporting[0]);
  EXPECT_EQ(&r.supporting_op(Op::kIndexerPrefill), &r.supporting[3]);
  const DsaBackends d = r.dsa_backends();
  EXPECT_EQ(d.indexer_logits->name(), "reference");  // bf16only has no indexer logits or top-k
  EXPECT_EQ(d.topk->name(), "reference");
  EXPECT_EQ(d.sparse_decode->name(), "reference");  // named by the flag
  EXPECT_EQ(d.indexer_prefill->name(), "reference");  // over the fp8 indexer cache, which bf16only refuses
  EXPECT_EQ(d.sparse_prefill->name(), "bf16only");   // auto: preference 10 over the reference's 0
  EXPECT_EQ(d.sparse_decode, r.slot(Slot::kSparseDecode).backend);
  for (Op op : {Op::kMlaDecode, Op::kSparseMlaDecode}) {
    try {
      (void)r.supporting_op(op);
      ADD_FAILURE() << op_name(op) << " is a slot's op, not a supporting one";
    } catch (const Error& e) {
      EXPECT_EQ(e.argument(), "op");
      EXPECT_EQ(e.value(), op_name(op));
      EXPECT_THAT(e.what(), HasSubstr("append, indexer_logits, topk or indexer_prefill"));
    }
  }
}

TEST(Config, SlotOpsAndNames) {
  EXPECT_EQ(slot_op(Slot::kDensePrefill), Op::kMlaPrefill);
  EXPECT_EQ(slot_op(Slot::kDenseDecode), Op::kMlaDecode);
  EXPECT_EQ(slot_op(Slot::kSparsePrefill), Op::kSparseMlaPrefill);
  EXPECT_EQ(slot_op(Slot::kSparseDecode), Op::kSparseMlaDecode);
  EXPECT_EQ(environment_variable("page_size"), "LATENTKV_PAGE_SIZE");
  EXPECT_EQ(flag_name("sparse_decode"), "--sparse-decode");
  EXPECT_EQ(config_keys().size(), 9u);
}

TEST(Config, DeepseekHeadsPerGpu) {
  const ResolvedConfig r = resolve_config(with_flags({{"model", "deepseek-v3.2"}, {"tp", "8"}}), cpu());
  EXPECT_EQ(r.slot(Slot::kSparseDecode).problem.heads, 16);
  EXPECT_EQ(r.supporting[1].problem.heads, 64);
}

TEST(Config, SupportingOpsAreAskedForTheConfiguredPageSizeAndQLen) {
  const ResolvedConfig r = resolve_config(with_flags({{"q_len", "2"}, {"page_size", "32"}}), cpu());
  for (const OpResolution& op : r.supporting) EXPECT_EQ(op.problem.page_size, 32) << op.role;
  EXPECT_EQ(r.supporting_op(Op::kIndexerLogits).problem.q_len, 2);
  EXPECT_EQ(r.supporting_op(Op::kTopk).problem.q_len, 2);
  // A backend of higher preference that takes one new token at a time is passed over for both.
  const FakeBackend one_token("onetoken", 10, [](const Problem& p) -> std::string {
    return p.q_len > 1 ? "q_len " + std::to_string(p.q_len) + " > 1" : "";
  });
  const ResolvedConfig two = resolve_config(with_flags({{"q_len", "2"}}), cpu(), {&reference(), &one_token});
  EXPECT_EQ(two.supporting_op(Op::kIndexerLogits).backend->name(), "reference");
  EXPECT_EQ(two.supporting_op(Op::kTopk).backend->name(), "reference");
  EXPECT_EQ(two.supporting_op(Op::kAppend).backend->name(), "onetoken");
}

// SPEC section 2, field by field.
TEST(Config, PresetsHaveTheShapesOfSpecSection2) {
  EXPECT_EQ(model_preset_names(), (std::vector<std::string>{"glm5", "deepseek-v3.2"}));
  const ModelPreset& glm5 = model_preset("glm5");
  EXPECT_EQ(glm5.name, "glm5");
  EXPECT_EQ(glm5.layers, 78);
  EXPECT_EQ(glm5.heads, 64);
  EXPECT_DOUBLE_EQ(glm5.softmax_scale, 0.0625);
  EXPECT_EQ(glm5.indexer_heads, 32);
  EXPECT_EQ(glm5.indexer_rope, IndexerRope::kInterleaved);
  EXPECT_EQ(glm5.max_positions, 202752);
  const ModelPreset& ds = model_preset("deepseek-v3.2");
  EXPECT_EQ(ds.name, "deepseek-v3.2");
  EXPECT_EQ(ds.layers, 61);
  EXPECT_EQ(ds.heads, 128);
  const double mscale = 0.1 * std::log(40.0) + 1.0;
  EXPECT_DOUBLE_EQ(ds.softmax_scale, mscale * mscale / std::sqrt(192.0));
  EXPECT_EQ(ds.indexer_heads, 64);
  EXPECT_EQ(ds.indexer_rope, IndexerRope::kHalfSplit);
  EXPECT_EQ(ds.max_positions, 163840);
  for (const ModelPreset* m : {&glm5, &ds}) {
    EXPECT_EQ(m->kv_lora_rank, 512) << m->name;
    EXPECT_EQ(m->rope_dim, 64) << m->name;
    EXPECT_EQ(m->d_qk, 576) << m->name;
    EXPECT_EQ(m->d_v, 512) << m->name;
    EXPECT_EQ(m->indexer_dim, 128) << m->name;
    EXPECT_EQ(m->index_topk, 2048) << m->name;
  }
}

TEST(Config, AutoTakesHighestPreferenceThatAcceptsAndSaysWhyOthersWerePassedOver) {
  const std::vector<const Backend*> backends = {&reference(), &kBf16Only};
  const ResolvedConfig bf16 = resolve_config(with_flags({{"kv_dtype", "bf16"}}), cpu(), backends);
  EXPECT_EQ(bf16.slot(Slot::kDenseDecode).backend->name(), "bf16only");
  EXPECT_EQ(bf16.slot(Slot::kDenseDecode).kernel.name, "bf16only.mla_decode");
  EXPECT_EQ(bf16.supporting[1].backend->name(), "reference");  // bf16only has no indexer ops

  const ResolvedConfig fp8 = resolve_config(with_flags({}), cpu(), backends);
  const OpResolution& d = fp8.slot(Slot::kDenseDecode);
  EXPECT_EQ(d.backend->name(), "reference");
  EXPECT_THAT(d.why, HasSubstr("passed over: bf16only (bf16 caches only (cache is fp8_e4m3))"));
  ASSERT_EQ(d.candidates.size(), 2u);
  EXPECT_EQ(d.candidates[0].backend, "bf16only");  // highest preference first
  EXPECT_FALSE(d.candidates[0].accepted);
  EXPECT_TRUE(d.candidates[1].accepted);
  EXPECT_EQ(d.candidates[1].kernel, "reference.mla_decode");
}

TEST(Config, AutoBreaksPreferenceTiesByRegistrationOrder) {
  const std::vector<const Backend*> a = {&kPage64, &kDenseOnly, &reference()};
  EXPECT_EQ(resolve_config(with_flags({}), cpu(), a).slot(Slot::kDenseDecode).backend->name(), "page64");
  const std::vector<const Backend*> b = {&kDenseOnly, &kPage64, &reference()};
  EXPECT_EQ(resolve_config(with_flags({}), cpu(), b).slot(Slot::kDenseDecode).backend->name(), "denseonly");
}

TEST(Config, NamedBackendIsUsedAndGpuBackendResolvesOnItsArchitecture) {
  const std::vector<const Backend*> backends = {&reference(), &kHopper};
  const ResolvedConfig r = resolve_config(with_flags({{"sparse_decode", "hopper"}}), gpu(90), backends);
  EXPECT_EQ(r.slot(Slot::kSparseDecode).backend->name(), "hopper");
  EXPECT_THAT(r.slot(Slot::kSparseDecode).why, HasSubstr("named by flag --sparse-decode"));
  EXPECT_EQ(r.slot(Slot::kDenseDecode).backend->name(), "hopper");  // auto, preference 20
  EXPECT_EQ(r.device.sm, 90);
}

// ---- precedence and provenance ------------------------------------------------------------------

TEST(Config, FlagsOverEnvironmentOverFileOverDefaultsWithProvenance) {
  const TempFile file("precedence.toml",
                      "model = \"deepseek-v3.2\"\n"
                      "tp = 16\n"
                      "page_size = 32\n"
                      "q_len = 2\n"
                      "dense_decode = \"reference\"\n");
  const AttentionConfig c = with_flags({{"tp", "64"}},
                                       {{"LATENTKV_CONFIG", file.path()}, {"LATENTKV_TP", "32"}, {"LATENTKV_Q_LEN", "3"}});
  EXPECT_EQ(c.model.value, "deepseek-v3.2");
  EXPECT_EQ(c.model.source.kind, SourceKind::kFile);
  EXPECT_EQ(c.model.source.where, file.path() + ":1");
  EXPECT_EQ(c.tp.value, 64);
  EXPECT_EQ(c.tp.source.describe(), "flag --tp");
  EXPECT_EQ(c.page_size.value, 32);
  EXPECT_EQ(c.page_size.source.describe(), "file " + file.path() + ":3");
  EXPECT_EQ(c.q_len.value, 3);
  EXPECT_EQ(c.q_len.source.describe(), "environment LATENTKV_Q_LEN");
  EXPECT_EQ(c.kv_dtype.source.kind, SourceKind::kDefault);
  EXPECT_EQ(c.backend(Slot::kDenseDecode).value, "reference");
  EXPECT_EQ(c.backend(Slot::kDenseDecode).source.where, file.path() + ":5");
  EXPECT_EQ(c.backend(Slot::kSparseDecode).source.kind, SourceKind::kDefault);
  ASSERT_TRUE(c.config_file.has_value());
  EXPECT_EQ(c.config_file->value, file.path());
  EXPECT_EQ(c.config_file->source.describe(), "environment LATENTKV_CONFIG");
}

TEST(Config, EveryKeyFromEveryTextSource) {
  std::map<std::string, std::string> env = {
      {"LATENTKV_MODEL", "deepseek-v3.2"},      {"LATENTKV_TP", "4"},
      {"LATENTKV_KV_DTYPE", "bf16"},            {"LATENTKV_PAGE_SIZE", "1"},
      {"LATENTKV_Q_LEN", "4"},                  {"LATENTKV_DENSE_PREFILL", "reference"},
      {"LATENTKV_DENSE_DECODE", "reference"},   {"LATENTKV_SPARSE_PREFILL", "reference"},
      {"LATENTKV_SPARSE_DECODE", "reference"},
  };
  const AttentionConfig from_env = with_flags({}, env);
  EXPECT_EQ(from_env.model.value, "deepseek-v3.2");
  EXPECT_EQ(from_env.tp.value, 4);
  EXPECT_EQ(from_env.kv_dtype.value, KvDtype::kBf16);
  EXPECT_EQ(from_env.page_size.value, 1);
  EXPECT_EQ(from_env.q_len.value, 4);
  for (Slot slot : kAllSlots) {
    EXPECT_EQ(from_env.backend(slot).value, "reference");
    EXPECT_EQ(from_env.backend(slot).source.where, environment_variable(slot_name(slot)));
  }
  std::vector<FlagValue> flags;
  for (const auto& [name, value] : env) flags.push_back({name.substr(9), value});
  for (FlagValue& f : flags) {
    for (char& ch : f.key) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  }
  const AttentionConfig from_flags = with_flags(flags);
  EXPECT_EQ(from_flags.tp.value, 4);
  EXPECT_EQ(from_flags.q_len.source.describe(), "flag --q-len");
  EXPECT_EQ(from_flags.backend(Slot::kSparsePrefill).source.describe(), "flag --sparse-prefill");
  // Resolves with q_len 4 and page size 1 on the reference.
  const ResolvedConfig r = resolve_config(from_flags, cpu());
  EXPECT_EQ(r.slot(Slot::kSparseDecode).problem.q_len, 4);
}

TEST(Config, EmptyEnvironmentVariableCountsAsUnset) {
  const AttentionConfig c = with_flags({}, {{"LATENTKV_TP", ""}, {"LATENTKV_CONFIG", ""}});
  EXPECT_EQ(c.tp.value, 8);
  EXPECT_EQ(c.tp.source.kind, SourceKind::kDefault);
}

TEST(Config, Fp8IsAnAliasOfFp8E4M3) {
  const AttentionConfig c = with_flags({{"kv_dtype", "fp8"}}, {{"LATENTKV_KV_DTYPE", "bf16"}});
  EXPECT_EQ(c.kv_dtype.value, KvDtype::kFp8E4M3);
  EXPECT_EQ(c.kv_dtype.source.describe(), "flag --kv-dtype");
  EXPECT_EQ(with_flags({}, {{"LATENTKV_KV_DTYPE", "fp8"}}).kv_dtype.value, KvDtype::kFp8E4M3);
}

TEST(Config, ValuesAtTheEndsOfTheirRangesAreAccepted) {
  const std::string longest(64, 'b');  // backend names may have up to 64 characters
  EXPECT_EQ(with_flags({{"dense_decode", longest}}).backend(Slot::kDenseDecode).value, longest);
  EXPECT_THAT(config_error([&] { with_flags({{"dense_decode", longest + "b"}}); }).what(),
              HasSubstr("dense_decode = '" + longest + "b' (flag --dense-decode): expected auto or a backend name"));
  EXPECT_EQ(with_flags({{"sparse_decode", "my.backend"}}).backend(Slot::kSparseDecode).value, "my.backend");
  EXPECT_THAT(message_of_resolve(with_flags({{"sparse_decode", "my.backend"}}), cpu(), {&reference()}),
              HasSubstr("sparse_decode = 'my.backend' (flag --sparse-decode): no backend is named 'my.backend'"));
  EXPECT_EQ(with_flags({{"page_size", "1073741824"}}).page_size.value, 1 << 30);  // 2^30: one page fills a table row
}

TEST(Config, EnvironmentVariablesReadAreTheFileTheKeysTheKernelOverridesAndThePrograms) {
  const std::vector<std::string> read = environment_variables();
  ASSERT_EQ(read.size(), 1 + config_keys().size() + 3);
  EXPECT_EQ(read.front(), "LATENTKV_CONFIG");
  EXPECT_EQ(read[1], "LATENTKV_MODEL");
  EXPECT_THAT(read, ::testing::Contains("LATENTKV_PAGE_SIZE"));
  EXPECT_THAT(read, ::testing::Contains("LATENTKV_SPARSE_DECODE"));
  EXPECT_EQ(read[read.size() - 3], kMlaKernelVariable);
  EXPECT_EQ(read[read.size() - 2], kIndexerKernelVariable);
  EXPECT_EQ(read.back(), kPythonVariable);
}

TEST(Config, UnreadLatentkvVariablesAreNamedWithTheNearestRead) {
  const std::vector<std::string> set = {"PATH",          "LATENTKV_TP",           "LATENTKV_PAGESIZE",
                                        "LATENTKV_APP",  "LATENTKV_MLA_KERNEL",   "LATENTKV_SPARSE_DECODE_BACKEND",
                                        "LKV_TEST_SEED", "LATENTKV_DECODE_BACKEND", "latentkv_tp"};
  const std::vector<std::string> warnings = unread_environment_warnings(set, {"LATENTKV_APP"});
  ASSERT_EQ(warnings.size(), 3u);
  EXPECT_EQ(warnings[0],
            "LATENTKV_PAGESIZE is set but latentkv reads no variable of that name; it is ignored (did you mean "
            "LATENTKV_PAGE_SIZE?)");
  EXPECT_THAT(warnings[1], HasSubstr("LATENTKV_SPARSE_DECODE_BACKEND is set"));
  EXPECT_THAT(warnings[1], HasSubstr("(did you mean LATENTKV_SPARSE_DECODE?)"));
  // Nothing close: every name read is listed, the caller's own too.
  EXPECT_THAT(warnings[2], HasSubstr("LATENTKV_DECODE_BACKEND is set but latentkv reads no variable of that name"));
  EXPECT_THAT(warnings[2], HasSubstr("(latentkv reads LATENTKV_CONFIG, LATENTKV_MODEL, LATENTKV_TP,"));
  EXPECT_THAT(warnings[2], HasSubstr("LATENTKV_INDEXER_KERNEL, LATENTKV_PYTHON, LATENTKV_APP)"));
  EXPECT_TRUE(unread_environment_warnings({"LATENTKV_TP", "HOME"}).empty());
  // Two edits from TP, but half its length: no guess.
  const std::vector<std::string> topk = unread_environment_warnings({"LATENTKV_TOPK"});
  ASSERT_EQ(topk.size(), 1u);
  EXPECT_THAT(topk[0], Not(HasSubstr("did you mean")));
  EXPECT_THAT(unread_environment_warnings({"LATENTKV_MLA_KERNL"}).at(0), HasSubstr("did you mean LATENTKV_MLA_KERNEL?"));
  // A name read among the words of the one set is a guess; TP inside a word (OUTPUT, HTTP) is not.
  EXPECT_THAT(unread_environment_warnings({"LATENTKV_TP_SIZE"}).at(0), HasSubstr("did you mean LATENTKV_TP?"));
  for (const std::string name : {"LATENTKV_OUTPUT_DIR", "LATENTKV_HTTP_PORT", "LATENTKV_LOG_OUTPUT"}) {
    EXPECT_THAT(unread_environment_warnings({name}).at(0), Not(HasSubstr("did you mean"))) << name;
  }
  EXPECT_EQ(unread_environment_warnings({"LATENTKV_APP"}).size(), 1u);  // the caller's own only where it says so
  // A name of the caller's without the prefix is not latentkv's business: not listed as read.
  const std::vector<std::string> home = unread_environment_warnings({"LATENTKV_X"}, {"HOME"});
  ASSERT_EQ(home.size(), 1u);
  EXPECT_THAT(home[0], HasSubstr("LATENTKV_X is set"));
  EXPECT_THAT(home[0], Not(HasSubstr("HOME")));
}

TEST(Config, ConfigFlagOverridesConfigEnvironmentVariable) {
  const TempFile file("flagfile.json", R"({"tp": 2, "kv_dtype": "bf16", "sparse_prefill": "reference"})");
  const AttentionConfig c =
      with_flags({{"config", file.path()}}, {{"LATENTKV_CONFIG", "/nonexistent/never/read.toml"}});
  EXPECT_EQ(c.tp.value, 2);
  EXPECT_EQ(c.tp.source.describe(), "file " + file.path());
  EXPECT_EQ(c.kv_dtype.value, KvDtype::kBf16);
  EXPECT_EQ(c.backend(Slot::kSparsePrefill).value, "reference");
  ASSERT_TRUE(c.config_file.has_value());
  EXPECT_EQ(c.config_file->source.describe(), "flag --config");
  // Of two --config flags only the last is read.
  const TempFile first("first.toml", "tp = 2\npage_size = 32\n");
  const TempFile second("second.toml", "tp = 4\n");
  const AttentionConfig last = with_flags({{"config", first.path()}, {"config", second.path()}});
  EXPECT_EQ(last.tp.value, 4);
  EXPECT_EQ(last.page_size.value, 64);
  ASSERT_TRUE(last.config_file.has_value());
  EXPECT_EQ(last.config_file->value, second.path());
}

TEST(Config, FormatFollowsExtension) {
  EXPECT_EQ(config_format_for("a.json"), ConfigFormat::kJson);
  EXPECT_EQ(config_format_for("a.toml"), ConfigFormat::kToml);
  EXPECT_EQ(config_format_for("json"), ConfigFormat::kToml);
  EXPECT_EQ(config_format_for(".json"), ConfigFormat::kJson);
  EXPECT_EQ(config_format_for(""), ConfigFormat::kToml);
}

TEST(Config, ConfigFileOfAtMostOneMebibyteIsRead) {
  constexpr std::size_t kLimit = 1 << 20;
  std::string text = "tp = 4\n";
  text.resize(kLimit - 1, '#');  // one long comment
  text += '\n';
  const TempFile largest("largest.toml", text);
  EXPECT_EQ(std::filesystem::file_size(largest.path()), kLimit);
  EXPECT_EQ(with_flags({{"config", largest.path()}}).tp.value, 4);
  const TempFile larger("larger.toml", text + "\n");
  EXPECT_THAT(config_error([&] { with_flags({{"config", larger.path()}}); }).what(),
              HasSubstr("(flag --config): expected a configuration file of at most 1048576 bytes"));
  // A file whose size the file system reports as 0 (procfs) is held to the limit as it is read.
  const std::filesystem::path symbols = "/proc/kallsyms";
  std::error_code ec;
  if (std::filesystem::file_size(symbols, ec) == 0 && !ec) {
    std::ifstream in(symbols, std::ios::binary);
    in.ignore(std::numeric_limits<std::streamsize>::max());
    if (static_cast<std::size_t>(in.gcount()) > kLimit) {
      EXPECT_THAT(config_error([&] { with_flags({{"config", symbols.string()}}); }).what(),
                  HasSubstr("(flag --config): expected a configuration file of at most 1048576 bytes"));
    }
  }
}

TEST(Config, RejectedSourceChangesNothing) {
  AttentionConfig c;
  config_error([&] { apply_config_text(c, "tp = 4\nq_len = 9\n", "x.toml", ConfigFormat::kToml); });
  EXPECT_EQ(c.tp.value, 8);
  config_error([&] { apply_flags(c, {{"tp", "4"}, {"page_size", "0"}}); });
  EXPECT_EQ(c.tp.value, 8);
  config_error([&] { apply_environment(c, environment_from({{"LATENTKV_TP", "4"}, {"LATENTKV_Q_LEN", "x"}})); });
  EXPECT_EQ(c.tp.value, 8);
}

// ---- rejections: values -------------------------------------------------------------------------

TEST(ConfigReject, TpNotDividingHeadsNamesHeadsSourceAndDivisors) {
  const ConfigError e = config_error([] { with_flags({{"tp", "3"}}); });
  EXPECT_EQ(e.key(), "tp");
  EXPECT_THAT(e.what(), HasSubstr("tp = 3 (flag --tp)"));
  EXPECT_THAT(e.what(), HasSubstr("a divisor of the 64 attention heads of glm5 (model from default)"));
  EXPECT_THAT(e.what(), HasSubstr("1, 2, 4, 8, 16, 32, 64"));
  const std::string ds = config_error([] {
                           with_flags({{"model", "deepseek-v3.2"}}, {{"LATENTKV_TP", "48"}});
                         }).what();
  EXPECT_THAT(ds, HasSubstr("tp = 48 (environment LATENTKV_TP)"));
  EXPECT_THAT(ds, HasSubstr("128 attention heads of deepseek-v3.2 (model from flag --model)"));
}

TEST(Config, TextIntegersTakeALeadingPlus) {
  // As the commands' own integer options do (`latentkv step --tp +8`).
  const AttentionConfig c = with_flags({{"tp", "+8"}}, {{"LATENTKV_PAGE_SIZE", "+32"}});
  EXPECT_EQ(c.tp.value, 8);
  EXPECT_EQ(c.page_size.value, 32);
}

TEST(ConfigReject, BadIntegers) {
  struct Case {
    std::string key, value, expect;
  };
  const std::vector<Case> cases = {
      {"tp", "0", "tp = 0 (flag --tp): expected a positive integer"},
      {"tp", "-8", "tp = -8"},
      {"tp", "abc", "tp = 'abc' (flag --tp): expected"},
      {"tp", "8x", "tp = '8x'"},
      {"tp", "+-8", "tp = '+-8'"},
      {"tp", "+", "tp = '+'"},
      {"tp", "++8", "tp = '++8'"},
      {"tp", " 8", "tp = ' 8'"},
      {"tp", "", "tp = ''"},
      {"tp", "99999999999999999999", "tp = '99999999999999999999'"},
      {"tp", "4294967304", "tp = 4294967304"},
      {"page_size", "0", "page_size = 0 (flag --page-size): expected an integer from 1 to 1073741824"},
      {"page_size", "1073741825", "page_size = 1073741825 (flag --page-size): expected an integer from 1 to 1073741824 "
                                  "(tokens per page; a block-table row holds at most 2^30 tokens)"},
      {"page_size", "-64", "page_size = -64"},
      {"page_size", "6.4", "page_size = '6.4'"},
      {"q_len", "0", "q_len = 0 (flag --q-len): expected an integer from 1 to 4"},
      {"q_len", "5", "q_len = 5"},
      {"q_len", "2.0", "q_len = '2.0'"},
  };
  for (const Case& c : cases) {
    const ConfigError e = config_error([&] { with_flags({{c.key, c.value}}); });
    EXPECT_EQ(e.key(), c.key);
    EXPECT_THAT(e.what(), HasSubstr(c.expect)) << c.key << "=" << c.value;
  }
}

TEST(ConfigReject, BadNamesListWhatIsAccepted) {
  std::string m = config_error([] { with_flags({{"model", "glm4"}}); }).what();
  EXPECT_THAT(m, HasSubstr("model = 'glm4' (flag --model): expected one of: glm5, deepseek-v3.2"));
  // A bad value is an error even where a higher source sets the key too.
  m = config_error([] { with_flags({{"model", "glm5"}}, {{"LATENTKV_MODEL", "glm4"}}); }).what();
  EXPECT_THAT(m, HasSubstr("model = 'glm4' (environment LATENTKV_MODEL): expected one of: glm5, deepseek-v3.2"));
  m = config_error([] { with_flags({{"model", std::string(100, 'a')}}); }).what();
  EXPECT_THAT(m, HasSubstr("model = '" + std::string(80, 'a') + "...' (flag --model)"));  // cut at 80
  m = config_error([] { with_flags({}, {{"LATENTKV_KV_DTYPE", "fp16"}}); }).what();
  EXPECT_THAT(m, HasSubstr("kv_dtype = 'fp16' (environment LATENTKV_KV_DTYPE): expected fp8_e4m3 or bf16"));
  m = config_error([] { with_flags({{"dense_decode", "ref erence"}}); }).what();
  EXPECT_THAT(m, HasSubstr("dense_decode = 'ref erence' (flag --dense-decode): expected auto or a backend name"));
  EXPECT_THAT(m, HasSubstr("registered: reference"));
  m = config_error([] { with_flags({{"dense_decode", std::string("a\x01\xff", 3)}}); }).what();
  EXPECT_THAT(m, HasSubstr("'a\\x01\\xff'"));  // control bytes are escaped, not printed raw
  EXPECT_EQ(quoted_value("it's a\\b"), "'it\\'s a\\\\b'");  // the quote itself and backslashes too
  m = config_error([] { with_flags({{"frobnicate", "1"}}); }).what();
  EXPECT_THAT(m, HasSubstr("unknown setting 'frobnicate' (a flag); expected one of: "));  // the source named
}

TEST(ConfigReject, TomlErrorsNameFileLineKeyValueAndExpected) {
  auto toml = [](const std::string& text) {
    return std::string(config_error([&] {
                         AttentionConfig c;
                         apply_config_text(c, text, "cfg.toml", ConfigFormat::kToml);
                       }).what());
  };
  EXPECT_THAT(toml("tp = 8\nfrobnicate = 1\n"), HasSubstr("unknown key 'frobnicate' (file cfg.toml:2); expected one of: model, tp"));
  EXPECT_THAT(toml("tp = \"8\"\n"), HasSubstr("tp = '8' (file cfg.toml:1): expected a positive integer"));
  EXPECT_THAT(toml("tp = \"8\"\n"), HasSubstr("got a string"));
  EXPECT_THAT(toml("\npage_size = 6.5\n"), HasSubstr("page_size = 6.5 (file cfg.toml:2)"));
  EXPECT_THAT(toml("\npage_size = 6.5\n"), HasSubstr("got a floating-point number"));
  // A whole float is shown as one, as written, not as the integer it equals.
  EXPECT_THAT(toml("tp = 8.0\n"), HasSubstr("tp = 8.0 (file cfg.toml:1): expected a positive integer"));
  EXPECT_THAT(toml("model = 5\n"), HasSubstr("model = 5 (file cfg.toml:1): expected a string: one of: glm5"));
  EXPECT_THAT(toml("q_len = [1, 2]\n"), HasSubstr("q_len = <array>"));
  EXPECT_THAT(toml("q_len = 7\n"), HasSubstr("q_len = 7 (file cfg.toml:1): expected an integer from 1 to 4"));
  EXPECT_THAT(toml("tp = 8\ntp = 4\n"), HasSubstr("file cfg.toml:2"));
  EXPECT_THAT(toml("tp = 8\ntp = 4\n"), HasSubstr("malformed TOML"));
  EXPECT_THAT(toml("tp = \n"), HasSubstr("file cfg.toml:1:"));
  EXPECT_THAT(toml("[backends]\nsparse_decode = \"reference\"\n"), HasSubstr("file cfg.toml:1:1: a table header"));
  EXPECT_THAT(toml("tp = 8\n  [[a]]\n"), HasSubstr("file cfg.toml:2:3: a table header"));
  EXPECT_THAT(toml("\t[a]\n"), HasSubstr("file cfg.toml:1:2: a table header"));
  EXPECT_THAT(toml("backends = {sparse_decode = \"reference\"}\n"), HasSubstr("unknown key 'backends'"));
  // toml++ 3.3 breaks an internal precondition on these (its pull request 301): refused before parsing.
  EXPECT_THAT(toml("[%["), HasSubstr("a table header"));
  EXPECT_THAT(toml("[[[1]]]"), HasSubstr("a table header"));
  EXPECT_THAT(toml("tp = 99999999999\n"), HasSubstr("tp = 99999999999 (file cfg.toml:1)"));
  // toml++ 3.3 reaches __builtin_unreachable() on these (its issues 190 and 295): refused before parsing.
  EXPECT_THAT(toml("s = \"\"\"\\\n\xc2\xa7\"\"\"\n"), HasSubstr("file cfg.toml:2:1: non-ASCII byte 0xc2"));
  EXPECT_THAT(toml("\xcc\xaa"), HasSubstr("file cfg.toml:1:1: non-ASCII byte 0xcc"));
  EXPECT_THAT(toml("tp = 8 # f\xc3\xbcr\n"), HasSubstr("cfg.toml:1:11: non-ASCII byte 0xc3"));
  AttentionConfig with_bom;
  apply_config_text(with_bom, "\xef\xbb\xbftp = 4\n", "bom.toml", ConfigFormat::kToml);
  EXPECT_EQ(with_bom.tp.value, 4);
}

TEST(ConfigReject, JsonErrorsNameFileKeyValueAndExpected) {
  auto json = [](const std::string& text) {
    return std::string(config_error([&] {
                         AttentionConfig c;
                         apply_config_text(c, text, "cfg.json", ConfigFormat::kJson);
                       }).what());
  };
  EXPECT_THAT(json("{\"tp\": 8,}"), HasSubstr("file cfg.json: malformed JSON: parse error at line 1"));
  EXPECT_THAT(json("[1, 2]"), HasSubstr("expected a JSON object of settings at the top level, got array"));
  EXPECT_THAT(json("{\"tp\": 8, \"tp\": 4}"), HasSubstr("key 'tp' appears more than once"));
  EXPECT_THAT(json("{\"tp\": 8.0}"), HasSubstr("tp = 8.0 (file cfg.json): expected a positive integer"));
  EXPECT_THAT(json("{\"tp\": 1e30}"), HasSubstr("got a floating-point number"));
  EXPECT_THAT(json("{\"tp\": 18446744073709551615}"), HasSubstr("tp = 18446744073709551615"));
  EXPECT_THAT(json("{\"tp\": true}"), HasSubstr("got a boolean"));
  EXPECT_THAT(json("{\"tp\": {\"a\": 1}}"), HasSubstr("got an object"));
  EXPECT_THAT(json("{\"model\": 5}"), HasSubstr("got an integer"));
  EXPECT_THAT(json("{\"tp\": null}"), HasSubstr("attention heads, got null"));
  EXPECT_THAT(json("{\"model\": null}"), HasSubstr("model = null (file cfg.json): expected a string"));
  EXPECT_THAT(json("{\"extra\": {}}"), HasSubstr("unknown key 'extra' (file cfg.json)"));
  EXPECT_THAT(json(""), HasSubstr("malformed JSON"));
}

TEST(ConfigReject, UnreadableFilesNameTheirSource) {
  std::string m = config_error([] { with_flags({{"config", "/nonexistent/cfg.toml"}}); }).what();
  EXPECT_THAT(m, HasSubstr("config = '/nonexistent/cfg.toml' (flag --config): expected an existing TOML or JSON file"));
  m = config_error([] { with_flags({}, {{"LATENTKV_CONFIG", ::testing::TempDir()}}); }).what();
  EXPECT_THAT(m, HasSubstr("(environment LATENTKV_CONFIG): expected a regular file"));
  m = config_error([] { with_flags({{"config", ""}}); }).what();
  EXPECT_THAT(m, HasSubstr("config = '' (flag --config)"));
  const TempFile bad("bad.toml", "tp = 8\nmodel = glm5\n");
  m = config_error([&] { with_flags({{"config", bad.path()}}); }).what();
  EXPECT_THAT(m, HasSubstr("file " + bad.path() + ":2:"));
  EXPECT_THAT(m, HasSubstr("malformed TOML"));
  // A regular file whose read fails (a process's memory at address 0) is named as unreadable, not
  // passed on as the stream's own exception.
  if (std::filesystem::exists("/proc/self/mem")) {
    m = config_error([] { with_flags({{"config", "/proc/self/mem"}}); }).what();
    EXPECT_THAT(m, HasSubstr("config = '/proc/self/mem' (flag --config): expected a readable file"));
  }
}

// A value that is not one of the four slots is refused wherever a slot indexes a table.
TEST(ConfigReject, ValuesThatAreNotSlots) {
  const auto not_a_slot = static_cast<Slot>(4);
  AttentionConfig c;
  EXPECT_THAT(config_error([&] { (void)c.backend(not_a_slot); }).what(), HasSubstr("slot 4 is not a Slot"));
  EXPECT_THAT(config_error([&] { (void)slot_op(not_a_slot); }).what(), HasSubstr("slot 4 is not a Slot"));
  const ResolvedConfig r = resolve_config(c, cpu());
  EXPECT_THAT(config_error([&] { (void)r.slot(not_a_slot); }).what(), HasSubstr("slot 4 is not a Slot"));
  EXPECT_THAT(config_error([&] { (void)slot_problem(c, not_a_slot, cpu()); }).what(),
              HasSubstr("slot 4 is not a Slot"));
  EXPECT_EQ(slot_index(Slot::kSparseDecode), 3u);
}

// ---- rejections: backends -----------------------------------------------------------------------

TEST(ConfigReject, UnknownBackendNamesSlotSourceRegisteredAndWorkingBackends) {
  const ConfigError e = config_error([] { resolve_config(with_flags({{"sparse_decode", "nosuch"}}), DeviceInfo{}); });
  EXPECT_EQ(e.key(), "sparse_decode");
  const std::string m = e.what();
  EXPECT_THAT(m, HasSubstr("sparse_decode = 'nosuch' (flag --sparse-decode): no backend is named 'nosuch'"));
  EXPECT_THAT(m, HasSubstr("registered: reference"));
  EXPECT_THAT(m, HasSubstr("Backends that would run sparse_decode [sparse_mla_decode: fp8_e4m3 cache, 8 heads, "
                           "page size 64, q_len 1, topk 2048, on cpu] here: reference (or auto)."));
}

TEST(ConfigReject, SixteenBitOnlyBackendMeetsFp8Cache) {
  const std::string m = message_of_resolve(with_flags({{"dense_decode", "bf16only"}}), cpu(), {&reference(), &kBf16Only});
  EXPECT_THAT(m, HasSubstr("dense_decode = 'bf16only' (flag --dense-decode): backend 'bf16only' cannot run "
                           "dense_decode [mla_decode: fp8_e4m3 cache"));
  EXPECT_THAT(m, HasSubstr("bf16 caches only (cache is fp8_e4m3)"));
  EXPECT_THAT(m, HasSubstr("'bf16only' would run it with kv_dtype bf16 but not fp8_e4m3"));
  EXPECT_THAT(m, HasSubstr("Backends that would run dense_decode here: reference (or auto)."));
}

TEST(ConfigReject, GpuBackendOnCpuAndOnWrongArchitecture) {
  const AttentionConfig c = with_flags({{"sparse_prefill", "hopper"}});
  std::string m = message_of_resolve(c, cpu(), {&reference(), &kHopper});
  EXPECT_THAT(m, HasSubstr("sparse_prefill = 'hopper' (flag --sparse-prefill): backend 'hopper' cannot run"));
  EXPECT_THAT(m, HasSubstr("needs a CUDA device (device is cpu)"));
  EXPECT_THAT(m, HasSubstr("'hopper' would run it on: sm_90, sm_100 (this device: cpu)"));
  EXPECT_THAT(m, HasSubstr("Backends that would run sparse_prefill here: reference"));

  const AttentionConfig all_hopper = with_flags({{"dense_prefill", "hopper"},
                                                {"dense_decode", "hopper"},
                                                {"sparse_prefill", "hopper"},
                                                {"sparse_decode", "hopper"}});
  m = message_of_resolve(all_hopper, gpu(120), {&reference(), &kHopper});
  EXPECT_THAT(m, HasSubstr("dense_prefill = 'hopper' (flag --dense-prefill): backend 'hopper' cannot run"));
  EXPECT_THAT(m, HasSubstr("built for sm_90 and sm_100 (device is sm_120)"));
  EXPECT_THAT(m, HasSubstr("(this device: test GPU (sm_120))"));
  // The reference does not run on a GPU either, so nothing would.
  EXPECT_THAT(m, HasSubstr("No registered backend would run dense_prefill here."));

  // auto with nothing that runs here: every backend's reason is listed.
  m = message_of_resolve(with_flags({}), gpu(89), {&kHopper});
  EXPECT_THAT(m, HasSubstr("dense_prefill = auto (default): no registered backend can run dense_prefill"));
  EXPECT_THAT(m, HasSubstr("hopper: built for sm_90 and sm_100 (device is sm_89)"));
}

TEST(ConfigReject, UnsupportedHeadCountAndPageSize) {
  std::string m = message_of_resolve(with_flags({{"sparse_decode", "wideheads"}}), cpu(), {&reference(), &kWideHeads});
  EXPECT_THAT(m, HasSubstr("sparse_decode = 'wideheads'"));
  EXPECT_THAT(m, HasSubstr("heads 8 not in {64, 128}"));
  EXPECT_THAT(m, HasSubstr("8 heads"));
  EXPECT_THAT(m, HasSubstr("Backends that would run sparse_decode here: reference"));
  // At tp 1 glm5 has 64 heads per GPU, which it accepts.
  EXPECT_EQ(resolve_config(with_flags({{"sparse_decode", "wideheads"}, {"tp", "1"}}), cpu(), {&reference(), &kWideHeads})
                .slot(Slot::kSparseDecode)
                .backend->name(),
            "wideheads");

  m = message_of_resolve(with_flags({{"dense_prefill", "page64"}, {"page_size", "32"}}), cpu(), {&reference(), &kPage64});
  EXPECT_THAT(m, HasSubstr("dense_prefill = 'page64'"));
  EXPECT_THAT(m, HasSubstr("page size 32 != 64"));
}

TEST(ConfigReject, DenseBackendInSparseSlotIsSaidPlainly) {
  const std::string m =
      message_of_resolve(with_flags({{"sparse_decode", "denseonly"}}), cpu(), {&reference(), &kDenseOnly});
  EXPECT_THAT(m, HasSubstr("sparse_decode = 'denseonly'"));
  EXPECT_THAT(m, HasSubstr("'denseonly' is a dense backend: it runs mla_decode but not sparse_mla_decode"));
  EXPECT_THAT(m, HasSubstr("would attend to every token where glm5 attends only to the index_topk = 2048 tokens"));
  EXPECT_THAT(m, HasSubstr("Backends that would run sparse_decode here: reference"));
  // A dense backend in a dense slot is fine.
  EXPECT_EQ(resolve_config(with_flags({{"dense_decode", "denseonly"}}), cpu(), {&reference(), &kDenseOnly})
                .slot(Slot::kDenseDecode)
                .backend->name(),
            "denseonly");
}

TEST(ConfigReject, SparseBackendInDenseSlot) {
  const std::string m =
      message_of_resolve(with_flags({{"dense_prefill", "sparseonly"}}), cpu(), {&reference(), &kSparseOnly});
  EXPECT_THAT(m, HasSubstr("'sparseonly' is a sparse backend: it runs sparse_mla_prefill but not mla_prefill"));
  // The hint asks for the sparse op at the model's index_topk, which sparseonly needs.
  const std::string d =
      message_of_resolve(with_flags({{"dense_decode", "sparseonly"}}), cpu(), {&reference(), &kSparseOnly});
  EXPECT_THAT(d, HasSubstr("'sparseonly' is a sparse backend: it runs sparse_mla_decode but not mla_decode"));
}

TEST(ConfigReject, DecodeSlotNeedsEveryQLenUpToTheConfiguredOne) {
  // qlen2 accepts q_len 3 but not 2: a q_len 3 configuration also decodes 2 tokens at a time.
  const std::string m =
      message_of_resolve(with_flags({{"dense_decode", "qlen2"}, {"q_len", "3"}}), cpu(), {&reference(), &kQLen2});
  EXPECT_THAT(m, HasSubstr("at q_len 2: q_len 2 not instantiated"));
  // The sweep starts at q_len 1.
  const FakeBackend multi("multitoken", 5, [](const Problem& p) -> std::string {
    return p.q_len == 1 ? "q_len 1 not instantiated" : "";
  });
  EXPECT_THAT(
      message_of_resolve(with_flags({{"dense_decode", "multitoken"}, {"q_len", "2"}}), cpu(), {&reference(), &multi}),
      HasSubstr("backend 'multitoken' cannot run dense_decode [mla_decode: fp8_e4m3 cache, 8 heads, page size 64, "
                "q_len 2, on cpu]: at q_len 1: q_len 1 not instantiated"));
  EXPECT_EQ(resolve_config(with_flags({{"dense_decode", "qlen2"}}), cpu(), {&reference(), &kQLen2})
                .slot(Slot::kDenseDecode)
                .backend->name(),
            "qlen2");
  // Prefill slots carry no q_len.
  EXPECT_EQ(resolve_config(with_flags({{"dense_prefill", "qlen2"}, {"q_len", "3"}}), cpu(), {&reference(), &kQLen2})
                .slot(Slot::kDensePrefill)
                .backend->name(),
            "qlen2");
}

TEST(ConfigReject, NoBackendsAtAll) {
  const std::string m = message_of_resolve(with_flags({}), cpu(), {});
  EXPECT_THAT(m, HasSubstr("no backend is registered"));
}

TEST(ConfigReject, ProgrammaticConfigIsCheckedToo) {
  AttentionConfig c;
  c.q_len.value = 9;
  EXPECT_THAT(config_error([&] { resolve_config(c, cpu()); }).what(), HasSubstr("q_len = 9 (default)"));
  c = AttentionConfig{};
  c.backend(Slot::kDenseDecode).value = "";
  EXPECT_THAT(config_error([&] { resolve_config(c, cpu()); }).what(), HasSubstr("dense_decode = ''"));
  c = AttentionConfig{};
  c.model.value = "llama";
  EXPECT_THAT(config_error([&] { resolve_config(c, cpu()); }).what(), HasSubstr("model = 'llama'"));
  c = AttentionConfig{};
  c.kv_dtype.value = static_cast<KvDtype>(7);
  EXPECT_THAT(config_error([&] { resolve_config(c, cpu()); }).what(), HasSubstr("kv_dtype = 7 (default)"));
  c = AttentionConfig{};
  c.tp.value = -8;  // divides 64, but is no tensor parallelism
  EXPECT_THAT(config_error([&] { resolve_config(c, cpu()); }).what(),
              HasSubstr("tp = -8 (default): expected a divisor of the 64 attention heads of glm5 (model from"));
  c.tp.value = 0;
  EXPECT_THAT(config_error([&] { resolve_config(c, cpu()); }).what(),
              HasSubstr("tp = 0 (default): expected a divisor of the 64 attention heads of glm5"));
  c = AttentionConfig{};
  c.page_size.value = 0;
  EXPECT_THAT(config_error([&] { resolve_config(c, cpu()); }).what(),
              HasSubstr("page_size = 0 (default): expected an integer from 1 to 1073741824 (tokens per page"));
  c = AttentionConfig{};
  c.page_size.value = (1 << 30) + 1;  // no block table of one page or more could be taken
  EXPECT_THAT(config_error([&] { resolve_config(c, cpu()); }).what(),
              HasSubstr("page_size = 1073741825 (default): expected an integer from 1 to 1073741824"));
  c = AttentionConfig{};
  c.q_len.value = 0;
  EXPECT_THAT(config_error([&] { resolve_config(c, cpu()); }).what(),
              HasSubstr("q_len = 0 (default): expected an integer from 1 to 4 (new tokens per request in decode)"));
}

// A backend whose select() throws an Error about an environment variable (a kernel override set to a
// value it does not know, as the CUDA backend does for LATENTKV_MLA_KERNEL=bogus) stops the
// resolution and the capability matrix with that Error, instead of narrowing what it claims to run;
// any other exception from select() is that backend rejecting the problem.
TEST(ConfigReject, AKernelOverrideTheBackendRefusesIsTheError) {
  const FakeBackend overridden("overridden", 30, [](const Problem& p) -> std::string {
    throw Error(std::string(op_name(p.op)), "LATENTKV_FAKE_KERNEL", "bogus", "unset or \"auto\"");
  });
  const FakeBackend broken("broken", 30, [](const Problem&) -> std::string { throw Error("select", "an internal failure"); });
  try {
    resolve_config(with_flags({}), cpu(), {&overridden, &reference()});
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_THAT(e.what(), HasSubstr("argument 'LATENTKV_FAKE_KERNEL' = bogus: expected unset or \"auto\""));
  }
  EXPECT_THROW(probe_capabilities(overridden, default_probe_grid()), Error);
  const ResolvedConfig r = resolve_config(with_flags({}), cpu(), {&broken, &reference()});
  for (Slot slot : kAllSlots) {
    EXPECT_EQ(r.slot(slot).backend->name(), "reference");
    EXPECT_THAT(r.slot(slot).why, HasSubstr("select() threw: select: an internal failure"));
  }
}

TEST(ConfigReject, ConfigErrorIsALatentkvError) {
  try {
    with_flags({{"tp", "3"}});
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.op(), "config");
    EXPECT_THAT(e.what(), HasSubstr("config: tp = 3"));
  }
}

// ---- the DSA rule -------------------------------------------------------------------------------

TEST(Config, DenseSlotsServeOnlyRowsWithinIndexTopk) {
  const ResolvedConfig r = resolve_config(with_flags({}), cpu());
  EXPECT_EQ(r.dense_max_visible_tokens, 2048);
  EXPECT_EQ(r.route(Phase::kDecode, 0), Slot::kDenseDecode);
  EXPECT_EQ(r.route(Phase::kDecode, 2048), Slot::kDenseDecode);
  EXPECT_EQ(r.route(Phase::kDecode, 2049), Slot::kSparseDecode);
  EXPECT_EQ(r.route(Phase::kPrefill, 2048), Slot::kDensePrefill);
  EXPECT_EQ(r.route(Phase::kPrefill, 495000), Slot::kSparsePrefill);
  // A negative count is a caller's bug, not a short row for the dense slot.
  EXPECT_TRUE(throws_error([&] { r.route(Phase::kDecode, -1); }, "ResolvedConfig::route", "visible_tokens", "-1"));
  const std::string rule = r.dense_rule();
  EXPECT_THAT(rule, HasSubstr("glm5 is a DSA model"));
  EXPECT_THAT(rule, HasSubstr("at most 2048 tokens"));
  EXPECT_THAT(rule, HasSubstr("sparse attention equals dense attention"));
  EXPECT_THAT(rule, HasSubstr("every longer row goes to the sparse slots"));
}

// ---- the capability matrix ----------------------------------------------------------------------

TEST(ConfigCapabilities, ReferenceRunsEveryOpOnCpuUpToItsHeadLimit) {
  const ProbeGrid grid = default_probe_grid();
  ASSERT_EQ(grid.devices.size(), 5u);
  const std::vector<CapabilityRow> rows = probe_capabilities(reference(), grid);
  ASSERT_EQ(rows.size(), 2 * std::size(kAllOps));  // per op: the CPU, then every GPU
  for (std::size_t i = 0; i < rows.size(); i += 2) {
    const CapabilityRow& on_cpu = rows[i];
    const CapabilityRow& on_gpu = rows[i + 1];
    EXPECT_EQ(on_cpu.devices, std::vector<std::string>{"cpu"});
    EXPECT_TRUE(on_cpu.supported);
    EXPECT_TRUE(on_cpu.every_combination);
    EXPECT_EQ(on_cpu.page_sizes, grid.page_sizes);
    const bool indexer = on_cpu.op == Op::kIndexerLogits || on_cpu.op == Op::kIndexerPrefill;
    if (!on_cpu.heads.empty()) EXPECT_EQ(on_cpu.heads.back(), indexer ? 64 : 128) << op_name(on_cpu.op);
    EXPECT_EQ(on_cpu.kernels, std::vector<std::string>{"reference." + std::string(op_name(on_cpu.op))});
    // Ops that read no latent cache list no cache dtype.
    const bool no_dtype = indexer || on_cpu.op == Op::kTopk;
    EXPECT_EQ(on_cpu.kv_dtypes, no_dtype ? std::vector<KvDtype>{} : grid.kv_dtypes) << op_name(on_cpu.op);
    EXPECT_EQ(on_gpu.devices, (std::vector<std::string>{"sm_89", "sm_90", "sm_100", "sm_120"}));
    EXPECT_FALSE(on_gpu.supported);
    EXPECT_THAT(on_gpu.rejection, HasSubstr("CPU only"));
  }
}

// Devices share a row only when they refuse for the same reason, read with their own name left out.
TEST(ConfigCapabilities, GpuOnlyBackendGroupsDevicesByTheirReason) {
  const std::vector<CapabilityRow> rows = probe_capabilities(kHopper, default_probe_grid());
  ASSERT_EQ(rows.size(), 3 * std::size(kAllOps));
  for (std::size_t i = 0; i < rows.size(); i += 3) {
    const std::string op(op_name(rows[i].op));
    EXPECT_EQ(rows[i].devices, std::vector<std::string>{"cpu"}) << op;
    EXPECT_FALSE(rows[i].supported) << op;
    EXPECT_EQ(rows[i].rejection, "needs a CUDA device (device is cpu)") << op;
    EXPECT_EQ(rows[i + 1].devices, (std::vector<std::string>{"sm_89", "sm_120"})) << op;
    EXPECT_FALSE(rows[i + 1].supported) << op;
    EXPECT_EQ(rows[i + 1].rejection, "built for sm_90 and sm_100 (device is sm_89 or sm_120)") << op;
    EXPECT_EQ(rows[i + 2].devices, (std::vector<std::string>{"sm_90", "sm_100"})) << op;
    EXPECT_TRUE(rows[i + 2].supported) << op;
    EXPECT_EQ(rows[i + 2].kernels, std::vector<std::string>{"hopper." + op}) << op;
  }
}

// Three devices refusing alike are listed as "a, b or c" in their shared reason.
TEST(ConfigCapabilities, ThreeDevicesSharingAReasonAreListedInIt) {
  ProbeGrid grid = default_probe_grid();
  DeviceInfo sm86;
  sm86.kind = DeviceKind::kCuda;
  sm86.sm = 86;
  sm86.name = "sm_86";
  grid.devices.push_back(sm86);
  const std::vector<CapabilityRow> rows = probe_capabilities(kHopper, grid);
  ASSERT_EQ(rows.size(), 3 * std::size(kAllOps));
  EXPECT_EQ(rows[1].devices, (std::vector<std::string>{"sm_89", "sm_120", "sm_86"}));
  EXPECT_EQ(rows[1].rejection, "built for sm_90 and sm_100 (device is sm_89, sm_120 or sm_86)");
}

// The matrix is read off select(): every point it claims is accepted, every point outside is not.
TEST(ConfigCapabilities, MatrixAgreesWithSelectPointByPoint) {
  const FakeBackend mixed("mixed", 1, [](const Problem& p) -> std::string {
    if (p.device.kind != DeviceKind::kCuda || p.device.sm < 90) return "needs sm_90+";
    if (is_attention(p.op) && p.heads > 64) return "heads > 64";
    if (p.op == Op::kMlaDecode && p.kv_dtype == KvDtype::kFp8E4M3 && p.page_size == 1) return "fp8 at page 1";
    return "";
  });
  const ProbeGrid grid = default_probe_grid();
  for (const CapabilityRow& row : probe_capabilities(mixed, grid)) {
    for (const DeviceInfo& device : grid.devices) {
      const std::string name = device.kind == DeviceKind::kCpu ? "cpu" : describe_device(device);
      if (std::find(row.devices.begin(), row.devices.end(), name) == row.devices.end()) continue;
      Problem p;
      p.op = row.op;
      p.device = device;
      p.page_size = 64;
      if (!row.supported) {
        EXPECT_FALSE(mixed.select(p)) << name;
        continue;
      }
      if (is_attention(row.op)) {
        EXPECT_EQ(row.heads.back(), 64);
        p.heads = 129;
        EXPECT_FALSE(mixed.select(p));
        p.heads = 64;
      }
      EXPECT_TRUE(mixed.select(p)) << describe_problem(p);
      if (row.op == Op::kMlaDecode) {
        EXPECT_FALSE(row.every_combination);
        EXPECT_EQ(row.rejection, "fp8 at page 1");
      } else {
        EXPECT_TRUE(row.every_combination) << op_name(row.op);
      }
    }
  }
}

}  // namespace
}  // namespace latentkv
