// FP8 e4m3fn and bf16 codecs, and the block scale rule (SPEC section 3), bit for bit.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>

#include "latentkv/fp8.hpp"
#include "support/rng.hpp"

namespace latentkv::testing {
namespace {

// The value of an e4m3fn code written out from the format's definition (NaN for S.1111.111).
double e4m3_by_definition(int code) {
  const int sign = code >> 7, e = (code >> 3) & 15, m = code & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double magnitude = e == 0 ? (m / 8.0) * std::pow(2.0, -6) : (1.0 + m / 8.0) * std::pow(2.0, e - 7);
  return sign ? -magnitude : magnitude;
}

std::uint32_t bits_of(float x) { return std::bit_cast<std::uint32_t>(x); }

TEST(Fp8Codec, DecodesAll256Codes) {
  for (int c = 0; c < 256; ++c) {
    const double want = e4m3_by_definition(c);
    const float got = fp8_e4m3_decode(static_cast<std::uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code 0x" << std::hex << c;
    } else {
      EXPECT_EQ(static_cast<double>(got), want) << "code 0x" << std::hex << c;
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "code 0x" << std::hex << c;
    }
  }
  EXPECT_EQ(fp8_e4m3_decode(0x7E), 448.0f);
  EXPECT_EQ(fp8_e4m3_decode(0xFE), -448.0f);
  EXPECT_EQ(fp8_e4m3_decode(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(fp8_e4m3_decode(0x08), std::ldexp(1.0f, -6));
  EXPECT_EQ(fp8_e4m3_decode(0x38), 1.0f);
}

TEST(Fp8Codec, EncodeInvertsDecodeForEveryFiniteCode) {
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;  // NaN
    EXPECT_EQ(fp8_e4m3_encode(fp8_e4m3_decode(static_cast<std::uint8_t>(c))), c) << "code 0x" << std::hex << c;
  }
  EXPECT_EQ(fp8_e4m3_encode(0.0f), 0x00);
  EXPECT_EQ(fp8_e4m3_encode(-0.0f), 0x80);
}

TEST(Fp8Codec, MidpointsRoundToEvenAndNeighboursRoundToNearest) {
  // Adjacent positive codes c, c+1 (0x00 .. 0x7E): the midpoint goes to the even code, anything just
  // above to c+1, anything just below to c. Midpoints have at most 5 significant bits: exact floats.
  for (int c = 0; c < 0x7E; ++c) {
    const float lo = fp8_e4m3_decode(static_cast<std::uint8_t>(c));
    const float hi = fp8_e4m3_decode(static_cast<std::uint8_t>(c + 1));
    const float mid = (lo + hi) / 2;
    ASSERT_EQ(static_cast<double>(mid), (static_cast<double>(lo) + hi) / 2) << "midpoint not exact";
    const int even = (c % 2 == 0) ? c : c + 1;
    EXPECT_EQ(fp8_e4m3_encode(mid), even) << "midpoint " << mid << " between codes 0x" << std::hex << c;
    EXPECT_EQ(fp8_e4m3_encode(std::nextafter(mid, 1e9f)), c + 1) << "just above " << mid;
    EXPECT_EQ(fp8_e4m3_encode(std::nextafter(mid, 0.0f)), c) << "just below " << mid;
    // Negative mirror.
    EXPECT_EQ(fp8_e4m3_encode(-mid), even | 0x80) << "midpoint -" << mid;
    EXPECT_EQ(fp8_e4m3_encode(-std::nextafter(mid, 1e9f)), (c + 1) | 0x80);
    EXPECT_EQ(fp8_e4m3_encode(-std::nextafter(mid, 0.0f)), c | 0x80);
  }
}

TEST(Fp8Codec, SubnormalsAndZero) {
  EXPECT_EQ(fp8_e4m3_encode(std::ldexp(1.0f, -10)), 0x00);  // half the smallest subnormal: tie to 0
  EXPECT_EQ(fp8_e4m3_encode(-std::ldexp(1.0f, -10)), 0x80);
  EXPECT_EQ(fp8_e4m3_encode(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(fp8_e4m3_encode(std::ldexp(1.0f, -9)), 0x01);
  EXPECT_EQ(fp8_e4m3_encode(3 * std::ldexp(1.0f, -10)), 0x02);  // 1.5 * 2^-9: tie to even 2
  EXPECT_EQ(fp8_e4m3_encode(5 * std::ldexp(1.0f, -10)), 0x02);  // 2.5 * 2^-9: tie to even 2
  EXPECT_EQ(fp8_e4m3_encode(15 * std::ldexp(1.0f, -10)), 0x08);  // 7.5 * 2^-9: to the smallest normal
  EXPECT_EQ(fp8_e4m3_encode(1e-30f), 0x00);
  EXPECT_EQ(fp8_e4m3_encode(std::numeric_limits<float>::denorm_min()), 0x00);
  EXPECT_EQ(fp8_e4m3_encode(-1e-30f), 0x80);
}

TEST(Fp8Codec, SaturatesAtTheTop) {
  EXPECT_EQ(fp8_e4m3_encode(448.0f), 0x7E);
  EXPECT_EQ(fp8_e4m3_encode(464.0f), 0x7E);  // tie between 448 (even) and 480 (would be NaN)
  EXPECT_EQ(fp8_e4m3_encode(std::nextafter(464.0f, 0.0f)), 0x7E);
  EXPECT_EQ(fp8_e4m3_encode(464.0001f), 0x7E);  // beyond the tie: saturated, not NaN
  EXPECT_EQ(fp8_e4m3_encode(480.0f), 0x7E);
  EXPECT_EQ(fp8_e4m3_encode(1e30f), 0x7E);
  EXPECT_EQ(fp8_e4m3_encode(std::numeric_limits<float>::max()), 0x7E);
  EXPECT_EQ(fp8_e4m3_encode(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(fp8_e4m3_encode(-464.0f), 0xFE);
  EXPECT_EQ(fp8_e4m3_encode(-464.0001f), 0xFE);
  EXPECT_EQ(fp8_e4m3_encode(-1e30f), 0xFE);
  EXPECT_EQ(fp8_e4m3_encode(-std::numeric_limits<float>::infinity()), 0xFE);
  // NaN of either sign encodes as 0x7F, as the device's cvt.rn.satfinite.e4m3x2 does (seen on an
  // H200: tests/gpu/test_fp8_codec.cu checks the two agree).
  EXPECT_EQ(fp8_e4m3_encode(std::numeric_limits<float>::quiet_NaN()), 0x7F);
  EXPECT_EQ(fp8_e4m3_encode(-std::numeric_limits<float>::quiet_NaN()), 0x7F);
}

TEST(Fp8Codec, RandomValuesRoundToANearestCode) {
  Rng rng = test_rng();
  for (int i = 0; i < 20000; ++i) {
    const float x = static_cast<float>(rng.normal(0.0, std::exp2(rng.uniform(-12, 9))));
    const std::uint8_t c = fp8_e4m3_encode(x);
    const double got = fp8_e4m3_decode(c);
    const double err = std::fabs(got - x);
    // No finite code is strictly closer (above 448 the answer is 448 by saturation).
    for (int other = 0; other < 256; ++other) {
      if ((other & 0x7F) == 0x7F) continue;
      if (std::fabs(x) >= 448.0f) break;
      ASSERT_LE(err, std::fabs(e4m3_by_definition(other) - x)) << "x=" << x << " code 0x" << std::hex << int(c);
    }
  }
}

TEST(Bf16Codec, RoundsToNearestEven) {
  const float one = 1.0f;
  const float ulp = std::ldexp(1.0f, -7);  // bf16 spacing at 1
  EXPECT_EQ(bf16_encode(one), 0x3F80);
  EXPECT_EQ(bf16_encode(one + ulp / 2), 0x3F80);      // tie, 0x3F80 even
  EXPECT_EQ(bf16_encode(std::nextafter(one + ulp / 2, 2.0f)), 0x3F81);
  EXPECT_EQ(bf16_encode(std::nextafter(one + ulp / 2, 0.0f)), 0x3F80);
  EXPECT_EQ(bf16_encode(one + 3 * ulp / 2), 0x3F82);  // tie between 0x3F81 and 0x3F82 (even)
  EXPECT_EQ(bf16_encode(-(one + 3 * ulp / 2)), 0xBF82);
  EXPECT_EQ(bf16_encode(-(one + ulp / 2)), 0xBF80);
  EXPECT_EQ(bf16_encode(std::numeric_limits<float>::infinity()), 0x7F80);
  EXPECT_EQ(bf16_encode(-std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_EQ(bf16_encode(std::numeric_limits<float>::max()), 0x7F80);  // rounds up to inf
  EXPECT_EQ(bf16_encode(0.0f), 0x0000);
  EXPECT_EQ(bf16_encode(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(bf16_decode(bf16_encode(std::numeric_limits<float>::quiet_NaN()))));
  // A NaN whose payload sits only in the low 16 bits must stay NaN (not become inf).
  EXPECT_TRUE(std::isnan(bf16_decode(bf16_encode(std::bit_cast<float>(0x7F800001u)))));
}

// From a double, rounded once: values within a float ulp of a bf16 tie go to their own side.
TEST(Bf16Codec, DoublesRoundOnceToNearestEven) {
  const double one = 1.0, ulp = std::ldexp(1.0, -7);  // bf16 spacing at 1
  const double tiny = std::ldexp(1.0, -40);          // far below a float ulp at 1 (2^-23)
  EXPECT_EQ(bf16_encode_double(one + ulp / 2), 0x3F80);         // the tie itself: even
  EXPECT_EQ(bf16_encode_double(one + ulp / 2 + tiny), 0x3F81);  // through float: the tie, then 0x3F80
  EXPECT_EQ(bf16_encode(static_cast<float>(one + ulp / 2 + tiny)), 0x3F80);
  EXPECT_EQ(bf16_encode_double(one + ulp / 2 - tiny), 0x3F80);
  EXPECT_EQ(bf16_encode_double(one + 3 * ulp / 2 - tiny), 0x3F81);  // below the tie whose even side is 0x3F82
  EXPECT_EQ(bf16_encode_double(-(one + ulp / 2 + tiny)), 0xBF81);
  EXPECT_EQ(bf16_encode_double(-(one + 3 * ulp / 2 - tiny)), 0xBF81);
  EXPECT_EQ(bf16_encode_double(1.0039062500009095), 0x3F81);
  // Past the largest bf16's half step: infinity, as for floats.
  EXPECT_EQ(bf16_encode_double(static_cast<double>(std::numeric_limits<float>::max())), 0x7F80);
  EXPECT_EQ(bf16_encode_double(std::numeric_limits<double>::infinity()), 0x7F80);
  EXPECT_EQ(bf16_encode_double(-0.0), 0x8000);
  EXPECT_TRUE(std::isnan(bf16_decode(bf16_encode_double(std::numeric_limits<double>::quiet_NaN()))));
  // Elsewhere it agrees with the float path: every bf16 value, and points between neighbours.
  for (std::uint32_t b = 0; b < 0x7F80; b += 7) {
    const double x = bf16_decode(static_cast<std::uint16_t>(b));
    ASSERT_EQ(bf16_encode_double(x), b);
    const double between = 0.25 * x + 0.75 * static_cast<double>(bf16_decode(static_cast<std::uint16_t>(b + 1)));
    ASSERT_EQ(bf16_encode_double(between), b + 1) << "pattern 0x" << std::hex << b;
  }
}

TEST(Bf16Codec, EncodeInvertsDecodeForEveryPattern) {
  for (std::uint32_t b = 0; b < 0x10000; ++b) {
    const float x = bf16_decode(static_cast<std::uint16_t>(b));
    ASSERT_EQ(bits_of(x), b << 16);
    if (std::isnan(x)) continue;
    ASSERT_EQ(bf16_encode(x), b) << "pattern 0x" << std::hex << b;
  }
}

TEST(BlockScale, Pow2IsTheSmallestPowerOfTwoThatFits) {
  EXPECT_EQ(fp8_block_scale(448.0f, ScaleMode::kPow2), 1.0f);        // exact power of two: 2^0
  EXPECT_EQ(fp8_block_scale(896.0f, ScaleMode::kPow2), 2.0f);
  EXPECT_EQ(fp8_block_scale(56.0f, ScaleMode::kPow2), 0.125f);
  EXPECT_EQ(fp8_block_scale(449.0f, ScaleMode::kPow2), 2.0f);
  EXPECT_EQ(fp8_block_scale(447.0f, ScaleMode::kPow2), 1.0f);
  EXPECT_EQ(fp8_block_scale(57.0f, ScaleMode::kPow2), 0.25f);
  EXPECT_EQ(fp8_block_scale(1.0f, ScaleMode::kPow2), std::ldexp(1.0f, -8));   // 1/448 -> 2^-8
  EXPECT_EQ(fp8_block_scale(3.0f, ScaleMode::kPow2), std::ldexp(1.0f, -7));
  // The 1e-4 clamp: 1e-4 / 448 = 2.23e-7 -> 2^-22.
  EXPECT_EQ(fp8_block_scale(0.0f, ScaleMode::kPow2), std::ldexp(1.0f, -22));
  EXPECT_EQ(fp8_block_scale(1e-9f, ScaleMode::kPow2), std::ldexp(1.0f, -22));
  EXPECT_EQ(fp8_block_scale(kScaleAmaxFloor, ScaleMode::kPow2), std::ldexp(1.0f, -22));

  Rng rng = test_rng();
  for (int i = 0; i < 5000; ++i) {
    const float amax = static_cast<float>(std::exp2(rng.uniform(-12, 14)));
    const float s = fp8_block_scale(amax, ScaleMode::kPow2);
    int e = 0;
    ASSERT_EQ(std::frexp(s, &e), 0.5f) << "not a power of two: " << s;
    ASSERT_LE(amax / s, 448.0f) << amax;
    ASSERT_GT(amax / s, 224.0f) << amax;  // the next smaller power would overflow
  }
}

TEST(BlockScale, ExactIsAmaxOver448) {
  EXPECT_EQ(fp8_block_scale(448.0f, ScaleMode::kExact), 1.0f);
  EXPECT_EQ(fp8_block_scale(3.0f, ScaleMode::kExact), 3.0f / 448.0f);
  EXPECT_EQ(fp8_block_scale(0.0f, ScaleMode::kExact), 1e-4f / 448.0f);
  EXPECT_EQ(fp8_block_scale(5e-5f, ScaleMode::kExact), 1e-4f / 448.0f);
  EXPECT_EQ(fp8_e4m3_encode(3.0f / fp8_block_scale(3.0f, ScaleMode::kExact)), 0x7E);
}

}  // namespace
}  // namespace latentkv::testing
