// COLOD_HOST_DEVICE marks the functions that host and device code share
// (kernels/gelu.h, activation.h, philox.h): __host__ __device__ inline under
// nvcc, plain inline for the host compiler.
#ifndef COLOD_KERNELS_HOST_DEVICE_H_
#define COLOD_KERNELS_HOST_DEVICE_H_

#ifdef __CUDACC__
#define COLOD_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define COLOD_HOST_DEVICE inline
#endif

#endif  // COLOD_KERNELS_HOST_DEVICE_H_
