// tools/commands.hpp - the subcommands of the `latentkv` program, one source file each.
#pragma once

#include <CLI/CLI.hpp>

namespace latentkv::tools {

// Exit codes: 0 success, 1 a failure while running, 2 a usage or configuration error.
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

// The program's own variable beside the library's (latentkv/environment.hpp): the Python that draws
// `latentkv step --plot`.
inline constexpr char kPythonVariable[] = "LATENTKV_PYTHON";

void add_demo_command(CLI::App& app);
void add_config_command(CLI::App& app);
void add_info_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_step_command(CLI::App& app);

}  // namespace latentkv::tools
