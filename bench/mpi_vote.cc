// The per-step cost of the step protocol over MPI (run with mpirun -np 4),
// side by side in one run:
//   round1   what the first protocol ran per step: one MPI_Iallreduce(MAX) of
//            6 int64 (the vote), then the user's gradient MPI_Iallreduce(SUM)
//   three    the atomic step before issue 29: the vote (Allgather of 19
//            int64), the gradient sum with 4 status words appended
//            (AllreduceSum), the agreement after the apply (Allgather of 3)
//   atomic   what the guard runs now when the sync does not fit in the vote:
//            the vote (Allgather of 29 int64), the sum with 2 sequence words,
//            the agreement
//   fused    what it runs when the sync rides in the vote (a loss alone):
//            the vote (Allgather of 29) and the agreement
//   step     a whole Guard::Step with the guard-owned sync, over MPI, and the
//            same step with the local coordinator (no collectives)
// The three, fused and atomic patterns are interleaved round by round.
// Each with a gradient of `--grad N` float64 (default 4417: mlp_train's
// parameters at --hidden 64) and with none (the loss alone: the guarded step
// then takes the fused path). Rank 0 prints JSON lines.
#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "oomguard/guard.h"
#include "oomguard/logging.h"
#include "oomguard/mpi_coordinator.h"

using Clock = std::chrono::steady_clock;

namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Times `rounds` calls of fn (each one step's collectives), in microseconds.
template <typename Fn>
std::vector<double> Time(int rounds, Fn&& fn) {
  std::vector<double> out;
  out.reserve(static_cast<size_t>(rounds));
  for (int i = 0; i < rounds; ++i) {
    auto t0 = Clock::now();
    fn();
    out.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return out;
}

void Wait(MPI_Request* reqs, int n) {
  int done = 0;
  while (!done) MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 20000;
  int64_t grad_n = 4417;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--rounds") == 0) rounds = std::atoi(argv[i + 1]);
    else if (std::strcmp(argv[i], "--grad") == 0) grad_n = std::atoll(argv[i + 1]);
  }
  oomguard::Logger()->set_level(spdlog::level::off);
  auto c = oomguard::MakeMpiCoordinator();
  if (!c.ok()) {
    std::fprintf(stderr, "%s\n", c.status().ToString().c_str());
    return 1;
  }
  oomguard::Coordinator& co = **c;
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  const auto deadline = std::chrono::milliseconds(10000);

  for (int64_t n : {int64_t{0}, grad_n}) {
    std::vector<double> grad(static_cast<size_t>(n) + 1, 1.0);  // + the loss
    // The first protocol: a MAX vote, then the user's own gradient sum.
    auto round1 = Time(rounds, [&] {
      int64_t w[6] = {0, -5, -5, 5, -64, 0}, m[6];
      MPI_Request r;
      MPI_Iallreduce(w, m, 6, MPI_INT64_T, MPI_MAX, comm, &r);
      Wait(&r, 1);
      MPI_Iallreduce(MPI_IN_PLACE, grad.data(), static_cast<int>(grad.size()), MPI_DOUBLE, MPI_SUM, comm, &r);
      Wait(&r, 1);
    });
    MPI_Barrier(comm);
    // The step's collectives through the coordinator, before issue 29 and now.
    std::vector<int64_t> vote19(19, 0), votes19(19 * static_cast<size_t>(co.size()));
    std::vector<int64_t> vote(29, 0), votes(29 * static_cast<size_t>(co.size()));
    std::vector<int64_t> agree(3, 0), agreed(3 * static_cast<size_t>(co.size()));
    auto sum = [&](int status_words) {
      double status[4] = {0, 0, 1, 1};
      std::vector<oomguard::SumBuffer> bufs = {oomguard::SumBuffer::Host(grad.data(), static_cast<int64_t>(grad.size())),
                                               oomguard::SumBuffer::Host(status, status_words)};
      bufs[0].scale = 0.25;
      if (!co.AllreduceSum(bufs, deadline).ok()) std::abort();
    };
    // Interleaved round by round, so that the three face the same load.
    std::vector<double> three, atomic, fused;
    for (int i = 0; i < rounds; ++i) {
      three.push_back(Time(1, [&] {
        if (!co.Allgather(vote19, votes19, deadline).ok()) std::abort();
        sum(4);
        if (!co.Allgather(agree, agreed, deadline).ok()) std::abort();
      })[0]);
      atomic.push_back(Time(1, [&] {
        if (!co.Allgather(vote, votes, deadline).ok()) std::abort();
        sum(2);
        if (!co.Allgather(agree, agreed, deadline).ok()) std::abort();
      })[0]);
      fused.push_back(Time(1, [&] {
        if (!co.Allgather(vote, votes, deadline).ok()) std::abort();
        if (!co.Allgather(agree, agreed, deadline).ok()) std::abort();
      })[0]);
    }
    MPI_Barrier(comm);
    // A whole guarded step with the guard-owned sync: MPI, and local.
    auto step_us = [&](oomguard::Coordinator* coord) {
      oomguard::GuardOptions o;
      o.initial_micro_batch = 8;
      o.grow_after = 0;
      o.coordinator = coord;
      auto guard = oomguard::Guard::Create(o).value();
      double loss = 0;
      oomguard::StepRequest req;
      req.samples = 64;
      req.micro = [&](const oomguard::MicroBatch& mb) { loss += mb.weight; };
      req.reset = [&] { loss = 0; };
      req.sync = [&] {
        grad.back() = loss;
        return std::vector<oomguard::SumBuffer>{
            oomguard::SumBuffer::Host(grad.data(), static_cast<int64_t>(grad.size()))};
      };
      req.apply = [&] { loss = 0; };
      return Time(rounds / 2, [&] {
        if (!guard->Step(req).ok()) std::abort();
      });
    };
    auto local = step_us(nullptr);
    MPI_Barrier(comm);
    auto mpi = step_us(&co);
    if (co.rank() == 0) {
      std::printf("{\"bench\":\"step_protocol\",\"engine\":\"mpi\",\"ranks\":%d,\"grad_floats\":%lld,\"rounds\":%d,"
                  "\"round1_vote_and_sum_us\":%.2f,\"atomic_vote_sum_agree_us\":%.2f,\"ratio\":%.2f,"
                  "\"three_before_issue29_us\":%.2f,\"fused_vote_agree_us\":%.2f,"
                  "\"guarded_step_local_us\":%.2f,\"guarded_step_mpi_us\":%.2f}\n",
                  co.size(), static_cast<long long>(n), rounds, Median(round1), Median(atomic),
                  Median(atomic) / Median(round1), Median(three), Median(fused), Median(local), Median(mpi));
    }
    MPI_Barrier(comm);
  }
  MPI_Comm_free(&comm);
  return 0;
}
