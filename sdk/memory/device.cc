// The device-independent parts of device.h: Device's anchor and DeviceBuffer.

#include "oomguard/device.h"

#include <utility>

namespace oomguard {

// Out of line so that Device's vtable and type_info live in this library.
Device::~Device() = default;

bool CudaCompiled() {
#ifdef OOMGUARD_WITH_CUDA
  return true;
#else
  return false;
#endif
}

DeviceBuffer::DeviceBuffer(Device* device, size_t bytes) : size_(bytes) {
  // Allocate before recording the device, so that a throwing Allocate leaves
  // nothing for the destructor to free (the destructor does not run anyway,
  // but a half-built object must not look owning).
  data_ = device->Allocate(bytes);
  device_ = device;
}

DeviceBuffer::~DeviceBuffer() { reset(); }

DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : device_(std::exchange(o.device_, nullptr)),
      data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)) {}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    device_ = std::exchange(o.device_, nullptr);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

void DeviceBuffer::reset() {
  if (device_ != nullptr && data_ != nullptr) device_->Free(data_);
  device_ = nullptr;
  data_ = nullptr;
  size_ = 0;
}

}  // namespace oomguard
