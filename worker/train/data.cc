#include "worker/train/data.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/status_macros.h"
#include "worker/tensor/npy.h"

namespace colod::train {
namespace {

// splitmix64: a well-mixed 64-bit hash of (seed, step, row).
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

}  // namespace

absl::StatusOr<DataFormat> ParseDataFormat(const std::string& name) {
  if (name == "auto") return DataFormat::kAuto;
  if (name == "uint16") return DataFormat::kU16;
  if (name == "uint32") return DataFormat::kU32;
  if (name == "npy") return DataFormat::kNpy;
  if (name == "text") return DataFormat::kText;
  return absl::InvalidArgumentError(
      absl::StrCat("data format '", name, "' is not one of auto, uint16, uint32, npy, text"));
}

TokenCorpus::~TokenCorpus() {
  if (map_ != nullptr) ::munmap(const_cast<void*>(map_), map_bytes_);
}

absl::StatusOr<std::unique_ptr<TokenCorpus>> TokenCorpus::Open(const std::string& path, DataFormat format) {
  if (format == DataFormat::kAuto) {
    format = absl::EndsWith(path, ".bin") ? DataFormat::kU16
             : absl::EndsWith(path, ".npy") ? DataFormat::kNpy
                                            : DataFormat::kText;
  }
  // Only a regular file: a FIFO or a device would block the rank in open or
  // read (where no abort reaches it) or never end, and is read only once
  // while training samples it again and again.
  struct stat info;
  if (::stat(path.c_str(), &info) != 0) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(info.st_mode)) {
    const char* kind = S_ISDIR(info.st_mode)    ? "a directory"
                       : S_ISFIFO(info.st_mode) ? "a FIFO"
                       : S_ISCHR(info.st_mode)  ? "a character device"
                       : S_ISBLK(info.st_mode)  ? "a block device"
                       : S_ISSOCK(info.st_mode) ? "a socket"
                                                : "not a regular file";
    return absl::InvalidArgumentError(absl::StrCat(path, " is ", kind, "; training data must be a regular file"));
  }
  if (info.st_size == 0) return absl::InvalidArgumentError(absl::StrCat(path, " is empty"));
  std::unique_ptr<TokenCorpus> c(new TokenCorpus());
  c->format_ = format;
  if (format == DataFormat::kNpy) {
    ASSIGN_OR_RETURN(Tensor t, ReadNpy(path));
    if (t.dtype() != DType::kI64 && t.dtype() != DType::kI32) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": token arrays must hold integers, not ",
                                                     DTypeName(t.dtype())));
    }
    c->owned_ = t.ToInt64s();
    c->size_ = static_cast<int64_t>(c->owned_.size());
    if (c->size_ == 0) return absl::InvalidArgumentError(absl::StrCat(path, ": the array holds no tokens"));
    return c;
  }
  if (format == DataFormat::kText) {
    ASSIGN_OR_RETURN(const std::string text, ReadFileToString(path));
    c->owned_.reserve(text.size() + 1);
    for (unsigned char b : text) c->owned_.push_back(b);
    c->owned_.push_back(kEndOfText);
    c->size_ = static_cast<int64_t>(c->owned_.size());
    return c;
  }
  const size_t width = format == DataFormat::kU16 ? 2 : 4;
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // replaced by a FIFO meanwhile: no wait
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  struct stat st;
  if (::fstat(fd, &st) != 0 || st.st_size == 0 || st.st_size % width != 0) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", st.st_size, " bytes is not a whole number of ",
                                                   width * 8, "-bit tokens"));
  }
  void* map = ::mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return absl::InternalError(absl::StrCat("cannot map ", path, ": ", std::strerror(errno)));
  c->map_ = map;
  c->map_bytes_ = st.st_size;
  c->size_ = st.st_size / static_cast<int64_t>(width);
  return c;
}

int64_t TokenCorpus::token(int64_t i) const {
  if (map_ == nullptr) return owned_[i];
  // Little-endian on disk; read byte by byte so the host order does not matter.
  const auto* p = static_cast<const unsigned char*>(map_);
  if (format_ == DataFormat::kU16) return p[2 * i] | (p[2 * i + 1] << 8);
  return static_cast<int64_t>(p[4 * i]) | (static_cast<int64_t>(p[4 * i + 1]) << 8) |
         (static_cast<int64_t>(p[4 * i + 2]) << 16) | (static_cast<int64_t>(p[4 * i + 3]) << 24);
}

absl::StatusOr<Tensor> TokenCorpus::Window(int64_t start, int64_t length) const {
  if (start < 0 || length < 0 || start > size_ || length > size_ - start) {
    return absl::OutOfRangeError(absl::StrCat("tokens [", start, ", ", start + length, ") outside the corpus of ",
                                              size_));
  }
  std::vector<int64_t> v(length);
  for (int64_t i = 0; i < length; ++i) v[i] = token(start + i);
  return Tensor::FromInt64s({length}, v);
}

absl::StatusOr<BatchSampler> BatchSampler::Create(int64_t corpus_tokens, int64_t seq_len, int64_t global_batch,
                                                  int dp, uint64_t seed) {
  if (seq_len < 1 || global_batch < 1 || dp < 1) {
    return absl::InvalidArgumentError("seq_len, the batch size and dp must be positive");
  }
  if (corpus_tokens < seq_len + 1) {
    return absl::InvalidArgumentError(absl::StrCat("the corpus has ", corpus_tokens,
                                                   " tokens, fewer than one window of seq_len + 1 = ", seq_len + 1));
  }
  if (global_batch % dp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("the batch of ", global_batch, " sequences does not split over data_parallel_size ", dp));
  }
  return BatchSampler(corpus_tokens, seq_len, global_batch, dp, seed);
}

std::vector<int64_t> BatchSampler::Starts(int64_t step) const {
  const uint64_t windows = static_cast<uint64_t>(corpus_tokens_ - seq_len_);  // last start: n - (seq_len + 1)
  std::vector<int64_t> starts(global_batch_);
  for (int64_t r = 0; r < global_batch_; ++r) {
    starts[r] = static_cast<int64_t>(Mix(Mix(seed_ ^ Mix(static_cast<uint64_t>(step))) + r) % windows);
  }
  return starts;
}

absl::Status BatchSampler::Batch(const TokenCorpus& corpus, int64_t step, int replica, Tensor* inputs,
                                 Tensor* labels) const {
  const int64_t rows = global_batch_ / dp_;
  const std::vector<int64_t> starts = Starts(step);
  std::vector<int64_t> in(rows * seq_len_), out(rows * seq_len_);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t s = starts[replica * rows + r];
    for (int64_t j = 0; j < seq_len_; ++j) {
      in[r * seq_len_ + j] = corpus.token(s + j);
      out[r * seq_len_ + j] = corpus.token(s + j + 1);
    }
  }
  ASSIGN_OR_RETURN(*inputs, Tensor::FromInt64s({rows, seq_len_}, in));
  ASSIGN_OR_RETURN(*labels, Tensor::FromInt64s({rows, seq_len_}, out));
  return absl::OkStatus();
}

}  // namespace colod::train
