// Writes Megatron-LM's indexed dataset (the MMapIndexedDataset layout of
// data.h): PREFIX.bin and PREFIX.idx, one sequence per document, as its
// preprocess_data.py writes them, so that Megatron and colod read it alike.
// Tokens are uint16 when the vocabulary has fewer than 65500 ids (Megatron's
// best_fitting_dtype), else int32.
//
// The .bin is streamed to a temporary file beside it. A writer dropped
// without Finish (an error, a full disk) removes it and leaves any earlier
// PREFIX.bin/.idx as they were. Finish fsyncs it, writes the .idx to a
// temporary file and fsyncs that, then renames both into place: a full disk
// fails before either rename and leaves the old pair, and only a crash
// between the two renames leaves a new .bin beside an old .idx (which
// TokenCorpus checks against it).
//
// Thread-compatible: one thread writes.
#ifndef COLOD_WORKER_TRAIN_MEGATRON_WRITER_H_
#define COLOD_WORKER_TRAIN_MEGATRON_WRITER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace colod::train {

class MegatronWriter {
 public:
  // INVALID_ARGUMENT for a vocabulary outside [1, 2^31); the file errors of
  // FileError (RESOURCE_EXHAUSTED for a full disk).
  static absl::StatusOr<std::unique_ptr<MegatronWriter>> Create(const std::string& prefix, int64_t vocab_size);
  ~MegatronWriter();
  MegatronWriter(const MegatronWriter&) = delete;
  MegatronWriter& operator=(const MegatronWriter&) = delete;

  // INVALID_ARGUMENT for an id outside the vocabulary or a document of 2^31
  // tokens or more.
  absl::Status AddDocument(absl::Span<const int64_t> ids);
  absl::Status Finish();

  int64_t documents() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t tokens() const { return tokens_; }
  // "uint16" or "int32".
  const char* dtype_name() const { return width_ == 2 ? "uint16" : "int32"; }

 private:
  MegatronWriter(std::string prefix, int64_t vocab, int fd, std::string tmp);
  absl::Status Flush();

  const std::string prefix_;
  const int64_t vocab_;
  const int width_;
  int fd_;
  std::string tmp_;
  std::string buffer_;
  std::vector<int32_t> lengths_;
  int64_t tokens_ = 0;
  bool finished_ = false;
};

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_MEGATRON_WRITER_H_
