// colod's CUDA emulation: bfloat16 (see cuda_runtime.h). The conversion to
// bf16 rounds to nearest even; a NaN stays a (quiet) NaN.
#ifndef COLOD_KERNELS_CUDA_EMU_CUDA_BF16_H_
#define COLOD_KERNELS_CUDA_EMU_CUDA_BF16_H_

#include "cuda_runtime.h"

struct __nv_bfloat16 {
  unsigned short x;
};

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }

inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(static_cast<unsigned int>(h.x) << 16); }

inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned int bits = __float_as_uint(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return __nv_bfloat16{static_cast<unsigned short>((bits >> 16) | 0x40)};
  return __nv_bfloat16{static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16)};
}

#endif  // COLOD_KERNELS_CUDA_EMU_CUDA_BF16_H_
