// Logging: oomguard logs through a named spdlog logger "oomguard", never the
// global default logger, and never changes the default's level. Each line
// carries the rank. OOMGUARD_LOG_LEVEL (trace, debug, info, warn or warning,
// error or err, critical, off; in any letter case) sets the level; the
// default is info. The built-in logger takes another value as info and says
// so in its first line; tools that can refuse it (the CLI) use
// LogLevelFromEnv.
//
// Logging never throws on the training path: the logger's error handler
// swallows formatting and sink errors (counted in LogErrors()).
//
// Not included by oomguard.h: this header brings spdlog and fmt.
//
// Thread-safety: all functions may be called from any thread.
#ifndef OOMGUARD_LOGGING_H_
#define OOMGUARD_LOGGING_H_

#include <spdlog/logger.h>

#include <cstdint>
#include <memory>

#include "oomguard/export.h"
#include "oomguard/status.h"

namespace oomguard {

// The level OOMGUARD_LOG_LEVEL names (info when it is unset or empty);
// kInvalidArgument naming the variable, the value and the levels otherwise.
OOMGUARD_EXPORT StatusOr<spdlog::level::level_enum> LogLevelFromEnv();

// The logger in use (created on first use: stderr, pattern with the rank).
OOMGUARD_EXPORT std::shared_ptr<spdlog::logger> Logger();
// Replaces the logger (injectable: tests and host programs route it anywhere).
// nullptr restores the built-in one.
OOMGUARD_EXPORT void SetLogger(std::shared_ptr<spdlog::logger> logger);
// The rank shown in every line of the built-in logger.
OOMGUARD_EXPORT void SetLogRank(int rank);
// Errors swallowed by the logger's error handler since start.
OOMGUARD_EXPORT int64_t LogErrors();

}  // namespace oomguard

#endif  // OOMGUARD_LOGGING_H_
