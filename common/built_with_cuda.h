#ifndef COLOD_COMMON_BUILT_WITH_CUDA_H_
#define COLOD_COMMON_BUILT_WITH_CUDA_H_

namespace colod {

// Whether this binary was built with CUDA (the toolkit, or the emulation
// under --config=cuda-emu). colod_build_info's `cuda` label; the kernels
// name it kernels::BuiltWithCuda (kernels/device.h).
bool BuiltWithCuda();

}  // namespace colod

#endif  // COLOD_COMMON_BUILT_WITH_CUDA_H_
