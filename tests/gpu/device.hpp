// tests/gpu/device.hpp - device buffers and the skip rule for GPU tests.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "latentkv/backend.hpp"
#include "latentkv/device_fault.hpp"
#include "support/expect_error.hpp"
#include "support/host_tensor.hpp"

namespace latentkv::testing {

// Skips the test where no CUDA device is present (CI builds the GPU tests but has no GPU).
#define LKV_REQUIRE_GPU()                                                              \
  do {                                                                                 \
    if (::latentkv::detect_device().kind != ::latentkv::DeviceKind::kCuda) {           \
      GTEST_SKIP() << "no CUDA device";                                                \
    }                                                                                  \
  } while (0)

#define LKV_CUDA_OK(call) ASSERT_EQ((call), cudaSuccess) << #call << ": " << cudaGetErrorString(cudaGetLastError())

// Throws on a failed CUDA call, for helpers that cannot ASSERT.
inline void check_cuda(cudaError_t status) {
  if (status != cudaSuccess) throw std::runtime_error(cudaGetErrorString(status));
}

// Owning device memory, copied from and to host vectors.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(std::size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0 && cudaMalloc(&data_, bytes_) != cudaSuccess) {
      throw std::runtime_error("cudaMalloc of " + std::to_string(bytes_) + " bytes failed");
    }
  }
  template <typename T>
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size() * sizeof(T)) {
    upload(host.data(), bytes_);
  }
  DeviceBuffer(const void* host, std::size_t bytes) : DeviceBuffer(bytes) { upload(host, bytes); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~DeviceBuffer() {
    if (data_) cudaFree(data_);
  }

  void upload(const void* host, std::size_t bytes) {
    if (bytes && cudaMemcpy(data_, host, bytes, cudaMemcpyHostToDevice) != cudaSuccess) {
      throw std::runtime_error("upload failed");
    }
  }
  // `bytes` of the buffer from byte `offset` on.
  void download(void* host, std::size_t bytes, std::size_t offset = 0) const {
    if (bytes && cudaMemcpy(host, static_cast<const std::uint8_t*>(data_) + offset, bytes,
                            cudaMemcpyDeviceToHost) != cudaSuccess) {
      throw std::runtime_error(std::string("download failed: ") + cudaGetErrorString(cudaGetLastError()));
    }
  }
  template <typename T>
  std::vector<T> to_host() const {
    std::vector<T> out(bytes_ / sizeof(T));
    download(out.data(), out.size() * sizeof(T));
    return out;
  }

  template <typename T = void>
  T* get() const { return static_cast<T*>(data_); }
  std::size_t bytes() const { return bytes_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

// Device memory holding `host`'s bytes between two guard regions of a fixed pattern, for a call that
// must not write outside what it was given (a slot of -1, -2 or one past the pool lands just before
// or after the cache), nor read there (a cache between guards of kPoisonFp8 bytes, fp8 NaN codes and
// scales of 3.4e38: what a kernel reads there shows in its outputs): get() is the start of the
// bytes, to_host() returns them alone, and guards_intact() says whether both guards still hold the
// pattern.
class GuardedBuffer {
 public:
  static constexpr std::size_t kGuardBytes = 64 * 1024;  // more than a token or an indexer page, either side
  static constexpr std::uint8_t kPattern = 0x5A;

  explicit GuardedBuffer(const std::vector<std::uint8_t>& host, std::uint8_t pattern = kPattern)
      : bytes_(host.size()), pattern_(pattern), buffer_(host.size() + 2 * kGuardBytes) {
    std::vector<std::uint8_t> all(buffer_.bytes(), pattern);
    std::memcpy(all.data() + kGuardBytes, host.data(), host.size());
    buffer_.upload(all.data(), all.size());
  }
  template <typename T = void>
  T* get() const { return reinterpret_cast<T*>(buffer_.get<std::uint8_t>() + kGuardBytes); }
  std::vector<std::uint8_t> to_host() const { return download_at(kGuardBytes, bytes_); }
  bool guards_intact() const {
    const auto holds_pattern = [this](const std::vector<std::uint8_t>& guard) {
      return std::all_of(guard.begin(), guard.end(), [this](std::uint8_t x) { return x == pattern_; });
    };
    return holds_pattern(download_at(0, kGuardBytes)) && holds_pattern(download_at(kGuardBytes + bytes_, kGuardBytes));
  }

 private:
  std::vector<std::uint8_t> download_at(std::size_t offset, std::size_t bytes) const {
    std::vector<std::uint8_t> out(bytes);
    buffer_.download(out.data(), bytes, offset);
    return out;
  }

  std::size_t bytes_;
  std::uint8_t pattern_;
  DeviceBuffer buffer_;
};

// A zeroed fault record (latentkv/device_fault.hpp) to give a call, and what the calls left in it.
class FaultRecord {
 public:
  FaultRecord() : buffer_(sizeof(DeviceFault)) { clear(); }
  DeviceFault* get() const { return buffer_.get<DeviceFault>(); }
  void clear() {
    if (cudaMemset(buffer_.get(), 0, sizeof(DeviceFault)) != cudaSuccess) throw std::runtime_error("fault record memset");
  }
  DeviceFault read() const {
    DeviceFault f;
    buffer_.download(&f, sizeof f);
    return f;
  }
  // The message of the Error throw_device_fault raises for the record, or "" when it holds none.
  std::string message() const {
    const DeviceFault f = read();
    return error_of([&] { throw_device_fault(f); });
  }

 private:
  DeviceBuffer buffer_;
};

// A DSA call (the tests' DeviceDsa or DeviceDsaPrefill) with its o moved off 8-byte alignment:
// `sparse_op`'s checks refuse it before the indexer step is queued, so the workspace, the sentinel
// lse and the fault record are left as they were.
template <class Dsa>
void expect_misaligned_o_queues_nothing(Dsa& d, std::string_view sparse_op) {
  DeviceBuffer shifted(d.o_bytes() + 16);
  d.move_o(shifted.template get<std::uint8_t>() + 4);
  d.fill_sentinels();
  check_cuda(cudaDeviceSynchronize());
  const std::vector<std::uint8_t> before = d.workspace_contents();
  EXPECT_TRUE(throws_error([&] { d.run(); }, sparse_op, "o", "not 8-byte aligned"));
  check_cuda(cudaDeviceSynchronize());
  EXPECT_TRUE(d.workspace_contents() == before) << "the indexer step was queued before the sparse step's checks refused";
  EXPECT_TRUE(is_sentinel(d.download().lse));
  EXPECT_EQ(d.fault(), "");
}

// A DSA call with its workspace (the planned size, at `offset` bytes past a 256-byte boundary)
// aligned less than its steps want (`align` bytes): the call refuses it under its own name `op`
// before any step is queued, so o and lse keep their sentinels and the fault record stays empty.
template <class Dsa>
void expect_misaligned_workspace_refused(Dsa& d, std::string_view op, std::size_t offset, std::size_t align) {
  DeviceBuffer shifted(d.plan().workspace_bytes + 256);
  d.fill_sentinels();
  check_cuda(cudaDeviceSynchronize());
  d.move_workspace(shifted.template get<std::uint8_t>() + offset);
  EXPECT_TRUE(
      throws_error([&] { d.run(); }, op, "workspace", "not " + std::to_string(align) + "-byte aligned (0x"));
  check_cuda(cudaDeviceSynchronize());
  const auto r = d.download();
  EXPECT_TRUE(is_sentinel(r.o));
  EXPECT_TRUE(is_sentinel(r.lse));
  EXPECT_EQ(d.fault(), "");
}

}  // namespace latentkv::testing
