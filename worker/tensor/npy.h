// NumPy .npy files (format versions 1.0, 2.0 and 3.0): a magic string, the
// version, a header dict {'descr', 'fortran_order', 'shape'} and the raw
// array. colod reads little-endian f4, f2, i8, i4 (kept as they are), u2 and
// u4 (token files; read as i64), and b1/u1 are refused; C order only. It
// writes f4, f2, i8 and i4 in version 1.0.
//
// Thread-safe (no shared state).
#ifndef COLOD_WORKER_TENSOR_NPY_H_
#define COLOD_WORKER_TENSOR_NPY_H_

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "worker/tensor/tensor.h"

namespace colod {

// Which files ReadNpy reads. A worker reads regular files only: a FIFO
// whose writer never writes would hold its rank in a read no abort ends. A
// command line may name a pipe too (a shell's <(...)).
enum class NpySource { kRegularFile, kRegularFileOrPipe };

// NOT_FOUND for a missing file; INVALID_ARGUMENT, naming the file and the
// problem, for anything that is not a supported .npy array, or not a file
// `source` allows; RESOURCE_EXHAUSTED, before it is read, for one that would
// not fit in the memory available (NpyReadPeakBytes); FileError's status
// for a file that cannot be read (UNAVAILABLE for EIO, ESTALE).
absl::StatusOr<Tensor> ReadNpy(const std::string& path, NpySource source = NpySource::kRegularFile);
absl::StatusOr<Tensor> ParseNpy(const std::string& bytes, const std::string& what = "npy");
// What a .npy file's header says, read without its array: for a reader that
// must know the array's size before it reads it (a corpus that must fit in
// memory). The same errors as ReadNpy for the header.
struct NpyInfo {
  std::string descr;                 // "<u2", "<f4", ...
  int64_t element_bytes = 0;         // in the file; 0 for a dtype ReadNpy refuses
  bool widened = false;              // u2 and u4: read into i64, through a vector
  int64_t tensor_element_bytes = 0;  // in the tensor ReadNpy returns (8 where widened)
  int64_t elements = 0;
  bool integer = false;              // read as i64 (u2, u4) or i32/i64
};
absl::StatusOr<NpyInfo> ReadNpyInfo(const std::string& path);
// The most host memory ReadNpy holds at once for that file of `file_bytes`:
// the file's bytes and the tensor parsed from them (u2 and u4 widened to
// i64, through a vector); nullopt past int64.
std::optional<int64_t> NpyReadPeakBytes(const NpyInfo& info, int64_t file_bytes);
// f32, f16, i64 or i32 host tensors; the file appears atomically.
absl::Status WriteNpy(const std::string& path, const Tensor& t);
absl::StatusOr<std::string> SerializeNpy(const Tensor& t);

}  // namespace colod

#endif  // COLOD_WORKER_TENSOR_NPY_H_
