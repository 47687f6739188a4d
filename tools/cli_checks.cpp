#include "cli_checks.hpp"

#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <sstream>
#include <type_traits>

#include "latentkv/backend.hpp"

namespace latentkv::tools {
namespace {

// MemAvailable of /proc/meminfo, else the free pages sysconf counts; 0 when neither says.
double available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  for (std::string line; std::getline(meminfo, line);) {
    std::istringstream fields(line);
    std::string key;
    double kib = 0;
    if (fields >> key >> kib && key == "MemAvailable:") return kib * 1024.0;
  }
  const long pages = sysconf(_SC_AVPHYS_PAGES), page_bytes = sysconf(_SC_PAGESIZE);
  return pages > 0 && page_bytes > 0 ? static_cast<double>(pages) * static_cast<double>(page_bytes) : 0.0;
}

// What the address-space limit (ulimit -v) leaves this process: the limit less what it maps now.
// Infinite without a limit.
double address_space_left_bytes() {
  rlimit limit{};
  if (getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) {
    return std::numeric_limits<double>::infinity();
  }
  double mapped_pages = 0;
  std::ifstream("/proc/self/statm") >> mapped_pages;
  const double mapped = mapped_pages * static_cast<double>(sysconf(_SC_PAGESIZE));
  return std::max(0.0, static_cast<double>(limit.rlim_cur) - mapped);
}

}  // namespace

namespace {

// Why `text` is not a decimal integer of T within [lo, hi] ("" when it is), `bounds` and `why` said
// after a value out of them. A minus sign before an unsigned T is parsed past, so that "-1" is
// called out of bounds rather than wrapped around as CLI11 alone would. A value that passes is
// rewritten in plain decimal ("010" -> "10", "+8" -> "8"): CLI11 converts the text itself, and would
// read a leading zero as octal.
template <typename T>
std::string integer_problem(std::string& text, T lo, T hi, const std::string& bounds, const std::string& why) {
  const char* first = text.data();
  const char* last = first + text.size();
  // A word that is not a number is echoed as `latentkv config` echoes a value (quoted_value: control
  // bytes escaped, cut at 80 characters); a number out of bounds, all digits, as typed, cut alike.
  const std::string shown = quoted_value(text);
  if (std::string problem = option_as_value_problem(text); !problem.empty()) return problem;
  if (text.starts_with("+-")) return shown + " is not an integer";  // from_chars would take the '-' after the '+'
  const bool negative = first != last && *first == '-';
  if (first != last && (*first == '+' || (negative && std::is_unsigned_v<T>))) ++first;
  T value{};
  const auto [end, ec] = std::from_chars(first, last, value);
  const bool out_of_range = ec == std::errc::result_out_of_range;
  if (first == last || end != last || (ec != std::errc() && !out_of_range)) return shown + " is not an integer";
  if (out_of_range || (std::is_unsigned_v<T> && negative) || value < lo || value > hi) {
    return (text.size() > 80 ? text.substr(0, 80) + "..." : text) + " is not in " + bounds + why;
  }
  text = std::to_string(value);
  return "";
}

// The file a path names once its links are followed (it need not exist).
std::filesystem::path link_target(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::path file = path;
  for (int hops = 0; hops < 40 && fs::is_symlink(fs::symlink_status(file, ec)); ++hops) {
    const fs::path target = fs::read_symlink(file, ec);
    if (ec) break;
    file = target.is_relative() ? file.parent_path() / target : target;
  }
  return file;
}

}  // namespace

std::string option_as_value_problem(const std::string& text) {
  if (!text.starts_with("--") || text.size() == 2) return "";
  return "no value was given (the word after it, " + quoted_value(text) + ", is an option)";
}

void refuse_options_as_values(CLI::App& app) {
  for (CLI::App* command : app.get_subcommands([](CLI::App*) { return true; })) {
    for (CLI::Option* option : command->get_options()) {
      if (option->get_type_size_max() == 0 || option->get_positional()) continue;  // a flag takes no value
      // First of the option's checks (transform() puts it before them; it changes nothing), so that
      // `--op --batch 4` says no value was given rather than that --batch is not an op.
      option->transform(CLI::Validator(option_as_value_problem, "").non_modifying());
    }
  }
}

CLI::Validator integer_in(std::int64_t lo, std::int64_t hi, const std::string& why) {
  const std::string bounds = std::to_string(lo) + " .. " + std::to_string(hi);
  return CLI::Validator(
      [lo, hi, why, bounds](std::string& text) { return integer_problem(text, lo, hi, bounds, why); },
      "[" + bounds + "]");
}

CLI::Option* add_name_list(CLI::App& app, const std::string& flag, std::vector<std::string>& names,
                           const std::string& help) {
  const CLI::Validator single_commas(
      [](std::string& text) -> std::string {
        const bool empty_entry =
            text.empty() || text.front() == ',' || text.back() == ',' || text.find(",,") != std::string::npos;
        return empty_entry ? "'" + text + "' has an empty entry (names separated by single commas)" : "";
      },
      "NAME[,NAME...]");
  const std::string defaults = join(names);
  return app
      .add_option_function<std::vector<std::string>>(
          flag,
          [&names](const std::vector<std::string>& texts) {
            names.clear();
            for (const std::string& text : texts) {
              for (std::size_t begin = 0, end = 0; end != std::string::npos; begin = end + 1) {
                end = text.find(',', begin);
                names.push_back(text.substr(begin, end == std::string::npos ? end : end - begin));
              }
            }
          },
          help)
      ->check(single_commas)
      ->default_str(defaults);
}

std::string join(const std::vector<std::string>& items, const std::string& separator) {
  std::string s;
  for (std::size_t i = 0; i < items.size(); ++i) s += (i == 0 ? "" : separator) + items[i];
  return s;
}

CLI::Validator seed_in_range() {
  constexpr std::uint64_t kMost = std::numeric_limits<std::uint64_t>::max();
  const std::string bounds = "0 .. " + std::to_string(kMost);
  return CLI::Validator(
      [bounds](std::string& text) {
        const bool negative = !text.empty() && text.front() == '-';
        return integer_problem<std::uint64_t>(text, 0, kMost, bounds, negative ? " (a seed is not negative)" : "");
      },
      "[" + bounds + "]");
}

std::string controls_escaped(const std::string& message) {
  std::string out;
  for (const char ch : message) {
    const auto byte = static_cast<unsigned char>(ch);
    if (byte < 0x20 || byte == 0x7F) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += {'\\', 'x', kHex[byte >> 4], kHex[byte & 0xF]};
    } else {
      out += ch;
    }
  }
  return out;
}

void check_output_path(const std::string& command, const std::string& option, const std::string& path) {
  namespace fs = std::filesystem;
  // CLI11 takes the word after the option as its value, whatever it is: `--json --no-progress`
  // would write a file named --no-progress and drop the option.
  if (path == "-") {
    throw Error(command, option, path, "a file name ('-' is no standard output here: the table is printed there)");
  }
  if (path.starts_with("-")) {
    throw Error(command, option, path,
                "a file name, not an option (no file name was given after " + option +
                    "; to name a file that starts with '-', write ./" + path + ")");
  }
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec == std::errc::too_many_symbolic_link_levels) {
    throw Error(command, option, path, "a file, or a link that ends at one (its links go round in a loop)");
  }
  if (fs::exists(status)) {
    if (fs::is_directory(status)) throw Error(command, option, path, "a file name (this is a directory)");
    // A FIFO or a character device (/dev/stdout, /dev/null) takes the text as a file does; a disk
    // would be overwritten, and a socket cannot be opened.
    if (fs::is_block_file(status) || fs::is_socket(status)) {
      throw Error(command, option, path,
                  std::string("a file, FIFO or character device (this is a ") +
                      (fs::is_socket(status) ? "socket)" : "block device)"));
    }
    if (access(path.c_str(), W_OK) != 0) {
      throw Error(command, option, path, std::string("a writable file (") + std::strerror(errno) + ")");
    }
    return;
  }
  // A new name, or a link to one (the file is then created where the link points).
  const fs::path file = link_target(path);
  fs::path dir = file.parent_path();
  if (dir.empty()) dir = ".";
  if (!fs::is_directory(fs::status(dir, ec))) {
    throw Error(command, option, path,
                "a file in an existing directory (" + dir.string() +
                    (fs::exists(fs::status(dir, ec)) ? " is not a directory)" : " does not exist)"));
  }
  if (access(dir.c_str(), W_OK | X_OK) != 0) {
    throw Error(command, option, path,
                "a file in a writable directory (" + dir.string() + ": " + std::strerror(errno) + ")");
  }
  // access() answers yes to root in directories that take no new files (/proc, /sys): the name is
  // created, then removed again.
  const int fd = open(file.c_str(), O_WRONLY | O_CREAT | O_EXCL, 0644);
  if (fd < 0) {
    throw Error(command, option, path,
                "a file in a directory that takes new files (creating " + file.string() + ": " + std::strerror(errno) +
                    ")");
  }
  close(fd);
  unlink(file.c_str());
}

int standard_stream_named(const std::string& path) {
  // stat() lets the kernel follow the links: those of /dev/stdout end in /proc/self/fd, whose targets
  // (pipe:[N]) are no paths that link_target could follow.
  struct stat named {};
  if (stat(path.c_str(), &named) != 0) return -1;
  for (const int fd : {STDOUT_FILENO, STDERR_FILENO}) {
    struct stat open_file {};
    if (fstat(fd, &open_file) == 0 && open_file.st_dev == named.st_dev && open_file.st_ino == named.st_ino) return fd;
  }
  return -1;
}

namespace {

// The temporary files of the OutputFiles alive now, removed by a signal that ends the process
// (Ctrl-C or a kill while a picture is drawn) before it ends it as it would have: a handler may only
// unlink paths it finds ready, so each sits in a fixed slot, published once written. The process
// run_shell_with_input() waits for (the drawing) is ended and waited for first, so that it cannot
// write its file again once the file is removed.
struct PendingFile {
  std::atomic<bool> ready{false};
  std::array<char, 4096> path{};
};
std::array<PendingFile, 8> pending_files;
std::mutex pending_slots;  // taking and freeing slots (not the handler, which only reads them)
std::atomic<pid_t> running_child{0};

constexpr std::array kRemovalSignals = {SIGINT, SIGTERM, SIGHUP, SIGQUIT};

extern "C" void remove_pending_files(int signal_number) {
  if (const pid_t child = running_child.load(); child > 0) {
    kill(child, SIGKILL);
    while (waitpid(child, nullptr, 0) < 0 && errno == EINTR) {
    }
  }
  for (PendingFile& file : pending_files) {
    if (file.ready.load(std::memory_order_acquire)) unlink(file.path.data());
  }
  struct sigaction fallback {};
  fallback.sa_handler = SIG_DFL;
  sigemptyset(&fallback.sa_mask);
  sigaction(signal_number, &fallback, nullptr);
  raise(signal_number);
}

// Handlers for the signals that end a process from outside, once; a signal the process was started
// ignoring (nohup's SIGHUP) stays ignored.
void install_removal_handlers() {
  static std::once_flag once;
  std::call_once(once, [] {
    for (const int signal_number : kRemovalSignals) {
      struct sigaction current {};
      if (sigaction(signal_number, nullptr, &current) != 0 || current.sa_handler == SIG_IGN) continue;
      struct sigaction removal {};
      removal.sa_handler = remove_pending_files;
      sigemptyset(&removal.sa_mask);
      sigaction(signal_number, &removal, nullptr);
    }
  });
}

// A slot holding `path` (-1 when all are taken or the path is too long: the file is then only
// removed by the destructor, as before a signal).
int hold_pending_file(const std::string& path) {
  install_removal_handlers();
  const std::lock_guard lock(pending_slots);
  for (std::size_t i = 0; i < pending_files.size(); ++i) {
    PendingFile& file = pending_files[i];
    if (file.ready.load(std::memory_order_relaxed) || path.size() >= file.path.size()) continue;
    std::memcpy(file.path.data(), path.c_str(), path.size() + 1);
    file.ready.store(true, std::memory_order_release);
    return static_cast<int>(i);
  }
  return -1;
}

void release_pending_file(int slot) {
  if (slot < 0) return;
  const std::lock_guard lock(pending_slots);
  pending_files[static_cast<std::size_t>(slot)].ready.store(false, std::memory_order_release);
}

// Writes `text` to `fd` whole: 0, or the errno of the write that failed (EIO for one that wrote
// nothing).
int write_whole(int fd, const std::string& text) {
  for (std::size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return n < 0 ? errno : EIO;
    done += static_cast<std::size_t>(n);
  }
  return 0;
}

// write_whole() with SIGPIPE held back: a reader that exits without reading is that reader's
// failure, not a reason for this process to die.
void write_to_pipe(int fd, const std::string& text) {
  sigset_t pipe_signal, before;
  sigemptyset(&pipe_signal);
  sigaddset(&pipe_signal, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_signal, &before);
  if (write_whole(fd, text) == EPIPE && !sigismember(&before, SIGPIPE)) {
    const timespec now{};
    sigtimedwait(&pipe_signal, nullptr, &now);  // the SIGPIPE the write raised, taken back
  }
  pthread_sigmask(SIG_SETMASK, &before, nullptr);
}

}  // namespace

int run_shell_with_input(const std::string& command, const std::string& input) {
  install_removal_handlers();
  int ends[2];
  if (pipe2(ends, O_CLOEXEC) != 0) return -1;
  // The signals that end this process are held back until the child is recorded (so that one
  // arriving now still ends it); the child starts with this thread's mask as it was.
  sigset_t removal, before;
  sigemptyset(&removal);
  for (const int signal_number : kRemovalSignals) sigaddset(&removal, signal_number);
  pthread_sigmask(SIG_BLOCK, &removal, &before);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, ends[0], STDIN_FILENO);  // the copy keeps no FD_CLOEXEC
  posix_spawnattr_t attributes;
  posix_spawnattr_init(&attributes);
  posix_spawnattr_setsigmask(&attributes, &before);
  posix_spawnattr_setflags(&attributes, POSIX_SPAWN_SETSIGMASK);
  const std::array<const char*, 4> args = {"sh", "-c", command.c_str(), nullptr};
  pid_t child = -1;
  const int spawned = posix_spawn(&child, "/bin/sh", &actions, &attributes, const_cast<char* const*>(args.data()),
                                  environ);
  posix_spawnattr_destroy(&attributes);
  posix_spawn_file_actions_destroy(&actions);
  if (spawned == 0) running_child.store(child);
  pthread_sigmask(SIG_SETMASK, &before, nullptr);
  close(ends[0]);
  if (spawned != 0) {
    close(ends[1]);
    return -1;
  }
  write_to_pipe(ends[1], input);  // one that stops reading early says so by its status
  close(ends[1]);
  int status = -1;
  while (waitpid(child, &status, 0) < 0 && errno == EINTR) {
  }
  running_child.store(0);
  return status;
}

OutputFile::OutputFile(std::string command, std::string option, std::string path, int suffix_length)
    : command_(std::move(command)), option_(std::move(option)), path_(std::move(path)) {
  namespace fs = std::filesystem;
  // This process's standard output or error (whatever it is: a pipe, a terminal, or a file the shell
  // opened, which a renamed file would take the place of): written through the descriptor, after
  // what the process has printed there.
  own_fd_ = standard_stream_named(path_);
  if (own_fd_ >= 0) {
    write_path_ = path_;
    return;
  }
  std::error_code ec;
  const fs::file_status named_status = fs::status(path_, ec);
  if (fs::exists(named_status) && !fs::is_regular_file(named_status)) {  // a FIFO or a character device
    write_path_ = path_;
    return;
  }
  const fs::path target = link_target(path_);
  target_ = target.string();
  const std::string name = target.filename().string();
  const std::string suffix = name.substr(name.size() - std::min<std::size_t>(name.size(), suffix_length));
  const fs::path dir = target.parent_path().empty() ? fs::path(".") : target.parent_path();
  std::string temp = (dir / ("." + name + ".partial-XXXXXX" + suffix)).string();
  const int fd = mkstemps(temp.data(), static_cast<int>(suffix.size()));
  if (fd < 0) {
    // A writable file in a directory that takes no new files is written in place.
    const int error = errno;
    if (access(target_.c_str(), W_OK) == 0) {
      write_path_ = path_;
      return;
    }
    fail("creating a file beside it failed: " + std::string(std::strerror(error)));
  }
  // The mode a new file gets (0666 less the umask), or the one the file being replaced has.
  const mode_t mask = umask(0);
  umask(mask);
  mode_t mode = 0666 & ~mask;
  struct stat old {};
  if (stat(target_.c_str(), &old) == 0) mode = old.st_mode & 07777;
  fchmod(fd, mode);
  close(fd);
  write_path_ = temp;
  pending_slot_ = hold_pending_file(temp);
}

OutputFile::~OutputFile() {
  if (!committed_ && write_path_ != path_) unlink(write_path_.c_str());
  release_pending_file(pending_slot_);
}

void OutputFile::write(const std::string& text) {
  const bool own = own_fd_ >= 0;
  if (own) std::fflush(nullptr);  // what the process printed there comes first
  const int fd = own ? own_fd_ : open(write_path_.c_str(), O_WRONLY | O_TRUNC | O_CLOEXEC);
  if (fd < 0) fail(std::string("opening it failed: ") + std::strerror(errno));
  int error = write_whole(fd, text);
  if (!own && close(fd) != 0 && error == 0) error = errno;
  if (error != 0) fail(std::string("writing it failed: ") + std::strerror(error));
}

void OutputFile::commit() {
  if (write_path_ != path_ && rename(write_path_.c_str(), target_.c_str()) != 0) {
    fail("renaming " + write_path_ + " onto it failed: " + std::strerror(errno));
  }
  committed_ = true;
  release_pending_file(pending_slot_);
  pending_slot_ = -1;
}

void OutputFile::fail(const std::string& why) const {
  throw Error(command_, option_, path_, "a writable file (" + why + ")");
}

void write_output_file(const std::string& command, const std::string& option, const std::string& path,
                       const std::string& text) {
  OutputFile out(command, option, path);
  out.write(text);
  out.commit();
}

ModelShard shard_from_flags(const std::string& command, const std::string& model, int tp) {
  const ModelPreset* preset = nullptr;
  try {
    preset = &model_preset(model);
  } catch (const Error& e) {
    throw Error(command, "--model", e.value(), e.expected());
  }
  try {
    return shard_model(*preset, tp);
  } catch (const Error& e) {
    throw Error(command, "--tp", e.value(), e.expected());
  }
}

void check_context_in_model(const std::string& command, std::int64_t context, const ModelPreset& model) {
  if (context > model.max_positions) {
    throw Error(command, "--context", std::to_string(context),
                "<= " + std::to_string(model.max_positions) + " (max positions of " + model.name + ")");
  }
}

namespace {
// --context and --page-size are at most 2^31 - 1, so nothing here overflows.
std::int64_t pages_per_request(std::int64_t context, int page_size) { return (context + page_size - 1) / page_size; }
}  // namespace

std::int64_t pool_tokens_needed(const std::string& command, int batch, std::int64_t context, int page_size) {
  const std::int64_t needed = static_cast<std::int64_t>(batch) * pages_per_request(context, page_size) * page_size;
  if (needed > max_pool_tokens(page_size)) {
    throw Error(command, std::to_string(batch) + " requests of " + std::to_string(context) +
                             " tokens in whole pages of " + std::to_string(page_size) + " need " +
                             std::to_string(needed) + " slots, more than the " +
                             std::to_string(max_pool_tokens(page_size)) +
                             " a pool of int32 slots holds: lower --batch, --context or --page-size");
  }
  return needed;
}

void check_pool(const std::string& command, std::int64_t pool, int batch, std::int64_t context, int page_size) {
  const std::int64_t needed = pool_tokens_needed(command, batch, context, page_size);
  if (pool > max_pool_tokens(page_size)) {  // --pool itself is below 2^31; rounded up to whole pages it may not be
    throw Error(command, "--pool", std::to_string(pool),
                "at most " + std::to_string(max_pool_tokens(page_size)) + " (rounded up to whole pages of " +
                    std::to_string(page_size) + " tokens, the pool must stay below 2^31 slots: slots are int32)");
  }
  if (pool < needed) {  // what the requests' pages take; a pool of more is rounded up to whole pages
    const std::int64_t pages = pages_per_request(context, page_size);
    throw Error(command, "--pool", std::to_string(pool),
                ">= " + std::to_string(needed) + " tokens (" + std::to_string(batch) +
                    (batch == 1 ? " request of " : " requests of ") + std::to_string(context) + " tokens take" +
                    (batch == 1 ? "s " : " ") + std::to_string(pages) + " page" + (pages == 1 ? "" : "s") + " of " +
                    std::to_string(page_size) + (batch == 1 ? ")" : " each)"));
  }
}

std::string gigabytes(double bytes) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f GB", bytes / 1e9);
  return buf;
}

void check_host_memory(const std::string& command, double needed, const std::string& what, const std::string& lower) {
  const std::string need = what + ": " + gigabytes(needed) + " of host memory; ";
  const double available = available_memory_bytes();
  if (available > 0 && needed > available) {
    throw Error(command, need + "this machine has " + gigabytes(available) + " available: lower " + lower);
  }
  const double left = address_space_left_bytes();
  if (needed > left) {
    throw Error(command, need + "the address-space limit (ulimit -v) leaves " + gigabytes(left) + ": lower " + lower);
  }
}

std::string why_no_gpu() {
  if (find_backend("cuda") == nullptr) return "this build has no CUDA backends (it was built without nvcc)";
  return "no CUDA GPU was found (or its driver cannot run this build's CUDA runtime)";
}

}  // namespace latentkv::tools
