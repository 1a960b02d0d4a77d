// Uses the installed library through its public headers only: one guarded
// step with an injected OOM, recovered by splitting, on a Device of the
// program's own (Device is a public extension point).
#include <oomguard/oomguard.h>
#ifdef CONSUMER_WITH_MPI
#include <oomguard/mpi_coordinator.h>
#endif

#include <cstdio>
#include <stdexcept>
#include <string>

namespace {

// A framework's allocator as the guard sees it: figures and a cache release.
class FrameworkDevice : public oomguard::Device {
 public:
  std::string Name() const override { return "framework:0"; }
  oomguard::MemoryStats Stats() const override {
    ++stats_calls;
    oomguard::MemoryStats s;
    s.allocated = 1 << 20;
    s.reserved = 2 << 20;
    return s;
  }
  void ReleaseCaches() override { ++releases; }
  void ResetPeak() override { ++peak_resets; }
  void* Allocate(size_t) override { throw std::logic_error("the framework allocates by itself"); }
  void Free(void*) override {}
  mutable int stats_calls = 0;
  int releases = 0;
  int peak_resets = 0;
};

}  // namespace

int main() {
  if (!oomguard::SetFaultRules("oom@step=0,site=forward,micro=0").ok()) return 10;
  FrameworkDevice device;
  oomguard::GuardOptions options;
  options.initial_micro_batch = 8;
  options.device = &device;
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
  std::printf("device: %d releases, %d stats, %d peak resets\n", device.releases, device.stats_calls,
              device.peak_resets);
  if (device.releases != 1 || device.stats_calls == 0 || device.peak_resets == 0) return 14;
  // A StatusOr holding an error refuses its value, loudly, in this build too.
  try {
    (void)oomguard::Guard::Create(oomguard::GuardOptions{.min_micro_batch = 0}).value();
    return 15;
  } catch (const oomguard::BadStatusOrAccess& e) {
    if (std::string(e.what()).find("min_micro_batch") == std::string::npos) return 16;
  }
  return s.ok() && report.ooms == 1 && report.limit_after == 4 && seen == 8 ? 0 : 1;
}
