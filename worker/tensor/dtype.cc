#include "worker/tensor/dtype.h"

#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace colod {
namespace {

// The first of `n` elements of `Bits` whose bits under `exponent` are all set.
template <typename Bits>
int64_t FirstWithExponentSet(const void* data, int64_t n, Bits exponent) {
  const auto* bytes = static_cast<const unsigned char*>(data);
  for (int64_t i = 0; i < n; ++i) {
    Bits b;
    std::memcpy(&b, bytes + i * static_cast<int64_t>(sizeof(Bits)), sizeof(Bits));
    if ((b & exponent) == exponent) return i;
  }
  return -1;
}

}  // namespace

int64_t FirstNonFinite(DType t, const void* data, int64_t n) {
  switch (t) {
    case DType::kF32:
      return FirstWithExponentSet<uint32_t>(data, n, 0x7f800000u);
    case DType::kBF16:
      return FirstWithExponentSet<uint16_t>(data, n, 0x7f80u);
    case DType::kF16:
      return FirstWithExponentSet<uint16_t>(data, n, 0x7c00u);
    case DType::kI32:
    case DType::kI64:
      return -1;
  }
  return -1;
}

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
