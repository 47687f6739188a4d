#include "latentkv/tensor.hpp"

#include <algorithm>
#include <limits>

#include "latentkv/error.hpp"

namespace latentkv {
namespace {

// a * b, or INT64_MAX where that does not fit: a hand-built view may hold any extents, and counts and
// strides must not wrap (a count wrapped to 0 would pass null data as an empty view). Validation
// refuses a shape whose bytes do not fit (expect_descriptor) before a saturated count is used.
std::int64_t saturating_mul(std::int64_t a, std::int64_t b) {
  std::int64_t product = 0;
  return __builtin_mul_overflow(a, b, &product) ? std::numeric_limits<std::int64_t>::max() : product;
}

}  // namespace

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF64: return 8;
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kFP8E4M3: return 1;
    case DType::kI32: return 4;
    case DType::kU8: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF64: return "f64";
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kFP8E4M3: return "fp8_e4m3";
    case DType::kI32: return "i32";
    case DType::kU8: return "u8";
  }
  return "?";
}

std::string_view device_kind_name(DeviceKind kind) { return kind == DeviceKind::kCpu ? "cpu" : "cuda"; }

TensorView TensorView::contiguous(void* data, DType dtype, std::initializer_list<std::int64_t> shape, Device device) {
  return contiguous(data, dtype, std::span<const std::int64_t>(shape.begin(), shape.size()), device);
}

TensorView TensorView::contiguous(void* data, DType dtype, std::span<const std::int64_t> shape, Device device) {
  if (shape.size() > static_cast<std::size_t>(kMaxRank)) {
    throw Error("TensorView", "shape", std::to_string(shape.size()) + " dims", "at most 4 dims");
  }
  TensorView view;
  view.data = data;
  view.dtype = dtype;
  view.device = device;
  view.rank = static_cast<int>(shape.size());
  int i = 0;
  for (std::int64_t extent : shape) view.shape[static_cast<std::size_t>(i++)] = extent;
  std::int64_t stride = 1;
  for (int d = view.rank - 1; d >= 0; --d) {
    view.strides[static_cast<std::size_t>(d)] = stride;
    stride = saturating_mul(stride, view.shape[static_cast<std::size_t>(d)]);
  }
  return view;
}

namespace {

// The dims a view holds, even when a hand-built view's rank field says otherwise (validation
// refuses such a view; its message still reads the shape).
int held_rank(int rank) { return std::clamp(rank, 0, TensorView::kMaxRank); }

}  // namespace

std::int64_t TensorView::size(int dim) const {
  if (dim < 0 || dim >= kMaxRank) {
    throw Error("TensorView", "dim", std::to_string(dim), "0 .. " + std::to_string(kMaxRank - 1));
  }
  return dim < held_rank(rank) ? shape[static_cast<std::size_t>(dim)] : 0;
}

std::int64_t TensorView::numel() const {
  std::int64_t n = 1;
  for (int d = 0; d < held_rank(rank); ++d) n = saturating_mul(n, shape[static_cast<std::size_t>(d)]);
  return n;
}

bool TensorView::is_contiguous() const {
  std::int64_t stride = 1;
  for (int d = held_rank(rank) - 1; d >= 0; --d) {
    const auto i = static_cast<std::size_t>(d);
    if (shape[i] != 1 && strides[i] != stride) return false;
    stride = saturating_mul(stride, shape[i]);
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::string s = "[";
  for (int d = 0; d < held_rank(rank); ++d) {
    if (d) s += ", ";
    s += std::to_string(shape[static_cast<std::size_t>(d)]);
  }
  return s + "]";
}

}  // namespace latentkv
