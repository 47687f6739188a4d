#include "latentkv/environment.hpp"

#include <algorithm>
#include <cstddef>
#include <string_view>

#include "latentkv/config.hpp"

extern char** environ;  // POSIX: the process's environment, "NAME=value" strings

namespace latentkv {
namespace {

constexpr std::string_view kPrefix = kEnvironmentPrefix;

// Edits (insertions, deletions, substitutions) that turn a into b.
std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({above + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// Whether the words of `part` ('_'-separated) stand in `whole` as a run of its words.
bool among_words(std::string_view part, std::string_view whole) {
  const auto padded = [](std::string_view words) {
    std::string s(1, '_');
    s.append(words);
    s.push_back('_');
    return s;
  };
  return !part.empty() && padded(whole).find(padded(part)) != std::string::npos;
}

// The name read that `name` most likely meant, or "" when none is close: the fewest edits after
// LATENTKV_, at most 3 and a third of the longer name (TOPK is not TP), or one name's words among
// the other's (SPARSE_DECODE_BACKEND: SPARSE_DECODE; TP_SIZE: TP; but not OUTPUT: TP).
std::string closest(std::string_view name, const std::vector<std::string>& read) {
  const std::string_view word = name.substr(kPrefix.size());
  std::string best;
  std::size_t best_distance = 4;
  for (const std::string& candidate : read) {
    const std::string_view other = std::string_view(candidate).substr(kPrefix.size());
    std::size_t d = edit_distance(word, other);
    if (d > std::max(word.size(), other.size()) / 3) d = 4;
    if (among_words(word, other) || among_words(other, word)) d = std::min<std::size_t>(d, 3);
    if (d < best_distance) {
      best_distance = d;
      best = candidate;
    }
  }
  return best;
}

}  // namespace

std::vector<std::string> environment_variables() {
  std::vector<std::string> names = {environment_variable(kConfigFileKey)};
  for (const std::string_view key : config_keys()) names.push_back(environment_variable(key));
  names.emplace_back(kMlaKernelVariable);
  names.emplace_back(kIndexerKernelVariable);
  names.emplace_back(kPythonVariable);
  return names;
}

std::vector<std::string> unread_environment_warnings(const std::vector<std::string>& names,
                                                     const std::vector<std::string>& also_read) {
  std::vector<std::string> read = environment_variables();
  for (const std::string& name : also_read) {
    if (name.starts_with(kPrefix)) read.push_back(name);
  }
  std::vector<std::string> warnings;
  for (const std::string& name : names) {
    if (!name.starts_with(kPrefix) || std::find(read.begin(), read.end(), name) != read.end()) continue;
    std::string line = name + " is set but latentkv reads no variable of that name; it is ignored";
    if (const std::string meant = closest(name, read); !meant.empty()) {
      line += " (did you mean " + meant + "?)";
    } else {
      line += " (latentkv reads ";
      for (std::size_t i = 0; i < read.size(); ++i) line += (i == 0 ? "" : ", ") + read[i];
      line += ")";
    }
    warnings.push_back(std::move(line));
  }
  return warnings;
}

std::vector<std::string> process_environment_names() {
  std::vector<std::string> names;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const std::string_view text(*entry);
    names.emplace_back(text.substr(0, text.find('=')));
  }
  return names;
}

}  // namespace latentkv
