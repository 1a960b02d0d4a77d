// A rank that stops answering: the others must return kUnavailable within the
// deadline and exit with kExitCoordinationTimeout (the launcher's cue to
// restart every rank). Checked by mpi_silent_rank_test.sh.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "oomguard/mpi_coordinator.h"

int main() {
  auto c = oomguard::MakeMpiCoordinator();
  if (!c.ok()) return 1;
  oomguard::Coordinator& co = **c;
  const int silent = co.size() - 1;
  if (co.rank() == silent) {
    std::this_thread::sleep_for(std::chrono::seconds(3));  // never votes
    std::fflush(stdout);
    _exit(0);
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<int64_t> mine(19, co.rank()), all(19 * static_cast<size_t>(co.size()));
  oomguard::Status r = co.Allgather(mine, all, std::chrono::milliseconds(500));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!r.ok() && r.code() == oomguard::StatusCode::kUnavailable && s < 2.0) {
    std::printf("TIMEOUT-OK rank %d after %.2f s: %s\n", co.rank(), s, r.message().c_str());
  } else {
    std::printf("TIMEOUT-BAD rank %d after %.2f s: %s\n", co.rank(), s, r.ToString().c_str());
  }
  std::fflush(stdout);
  _exit(oomguard::kExitCoordinationTimeout);  // no MPI_Finalize with a collective pending
}
