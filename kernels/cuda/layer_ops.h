// The CUDA twins of the layer kernels (declared in kernels/layer_ops.inc;
// kernels/cpu/layer_ops.h has the CPU ones), on contiguous device buffers;
// worker/tensor/ops.h validates shapes and dtypes and dispatches here for
// tensors on a CUDA device. f32 buffers except GEMM, which takes f32, bf16 or
// f16 operands with f32 accumulation (cuBLAS; TF32 off). Each call enqueues
// its work on `device`'s compute stream (kernels/cuda/stream.h) and returns
// without waiting for it. Errors name the CUDA or cuBLAS call.
//
// Thread-safe: one cuBLAS handle per device, shared by the threads.
#ifndef COLOD_KERNELS_CUDA_LAYER_OPS_H_
#define COLOD_KERNELS_CUDA_LAYER_OPS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/tensor_ops.h"
#include "kernels/types.h"

namespace colod::kernels::cuda {

#include "kernels/layer_ops.inc"  // NOLINT(build/include): the twins' shared declarations

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_LAYER_OPS_H_
