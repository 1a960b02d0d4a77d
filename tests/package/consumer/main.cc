// Uses the installed library through its public headers only: one guarded
// step with an injected OOM, recovered by splitting.
#include <oomguard/oomguard.h>
#ifdef CONSUMER_WITH_MPI
#include <oomguard/mpi_coordinator.h>
#endif

#include <cstdio>

int main() {
  if (!oomguard::SetFaultRules("oom@step=0,site=forward,micro=0").ok()) return 10;
  oomguard::GuardOptions options;
  options.initial_micro_batch = 8;
  auto guard = oomguard::Guard::Create(options);
  if (!guard.ok()) return 11;
  int64_t seen = 0;
  oomguard::StepRequest req;
  req.samples = 8;
  req.micro = [&](const oomguard::MicroBatch& mb) {
    (*guard)->MarkPhase(oomguard::Phase::kForward);
    seen += mb.size;
  };
  oomguard::StepReport report;
  oomguard::Status s = (*guard)->Step(req, &report);
  std::printf("status=%s ooms=%d limit_after=%lld seen=%lld version=%s\n", s.ToString().c_str(), report.ooms,
              static_cast<long long>(report.limit_after), static_cast<long long>(seen), OOMGUARD_VERSION_STRING);
  // Catching the SDK's exception type across the library boundary.
  try {
    throw oomguard::DeviceOomError("x", 1, {});
  } catch (const oomguard::DeviceOomError& e) {
    if (e.requested_bytes() != 1) return 12;
  }
#ifdef CONSUMER_WITH_MPI
  // Resolved from liboomguard_mpi at link time; not called, so that the test
  // needs no MPI launcher.
  auto* volatile make_mpi = &oomguard::MakeMpiCoordinator;
  if (make_mpi == nullptr) return 13;
#endif
  return s.ok() && report.ooms == 1 && report.limit_after == 4 && seen == 8 ? 0 : 1;
}
