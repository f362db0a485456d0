#include "worker/train/megatron_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/status_macros.h"

namespace colod::train {
namespace {

void PutLittleEndian(std::string* out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

constexpr size_t kBufferBytes = 1 << 20;

}  // namespace

MegatronWriter::MegatronWriter(std::string prefix, int64_t vocab, int fd, std::string tmp)
    : prefix_(std::move(prefix)), vocab_(vocab), width_(vocab < 65500 ? 2 : 4), fd_(fd), tmp_(std::move(tmp)) {
  buffer_.reserve(kBufferBytes + 8);
}

absl::StatusOr<std::unique_ptr<MegatronWriter>> MegatronWriter::Create(const std::string& prefix,
                                                                        int64_t vocab_size) {
  if (vocab_size < 1 || vocab_size > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("a vocabulary of ", vocab_size, " ids does not fit int32 tokens"));
  }
  // Both destinations before a token is written (Finish renames them).
  for (const char* ext : {".bin", ".idx"}) RETURN_IF_ERROR(CheckReplaceable(prefix + ext));
  static std::atomic<uint64_t> counter{0};
  const std::string tmp = absl::StrCat(prefix, ".bin.tmp.", ::getpid(), ".", counter++);
  RegisterTemporaryFile(tmp);  // removed if a signal ends the process (coloctl tokenize's Ctrl-C)
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    const int error = errno;
    UnregisterTemporaryFile(tmp);
    return FileError("cannot create", tmp, error);
  }
  TemporaryFileMade(tmp);
  return std::unique_ptr<MegatronWriter>(new MegatronWriter(prefix, vocab_size, fd, tmp));
}

MegatronWriter::~MegatronWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!finished_) std::remove(tmp_.c_str());
  UnregisterTemporaryFile(tmp_);
}

absl::Status MegatronWriter::Flush() {
  RETURN_IF_ERROR(WriteAll(fd_, buffer_, tmp_));
  buffer_.clear();
  return absl::OkStatus();
}

absl::Status MegatronWriter::AddDocument(absl::Span<const int64_t> ids) {
  if (finished_ || fd_ < 0) return absl::FailedPreconditionError("the dataset is already written");
  if (ids.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat("a document of ", ids.size(), " tokens is over Megatron's 2^31 - 1"));
  }
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab_) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", id, " is outside the vocabulary of ", vocab_));
    }
    PutLittleEndian(&buffer_, static_cast<uint64_t>(id), width_);
    if (buffer_.size() >= kBufferBytes) RETURN_IF_ERROR(Flush());
  }
  lengths_.push_back(static_cast<int32_t>(ids.size()));
  tokens_ += static_cast<int64_t>(ids.size());
  return absl::OkStatus();
}

absl::Status MegatronWriter::Finish() {
  if (finished_ || fd_ < 0) return absl::FailedPreconditionError("the dataset is already written");
  RETURN_IF_ERROR(Flush());
  if (::fsync(fd_) != 0) return FileError("cannot fsync", tmp_, errno);
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) return FileError("cannot close", tmp_, errno);
  // The index: header, version 1, dtype code (8 uint16, 4 int32), counts,
  // each sequence's length and byte offset, the document boundaries.
  std::string idx("MMIDIDX\0\0", 9);
  PutLittleEndian(&idx, 1, 8);
  PutLittleEndian(&idx, width_ == 2 ? 8 : 4, 1);
  PutLittleEndian(&idx, lengths_.size(), 8);
  PutLittleEndian(&idx, lengths_.size() + 1, 8);
  for (int32_t n : lengths_) PutLittleEndian(&idx, static_cast<uint32_t>(n), 4);
  uint64_t offset = 0;
  for (int32_t n : lengths_) {
    PutLittleEndian(&idx, offset, 8);
    offset += static_cast<uint64_t>(n) * static_cast<uint64_t>(width_);
  }
  for (size_t d = 0; d <= lengths_.size(); ++d) PutLittleEndian(&idx, d, 8);
  // The .bin is renamed once the .idx is written and durable, just before
  // the .idx's own rename: a full disk fails before either.
  return WriteFileAtomically(prefix_ + ".idx", idx, [this] {
    const std::string bin = prefix_ + ".bin";
    if (std::rename(tmp_.c_str(), bin.c_str()) != 0) return FileError("cannot rename to", bin, errno);
    finished_ = true;
    return absl::OkStatus();
  });
}

}  // namespace colod::train
