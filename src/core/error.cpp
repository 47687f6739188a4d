#include "latentkv/error.hpp"

#include <utility>

namespace latentkv {

Error::Error(std::string op, std::string argument, std::string value, std::string expected)
    : std::runtime_error(op + ": argument '" + argument + "' = " + value + ": expected " + expected),
      op_(std::move(op)),
      argument_(std::move(argument)),
      value_(std::move(value)),
      expected_(std::move(expected)) {}

Error::Error(std::string op, std::string message)
    : std::runtime_error(op + ": " + message), op_(std::move(op)) {}

std::string quoted_value(std::string_view text) {
  constexpr std::size_t kMostShown = 80;
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out = "'";
  std::size_t shown = 0;
  for (char ch : text) {
    if (shown == kMostShown) {
      out += "...";
      break;
    }
    const auto byte = static_cast<unsigned char>(ch);
    if (byte < 0x20 || byte == 0x7F || byte >= 0x80) {
      out += "\\x";
      out += kHex[byte >> 4];
      out += kHex[byte & 0xF];
    } else {
      if (ch == '\'' || ch == '\\') out += '\\';
      out += ch;
    }
    ++shown;
  }
  return out + "'";
}

}  // namespace latentkv
