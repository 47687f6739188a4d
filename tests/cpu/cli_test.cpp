// The `latentkv` program run as a user runs it (LKV_CLI_PATH, built with the tests): usage errors
// exit 2 in every subcommand, messages name the option, the value and the bounds, output files that
// cannot be written are refused before anything runs, and --from-json refuses the options of a run
// and reports that are not consistent. Every run is a usage error, the smallest CPU step or the
// demo, so each test takes well under a second.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "latentkv/backend.hpp"
#include "latentkv/environment.hpp"
#include "latentkv/version.hpp"

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

  // Runs `latentkv args...` with its output captured in files of the test's directory, and with
  // `environment` ("NAME=value" each) set for it; no LATENTKV_* variable of the test's own
  // environment reaches it (the program warns about those it does not read).
  Result run(std::vector<std::string> args, const std::vector<std::string>& more = {},
             const std::vector<std::string>& environment = {}) const {
    args.insert(args.end(), more.begin(), more.end());
    const std::string command =
        command_line(args, environment) + " >" + shell_quote(path("stdout")) + " 2>" + shell_quote(path("stderr"));
    const int status = std::system(command.c_str());
    Result r;
    r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = read_file(path("stdout"));
    r.err = read_file(path("stderr"));
    return r;
  }

  // The shell words that run `latentkv args...` as run() does: no LATENTKV_* variable of the test's
  // environment, `environment` set.
  static std::string command_line(const std::vector<std::string>& args,
                                  const std::vector<std::string>& environment = {}) {
    std::string command = "env";
    for (const std::string& name : latentkv::process_environment_names()) {
      if (name.starts_with(latentkv::kEnvironmentPrefix)) command += " -u " + shell_quote(name);
    }
    command += " ";
    for (const std::string& assignment : environment) {
      const std::size_t equals = assignment.find('=');
      command += assignment.substr(0, equals + 1) + shell_quote(assignment.substr(equals + 1)) + " ";
    }
    command += shell_quote(LKV_CLI_PATH);
    for (const std::string& a : args) command += " " + shell_quote(a);
    return command;
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // The report of the smallest step, saved in the test's directory; its path.
  std::string saved_step() const {
    const Result saved = run(kSmallStep, {"--json", path("step.json")});
    EXPECT_EQ(saved.exit_code, 0) << saved.err;
    return path("step.json");
  }

  // An executable shell script in the test's directory; its path.
  std::string script(const std::string& name, const std::string& body) const {
    std::ofstream(path(name)) << "#!/bin/sh\n" << body << "\n";
    fs::permissions(path(name), fs::perms::owner_all);
    return path(name);
  }

  fs::path dir_;
};

TEST_F(Cli, AMisspeltVariableIsNamedAndTheCommandStillRuns) {
  const Result r = run({"info"}, {}, {"LATENTKV_PAGESIZE=32", "LATENTKV_PYTHON=python3"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.err, HasSubstr("warning: LATENTKV_PAGESIZE is set but latentkv reads no variable of that name; it is "
                               "ignored (did you mean LATENTKV_PAGE_SIZE?)\n"));
  EXPECT_THAT(r.err, Not(HasSubstr("LATENTKV_PYTHON is set")));  // the program's own, read
  EXPECT_THAT(r.out, Not(HasSubstr("warning")));
}

// `--json /dev/stdout` puts the report after the table on the standard output, whatever that is:
// a file the shell opened (which a renamed file would have taken the place of, losing the table) or
// a pipe (whose link, /proc/self/fd/1 -> pipe:[N], names no path to put a file beside). A --plot
// there is refused.
TEST_F(Cli, JsonToStandardOutputFollowsTheTable) {
  if (!fs::exists("/dev/stdout")) GTEST_SKIP() << "no /dev/stdout here";
  std::vector<std::string> args = kSmallStep;
  args.insert(args.end(), {"--json", "/dev/stdout"});
  const Result to_file = run(args);
  // The same through a pipe, its exit status kept (a pipeline's status is its last command's).
  const std::string line = "{ " + command_line(args) + " 2>" + shell_quote(path("stderr")) + "; echo $? >" +
                           shell_quote(path("status")) + "; } | cat >" + shell_quote(path("stdout"));
  ASSERT_EQ(std::system(line.c_str()), 0);
  const Result through_pipe{std::stoi(read_file(path("status"))), read_file(path("stdout")), read_file(path("stderr"))};
  for (const Result& r : {to_file, through_pipe}) {
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.err, "");
    const std::size_t repro = r.out.find("repro: latentkv step"), json = r.out.find("\n{\n") + 1;
    ASSERT_NE(repro, std::string::npos) << r.out;
    ASSERT_NE(json, 0u) << r.out;  // npos + 1
    EXPECT_LT(repro, json);
    const std::size_t end = r.out.rfind("}\n");
    ASSERT_NE(end, std::string::npos);
    const nlohmann::json report = nlohmann::json::parse(r.out.substr(json, end + 1 - json));
    EXPECT_THAT(report.at("command").get<std::string>(), ::testing::StartsWith("latentkv step "));
  }
  // A picture there would overwrite the table: refused before the run.
  fs::create_symlink("/dev/stdout", path("stdout.png"));
  const Result plot = run(kSmallStep, {"--plot", path("stdout.png")});
  EXPECT_EQ(plot.exit_code, 2);
  EXPECT_THAT(plot.err, HasSubstr("expected a file other than the standard output or error"));
}

// Output that could not be written (here to /dev/full, a device that is always full) is a failure,
// said on stderr, not a success.
TEST_F(Cli, OutputThatCannotBeWrittenFails) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  for (const char* command : {"info", "config --json"}) {
    SCOPED_TRACE(command);
    const std::string line = shell_quote(LKV_CLI_PATH) + " " + command + " >/dev/full 2>" + shell_quote(path("stderr"));
    const int status = std::system(line.c_str());
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), 1);
    EXPECT_THAT(read_file(path("stderr")), HasSubstr("error: the output could not be written to standard output"));
  }
}

// An empty file name, or a picture asked into the report's own file, is a usage error before the run.
TEST_F(Cli, EmptyOrSharedOutputFilesAreRefused) {
  for (const char* option : {"--json", "--plot", "--from-json"}) {
    const Result r = run(kSmallStep, {option, ""});
    EXPECT_EQ(r.exit_code, 2) << option;
    EXPECT_THAT(r.err, HasSubstr(std::string("argument '") + option + "' = '': expected a file name"));
  }
  const Result same = run(kSmallStep, {"--json", path("r.svg"), "--plot", (dir_ / "." / "r.svg").string()});
  EXPECT_EQ(same.exit_code, 2);
  EXPECT_THAT(same.err, HasSubstr("expected another file than --json's"));
  EXPECT_FALSE(fs::exists(path("r.svg")));
}

// The word after a file option is its file name to CLI11 whatever it is: an option there, or "-",
// is refused before anything runs (rather than written to a file named --no-progress, with the
// option dropped), and so is an integer option whose value is missing.
TEST_F(Cli, AnOptionWhereAFileNameGoesIsRefused) {
  for (const std::string command : {"step", "bench"}) {
    SCOPED_TRACE(command);
    const Result option = run({command, "--json", "--no-progress"});
    EXPECT_EQ(option.exit_code, 2);
    EXPECT_THAT(option.err, HasSubstr("error: " + command + ": --json: no value was given (the word after it, "
                                      "'--no-progress', is an option)"));
    const Result dash_name = run({command, "--json", "-x.json"});
    EXPECT_EQ(dash_name.exit_code, 2);
    EXPECT_THAT(dash_name.err, HasSubstr("argument '--json' = -x.json: expected a file name, not an option (no file "
                                         "name was given after --json; to name a file that starts with '-', write "
                                         "./-x.json)"));
    const Result dash = run({command, "--json", "-"});
    EXPECT_EQ(dash.exit_code, 2);
    EXPECT_THAT(dash.err, HasSubstr("argument '--json' = -: expected a file name ('-' is no standard output here"));
    EXPECT_EQ(option.out + dash.out, "");
  }
  const Result plot = run(kSmallStep, {"--plot", "--json"});
  EXPECT_EQ(plot.exit_code, 2);
  EXPECT_THAT(plot.err, HasSubstr("--plot: no value was given (the word after it, '--json', is an option)"));
  const Result missing = run({"step", "--batch", "--tp", "8"});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_THAT(missing.err, HasSubstr("error: step: --batch: no value was given (the word after it, '--tp', is an option)"));
  // So every option that takes a value, not only the integers and file names: without the check the
  // option took the next one's name as its value and the number after it was a stray word; one with
  // a list of values (bench's --op and --kv-dtype, step's --device) said that "--batch" was none of them.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"step", "--model", "--tp", "8"}, {"step", "--strategies", "--no-progress"},
           {"step", "--from-json", "--no-progress"}, {"bench", "--model", "--batch", "1"},
           {"bench", "--op", "--batch", "1"}, {"bench", "--kv-dtype", "--batch", "1"},
           {"step", "--device", "--batch", "1"}, {"config", "--device", "--tp", "8"},
           {"demo", "--model", "--batch", "1"}, {"config", "--model", "--tp", "8"}, {"config", "--config", "--explain"}}) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args[0] << " " << args[1];
    EXPECT_THAT(r.err, HasSubstr("error: " + args[0] + ": " + args[1] + ": no value was given (the word after it, '" +
                                 args[2] + "', is an option)"));
  }
}

// A flag given a value that is no boolean is said to be one; a long bad value is echoed in part.
TEST_F(Cli, BadFlagAndLongValuesAreSaidPlainly) {
  const Result flag = run({"step", "--fault-checks=bogus"});
  EXPECT_EQ(flag.exit_code, 2);
  EXPECT_THAT(flag.err, HasSubstr("error: step: --fault-checks: 'bogus' is not a boolean (give --fault-checks alone, "
                                  "or =true / =false)"));
  const Result explain = run({"config", "--explain=bogus"});
  EXPECT_EQ(explain.exit_code, 2);
  EXPECT_THAT(explain.err, HasSubstr("error: config: --explain: 'bogus' is not a boolean"));
  const Result long_value = run({"step", "--tp", std::string(100000, '9')});
  EXPECT_EQ(long_value.exit_code, 2);
  EXPECT_THAT(long_value.err, HasSubstr("--tp: " + std::string(80, '9') + "... is not in 1 .. "));
  EXPECT_LT(long_value.err.size(), 400u);
}

// A report is written whole or not at all: into a file beside the one named, renamed onto it once
// written, so that a link stays a link to the file it names and a replaced file keeps its mode; a
// device written as it is says why it failed (/dev/full: no space).
TEST_F(Cli, AReportReplacesItsFileWhole) {
  { std::ofstream(path("old.json")) << "an earlier report"; }
  fs::permissions(path("old.json"), fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  fs::create_symlink("old.json", path("link.json"));
  const Result r = run(kSmallStep, {"--json", path("link.json")});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::is_symlink(path("link.json")));
  EXPECT_EQ(read_file(path("old.json")).rfind("{\n  \"command\": \"latentkv step ", 0), 0u);
  EXPECT_EQ(fs::status(path("old.json")).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  for (const fs::directory_entry& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().filename().string().find(".partial-"), std::string::npos) << entry.path();
  }
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full here";
  const Result full = run(kSmallStep, {"--json", "/dev/full"});
  EXPECT_EQ(full.exit_code, 1);
  EXPECT_THAT(full.err, HasSubstr("argument '--json' = /dev/full: expected a writable file (writing it failed: "));
}

// On the CPU the baselines are not run: a picture of them alone is refused before the run.
TEST_F(Cli, APlotOfNothingTheCpuRunsIsRefusedFirst) {
  const Result r = run(kSmallStep, {"--strategies", "cast_full,gather_cast", "--plot", path("p.svg")});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("argument '--plot' = " + path("p.svg") + ": expected a run with a strategy the CPU "
                               "reference times (fp8, dense or sparse)"));
  EXPECT_EQ(r.out, "");
  EXPECT_FALSE(fs::exists(path("p.svg")));
}

// bench's --pool left at its default is said to be one, with the options that change what it must hold.
TEST_F(Cli, ADefaultPoolTooSmallIsSaidToBeTheDefault) {
  const Result r = run({"bench", "--page-size", "1073741824"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("argument '--pool' = 495000 (its default): expected >= 1073741824 tokens"));
  EXPECT_THAT(r.err, HasSubstr("give a larger --pool, or lower --batch, --context or --page-size"));
}

// The configuration's variables set for a command that takes its shape from its options are said,
// with the option to use (empty ones, unset to the configuration, are not); the kernel overrides,
// read by every command, are not; `config` reads them.
TEST_F(Cli, ConfigurationVariablesACommandDoesNotReadAreSaid) {
  const std::vector<std::string> environment = {"LATENTKV_PAGE_SIZE=32", "LATENTKV_SPARSE_DECODE=reference",
                                                "LATENTKV_MLA_KERNEL=auto"};
  const Result step = run(kSmallStep, {}, environment);
  EXPECT_EQ(step.exit_code, 0) << step.err;
  EXPECT_THAT(step.err, HasSubstr("warning: LATENTKV_PAGE_SIZE is set, but `latentkv step` does not read the "
                                  "configuration's variables; its --page-size option sets the same"));
  EXPECT_THAT(step.err, HasSubstr("warning: LATENTKV_SPARSE_DECODE is set, but `latentkv step` does not read the "
                                  "configuration's variables (it is ignored here)"));
  EXPECT_THAT(step.err, Not(HasSubstr("LATENTKV_MLA_KERNEL")));
  // An empty one is unset, as `config` reads it: nothing to say.
  const Result empty = run(kSmallStep, {}, {"LATENTKV_TP=", "LATENTKV_CONFIG="});
  EXPECT_EQ(empty.exit_code, 0) << empty.err;
  EXPECT_EQ(empty.err, "");
  // For the CPU: on a machine with a GPU, sparse_decode = reference is refused for it.
  const Result config = run({"config", "--device", "cpu"}, {}, environment);
  EXPECT_EQ(config.exit_code, 0) << config.err;
  EXPECT_EQ(config.err, "");
}

// Help fits 100 columns: descriptions wrap under their column (an option's own name and its list
// of values may be longer, on a line of their own).
TEST_F(Cli, HelpIsWrappedToAHundredColumns) {
  for (const char* command : {"", "step", "demo", "config", "info", "bench"}) {
    std::vector<std::string> args;
    if (*command != '\0') args.emplace_back(command);
    args.emplace_back("--help");
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 0) << command;
    std::istringstream lines(r.out);
    int wrapped = 0;
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("  -", 0) == 0 && line.find("  ", 3) == std::string::npos) continue;  // a name alone
      if (line.rfind("Usage: ", 0) == 0) continue;  // the program's path, as it was run
      EXPECT_LE(line.size(), 100u) << command << ": " << line;
      wrapped += line.rfind(std::string(30, ' '), 0) == 0;
    }
    if (std::string(command) == "step") EXPECT_GT(wrapped, 5) << "step's long descriptions continue under their column";
  }
}

// The commands take each other's names for the same values: `config --device auto` (step's word
// for the detected device) and `config --device cuda` (step's word for a GPU, an error without
// one), `step --device detected` (config's word), and `bench --kv-dtype fp8` (config's short name
// of fp8_e4m3).
TEST_F(Cli, CommandsTakeEachOthersNamesForTheSameValues) {
  const Result config = run({"config", "--device", "auto", "--json"});
  EXPECT_EQ(config.exit_code, 0) << config.err;
  const Result gpu = run({"config", "--device", "cuda", "--json"});
  if (latentkv::detect_device().kind == latentkv::DeviceKind::kCuda) {
    EXPECT_EQ(gpu.exit_code, 0) << gpu.err;
  } else {
    EXPECT_EQ(gpu.exit_code, 2);
    EXPECT_THAT(gpu.err, HasSubstr("config: argument '--device' = cuda: expected a CUDA GPU"));
  }
  std::vector<std::string> detected = kSmallStep;
  detected[2] = "detected";  // in place of cpu
  const Result step = run(detected, {"--check-requests", "0"});
  EXPECT_EQ(step.exit_code, 0) << step.err;
  // Refused for another option, checked after the values were read, and on any machine before a GPU runs.
  const Result bench = run({"bench", "--kv-dtype", "fp8", "--op", "sparse_mla_decode", "--context-min", "5"});
  EXPECT_EQ(bench.exit_code, 2);
  EXPECT_THAT(bench.err, HasSubstr("argument '--context-min' = 5: expected only with --op mla_decode "
                                   "(sparse_mla_decode does not read it)"));
  const Result bad = run({"bench", "--kv-dtype", "fp9"});
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_THAT(bad.err, HasSubstr("--kv-dtype: fp9 not in {fp8_e4m3,bf16}"));
}

// A run with --plot and no python3 that imports matplotlib is refused before it runs (not after,
// with the data and no picture).
TEST_F(Cli, PlotWithoutMatplotlibIsRefusedBeforeTheRun) {
  const std::string without = script("python-without-matplotlib", "cat >/dev/null; exit 1");
  const Result r = run(kSmallStep, {"--plot", path("p.svg")}, {"LATENTKV_PYTHON=" + without});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("argument '--plot' = " + path("p.svg") + ": expected a python3 that imports "
                               "matplotlib (tried " + without + ")"));
  EXPECT_EQ(r.out, "") << "nothing ran";
}

TEST_F(Cli, VersionIsTheLibrarysAndSaysWhatItWasBuiltFor) {
  const std::string line = std::string("latentkv ") + LATENTKV_VERSION + " (" + latentkv::library_build() + ")\n";
  const Result version = run({"--version"});
  EXPECT_EQ(version.exit_code, 0) << version.err;
  EXPECT_EQ(version.out, line);
  const Result info = run({"info"});
  EXPECT_EQ(info.out.substr(0, line.size()), line);
  EXPECT_STREQ(latentkv::library_version(), LATENTKV_VERSION);
  EXPECT_EQ(std::string("latentkv ") + latentkv::library_description() + "\n", line);
  const std::string build = latentkv::library_build();
#ifdef LKV_WITH_CUDA
  EXPECT_THAT(build, ::testing::StartsWith("CUDA backends for "));
#else
  EXPECT_EQ(build, "CPU reference only, built without CUDA");
#endif
}

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
  // A terminal escape sequence typed as a value is shown escaped, not sent to the terminal.
  const Result escape = run({"step", "--batch", "\x1b[31m8"});
  EXPECT_EQ(escape.exit_code, 2);
  EXPECT_THAT(escape.err, HasSubstr("--batch: '\\x1b[31m8' is not an integer"));
  EXPECT_THAT(escape.err, Not(HasSubstr("\x1b")));
  // So in the messages CLI11 forms: an unknown option, an unknown subcommand, a name not in a list.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"step", "--\x1b[31m"}, {"\x1b[31m"}, {"bench", "--op", "\x1b[31m"}}) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args.back();
    EXPECT_THAT(r.err, HasSubstr("\\x1b[31m"));
    EXPECT_THAT(r.err, Not(HasSubstr("\x1b")));
  }
  // So in a path that cannot be written (its message comes from the library's Error), and in a
  // file --from-json cannot read.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"step", "--json", "/nonexistent/\x1b[31mRED.json"}, {"step", "--from-json", "/nonexistent/\x1b[31m.json"},
           {"bench", "--json", "/nonexistent/\x1b[31m.json"}, {"config", "--json", "/nonexistent/\x1b[31m.json"}}) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args[0] << " " << args[1];
    EXPECT_THAT(r.err, HasSubstr("\\x1b[31m"));
    EXPECT_THAT(r.err, Not(HasSubstr("\x1b")));
  }
  // A sign of "+-" is no integer's (from_chars would read the '-' after a skipped '+').
  for (const char* value : {"+-0", "+-1"}) {
    const Result signs = run({"step", "--warmup", value});
    EXPECT_EQ(signs.exit_code, 2) << value;
    EXPECT_THAT(signs.err, HasSubstr("--warmup: '" + std::string(value) + "' is not an integer"));
  }
  const Result twice = run({"step", "--tp", "8", "--tp", "4"});
  EXPECT_EQ(twice.exit_code, 2);
  EXPECT_THAT(twice.err, HasSubstr("error: step: --tp: given 2 times; give it once"));
  // The same checks in the other subcommands.
  EXPECT_THAT(run({"demo", "--batch", "65"}).err, HasSubstr("--batch: 65 is not in 1 .. 64"));
  const Result positions = run({"demo", "--model", "deepseek-v3.2", "--context", "170000"});
  EXPECT_EQ(positions.exit_code, 2);
  EXPECT_THAT(positions.err, HasSubstr("demo: argument '--context' = 170000: expected <= 163840 (max positions of "
                                       "deepseek-v3.2)"));
  // demo's --context goes up to the model's max positions (glm5's 202,752), as step's does.
  const Result past_glm5 = run({"demo", "--context", "202753"});
  EXPECT_EQ(past_glm5.exit_code, 2);
  EXPECT_THAT(past_glm5.err,
              HasSubstr("demo: argument '--context' = 202753: expected <= 202752 (max positions of glm5)"));
  EXPECT_THAT(run({"demo", "--tp", "0"}).err, HasSubstr("--tp: 0 is not in 1 .. "));
  const Result negative = run({"bench", "--check-requests", "-5"});
  EXPECT_EQ(negative.exit_code, 2);
  EXPECT_THAT(negative.err, HasSubstr("--check-requests: -5 is not in 0 .. "));
}

// A leading zero is decimal, as in `config` (CLI11 alone would read "010" as octal 8), and a sign
// or zeros never reach the numbers a run prints.
TEST_F(Cli, LeadingZerosAreDecimal) {
  const Result tp = run({"step", "--device", "cpu", "--tp", "010"});  // octal 8 would divide 64 heads
  EXPECT_EQ(tp.exit_code, 2);
  EXPECT_THAT(tp.err, HasSubstr("argument '--tp' = 10"));
  const Result bench = run({"bench", "--batch", "9", "--check-requests", "010"});  // octal 8 <= 9
  EXPECT_EQ(bench.exit_code, 2);
  EXPECT_THAT(bench.err, HasSubstr("argument '--check-requests' = 10: expected at most the batch, 9"));
  const Result pool = run({"bench", "--context", "65", "--pool", "0100"});  // octal 64 < 128
  EXPECT_EQ(pool.exit_code, 2);
  EXPECT_THAT(pool.err, HasSubstr("argument '--pool' = 100: expected >= 128"));
  const Result step = run({"step", "--device", "cpu", "--context", "+0100", "--batch", "01", "--layers", "1",
                           "--iters", "1", "--warmup", "0", "--strategies", "fp8"});
  ASSERT_EQ(step.exit_code, 0) << step.err;
  EXPECT_THAT(step.out, HasSubstr("--context 100 "));
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

// What bench's op would not read, and a pool too small for the requests, are refused before the GPU
// is looked for (the message is the option's, not the missing GPU's).
TEST_F(Cli, BenchRefusesWhatItsOpWouldNotRunBeforeLookingForAGpu) {
  const Result dtype = run({"bench", "--op", "dsa_decode", "--kv-dtype", "bf16"});
  EXPECT_EQ(dtype.exit_code, 2);
  EXPECT_THAT(dtype.err, HasSubstr("argument '--kv-dtype' = bf16: expected only with --op mla_decode, "
                                   "sparse_mla_decode, mla_prefill, sparse_mla_prefill or dsa_prefill (dsa_decode "
                                   "does not read it)"));
  const Result q_len = run({"bench", "--op", "mla_prefill", "--q-len", "4"});
  EXPECT_EQ(q_len.exit_code, 2);
  EXPECT_THAT(q_len.err, HasSubstr("argument '--q-len' = 4: expected only with --op mla_decode, sparse_mla_decode, "
                                   "indexer_logits, topk or dsa_decode (mla_prefill does not read it)"));
  // Typed at its default value, too: the bench cannot tell it from an option left out by the value.
  const Result at_default = run({"bench", "--op", "mla_decode", "--new-tokens", "4096"});
  EXPECT_EQ(at_default.exit_code, 2);
  EXPECT_THAT(at_default.err, HasSubstr("argument '--new-tokens' = 4096: expected only with --op mla_prefill"));
  const Result pool = run({"bench", "--pool", "1000", "--context", "4096"});
  EXPECT_EQ(pool.exit_code, 2);
  EXPECT_THAT(pool.err, HasSubstr("argument '--pool' = 1000: expected >= 4096 tokens (1 request of 4096 tokens "
                                  "takes 64 pages of 64)"));
  EXPECT_EQ(pool.out, "");
}

TEST_F(Cli, ModelAndTpErrorsNameTheCommandAndTheFlag) {
  for (const std::string command : {"step", "demo", "bench"}) {
    const Result tp = run({command, "--tp", "3"});
    EXPECT_EQ(tp.exit_code, 2) << command;
    EXPECT_THAT(tp.err, HasSubstr("error: " + command +
                                  ": argument '--tp' = 3: expected a positive divisor of glm5's 64 attention heads"));
    const Result model = run({command, "--model", "foo"});
    EXPECT_EQ(model.exit_code, 2) << command;
    EXPECT_THAT(model.err, HasSubstr("error: " + command + ": argument '--model' = 'foo': expected one of: glm5"));
    EXPECT_EQ(model.out, "");
  }
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
  const Result bench_empty = run({"bench", "--json", ""});
  EXPECT_EQ(bench_empty.exit_code, 2);
  EXPECT_THAT(bench_empty.err, HasSubstr("bench: argument '--json' = '': expected a file name"));

  // A directory that takes no new files (procfs) says yes to root's access(): the name is tried.
  if (fs::is_directory("/proc/self")) {
    const Result proc = run(kSmallStep, {"--json", "/proc/self/new.json"});
    EXPECT_EQ(proc.exit_code, 2);
    EXPECT_THAT(proc.err, HasSubstr("argument '--json' = /proc/self/new.json"));
    EXPECT_EQ(proc.out, "");
  }
  // A link to a file yet to be written is a new name where the link points (the write follows it).
  fs::create_symlink("written-later.json", path("link.json"));
  const Result link = run(kSmallStep, {"--json", path("link.json")});
  EXPECT_EQ(link.exit_code, 0) << link.err;
  EXPECT_TRUE(fs::is_regular_file(path("written-later.json")));
  // Links that go round in a loop are said to, not that the name exists.
  fs::create_symlink("loop-b.json", path("loop-a.json"));
  fs::create_symlink("loop-a.json", path("loop-b.json"));
  const Result loop = run(kSmallStep, {"--json", path("loop-a.json")});
  EXPECT_EQ(loop.exit_code, 2);
  EXPECT_THAT(loop.err, HasSubstr("argument '--json' = " + path("loop-a.json") +
                                  ": expected a file, or a link that ends at one (its links go round in a loop)"));
  // The trial file of a new name is not left behind.
  const Result fresh = run(kSmallStep, {"--json", path("fresh.json"), "--check-requests", "5"});
  EXPECT_EQ(fresh.exit_code, 2);
  EXPECT_FALSE(fs::exists(path("fresh.json")));
}

TEST_F(Cli, FromJsonRefusesTheOptionsOfARunAndHonoursJson) {
  const Result saved = run(kSmallStep, {"--json", path("step.json")});
  ASSERT_EQ(saved.exit_code, 0) << saved.err;

  const Result conflict = run({"step", "--from-json", path("step.json"), "--batch", "7", "--device", "cuda",
                               "--model", "foo"});
  EXPECT_EQ(conflict.exit_code, 2);
  EXPECT_THAT(conflict.err, HasSubstr("argument '--from-json'"));
  EXPECT_THAT(conflict.err, HasSubstr("expected no option of a run beside it (it prints a saved report; only "
                                      "--json, --plot and --no-progress are taken with it), but --model, --batch, "
                                      "--device were given"));
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
  for (nlohmann::json& s : zero["strategies"]) {
    for (const char* key : {"step_us", "step_p10_us", "step_p90_us"}) s[key] = 0.0;
  }
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
  EXPECT_THAT(r.err, HasSubstr("lower --pool, --page-size, --layers, --batch or --context"));
  EXPECT_THAT(r.err, Not(HasSubstr("bad_alloc")));
  // One layer of the largest pool: 2^31 - 64 slots of 788 B, 1692 GB.
  const Result one = run({"step", "--device", "cpu", "--batch", "1", "--layers", "1", "--context", "300", "--pool",
                          "2147483584", "--no-progress"});
  EXPECT_EQ(one.exit_code, 1);
  EXPECT_THAT(one.err, HasSubstr("step: 1 layer x 2147483584 slots of cache take 1692.2 GB (788 B a slot"));
}

TEST_F(Cli, DuplicateStrategyIsNamedAsOne) {
  const Result r = run(kSmallStep, {"--strategies", "fp8,fp8,fp8"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string note = "fp8 is listed more than once in --strategies: the repeats are left out";
  EXPECT_THAT(r.out, HasSubstr(note));
  EXPECT_EQ(r.out.find(note), r.out.rfind(note)) << "the note once, however many repeats";
  EXPECT_THAT(r.out, Not(HasSubstr("the model's rule picks")));
}

TEST_F(Cli, ChosenPythonThatCannotRunIsNamedAndRefusedBeforeTheRun) {
  const std::string report = saved_step();
  const std::string plot = path("p.png");
  for (const std::string python : {"/nonexistent/python3", "no-such-python-here"}) {
    const Result r = run({"step", "--from-json", report, "--plot", plot}, {}, {"LATENTKV_PYTHON=" + python});
    EXPECT_EQ(r.exit_code, 2) << python << ": " << r.err;
    EXPECT_THAT(r.err, HasSubstr("LATENTKV_PYTHON=" + python + " cannot be run ("));
    EXPECT_THAT(r.err, HasSubstr("expected a python3 with matplotlib"));
    EXPECT_THAT(r.err, Not(HasSubstr("no python3 was found"))) << "the variable was set: it is the one to name";
    EXPECT_EQ(r.out, "");
  }
  // A run is refused before it starts: nothing printed, nothing written.
  const Result before = run(kSmallStep, {"--json", path("run.json"), "--plot", plot}, {"LATENTKV_PYTHON=/nonexistent"});
  EXPECT_EQ(before.exit_code, 2);
  EXPECT_EQ(before.out, "");
  EXPECT_FALSE(fs::exists(path("run.json")));
  // One that runs but has no matplotlib (the script's exit 3) is named too, and no other is tried;
  // the report to redraw is the --from-json one.
  const std::string without = script("python-without-matplotlib", "cat >/dev/null; exit 3");
  const Result bare = run({"step", "--from-json", report, "--plot", plot}, {}, {"LATENTKV_PYTHON=" + without});
  EXPECT_EQ(bare.exit_code, 1);
  EXPECT_THAT(bare.err, HasSubstr("LATENTKV_PYTHON=" + without + " cannot import matplotlib"));
  EXPECT_THAT(bare.err, HasSubstr("kept in " + report));
  EXPECT_FALSE(fs::exists(plot));
  // One that exits 0 without drawing is an error too, also where an earlier picture lies at the path:
  // it is not taken for this one's, and stays as it was (the picture is drawn beside it and renamed
  // onto it only once drawn), with nothing else left in the directory.
  { std::ofstream(plot) << "an earlier run's picture"; }
  const std::string silent = script("python-that-draws-nothing", "cat >/dev/null; exit 0");
  const Result nothing = run({"step", "--from-json", report, "--plot", plot}, {}, {"LATENTKV_PYTHON=" + silent});
  EXPECT_EQ(nothing.exit_code, 1);
  EXPECT_THAT(nothing.err, HasSubstr("exit 0 without writing " + plot));
  EXPECT_EQ(read_file(plot), "an earlier run's picture");
  for (const fs::directory_entry& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().filename().string().find(".partial-"), std::string::npos) << entry.path();
  }
}

// A drawing ended by a signal (Ctrl-C, a kill) leaves neither its partial picture nor the earlier
// one changed: the program removes the file it was drawing into before the signal ends it.
TEST_F(Cli, ASignalWhileDrawingLeavesNoPartialPicture) {
  const std::string report = saved_step();
  const std::string plot = path("p.svg");
  { std::ofstream(plot) << "an earlier run's picture"; }
  for (const char* signal_name : {"INT", "TERM"}) {
    SCOPED_TRACE(signal_name);
    // The drawing has begun (its file holds bytes) when the interpreter signals the program that ran it.
    const std::string python = script(std::string("python-signalled-") + signal_name,
                                      "cat >/dev/null; echo '<svg' > \"$3\"; kill -" + std::string(signal_name) + " $PPID");
    const Result r = run({"step", "--from-json", report, "--plot", plot}, {}, {"LATENTKV_PYTHON=" + python});
    EXPECT_NE(r.exit_code, 0);
    EXPECT_EQ(read_file(plot), "an earlier run's picture");
    for (const fs::directory_entry& entry : fs::directory_iterator(dir_)) {
      EXPECT_EQ(entry.path().filename().string().find(".partial-"), std::string::npos) << entry.path();
    }
  }
  // A kill of the program alone (not its process group) while the drawing goes on: the drawing is
  // ended too, before it could write its file after the program removed it.
  const std::string python = script("python-drawing-on", "cat >/dev/null; kill -TERM $PPID; sleep 1; echo '<svg' > \"$3\"");
  const Result r = run({"step", "--from-json", report, "--plot", plot}, {}, {"LATENTKV_PYTHON=" + python});
  EXPECT_NE(r.exit_code, 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // past the drawing's write, had it lived
  EXPECT_EQ(read_file(plot), "an earlier run's picture");
  for (const fs::directory_entry& entry : fs::directory_iterator(dir_)) {
    EXPECT_EQ(entry.path().filename().string().find(".partial-"), std::string::npos) << entry.path();
  }
}

TEST_F(Cli, NegativeSeedsAreRefused) {
  for (const std::string command : {"step", "demo", "bench"}) {
    for (const std::vector<std::string>& seed : std::vector<std::vector<std::string>>{{"--seed", "-1"}, {"--seed=-1"}}) {
      const Result r = run({command}, seed);
      EXPECT_EQ(r.exit_code, 2) << command;
      EXPECT_THAT(r.err, HasSubstr("error: " + command +
                                   ": --seed: -1 is not in 0 .. 18446744073709551615 (a seed is not negative)"));
      EXPECT_EQ(r.out, "");
    }
  }
  const Result big = run(kSmallStep, {"--seed", "18446744073709551615"});
  EXPECT_EQ(big.exit_code, 0) << big.err;
  EXPECT_THAT(big.out, HasSubstr("--seed 18446744073709551615"));
}

TEST_F(Cli, CheckRequestsAboveTheBatchIsRefused) {
  const Result r = run({"step", "--device", "cpu", "--batch", "2", "--check-requests", "5"});
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_THAT(r.err, HasSubstr("argument '--check-requests' = 5: expected at most the batch, 2 (--batch)"));
  const Result by_default = run({"step", "--device", "cpu", "--check-requests", "3"});
  EXPECT_THAT(by_default.err, HasSubstr("at most the batch, 2 (--batch, its default on the CPU)"));
  // Its own default follows a smaller batch.
  const Result small = run(kSmallStep);
  ASSERT_EQ(small.exit_code, 0) << small.err;
  EXPECT_THAT(small.out, HasSubstr("--check-requests 1 "));
  const Result bench = run({"bench", "--batch", "2", "--check-requests", "3"});
  EXPECT_EQ(bench.exit_code, 2);
  EXPECT_THAT(bench.err, HasSubstr("argument '--check-requests' = 3: expected at most the batch, 2 (--batch)"));
  const Result bench_default = run({"bench", "--check-requests", "5"});
  EXPECT_EQ(bench_default.exit_code, 2);
  EXPECT_THAT(bench_default.err, HasSubstr("expected at most the batch, 1 (--batch, its default)"));
}

TEST_F(Cli, ValuesNeverMeasuredAreNullInTheJson) {
  const nlohmann::json j = nlohmann::json::parse(read_file(saved_step()));
  for (const char* key : {"read_gbps", "copy_gbps", "matrix_tflops", "launch_us"}) {
    EXPECT_TRUE(j[key].is_null()) << key << " = " << j[key];
  }
  const nlohmann::json& fp8 = j["strategies"][0];
  ASSERT_TRUE(fp8["timed"].get<bool>());
  EXPECT_TRUE(fp8["step_us"].is_number());
  for (const char* key : {"floor_us", "gap", "speedup_vs_cast_full"}) EXPECT_TRUE(fp8[key].is_null()) << key;
  for (const nlohmann::json& op : fp8["ops"]) {
    EXPECT_TRUE(op["us"].is_number());
    EXPECT_TRUE(op["gbps"].is_number());
    for (const char* key : {"floor_us", "gap", "pct_of_copy", "pct_of_matrix", "launches"}) {
      EXPECT_TRUE(op[key].is_null()) << op["op"] << "." << key << " = " << op[key];
    }
  }
  // The table keeps its "-", and --from-json reads the nulls back.
  const Result again = run({"step", "--from-json", path("step.json"), "--json", path("again.json")});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(nlohmann::json::parse(read_file(path("again.json"))), j);
}

TEST_F(Cli, PoolBelowWhatTheRequestsTakeIsRefusedAsTheMessageSays) {
  for (const std::string pool : {"10", "200", "255"}) {
    const Result r = run({"step", "--device", "cpu", "--context", "100", "--layers", "1", "--pool", pool});
    EXPECT_EQ(r.exit_code, 2) << pool;
    EXPECT_THAT(r.err, HasSubstr("argument '--pool' = " + pool +
                                 ": expected >= 256 tokens (2 requests of 100 tokens take 2 pages of 64 each)"));
  }
  const std::vector<std::string> tiny = {"step",  "--device",   "cpu", "--context", "100", "--layers",
                                         "1",     "--warmup",   "0",   "--iters",   "1",   "--no-progress"};
  const Result least = run(tiny, {"--pool", "256"});
  ASSERT_EQ(least.exit_code, 0) << least.err;
  EXPECT_THAT(least.out, HasSubstr("--pool 256 "));
  EXPECT_THAT(run(tiny, {"--pool", "257"}).out, HasSubstr("--pool 320 "));  // rounded up to whole pages
  EXPECT_THAT(run(tiny).out, HasSubstr("--pool 512 "));  // the CPU default: 2 x B x L in whole pages
}

TEST_F(Cli, StepHelpListsWhatIsAccepted) {
  const Result r = run({"step", "--help"});
  ASSERT_EQ(r.exit_code, 0);
  std::string text;  // the help with its wrapping undone: one space for each run of spaces and line breaks
  std::istringstream words(r.out);
  for (std::string word; words >> word;) text += (text.empty() ? "" : " ") + word;
  EXPECT_THAT(text, HasSubstr("dense_/sparse_ followed by fp8, gather_cast or cast_full"));
  EXPECT_THAT(text, Not(HasSubstr("<backend>")));
  EXPECT_THAT(text, Not(HasSubstr("{false}")));
  EXPECT_THAT(text, HasSubstr("on the CPU twice the batch's pages"));
}

// Words the parser had no use for are given in the order typed: an option of the command typed
// before its name is said to go after it; an option it does not have is named as unknown.
TEST_F(Cli, ArgumentsNotExpectedAreSaidInTheOrderTyped) {
  const Result before = run({"--batch", "2", "step"});
  EXPECT_EQ(before.exit_code, 2);
  EXPECT_EQ(before.err.rfind("error: step: '--batch 2' came before the subcommand; options go after it: latentkv "
                             "step --batch 2 ...\n", 0), 0u) << before.err;
  const Result unknown = run({"demo", "--json", "x.json"});
  EXPECT_EQ(unknown.exit_code, 2);
  EXPECT_EQ(unknown.err.rfind("error: demo: unknown option '--json' (in '--json x.json')\n", 0), 0u) << unknown.err;
  const Result words = run({"info", "one", "two"});
  EXPECT_EQ(words.exit_code, 2);
  EXPECT_EQ(words.err.rfind("error: info: arguments not expected: one two\n", 0), 0u) << words.err;
  const Result separated = run({"step", "--", "--batch", "2"});
  EXPECT_EQ(separated.exit_code, 2);
  EXPECT_EQ(separated.err.rfind("error: step: '--batch 2' came after `--`, which ends the options: leave the `--` "
                                "out\n", 0), 0u) << separated.err;
  // A `--` later on the line does not move what came before the subcommand.
  const Result before_and_separated = run({"--batch", "2", "step", "--", "x"});
  EXPECT_EQ(before_and_separated.err.rfind("error: step: '--batch 2 x' came before the subcommand", 0), 0u)
      << before_and_separated.err;
}

TEST_F(Cli, ParserErrorsReadAsEveryOtherUsageError) {
  const Result config = run({"config", "--bogus"});
  EXPECT_EQ(config.exit_code, 2);
  EXPECT_EQ(config.err.rfind("error: config: unknown option '--bogus'\n", 0), 0u) << config.err;
  EXPECT_THAT(config.err, HasSubstr("(configuration rejected"));
  EXPECT_THAT(config.err, HasSubstr("`latentkv config --help`"));
  const Result missing = run({"step", "--tp"});
  EXPECT_EQ(missing.exit_code, 2);
  EXPECT_EQ(missing.err.rfind("error: step: --tp: expected a value", 0), 0u) << missing.err;
  EXPECT_THAT(missing.err, HasSubstr("`latentkv step --help`"));
  const Result top = run({"--bogus"});
  EXPECT_EQ(top.exit_code, 2);
  EXPECT_THAT(top.err, HasSubstr("error: unknown option '--bogus' before the subcommand (one of: step,"));
  for (const Result& r : {config, missing, top}) EXPECT_THAT(r.err, Not(HasSubstr("Run with --help")));
}

TEST_F(Cli, NoGpuIsTheSameUsageErrorInStepAndBench) {
  if (latentkv::detect_device().kind == latentkv::DeviceKind::kCuda) GTEST_SKIP() << "this machine has a GPU";
  const Result step = run({"step", "--device", "cuda"});
  const Result bench = run({"bench"});
  EXPECT_EQ(step.exit_code, 2) << step.err;
  EXPECT_EQ(bench.exit_code, 2) << bench.err;
  // Which of the two it is: a build without CUDA backends, or a machine without a usable GPU.
  const std::string why = latentkv::find_backend("cuda") == nullptr ? "this build has no CUDA backends"
                                                                      : "no CUDA GPU was found";
  EXPECT_THAT(bench.err, HasSubstr(why));
  EXPECT_THAT(step.err, HasSubstr("expected a CUDA GPU: " + why));
}

// CLI11's own list splitting would drop the empty entry and run the rest as if asked for.
TEST_F(Cli, AnEmptyEntryInANameListIsAnError) {
  const std::vector<std::vector<std::string>> cases = {{"bench", "--backends", "cuda,,cast_full"},
                                                       {"bench", "--backends", ""},
                                                       {"step", "--device", "cpu", "--strategies", "fp8,"},
                                                       {"step", "--device", "cpu", "--strategies", ",dense"}};
  for (const std::vector<std::string>& args : cases) {
    const Result r = run(args);
    EXPECT_EQ(r.exit_code, 2) << args.back();
    EXPECT_THAT(r.err, HasSubstr(args[args.size() - 2] + ": '" + args.back() + "' has an empty entry")) << r.err;
  }
}

TEST_F(Cli, BenchChecksWhatNeedsNoGpuFirst) {
  const Result names = run({"bench", "--backends", "cuda,foo"});
  EXPECT_EQ(names.exit_code, 2);
  EXPECT_THAT(names.err, HasSubstr("argument '--backends' = 'foo': expected one of cuda, gather_cast, cast_full"));
  EXPECT_THAT(names.err, Not(HasSubstr("GPU")));
  const Result lengths = run({"bench", "--context", "1", "--q-len", "2"});
  EXPECT_EQ(lengths.exit_code, 2);
  EXPECT_THAT(lengths.err, HasSubstr("argument '--context' = 1: expected >= --q-len (2)"));
  const Result prefill = run({"bench", "--op", "mla_prefill", "--context", "100", "--new-tokens", "200"});
  EXPECT_EQ(prefill.exit_code, 2);
  EXPECT_THAT(prefill.err, HasSubstr("argument '--new-tokens' = 200: expected at most --context (100)"));
  // The default new tokens (4096) over a shorter --context: the message says which value was not typed.
  const Result by_default = run({"bench", "--op", "mla_prefill", "--context", "2048"});
  EXPECT_EQ(by_default.exit_code, 2);
  EXPECT_THAT(by_default.err, HasSubstr("argument '--new-tokens' = 4096 (its default): expected at most --context "
                                        "(2048): give --new-tokens, or a larger --context"));
}

TEST_F(Cli, FromJsonRefusesAnInconsistentReportNamingTheField) {
  const nlohmann::json original = nlohmann::json::parse(read_file(saved_step()));
  const auto refused = [&](const std::string& name, const std::function<void(nlohmann::json&)>& change,
                           const std::string& want) {
    nlohmann::json j = original;
    change(j);
    std::ofstream(path(name)) << j.dump();
    const Result r = run({"step", "--from-json", path(name)});
    EXPECT_EQ(r.exit_code, 2) << name;
    EXPECT_THAT(r.err, HasSubstr("argument '--from-json' = " + path(name)));
    EXPECT_THAT(r.err, HasSubstr(want)) << name;
    EXPECT_EQ(r.out, "") << name;
  };
  refused("batch.json", [](nlohmann::json& j) { j["shape"]["batch"] = 0; },
          "shape.batch = 0: expected an integer in 1 .. 4096");
  refused("layers.json", [](nlohmann::json& j) { j["shape"]["layers"] = -2; }, "shape.layers = -2: expected");
  refused("time.json", [](nlohmann::json& j) { j["strategies"][0]["ops"][1]["us"] = -5.0; },
          "strategies[0].ops[1].us = -5.0: expected >= 0");
  refused("step.json", [](nlohmann::json& j) { j["strategies"][0]["step_us"] = -1.0; },
          "strategies[0].step_us = -1.0: expected >= 0");
  refused("none.json", [](nlohmann::json& j) { j["strategies"] = nlohmann::json::array(); },
          "strategies = []: expected a list of one or more strategies");
  refused("ops.json", [](nlohmann::json& j) { j["strategies"][0]["ops"].erase(1); }, "strategies[0].ops = append:");
  // A file without an end is read no further than a report could be long.
  if (fs::exists("/dev/zero")) {
    const Result endless = run({"step", "--from-json", "/dev/zero"});
    EXPECT_EQ(endless.exit_code, 2);
    EXPECT_THAT(endless.err,
                HasSubstr("argument '--from-json' = /dev/zero: expected a saved report of at most 16777216 bytes"));
  }
}

TEST_F(Cli, DemoSaysWhatTheTopkPaddedAndOneReadPerDecode) {
  const Result full = run({"demo", "--context", "3000"});
  ASSERT_EQ(full.exit_code, 0) << full.err;
  EXPECT_THAT(full.out, HasSubstr("top-2048 of 3000 per request (4096 slots)"));
  EXPECT_THAT(full.out, Not(HasSubstr("padded")));
  // The sparse decode's read on its step line is the one the summary gives.
  const std::size_t line = full.out.find("sparse_mla_decode");
  ASSERT_NE(line, std::string::npos);
  const std::size_t read = full.out.find("read ", line);
  const double step_mb = std::stod(full.out.substr(read + 5));
  const std::size_t summary = full.out.find("the sparse decode read ");
  ASSERT_NE(summary, std::string::npos) << full.out;
  EXPECT_DOUBLE_EQ(std::stod(full.out.substr(summary + 23)), step_mb);

  const Result short_rows = run({"demo", "--context", "1000"});
  ASSERT_EQ(short_rows.exit_code, 0) << short_rows.err;
  EXPECT_THAT(short_rows.out, HasSubstr("(2000 slots, 2096 padded with -1)"));
}

TEST_F(Cli, InfoListsTheDeviceThePresetsTheCacheFormatsAndEveryBackend) {
  const Result info = run({"info"});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  const bool gpu = latentkv::detect_device().kind == latentkv::DeviceKind::kCuda;
  EXPECT_THAT(info.out, HasSubstr(gpu ? "device: " : "device: cpu"));
  EXPECT_THAT(info.out, HasSubstr("  glm5           78 layers,  64 heads, d_qk 576, d_v 512"));
  EXPECT_THAT(info.out, HasSubstr("  deepseek-v3.2  61 layers, 128 heads"));
  EXPECT_THAT(info.out, HasSubstr("fp8_e4m3 656 B/token, bf16 1152 B/token, indexer 132 B/token"));
  for (const latentkv::Backend* b : latentkv::registered_backends()) {
    EXPECT_THAT(info.out, HasSubstr("  " + std::string(b->name()) + " ")) << b->name();
  }
}

TEST_F(Cli, ConfigurationThatCannotRunExitsTwo) {
  for (const Result& r : {run({"config", "--tp", "3"}), run({"config"}, {}, {"LATENTKV_Q_LEN=5"})}) {
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_THAT(r.err, HasSubstr("error: config: "));
    EXPECT_THAT(r.err, HasSubstr("(configuration rejected before any kernel ran"));
    EXPECT_EQ(r.out, "");
  }
}

// Without sizes the CPU step runs its small default (docs/step.md: B 2, L 3000, 4 layers, 12032
// slots a layer, 1 warm-up + 3 timed) and says so; any size given is "as asked". Times are ms.
TEST_F(Cli, CpuStepDefaultsAreTheSmallSizeAndSaySo) {
  const Result defaults = run({"step", "--device", "cpu", "--strategies", "dense", "--warmup", "0", "--iters", "1",
                               "--no-progress", "--json", path("defaults.json")});
  ASSERT_EQ(defaults.exit_code, 0) << defaults.err;
  EXPECT_THAT(defaults.out, HasSubstr("note: --device cpu: CPU reference (float64), small default: batch 2, "
                                      "context 3000, 4 of 78 layers; times are host wall-clock"));
  EXPECT_THAT(defaults.out, HasSubstr("--batch 2 --context 3000 --q-len 1 --pool 12032 --page-size 64 --layers 4 "));
  EXPECT_THAT(defaults.out, HasSubstr("device: cpu (the float64 reference backend)"));
  EXPECT_THAT(defaults.out, HasSubstr("step ms"));
  const nlohmann::json j = nlohmann::json::parse(read_file(path("defaults.json")));
  EXPECT_TRUE(j["cpu_reference"].get<bool>());
  EXPECT_EQ(j["device"], "cpu (the float64 reference backend)");

  const Result layers = run({"step", "--device", "cpu", "--layers", "1", "--strategies", "dense", "--warmup", "0",
                             "--iters", "1", "--no-progress"});
  ASSERT_EQ(layers.exit_code, 0) << layers.err;
  EXPECT_THAT(layers.out, HasSubstr("size as asked: batch 2, context 3000, 1 of 78 layers"));

  // The replays' defaults on the CPU, and the repro line gives both as run.
  const Result replays = run({"step", "--device", "cpu", "--layers", "1", "--batch", "1", "--context", "300",
                              "--no-progress"});
  ASSERT_EQ(replays.exit_code, 0) << replays.err;
  EXPECT_THAT(replays.out, HasSubstr("1 warm-up + 3 timed"));
  EXPECT_THAT(replays.out, HasSubstr(" --warmup 1 --iters 3 "));
  EXPECT_THAT(run(kSmallStep).out, HasSubstr(" --warmup 0 --iters 1 "));
}

// Each bound is accepted at its value and refused one past it.
TEST_F(Cli, StepBoundsAreInclusive) {
  const std::vector<std::string> step = {"step", "--device", "cpu", "--batch", "1", "--warmup", "0",
                                         "--iters", "1", "--no-progress", "--strategies", "dense"};
  // Every layer of glm5 (tiny, so that 78 layers run at once).
  const Result all = run(step, {"--layers", "78", "--context", "1", "--page-size", "1"});
  EXPECT_EQ(all.exit_code, 0) << all.err;
  EXPECT_THAT(all.out, HasSubstr("78 of 78 layers"));
  EXPECT_THAT(run(step, {"--layers", "79"}).err,
              HasSubstr("argument '--layers' = 79: expected 1 .. 78 (the layers of glm5)"));
  // A context of q_len tokens.
  const Result least = run(step, {"--layers", "1", "--context", "2", "--q-len", "2"});
  EXPECT_EQ(least.exit_code, 0) << least.err;
  EXPECT_THAT(run(step, {"--layers", "1", "--context", "1", "--q-len", "2"}).err,
              HasSubstr("argument '--context' = 1: expected >= q_len 2"));
  // glm5's max positions passes the context's check (the pool's is the one that refuses it).
  const Result most = run(step, {"--layers", "1", "--context", "202752", "--pool", "1"});
  EXPECT_EQ(most.exit_code, 2);
  EXPECT_THAT(most.err, HasSubstr("argument '--pool' = 1: expected >= 202752 tokens"));
  EXPECT_THAT(run(step, {"--layers", "1", "--context", "202753"}).err,
              HasSubstr("argument '--context' = 202753: expected <= 202752 (max positions of glm5)"));
  // The largest pool of whole 64-token pages below 2^31 is no usage error (only too large for the host).
  const Result pool = run(step, {"--layers", "1", "--context", "300", "--pool", "2147483584"});
  EXPECT_EQ(pool.exit_code, 1) << pool.err;
  EXPECT_THAT(pool.err, HasSubstr("of host memory"));
  // A page of 2^30 tokens fills a block-table row; one more token is refused by step, bench and demo.
  const std::vector<std::vector<std::string>> commands = {step, {"bench"}, {"demo"}};
  for (const std::vector<std::string>& command : commands) {
    const Result page = run(command, {"--page-size", "1073741825"});
    EXPECT_EQ(page.exit_code, 2) << command[0] << ": " << page.err;
    EXPECT_THAT(page.err, HasSubstr("--page-size: 1073741825 is not in 1 .. 1073741824 (a block-table row holds at "
                                    "most 2^30 tokens)"))
        << command[0];
  }
  // As many requests checked as the batch holds.
  const Result checked = run(step, {"--layers", "1", "--context", "300", "--check-requests", "1"});
  EXPECT_EQ(checked.exit_code, 0) << checked.err;
  EXPECT_THAT(checked.out, HasSubstr("--check-requests 1 "));
}

TEST_F(Cli, CpuStepSaysWhatItRunsAndWhatItLeavesOut) {
  const Result faults = run(kSmallStep, {"--fault-checks"});
  ASSERT_EQ(faults.exit_code, 0) << faults.err;
  EXPECT_THAT(faults.out, HasSubstr("note: --fault-checks: the CPU reference checks every value anyway"));
  EXPECT_THAT(faults.out, HasSubstr(" --fault-checks "));
  // The default list at L 300: fp8 is dense by the rule, and dense is left out without a note.
  const Result defaults = run(kSmallStep);
  ASSERT_EQ(defaults.exit_code, 0) << defaults.err;
  EXPECT_THAT(defaults.out, Not(HasSubstr("left out")));
  EXPECT_THAT(defaults.out, HasSubstr("--strategies fp8,sparse "));
  // Asked for, it is named; a CUDA baseline shows as unsupported and the run still succeeds.
  const Result asked = run(kSmallStep, {"--strategies", "fp8,dense,cast_full"});
  ASSERT_EQ(asked.exit_code, 0) << asked.err;
  EXPECT_THAT(asked.out, HasSubstr("note: dense runs what fp8 runs here (the model's rule picks dense at this "
                                   "context): left out"));
  EXPECT_THAT(asked.out, HasSubstr("unsupported: cast_full is a CUDA baseline; the CPU run has the reference "
                                   "backend only"));
}

TEST_F(Cli, FromJsonTakesSvgPlotsAndNoProgress) {
  const std::string report = saved_step();
  const Result quiet = run({"step", "--from-json", report, "--no-progress"});
  EXPECT_EQ(quiet.exit_code, 0) << quiet.err;
  EXPECT_THAT(quiet.out, HasSubstr("repro: "));
  // An .svg name passes the name's check: what refuses it here is the interpreter chosen.
  const Result svg = run({"step", "--from-json", report, "--plot", path("p.svg")}, {},
                         {"LATENTKV_PYTHON=/nonexistent/python3"});
  EXPECT_EQ(svg.exit_code, 2);
  EXPECT_THAT(svg.err, HasSubstr("LATENTKV_PYTHON=/nonexistent/python3 cannot be run"));
  EXPECT_THAT(svg.err, Not(HasSubstr(".png or .svg")));
  // ".png" alone is a name ending in .png (a hidden file's).
  const Result bare = run({"step", "--from-json", report, "--plot", ".png"}, {}, {"LATENTKV_PYTHON=/nonexistent/python3"});
  EXPECT_EQ(bare.exit_code, 2);
  EXPECT_THAT(bare.err, HasSubstr("LATENTKV_PYTHON=/nonexistent/python3 cannot be run"));
  const Result other = run({"step", "--from-json", report, "--plot", path("p.jpg")});
  EXPECT_EQ(other.exit_code, 2);
  EXPECT_THAT(other.err, HasSubstr("expected a file name ending in .png or .svg"));
}

TEST_F(Cli, DemoDefaultsAndTheDenseReadItComparesWith) {
  const Result r = run({"demo"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_THAT(r.out, HasSubstr("one layer of glm5 at tp 8 (8 heads here, 32 indexer heads, top-2048), 2 requests x "
                               "3000 tokens, page size 64, seed 1"));
  // 6000 cached tokens x 656 B + q (2 x 8 heads x 576 x 2 B) + the page table (2 x 47) and lengths (2) x 4 B.
  EXPECT_THAT(r.out, HasSubstr("a dense decode would read 3.95 MB for this step"));
  const Result tp = run({"demo", "--tp", "4", "--context", "100"});
  ASSERT_EQ(tp.exit_code, 0) << tp.err;
  EXPECT_THAT(tp.out, HasSubstr("one layer of glm5 at tp 4 (16 heads here,"));
}

TEST_F(Cli, InfoGivesEachPresetsIndexerAndTopk) {
  const Result info = run({"info"});
  ASSERT_EQ(info.exit_code, 0) << info.err;
  EXPECT_THAT(info.out, HasSubstr("  glm5           78 layers,  64 heads, d_qk 576, d_v 512, scale "));
  EXPECT_THAT(info.out, HasSubstr(", indexer 32 x 128, topk 2048\n"));
}

TEST_F(Cli, AMissingOrUnknownSubcommandIsNamed) {
  const Result none = run({});
  EXPECT_EQ(none.exit_code, 2);
  EXPECT_THAT(none.err, HasSubstr("error: a subcommand is required (one of: step, demo, config, info, bench)"));
  const Result dash = run({"-x"});
  EXPECT_EQ(dash.exit_code, 2);
  EXPECT_THAT(dash.err, HasSubstr("error: unknown option '-x' before the subcommand"));
}

}  // namespace
