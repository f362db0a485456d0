#include "worker/tensor/dtype.h"

#include "absl/strings/str_cat.h"

namespace colod {

absl::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kI32: return "i32";
    case DType::kI64: return "i64";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  for (DType t : {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kI64}) {
    if (DTypeName(t) == name) return t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("dtype: '", name, "' is not one of f32, bf16, f16, i32, i64"));
}

}  // namespace colod
