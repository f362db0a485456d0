// Branch-free f32 exp and tanh that compilers vectorize (no libm call in the
// loop), for the CPU kernels' elementwise hot loops (tanh-GELU forward and
// backward): libm's tanhf and expm1f are scalar calls, and were a fifth of a
// CPU training step's samples.
//
// VecExp follows Cephes' expf: the argument clamped to [-87, 88] (past
// them expf's result leaves the normal range), reduced by n ln 2 in two parts
// (Cody-Waite), a degree-5 polynomial on the remainder, 2^n written into the
// exponent bits; within 2 ulp of expf there. VecTanh is 1 - 2 / (exp(2x) + 1):
// within 2e-7 of tanh absolutely (not relatively near 0, where tanh(x) ~ x:
// GELU adds it to 1), exactly +-1 from |x| = 10 on. GCC vectorizes loops of
// them with -fno-trapping-math (kernels/BUILD.bazel), clang without.
#ifndef COLOD_KERNELS_CPU_VEC_MATH_H_
#define COLOD_KERNELS_CPU_VEC_MATH_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace colod::kernels::cpu {

inline float VecExp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f;  // x / ln 2, in [-125.6, 127]
  const int32_t n = static_cast<int32_t>(t + 128.5f) - 128;  // nearest, by truncating a positive number
  const float fn = static_cast<float>(n);
  float r = x - fn * 0.693359375f;  // ln 2's high part: exact in f32 times n
  r = r + fn * 2.12194440e-4f;      // and the rest
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const int32_t bits = (n + 127) << 23;  // n in [-126, 127]: a normal 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

inline float VecTanh(float x) { return 1.0f - 2.0f / (VecExp(2.0f * x) + 1.0f); }

// Whether the CPU runs AVX2 (asked once).
inline bool CpuHasAvx2() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  return has;
}

}  // namespace colod::kernels::cpu

// Defines `ret name params` running `body` compiled for AVX2 where the CPU
// has it, else for the baseline ISA, chosen at each call from CpuHasAvx2().
// Not target_clones: its ifunc resolvers run before a sanitizer's runtime
// starts, and ThreadSanitizer's build crashes in them. `args` passes the
// parameters on; `body` may hold commas only inside parentheses.
#define COLOD_AVX2_OR_GENERIC(ret, name, params, body, args) \
  __attribute__((target("avx2"))) ret name##Avx2 params body \
  ret name##Generic params body                              \
  ret name params { return ::colod::kernels::cpu::CpuHasAvx2() ? name##Avx2 args : name##Generic args; }

namespace colod::kernels::cpu {

}  // namespace colod::kernels::cpu

#endif  // COLOD_KERNELS_CPU_VEC_MATH_H_
