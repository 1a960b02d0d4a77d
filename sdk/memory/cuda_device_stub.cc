// MakeCudaDevice when the library is built without the CUDA toolkit.

#include <memory>

#include "oomguard/device.h"
#include "oomguard/status.h"

namespace oomguard {

StatusOr<std::unique_ptr<Device>> MakeCudaDevice(int /*device_index*/) {
  return Status::Unimplemented("built without CUDA (OOMGUARD_WITH_CUDA=OFF)");
}

}  // namespace oomguard
