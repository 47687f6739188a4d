// src/core/workspace.hpp - carving one planned workspace into aligned pieces (the composite ops in
// src/core and the CUDA launchers share it).
#pragma once

#include <cstddef>

namespace latentkv::detail {

inline constexpr std::size_t kWorkspaceAlign = 256;

inline constexpr std::size_t align_up(std::size_t n) {
  return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

}  // namespace latentkv::detail
