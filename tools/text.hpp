// tools/text.hpp - printf-style text appended to a string, for the tables the commands print.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <string>

namespace latentkv::tools {

// Appends `format` filled in with the arguments, as printf would print it, to `out`.
inline void appendf(std::string& out, const char* format, ...) __attribute__((format(printf, 2, 3)));
inline void appendf(std::string& out, const char* format, ...) {
  va_list args, again;
  va_start(args, format);
  va_copy(again, args);
  const int n = std::vsnprintf(nullptr, 0, format, args);
  va_end(args);
  if (n > 0) {
    const std::size_t at = out.size();
    out.resize(at + static_cast<std::size_t>(n) + 1);
    std::vsnprintf(out.data() + at, static_cast<std::size_t>(n) + 1, format, again);
    out.resize(at + static_cast<std::size_t>(n));
  }
  va_end(again);
}

}  // namespace latentkv::tools
