// The classifier's rules: one function per pattern, each reading only known
// facts. A rule whose evidence is unknown does not fire. Confidence says how
// strong the deciding evidence is: figures the allocator printed and frames
// of the traceback weigh more than log progress, and those more than words
// of a description. docs/patterns.md states every rule and threshold; keep
// the two in step.
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "sdk/core/format.h"
#include "sdk/kb/classifier_facts.h"
#include "sdk/kb/text_scan.h"

namespace oomguard::kb {
namespace {

using internal::FormatBytes;
using text::Contains;
using text::ContainsAny;

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;

// ---- thresholds (docs/patterns.md) ----
constexpr double kImpossibleOfCapacity = 2.0;      // impossible_request: request >= 2x the device
constexpr double kImpossibleOfHeld = 10.0;         // ... or > the device and >= 10x what the process holds
constexpr int64_t kImpossibleAbsolute = 256 * kGiB;  // ... or, capacity unknown, >= 256 GiB of host memory
// ... or of device memory: more than the largest single accelerator ships
// with (256 GB of HBM3E on an MI325X; 192 GB on a B200).
constexpr int64_t kImpossibleAbsoluteDevice = int64_t{256} * 1000 * 1000 * 1000;
constexpr double kFragMinOfReserved = 0.08;        // fragmentation: cached free >= 8% of reserved (+0.1) ...
constexpr double kFragManyRequests = 4.0;          // ... or >= 4x the request and ...
constexpr double kFragFloorOfReserved = 0.03;      // ... >= 3% of reserved (below: ordinary allocator slack)
constexpr double kFragLargeOfReserved = 0.20;      // +0.1 when cached free >= 20% of reserved
constexpr double kFragStrongOfRequest = 2.0;       // +0.1 when cached free >= 2x the request
constexpr double kForeignOfReserved = 0.25;        // foreign_memory: outside >= 25% of this process's reserved
constexpr double kCopyOfAllocated = 0.10;          // checkpoint_load: state copies >= 10% of allocated
constexpr int64_t kContextAllowance = 512 * kMiB;  // a CUDA context's own memory, when not printed
constexpr double kSpikeCostRatio = 1.5;            // activation_spike: largest sample cost / median
constexpr double kImbalanceSpread = 0.20;          // rank_imbalance: (max - min) / max of per-rank peaks
constexpr size_t kGrowthMinPoints = 6;             // gradual_growth: step peaks needed
constexpr double kGrowthRiseOfCapacity = 0.05;     // ... rise of the step peaks, share of capacity
constexpr double kGrowthRiseOfFirst = 0.10;        // ... of the first peaks when capacity is unknown
constexpr double kGrowthMonotone = 0.60;           // ... share of step-to-step changes that rise
constexpr int64_t kManyEpochs = 3;                 // gradual_growth: clean epochs over the same data

std::string Pct(double frac) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.0f%%", frac * 100.0);
  return buf;
}
// Sample costs are usually token or pixel counts: whole numbers print whole.
std::string Num(double v) {
  char buf[32];
  if (v == std::floor(v) && std::fabs(v) < 1e15)
    std::snprintf(buf, sizeof(buf), "%.0f", v);
  else
    std::snprintf(buf, sizeof(buf), "%.3g", v);
  return buf;
}
std::string B(int64_t v) { return FormatBytes(static_cast<double>(v)); }
double D(int64_t v) { return static_cast<double>(v); }

Candidate Make(const char* pattern, double confidence, std::string evidence) {
  return Candidate{pattern, std::min(confidence, 0.95), std::move(evidence)};
}

std::optional<Candidate> ImpossibleRequest(const Facts& f) {
  if (!f.requested) return std::nullopt;
  const int64_t req = *f.requested;
  const std::string tail = ": no batch size or precision change makes one allocation of that size fit; a shape, "
                           "dtype or unit computed it (check the tensor sizes of the failing op)";
  if (f.requested_lower_bound && req >= int64_t{1000000000000000})
    return Make("impossible_request", 0.95,
                "the request was more than " +
                    (req >= int64_t{1000000000000000000} ? std::string("1 EB (10^18 bytes)") : B(req)) + tail);
  if (f.total) {
    const double times = D(req) / D(std::max<int64_t>(*f.total, 1));
    if (times >= kImpossibleOfCapacity)
      return Make("impossible_request", 0.9,
                  "a single request of " + B(req) + " is " + Num(times) + "x the whole device (" + B(*f.total) + ")" +
                      tail);
    const int64_t held = std::max(f.reserved.value_or(0), f.allocated.value_or(0));
    if (req > *f.total && (f.reserved || f.allocated) && D(req) >= kImpossibleOfHeld * D(std::max(held, kMiB)))
      return Make("impossible_request", 0.8,
                  "a single request of " + B(req) + " exceeds the whole device (" + B(*f.total) +
                      ") while the process holds only " + B(held) + tail);
    return std::nullopt;
  }
  if (req >= (f.kind == "host" ? kImpossibleAbsolute : kImpossibleAbsoluteDevice))
    return Make("impossible_request", 0.85,
                "a single request of " + B(req) + " is beyond the memory of any single " +
                    (f.kind == "host" ? "ordinary host" : "device (the largest have 256 GB)") + tail);
  return std::nullopt;
}

std::optional<Candidate> CheckpointStaging(const Facts& f) {
  if (f.phase == "checkpoint")
    return Make("checkpoint_staging", f.phase_recorded ? 0.9 : 0.85,
                "the OOM happened while a checkpoint was being staged or saved (" + f.phase_why + ")");
  const std::string m = text::Lower(f.inc.message);
  if (ContainsAny(m, {"staging buffer", "checkpoint stag"}) && !Contains(m, "shards"))
    return Make("checkpoint_staging", 0.7, "the error message names checkpoint staging");
  if (f.cues.said_save && f.phase != "load")
    return Make("checkpoint_staging", 0.65, "the OOM came with saving a checkpoint: " + f.cues.said_save.why);
  return std::nullopt;
}

std::optional<Candidate> CheckpointLoad(const Facts& f) {
  if (f.kind == "host") return std::nullopt;  // weights restored in host memory: host_memory
  const std::string hold = ": restored tensors (model, optimizer state, the checkpoint dict itself) are held on the "
                           "device when training needs the memory";
  if (const int64_t copies = f.inc.framework.state_copy_bytes; copies > 0) {
    const int64_t held = f.allocated.value_or(0);
    const std::optional<int64_t> shortfall =
        f.requested && f.free ? std::optional<int64_t>(*f.requested - *f.free) : std::nullopt;
    if (D(copies) >= kCopyOfAllocated * D(held) || (shortfall && copies >= *shortfall)) {
      const bool explains = shortfall && copies >= *shortfall;
      return Make("checkpoint_load", explains ? 0.9 : 0.8,
                  B(copies) + " of live tensors outside the model copy its state (its parameter names and shapes)" +
                      (held > 0 ? ", " + Pct(D(copies) / D(held)) + " of the " + B(held) + " allocated" : "") +
                      (explains ? "; without them the " + B(*f.requested) + " request would fit" : "") +
                      ": a loaded checkpoint (its state dict) is still referenced beside the model");
    }
  }
  if (f.phase == "load")
    return Make("checkpoint_load", 0.85, "the OOM was raised while a checkpoint was restored onto the device (" +
                                             f.phase_why + ")" + hold);
  if (f.cues.resumed && !(f.CleanSteps() && *f.CleanSteps() > 50))
    return Make("checkpoint_load", 0.75, "training resumed from a checkpoint (" + f.cues.resumed.why +
                                             ") and ran out in its first steps" + hold);
  if (f.cues.said_resume)
    return Make("checkpoint_load", 0.7, "the OOM follows restoring a checkpoint: " + f.cues.said_resume.why + hold);
  if (f.cues.said_pretrained)
    return Make("checkpoint_load", 0.6, "the OOM comes with loading pretrained weights onto the device: " +
                                            f.cues.said_pretrained.why + hold);
  return std::nullopt;
}

std::optional<Candidate> Workspace(const Facts& f) {
  if (f.kind == "workspace")
    return Make("workspace", 0.9, "a library's scratch allocation (cuBLAS/cuDNN handle or workspace) failed");
  if (ContainsAny(text::Lower(f.inc.message), {"workspace", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
                                              "cudnn_status_not_supported"}))
    return Make("workspace", 0.8, "the error message names a cuDNN/cuBLAS workspace allocation");
  return std::nullopt;
}

bool LoaderWords(const Facts& f) {
  return ContainsAny(text::Lower(f.inc.message), {"dataloader", "worker", "pin_memory", "prefetch", "shared memory",
                                                  "/dev/shm", "(shm)", "killed by signal"});
}

std::optional<Candidate> HostDataloader(const Facts& f) {
  if (f.kind == "host") {
    if (f.phase == "data")
      return Make("host_dataloader", 0.9, "host memory ran out in the data pipeline (" + f.phase_why + ")");
    if (LoaderWords(f))
      return Make("host_dataloader", 0.85, "host memory ran out in the data pipeline: the message reports a loader "
                                           "worker killed or out of shared memory");
    if (f.cues.data_prep)
      return Make("host_dataloader", 0.8, "host memory ran out while the dataset was being prepared (" +
                                              f.cues.data_prep.why + ")");
    if (f.cues.said_data_pipeline && !f.cues.said_no_workers)
      return Make("host_dataloader", 0.65, "host memory ran out and the report points at the data pipeline: " +
                                               f.cues.said_data_pipeline.why);
    return std::nullopt;
  }
  if (f.phase == "data")
    return Make("host_dataloader", 0.6, "device memory ran out during data loading, before the forward pass (" +
                                            f.phase_why + ")");
  if (LoaderWords(f)) return Make("host_dataloader", 0.5, "the error message mentions the data loader");
  return std::nullopt;
}

std::optional<Candidate> HostMemory(const Facts& f) {
  if (f.kind != "host" || f.phase == "data" || LoaderWords(f) || f.cues.data_prep) return std::nullopt;
  if (f.cues.said_data_pipeline && !f.cues.said_no_workers) return std::nullopt;
  const Cue& w = f.cues.loading_weights ? f.cues.loading_weights : f.cues.said_loading_weights;
  if (w || f.phase == "load" || f.phase == "init")
    return Make("host_memory", 0.75, "host memory ran out while model weights were loaded, merged or offloaded in "
                                     "host memory (" + (w ? w.why : f.phase_why) + "), outside the data pipeline");
  if (f.cues.said_no_workers)
    return Make("host_memory", 0.7, "host memory ran out with no loader worker processes (" +
                                        f.cues.said_no_workers.why + "): the main process itself held it");
  return Make("host_memory", 0.5, "host (not device) memory ran out in phase '" +
                                      (f.phase.empty() ? std::string("unknown") : f.phase) +
                                      "'; nothing in the record points at the data pipeline (no loader worker, "
                                      "pin-memory or shared-memory message)");
}

std::optional<Candidate> ForeignMemory(const Facts& f) {
  if (f.kind == "host") return std::nullopt;
  const std::string m = text::Lower(f.inc.message);
  if (Contains(m, "nccl") && ContainsAny(m, {"out of memory", "calloc", "malloc"}))
    return Make("foreign_memory", 0.8, "NCCL could not allocate its own communication buffers (\"" +
                                           f.inc.message.substr(0, 120) + "\"): the framework's allocator left no room "
                                           "for memory held outside it");
  if (f.phase == "comm")
    return Make("foreign_memory", 0.75, "the OOM was raised inside a collective (" + f.phase_why + "): NCCL allocates "
                                        "its communicators and buffers there, outside the framework's allocator");
  const std::string ctx = text::Lower(f.inc.context);
  if (Contains(ctx, "nccl") && ContainsAny(ctx, {"unhandled cuda error", "ncclunhandledcudaerror", "cuda failure"}))
    return Make("foreign_memory", 0.7, "NCCL failed with a CUDA error alongside the OOM: its buffers found no room "
                                       "beside the framework's memory");
  if (!f.FreeCoversRequest() && f.total && f.reserved && f.free) {
    const int64_t reserved = *f.reserved;
    const int64_t outside = *f.total - reserved - *f.free;
    const bool listed = f.other_processes > 0;
    int64_t self_extra = f.process_in_use ? std::max<int64_t>(0, *f.process_in_use - reserved) : kContextAllowance;
    int64_t foreign = listed ? f.other_processes : outside - self_extra;
    const std::optional<int64_t> shortfall =
        f.requested ? std::optional<int64_t>(*f.requested - *f.free) : std::nullopt;
    if (foreign >= kForeignOfReserved * D(std::max<int64_t>(reserved, 1)) && (!shortfall || foreign >= *shortfall)) {
      double conf = listed ? 0.85 : 0.75;
      // Most of the device held elsewhere outweighs where the last
      // allocation happened to be made (a frame says where, not why).
      if (foreign >= reserved) conf += 0.15;
      return Make("foreign_memory", conf,
                  B(foreign) + " of the " + B(*f.total) + " device is held outside this process's allocator (" +
                      (listed ? std::string("other processes listed in the message")
                              : "capacity - reserved - free" +
                                    std::string(f.process_in_use ? ", less this process's own non-PyTorch memory"
                                                                 : ", less a CUDA context")) +
                      ") against " + B(reserved) + " reserved by the process" +
                      (shortfall ? "; without it the " + B(*f.requested) + " request would fit" : ""));
    }
    if (f.process_in_use && self_extra >= kForeignOfReserved * D(reserved) && (!shortfall || self_extra >= *shortfall))
      return Make("foreign_memory", 0.65,
                  "this process holds " + B(self_extra) + " outside PyTorch's allocator (CUDA context, NCCL buffers, "
                  "other libraries) beside " + B(reserved) + " reserved");
  }
  if (f.cues.said_other_process)
    return Make("foreign_memory", 0.55, "another process shares the device: " + f.cues.said_other_process.why);
  return std::nullopt;
}

std::optional<Candidate> Fragmentation(const Facts& f) {
  auto slack = f.CachedFree();
  if (!slack || !f.requested || !f.reserved || f.FreeCoversRequest()) return std::nullopt;
  const double s = D(*slack), req = D(*f.requested), res = D(*f.reserved);
  // Cached free blocks matter when they are a real share of what the
  // allocator holds, or many times the request while not a rounding error.
  const double share = s / res;
  if (s < req) return std::nullopt;
  if (share < kFragMinOfReserved && !(s >= kFragManyRequests * req && share >= kFragFloorOfReserved))
    return std::nullopt;
  double conf = 0.55;
  if (share >= kFragMinOfReserved) conf += 0.1;
  if (share >= kFragLargeOfReserved) conf += 0.1;
  if (s >= kFragStrongOfRequest * req) conf += 0.1;
  std::string ev = B(*slack) + " is reserved but unallocated (" + Pct(share) + " of the " + B(*f.reserved) +
                   " reserved) against a request of " + B(*f.requested) +
                   ": the cache holds enough in total, but no free block is large enough";
  if (f.inactive_split && D(*f.inactive_split) >= 0.5 * s) {
    ev += "; " + B(*f.inactive_split) + " is stranded in split blocks";
    conf += 0.05;
  }
  if (f.inc.memory.num_alloc_retries > 0) {
    ev += "; the allocator already retried " + std::to_string(f.inc.memory.num_alloc_retries) +
          " allocation(s) after freeing its cache";
    conf += 0.05;
  }
  if (f.AtFirstStep()) {
    // Fragmentation builds up over steps; before any clean step the cached
    // blocks are the failed attempt's own and the configuration is the
    // likelier cause (startup_capacity then wins).
    conf -= 0.2;
    ev += "; but no step has completed yet";
  }
  return Make("fragmentation", std::min(conf, 0.9), ev);
}

std::optional<Candidate> EvalWithoutNoGrad(const Facts& f) {
  if (f.kind == "host" || f.cues.no_grad) return std::nullopt;
  if (f.phase == "backward" || f.phase == "optimizer" || f.phase == "load" || f.phase == "checkpoint") return std::nullopt;
  if (const std::optional<bool> recording = f.inc.framework.grad_recording; recording && f.phase == "eval") {
    if (!*recording) return std::nullopt;  // autograd was off where it failed
    return Make("eval_without_no_grad", f.RanBefore() ? 0.9 : 0.85,
                "the OOM happened in evaluation (" + f.phase_why + ") while tensors of the failing frames were "
                "recording autograd graphs: without torch.no_grad()/inference_mode every activation is kept for a "
                "backward that never runs" + std::string(f.RanBefore() ? "; training steps ran before" : ""));
  }
  const Cue& e = f.cues.eval ? f.cues.eval : f.cues.said_eval;
  if (!e && !f.cues.said_grad_on) return std::nullopt;
  double conf = f.cues.eval ? 0.7 : 0.6;
  std::string ev = e ? "the OOM happened in evaluation/validation (" + e.why + ") and nothing shows gradients "
                       "disabled there: without torch.no_grad()/inference_mode every activation is kept for a backward "
                       "that never runs"
                     : "an evaluation runs with gradients on";
  if (f.cues.said_grad_on) {
    conf = e ? conf + 0.1 : 0.65;
    ev += "; " + f.cues.said_grad_on.why;
  }
  if (f.cues.eval_code_without_no_grad) {
    conf += 0.1;
    ev += "; " + f.cues.eval_code_without_no_grad.why;
  }
  if (f.RanBefore()) {
    conf += 0.05;
    ev += "; training steps ran before at the same batch size";
  }
  if (f.CleanEpochs() && *f.CleanEpochs() >= 2) {
    // Evaluation already passed after earlier epochs: its own footprint fits.
    conf = 0.4;
    ev += "; but " + std::to_string(*f.CleanEpochs()) + " epochs (with their evaluations) completed before";
  }
  return Make("eval_without_no_grad", conf, ev);
}

std::optional<Candidate> RankImbalance(const Facts& f) {
  const auto& ranks = f.inc.ranks;
  if (ranks.size() >= 2) {
    auto figure = [](const RankMemory& r) { return r.peak_allocated > 0 ? r.peak_allocated : r.allocated; };
    auto [lo, hi] = std::minmax_element(ranks.begin(), ranks.end(),
                                        [&](const RankMemory& a, const RankMemory& b) { return figure(a) < figure(b); });
    double mx = D(figure(*hi)), mn = D(figure(*lo));
    if (mx > 0 && (mx - mn) / mx >= kImbalanceSpread) {
      bool failing_is_top = IsKnown(f.inc, "rank") && hi->rank == f.inc.rank;
      return Make("rank_imbalance", failing_is_top ? 0.85 : 0.7,
                  "rank " + std::to_string(hi->rank) + " peaked at " + FormatBytes(mx) + " while rank " +
                      std::to_string(lo->rank) + " peaked at " + FormatBytes(mn) + " (" + Pct((mx - mn) / mx) +
                      " spread across " + std::to_string(ranks.size()) + " ranks)" +
                      (failing_is_top ? "; the failing rank is the heaviest" : ""));
    }
  }
  if (f.cues.said_imbalance)
    return Make("rank_imbalance", 0.7, "one device holds much more than the others: " + f.cues.said_imbalance.why);
  return std::nullopt;
}

std::optional<Candidate> ActivationSpike(const Facts& f) {
  const Incident& i = f.inc;
  if (i.sample_cost_this > 0 && i.sample_cost_median > 0) {
    double ratio = i.sample_cost_this / i.sample_cost_median;
    if (ratio < kSpikeCostRatio) return std::nullopt;
    // A data-dependent cause is more specific than any memory-layout signal
    // seen at the same moment, so a strong ratio outranks fragmentation.
    return Make("activation_spike", ratio >= 3 ? 0.95 : 0.8,
                "the failing micro-batch holds a sample of cost " + Num(i.sample_cost_this) + ", " + Num(ratio) +
                    "x the step's median " + Num(i.sample_cost_median) + " (data-dependent peak)" +
                    (f.steps_ok_before ? " after " + std::to_string(*f.steps_ok_before) + " clean steps" : ""));
  }
  if (f.steps_ok_before && *f.steps_ok_before >= 5 && i.step_peaks.size() >= 3 &&
      (f.phase == "forward" || f.phase == "backward")) {
    auto [lo, hi] = std::minmax_element(i.step_peaks.begin(), i.step_peaks.end());
    if (*hi > 0 && D(*hi - *lo) <= 0.05 * D(*hi))
      return Make("activation_spike", 0.5,
                  std::to_string(*f.steps_ok_before) + " clean steps with a flat peak of about " + B(*hi) +
                      " before this one failed: a larger-than-usual batch is likely (no per-sample costs were "
                      "recorded to confirm)");
  }
  if (f.cues.said_growth || f.AtFirstStep()) return std::nullopt;
  if (f.cues.said_batch_specific)
    return Make("activation_spike", 0.7, "the failure follows particular batches, not the configuration: " +
                                             f.cues.said_batch_specific.why);
  if (f.RanBefore() && f.cues.variable_size_data && !(f.CleanEpochs() && *f.CleanEpochs() >= kManyEpochs))
    return Make("activation_spike", 0.55,
                "training ran cleanly before the OOM (" + std::to_string(f.CleanSteps().value_or(0)) +
                    " steps) on data whose samples vary in size (" + f.cues.variable_size_data.why +
                    "): one long or large batch is the likely trigger");
  return std::nullopt;
}

std::optional<Candidate> OptimizerState(const Facts& f) {
  // Only the optimizer phase: "commit" is the guard's end of the local work
  // (the sync buffers, the vote and the gradient sum), which holds gradients
  // and communication buffers, not optimizer state.
  const bool opt_phase = f.phase == "optimizer";
  const std::string ctx = text::Lower(f.inc.context);
  if (opt_phase && (f.AtFirstStep() || f.cues.said_first || Contains(ctx, "initialize(")))
    return Make("optimizer_state", 0.85,
                "the OOM hit the optimizer (" + f.phase_why + ") before any step completed: optimizer state (Adam "
                "moments: 2x the parameters) is allocated at the first optimizer step");
  if (opt_phase) return Make("optimizer_state", f.phase_recorded ? 0.65 : 0.7, "the OOM hit the optimizer step (" + f.phase_why + ")");
  if (f.kind == "host") return std::nullopt;
  if (f.cues.said_adam_not_sgd)
    return Make("optimizer_state", 0.7, "the same batch fits with SGD but not with Adam: " + f.cues.said_adam_not_sgd.why);
  if (ContainsAny(ctx, {"optimizer state", "zero optimizer", "optimizer states"}))
    return Make("optimizer_state", f.cues.said_first ? 0.8 : 0.65,
                "the report places the OOM in creating the optimizer's state");
  const auto clean = f.CleanSteps();
  if (clean && *clean == 1 && (f.phase.empty() || f.phase == "forward" || f.phase == "backward"))
    return Make("optimizer_state", 0.6,
                "exactly one step completed before the OOM: the first optimizer step creates Adam's state (2x the "
                "parameters), so the second iteration is the first to carry it");
  if (ContainsAny(text::Lower(f.inc.message), {"optimizer", "exp_avg", "adam"}))
    return Make("optimizer_state", 0.5, "the error message mentions optimizer state");
  return std::nullopt;
}

std::optional<Candidate> GradualGrowth(const Facts& f) {
  const auto& p = f.inc.step_peaks;
  if (p.size() >= kGrowthMinPoints) {
    size_t k = std::max<size_t>(2, p.size() / 4);
    int64_t first = *std::min_element(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(k));
    int64_t last = *std::max_element(p.end() - static_cast<std::ptrdiff_t>(k), p.end());
    double rise = D(last - first);
    int ups = 0, changes = 0;
    for (size_t i = 1; i < p.size(); ++i) {
      if (p[i] == p[i - 1]) continue;
      ++changes;
      if (p[i] > p[i - 1]) ++ups;
    }
    double monotone = changes > 0 ? static_cast<double>(ups) / changes : 0;
    double threshold = f.total ? kGrowthRiseOfCapacity * D(*f.total) : kGrowthRiseOfFirst * D(std::max<int64_t>(first, 1));
    if (changes > 0 && rise >= threshold && monotone >= kGrowthMonotone) {
      double conf = 0.7 + (monotone >= 0.9 ? 0.1 : 0) + (f.steps_ok_before && *f.steps_ok_before >= 10 ? 0.05 : 0);
      return Make("gradual_growth", conf,
                  "the per-step peak rose by " + FormatBytes(rise) +
                      (f.total ? " (" + Pct(rise / D(*f.total)) + " of capacity)" : "") + " over the last " +
                      std::to_string(p.size()) + " steps, rising in " + Pct(monotone) +
                      " of step-to-step changes: memory is not released between steps");
    }
  }
  if (f.cues.said_growth) {
    bool long_run = (f.CleanEpochs() && *f.CleanEpochs() >= 2) || (f.CleanSteps() && *f.CleanSteps() >= 1000);
    return Make("gradual_growth", long_run ? 0.75 : 0.7,
                "memory grew during training until it ran out: " + f.cues.said_growth.why);
  }
  if (f.CleanEpochs() && *f.CleanEpochs() >= kManyEpochs && !f.cues.said_batch_specific && !f.cues.variable_size_data)
    return Make("gradual_growth", 0.55,
                std::to_string(*f.CleanEpochs()) + " epochs over the same data completed before the OOM, so no batch "
                "of it is too large on its own: memory accumulated across steps");
  return std::nullopt;
}

std::optional<Candidate> StartupCapacity(const Facts& f) {
  if (f.kind == "host" || f.phase == "optimizer") return std::nullopt;
  if (f.RanBefore()) return std::nullopt;
  std::string figures;
  if (f.total && f.requested)
    figures = ": " + (f.allocated ? B(*f.allocated) + " allocated + " : std::string()) + "a request of " +
              B(*f.requested) + " against a capacity of " + B(*f.total);
  const std::string end = figures + ": the configuration does not fit from the start";
  if (f.step && f.steps_ok_before && *f.steps_ok_before == 0 && *f.step <= 1)
    return Make("startup_capacity", 0.75, "the OOM hit step " + std::to_string(*f.step) + " (phase '" +
                                              (f.phase.empty() ? std::string("unknown") : f.phase) +
                                              "') before any step completed" + end);
  if (f.phase == "init")
    return Make("startup_capacity", 0.75, "the OOM hit while the model was being placed on the device (" + f.phase_why +
                                              "), before training" + end);
  if (f.cues.first_step) return Make("startup_capacity", 0.7, f.cues.first_step.why + end);
  if (f.fig.program_total && (!f.total || *f.fig.program_total > *f.total))
    return Make("startup_capacity", 0.6, "XLA sized the compiled program's buffers at " + B(*f.fig.program_total) +
                                             ": the same program fails on every step" + end);
  if (f.cues.said_first) return Make("startup_capacity", 0.65, "the OOM came at the start: " + f.cues.said_first.why + end);
  if (f.cues.said_model_to_device)
    return Make("startup_capacity", 0.65, "the OOM came while the model was set up on the device: " +
                                              f.cues.said_model_to_device.why + end);
  if (f.cues.said_batch_one)
    return Make("startup_capacity", 0.6, "it fails even at batch size 1, so the model and its states alone do not fit: " +
                                             f.cues.said_batch_one.why + end);
  if (f.total && f.requested && *f.requested > *f.total)
    return Make("startup_capacity", 0.55, "one request of " + B(*f.requested) + " is larger than the whole device (" +
                                              B(*f.total) + ")" + end);
  return std::nullopt;
}

}  // namespace

// In order of specificity: ties go to the earlier rule.
const Rule kRules[] = {ImpossibleRequest, CheckpointStaging, CheckpointLoad,    Workspace,     HostDataloader,
                       HostMemory,        ForeignMemory,     Fragmentation,     EvalWithoutNoGrad, RankImbalance,
                       ActivationSpike,   OptimizerState,    GradualGrowth,     StartupCapacity};
const size_t kRuleCount = sizeof(kRules) / sizeof(kRules[0]);

}  // namespace oomguard::kb
