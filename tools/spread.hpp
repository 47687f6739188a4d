// tools/spread.hpp - the median and p10/p90 of timed samples, as `latentkv bench` and `latentkv
// step` report them (GPU event times and the CPU reference's host clock alike).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>

namespace latentkv::tools {

struct Spread {
  double median = 0, p10 = 0, p90 = 0, min = 0;
};

// The median (the mean of the middle two for an even count), p10 and p90 (the nearest rank) and the
// least; all 0 for no samples.
inline Spread spread_of(std::vector<double> samples) {
  Spread s;
  if (samples.empty()) return s;
  std::sort(samples.begin(), samples.end());
  const std::size_t n = samples.size(), half = n / 2;
  const auto at = [&](double q) { return samples[static_cast<std::size_t>(q * static_cast<double>(n - 1) + 0.5)]; };
  s.median = n % 2 == 1 ? samples[half] : 0.5 * (samples[half - 1] + samples[half]);
  s.p10 = at(0.1);
  s.p90 = at(0.9);
  s.min = samples.front();
  return s;
}

}  // namespace latentkv::tools
