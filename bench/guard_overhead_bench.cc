// Guard overhead and recovery latency (Google Benchmark).
//
// BM_GuardOverhead/mb:N/work_us:W/dev:D
//   One optimizer step of N micro-batches with W microseconds of identical
//   arithmetic per micro-batch, run unguarded and through Guard::Step in the
//   same iteration (the order alternates), so that clock drift and noise from
//   other processes hit both variants alike. The unguarded variant is what a
//   user would write by hand: PlanBySamples once per step, then the same micro
//   and commit lambdas called directly in a plain loop. The guarded variant
//   passes them through a StepRequest. D=1 gives the guard a SimulatedDevice
//   (ResetPeak and Stats once per step); D=0 runs without a device.
//   The reported (manual) time is the guarded step. Counters, from the
//   per-iteration pairs (the mean of the medians over iterations where the
//   guarded step ran first and where it ran second; robust to preemption on a
//   shared machine and to any advantage of running first):
//     overhead_ns_per_mb      median(guarded - unguarded) / N, wall clock
//     ratio                   median(guarded / unguarded), wall clock
//     overhead_cpu_ns_per_mb  the same on the thread's CPU clock (excludes
//     ratio_cpu               time the thread was preempted)
//     work_us_per_mb          median unguarded CPU time / N (the work, measured;
//                             the calibration targets W on an idle core)
//
// BM_Recovery/src:S/dev:D
//   Every iteration resets the limit to 64 with SetMicroLimit, so the step's
//   single micro-batch of 64 samples OOMs once, the guard halves to 32 and
//   retries. S=0: the micro lambda throws DeviceOomError when mb.size > 32;
//   S=1: fault injection (oom@site=micro_batch,times=0,min_size=33).
//   Counters:
//     recovery_us        mean StepReport::recovery_ms (the SDK's own account:
//                        from catching the OOM to the re-planned retry)
//     throw_to_retry_us  S=0 only: mean time from the `throw` in user code to
//                        the retry's micro call, i.e. including unwinding
//   The SDK's warning per OOM is formatted into a null sink (formatting is
//   paid, terminal I/O is not).
//
// BM_MarkPhasePair
//   Two Guard::MarkPhase calls (forward, backward), as in guard.h's example.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <memory>
#include <vector>

#include <benchmark/benchmark.h>
#include <spdlog/logger.h>
#include <spdlog/sinks/null_sink.h>

#include "oomguard/device.h"
#include "oomguard/faults.h"
#include "oomguard/guard.h"
#include "oomguard/logging.h"
#include "oomguard/options.h"
#include "oomguard/plan.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kSamplesPerMicro = 32;
constexpr int kBufferLen = 256;

// One unit of work: an affine update of a small, L1-resident buffer. The
// clobber keeps the compiler from collapsing repetitions. Never inlined, so
// that both variants run the very same machine code for the work (inlined
// copies are laid out and vectorised differently, which showed up as a
// several-percent difference either way).
[[gnu::noinline]] float Work(float* buf, int64_t reps, float w) {
  for (int64_t r = 0; r < reps; ++r) {
    for (int i = 0; i < kBufferLen; ++i) buf[i] = buf[i] * 0.999f + w;
    benchmark::DoNotOptimize(buf);
    benchmark::ClobberMemory();
  }
  return buf[0];
}

// Nanoseconds per repetition of Work, measured once (best of several trials).
double NsPerRep() {
  static const double ns = [] {
    std::vector<float> buf(kBufferLen, 1.0f);
    constexpr int64_t kReps = 20000;
    double best = 1e300;
    for (int trial = 0; trial < 7; ++trial) {
      auto t0 = Clock::now();
      float v = Work(buf.data(), kReps, 0.5f);
      benchmark::DoNotOptimize(v);
      best = std::min(best, std::chrono::duration<double, std::nano>(Clock::now() - t0).count());
    }
    return best / kReps;
  }();
  return ns;
}

int64_t RepsFor(int64_t work_us) {
  if (work_us <= 0) return 0;
  return std::max<int64_t>(1, static_cast<int64_t>(work_us * 1000.0 / NsPerRep() + 0.5));
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  auto mid = v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2);
  std::nth_element(v.begin(), mid, v.end());
  if (v.size() % 2 == 1) return *mid;
  double hi = *mid;
  double lo = *std::max_element(v.begin(), mid);
  return (lo + hi) / 2;
}

double SecondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double ThreadCpuSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

// Paired timings of the guarded (g) and unguarded (u) step. Estimates are the
// mean of the two per-order medians, so that an advantage of running first
// (or second) cancels and preempted iterations do not move the result.
struct Pairs {
  std::vector<double> g, u;
  std::vector<bool> g_first;

  void Add(double guarded, double unguarded, bool guarded_ran_first) {
    g.push_back(guarded);
    u.push_back(unguarded);
    g_first.push_back(guarded_ran_first);
  }
  template <typename F>
  double PerOrderMedian(F f) const {
    std::vector<double> a, b;
    for (size_t i = 0; i < g.size(); ++i) (g_first[i] ? a : b).push_back(f(g[i], u[i]));
    if (a.empty() || b.empty()) return Median(a.empty() ? b : a);
    return (Median(a) + Median(b)) / 2;
  }
  double MedianDiff() const {
    return PerOrderMedian([](double x, double y) { return x - y; });
  }
  double MedianRatio() const {
    return PerOrderMedian([](double x, double y) { return y > 0 ? x / y : 0.0; });
  }
};

std::unique_ptr<oomguard::Device> MakeDevice() {
  oomguard::SimulatedDeviceOptions o;
  o.capacity_bytes = int64_t{1} << 30;
  o.backing = false;
  return oomguard::MakeSimulatedDevice(o).value();
}

void BM_GuardOverhead(benchmark::State& state) {
  const int n = static_cast<int>(state.range(0));
  const int64_t reps = RepsFor(state.range(1));
  const bool with_device = state.range(2) != 0;
  const int64_t samples = n * kSamplesPerMicro;

  std::vector<float> buf(kBufferLen, 1.0f);
  float acc = 0;
  int64_t commits = 0;
  auto micro = [&](const oomguard::MicroBatch& mb) {
    acc += Work(buf.data(), reps, static_cast<float>(mb.weight));
  };
  auto commit = [&] {
    benchmark::DoNotOptimize(acc);
    ++commits;
  };

  std::unique_ptr<oomguard::Device> device;
  oomguard::GuardOptions options;
  if (with_device) {
    device = MakeDevice();
    options.device = device.get();
  }
  // The limit fields make the step split into exactly N micro-batches; with
  // max_micro_batch equal to the limit, growth probes cannot change it.
  options.initial_micro_batch = kSamplesPerMicro;
  options.max_micro_batch = kSamplesPerMicro;
  auto guard_or = oomguard::Guard::Create(options);
  if (!guard_or.ok()) {
    state.SkipWithError(guard_or.status().ToString().c_str());
    return;
  }
  std::unique_ptr<oomguard::Guard> guard = std::move(guard_or).value();

  oomguard::StepRequest req;
  req.samples = samples;
  req.micro = micro;
  req.apply = commit;
  req.reset = [] {};  // no OOM is injected here: a step is never redone
  oomguard::StepReport report;

  auto unguarded = [&] {
    std::vector<oomguard::MicroBatch> plan = oomguard::PlanBySamples(samples, kSamplesPerMicro);
    for (const oomguard::MicroBatch& mb : plan) micro(mb);
    commit();
  };
  auto guarded = [&] {
    oomguard::Status s = guard->Step(req, &report);
    if (!s.ok() || report.micro_batches != n) {
      state.SkipWithError(("unexpected step: " + s.ToString()).c_str());
    }
  };

  // Per iteration: wall and thread-CPU seconds of each variant, and which ran
  // first. The CPU clock excludes time the thread was preempted (the machine
  // may be shared), the wall clock does not.
  Pairs wall, cpu;
  bool guarded_first = false;
  for (auto _ : state) {
    guarded_first = !guarded_first;
    const Clock::time_point w0 = Clock::now();
    const double c0 = ThreadCpuSeconds();
    if (guarded_first) {
      guarded();
    } else {
      unguarded();
    }
    const Clock::time_point w1 = Clock::now();
    const double c1 = ThreadCpuSeconds();
    if (guarded_first) {
      unguarded();
    } else {
      guarded();
    }
    const Clock::time_point w2 = Clock::now();
    const double c2 = ThreadCpuSeconds();
    const double wa = SecondsBetween(w0, w1), wb = SecondsBetween(w1, w2);
    const double ca = c1 - c0, cb = c2 - c1;
    wall.Add(guarded_first ? wa : wb, guarded_first ? wb : wa, guarded_first);
    cpu.Add(guarded_first ? ca : cb, guarded_first ? cb : ca, guarded_first);
    state.SetIterationTime(guarded_first ? wa : wb);
  }

  state.counters["overhead_ns_per_mb"] = wall.MedianDiff() * 1e9 / n;
  state.counters["ratio"] = wall.MedianRatio();
  state.counters["overhead_cpu_ns_per_mb"] = cpu.MedianDiff() * 1e9 / n;
  state.counters["ratio_cpu"] = cpu.MedianRatio();
  state.counters["guarded_us"] = Median(wall.g) * 1e6;
  state.counters["unguarded_us"] = Median(wall.u) * 1e6;
  state.counters["work_us_per_mb"] = Median(cpu.u) * 1e6 / n;
  benchmark::DoNotOptimize(commits);
}
BENCHMARK(BM_GuardOverhead)
    ->ArgNames({"mb", "work_us", "dev"})
    ->ArgsProduct({{1, 8, 64}, {0, 2, 100}, {0, 1}})
    ->UseManualTime()
    ->MinTime(0.3)
    ->Unit(benchmark::kMicrosecond);

// The per-micro-batch cost of the phase marks the guard's usage example puts
// in a micro lambda (forward, then backward), which BM_GuardOverhead leaves out
// so that its two variants run identical lambdas.
void BM_MarkPhasePair(benchmark::State& state) {
  auto guard = oomguard::Guard::Create(oomguard::GuardOptions{}).value();
  for (auto _ : state) {
    guard->MarkPhase(oomguard::Phase::kForward);
    guard->MarkPhase(oomguard::Phase::kBackward);
    benchmark::ClobberMemory();
  }
}
BENCHMARK(BM_MarkPhasePair)->MinTime(0.1);

void BM_Recovery(benchmark::State& state) {
  const bool injected = state.range(0) != 0;
  const bool with_device = state.range(1) != 0;
  constexpr int64_t kSamples = 64;
  constexpr int64_t kFits = 32;

  std::unique_ptr<oomguard::Device> device;
  oomguard::GuardOptions options;
  if (with_device) {
    device = MakeDevice();
    options.device = device.get();
  }
  options.initial_micro_batch = kSamples;
  options.max_micro_batch = kSamples;
  auto guard_or = oomguard::Guard::Create(options);
  if (!guard_or.ok()) {
    state.SkipWithError(guard_or.status().ToString().c_str());
    return;
  }
  std::unique_ptr<oomguard::Guard> guard = std::move(guard_or).value();
  if (injected) {
    oomguard::Status s = oomguard::SetFaultRules("oom@site=micro_batch,times=0,min_size=" +
                                                 std::to_string(kFits + 1));
    if (!s.ok()) {
      state.SkipWithError(s.ToString().c_str());
      return;
    }
  }

  std::vector<float> buf(kBufferLen, 1.0f);
  float acc = 0;
  Clock::time_point t_throw;
  bool pending = false;
  double throw_to_retry_s = 0;
  auto micro = [&](const oomguard::MicroBatch& mb) {
    if (!injected && mb.size > kFits) {
      t_throw = Clock::now();
      pending = true;
      throw oomguard::DeviceOomError("benchmark: simulated out of memory", 1 << 20,
                                     oomguard::MemoryStats{});
    }
    if (pending) {
      throw_to_retry_s += SecondsBetween(t_throw, Clock::now());
      pending = false;
    }
    acc += Work(buf.data(), 1, static_cast<float>(mb.weight));
  };

  oomguard::StepRequest req;
  req.samples = kSamples;
  req.micro = micro;
  req.apply = [&] { benchmark::DoNotOptimize(acc); };
  // The OOM comes before any MarkPhase, so the guard cannot tell whether
  // gradients were touched: it zeroes them and redoes the step (the general path).
  req.reset = [&] { acc = 0; };
  oomguard::StepReport report;

  double recovery_ms = 0;
  for (auto _ : state) {
    guard->SetMicroLimit(kSamples);
    oomguard::Status s = guard->Step(req, &report);
    if (!s.ok() || report.ooms != 1 || report.micro_batches != kSamples / kFits) {
      state.SkipWithError(("expected one recovered OOM: " + s.ToString()).c_str());
      break;
    }
    recovery_ms += report.recovery_ms;
  }
  if (injected) oomguard::ClearFaultRules();

  const double iters = static_cast<double>(state.iterations());
  if (iters > 0) {
    state.counters["recovery_us"] = recovery_ms * 1e3 / iters;
    if (!injected) state.counters["throw_to_retry_us"] = throw_to_retry_s * 1e6 / iters;
  }
}
BENCHMARK(BM_Recovery)
    ->ArgNames({"src", "dev"})
    ->ArgsProduct({{0, 1}, {0, 1}})
    ->MinTime(0.3)
    ->Unit(benchmark::kMicrosecond);

}  // namespace

int main(int argc, char** argv) {
  // The guard logs a warning per OOM; format it (part of the SDK's cost) but
  // do not write it to the terminal thousands of times.
  auto logger = std::make_shared<spdlog::logger>("oomguard",
                                                 std::make_shared<spdlog::sinks::null_sink_mt>());
  logger->set_level(spdlog::level::info);
  oomguard::SetLogger(logger);

  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::AddCustomContext("ns_per_work_rep", std::to_string(NsPerRep()));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
