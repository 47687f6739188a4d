// tests/support/scoped_env.hpp - an environment variable set for a scope and restored after it.
#pragma once

#include <cstdlib>
#include <optional>
#include <string>

namespace latentkv::testing {

// Sets `name` to `value` (unsets it for nullptr) for the object's life, then puts back what was
// there, so that a test forcing a kernel leaves the variable as the run set it (gpu_run.sh's
// LATENTKV_MLA_KERNEL=mma pass runs every later test on the mma.sync kernels).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* before = std::getenv(name)) saved_ = before;
    set(value);
  }
  ~ScopedEnv() { set(saved_ ? saved_->c_str() : nullptr); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  void set(const char* value) const {
    if (value != nullptr) ::setenv(name_.c_str(), value, 1);
    else ::unsetenv(name_.c_str());
  }

  std::string name_;
  std::optional<std::string> saved_;
};

}  // namespace latentkv::testing
