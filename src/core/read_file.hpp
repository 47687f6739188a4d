// src/core/read_file.hpp - a file a person names (a configuration file, a saved step report) read
// whole, but never more than a limit: the file system need not tell its size (procfs reports 0), and
// a device need not end (/dev/zero).
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

namespace latentkv::detail {

struct BoundedRead {
  enum class Status { kRead, kCannotOpen, kReadFailed, kTooLarge };
  Status status = Status::kRead;
  std::string text;  // the whole file when kRead
};

// At most `limit` + 1 bytes are read; more than `limit` is kTooLarge. A failed read (an I/O error,
// which the stream buffer throws and read() turns into badbit) is kReadFailed, not an exception.
BoundedRead read_at_most(const std::filesystem::path& file, std::size_t limit);

}  // namespace latentkv::detail
