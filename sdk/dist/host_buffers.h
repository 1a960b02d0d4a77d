// Host-memory arithmetic shared by the engines that sum on the CPU (local,
// ThreadGroup, MPI): which SumBuffers they accept, and scaling in place.
//
// Thread-safety: pure functions on the caller's buffers.
#ifndef OOMGUARD_SDK_DIST_HOST_BUFFERS_H_
#define OOMGUARD_SDK_DIST_HOST_BUFFERS_H_

#include <span>
#include <string_view>

#include "oomguard/coordinator.h"

namespace oomguard::dist {

// OK when every buffer is host memory of float32, float64 or int64 (scale 1
// for int64) with count >= 0 and data set when count > 0; otherwise
// kInvalidArgument naming `engine` and the buffer.
Status CheckHostBuffers(std::span<const SumBuffer> buffers, std::string_view engine);

// data *= scale, in place (nothing for scale 1). REQUIRES: CheckHostBuffers passed.
void ScaleInPlace(const SumBuffer& b);

}  // namespace oomguard::dist

#endif  // OOMGUARD_SDK_DIST_HOST_BUFFERS_H_
