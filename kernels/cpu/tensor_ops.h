// The CPU twin of kernels/cuda/tensor_ops.h (both declared in
// kernels/tensor_ops.inc): host memory, strided copies with dtype conversion,
// seeded Philox fills, elementwise ops and sums, so worker/tensor dispatches
// to either with one table. The `device` argument is unused on the CPU.
//
// Thread-safe: every call works only on the buffers it is given.
#ifndef COLOD_KERNELS_CPU_TENSOR_OPS_H_
#define COLOD_KERNELS_CPU_TENSOR_OPS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/types.h"

namespace colod::kernels::cpu {

#include "kernels/tensor_ops.inc"  // NOLINT(build/include): the twins' shared declarations

}  // namespace colod::kernels::cpu

#endif  // COLOD_KERNELS_CPU_TENSOR_OPS_H_
