// Cross-entropy over logits sharded on the vocabulary (Megatron's
// vocab-parallel cross-entropy): the loss of every row without gathering the
// logits. Forward runs one all-gather over tp of each rank's row max and its
// sums against that max (of exponentials, the target logit and, for label
// smoothing, of logits), which every rank combines in rank order into the
// same loss; backward is local. Every pass runs on the
// logits' device (kernels' VocabShard*) and the all-reduces are waited on by
// the device, so on CUDA nothing is read on the host.
#ifndef COLOD_WORKER_NN_VOCAB_CROSS_ENTROPY_H_
#define COLOD_WORKER_NN_VOCAB_CROSS_ENTROPY_H_

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"
#include "worker/tensor/autograd.h"

namespace colod::nn {

// `logits` is [..., V_pad] sharded tp: S(-1); the columns from `vocab_size`
// on are padding and take no part. `labels` holds one integer per row
// (the leading dims flattened), the same on every tp rank. Returns the loss
// per row, [rows] f32, replicated over tp, on the tape: the target is
// (1 - s) * onehot + s / vocab_size, a row labelled `ignore_index` has loss 0
// and no gradient, and any other label outside [0, vocab_size) is
// INVALID_ARGUMENT (found before any collective). The labels are checked
// where they are: pass them on the host (ShardedModel::TokenLoss does) and
// checking them costs no device synchronization; labels on a device are read
// back once to be checked.
absl::StatusOr<Variable> VocabParallelCrossEntropy(const ColoTensor& logits, const Tensor& labels, int64_t vocab_size,
                                                   float label_smoothing = 0, int64_t ignore_index = -100);

// The LM head and that loss fused, chunk by chunk over the rows (llm.c's
// fused classifier, Liger's fused linear cross-entropy): `hidden` [rows, H]
// (the same on every tp rank) times this rank's vocabulary shard of the
// head's `weight` ([V_pad, H] sharded on dim 0 over tp: VocabParallelLMHead1D's
// or a tied VocabParallelEmbedding1D's) gives the logits of `chunk_rows` rows
// at a time, whose loss is taken as VocabParallelCrossEntropy takes it (one
// all-gather of the chunk's row statistics); only each row's log-sum-exp is
// kept. The backward recomputes each chunk's logits and, from their
// gradient, adds the chunk's share to the weight's gradient and to
// hidden's, which is all-reduced over tp once (as a column-parallel layer's
// replicated input's is). So the logits and their gradient exist for at most
// `chunk_rows` rows at a time, f32 [chunk_rows, V_pad / tp], instead of for
// the whole batch, for one more GEMM of the head's (the recomputation).
// Returns the loss per row as VocabParallelCrossEntropy does, equal to it on
// hidden W^T within f32 rounding; the same errors, and INVALID_ARGUMENT for
// chunk_rows < 1 or mismatched shapes.
absl::StatusOr<Variable> VocabParallelLinearCrossEntropy(const Variable& hidden, const ColoTensor& weight,
                                                         const Tensor& labels, int64_t vocab_size, int64_t chunk_rows,
                                                         float label_smoothing = 0, int64_t ignore_index = -100);

// The same fused head and loss with the gradients taken in forward, as
// llm.c's fused classifier and Liger's fused linear cross-entropy take them:
// returns the sum of the rows' losses, [] f32 (replicated over tp; the loss
// per row VocabParallelLinearCrossEntropy gives, summed as Sum sums it). Each
// chunk's logits give its loss and, for a gradient of 1 at each row, the
// logits' gradient, from which its share of hidden's and the weight's
// gradients are added up in f32; then the chunk's logits and their gradient
// are freed. The backward only multiplies those sums by the sum's gradient
// g (read on the device) and rounds them once: no chunk's logits are
// computed again. The price is memory from forward until that backward,
// which lets them go: the f32 sums, [rows, H] and this rank's [V_pad / tp,
// H] (154 MB at GPT-2 124M). Without a tape (NoGradScope, or no input that
// requires grad) only the losses are computed.
// That is cheap with one micro-batch in flight, but a pipeline schedule
// holds several, so ShardedModel takes it only without pipeline stages. The
// same errors as VocabParallelLinearCrossEntropy.
absl::StatusOr<Variable> VocabParallelLinearCrossEntropySum(const Variable& hidden, const ColoTensor& weight,
                                                            const Tensor& labels, int64_t vocab_size,
                                                            int64_t chunk_rows, float label_smoothing = 0,
                                                            int64_t ignore_index = -100);

}  // namespace colod::nn

#endif  // COLOD_WORKER_NN_VOCAB_CROSS_ENTROPY_H_
