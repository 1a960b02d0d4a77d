#include "oomguard/logging.h"

#include <spdlog/pattern_formatter.h>
#include <spdlog/sinks/stdout_sinks.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>

namespace oomguard {
namespace {

std::atomic<int64_t> g_log_errors{0};
std::atomic<int> g_process_rank{0};
// Ranks may be threads of one process (ThreadGroup), so the rank shown is per
// thread, falling back to the process-wide one.
thread_local int t_rank = -1;

class RankFlag final : public spdlog::custom_flag_formatter {
 public:
  void format(const spdlog::details::log_msg&, const std::tm&, spdlog::memory_buf_t& dest) override {
    int r = t_rank >= 0 ? t_rank : g_process_rank.load(std::memory_order_relaxed);
    std::string s = std::to_string(r);
    dest.append(s.data(), s.data() + s.size());
  }
  std::unique_ptr<custom_flag_formatter> clone() const override { return std::make_unique<RankFlag>(); }
};

std::shared_ptr<spdlog::logger> MakeBuiltinLogger() {
  auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  auto logger = std::make_shared<spdlog::logger>("oomguard", std::move(sink));
  auto formatter = std::make_unique<spdlog::pattern_formatter>();
  formatter->add_flag<RankFlag>('*').set_pattern("[%H:%M:%S.%e] [oomguard r%*] [%l] %v");
  logger->set_formatter(std::move(formatter));
  auto level = LogLevelFromEnv();
  logger->set_level(level.ok() ? *level : spdlog::level::info);
  logger->flush_on(spdlog::level::warn);
  // A library must not refuse to run over a log setting, nor ignore it silently.
  if (!level.ok()) logger->warn("{}; logging at info", level.status().message());
  return logger;
}

void InstallErrorHandler(spdlog::logger& logger) {
  // Logging must never throw on the training path.
  logger.set_error_handler([](const std::string&) { g_log_errors.fetch_add(1, std::memory_order_relaxed); });
}

std::mutex g_mu;
std::shared_ptr<spdlog::logger> g_logger;

}  // namespace

StatusOr<spdlog::level::level_enum> LogLevelFromEnv() {
  const char* env = std::getenv("OOMGUARD_LOG_LEVEL");
  if (env == nullptr || *env == '\0') return spdlog::level::info;
  std::string v(env);
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  static const std::pair<const char*, spdlog::level::level_enum> kNames[] = {
      {"trace", spdlog::level::trace}, {"debug", spdlog::level::debug},       {"info", spdlog::level::info},
      {"warn", spdlog::level::warn},   {"warning", spdlog::level::warn},      {"error", spdlog::level::err},
      {"err", spdlog::level::err},     {"critical", spdlog::level::critical}, {"off", spdlog::level::off}};
  for (const auto& [name, level] : kNames)
    if (v == name) return level;
  return Status::InvalidArgument("OOMGUARD_LOG_LEVEL='" + std::string(env).substr(0, 64) +
                                 "' is not a level (trace, debug, info, warn, error, critical or off)");
}

std::shared_ptr<spdlog::logger> Logger() {
  std::lock_guard<std::mutex> lock(g_mu);
  if (!g_logger) {
    g_logger = MakeBuiltinLogger();
    InstallErrorHandler(*g_logger);
  }
  return g_logger;
}

void SetLogger(std::shared_ptr<spdlog::logger> logger) {
  std::lock_guard<std::mutex> lock(g_mu);
  if (logger) InstallErrorHandler(*logger);
  g_logger = std::move(logger);
}

void SetLogRank(int rank) {
  t_rank = rank;
  g_process_rank.store(rank, std::memory_order_relaxed);
}

int64_t LogErrors() { return g_log_errors.load(std::memory_order_relaxed); }

}  // namespace oomguard
