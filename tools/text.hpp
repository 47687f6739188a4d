// tools/text.hpp - printf-style text appended to a string, for the tables the commands print, and
// text wrapped at word boundaries.
#pragma once

#include <cstdarg>
#include <cstdio>
#include <sstream>
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

// `text` wrapped at word boundaries so that no line passes `columns` (a longer word keeps a line of
// its own), its first line starting at column `first_column`; continuation lines start with
// `indent`. Runs of spaces and line breaks count as one space.
inline std::string wrap_words(const std::string& text, std::size_t first_column, const std::string& indent,
                              std::size_t columns) {
  std::istringstream words(text);
  std::string word, out;
  std::size_t column = first_column;
  bool line_start = true;
  while (words >> word) {
    if (!line_start && column + 1 + word.size() > columns) {
      out += "\n" + indent;
      column = indent.size();
      line_start = true;
    }
    if (!line_start) {
      out += ' ';
      ++column;
    }
    out += word;
    column += word.size();
    line_start = false;
  }
  return out;
}

// Each line of `text` wrapped to `columns` from column 0; its line breaks (and a last one) kept.
inline std::string wrap_lines(const std::string& text, std::size_t columns) {
  std::string out;
  std::size_t start = 0;
  while (start < text.size()) {
    const std::size_t end = text.find('\n', start);
    const std::string line = text.substr(start, end == std::string::npos ? std::string::npos : end - start);
    out += wrap_words(line, 0, "", columns);
    if (end == std::string::npos) break;
    out += '\n';
    start = end + 1;
  }
  return out;
}

}  // namespace latentkv::tools
