// f16 and bf16 <-> f32 on the host: exact widening, and narrowing rounded to
// nearest, ties to even (NaN stays NaN), as CUDA's __float2half_rn and
// __float2bfloat16 do; element loads and stores of any ElemType as floats. Used by the CPU kernels, Gloo's reductions and the
// tensors' host conversions.
#ifndef COLOD_KERNELS_HALF_H_
#define COLOD_KERNELS_HALF_H_

#include <cstdint>
#include <cstring>

#include "common/half.h"
#include "kernels/types.h"

namespace colod::kernels {

// The scalar conversions are common/half.h's (coloctl reads tensor values
// with them without linking the kernels).
using ::colod::BF16ToFloat;
using ::colod::F16ToFloat;
using ::colod::FloatToBF16;
using ::colod::FloatToF16;

// Element i of a host buffer of `t` as a float, and a float stored there
// (integers convert as static_cast does).
inline float LoadF(const void* base, int64_t i, ElemType t) {
  const char* p = static_cast<const char*>(base) + i * ElemBytes(t);
  switch (t) {
    case ElemType::kF32: { float v; std::memcpy(&v, p, 4); return v; }
    case ElemType::kBF16: { uint16_t v; std::memcpy(&v, p, 2); return BF16ToFloat(v); }
    case ElemType::kF16: { uint16_t v; std::memcpy(&v, p, 2); return F16ToFloat(v); }
    case ElemType::kI32: { int32_t v; std::memcpy(&v, p, 4); return static_cast<float>(v); }
    case ElemType::kI64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<float>(v); }
  }
  return 0;
}

inline void StoreF(void* base, int64_t i, ElemType t, float f) {
  char* p = static_cast<char*>(base) + i * ElemBytes(t);
  switch (t) {
    case ElemType::kF32: std::memcpy(p, &f, 4); return;
    case ElemType::kBF16: { uint16_t v = FloatToBF16(f); std::memcpy(p, &v, 2); return; }
    case ElemType::kF16: { uint16_t v = FloatToF16(f); std::memcpy(p, &v, 2); return; }
    case ElemType::kI32: { int32_t v = static_cast<int32_t>(f); std::memcpy(p, &v, 4); return; }
    case ElemType::kI64: { int64_t v = static_cast<int64_t>(f); std::memcpy(p, &v, 8); return; }
  }
}

}  // namespace colod::kernels

#endif  // COLOD_KERNELS_HALF_H_
