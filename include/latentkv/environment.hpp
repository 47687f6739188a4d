// latentkv/environment.hpp - the environment variables latentkv reads, and the ones set in its name
// that it does not: a misspelt setting (LATENTKV_PAGESIZE=32) is otherwise ignored without a word.
#pragma once

#include <string>
#include <vector>

namespace latentkv {

// Kernel overrides of the CUDA backends (docs/operations.md): "mma" keeps the mma.sync kernels on
// sm_90 where the wgmma ones would run; unset or "auto" lets the device decide.
inline constexpr char kMlaKernelVariable[] = "LATENTKV_MLA_KERNEL";
inline constexpr char kIndexerKernelVariable[] = "LATENTKV_INDEXER_KERNEL";

// Every variable the library reads, in this order: LATENTKV_CONFIG, one per configuration key
// (LATENTKV_MODEL, LATENTKV_TP, ...: config_keys()), then the two kernel overrides above.
std::vector<std::string> environment_variables();

// The LATENTKV_* names among `names` that neither the library (environment_variables()) nor the
// caller (`also_read`: an application's own LATENTKV_* variables) reads, each as one line:
// "LATENTKV_PAGESIZE is set but latentkv reads no variable of that name; it is ignored (did you
// mean LATENTKV_PAGE_SIZE?)" - the suggestion where a name read is close (after LATENTKV_, at most
// 3 edits and a third of the longer name, or one inside the other), else the list of the names
// read. Names without the LATENTKV_ prefix are not latentkv's business and never listed.
std::vector<std::string> unread_environment_warnings(const std::vector<std::string>& names,
                                                     const std::vector<std::string>& also_read = {});

// The names of this process's environment variables, for the above.
std::vector<std::string> process_environment_names();

}  // namespace latentkv
