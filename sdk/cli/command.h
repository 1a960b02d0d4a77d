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

// `oomguard kb serve` and `kb report` (kb_serve_command.cc), added to the
// `kb` group that AddKbCommands created.
void AddKbServeCommands(CLI::App* kb, CommandResult* result);

// `oomguard diagnose` and `oomguard kb import-log` (diagnose_commands.cc);
// import-log joins the `kb` group that AddKbCommands created.
void AddDiagnoseCommands(CLI::App* app, CommandResult* result);

// `oomguard ckpt list|verify|inspect` (ckpt_commands.cc).
void AddCkptCommands(CLI::App* app, CommandResult* result);

}  // namespace oomguard::cli

#endif  // OOMGUARD_SDK_CLI_COMMAND_H_
