// The CUDA half of colod::Tensor: device memory, strided copies with dtype
// conversion, seeded Philox fills, elementwise ops and sums on device
// buffers. Plain C++ interface (no CUDA types), implemented in tensor_ops.cu;
// worker/tensor calls it for tensors on a CUDA device.
//
// Element types are given by ElemType, whose order matches colod::DType.
// Every call selects `device` first and is synchronous: it returns once the
// device work is done (a stream-ordered path comes with the layer kernels).
// Errors are FAILED_PRECONDITION for a missing device or driver and INTERNAL
// for a failed launch, each naming the CUDA call and error.
//
// Thread-safe (the CUDA runtime is; each call sets the calling thread's
// current device).
#ifndef COLOD_KERNELS_CUDA_TENSOR_OPS_H_
#define COLOD_KERNELS_CUDA_TENSOR_OPS_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace colod::kernels::cuda {

enum class ElemType { kF32, kBF16, kF16, kI32, kI64 };
enum class BinaryOp { kAdd, kSub, kMul };

// The most dims a non-contiguous copy handles.
constexpr int kMaxDims = 8;

// A strided view: element (i0, ..., ik) is at data + sum(i_d * strides[d])
// elements.
struct Layout {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
};

absl::StatusOr<void*> Malloc(int device, size_t nbytes);
void Free(int device, void* p);
absl::Status Memset0(int device, void* p, size_t nbytes);
// Copies between host and device or within a device (pointers say which).
absl::Status Memcpy(int device, void* dst, const void* src, size_t nbytes);

// dst[layout] <- convert(src[layout]): float types go through f32 (rounded to
// nearest even into bf16/f16), integer to integer through i64, float to
// integer truncates, as on the CPU.
absl::Status StridedCopy(int device, const void* src, const Layout& src_layout, ElemType src_type, void* dst,
                         const Layout& dst_layout, ElemType dst_type);

// p[i] <- PhiloxNormal(seed, i) or PhiloxUniform(seed, i) (kernels/philox.h).
absl::Status FillRandom(int device, void* p, ElemType type, int64_t n, uint64_t seed, bool normal);

// out[i] <- a[i] op b[i] on contiguous buffers (bf16/f16 computed in f32).
absl::Status Binary(int device, BinaryOp op, ElemType type, const void* a, const void* b, void* out, int64_t n);
// out[i] <- a[i] * s (float types).
absl::Status Scale(int device, ElemType type, const void* a, float s, void* out, int64_t n);
// The sum of a contiguous buffer in double, in a fixed order (deterministic).
absl::StatusOr<double> Sum(int device, ElemType type, const void* a, int64_t n);

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_TENSOR_OPS_H_
