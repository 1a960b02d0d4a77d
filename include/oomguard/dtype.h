// DType: element types of tensors, shared by checkpoints (the `dtype`
// attribute of a shard's datasets) and by the gradient buffers a coordinator
// sums over ranks.
//
// Thread-safety: pure functions.
#ifndef OOMGUARD_DTYPE_H_
#define OOMGUARD_DTYPE_H_

#include <cstddef>
#include <optional>
#include <string_view>

#include "oomguard/export.h"

namespace oomguard {

enum class DType {
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
  kInt8,
  kInt16,
  kInt32,
  kInt64,
  kUInt8,
  kUInt16,
  kUInt32,
  kUInt64,
  kBool,
};
// "float32", "bfloat16", ... (the names torch and numpy use).
OOMGUARD_EXPORT std::string_view DTypeName(DType t);
OOMGUARD_EXPORT std::optional<DType> ParseDType(std::string_view name);
// Bytes per element.
OOMGUARD_EXPORT size_t DTypeSize(DType t);

}  // namespace oomguard

#endif  // OOMGUARD_DTYPE_H_
