// GuardOptions: everything a Guard is configured with. Every field has a
// default; ValidateGuardOptions names the field and the bad value.
//
// Pointers are not owned and must outlive the Guard (as LevelDB's Options::env).
#ifndef OOMGUARD_OPTIONS_H_
#define OOMGUARD_OPTIONS_H_

#include <cstdint>
#include <string>

#include "oomguard/export.h"
#include "oomguard/size_controller.h"
#include "oomguard/status.h"

namespace oomguard {

class Device;
class Coordinator;
class IncidentSink;
class RecoveryStore;
class MicroBatchPriors;

struct GuardOptions {
  // Micro-batch limit at the first step (samples, or cost units when steps pass
  // per-sample costs). 0: the whole step in one micro-batch.
  int64_t initial_micro_batch = 0;
  // Smallest micro-batch the guard splits down to; an OOM there escalates.
  int64_t min_micro_batch = 1;
  // Largest micro-batch a growth probe may try. 0: no bound but the step itself.
  int64_t max_micro_batch = 0;
  // Clean, limit-bound steps before the guard probes a larger micro-batch. 0: never grow.
  int grow_after = 10;
  // Probing stops when (smallest failing - limit) <= grow_tolerance * smallest failing.
  double grow_tolerance = 0.05;
  // Steps after which the smallest failing size is forgotten. 0: never.
  int forget_bad_after = 500;
  // How the micro-batch limit is chosen (size_controller.h). kPredictive fits
  // the device's memory figures and jumps to the largest size predicted to
  // fit; without a device (or one with no capacity) it acts as kSearch.
  // kSearch halves on OOM and binary-searches back up, ignoring figures.
  SizePolicy controller = SizePolicy::kPredictive;
  // Hard bound on OOMs handled within one step before the guard gives up
  // (also bounds the redos of a step after other ranks failed to sync).
  int max_ooms_per_step = 32;
  // Rollbacks to the same step in a row (no step after the failing one
  // committed in between) before the guard gives up with kResourceExhausted.
  int max_rollbacks_per_step = 3;
  // On an OOM whose request the cached-but-free memory could have served,
  // first retry at the same size after releasing caches (once per step).
  bool retry_after_release = true;
  // Per-step peak allocations kept for incidents (ring buffer length).
  int history_steps = 32;
  // Every rank uses the smallest micro-batch limit of all ranks (pipeline and
  // tensor parallelism need equal sizes). Off: each rank learns its own.
  bool uniform_micro_batch = false;
  // Deadline for each coordinator call, in milliseconds.
  int64_t vote_deadline_ms = 60000;
  // Run identifier stored on incidents. "": the coordinator's job_id() (the
  // same on every rank of a job), else a random one per guard.
  std::string run_id;
  // Workload signature (model, sequence length, dtype, ...): groups incidents
  // and keys learned micro-batch priors.
  std::string workload;

  Device* device = nullptr;            // memory figures and ReleaseCaches; null: none
  Coordinator* coordinator = nullptr;  // null: a single-process coordinator
  IncidentSink* incidents = nullptr;   // null: incidents are only logged and reported
  RecoveryStore* recovery = nullptr;   // null: no rollback rung (give up instead)
  // Learned micro-batch sizes per workload (the knowledge base). With a
  // workload signature, the guard starts at the prior when it is smaller than
  // initial_micro_batch, and reports each clean step's largest micro-batch.
  MicroBatchPriors* priors = nullptr;
};

// OK, or kInvalidArgument: "GuardOptions.min_micro_batch must be >= 1 (got 0)".
OOMGUARD_EXPORT Status ValidateGuardOptions(const GuardOptions& options);

}  // namespace oomguard

#endif  // OOMGUARD_OPTIONS_H_
