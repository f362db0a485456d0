// The dense math of colod's layers: one API over Tensors, computed on the
// tensors' device. These functions validate shapes, dtypes and devices and
// hand contiguous buffers to the device's raw-pointer kernels through
// device_kernels.h: on the CPU kernels/cpu/layer_ops.cc (GEMM through
// OpenBLAS, f32; bf16 and f16 inputs are widened and accumulated in f32; the
// other kernels are loops the compiler vectorizes), on a CUDA device
// kernels/cuda/layer_ops.cu (GEMM through cuBLAS, f32 with TF32 off, bf16 and
// f16 with f32 accumulation; the rest through colod's kernels). Every operand
// must be on the same device.
//
// Inputs may be strided views (they are made contiguous); outputs are new
// contiguous tensors of the input's dtype and device. Shape errors are
// INVALID_ARGUMENT naming both shapes.
//
// Thread-safe; on the CPU, OpenBLAS uses kernels::cpu::SetBlasThreads()
// threads per call.
#ifndef COLOD_WORKER_TENSOR_OPS_H_
#define COLOD_WORKER_TENSOR_OPS_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/types.h"
#include "worker/tensor/tensor.h"

namespace colod::ops {

// op(a) @ op(b), op = transpose when the flag is set. `b` is a matrix; `a`
// is a matrix or, without trans_a, a batch of rows [..., K] whose leading
// dims are kept: [B, S, K] @ [K, N] -> [B, S, N].
absl::StatusOr<Tensor> MatMul(const Tensor& a, const Tensor& b, bool trans_a = false, bool trans_b = false);
// MatMul(a, b) + bias over its last dim (bias [N]), the bias added in the
// GEMM's epilogue where a and b share a float dtype: to the f32 products,
// rounded to the dtype once, with no pass of its own over the result
// (kernels' GemmBias). Otherwise the product and then BiasAddInPlace.
absl::StatusOr<Tensor> MatMulBias(const Tensor& a, const Tensor& b, const Tensor& bias, bool trans_a = false,
                                  bool trans_b = false);
// MatMulBias(a, b) followed by the tanh-approximated GELU, an MLP's up
// projection: y = GELU_tanh(pre), pre = a @ op(b) + bias (GELU's input, for
// GeluBackward), both from the f32 products, each rounded once; the bias and
// GELU in the GEMM's epilogue (kernels' GemmBiasGelu). a rows [..., K] and b
// a matrix of one float dtype; INVALID_ARGUMENT otherwise.
struct BiasGeluProduct {
  Tensor y, pre;
};
absl::StatusOr<BiasGeluProduct> MatMulBiasGelu(const Tensor& a, const Tensor& b, const Tensor& bias,
                                               bool trans_b = false);
// An MLP's down projection's input gradient through the up projection's
// tanh GELU: (dy @ w) * GELU_tanh'(pre), for dy [..., N], w [N, K] and pre
// [..., K] (MatMulBiasGelu's), GELU's derivative applied to the f32
// products in the GEMM's epilogue and the result rounded once (kernels'
// GemmDGelu; on the CPU the bits of MatMul then GeluBackward at f32, one
// rounding fewer at bf16/f16; on CUDA cuBLASLt's epilogue, or where it is
// not taken the GEMM and GeluBackward, rounding twice). Operands of one
// float dtype; INVALID_ARGUMENT otherwise.
absl::StatusOr<Tensor> MatMulGeluBackward(const Tensor& dy, const Tensor& w, const Tensor& pre);
// Whether `device` puts biases in its GEMMs' epilogues (kernels'
// GemmEpilogues: the CPU always, CUDA unless COLOD_GEMM_EPILOGUES=0). Where
// it does not, a linear layer's bias + GELU is the GEMM and one fused
// kernel each way, as it was before the epilogues.
bool FusesGemmEpilogues(Device device);
// A linear layer's weight and bias gradients from its output gradient dy
// [..., M] and input x [..., N] (leading dims flattened to rows): dw [M, N] =
// dy^T @ x and db [M] = dy summed over its rows, in dy's dtype; one GEMM
// with the sums in its epilogue where dy and x share a float dtype (kernels'
// GemmBiasGrad), MatMul and BiasGrad otherwise.
struct LinearGrads {
  Tensor dw, db;
};
absl::StatusOr<LinearGrads> LinearWeightGrads(const Tensor& dy, const Tensor& x);
// c = op(a) @ op(b), or c += it where `accumulate`, in f32: a and b
// matrices of one float dtype, c a contiguous f32 [m, n] on their device.
// bf16/f16 products are kept in f32, not rounded to their dtype: a sum over
// chunks (the fused LM head's weight gradient) in one GEMM a chunk.
// INVALID_ARGUMENT for other shapes or dtypes.
absl::Status MatMulF32Into(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, Tensor& c,
                           bool accumulate);
// Whether the f32 MatMuls on `device` that follow may round their operands
// to TF32 (10-bit mantissa) on tensor cores, as PyTorch's allow_tf32 does;
// off until set, and a setting of the whole process for that device (a rank
// owns its device). The CPU computes f32 in f32 either way.
absl::Status SetAllowTf32(Device device, bool allow);

// x + bias over the last dim; and the bias gradient, dy summed over all
// leading dims.
absl::StatusOr<Tensor> BiasAdd(const Tensor& x, const Tensor& bias);
// x += bias in x's own storage, for an op's fresh output that nothing else
// reads (no new buffer, one pass over x). x must be contiguous and of a float
// dtype (the bias is converted to it); INVALID_ARGUMENT otherwise.
absl::Status BiasAddInPlace(Tensor& x, const Tensor& bias);
absl::StatusOr<Tensor> BiasGrad(const Tensor& dy);

// GELU, exact (x * Phi(x), with erf) or with the tanh approximation
// (HF's gelu_new / gelu_pytorch_tanh), and its backward: dx = dy * gelu'(x).
enum class GeluApprox { kNone, kTanh };
absl::StatusOr<Tensor> Gelu(const Tensor& x, GeluApprox approx);
absl::StatusOr<Tensor> GeluBackward(const Tensor& dy, const Tensor& x, GeluApprox approx);
// GELU(x + bias), the bias over the last dim, in one kernel (x + bias is
// not rounded to x's dtype in between); and its backward from the same x and
// bias, also one kernel: dx = dy * gelu'(x + bias) and db = dx summed over
// all leading dims.
absl::StatusOr<Tensor> BiasGelu(const Tensor& x, const Tensor& bias, GeluApprox approx);
struct BiasGeluGrads {
  Tensor dx, db;
};
absl::StatusOr<BiasGeluGrads> BiasGeluBackward(const Tensor& dy, const Tensor& x, const Tensor& bias,
                                               GeluApprox approx);
// A pointwise activation (kernels/activation.h): SiLU x * sigmoid(x),
// backward dy * s * (1 + x * (1 - s)); ReLU max(x, 0), backward dy where x > 0.
using ActivationKind = kernels::ActivationKind;
absl::StatusOr<Tensor> Activation(const Tensor& x, ActivationKind kind);
absl::StatusOr<Tensor> ActivationBackward(const Tensor& dy, const Tensor& x, ActivationKind kind);

// LayerNorm over the last dim: y = (x - mean) * rstd * gamma + beta, with
// rstd = 1 / sqrt(var + eps) (biased variance). mean and rstd ([rows], f32)
// are kept for the backward.
// With a residual (the norm of a residual stream, as a transformer block's
// x + attn(x) before its second norm), sum = x + residual is computed in the
// same kernel, returned, and normalized: the result of Add then LayerNorm,
// bit for bit, one kernel instead of two. The backward is LayerNormBackward
// at x = sum.
struct LayerNormResult {
  Tensor y, mean, rstd;
  Tensor sum;  // x + residual, where a residual was given
};
absl::StatusOr<LayerNormResult> LayerNorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                                          const Tensor* residual = nullptr);
struct LayerNormGrads {
  Tensor dx, dgamma, dbeta;
};
// With `acc` (the gradient x already has, in the kernels' dtype for x:
// FoldsInto's test), dx = acc + the norm's dx in the backward's kernel, with
// the bits of Add(*acc, dx): the residual stream's add folded in.
absl::StatusOr<LayerNormGrads> LayerNormBackward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                                 const Tensor& mean, const Tensor& rstd,
                                                 const Tensor* acc = nullptr);

// RMSNorm over the last dim (LLaMA): y = x * rstd * gamma, rstd =
// 1 / sqrt(mean(x^2) + eps); rstd ([rows], f32) is kept for the backward.
// The residual as for LayerNorm.
struct RmsNormResult {
  Tensor y, rstd;
  Tensor sum;  // x + residual, where a residual was given
};
absl::StatusOr<RmsNormResult> RmsNorm(const Tensor& x, const Tensor& gamma, float eps,
                                      const Tensor* residual = nullptr);
struct RmsNormGrads {
  Tensor dx, dgamma;
};
absl::StatusOr<RmsNormGrads> RmsNormBackward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                             const Tensor& rstd, const Tensor* acc = nullptr);
// Whether a norm backward of x can fold `acc` into its dx: acc is
// contiguous, of x's shape and device, in the dtype the backward computes
// x's gradient in (where not, the caller adds).
bool FoldsInto(const Tensor& x, const Tensor& acc);

// The passes of a norm whose hidden dim is split over ranks (worker/nn's
// ShardedLayerNorm): x (and dy) hold this rank's piece of n = the last dim
// of rows of h elements; the caller all-reduces the row statistics between
// the passes, on the device. `mean` is absent for RMSNorm. Statistics are
// f32 [rows] on x's device; y and dx come in x's dtype.
// Per row, the piece's sum of x - center (of its square with `square`).
absl::StatusOr<Tensor> NormRowSums(const Tensor& x, const std::optional<Tensor>& center, bool square);
struct NormApplied {
  Tensor y, rstd;
};
// rstd = 1 / sqrt(sq_sums / h + eps) (sq_sums over whole rows); y = (x -
// mean) * rstd * gamma + beta.
absl::StatusOr<NormApplied> NormApply(const Tensor& x, const Tensor& gamma, const std::optional<Tensor>& beta,
                                      const std::optional<Tensor>& mean, const Tensor& sq_sums, int64_t h,
                                      float eps);
// [2, rows]: the piece's sums of dy * gamma and of dy * gamma * xhat.
absl::StatusOr<Tensor> NormBackwardSums(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                        const std::optional<Tensor>& mean, const Tensor& rstd);
// dx from the whole rows' sums (NormBackwardSums all-reduced).
absl::StatusOr<Tensor> NormBackwardApply(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                         const std::optional<Tensor>& mean, const Tensor& rstd, const Tensor& sums,
                                         int64_t h);
// The piece's gamma (and, with `beta`, beta) gradients over its rows, f32.
struct NormParamGrads {
  Tensor dgamma;
  std::optional<Tensor> dbeta;
};
absl::StatusOr<NormParamGrads> NormParamGrad(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& mean,
                                             const Tensor& rstd, bool beta);

// Softmax over the last dim. With `causal`, x is [..., Q, K] attention scores
// and key j is masked for query i when j > i + (K - Q) (a query sees the keys
// up to its own position, counting a cached prefix of K - Q keys).
absl::StatusOr<Tensor> Softmax(const Tensor& x, bool causal);
// dx = y * (dy - sum(dy * y)) over the last dim, from the softmax output y.
absl::StatusOr<Tensor> SoftmaxBackward(const Tensor& dy, const Tensor& y);

// Inverted dropout with a counter-based mask: element i is kept when
// PhiloxUniform(seed, offset + i) >= p and scaled by 1 / (1 - p). The same
// (seed, offset) gives the same mask on every device; the backward
// regenerates it, so no mask is stored. p in [0, 1).
absl::StatusOr<Tensor> Dropout(const Tensor& x, float p, uint64_t seed, uint64_t offset);
absl::StatusOr<Tensor> DropoutBackward(const Tensor& dy, float p, uint64_t seed, uint64_t offset);

// Rows of `table` [rows, H] for integer `ids` [...] -> [..., H]. The table
// holds vocabulary rows [row_offset, row_offset + rows); with
// `mask_out_of_range` an id outside them gives a zero row (a vocab-parallel
// shard), otherwise it is INVALID_ARGUMENT naming the id. The ids may be on
// the table's device or on the host: host ids are checked there and copied
// up without a device synchronization (ids on a device are read back to be
// checked).
absl::StatusOr<Tensor> Embedding(const Tensor& table, const Tensor& ids, int64_t row_offset = 0,
                                 bool mask_out_of_range = false);
// The table gradient: dy rows scatter-added into [rows, H] (masked ids
// skipped). The ids are grouped on the host: pass them on the host (as the
// forward's caller had them) and nothing is read back from the device.
absl::StatusOr<Tensor> EmbeddingBackward(const Tensor& dy, const Tensor& ids, int64_t rows, int64_t row_offset = 0);

// Cross-entropy per row of logits [N, V] against integer labels [N], with
// label smoothing s: the target is (1 - s) * onehot + s / V. A label equal to
// `ignore_index` contributes loss 0 and no gradient; any other label outside
// [0, V) is INVALID_ARGUMENT. Returns the per-row loss [N] (f32). Labels may
// be on logits' device or on the host: host labels are checked there and
// copied up in stream order, so the loss reads nothing back from a device.
absl::StatusOr<Tensor> CrossEntropy(const Tensor& logits, const Tensor& labels, float label_smoothing = 0,
                                    int64_t ignore_index = -100);
// dlogits = dloss[n] * (softmax(logits) - target).
absl::StatusOr<Tensor> CrossEntropyBackward(const Tensor& dloss, const Tensor& logits, const Tensor& labels,
                                            float label_smoothing = 0, int64_t ignore_index = -100);

// Vocab-parallel cross-entropy on one rank's shard (nn::VocabParallelCrossEntropy
// holds the group): `z` [rows, width] logits (any float dtype, computed in
// f32) whose first `real` columns are the vocabulary ids [start, start +
// real) of a `vocab`-word vocabulary, the rest padding; `labels` [rows] i64
// on z's device, already checked (each in [0, vocab) or ignore_index).
// `all_gather(in, out)` gathers an f32 tensor over the `shards` shards, on
// the device (out: `shards` times in's elements, in shard order): one
// collective, of each shard's (max, sum of exp, label logit, logit sum) per
// row. Nothing is read on the host.
struct VocabShardForward {
  Tensor loss;  // [rows] f32, 0 where ignored
  Tensor lse;   // [rows] f32: the log-sum-exp over the whole vocabulary
  Tensor z;     // [rows, width]: the logits the backward needs, in their float type
};
absl::StatusOr<VocabShardForward> VocabShardCrossEntropy(
    const Tensor& z, const Tensor& labels, int64_t real, int64_t start, int64_t vocab, float label_smoothing,
    int64_t ignore_index, int64_t shards, const std::function<absl::Status(const Tensor& in, Tensor& out)>& all_gather);
// dz [rows, width] in `dtype`: dloss[r] * (softmax - target) on the real
// columns of labelled rows, 0 elsewhere.
absl::StatusOr<Tensor> VocabShardCrossEntropyBackward(const Tensor& dloss, const VocabShardForward& forward,
                                                      const Tensor& labels, int64_t real, int64_t start,
                                                      int64_t vocab, float label_smoothing, int64_t ignore_index,
                                                      DType dtype);

// Rotary position embedding, HF LLaMA's rotate_half convention, on x
// [B, S, heads, D] (D even): for i < D/2 with angle = (position_offset + s) *
// theta^(-2i/D), (x_i, x_{i+D/2}) turns by the angle. The backward turns dy
// by minus the angle.
absl::StatusOr<Tensor> Rope(const Tensor& x, float theta, int64_t position_offset = 0);
absl::StatusOr<Tensor> RopeBackward(const Tensor& dy, float theta, int64_t position_offset = 0);

// Scaled-dot-product attention operands: q [B, Sq, Hq, D], k and v
// [B, Sk, Hkv, D] with Hq a multiple of Hkv (grouped-query attention: query
// head h reads kv head h / (Hq / Hkv)), and Sq = Sk unless `same_length` is
// false (cross-attention). INVALID_ARGUMENT otherwise.
absl::Status CheckAttentionShapes(const Tensor& q, const Tensor& k, const Tensor& v, bool same_length = true);

// Fused attention (the kernels' FlashAttention: one kernel, online softmax,
// no [S, S] scores in memory) of float q, k, v (any float dtype, computed in
// f32): out = softmax(q k^T * scale, causal) v. D at most
// kernels::kMaxFusedHeadDim (INVALID_ARGUMENT beyond).
// The kernels compute in f32 on operands of q's dtype (f32, bf16 or f16):
// out and the gradients come in that dtype.
struct AttentionForward {
  Tensor out;  // [B, S, Hq, D] in the kernels' dtype
  Tensor lse;  // [B, Hq, S] f32: each query row's log-sum-exp, for the backward
};
// What the scores gain after the scaling, each where set, on q's device:
// ALiBi's f32 [Hq] head slopes, score (i, j) of query head h gaining
// alibi[h] * (j - i) (BLOOM's softmax; nn::AlibiAttention), and a learned
// bias, f32 [Hq, S, S], gaining bias[h, i, j] (T5's relative position bias;
// nn::BiasedAttention). INVALID_ARGUMENT for other shapes, dtypes or devices.
struct AttentionExtras {
  std::optional<Tensor> alibi;
  std::optional<Tensor> bias;
};
absl::StatusOr<AttentionForward> FusedAttention(const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                                                bool causal, const AttentionExtras& extras = {});
// Whether the attention kernels read (or write) t [B, S, heads, D] where it
// is: D contiguous, the batch S tokens apart, and every row 16-byte aligned
// (kernels::HeadRows; the tensor-core kernels stage rows 16 bytes at a time).
// A slice of GPT-2's or BLOOM's packed q, k and v is; a transposed view is not.
bool AttentionReadsInPlace(const Tensor& t);
// q, k and v as FusedAttention and its backward give them to the kernels:
// each as it is where the kernels read it in place (AttentionReadsInPlace;
// k and v only together, laid out alike, in q's dtype), else a contiguous
// copy in q's dtype. What an attention node keeps for its backward, which
// then copies nothing again. INVALID_ARGUMENT as FusedAttention.
struct AttentionQkv {
  Tensor q, k, v;
};
absl::StatusOr<AttentionQkv> AttentionInputs(const Tensor& q, const Tensor& k, const Tensor& v);
// The gradients (shaped like q, k and v, in the forward's dtype) from dout [B, S, Hq, D] and
// the forward of the same q, k, v and extras, and the learned bias's (f32
// [Hq, S, S]: the scores' gradients summed over the batch) where it has one.
// Bitwise repeatable on the CPU, and on CUDA but for dq of the tensor-core
// path, whose one-pass backward adds it up with atomics unless the
// environment sets COLOD_DETERMINISTIC=1 (kernels' FlashAttentionBackward).
// q, k and v may be views (the slices of one packed projection): the
// kernels read them in place where AttentionReadsInPlace, else from a
// contiguous copy (k and v in place only where both are, laid out alike).
// Where `places` are set (all three: tensors or views of q's, k's and v's
// shapes in the forward's dtype on q's device; INVALID_ARGUMENT otherwise),
// dq, dk and dv are written into them and returned as them: by the kernels
// themselves where the places are read in place so, their rows do not
// overlap, dk's and dv's are laid out alike, and none shares storage with
// q, k, v, out or dout (the slices of one packed gradient buffer: no
// copies); else copied in after the kernels. The three places must not
// share elements with each other.
struct AttentionGrads {
  Tensor dq, dk, dv;
  std::optional<Tensor> dbias;
};
struct AttentionGradPlaces {
  std::optional<Tensor> dq, dk, dv;
};
absl::StatusOr<AttentionGrads> FusedAttentionBackward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                      const Tensor& v, const AttentionForward& forward, float scale,
                                                      bool causal, const AttentionExtras& extras = {},
                                                      const AttentionGradPlaces& places = {});

// torch.optim.AdamW's step: decoupled weight decay, bias correction with
// `step` (1-based). grad_scale multiplies every gradient as it is read (the
// global-norm clipping factor), leaving the gradients as they are.
struct AdamWOptions {
  float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 0.01f;
  float grad_scale = 1.0f;
  // Where set, a one-element f32 tensor on the parameters' device whose
  // value multiplies the gradients instead of grad_scale: GradNormClip's
  // factor, read by the update where it is, with no host read before it.
  std::optional<Tensor> grad_scale_at;
};
// One parameter of the step: the f32 weights `master` the update runs on,
// its gradient (f32, bf16 or f16), the f32 moments m and v, all contiguous
// and of master's shape; under mixed precision `held` is the bf16/f16 copy
// the model computes with, which receives the updated weights rounded to
// its dtype (none where master is the held weights).
struct AdamWParam {
  Tensor master;
  std::optional<Tensor> held;
  Tensor grad, m, v;
};
// One fused step over every parameter, on their device (all on one): on
// CUDA a launch per 32 parameters, the casts of mixed precision included.
absl::Status AdamW(const std::vector<AdamWParam>& params, int64_t step, const AdamWOptions& o);

// The global gradient norm and its clipping factor from `squares` (f32, the
// norm's sums of squares, added in order in double), on their device: a
// new [2] f32 tensor there, the norm and kernels::ClipFactor(norm, max_norm)
// (kernels/clip.h), the bits the host computes from the same squares. The
// factor's view is AdamWOptions::grad_scale_at. `loss_scale` (>= 1, a power
// of two under the trainer): the squares are of gradients scaled by it
// (fp16's loss scaling); the norm is divided by it, and so is the factor,
// which then unscales the gradients as the update reads them.
absl::StatusOr<Tensor> GradNormClip(const Tensor& squares, double max_norm, double loss_scale = 1.0);

}  // namespace colod::ops

#endif  // COLOD_WORKER_TENSOR_OPS_H_
