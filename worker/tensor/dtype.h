// Element types of colod tensors, and the f16/bf16 <-> f32 conversions that
// the CPU paths use (f32 accumulation, round-to-nearest-even on the way back).
#ifndef COLOD_WORKER_TENSOR_DTYPE_H_
#define COLOD_WORKER_TENSOR_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kernels/half.h"

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

// The floating-point types (f32, bf16, f16).
inline bool IsFloat(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }
// The integer types (i32, i64; a .npy's other integer types load as these).
inline bool IsInteger(DType t) { return t == DType::kI32 || t == DType::kI64; }

// The index of the first of the `n` elements of type `t` at `data` that is
// not finite (an infinity or a NaN: its exponent bits all set), or -1 where
// every one is, as for the integer types.
int64_t FirstNonFinite(DType t, const void* data, int64_t n);

// "f32", "bf16", "f16", "i32", "i64".
absl::string_view DTypeName(DType t);
// INVALID_ARGUMENT for an unknown name.
absl::StatusOr<DType> ParseDType(absl::string_view name);

// The host conversions live with the kernels (kernels/half.h).
using kernels::BF16ToFloat;
using kernels::F16ToFloat;
using kernels::FloatToBF16;
using kernels::FloatToF16;

}  // namespace colod

#endif  // COLOD_WORKER_TENSOR_DTYPE_H_
