// Differentiable layer math on Variables: each op computes with worker/tensor/ops.h
// and records its backward on the autograd tape (worker/tensor/autograd.h).
// Communication ops that are not DistSpec conversions live here too.
//
// Thread-safety: as autograd (one tape per thread).
#ifndef COLOD_WORKER_NN_FUNCTIONAL_H_
#define COLOD_WORKER_NN_FUNCTIONAL_H_

#include <optional>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "worker/comm/communicator.h"
#include "worker/tensor/autograd.h"
#include "worker/tensor/ops.h"

namespace colod::nn {

// `t` as a contiguous matrix [rows, last dim] (leading dims flattened; a
// view when `t` is contiguous).
absl::StatusOr<Tensor> Rows(const Tensor& t);

// What a linear layer applies to its output after the bias (a fused
// epilogue): nothing, or GELU (exact or tanh-approximated).
enum class Epilogue { kNone, kGelu, kGeluTanh };
// The epilogue for an MLP activation (kGelu or kGeluTanh).
Epilogue GeluEpilogue(ops::GeluApprox approx);

// y = x @ w^T (+ b), torch.nn.Linear's layout: x [..., in], w [out, in],
// b [out]. Backward: dx = dy @ w, dw = dy^T @ x over all rows, db = sum dy.
// With an epilogue, y = epilogue(x @ w^T + b), the bias and the epilogue one
// kernel each way (BiasEpilogue).
absl::StatusOr<Variable> Linear(const Variable& x, const Variable& w, const std::optional<Variable>& b,
                                Epilogue epilogue = Epilogue::kNone);
// epilogue(x + b), b over the last dim (absent: epilogue(x)). GELU with a
// bias is one node of one kernel forward (ops::BiasGelu) and one backward
// that also gives the bias gradient; kNone is BiasAdd.
absl::StatusOr<Variable> BiasEpilogue(const Variable& x, const std::optional<Variable>& b, Epilogue epilogue);
// The same elements in a new shape (a view when x is contiguous).
absl::StatusOr<Variable> Reshape(const Variable& x, const Shape& shape);
// x[.., start:start+length, ..] along `dim` (a copy); the backward puts
// the gradient back in place, zeros elsewhere.
absl::StatusOr<Variable> Narrow(const Variable& x, int64_t dim, int64_t start, int64_t length);
// x[.., index, ..] along `dim`, the dimension removed: a strided view of x
// (no copy; x's storage stays alive), for consumers that take strided
// operands (the attentions: q, k and v out of one fused projection). The
// backward puts the gradient back in place, zeros elsewhere.
absl::StatusOr<Variable> Select(const Variable& x, int64_t dim, int64_t index);
// Concatenation along `dim`; the backward narrows the gradient.
absl::StatusOr<Variable> Cat(const std::vector<Variable>& parts, int64_t dim);
// x + b over the last dim.
absl::StatusOr<Variable> BiasAdd(const Variable& x, const Variable& b);
absl::StatusOr<Variable> Gelu(const Variable& x, ops::GeluApprox approx);
// A pointwise activation (ops::Activation) on the tape; Silu and Relu name it.
absl::StatusOr<Variable> Activation(const Variable& x, ops::ActivationKind kind);
absl::StatusOr<Variable> Silu(const Variable& x);
absl::StatusOr<Variable> Relu(const Variable& x);
// Rotary position embedding (ops::Rope) of x [B, S, heads, D].
absl::StatusOr<Variable> Rope(const Variable& x, float theta, int64_t position_offset = 0);
// LayerNorm over the last dim with affine gamma and beta.
absl::StatusOr<Variable> LayerNorm(const Variable& x, const Variable& gamma, const Variable& beta, float eps);

absl::StatusOr<Variable> RmsNorm(const Variable& x, const Variable& gamma, float eps);
// The norm of a residual stream: sum = x + residual and y = its LayerNorm
// (beta given) or RMSNorm (beta absent), the add and the norm one kernel
// (ops::LayerNorm/RmsNorm with a residual). The tape is Add then the norm, so
// the gradients are the unfused ones; x and residual of different dtypes are
// added and normalized apart.
struct ResidualNorm {
  Variable sum, y;
};
absl::StatusOr<ResidualNorm> AddNorm(const Variable& x, const Variable& residual, const Variable& gamma,
                                     const std::optional<Variable>& beta, float eps);
// Inverted dropout with the Philox mask of (seed, offset); see worker/tensor/ops.h.
absl::StatusOr<Variable> Dropout(const Variable& x, float p, uint64_t seed, uint64_t offset);
// Rows of `table` for `ids`, as ops::Embedding (the table's gradient is a
// scatter-add; ids get none).
absl::StatusOr<Variable> Embedding(const Variable& table, const Tensor& ids, int64_t row_offset = 0,
                                   bool mask_out_of_range = false);

// Per-row cross-entropy of logits [N, V] against integer labels [N]
// (ops::CrossEntropy); the loss [N] is on the tape.
absl::StatusOr<Variable> CrossEntropy(const Variable& logits, const Tensor& labels, float label_smoothing = 0,
                                      int64_t ignore_index = -100);

// Causal scaled-dot-product attention, per batch and head: q [B, S, Hq, D],
// k and v [B, S, Hkv, D] with Hq a multiple of Hkv (grouped-query attention:
// query head h reads kv head h / (Hq / Hkv)); out [B, S, Hq, D] =
// softmax(q k^T * scale, causal) v. q, k and v may be strided views (nn::Select
// of a fused projection); out is contiguous. INVALID_ARGUMENT for
// mismatched shapes.
absl::StatusOr<Variable> CausalAttention(const Variable& q, const Variable& k, const Variable& v, float scale);
// The same with or without the causal mask (BERT's attention is bidirectional).
// kAuto runs the fused kernel (ops::FusedAttention: one launch forward, two
// backward, no [S, S] probabilities kept) on CUDA devices for head dims up
// to kernels::kMaxFusedHeadDim, and per (batch, head) GEMMs through
// OpenBLAS on the CPU, where they are faster; tests pick either.
enum class AttentionImpl { kAuto, kFused, kPerHead };
// While alive, the per-head attention on this thread keeps no [S, S]
// probabilities for its backward, which computes them again from the
// queries and keys it keeps (selective activation recomputation, Megatron's
// --recompute-granularity selective; the gradients are the same, bitwise).
// The fused attention never keeps them.
class RecomputeScoresScope {
 public:
  RecomputeScoresScope();
  ~RecomputeScoresScope();
  RecomputeScoresScope(const RecomputeScoresScope&) = delete;
  RecomputeScoresScope& operator=(const RecomputeScoresScope&) = delete;

 private:
  bool previous_;
};
absl::StatusOr<Variable> Attention(const Variable& q, const Variable& k, const Variable& v, float scale, bool causal,
                                   AttentionImpl impl = AttentionImpl::kAuto);

// The non-overlapping patch x patch squares of images [B, C, H, W] as rows
// [B, (H / patch) * (W / patch), C * patch * patch]: patches in row-major
// order over the image (the order of a Conv2d's output flattened, ViT's
// sequence), each flattened as (channel, row, column), the layout of a
// Conv2d weight [out, C, patch, patch]; so a Conv2d with kernel = stride =
// patch is a Linear on these rows. INVALID_ARGUMENT unless H and W divide by
// patch. A copy on x's device (no gradient: images are inputs).
absl::StatusOr<Tensor> ImagePatches(const Tensor& images, int64_t patch);

// q, k and v as slices 0, 1 and 2 along `dim` of one fused projection's
// output: GPT-2's c_attn as [B, S, 3, H, D] at dim 2, BLOOM's
// query_key_value as [B, S, H, 3, D] at dim 3 (a negative dim counts from
// the end). The attention functions that
// take one give the projection's output one gradient on the fused kernel,
// written slice by slice: three nn::Selects each give a zeroed gradient of
// the whole output, and Backward adds the three (GPT-2 124M: three [8192,
// 2304] buffers zeroed and two added a layer). With the per-head GEMMs they
// are the three Selects. INVALID_ARGUMENT unless the dim has 3 entries and
// the slices are attention operands.
struct PackedQkv {
  Variable qkv;
  int64_t dim = 0;
};
absl::StatusOr<Variable> CausalAttention(const PackedQkv& packed, float scale,
                                         AttentionImpl impl = AttentionImpl::kAuto);

// T5's relative position buckets (transformers' _relative_position_bucket):
// the bucket of key j for query i, relative position r = j - i. Encoder
// attention is bidirectional: half the buckets for r > 0, r's magnitude in
// the other half. Decoder self-attention is causal: only r <= 0 counts
// (r > 0 is bucket 0; the mask hides it). Of the n buckets (of a half),
// distances below n/2 get one each; the rest are logarithmic up to
// max_distance, the last bucket holding everything further. Computed in f32
// as torch does (log(d / (n/2)) / log(max_distance / (n/2)) * (n/2),
// truncated), so the boundaries are the trained model's. [q_len, k_len]
// row-major.
std::vector<int64_t> RelativePositionBuckets(int64_t q_len, int64_t k_len, bool bidirectional, int64_t num_buckets,
                                             int64_t max_distance);

// ALiBi (Press et al., "Train Short, Test Long", 2022; BLOOM): the head
// slopes of a model with `heads` heads, as transformers' build_alibi_tensor
// makes them: for the largest power of two n <= heads, 2^(-8k/n) for k = 1..n,
// then (heads not a power of two) 2^(-4k/n) for the odd k = 1, 3, .. up to
// the remaining heads.
std::vector<float> AlibiSlopes(int64_t heads);
// Causal attention whose score (i, j) of query head h gains slopes[h] *
// (j - i) (keys further back weigh less; the same softmax as BLOOM's
// slopes[h] * j, as each row's shift cancels). `slopes` holds one slope per
// query head of q (a tensor-parallel rank passes its heads' slopes);
// INVALID_ARGUMENT for another count. `impl` as Attention's: kAuto is the
// fused kernel on a CUDA device, per-head GEMMs on the CPU.
absl::StatusOr<Variable> AlibiAttention(const Variable& q, const Variable& k, const Variable& v, float scale,
                                        const std::vector<float>& slopes,
                                        AttentionImpl impl = AttentionImpl::kAuto);
absl::StatusOr<Variable> AlibiAttention(const PackedQkv& packed, float scale, const std::vector<float>& slopes,
                                        AttentionImpl impl = AttentionImpl::kAuto);
// Attention whose scores gain a learned bias [Hq, Sq, Sk] (T5's relative
// position bias) after the scaling: softmax(q k^T * scale + bias[h]) v,
// or none (T5's cross-attention). q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D]:
// Sq and Sk may differ (cross-attention) unless causal. The bias gets its
// gradient (the scores', summed over the batch). `impl` as Attention's:
// kAuto is the fused kernel on a CUDA device where Sq = Sk, the per-head
// GEMMs otherwise (kFused with Sq != Sk is INVALID_ARGUMENT).
absl::StatusOr<Variable> BiasedAttention(const Variable& q, const Variable& k, const Variable& v, float scale,
                                         bool causal, const std::optional<Variable>& bias,
                                         AttentionImpl impl = AttentionImpl::kAuto);

// LayerNorm over a hidden dim split across `hidden` (x [.., h/n] and gamma,
// beta [h/n] on each of its n ranks): the row statistics are all-reduced
// over `hidden` (two passes: the mean, then the centred squares), and the
// gamma/beta gradients over each of `replicas`, the groups over which gamma
// and beta are replicated while the rows differ. Used by the 2D, 2.5D and 3D
// layer norms.
absl::StatusOr<Variable> ShardedLayerNorm(const Variable& x, const Variable& gamma, const Variable& beta, float eps,
                                          Communicator* hidden, const std::vector<Communicator*>& replicas,
                                          absl::Duration timeout);

// The same for RMSNorm (no mean, no beta): one all-reduce of the row sums of
// squares forward.
absl::StatusOr<Variable> ShardedRmsNorm(const Variable& x, const Variable& gamma, float eps, Communicator* hidden,
                                        const std::vector<Communicator*>& replicas, absl::Duration timeout);

// Sequence parallelism's two region boundaries (Megatron): all-gather along
// `dim` forward and reduce-scatter the gradient along it backward; and the
// reverse. `comm` is the tp group; the dim must split evenly.
absl::StatusOr<Variable> GatherAlongDim(const Variable& x, int64_t dim, Communicator* comm, absl::Duration timeout);
absl::StatusOr<Variable> ReduceScatterAlongDim(const Variable& x, int64_t dim, Communicator* comm,
                                               absl::Duration timeout);

// Forward: x, a partial sum over `comm` (what a row-parallel GEMM leaves on
// each rank), summed over the group, plus b over the last dim if given.
// Backward: dx = dy, db = dy summed over the rows. Megatron's
// reduce-from-tensor-parallel region with the bias after it, as one node:
// the sum and the bias are written over x's own storage (the DistSpec
// conversion P -> R sums a copy, and a BiasAdd makes another), so x must be
// an op's fresh output that nothing else reads, its own backward included
// (a Linear's output). x contiguous, on the device `comm` moves.
absl::StatusOr<Variable> SumPartialAddBias(const Variable& x, const std::optional<Variable>& b, Communicator* comm,
                                           absl::Duration timeout);

// Forward: the identity. Backward: the gradient all-reduced (sum) over
// `comm`. Used where a tensor replicated over a group feeds rank-local math,
// so that each rank's gradient is one term of the true one (Megatron's
// copy-to-tensor-parallel-region; a Linear1D_Col input).
absl::StatusOr<Variable> ReduceGradient(const Variable& x, Communicator* comm, absl::Duration timeout);

// Linear(ReduceGradient(x, comm), w, b, epilogue) as one node (a
// column-parallel linear on a replicated input, Megatron's f then the
// GEMM): backward computes dx = dy @ w first and sums it over `comm` while it
// computes dw and db, so the all-reduce runs behind the weight-gradient GEMM
// (Megatron-LM's asynchronous input-gradient all-reduce).
absl::StatusOr<Variable> LinearSumInputGrad(const Variable& x, const Variable& w, const std::optional<Variable>& b,
                                            Epilogue epilogue, Communicator* comm, absl::Duration timeout);

// Linear(GatherAlongDim(x, dim, comm), w, b, epilogue) as one node that
// keeps x's shard, not the gathered input (Megatron-LM's sequence
// parallelism): the backward all-gathers x again, started before dx =
// dy @ w so the two overlap, computes dw and db from it, and reduce-scatters
// dx along `dim`. The same arithmetic as the two nodes, bitwise.
absl::StatusOr<Variable> GatheredLinear(const Variable& x, const Variable& w, const std::optional<Variable>& b,
                                        Epilogue epilogue, int64_t dim, Communicator* comm, absl::Duration timeout);
// ReduceScatterAlongDim(Linear(x, w), dim, comm) as one node, which keeps x
// and w but not the partial product (a row-parallel linear under sequence
// parallelism): the backward all-gathers dy along `dim` and computes dx and
// dw from it. The same arithmetic as the two nodes, bitwise.
absl::StatusOr<Variable> ScatteredLinear(const Variable& x, const Variable& w, int64_t dim, Communicator* comm,
                                         absl::Duration timeout);

}  // namespace colod::nn

#endif  // COLOD_WORKER_NN_FUNCTIONAL_H_
