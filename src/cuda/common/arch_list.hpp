// src/cuda/common/arch_list.hpp - which GPUs a list of CUDA architectures (CMake's
// CUDA_ARCHITECTURES syntax, as LKV_CUDA_ARCHS gives it) holds code for. Plain C++: the CUDA
// backends ask it of the list they were built with (device.cpp), the CPU tests of any list.
#pragma once

#include <algorithm>
#include <cctype>
#include <string>
#include <string_view>

namespace latentkv::cuda {

// Whether a GPU of compute capability `sm` (90 for sm_90) runs code built for the architectures in
// `built`, entries separated by ',' or ';': "89" is sm_89 code, which later minors of 8.x run, plus
// PTX that any later GPU compiles; "89-real" the code alone, "89-virtual" the PTX alone; "90a" (also
// -real or -virtual) is for sm_90 alone, its PTX using features no other GPU has; "100f" for the
// family, sm_100 and later minors of 10.x. "native", "all" and "all-major" are resolved by CMake, not
// known here: taken as holding code for any GPU.
inline bool arch_list_runs_on(std::string_view built, int sm) {
  std::size_t from = 0;
  while (from <= built.size()) {
    const std::size_t end = std::min(built.find_first_of(",;", from), built.size());
    const std::string entry(built.substr(from, end - from));
    from = end + 1;
    if (entry == "native" || entry == "all" || entry == "all-major") return true;
    if (entry.empty() || !std::isdigit(static_cast<unsigned char>(entry[0]))) continue;
    std::size_t digits = 0;
    while (digits < entry.size() && std::isdigit(static_cast<unsigned char>(entry[digits]))) ++digits;
    if (digits > 4) continue;  // no architecture of ours
    const int arch = std::stoi(entry.substr(0, digits));
    std::string rest = entry.substr(digits);
    const char marker = !rest.empty() && (rest[0] == 'a' || rest[0] == 'f') ? rest[0] : '\0';
    if (marker != '\0') rest.erase(0, 1);
    if (rest != "" && rest != "-real" && rest != "-virtual") continue;  // not an entry CMake takes
    if (marker == 'a') {
      if (sm == arch) return true;
    } else if (marker == 'f') {
      if (sm / 10 == arch / 10 && sm >= arch) return true;
    } else {
      const bool code = rest != "-virtual", ptx = rest != "-real";
      if (code && sm / 10 == arch / 10 && sm >= arch) return true;
      if (ptx && sm >= arch) return true;
    }
  }
  return false;
}

}  // namespace latentkv::cuda
