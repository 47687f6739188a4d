// `latentkv`: the command-line program. Each subcommand lives in its own file.
#include <cstdio>
#include <exception>

#include "commands.hpp"
#include "latentkv/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{"latentkv: FP8-native MLA and DeepSeek Sparse Attention over paged caches"};
  app.require_subcommand(1);
  latentkv::tools::add_step_command(app);
  latentkv::tools::add_demo_command(app);
  latentkv::tools::add_config_command(app);
  latentkv::tools::add_info_command(app);
  latentkv::tools::add_bench_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();  // a subcommand chose its exit code (and printed why)
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : latentkv::tools::kExitUsage;
  } catch (const latentkv::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return latentkv::tools::kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return latentkv::tools::kExitFailure;
  }
  return 0;
}
