// The pattern classifier: one explicit rule per pattern of the catalogue,
// each a pure function of an incident's figures that returns a confidence and
// evidence in plain words. The highest confidence wins; ties go to the rule
// listed first (the more specific signal). docs/patterns.md documents every
// rule and threshold below; keep the two in step.
//
// Incidents from other tools often lack figures. A rule whose inputs are
// missing (0 / empty) does not fire, and a PyTorch OOM message fills the
// capacity, allocated, reserved and requested figures a record lacks.
#include <xxhash.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <optional>
#include <regex>
#include <string>

#include "oomguard/knowledge_base.h"
#include "sdk/core/format.h"

namespace oomguard {
namespace {

using internal::FormatBytes;

// ---- thresholds (docs/patterns.md) ----
constexpr double kSpikeCostRatio = 1.5;       // activation_spike: largest sample cost / median
constexpr double kFragSlackOfCapacity = 0.10;  // fragmentation: reserved - allocated, share of capacity
constexpr double kForeignOfCapacity = 0.15;   // foreign_memory: held outside the allocator, share of capacity
constexpr double kImbalanceSpread = 0.20;     // rank_imbalance: (max - min) / max of per-rank peaks
constexpr size_t kGrowthMinPoints = 6;        // gradual_growth: step peaks needed
constexpr double kGrowthRiseOfCapacity = 0.05;  // gradual_growth: rise of the step peaks, share of capacity
constexpr double kGrowthRiseOfFirst = 0.10;   // ... of the first peaks when capacity is unknown
constexpr double kGrowthMonotone = 0.60;      // gradual_growth: share of step-to-step changes that rise
constexpr int64_t kStartupSteps = 1;          // startup_capacity: OOM at step <= this with no clean step

const char* kMixedPrecision = "Mixed precision (FP16/BF16 autocast) cuts training memory by about 30-50%";
const char* kActivationCkpt =
    "Activation (gradient) checkpointing saves about 60-70% of activation memory for 20-30% more compute";
const char* kHeadroom = "Leave 20-30% headroom over the estimated per-device need when sizing the job";
const char* kAccumulation =
    "Smaller micro-batches with gradient accumulation keep the global batch (the guard does this; start "
    "from the learned prior)";


std::string Pct(double frac) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%.0f%%", frac * 100.0);
  return buf;
}

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.4g", v);
  return buf;
}

bool Contains(const std::string& hay, std::initializer_list<const char*> needles) {
  std::string lower(hay.size(), ' ');
  std::transform(hay.begin(), hay.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  for (const char* n : needles)
    if (lower.find(n) != std::string::npos) return true;
  return false;
}

// The figures the rules read, with gaps filled from a PyTorch OOM message.
struct Facts {
  const Incident& inc;
  int64_t total, free, allocated, reserved, inactive_split, requested;
  std::string phase;
};

double ParseSize(const std::string& num, const std::string& unit) {
  double v = std::strtod(num.c_str(), nullptr);
  if (unit == "KiB" || unit == "KB") return v * 1024.0;
  if (unit == "MiB" || unit == "MB") return v * 1024.0 * 1024.0;
  if (unit == "GiB" || unit == "GB") return v * 1024.0 * 1024.0 * 1024.0;
  if (unit == "TiB" || unit == "TB") return v * 1024.0 * 1024.0 * 1024.0 * 1024.0;
  return v;
}

void FillFromMessage(Facts* f) {
  const std::string& m = f->inc.message;
  if (m.size() > 8192 || m.find("allocate") == std::string::npos) return;
  static const std::string kSize = R"(([0-9]+(?:\.[0-9]+)?) ?(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB))";
  // std::regex is slow but this runs on the writer thread or in the CLI, and
  // only on messages that look like PyTorch's.
  static const std::regex kTried("Tried to allocate " + kSize);
  static const std::regex kTotalOld(kSize + " total capacity");
  static const std::regex kAllocOld(kSize + " already allocated");
  static const std::regex kFreeOld(kSize + " free");
  static const std::regex kReservedOld(kSize + " reserved in total");
  static const std::regex kTotalNew("total capacity of " + kSize + " of which " + kSize + " is free");
  static const std::regex kAllocNew(kSize + " is allocated by PyTorch, and " + kSize + " is reserved by PyTorch");
  std::smatch s;
  auto get = [&](const std::regex& re, int64_t* out, int group = 1) {
    if (*out == 0 && std::regex_search(m, s, re))
      *out = static_cast<int64_t>(ParseSize(s[group].str(), s[group + 1].str()));
  };
  get(kTried, &f->requested);
  if (std::regex_search(m, s, kTotalNew)) {
    if (f->total == 0) f->total = static_cast<int64_t>(ParseSize(s[1].str(), s[2].str()));
    if (f->free == 0) f->free = static_cast<int64_t>(ParseSize(s[3].str(), s[4].str()));
  }
  if (std::regex_search(m, s, kAllocNew) && f->allocated == 0 && f->reserved == 0) {
    f->allocated = static_cast<int64_t>(ParseSize(s[1].str(), s[2].str()));
    f->reserved = f->allocated + static_cast<int64_t>(ParseSize(s[3].str(), s[4].str()));
  }
  get(kTotalOld, &f->total);
  get(kAllocOld, &f->allocated);
  get(kReservedOld, &f->reserved);
  get(kFreeOld, &f->free);
}

struct Candidate {
  std::string pattern;
  double confidence = 0;
  std::string evidence;
};
using Rule = std::optional<Candidate> (*)(const Facts&);

std::optional<Candidate> CheckpointStaging(const Facts& f) {
  if (f.phase == "checkpoint")
    return Candidate{"checkpoint_staging", 0.9, "the OOM happened while a checkpoint was being staged or written"};
  if (Contains(f.inc.message, {"checkpoint", "staging buffer"}))
    return Candidate{"checkpoint_staging", 0.7, "the error message mentions checkpoint staging"};
  return std::nullopt;
}

std::optional<Candidate> Workspace(const Facts& f) {
  if (f.inc.kind == "workspace")
    return Candidate{"workspace", 0.9, "a library workspace allocation (cuDNN/cuBLAS) failed"};
  if (Contains(f.inc.message, {"workspace", "cublas_status_alloc_failed", "cudnn_status_alloc_failed",
                               "cudnn_status_not_supported"}))
    return Candidate{"workspace", 0.8, "the error message names a cuDNN/cuBLAS workspace allocation"};
  return std::nullopt;
}

std::optional<Candidate> HostDataloader(const Facts& f) {
  bool loader_words = Contains(f.inc.message, {"dataloader", "worker", "pin_memory", "prefetch", "shared memory",
                                               "shm", "killed by signal"});
  if (f.inc.kind == "host" && (f.phase == "data" || loader_words))
    return Candidate{"host_dataloader", 0.9,
                     "host memory ran out in the data pipeline (phase '" + f.phase + "')"};
  if (f.inc.kind == "host")
    return Candidate{"host_dataloader", 0.6, "host (not device) memory ran out in phase '" + f.phase +
                                                 "'; the data pipeline is the usual host-memory consumer"};
  if (f.phase == "data")
    return Candidate{"host_dataloader", 0.6,
                     "device memory ran out during data loading/preprocessing, before the forward pass"};
  if (loader_words) return Candidate{"host_dataloader", 0.5, "the error message mentions the data loader"};
  return std::nullopt;
}

std::optional<Candidate> ForeignMemory(const Facts& f) {
  bool nccl = Contains(f.inc.message, {"nccl"});
  if (f.total > 0 && (f.reserved > 0 || f.free > 0)) {
    double outside = static_cast<double>(f.total - f.reserved - f.free);
    if (outside >= kForeignOfCapacity * static_cast<double>(f.total)) {
      double conf = outside >= static_cast<double>(f.requested) ? 0.85 : 0.7;
      return Candidate{"foreign_memory", conf,
                       FormatBytes(outside) + " (" + Pct(outside / static_cast<double>(f.total)) +
                           " of capacity) is held outside the framework's allocator (capacity - reserved - free)" +
                           (nccl ? "; the message mentions NCCL" : "") + "; the request was " +
                           FormatBytes(static_cast<double>(f.requested))};
    }
  }
  if (nccl || Contains(f.inc.message, {"other process", "process has", "processes have"}))
    return Candidate{"foreign_memory", 0.6,
                     "the error message points at memory held by NCCL or another process"};
  return std::nullopt;
}

std::optional<Candidate> Fragmentation(const Facts& f) {
  if (f.reserved <= 0 || f.requested <= 0) return std::nullopt;
  double slack = static_cast<double>(f.reserved - f.allocated);
  double cap = static_cast<double>(f.total > 0 ? f.total : f.reserved);
  if (slack < kFragSlackOfCapacity * cap) return std::nullopt;
  if (slack + static_cast<double>(std::max<int64_t>(f.free, 0)) < static_cast<double>(f.requested))
    return std::nullopt;
  double conf = 0.75;
  std::string ev = "reserved minus allocated is " + FormatBytes(slack) + " (" + Pct(slack / cap) +
                   " of capacity) while the request was " + FormatBytes(static_cast<double>(f.requested)) +
                   ": enough memory in total, but not in one piece";
  if (f.inactive_split > 0) {
    ev += "; " + FormatBytes(static_cast<double>(f.inactive_split)) + " is stranded in split blocks";
    if (static_cast<double>(f.inactive_split) >= 0.5 * slack) conf += 0.1;
  }
  if (f.inc.memory.num_alloc_retries > 0) {
    ev += "; the allocator already retried " + std::to_string(f.inc.memory.num_alloc_retries) +
          " allocation(s) after freeing its cache";
    conf += 0.05;
  }
  if (f.inc.steps_ok_before == 0 && f.inc.step <= kStartupSteps) {
    // Fragmentation builds up over many steps; before any clean step the
    // cached blocks are the failed attempt's own, and the configuration
    // itself is the likelier cause (startup_capacity then wins).
    conf -= 0.2;
    ev += "; but no step has completed yet";
  }
  return Candidate{"fragmentation", std::min(conf, 0.95), ev};
}

std::optional<Candidate> ActivationSpike(const Facts& f) {
  const Incident& i = f.inc;
  if (i.sample_cost_this > 0 && i.sample_cost_median > 0) {
    double ratio = i.sample_cost_this / i.sample_cost_median;
    if (ratio >= kSpikeCostRatio)
      // A data-dependent cause is more specific than any memory-layout signal
      // seen at the same moment, so a strong ratio outranks fragmentation.
      return Candidate{"activation_spike", ratio >= 3 ? 0.95 : 0.8,
                       "the failing micro-batch holds a sample of cost " + Num(i.sample_cost_this) + ", " +
                           Num(ratio) + "x the step's median " + Num(i.sample_cost_median) +
                           " (data-dependent peak) after " + std::to_string(i.steps_ok_before) + " clean steps"};
    return std::nullopt;
  }
  // Without per-sample costs: clean steps at a stable peak, then one step fails.
  if (i.steps_ok_before >= 5 && i.step_peaks.size() >= 3 && (f.phase == "forward" || f.phase == "backward")) {
    auto [lo, hi] = std::minmax_element(i.step_peaks.begin(), i.step_peaks.end());
    if (*hi > 0 && static_cast<double>(*hi - *lo) <= 0.05 * static_cast<double>(*hi))
      return Candidate{"activation_spike", 0.5,
                       std::to_string(i.steps_ok_before) + " clean steps with a flat peak of about " +
                           FormatBytes(static_cast<double>(*hi)) +
                           " before this one failed: a larger-than-usual batch is likely (no per-sample costs "
                           "were recorded to confirm)"};
  }
  return std::nullopt;
}

std::optional<Candidate> RankImbalance(const Facts& f) {
  const auto& ranks = f.inc.ranks;
  if (ranks.size() < 2) return std::nullopt;
  auto figure = [](const RankMemory& r) { return r.peak_allocated > 0 ? r.peak_allocated : r.allocated; };
  auto [lo, hi] = std::minmax_element(ranks.begin(), ranks.end(),
                                      [&](const RankMemory& a, const RankMemory& b) { return figure(a) < figure(b); });
  double mx = static_cast<double>(figure(*hi)), mn = static_cast<double>(figure(*lo));
  if (mx <= 0) return std::nullopt;
  double spread = (mx - mn) / mx;
  if (spread < kImbalanceSpread) return std::nullopt;
  bool failing_is_top = hi->rank == f.inc.rank;
  return Candidate{"rank_imbalance", failing_is_top ? 0.85 : 0.7,
                   "rank " + std::to_string(hi->rank) + " peaked at " + FormatBytes(mx) + " while rank " +
                       std::to_string(lo->rank) + " peaked at " + FormatBytes(mn) + " (" + Pct(spread) +
                       " spread across " + std::to_string(ranks.size()) + " ranks)" +
                       (failing_is_top ? "; the failing rank is the heaviest" : "")};
}

std::optional<Candidate> OptimizerState(const Facts& f) {
  bool opt_phase = f.phase == "optimizer" || f.phase == "commit";
  bool words = Contains(f.inc.message, {"optimizer", "exp_avg", "adam"});
  if (!opt_phase && !words) return std::nullopt;
  bool first = f.inc.steps_ok_before == 0 && f.inc.step <= kStartupSteps;
  if (opt_phase && first)
    return Candidate{"optimizer_state", 0.85,
                     "the OOM hit the optimizer step at step " + std::to_string(f.inc.step) +
                         " before any step completed: optimizer state (Adam moments: 2x the parameters) is "
                         "allocated at the first optimizer step"};
  if (opt_phase)
    return Candidate{"optimizer_state", 0.65, "the OOM hit the optimizer step (phase '" + f.phase + "')"};
  return Candidate{"optimizer_state", 0.5, "the error message mentions optimizer state"};
}

std::optional<Candidate> GradualGrowth(const Facts& f) {
  const auto& p = f.inc.step_peaks;
  if (p.size() < kGrowthMinPoints) return std::nullopt;
  size_t k = std::max<size_t>(2, p.size() / 4);
  int64_t first = *std::min_element(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(k));
  int64_t last = *std::max_element(p.end() - static_cast<std::ptrdiff_t>(k), p.end());
  double rise = static_cast<double>(last - first);
  int ups = 0, changes = 0;
  for (size_t i = 1; i < p.size(); ++i) {
    if (p[i] == p[i - 1]) continue;
    ++changes;
    if (p[i] > p[i - 1]) ++ups;
  }
  if (changes == 0) return std::nullopt;
  double monotone = static_cast<double>(ups) / changes;
  double threshold = f.total > 0 ? kGrowthRiseOfCapacity * static_cast<double>(f.total)
                                 : kGrowthRiseOfFirst * static_cast<double>(std::max<int64_t>(first, 1));
  if (rise < threshold || monotone < kGrowthMonotone) return std::nullopt;
  double conf = 0.7 + (monotone >= 0.9 ? 0.1 : 0) + (f.inc.steps_ok_before >= 10 ? 0.05 : 0);
  return Candidate{"gradual_growth", conf,
                   "the per-step peak rose by " + FormatBytes(rise) +
                       (f.total > 0 ? " (" + Pct(rise / static_cast<double>(f.total)) + " of capacity)" : "") +
                       " over the last " + std::to_string(p.size()) + " steps, rising in " + Pct(monotone) +
                       " of step-to-step changes, after " + std::to_string(f.inc.steps_ok_before) +
                       " clean steps: memory is not released between steps"};
}

std::optional<Candidate> StartupCapacity(const Facts& f) {
  if (f.inc.steps_ok_before != 0 || f.inc.step > kStartupSteps) return std::nullopt;
  // The optimizer step has its own, more specific rule (optimizer_state).
  if (f.phase == "optimizer" || f.phase == "commit") return std::nullopt;
  std::string ev = "the OOM hit step " + std::to_string(f.inc.step) + " (phase '" + f.phase +
                   "') before any step completed";
  if (f.total > 0 && f.requested > 0)
    ev += ": " + FormatBytes(static_cast<double>(f.allocated)) + " allocated + a request of " +
          FormatBytes(static_cast<double>(f.requested)) + " against a capacity of " +
          FormatBytes(static_cast<double>(f.total));
  if (f.inc.micro_before > 0) ev += "; micro-batch " + std::to_string(f.inc.micro_before);
  return Candidate{"startup_capacity", 0.75, ev + ": the configuration does not fit from the start"};
}

// In catalogue order of specificity: ties go to the earlier rule.
constexpr Rule kRules[] = {CheckpointStaging, Workspace,      HostDataloader, ForeignMemory,  Fragmentation,
                           ActivationSpike,   RankImbalance,  OptimizerState, GradualGrowth, StartupCapacity};

std::vector<PatternInfo> BuildCatalogue() {
  return {
      {"startup_capacity", "The configuration does not fit from the first step",
       "OOM at the first step(s), before any step completed; allocated + requested exceeds capacity.",
       "steps_ok_before == 0 and step <= 1, outside the optimizer step (confidence 0.75).",
       {kAccumulation, kMixedPrecision, kActivationCkpt, kHeadroom,
        "Models that do not fit one device: ZeRO-3/FSDP sharding, tensor or pipeline parallelism; CPU/NVMe "
        "offload (ZeRO-Offload/Infinity) as a last resort, it slows training markedly",
        "Scale up in stages: small data subset, small model, one device first, then grow"}},
      {"activation_spike", "A data-dependent peak: one long or large batch",
       "Clean steps, then one micro-batch holding an unusually costly sample (long sequence, large image) fails.",
       "sample_cost.this >= 1.5 x sample_cost.median (0.8; 0.9 at 3x); without costs: >= 5 clean steps with "
       "a flat step peak (within 5%) and an OOM in forward/backward (0.5).",
       {"Bucket samples by length (dynamic batching) so a long sample does not share a micro-batch with many",
        "Limit micro-batches by cost (tokens), not sample count: pass per-sample costs to Guard::Step",
        kActivationCkpt,
        "Memory-efficient (flash) attention saves a further 20-30% on long sequences",
        "Truncate or filter outlier samples during data preparation"}},
      {"gradual_growth", "Memory grows step after step (a leak)",
       "The per-step peak climbs over many steps until an OOM.",
       ">= 6 step peaks; the max of the last quarter exceeds the min of the first quarter by >= 5% of capacity "
       "(10% of the first peaks when capacity is unknown) and >= 60% of step-to-step changes rise (0.7-0.85).",
       {"Look for references kept across steps: losses summed without .item()/.detach(), lists of tensors, "
        "caches keyed by step, retain_graph=True",
        "Compare memory at the same point of every step or epoch; memory not released after an epoch is a leak",
        "Remove hooks and closures that capture tensors; clear metric accumulators each epoch",
        "Until fixed, checkpoints let the guard roll back and resume instead of failing the run"}},
      {"fragmentation", "Enough free memory in total, but not in one piece",
       "reserved - allocated is large while a request of that size fails; inactive_split is high.",
       "reserved - allocated >= 10% of capacity and reserved - allocated + free >= requested (0.75; +0.1 when "
       "inactive_split is at least half of it, +0.05 after allocator retries).",
       {"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (or max_split_size_mb) so blocks are not split "
        "across segments",
        "The asynchronous allocator cudaMallocAsync (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)",
        "Pool fixed-size tensors and reuse buffers of constant shape: one CV team cut fragmentation from 35% "
        "to 8% this way",
        "Pad variable shapes to a few bucket sizes so freed blocks are reused",
        "torch.cuda.empty_cache() between phases returns cached segments; it stalls training, call it rarely"}},
      {"rank_imbalance", "One rank needs much more memory than the others",
       "Per-rank peaks differ widely; the heaviest rank fails while others have room.",
       ">= 2 ranks and (max - min) / max of per-rank peak (or allocated) >= 20% (0.7; 0.85 when the failing "
       "rank is the heaviest).",
       {"Balance the data across ranks: equal token counts per rank, length bucketing across ranks",
        "Check model/pipeline partitioning and rank 0's extra buffers (metrics, logging, embeddings)",
        "Shard optimizer state with ZeRO so it is spread evenly across ranks",
        "Size micro-batches per rank in cost units, not samples"}},
      {"optimizer_state", "Optimizer state appears at the first optimizer step",
       "Forward and backward fit, then the optimizer step fails (Adam/AdamW moments are 2-3x the parameters).",
       "phase optimizer/commit and no clean step yet at step <= 1 (0.85); phase optimizer/commit later (0.65); "
       "message mentions optimizer/Adam state (0.5).",
       {"Budget for optimizer state: AdamW keeps two moments, 2-3x the parameter memory",
        "Shard optimizer state with ZeRO-1/2 or FSDP; offload it with ZeRO-Offload at a throughput cost",
        "Use a leaner optimizer (8-bit Adam, Adafactor, SGD with momentum)",
        kMixedPrecision}},
      {"host_dataloader", "Host memory exhausted by the data pipeline",
       "A host (not device) OOM, usually in the data phase; or a device OOM during data preprocessing.",
       "kind host and (phase data or the message names the loader/workers/pin_memory/shared memory) (0.9); "
       "kind host elsewhere (0.6); device OOM in phase data (0.6); loader words only (0.5).",
       {"Fewer DataLoader workers (num_workers) and a smaller prefetch_factor: each worker holds prefetched "
        "batches in host memory",
        "Load large files (video) in shards instead of whole; move preprocessing to the GPU",
        "Share memory between workers instead of copying; pin_memory only with host memory to spare",
        "Request 20-30% more host memory than the estimate for the container/pod"}},
      {"checkpoint_staging", "Checkpoint staging needs memory the step also needs",
       "The OOM happens while a checkpoint is staged or written.",
       "phase checkpoint (0.9); the message mentions checkpoint/staging buffer (0.7).",
       {"Lower the checkpoint staging budget or save fewer tensors at once (sharded, asynchronous save)",
        "Stage to host memory, not device memory, and keep at most one snapshot in host memory",
        "Save right after the optimizer step, when activations are freed",
        "Keep retention to the last K checkpoints"}},
      {"workspace", "A library workspace (cuDNN/cuBLAS) could not be allocated",
       "A small or medium request from a math library fails near the capacity limit.",
       "kind workspace (0.9); the message names a cuDNN/cuBLAS workspace or *_STATUS_ALLOC_FAILED (0.8).",
       {"Limit library workspaces (CUBLAS_WORKSPACE_CONFIG=:4096:8; torch.backends.cudnn.benchmark=False)",
        kHeadroom, "Pick algorithms with smaller workspaces or run the layer at a smaller micro-batch",
        kMixedPrecision}},
      {"foreign_memory", "Memory held outside the framework (NCCL buffers, another process)",
       "capacity - reserved - free is large: someone other than this allocator holds device memory.",
       "capacity - reserved - free >= 15% of capacity (0.85 when it alone exceeds the request, else 0.7); the "
       "message names NCCL or another process (0.6).",
       {"Find other processes on the device (nvidia-smi) and run one training process per GPU",
        "Account for NCCL communication buffers; lower NCCL_BUFFSIZE or the number of channels",
        "Set the device (CUDA_VISIBLE_DEVICES, torch.cuda.set_device) before any CUDA call so ranks do not "
        "create contexts on each other's GPUs",
        kHeadroom}},
  };
}

const PatternInfo* FindPattern(const std::string& name) {
  for (const auto& p : PatternCatalogue())
    if (p.name == name) return &p;
  return nullptr;
}

}  // namespace

const std::vector<PatternInfo>& PatternCatalogue() {
  static const std::vector<PatternInfo> kCatalogue = BuildCatalogue();
  return kCatalogue;
}

Classification ClassifyIncident(const Incident& incident) {
  Facts f{incident,
          incident.memory.total,
          incident.memory.free,
          incident.memory.allocated,
          incident.memory.reserved,
          incident.memory.inactive_split,
          incident.requested_bytes,
          incident.phase.empty() ? "unknown" : incident.phase};
  FillFromMessage(&f);

  std::optional<Candidate> best;
  std::vector<Candidate> others;
  for (Rule rule : kRules) {
    std::optional<Candidate> c = rule(f);
    if (!c) continue;
    if (!best || c->confidence > best->confidence) {
      if (best) others.push_back(*best);
      best = std::move(c);
    } else {
      others.push_back(*c);
    }
  }
  Classification out;
  if (!best) {
    out.pattern = "unknown";
    out.confidence = 0.2;
    out.evidence = "no rule matched the recorded figures (phase '" + f.phase + "', kind '" +
                   (incident.kind.empty() ? "unknown" : incident.kind) + "')";
    out.remedies = {kAccumulation, kMixedPrecision, kActivationCkpt, kHeadroom};
    return out;
  }
  out.pattern = best->pattern;
  out.confidence = best->confidence;
  out.evidence = best->evidence;
  // A close runner-up lowers confidence and is named, so a reader sees the doubt.
  std::sort(others.begin(), others.end(), [](const Candidate& a, const Candidate& b) { return a.confidence > b.confidence; });
  if (!others.empty() && others[0].pattern != best->pattern && others[0].confidence >= best->confidence - 0.1) {
    out.confidence = std::max(0.3, out.confidence - 0.1);
    out.evidence += "; also consistent with " + others[0].pattern + " (" + others[0].evidence + ")";
  }
  if (const PatternInfo* p = FindPattern(out.pattern)) out.remedies = p->remedies;
  return out;
}

std::string IncidentFingerprint(const Incident& inc) {
  // Version 1 of the grouping key. Bump it when the key changes, so old and
  // new fingerprints never collide by accident.
  int bucket = -1;
  if (inc.requested_bytes > 0) bucket = 63 - __builtin_clzll(static_cast<unsigned long long>(inc.requested_bytes));
  std::string key = "oomguard-group/1";
  for (const std::string* s : {&inc.pattern, &inc.kind, &inc.phase, &inc.workload}) {
    key.push_back('\0');
    key += *s;
  }
  key.push_back('\0');
  key += std::to_string(bucket);
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016" PRIx64, static_cast<uint64_t>(XXH3_64bits(key.data(), key.size())));
  return buf;
}

void ClassifyInPlace(Incident* incident) {
  Classification c = ClassifyIncident(*incident);
  incident->pattern = std::move(c.pattern);
  incident->confidence = c.confidence;
  incident->evidence = std::move(c.evidence);
  incident->remedies = std::move(c.remedies);
  incident->fingerprint = IncidentFingerprint(*incident);
}

}  // namespace oomguard
