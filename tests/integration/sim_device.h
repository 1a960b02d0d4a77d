// The simulated device the integration tests train on: a caching allocator
// scaled to the test models (64 KiB segments), so budgets of a fraction of a
// MiB behave as GiB budgets do on a GPU.
#ifndef OOMGUARD_TESTS_INTEGRATION_SIM_DEVICE_H_
#define OOMGUARD_TESTS_INTEGRATION_SIM_DEVICE_H_

#include <memory>

#include "oomguard/device.h"

namespace oomguard::testing {

// budget_mib 0: unlimited.
inline std::unique_ptr<Device> SmallSimDevice(double budget_mib) {
  SimulatedDeviceOptions o;
  o.capacity_bytes = static_cast<int64_t>(budget_mib * (1 << 20));
  o.segment_bytes = 64 << 10;
  o.small_request_bytes = 32 << 10;
  return MakeSimulatedDevice(o).value();
}

}  // namespace oomguard::testing

#endif  // OOMGUARD_TESTS_INTEGRATION_SIM_DEVICE_H_
