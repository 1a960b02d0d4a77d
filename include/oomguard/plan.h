// The micro-batch plan: how one optimizer step's samples are split so that each
// piece fits, while the weighted sum of micro-batch gradients equals the
// gradient of the whole batch.
//
// For a mean-reduced loss L, sum_i weight_i * grad L(mb_i) == grad L(batch)
// when weight_i = size_i / n. The weight depends only on the micro-batch's own
// size, never on how the rest is split, which is what lets the guard keep
// micro-batches that completed before an OOM and re-plan only the rest.
//
// Thread-safety: pure functions.
#ifndef OOMGUARD_PLAN_H_
#define OOMGUARD_PLAN_H_

#include <cstdint>
#include <span>
#include <vector>

#include "oomguard/export.h"
#include "oomguard/status.h"

namespace oomguard {

struct MicroBatch {
  int index = 0;        // position in the step's plan (0-based)
  int count = 0;        // micro-batches in the plan
  int64_t offset = 0;   // first sample, in [0, n)
  int64_t size = 0;     // samples in this micro-batch (>= 1)
  double weight = 0.0;  // size / n: multiply the mean loss by this
  int64_t cost = 0;     // summed per-sample cost (== size without costs)
};

// Splits samples [begin, n) into ceil((n-begin)/limit) contiguous micro-batches
// whose sizes differ by at most one and never exceed `limit`. Indices start at
// `first_index`. REQUIRES: 0 <= begin < n, limit >= 1.
OOMGUARD_EXPORT std::vector<MicroBatch> PlanBySamples(int64_t n, int64_t limit, int64_t begin = 0,
                                                      int first_index = 0);

// Packs samples [begin, n) greedily into contiguous micro-batches whose summed
// cost is within `limit`; a sample whose cost alone exceeds the limit gets a
// micro-batch of its own. n = costs.size(). kInvalidArgument for a negative
// cost, costs whose sum overflows int64, limit < 1, or begin out of range.
OOMGUARD_EXPORT StatusOr<std::vector<MicroBatch>> PlanByCost(std::span<const int64_t> costs,
                                                             int64_t limit, int64_t begin = 0,
                                                             int first_index = 0);

}  // namespace oomguard

#endif  // OOMGUARD_PLAN_H_
