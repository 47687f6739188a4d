// latentkv/tensor.hpp - non-owning views of tensors in host or device memory.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include "latentkv/dtype.hpp"

namespace latentkv {

// A view never owns its memory. Strides are in elements. A default-constructed view is "absent"
// (data == nullptr, rank 0) and is how optional arguments are left out.
struct TensorView {
  static constexpr int kMaxRank = 4;

  void* data = nullptr;
  DType dtype = DType::kU8;
  Device device{};
  int rank = 0;
  std::array<std::int64_t, kMaxRank> shape{};
  std::array<std::int64_t, kMaxRank> strides{};

  // A contiguous (row-major) view of at most kMaxRank dims (more: Error). The span form takes a shape
  // known only at run time (a framework tensor's sizes).
  static TensorView contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                               Device device = Device::cpu());
  static TensorView contiguous(void* data, DType dtype, std::span<const std::int64_t> shape,
                               Device device = Device::cpu());

  bool present() const { return data != nullptr; }
  std::int64_t numel() const;  // INT64_MAX where the count does not fit int64 (0 with any zero extent)
  // Extent of dim 0 .. kMaxRank - 1 (a dim at or past rank reads 0, as in an absent view, so that
  // selection may read a wrongly ranked view before validation names it); any other dim: Error.
  std::int64_t size(int dim) const;
  bool is_contiguous() const;
  std::string shape_string() const;  // "[2, 1, 8, 576]"

  template <typename T>
  T* as() const { return static_cast<T*>(data); }
};

}  // namespace latentkv
