// The pointwise activations and their derivatives at one point, for both
// twins (host and device code), in f32:
//   SiLU  x * sigmoid(x) (LLaMA's MLP gate)
//   ReLU  max(x, 0), derivative 0 at 0 as torch's threshold_backward (OPT's MLP)
#ifndef COLOD_KERNELS_ACTIVATION_H_
#define COLOD_KERNELS_ACTIVATION_H_

#include <cmath>

#include "kernels/types.h"

#include "kernels/host_device.h"

namespace colod::kernels {

COLOD_HOST_DEVICE float ActivationAt(float v, ActivationKind kind) {
  if (kind == ActivationKind::kRelu) return v > 0.0f ? v : 0.0f;
  return v / (1.0f + expf(-v));
}

// d activation / dv.
COLOD_HOST_DEVICE float ActivationSlopeAt(float v, ActivationKind kind) {
  if (kind == ActivationKind::kRelu) return v > 0.0f ? 1.0f : 0.0f;
  const float s = 1.0f / (1.0f + expf(-v));
  return s * (1.0f + v * (1.0f - s));
}

}  // namespace colod::kernels

#endif  // COLOD_KERNELS_ACTIVATION_H_
