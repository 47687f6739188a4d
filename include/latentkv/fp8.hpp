// latentkv/fp8.hpp - bit-exact host conversions for the cache formats (SPEC section 3).
#pragma once

#include <cstdint>

namespace latentkv {

// FP8 e4m3fn: round to nearest even, saturating to +-448 (as CUDA's
// __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)); NaN of either sign encodes as 0x7F, as on the device.
std::uint8_t fp8_e4m3_encode(float x);
float fp8_e4m3_decode(std::uint8_t code);
inline constexpr float kFp8E4M3Max = 448.0f;

// bfloat16 stored as its 16-bit pattern; encode rounds to nearest even, keeps NaN a quiet NaN.
std::uint16_t bf16_encode(float x);
float bf16_decode(std::uint16_t bits);
// A double rounded once, straight to the nearest bf16 (even on a tie), as the float64 reference
// stores its bf16 outputs. (Through float first, a value just off a bf16 tie could become the tie
// and then round the wrong way.)
std::uint16_t bf16_encode_double(double x);

enum class ScaleMode {
  kPow2,   // scale = 2^ceil(log2(amax / 448)), the default (DeepSeek's deployed form)
  kExact,  // scale = amax / 448
};

// The float32 scale for a block whose largest magnitude is `amax` (clamped below at 1e-4).
// Computed with exactly representable steps so host and device agree to the bit.
float fp8_block_scale(float amax, ScaleMode mode);
inline constexpr float kScaleAmaxFloor = 1e-4f;

// The bf16 magnitude (bits & 0x7FFF) from which a value cannot be stored in an fp8 block under a
// pow2 scale: from 248 x 2^120 (3.29649e+38) the block's scale is 2^120 and the value rounds to the
// code 256, so it reads back as 2^128, inf in float32. The append refuses such values; exact scales
// hold every finite bf16.
inline constexpr std::uint16_t kPow2StorableMagnitudeBits = 0x7F78;

}  // namespace latentkv
