// f16 and bf16 <-> f32 on the host: exact widening, and narrowing rounded to
// nearest, ties to even (NaN stays NaN), as CUDA's __float2half_rn and
// __float2bfloat16 do, and element loads as floats. The kernels' element
// loads and stores (kernels/half.h) and coloctl's printing of tensor values
// use them.
//
// Thread-safety: pure functions.
#ifndef COLOD_COMMON_HALF_H_
#define COLOD_COMMON_HALF_H_

#include <cstdint>
#include <cstring>

namespace colod {

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

// The element types of host buffers read as floats, in kernels::ElemType's
// (and colod::DType's) order.
enum class HostScalar { kF32, kBF16, kF16, kI32, kI64 };

inline int HostScalarBytes(HostScalar t) {
  return t == HostScalar::kI64 ? 8 : (t == HostScalar::kBF16 || t == HostScalar::kF16) ? 2 : 4;
}

// Element i of a host buffer of `t` as a float (integers convert as
// static_cast does): the kernels' LoadF, and coloctl's reading of tensor
// values.
inline float LoadAsFloat(const void* base, int64_t i, HostScalar t) {
  const char* p = static_cast<const char*>(base) + i * HostScalarBytes(t);
  switch (t) {
    case HostScalar::kF32: { float v; std::memcpy(&v, p, 4); return v; }
    case HostScalar::kBF16: { uint16_t v; std::memcpy(&v, p, 2); return BF16ToFloat(v); }
    case HostScalar::kF16: { uint16_t v; std::memcpy(&v, p, 2); return F16ToFloat(v); }
    case HostScalar::kI32: { int32_t v; std::memcpy(&v, p, 4); return static_cast<float>(v); }
    case HostScalar::kI64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<float>(v); }
  }
  return 0;
}

}  // namespace colod

#endif  // COLOD_COMMON_HALF_H_
