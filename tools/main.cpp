// `latentkv`: the command-line program. Each subcommand lives in its own file.
#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <new>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "cli_checks.hpp"
#include "commands.hpp"
#include "help_format.hpp"
#include "latentkv/environment.hpp"
#include "latentkv/error.hpp"
#include "latentkv/version.hpp"

namespace {

// The subcommands there are: "step, demo, config, info, bench".
std::string subcommand_names(CLI::App& app) {
  std::string known;
  for (const CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) {
    known += (known.empty() ? "" : ", ") + sub->get_name();
  }
  return known;
}

// `latentkv foo`, `latentkv --bogus`, `latentkv`: CLI11 says only that a subcommand is required;
// this names the word it did not know and the subcommands there are. Empty when a subcommand was found.
std::string missing_subcommand(CLI::App& app) {
  if (!app.get_subcommands().empty()) return "";
  const std::vector<std::string> left = app.remaining();
  const std::string known = " (one of: " + subcommand_names(app) + ")";
  if (left.empty()) return "a subcommand is required" + known;
  if (left.front().rfind("-", 0) == 0) return "unknown option '" + left.front() + "' before the subcommand" + known;
  return "unknown subcommand '" + left.front() + "'" + known;
}

// CLI11's "--tp: 1 required INT:[1 .. 2147483647] missing" said plainly: "--tp: expected a value
// (INT:[1 .. 2147483647]), none was given". Other messages are returned as they are.
std::string plain_message(std::string message) {
  const std::size_t colon = message.find(": 1 required ");
  const std::string missing = " missing";
  if (colon != std::string::npos && message.ends_with(missing)) {
    const std::size_t type = colon + std::string(": 1 required ").size();
    return message.substr(0, colon) + ": expected a value (" +
           message.substr(type, message.size() - missing.size() - type) + "), none was given";
  }
  // "--tp: At Most 1 required but received 2": an option given more than once.
  const std::size_t repeated = message.find(": At Most 1 required but received ");
  if (repeated != std::string::npos) {
    const std::string times = message.substr(repeated + std::string(": At Most 1 required but received ").size());
    return message.substr(0, repeated) + ": given " + times + " times; give it once";
  }
  // "Could not convert: --fault-checks = bogus": a flag given a value that is no boolean.
  for (const std::string_view lead : {"Could not convert: ", "could not convert: "}) {
    const std::size_t equals = message.find(" = ");
    if (message.starts_with(lead) && equals != std::string::npos && message.compare(lead.size(), 2, "--") == 0) {
      const std::string flag = message.substr(lead.size(), equals - lead.size());
      return flag + ": '" + message.substr(equals + 3) + "' is not a boolean (give " + flag +
             " alone, or =true / =false)";
    }
  }
  if (!message.empty() && message.front() >= 'A' && message.front() <= 'Z') message.front() += 'a' - 'A';
  return message;
}

// CLI11's "The following arguments were not expected: 2 --batch" (the words last first) said in the
// order given, and plainly where the first is an option: one of the command's own that came after a
// `--` (`latentkv step -- --batch 2`: the `--` ends the options) or before the subcommand's name
// (`latentkv --batch 2 step`), or one the command does not have.
std::string extras_message(const CLI::App& command, const std::string& what, const std::vector<std::string>& args) {
  std::string lead = "were not expected: ";
  std::size_t at = what.find(lead);
  if (at == std::string::npos) at = what.find(lead = "was not expected: ");  // one word
  if (at == std::string::npos) return plain_message(what);
  std::vector<std::string> words;
  std::istringstream in(what.substr(at + lead.size()));
  for (std::string w; in >> w;) words.insert(words.begin(), w);
  std::string given;
  for (const std::string& w : words) given += (given.empty() ? "" : " ") + w;
  const std::string& first = words.empty() ? given : words.front();
  const std::string name = command.get_name();
  if (first.rfind("-", 0) == 0) {
    const std::string option = first.substr(0, first.find('='));
    if (command.get_option_no_throw(option) != nullptr) {
      // Typed only after a `--`, which ends the options.
      const auto separator = std::find(args.begin(), args.end(), "--");
      if (std::find(args.begin(), separator, first) == separator) {
        return "'" + given + "' came after `--`, which ends the options: leave the `--` out";
      }
      return "'" + given + "' came before the subcommand; options go after it: latentkv " + name + " " + given + " ...";
    }
    return "unknown option '" + option + "'" + (given == option ? "" : " (in '" + given + "')");
  }
  return (words.size() == 1 ? "argument not expected: " : "arguments not expected: ") + given;
}

// A command line CLI11 could not read, said as every other usage error is (docs/configuration.md,
// "Exit codes"): "error: <subcommand>: <what>" on stderr, then where the options are listed; for
// `latentkv config` the line in between says that the configuration was rejected, as its own errors
// do. `args`: the command line's words after the program's name. Returns the exit code.
int parse_error(CLI::App& app, const CLI::ParseError& e, const std::vector<std::string>& args) {
  if (e.get_exit_code() == 0) return app.exit(e);  // --help: printed, success
  // The subcommand whose options were being read, when CLI11 had got that far.
  const std::vector<CLI::App*> parsed = app.get_subcommands();
  const std::string sub = parsed.empty() ? "" : parsed.back()->get_name();
  std::string message = sub.empty() ? missing_subcommand(app) : sub + ": " + plain_message(e.what());
  if (!sub.empty() && dynamic_cast<const CLI::ExtrasError*>(&e) != nullptr) {
    message = sub + ": " + extras_message(*parsed.back(), e.what(), args);
  }
  const std::string help = "latentkv" + (sub.empty() ? std::string() : " " + sub) + " --help";
  std::fprintf(stderr, "error: %s\n", latentkv::tools::controls_escaped(message).c_str());
  if (sub == "config") {
    std::fprintf(stderr, "(configuration rejected: the command line could not be read; `%s` lists the options)\n",
                 help.c_str());
  } else {
    std::fprintf(stderr, "run `%s` for the options\n", help.c_str());
  }
  return latentkv::tools::kExitUsage;
}

// A run that printed its output to a stream it could not write (a full disk, a closed pipe's
// reader gone, /dev/full) did not succeed: said, and exit 1 instead of 0.
int checked_output(int code) {
  std::cout.flush();
  const bool failed = std::fflush(stdout) != 0 || std::ferror(stdout) != 0 || !std::cout;
  if (!failed || code != 0) return code;
  std::fprintf(stderr, "error: the output could not be written to standard output (a full disk or device?)\n");
  return latentkv::tools::kExitFailure;
}

// The configuration's variables (LATENTKV_CONFIG, LATENTKV_MODEL, LATENTKV_PAGE_SIZE, ...) are read
// by `latentkv config` and by programs that resolve a configuration, not by the commands that take
// their shape from their own options (step, bench, demo): one set for such a command is said, with
// the option that does the same where the command has one, rather than ignored without a word; an
// empty one counts as unset, as the configuration reads it. (The kernel overrides and
// LATENTKV_PYTHON are read by every command.)
void warn_configuration_unread(const CLI::App& command) {
  for (const std::string& name : latentkv::environment_variables()) {
    const char* value = std::getenv(name.c_str());
    if (name == latentkv::kMlaKernelVariable || name == latentkv::kIndexerKernelVariable ||
        name == latentkv::kPythonVariable || value == nullptr || *value == '\0') {
      continue;
    }
    std::string option = "--" + name.substr(std::string(latentkv::kEnvironmentPrefix).size());
    std::transform(option.begin(), option.end(), option.begin(), [](char c) {
      return c == '_' ? '-' : static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    });
    const bool has_option = command.get_option_no_throw(option) != nullptr;
    std::fprintf(stderr, "warning: %s is set, but `latentkv %s` does not read the configuration's variables%s\n",
                 name.c_str(), command.get_name().c_str(),
                 has_option ? ("; its " + option + " option sets the same").c_str() : " (it is ignored here)");
  }
}

// The program, given its command line; returns the exit code.
int run(int argc, char** argv) {
  // A misspelt LATENTKV_* variable would otherwise be ignored without a word.
  for (const std::string& line : latentkv::unread_environment_warnings(latentkv::process_environment_names())) {
    std::fprintf(stderr, "warning: %s\n", line.c_str());
  }
  CLI::App app{"latentkv: FP8-native MLA and DeepSeek Sparse Attention over paged caches"};
  app.set_version_flag("--version", std::string("latentkv ") + latentkv::library_description());
  app.require_subcommand(1);
  app.formatter(std::make_shared<latentkv::tools::WrappedHelp>());  // before the subcommands, which take it over
  latentkv::tools::add_step_command(app);
  latentkv::tools::add_demo_command(app);
  latentkv::tools::add_config_command(app);
  latentkv::tools::add_info_command(app);
  latentkv::tools::add_bench_command(app);
  latentkv::tools::refuse_options_as_values(app);
  for (const char* name : {"step", "demo", "bench"}) {
    CLI::App* command = app.get_subcommand(name);
    command->preparse_callback([command](std::size_t) { warn_configuration_unread(*command); });
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::RuntimeError& e) {
    return e.get_exit_code();  // a subcommand chose its exit code (and printed why)
  } catch (const CLI::ParseError& e) {
    return parse_error(app, e, std::vector<std::string>(argv + 1, argv + argc));
  } catch (const latentkv::Error& e) {
    std::fprintf(stderr, "error: %s\n", latentkv::tools::controls_escaped(e.what()).c_str());
    return latentkv::tools::kExitFailure;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "error: out of memory: an allocation of host memory failed; lower the sizes asked "
                 "(--batch, --context, --pool, --layers)\n");
    return latentkv::tools::kExitFailure;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", latentkv::tools::controls_escaped(e.what()).c_str());
    return latentkv::tools::kExitFailure;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return checked_output(run(argc, argv)); }
