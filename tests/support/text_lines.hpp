// tests/support/text_lines.hpp - reading a printed table back: the line that starts with a given
// text, and its whitespace-separated words.
#pragma once

#include <sstream>
#include <string>
#include <vector>

namespace latentkv::testing {

// The first line of `text` that starts with `start`, or a line saying there is none.
inline std::string line_of(const std::string& text, const std::string& start) {
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(start, 0) == 0) return line;
  }
  return "(no line starting '" + start + "')";
}

// The whitespace-separated words of `line`.
inline std::vector<std::string> words_of(const std::string& line) {
  std::istringstream in(line);
  std::vector<std::string> out;
  for (std::string w; in >> w;) out.push_back(w);
  return out;
}

// The words of the first line of `text` that starts with `start`.
inline std::vector<std::string> words_of_line(const std::string& text, const std::string& start) {
  return words_of(line_of(text, start));
}

}  // namespace latentkv::testing
