// The pieces GuardImpl's states share: creation (the learned priors), the
// plan of a step's micro-batches, the cache release of rung 1, and the
// incidents it records. The states themselves are in guard.cc,
// guard_agreement.cc and guard_restore.cc.
#include <algorithm>

#include "sdk/guard/guard_impl.h"

namespace oomguard::guard_internal {

GuardImpl::GuardImpl(const GuardOptions& o)
    : options_(o),
      controller_(ControllerOptions(o)),
      run_id_(o.run_id),
      own_coordinator_(o.coordinator == nullptr ? MakeLocalCoordinator() : nullptr),
      coordinator_(o.coordinator != nullptr ? o.coordinator : own_coordinator_.get()),
      channel_(coordinator_, std::chrono::milliseconds(o.vote_deadline_ms)),
      commits_(o.recovery, coordinator_->rank(), coordinator_->size()) {
  // One job, one run: every rank takes the group's id when nobody named the run.
  if (run_id_.empty()) run_id_ = coordinator_->job_id();
  if (run_id_.empty()) run_id_ = internal::RandomHex16();
  prior_key_ = PriorKey(options_.workload, coordinator_->rank(), coordinator_->size());
  if (options_.priors != nullptr && !options_.workload.empty()) {
    // A learned model gives the size that fits on this device at the first
    // step's figures; without one (or a device), the learned size.
    std::optional<SizeModel> model;
    if (controller_.options().policy == SizePolicy::kPredictive && options_.device != nullptr)
      model = options_.priors->PriorModel(prior_key_);
    if (model && model->unit_bytes > 0) {
      controller_.AdoptPrior(*model);
      // Until the first step's figures give the size for this device, the
      // learned size is the best guess (what micro_limit() reports).
      if (auto prior = options_.priors->PriorMicroBatch(prior_key_);
          prior && *prior >= 1 && *prior < controller_.limit())
        controller_.SetLimit(*prior);
      Logger()->info("workload '{}': starting from the learned memory model ({} per unit)", options_.workload,
                     FormatBytes(model->unit_bytes));
    } else if (auto prior = options_.priors->PriorMicroBatch(prior_key_);
               prior && *prior >= 1 && *prior < controller_.limit()) {
      controller_.AdoptPrior(*prior);
      Logger()->info("workload '{}': starting at the learned micro-batch {}", options_.workload,
                     controller_.limit());
    }
  }
  // The guard is created on its training thread: its log lines carry its rank.
  SetLogRank(coordinator_->rank());
}

SizeControllerOptions GuardImpl::ControllerOptions(const GuardOptions& o) {
  SizeControllerOptions c;
  c.min = o.min_micro_batch;
  c.max = o.max_micro_batch > 0 ? o.max_micro_batch : INT64_MAX;
  c.initial = o.initial_micro_batch > 0 ? std::min(o.initial_micro_batch, c.max) : c.max;
  c.grow_after = o.grow_after;
  c.tolerance = o.grow_tolerance;
  c.forget_bad_after = o.forget_bad_after;
  // Ranks that must use equal sizes agree on the limit once per step, at
  // the vote: they stay equal as long as they grow together, on the
  // search's probe schedule. Predictions differ by rank (a protocol that
  // agrees on them is for later).
  c.policy = o.uniform_micro_batch ? SizePolicy::kSearch : o.controller;
  return c;
}

void GuardImpl::BeforeMicroBatch(Run& run) {
  Device* device = options_.device;
  if (run.mem_base < 0) {
    const MemoryStats st = device->Stats();
    run.mem_base = st.allocated;
    run.mem_retries = st.num_alloc_retries;
  }
  device->ResetPeak();
}

bool GuardImpl::Reset(Run& run) {
  try {
    run.reset();
    return true;
  } catch (...) {
    run.FailWith(std::current_exception(), "the reset hook raised: ");
    return false;
  }
}

int64_t GuardImpl::EffectiveLimit(const StepRequest& req) const {
  int64_t whole = req.samples;
  if (!req.costs.empty()) {
    whole = 0;
    for (int64_t c : req.costs)
      if (__builtin_add_overflow(whole, std::max<int64_t>(c, 0), &whole)) whole = INT64_MAX;
  }
  return std::min(controller_.limit(), std::max<int64_t>(whole, 1));
}

StatusOr<std::vector<MicroBatch>> GuardImpl::MakePlan(const Run& run, int64_t begin, int first_index) const {
  const StepRequest& req = run.req;
  StatusOr<std::vector<MicroBatch>> plan =
      !req.costs.empty() ? PlanByCost(req.costs, controller_.limit(), begin, first_index)
                         : StatusOr<std::vector<MicroBatch>>(PlanBySamples(
                               req.samples, std::max<int64_t>(1, std::min(controller_.limit(), req.samples)),
                               begin, first_index));
  if (plan.ok() && !run.unit_prefix.empty()) {
    for (MicroBatch& mb : *plan) {
      const int64_t u = run.unit_prefix[static_cast<size_t>(mb.offset + mb.size)] -
                        run.unit_prefix[static_cast<size_t>(mb.offset)];
      mb.weight = run.local_units > 0 ? static_cast<double>(u) / static_cast<double>(run.local_units) : 0.0;
    }
  }
  return plan;
}

void GuardImpl::PlanAnew(Run& run) {
  auto plan = MakePlan(run, 0, 0);
  if (plan.ok()) run.plan = std::move(plan).value();  // the first plan succeeded, so this one does
  run.pos = 0;
  run.largest = 0;
}

double GuardImpl::ReleaseCaches(Run& run) {
  std::string name;
  std::exception_ptr foreign;
  const double user_ms = ReleaseCaches(&foreign, &name);
  if (foreign) run.FailWith(std::move(foreign), "cache releaser '" + name + "' raised: ");
  return user_ms;
}

double GuardImpl::ReleaseCaches(std::exception_ptr* foreign, std::string* who) {
  auto t0 = Clock::now();
  for (auto& [name, fn] : releasers_) {
    try {
      fn();
    } catch (const std::exception& e) {
      Logger()->warn("cache releaser '{}' threw: {}", name, e.what());
    } catch (...) {
      *foreign = std::current_exception();
      *who = name;
      break;
    }
  }
  double user_ms = MsSince(t0);
  if (options_.device != nullptr) options_.device->ReleaseCaches();
  return user_ms;
}

Incident GuardImpl::NewIncident(const OomInfo& info, const MemoryStats& mem, const MicroBatch& mb,
                                std::span<const int64_t> costs) const {
  Incident inc;
  inc.id = internal::RandomHex16();
  inc.run_id = run_id_;
  inc.time_unix_ms = internal::NowUnixMs();
  inc.host = internal::HostName();
  inc.rank = coordinator_->rank();
  inc.world_size = coordinator_->size();
  inc.step = step_;
  inc.micro_index = mb.index;
  inc.phase = phase_;
  inc.kind = internal::IncidentKindOf(info.kind);
  inc.exception_type = info.exception_type;
  inc.message = info.message;
  inc.requested_bytes = info.requested_bytes;
  inc.memory = mem;
  inc.step_peaks.assign(peaks_.begin(), peaks_.end());
  inc.steps_ok_before = steps_ok_since_oom_;
  if (!costs.empty()) {
    std::vector<int64_t> c(costs.begin(), costs.end());
    auto mid = c.begin() + static_cast<std::ptrdiff_t>(c.size() / 2);
    std::nth_element(c.begin(), mid, c.end());
    inc.sample_cost_median = static_cast<double>(*mid);
    int64_t top = 0;
    for (int64_t i = mb.offset; i < mb.offset + mb.size; ++i)
      top = std::max(top, costs[static_cast<size_t>(i)]);
    inc.sample_cost_this = static_cast<double>(top);
  }
  inc.micro_before = mb.cost;
  inc.workload = options_.workload;
  inc.injected = info.injected;
  inc.framework = info.framework;
  inc.outcome = IncidentOutcome::kPending;
  return inc;
}

void GuardImpl::RecordIncident(StepReport& rep, Incident inc) {
  if (options_.incidents != nullptr) {
    try {
      options_.incidents->Record(inc);
    } catch (...) {
      // A failing knowledge base must never stop training.
      Logger()->warn("incident sink failed to record incident {}", inc.id);
    }
  }
  rep.incidents.push_back(std::move(inc));
}

void GuardImpl::FinishIncidents(std::vector<Incident>& incs, IncidentOutcome outcome) {
  for (auto& inc : incs) {
    if (inc.outcome != IncidentOutcome::kPending) continue;
    inc.outcome = outcome;
    if (options_.incidents != nullptr) {
      try {
        options_.incidents->UpdateOutcome(inc);
      } catch (...) {
        Logger()->warn("incident sink failed to update incident {}", inc.id);
      }
    }
  }
}

}  // namespace oomguard::guard_internal
