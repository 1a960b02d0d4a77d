// Fault injection: rule parsing, the active rule set and the fault points.
// FaultPoint's fast path only reads internal::g_faults_armed; the slow path
// (FireFaults) runs when some rule is set.
//
// Concurrency design: the active rules live in an immutable-shape RuleSet
// published through a shared_ptr. Writers (SetFaultRules, ClearFaultRules,
// the env loader) build a new set and swap the pointer under a mutex;
// FireFaults copies the pointer under the same mutex and evaluates without
// holding it, so a slow rule (a delay) never blocks a writer and a set that is
// replaced mid-evaluation stays alive until its last reader drops it. The only
// mutable state inside a set is atomic (per-rule fire counts and the total),
// which is what lets ranks running as threads share one `times` budget.

#include "oomguard/faults.h"

#include <array>
#include <atomic>
#include <cctype>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "oomguard/oom_error.h"
#include "sdk/core/faults_internal.h"

namespace oomguard {

namespace internal {
// Constant-initialised (no static-initialisation-order hazard): fault points
// in other translation units' static initialisers see `false`.
std::atomic<bool> g_faults_armed{false};
}  // namespace internal

namespace {

constexpr std::array<std::pair<FaultSite, std::string_view>, kNumFaultSites> kSiteNames = {{
    {FaultSite::kMicroBatch, "micro_batch"},
    {FaultSite::kForward, "forward"},
    {FaultSite::kBackward, "backward"},
    {FaultSite::kOptimizer, "optimizer"},
    {FaultSite::kCommit, "commit"},
    {FaultSite::kSync, "sync"},
    {FaultSite::kApply, "apply"},
    {FaultSite::kCkptStage, "ckpt_stage"},
    {FaultSite::kCkptWrite, "ckpt_write"},
    {FaultSite::kCkptManifest, "ckpt_manifest"},
    {FaultSite::kVote, "vote"},
    {FaultSite::kKbWrite, "kb_write"},
    {FaultSite::kEval, "eval"},
}};

// The longest delay a rule may ask for, in milliseconds (one hour).
constexpr int64_t kMaxDelayMs = 3'600'000;
constexpr std::string_view kValidKinds = "oom, host_oom, error, kill or delay";
constexpr std::string_view kValidKeys = "step, rank, site, micro, times, min_size, ms or bytes";

std::string ValidSites() {
  std::string out;
  for (size_t i = 0; i < kSiteNames.size(); ++i) {
    if (i > 0) out += (i + 1 == kSiteNames.size()) ? " or " : ", ";
    out += kSiteNames[i].second;
  }
  return out;
}

std::string_view Trim(std::string_view s) {
  auto is_space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!s.empty() && is_space(s.front())) s.remove_prefix(1);
  while (!s.empty() && is_space(s.back())) s.remove_suffix(1);
  return s;
}

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

enum class Count { kOk, kNotANumber, kOutOfRange, kNegative };

// A non-negative decimal int64 in *out. The whole of `s` must be the number:
// trailing garbage, a sign other than a leading '-', and overflow are errors.
Count ParseCountValue(std::string_view s, int64_t* out) {
  if (s.empty()) return Count::kNotANumber;
  int64_t v = 0;
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, v);
  if (ec == std::errc::result_out_of_range) return Count::kOutOfRange;
  if (ec != std::errc() || ptr != end) return Count::kNotANumber;
  if (v < 0) return Count::kNegative;
  *out = v;
  return Count::kOk;
}

// ParseCountValue with a message naming the key. `expected` completes the
// "not a number" message ("N" or "N or A-B").
Status ParseCount(std::string_view key, std::string_view s, std::string_view expected,
                  int64_t* out) {
  switch (ParseCountValue(s, out)) {
    case Count::kOk:
      return Status::Ok();
    case Count::kOutOfRange:
      return Status::InvalidArgument(std::string(key) + ": " + Quote(s) + " is out of range");
    case Count::kNegative:
      return Status::InvalidArgument(std::string(key) + ": " + Quote(s) + " is negative");
    case Count::kNotANumber:
      break;
  }
  return Status::InvalidArgument(std::string(key) + ": " + Quote(s) + " is not a number (expected " +
                                 std::string(expected) + ")");
}

// As ParseCount, for fields stored as int (rank, micro).
Status ParseIntCount(std::string_view key, std::string_view s, int* out) {
  int64_t v = 0;
  OOMGUARD_RETURN_IF_ERROR(ParseCount(key, s, "N", &v));
  if (v > std::numeric_limits<int>::max()) {
    return Status::InvalidArgument(std::string(key) + ": " + Quote(s) +
                                   " is out of range (at most " +
                                   std::to_string(std::numeric_limits<int>::max()) + ")");
  }
  *out = static_cast<int>(v);
  return Status::Ok();
}

// step=N or step=A-B (inclusive). A leading '-' is a negative number, not a
// range separator, so "-3" reports "negative" rather than a confusing range error.
Status ParseStep(std::string_view s, FaultRule* rule) {
  constexpr std::string_view kExpected = "N or A-B";
  const size_t dash = s.find('-', 1);
  if (s.empty() || s.front() == '-' || dash == std::string_view::npos) {
    int64_t v = 0;
    OOMGUARD_RETURN_IF_ERROR(ParseCount("step", s, kExpected, &v));
    rule->step_lo = rule->step_hi = v;
    return Status::Ok();
  }
  int64_t lo = 0, hi = 0;
  const Count first = ParseCountValue(s.substr(0, dash), &lo), last = ParseCountValue(s.substr(dash + 1), &hi);
  // A bound too large to hold says so; anything else is not a range at all.
  if (first == Count::kOutOfRange || last == Count::kOutOfRange) {
    const bool start = first == Count::kOutOfRange;
    return Status::InvalidArgument("step: range " + Quote(s) + ": " + (start ? "start " : "end ") +
                                   Quote(start ? s.substr(0, dash) : s.substr(dash + 1)) + " is out of range");
  }
  if (first != Count::kOk || last != Count::kOk) {
    return Status::InvalidArgument("step: " + Quote(s) + " is not a number (expected " +
                                   std::string(kExpected) + ")");
  }
  if (lo > hi) {
    return Status::InvalidArgument("step: range " + Quote(s) + " is empty (start " +
                                   std::to_string(lo) + " > end " + std::to_string(hi) + ")");
  }
  rule->step_lo = lo;
  rule->step_hi = hi;
  return Status::Ok();
}

StatusOr<FaultKind> ParseKind(std::string_view s) {
  if (s == "oom") return FaultKind::kOom;
  if (s == "host_oom") return FaultKind::kHostOom;
  if (s == "error") return FaultKind::kError;
  if (s == "kill") return FaultKind::kKill;
  if (s == "delay") return FaultKind::kDelay;
  if (s.empty()) {
    return Status::InvalidArgument("missing kind (expected " + std::string(kValidKinds) + ")");
  }
  return Status::InvalidArgument("unknown kind " + Quote(s) + " (expected " +
                                 std::string(kValidKinds) + ")");
}

// Parses one trimmed, non-empty rule. Errors carry only the problem; the
// caller prefixes the rule text.
Status ParseRuleBody(std::string_view text, FaultRule* rule) {
  const size_t at = text.find('@');
  StatusOr<FaultKind> kind = ParseKind(Trim(text.substr(0, at)));
  if (!kind.ok()) return kind.status();
  rule->kind = *kind;

  bool has_ms = false;
  if (at != std::string_view::npos) {
    std::string_view rest = text.substr(at + 1);
    if (Trim(rest).empty()) return Status::InvalidArgument("expected key=value after '@'");
    enum Key { kStep, kRank, kSite, kMicro, kTimes, kMinSize, kMs, kBytes, kNumKeys };
    constexpr std::array<std::string_view, kNumKeys> kKeyNames = {
        "step", "rank", "site", "micro", "times", "min_size", "ms", "bytes"};
    std::array<bool, kNumKeys> seen{};
    while (true) {
      const size_t comma = rest.find(',');
      const std::string_view pair = Trim(rest.substr(0, comma));
      if (pair.empty()) return Status::InvalidArgument("empty key=value pair (stray ',')");
      const size_t eq = pair.find('=');
      if (eq == std::string_view::npos) {
        return Status::InvalidArgument(Quote(pair) + " has no '=' (expected key=value)");
      }
      const std::string_view key = Trim(pair.substr(0, eq));
      const std::string_view value = Trim(pair.substr(eq + 1));
      int k = 0;
      while (k < kNumKeys && kKeyNames[k] != key) ++k;
      if (k == kNumKeys) {
        return Status::InvalidArgument("unknown key " + Quote(key) + " (expected " +
                                       std::string(kValidKeys) + ")");
      }
      if (seen[k]) return Status::InvalidArgument("duplicate key " + Quote(key));
      seen[k] = true;
      switch (static_cast<Key>(k)) {
        case kStep:
          OOMGUARD_RETURN_IF_ERROR(ParseStep(value, rule));
          break;
        case kRank: {
          int v = 0;
          OOMGUARD_RETURN_IF_ERROR(ParseIntCount(key, value, &v));
          rule->rank = v;
          break;
        }
        case kSite: {
          std::optional<FaultSite> site = ParseFaultSite(value);
          if (!site) {
            return Status::InvalidArgument("site: unknown site " + Quote(value) + " (expected " +
                                           ValidSites() + ")");
          }
          rule->site = *site;
          break;
        }
        case kMicro: {
          int v = 0;
          OOMGUARD_RETURN_IF_ERROR(ParseIntCount(key, value, &v));
          rule->micro = v;
          break;
        }
        case kTimes:
          OOMGUARD_RETURN_IF_ERROR(ParseCount(key, value, "N", &rule->times));
          break;
        case kMinSize:
          OOMGUARD_RETURN_IF_ERROR(ParseCount(key, value, "N", &rule->min_size));
          break;
        case kMs:
          if (rule->kind != FaultKind::kDelay) {
            return Status::InvalidArgument("ms is only valid for delay");
          }
          OOMGUARD_RETURN_IF_ERROR(ParseCount(key, value, "N", &rule->delay_ms));
          // Longer is no test of anything, and milliseconds past ~292 years
          // overflow the nanoseconds a sleep counts in.
          if (rule->delay_ms > kMaxDelayMs) {
            return Status::InvalidArgument("ms: " + Quote(value) + " is out of range (at most " +
                                           std::to_string(kMaxDelayMs) + ", one hour)");
          }
          has_ms = true;
          break;
        case kBytes:
          if (rule->kind != FaultKind::kOom && rule->kind != FaultKind::kHostOom) {
            return Status::InvalidArgument("bytes is only valid for oom and host_oom");
          }
          OOMGUARD_RETURN_IF_ERROR(ParseCount(key, value, "N", &rule->bytes));
          if (rule->bytes == 0) return Status::InvalidArgument("bytes: must be > 0");
          break;
        case kNumKeys:
          break;
      }
      if (comma == std::string_view::npos) break;
      rest.remove_prefix(comma + 1);
    }
  }
  if (rule->kind == FaultKind::kDelay && !has_ms) {
    return Status::InvalidArgument("delay needs ms=N (the delay in milliseconds)");
  }
  return Status::Ok();
}

// The rules in force plus their fire counters. `rules` and `spec` never change
// after publication; the counters are atomics shared by every reader.
struct RuleSet {
  explicit RuleSet(std::vector<FaultRule> r) : rules(std::move(r)), fired_per_rule(rules.size()) {
    for (const FaultRule& rule : rules) {
      if (!spec.empty()) spec += ';';
      spec += rule.text;
    }
  }
  std::vector<FaultRule> rules;
  std::string spec;
  std::vector<std::atomic<int64_t>> fired_per_rule;  // value-initialised to 0 (C++20)
  std::atomic<int64_t> fired_total{0};
};

struct ActiveState {
  std::mutex mu;
  std::shared_ptr<RuleSet> rules;  // guarded by mu; null: nothing armed
};

// Leaked on purpose: threads that are still at a fault point during static
// destruction must not see a destroyed mutex.
ActiveState& State() {
  static ActiveState* state = new ActiveState();
  return *state;
}

std::shared_ptr<RuleSet> Snapshot() {
  ActiveState& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  return s.rules;
}

void Install(std::shared_ptr<RuleSet> set) {
  ActiveState& s = State();
  std::lock_guard<std::mutex> lock(s.mu);
  // Stored under the lock so that the flag and the pointer change together
  // as seen by writers; readers only use the flag as a hint and re-check the
  // pointer under the lock.
  internal::g_faults_armed.store(set != nullptr && !set->rules.empty(), std::memory_order_relaxed);
  s.rules = std::move(set);
}

bool Matches(const FaultRule& rule, FaultSite site, const FaultContext& ctx) {
  if (rule.site && *rule.site != site) return false;
  if (rule.step_lo && (ctx.step < *rule.step_lo || ctx.step > *rule.step_hi)) return false;
  if (rule.rank && *rule.rank != ctx.rank) return false;
  if (rule.micro && *rule.micro != ctx.micro) return false;
  if (ctx.size < rule.min_size) return false;
  return true;
}

// Takes one of the rule's `times` firings. The compare-exchange loop makes
// the budget exact under concurrency: N threads never fire more than `times`.
bool ClaimFiring(std::atomic<int64_t>& fired, int64_t times) {
  if (times == 0) {
    fired.fetch_add(1, std::memory_order_relaxed);
    return true;
  }
  int64_t n = fired.load(std::memory_order_relaxed);
  while (n < times) {
    if (fired.compare_exchange_weak(n, n + 1, std::memory_order_relaxed)) return true;
  }
  return false;
}

std::string Where(FaultSite site, const FaultContext& ctx) {
  return "at site " + std::string(FaultSiteName(site)) + ", step " + std::to_string(ctx.step) +
         ", rank " + std::to_string(ctx.rank) + ", micro " + std::to_string(ctx.micro);
}

}  // namespace

std::string_view FaultSiteName(FaultSite site) {
  for (const auto& [s, name] : kSiteNames) {
    if (s == site) return name;
  }
  return "unknown";
}

std::optional<FaultSite> ParseFaultSite(std::string_view name) {
  for (const auto& [s, n] : kSiteNames) {
    if (n == name) return s;
  }
  return std::nullopt;
}

StatusOr<std::vector<FaultRule>> ParseFaultRules(std::string_view spec) {
  std::vector<FaultRule> rules;
  while (true) {
    const size_t semi = spec.find(';');
    const std::string_view text = Trim(spec.substr(0, semi));
    if (!text.empty()) {
      FaultRule rule;
      rule.text = std::string(text);
      Status s = ParseRuleBody(text, &rule);
      if (!s.ok()) {
        return Status::InvalidArgument("fault rule " + Quote(text) + ": " + s.message());
      }
      rules.push_back(std::move(rule));
    }
    if (semi == std::string_view::npos) break;
    spec.remove_prefix(semi + 1);
  }
  return rules;
}

Status SetFaultRules(std::string_view spec) {
  StatusOr<std::vector<FaultRule>> rules = ParseFaultRules(spec);
  if (!rules.ok()) return rules.status();
  if (rules->empty()) {
    Install(nullptr);
  } else {
    Install(std::make_shared<RuleSet>(std::move(*rules)));
  }
  return Status::Ok();
}

void ClearFaultRules() { Install(nullptr); }

std::string ActiveFaultRules() {
  std::shared_ptr<RuleSet> set = Snapshot();
  return set ? set->spec : std::string();
}

int64_t FaultsFired() {
  std::shared_ptr<RuleSet> set = Snapshot();
  return set ? set->fired_total.load(std::memory_order_relaxed) : 0;
}

namespace internal {

Status LoadFaultRulesFromEnvValue(const char* value) {
  if (value == nullptr || Trim(value).empty()) return Status::Ok();
  Status s = SetFaultRules(value);
  if (!s.ok()) return Status(s.code(), "OOMGUARD_FAULTS: " + s.message());
  return s;
}

void FireFaults(FaultSite site, const FaultContext& ctx) {
  std::shared_ptr<RuleSet> set = Snapshot();
  if (!set) return;
  for (size_t i = 0; i < set->rules.size(); ++i) {
    const FaultRule& rule = set->rules[i];
    if (!Matches(rule, site, ctx)) continue;
    if (!ClaimFiring(set->fired_per_rule[i], rule.times)) continue;
    set->fired_total.fetch_add(1, std::memory_order_relaxed);
    switch (rule.kind) {
      case FaultKind::kOom:
        throw DeviceOomError(
            "injected device OOM (fault rule " + Quote(rule.text) + ") " + Where(site, ctx),
            rule.bytes, MemoryStats{}, /*injected=*/true);
      case FaultKind::kHostOom:
        throw HostOomError(
            "injected host OOM (fault rule " + Quote(rule.text) + ") " + Where(site, ctx),
            rule.bytes);
      case FaultKind::kError:
        throw std::runtime_error("injected error (fault rule " + Quote(rule.text) + ") " + Where(site, ctx));
      case FaultKind::kKill: {
        // Plain stdio, not the logger: the process dies on the next line, and
        // this line is what a test harness sees to explain the death.
        const std::string line = "oomguard: fault rule " + Quote(rule.text) +
                                 " kills this process (SIGKILL) " + Where(site, ctx) + "\n";
        std::fputs(line.c_str(), stderr);
        std::fflush(stderr);
        std::raise(SIGKILL);
        break;  // not reached
      }
      case FaultKind::kDelay:
        std::this_thread::sleep_for(std::chrono::milliseconds(rule.delay_ms));
        break;
    }
  }
}

}  // namespace internal

void FaultPoint(FaultSite site, const FaultContext& ctx) {
  if (internal::g_faults_armed.load(std::memory_order_relaxed)) internal::FireFaults(site, ctx);
}

Status LoadFaultRulesFromEnv() {
  static std::once_flag once;
  static Status* result = nullptr;  // leaked, as State(); copied out on every call
  std::call_once(once, [] {
    result = new Status(internal::LoadFaultRulesFromEnvValue(std::getenv("OOMGUARD_FAULTS")));
  });
  return *result;
}

namespace {
thread_local FaultContext t_fault_context;
}  // namespace

const FaultContext& CurrentFaultContext() { return t_fault_context; }

void SetCurrentFaultContext(const FaultContext& ctx) { t_fault_context = ctx; }

}  // namespace oomguard
