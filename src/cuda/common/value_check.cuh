// src/cuda/common/value_check.cuh - the reference's value checks of inputs (validate.cpp: no
// non-finite bf16 or float, no NaN fp8 code) on the device, for kernels that make them as they
// stage their inputs and for value_check.cu's kernel. A value found bad goes to the call's record.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/common/device_fault.cuh"

namespace latentkv::cuda {

// Whether a bf16 (exponent all ones: inf or NaN) or float is not finite.
__device__ __forceinline__ bool nonfinite_bf16(std::uint32_t bits) { return (bits & 0x7F80u) == 0x7F80u; }
__device__ __forceinline__ bool nonfinite_f32(float x) { return (__float_as_uint(x) & 0x7F800000u) == 0x7F800000u; }

// The e4m3 NaN codes (0x7F, 0xFF) among a word's four codes: the top bit of each such byte. Low 7
// bits all ones carry into the top bit when one is added, and no byte carries into the next.
__device__ __forceinline__ std::uint32_t fp8_nan_bytes(std::uint32_t w) {
  return ((w & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
}

// The first non-finite value among the 8 bf16 of `v` (its place 0 .. 7, its bits in `bits`), or -1.
__device__ __forceinline__ int first_nonfinite_bf16x8(const uint4& v, std::uint32_t& bits) {
  const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
  int first = -1;
#pragma unroll
  for (int e = 7; e >= 0; --e) {  // from the last, so that the first bad one is kept
    const std::uint32_t b = (words[e / 2] >> (16 * (e % 2))) & 0xFFFFu;
    if (nonfinite_bf16(b)) {
      first = e;
      bits = b;
    }
  }
  return first;
}

// The first NaN code among the 16 fp8 codes of `v` (its place 0 .. 15, the code in `code`), or -1.
__device__ __forceinline__ int first_nan_fp8x16(const uint4& v, std::uint32_t& code) {
  const std::uint32_t words[4] = {v.x, v.y, v.z, v.w};
  int first = -1;
#pragma unroll
  for (int k = 3; k >= 0; --k) {
    const std::uint32_t nan = fp8_nan_bytes(words[k]);
    if (nan != 0) {
      const int byte = (__ffs(static_cast<int>(nan)) - 1) / 8;
      first = 4 * k + byte;
      code = (words[k] >> (8 * byte)) & 0xFFu;
    }
  }
  return first;
}

// Notes the first bad value of `v` as element first + its place of the argument that `code` names.
__device__ __forceinline__ void note_nonfinite_bf16x8(const FaultSink& sink, DeviceFaultCode code, std::int64_t first,
                                                      const uint4& v) {
  std::uint32_t bits = 0;
  const int e = first_nonfinite_bf16x8(v, bits);
  if (e >= 0) record_fault(sink, code, {.index = first + e, .value = bits});
}
__device__ __forceinline__ void note_nan_fp8x16(const FaultSink& sink, DeviceFaultCode code, std::int64_t first,
                                                const uint4& v) {
  std::uint32_t byte = 0;
  const int e = first_nan_fp8x16(v, byte);
  if (e >= 0) record_fault(sink, code, {.index = first + e, .value = byte});
}

// Notes float element `index` when it is not finite.
__device__ __forceinline__ void note_nonfinite_f32(const FaultSink& sink, DeviceFaultCode code, std::int64_t index,
                                                   float x) {
  if (nonfinite_f32(x)) record_fault(sink, code, {.index = index, .value = __float_as_uint(x)});
}

}  // namespace latentkv::cuda
