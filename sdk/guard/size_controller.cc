#include "oomguard/size_controller.h"

#include <algorithm>

namespace oomguard {

SizeController::SizeController(const SizeControllerOptions& options)
    : options_(options), limit_(options.initial) {}

bool SizeController::OnOom(int64_t size) {
  ++ooms_;
  clean_steps_ = 0;
  bad_ = bad_ ? std::min(*bad_, size) : size;
  bad_set_at_ = steps_;
  // A size that used to fit failed: memory conditions changed, so what was
  // known good is no longer evidence.
  if (good_ >= size) good_ = 0;
  if (size <= options_.min) {
    limit_ = options_.min;
    probing_ = false;
    return false;
  }
  if (probing_ && good_ > 0 && good_ < size) {
    limit_ = good_;  // the probe failed; the last proven size is known to fit
  } else {
    limit_ = std::max(options_.min, std::min(limit_, size / 2));
  }
  probing_ = false;
  return true;
}

void SizeController::OnSuccess(int64_t largest, bool limit_bound) {
  ++steps_;
  if (bad_ && options_.forget_bad_after > 0 && steps_ - bad_set_at_ >= options_.forget_bad_after) {
    bad_.reset();
  }
  if (largest > good_) good_ = largest;
  if (probing_) {
    // The probe completed: it becomes the new proven size.
    probing_ = false;
    clean_steps_ = 0;
  }
  if (!limit_bound) return;  // the step fitted in one micro-batch: nothing to learn by growing
  if (options_.grow_after == 0) return;
  if (++clean_steps_ < options_.grow_after) return;
  clean_steps_ = 0;
  int64_t next = limit_;
  if (!bad_) {
    next = limit_ > options_.max / 2 ? options_.max : 2 * limit_;
  } else {
    const int64_t gap = *bad_ - limit_;
    const double stop = std::max(1.0, options_.tolerance * static_cast<double>(*bad_));
    if (static_cast<double>(gap) > stop) next = limit_ + gap / 2;
  }
  next = std::min(next, options_.max);
  if (next > limit_) {
    limit_ = next;
    probing_ = true;
  }
}

void SizeController::SetLimit(int64_t limit) {
  limit_ = std::clamp(limit, options_.min, options_.max);
  probing_ = false;
  clean_steps_ = 0;
}

}  // namespace oomguard

namespace oomguard {

void SizeController::AdoptPrior(int64_t size) {
  SetLimit(size);
  good_ = limit_;
  const int64_t above = std::max<int64_t>(
      1, static_cast<int64_t>(options_.tolerance * static_cast<double>(limit_)));
  bad_ = limit_ > options_.max - above ? options_.max : limit_ + above;
  bad_set_at_ = steps_;
}

}  // namespace oomguard
