// tests/support/host_tensor.hpp - an owning host tensor, sentinels, and random inputs.
//
// HostTensor owns contiguous host memory of one DType and hands out TensorViews of it. GPU tests
// copy raw() to device memory and describe it with view_of(device_pointer, Device::cuda()).
//
// Sentinels: fill_sentinel() writes a pattern no op ever produces (bf16 0xFFFF, NaN floats with a
// payload, i32 kSentinelI32), so an element an op forgot to write fails every comparison, and
// is_sentinel() tells whether a rejected call left an output untouched.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "latentkv/dtype.hpp"
#include "latentkv/fp8.hpp"
#include "latentkv/tensor.hpp"
#include "support/rng.hpp"

namespace latentkv::testing {

inline constexpr std::uint16_t kSentinelBf16 = 0xFFFF;                  // a negative NaN
inline constexpr std::uint32_t kSentinelF32Bits = 0x7FC05EEDu;          // a quiet NaN with payload 0x5EED
inline constexpr std::uint64_t kSentinelF64Bits = 0x7FF8000000005EEDull;
inline constexpr std::int32_t kSentinelI32 = -0x5EED;                   // neither a slot nor -1
inline constexpr std::uint8_t kSentinelU8 = 0x7F;                       // fp8 NaN

class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<std::int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    bytes_.assign(static_cast<std::size_t>(numel()) * dtype_size(dtype_), 0);
  }

  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t numel() const {
    return std::accumulate(shape_.begin(), shape_.end(), std::int64_t{1}, std::multiplies<>());
  }
  std::size_t bytes() const { return bytes_.size(); }
  std::uint8_t* raw() { return bytes_.data(); }
  const std::uint8_t* raw() const { return bytes_.data(); }
  const std::vector<std::uint8_t>& byte_vector() const { return bytes_; }

  template <typename T>
  T* data() { return reinterpret_cast<T*>(bytes_.data()); }
  template <typename T>
  const T* data() const { return reinterpret_cast<const T*>(bytes_.data()); }

  // A contiguous view of this tensor's host memory.
  TensorView view() { return view_of(bytes_.data(), Device::cpu()); }
  // The same dtype and shape over other memory (a device copy).
  TensorView view_of(void* memory, Device device) const {
    TensorView v;
    v.data = memory;
    v.dtype = dtype_;
    v.device = device;
    v.rank = static_cast<int>(shape_.size());
    std::int64_t stride = 1;
    for (int d = v.rank - 1; d >= 0; --d) {
      v.shape[static_cast<std::size_t>(d)] = shape_[static_cast<std::size_t>(d)];
      v.strides[static_cast<std::size_t>(d)] = stride;
      stride *= shape_[static_cast<std::size_t>(d)];
    }
    return v;
  }

  // Element i as a double (bf16 and fp8 decoded).
  double get(std::int64_t i) const {
    switch (dtype_) {
      case DType::kF64: return data<double>()[i];
      case DType::kF32: return data<float>()[i];
      case DType::kBF16: return bf16_decode(data<std::uint16_t>()[i]);
      case DType::kFP8E4M3: return fp8_e4m3_decode(data<std::uint8_t>()[i]);
      case DType::kI32: return data<std::int32_t>()[i];
      case DType::kU8: return data<std::uint8_t>()[i];
    }
    return 0.0;
  }
  // Stores v rounded to the dtype (bf16 and fp8 round to nearest even).
  void set(std::int64_t i, double v) {
    switch (dtype_) {
      case DType::kF64: data<double>()[i] = v; break;
      case DType::kF32: data<float>()[i] = static_cast<float>(v); break;
      case DType::kBF16: data<std::uint16_t>()[i] = bf16_encode(static_cast<float>(v)); break;
      case DType::kFP8E4M3: data<std::uint8_t>()[i] = fp8_e4m3_encode(static_cast<float>(v)); break;
      case DType::kI32: data<std::int32_t>()[i] = static_cast<std::int32_t>(v); break;
      case DType::kU8: data<std::uint8_t>()[i] = static_cast<std::uint8_t>(v); break;
    }
  }
  std::vector<double> to_doubles() const {
    std::vector<double> out(static_cast<std::size_t>(numel()));
    for (std::int64_t i = 0; i < numel(); ++i) out[static_cast<std::size_t>(i)] = get(i);
    return out;
  }

 private:
  DType dtype_ = DType::kU8;
  std::vector<std::int64_t> shape_;
  std::vector<std::uint8_t> bytes_;
};

// A host tensor holding a copy of what `view` (contiguous, in host memory) shows: an intermediate
// an op left in a caller's host workspace, say.
inline HostTensor copy_of(const TensorView& view) {
  HostTensor t(view.dtype, std::vector<std::int64_t>(view.shape.begin(), view.shape.begin() + view.rank));
  if (t.bytes() > 0) std::memcpy(t.raw(), view.data, t.bytes());
  return t;
}

// The sentinel pattern of one element of `dtype`, as bytes.
inline std::vector<std::uint8_t> sentinel_bytes(DType dtype) {
  std::vector<std::uint8_t> b(dtype_size(dtype));
  switch (dtype) {
    case DType::kF64: std::memcpy(b.data(), &kSentinelF64Bits, 8); break;
    case DType::kF32: std::memcpy(b.data(), &kSentinelF32Bits, 4); break;
    case DType::kBF16: std::memcpy(b.data(), &kSentinelBf16, 2); break;
    case DType::kI32: std::memcpy(b.data(), &kSentinelI32, 4); break;
    case DType::kFP8E4M3:
    case DType::kU8: b[0] = kSentinelU8; break;
  }
  return b;
}

inline void fill_sentinel(HostTensor& t) {
  const std::vector<std::uint8_t> pattern = sentinel_bytes(t.dtype());
  for (std::size_t i = 0; i < t.bytes(); ++i) t.raw()[i] = pattern[i % pattern.size()];
}

// How many of elements [first, first + count) (to the end by default) still hold the sentinel: none
// once a call wrote them.
inline std::int64_t sentinel_elements(const HostTensor& t, std::int64_t first = 0, std::int64_t count = -1) {
  const std::vector<std::uint8_t> pattern = sentinel_bytes(t.dtype());
  const std::int64_t end = count < 0 ? t.numel() : first + count;
  std::int64_t n = 0;
  for (std::int64_t i = first; i < end; ++i) {
    n += std::memcmp(t.raw() + static_cast<std::size_t>(i) * pattern.size(), pattern.data(), pattern.size()) == 0;
  }
  return n;
}

// True when every element still holds the sentinel.
inline bool is_sentinel(const HostTensor& t) { return sentinel_elements(t) == t.numel(); }

// A tensor of `dtype` and `shape` filled with the sentinel.
inline HostTensor sentinel_tensor(DType dtype, std::vector<std::int64_t> shape) {
  HostTensor t(dtype, std::move(shape));
  fill_sentinel(t);
  return t;
}

// ---- random inputs ---------------------------------------------------------------------------

// bf16 values drawn from N(0, stddev^2), rounded to nearest even.
inline HostTensor random_bf16(Rng& rng, std::vector<std::int64_t> shape, double stddev = 1.0) {
  HostTensor t(DType::kBF16, std::move(shape));
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.normal(0.0, stddev));
  return t;
}

// fp8 e4m3 codes of N(0, stddev^2) values (saturating, so never NaN): indexer queries.
inline HostTensor random_fp8(Rng& rng, std::vector<std::int64_t> shape, double stddev = 1.0) {
  HostTensor t(DType::kFP8E4M3, std::move(shape));
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.normal(0.0, stddev));
  return t;
}

// float32 values uniform in [lo, hi): indexer weights.
inline HostTensor random_f32(Rng& rng, std::vector<std::int64_t> shape, double lo, double hi) {
  HostTensor t(DType::kF32, std::move(shape));
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, rng.uniform(lo, hi));
  return t;
}

// An i32 tensor holding `values` (row-major).
inline HostTensor i32_tensor(std::vector<std::int64_t> shape, const std::vector<std::int32_t>& values) {
  HostTensor t(DType::kI32, std::move(shape));
  std::copy(values.begin(), values.end(), t.data<std::int32_t>());
  return t;
}

}  // namespace latentkv::testing
