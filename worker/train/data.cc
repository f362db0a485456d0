#include "worker/train/data.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/atomic_file.h"
#include "common/host_memory.h"
#include "common/int_math.h"
#include "common/json.h"
#include "common/little_endian.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "spec/job_validation.h"
#include "worker/tensor/npy.h"

namespace colod::train {
namespace {

using Json = nlohmann::json;

// splitmix64: a well-mixed 64-bit hash of (seed, step, row).
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Only a regular file, not empty: a FIFO or a device would block the rank
// in open or read (where no abort reaches it) or never end, and is read only
// once while training samples it again and again. Its size.
absl::StatusOr<int64_t> RegularFileSize(const std::string& path) {
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(info.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is ", FileKind(info.st_mode), "; training data must be a regular file"));
  }
  if (info.st_size == 0) return absl::InvalidArgumentError(absl::StrCat(path, " is empty"));
  return static_cast<int64_t>(info.st_size);
}


// Little-endian integers of a buffer whose size was checked.
uint64_t U64At(const unsigned char* p) { return LoadLittleEndian(p, 8); }

constexpr char kMegatronMagic[] = "MMIDIDX\0\0";  // 9 bytes
constexpr int64_t kMegatronHeaderBytes = 9 + 8 + 1 + 8 + 8;

// A Megatron index, checked against its .bin's size.
struct MegatronIndex {
  int width = 0;
  bool is_signed = false;
  int64_t first_byte = 0;  // of the first sequence in the .bin
  int64_t tokens = 0;
  std::vector<int64_t> documents;  // token offsets of the documents' starts
};

// `count` little-endian signed integers of `width` bytes from byte `at` of
// `file` (in bounds: checked by the caller), read in order a window at a
// time, so that an index of any size is parsed in a few MiB of memory.
class IndexStream {
 public:
  IndexStream(const RegularFileReader& file, int64_t at, int64_t count, int width)
      : file_(file), at_(at), left_(count), width_(width) {}
  absl::StatusOr<int64_t> Next() {
    if (pos_ == buffer_.size()) {
      const int64_t items = std::min<int64_t>(left_, kWindowBytes / width_);
      buffer_.resize(static_cast<size_t>(items * width_));
      RETURN_IF_ERROR(file_.ReadAt(at_, buffer_.data(), buffer_.size()));
      at_ += items * width_;
      left_ -= items;
      pos_ = 0;
    }
    const int64_t v = LoadLittleEndianSigned(buffer_.data() + pos_, width_);
    pos_ += static_cast<size_t>(width_);
    return v;
  }

 private:
  static constexpr int64_t kWindowBytes = int64_t{1} << 20;
  const RegularFileReader& file_;
  int64_t at_;
  int64_t left_;  // items not yet read into the buffer
  const int width_;
  std::vector<unsigned char> buffer_;
  size_t pos_ = 0;
};

// The .idx's header, then its sequence lengths and pointers (which must
// tile the .bin from the first pointer on), then its document boundaries,
// each read in order: the documents' token offsets are the running sums of
// the lengths up to each boundary.
//
// Its counts are bounded by the file's apparent size, which a sparse file
// makes as large as it likes for a few KiB on disk: the passes poll
// `stopped` (an abort ends them), and the documents' starts are kept only
// where they grow (an empty document adds no cut), after a check that they
// fit in memory.
absl::StatusOr<MegatronIndex> ParseMegatronIndex(const RegularFileReader& idx, int64_t bin_bytes,
                                                 const std::function<bool()>& stopped) {
  const std::string& where = idx.path();
  const int64_t idx_bytes = idx.size();
  auto bad = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
  };
  unsigned char header[kMegatronHeaderBytes];
  if (idx_bytes < kMegatronHeaderBytes) return bad("not a Megatron index (no MMIDIDX header)");
  RETURN_IF_ERROR(idx.ReadAt(0, header, sizeof(header)));
  if (std::memcmp(header, kMegatronMagic, 9) != 0) return bad("not a Megatron index (no MMIDIDX header)");
  if (U64At(header + 9) != 1) {
    return bad(absl::StrCat("index version ", U64At(header + 9), "; only version 1 is known"));
  }
  MegatronIndex out;
  switch (header[17]) {
    case 1: out.width = 1; break;                          // uint8
    case 2: out.width = 1, out.is_signed = true; break;    // int8
    case 3: out.width = 2, out.is_signed = true; break;    // int16
    case 4: out.width = 4, out.is_signed = true; break;    // int32
    case 5: out.width = 8, out.is_signed = true; break;    // int64
    case 8: out.width = 2; break;                          // uint16
    default:
      return bad(absl::StrCat("token dtype code ", static_cast<int>(header[17]),
                              " is not an integer type (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 8 uint16)"));
  }
  const uint64_t sequences = U64At(header + 18), docs = U64At(header + 26);
  // Each count fits easily once it is below the file's size.
  if (sequences > static_cast<uint64_t>(idx_bytes) || docs > static_cast<uint64_t>(idx_bytes)) {
    return bad("its counts are larger than the file");
  }
  const int64_t n = static_cast<int64_t>(sequences), d = static_cast<int64_t>(docs);
  // (Each product checked: a sparse file's size lets them pass int64.)
  const std::optional<int64_t> n12 = CheckedMul(n, 12), d8 = CheckedMul(d, 8);
  const std::optional<int64_t> body = n12.has_value() && d8.has_value() ? CheckedAdd(*n12, *d8) : std::nullopt;
  const std::optional<int64_t> need = body.has_value() ? CheckedAdd(kMegatronHeaderBytes, *body) : std::nullopt;
  if (!need.has_value() || *need > idx_bytes) {
    return bad(absl::StrCat(idx_bytes, " bytes cannot hold ", n, " sequences and ", d, " document boundaries"));
  }
  const int64_t lengths = kMegatronHeaderBytes, pointers = lengths + 4 * n, bounds = pointers + 8 * n;
  if (n == 0) return bad("it holds no sequence");
  const auto stop = [&](int64_t i) -> absl::Status {
    if ((i & 0xfffff) == 0 && stopped && stopped()) {
      return absl::CancelledError(absl::StrCat(where, ": stopped while its index was read"));
    }
    return absl::OkStatus();
  };
  IndexStream length(idx, lengths, n, 4), pointer(idx, pointers, n, 8);
  int64_t expected = 0;
  for (int64_t i = 0; i < n; ++i) {
    RETURN_IF_ERROR(stop(i));
    ASSIGN_OR_RETURN(const int64_t len, length.Next());
    ASSIGN_OR_RETURN(const int64_t at, pointer.Next());
    if (i == 0) out.first_byte = expected = at;
    if (len < 0) return bad(absl::StrCat("sequence ", i, " has length ", len));
    if (at != expected) {
      return bad(absl::StrCat("sequence ", i, " starts at byte ", at, ", not right after the one before (", expected,
                              "); only contiguous datasets are read"));
    }
    const std::optional<int64_t> end = at < 0 ? std::nullopt : CheckedAdd(at, len * out.width);
    if (!end.has_value() || *end > bin_bytes) {
      return bad(absl::StrCat("sequence ", i, " (", len, " tokens from byte ", at, ") runs past the .bin's ",
                              bin_bytes, " bytes"));
    }
    expected = *end;
    out.tokens += len;
  }
  if (out.tokens == 0) return bad("its sequences hold no tokens");
  unsigned char last[8];
  if (d >= 1) RETURN_IF_ERROR(idx.ReadAt(bounds + 8 * (d - 1), last, 8));
  IndexStream bound(idx, bounds, d, 8);
  int64_t from = 0;
  if (d >= 1) {
    ASSIGN_OR_RETURN(from, bound.Next());
  }
  if (d < 1 || from != 0 || LoadLittleEndianSigned(last, 8) != n) {
    return bad(absl::StrCat("its document boundaries do not run from sequence 0 to ", n));
  }
  // At most one start a token and one a boundary, 8 bytes each (twice as
  // the vector grows).
  const std::optional<int64_t> starts_bytes = CheckedMul(std::min(d, out.tokens + 1), 16);
  const int64_t available = AvailableHostMemoryBytes();
  if (!starts_bytes.has_value() || *starts_bytes > available) {
    return absl::ResourceExhaustedError(absl::StrCat(
        where, ": its ", d, " document boundaries would take ",
        starts_bytes.has_value() ? absl::StrCat(*starts_bytes >> 20, " MiB") : std::string("more than 8 EiB"),
        " of memory, and ", available >> 20, " MiB is available"));
  }
  // Sequence `next` starts at token `start` (the lengths' running sum):
  // boundaries only grow, so one pass over the lengths serves them all.
  IndexStream again(idx, lengths, n, 4);
  int64_t next = 0, start = 0;
  for (int64_t j = 0; j + 1 < d; ++j) {
    RETURN_IF_ERROR(stop(j));
    ASSIGN_OR_RETURN(const int64_t to, bound.Next());
    if (from < 0 || to < from || to > n) return bad(absl::StrCat("document ", j, " spans sequences ", from, "..", to));
    for (; next < from; ++next) {
      RETURN_IF_ERROR(stop(next));
      ASSIGN_OR_RETURN(const int64_t len, again.Next());
      start += len;
    }
    // (An empty last document, from == n, starts at the end.)
    if (out.documents.empty() || start > out.documents.back()) out.documents.push_back(start);
    from = to;
  }
  return out;  // d >= 2 here: bounds run from 0 to n >= 1
}

}  // namespace

absl::StatusOr<DataFormat> ParseDataFormat(const std::string& name) {
  if (name == "auto") return DataFormat::kAuto;
  if (name == "uint16") return DataFormat::kU16;
  if (name == "uint32") return DataFormat::kU32;
  if (name == "npy") return DataFormat::kNpy;
  if (name == "text") return DataFormat::kText;
  if (name == "jsonl") return DataFormat::kJsonl;
  if (name == "megatron") return DataFormat::kMegatron;
  // The names are spec/'s list (kDataFormats), which the coordinator and
  // coloctl check against: its message names them all.
  return absl::InvalidArgumentError(absl::StrCat("data format ", CheckDataFormat(name).message()));
}

absl::Status TokenCorpus::OpenTokens(const std::string& path, int64_t offset, int64_t tokens) {
  // The size checked on the descriptor: a file replaced by a FIFO after
  // RegularFileSize's stat does not block the open.
  ASSIGN_OR_RETURN(RegularFileReader bin, RegularFileReader::Open(path));
  const int64_t bytes = bin.size();
  if (offset < 0 || tokens < 1 || offset > bytes || tokens > (bytes - offset) / width_) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", bytes, " bytes do not hold ", tokens, " ",
                                                   width_ * 8, "-bit tokens from byte ", offset));
  }
  bin_.emplace(std::move(bin));
  file_offset_ = offset;
  size_ = tokens;
  return absl::OkStatus();
}

namespace {

// PATH without a .bin or .idx: a Megatron dataset's prefix.
std::string MegatronPrefix(const std::string& path) {
  return absl::EndsWith(path, ".bin") || absl::EndsWith(path, ".idx") ? path.substr(0, path.size() - 4) : path;
}

}  // namespace

std::vector<std::string> DataFiles(const std::string& path) {
  const std::string prefix = MegatronPrefix(path);
  return {path, prefix + ".bin", prefix + ".idx"};
}

DataFormat ResolveDataFormat(const std::string& path, DataFormat format) {
  if (format != DataFormat::kAuto) return format;
  const bool named_bin = absl::EndsWith(path, ".bin"), named_idx = absl::EndsWith(path, ".idx");
  const std::string prefix = MegatronPrefix(path);
  return named_idx || (named_bin && IsRegularFile(prefix + ".idx")) ? DataFormat::kMegatron
         : named_bin                                                ? DataFormat::kU16
         : absl::EndsWith(path, ".npy")                              ? DataFormat::kNpy
         : absl::EndsWith(path, ".jsonl")                            ? DataFormat::kJsonl
         : !IsRegularFile(path) && IsRegularFile(prefix + ".bin") && IsRegularFile(prefix + ".idx")
             ? DataFormat::kMegatron
             : DataFormat::kText;
}

void TokenCorpus::AddDocument(std::vector<int64_t> ids) {
  if (owned_.empty()) {
    owned_ = std::move(ids);  // the first (a whole file's, without a tokenizer): not copied
    return;
  }
  documents_.push_back(static_cast<int64_t>(owned_.size()));
  owned_.insert(owned_.end(), ids.begin(), ids.end());
}

namespace {

// Byte-level tokens of a document: its bytes, then <|endoftext|>.
std::vector<int64_t> ByteTokens(absl::string_view text) {
  std::vector<int64_t> ids;
  ids.reserve(text.size() + 1);
  for (unsigned char b : text) ids.push_back(b);
  ids.push_back(kEndOfText);
  return ids;
}

// Calls fn(line, line_number) for each line of `path` (without its '\n'; the
// last one also where no '\n' ends it), reading it a block at a time: a
// file larger than the memory is walked in the memory of its longest line.
// A regular file, read through the descriptor it was opened as (a FIFO
// that takes its place is never opened, nor read without end), up to the
// size it had then; a read error midway is an error, never a shorter walk.
absl::Status ForEachLine(const std::string& path,
                         const std::function<absl::Status(absl::string_view, int64_t)>& fn) {
  ASSIGN_OR_RETURN(const RegularFileReader file, RegularFileReader::Open(path));
  constexpr int64_t kBlock = int64_t{1} << 20;
  std::string block(static_cast<size_t>(std::min(kBlock, file.size())), '\0');
  std::string line;  // a line's start, from the blocks before
  int64_t line_no = 0;
  for (int64_t at = 0; at < file.size();) {
    const size_t n = static_cast<size_t>(std::min(kBlock, file.size() - at));
    RETURN_IF_ERROR(file.ReadAt(at, block.data(), n));
    at += static_cast<int64_t>(n);
    absl::string_view rest(block.data(), n);
    for (size_t end = rest.find('\n'); end != absl::string_view::npos; end = rest.find('\n')) {
      if (line.empty()) {
        RETURN_IF_ERROR(fn(rest.substr(0, end), ++line_no));
      } else {
        line.append(rest.data(), end);
        RETURN_IF_ERROR(fn(line, ++line_no));
        line.clear();
      }
      rest.remove_prefix(end + 1);
    }
    line.append(rest.data(), rest.size());
  }
  if (!line.empty()) RETURN_IF_ERROR(fn(line, ++line_no));
  return absl::OkStatus();
}

}  // namespace

absl::Status ForEachTextDocument(const std::string& path, DataFormat format, bool paragraphs,
                                 const std::function<absl::Status(absl::string_view, const std::string&)>& fn,
                                 int64_t max_bytes) {
  RETURN_IF_ERROR(RegularFileSize(path).status());
  if (format != DataFormat::kJsonl && !paragraphs) {
    ASSIGN_OR_RETURN(const std::string text, ReadFileToString(path, max_bytes));
    return fn(text, path);
  }
  if (format != DataFormat::kJsonl) {
    // Paragraphs: the lines up to a blank one (of only white space), joined
    // by the line breaks between them.
    std::string paragraph;
    bool open = false;
    RETURN_IF_ERROR(ForEachLine(path, [&](absl::string_view line, int64_t) -> absl::Status {
      if (absl::StripAsciiWhitespace(line).empty()) {
        if (open) RETURN_IF_ERROR(fn(paragraph, path));
        paragraph.clear();
        open = false;
        return absl::OkStatus();
      }
      if (open) paragraph += '\n';
      paragraph.append(line.data(), line.size());
      open = true;
      return absl::OkStatus();
    }));
    return open ? fn(paragraph, path) : absl::OkStatus();
  }
  return ForEachLine(path, [&](absl::string_view line, int64_t line_no) -> absl::Status {
    if (absl::StripAsciiWhitespace(line).empty()) return absl::OkStatus();
    const std::string where = absl::StrCat(path, ":", line_no);
    Json j = ParseJson(line);
    if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat(where, ": not a JSON object"));
    auto it = j.find("text");
    if (it == j.end() || !it->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": no string \"text\""));
    }
    return fn(it->get_ref<const std::string&>(), where);
  });
}

absl::StatusOr<NpyFootprint> NpyFootprintOf(const std::string& path) {
  ASSIGN_OR_RETURN(const int64_t bytes, RegularFileSize(path));
  NpyFootprint f;
  f.path = path;
  ASSIGN_OR_RETURN(f.info, ReadNpyInfo(path));
  f.read = NpyReadPeakBytes(f.info, bytes);
  // (A file shorter than its header says is refused by ReadNpy.)
  f.elements = f.info.element_bytes > 0 ? std::min(f.info.elements, bytes / f.info.element_bytes) : 0;
  f.tensor = CheckedMul(f.elements, f.info.tensor_element_bytes);
  return f;
}

std::optional<int64_t> NpyFootprint::TensorAndInt64s() const {
  // The vector, and before it a copy widened to i64 where the tensor is narrower.
  const std::optional<int64_t> copies = CheckedMul(elements, info.tensor_element_bytes >= 8 ? 8 : 16);
  return tensor.has_value() && copies.has_value() ? CheckedAdd(*tensor, *copies) : std::nullopt;
}

std::optional<int64_t> MaxBytes(std::optional<int64_t> a, std::optional<int64_t> b) {
  return a.has_value() && b.has_value() ? std::optional<int64_t>(std::max(*a, *b)) : std::nullopt;
}

std::optional<int64_t> SumBytes(std::optional<int64_t> a, std::optional<int64_t> b) {
  return a.has_value() && b.has_value() ? CheckedAdd(*a, *b) : std::nullopt;
}

namespace {

constexpr double kGiB = 1 << 30;

// OK where `need` bytes (nullopt: past int64) fit in the memory available
// now; else RESOURCE_EXHAUSTED: "WHAT would take N of memory HOW, and M is
// available: REMEDY".
absl::Status NeedFitsInMemory(const std::string& what, const char* how, std::optional<int64_t> need,
                              const std::string& remedy) {
  const int64_t available = AvailableHostMemoryBytes();
  if (need.has_value() && *need <= available) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrFormat(
      "%s would take %s of memory %s, and %.1f GiB is available: %s", what,
      need.has_value() ? absl::StrFormat("about %.1f GiB", *need / kGiB) : std::string("more than 8 EiB"), how,
      available / kGiB, remedy));
}

}  // namespace

absl::Status ArraysFitInMemory(const std::vector<std::string>& files, std::optional<int64_t> need) {
  return NeedFitsInMemory(absl::StrJoin(files, " and "), "while read", need,
                          "use fewer or smaller examples, or a worker with more memory");
}

namespace {

// A corpus held in memory as 8-byte tokens (.npy, text, jsonl) must fit
// there with what reading it holds at its peak (`need`, nullopt past int64):
// one that would not is refused before it is read, naming the way that reads
// tokens from disk instead (a worker that ran out would be killed mid-job,
// and every job on it with it).
absl::Status FitsInMemory(const std::string& path, int64_t file_bytes, std::optional<int64_t> need) {
  return NeedFitsInMemory(absl::StrFormat("%s (%.1f GiB)", path, file_bytes / kGiB), "as a token array", need,
                          absl::StrCat("tokenize it once (coloctl tokenize --model DIR --input ", path,
                                       " --out PREFIX) and train from PREFIX, which is read from disk"));
}

// a * b + c, nullopt past int64 (for sizes of files, which are non-negative).
std::optional<int64_t> MulAdd(int64_t a, int64_t b, int64_t c) {
  const std::optional<int64_t> ab = CheckedMul(a, b);
  return ab.has_value() ? CheckedAdd(*ab, c) : std::nullopt;
}

}  // namespace

absl::StatusOr<std::unique_ptr<TokenCorpus>> TokenCorpus::Open(const std::string& path, DataFormat format,
                                                               const Tokenizer* tokenizer,
                                                               const std::function<bool()>& stopped,
                                                               int64_t vocab_size) {
  if (vocab_size < 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": a model's vocabulary of ", vocab_size, " ids"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<TokenCorpus> c, OpenAnyIds(path, format, tokenizer, stopped));
  c->vocab_size_ = vocab_size;
  if (vocab_size == 0 || c->bin_.has_value()) return c;  // a file's tokens are checked as Read reads them
  // The tokens in memory (.npy, text), all of them now: a bad id is found
  // before the job starts, not at the step that first draws it.
  for (size_t i = 0; i < c->owned_.size(); ++i) {
    if (c->owned_[i] < 0 || c->owned_[i] >= vocab_size) {
      return c->OutsideTheVocabulary(path, static_cast<int64_t>(i), c->owned_[i]);
    }
  }
  return c;
}

absl::Status TokenCorpus::OutsideTheVocabulary(const std::string& path, int64_t at, int64_t id) const {
  return absl::InvalidArgumentError(absl::StrCat(path, ": token ", at, " of the corpus is id ", id,
                                                 ", outside the model's vocabulary [0, ", vocab_size_,
                                                 ") (config.json's vocab_size)"));
}

absl::StatusOr<std::unique_ptr<TokenCorpus>> TokenCorpus::OpenAnyIds(const std::string& path, DataFormat format,
                                                                     const Tokenizer* tokenizer,
                                                                     const std::function<bool()>& stopped) {
  format = ResolveDataFormat(path, format);
  const std::string prefix = MegatronPrefix(path);
  std::unique_ptr<TokenCorpus> c(new TokenCorpus());
  c->format_ = format;
  if (format == DataFormat::kMegatron) {
    const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
    RETURN_IF_ERROR(RegularFileSize(idx_path).status());
    ASSIGN_OR_RETURN(const int64_t bin_bytes, RegularFileSize(bin_path));
    ASSIGN_OR_RETURN(const RegularFileReader idx, RegularFileReader::Open(idx_path));
    ASSIGN_OR_RETURN(MegatronIndex index, ParseMegatronIndex(idx, bin_bytes, stopped));
    c->width_ = index.width;
    c->signed_ = index.is_signed;
    RETURN_IF_ERROR(c->OpenTokens(bin_path, index.first_byte, index.tokens));
    c->documents_ = std::move(index.documents);
    return c;
  }
  ASSIGN_OR_RETURN(const int64_t bytes, RegularFileSize(path));
  if (format == DataFormat::kNpy) {
    ASSIGN_OR_RETURN(const NpyFootprint npy, NpyFootprintOf(path));
    if (!npy.info.integer) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": token arrays must hold integers (<i8, <i4, <u2, <u4), not '", npy.info.descr, "'"));
    }
    // At the peak: what ReadNpy holds, or the tensor it returns and the
    // tokens taken from it.
    RETURN_IF_ERROR(FitsInMemory(path, bytes, MaxBytes(npy.read, npy.TensorAndInt64s())));
    ASSIGN_OR_RETURN(Tensor t, ReadNpy(path));
    ASSIGN_OR_RETURN(c->owned_, t.ReadInt64s());
    c->size_ = static_cast<int64_t>(c->owned_.size());
    if (c->size_ == 0) return absl::InvalidArgumentError(absl::StrCat(path, ": the array holds no tokens"));
    return c;
  }
  if (IsTextFormat(format)) {
    // A byte a token without a tokenizer, BPE's 3 to 4 (2 at worst in
    // practice). Text without a tokenizer is one document of the whole file:
    // the file and its tokens, moved in. Otherwise documents are read a line
    // at a time, and the tokens grow by doubling: twice their bytes as they
    // are copied.
    const bool whole = format != DataFormat::kJsonl && tokenizer == nullptr;
    RETURN_IF_ERROR(FitsInMemory(path, bytes,
                                 whole ? MulAdd(bytes, 8, bytes) : CheckedMul(bytes / (tokenizer == nullptr ? 1 : 2), 16)));
    const auto grow = [&](std::vector<int64_t>& v, size_t more) -> absl::Status {
      if (v.empty() || v.size() + more <= v.capacity()) return absl::OkStatus();  // (the first is moved in)
      const size_t next = std::max(v.size() + more, 2 * v.capacity());
      RETURN_IF_ERROR(FitsInMemory(path, bytes, CheckedMul(static_cast<int64_t>(next), 8)));
      v.reserve(next);
      return absl::OkStatus();
    };
    RETURN_IF_ERROR(ForEachTextDocument(
        path, format, /*paragraphs=*/tokenizer != nullptr,
        [&](absl::string_view doc, const std::string& where) -> absl::Status {
          if (stopped && stopped()) {
            return absl::CancelledError(absl::StrCat(path, ": stopped while its text was read, at ", where));
          }
          std::vector<int64_t> ids;
          if (tokenizer == nullptr) {
            ids = ByteTokens(doc);
          } else {
            absl::StatusOr<std::vector<int64_t>> encoded = tokenizer->EncodeDocument(doc);
            if (!encoded.ok()) {
              return absl::Status(encoded.status().code(), absl::StrCat(where, ": the ", tokenizer->kind(),
                                                                        " tokenizer: ", encoded.status().message()));
            }
            ids = *std::move(encoded);
          }
          // The arrays grow by doubling: each growth is checked against the
          // memory available, which the estimate above cannot know (short
          // paragraphs make a token a byte, and a start each).
          RETURN_IF_ERROR(grow(c->owned_, ids.size()));
          RETURN_IF_ERROR(grow(c->documents_, 1));
          c->AddDocument(std::move(ids));
          return absl::OkStatus();
        },
        bytes));
    c->size_ = static_cast<int64_t>(c->owned_.size());
    if (c->size_ == 0) return absl::InvalidArgumentError(absl::StrCat(path, " holds no document"));
    return c;
  }
  c->width_ = format == DataFormat::kU16 ? 2 : 4;
  if (bytes % c->width_ != 0) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", bytes, " bytes is not a whole number of ",
                                                   c->width_ * 8, "-bit tokens"));
  }
  RETURN_IF_ERROR(c->OpenTokens(path, 0, bytes / c->width_));
  return c;
}

absl::Status TokenCorpus::Read(int64_t start, int64_t n, int64_t* out) const {
  if (start < 0 || n < 0 || start > size_ || n > size_ - start) {
    return absl::OutOfRangeError(absl::StrCat("tokens [", start, ", ", start + n, ") outside the corpus of ",
                                              size_));
  }
  if (!bin_.has_value()) {
    std::copy(owned_.begin() + start, owned_.begin() + start + n, out);
    return absl::OkStatus();
  }
  // Fits: start + n <= size_, whose bytes Open checked against the file's.
  std::vector<unsigned char> bytes(static_cast<size_t>(n * width_));
  RETURN_IF_ERROR(bin_->ReadAt(file_offset_ + start * width_, bytes.data(), bytes.size()));
  // Little-endian on disk; read byte by byte so the host order does not matter.
  for (int64_t i = 0; i < n; ++i) {
    const unsigned char* p = bytes.data() + i * width_;
    out[i] = signed_ ? LoadLittleEndianSigned(p, width_) : static_cast<int64_t>(LoadLittleEndian(p, width_));
    if (vocab_size_ > 0 && (out[i] < 0 || out[i] >= vocab_size_)) {
      return OutsideTheVocabulary(bin_->path(), start + i, out[i]);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> TokenCorpus::Window(int64_t start, int64_t length) const {
  if (length < 0) return absl::OutOfRangeError(absl::StrCat("a window of ", length, " tokens"));
  std::vector<int64_t> v(static_cast<size_t>(std::min(length, size_)));
  RETURN_IF_ERROR(Read(start, length, v.data()));
  return Tensor::FromInt64s({length}, v);
}

absl::StatusOr<int64_t> HeldOutStart(const TokenCorpus& corpus, double fraction, int64_t min_tokens) {
  if (!(fraction > 0 && fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("eval_split ", fraction, " is not in (0, 1)"));
  }
  const int64_t n = corpus.size();
  const double target = (1 - fraction) * static_cast<double>(n);
  const auto fits = [&](int64_t at) { return at >= min_tokens && n - at >= min_tokens; };
  const std::vector<int64_t>& docs = corpus.documents();
  std::optional<int64_t> best;
  for (const int64_t d : docs) {
    if (d <= 0 || d >= n || !fits(d)) continue;
    if (!best.has_value() || std::abs(static_cast<double>(d) - target) < std::abs(static_cast<double>(*best) - target)) {
      best = d;
    }
  }
  if (docs.size() > 1) {
    if (best.has_value()) return *best;
    return absl::InvalidArgumentError(absl::StrCat(
        "eval_split ", fraction, ": no document boundary of the corpus (", docs.size(), " documents, ", n,
        " tokens) leaves both the training and the held-out part a window of ", min_tokens, " tokens"));
  }
  const int64_t at = std::clamp<int64_t>(std::llround(target), 0, n);
  if (!fits(at)) {
    return absl::InvalidArgumentError(absl::StrCat("eval_split ", fraction, " of a corpus of ", n,
                                                   " tokens leaves a part shorter than a window of ", min_tokens,
                                                   " tokens"));
  }
  return at;
}

absl::StatusOr<int64_t> HeldOutStart(int64_t examples, double fraction) {
  if (!(fraction > 0 && fraction < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("eval_split ", fraction, " is not in (0, 1)"));
  }
  const int64_t held = std::max<int64_t>(1, std::llround(fraction * static_cast<double>(examples)));
  if (examples - held < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("eval_split ", fraction, " of ", examples, " examples leaves none to train on"));
  }
  return examples - held;
}

absl::StatusOr<SampleRange> BatchSampler::Resolve(SampleRange range, int64_t size) {
  if (range.end < 0) range.end = size;
  if (range.begin < 0 || range.begin > range.end || range.end > size) {
    return absl::InvalidArgumentError(
        absl::StrCat("sample range [", range.begin, ", ", range.end, ") is outside [0, ", size, ")"));
  }
  return range;
}

absl::StatusOr<BatchSampler> BatchSampler::Create(int64_t corpus_tokens, int64_t seq_len, int64_t global_batch,
                                                  int dp, uint64_t seed, SampleRange range) {
  if (seq_len < 1 || global_batch < 1 || dp < 1) {
    return absl::InvalidArgumentError("seq_len, the batch size and dp must be positive");
  }
  ASSIGN_OR_RETURN(range, Resolve(range, corpus_tokens));
  const int64_t tokens = range.end - range.begin;
  if (tokens < seq_len + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        range.begin == 0 && range.end == corpus_tokens ? "the corpus has " : "the corpus' part has ", tokens,
        " tokens, fewer than one window of seq_len + 1 = ", seq_len + 1));
  }
  if (global_batch % dp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the batch of ", global_batch, " sequences does not split over data_parallel_size ", dp));
  }
  return BatchSampler(tokens, seq_len, global_batch, dp, seed, range.begin, range.sequential);
}

absl::StatusOr<BatchSampler> BatchSampler::ForExamples(int64_t examples, int64_t global_batch, int dp,
                                                       uint64_t seed, SampleRange range) {
  if (examples < 1 || global_batch < 1 || dp < 1) {
    return absl::InvalidArgumentError("the examples, the batch size and dp must be positive");
  }
  ASSIGN_OR_RETURN(range, Resolve(range, examples));
  if (range.end == range.begin) return absl::InvalidArgumentError("the sample range holds no example");
  if (global_batch % dp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the batch of ", global_batch, " examples does not split over data_parallel_size ", dp));
  }
  // Starts: the range's examples.
  return BatchSampler(range.end - range.begin, /*seq_len=*/0, global_batch, dp, seed, range.begin, range.sequential);
}

int64_t BatchSampler::windows() const {
  return seq_len_ == 0 ? corpus_tokens_ : (corpus_tokens_ - 1) / seq_len_;
}

std::vector<int64_t> BatchSampler::Starts(int64_t step) const { return Starts(step, 0, global_batch_); }

std::vector<int64_t> BatchSampler::Starts(int64_t step, int64_t first, int64_t count) const {
  first = std::clamp<int64_t>(first, 0, global_batch_);
  count = std::clamp<int64_t>(count, 0, global_batch_ - first);
  std::vector<int64_t> starts(static_cast<size_t>(count));
  if (sequential_) {
    const int64_t stride = std::max<int64_t>(seq_len_, 1);
    const uint64_t period = static_cast<uint64_t>(windows());
    for (int64_t i = 0; i < count; ++i) {
      const uint64_t r = static_cast<uint64_t>(first + i);
      const uint64_t w = (static_cast<uint64_t>(step) * static_cast<uint64_t>(global_batch_) + r) % period;
      starts[i] = begin_ + static_cast<int64_t>(w) * stride;
    }
    return starts;
  }
  const uint64_t windows = static_cast<uint64_t>(corpus_tokens_ - seq_len_);  // last start: n - (seq_len + 1)
  const uint64_t mixed = Mix(seed_ ^ Mix(static_cast<uint64_t>(step)));
  for (int64_t i = 0; i < count; ++i) {
    starts[i] = begin_ + static_cast<int64_t>(Mix(mixed + static_cast<uint64_t>(first + i)) % windows);
  }
  return starts;
}

namespace {

// MaskedLm's draws for one position: whether it is masked, then how it is
// read and which random id; from (seed, step, global row, position) alone.
struct MaskDraw {
  bool masked;
  uint64_t how, random_id;
};

uint64_t MaskRowKey(uint64_t seed, int64_t step, int64_t row) {
  constexpr uint64_t kMaskSalt = 0x6d61736b65646c6dULL;  // "maskedlm": not the starts' stream
  return Mix(Mix(seed ^ kMaskSalt ^ Mix(static_cast<uint64_t>(step))) + static_cast<uint64_t>(row));
}

// Whether the position is masked: the first of its three draws.
bool IsMasked(uint64_t row_key, int64_t position) {
  // 0.15 of 2^64, below which a draw masks.
  constexpr uint64_t kBelow = static_cast<uint64_t>(MaskedLm::kMaskedFraction * 18446744073709551616.0);
  return Mix(row_key + 3 * static_cast<uint64_t>(position)) < kBelow;
}

MaskDraw DrawMask(uint64_t row_key, int64_t position) {
  const uint64_t at = row_key + 3 * static_cast<uint64_t>(position);
  return MaskDraw{.masked = IsMasked(row_key, position), .how = Mix(at + 1), .random_id = Mix(at + 2)};
}

}  // namespace

int64_t BatchSampler::MaskedPositions(int64_t step, int64_t first, int64_t count) const {
  first = std::clamp<int64_t>(first, 0, global_batch_);
  count = std::clamp<int64_t>(count, 0, global_batch_ - first);
  int64_t masked = 0;
  for (int64_t r = first; r < first + count; ++r) {
    const uint64_t key = MaskRowKey(seed_, step, r);
    for (int64_t p = 0; p < seq_len_; ++p) masked += IsMasked(key, p) ? 1 : 0;  // (every step, on every rank)
  }
  return masked;
}

absl::Status BatchSampler::Batch(const TokenCorpus& corpus, int64_t step, int replica, Tensor* inputs, Tensor* labels,
                                 int64_t first, int64_t count, const MaskedLm* masked) const {
  const int64_t replica_rows = global_batch_ / dp_;
  if (count < 0) count = replica_rows - first;
  if (replica < 0 || replica >= dp_) {
    return absl::InvalidArgumentError(absl::StrCat("replica ", replica, " of ", dp_));
  }
  if (first < 0 || count < 0 || first > replica_rows - count) {
    return absl::InvalidArgumentError(absl::StrCat("rows [", first, ", ", first + count, ") of a replica's ",
                                                   replica_rows));
  }
  const int64_t rows = count;
  // Only this pass's rows of the step (a step may hold 2^31 of them).
  const std::vector<int64_t> starts = Starts(step, replica * replica_rows + first, rows);
  std::vector<int64_t> in(rows * seq_len_), out(rows * seq_len_), window(seq_len_ + 1);
  if (masked != nullptr &&
      (masked->vocab_size < 1 || masked->mask_token_id < 0 || masked->mask_token_id >= masked->vocab_size)) {
    return absl::InvalidArgumentError(
        absl::StrCat("mask_token_id ", masked->mask_token_id, " is not an id of a vocabulary of ", masked->vocab_size));
  }
  for (int64_t r = 0; r < rows; ++r) {
    RETURN_IF_ERROR(corpus.Read(starts[r], seq_len_ + 1, window.data()));
    if (masked == nullptr) {
      std::copy(window.begin(), window.end() - 1, in.begin() + r * seq_len_);
      std::copy(window.begin() + 1, window.end(), out.begin() + r * seq_len_);
      continue;
    }
    const uint64_t key = MaskRowKey(seed_, step, replica * replica_rows + first + r);
    for (int64_t p = 0; p < seq_len_; ++p) {
      const int64_t token = window[p];
      const MaskDraw d = DrawMask(key, p);
      int64_t read = token;
      if (d.masked && d.how % 10 < 8) {
        read = masked->mask_token_id;
      } else if (d.masked && d.how % 10 == 8) {
        read = static_cast<int64_t>(d.random_id % static_cast<uint64_t>(masked->vocab_size));
      }
      in[r * seq_len_ + p] = read;
      out[r * seq_len_ + p] = d.masked ? token : int64_t{-100};
    }
  }
  ASSIGN_OR_RETURN(*inputs, Tensor::FromInt64s({rows, seq_len_}, in));
  ASSIGN_OR_RETURN(*labels, Tensor::FromInt64s({rows, seq_len_}, out));
  return absl::OkStatus();
}

}  // namespace colod::train
