// The vocabulary the CPU and CUDA kernel twins share (kernels/cpu,
// kernels/cuda): element types, elementwise ops and strided layouts. Plain
// data, no device types; nvcc and the host compiler both read it.
#ifndef COLOD_KERNELS_TYPES_H_
#define COLOD_KERNELS_TYPES_H_

#include <cstddef>
#include <cstdint>

namespace colod::kernels {

// Element types; the order matches colod::DType (worker/tensor/dtype.h).
enum class ElemType { kF32, kBF16, kF16, kI32, kI64 };
enum class BinaryOp { kAdd, kSub, kMul };
// The pointwise activations of the Activation kernels (kernels/activation.h
// has their math); GELU has kernels of its own, fused with a bias.
enum class ActivationKind { kSilu, kRelu };

// The most dims a strided layout has; worker/tensor rejects higher ranks.
constexpr int kMaxDims = 16;

// The largest head dim of the fused attention kernels (layer_ops.inc's
// FlashAttention); models with larger heads use the unfused path.
constexpr int64_t kMaxFusedHeadDim = 256;

// The most bytes one started read (StartRead, tensor_ops.inc) copies.
inline constexpr size_t kMaxStartedRead = size_t{64} << 10;

// What a fused attention (layer_ops.inc's FlashAttention) adds to score
// (i, j) of query head h after the scaling, each where set (device
// pointers; null: none): ALiBi's alibi[h] * (j - i) (hq f32 slopes, BLOOM)
// and a learned bias[h][i][j] ([hq, s, s] f32, T5's relative position bias).
// The backward writes dbias[b][h][i][j], the gradient of batch element b's
// biased score, where set ([b, hq, s, s] f32, zeroed by the caller: entries
// the causal mask hides stay 0). Passed to CUDA kernels by value.
struct AttentionBias {
  const float* alibi = nullptr;
  const float* bias = nullptr;
  float* dbias = nullptr;
};

// Where the rows of an attention operand [b, s, heads, d] are (layer_ops.inc's
// FlashAttention): row (b, i) of head h starts `token` (b s + i) + `head` h
// elements in, its d elements contiguous. {heads d, d} is the contiguous
// layout; a slice of q, k and v packed in one tensor is not: [b, s, 3,
// heads, d] (GPT-2's c_attn) gives {3 heads d, d}, [b, s, heads, 3, d]
// (BLOOM's) {3 heads d, 3 d}.
struct HeadRows {
  int64_t token = 0;
  int64_t head = 0;
};
inline HeadRows ContiguousHeadRows(int64_t heads, int64_t d) { return {heads * d, d}; }

// The attention's operands' layouts: q's, k's and v's (alike), and the
// backward's dq's, and dk's and dv's (alike); out, dout and the row
// statistics are contiguous. Passed to CUDA kernels by value.
struct AttentionLayout {
  HeadRows q;
  HeadRows kv;
  HeadRows dq;
  HeadRows dkv;
};
inline AttentionLayout ContiguousAttention(int64_t hq, int64_t hkv, int64_t d) {
  return {ContiguousHeadRows(hq, d), ContiguousHeadRows(hkv, d), ContiguousHeadRows(hq, d),
          ContiguousHeadRows(hkv, d)};
}
// Every stride at least 1 (the kernels refuse the rest).
inline bool StridesPositive(const AttentionLayout& l) {
  for (const HeadRows& r : {l.q, l.kv, l.dq, l.dkv}) {
    if (r.token < 1 || r.head < 1) return false;
  }
  return true;
}

// A strided view: element (i0, ..., ik) is at data + sum(i_d * strides[d])
// elements. Passed to CUDA kernels by value.
struct Layout {
  int ndim = 0;
  int64_t shape[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
};

// A contiguous buffer of n elements of `type` on the twin's device; the
// multi-tensor kernels take lists of them.
struct BufferRef {
  const void* data = nullptr;
  int64_t n = 0;
  ElemType type = ElemType::kF32;
};

// One parameter of the multi-tensor AdamW (layer_ops.inc): the f32 weights
// `master` are updated from `grad` (grad_type, scaled by the step's
// grad_scale) and the f32 moments m and v, all of n elements; where `param`
// is not null it is the held copy of the weights (param_type, bf16 or f16
// under mixed precision) and receives the updated master rounded to it.
struct AdamWTensor {
  float* master = nullptr;
  void* param = nullptr;
  const void* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  int64_t n = 0;
  ElemType param_type = ElemType::kF32;
  ElemType grad_type = ElemType::kF32;
};

// torch.optim.AdamW's hyperparameters for one step; bias_correction1/2 are
// 1 - beta^step. grad_scale multiplies every gradient as it is read (the
// global-norm clipping factor; 1 for none); where grad_scale_at is set, the
// f32 it points to (in the tensors' memory: on CUDA a device pointer, the
// factor GradNormClip computed there) does instead, so the host need not
// read the norm before it enqueues the update.
struct AdamWHyper {
  float lr = 0, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0;
  float bias_correction1 = 1, bias_correction2 = 1;
  float grad_scale = 1;
  const float* grad_scale_at = nullptr;
};

// The most tensors one launch of a multi-tensor kernel carries (they travel
// in the kernel's parameters, within CUDA's 4 KiB); longer lists take more
// launches.
constexpr int kMaxTensorsPerLaunch = 32;

// Rewrites two layouts of the same shape into the fewest dims that walk the
// same elements in the same order: dims of size 1 dropped, and a dim merged
// into the next where both layouts step over it contiguously (stride[d] ==
// stride[d + 1] * shape[d + 1] in each). A contiguous copy becomes one dim
// of stride 1; a transposed one keeps two.
inline void CoalesceLayouts(Layout* a, Layout* b) {
  Layout x, y;
  for (int d = 0; d < a->ndim; ++d) {
    if (a->shape[d] == 1) continue;
    const int k = x.ndim;
    if (k > 0 && x.strides[k - 1] == a->strides[d] * a->shape[d] && y.strides[k - 1] == b->strides[d] * b->shape[d]) {
      x.shape[k - 1] *= a->shape[d];
      y.shape[k - 1] *= a->shape[d];
      x.strides[k - 1] = a->strides[d];
      y.strides[k - 1] = b->strides[d];
      continue;
    }
    x.shape[k] = y.shape[k] = a->shape[d];
    x.strides[k] = a->strides[d];
    y.strides[k] = b->strides[d];
    ++x.ndim;
    y.ndim = x.ndim;
  }
  if (x.ndim == 0) {  // a single element
    x.ndim = y.ndim = 1;
    x.shape[0] = y.shape[0] = 1;
    x.strides[0] = y.strides[0] = 1;
  }
  *a = x;
  *b = y;
}

inline int ElemBytes(ElemType t) {
  return (t == ElemType::kBF16 || t == ElemType::kF16) ? 2 : (t == ElemType::kI64 ? 8 : 4);
}

}  // namespace colod::kernels

#endif  // COLOD_KERNELS_TYPES_H_
