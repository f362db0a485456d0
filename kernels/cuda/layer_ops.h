// CUDA twins of the CPU layer kernels (kernels/cpu/ops.cc), on contiguous
// device buffers; kernels/ops.h validates shapes and dtypes and dispatches
// here for tensors on a CUDA device. f32 buffers except GEMM, which takes
// f32, bf16 or f16 operands with f32 accumulation (cuBLAS; TF32 off). Each
// call runs on the calling thread's default stream of `device` and returns
// when the work is done. Errors name the CUDA or cuBLAS call.
//
// Thread-safe: cuBLAS handles are per thread and device.
#ifndef COLOD_KERNELS_CUDA_LAYER_OPS_H_
#define COLOD_KERNELS_CUDA_LAYER_OPS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "kernels/cuda/tensor_ops.h"

namespace colod::kernels::cuda {

// Row-major C [m, n] = op(A) op(B), A [m, k] (or [k, m] transposed),
// B [k, n] (or [n, k]); all three of `type` (C too).
absl::Status Gemm(int device, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                  const void* a, const void* b, void* c);

absl::Status BiasAdd(int device, const float* x, const float* bias, float* out, int64_t rows, int64_t n);
absl::Status BiasGrad(int device, const float* dy, float* db, int64_t rows, int64_t n);
absl::Status Gelu(int device, const float* x, float* y, int64_t n, bool tanh_approx);
absl::Status GeluBackward(int device, const float* dy, const float* x, float* dx, int64_t n, bool tanh_approx);
absl::Status Silu(int device, const float* x, float* y, int64_t n);
absl::Status SiluBackward(int device, const float* dy, const float* x, float* dx, int64_t n);

// Per row of [rows, n]: mean and rstd out; y = (x - mean) * rstd * g + b.
absl::Status LayerNorm(int device, const float* x, const float* g, const float* b, float eps, float* y, float* mean,
                       float* rstd, int64_t rows, int64_t n);
absl::Status LayerNormBackward(int device, const float* dy, const float* x, const float* g, const float* mean,
                               const float* rstd, float* dx, float* dg, float* db, int64_t rows, int64_t n);
absl::Status RmsNorm(int device, const float* x, const float* g, float eps, float* y, float* rstd, int64_t rows,
                     int64_t n);
absl::Status RmsNormBackward(int device, const float* dy, const float* x, const float* g, const float* rstd,
                             float* dx, float* dg, int64_t rows, int64_t n);

// Rows of k scores; with q > 0 causal: row r sees keys [0, r % q + k - q].
absl::Status Softmax(int device, const float* x, float* y, int64_t rows, int64_t k, int64_t causal_q);
absl::Status SoftmaxBackward(int device, const float* dy, const float* y, float* dx, int64_t rows, int64_t k);

absl::Status Dropout(int device, const float* x, float* y, int64_t n, float p, uint64_t seed, uint64_t offset);

// ids are i64; rows outside [row_offset, row_offset + rows) give zeros (the
// caller has rejected them when masking is off).
absl::Status Embedding(int device, const float* table, const int64_t* ids, float* out, int64_t count, int64_t rows,
                       int64_t h, int64_t row_offset);
// dtable[rows, h] <- for each row, the sum of dy's rows of the tokens with
// that id. The tokens come grouped by row on the host: segment s is table
// row seg_rows[s] and tokens[seg_starts[s] .. seg_starts[s+1]) (increasing);
// each sum runs in token order in double, so the result is the same bitwise
// on every run and equal to the CPU kernel's (no atomics).
absl::Status EmbeddingBackward(int device, const float* dy, const std::vector<int64_t>& seg_rows,
                               const std::vector<int64_t>& seg_starts, const std::vector<int64_t>& tokens,
                               float* dtable, int64_t rows, int64_t h);

// Per row of [n, v] logits with i64 labels (ignore_index rows: loss 0, no gradient).
absl::Status CrossEntropy(int device, const float* logits, const int64_t* labels, float* loss, int64_t n, int64_t v,
                          float smoothing, int64_t ignore_index);
absl::Status CrossEntropyBackward(int device, const float* dloss, const float* logits, const int64_t* labels,
                                  float* dlogits, int64_t n, int64_t v, float smoothing, int64_t ignore_index);

// x [b, s, heads, d]; sign +1 forward, -1 backward.
absl::Status Rope(int device, const float* x, float* y, int64_t b, int64_t s, int64_t heads, int64_t d, float theta,
                  int64_t position_offset, float sign);

absl::Status AdamW(int device, float* param, const float* grad, float* m, float* v, int64_t n, float lr, float beta1,
                   float beta2, float eps, float weight_decay, float bias_correction1, float bias_correction2);

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_LAYER_OPS_H_
