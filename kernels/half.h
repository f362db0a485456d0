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
using ::colod::HostScalar;
using ::colod::LoadAsFloat;

static_assert(static_cast<int>(ElemType::kF32) == static_cast<int>(HostScalar::kF32) &&
                  static_cast<int>(ElemType::kBF16) == static_cast<int>(HostScalar::kBF16) &&
                  static_cast<int>(ElemType::kF16) == static_cast<int>(HostScalar::kF16) &&
                  static_cast<int>(ElemType::kI32) == static_cast<int>(HostScalar::kI32) &&
                  static_cast<int>(ElemType::kI64) == static_cast<int>(HostScalar::kI64),
              "ElemType and common/half.h's HostScalar list the types in one order");

// Element i of a host buffer of `t` as a float (common/half.h's
// LoadAsFloat), and a float stored there (integers convert as static_cast
// does).
inline float LoadF(const void* base, int64_t i, ElemType t) {
  return LoadAsFloat(base, i, static_cast<HostScalar>(t));
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
