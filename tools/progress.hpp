// tools/progress.hpp - a one-line progress indicator on stderr for the commands that run long.
//
// On a terminal it rewrites one line ("[step] filling layer caches 34/78  12 s"), at most ten times a
// second, and clears it at the end. Elsewhere (a log file, a pipe) it stays silent until the run has
// taken a while, then prints a plain line every few seconds, so that a short run's log is unchanged
// and a long one shows where it is.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>

namespace latentkv::tools {

class Progress {
 public:
  explicit Progress(std::string label, bool enabled = true)
      : label_(std::move(label)), enabled_(enabled), terminal_(isatty(fileno(stderr)) != 0) {}
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() { finish(); }

  // Where the run is: `what`, `done` of `total` (total 0: no count).
  void update(const std::string& what, int done = 0, int total = 0) {
    if (!enabled_) return;
    const Clock::time_point now = Clock::now();
    const double since_start = seconds(start_, now), since_shown = seconds(shown_, now);
    const bool last = total > 0 && done == total;
    if (terminal_ ? (since_shown < 0.1 && !last) : (since_start < kQuietSeconds || since_shown < kLineSeconds)) return;
    shown_ = now;
    char count[48] = "";
    if (total > 0) std::snprintf(count, sizeof count, " %d/%d", done, total);
    char line[512];
    std::snprintf(line, sizeof line, "[%s] %s%s  %d s", label_.c_str(), what.c_str(), count,
                  static_cast<int>(since_start));
    if (terminal_) {
      std::fprintf(stderr, "\r\033[K%s", line);
      on_line_ = true;
    } else {
      std::fprintf(stderr, "%s\n", line);
    }
    std::fflush(stderr);
  }

  // Clears the terminal line (before the command prints its results).
  void finish() {
    if (on_line_) std::fprintf(stderr, "\r\033[K");
    on_line_ = false;
    std::fflush(stderr);
  }

 private:
  using Clock = std::chrono::steady_clock;
  static constexpr double kQuietSeconds = 5;  // not a terminal: silent for the first seconds
  static constexpr double kLineSeconds = 10;  // then a line at most this often
  static double seconds(Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  }

  std::string label_;
  bool enabled_;
  bool terminal_;
  bool on_line_ = false;
  Clock::time_point start_ = Clock::now();
  Clock::time_point shown_{};
};

}  // namespace latentkv::tools
