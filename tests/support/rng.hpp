// tests/support/rng.hpp - seeded, printed, replayable random numbers for tests.
//
// Every test draws its randomness from test_rng(), whose seed is derived from one base seed and the
// running test's full name:
//   base seed  = $LKV_TEST_SEED (decimal or 0x-hex) when set, else kDefaultBaseSeed
//   test seed  = mix_seed(base seed, hash(suite.test[/param]) , stream)
// Both are printed on stdout and recorded as test properties ("base_seed", "seed"), so a failure is
// replayed exactly with `LKV_TEST_SEED=<base> ./latentkv_tests --gtest_filter=<the test>`, and a run
// with another LKV_TEST_SEED explores other inputs.
//
// The generator is splitmix64-based and its distributions are written out here (no
// std::normal_distribution), so a seed gives the same numbers with every standard library.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

namespace latentkv::testing {

inline constexpr std::uint64_t kDefaultBaseSeed = 20261129;

// What splitmix64 adds to its state per step.
inline constexpr std::uint64_t kSplitmixGamma = 0x9E3779B97F4A7C15ull;

// One step of splitmix64: a good 64-bit mixer.
inline std::uint64_t splitmix64(std::uint64_t& state) {
  std::uint64_t z = (state += kSplitmixGamma);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline std::uint64_t mix_seed(std::uint64_t a, std::uint64_t b) {
  std::uint64_t state = a ^ (b * 0xD6E8FEB86659FD93ull);
  return splitmix64(state);
}

// FNV-1a, for turning test names into seeds.
inline std::uint64_t hash_name(std::string_view s) {
  std::uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001B3ull;
  }
  return h;
}

// LKV_TEST_SEED when set (decimal, or hex with 0x), else kDefaultBaseSeed.
inline std::uint64_t base_seed() {
  const char* env = std::getenv("LKV_TEST_SEED");
  if (env == nullptr || *env == '\0') return kDefaultBaseSeed;
  return std::strtoull(env, nullptr, 0);
}

class Rng {
 public:
  explicit Rng(std::uint64_t seed) : seed_(seed), state_(seed) {}

  std::uint64_t seed() const { return seed_; }
  std::uint64_t next_u64() { return splitmix64(state_); }
  // Skips the next `draws` calls of next_u64 at once (the state steps by a constant each call), so
  // that a copy skipped ahead can draw, in another thread, what this generator would draw later.
  void discard(std::uint64_t draws) { state_ += draws * kSplitmixGamma; }

  // Uniform in [lo, hi).
  double uniform(double lo = 0.0, double hi = 1.0) {
    return lo + (hi - lo) * (static_cast<double>(next_u64() >> 11) * 0x1p-53);
  }
  // Uniform integer in [lo, hi] (inclusive).
  std::int64_t uniform_int(std::int64_t lo, std::int64_t hi) {
    const auto span = static_cast<std::uint64_t>(hi - lo) + 1;
    return lo + static_cast<std::int64_t>(span == 0 ? next_u64() : next_u64() % span);
  }
  bool coin(double p_true = 0.5) { return uniform() < p_true; }
  // Normal by Box-Muller.
  double normal(double mean = 0.0, double stddev = 1.0) {
    const double u1 = 1.0 - uniform();  // (0, 1]
    const double u2 = uniform();
    return mean + stddev * std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  // A fresh seed for a sub-generator or a PageAllocator shuffle (never 0, which means "unshuffled").
  std::uint64_t fork_seed() {
    const std::uint64_t s = next_u64();
    return s == 0 ? 1 : s;
  }

  // UniformRandomBitGenerator, for std::shuffle.
  using result_type = std::uint64_t;
  static constexpr result_type min() { return 0; }
  static constexpr result_type max() { return ~result_type{0}; }
  result_type operator()() { return next_u64(); }

 private:
  std::uint64_t seed_;
  std::uint64_t state_;
};

// The running test's full name ("Suite.Test" plus "/param" where parameterized); "" outside a test.
inline std::string current_test_name() {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  if (info == nullptr) return {};
  std::string name = std::string(info->test_suite_name()) + "." + info->name();
  return name;
}

// The generator of the running test (`stream` separates independent generators of one test). Prints
// and records the seeds.
inline Rng test_rng(std::string_view stream = {}) {
  const std::uint64_t base = base_seed();
  const std::string name = current_test_name();
  const std::uint64_t seed = mix_seed(mix_seed(base, hash_name(name)), hash_name(stream));
  const std::string label = name + (stream.empty() ? std::string() : " stream " + std::string(stream));
  std::printf("[   seed   ] %s: seed 0x%016llx from base seed %llu (replay: LKV_TEST_SEED=%llu)\n", label.c_str(),
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(base),
              static_cast<unsigned long long>(base));
  std::fflush(stdout);
  if (::testing::UnitTest::GetInstance()->current_test_info() != nullptr) {
    ::testing::Test::RecordProperty("base_seed", std::to_string(base));
    ::testing::Test::RecordProperty(stream.empty() ? std::string("seed") : "seed." + std::string(stream),
                                    std::to_string(seed));
  }
  return Rng(seed);
}

}  // namespace latentkv::testing
