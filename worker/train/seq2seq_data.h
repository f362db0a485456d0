// Training data for an encoder-decoder (T5): (input, target) pairs as two
// .npy files of token ids, the inputs integers [N, input_len] and the
// targets integers [N, target_len] (int64, int32, uint16, uint32), row i of
// each one pair. A target of -100 is left out of the loss: pad shorter
// targets with it. The decoder reads the targets shifted right after the
// model's decoder_start_token_id, with pad_token_id where a target is -100
// (Hugging Face's T5 `labels` and `_shift_right`). The encoder attends to
// every input position: there is no attention mask, so inputs are best
// packed to their full length (as T5's span-corruption pre-training packs
// them). Both files are read into memory when opened. Batches take the pairs
// BatchSampler::ForExamples draws.
//
// Thread-safety: immutable after Open (concurrent Batch calls are fine).
#ifndef COLOD_WORKER_TRAIN_SEQ2SEQ_DATA_H_
#define COLOD_WORKER_TRAIN_SEQ2SEQ_DATA_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/tensor/tensor.h"

namespace colod::train {

// What the decoder reads for `targets` [B, S] (integers): decoder_start,
// then targets[:, :-1], with `pad` for -100. INVALID_ARGUMENT for anything
// but integers [B, S >= 1].
absl::StatusOr<Tensor> ShiftRight(const Tensor& targets, int64_t decoder_start, int64_t pad);

class Seq2SeqDataset {
 public:
  // Ids below `vocab`. NOT_FOUND for a missing file; INVALID_ARGUMENT naming
  // the file for an array of another shape or dtype, a pair count that
  // differs between the files, an id outside [0, vocab) (a target may also
  // be -100) or a target row with no target at all (naming the pair).
  static absl::StatusOr<std::unique_ptr<Seq2SeqDataset>> Open(const std::string& inputs_path,
                                                              const std::string& targets_path, int64_t vocab,
                                                              int64_t decoder_start, int64_t pad);

  int64_t size() const { return size_; }
  int64_t input_len() const { return input_len_; }
  int64_t target_len() const { return target_len_; }
  // How many targets (not -100) the pairs at `indices` have.
  int64_t Labelled(const std::vector<int64_t>& indices) const;
  // The pairs at `indices`: encoder ids [n, input_len], decoder ids and
  // labels [n, target_len], all int64. OUT_OF_RANGE for an index past the
  // pairs.
  absl::Status Batch(const std::vector<int64_t>& indices, Tensor* ids, Tensor* decoder_ids, Tensor* labels) const;

 private:
  Seq2SeqDataset() = default;
  int64_t size_ = 0, input_len_ = 0, target_len_ = 0;
  int64_t decoder_start_ = 0, pad_ = 0;
  std::vector<int64_t> inputs_;   // [N, input_len]
  std::vector<int64_t> targets_;  // [N, target_len]
  std::vector<int64_t> labelled_; // [N]: each target row's positions that are not -100
};

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_SEQ2SEQ_DATA_H_
