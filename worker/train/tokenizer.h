// Tokenizers: a model directory's own, so that text trains with the ids the
// model was trained on.
//
//   byte-level BPE  tokenizer.json with a BPE model and a ByteLevel
//                   pre-tokenizer, or vocab.json + merges.txt (GPT-2, OPT):
//                   GPT-2's algorithm (byte_level_bpe.h)
//
//   SentencePiece   tokenizer.model (LLaMA) or spiece.model (T5), through
//                   Debian's libsentencepiece in a helper process
//                   (sentencepiece_tokenizer.h); preferred when a directory
//                   also has a tokenizer.json
//
// A document is encoded as [bos] + Encode(text) + [eos]: bos when the
// tokenizer has one and tokenizer_config.json's add_bos_token is true (as
// GPT2Tokenizer, false unless it says so), eos (Megatron's end-of-document
// token) whenever the tokenizer has one. Special tokens written in the text are text: they
// are not matched, as in GPT-2's own encoder and Megatron's preprocessing.
//
// Thread-safety: a Tokenizer is immutable after loading; Encode and Decode
// may be called from any thread.
#ifndef COLOD_WORKER_TRAIN_TOKENIZER_H_
#define COLOD_WORKER_TRAIN_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace colod::train {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  // "sentencepiece" or "byte-level BPE".
  virtual std::string kind() const = 0;
  // One more than the largest id Encode can return (bos and eos included).
  virtual int64_t vocab_size() const = 0;
  virtual std::optional<int64_t> bos_id() const = 0;
  virtual std::optional<int64_t> eos_id() const = 0;
  // Whether EncodeDocument puts bos in front.
  virtual bool add_bos() const = 0;
  // The ids of `text` (any bytes: invalid UTF-8 is kept, byte for byte,
  // where the tokenizer can represent it).
  virtual absl::StatusOr<std::vector<int64_t>> Encode(absl::string_view text) const = 0;
  // The text of `ids`; INVALID_ARGUMENT for an id outside the vocabulary.
  virtual absl::StatusOr<std::string> Decode(absl::Span<const int64_t> ids) const = 0;

  // [bos] + Encode(text) + [eos], as the header says.
  absl::StatusOr<std::vector<int64_t>> EncodeDocument(absl::string_view text) const;
};

// The tokenizer of a model directory: tokenizer.model or spiece.model, else
// tokenizer.json, else vocab.json with merges.txt. NOT_FOUND
// when the directory has none;
// INVALID_ARGUMENT naming the file and what is wrong for a malformed one or
// one of a kind colod does not implement (a WordPiece or Unigram
// tokenizer.json, a normalizer, another pre-tokenizer).
absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& model_dir);
// Whether `model_dir` holds one of the files above.
bool HasTokenizer(const std::string& model_dir);

// Files larger than this are refused before they are read.
inline constexpr int64_t kMaxTokenizerFileBytes = int64_t{512} << 20;

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_TOKENIZER_H_
