// 1D tensor-parallel embeddings over the "tp" axis (DESIGN.md section 3).
//
//   VocabParallelEmbedding1D  table [V_pad/p, H] = tp: S(0). The vocabulary is
//       padded with zero rows to a multiple of pad_to_multiple_of * p; each
//       rank looks up the ids in its vocabulary range (others give zero rows)
//       and the partial result is all-reduced; backward is local.
//   Embedding1D  table [V, H/p] = tp: S(1); the looked-up [.., H/p] pieces
//       are all-gathered; backward slices.
//
// Ids are an integer Tensor replicated over tp (every rank passes the same
// ids); an id outside [0, V) is INVALID_ARGUMENT, found before any
// collective. Outputs are replicated over tp.
//
// Thread-safety: a layer is used by one rank thread at a time.
#ifndef COLOD_WORKER_NN_EMBEDDING1D_H_
#define COLOD_WORKER_NN_EMBEDDING1D_H_

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"

namespace colod::nn {

class VocabParallelEmbedding1D {
 public:
  struct Options {
    int64_t pad_to_multiple_of = 64;  // ShardFormer's make_vocab_size_divisible_by
  };
  // `table` is the full [V, H] embedding.
  static absl::StatusOr<VocabParallelEmbedding1D> FromGlobal(const Tensor& table, ProcessGroup* pg, Options options);
  // V_pad for a vocabulary of `vocab_size` on `pg`'s tp axis.
  static absl::StatusOr<int64_t> PaddedVocab(int64_t vocab_size, ProcessGroup* pg, const Options& options);
  // The table's spec: [V_pad, H] tp: S(0).
  static absl::StatusOr<DistSpec> Spec(ProcessGroup* pg);
  // From this rank's rows of the padded table [V_pad, H] (rows from
  // `vocab_size` on must be zero); INVALID_ARGUMENT for another shape or spec.
  static absl::StatusOr<VocabParallelEmbedding1D> FromParameters(ColoParameter table, int64_t vocab_size,
                                                                 ProcessGroup* pg, Options options);
  absl::StatusOr<ColoTensor> Forward(const Tensor& ids) const;

  const ColoParameter& weight() const { return weight_; }
  int64_t vocab_size() const { return vocab_size_; }          // V
  int64_t padded_vocab_size() const { return padded_vocab_; }  // V_pad
  int64_t vocab_start() const { return vocab_start_; }        // this rank's first row

 private:
  VocabParallelEmbedding1D(ColoParameter w, ProcessGroup* pg, int64_t v, int64_t vp, int64_t start)
      : weight_(std::move(w)), pg_(pg), vocab_size_(v), padded_vocab_(vp), vocab_start_(start) {}
  ColoParameter weight_;
  ProcessGroup* pg_;
  int64_t vocab_size_, padded_vocab_, vocab_start_;
};

class Embedding1D {
 public:
  static absl::StatusOr<Embedding1D> FromGlobal(const Tensor& table, ProcessGroup* pg);
  absl::StatusOr<ColoTensor> Forward(const Tensor& ids) const;
  const ColoParameter& weight() const { return weight_; }

 private:
  Embedding1D(ColoParameter w, ProcessGroup* pg) : weight_(std::move(w)), pg_(pg) {}
  ColoParameter weight_;
  ProcessGroup* pg_;
};

// INVALID_ARGUMENT naming the first id outside [0, vocab_size).
absl::Status CheckIds(const Tensor& ids, int64_t vocab_size);

}  // namespace colod::nn

#endif  // COLOD_WORKER_NN_EMBEDDING1D_H_
