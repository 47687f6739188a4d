// tools/commands.hpp - the subcommands of the `latentkv` program, one source file each.
#pragma once

#include <CLI/CLI.hpp>

namespace latentkv::tools {

// Exit codes: 0 success, 1 a failure while running, 2 a usage or configuration error.
inline constexpr int kExitFailure = 1;
inline constexpr int kExitUsage = 2;

void add_demo_command(CLI::App& app);
void add_config_command(CLI::App& app);
void add_info_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_step_command(CLI::App& app);

}  // namespace latentkv::tools
