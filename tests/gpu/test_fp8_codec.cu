// The device's fp8 conversion (what append uses) against the host codec, bit for bit.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cuda/common/convert.cuh"
#include "latentkv/fp8.hpp"
#include "support/rng.hpp"
#include "gpu/device.hpp"

namespace latentkv::testing {
namespace {

__global__ void encode_kernel(const float* in, std::uint8_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = cuda::encode_fp8(in[i]);
}

__global__ void scale_kernel(const float* amax, float* out, int n, bool pow2) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = cuda::block_scale(amax[i], pow2);
}

__global__ void decode_pairs_kernel(const std::uint16_t* pairs, std::uint32_t* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = cuda::fp8x2_to_bf16x2(pairs[i]);
}

__global__ void decode_words_f16_kernel(const std::uint32_t* words, uint2* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = make_uint2(cuda::fp8x2_to_f16x2(words[i]), cuda::fp8x2_hi_to_f16x2(words[i]));
}

// Every code's value, the midpoints between neighbours and a hair either side, the saturation
// region, subnormal boundaries, infinities, and random floats over the whole exponent range.
std::vector<float> interesting_floats() {
  std::vector<float> v;
  for (int c = 0; c < 256; ++c) {
    const float x = fp8_e4m3_decode(static_cast<std::uint8_t>(c));
    if (std::isnan(x)) continue;
    v.push_back(x);
    const float next = fp8_e4m3_decode(static_cast<std::uint8_t>((c & 0x80) | ((c & 0x7F) + 1)));
    if ((c & 0x7F) < 0x7E && !std::isnan(next)) {
      const float mid = 0.5f * (x + next);
      v.push_back(mid);
      v.push_back(std::nextafter(mid, 0.0f));
      v.push_back(std::nextafter(mid, std::copysign(1e30f, mid)));
    }
  }
  for (float x : {448.0f, 455.99f, 456.0f, 464.0f, std::nextafter(464.0f, 1e9f), 480.0f, 1e6f, 3.4e38f,
                  std::numeric_limits<float>::infinity(), 0x1p-10f, std::nextafter(0x1p-10f, 1.0f), 0x1p-11f,
                  1e-30f, 0.0f}) {
    v.push_back(x);
    v.push_back(-x);
  }
  Rng rng = test_rng();
  for (int i = 0; i < 20000; ++i) {
    v.push_back(static_cast<float>(std::ldexp(rng.uniform(-1.0, 1.0), static_cast<int>(rng.uniform_int(-14, 10)))));
  }
  return v;
}

TEST(GpuFp8, EncodeMatchesHostBitForBit) {
  LKV_REQUIRE_GPU();
  const std::vector<float> in = interesting_floats();
  DeviceBuffer d_in(in);
  DeviceBuffer d_out(in.size());
  encode_kernel<<<static_cast<unsigned>((in.size() + 255) / 256), 256>>>(d_in.get<float>(), d_out.get<std::uint8_t>(),
                                                                      static_cast<int>(in.size()));
  LKV_CUDA_OK(cudaDeviceSynchronize());
  const auto out = d_out.to_host<std::uint8_t>();
  int mismatches = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const std::uint8_t host = fp8_e4m3_encode(in[i]);
    if (host != out[i] && ++mismatches <= 10) {
      ADD_FAILURE() << "x = " << in[i] << " (bits 0x" << std::hex << std::bit_cast<std::uint32_t>(in[i])
                    << "): device 0x" << int(out[i]) << ", host 0x" << int(host) << std::dec;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST(GpuFp8, NanEncodesLikeTheHost) {
  LKV_REQUIRE_GPU();
  const std::vector<float> in = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN()};
  DeviceBuffer d_in(in);
  DeviceBuffer d_out(in.size());
  encode_kernel<<<1, 32>>>(d_in.get<float>(), d_out.get<std::uint8_t>(), 2);
  LKV_CUDA_OK(cudaDeviceSynchronize());
  const auto out = d_out.to_host<std::uint8_t>();
  // Both must be NaN codes; record the exact pattern the device produces next to the host's.
  EXPECT_EQ(out[0] & 0x7F, 0x7F);
  EXPECT_EQ(out[1] & 0x7F, 0x7F);
  RecordProperty("device_nan_codes", std::to_string(out[0]) + "," + std::to_string(out[1]));
  EXPECT_EQ(out[0], fp8_e4m3_encode(in[0]));
  EXPECT_EQ(out[1], fp8_e4m3_encode(in[1]));
}

TEST(GpuFp8, BlockScaleMatchesHost) {
  LKV_REQUIRE_GPU();
  std::vector<float> amax = {0.0f, 1e-5f, 1e-4f, 448.0f, 896.0f, 1.0f, 3.5f, 0.4375f, 1e6f, 7.0f / 448.0f};
  Rng rng = test_rng();
  for (int i = 0; i < 5000; ++i) amax.push_back(static_cast<float>(std::ldexp(rng.uniform(0.5, 1.0), static_cast<int>(rng.uniform_int(-20, 20)))));
  for (bool pow2 : {true, false}) {
    DeviceBuffer d_in(amax);
    DeviceBuffer d_out(amax.size() * sizeof(float));
    scale_kernel<<<static_cast<unsigned>((amax.size() + 255) / 256), 256>>>(d_in.get<float>(), d_out.get<float>(),
                                                                           static_cast<int>(amax.size()), pow2);
    LKV_CUDA_OK(cudaDeviceSynchronize());
    const auto out = d_out.to_host<float>();
    for (std::size_t i = 0; i < amax.size(); ++i) {
      const float host = fp8_block_scale(amax[i], pow2 ? ScaleMode::kPow2 : ScaleMode::kExact);
      ASSERT_EQ(std::bit_cast<std::uint32_t>(out[i]), std::bit_cast<std::uint32_t>(host))
          << "amax " << amax[i] << (pow2 ? " pow2" : " exact");
    }
  }
}

TEST(GpuFp8, PairsDecodeExactlyToBf16) {
  LKV_REQUIRE_GPU();
  std::vector<std::uint16_t> pairs;
  for (int lo = 0; lo < 256; ++lo) {
    for (int hi = 0; hi < 256; hi += 17) pairs.push_back(static_cast<std::uint16_t>(lo | (hi << 8)));
  }
  DeviceBuffer d_in(pairs);
  DeviceBuffer d_out(pairs.size() * 4);
  decode_pairs_kernel<<<static_cast<unsigned>((pairs.size() + 255) / 256), 256>>>(
      d_in.get<std::uint16_t>(), d_out.get<std::uint32_t>(), static_cast<int>(pairs.size()));
  LKV_CUDA_OK(cudaDeviceSynchronize());
  const auto out = d_out.to_host<std::uint32_t>();
  for (std::size_t i = 0; i < pairs.size(); ++i) {
    for (int h = 0; h < 2; ++h) {
      const auto code = static_cast<std::uint8_t>(pairs[i] >> (8 * h));
      const float want = fp8_e4m3_decode(code);
      const float got = bf16_decode(static_cast<std::uint16_t>(out[i] >> (16 * h)));
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << "code " << int(code);
      } else {
        ASSERT_EQ(got, want) << "code " << int(code);
      }
    }
  }
}

// The f16 conversion of the narrow and wgmma decode kernels and the indexer: every code in every
// byte position of a word, the low half's two codes by fp8x2_to_f16x2, the high half's by
// fp8x2_hi_to_f16x2; exact for finite codes (sign of zero included), NaN for the two NaN codes.
TEST(GpuFp8, WordsDecodeExactlyToF16) {
  LKV_REQUIRE_GPU();
  std::vector<std::uint32_t> words;
  for (int c = 0; c < 256; ++c) {
    for (int other = 0; other < 256; other += 51) {
      for (int pos = 0; pos < 4; ++pos) {
        std::uint32_t w = 0x01010101u * static_cast<std::uint32_t>(other);
        w = (w & ~(0xFFu << (8 * pos))) | (static_cast<std::uint32_t>(c) << (8 * pos));
        words.push_back(w);
      }
    }
  }
  DeviceBuffer d_in(words);
  DeviceBuffer d_out(words.size() * sizeof(uint2));
  decode_words_f16_kernel<<<static_cast<unsigned>((words.size() + 255) / 256), 256>>>(
      d_in.get<std::uint32_t>(), d_out.get<uint2>(), static_cast<int>(words.size()));
  LKV_CUDA_OK(cudaDeviceSynchronize());
  const auto out = d_out.to_host<std::uint32_t>();  // codes 0-1, codes 2-3 per word
  for (std::size_t i = 0; i < words.size(); ++i) {
    for (int pos = 0; pos < 4; ++pos) {
      const auto code = static_cast<std::uint8_t>(words[i] >> (8 * pos));
      const auto bits = static_cast<std::uint16_t>(out[2 * i + pos / 2] >> (16 * (pos % 2)));
      const float got = __half2float(__ushort_as_half(bits));
      const float want = fp8_e4m3_decode(code);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(got)) << "code " << int(code) << " in byte " << pos;
      } else {
        ASSERT_EQ(got, want) << "code " << int(code) << " in byte " << pos;
        ASSERT_EQ(std::signbit(got), std::signbit(want)) << "code " << int(code) << " in byte " << pos;
      }
    }
  }
}

}  // namespace
}  // namespace latentkv::testing
