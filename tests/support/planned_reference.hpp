// tests/support/planned_reference.hpp - a test-only backend: the CPU reference's kernels with plans
// of its own (scratch, splits, chunk, cleared bytes, per op), so that where dsa_decode and
// dsa_prefill lay out their steps' scratch is checked on the CPU too (the reference plans none).
// Its kernels ignore the scratch, apart from the indexer's clear of another op's.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string_view>
#include <utility>
#include <vector>

#include "latentkv/backend.hpp"

namespace latentkv::testing {

class PlannedReference final : public Backend {
 public:
  explicit PlannedReference(std::map<Op, Plan> plans) : plans_(std::move(plans)) {}

  std::string_view name() const override { return "planned_reference"; }
  std::string_view description() const override { return "test-only: the reference's kernels, a plan of its own"; }
  int preference() const override { return 0; }
  Selection select(const Problem& problem) const override { return reference().select(problem); }
  Plan plan(const OpArgs& args, const DeviceInfo&) const override {
    const auto it = plans_.find(op_of(args));
    return it == plans_.end() ? Plan{} : it->second;
  }

 private:
  static const Backend& reference() {
    const Backend* b = find_backend("reference");
    if (b == nullptr) throw std::logic_error("no backend named reference");
    return *b;
  }
  std::map<Op, Plan> plans_;
};

// The alignment of every piece a DSA call carves its workspace into (latentkv/ops.hpp: the DSA calls
// want their workspace 256-byte aligned).
inline constexpr std::size_t kDsaWorkspaceAlign = 256;

// A step's view of a workspace: its offset from the workspace's start and its bytes.
struct WorkspaceRange {
  const char* name;
  std::size_t offset;
  std::size_t bytes;
};

inline WorkspaceRange range_in(const void* base, const char* name, const void* data, std::size_t bytes) {
  const auto offset = static_cast<const std::uint8_t*>(data) - static_cast<const std::uint8_t*>(base);
  return {name, static_cast<std::size_t>(offset), bytes};
}

// Every range inside [0, workspace_bytes) and starting at a multiple of `align`.
inline ::testing::AssertionResult inside_and_aligned(const std::vector<WorkspaceRange>& ranges,
                                                     std::size_t workspace_bytes, std::size_t align) {
  for (const WorkspaceRange& r : ranges) {
    if (r.offset > workspace_bytes || r.bytes > workspace_bytes - r.offset) {
      return ::testing::AssertionFailure() << r.name << " [" << r.offset << ", " << r.offset + r.bytes
                                           << ") outside the workspace of " << workspace_bytes << " bytes";
    }
    if (r.offset % align != 0) {
      return ::testing::AssertionFailure() << r.name << " at offset " << r.offset << ", not " << align << "-aligned";
    }
  }
  return ::testing::AssertionSuccess();
}

// No two ranges share a byte.
inline ::testing::AssertionResult disjoint(const std::vector<WorkspaceRange>& ranges) {
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    for (std::size_t j = i + 1; j < ranges.size(); ++j) {
      const WorkspaceRange &a = ranges[i], &b = ranges[j];
      if (a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes) {
        return ::testing::AssertionFailure() << a.name << " [" << a.offset << ", " << a.offset + a.bytes << ") and "
                                             << b.name << " [" << b.offset << ", " << b.offset + b.bytes << ") overlap";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace latentkv::testing
