// src/cuda/common/convert.cuh - device conversions matching the host codecs of latentkv/fp8.hpp bit for bit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

namespace latentkv::cuda {

inline constexpr float kFp8Max = 448.0f;
inline constexpr float kAmaxFloor = 1e-4f;

// scale for a block with largest magnitude amax; the host's fp8_block_scale step for step.
__device__ __forceinline__ float block_scale(float amax, bool pow2) {
  const float ratio = __fdiv_rn(fmaxf(amax, kAmaxFloor), kFp8Max);
  if (!pow2) return ratio;
  int e = 0;
  const float m = frexpf(ratio, &e);
  return ldexpf(1.0f, m == 0.5f ? e - 1 : e);
}

__device__ __forceinline__ std::uint8_t encode_fp8(float x) {
  return static_cast<std::uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float bf16_bits_to_float(std::uint16_t bits) {
  return __uint_as_float(static_cast<std::uint32_t>(bits) << 16);
}

// 16 bf16 values held in two 16-byte words, as floats; returns their largest magnitude.
__device__ __forceinline__ float unpack_bf16x16(const uint4& w0, const uint4& w1, float (&v)[16]) {
  const std::uint32_t words[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    v[2 * i] = bf16_bits_to_float(static_cast<std::uint16_t>(words[i] & 0xFFFFu));
    v[2 * i + 1] = bf16_bits_to_float(static_cast<std::uint16_t>(words[i] >> 16));
    amax = fmaxf(amax, fmaxf(fabsf(v[2 * i]), fabsf(v[2 * i + 1])));
  }
  return amax;
}

// Two packed fp8 e4m3 codes (low byte first) to two packed bf16 values; exact (every e4m3 value is
// a bf16 value). One cvt to f16x2 (sm_89+), then to float and bf16.
__device__ __forceinline__ std::uint32_t fp8x2_to_bf16x2(std::uint16_t two_codes) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_codes), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  const __nv_bfloat162 b = __float22bfloat162_rn(f);
  return *reinterpret_cast<const std::uint32_t*>(&b);
}

__device__ __forceinline__ std::uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const std::uint32_t*>(&b);
}

// x = hi + lo with hi, lo bf16: hi = bf16(x), lo = bf16(x - hi); |x - hi - lo| <= 2^-17 |x|.
__device__ __forceinline__ void split_bf16x2(float x0, float x1, std::uint32_t& hi, std::uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const std::uint32_t*>(&h);
  lo = *reinterpret_cast<const std::uint32_t*>(&l);
}

}  // namespace latentkv::cuda

namespace latentkv::cuda {

// The two fp8 e4m3 codes in the low (bytes 0, 1) or high (bytes 2, 3) half of a word to two packed
// f16 values (low byte first): exact, one instruction each. The high half is selected by the
// conversion itself (an operand selector in SASS), with no shift before it.
__device__ __forceinline__ std::uint32_t fp8x2_to_f16x2(std::uint32_t codes) {
  std::uint32_t r;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n" : "=r"(r) : "r"(codes));
  return r;
}
__device__ __forceinline__ std::uint32_t fp8x2_hi_to_f16x2(std::uint32_t codes) {
  std::uint32_t r;
  asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n" : "=r"(r) : "r"(codes));
  return r;
}

// x = hi + lo with hi, lo f16.
__device__ __forceinline__ void split_f16x2(float x0, float x1, std::uint32_t& hi, std::uint32_t& lo) {
  const __half2 h = __floats2half2_rn(x0, x1);
  const float2 hf = __half22float2(h);
  const __half2 l = __floats2half2_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const std::uint32_t*>(&h);
  lo = *reinterpret_cast<const std::uint32_t*>(&l);
}

}  // namespace latentkv::cuda
