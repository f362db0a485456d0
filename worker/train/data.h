// Training data: a token corpus and the seeded sampler that cuts batches
// from it.
//
// Corpora come as
//   .bin   a flat little-endian array of uint16 tokens (nanoGPT's layout), or
//          uint32 with DataFormat::kU32; read from disk at each use, not
//          into memory
//   .npy   an integer array (int64, int32, uint16, uint32), flattened
//   text   anything else: UTF-8 text. With a tokenizer (the model
//          directory's own, tokenizer.h; the trainer passes it when the
//          directory has one) each paragraph (lines up to a blank line) is a
//          document, encoded [bos] text [eos] as the tokenizer frames it.
//          Without one the whole file is one document, tokenized byte-level
//          (token = byte, 0..255) with <|endoftext|> = 256 appended;
//          vocabulary 257
//   .jsonl one JSON object per line whose "text" is a document (the input
//          of Megatron-LM's preprocess_data.py), tokenized as text is
//   Megatron-LM's indexed dataset (MMapIndexedDataset): PREFIX.bin with
//          PREFIX.idx beside it (the path names PREFIX, PREFIX.bin or
//          PREFIX.idx; a .bin with an .idx beside it is this format). The
//          .idx holds the header "MMIDIDX\0\0", version 1 (u64), the token
//          dtype code (u8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
//          8 uint16), the sequence count (u64), the document count (u64),
//          then each sequence's length (i32), its byte offset in the .bin
//          (i64), and the documents as sequence-index boundaries (i64,
//          0 ... sequence count); all little-endian. The corpus is every
//          sequence in order (read from the .bin as a .bin is; the .idx is
//          streamed through at Open), and documents() keeps where each
//          document starts. As in Megatron's GPT dataset, windows run across
//          documents (its preprocessing appends an end-of-document token to
//          each).
//
// BatchSampler draws each step's global batch of windows of seq_len + 1
// tokens at offsets that depend only on (seed, step, row), so a run that
// resumes at step k sees exactly the batches the uninterrupted run saw. The
// global batch splits over dp: replica d takes rows [d*B/dp, (d+1)*B/dp);
// the tp ranks of a replica take the same rows.
//
// A .bin (raw or Megatron's) is read with pread at each use, not mapped: a
// file truncated or rewritten while a job trains on it (or an I/O error of
// network storage) is then an error of the step that reads it, where a map
// would have killed the whole worker with SIGBUS.
//
// Thread-safety: TokenCorpus is immutable after Open (concurrent reads are
// fine); BatchSampler is a value type.
#ifndef COLOD_WORKER_TRAIN_DATA_H_
#define COLOD_WORKER_TRAIN_DATA_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/atomic_file.h"
#include "worker/tensor/npy.h"
#include "worker/tensor/tensor.h"
#include "worker/train/tokenizer.h"

namespace colod::train {

inline constexpr int64_t kByteVocab = 257;  // 256 bytes + <|endoftext|>
inline constexpr int64_t kEndOfText = 256;

enum class DataFormat { kAuto, kU16, kU32, kNpy, kText, kJsonl, kMegatron };
// "auto", "uint16", "uint32", "npy", "text", "jsonl", "megatron".
absl::StatusOr<DataFormat> ParseDataFormat(const std::string& name);

// The format Open reads `path` as: `format` unless it is kAuto, else by
// extension (.bin: uint16 unless an .idx is beside it, .idx: Megatron,
// .npy, .jsonl, else text; a path that does not exist but whose .bin and
// .idx do: Megatron).
DataFormat ResolveDataFormat(const std::string& path, DataFormat format);
// Whether the format is text a tokenizer reads (text, jsonl).
inline bool IsTextFormat(DataFormat f) { return f == DataFormat::kText || f == DataFormat::kJsonl; }

// The files TokenCorpus::Open(path) may open: the path itself, and the
// PREFIX.bin and PREFIX.idx of a Megatron dataset it may name (PREFIX is
// the path without a .bin or .idx). For checks of what a job may read.
std::vector<std::string> DataFiles(const std::string& path);

// Calls `fn` with each document of a text or jsonl file in order, and
// where it is (the path, or PATH:LINE for jsonl): jsonl's "text"s; text's
// paragraphs when `paragraphs`, else the whole file. INVALID_ARGUMENT
// naming the line for a jsonl line that is not an object with a string
// "text"; `fn`'s error ends the walk. The file is read a line at a time (a
// file larger than the memory is walked in the memory of its longest
// document), but for text without `paragraphs`, which is read whole, at
// most `max_bytes` of it (the size a caller's memory check measured:
// FAILED_PRECONDITION where it grew since).
absl::Status ForEachTextDocument(const std::string& path, DataFormat format, bool paragraphs,
                                 const std::function<absl::Status(absl::string_view doc, const std::string& where)>& fn,
                                 int64_t max_bytes = std::numeric_limits<int64_t>::max());

// A .npy array a dataset reads whole into memory, sized from its header
// before it is read: what ReadNpy holds at its peak (`read`), the tensor it
// returns (`tensor`), and its elements, each nullopt past int64.
struct NpyFootprint {
  std::string path;
  NpyInfo info;
  std::optional<int64_t> read, tensor;
  int64_t elements = 0;
  // The tensor and its values as int64 (Tensor::ReadInt64s: the vector, and
  // a copy widened to int64 before it where the tensor is narrower), held
  // together: 8 bytes an element beside an int64 tensor, 16 beside others.
  std::optional<int64_t> TensorAndInt64s() const;
};
absl::StatusOr<NpyFootprint> NpyFootprintOf(const std::string& path);
// OK where `need` bytes (nullopt: past int64), the most a dataset's reading
// of `files` holds at once, fit in the memory available now; else
// RESOURCE_EXHAUSTED naming the files and both sizes, before anything is
// read (a worker that ran out would be killed mid-job, and every rank on
// it with it).
absl::Status ArraysFitInMemory(const std::vector<std::string>& files, std::optional<int64_t> need);
// The larger of two sizes, and their sum: nullopt where either is (past
// int64), or the sum is.
std::optional<int64_t> MaxBytes(std::optional<int64_t> a, std::optional<int64_t> b);
std::optional<int64_t> SumBytes(std::optional<int64_t> a, std::optional<int64_t> b);

class TokenCorpus {
 public:
  // The format is ResolveDataFormat's; `tokenizer` (may be null) encodes
  // text and jsonl. NOT_FOUND for a missing file; INVALID_ARGUMENT for a
  // .bin whose size is not a multiple of the token size, a malformed .npy,
  // a non-integer array, a Megatron index that does not describe its .bin
  // (every count and offset is checked against the files' sizes before
  // use), a jsonl line that is not an object with a string "text" (naming
  // the line), text with no document, or text the tokenizer refuses.
  // `stopped` (may be empty) is polled between text documents: true ends
  // the read, CANCELLED. A `vocab_size` above 0 is the model's: a token
  // outside [0, vocab_size) is INVALID_ARGUMENT naming the file, its
  // offset in the corpus and its id; tokens held in memory (.npy, text,
  // jsonl) are checked here, all of them, and a file's (.bin, Megatron) as
  // Read reads them (a full scan at open would read the whole file).
  static absl::StatusOr<std::unique_ptr<TokenCorpus>> Open(const std::string& path,
                                                           DataFormat format = DataFormat::kAuto,
                                                           const Tokenizer* tokenizer = nullptr,
                                                           const std::function<bool()>& stopped = {},
                                                           int64_t vocab_size = 0);
  TokenCorpus(const TokenCorpus&) = delete;
  TokenCorpus& operator=(const TokenCorpus&) = delete;

  int64_t size() const { return size_; }
  // Tokens [start, start + n) into out[0, n): OUT_OF_RANGE past the corpus;
  // for a .bin, DATA_LOSS where the file is shorter than it was at Open
  // (changed while in use) and UNAVAILABLE for a read error of the moment
  // (EIO, ESTALE), naming the file; INVALID_ARGUMENT for a token outside
  // Open's vocab_size.
  absl::Status Read(int64_t start, int64_t n, int64_t* out) const;
  DataFormat format() const { return format_; }
  // Tokens [start, start + length) as int64 [length].
  absl::StatusOr<Tensor> Window(int64_t start, int64_t length) const;
  // Where each document starts (token offsets, non-decreasing, the first
  // 0; an empty document starts where the next one does, and a Megatron
  // index's are kept once): Megatron's documents, text's paragraphs when a
  // tokenizer encodes them, and jsonl's lines; one document otherwise.
  const std::vector<int64_t>& documents() const { return documents_; }

 private:
  TokenCorpus() = default;
  // Open without the vocabulary's check.
  static absl::StatusOr<std::unique_ptr<TokenCorpus>> OpenAnyIds(const std::string& path, DataFormat format,
                                                                 const Tokenizer* tokenizer,
                                                                 const std::function<bool()>& stopped);
  // INVALID_ARGUMENT: token `at` of the corpus, `id`, is outside vocab_size_.
  absl::Status OutsideTheVocabulary(const std::string& path, int64_t at, int64_t id) const;
  // Opens the .bin `path` holding `tokens` tokens from byte `offset`.
  absl::Status OpenTokens(const std::string& path, int64_t offset, int64_t tokens);
  DataFormat format_ = DataFormat::kText;
  int64_t size_ = 0;
  std::optional<RegularFileReader> bin_;  // of a .bin, read with pread
  int64_t file_offset_ = 0;  // bytes before the first token
  int width_ = 2;            // bytes per token in the file
  bool signed_ = false;      // the file's tokens are two's complement
  int64_t vocab_size_ = 0;   // Open's: each token is below it (0: unchecked)
  // Appends a document's tokens and where it starts.
  void AddDocument(std::vector<int64_t> ids);
  std::vector<int64_t> owned_;  // .npy and text
  std::vector<int64_t> documents_{0};
};

// The held-out split of a corpus (TrainConfig.eval_split): the offset from
// which the trailing `fraction` of its tokens is held out. It is the
// document start nearest to (1 - fraction) x size where the corpus has
// documents (Megatron's, tokenized text's paragraphs, jsonl's lines) and
// that token otherwise (a .bin, a .npy, byte-level text), so that neither
// side is shorter than `min_tokens` (a window). INVALID_ARGUMENT naming
// eval_split when no split leaves both sides that long, or the fraction is
// not in (0, 1).
absl::StatusOr<int64_t> HeldOutStart(const TokenCorpus& corpus, double fraction, int64_t min_tokens);
// The same for `examples` whole examples (images, pairs): the trailing
// round(fraction x examples) of them, at least one, leaving at least one.
absl::StatusOr<int64_t> HeldOutStart(int64_t examples, double fraction);

// Which part of a corpus (of a dataset's examples) a sampler draws from, and
// how.
struct SampleRange {
  int64_t begin = 0;
  int64_t end = -1;  // one past the last; -1: the whole corpus
  // Windows in order from `begin`, each seq_len on from the last (examples:
  // one on), wrapping at the range's end: a held-out evaluation's, the same
  // for every evaluation. Otherwise drawn at random from (seed, step, row).
  bool sequential = false;
};

// Masked language modelling (BERT: TrainConfig.mask_token_id). Each
// position of a window is drawn with probability kMaskedFraction from (the
// sampler's seed, the step, the row of the global batch, the position) and
// not from the tokens, so that every rank counts a step's labelled
// positions without reading its data, and a row masks the same however the
// batch splits over replicas and micro-batches. A drawn position is
// labelled with its token and read as mask_token_id 80 % of the time, a
// random id of [0, vocab_size) 10 %, itself 10 %; the others are labelled
// -100 (Hugging Face's DataCollatorForLanguageModeling).
struct MaskedLm {
  static constexpr double kMaskedFraction = 0.15;
  int64_t mask_token_id = 0;
  int64_t vocab_size = 0;
};

class BatchSampler {
 public:
  // INVALID_ARGUMENT when the range has fewer than seq_len + 1 tokens or
  // the batch does not split over dp.
  static absl::StatusOr<BatchSampler> Create(int64_t corpus_tokens, int64_t seq_len, int64_t global_batch, int dp,
                                             uint64_t seed, SampleRange range = {});
  // A sampler of whole examples (ImageDataset's images): Starts(step) are
  // indices in the range, drawn as windows are; Batch is not for it.
  static absl::StatusOr<BatchSampler> ForExamples(int64_t examples, int64_t global_batch, int dp, uint64_t seed,
                                                  SampleRange range = {});
  // The corpus offsets of the global batch of `step` (0-based).
  std::vector<int64_t> Starts(int64_t step) const;
  // Rows [first, first + count) of Starts(step) (clamped to the batch),
  // computed alone: each row's start depends on (seed, step, row) only.
  std::vector<int64_t> Starts(int64_t step, int64_t first, int64_t count) const;
  // The distinct windows (examples) of the range: a sequential sampler's
  // period.
  int64_t windows() const;
  // Replica `replica`'s rows of step `step`: inputs [B/dp, seq_len] and
  // next-token labels [B/dp, seq_len] (int64); with count >= 0, only its
  // rows [first, first + count) (INVALID_ARGUMENT outside [0, B/dp)).
  // With `masked`, the inputs are each window's seq_len tokens, masked,
  // and the labels the masked positions' tokens (-100 elsewhere).
  absl::Status Batch(const TokenCorpus& corpus, int64_t step, int replica, Tensor* inputs, Tensor* labels,
                     int64_t first = 0, int64_t count = -1, const MaskedLm* masked = nullptr) const;
  // The positions MaskedLm draws in rows [first, first + count) of step
  // `step`'s global batch (clamped to it).
  int64_t MaskedPositions(int64_t step, int64_t first, int64_t count) const;

  int64_t seq_len() const { return seq_len_; }
  int64_t global_batch() const { return global_batch_; }
  uint64_t seed() const { return seed_; }

 private:
  BatchSampler(int64_t n, int64_t seq_len, int64_t batch, int dp, uint64_t seed, int64_t begin, bool sequential)
      : corpus_tokens_(n), seq_len_(seq_len), global_batch_(batch), dp_(dp), seed_(seed), begin_(begin),
        sequential_(sequential) {}
  static absl::StatusOr<SampleRange> Resolve(SampleRange range, int64_t size);
  int64_t corpus_tokens_, seq_len_, global_batch_;  // corpus_tokens_: the range's
  int dp_;
  uint64_t seed_;
  int64_t begin_;
  bool sequential_;
};

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_DATA_H_
