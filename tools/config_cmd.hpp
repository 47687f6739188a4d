// tools/config_cmd.hpp - `latentkv config` with its input and output replaceable, for its tests.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <iostream>
#include <ostream>
#include <vector>

#include "latentkv/backend.hpp"
#include "latentkv/config.hpp"

namespace latentkv::tools {

// What the command reads and writes; tests replace the streams, the environment and the device.
struct ConfigCommandIo {
  std::ostream* out = &std::cout;
  std::ostream* err = &std::cerr;
  Environment environment = process_environment();
  std::function<DeviceInfo()> device = [] { return detect_device(); };
  std::function<std::vector<const Backend*>()> backends = [] { return registered_backends(); };
};

// Adds the `config` subcommand reading and writing through `io`; returns it.
CLI::App* add_config_command(CLI::App& app, ConfigCommandIo io);

}  // namespace latentkv::tools
