// SizeController: halve on OOM, then find the largest micro-batch that fits.
//
// State: limit, good (largest size that completed), bad (smallest size that
// failed, or none).
//   OOM at size s:  bad = min(bad, s); limit = max(min, s/2), or limit = good
//                   when s was a growth probe (good is known to fit). An OOM at
//                   s <= min cannot be fixed by splitting: OnOom returns false.
//   After grow_after clean steps that were limited by the limit: probe
//   min(2*limit, max) while bad is unknown, else the midpoint of limit and bad
//   while bad - limit > max(1, tolerance*bad). bad is forgotten forget_bad_after
//   steps after it was last set (memory conditions change).
// The steady state is within `tolerance` of the largest size that fits and is
// reached in O(log(max/min)) OOMs.
//
// Thread-safety: not thread-safe; owned by one guard.
#ifndef OOMGUARD_SIZE_CONTROLLER_H_
#define OOMGUARD_SIZE_CONTROLLER_H_

#include <cstdint>
#include <optional>

#include "oomguard/export.h"
#include "oomguard/status.h"

namespace oomguard {

struct SizeControllerOptions {
  int64_t initial = 1;             // starting limit
  int64_t min = 1;                 // smallest micro-batch (samples or cost units)
  int64_t max = INT64_MAX;         // largest micro-batch ever tried
  int grow_after = 10;             // clean limit-bound steps before a growth probe; 0: never grow
  double tolerance = 0.05;         // stop probing when bad - limit <= tolerance * bad
  int forget_bad_after = 500;      // steps after which `bad` is forgotten; 0: never
};

// kInvalidArgument naming the field for a bad option set.
OOMGUARD_EXPORT Status ValidateSizeControllerOptions(const SizeControllerOptions& o);

class OOMGUARD_EXPORT SizeController {
 public:
  // REQUIRES: ValidateSizeControllerOptions(options).ok()
  explicit SizeController(const SizeControllerOptions& options);

  int64_t limit() const { return limit_; }
  int64_t good() const { return good_; }                 // 0: nothing completed yet
  std::optional<int64_t> bad() const { return bad_; }
  bool probing() const { return probing_; }              // limit is an unproven growth probe
  int64_t ooms() const { return ooms_; }
  const SizeControllerOptions& options() const { return options_; }

  // An OOM at a micro-batch of size `size`. Returns false when the size cannot
  // be reduced (size <= min): the caller escalates.
  bool OnOom(int64_t size);

  // A step completed; `largest` is its largest micro-batch, `limit_bound` says
  // whether the limit split the step (growth is pointless otherwise).
  void OnSuccess(int64_t largest, bool limit_bound);

  // Sets the limit outright (the minimum across ranks, a user's choice).
  void SetLimit(int64_t limit);

  // Starts from a learned prior: the largest size that ran clean for this
  // workload before, which an earlier run had already brought within
  // `tolerance` of what fits. The size counts as proven, and the failing size
  // is taken to lie just above it, so the controller does not re-probe what
  // the earlier run learned until `forget_bad_after` steps have passed.
  void AdoptPrior(int64_t size);

 private:
  SizeControllerOptions options_;
  int64_t limit_;
  int64_t good_ = 0;
  std::optional<int64_t> bad_;
  bool probing_ = false;
  int clean_steps_ = 0;
  int64_t steps_ = 0;
  int64_t bad_set_at_ = 0;
  int64_t ooms_ = 0;
};

}  // namespace oomguard

#endif  // OOMGUARD_SIZE_CONTROLLER_H_
