// Micro-batch size policies against a hidden limit.
//
// A simulated device fits a micro-batch of size s iff s <= L (L unknown to the
// policy). Each step tries the policy's current size; an OOM is reported to
// the policy and the step retries at the new size, as a guard does, until a
// size fits. Policies:
//   oomguard   oomguard::SizeController (default options, grow_after 10)
//   halving    halve on OOM, never grow
//   accel_x0.9 HF Accelerate's find_executable_batch_size rule: on OOM the
//              size becomes int(size * 0.9), never grows
// A fourth run drives the real oomguard::Guard end to end (a step of
// `--global` samples whose micro lambda throws DeviceOomError above L), which
// checks that the guard feeds its controller as the bare simulation does;
// its micro-batches are balanced splits of the step, so the largest one that
// ran can sit a little below the limit.
//
// Per scenario and policy: OOMs, the size at the last step, its ratio to L
// and to the oracle (L; for the guard, the largest balanced split of the step
// whose micro-batches fit: ceil(global / ceil(global / L))),
// the first step from which every step's size stays within 5% of that final
// size, and the mean size over all steps relative to L (throughput proxy).
//
// Usage: controller_bench [--steps=300] [--max=8192] [--global=8192]
//                         [--csv=controller.csv] [--json=controller.json]
// The CSV has one row per attempt: L,start,policy,step,size,event (ok|oom).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <spdlog/logger.h>
#include <spdlog/sinks/null_sink.h>

#include "oomguard/device.h"
#include "oomguard/guard.h"
#include "oomguard/logging.h"
#include "oomguard/options.h"
#include "oomguard/size_controller.h"

namespace {

// A size policy as a training loop would hold it.
class Policy {
 public:
  virtual ~Policy() = default;
  virtual int64_t size() const = 0;
  // An OOM at `size`; false when the policy cannot go lower.
  virtual bool OnOom(int64_t size) = 0;
  virtual void OnSuccess(int64_t size) = 0;
};

class ControllerPolicy final : public Policy {
 public:
  ControllerPolicy(int64_t start, int64_t max) : controller_(Options(start, max)) {}
  int64_t size() const override { return controller_.limit(); }
  bool OnOom(int64_t size) override { return controller_.OnOom(size); }
  // A step of max samples at a smaller limit is always split: limit-bound.
  void OnSuccess(int64_t size) override { controller_.OnSuccess(size, /*limit_bound=*/true); }

 private:
  static oomguard::SizeControllerOptions Options(int64_t start, int64_t max) {
    oomguard::SizeControllerOptions o;
    o.initial = start;
    o.max = max;
    o.grow_after = 10;
    return o;
  }
  oomguard::SizeController controller_;
};

class HalvingPolicy final : public Policy {
 public:
  explicit HalvingPolicy(int64_t start) : size_(start) {}
  int64_t size() const override { return size_; }
  bool OnOom(int64_t size) override {
    if (size <= 1) return false;
    size_ = size / 2;
    return true;
  }
  void OnSuccess(int64_t) override {}

 private:
  int64_t size_;
};

class Times09Policy final : public Policy {
 public:
  explicit Times09Policy(int64_t start) : size_(start) {}
  int64_t size() const override { return size_; }
  bool OnOom(int64_t size) override {
    const auto next = static_cast<int64_t>(static_cast<double>(size) * 0.9);
    if (next < 1) return false;  // Accelerate raises "No executable batch size found"
    size_ = next;
    return true;
  }
  void OnSuccess(int64_t) override {}

 private:
  int64_t size_;
};

struct Attempt {
  int step;
  int64_t size;
  bool oom;
};

struct Trace {
  std::string policy;
  std::vector<Attempt> attempts;
  std::vector<int64_t> step_size;  // the size that completed, per step
  int64_t ooms = 0;
  bool failed = false;
  int64_t final_limit = 0;  // Guard only: the limit after the last step
  int64_t oracle = 0;       // the largest micro-batch that could run: L, or for
                            // the guard the largest balanced split that fits
};

// Runs a bare policy for `steps` steps against the hidden limit.
Trace Simulate(const std::string& name, Policy& policy, int64_t hidden, int steps) {
  Trace t;
  t.policy = name;
  for (int step = 0; step < steps && !t.failed; ++step) {
    for (;;) {
      const int64_t s = policy.size();
      if (s > hidden) {
        t.attempts.push_back({step, s, true});
        ++t.ooms;
        if (!policy.OnOom(s)) {
          t.failed = true;
          break;
        }
        continue;
      }
      t.attempts.push_back({step, s, false});
      t.step_size.push_back(s);
      policy.OnSuccess(s);
      break;
    }
  }
  t.final_limit = t.step_size.empty() ? 0 : t.step_size.back();
  t.oracle = hidden;
  return t;
}

// Drives oomguard::Guard: one step of `global` samples per optimizer step.
Trace SimulateGuard(int64_t hidden, int64_t start, int64_t max, int64_t global, int steps) {
  Trace t;
  t.policy = "guard_e2e";
  oomguard::GuardOptions o;
  o.initial_micro_batch = start;
  o.max_micro_batch = max;
  o.grow_after = 10;
  auto guard = oomguard::Guard::Create(o).value();
  int step = 0;
  int64_t largest = 0;
  oomguard::StepRequest req;
  req.samples = global;
  req.micro = [&](const oomguard::MicroBatch& mb) {
    guard->MarkPhase(oomguard::Phase::kForward);
    if (mb.size > hidden) {
      t.attempts.push_back({step, mb.size, true});
      throw oomguard::DeviceOomError("simulated", mb.size, oomguard::MemoryStats{});
    }
    largest = std::max(largest, mb.size);
  };
  req.reset = [] {};
  oomguard::StepReport report;
  for (; step < steps; ++step) {
    largest = 0;
    oomguard::Status s = guard->Step(req, &report);
    if (!s.ok()) {
      t.failed = true;
      break;
    }
    t.ooms += report.ooms;
    t.attempts.push_back({step, report.largest_micro, false});
    t.step_size.push_back(report.largest_micro);
  }
  t.final_limit = guard->micro_limit();
  const int64_t pieces = (global + hidden - 1) / hidden;
  t.oracle = (global + pieces - 1) / pieces;
  return t;
}

struct Summary {
  int64_t final_size = 0;
  double ratio = 0;         // final / L
  double oracle_ratio = 0;  // final / oracle
  int converge_step = -1;
  double mean_ratio = 0;
};

Summary Summarise(const Trace& t, int64_t hidden) {
  Summary s;
  if (t.step_size.empty()) return s;
  s.final_size = t.step_size.back();
  s.ratio = static_cast<double>(s.final_size) / static_cast<double>(hidden);
  s.oracle_ratio = static_cast<double>(s.final_size) / static_cast<double>(t.oracle);
  const double band = 0.05 * static_cast<double>(s.final_size);
  s.converge_step = static_cast<int>(t.step_size.size()) - 1;
  for (int i = static_cast<int>(t.step_size.size()) - 1; i >= 0; --i) {
    if (std::abs(static_cast<double>(t.step_size[i] - s.final_size)) > band) break;
    s.converge_step = i;
  }
  double sum = 0;
  for (int64_t v : t.step_size) sum += static_cast<double>(v);
  s.mean_ratio = sum / static_cast<double>(t.step_size.size()) / static_cast<double>(hidden);
  return s;
}

bool Flag(std::string_view arg, std::string_view name, std::string* value) {
  if (arg.substr(0, name.size()) != name) return false;
  *value = std::string(arg.substr(name.size()));
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 300;
  int64_t max = 8192;
  int64_t global = 8192;
  std::string csv_path = "controller.csv";
  std::string json_path = "controller.json";
  for (int i = 1; i < argc; ++i) {
    std::string v;
    std::string_view a = argv[i];
    if (Flag(a, "--steps=", &v)) {
      steps = std::atoi(v.c_str());
    } else if (Flag(a, "--max=", &v)) {
      max = std::atoll(v.c_str());
    } else if (Flag(a, "--global=", &v)) {
      global = std::atoll(v.c_str());
    } else if (Flag(a, "--csv=", &v)) {
      csv_path = v;
    } else if (Flag(a, "--json=", &v)) {
      json_path = v;
    } else {
      std::fprintf(stderr, "usage: %s [--steps=N] [--max=N] [--global=N] [--csv=PATH] [--json=PATH]\n",
                   argv[0]);
      return 2;
    }
  }
  if (steps < 1 || max < 1 || global < 1) {
    std::fprintf(stderr, "--steps, --max and --global must be >= 1\n");
    return 2;
  }
  // The guard warns on every OOM; the simulation makes hundreds.
  oomguard::SetLogger(std::make_shared<spdlog::logger>(
      "oomguard", std::make_shared<spdlog::sinks::null_sink_mt>()));

  const int64_t kLimits[] = {37, 300, 1000, 4000};
  const int64_t kStarts[] = {4096, 32};

  FILE* csv = std::fopen(csv_path.c_str(), "w");
  FILE* json = std::fopen(json_path.c_str(), "w");
  if (csv == nullptr || json == nullptr) {
    std::fprintf(stderr, "cannot write %s or %s\n", csv_path.c_str(), json_path.c_str());
    return 1;
  }
  std::fprintf(csv, "L,start,policy,step,size,event\n");
  std::fprintf(json, "{\"steps\": %d, \"max\": %lld, \"global\": %lld, \"runs\": [\n", steps,
               static_cast<long long>(max), static_cast<long long>(global));
  std::printf("%6s %6s  %-11s %6s %8s %8s %8s %10s %8s %s\n", "L", "start", "policy", "OOMs",
              "final", "final/L", "/oracle", "converged", "mean/L", "");
  bool first_row = true;
  bool target_met = true;
  for (int64_t hidden : kLimits) {
    for (int64_t start : kStarts) {
      ControllerPolicy controller(start, max);
      HalvingPolicy halving(start);
      Times09Policy times09(start);
      std::vector<Trace> traces;
      traces.push_back(Simulate("oomguard", controller, hidden, steps));
      traces.push_back(Simulate("halving", halving, hidden, steps));
      traces.push_back(Simulate("accel_x0.9", times09, hidden, steps));
      traces.push_back(SimulateGuard(hidden, start, max, global, steps));
      for (const Trace& t : traces) {
        const Summary s = Summarise(t, hidden);
        if ((t.policy == "oomguard" || t.policy == "guard_e2e") && s.oracle_ratio < 0.95) {
          target_met = false;
        }
        std::printf("%6lld %6lld  %-11s %6lld %8lld %8.3f %8.3f %10d %8.3f %s\n",
                    static_cast<long long>(hidden), static_cast<long long>(start), t.policy.c_str(),
                    static_cast<long long>(t.ooms), static_cast<long long>(s.final_size), s.ratio,
                    s.oracle_ratio, s.converge_step, s.mean_ratio, t.failed ? "FAILED" : "");
        std::fprintf(json,
                     "%s  {\"L\": %lld, \"start\": %lld, \"policy\": \"%s\", \"ooms\": %lld, "
                     "\"final\": %lld, \"ratio\": %.4f, \"oracle\": %lld, \"oracle_ratio\": %.4f, "
                     "\"converge_step\": %d, \"mean_ratio\": %.4f, "
                     "\"final_limit\": %lld, \"failed\": %s}",
                     first_row ? "" : ",\n", static_cast<long long>(hidden),
                     static_cast<long long>(start), t.policy.c_str(), static_cast<long long>(t.ooms),
                     static_cast<long long>(s.final_size), s.ratio,
                     static_cast<long long>(t.oracle), s.oracle_ratio, s.converge_step, s.mean_ratio,
                     static_cast<long long>(t.final_limit), t.failed ? "true" : "false");
        first_row = false;
        for (const Attempt& a : t.attempts) {
          std::fprintf(csv, "%lld,%lld,%s,%d,%lld,%s\n", static_cast<long long>(hidden),
                       static_cast<long long>(start), t.policy.c_str(), a.step,
                       static_cast<long long>(a.size), a.oom ? "oom" : "ok");
        }
      }
    }
  }
  std::fprintf(json, "\n]}\n");
  std::fclose(csv);
  std::fclose(json);
  std::printf("target (oomguard and guard_e2e final >= 0.95 oracle in every scenario): %s\n",
              target_met ? "met" : "NOT met");
  return 0;
}
