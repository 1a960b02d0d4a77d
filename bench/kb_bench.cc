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

// A pasted report (traceback and description, 1.3 KB): the text cues and the
// text model run, as for every incident `oomguard diagnose` finds.
void BM_ClassifyReport(benchmark::State& state) {
  oomguard::Incident inc;
  inc.id = "report";
  inc.kind = oomguard::IncidentKind::kDevice;
  inc.message =
      "RuntimeError: CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; 7.93 GiB total capacity; 6.19 GiB "
      "already allocated; 340.00 MiB free; 551.04 MiB cached)";
  inc.context =
      "# CUDA out of memory when validation\n"
      "I run your code with librispeech train 100 as training data on a GeForce RTX 2070. After several OOM errors\n"
      "I set the batch size to 4 and finally can train normally. But after one epoch, i also met the OOM error in\n"
      "validation. The training data have been pruned to min/max duration but the validation data didn't.\n"
      "Epoch 1: 100%|##########| 7330/7330 [55:12<00:00, 2.21it/s]\n"
      "Traceback (most recent call last):\n"
      "  File \"train.py\", line 349, in <module>\n"
      "    main()\n"
      "  File \"train.py\", line 127, in main\n"
      "    recent_bleu4 = validate(val_loader=val_loader, encoder=encoder, decoder=decoder)\n"
      "  File \"train.py\", line 282, in validate\n"
      "    scores_copy = scores.clone()\n"
      "  File \"/usr/lib/python3/dist-packages/torch/nn/modules/module.py\", line 1130, in _call_impl\n"
      "    return forward_call(*input, **kwargs)\n" +
      inc.message + "\n";
  for (auto _ : state) {
    oomguard::Incident c = inc;
    oomguard::ClassifyInPlace(&c);
    benchmark::DoNotOptimize(c.pattern);
  }
  state.SetItemsProcessed(state.iterations());
}
BENCHMARK(BM_ClassifyReport);

}  // namespace

BENCHMARK_MAIN();
