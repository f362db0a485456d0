// The vocabulary the CPU and CUDA kernel twins share (kernels/cpu,
// kernels/cuda): element types, elementwise ops and strided layouts. Plain
// data, no device types; nvcc and the host compiler both read it.
#ifndef COLOD_KERNELS_TYPES_H_
#define COLOD_KERNELS_TYPES_H_

#include <cstdint>

namespace colod::kernels {

// Element types; the order matches colod::DType (worker/tensor/dtype.h).
enum class ElemType { kF32, kBF16, kF16, kI32, kI64 };
enum class BinaryOp { kAdd, kSub, kMul };

// The most dims a strided layout has; worker/tensor rejects higher ranks.
constexpr int kMaxDims = 16;

// The largest head dim of the fused attention kernels (layer_ops.inc's
// FlashAttention); models with larger heads use the unfused path.
constexpr int64_t kMaxFusedHeadDim = 256;

// A strided view: element (i0, ..., ik) is at data + sum(i_d * strides[d])
// elements. Passed to CUDA kernels by value.
struct Layout {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
};

inline int ElemBytes(ElemType t) {
  return (t == ElemType::kBF16 || t == ElemType::kF16) ? 2 : (t == ElemType::kI64 ? 8 : 4);
}

}  // namespace colod::kernels

#endif  // COLOD_KERNELS_TYPES_H_
