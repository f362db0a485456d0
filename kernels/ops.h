// The dense math of colod's layers: one host API over Tensors, computed on
// the tensor's device. On the CPU, GEMM goes through OpenBLAS (f32; bf16 and
// f16 inputs are converted and accumulated in f32) and the other kernels are
// plain loops the compiler vectorizes. CUDA versions (cuBLAS and kernels/
// cuda) follow; until then a CUDA tensor gets UNIMPLEMENTED naming the op.
//
// Inputs may be strided views (they are made contiguous); outputs are new
// contiguous tensors of the input's dtype and device. Shape errors are
// INVALID_ARGUMENT naming both shapes.
//
// Thread-safe; OpenBLAS uses SetBlasThreads() threads per call.
#ifndef COLOD_KERNELS_OPS_H_
#define COLOD_KERNELS_OPS_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "worker/tensor/tensor.h"

namespace colod::kernels {

// Threads OpenBLAS may use per GEMM (1 = the calling thread only).
void SetBlasThreads(int n);
int BlasThreads();

// op(a) @ op(b), op = transpose when the flag is set. `b` is a matrix; `a`
// is a matrix or, without trans_a, a batch of rows [..., K] whose leading
// dims are kept: [B, S, K] @ [K, N] -> [B, S, N].
absl::StatusOr<Tensor> MatMul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);

// x + bias over the last dim; and the bias gradient, dy summed over all
// leading dims.
absl::StatusOr<Tensor> BiasAdd(const Tensor& x, const Tensor& bias);
absl::StatusOr<Tensor> BiasGrad(const Tensor& dy);

// GELU, exact (x * Phi(x), with erf) or with the tanh approximation
// (HF's gelu_new / gelu_pytorch_tanh), and its backward: dx = dy * gelu'(x).
enum class GeluApprox { kNone, kTanh };
absl::StatusOr<Tensor> Gelu(const Tensor& x, GeluApprox approx);
absl::StatusOr<Tensor> GeluBackward(const Tensor& dy, const Tensor& x, GeluApprox approx);

// LayerNorm over the last dim: y = (x - mean) * rstd * gamma + beta, with
// rstd = 1 / sqrt(var + eps) (biased variance). mean and rstd ([rows], f32)
// are kept for the backward.
struct LayerNormResult {
  Tensor y, mean, rstd;
};
absl::StatusOr<LayerNormResult> LayerNorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps);
struct LayerNormGrads {
  Tensor dx, dgamma, dbeta;
};
absl::StatusOr<LayerNormGrads> LayerNormBackward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                                 const Tensor& mean, const Tensor& rstd);

}  // namespace colod::kernels

#endif  // COLOD_KERNELS_OPS_H_
