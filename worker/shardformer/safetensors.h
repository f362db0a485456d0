// The safetensors format (https://huggingface.co/docs/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON, then the data buffer.
// The header maps each tensor name to {"dtype", "shape", "data_offsets":
// [begin, end)} relative to the buffer, plus an optional "__metadata__"
// object of strings.
//
// SafetensorsFile opens a file and validates its header strictly
// before anything is read: the length fits the file, the JSON is an object
// of well-formed entries, every dtype is one of the format's that colod
// knows, dtype size x shape = the entry's byte length (whole bytes for the
// packed 4- and 6-bit kinds), and the offsets
// tile the buffer exactly (in bounds, no overlap, no hole, as the format
// requires). Any violation is INVALID_ARGUMENT naming the file, the tensor
// and the rule. Tensors of a dtype colod reads (F32, F16, BF16, I64, I32)
// are tensors(); the others (BOOL, U8, F64, ...: a model's mask buffer)
// are unreadable(), so that such a file opens, and only Info or a read of
// one of them is INVALID_ARGUMENT naming its dtype. Reads are positioned
// reads of the open file, not a
// map: a file cut short while a rank reads it is DATA_LOSS rather than a
// SIGBUS that kills the daemon. A rank that loads its shard of a tensor
// reads only that shard's bytes, and the gaps of up to 16 KiB between its
// rows (read together, up to 8 MiB a call).
//
// Thread-safety: a SafetensorsFile is immutable after Open; reads may run
// concurrently.
#ifndef COLOD_WORKER_SHARDFORMER_SAFETENSORS_H_
#define COLOD_WORKER_SHARDFORMER_SAFETENSORS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/atomic_file.h"
#include "worker/tensor/tensor.h"

namespace colod::shardformer {

struct TensorInfo {
  DType dtype = DType::kF32;
  Shape shape;
  int64_t begin = 0;  // byte offsets in the data buffer
  int64_t end = 0;
};

// "F32" <-> DType::kF32 and so on; INVALID_ARGUMENT for other dtypes.
absl::StatusOr<DType> ParseSafetensorsDType(const std::string& name);
const char* SafetensorsDTypeName(DType dtype);

class SafetensorsFile {
 public:
  // NOT_FOUND when the file does not exist; INVALID_ARGUMENT when it is not
  // a regular file or not a valid safetensors file; DATA_LOSS when it was
  // cut short while read; FileError's status (common/atomic_file.h) for
  // another error of the file system (EACCES: FAILED_PRECONDITION, EIO:
  // UNAVAILABLE).
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // The tensors of a dtype colod reads.
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  // The others, name -> the dtype's name in the file ("BOOL").
  const std::map<std::string, std::string>& unreadable() const { return unreadable_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Whether the file holds `name`, readable or not.
  bool Has(const std::string& name) const { return tensors_.count(name) > 0 || unreadable_.count(name) > 0; }
  // NOT_FOUND naming the tensor and the file; INVALID_ARGUMENT naming the
  // dtype for an unreadable() tensor.
  absl::StatusOr<TensorInfo> Info(const std::string& name) const;

  // The whole tensor, as a host tensor.
  absl::StatusOr<Tensor> Read(const std::string& name) const;
  // The block [starts[d], starts[d] + lengths[d]) of every dim (reading its
  // bytes and short gaps between them, above). INVALID_ARGUMENT for a range
  // outside the shape. Read and ReadSlice are DATA_LOSS naming the file
  // where it was cut short since Open, and UNAVAILABLE for a read error of
  // the moment (EIO).
  absl::StatusOr<Tensor> ReadSlice(const std::string& name, const std::vector<int64_t>& starts,
                                   const std::vector<int64_t>& lengths) const;

 private:
  explicit SafetensorsFile(RegularFileReader file) : path_(file.path()), file_(std::move(file)) {}
  const std::string path_;
  RegularFileReader file_;
  int64_t data_start_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> unreadable_;
  std::map<std::string, std::string> metadata_;
};

// Writes `tensors` (in the given order; names unique) and `metadata` as a
// safetensors file: header padded with spaces to a multiple of 8 bytes, data
// contiguous. The file appears atomically (written to a temporary name,
// fsync'ed, renamed), so a crash never leaves a partial file at `path`.
absl::Status WriteSafetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

// A tensor of a file WriteSafetensorsStreamed writes, before it is made.
struct TensorLayout {
  std::string name;
  DType dtype = DType::kF32;
  Shape shape;
};
// The same for tensors made one at a time: the header from `layout`, then
// each tensor's bytes as `make(i)` makes layout[i] (dropped once written),
// so that a model is written without all of it held (a consolidation holds
// one tensor of it). INVALID_ARGUMENT for a name empty, reserved or
// repeated, or a tensor made of another dtype or shape than its layout's;
// `make`'s error is returned. Either way no file is left at `path`.
// `before_rename` (if given) runs once the file is whole and durable, just
// before it takes `path`'s place (WriteFileAtomically's): its error leaves
// `path` as it was.
absl::Status WriteSafetensorsStreamed(const std::string& path, const std::vector<TensorLayout>& layout,
                                      const std::function<absl::StatusOr<Tensor>(size_t i)>& make,
                                      const std::map<std::string, std::string>& metadata = {},
                                      const std::function<absl::Status()>& before_rename = nullptr);

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_SAFETENSORS_H_
