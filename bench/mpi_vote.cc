// Vote latency over MPI (run with mpirun -np 4), and the per-step overhead of
// the vote: the same guarded step with the local coordinator and with MPI.
// Rank 0 prints JSON lines.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "oomguard/guard.h"
#include "oomguard/logging.h"
#include "oomguard/mpi_coordinator.h"

using Clock = std::chrono::steady_clock;

int main(int argc, char** argv) {
  const int votes = argc > 1 ? std::atoi(argv[1]) : 20000;
  oomguard::Logger()->set_level(spdlog::level::off);
  auto c = oomguard::MakeMpiCoordinator();
  if (!c.ok()) {
    std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
    return 1;
  }
  oomguard::Coordinator& co = **c;
  std::vector<double> lat;
  for (int i = 0; i < votes; ++i) {
    auto t0 = Clock::now();
    if (!co.Vote(oomguard::VoteInput{}, std::chrono::milliseconds(10000)).ok()) return 1;
    lat.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  std::sort(lat.begin(), lat.end());
  auto step_us = [&](oomguard::Coordinator* coord) {
    oomguard::GuardOptions o;
    o.initial_micro_batch = 8;
    o.grow_after = 0;
    o.coordinator = coord;
    auto guard = oomguard::Guard::Create(o).value();
    oomguard::StepRequest req;
    req.samples = 64;
    volatile double sink = 0;
    req.micro = [&](const oomguard::MicroBatch& mb) { sink = sink + mb.weight; };
    const int steps = votes / 2;
    auto t0 = Clock::now();
    for (int i = 0; i < steps; ++i)
      if (!guard->Step(req).ok()) std::abort();
    return std::chrono::duration<double, std::micro>(Clock::now() - t0).count() / steps;
  };
  const double local = step_us(nullptr);
  (void)co.Barrier(std::chrono::milliseconds(10000));
  const double mpi = step_us(&co);
  if (co.rank() == 0) {
    std::printf("{\"bench\":\"vote_latency\",\"engine\":\"mpi\",\"ranks\":%d,\"votes\":%d,\"median_us\":%.2f,"
                "\"p99_us\":%.2f}\n",
                co.size(), votes, lat[lat.size() / 2], lat[static_cast<size_t>(0.99 * (lat.size() - 1))]);
    std::printf("{\"bench\":\"step_with_vote\",\"engine\":\"mpi\",\"ranks\":%d,\"step_us_local\":%.2f,"
                "\"step_us_mpi\":%.2f,\"vote_overhead_us\":%.2f}\n",
                co.size(), local, mpi, mpi - local);
  }
  return 0;
}
