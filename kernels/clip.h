// Global-norm gradient clipping's factor, which the host (train::ClipFactor)
// and the GradNormClip kernels (layer_ops.inc) compute alike, in double, so
// that a factor computed on the device has the host's bits.
#ifndef COLOD_KERNELS_CLIP_H_
#define COLOD_KERNELS_CLIP_H_

#include "kernels/host_device.h"

namespace colod::kernels {

// torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6) when
// norm > max_norm > 0, else 1 (a NaN norm gives NaN, as torch's does).
COLOD_HOST_DEVICE double ClipFactor(double norm, double max_norm) {
  if (max_norm <= 0 || norm <= max_norm) return 1.0;
  return max_norm / (norm + 1e-6);
}

}  // namespace colod::kernels

#endif  // COLOD_KERNELS_CLIP_H_
