// latentkv/error.hpp - the one exception type the library throws.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace latentkv {

// Every rejected input or failed operation raises an Error that names the op, the argument, the
// value that was seen and what was expected, e.g.
//   mla_decode: argument 'seq_lens[3]' = 70000: expected 0 .. 65536 (block table capacity: 1024 pages x 64 tokens)
class Error : public std::runtime_error {
 public:
  Error(std::string op, std::string argument, std::string value, std::string expected);
  // A failure that is not about one argument (a CUDA error, an exhausted pool, ...).
  Error(std::string op, std::string message);

  const std::string& op() const noexcept { return op_; }
  const std::string& argument() const noexcept { return argument_; }
  const std::string& value() const noexcept { return value_; }
  const std::string& expected() const noexcept { return expected_; }

 private:
  std::string op_, argument_, value_, expected_;
};

// A value the user gave, as a message shows it: in single quotes, a quote or backslash escaped with a
// backslash, control and non-ASCII bytes as \xNN (so that no message carries a terminal escape
// sequence), and cut after 80 characters with "...".
std::string quoted_value(std::string_view text);

}  // namespace latentkv
