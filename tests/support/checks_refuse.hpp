// tests/support/checks_refuse.hpp - a test-only backend whose kernels' own checks (Kernel::check)
// refuse every call, as the cuda backend's refuse a misaligned o; launching one is a test failure.
// In place of one step's backend it shows that a call of several steps (dsa_decode, dsa_prefill)
// asks every step's kernel before it queues the first.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <string_view>

#include "latentkv/backend.hpp"
#include "latentkv/error.hpp"

namespace latentkv::testing {

class ChecksRefuse final : public Backend {
 public:
  std::string_view name() const override { return "checks_refuse"; }
  std::string_view description() const override { return "test-only: its kernels' checks refuse every call"; }
  int preference() const override { return 0; }
  Selection select(const Problem&) const override {
    return Selection::yes(Kernel{
        "checks_refuse",
        [](const OpArgs&, const ExecContext&) { ADD_FAILURE() << "launched a call its checks refuse"; },
        [](const OpArgs& args) {
          throw Error(std::string(op_name(op_of(args))), "o", "an address not 8-byte aligned",
                      "8-byte aligned device memory");
        }});
  }
};

}  // namespace latentkv::testing
