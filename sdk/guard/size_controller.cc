// SizeController: when each policy moves the limit. The memory model itself
// (points, the fit, the overhead bracket, sizes from shares) is in
// size_model.cc.
#include "oomguard/size_controller.h"

#include <algorithm>
#include <cmath>

namespace oomguard {

std::string_view SizePolicyName(SizePolicy p) {
  switch (p) {
    case SizePolicy::kPredictive:
      return "predictive";
    case SizePolicy::kSearch:
      return "search";
  }
  return "unknown";
}

SizeController::SizeController(const SizeControllerOptions& options)
    : options_(options), limit_(options.initial) {}

bool SizeController::predicting() const {
  return options_.policy == SizePolicy::kPredictive && ModelUsable() && search_since_ < 0;
}

bool SizeController::OnOom(int64_t size) { return OnOom(size, MicroBatchMemory{}); }

int64_t SizeController::BadWindow() const {
  if (options_.grow_after == 0 || options_.forget_bad_after == 0) return INT64_MAX;
  const int64_t cap = options_.forget_bad_after;
  int64_t window = 2 * static_cast<int64_t>(options_.grow_after);
  for (int i = 0; i < bad_strikes_ && window < cap; ++i) window = window > cap / 2 ? cap : 2 * window;
  return std::min(window, cap);
}

void SizeController::RememberBad(int64_t size) {
  // A retry of a size that had failed failed again: it was no one-off.
  if (retried_bad_ && size >= *retried_bad_ && bad_strikes_ < 30) ++bad_strikes_;
  retried_bad_.reset();
  bad_ = bad_ ? std::min(*bad_, size) : size;
  bad_set_at_ = steps_;
}

bool SizeController::AtMinimum() {
  limit_ = options_.min;
  probing_ = false;
  model_limit_ = false;
  cold_ = false;
  return false;
}

bool SizeController::OnInjectedOom(int64_t size) {
  ++ooms_;
  clean_steps_ = 0;
  probe_ = false;
  if (size <= options_.min) return AtMinimum();
  SearchOnOom(size);
  return true;
}

bool SizeController::OnOom(int64_t size, const MicroBatchMemory& memory) {
  ++ooms_;
  clean_steps_ = 0;
  RememberBad(size);
  // A size that used to fit failed: memory conditions changed, so what was
  // known good is no longer evidence.
  if (good_ >= size) good_ = 0;
  const bool predictive = options_.policy == SizePolicy::kPredictive;
  const bool figures = predictive && memory.capacity > 0 && memory.used > memory.base && memory.base >= 0;
  const bool was_probe = probe_;
  const bool was_model = model_limit_;
  probe_ = false;
  if (figures) {
    base_ = memory.base;
    capacity_ = memory.capacity;
    LearnStranded(memory);
    AddFailure(size, memory.used - memory.base);
  } else if (predictive) {
    // What the model cannot explain it must not grow into again.
    CapBelow(size);
  }
  if (size <= options_.min) return AtMinimum();
  if (!figures || search_since_ >= 0) {
    SearchOnOom(size);
    return true;
  }
  if (ModelUsable()) {
    // The share that would have let this size fit is not enough. A smaller
    // micro-batch than the limit fails among larger ones (a balanced split,
    // packing by cost) because of what they left behind: the bound is the
    // limit's. Not where segments are a sizeable part of the capacity (a
    // stranded tail seen): there the failed size's own segments explain it,
    // and the limit's bound would let the model predict that size again.
    const int64_t at = stranded_ > 0 ? size : std::max(size, limit_);
    const double needed = std::max(static_cast<double>(memory.used - memory.base), Bytes(at));
    TooSmall((static_cast<double>(Room()) - over_bytes_) / needed - 1.0);
    if (was_probe) {
      TooSmall(probe_share_);
      ++probes_failed_;
    } else if (was_model && ++misses_ >= kMaxMisses) {
      // The model keeps being wrong about this device: the search takes over
      // growth, from the model's size after this failure, with the model
      // vetting its probes.
      search_since_ = steps_;
    }
    SetModelLimit();
    if (limit_ >= size) {
      // Even with this failure the model predicts the failed size to fit (a
      // cache it counted as needed was not the whole story): it may not
      // predict that size again.
      CapBelow(size);
      SetModelLimit();
    }
    probing_ = false;
    return true;
  }
  if (options_.grow_after == 0) {
    SearchOnOom(size);  // the limit would never grow back from a cold measurement
    return true;
  }
  limit_ = std::max(options_.min, std::min(limit_, size / kColdShrink));
  probing_ = false;
  model_limit_ = false;
  cold_ = true;
  return true;
}

void SizeController::LearnStranded(const MicroBatchMemory& memory) {
  if (memory.requested <= 0 || memory.reserved <= 0 || memory.reserved > memory.capacity) return;
  const int64_t free = memory.capacity - memory.reserved;
  // A request that the free memory could have held failed: the allocator
  // grows its reserve by segments larger than what was free, so none of it
  // was in reach. (A request larger than the free memory says nothing about
  // the tail: it fails either way.)
  if (memory.requested > free || free == stranded_) return;
  stranded_ = free;
  // The shares earlier OOMs showed too small were measured against a room
  // that counted the tail: against the room there is, they overstate what
  // is needed. This OOM (OnOom, next) sets the bracket again.
  too_small_ = -INFINITY;
  raised_ = -INFINITY;
  Refit();
}

void SizeController::SearchOnOom(int64_t size) {
  if (probing_ && good_ > 0 && good_ < size) {
    limit_ = good_;  // the probe failed; the last proven size is known to fit
  } else {
    limit_ = std::max(options_.min, std::min(limit_, size / 2));
  }
  probing_ = false;
  model_limit_ = false;
  cold_ = false;
  probe_ = false;
}

bool SizeController::OnMicroBatch(int64_t size, const MicroBatchMemory& memory) {
  if (options_.policy != SizePolicy::kPredictive || memory.capacity <= 0 || memory.used <= memory.base ||
      memory.base < 0 || size < 1) {
    return false;
  }
  base_ = memory.base;
  capacity_ = memory.capacity;
  // The allocator reached into bytes believed stranded (the room grew since,
  // or the tail moved): only what it could not reach stays stranded.
  const bool reached = stranded_ > 0 && memory.reserved > capacity_ - stranded_;
  if (reached) stranded_ = std::max<int64_t>(0, capacity_ - memory.reserved);
  // What the allocator holds beyond the peak, settled over the steps at this
  // size: fragments, rounding and its cache. Holding it did not make the
  // allocator release anything, so it suffices. A micro-batch during which
  // it did release says little: its reserve was just compacted.
  // (An allocator without a cache holds nothing beyond the peak.)
  const int64_t over =
      !memory.flushed && memory.reserved > 0 ? std::max<int64_t>(0, memory.reserved - memory.used) : -1;
  AddPoint(size, memory.used - memory.base, over, memory.reserved);
  if (reached) Refit();  // which reserves were at the wall changed
  if (!predicting() || !KnowsOverhead()) return false;
  // A probe whose own figures show that more than it tries fits has nothing
  // left to prove.
  if (probe_ && SizeFor(Share()) > limit_) probe_ = false;
  if (probe_) return false;
  const int64_t next = SizeFor(Share());
  if (cold_ && next > limit_) {
    // The first figures of a run: leave the measurement size at once.
    SetModelLimit();
    probing_ = true;
    return true;
  }
  // Otherwise only a rise worth re-planning for; the prediction moves by a
  // unit or two as figures arrive, which the next step picks up.
  if (options_.grow_after == 0 || next <= limit_ + std::max<int64_t>(1, limit_ / 100)) {
    return false;
  }
  SetModelLimit();
  probing_ = true;
  return true;
}

void SizeController::OnStepStart(int64_t base, int64_t capacity) {
  if (options_.policy != SizePolicy::kPredictive || capacity <= 0 || base < 0) return;
  base_ = base;
  capacity_ = capacity;
  if (std::isfinite(too_small_) && options_.forget_bad_after > 0 &&
      steps_ - too_small_at_ >= options_.forget_bad_after) {
    too_small_ = -INFINITY;  // conditions change: the bracket opens again
    probes_failed_ = 0;
  }
  if (!predicting()) return;
  const int64_t next = SizeFor(Share());
  if (good_ == 0 && !cold_ && n_points_ == 0 && prior_) {
    // An adopted model and nothing proven in this run: the prior decides.
    SetModelLimit();
    return;
  }
  if (next < limit_ && Room() < room_at_limit_) {
    // Less room than when this limit was chosen: take the size that fits
    // now rather than learn it from an OOM.
    probe_ = false;
    SetModelLimit();
    probing_ = false;
  } else if (next > limit_ && !probe_ && KnowsOverhead() && options_.grow_after > 0) {
    SetModelLimit();
    probing_ = true;
  }
}

void SizeController::OnSuccess(int64_t largest, bool limit_bound) {
  ++steps_;
  // A step that ran clean at or above a failing size that was being tried
  // again settles it: that failure was a one-off.
  if (retried_bad_ && largest >= *retried_bad_) {
    retried_bad_.reset();
    bad_strikes_ = 0;
  }
  if (bad_ && steps_ - bad_set_at_ >= BadWindow()) {
    // Try the failing size again (SearchGrow goes no further than it at first).
    retried_bad_ = *bad_;
    bad_.reset();
    cap_.reset();
  }
  if (search_since_ >= 0 && options_.forget_bad_after > 0 &&
      steps_ - search_since_ >= options_.forget_bad_after) {
    search_since_ = -1;  // conditions may have changed: the model may drive again
    misses_ = 0;
  }
  if (largest > good_) good_ = largest;
  cold_ = false;
  if (probe_ && ++probe_steps_ >= kProbeSteps) {
    // The probe ran clean long enough for fragmentation to show: the share
    // that its largest micro-batch needed suffices (a balanced split may not
    // reach the limit itself).
    const double share = ModelUsable() ? ShareAt(std::max<int64_t>(1, largest)) : probe_share_;
    proven_ = std::min(proven_, share);
    if (raised_ > share) raised_ = share;
    probe_ = false;
  }
  if (probing_) {
    // The probe completed: it becomes the new proven size.
    probing_ = false;
    clean_steps_ = 0;
  }
  if (model_limit_) room_at_limit_ = Room();
  if (!limit_bound) return;  // the step fitted in one micro-batch: nothing to learn by growing
  if (options_.grow_after == 0) return;
  ++clean_steps_;
  if (clean_steps_ >= kProbeSteps) misses_ = 0;
  if (predicting()) {
    if (probe_) return;
    if (!KnowsOverhead()) return;
    if (SizeFor(Share()) > limit_) {
      SetModelLimit();
      probing_ = true;
      clean_steps_ = 0;
      return;
    }
    if (clean_steps_ < options_.grow_after) return;
    clean_steps_ = 0;
    MaybeProbe();
    return;
  }
  if (clean_steps_ < options_.grow_after) return;
  clean_steps_ = 0;
  SearchGrow();
}

void SizeController::SearchGrow() {
  int64_t next = limit_;
  if (!bad_) {
    next = limit_ > options_.max / 2 ? options_.max : 2 * limit_;
    if (retried_bad_ && *retried_bad_ > limit_) next = std::min(next, *retried_bad_);
  } else {
    const int64_t gap = *bad_ - limit_;
    const double stop = std::max(1.0, options_.tolerance * static_cast<double>(*bad_));
    if (static_cast<double>(gap) > stop) next = limit_ + gap / 2;
  }
  next = std::min(next, options_.max);
  if (options_.policy == SizePolicy::kPredictive && ModelUsable()) {
    // A probe the model predicts to fail even with the least overhead it
    // thinks possible is not tried: it would only cost an OOM.
    int64_t top = Ceiling();
    if (std::isfinite(too_small_)) top = std::min(top, SizeFor(too_small_));
    next = std::min(next, std::max(options_.min, top - 1));
  }
  if (next > limit_) {
    limit_ = next;
    probing_ = true;
    model_limit_ = false;
  }
}

bool SizeController::MaybeProbe() {
  // One failed probe says the limit is within a step of what fits; another
  // would only cost another OOM.
  if (probes_failed_ > 0) return false;
  // Below what fits with the least overhead not shown too small, and below
  // what cannot fit at all.
  int64_t top = Ceiling();
  if (std::isfinite(too_small_)) top = std::min(top, SizeFor(too_small_));
  const int64_t size = std::max(
      limit_ + 1, static_cast<int64_t>(static_cast<double>(limit_) * (1.0 + options_.tolerance / 2)));
  if (size >= top) return false;
  limit_ = size;
  room_at_limit_ = Room();
  probe_ = true;
  probe_share_ = ShareAt(size);
  probe_steps_ = 0;
  probing_ = true;
  model_limit_ = true;
  cold_ = false;
  return true;
}

void SizeController::SetModelLimit() {
  limit_ = SizeFor(Share());
  model_limit_ = true;
  cold_ = false;
  room_at_limit_ = Room();
}

void SizeController::SetLimit(int64_t limit) {
  limit_ = std::clamp(limit, options_.min, options_.max);
  probing_ = false;
  clean_steps_ = 0;
  model_limit_ = false;
  cold_ = false;
  probe_ = false;
}

void SizeController::AdoptPrior(int64_t size) {
  SetLimit(size);
  good_ = limit_;
  if (limit_ >= options_.max) return;  // nothing above it to try
  const int64_t above =
      std::max<int64_t>(1, static_cast<int64_t>(options_.tolerance * static_cast<double>(limit_)));
  bad_ = limit_ > options_.max - above ? options_.max : limit_ + above;
  bad_set_at_ = steps_;
  bad_strikes_ = 1;
  retried_bad_.reset();
}

void SizeController::AdoptPrior(const SizeModel& model) {
  if (options_.policy != SizePolicy::kPredictive || !(model.unit_bytes > 0) || model.fixed_bytes < 0 ||
      model.overhead < 0 || model.overhead_bytes < 0 || model.overhead_too_small < 0 ||
      model.noise_bytes < 0) {
    return;
  }
  prior_ = model;
  raised_ = -INFINITY;
  proven_ = INFINITY;
  too_small_ = model.overhead_too_small > 0 ? std::min(model.overhead_too_small, model.overhead) : -INFINITY;
  too_small_at_ = steps_;
  Refit();
}

}  // namespace oomguard
