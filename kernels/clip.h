// Global-norm gradient clipping's factor, which the host (train::ClipFactor)
// and the GradNormClip kernels (layer_ops.inc) compute alike, in double, so
// that a factor computed on the device has the host's bits.
#ifndef COLOD_KERNELS_CLIP_H_
#define COLOD_KERNELS_CLIP_H_

#include <math.h>
#include <stdint.h>

#include "kernels/host_device.h"

namespace colod::kernels {

// torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6) when
// norm > max_norm > 0, else 1 (a NaN norm gives NaN, as torch's does).
COLOD_HOST_DEVICE double ClipFactor(double norm, double max_norm) {
  if (max_norm <= 0 || norm <= max_norm) return 1.0;
  return max_norm / (norm + 1e-6);
}

// GradNormClip's work (layer_ops.inc), the same on either twin: out[0] = the
// square root of squares[0..n) added in order in double, divided by
// `loss_scale` (the squares are of gradients scaled by it: fp16's loss
// scaling), out[1] = its ClipFactor divided by `loss_scale` (what multiplies
// the scaled gradients into the clipped ones), each rounded to f32. A power
// of two as `loss_scale` divides exactly; 1 leaves both as they are.
COLOD_HOST_DEVICE void NormAndClipFactor(const float* squares, int64_t n, double max_norm, double loss_scale,
                                         float* out) {
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += squares[i];
  const double norm = sqrt(sum) / loss_scale;
  out[0] = static_cast<float>(norm);
  out[1] = static_cast<float>(ClipFactor(norm, max_norm) / loss_scale);
}

}  // namespace colod::kernels

#endif  // COLOD_KERNELS_CLIP_H_
