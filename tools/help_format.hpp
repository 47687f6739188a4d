// tools/help_format.hpp - `latentkv ... --help` wrapped to a terminal's width: CLI11 (2.1) prints each
// description on one line, some of them 200 characters and more.
#pragma once

#include <CLI/CLI.hpp>

#include <cstddef>
#include <sstream>
#include <string>

#include "text.hpp"

namespace latentkv::tools {

class WrappedHelp : public CLI::Formatter {
 public:
  static constexpr std::size_t kColumns = 100;

  // The right column: CLI11 indents each line after a line break to it.
  std::string make_option_desc(const CLI::Option* option) const override {
    return wrap_lines(CLI::Formatter::make_option_desc(option), description_columns());
  }
  std::string make_subcommand(const CLI::App* sub) const override {
    std::stringstream out;
    const std::string description = wrap_lines(sub->get_description(), description_columns());
    CLI::detail::format_help(out, sub->get_display_name(true), description, get_column_width());
    return out.str();
  }
  // The command's own description, above its usage line.
  std::string make_description(const CLI::App* app) const override {
    return wrap_lines(CLI::Formatter::make_description(app), kColumns);
  }

 private:
  std::size_t description_columns() const { return kColumns - get_column_width(); }
};

}  // namespace latentkv::tools
