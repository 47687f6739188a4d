// The `latentkv` program run as a user runs it (LKV_CLI_PATH, built with the tests): usage errors
// exit 2 in every subcommand, messages name the option, the value and the bounds, output files that
// cannot be written are refused before anything runs, and --from-json refuses the options of a run.
// Every run is a usage error or the smallest CPU step, so each test takes well under a second.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

namespace fs = std::filesystem;

// The smallest step: one layer, one request of 300 tokens, one timed replay on the CPU reference.
const std::vector<std::string> kSmallStep = {"step",      "--device", "cpu", "--layers", "1", "--batch", "1",
                                             "--context", "300",      "--warmup", "0", "--iters",  "1",
                                             "--no-progress"};

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

class Cli : public ::testing::Test {
 protected:
  struct Result {
    int exit_code = -1;
    std::string out, err;
  };

  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) /
           ("latentkv_cli_" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()) + "_" +
            std::to_string(getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Runs `latentkv args...` with its output captured in files of the test's directory.
  Result run(std::vector<std::string> args, const std::vector<std::string>& more = {}) const {
    args.insert(args.end(), more.begin(), more.end());
    std::string command = shell_quote(LKV_CLI_PATH);
    for (const std::string& a : args) command += " " + shell_quote(a);
    command += " >" + shell_quote(path("stdout")) + " 2>" + shell_quote(path("stderr"));
    const int status = std::system(command.c_str());
    Result r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = read_file(path("stdout"));
    r.err = read_file(path("stderr"));
    return r;
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

TEST_F(Cli, PoolBeyondInt32SlotsNamesThePoolAndTheValueTyped) {
  for (const std::string typed : {"9223372036854775807", "99999999999999999999"}) {
    const Result r = run({"step", "--device", "cpu", "--pool", typed});
    EXPECT_EQ(r.exit_code, 2) << typed;
    EXPECT_THAT(r.err, HasSubstr("--pool: " + typed + " is not in 1 .. 2147483647 (slots are int32)"));
    EXPECT_EQ(r.out, "");
  }
  // Below 2^31 as typed, but not once rounded up to whole pages: the message shows what was typed.
  const Result rounded = run({"step", "--device", "cpu", "--pool", "2147483647"});
  EXPECT_EQ(rounded.exit_code, 2);
  EXPECT_THAT(rounded.err, HasSubstr("argument '--pool' = 2147483647: expected at most 2147483584"));
  EXPECT_THAT(rounded.err, HasSubstr("rounded up to whole pages of 64 tokens"));
  EXPECT_THAT(rounded.err, Not(HasSubstr("2147483648")));
}

TEST_F(Cli, IntegerOptionsPrintTheirBoundsOrSayNotAnInteger) {
  const Result zero = run({"step", "--context", "0"});
  EXPECT_EQ(zero.exit_code, 2);
  EXPECT_THAT(zero.err, HasSubstr("--context: 0 is not in 1 .. 2147483647"));
  EXPECT_THAT(zero.err, Not(HasSubstr("0.000000")));
  const Result word = run({"step", "--batch", "abc"});
  EXPECT_EQ(word.exit_code, 2);
  EXPECT_THAT(word.err, HasSubstr("--batch: 'abc' is not an integer"));
  const Result fraction = run({"step", "--iters", "1.0"});
  EXPECT_EQ(fraction.exit_code, 2);
  EXPECT_THAT(fraction.err, HasSubstr("--iters: '1.0' is not an integer"));
  // The same checks in the other subcommands.
  EXPECT_THAT(run({"demo", "--batch", "65"}).err, HasSubstr("--batch: 65 is not in 1 .. 64"));
  EXPECT_THAT(run({"demo", "--tp", "0"}).err, HasSubstr("--tp: 0 is not in 1 .. "));
  const Result negative = run({"bench", "--check-requests", "-5"});
  EXPECT_EQ(negative.exit_code, 2);
  EXPECT_THAT(negative.err, HasSubstr("--check-requests: -5 is not in 0 .. "));
}

TEST_F(Cli, UsageErrorsExitTwoInDemoAndBench) {
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"demo", "--tp", "3"},
           {"demo", "--model", "foo"},
           {"bench", "--op", "topk", "--splits", "4"},
           {"bench", "--context-min", "10", "--context", "5"},
           {"bench", "--tp", "3"},
       }) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args[0] << " " << args[1] << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr("error: "));
    EXPECT_EQ(r.out, "");
  }
  const Result unknown = run({"foo"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_THAT(unknown.err, HasSubstr("unknown subcommand 'foo'"));
}

TEST_F(Cli, UnwritableOutputPathsAreRefusedBeforeTheRun) {
  const Result json = run(kSmallStep, {"--json", "/nonexistent/dir/x.json"});
  EXPECT_EQ(json.exit_code, 2);
  EXPECT_THAT(json.err, HasSubstr("argument '--json' = /nonexistent/dir/x.json"));
  EXPECT_THAT(json.err, HasSubstr("/nonexistent/dir does not exist"));
  EXPECT_EQ(json.out, "") << "the step ran before the path was checked";

  const Result directory = run(kSmallStep, {"--json", dir_.string()});
  EXPECT_EQ(directory.exit_code, 2);
  EXPECT_THAT(directory.err, HasSubstr("this is a directory"));

  // A bad --plot is found before the run, and before --json's existing file is written.
  std::ofstream(path("kept.json")) << "kept";
  const Result plot = run(kSmallStep, {"--json", path("kept.json"), "--plot", "/nonexistent/p.png"});
  EXPECT_EQ(plot.exit_code, 2);
  EXPECT_THAT(plot.err, HasSubstr("argument '--plot' = /nonexistent/p.png"));
  EXPECT_EQ(plot.out, "");
  EXPECT_EQ(read_file(path("kept.json")), "kept");

  const Result bench = run({"bench", "--json", "/nonexistent/x.json"});
  EXPECT_EQ(bench.exit_code, 2);
  EXPECT_THAT(bench.err, HasSubstr("argument '--json' = /nonexistent/x.json"));
}

TEST_F(Cli, FromJsonRefusesTheOptionsOfARunAndHonoursJson) {
  const Result saved = run(kSmallStep, {"--json", path("step.json")});
  ASSERT_EQ(saved.exit_code, 0) << saved.err;

  const Result conflict = run({"step", "--from-json", path("step.json"), "--batch", "7", "--device", "cuda",
                               "--model", "foo"});
  EXPECT_EQ(conflict.exit_code, 2);
  EXPECT_THAT(conflict.err, HasSubstr("argument '--from-json'"));
  EXPECT_THAT(conflict.err, HasSubstr("--model, --batch, --device were given"));
  EXPECT_EQ(conflict.out, "");

  const Result again = run({"step", "--from-json", path("step.json"), "--json", path("again.json")});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  ASSERT_TRUE(fs::exists(path("again.json")));
  const nlohmann::json original = nlohmann::json::parse(read_file(path("step.json")));
  const nlohmann::json rewritten = nlohmann::json::parse(read_file(path("again.json")));
  EXPECT_EQ(rewritten["command"], original["command"]);
  EXPECT_EQ(rewritten["strategies"].size(), original["strategies"].size());

  // A report whose steps took no measurable time prints no NaN.
  nlohmann::json zero = original;
  for (nlohmann::json& s : zero["strategies"]) s["step_us"] = 0.0;
  std::ofstream(path("zero.json")) << zero.dump();
  const Result printed = run({"step", "--from-json", path("zero.json")});
  EXPECT_EQ(printed.exit_code, 0) << printed.err;
  EXPECT_THAT(printed.out, Not(HasSubstr("nan")));
}

TEST_F(Cli, StepTooLargeForHostMemoryFailsBeforeAllocating) {
  // About 5 TB of caches: more than any machine this runs on has.
  const Result r = run({"step", "--device", "cpu", "--batch", "4096", "--context", "200000", "--no-progress"});
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_THAT(r.err, HasSubstr("of host memory"));
  EXPECT_THAT(r.err, HasSubstr("lower --pool, --layers, --batch or --context"));
  EXPECT_THAT(r.err, Not(HasSubstr("bad_alloc")));
}

TEST_F(Cli, DuplicateStrategyIsNamedAsOne) {
  const Result r = run(kSmallStep, {"--strategies", "fp8,fp8"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("fp8 is listed twice in --strategies"));
  EXPECT_THAT(r.out, Not(HasSubstr("the model's rule picks")));
}

}  // namespace
