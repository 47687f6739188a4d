// tests/support/compare.hpp - comparing an op's output with a reference (SPEC section 5).
//
// Per element: |a - b| <= atol or |a - b| <= rtol * |b| (b the expected value); NaN must meet NaN
// and an infinity the same infinity, exactly. Over the whole tensor: 1 - cos(a, b) <= bound,
// computed over the elements where both are finite. A float output (HostTensor) element that still
// holds its sentinel fails whatever was expected: the sentinels are NaN, so NaN expected must not
// let an element the op never wrote pass. The result names the worst element (its
// multi-index, both values, the error and the bound it broke) so that a failure reads by itself:
//
//   EXPECT_TRUE(compare("o", o, expected_o, Tolerance::bf16_output()));
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "support/host_tensor.hpp"

namespace latentkv::testing {

struct Tolerance {
  double atol = 1e-3;
  double rtol = 2.0 / 128.0;
  double max_one_minus_cos = 5e-6;  // < 0: no cosine bound

  // SPEC section 5, bf16 outputs (o of the attention ops).
  static Tolerance bf16_output() { return {1e-3, 2.0 / 128.0, 5e-6}; }
  // SPEC section 5, lse: within 1e-5 absolute.
  static Tolerance lse() { return {1e-5, 0.0, -1.0}; }
  // float32 outputs computed in float64 and rounded once (indexer logits).
  static Tolerance f32_output() { return {1e-5, 1e-6, 1e-10}; }
  // Two float64 computations of the same math in different orders.
  static Tolerance float64(double eps = 1e-9) { return {eps, eps, eps}; }
  static Tolerance exact() { return {0.0, 0.0, -1.0}; }
};

struct Comparison {
  bool ok = true;
  std::string name;
  std::vector<std::int64_t> shape;
  std::int64_t count = 0;
  std::int64_t failures = 0;          // elements outside the tolerance
  std::int64_t special_failures = 0;  // NaN/inf where the other side differs
  std::int64_t unwritten = 0;         // elements still holding the sentinel
  std::int64_t first_unwritten = -1;
  std::int64_t worst_index = -1;      // flat index of the worst element (-1: none failed)
  double worst_actual = 0, worst_expected = 0, worst_error = 0, worst_allowed = 0;
  double one_minus_cos = 0;
  bool cos_failed = false;
  Tolerance tolerance;

  std::string coords(std::int64_t flat) const {
    std::vector<std::int64_t> idx(shape.size());
    for (std::size_t d = shape.size(); d-- > 0;) {
      idx[d] = shape[d] ? flat % shape[d] : 0;
      flat = shape[d] ? flat / shape[d] : 0;
    }
    std::string s = "[";
    for (std::size_t d = 0; d < idx.size(); ++d) s += (d ? ", " : "") + std::to_string(idx[d]);
    return s + "]";
  }

  std::string report() const {
    char buf[512];
    std::string s = name + " " + shape_string() + ": ";
    if (ok) {
      std::snprintf(buf, sizeof buf, "ok (%lld elements, 1-cos %.3g)", static_cast<long long>(count), one_minus_cos);
      return s + buf;
    }
    std::snprintf(buf, sizeof buf, "%lld of %lld elements out of tolerance (%lld NaN/inf mismatches)",
                  static_cast<long long>(failures), static_cast<long long>(count),
                  static_cast<long long>(special_failures));
    s += buf;
    if (unwritten > 0) {
      std::snprintf(buf, sizeof buf, "; %lld elements still hold the sentinel (first at %s)",
                    static_cast<long long>(unwritten), coords(first_unwritten).c_str());
      s += buf;
    }
    if (worst_index >= 0) {
      std::snprintf(buf, sizeof buf, "; worst at %s: got %.9g, expected %.9g, |error| %.3g > allowed %.3g",
                    coords(worst_index).c_str(), worst_actual, worst_expected, worst_error, worst_allowed);
      s += buf;
    }
    std::snprintf(buf, sizeof buf, "; 1-cos %.3g (bound %.3g)%s [atol %.3g rtol %.3g]", one_minus_cos,
                  tolerance.max_one_minus_cos, cos_failed ? " FAILED" : "", tolerance.atol, tolerance.rtol);
    return s + buf;
  }

  std::string shape_string() const {
    std::string s = "[";
    for (std::size_t d = 0; d < shape.size(); ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
    return s + "]";
  }

  explicit operator bool() const { return ok; }
  operator ::testing::AssertionResult() const {  // NOLINT: lets EXPECT_TRUE print the report
    return ok ? ::testing::AssertionSuccess() << report() : ::testing::AssertionFailure() << report();
  }
};

// Compares `actual` with `expected` (both flat, `shape` for the report).
inline Comparison compare(std::string_view name, std::span<const double> actual, std::span<const double> expected,
                          std::vector<std::int64_t> shape, Tolerance tol) {
  Comparison c;
  c.name = std::string(name);
  c.shape = std::move(shape);
  c.tolerance = tol;
  c.count = static_cast<std::int64_t>(expected.size());
  if (actual.size() != expected.size()) {
    c.ok = false;
    c.name += " (size " + std::to_string(actual.size()) + " vs expected " + std::to_string(expected.size()) + ")";
    return c;
  }
  double worst_ratio = -1.0;
  double dot = 0, norm_a = 0, norm_b = 0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const double a = actual[i], b = expected[i];
    const double allowed = std::max(tol.atol, tol.rtol * std::fabs(b));
    double error = 0.0, ratio = 0.0;
    bool bad = false;
    if (std::isnan(a) || std::isnan(b) || std::isinf(a) || std::isinf(b)) {
      const bool same = (std::isnan(a) && std::isnan(b)) || a == b;
      if (!same) {
        bad = true;
        ++c.special_failures;
        error = std::numeric_limits<double>::infinity();
        ratio = std::numeric_limits<double>::infinity();
      }
    } else {
      dot += a * b;
      norm_a += a * a;
      norm_b += b * b;
      error = std::fabs(a - b);
      bad = error > allowed;
      ratio = allowed > 0 ? error / allowed : (error > 0 ? std::numeric_limits<double>::infinity() : 0.0);
    }
    if (bad) {
      ++c.failures;
      // The first element with an infinite ratio stays the worst: usually the most telling one.
      if (ratio > worst_ratio) {
        worst_ratio = ratio;
        c.worst_index = static_cast<std::int64_t>(i);
        c.worst_actual = a;
        c.worst_expected = b;
        c.worst_error = error;
        c.worst_allowed = allowed;
      }
    }
  }
  if (norm_a == 0 && norm_b == 0) {
    c.one_minus_cos = 0.0;
  } else if (norm_a == 0 || norm_b == 0) {
    c.one_minus_cos = 1.0;
  } else {
    c.one_minus_cos = 1.0 - dot / (std::sqrt(norm_a) * std::sqrt(norm_b));
  }
  c.cos_failed = tol.max_one_minus_cos >= 0 && c.one_minus_cos > tol.max_one_minus_cos;
  c.ok = c.failures == 0 && !c.cos_failed;
  return c;
}

inline Comparison compare(std::string_view name, const HostTensor& actual, std::span<const double> expected,
                          Tolerance tol) {
  const std::vector<double> a = actual.to_doubles();
  Comparison c = compare(name, a, expected, actual.shape(), tol);
  const DType dtype = actual.dtype();
  if (dtype == DType::kBF16 || dtype == DType::kF32 || dtype == DType::kF64) {
    const std::vector<std::uint8_t> pattern = sentinel_bytes(dtype);
    const std::size_t size = pattern.size();
    for (std::int64_t i = 0; i < actual.numel(); ++i) {
      if (std::memcmp(actual.raw() + static_cast<std::size_t>(i) * size, pattern.data(), size) != 0) continue;
      if (c.unwritten++ == 0) c.first_unwritten = i;
    }
    if (c.unwritten > 0) c.ok = false;
  }
  return c;
}

inline Comparison compare(std::string_view name, const HostTensor& actual, const HostTensor& expected, Tolerance tol) {
  const std::vector<double> b = expected.to_doubles();
  return compare(name, actual, b, tol);
}

// An output rounded to nearest from `expected` (a float64 result of the same math): each bf16 or f32
// element within half an ulp of it (8 or 24 significant bits), plus `slack` relative, where SPEC's
// tolerances for a kernel's output (Tolerance::bf16_output, f32_output) would let a truncated or
// otherwise misrounded value pass. The default slack is for a bf16 rounded through float32 (2^-24)
// from a sum whose float64 orders differ by less than 1e-9; an f32 rounded once from float64 wants
// far less. Zero and the specials must match exactly.
inline ::testing::AssertionResult rounded_to_nearest(std::string_view name, const HostTensor& actual,
                                                     std::span<const double> expected, double slack = 1e-6) {
  const DType dtype = actual.dtype();
  if ((dtype != DType::kBF16 && dtype != DType::kF32) || actual.numel() != static_cast<std::int64_t>(expected.size())) {
    return ::testing::AssertionFailure() << name << ": not a bf16 or f32 tensor of " << expected.size() << " elements";
  }
  const int bits = dtype == DType::kBF16 ? 8 : 24;  // significant bits
  const std::vector<double> a = actual.to_doubles();
  std::int64_t failures = 0, worst = -1;
  double worst_ratio = 0.0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const double e = expected[i];
    bool bad;
    double ratio = 0.0;
    if (!std::isfinite(e) || e == 0.0) {
      bad = !(a[i] == e || (std::isnan(a[i]) && std::isnan(e)));
      ratio = bad ? std::numeric_limits<double>::infinity() : 0.0;
    } else {
      const double half_ulp = std::ldexp(1.0, std::ilogb(e) - bits);
      const double allowed = half_ulp + slack * std::fabs(e);
      ratio = std::fabs(a[i] - e) / allowed;
      bad = !(ratio <= 1.0);
    }
    if (bad) {
      ++failures;
      if (worst < 0 || ratio > worst_ratio) worst = static_cast<std::int64_t>(i), worst_ratio = ratio;
    }
  }
  if (failures == 0) return ::testing::AssertionSuccess() << name << ": every element rounded to nearest";
  return ::testing::AssertionFailure() << name << ": " << failures << " of " << expected.size() << " elements not within half an "
                                       << (bits == 8 ? "bf16" : "f32") << " ulp of the float64 result; worst at " << worst
                                       << ": got " << a[static_cast<std::size_t>(worst)] << ", expected "
                                       << expected[static_cast<std::size_t>(worst)] << " (" << worst_ratio
                                       << " x the allowed error)";
}

}  // namespace latentkv::testing
