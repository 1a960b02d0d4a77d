// Knowledge-base costs: Record() on the training thread (target: a few
// microseconds; it only copies into the queue) and classification throughput.
#include <benchmark/benchmark.h>
#include <unistd.h>

#include <filesystem>

#include "oomguard/knowledge_base.h"

namespace {

oomguard::Incident Sample() {
  oomguard::Incident i;
  i.id = "0123456789abcdef";
  i.run_id = "run";
  i.phase = oomguard::Phase::kBackward;
  i.kind = oomguard::IncidentKind::kDevice;
  i.workload = "bench";
  i.requested_bytes = 1 << 30;
  i.memory.total = int64_t{16} << 30;
  i.memory.reserved = int64_t{15} << 30;
  i.memory.allocated = int64_t{10} << 30;
  i.memory.inactive_split = int64_t{4} << 30;
  i.step_peaks.assign(32, int64_t{9} << 30);
  i.steps_ok_before = 40;
  i.message = "simulated device out of memory";
  return i;
}

void BM_Record(benchmark::State& state) {
  std::string path = (std::filesystem::temp_directory_path() / ("oomguard-kb-bench-" + std::to_string(::getpid()) + ".db")).string();
  oomguard::KnowledgeBaseOptions o;
  o.queue_capacity = 1 << 16;
  auto kb = oomguard::KnowledgeBase::Open(path, o).value();
  oomguard::Incident inc = Sample();
  for (auto _ : state) kb->sink()->Record(inc);
  (void)kb->Flush();
  state.counters["dropped"] = static_cast<double>(kb->sink_stats().dropped);
  kb.reset();
  std::filesystem::remove(path);
  std::filesystem::remove(path + "-wal");
  std::filesystem::remove(path + "-shm");
}
BENCHMARK(BM_Record);

void BM_Classify(benchmark::State& state) {
  oomguard::Incident inc = Sample();
  for (auto _ : state) {
    oomguard::Incident c = inc;
    oomguard::ClassifyInPlace(&c);
    benchmark::DoNotOptimize(c.pattern);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_Classify);

}  // namespace

BENCHMARK_MAIN();
