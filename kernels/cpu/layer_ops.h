// The CPU twins of the layer kernels (declared in kernels/layer_ops.inc;
// kernels/cuda/layer_ops.h has the CUDA ones): contiguous host buffers, f32
// except GEMM, which takes f32, bf16 or f16 operands (bf16/f16 are widened to
// f32, computed with OpenBLAS's sgemm and rounded back once). The `device` argument is the
// twin's device ordinal; on the CPU it is unused. Reductions accumulate in
// double in index order, so results do not depend on the thread count.
// worker/tensor/ops.h validates shapes and dtypes and dispatches here for
// host tensors.
//
// Thread-safe. OpenBLAS and the elementwise loops use up to BlasThreads()
// threads per call.
#ifndef COLOD_KERNELS_CPU_LAYER_OPS_H_
#define COLOD_KERNELS_CPU_LAYER_OPS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/types.h"

namespace colod::kernels::cpu {

// Threads OpenBLAS and the large elementwise loops may use per call (1 = the
// calling thread only).
void SetBlasThreads(int n);
int BlasThreads();

#include "kernels/layer_ops.inc"  // NOLINT(build/include): the twins' shared declarations

}  // namespace colod::kernels::cpu

#endif  // COLOD_KERNELS_CPU_LAYER_OPS_H_
