// Vote latency with ranks as threads (ThreadGroup: an Allgather of the
// guard's 29-word vote record), and the per-step cost of the step protocol
// inside Guard::Step: the same step with 1 rank (local coordinator, no
// communication) and with 4 ranks, once with a sync of one float64 (it rides
// in the vote: vote and agreement, two collectives) and once with a sync of
// kVoteSumWords + 1 float64 (vote, sum, agreement: three), alternating in one
// run. Prints one JSON object per line.
//   vote_bench [--ranks 4] [--votes 20000]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "oomguard/coordinator.h"
#include "oomguard/guard.h"
#include "oomguard/logging.h"

namespace {

using Clock = std::chrono::steady_clock;

double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(p * static_cast<double>(v.size() - 1))];
}

// Median and p99 of single votes, as seen by rank 0.
void VoteLatency(int ranks, int votes) {
  auto group = oomguard::MakeThreadGroup(ranks).value();
  std::vector<double> lat;
  lat.reserve(static_cast<size_t>(votes));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      for (int i = 0; i < votes; ++i) {
        // The guard's vote record: 29 words with its tag.
        std::vector<int64_t> mine(29, 64 + r), all(29 * static_cast<size_t>(ranks));
        auto t0 = Clock::now();
        if (!group[r]->Allgather(mine, all, std::chrono::milliseconds(10000)).ok()) std::abort();
        if (r == 0) lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      }
    });
  }
  for (auto& t : threads) t.join();
  std::printf("{\"bench\":\"vote_latency\",\"engine\":\"threads\",\"ranks\":%d,\"votes\":%d,\"median_us\":%.2f,"
              "\"p99_us\":%.2f}\n",
              ranks, votes, Percentile(lat, 0.5), Percentile(lat, 0.99));
}

// Wall time per Guard::Step of `micro` empty micro-batches on each of `ranks`
// threads, with a sync of `words` float64; the difference to ranks=1 is what
// agreement costs per step.
double StepTime(int ranks, int steps, int words) {
  std::vector<std::unique_ptr<oomguard::Coordinator>> group;
  if (ranks > 1) group = oomguard::MakeThreadGroup(ranks).value();
  std::vector<double> per_rank(static_cast<size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back([&, r] {
      oomguard::GuardOptions o;
      o.initial_micro_batch = 8;
      o.grow_after = 0;
      if (ranks > 1) o.coordinator = group[r].get();
      auto guard = oomguard::Guard::Create(o).value();
      oomguard::StepRequest req;
      req.samples = 64;
      std::vector<double> grad(static_cast<size_t>(words), 0.0);
      req.micro = [&](const oomguard::MicroBatch& mb) { grad[0] += mb.weight; };
      req.reset = [&] { std::fill(grad.begin(), grad.end(), 0.0); };
      req.sync = [&] { return std::vector<oomguard::SumBuffer>{oomguard::SumBuffer::Host(grad.data(), words)}; };
      req.apply = [&] { std::fill(grad.begin(), grad.end(), 0.0); };
      auto t0 = Clock::now();
      for (int i = 0; i < steps; ++i)
        if (!guard->Step(req).ok()) std::abort();
      per_rank[r] = std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / steps;
    });
  }
  for (auto& t : threads) t.join();
  return *std::max_element(per_rank.begin(), per_rank.end());
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 4, votes = 20000;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--ranks") == 0) ranks = std::atoi(argv[i + 1]);
    else if (std::strcmp(argv[i], "--votes") == 0) votes = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: vote_bench [--ranks N] [--votes N]\n");
      return 2;
    }
  }
  if (ranks < 2 || votes < 100) {
    std::fprintf(stderr, "vote_bench: --ranks must be >= 2 and --votes >= 100\n");
    return 2;
  }
  oomguard::Logger()->set_level(spdlog::level::off);
  VoteLatency(ranks, votes);
  // Alternating rounds of the two syncs; the medians of the rounds.
  const int rounds = 5, steps = votes / 2 / rounds;
  constexpr int kApart = 9;  // one word more than the vote carries (step_protocol.h)
  std::vector<double> one, many, one_apart, many_apart;
  for (int i = 0; i < rounds; ++i) {
    one.push_back(StepTime(1, steps, 1));
    many.push_back(StepTime(ranks, steps, 1));
    one_apart.push_back(StepTime(1, steps, kApart));
    many_apart.push_back(StepTime(ranks, steps, kApart));
  }
  const double o = Percentile(one, 0.5), m = Percentile(many, 0.5);
  const double oa = Percentile(one_apart, 0.5), ma = Percentile(many_apart, 0.5);
  std::printf("{\"bench\":\"step_with_vote\",\"engine\":\"threads\",\"ranks\":%d,\"steps\":%d,\"step_us_1rank\":%.2f,"
              "\"step_us_nranks\":%.2f,\"vote_overhead_us\":%.2f,\"sum_apart_step_us_1rank\":%.2f,"
              "\"sum_apart_step_us_nranks\":%.2f,\"sum_apart_overhead_us\":%.2f}\n",
              ranks, steps * rounds, o, m, m - o, oa, ma, ma - oa);
  return 0;
}
