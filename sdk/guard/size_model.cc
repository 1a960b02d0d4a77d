// The predictive policy's memory model (SizeController, kPredictive).
//
// Points: per micro-batch size, the largest (peak - base) seen and the
// allocator's overhead (reserved - peak) after the latest micro-batch of that
// size during which it did not release its cache; at most kPoints sizes. A
// new size replaces the nearest one (in ratio), so the points keep spanning
// the widest range of sizes seen, which is what pins down the slopes.
//
// Fit of the micro-batch's own memory: least squares of
//   bytes = fixed + unit * size
// when the sizes span a factor of kSpread or more. Over a narrower range the
// intercept is not identified, so the line goes through the origin (or an
// adopted prior's intercept) along the steepest point: the slope is then
// overestimated by fixed/size, which errs towards smaller sizes. An OOM whose
// micro-batch had already used more than the line says at its size steepens
// the line until it does not (the failed requests are evidence too).
//
// Overhead: the line through the points of the smallest and the largest size
// that have one, when their bytes span kSpread:
//   over = overhead_bytes + share * bytes;
// a line that falls is taken as flat (the largest size's overhead, in bytes:
// a cache kept whatever the size); with one point, or a line through a
// negative intercept, all of it is a share of the largest point's bytes.
// Taking all of it as a share overestimates it at larger sizes (segments and
// pools that do not grow count in full), which errs towards smaller sizes;
// the second size seen corrects it.
//
// Sizes: the largest size with
//   base + overhead_bytes + (1 + share) * (fixed + unit * size) <= capacity - headroom,
// the headroom being twice the largest residual of the fit (allocator
// rounding), at least kHeadroomFloor of the room.
#include <algorithm>
#include <cmath>

#include "oomguard/size_controller.h"

namespace oomguard {
namespace {

// The sizes of the points must span this factor for an intercept to be fitted.
constexpr double kSpread = 1.5;
// The smallest headroom, as a share of the room (capacity - base).
constexpr double kHeadroomFloor = 0.002;

}  // namespace

void SizeController::AddPoint(int64_t size, int64_t bytes, int64_t over, int64_t reserved) {
  for (int i = 0; i < n_points_; ++i) {
    Point& p = points_[static_cast<size_t>(i)];
    if (p.size != size) continue;
    // Steady state: the same sizes again. Only a new figure changes the fit.
    if (bytes > p.bytes || (over >= 0 && (over != p.over || reserved != p.reserved))) {
      p.bytes = std::max(p.bytes, bytes);
      if (over >= 0) {
        p.over = over;
        p.reserved = reserved;
      }
      Refit();
    }
    return;
  }
  if (n_points_ < kPoints) {
    points_[static_cast<size_t>(n_points_++)] = Point{size, bytes, over, over >= 0 ? reserved : 0};
  } else {
    int nearest = 0;
    double best = INFINITY;
    for (int i = 0; i < n_points_; ++i) {
      const double d = std::fabs(
          std::log(static_cast<double>(points_[static_cast<size_t>(i)].size) / static_cast<double>(size)));
      if (d < best) {
        best = d;
        nearest = i;
      }
    }
    points_[static_cast<size_t>(nearest)] = Point{size, bytes, over, over >= 0 ? reserved : 0};
  }
  Refit();
}

void SizeController::AddFailure(int64_t size, int64_t need) {
  // What the allocator held at this size or above was not enough after all.
  for (int i = 0; i < n_points_; ++i) {
    if (points_[static_cast<size_t>(i)].size >= size) points_[static_cast<size_t>(i)].over = -1;
  }
  const Failure f{size, need, steps_};
  if (n_failures_ < kFailures) {
    failures_[static_cast<size_t>(n_failures_++)] = f;
  } else {
    int oldest = 0;
    for (int i = 1; i < n_failures_; ++i)
      if (failures_[static_cast<size_t>(i)].step < failures_[static_cast<size_t>(oldest)].step) oldest = i;
    failures_[static_cast<size_t>(oldest)] = f;
  }
  Refit();
}

void SizeController::Refit() {
  fitted_ = false;
  // Failures older than forget_bad_after no longer constrain the slope.
  for (int i = 0; i < n_failures_;) {
    if (options_.forget_bad_after > 0 &&
        steps_ - failures_[static_cast<size_t>(i)].step >= options_.forget_bad_after) {
      failures_[static_cast<size_t>(i)] = failures_[static_cast<size_t>(--n_failures_)];
    } else {
      ++i;
    }
  }
  double fixed = 0, unit = 0;
  if (n_points_ == 0) {
    if (!prior_) return;
    fixed = prior_->fixed_bytes;
    unit = prior_->unit_bytes;
  } else {
    double smin = INFINITY, smax = 0;
    for (int i = 0; i < n_points_; ++i) {
      const double s = static_cast<double>(points_[static_cast<size_t>(i)].size);
      smin = std::min(smin, s);
      smax = std::max(smax, s);
    }
    if (n_points_ >= 2 && smax >= kSpread * smin) {
      double ms = 0, mb = 0;
      for (int i = 0; i < n_points_; ++i) {
        ms += static_cast<double>(points_[static_cast<size_t>(i)].size);
        mb += static_cast<double>(points_[static_cast<size_t>(i)].bytes);
      }
      ms /= n_points_;
      mb /= n_points_;
      double sxy = 0, sxx = 0;
      for (int i = 0; i < n_points_; ++i) {
        const double ds = static_cast<double>(points_[static_cast<size_t>(i)].size) - ms;
        sxy += ds * (static_cast<double>(points_[static_cast<size_t>(i)].bytes) - mb);
        sxx += ds * ds;
      }
      unit = sxy / sxx;
      fixed = mb - unit * ms;
    }
    if (!(unit > 0) || fixed < 0) {
      fixed = prior_ ? std::max(0.0, prior_->fixed_bytes) : 0.0;
      unit = 0;
      for (int i = 0; i < n_points_; ++i) {
        const Point& p = points_[static_cast<size_t>(i)];
        unit = std::max(unit, (static_cast<double>(p.bytes) - fixed) / static_cast<double>(p.size));
      }
      if (!(unit > 0)) {
        fixed = 0;
        for (int i = 0; i < n_points_; ++i) {
          const Point& p = points_[static_cast<size_t>(i)];
          unit = std::max(unit, static_cast<double>(p.bytes) / static_cast<double>(p.size));
        }
      }
    }
  }
  for (int i = 0; i < n_failures_; ++i) {
    const Failure& f = failures_[static_cast<size_t>(i)];
    const double s = static_cast<double>(f.size);
    if (fixed + unit * s < static_cast<double>(f.need)) unit = (static_cast<double>(f.need) - fixed) / s;
  }
  if (!(unit > 0) || !std::isfinite(unit) || !std::isfinite(fixed)) return;
  double noise = n_points_ == 0 && prior_ ? prior_->noise_bytes : 0.0;
  for (int i = 0; i < n_points_; ++i) {
    const Point& p = points_[static_cast<size_t>(i)];
    noise =
        std::max(noise, std::fabs(static_cast<double>(p.bytes) - fixed - unit * static_cast<double>(p.size)));
  }
  fit_ = SizeModel{};
  fit_.fixed_bytes = fixed;
  fit_.unit_bytes = unit;
  fit_.noise_bytes = noise;
  fitted_ = true;

  // The overhead, through the smallest and the largest point that have one.
  const Point* lo = nullptr;
  const Point* hi = nullptr;
  bool below_wall = false;
  for (int i = 0; i < n_points_; ++i) {
    const Point& p = points_[static_cast<size_t>(i)];
    if (p.over < 0) continue;
    if (lo == nullptr || p.size < lo->size) lo = &p;
    if (hi == nullptr || p.size > hi->size) hi = &p;
    below_wall = below_wall || !AtWall(p.reserved);
  }
  // Reserves that all reached the wall (all the capacity the allocator can
  // reach, stranded tail known) show its cache filling the room, not what a
  // size needs: at a small budget one segment's cache over a small
  // micro-batch would read as a share that pins the limit where it is.
  // Beside a reserve below the wall they are an upper bound like any other;
  // alone they leave the overhead at nothing beyond the peak, which an OOM
  // corrects (TooSmall) and the probes otherwise confirm.
  if (hi != nullptr && !below_wall) {
    has_over_ = true;
    over_bytes_ = 0;
    share_ = 0;
    return;
  }
  if (hi == nullptr) {
    has_over_ = prior_.has_value();
    over_bytes_ = prior_ ? prior_->overhead_bytes : 0.0;
    share_ = prior_ ? prior_->overhead : 0.0;
    return;
  }
  has_over_ = true;
  const double hb = static_cast<double>(hi->bytes), ho = static_cast<double>(hi->over);
  over_bytes_ = 0;
  share_ = ho / hb;
  if (lo != hi && hb >= kSpread * static_cast<double>(lo->bytes)) {
    const double lb = static_cast<double>(lo->bytes), lo_over = static_cast<double>(lo->over);
    const double share = (ho - lo_over) / (hb - lb);
    const double bytes = lo_over - share * lb;
    if (share < 0) {
      // The overhead does not grow with the size (a cache the allocator
      // keeps whatever the size, plus noise): the largest size's, in bytes.
      share_ = 0;
      over_bytes_ = ho;
    } else if (bytes >= 0) {
      share_ = share;
      over_bytes_ = bytes;
    }
  }
}

double SizeController::Headroom() const {
  return std::max(2.0 * fit_.noise_bytes, kHeadroomFloor * static_cast<double>(std::max<int64_t>(0, Room())));
}

int64_t SizeController::SizeFor(double share) const {
  if (!ModelUsable()) return limit_;
  const double room = static_cast<double>(Room()) - Headroom() - over_bytes_;
  // (A share may be negative, relative to an overestimated fixed part.)
  const double units =
      std::floor((room / (1.0 + std::max(-0.9, share)) - fit_.fixed_bytes) / fit_.unit_bytes);
  int64_t size = options_.min;
  if (units >= static_cast<double>(options_.max)) {
    size = options_.max;
  } else if (units > static_cast<double>(options_.min)) {
    size = static_cast<int64_t>(units);
  }
  if (cap_ && *cap_ < size) size = std::max(options_.min, *cap_);
  return size;
}

void SizeController::CapBelow(int64_t size) {
  const int64_t below =
      size - std::max<int64_t>(1, static_cast<int64_t>(options_.tolerance * static_cast<double>(size)));
  cap_ = cap_ ? std::min(*cap_, below) : below;
}

double SizeController::Share() const {
  double share = has_over_ ? std::min(share_, proven_) : (std::isfinite(proven_) ? proven_ : 0.0);
  share = std::max(share, raised_);
  if (std::isfinite(too_small_))
    share = std::max(share, (1.0 + too_small_) * (1.0 + options_.tolerance / 4) - 1.0);
  return share;
}

int64_t SizeController::Ceiling() const {
  if (!ModelUsable()) return limit_;
  const double units =
      std::floor((static_cast<double>(Room()) - Headroom() - fit_.fixed_bytes) / fit_.unit_bytes);
  if (units >= static_cast<double>(options_.max)) return options_.max;
  return units > static_cast<double>(options_.min) ? static_cast<int64_t>(units) : options_.min;
}

double SizeController::ShareAt(int64_t size) const {
  return (static_cast<double>(Room()) - Headroom() - over_bytes_) / Bytes(size) - 1.0;
}

void SizeController::TooSmall(double share) {
  if (!std::isfinite(share) || (std::isfinite(too_small_) && share <= too_small_)) return;
  too_small_ = share;
  too_small_at_ = steps_;
  if (Share() > too_small_) return;
  // What was believed to suffice did not: step past the failure by the
  // probing tolerance in size, which the probes then win back.
  raised_ = (1.0 + too_small_) * (1.0 + options_.tolerance) - 1.0;
}

std::optional<int64_t> SizeController::Predict() const {
  if (!ModelUsable()) return std::nullopt;
  return SizeFor(Share());
}

std::optional<SizeModel> SizeController::model() const {
  if (!fitted_ || n_points_ == 0) return std::nullopt;
  SizeModel m = fit_;
  m.overhead_bytes = over_bytes_;
  m.overhead = std::max(0.0, Share());
  m.overhead_too_small = std::isfinite(too_small_) && too_small_ > 0 ? too_small_ : 0.0;
  return m;
}

}  // namespace oomguard
