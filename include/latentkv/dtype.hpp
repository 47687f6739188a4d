// latentkv/dtype.hpp - element types and devices of tensor views.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace latentkv {

enum class DType : std::uint8_t {
  kF64,
  kF32,
  kBF16,      // stored as uint16_t bit patterns
  kFP8E4M3,   // e4m3fn, stored as uint8_t codes
  kI32,
  kU8,        // raw bytes (caches)
};

std::size_t dtype_size(DType dtype);
std::string_view dtype_name(DType dtype);

enum class DeviceKind : std::uint8_t { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;

  static Device cpu() { return {}; }
  static Device cuda(int index = 0) { return {DeviceKind::kCuda, index}; }
  bool operator==(const Device&) const = default;
};

std::string_view device_kind_name(DeviceKind kind);

}  // namespace latentkv
