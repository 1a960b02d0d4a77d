// The browser's incident listing over 100,000 incidents: what one page of
// /api/incidents costs (filter + page + JSON), through BrowserApi::Handle
// exactly as the server calls it, without the socket. Target: a page in
// well under 200 ms (bench/RESULTS.md). Also the cost of building the
// snapshot (once per change of the files).
#include <benchmark/benchmark.h>

#include <memory>
#include <string>
#include <vector>

#include "oomguard/knowledge_base.h"
#include "sdk/server/browser_api.h"
#include "sdk/server/incident_index.h"

namespace {

using oomguard::Incident;
using oomguard::server::BrowserApi;
using oomguard::server::IncidentIndex;

std::vector<Incident> MakeIncidents(int n) {
  static const char* kPatterns[] = {"fragmentation",  "activation_spike", "gradual_growth",
                                    "rank_imbalance", "optimizer_state",  "foreign_memory"};
  std::vector<Incident> v;
  v.reserve(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) {
    Incident i;
    i.id = std::to_string(1000000000000000 + k);
    i.run_id = "run-" + std::to_string(k / 500);
    i.time_unix_ms = 1714557600000 + int64_t{k} * 1000;
    i.host = "gpu-node-" + std::to_string(k % 64);
    i.rank = k % 8;
    i.world_size = 8;
    i.step = k % 500 * 10;
    i.phase = k % 2 ? oomguard::Phase::kBackward : oomguard::Phase::kForward;
    i.kind = oomguard::IncidentKind::kDevice;
    i.exception_type = "torch.OutOfMemoryError";
    i.message = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU " + std::to_string(k % 8) +
                " has a total capacity of 79.15 GiB of which 1.20 GiB is free.";
    i.requested_bytes = int64_t{2} << 30;
    i.memory.total = int64_t{80} << 30;
    i.memory.allocated = int64_t{70} << 30;
    i.memory.reserved = int64_t{76} << 30;
    i.memory.free = int64_t{1} << 30;
    for (int s = 0; s < 16; ++s) i.step_peaks.push_back((int64_t{60} << 30) + s * (int64_t{1} << 28));
    for (int r = 0; r < 8; ++r)
      i.ranks.push_back({r, int64_t{60 + r} << 30, int64_t{64 + r} << 30, int64_t{66 + r} << 30});
    i.micro_before = 32;
    i.micro_after = 16;
    i.action = oomguard::LadderAction::kHalve;
    i.actions = {oomguard::LadderAction::kRelease, oomguard::LadderAction::kHalve};
    i.outcome = oomguard::IncidentOutcome::kRecovered;
    i.recovery_ms = 3.2;
    i.workload = "gpt2-medium-seq1024";
    i.pattern = kPatterns[k % 6];
    i.confidence = 0.8;
    i.evidence = "reserved minus allocated is 6.0 GiB (7% of capacity) while the request was 2.0 GiB";
    i.remedies = {"set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "release caches between phases"};
    i.fingerprint = std::to_string(k % 97);
    v.push_back(std::move(i));
  }
  return v;
}

std::shared_ptr<const IncidentIndex> Snapshot(int n) {
  static std::shared_ptr<const IncidentIndex> cached;
  static int cached_n = 0;
  if (cached_n != n) {
    cached = std::make_shared<IncidentIndex>(MakeIncidents(n), oomguard::kb::FileSetStats{}, 0);
    cached_n = n;
  }
  return cached;
}

void Page(benchmark::State& state, const std::string& target) {
  auto snap = Snapshot(static_cast<int>(state.range(0)));
  BrowserApi api([snap] { return snap; });
  size_t bytes = 0;
  for (auto _ : state) {
    auto r = api.Handle("GET", target);
    if (r.status != 200) state.SkipWithError(r.body.c_str());
    bytes = r.body.size();
    benchmark::DoNotOptimize(r);
  }
  state.counters["response_bytes"] = static_cast<double>(bytes);
}

void BM_ListFirstPage(benchmark::State& s) { Page(s, "/api/incidents?limit=50"); }
void BM_ListDeepPage(benchmark::State& s) { Page(s, "/api/incidents?limit=50&offset=99000"); }
void BM_ListFiltered(benchmark::State& s) { Page(s, "/api/incidents?pattern=fragmentation&rank=2&limit=50"); }
void BM_ListTextSearch(benchmark::State& s) { Page(s, "/api/incidents?q=GPU+7+has&limit=50"); }
void BM_ListSearchNoMatch(benchmark::State& s) { Page(s, "/api/incidents?q=no-such-text-anywhere&limit=50"); }
void BM_Stats(benchmark::State& s) { Page(s, "/api/stats"); }
void BM_Metrics(benchmark::State& s) { Page(s, "/metrics"); }

void BM_BuildSnapshot(benchmark::State& state) {
  auto incidents = MakeIncidents(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    state.PauseTiming();
    auto copy = incidents;
    state.ResumeTiming();
    IncidentIndex idx(std::move(copy), oomguard::kb::FileSetStats{}, 0);
    benchmark::DoNotOptimize(idx);
  }
}

BENCHMARK(BM_ListFirstPage)->Arg(100000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ListDeepPage)->Arg(100000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ListFiltered)->Arg(100000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ListTextSearch)->Arg(100000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ListSearchNoMatch)->Arg(100000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Stats)->Arg(100000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Metrics)->Arg(100000)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_BuildSnapshot)->Arg(100000)->Unit(benchmark::kMillisecond)->Iterations(3);

}  // namespace

BENCHMARK_MAIN();
