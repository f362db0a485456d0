// colod's CUDA emulation: IEEE half precision (see cuda_runtime.h). The
// conversions round to nearest even and keep NaN, infinities and subnormals,
// as the hardware's do.
#ifndef COLOD_KERNELS_CUDA_EMU_CUDA_FP16_H_
#define COLOD_KERNELS_CUDA_EMU_CUDA_FP16_H_

#include "cuda_runtime.h"

struct __half {
  unsigned short x;
};

inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.x; }

inline float __half2float(__half h) {
  const unsigned int sign = (h.x & 0x8000u) << 16;
  unsigned int exp = (h.x >> 10) & 0x1fu;
  unsigned int mant = h.x & 0x3ffu;
  unsigned int bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);  // inf or NaN
  } else if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {  // subnormal: normalize
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      bits = sign | ((127 - 15 - e) << 23) | ((mant & 0x3ffu) << 13);
    }
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
  }
  return __uint_as_float(bits);
}

inline __half __float2half_rn(float f) {
  const unsigned int bits = __float_as_uint(f);
  const unsigned short sign = static_cast<unsigned short>((bits >> 16) & 0x8000u);
  const unsigned int abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return __half{static_cast<unsigned short>(sign | 0x7e00u)};  // NaN
  if (abs >= 0x477ff000u) return __half{static_cast<unsigned short>(sign | 0x7c00u)};  // rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (abs < 0x33000000u) return __half{sign};  // below half the smallest subnormal (or equal: rounds to even 0)
    const unsigned int mant = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);  // 14 + (113 - exp)
    unsigned int h = mant >> shift;
    const unsigned int rem = mant & ((1u << shift) - 1), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (h & 1u))) ++h;
    return __half{static_cast<unsigned short>(sign | h)};
  }
  unsigned int h = ((abs >> 23) - 112) << 10 | ((abs >> 13) & 0x3ffu);
  const unsigned int rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // may carry into the exponent: still right
  return __half{static_cast<unsigned short>(sign | h)};
}

inline __half __float2half(float f) { return __float2half_rn(f); }

#endif  // COLOD_KERNELS_CUDA_EMU_CUDA_FP16_H_
