// `latentkv config` end to end (argv in, text or JSON out, exit code 2 on a rejected configuration),
// and fuzz tests of the configuration parsers: thousands of mutated TOML and JSON files, environments
// and argv vectors must each end in success, latentkv::Error or CLI::ParseError - never a crash and
// never another exception type. The seed is printed; LKV_TEST_FUZZ_SEED replays one and
// LKV_TEST_FUZZ_SCALE runs longer.
#include <gtest/gtest.h>
#include <gmock/gmock.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "latentkv/config.hpp"
#include "latentkv/environment.hpp"
#include "latentkv/version.hpp"
#include "support/scoped_env.hpp"

// The command itself (tools' latentkv_config_cmd library), so argv is parsed through exactly the
// options the program defines.
#include "commands.hpp"
#include "config_cmd.hpp"

namespace latentkv {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct CommandResult {
  int exit_code = 0;  // as tools/main.cpp maps it: 0, or 2 for any CLI::ParseError
  std::string out, err;
};

// `device` stands for the detected one (the CPU unless a test says otherwise).
CommandResult run_cli(const std::vector<std::string>& args, std::map<std::string, std::string> env = {},
                      const DeviceInfo& device = DeviceInfo{}) {
  std::ostringstream out, err;
  CLI::App app{"latentkv"};
  app.require_subcommand(1);
  tools::ConfigCommandIo io;
  io.out = &out;
  io.err = &err;
  io.environment = environment_from(std::move(env));
  io.device = [device] { return device; };
  tools::add_config_command(app, io);
  std::vector<std::string> storage = {"latentkv"};
  storage.insert(storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& s : storage) argv.push_back(s.data());
  CommandResult result;
  try {
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError& e) {
    std::ostringstream help_out, help_err;
    result.exit_code = app.exit(e, help_out, help_err) == 0 ? 0 : tools::kExitUsage;
  }
  result.out = out.str();
  result.err = err.str();
  return result;
}

// LKV_TEST_FUZZ_SCALE multiplies the iteration counts for a longer run (e.g. under sanitizers).
int fuzz_scale() {
  const char* s = std::getenv("LKV_TEST_FUZZ_SCALE");
  const int scale = s != nullptr ? std::atoi(s) : 1;
  return scale > 0 ? scale : 1;
}

std::uint64_t fuzz_seed() {
  std::uint64_t seed = 20261129;
  if (const char* s = std::getenv("LKV_TEST_FUZZ_SEED")) seed = std::strtoull(s, nullptr, 10);
  std::printf("[fuzz] seed %llu (set LKV_TEST_FUZZ_SEED to replay)\n", static_cast<unsigned long long>(seed));
  return seed;
}

// ---- the command --------------------------------------------------------------------------------

TEST(ConfigCommand, PrintsResolvedConfigurationWithProvenance) {
  const CommandResult r = run_cli({"config", "--model", "glm5", "--tp", "8", "--kv-dtype", "fp8_e4m3"},
                                  {{"LATENTKV_PAGE_SIZE", "128"}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_THAT(r.out, HasSubstr("precedence: flags > environment > config file > defaults"));
  EXPECT_THAT(r.out, HasSubstr("flag --model"));
  EXPECT_THAT(r.out, HasSubstr("flag --tp"));
  EXPECT_THAT(r.out, HasSubstr("environment LATENTKV_PAGE_SIZE"));
  EXPECT_THAT(r.out, HasSubstr("8 of 64 attention heads per GPU"));
  EXPECT_THAT(r.out, HasSubstr("device: cpu"));
  EXPECT_THAT(r.out, HasSubstr("kernel reference.sparse_mla_decode"));
  EXPECT_THAT(r.out, HasSubstr("kernel reference.indexer_logits"));
  EXPECT_THAT(r.out, HasSubstr("why: auto"));
  EXPECT_THAT(r.out, HasSubstr("DSA rule: glm5 is a DSA model"));
}

TEST(ConfigCommand, ImpossibleCombinationsExitTwoWithOneActionableError) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"config", "--sparse-decode", "nosuch"},
           {"config", "--tp", "3"},
           {"config", "--q-len", "5"},
           {"config", "--config", "/nonexistent/config.toml"},
       }) {
    const CommandResult r = run_cli(args);
    EXPECT_EQ(r.exit_code, 2) << args[1];
    EXPECT_EQ(r.out, "");
    EXPECT_THAT(r.err, HasSubstr("error: config: "));
    EXPECT_EQ(r.err.find("error:"), r.err.rfind("error:")) << "one error only: " << r.err;
  }
  const CommandResult bad = run_cli({"config", "--sparse-decode", "nosuch"});
  EXPECT_THAT(bad.err, HasSubstr("sparse_decode = 'nosuch' (flag --sparse-decode)"));
  EXPECT_THAT(bad.err, HasSubstr("here: reference (or auto)"));
  // An error from the environment names the variable.
  const CommandResult env = run_cli({"config"}, {{"LATENTKV_TP", "7"}});
  EXPECT_EQ(env.exit_code, 2);
  EXPECT_THAT(env.err, HasSubstr("tp = 7 (environment LATENTKV_TP)"));
}

TEST(ConfigCommand, UsageErrorsAlsoExitTwo) {
  EXPECT_EQ(run_cli({"config", "--tp"}).exit_code, 2);
  EXPECT_EQ(run_cli({"config", "--nosuch-flag"}).exit_code, 2);
  EXPECT_EQ(run_cli({"config", "--help"}).exit_code, 0);
}

// A CUDA kernel override the backend does not know (LATENTKV_MLA_KERNEL=bogus) is an error of the
// configuration, exit 2, with or without --explain, and no matrix narrowed by it is printed. The
// variable is read from the process's environment by the CUDA backend, whose check needs sm_90a code.
TEST(ConfigCommand, AnUnknownKernelOverrideIsAnError) {
  const Backend* cuda = find_backend("cuda");
  if (cuda == nullptr) GTEST_SKIP() << "no cuda backend in this build";
  // Skipped by what the build holds, not by the outcome: with sm_90a code the refusal is required.
  if (std::string_view(library_build()).find("sm_90a") == std::string_view::npos) {
    GTEST_SKIP() << "this build's cuda backend has no sm_90a kernels to choose between (" << library_build() << ")";
  }
  const testing::ScopedEnv bogus(kMlaKernelVariable, "bogus");
  Problem p;
  p.op = Op::kMlaDecode;
  p.device.kind = DeviceKind::kCuda;
  p.device.sm = 90;
  p.heads = 64;
  p.page_size = 64;
  p.q_len = 1;
  bool refused = false;
  try {
    (void)cuda->select(p);
  } catch (const Error&) {
    refused = true;
  }
  ASSERT_TRUE(refused) << "select() took LATENTKV_MLA_KERNEL=bogus in a build with sm_90a code";
  for (const std::vector<std::string>& args : {std::vector<std::string>{"config", "--explain"},
                                               std::vector<std::string>{"config", "--explain", "--json"}}) {
    const CommandResult r = run_cli(args);
    EXPECT_EQ(r.exit_code, tools::kExitUsage);
    EXPECT_THAT(r.err, HasSubstr("argument 'LATENTKV_MLA_KERNEL' = 'bogus': expected unset, \"auto\" or \"mma\""));
    EXPECT_THAT(r.err, HasSubstr("configuration rejected"));
    EXPECT_EQ(r.out, "") << "no capability matrix narrowed by the override";
  }
  // The value is shown as every user's value is: quoted, a control byte as \xNN, never raw.
  const testing::ScopedEnv escape(kMlaKernelVariable, "a\x1b[31mb");
  const CommandResult r = run_cli({"config", "--explain"});
  EXPECT_EQ(r.exit_code, tools::kExitUsage);
  EXPECT_THAT(r.err, HasSubstr("argument 'LATENTKV_MLA_KERNEL' = 'a\\x1b[31mb': expected"));
  EXPECT_EQ(r.err.find('\x1b'), std::string::npos) << r.err;
}

TEST(ConfigCommand, JsonIsTheResolvedConfiguration) {
  const CommandResult r = run_cli({"config", "--json", "--tp", "4", "--q-len", "2"}, {{"LATENTKV_KV_DTYPE", "bf16"}});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["settings"]["tp"]["value"], 4);
  EXPECT_EQ(j["settings"]["tp"]["source"]["kind"], "flag");
  EXPECT_EQ(j["settings"]["tp"]["source"]["where"], "--tp");
  EXPECT_EQ(j["settings"]["kv_dtype"]["value"], "bf16");
  EXPECT_EQ(j["settings"]["kv_dtype"]["source"]["where"], "LATENTKV_KV_DTYPE");
  EXPECT_EQ(j["settings"]["model"]["source"]["kind"], "default");
  EXPECT_TRUE(j["config_file"].is_null());
  EXPECT_EQ(j["shard"]["heads_per_gpu"], 16);
  EXPECT_EQ(j["slots"]["sparse_decode"]["backend"], "reference");
  EXPECT_EQ(j["slots"]["sparse_decode"]["kernel"], "reference.sparse_mla_decode");
  EXPECT_EQ(j["slots"]["sparse_decode"]["problem"]["q_len"], 2);
  EXPECT_EQ(j["slots"]["sparse_decode"]["problem"]["topk"], 2048);
  EXPECT_EQ(j["supporting"]["topk"]["backend"], "reference");
  EXPECT_EQ(j["dense_rule"]["dense_max_visible_tokens"], 2048);
  EXPECT_FALSE(j.contains("capabilities"));
  const nlohmann::json with_matrix = nlohmann::json::parse(run_cli({"config", "--json", "--explain"}).out);
  ASSERT_TRUE(with_matrix.contains("capabilities"));
  EXPECT_EQ(with_matrix["capabilities"][0]["backend"], "reference");
}

// --json FILE writes the same JSON into the file (as bench and step do) and prints nothing; "-" is
// standard output; a path that cannot be written is refused before anything resolves.
TEST(ConfigCommand, JsonIntoAFile) {
  const std::string file = ::testing::TempDir() + "latentkv_config_out.json";
  std::remove(file.c_str());
  const CommandResult r = run_cli({"config", "--json", file, "--tp", "4"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "");
  std::ifstream in(file);
  ASSERT_TRUE(in.good()) << file;
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j["settings"]["tp"]["value"], 4);
  EXPECT_EQ(j, nlohmann::json::parse(run_cli({"config", "--json", "-", "--tp", "4"}).out));
  std::remove(file.c_str());

  const std::string unwritable = ::testing::TempDir() + "no_such_directory_lkv/out.json";
  const CommandResult bad = run_cli({"config", "--json", unwritable});
  EXPECT_EQ(bad.exit_code, tools::kExitUsage);
  EXPECT_THAT(bad.err, HasSubstr("config: argument '--json' = " + unwritable));
  EXPECT_EQ(bad.out, "");
}

TEST(ConfigCommand, ExplainPrintsTheMatrixEvenWhenTheConfigurationFails) {
  const CommandResult ok = run_cli({"config", "--explain"});
  ASSERT_EQ(ok.exit_code, 0);
  EXPECT_THAT(ok.out, HasSubstr("capability matrix"));
  EXPECT_THAT(ok.out, HasSubstr("reference  (preference 0; extra traffic: none)"));
  EXPECT_THAT(ok.out, HasSubstr("heads all but 129"));
  EXPECT_THAT(ok.out, HasSubstr("sm_89,sm_90,sm_100,sm_120"));
  const CommandResult bad = run_cli({"config", "--explain", "--tp", "5"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.out, HasSubstr("capability matrix"));
  EXPECT_THAT(bad.err, HasSubstr("tp = 5"));
}

// Every key's line: the value and the source it came from, flags over the environment over the file.
TEST(ConfigCommand, EachLineNamesItsOwnSourceAndTheFileItsPath) {
  const std::string file = ::testing::TempDir() + "latentkv_config_sources.toml";
  std::FILE* f = std::fopen(file.c_str(), "w");
  ASSERT_NE(f, nullptr);
  std::fputs("model = \"deepseek-v3.2\"\nsparse_decode = \"reference\"\nq_len = 3\n", f);
  std::fclose(f);
  const CommandResult r = run_cli({"config", "--tp", "4", "--q-len", "2", "--config", file},
                                  {{"LATENTKV_KV_DTYPE", "bf16"}, {"LATENTKV_PAGE_SIZE", "128"}});
  std::remove(file.c_str());
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("  model           deepseek-v3.2   file " + file + ":1\n"));
  EXPECT_THAT(r.out, HasSubstr("  tp              4               flag --tp\n"));
  EXPECT_THAT(r.out, HasSubstr("  kv_dtype        bf16            environment LATENTKV_KV_DTYPE\n"));
  EXPECT_THAT(r.out, HasSubstr("  page_size       128             environment LATENTKV_PAGE_SIZE\n"));
  EXPECT_THAT(r.out, HasSubstr("  q_len           2               flag --q-len\n"));
  EXPECT_THAT(r.out, HasSubstr("  dense_decode    auto            default\n"));
  EXPECT_THAT(r.out, HasSubstr("  sparse_decode   reference       file " + file + ":2\n"));
  EXPECT_THAT(r.out, HasSubstr("  config file     " + file + "  (flag --config)\n"));
  EXPECT_THAT(r.out, HasSubstr("model: deepseek-v3.2 at tp 4: 32 of 128 attention heads per GPU; 61 layers"));
}

// Every slot and supporting op is printed with its backend, its kernel and the verdict of each
// backend considered; the JSON holds each of them too, with the shard's fields from the model.
TEST(ConfigCommand, EverySlotAndSupportingOpIsPrintedWithItsVerdicts) {
  const CommandResult r = run_cli({"config", "--tp", "4"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("16 of 64 attention heads per GPU"));
  for (const std::string op : {"mla_prefill", "mla_decode", "sparse_mla_prefill", "sparse_mla_decode", "append",
                               "indexer_logits", "topk", "indexer_prefill"}) {
    EXPECT_THAT(r.out, HasSubstr("kernel reference." + op + "\n")) << op;
    EXPECT_THAT(r.out, HasSubstr("considered reference (preference 0): accepts (reference." + op + ")")) << op;
  }
  EXPECT_THAT(r.out, HasSubstr("  dense_prefill   -> reference   kernel reference.mla_prefill\n"));
  // The reference rejects none (a build with CUDA lists its GPU backends as rejecting the CPU).
  EXPECT_THAT(r.out, Not(HasSubstr("considered reference (preference 0): rejects")));

  const nlohmann::json j = nlohmann::json::parse(run_cli({"config", "--json", "--tp", "4"}).out);
  EXPECT_EQ(j["shard"]["heads"], 64);
  EXPECT_EQ(j["shard"]["heads_per_gpu"], 16);
  EXPECT_EQ(j["shard"]["indexer_heads"], 32);
  EXPECT_EQ(j["shard"]["layers"], 78);
  EXPECT_EQ(j["settings"]["tp"]["source"]["text"], "flag --tp");
  EXPECT_EQ(j["settings"]["page_size"]["source"]["text"], "default");
  for (const char* slot : {"dense_prefill", "dense_decode", "sparse_prefill", "sparse_decode"}) {
    EXPECT_EQ(j["slots"][slot]["problem"]["heads"], 16) << slot;
    EXPECT_EQ(j["slots"][slot]["problem"]["page_size"], 64) << slot;
  }
  for (const char* op : {"append", "indexer_logits", "topk", "indexer_prefill"}) {
    ASSERT_TRUE(j["supporting"].contains(op)) << op;
    EXPECT_EQ(j["supporting"][op]["kernel"], std::string("reference.") + op);
  }
}

// Without --device the configuration is resolved for the detected device; --device cpu resolves
// for the CPU whatever was detected (here a stand-in sm_90 GPU, which this build's backends refuse
// or accept, but not as the CPU).
TEST(ConfigCommand, DeviceCpuResolvesForTheCpuWhateverIsDetected) {
  DeviceInfo gpu;
  gpu.kind = DeviceKind::kCuda;
  gpu.sm = 90;
  gpu.name = "Stand-in GPU";
  gpu.multiprocessors = 132;
  const CommandResult cpu = run_cli({"config", "--json", "--device", "cpu"}, {}, gpu);
  ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
  EXPECT_EQ(nlohmann::json::parse(cpu.out)["device"]["kind"], "cpu");
  const CommandResult detected = run_cli({"config", "--json"}, {}, gpu);
  if (detected.exit_code == 0) {
    EXPECT_EQ(nlohmann::json::parse(detected.out)["device"]["kind"], "cuda");
  } else {
    EXPECT_EQ(detected.exit_code, 2);
    EXPECT_THAT(detected.err, HasSubstr("sm_90"));
  }
}

// ---- fuzzing ------------------------------------------------------------------------------------

const std::vector<std::string> kTomlSeeds = {
    "model = \"glm5\"\ntp = 8\nkv_dtype = \"fp8_e4m3\"\npage_size = 64\nq_len = 1\n",
    "model = \"deepseek-v3.2\"\ntp = 16\ndense_prefill = \"auto\"\ndense_decode = \"reference\"\n"
    "sparse_prefill = \"reference\"\nsparse_decode = \"auto\"\n",
    "# comment\ntp = 4 # four\npage_size = 1\nq_len = 4\nkv_dtype = 'bf16'\n",
    "",
};
const std::vector<std::string> kJsonSeeds = {
    R"({"model": "glm5", "tp": 8, "kv_dtype": "fp8_e4m3", "page_size": 64, "q_len": 1})",
    R"({"model": "deepseek-v3.2", "tp": 16, "dense_decode": "reference", "sparse_decode": "auto"})",
    R"({"page_size": 1, "q_len": 4, "kv_dtype": "bf16", "sparse_prefill": "reference"})",
    "{}",
};
// Fragments that make mutations land on interesting syntax.
const std::vector<std::string> kFragments = {
    "=", "\"", "'", "[", "]", "{", "}", ",", ":", "\n", "#", " ", "\t", "\\", "\\u", "0", "-1", "9999999999999999999999",
    "1e400", "nan", "inf", "true", "null", "3.5", "tp", "q_len", "page_size", "model", "kv_dtype", "sparse_decode",
    "[[a]]", "[a.b]", "\"\"\"", "'''", std::string("\0", 1), "\xff", "\xc3\x28", "\xef\xbb\xbf", "glm5", "bf16",
    "reference", "auto", "nosuch", "0x10", "1_000", "+8", "2024-01-01",
};

std::string mutate(std::string text, std::mt19937_64& rng) {
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int i = 0; i < edits; ++i) {
    const std::size_t at = text.empty() ? 0 : rng() % (text.size() + 1);
    switch (rng() % 6) {
      case 0:  // flip a byte
        if (!text.empty()) text[std::min(at, text.size() - 1)] = static_cast<char>(rng() % 256);
        break;
      case 1:  // insert a fragment
        text.insert(at, kFragments[rng() % kFragments.size()]);
        break;
      case 2:  // delete a range
        if (!text.empty()) text.erase(std::min(at, text.size() - 1), 1 + rng() % 8);
        break;
      case 3:  // duplicate a range
        if (!text.empty()) {
          const std::size_t from = rng() % text.size();
          text.insert(at, text.substr(from, 1 + rng() % 16));
        }
        break;
      case 4:  // truncate
        text.resize(at);
        break;
      default:  // insert a random byte
        text.insert(at, 1, static_cast<char>(rng() % 256));
        break;
    }
  }
  return text;
}

// Parses, checks and resolves `text`; true on success, false on a latentkv::Error. Any other
// exception escapes and fails the test.
bool try_config_text(const std::string& text, ConfigFormat format) {
  try {
    AttentionConfig c;
    apply_config_text(c, text, format == ConfigFormat::kJson ? "fuzz.json" : "fuzz.toml", format);
    check_config(c);
    resolve_config(c, DeviceInfo{});
    return true;
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).rfind("config: ", 0), 0u) << e.what();
    return false;
  }
}

TEST(ConfigFuzz, MutatedTomlAndJsonFilesEndInSuccessOrError) {
  std::mt19937_64 rng(fuzz_seed());
  const int iterations = 4000 * fuzz_scale();
  for (ConfigFormat format : {ConfigFormat::kToml, ConfigFormat::kJson}) {
    const std::vector<std::string>& seeds = format == ConfigFormat::kJson ? kJsonSeeds : kTomlSeeds;
    for (const std::string& seed : seeds) EXPECT_TRUE(try_config_text(seed, format)) << seed;
    int ok = 0, rejected = 0;
    for (int i = 0; i < iterations; ++i) {
      const std::string text = mutate(seeds[rng() % seeds.size()], rng);
      try {
        (try_config_text(text, format) ? ok : rejected)++;
      } catch (const std::exception& e) {
        FAIL() << "iteration " << i << ": " << typeid(e).name() << ": " << e.what() << "\ninput:\n" << text;
      }
    }
    std::printf("[fuzz] %s: %d accepted, %d rejected\n", format == ConfigFormat::kJson ? "json" : "toml", ok, rejected);
    EXPECT_GT(ok, 0);
    EXPECT_GT(rejected, iterations / 2);
  }
}

TEST(ConfigFuzz, RandomBytesEndInError) {
  std::mt19937_64 rng(fuzz_seed() + 1);
  for (int i = 0; i < 2000 * fuzz_scale(); ++i) {
    std::string text(rng() % 64, '\0');
    for (char& ch : text) ch = static_cast<char>(rng() % 256);
    for (ConfigFormat format : {ConfigFormat::kToml, ConfigFormat::kJson}) {
      try {
        try_config_text(text, format);
      } catch (const std::exception& e) {
        FAIL() << "iteration " << i << ": " << e.what();
      }
    }
  }
}

// Inputs on which toml++ 3.3 breaks its own preconditions (found by this fuzz test with assertions on).
TEST(ConfigFuzz, InputsThatBreakTomlPlusPlusPreconditionsAreErrors) {
  for (const std::string text : {"tp =2024-01-01 8\n", "page_size = 1979-05-27 1\n", "[%[", "[[[1]]]", "[[=",
                                 "s = \"\"\"\\\n\xc2\xa7\"\"\"\n", "\xcc\xaa"}) {
    EXPECT_FALSE(try_config_text(text, ConfigFormat::kToml)) << text;
  }
}

TEST(ConfigFuzz, DeeplyNestedInputIsRejectedNotOverflowed) {
  EXPECT_FALSE(try_config_text("tp = " + std::string(100000, '[') + std::string(100000, ']'), ConfigFormat::kToml));
  EXPECT_FALSE(try_config_text("{\"tp\": " + std::string(100000, '[') + std::string(100000, ']') + "}",
                               ConfigFormat::kJson));
  EXPECT_FALSE(try_config_text("tp = " + std::string(100000, '{'), ConfigFormat::kToml));
}

const std::vector<std::string> kFlags = {"--model",        "--tp",           "--kv-dtype",    "--page-size",
                                         "--q-len",        "--dense-prefill", "--dense-decode", "--sparse-prefill",
                                         "--sparse-decode", "--config",       "--json",        "--explain",
                                         "-h",             "--",             "-x",            "--tp=4",
                                         "--model=glm5",   "--nosuch"};
const std::vector<std::string> kValues = {
    "glm5", "deepseek-v3.2", "8", "1", "3", "64", "0", "-1", "129", "4", "5", "fp8_e4m3", "bf16", "fp16",
    "reference", "auto", "nosuch", "", " ", "1e3", "99999999999999999999", "--tp", "missing/config.toml",
    std::string("\xff\xfe", 2), "a b", "=", "config"};

std::string random_token(std::mt19937_64& rng) {
  switch (rng() % 4) {
    case 0: return kFlags[rng() % kFlags.size()];
    case 1:
    case 2: return kValues[rng() % kValues.size()];
    default: return mutate(kValues[rng() % kValues.size()], rng);
  }
}

// The current directory moved to a fresh one under the test's temporary directory for the scope's
// life, and that directory removed after: the argv fuzz passes `--json 129`, `--json config` and the
// like, which write where the tests run.
class ScopedScratchDirectory {
 public:
  ScopedScratchDirectory()
      : previous_(std::filesystem::current_path()),
        scratch_(std::filesystem::path(::testing::TempDir()) /
                 ("lkv_config_fuzz_" + std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
                  std::to_string(std::random_device{}()))) {
    std::filesystem::create_directories(scratch_);
    std::filesystem::current_path(scratch_);
  }
  ~ScopedScratchDirectory() {
    std::error_code ec;
    std::filesystem::current_path(previous_, ec);
    std::filesystem::remove_all(scratch_, ec);
  }
  ScopedScratchDirectory(const ScopedScratchDirectory&) = delete;
  ScopedScratchDirectory& operator=(const ScopedScratchDirectory&) = delete;

 private:
  std::filesystem::path previous_, scratch_;
};

TEST(ConfigFuzz, RandomArgvAndEnvironmentEndInSuccessOrUsageError) {
  const ScopedScratchDirectory scratch;
  std::mt19937_64 rng(fuzz_seed() + 2);
  const int iterations = 3000 * fuzz_scale();
  int ok = 0, usage = 0;
  for (int i = 0; i < iterations; ++i) {
    std::vector<std::string> args;
    if (rng() % 16 != 0) args.push_back("config");
    const int n = static_cast<int>(rng() % 9);
    for (int k = 0; k < n; ++k) {
      std::string token = random_token(rng);
      if (token == "--explain" && rng() % 8 != 0) continue;  // the matrix is slow to print thousands of times
      args.push_back(token);
      if (token.rfind("--", 0) == 0 && rng() % 4 != 0) args.push_back(kValues[rng() % kValues.size()]);
    }
    std::map<std::string, std::string> env;
    if (rng() % 3 == 0) {
      const std::vector<std::string_view>& keys = config_keys();
      env[environment_variable(keys[rng() % keys.size()])] = random_token(rng);
    }
    try {
      const CommandResult r = run_cli(args, env);
      (r.exit_code == 0 ? ok : usage)++;
      if (r.exit_code != 0 && !r.err.empty()) EXPECT_THAT(r.err, HasSubstr("error: config: "));
    } catch (const Error& e) {
      FAIL() << "iteration " << i << ": latentkv::Error escaped the command: " << e.what();
    } catch (const std::exception& e) {
      std::string joined;
      for (const std::string& a : args) joined += " [" + a + "]";
      FAIL() << "iteration " << i << ": " << typeid(e).name() << ": " << e.what() << "\nargv:" << joined;
    }
  }
  std::printf("[fuzz] argv: %d succeeded, %d exited 2\n", ok, usage);
  EXPECT_GT(ok, 0);
  EXPECT_GT(usage, 0);
}

}  // namespace
}  // namespace latentkv
