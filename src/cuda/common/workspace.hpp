// src/cuda/common/workspace.hpp - carving one planned device workspace into aligned pieces.
#pragma once

#include <cstddef>

namespace latentkv::cuda {

inline constexpr std::size_t kWorkspaceAlign = 256;

inline constexpr std::size_t align_up(std::size_t n) {
  return (n + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign;
}

}  // namespace latentkv::cuda
