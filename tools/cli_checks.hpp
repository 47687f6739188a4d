// tools/cli_checks.hpp - checks every subcommand makes of its command line and of the machine
// before it runs: integer options against their real bounds, output files that must be writable,
// the host memory a run needs. Each failure names the option, the value and what was expected.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <ostream>
#include <string>
#include <vector>

#include "commands.hpp"
#include "latentkv/error.hpp"
#include "latentkv/model.hpp"

namespace latentkv::tools {

inline constexpr std::int64_t kIntMax = std::numeric_limits<int>::max();
inline constexpr std::int64_t kMaxSlots = std::numeric_limits<std::int32_t>::max();  // slots are int32
inline constexpr const char* kPageSizeWhy = " (a block-table row holds at most 2^30 tokens)";  // for --page-size

// CLI11 takes the word after an option as its value, whatever it is: `--model --tp 8` would give
// --model the value "--tp" and leave "8" over, to be refused as a stray word. Every option of every
// subcommand that takes a value is given this check ahead of its own (main.cpp, once the subcommands
// are added; the integer checks also make it first): "--model: no value was given (the word after
// it, '--tp', is an option)", not "--tp not in {...}". (A file whose name starts with "--" is named
// ./--name.)
std::string option_as_value_problem(const std::string& text);
void refuse_options_as_values(CLI::App& app);

// A CLI11 check that the value is a decimal integer in [lo, hi]; its failures read
// "--batch: 'abc' is not an integer" or "--context: 0 is not in 1 .. 2147483647" (+ `why`). It
// rewrites a value that passes in plain decimal, so it is registered with ->transform(), not
// ->check() (which hands it a copy): CLI11 alone would read "010" as octal 8.
CLI::Validator integer_in(std::int64_t lo, std::int64_t hi, const std::string& why = "");

// A list option of comma-separated names (--backends, --strategies), read into `names` (which holds
// the default until the option is given; given more than once, the entries add up). CLI11's own
// splitting drops an empty entry without a word, so that "cuda,,cast_full" would run two backends
// as if that were what was asked: here the text is checked whole ("--backends: 'cuda,,cast_full'
// has an empty entry") and then split.
CLI::Option* add_name_list(CLI::App& app, const std::string& flag, std::vector<std::string>& names,
                           const std::string& help);

// The items with `separator` between them: "a,b,c".
std::string join(const std::vector<std::string>& items, const std::string& separator = ",");

// The same check for a seed, a decimal integer in 0 .. 2^64 - 1: "--seed: -1 is not in 0 ..
// 18446744073709551615" (CLI11 alone would wrap -1 around to 2^64 - 1); also a ->transform().
CLI::Validator seed_in_range();

// Throws latentkv::Error unless `path` can be written as `option`'s output file: not "-" nor a word
// starting with '-' (the option CLI11 took as a missing file name), and an existing file,
// FIFO or character device that is writable (not a directory, block device or socket), or a new name
// in a directory that takes it (tried by creating the file and removing it again). Leaves nothing
// behind.
void check_output_path(const std::string& command, const std::string& option, const std::string& path);

// STDOUT_FILENO or STDERR_FILENO when `path` names this process's standard output or error (a link
// such as /dev/stdout, or the file the shell sent it to), else -1.
int standard_stream_named(const std::string& path);

// Runs `/bin/sh -c command` with `input` on its standard input and waits for it: its wait status, -1
// when it could not be started. A signal that ends this process while it runs (OutputFile's
// handlers) kills it and waits for it before removing the temporary files, so that what it writes
// into one (a drawing) cannot outlive the removal.
int run_shell_with_input(const std::string& command, const std::string& input);

// An output file written whole or not at all. A regular file (or a new name) is written as a
// temporary file beside the one `path` names once its links are followed, and renamed onto it by
// commit(): a run that fails to write (a full disk) leaves no partial file and an earlier one in
// place. A FIFO or character device is written as it is, and the process's own standard output or
// error (/dev/stdout, also when the shell sent it to a file) through its descriptor, after what was
// printed there. Without commit() the temporary file is removed, also by SIGINT, SIGTERM, SIGHUP or
// SIGQUIT ending the process (handlers installed by the first such file or run_shell_with_input()).
// `suffix_length`: the last characters of the name that the temporary one keeps too (a plot's
// ".png", which tells its writer the format). Failures throw latentkv::Error naming `option`, with
// the system's reason.
class OutputFile {
 public:
  OutputFile(std::string command, std::string option, std::string path, int suffix_length = 0);
  OutputFile(const OutputFile&) = delete;
  OutputFile& operator=(const OutputFile&) = delete;
  ~OutputFile();
  const std::string& write_path() const { return write_path_; }  // where the text goes until commit()
  void write(const std::string& text);                            // the whole text to write_path()
  void commit();

 private:
  [[noreturn]] void fail(const std::string& why) const;
  std::string command_, option_, path_, target_, write_path_;
  int own_fd_ = -1;        // STDOUT_FILENO or STDERR_FILENO when `path` names it
  int pending_slot_ = -1;  // where a signal that ends the process finds the temporary file to remove
  bool committed_ = false;
};

// Writes `text` to `path` through an OutputFile.
void write_output_file(const std::string& command, const std::string& option, const std::string& path,
                       const std::string& text);

// The preset named by --model split over --tp GPUs; throws latentkv::Error(command, "--model" or
// "--tp", ...) when there is no such preset or tp does not divide its attention heads.
ModelShard shard_from_flags(const std::string& command, const std::string& model, int tp);

// Throws latentkv::Error(command, "--context", ...) when `context` is past the model's max positions.
void check_context_in_model(const std::string& command, std::int64_t context, const ModelPreset& model);

// The most tokens a pool of whole pages of `page_size` holds with int32 slots.
constexpr std::int64_t max_pool_tokens(int page_size) { return kMaxSlots / page_size * page_size; }

// The slots `batch` requests of `context` tokens take in whole pages of `page_size`; throws
// latentkv::Error(command, ...) when that is more than a pool of int32 slots holds.
std::int64_t pool_tokens_needed(const std::string& command, int batch, std::int64_t context, int page_size);

// Throws latentkv::Error(command, "--pool", ...) unless `pool` tokens, rounded up to whole pages of
// `page_size`, stay within int32 slots and hold pool_tokens_needed(command, batch, context,
// page_size) (which throws first when nothing could).
void check_pool(const std::string& command, std::int64_t pool, int batch, std::int64_t context, int page_size);

// "12.3 GB"
std::string gigabytes(double bytes);

// Why there is no GPU to run on, where detect_device() says the CPU: "this build has no CUDA backends
// (it was built without nvcc)", or "no CUDA GPU was found (or its driver cannot run this build's
// CUDA runtime)".
std::string why_no_gpu();

// Throws latentkv::Error(command, ...) before anything is allocated when `needed` bytes of host
// memory (`what` says of what) exceed what this process can still get: the machine's available
// memory, and the address-space limit (ulimit -v) when one is set. `lower` names the options.
void check_host_memory(const std::string& command, double needed, const std::string& what, const std::string& lower);

// `message` with its control bytes shown as \xNN, as quoted_value shows them: every error the
// program prints goes through it, so that a terminal escape sequence in a word typed (an option's
// value, a path) is shown rather than obeyed.
std::string controls_escaped(const std::string& message);

// Runs `f`; a latentkv::Error from it is a usage error: printed (to `err` where one is given, else to
// standard error), then exit code 2 (kExitUsage) through CLI::RuntimeError. For what is wrong with
// the command line, checked before anything runs.
template <typename F>
auto or_usage_error(F&& f, std::ostream* err = nullptr) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    if (err != nullptr) {
      *err << "error: " << controls_escaped(e.what()) << "\n";
      err->flush();
    } else {
      std::fprintf(stderr, "error: %s\n", controls_escaped(e.what()).c_str());
    }
    throw CLI::RuntimeError(kExitUsage);
  }
}

}  // namespace latentkv::tools
