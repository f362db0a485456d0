// SentencePiece models (tokenizer.model: LLaMA; spiece.model: T5) through
// Debian's libsentencepiece, which runs in a helper process of its own,
// colod-sentencepiece (sentencepiece_helper.cc says why and gives the
// protocol). A tokenizer starts its helper when it loads and keeps it; a
// helper that died or stopped answering is killed and reaped, the call that
// met it fails UNAVAILABLE or DEADLINE_EXCEEDED naming it, and the next call
// starts a new one.
//
// The helper is $COLOD_SENTENCEPIECE_HELPER when that is set, else
// colod-sentencepiece next to this program (or in Bazel's output tree, or
// on $PATH).
//
// Thread-safety: Encode and Decode may be called from any thread; they take
// turns on the helper's socket (a mutex held across the exchange with the
// helper, which is bounded by Options::timeout, never across an RPC or a
// collective).
#ifndef COLOD_WORKER_TRAIN_SENTENCEPIECE_TOKENIZER_H_
#define COLOD_WORKER_TRAIN_SENTENCEPIECE_TOKENIZER_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "worker/train/tokenizer.h"

namespace colod::train {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  struct Options {
    // The helper program; empty: found as the header says.
    std::string helper;
    // An exchange with the helper may take this long plus a second per MiB
    // of its text; a helper past it is killed.
    absl::Duration timeout = absl::Seconds(60);
    // tokenizer_config.json's add_bos_token (LLaMA's default: true).
    std::optional<bool> add_bos;
  };

  // Loads `model_path` in a new helper. INVALID_ARGUMENT naming the file
  // when the library cannot read it; FAILED_PRECONDITION when there is no
  // helper to run.
  static absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> Load(const std::string& model_path,
                                                                       Options options);
  ~SentencePieceTokenizer() override;

  std::string kind() const override { return "sentencepiece"; }
  int64_t vocab_size() const override { return pieces_; }
  std::optional<int64_t> bos_id() const override { return bos_; }
  std::optional<int64_t> eos_id() const override { return eos_; }
  bool add_bos() const override { return add_bos_; }
  absl::StatusOr<std::vector<int64_t>> Encode(absl::string_view text) const override;
  absl::StatusOr<std::string> Decode(absl::Span<const int64_t> ids) const override;

  // The running helper's pid (0 when none runs), for tests.
  pid_t helper_pid() const;

  // Texts larger than this are refused (the library indexes with int).
  static constexpr size_t kMaxText = size_t{1} << 30;

 private:
  SentencePieceTokenizer(std::string model_path, std::string helper, Options options)
      : model_path_(std::move(model_path)), helper_(std::move(helper)), options_(std::move(options)) {}
  // Starts the helper and reads its hello into `hello` (4 ints).
  absl::Status StartLocked(int32_t hello[4]) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Kills and reaps the helper; `why` says what happened to it.
  std::string StopLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One request and its answer's payload.
  absl::StatusOr<std::string> Exchange(char op, absl::string_view payload, uint64_t count) const;

  const std::string model_path_;
  const std::string helper_;
  const Options options_;
  int64_t pieces_ = 0;
  std::optional<int64_t> bos_, eos_;
  bool add_bos_ = false;

  mutable absl::Mutex mu_;
  mutable int fd_ ABSL_GUARDED_BY(mu_) = -1;
  mutable pid_t pid_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_SENTENCEPIECE_TOKENIZER_H_
