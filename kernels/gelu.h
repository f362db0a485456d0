// GELU and its derivative at one point, for both twins (host and device
// code): exact (x * Phi(x), with erf) or with the tanh approximation
// (Hendrycks & Gimpel, "Gaussian Error Linear Units", 2016), in f32.
#ifndef COLOD_KERNELS_GELU_H_
#define COLOD_KERNELS_GELU_H_

#include <cmath>

#include "kernels/host_device.h"

namespace colod::kernels {

constexpr float kGeluSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluC = 0.044715f;
constexpr float kGeluInvSqrt2 = 0.7071067811865476f;
constexpr float kGeluInvSqrt2Pi = 0.3989422804014327f;

COLOD_HOST_DEVICE float GeluAt(float v, bool tanh_approx) {
  return tanh_approx ? 0.5f * v * (1.0f + tanhf(kGeluSqrt2OverPi * (v + kGeluC * v * v * v)))
                     : 0.5f * v * (1.0f + erff(v * kGeluInvSqrt2));
}

// d GELU / dv.
COLOD_HOST_DEVICE float GeluSlopeAt(float v, bool tanh_approx) {
  if (tanh_approx) {
    const float t = tanhf(kGeluSqrt2OverPi * (v + kGeluC * v * v * v));
    const float du = kGeluSqrt2OverPi * (1.0f + 3.0f * kGeluC * v * v);
    return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
  }
  return 0.5f * (1.0f + erff(v * kGeluInvSqrt2)) + v * kGeluInvSqrt2Pi * expf(-0.5f * v * v);
}

}  // namespace colod::kernels

#endif  // COLOD_KERNELS_GELU_H_
