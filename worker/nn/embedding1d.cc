#include "worker/nn/embedding1d.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear1d.h"

namespace colod::nn {

absl::Status CheckIds(const Tensor& ids, int64_t vocab_size) {
  if (!IsInteger(ids.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("ids must be i32 or i64, got ", DTypeName(ids.dtype())));
  }
  ASSIGN_OR_RETURN(const std::vector<int64_t> v, ids.ReadInt64s());
  for (size_t i = 0; i < v.size(); ++i) {
    if (v[i] < 0 || v[i] >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", v[i], " at position ", i,
                                                     " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<VocabParallelEmbedding1D> VocabParallelEmbedding1D::FromGlobal(const Tensor& table, ProcessGroup* pg,
                                                                              Options options) {
  if (table.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("VocabParallelEmbedding1D: the table must be [V, H], got ",
                                                   ShapeToString(table.shape())));
  }
  const int64_t v = table.shape()[0];
  ASSIGN_OR_RETURN(const int64_t vp, PaddedVocab(v, pg, options));
  ASSIGN_OR_RETURN(Tensor padded, Tensor::Zeros({vp, table.shape()[1]}, table.dtype(), table.device()));
  ASSIGN_OR_RETURN(Tensor top, padded.Narrow(0, 0, v));
  RETURN_IF_ERROR(top.CopyFrom(table));
  ASSIGN_OR_RETURN(DistSpec spec, Spec(pg));
  ASSIGN_OR_RETURN(ColoTensor w, ColoTensor::FromGlobal(padded, spec, pg, true));
  return FromParameters(ColoParameter(std::move(w), "weight"), v, pg, options);
}

absl::StatusOr<int64_t> VocabParallelEmbedding1D::PaddedVocab(int64_t vocab_size, ProcessGroup* pg,
                                                              const Options& options) {
  if (options.pad_to_multiple_of < 1) {
    return absl::InvalidArgumentError("VocabParallelEmbedding1D: pad_to_multiple_of must be >= 1");
  }
  ASSIGN_OR_RETURN(int p, pg->AxisSize("tp"));
  const int64_t multiple = options.pad_to_multiple_of * p;
  return (vocab_size + multiple - 1) / multiple * multiple;
}

absl::StatusOr<DistSpec> VocabParallelEmbedding1D::Spec(ProcessGroup* pg) {
  ASSIGN_OR_RETURN(int p, pg->AxisSize("tp"));
  return WithTp({}, Placement::Shard({0}, {p}));
}

absl::StatusOr<VocabParallelEmbedding1D> VocabParallelEmbedding1D::FromParameters(ColoParameter table,
                                                                                  int64_t vocab_size,
                                                                                  ProcessGroup* pg, Options options) {
  ASSIGN_OR_RETURN(const int64_t vp, PaddedVocab(vocab_size, pg, options));
  if (table.global_shape().size() != 2 || table.global_shape()[0] != vp) {
    return absl::InvalidArgumentError(absl::StrCat("VocabParallelEmbedding1D: the table must be [", vp,
                                                   ", H] (vocabulary ", vocab_size, " padded), got ",
                                                   ShapeToString(table.global_shape())));
  }
  ASSIGN_OR_RETURN(DistSpec spec, Spec(pg));
  RETURN_IF_ERROR(CheckSpec(table, spec, "VocabParallelEmbedding1D table"));
  table.set_compute_spec({ComputePattern::kTP1D});
  ASSIGN_OR_RETURN(int p, pg->AxisSize("tp"));
  ASSIGN_OR_RETURN(int k, pg->tp_local_rank());
  return VocabParallelEmbedding1D(std::move(table), pg, vocab_size, vp, k * (vp / p));
}

absl::StatusOr<ColoTensor> VocabParallelEmbedding1D::Forward(const Tensor& ids) const {
  RETURN_IF_ERROR(CheckIds(ids, vocab_size_));
  ASSIGN_OR_RETURN(Variable partial, Embedding(weight_.variable(), ids, vocab_start_, /*mask_out_of_range=*/true));
  ASSIGN_OR_RETURN(ColoTensor out, ColoTensor::FromLocal(partial, WithTp({}, Placement::Partial()), pg_));
  return out.Redistribute(DistSpec());
}

absl::StatusOr<Embedding1D> Embedding1D::FromGlobal(const Tensor& table, ProcessGroup* pg) {
  if (table.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("Embedding1D: the table must be [V, H], got ",
                                                   ShapeToString(table.shape())));
  }
  ASSIGN_OR_RETURN(int p, pg->AxisSize("tp"));
  auto w = ColoTensor::FromGlobal(table, WithTp({}, Placement::Shard({1}, {p})), pg, true);
  if (!w.ok()) return absl::InvalidArgumentError(absl::StrCat("Embedding1D weight: ", w.status().message()));
  w->set_compute_spec({ComputePattern::kTP1D});
  return Embedding1D(ColoParameter(*std::move(w), "weight"), pg);
}

absl::StatusOr<ColoTensor> Embedding1D::Forward(const Tensor& ids) const {
  RETURN_IF_ERROR(CheckIds(ids, weight_.global_shape()[0]));
  ASSIGN_OR_RETURN(int p, pg_->AxisSize("tp"));
  ASSIGN_OR_RETURN(Variable piece, Embedding(weight_.variable(), ids));
  ASSIGN_OR_RETURN(ColoTensor out,
                   ColoTensor::FromLocal(piece, WithTp({}, Placement::Shard({ids.dim()}, {p})), pg_));
  return out.Redistribute(DistSpec());
}

}  // namespace colod::nn
