#include "latentkv/fp8.hpp"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

namespace latentkv {

std::uint8_t fp8_e4m3_encode(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80u);
  if (std::isnan(x)) return 0x7Fu;  // the device's cvt drops the sign of a NaN
  const double a = std::fabs(static_cast<double>(x));
  // Everything at or above 464 (448 + half an ulp, which rounds up to the NaN pattern) saturates;
  // exactly 464 is a tie that rounds to even, i.e. down to 448. Infinity saturates too.
  if (a > 464.0) return static_cast<std::uint8_t>(sign | 0x7Eu);
  std::uint32_t code;
  if (a < 0x1p-6) {
    // Subnormals step by 2^-9; a result of 8 is the smallest normal (exponent field 1, mantissa 0).
    code = static_cast<std::uint32_t>(std::nearbyint(a * 0x1p9));
  } else {
    int e = 0;
    const double m = std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    auto mant = static_cast<std::uint32_t>(std::nearbyint((m * 2.0 - 1.0) * 8.0));
    int exp_field = e - 1 + 7;
    if (mant == 8) {
      mant = 0;
      ++exp_field;
    }
    code = (static_cast<std::uint32_t>(exp_field) << 3) | mant;
  }
  code = std::min<std::uint32_t>(code, 0x7Eu);
  return static_cast<std::uint8_t>(sign | code);
}

float fp8_e4m3_decode(std::uint8_t code) {
  const bool negative = (code & 0x80u) != 0;
  const int exp_field = (code >> 3) & 0xF;
  const int mant = code & 0x7;
  float v;
  if (exp_field == 0xF && mant == 0x7) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (exp_field == 0) {
    v = std::ldexp(static_cast<float>(mant), -9);
  } else {
    v = std::ldexp(1.0f + static_cast<float>(mant) / 8.0f, exp_field - 7);
  }
  return negative ? -v : v;
}

std::uint16_t bf16_encode(float x) {
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(x);
  if (std::isnan(x)) return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  const std::uint32_t rounding = 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

std::uint16_t bf16_encode_double(double x) {
  const float f = static_cast<float>(x);
  const std::uint32_t bits = std::bit_cast<std::uint32_t>(f);
  // f halfway between two bf16 values where x is not: x lies on one side, and rounds to it.
  if (std::isfinite(f) && (bits & 0xFFFFu) == 0x8000u && static_cast<double>(f) != x) {
    const bool away_from_zero = std::fabs(x) > std::fabs(static_cast<double>(f));
    return static_cast<std::uint16_t>((bits >> 16) + (away_from_zero ? 1u : 0u));
  }
  return bf16_encode(f);
}

float bf16_decode(std::uint16_t bits) { return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16); }

float fp8_block_scale(float amax, ScaleMode mode) {
  const float clamped = std::max(amax, kScaleAmaxFloor);
  const float ratio = clamped / kFp8E4M3Max;
  if (mode == ScaleMode::kExact) return ratio;
  // ceil(log2(ratio)) without a log: ratio = m * 2^e with m in [0.5, 1); an exact power of two
  // (m == 0.5) is 2^(e-1), anything else needs 2^e.
  int e = 0;
  const float m = std::frexp(ratio, &e);
  return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

}  // namespace latentkv
