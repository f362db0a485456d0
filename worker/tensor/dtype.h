// Element types of colod tensors, and the f16/bf16 <-> f32 conversions that
// the CPU paths use (f32 accumulation, round-to-nearest-even on the way back).
#ifndef COLOD_WORKER_TENSOR_DTYPE_H_
#define COLOD_WORKER_TENSOR_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace colod {

enum class DType { kF32, kBF16, kF16, kI32, kI64 };

inline size_t SizeOf(DType t) {
  switch (t) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kI32: return 4;
    case DType::kI64: return 8;
  }
  return 0;
}

// "f32", "bf16", "f16", "i32", "i64".
absl::string_view DTypeName(DType t);
// INVALID_ARGUMENT for an unknown name.
absl::StatusOr<DType> ParseDType(absl::string_view name);

inline float BF16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);  // round to nearest, ties to even
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// IEEE 754 binary16.
float F16ToFloat(uint16_t h);
uint16_t FloatToF16(float f);

}  // namespace colod

#endif  // COLOD_WORKER_TENSOR_DTYPE_H_
