#include "worker/nn/vocab_cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/tensor/ops.h"

namespace colod::nn {

namespace {

// The labels as [rows] i64 on `dev`, after checking there is one per row and
// each is in [0, vocab_size) or ignore_index (read where they are: free for
// host labels).
absl::StatusOr<Tensor> CheckedLabels(const Tensor& labels, int64_t rows, int64_t vocab_size, int64_t ignore_index,
                                     Device dev) {
  if (labels.numel() != rows || !IsInteger(labels.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("labels ", DTypeName(labels.dtype()), ShapeToString(labels.shape()),
                                                   " must be ", rows, " integers, one per row of the logits"));
  }
  ASSIGN_OR_RETURN(const std::vector<int64_t> lab, labels.ReadInt64s());
  for (int64_t r = 0; r < rows; ++r) {
    if (lab[r] != ignore_index && (lab[r] < 0 || lab[r] >= vocab_size)) {
      return absl::InvalidArgumentError(absl::StrCat("label ", lab[r], " at row ", r,
                                                     " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  ASSIGN_OR_RETURN(Tensor lab64, labels.ToDType(DType::kI64));
  ASSIGN_OR_RETURN(lab64, lab64.Reshape({rows}));
  return lab64.To(dev);
}

absl::Status CheckVocab(int64_t vocab_size, int64_t padded) {
  if (vocab_size < 1 || vocab_size > padded) {
    return absl::InvalidArgumentError(
        absl::StrCat("vocab_size ", vocab_size, " must be in [1, ", padded, "], the logits' last dim"));
  }
  return absl::OkStatus();
}

// The all-gather of VocabShardCrossEntropy over tp, waited on by the device.
std::function<absl::Status(const Tensor&, Tensor&)> TpAllGather(Communicator* comm, absl::Duration timeout) {
  return [comm, timeout](const Tensor& in, Tensor& out) -> absl::Status {
    return comm->AllGather(in.raw_data(), out.raw_data(), in.numel(), in.dtype())->WaitOnDevice(timeout);
  };
}

// What both fused heads share: the checked shapes, labels and vocabulary
// shard, the weight (padded on CUDA), and each chunk's rows of hidden and
// the labels.
struct FusedHead {
  struct Chunk {
    Tensor h, labels;
  };
  int p = 1;
  Communicator* comm = nullptr;
  absl::Duration timeout;
  int64_t rows = 0, start = 0, real = 0;
  Tensor w;            // this rank's shard, padded with zero rows on CUDA
  int64_t w_rows = 0;  // its rows before the padding
  std::vector<Chunk> chunks;
};

absl::StatusOr<FusedHead> PrepareFusedHead(const Variable& hidden, const ColoTensor& weight, const Tensor& labels,
                                           int64_t vocab_size, int64_t chunk_rows, int64_t ignore_index) {
  FusedHead f;
  ProcessGroup* pg = weight.process_group();
  ASSIGN_OR_RETURN(f.p, pg->AxisSize("tp"));
  ASSIGN_OR_RETURN(int k, pg->tp_local_rank());
  const int p = f.p;
  const Shape& global = weight.global_shape();
  const Shape& hs = hidden.value().shape();
  if (global.size() != 2 || !(weight.spec().Get("tp") == Placement::Shard({0}, {p}) ||
                              (p == 1 && weight.spec().Get("tp") == Placement::Replicate()))) {
    return absl::InvalidArgumentError(absl::StrCat("the fused LM head needs a [vocab, hidden] weight sharded on the "
                                                   "vocabulary over tp, got ", ShapeToString(global), " ",
                                                   weight.spec().ToString()));
  }
  if (hs.size() != 2 || hs[1] != global[1] || hidden.value().device() != weight.local().device()) {
    return absl::InvalidArgumentError(absl::StrCat("hidden ", ShapeToString(hs), " must be [rows, ", global[1],
                                                   "] on the weight's device"));
  }
  if (chunk_rows < 1) return absl::InvalidArgumentError(absl::StrCat("chunk_rows ", chunk_rows, " must be positive"));
  const int64_t padded = global[0], local_v = padded / p;
  f.rows = hs[0];
  RETURN_IF_ERROR(CheckVocab(vocab_size, padded));
  const Device dev = hidden.value().device();
  ASSIGN_OR_RETURN(Tensor lab64, CheckedLabels(labels, f.rows, vocab_size, ignore_index, dev));
  ASSIGN_OR_RETURN(f.comm, pg->Comm("tp"));
  f.start = k * local_v;
  f.real = std::clamp<int64_t>(vocab_size - f.start, 0, local_v);
  ASSIGN_OR_RETURN(const Tensor h, hidden.value().TryContiguous());
  ASSIGN_OR_RETURN(f.w, weight.local().TryContiguous());
  // On a CUDA device a shard whose rows (the logits' width) are not a
  // multiple of 8 computes padded with zero rows to a multiple of 64, as
  // NativeLinear does (cuBLAS's align1 kernels, docs/GPU.md): the extra
  // columns lie past `real`, so the loss leaves them out, and their rows of
  // the weight's gradient are dropped.
  f.w_rows = f.w.shape()[0];
  if (dev.is_cuda() && f.w_rows % 8 != 0) {
    ASSIGN_OR_RETURN(Tensor zeros, Tensor::Zeros({64 - f.w_rows % 64, global[1]}, f.w.dtype(), dev));
    ASSIGN_OR_RETURN(f.w, Tensor::Cat({f.w, zeros}, 0));
  }
  f.timeout = pg->timeout();
  for (int64_t r0 = 0; r0 < f.rows; r0 += chunk_rows) {
    const int64_t n = std::min(chunk_rows, f.rows - r0);
    ASSIGN_OR_RETURN(Tensor hc, h.Narrow(0, r0, n));
    ASSIGN_OR_RETURN(Tensor lc, lab64.Narrow(0, r0, n));
    ASSIGN_OR_RETURN(Tensor h_chunk, hc.TryContiguous());
    ASSIGN_OR_RETURN(Tensor labels_chunk, lc.TryContiguous());
    f.chunks.push_back({std::move(h_chunk), std::move(labels_chunk)});
  }
  return f;
}

}  // namespace

absl::StatusOr<Variable> VocabParallelCrossEntropy(const ColoTensor& logits, const Tensor& labels, int64_t vocab_size,
                                                   float label_smoothing, int64_t ignore_index) {
  ProcessGroup* pg = logits.process_group();
  ASSIGN_OR_RETURN(int p, pg->AxisSize("tp"));
  ASSIGN_OR_RETURN(int k, pg->tp_local_rank());
  const Shape& global = logits.global_shape();
  const int64_t last = static_cast<int64_t>(global.size()) - 1;
  if (last < 0 || !(logits.spec().Get("tp") == Placement::Shard({last}, {p}))) {
    return absl::InvalidArgumentError(absl::StrCat("vocab-parallel cross-entropy needs logits sharded on the last dim "
                                                   "over tp, got ", logits.spec().ToString()));
  }
  const int64_t padded = global[last], local_v = padded / p, rows = NumElements(global) / std::max<int64_t>(padded, 1);
  RETURN_IF_ERROR(CheckVocab(vocab_size, padded));
  const Device dev = logits.local().device();
  ASSIGN_OR_RETURN(Tensor lab64, CheckedLabels(labels, rows, vocab_size, ignore_index, dev));
  ASSIGN_OR_RETURN(Communicator * comm, pg->Comm("tp"));
  const int64_t start = k * local_v;
  const int64_t real = std::clamp<int64_t>(vocab_size - start, 0, local_v);  // real columns held here
  ASSIGN_OR_RETURN(Tensor z, logits.local().Reshape({rows, local_v}));  // a copy if strided
  ASSIGN_OR_RETURN(auto forward, ops::VocabShardCrossEntropy(z, lab64, real, start, vocab_size, label_smoothing,
                                                        ignore_index, p, TpAllGather(comm, pg->timeout())));
  Tensor loss = forward.loss;
  auto saved = std::make_shared<ops::VocabShardForward>(std::move(forward));
  const Shape local_shape = logits.local().shape();
  const DType dtype = logits.local().dtype();
  return RecordOp("vocab_parallel_cross_entropy", {logits.variable()}, std::move(loss),
                  [saved, lab64, start, real, vocab_size, label_smoothing, ignore_index, local_shape,
                   dtype](const Tensor& dloss) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
                    ASSIGN_OR_RETURN(Tensor dz, ops::VocabShardCrossEntropyBackward(dloss, *saved, lab64, real, start,
                                                                               vocab_size, label_smoothing,
                                                                               ignore_index, dtype));
                    ASSIGN_OR_RETURN(dz, dz.Reshape(local_shape));
                    return std::vector<std::optional<Tensor>>{dz};
                  });
}

absl::StatusOr<Variable> VocabParallelLinearCrossEntropy(const Variable& hidden, const ColoTensor& weight,
                                                         const Tensor& labels, int64_t vocab_size, int64_t chunk_rows,
                                                         float label_smoothing, int64_t ignore_index) {
  ASSIGN_OR_RETURN(FusedHead fh, PrepareFusedHead(hidden, weight, labels, vocab_size, chunk_rows, ignore_index));
  const int p = fh.p;
  Communicator* comm = fh.comm;
  const absl::Duration timeout = fh.timeout;
  const int64_t rows = fh.rows, start = fh.start, real = fh.real, w_rows = fh.w_rows;
  const Tensor w = fh.w;
  const Device dev = hidden.value().device();
  using Chunk = FusedHead::Chunk;
  const std::vector<Chunk> chunks = std::move(fh.chunks);
  std::vector<Tensor> losses, lses;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const Chunk& c = chunks[i];
    ASSIGN_OR_RETURN(Tensor z, ops::MatMul(c.h, w, false, true));  // [n, V_pad / tp], the head's dtype
    ASSIGN_OR_RETURN(ops::VocabShardForward f,
                     ops::VocabShardCrossEntropy(z, c.labels, real, start, vocab_size, label_smoothing, ignore_index,
                                                 p, TpAllGather(comm, timeout)));
    losses.push_back(std::move(f.loss));
    lses.push_back(std::move(f.lse));  // f.z, the chunk's logits, goes here
  }
  Tensor loss;
  if (losses.empty()) {
    ASSIGN_OR_RETURN(loss, Tensor::Zeros({0}, DType::kF32, dev));
  } else {
    ASSIGN_OR_RETURN(loss, Tensor::Cat(losses, 0));
  }
  auto saved = std::make_shared<std::vector<Tensor>>(std::move(lses));
  const DType dtype = w.dtype(), hidden_dtype = hidden.value().dtype();
  return RecordOp(
      "vocab_parallel_linear_cross_entropy", {hidden, weight.variable()}, std::move(loss),
      [chunks, saved, w, w_rows, comm, timeout, p, real, start, vocab_size, label_smoothing, ignore_index,
       dtype, hidden_dtype, rows,
       chunk_rows](const Tensor& dloss) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
        std::vector<Tensor> dh(chunks.size());
        std::optional<Tensor> dw;
        // The chunks from the last down, each summed into the weight's
        // gradient in that order.
        for (size_t j = 0; j < chunks.size(); ++j) {
          const size_t i = chunks.size() - 1 - j;
          const Chunk& c = chunks[i];
          const int64_t r0 = static_cast<int64_t>(i) * chunk_rows, n = c.h.shape()[0];
          ops::VocabShardForward f;
          ASSIGN_OR_RETURN(f.z, ops::MatMul(c.h, w, false, true));  // recomputed
          // f.z is in the head's dtype: the kernels read it as it is.
          f.lse = (*saved)[i];
          ASSIGN_OR_RETURN(Tensor dl, dloss.Narrow(0, r0, n));
          ASSIGN_OR_RETURN(dl, dl.TryContiguous());
          ASSIGN_OR_RETURN(Tensor dz, ops::VocabShardCrossEntropyBackward(dl, f, c.labels, real, start,
                                                                     vocab_size, label_smoothing, ignore_index,
                                                                     dtype));
          f.z = Tensor();  // the logits' memory back before the GEMMs that follow
          ASSIGN_OR_RETURN(dh[i], ops::MatMul(dz, w));  // [n, H]: this shard's share
          // The chunks' shares of a bf16/f16 weight's gradient are summed in
          // f32 and rounded once at the end: each chunk's GEMM adds its
          // share to the f32 sum (beta = 1), unrounded.
          if (chunks.size() > 1 && dz.dtype() == c.h.dtype()) {
            if (!dw.has_value()) {
              ASSIGN_OR_RETURN(dw, Tensor::Empty({w.shape()[0], w.shape()[1]}, DType::kF32, w.device()));
            }
            RETURN_IF_ERROR(ops::MatMulF32Into(dz, c.h, true, false, *dw, /*accumulate=*/j > 0));
            continue;
          }
          ASSIGN_OR_RETURN(Tensor dwc, ops::MatMul(dz, c.h, true, false));  // [V_pad / tp, H]
          if (dw.has_value()) {
            ASSIGN_OR_RETURN(dwc, dwc.ToDType(DType::kF32));
            ASSIGN_OR_RETURN(dw, Add(*dw, dwc));
          } else if (chunks.size() > 1) {
            ASSIGN_OR_RETURN(dw, dwc.ToDType(DType::kF32));
          } else {
            dw = std::move(dwc);
          }
        }
        Tensor dhidden;
        if (dh.empty()) {
          ASSIGN_OR_RETURN(dhidden, Tensor::Zeros({rows, w.shape()[1]}, hidden_dtype, w.device()));
          ASSIGN_OR_RETURN(dw, Tensor::Zeros({w_rows, w.shape()[1]}, dtype, w.device()));
        } else {
          ASSIGN_OR_RETURN(dhidden, Tensor::Cat(dh, 0));
        }
        if (dw->shape()[0] != w_rows) {
          ASSIGN_OR_RETURN(dw, dw->Narrow(0, 0, w_rows));
        }
        // Every vocabulary shard's share of hidden's gradient, summed over tp.
        if (p > 1) RETURN_IF_ERROR(AllReduceInPlace(dhidden, ReduceOp::kSum, *comm, timeout));
        ASSIGN_OR_RETURN(dhidden, dhidden.ContiguousAs(hidden_dtype));
        ASSIGN_OR_RETURN(Tensor dweight, dw->ContiguousAs(dtype));
        return std::vector<std::optional<Tensor>>{dhidden, dweight};
      });
}

absl::StatusOr<Variable> VocabParallelLinearCrossEntropySum(const Variable& hidden, const ColoTensor& weight,
                                                            const Tensor& labels, int64_t vocab_size,
                                                            int64_t chunk_rows, float label_smoothing,
                                                            int64_t ignore_index) {
  ASSIGN_OR_RETURN(FusedHead fh, PrepareFusedHead(hidden, weight, labels, vocab_size, chunk_rows, ignore_index));
  const Device dev = hidden.value().device();
  const Tensor& w = fh.w;
  const DType dtype = w.dtype(), hidden_dtype = hidden.value().dtype();
  const int64_t hdim = w.shape()[1];
  // Without a tape to record on (evaluation), the losses alone.
  const bool grads = GradEnabled() && (hidden.requires_grad() || weight.variable().requires_grad());
  // The gradients for a gradient of 1 at every row's loss, summed in f32:
  // hidden's [rows, H] (this shard's share) and the weight's [w rows, H].
  struct Sums {
    Tensor dh, dw;
    bool taken = false;  // by the backward, which lets them go
  };
  auto sums = std::make_shared<Sums>();
  Tensor ones;
  if (grads) {
    ASSIGN_OR_RETURN(sums->dh, Tensor::Empty({fh.rows, hdim}, DType::kF32, dev));
    ASSIGN_OR_RETURN(sums->dw, Tensor::Empty({w.shape()[0], hdim}, DType::kF32, dev));
    // A gradient of 1 a row, uploaded once (through the pinned ring: no wait).
    ASSIGN_OR_RETURN(ones, Tensor::FromFloats({fh.rows}, std::vector<float>(fh.rows, 1.0f)));
    ASSIGN_OR_RETURN(ones, ones.To(dev));
  }
  std::vector<Tensor> losses;
  int64_t r0 = 0;
  for (const FusedHead::Chunk& c : fh.chunks) {
    const int64_t n = c.h.shape()[0];
    ops::VocabShardForward f;
    {
      ASSIGN_OR_RETURN(Tensor z, ops::MatMul(c.h, w, false, true));  // [n, V_pad / tp], the head's dtype
      ASSIGN_OR_RETURN(f, ops::VocabShardCrossEntropy(z, c.labels, fh.real, fh.start, vocab_size, label_smoothing,
                                                      ignore_index, fh.p, TpAllGather(fh.comm, fh.timeout)));
    }
    losses.push_back(f.loss);
    if (!grads) continue;
    ASSIGN_OR_RETURN(Tensor unit, ones.Narrow(0, r0, n));
    ASSIGN_OR_RETURN(Tensor dz, ops::VocabShardCrossEntropyBackward(unit, f, c.labels, fh.real, fh.start, vocab_size,
                                                               label_smoothing, ignore_index, dtype));
    f = ops::VocabShardForward();  // the logits' memory back before the GEMMs
    ASSIGN_OR_RETURN(Tensor dh_rows, sums->dh.Narrow(0, r0, n));
    RETURN_IF_ERROR(ops::MatMulF32Into(dz, w, false, false, dh_rows, /*accumulate=*/false));
    if (dz.dtype() == c.h.dtype()) {
      RETURN_IF_ERROR(ops::MatMulF32Into(dz, c.h, true, false, sums->dw, /*accumulate=*/r0 > 0));
    } else {  // hidden in another dtype than the head's: both in f32, as ops::MatMul would take them
      ASSIGN_OR_RETURN(Tensor dz32, dz.ToDType(DType::kF32));
      ASSIGN_OR_RETURN(Tensor h32, c.h.ToDType(DType::kF32));
      RETURN_IF_ERROR(ops::MatMulF32Into(dz32, h32, true, false, sums->dw, /*accumulate=*/r0 > 0));
    }
    r0 += n;
  }
  Tensor sum;
  if (losses.empty()) {
    if (grads) {  // no rows: nothing of dw was written
      ASSIGN_OR_RETURN(sums->dw, Tensor::Zeros({w.shape()[0], hdim}, DType::kF32, dev));
    }
    ASSIGN_OR_RETURN(sum, Tensor::Zeros({}, DType::kF32, dev));
  } else {
    ASSIGN_OR_RETURN(Tensor per_row, Tensor::Cat(losses, 0));
    ASSIGN_OR_RETURN(sum, SumToTensor(per_row));  // as Sum(per_row) gives it
  }
  return RecordOp(
      "vocab_parallel_linear_cross_entropy_sum", {hidden, weight.variable()}, std::move(sum),
      [sums, w_rows = fh.w_rows, comm = fh.comm, timeout = fh.timeout, p = fh.p, dtype,
       hidden_dtype](const Tensor& g) -> absl::StatusOr<std::vector<std::optional<Tensor>>> {
        if (sums->taken) return absl::FailedPreconditionError("the fused LM head's backward ran twice");
        // Every row's loss has gradient g: the unit gradients times g,
        // rounded once. The sums are let go here, not when the tape is.
        const Sums mine = std::move(*sums);
        *sums = Sums();
        sums->taken = true;
        ASSIGN_OR_RETURN(Tensor dhidden, ScaleBy(mine.dh, g, hidden_dtype));
        // Every vocabulary shard's share of hidden's gradient, summed over tp.
        if (p > 1) RETURN_IF_ERROR(AllReduceInPlace(dhidden, ReduceOp::kSum, *comm, timeout));
        ASSIGN_OR_RETURN(Tensor rows, mine.dw.Narrow(0, 0, w_rows));
        ASSIGN_OR_RETURN(Tensor dweight, ScaleBy(rows, g, dtype));
        return std::vector<std::optional<Tensor>>{dhidden, dweight};
      });
}

}  // namespace colod::nn
