// oomguard: the command-line tool. Subcommand groups register themselves
// here; each lives in its own file.
#include <cstdio>

#include "oomguard/logging.h"
#include "oomguard/version.h"
#include "sdk/cli/command.h"

int main(int argc, char** argv) {
  CLI::App app{"oomguard: browse and manage what the oomguard SDK recorded"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "oomguard " + std::string(OOMGUARD_VERSION_STRING));
  // A setting the tool cannot honour is one clear error (exit 2, like a bad
  // argument), before any command runs.
  if (auto level = oomguard::LogLevelFromEnv(); !level.ok()) {
    std::fprintf(stderr, "oomguard: %s\n", level.status().message().c_str());
    return 2;
  }
  oomguard::cli::CommandResult result;
  oomguard::cli::AddKbCommands(&app, &result);
  oomguard::cli::AddKbServeCommands(app.get_subcommand("kb"), &result);
  oomguard::cli::AddCkptCommands(&app, &result);
  oomguard::cli::AddDiagnoseCommands(&app, &result);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : 2;
  }
  return result.exit_code;
}
