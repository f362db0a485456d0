#include "worker/train/seq2seq_data.h"

#include "absl/strings/str_cat.h"
#include "common/int_math.h"
#include "common/status_macros.h"
#include "worker/tensor/npy.h"
#include "worker/train/data.h"

namespace colod::train {
namespace {

// An integer [N, S >= 1] array from `path`, as int64 values.
absl::StatusOr<std::vector<int64_t>> ReadIds(const std::string& path, const std::string& what, int64_t rows,
                                             int64_t* len) {
  ASSIGN_OR_RETURN(Tensor t, ReadNpy(path));
  if (t.dim() != 2 || !IsInteger(t.dtype()) || t.shape()[0] < 1 || t.shape()[1] < 1 ||
      (rows >= 0 && t.shape()[0] != rows)) {
    const std::string n = rows >= 0 ? absl::StrCat(rows, " (one per input)") : "N";
    return absl::InvalidArgumentError(absl::StrCat(path, ": the ", what, " must be integer token ids [", n,
                                                   ", length], got ", DTypeName(t.dtype()), " ",
                                                   ShapeToString(t.shape())));
  }
  *len = t.shape()[1];
  return t.ReadInt64s();
}

}  // namespace

absl::StatusOr<Tensor> ShiftRight(const Tensor& targets, int64_t decoder_start, int64_t pad) {
  if (targets.dim() != 2 || !IsInteger(targets.dtype()) || targets.shape()[1] < 1) {
    return absl::InvalidArgumentError(absl::StrCat("targets must be integers [batch, length >= 1], got ",
                                                   DTypeName(targets.dtype()), " ", ShapeToString(targets.shape())));
  }
  const int64_t batch = targets.shape()[0], len = targets.shape()[1];
  ASSIGN_OR_RETURN(const std::vector<int64_t> t, targets.ReadInt64s());
  std::vector<int64_t> out(t.size());
  for (int64_t b = 0; b < batch; ++b) {
    out[b * len] = decoder_start;
    for (int64_t s = 1; s < len; ++s) {
      const int64_t prev = t[b * len + s - 1];
      out[b * len + s] = prev == -100 ? pad : prev;
    }
  }
  return Tensor::FromInt64s({batch, len}, out);
}

absl::StatusOr<std::unique_ptr<Seq2SeqDataset>> Seq2SeqDataset::Open(const std::string& inputs_path,
                                                                     const std::string& targets_path, int64_t vocab,
                                                                     int64_t decoder_start, int64_t pad) {
  // Both are held as int64 values: at its peak, reading one holds ReadNpy's
  // buffers or its tensor and their int64 copies, the targets' reading the
  // inputs' values too.
  ASSIGN_OR_RETURN(const NpyFootprint in, NpyFootprintOf(inputs_path));
  ASSIGN_OR_RETURN(const NpyFootprint out, NpyFootprintOf(targets_path));
  const auto reading = [](const NpyFootprint& f) { return MaxBytes(f.read, f.TensorAndInt64s()); };
  RETURN_IF_ERROR(ArraysFitInMemory({inputs_path, targets_path},
                                    MaxBytes(reading(in), SumBytes(CheckedMul(in.elements, 8), reading(out)))));
  std::unique_ptr<Seq2SeqDataset> d(new Seq2SeqDataset());
  ASSIGN_OR_RETURN(d->inputs_, ReadIds(inputs_path, "inputs", -1, &d->input_len_));
  d->size_ = static_cast<int64_t>(d->inputs_.size()) / d->input_len_;
  ASSIGN_OR_RETURN(d->targets_, ReadIds(targets_path, "targets", d->size_, &d->target_len_));
  d->decoder_start_ = decoder_start;
  d->pad_ = pad;
  for (size_t i = 0; i < d->inputs_.size(); ++i) {
    const int64_t id = d->inputs_[i];
    if (id < 0 || id >= vocab) {
      return absl::InvalidArgumentError(absl::StrCat(inputs_path, ": id ", id, " of input ",
                                                     static_cast<int64_t>(i) / d->input_len_,
                                                     " is outside the model's vocabulary of ", vocab));
    }
  }
  d->labelled_.assign(static_cast<size_t>(d->size_), 0);
  for (int64_t row = 0; row < d->size_; ++row) {
    for (int64_t s = 0; s < d->target_len_; ++s) {
      const int64_t id = d->targets_[row * d->target_len_ + s];
      if (id == -100) continue;
      if (id < 0 || id >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat(targets_path, ": id ", id, " of target ", row,
                                                       " is outside the model's vocabulary of ", vocab,
                                                       " (and is not -100)"));
      }
      ++d->labelled_[row];
    }
    if (d->labelled_[row] == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(targets_path, ": target ", row, " is all -100: the pair has nothing to learn"));
    }
  }
  return d;
}

int64_t Seq2SeqDataset::Labelled(const std::vector<int64_t>& indices) const {
  int64_t n = 0;
  for (int64_t i : indices) n += i >= 0 && i < size_ ? labelled_[i] : 0;
  return n;
}

absl::Status Seq2SeqDataset::Batch(const std::vector<int64_t>& indices, Tensor* ids, Tensor* decoder_ids,
                                   Tensor* labels) const {
  const int64_t n = static_cast<int64_t>(indices.size());
  std::vector<int64_t> in, target;
  in.reserve(static_cast<size_t>(n * input_len_));
  target.reserve(static_cast<size_t>(n * target_len_));
  for (int64_t i : indices) {
    if (i < 0 || i >= size_) return absl::OutOfRangeError(absl::StrCat("pair ", i, " of ", size_));
    in.insert(in.end(), inputs_.begin() + i * input_len_, inputs_.begin() + (i + 1) * input_len_);
    target.insert(target.end(), targets_.begin() + i * target_len_, targets_.begin() + (i + 1) * target_len_);
  }
  ASSIGN_OR_RETURN(*ids, Tensor::FromInt64s({n, input_len_}, in));
  ASSIGN_OR_RETURN(*labels, Tensor::FromInt64s({n, target_len_}, target));
  ASSIGN_OR_RETURN(*decoder_ids, ShiftRight(*labels, decoder_start_, pad_));
  return absl::OkStatus();
}

}  // namespace colod::train
