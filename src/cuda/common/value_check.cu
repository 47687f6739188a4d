// The value check on its own (see value_check.hpp): a grid-stride pass over the tensor, 16 bytes a
// thread and step, the elements past the last whole 16 bytes one at a time.
#include "cuda/common/value_check.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "cuda/common/cuda_check.hpp"
#include "cuda/common/value_check.cuh"
#include "latentkv/error.hpp"

namespace latentkv::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxCtas = 1024;

// Element `index` (one of the tensor's scalars).
__device__ __forceinline__ void check_element(const ValueCheck& c, std::int64_t index) {
  if (c.dtype == DType::kF32) {
    note_nonfinite_f32(c.fault, c.code, index, static_cast<const float*>(c.data)[index]);
  } else if (c.dtype == DType::kBF16) {
    const std::uint32_t bits = static_cast<const std::uint16_t*>(c.data)[index];
    if (nonfinite_bf16(bits)) record_fault(c.fault, c.code, {.index = index, .value = bits});
  } else {
    const std::uint32_t code = static_cast<const std::uint8_t*>(c.data)[index];
    if ((code & 0x7Fu) == 0x7Fu) record_fault(c.fault, c.code, {.index = index, .value = code});
  }
}

__global__ void __launch_bounds__(kThreads) value_check_kernel(const ValueCheck c, std::int64_t pieces) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kThreads;
  const std::int64_t start = static_cast<std::int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int per_piece = c.dtype == DType::kBF16 ? 8 : c.dtype == DType::kFP8E4M3 ? 16 : 4;  // elements per 16 bytes
  for (std::int64_t i = start; i < pieces; i += stride) {
    const uint4 v = __ldg(static_cast<const uint4*>(c.data) + i);
    const std::int64_t first = i * per_piece;
    if (c.dtype == DType::kBF16) {
      note_nonfinite_bf16x8(c.fault, c.code, first, v);
    } else if (c.dtype == DType::kFP8E4M3) {
      note_nan_fp8x16(c.fault, c.code, first, v);
    } else {
      note_nonfinite_f32(c.fault, c.code, first, __uint_as_float(v.x));
      note_nonfinite_f32(c.fault, c.code, first + 1, __uint_as_float(v.y));
      note_nonfinite_f32(c.fault, c.code, first + 2, __uint_as_float(v.z));
      note_nonfinite_f32(c.fault, c.code, first + 3, __uint_as_float(v.w));
    }
  }
  for (std::int64_t i = pieces * per_piece + start; i < c.count; i += stride) check_element(c, i);
}

}  // namespace

void launch_value_check(const ValueCheck& check, cudaStream_t stream, const char* op) {
  if (check.fault.record == nullptr || check.count <= 0) return;
  if (check.dtype != DType::kBF16 && check.dtype != DType::kFP8E4M3 && check.dtype != DType::kF32) {
    throw Error(op, "value check", std::string(dtype_name(check.dtype)), "bf16, fp8_e4m3 or f32 values");
  }
  const auto size = static_cast<std::int64_t>(dtype_size(check.dtype));
  const bool aligned = reinterpret_cast<std::uintptr_t>(check.data) % 16 == 0;
  const std::int64_t pieces = aligned ? check.count * size / 16 : 0;
  const std::int64_t work = std::max<std::int64_t>(pieces, check.count - pieces * (16 / size));
  const auto ctas = static_cast<unsigned>(std::clamp<std::int64_t>((work + kThreads - 1) / kThreads, 1, kMaxCtas));
  value_check_kernel<<<ctas, kThreads, 0, stream>>>(check, pieces);
  LKV_CUDA_CHECK_LAUNCH(op);
}

}  // namespace latentkv::cuda
