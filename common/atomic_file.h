#ifndef COLOD_COMMON_ATOMIC_FILE_H_
#define COLOD_COMMON_ATOMIC_FILE_H_

#include <sys/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace colod {

// Writes `contents` to `path` so that readers see the old file or the whole
// new one, never a part, even across a crash: a unique temporary name in the
// same directory, fsync, rename over `path`, fsync of the directory. On
// failure the temporary file is removed and the status is FileError's.
// FAILED_PRECONDITION, before anything is written, when `path` is there
// but not a regular file (a symbolic link, a FIFO, a device, a directory),
// which the rename would replace.
// Thread-safe.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents);
// The same, with `before_rename` run once the temporary file is whole and
// durable, just before the rename: its error removes the temporary file and
// is returned. A writer of two files renames the other one there, so that no
// write (a full disk) can fail between the two renames.
absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents,
                                 const std::function<absl::Status()>& before_rename);
// The same for contents in pieces, written one after the other (a header
// and large payloads, never copied into one buffer).
absl::Status WriteFileAtomically(const std::string& path, absl::Span<const absl::string_view> pieces,
                                 const std::function<absl::Status()>& before_rename);
// The same for contents `produce` makes as it goes, handing each piece to
// `write` (which returns the write's error): a model's tensors made one at a
// time, never all held at once. An error of `produce` removes the temporary
// file and is returned.
using PieceWriter = std::function<absl::Status(absl::string_view piece)>;
absl::Status WriteFileAtomicallyStreamed(const std::string& path,
                                         const std::function<absl::Status(const PieceWriter&)>& produce,
                                         const std::function<absl::Status()>& before_rename);
// open(path, flags | O_CLOEXEC) that never waits for a FIFO's other end
// (opened O_NONBLOCK: a FIFO without a writer opens for reading, one without
// a reader fails ENXIO for writing), then blocking again for what follows:
// a network file system may answer a non-blocking read EAGAIN. -1 with
// errno set on failure.
int OpenWithoutWaiting(const std::string& path, int flags);
// Writes all of `bytes` to `fd`, retrying short writes and EINTR:
// FileError("cannot write", path, errno) when a write fails (EIO for one
// that writes nothing).
absl::Status WriteAll(int fd, absl::string_view bytes, absl::string_view path);
// The temporary files this process is writing (WriteFileAtomically's, a
// MegatronWriter's), until they are renamed or removed: a process that a
// signal ends (coloctl-run's Ctrl-C) removes them with
// RemoveTemporaryFiles, where otherwise a tokenizer's gigabytes stayed.
// Thread-safe.
// Register before the file is made, and call TemporaryFileMade once it is:
// where the cleanup ran in between, it removes the file and blocks for good.
void RegisterTemporaryFile(const std::string& path);
void TemporaryFileMade(const std::string& path);
void UnregisterTemporaryFile(const std::string& path);
// Removes every registered file, for a process about to end: how many it
// removed. A file registered after it blocks its caller for good (the
// process ends).
int RemoveTemporaryFiles();

// Whether `name` (a directory entry) is a temporary file WriteFileAtomically
// leaves behind when its process dies mid-write: NAME.tmp.PID.N. A daemon
// that owns its directory (its lock held) removes them at start.
bool IsAtomicWriteLeftover(absl::string_view name);
// OK when `path` is absent or a regular file, which WriteFileAtomically may
// replace; otherwise its FAILED_PRECONDITION. A writer of several files
// checks every destination with it before it writes any, so that a refusal
// never leaves half a model or a dataset.
absl::Status CheckReplaceable(const std::string& path);

// A failed file operation as a status naming it, the path and errno's text:
// RESOURCE_EXHAUSTED when the disk, a quota or the file size limit is full
// (ENOSPC, EDQUOT, EFBIG), which may pass once space is freed; UNAVAILABLE
// for an error of the moment that a retry may not meet (EIO, ESTALE: an NFS
// handle gone stale, EMFILE, ENFILE, ENOMEM, EINTR, EAGAIN), which the
// coordinator restarts a job after; otherwise FAILED_PRECONDITION.
absl::Status FileError(absl::string_view what, absl::string_view path, int err);

// What a file that is not a regular one is, for messages: "a directory",
// "a FIFO", "a character device", "a block device", "a socket", "a symbolic
// link" (of an lstat), else "not a regular file".
const char* FileKind(mode_t mode);

// The whole content of `path`, a regular file or a pipe (a shell's <(...)):
// NOT_FOUND naming it when it does not exist; FAILED_PRECONDITION (FileError's
// status) when it cannot be opened, is a directory or a device, or reading
// fails midway (never a shorter content). A FIFO without a writer reads as
// empty rather than blocking.
absl::StatusOr<std::string> ReadFileToString(const std::string& path);
// The whole content of `path`, a regular file of at most `max_bytes` (what
// the caller measured or allows), read through the descriptor it was
// opened as (RegularFileReader: never waited on; a FIFO or a device is
// INVALID_ARGUMENT, so one swapped in after the caller's check can neither
// block the read nor feed it without end); FAILED_PRECONDITION where it
// holds more than `max_bytes` (it grew since it was measured, or is past
// what such a file holds), nothing of it read.
absl::StatusOr<std::string> ReadFileToString(const std::string& path, int64_t max_bytes);

// A regular file open for reads at given offsets, closed when it goes. The
// way a daemon reads large inputs (weights, token files) rather than mapping
// them: a file cut short while in use is then an error, DATA_LOSS, where a
// map's page beyond the new end kills the whole daemon with SIGBUS.
// Thread-safety: ReadAt may run concurrently (pread); moving is not.
class RegularFileReader {
 public:
  // Never blocks in open (a FIFO without a writer would, where no abort
  // reaches it). NOT_FOUND naming `path` when it does not exist;
  // INVALID_ARGUMENT "PATH is a directory (a FIFO, a character device, ...),
  // not a regular file"; FileError's status for anything else (EACCES).
  static absl::StatusOr<RegularFileReader> Open(const std::string& path);
  RegularFileReader(RegularFileReader&& other) noexcept;
  RegularFileReader& operator=(RegularFileReader&& other) noexcept;
  RegularFileReader(const RegularFileReader&) = delete;
  RegularFileReader& operator=(const RegularFileReader&) = delete;
  ~RegularFileReader();

  const std::string& path() const { return path_; }
  // The size when it was opened.
  int64_t size() const { return size_; }
  // Exactly `n` bytes from `offset` into `dst`: DATA_LOSS naming the path and
  // the byte where the file ended before them (it shrank since Open), or
  // FileError's status ("cannot read", EIO: UNAVAILABLE). INVALID_ARGUMENT
  // for a negative offset or one that overflows with `n`.
  absl::Status ReadAt(int64_t offset, void* dst, size_t n) const;

 private:
  RegularFileReader(std::string path, int fd, int64_t size) : path_(std::move(path)), fd_(fd), size_(size) {}
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

// Raises this process's soft limit of open files to its hard limit, once,
// as servers do: a coordinator serves a connection for each worker and
// client, and consolidating or resuming a checkpoint holds a file of each
// rank open (RegularFileReader): more than the usual soft limit of 1024 at
// a thousand ranks. Returns the soft limit now (0 if it cannot be read).
// Thread-safe.
uint64_t RaiseOpenFileLimit();

// The names of `dir`'s entries, "." and ".." left out, in no particular
// order: NOT_FOUND naming it when it cannot be opened (missing, not a
// directory, no permission), UNAVAILABLE when reading it fails midway (never
// a shorter list: a caller that prunes or resumes from it would act on a part
// without a word). Never throws, as a range-for over
// std::filesystem::directory_iterator does.
absl::StatusOr<std::vector<std::string>> ListDirectory(const std::string& dir);

// Makes a directory written file by file durable before it is renamed into
// place: fsyncs each regular file directly in `dir` (not links, not
// subdirectories), then `dir` itself. FileError's status naming the file
// that failed (EIO: a write-back the page cache lost).
absl::Status SyncFilesAndDirectory(const std::string& dir);
// fsync of the directory `dir`: a rename into it is durable once it returns.
absl::Status SyncDirectory(const std::string& dir);

// Removes the oldest regular files directly in `dir` (by modification
// time, then name) so that at most `keep` remain: a folder of dumps or
// reports a daemon writes for every failure, bounded. Links,
// subdirectories and what cannot be read are left alone; returns how many
// it removed.
size_t RemoveOldestFiles(const std::string& dir, size_t keep);

// Creates `dir` and takes an exclusive flock on DIR/LOCK (writing this
// process's id in it), so that no second daemon shares the directory: the
// returned descriptor holds the lock until it is closed (or the process
// ends). FAILED_PRECONDITION naming `flag` (--data-dir) and saying that
// another `holder` (coordinator) has it when the lock is taken. `made`, if
// given, gets the outermost directory this call created (`dir` or a parent
// of it; empty when `dir` was there, or when the call fails: a directory
// another daemon locked is never the caller's to remove), for a caller whose
// start fails after it to remove.
absl::StatusOr<int> LockDirectory(const std::string& dir, absl::string_view flag, absl::string_view holder,
                                  std::string* made = nullptr);

// Room left for an unprivileged process on the file system holding `dir`
// (statvfs's f_bavail blocks, f_favail inodes), and its size (f_blocks);
// free_inodes is -1 where the file system counts none (btrfs, some network
// ones). FileError's status where `dir` cannot be examined.
struct DiskSpace {
  int64_t free_bytes = 0;
  int64_t total_bytes = 0;
  int64_t free_inodes = -1;
};
absl::StatusOr<DiskSpace> FreeDiskSpace(const std::string& dir);

// Whether `path` names a regular file (following links).
bool IsRegularFile(const std::string& path);

// True for a name that stays inside the directory it is joined to: not
// empty, at most 255 bytes, no '/' or NUL, not "." or "..". For file names
// that arrive over the wire (model uploads).
bool IsPlainFileName(absl::string_view name);

}  // namespace colod

#endif  // COLOD_COMMON_ATOMIC_FILE_H_
