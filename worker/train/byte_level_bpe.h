// Byte-level BPE, GPT-2's tokenizer (openai/gpt-2 encoder.py; Hugging
// Face's ByteLevel pre-tokenizer with a BPE model), after the published
// algorithm:
//
//  1. Pre-tokenization: the text splits into words by GPT-2's pattern
//       's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//     (the first alternative that matches at a position wins; letters,
//     numbers and white space as ICU classifies code points; a byte that is
//     not valid UTF-8 counts as neither, and is kept).
//  2. Each byte of a word becomes a printable character (bytes_to_unicode:
//     '!'..'~', U+00A1..U+00AC and U+00AE..U+00FF stand for themselves, the
//     other 68 bytes for U+0100 on in byte order, so ' ' is 'Ġ' U+0120).
//  3. BPE: while some adjacent pair of symbols is in the merges, the pair of
//     the lowest rank merges (each occurrence, left to right).
//  4. Each symbol's id from the vocabulary.
//
// Create checks that every byte's symbol and every merge's result are in the
// vocabulary (as Hugging Face's BPE does), so Encode cannot fail on any
// input. Merging runs on a heap of candidate pairs: O(n log n) in a word's
// length, so a megabyte without a space is not quadratic. A word longer
// than kMaxWordBytes (a data file of one endless run of letters) is merged
// in pieces of that many bytes, no pair merged across a piece's end: the
// merge state is about 40 bytes a byte of the word, so a gigabyte word
// would have taken 40 GB (and past 2 GiB overflowed its int positions).
// Hugging Face merges such a word whole; no text a model learns from has one.
//
// Thread-safety: immutable after Create; Encode and Decode are const.
#ifndef COLOD_WORKER_TRAIN_BYTE_LEVEL_BPE_H_
#define COLOD_WORKER_TRAIN_BYTE_LEVEL_BPE_H_

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "worker/train/tokenizer.h"

namespace colod::train {

class ByteLevelBpe final : public Tokenizer {
 public:
  struct Options {
    // Hugging Face's ByteLevel add_prefix_space: a space in front of the
    // text (of each document) when it does not start with one.
    bool add_prefix_space = false;
    // Hugging Face's ignore_merges: a word that is itself in the vocabulary
    // is that one id.
    bool ignore_merges = false;
    std::optional<int64_t> bos, eos;
    bool add_bos = false;
    // Tokens that decode as their content (added and special tokens): id -> content.
    std::vector<std::pair<int64_t, std::string>> added;
  };
  // `vocab`: symbol -> id (ids in [0, 2^31), distinct); `merges` in rank
  // order. INVALID_ARGUMENT naming the first symbol that breaks the rules
  // in the header, or a bos/eos id outside the vocabulary.
  static absl::StatusOr<std::unique_ptr<ByteLevelBpe>> Create(
      const absl::flat_hash_map<std::string, int64_t>& vocab,
      const std::vector<std::pair<std::string, std::string>>& merges, Options options);

  static constexpr size_t kMaxWordBytes = size_t{1} << 20;

  std::string kind() const override { return "byte-level BPE"; }
  int64_t vocab_size() const override { return static_cast<int64_t>(symbols_.size()); }
  std::optional<int64_t> bos_id() const override { return options_.bos; }
  std::optional<int64_t> eos_id() const override { return options_.eos; }
  bool add_bos() const override { return options_.add_bos && options_.bos.has_value(); }
  absl::StatusOr<std::vector<int64_t>> Encode(absl::string_view text) const override;
  absl::StatusOr<std::string> Decode(absl::Span<const int64_t> ids) const override;

  // Step 1: `word` for each word of `text` in order; together they are the text.
  static void PreTokenize(absl::string_view text, absl::FunctionRef<void(absl::string_view)> word);
  static std::vector<absl::string_view> PreTokenize(absl::string_view text);
  // Step 2: the symbol of one byte, as UTF-8.
  static std::string ByteSymbol(uint8_t byte);

 private:
  struct Merge {
    int32_t rank;
    int32_t result;
  };
  explicit ByteLevelBpe(Options options) : options_(std::move(options)) {}
  // Steps 2-4 for one word.
  void EncodeWord(absl::string_view word, std::vector<int32_t>& scratch, std::vector<int64_t>& out) const;

  Options options_;
  std::array<int32_t, 256> byte_ids_{};
  // (left id << 32 | right id) -> its rank and the merged symbol's id.
  absl::flat_hash_map<uint64_t, Merge> merges_;
  // Whole words, for ignore_merges.
  absl::flat_hash_map<std::string, int32_t> vocab_;
  // id -> the bytes it stands for ("" and absent: not an id).
  std::vector<std::string> symbols_;
  std::vector<bool> is_id_;
};

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_BYTE_LEVEL_BPE_H_
