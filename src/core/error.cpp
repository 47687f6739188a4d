#include "latentkv/error.hpp"

#include <utility>

namespace latentkv {

Error::Error(std::string op, std::string argument, std::string value, std::string expected)
    : std::runtime_error(op + ": argument '" + argument + "' = " + value + ": expected " + expected),
      op_(std::move(op)),
      argument_(std::move(argument)),
      value_(std::move(value)),
      expected_(std::move(expected)) {}

Error::Error(std::string op, std::string message)
    : std::runtime_error(op + ": " + message), op_(std::move(op)) {}

}  // namespace latentkv
