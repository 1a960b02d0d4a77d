// SizeController: decides the micro-batch limit, from out-of-memory errors and,
// when the device reports them, from memory figures.
//
// Two policies (SizeControllerOptions::policy):
//
// kPredictive (the default) predicts what fits. It fits one micro-batch's
// own memory to its size from the micro-batches that ran clean,
//   bytes(size) = peak - base ~= fixed + unit * size,
// and what the caching allocator holds beyond that peak (blocks stranded by
// fragmentation, segment rounding, its cache) as
//   overhead(size) = overhead_bytes + share * bytes(size),
// so that a size fits when
//   base + bytes(size) + overhead(size) + headroom <= capacity.
// overhead_bytes and the share come from what the allocator reserved after
// clean micro-batches during which it did not have to release its cache (it
// held that much and fitted), through the smallest and the largest size seen.
// The share is bracketed: at least that, unless a probe proved less; and
// more than `overhead_too_small`, a share an OOM showed not to suffice. The
// limit is the largest size that fits with the upper share. Every grow_after
// clean steps a probe tries tolerance/2 more (its verdict: an OOM within
// kProbeSteps steps; else the share it needed is proven and becomes the
// upper one), below what fits with the lower share. The first probe that
// fails ends the probing until the failure is forgotten: an OOM costs more
// than a step's size, and the limit is then within a probe's step of the
// largest size that fits.
// A caching allocator that hoards when it has room shows a larger share than
// it needs under pressure, which the probes find. The headroom follows the
// fit's residuals (allocator rounding), at least 0.2% of the room.
// The room is capacity - base less the bytes an OOM showed stranded: when a
// request fails although the device had that much free (capacity - reserved
// at the failure), the allocator could not use that free memory (it grows
// its reserve by whole segments, and the next one did not fit), so the
// capacity it can reach is what it had reserved. Where segments are a
// sizeable part of the capacity (a small budget) that tail is a large part
// of the room; on a GPU it is under one segment.
//
// The limit jumps: after the first clean micro-batch of a run (the guard
// re-plans the rest of the step), when a prediction rises by more than 1%, and
// at the start of a step when the room shrank (another process took memory)
// or grew. Before any clean micro-batch there is no slope: an OOM then drops
// to 1/kColdShrink of the failed size, which almost surely fits and whose
// figures give the slope. Without figures (no device, an unlimited device,
// an injected fault) the reaction is kSearch's; after kMaxMisses OOMs at sizes
// the model chose it hands over to kSearch until `bad` is forgotten, and a
// growth probe the model predicts to fail is then never tried.
//
// kSearch: halve on OOM, then find the largest size that fits by probing.
//   State: limit, good (largest size that completed), bad (smallest size that
//   failed, or none).
//   OOM at size s:  bad = min(bad, s); limit = max(min, s/2), or limit = good
//                   when s was a growth probe (good is known to fit). An OOM at
//                   s <= min cannot be fixed by splitting: OnOom returns false.
//   After grow_after clean steps that were limited by the limit: probe
//   min(2*limit, max) while bad is unknown, else the midpoint of limit and bad
//   while bad - limit > max(1, tolerance*bad).
//   The steady state is within `tolerance` of the largest size that fits and is
//   reached in O(log(max/min)) OOMs.
//
// What an OOM teaches (both policies). One OOM may be a one-off (a transient
// peak, another process's burst): `bad` is tried again once it is
// BadWindow() steps old, and that window doubles each time the retry fails
// again (from 2*grow_after up to forget_bad_after), so a one-off costs a few
// dozen steps at a smaller size while a real limit costs O(log) extra OOMs
// over forget_bad_after steps. A retry that runs clean forgets the strikes. An
// injected OOM (OnInjectedOom) says nothing about memory: the limit halves, so
// that recovery is exercised, and nothing is remembered. OOMs outside the
// micro-batches (the gradient sync, the optimizer apply, checkpoint staging)
// do not depend on the micro-batch size; the guard does not report them here.
// A learned prior is a size that ran clean, not a bound: a run that starts
// from one still grows after its clean steps.
//
// docs/concepts.md ("The size controller") describes both with examples.
//
// Thread-safety: not thread-safe; owned by one guard.
#ifndef OOMGUARD_SIZE_CONTROLLER_H_
#define OOMGUARD_SIZE_CONTROLLER_H_

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string_view>

#include "oomguard/export.h"
#include "oomguard/priors.h"
#include "oomguard/status.h"

namespace oomguard {

enum class SizePolicy : int {
  kPredictive = 0,  // fit the device's figures; jump to the largest size predicted to fit
  kSearch = 1,      // halve on OOM, then binary search upwards (ignores figures)
};
// "predictive", "search".
OOMGUARD_EXPORT std::string_view SizePolicyName(SizePolicy p);

struct SizeControllerOptions {
  int64_t initial = 1;         // starting limit
  int64_t min = 1;             // smallest micro-batch (samples or cost units)
  int64_t max = INT64_MAX;     // largest micro-batch ever tried
  int grow_after = 10;         // clean limit-bound steps before a growth probe; 0: never grow
  double tolerance = 0.05;     // stop probing when bad - limit <= tolerance * bad
  int forget_bad_after = 500;  // longest a failing size (and what failures taught) is remembered; 0: for ever
  SizePolicy policy = SizePolicy::kPredictive;
};

// kInvalidArgument naming the field for a bad option set.
OOMGUARD_EXPORT Status ValidateSizeControllerOptions(const SizeControllerOptions& o);

// One micro-batch's memory as the device reported it, in bytes.
struct MicroBatchMemory {
  int64_t base = 0;      // allocated when the micro-batch started (what it does not own)
  int64_t used = 0;      // clean: peak allocated during it; OOM: allocated at the failure + the request
  int64_t capacity = 0;  // what this process's allocator could hold then: reserved + free (0: unknown)
  // Clean: reserved after it; OOM: reserved at the failure (0: unknown).
  int64_t reserved = 0;
  // Clean only: the allocator released its cache and retried during it, so
  // its reserve was just compacted and says little.
  bool flushed = false;
  // OOM only: the request that failed (0: unknown). With `reserved`, it says
  // whether free memory the request would have fitted in was out of the
  // allocator's reach (SizeController's stranded bytes).
  int64_t requested = 0;
};

// SizeModel, the predictive policy's model, is in priors.h (the core): the
// knowledge base stores it and must not depend on the guard.

class OOMGUARD_EXPORT SizeController {
 public:
  // OOMs at sizes the model chose, with no proven size between them, before
  // it hands over to kSearch.
  static constexpr int kMaxMisses = 2;
  // After an OOM with figures but no clean micro-batch yet, the next size is
  // the failed one divided by this: it must fit, since its figures are what
  // gives the model its slope, and it costs one small micro-batch.
  static constexpr int64_t kColdShrink = 128;
  // Clean steps that prove a probe (fragmentation shows within a few steps).
  static constexpr int kProbeSteps = 3;

  // REQUIRES: ValidateSizeControllerOptions(options).ok()
  explicit SizeController(const SizeControllerOptions& options);

  int64_t limit() const { return limit_; }
  int64_t good() const { return good_; }  // 0: nothing completed yet
  std::optional<int64_t> bad() const { return bad_; }
  bool probing() const { return probing_; }  // limit is an unproven growth probe
  int64_t ooms() const { return ooms_; }
  const SizeControllerOptions& options() const { return options_; }

  // True when the model sets the limit: kPredictive, with figures and a fit,
  // and not handed over to kSearch.
  bool predicting() const;
  // The largest size the model predicts to fit with the latest figures, or
  // nullopt when it cannot say (no fit, no capacity). Clamped to [min, max].
  std::optional<int64_t> Predict() const;
  // The model as fitted now, or nullopt before this run fitted one.
  std::optional<SizeModel> model() const;

  // An OOM at a micro-batch of size `size`. Returns false when the size cannot
  // be reduced (size <= min): the caller escalates. Without figures the
  // reaction is kSearch's.
  bool OnOom(int64_t size);
  // The same with the device's figures at the failure (kPredictive learns
  // from them; kSearch ignores them).
  bool OnOom(int64_t size, const MicroBatchMemory& memory);
  // An OOM that fault injection raised at a micro-batch of size `size`: the
  // limit halves (recovery is what is being tested) but no size is marked as
  // failing and nothing is learned, so growth resumes after grow_after clean
  // steps. Returns false when the size cannot be reduced.
  bool OnInjectedOom(int64_t size);
  // How many steps a failing size is remembered before it is tried again:
  // 2*grow_after, doubled for each retry of it that failed since one last ran
  // clean, at most forget_bad_after (for ever when either option is 0).
  int64_t BadWindow() const;

  // A micro-batch of `size` completed with these figures. Returns true when
  // the limit changed as a result: the rest of the step may be re-planned.
  bool OnMicroBatch(int64_t size, const MicroBatchMemory& memory);

  // A step starts with `base` bytes allocated and room for `capacity` (see
  // MicroBatchMemory). Lowers the limit when the room shrank below what the
  // model needs (another process took memory), raises it when it grew, or
  // sets it from an adopted prior model.
  void OnStepStart(int64_t base, int64_t capacity);

  // A step completed; `largest` is its largest micro-batch, `limit_bound` says
  // whether the limit split the step (growth is pointless otherwise).
  void OnSuccess(int64_t largest, bool limit_bound);

  // Sets the limit outright (the minimum across ranks, a user's choice).
  void SetLimit(int64_t limit);

  // Starts from a learned prior: the largest size that ran clean for this
  // workload before. The size counts as proven, and the failing size is taken
  // to lie just above it, with one strike: it is tried again after
  // BadWindow() (4*grow_after) clean steps, so a prior that one OOM set too
  // low does not hold the run below what fits.
  void AdoptPrior(int64_t size);
  // Starts from a learned model (kPredictive): the first step's figures
  // (OnStepStart) then give the limit directly, on this device, whatever the
  // size the earlier run ended at. Ignored by kSearch or when the model has no
  // slope.
  void AdoptPrior(const SizeModel& model);

 private:
  struct Point {
    int64_t size = 0;
    int64_t bytes = 0;  // largest peak - base
    int64_t over = -1;  // reserved - peak after the latest unflushed one (-1: none)
    int64_t reserved = 0;  // what the allocator had reserved then, with `over`
  };
  struct Failure {
    int64_t size = 0;
    int64_t need = 0;  // used - base: at least what the micro-batch needed
    int64_t step = 0;
  };
  static constexpr int kPoints = 8;
  static constexpr int kFailures = 4;

  // kSearch's reaction to an OOM at `size` (after bad/good were updated).
  void SearchOnOom(int64_t size);
  // Marks `size` as failing (a real OOM there), with a strike when it
  // retried a size that had failed before.
  void RememberBad(int64_t size);
  // An OOM at the minimum: the limit stays there; returns false (escalate).
  bool AtMinimum();
  // kSearch's growth after grow_after clean, limit-bound steps.
  void SearchGrow();
  // The model (size_model.cc).
  void AddPoint(int64_t size, int64_t bytes, int64_t over, int64_t reserved);
  void AddFailure(int64_t size, int64_t need);
  void Refit();
  // What the model's own memory is at `size`.
  double Bytes(int64_t size) const { return fit_.fixed_bytes + fit_.unit_bytes * static_cast<double>(size); }
  // The largest size that fits the latest room with overhead share `share`.
  int64_t SizeFor(double share) const;
  // The share with which `size` just fits the latest room.
  double ShareAt(int64_t size) const;
  // The overhead share believed to suffice (the bracket's top): the lower of
  // what was observed and what a probe proved, above the floor that OOMs set
  // (a little above a share shown not to suffice; observations can be stale).
  double Share() const;
  // Whether the overhead was observed or learned: without it a larger size
  // is a guess, and the limit does not rise on its own.
  bool KnowsOverhead() const { return has_over_ || std::isfinite(raised_) || std::isfinite(proven_); }
  // The largest size whose peak alone fits the latest room: nothing above it
  // can fit, whatever the allocator's overhead.
  int64_t Ceiling() const;
  double Headroom() const;
  // An OOM showed `share` not to suffice: raises the bracket's floor and,
  // when the share believed to suffice is not above it, that too.
  void TooSmall(double share);
  bool ModelUsable() const { return fitted_ && capacity_ > 0; }
  // What a micro-batch may use: the capacity the allocator can reach, less the base.
  int64_t Room() const { return capacity_ - std::min(stranded_, capacity_) - base_; }
  // The allocator had reserved all it can reach: the capacity less the
  // stranded tail, once an OOM showed one.
  bool AtWall(int64_t reserved) const { return stranded_ > 0 && reserved >= capacity_ - stranded_; }
  // An OOM's figures: learns the stranded bytes when the request failed
  // although the device had free memory enough for it.
  void LearnStranded(const MicroBatchMemory& memory);
  // Sets the limit to the largest size that fits with the share believed to suffice.
  void SetModelLimit();
  // Caps what the model may predict below a size that failed unexplained.
  void CapBelow(int64_t size);
  // Starts a probe of the bracket's middle when it is wide enough.
  bool MaybeProbe();

  SizeControllerOptions options_;
  int64_t limit_;
  int64_t good_ = 0;
  std::optional<int64_t> bad_;
  bool probing_ = false;
  int clean_steps_ = 0;
  int64_t steps_ = 0;
  int64_t bad_set_at_ = 0;
  int bad_strikes_ = 0;                // retries of a forgotten `bad` that failed again
  std::optional<int64_t> retried_bad_;  // the `bad` whose window ran out, until a step at it settles it
  int64_t ooms_ = 0;

  // kPredictive.
  std::array<Point, kPoints> points_{};
  int n_points_ = 0;
  std::array<Failure, kFailures> failures_{};
  int n_failures_ = 0;
  SizeModel fit_;  // fixed, unit and noise; valid when fitted_
  bool fitted_ = false;
  std::optional<SizeModel> prior_;  // an adopted model, until this run has figures of its own
  double over_bytes_ = 0;           // the allocator's overhead as observed (valid when has_over_)
  double share_ = 0;
  bool has_over_ = false;
  // Shares are relative to the fitted overhead_bytes, so they may be
  // negative (a probe proved that the fixed part was overestimated).
  double raised_ = -INFINITY;     // a floor an OOM at a size believed safe set
  double proven_ = INFINITY;      // the smallest share a probe proved to suffice
  double too_small_ = -INFINITY;  // known not to suffice
  int64_t too_small_at_ = 0;      // the step it was last raised
  double probe_share_ = 0;        // the share a probe tries (probe_ true)
  bool probe_ = false;
  int probe_steps_ = 0;    // clean steps of the probe so far
  int probes_failed_ = 0;  // failed probes since the bracket's floor was forgotten
  // A size the model may not predict: below what failed without figures or
  // in a way the model could not explain (forgotten with `bad`).
  std::optional<int64_t> cap_;
  int64_t base_ = 0;  // the latest figures
  int64_t capacity_ = 0;
  // Free bytes at the capacity's end that the allocator could not use, as
  // the latest OOM that showed them left them (0: none seen).
  int64_t stranded_ = 0;
  int64_t room_at_limit_ = 0;  // Room() when the limit was last set by the model or proven
  bool model_limit_ = false;   // the limit is the model's (an OOM there is a miss)
  bool cold_ = false;          // the limit is a cold measurement (kColdShrink)
  int misses_ = 0;             // OOMs at the model's sizes since one was proven
  int64_t search_since_ = -1;  // the step the model handed over to kSearch (-1: it did not)
};

}  // namespace oomguard

#endif  // OOMGUARD_SIZE_CONTROLLER_H_
