#include "sdk/dist/host_buffers.h"

#include <cmath>
#include <string>

namespace oomguard::dist {

Status CheckHostBuffers(std::span<const SumBuffer> buffers, std::string_view engine) {
  for (size_t i = 0; i < buffers.size(); ++i) {
    const SumBuffer& b = buffers[i];
    auto bad = [&](const std::string& why) {
      return Status::InvalidArgument(std::string(engine) + " AllreduceSum: buffer " + std::to_string(i) + " " + why);
    };
    if (b.device >= 0) return bad("is on CUDA device " + std::to_string(b.device) + "; this engine sums host memory");
    if (b.count < 0) return bad("has a negative count");
    if (b.count > 0 && b.data == nullptr) return bad("has no data");
    if (b.dtype != DType::kFloat32 && b.dtype != DType::kFloat64 && b.dtype != DType::kInt64)
      return bad("is " + std::string(DTypeName(b.dtype)) + "; this engine sums float32, float64 and int64");
    if (b.dtype == DType::kInt64 && b.scale != 1.0) return bad("is int64 with a scale other than 1");
    if (!std::isfinite(b.scale)) return bad("has a scale that is not finite");
  }
  return Status::Ok();
}

void ScaleInPlace(const SumBuffer& b) {
  if (b.scale == 1.0 || b.count == 0) return;
  if (b.dtype == DType::kFloat64) {
    double* p = static_cast<double*>(b.data);
    for (int64_t i = 0; i < b.count; ++i) p[i] *= b.scale;
  } else if (b.dtype == DType::kFloat32) {
    float* p = static_cast<float*>(b.data);
    const float s = static_cast<float>(b.scale);
    for (int64_t i = 0; i < b.count; ++i) p[i] *= s;
  }
}

}  // namespace oomguard::dist
