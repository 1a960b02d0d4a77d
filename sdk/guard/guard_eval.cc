// Guard::Evaluate: a batch of evaluation split into micro-batches that fit.
//
// Nothing here changes the model, so nothing is agreed with other ranks and
// nothing is rolled back: an OOM releases caches, halves the evaluation's own
// limit and re-runs what was not done. The limit is separate from training's
// (an evaluation holds no activations for backward, so more fits), starts at
// the training limit and grows back on the search's schedule.
#include <algorithm>
#include <string>

#include "oomguard/guard.h"
#include "sdk/guard/guard_impl.h"

namespace oomguard::guard_internal {
Status GuardImpl::Evaluate(const EvalRequest& req, StepReport* report_out) {
  StepReport local_report;
  StepReport& rep = report_out != nullptr ? *report_out : local_report;
  rep = StepReport{};
  rep.step = step_;
  rep.checkpoint_step = commits_.committed();
  const auto started = Clock::now();
  Status bad = req.micro ? ValidatePerSample("EvalRequest", req.samples, req.costs, req.units)
                         : Status::InvalidArgument("EvalRequest.micro must be set");
  if (!bad.ok()) {
    rep.status = bad;
    return bad;
  }
  if (!eval_controller_) {
    SizeControllerOptions o = ControllerOptions(options_);
    o.policy = SizePolicy::kSearch;
    o.initial = controller_.limit();
    eval_controller_.emplace(o);
  }
  SizeController& limit = *eval_controller_;

  std::vector<int64_t> prefix;
  if (!req.units.empty()) {
    prefix.assign(req.units.size() + 1, 0);
    for (size_t i = 0; i < req.units.size(); ++i) prefix[i + 1] = prefix[i] + req.units[i];
  }
  const auto plan_from = [&](int64_t begin, int first) -> StatusOr<std::vector<MicroBatch>> {
    StatusOr<std::vector<MicroBatch>> plan =
        !req.costs.empty() ? PlanByCost(req.costs, limit.limit(), begin, first)
                           : StatusOr<std::vector<MicroBatch>>(PlanBySamples(
                                 req.samples, std::max<int64_t>(1, std::min(limit.limit(), req.samples)), begin,
                                 first));
    if (plan.ok() && !prefix.empty()) {
      const int64_t total = prefix.back();
      for (MicroBatch& mb : *plan) {
        const int64_t u = prefix[static_cast<size_t>(mb.offset + mb.size)] - prefix[static_cast<size_t>(mb.offset)];
        mb.weight = total > 0 ? static_cast<double>(u) / static_cast<double>(total) : 0.0;
      }
    }
    return plan;
  };
  auto first = plan_from(0, 0);
  if (!first.ok()) {
    rep.status = Status::InvalidArgument(first.status().message());
    return rep.status;
  }
  std::vector<MicroBatch> plan = std::move(first).value();
  int64_t whole = req.samples;
  if (!req.costs.empty()) {
    whole = 0;
    for (int64_t c : req.costs) whole += c;
  }
  rep.limit_before = std::min(limit.limit(), std::max<int64_t>(whole, 1));

  size_t pos = 0;
  int64_t largest = 0;
  Status status;
  while (pos < plan.size()) {
    const MicroBatch mb = plan[pos];
    std::exception_ptr error;
    try {
      phase_ = Phase::kEval;
      fault_ctx_ = FaultContext{step_, coordinator_->rank(), mb.index, mb.cost};
      SetCurrentFaultContext(fault_ctx_);
      FaultPoint(FaultSite::kEval, fault_ctx_);
      req.micro(mb);
      largest = std::max(largest, mb.cost);
      ++pos;
      continue;
    } catch (...) {
      error = std::current_exception();
    }
    const auto t_oom = Clock::now();
    OomInfo info = ClassifyException(error);
    if (!info.is_oom()) {
      phase_ = Phase::kUnknown;
      FinishIncidents(rep.incidents, IncidentOutcome::kFailed);
      std::rethrow_exception(error);  // the user's own error, unchanged
    }
    const MemoryStats mem = StatsAtFailure(error, options_.device);
    error = nullptr;  // drop what the failed micro-batch holds before releasing caches
    Incident inc = NewIncident(info, mem, mb, req.costs);
    ++rep.ooms;
    ++total_ooms_;
    std::exception_ptr foreign;
    std::string releaser;
    const double user_ms = ReleaseCaches(&foreign, &releaser);
    ++rep.cache_releases;
    inc.actions.push_back(LadderAction::kRelease);
    if (foreign) {  // a releaser's own exception (Ctrl-C in Python): the caller's to handle
      inc.action = LadderAction::kGiveUp;
      RecordIncident(rep, std::move(inc));
      FinishIncidents(rep.incidents, IncidentOutcome::kFailed);
      phase_ = Phase::kUnknown;
      std::rethrow_exception(foreign);
    }
    const bool smaller = rep.ooms <= options_.max_ooms_per_step && mb.size > 1 &&
                         (info.injected ? limit.OnInjectedOom(mb.cost) : limit.OnOom(mb.cost));
    rep.recovery_ms += std::max(0.0, MsSince(t_oom) - user_ms);
    if (!smaller) {
      inc.action = LadderAction::kGiveUp;
      inc.micro_after = limit.limit();
      status = Status::ResourceExhausted(
          "out of memory in evaluation at step " + std::to_string(step_) + " (" +
          std::string(IncidentKindName(inc.kind)) + ", requested " + FormatBytes(info.requested_bytes) + ") " +
          (mb.size <= 1 ? std::string("in a micro-batch of one sample")
                        : "after " + std::to_string(rep.ooms - 1) + " OOMs in one batch (max_ooms_per_step)") +
          "; incident " + inc.id + "; remedies: evaluate under torch.no_grad() (or inference_mode), in the "
          "training precision or lower; lower min_micro_batch or the sequence length");
      RecordIncident(rep, std::move(inc));
      break;
    }
    inc.action = LadderAction::kHalve;
    inc.actions.push_back(LadderAction::kHalve);
    inc.micro_after = limit.limit();
    Logger()->warn("OOM ({}) in evaluation at step {} micro-batch {}/{} (size {}); released caches; halve -> "
                   "micro-batch {}",
                   IncidentKindName(inc.kind), step_, mb.index + 1, mb.count, mb.cost, inc.micro_after);
    RecordIncident(rep, std::move(inc));
    // Completed micro-batches are kept: nothing accumulates in the model.
    auto rest = plan_from(mb.offset, mb.index);
    if (!rest.ok()) {
      status = Status::InvalidArgument(rest.status().message());
      break;
    }
    plan = std::move(rest).value();
    pos = 0;
    ++rep.replans;
  }
  phase_ = Phase::kUnknown;
  fault_ctx_.micro = -1;
  SetCurrentFaultContext(fault_ctx_);
  if (status.ok()) limit.OnSuccess(largest, /*limit_bound=*/largest < whole);
  FinishIncidents(rep.incidents, status.ok() ? IncidentOutcome::kRecovered : IncidentOutcome::kFailed);
  rep.status = status;
  rep.micro_batches = plan.empty() ? 0 : plan.back().index + 1;
  rep.largest_micro = largest;
  rep.limit_after = std::min(limit.limit(), std::max<int64_t>(whole, 1));
  rep.wall_ms = MsSince(started);
  return status;
}

}  // namespace oomguard::guard_internal
