#include "oomguard/dtype.h"

namespace oomguard {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
    case DType::kFloat64:
      return "float64";
    case DType::kInt8:
      return "int8";
    case DType::kInt16:
      return "int16";
    case DType::kInt32:
      return "int32";
    case DType::kInt64:
      return "int64";
    case DType::kUInt8:
      return "uint8";
    case DType::kUInt16:
      return "uint16";
    case DType::kUInt32:
      return "uint32";
    case DType::kUInt64:
      return "uint64";
    case DType::kBool:
      return "bool";
  }
  return "uint8";
}

std::optional<DType> ParseDType(std::string_view name) {
  for (int i = 0; i <= static_cast<int>(DType::kBool); ++i)
    if (DTypeName(static_cast<DType>(i)) == name) return static_cast<DType>(i);
  return std::nullopt;
}

size_t DTypeSize(DType t) {
  switch (t) {
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kInt16:
    case DType::kUInt16:
      return 2;
    case DType::kFloat32:
    case DType::kInt32:
    case DType::kUInt32:
      return 4;
    case DType::kFloat64:
    case DType::kInt64:
    case DType::kUInt64:
      return 8;
    default:
      return 1;
  }
}

}  // namespace oomguard
