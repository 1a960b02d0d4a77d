// The OOM exception types (oom_error.h). Out of line, so that their vtables
// and type_info live once, in this library.
#include "oomguard/oom_error.h"

#include <string>
#include <utility>

namespace oomguard {

DeviceOomError::DeviceOomError(const std::string& what, int64_t requested_bytes, MemoryStats stats,
                               bool injected)
    : std::runtime_error(what), requested_bytes_(requested_bytes), stats_(stats), injected_(injected) {}

HostOomError::HostOomError(std::string what, int64_t requested_bytes)
    : what_(std::move(what)), requested_bytes_(requested_bytes) {}

}  // namespace oomguard
