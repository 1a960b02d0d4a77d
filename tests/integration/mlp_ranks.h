// The demo model trained on several ranks as threads (ThreadGroup), each rank
// on a simulated device of its own: what the multi-rank integration tests share.
#ifndef OOMGUARD_TESTS_INTEGRATION_MLP_RANKS_H_
#define OOMGUARD_TESTS_INTEGRATION_MLP_RANKS_H_

#include <thread>
#include <vector>

#include "mlp.h"
#include "oomguard/coordinator.h"
#include "sim_device.h"

namespace oomguard::testing {

// Trains `cfg` on budgets.size() ranks, rank r on a device of budgets[r] MiB
// (0: unlimited), each with `hooks` (a knowledge base the ranks share, ...)
// and its own coordinator of one group. Returns the ranks' results in rank order.
inline std::vector<mlp::TrainResult> RunRanks(const mlp::Config& cfg, const std::vector<double>& budgets,
                                              const mlp::TrainHooks& hooks = {}) {
  const int n = static_cast<int>(budgets.size());
  auto group = MakeThreadGroup(n).value();
  std::vector<mlp::TrainResult> out(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto dev = SmallSimDevice(budgets[static_cast<size_t>(r)]);
      mlp::TrainHooks h = hooks;
      h.coordinator = group[static_cast<size_t>(r)].get();
      out[static_cast<size_t>(r)] = mlp::Train(cfg, dev.get(), h);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace oomguard::testing

#endif  // OOMGUARD_TESTS_INTEGRATION_MLP_RANKS_H_
