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

// OpenBLAS 0.3.21 (Debian 12's) runs its Haswell (AVX2) kernels on AMD Zen
// 4, which has AVX-512: sgemm at half the speed it could have. For a
// binary's main(), before any thread starts: when OPENBLAS_CORETYPE is
// unset, the CPU has AVX-512 F, CD, BW, DQ and VL, and OpenBLAS chose its
// Haswell or Zen kernels, sets OPENBLAS_CORETYPE=SKYLAKEX and re-executes
// the binary with the same arguments (OpenBLAS reads the variable only as it
// loads). Returns when there is nothing to do, or if the re-exec fails. Set
// OPENBLAS_CORETYPE to keep a choice of one's own.
void PreferAvx512Blas(char** argv);

#include "kernels/layer_ops.inc"  // NOLINT(build/include): the twins' shared declarations

}  // namespace colod::kernels::cpu

#endif  // COLOD_KERNELS_CPU_LAYER_OPS_H_
