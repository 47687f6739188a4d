// tests/support/expect_error.hpp - asserting that a call throws a readable latentkv::Error.
//
//   EXPECT_TRUE(throws_error([&] { cpu::mla_decode(p); }, "mla_decode", "block_table[0][1]", "99"));
//
// passes when the call throws latentkv::Error whose op() is `op`, whose argument() contains
// `argument` and whose value() contains `value`, and whose what() names all three. error_of(call)
// is the message itself.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <string>
#include <string_view>

#include "latentkv/error.hpp"

namespace latentkv::testing {

template <typename F>
::testing::AssertionResult throws_error(F&& call, std::string_view op, std::string_view argument,
                                        std::string_view value) {
  try {
    call();
  } catch (const Error& e) {
    const std::string what = e.what();
    auto has = [](std::string_view text, std::string_view part) { return text.find(part) != std::string_view::npos; };
    if (e.op() != op || !has(e.argument(), argument) || !has(e.value(), value) || !has(what, op) ||
        !has(what, argument) || !has(what, value)) {
      return ::testing::AssertionFailure() << "threw \"" << what << "\" (op '" << e.op() << "', argument '"
                                           << e.argument() << "', value '" << e.value() << "'), expected op '" << op
                                           << "', argument containing '" << argument << "', value containing '"
                                           << value << "'";
    }
    return ::testing::AssertionSuccess() << what;
  } catch (const std::exception& e) {
    return ::testing::AssertionFailure() << "threw a non-latentkv exception: " << e.what();
  }
  return ::testing::AssertionFailure() << "did not throw (expected " << op << ": '" << argument << "' = " << value << ")";
}

// The message of the latentkv::Error `call` throws, or "" when it throws none: for comparing two
// ways to the same error (a GPU fault record and the reference's check of the same input).
template <typename F>
std::string error_of(F&& call) {
  try {
    call();
  } catch (const Error& e) {
    return e.what();
  }
  return {};
}

}  // namespace latentkv::testing
