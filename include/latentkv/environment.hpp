// latentkv/environment.hpp - the environment variables latentkv reads, and the ones set in its name
// that it does not: a misspelt setting (LATENTKV_PAGESIZE=32) is otherwise ignored without a word.
#pragma once

#include <string>
#include <vector>

namespace latentkv {

inline constexpr char kEnvironmentPrefix[] = "LATENTKV_";  // every variable latentkv reads begins so

// Kernel overrides of the CUDA backends (docs/operations.md): "mma" keeps the mma.sync kernels on
// sm_90 where the wgmma ones would run; unset or "auto" lets the device decide.
inline constexpr char kMlaKernelVariable[] = "LATENTKV_MLA_KERNEL";
inline constexpr char kIndexerKernelVariable[] = "LATENTKV_INDEXER_KERNEL";
// The `latentkv` program's own: the Python that draws `latentkv step --plot`.
inline constexpr char kPythonVariable[] = "LATENTKV_PYTHON";

// Every variable latentkv reads, in this order: LATENTKV_CONFIG, one per configuration key
// (LATENTKV_MODEL, LATENTKV_TP, ...: config_keys()), the two kernel overrides (read by the CUDA
// backends), then the program's LATENTKV_PYTHON.
std::vector<std::string> environment_variables();

// The LATENTKV_* names among `names` that neither latentkv (environment_variables()) nor the
// caller (`also_read`: an application's own LATENTKV_* variables) reads, each as one line:
// "LATENTKV_PAGESIZE is set but latentkv reads no variable of that name; it is ignored (did you
// mean LATENTKV_PAGE_SIZE?)" - the suggestion where a name read is close (after LATENTKV_, at most
// 3 edits and a third of the longer name, or the one's words among the other's: TP in TP_SIZE,
// not in OUTPUT), else the list of the names read. Names without the LATENTKV_ prefix are not
// latentkv's business and never listed.
std::vector<std::string> unread_environment_warnings(const std::vector<std::string>& names,
                                                     const std::vector<std::string>& also_read = {});

// The names of this process's environment variables, for the above.
std::vector<std::string> process_environment_names();

}  // namespace latentkv
