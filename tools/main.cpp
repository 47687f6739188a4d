// `latentkv`: the command-line program. Each subcommand lives in its own file.
#include <cstdio>
#include <exception>
#include <new>
#include <string>
#include <vector>

#include "commands.hpp"
#include "latentkv/error.hpp"

namespace {

// `latentkv foo`: CLI11 says only that a subcommand is required; this names the word it did not
// know and the subcommands there are. Empty when the error is another one.
std::string unknown_subcommand(CLI::App& app) {
  const std::vector<std::string> left = app.remaining();
  if (!app.get_subcommands().empty() || left.empty() || left.front().rfind("-", 0) == 0) return "";
  std::string known;
  for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    known += (known.empty() ? "" : ", ") + sub->get_name();
  }
  return "unknown subcommand '" + left.front() + "' (one of: " + known + ")";
}

}  // namespace

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
    if (const std::string unknown = unknown_subcommand(app); !unknown.empty()) {
      std::fprintf(stderr, "error: %s\nRun with --help for more information.\n", unknown.c_str());
      return latentkv::tools::kExitUsage;
    }
    const int code = app.exit(e);
    return code == 0 ? 0 : latentkv::tools::kExitUsage;
  } catch (const latentkv::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return latentkv::tools::kExitFailure;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "error: out of memory: an allocation of host memory failed; lower the sizes asked "
                 "(--batch, --context, --pool, --layers)\n");
    return latentkv::tools::kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return latentkv::tools::kExitFailure;
  }
  return 0;
}
