// colod's CUDA emulation: CUDA's data type tags (see cuda_runtime.h).
#ifndef COLOD_KERNELS_CUDA_EMU_LIBRARY_TYPES_H_
#define COLOD_KERNELS_CUDA_EMU_LIBRARY_TYPES_H_

typedef enum cudaDataType_t {
  CUDA_R_32F = 0,
  CUDA_R_64F = 1,
  CUDA_R_16F = 2,
  CUDA_R_8I = 3,
  CUDA_R_32I = 10,
  CUDA_R_16BF = 14,
} cudaDataType_t;
typedef cudaDataType_t cudaDataType;

#endif  // COLOD_KERNELS_CUDA_EMU_LIBRARY_TYPES_H_
