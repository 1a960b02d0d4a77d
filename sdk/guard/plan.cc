#include "oomguard/plan.h"

#include <cassert>
#include <string>

namespace oomguard {

std::vector<MicroBatch> PlanBySamples(int64_t n, int64_t limit, int64_t begin, int first_index) {
  assert(n > 0 && begin >= 0 && begin < n && limit >= 1);
  const int64_t rest = n - begin;
  // Balanced sizes (differ by at most one) rather than limit,limit,...,remainder:
  // the same number of micro-batches, and no tiny last one.
  const int64_t count = (rest + limit - 1) / limit;
  const int64_t base = rest / count;
  const int64_t extra = rest % count;  // the first `extra` micro-batches get one more
  std::vector<MicroBatch> plan;
  plan.reserve(static_cast<size_t>(count));
  int64_t offset = begin;
  for (int64_t i = 0; i < count; ++i) {
    MicroBatch mb;
    mb.index = first_index + static_cast<int>(i);
    mb.count = first_index + static_cast<int>(count);
    mb.offset = offset;
    mb.size = base + (i < extra ? 1 : 0);
    mb.weight = static_cast<double>(mb.size) / static_cast<double>(n);
    mb.cost = mb.size;
    offset += mb.size;
    plan.push_back(mb);
  }
  return plan;
}

StatusOr<std::vector<MicroBatch>> PlanByCost(std::span<const int64_t> costs, int64_t limit,
                                             int64_t begin, int first_index) {
  const int64_t n = static_cast<int64_t>(costs.size());
  if (limit < 1) return Status::InvalidArgument("plan: cost limit must be >= 1 (got " + std::to_string(limit) + ")");
  if (n == 0) return Status::InvalidArgument("plan: no samples");
  if (begin < 0 || begin >= n)
    return Status::InvalidArgument("plan: begin " + std::to_string(begin) + " outside [0, " + std::to_string(n) + ")");
  // Costs are summed into micro-batches (and the caller sums them for the
  // whole step): a sum that wraps would pack a negative cost.
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i)
    if (costs[static_cast<size_t>(i)] >= 0 && __builtin_add_overflow(total, costs[static_cast<size_t>(i)], &total))
      return Status::InvalidArgument("plan: costs overflow: their sum passes 2^63 - 1 at sample " +
                                     std::to_string(i) + " (" + std::to_string(costs[static_cast<size_t>(i)]) +
                                     ")");
  std::vector<MicroBatch> plan;
  MicroBatch cur;
  cur.offset = begin;
  auto flush = [&] {
    cur.index = first_index + static_cast<int>(plan.size());
    cur.weight = static_cast<double>(cur.size) / static_cast<double>(n);
    plan.push_back(cur);
    cur = MicroBatch{};
  };
  for (int64_t i = begin; i < n; ++i) {
    const int64_t c = costs[static_cast<size_t>(i)];
    if (c < 0)
      return Status::InvalidArgument("plan: cost of sample " + std::to_string(i) + " is negative (" +
                                     std::to_string(c) + ")");
    if (cur.size > 0 && cur.cost + c > limit) {
      flush();
      cur.offset = i;
    }
    cur.size += 1;
    cur.cost += c;
  }
  if (cur.size > 0) flush();
  for (auto& mb : plan) mb.count = first_index + static_cast<int>(plan.size());
  return plan;
}

}  // namespace oomguard
