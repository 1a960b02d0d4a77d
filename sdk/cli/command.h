// What every subcommand group of the `oomguard` tool shares.
//
// A group registers its subcommands on the top-level CLI::App; each
// subcommand's callback stores its exit code in CommandResult. Exit codes:
// 0 success, 1 the command failed (message on stderr), 2 bad arguments.
#ifndef OOMGUARD_SDK_CLI_COMMAND_H_
#define OOMGUARD_SDK_CLI_COMMAND_H_

#include <CLI/CLI.hpp>

namespace oomguard::cli {

struct CommandResult {
  int exit_code = 0;
};

// `oomguard kb ...` (kb_commands.cc).
void AddKbCommands(CLI::App* app, CommandResult* result);

}  // namespace oomguard::cli

#endif  // OOMGUARD_SDK_CLI_COMMAND_H_
