#include "oomguard/options.h"

#include <cmath>
#include <string>

#include "oomguard/size_controller.h"

namespace oomguard {
namespace {

template <typename T>
Status Bad(const char* field, const char* rule, T got) {
  return Status::InvalidArgument(std::string("GuardOptions.") + field + " " + rule + " (got " +
                                 std::to_string(got) + ")");
}

}  // namespace

Status ValidateGuardOptions(const GuardOptions& o) {
  if (o.min_micro_batch < 1) return Bad("min_micro_batch", "must be >= 1", o.min_micro_batch);
  if (o.initial_micro_batch < 0)
    return Bad("initial_micro_batch", "must be >= 0 (0: whole step)", o.initial_micro_batch);
  if (o.max_micro_batch < 0) return Bad("max_micro_batch", "must be >= 0 (0: unbounded)", o.max_micro_batch);
  if (o.max_micro_batch > 0 && o.max_micro_batch < o.min_micro_batch)
    return Status::InvalidArgument("GuardOptions.max_micro_batch (" + std::to_string(o.max_micro_batch) +
                                   ") must be >= min_micro_batch (" + std::to_string(o.min_micro_batch) + ")");
  if (o.initial_micro_batch > 0 && o.initial_micro_batch < o.min_micro_batch)
    return Status::InvalidArgument("GuardOptions.initial_micro_batch (" +
                                   std::to_string(o.initial_micro_batch) + ") must be >= min_micro_batch (" +
                                   std::to_string(o.min_micro_batch) + ")");
  if (o.grow_after < 0) return Bad("grow_after", "must be >= 0 (0: never grow)", o.grow_after);
  if (!(o.grow_tolerance > 0.0 && o.grow_tolerance < 1.0) || !std::isfinite(o.grow_tolerance))
    return Bad("grow_tolerance", "must be in (0, 1)", o.grow_tolerance);
  if (o.forget_bad_after < 0) return Bad("forget_bad_after", "must be >= 0 (0: never)", o.forget_bad_after);
  if (o.controller != SizePolicy::kPredictive && o.controller != SizePolicy::kSearch)
    return Bad("controller", "must be SizePolicy::kPredictive or kSearch", static_cast<int>(o.controller));
  if (o.max_ooms_per_step < 1) return Bad("max_ooms_per_step", "must be >= 1", o.max_ooms_per_step);
  if (o.max_rollbacks_per_step < 1)
    return Bad("max_rollbacks_per_step", "must be >= 1", o.max_rollbacks_per_step);
  if (o.history_steps < 1 || o.history_steps > 4096)
    return Bad("history_steps", "must be in [1, 4096]", o.history_steps);
  if (o.vote_deadline_ms < 1) return Bad("vote_deadline_ms", "must be >= 1", o.vote_deadline_ms);
  for (char c : o.workload) {
    if (static_cast<unsigned char>(c) < 0x20)
      return Status::InvalidArgument("GuardOptions.workload must not contain control characters");
  }
  if (o.workload.size() > 512)
    return Bad("workload", "must be at most 512 characters long", o.workload.size());
  return Status::Ok();
}

Status ValidateSizeControllerOptions(const SizeControllerOptions& o) {
  auto bad = [](const char* field, const char* rule, auto got) {
    return Status::InvalidArgument(std::string("SizeControllerOptions.") + field + " " + rule + " (got " +
                                   std::to_string(got) + ")");
  };
  if (o.min < 1) return bad("min", "must be >= 1", o.min);
  if (o.max < o.min) return bad("max", "must be >= min", o.max);
  if (o.initial < o.min || o.initial > o.max) return bad("initial", "must be within [min, max]", o.initial);
  if (o.grow_after < 0) return bad("grow_after", "must be >= 0", o.grow_after);
  if (!(o.tolerance > 0.0 && o.tolerance < 1.0)) return bad("tolerance", "must be in (0, 1)", o.tolerance);
  if (o.forget_bad_after < 0) return bad("forget_bad_after", "must be >= 0", o.forget_bad_after);
  if (o.policy != SizePolicy::kPredictive && o.policy != SizePolicy::kSearch)
    return bad("policy", "must be SizePolicy::kPredictive or kSearch", static_cast<int>(o.policy));
  return Status::Ok();
}

}  // namespace oomguard
