// Introspection of colod's cuBLAS emulation, for tests.
#ifndef COLOD_KERNELS_CUDA_EMU_CUBLAS_EMU_H_
#define COLOD_KERNELS_CUDA_EMU_CUBLAS_EMU_H_

namespace colod_cublas_emu {

// Handles created and not yet destroyed in this process.
int LiveHandles();
// cuBLASLt handles created and not yet destroyed.
int LiveLtHandles();

}  // namespace colod_cublas_emu

#endif  // COLOD_KERNELS_CUDA_EMU_CUBLAS_EMU_H_
