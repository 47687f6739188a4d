#include "core/read_file.hpp"

#include <fstream>
#include <ios>

namespace latentkv::detail {

BoundedRead read_at_most(const std::filesystem::path& file, std::size_t limit) {
  BoundedRead r;
  std::ifstream in(file, std::ios::binary);
  if (!in) {
    r.status = BoundedRead::Status::kCannotOpen;
    return r;
  }
  r.text.assign(limit + 1, '\0');
  in.read(r.text.data(), static_cast<std::streamsize>(r.text.size()));
  if (in.bad()) {
    r.status = BoundedRead::Status::kReadFailed;
    r.text.clear();
    return r;
  }
  r.text.resize(static_cast<std::size_t>(in.gcount()));
  if (r.text.size() > limit) {
    r.status = BoundedRead::Status::kTooLarge;
    r.text.clear();
  }
  return r;
}

}  // namespace latentkv::detail
