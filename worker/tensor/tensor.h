// Tensor: a typed, strided view of a shared byte buffer.
//
// A Tensor is a cheap handle: copies share the storage (like torch.Tensor).
// Views (Narrow, Chunk, Transpose) share it too; Contiguous/Clone copy.
//
// Storage lives in host memory (64-byte aligned) or on a CUDA device; every
// operation below works on both and keeps the device of its inputs. Storage
// and operations go through the device's kernel table (device_kernels.h:
// kernels/cpu or kernels/cuda, synchronous), so nothing here is per device.
// A build without CUDA answers FAILED_PRECONDITION for CUDA tensors. Shapes
// have at most kernels::kMaxDims (16) dims and sizes whose bytes fit int64;
// other shapes are INVALID_ARGUMENT. The infallible calls (Clone, Contiguous,
// ToFloats, ...) treat a failed CUDA allocation or launch like a failed host
// allocation: the process stops with the CUDA error.
// Binary ops need both operands on one device (INVALID_ARGUMENT otherwise);
// To() moves between devices.
//
// Thread-safety: a Tensor handle may be read from several threads; writing the
// same storage from several threads needs outside synchronization.
#ifndef COLOD_WORKER_TENSOR_TENSOR_H_
#define COLOD_WORKER_TENSOR_TENSOR_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "worker/tensor/device.h"
#include "worker/tensor/dtype.h"

namespace colod {

using Shape = std::vector<int64_t>;

// Number of elements of a shape (1 for a scalar []).
int64_t NumElements(const Shape& shape);
std::string ShapeToString(const Shape& shape);

// Bytes on one device, freed with the last handle. Thread-safe.
class Storage;
struct DeviceKernels;

// A tensor's values on their way to the host (Tensor::StartRead): the copy
// was enqueued in stream order when the read started, so Floats() waits
// for the work enqueued before that (on CUDA the copy's event), not for the
// work enqueued since: a host that runs ahead of its device reads a step's
// values while the next step's kernels run. Floats() once; a read never
// finished is dropped with it. Movable; thread-compatible.
class PendingRead {
 public:
  PendingRead(PendingRead&& other) noexcept;
  PendingRead& operator=(PendingRead&& other) noexcept;
  PendingRead(const PendingRead&) = delete;
  PendingRead& operator=(const PendingRead&) = delete;
  ~PendingRead();

  // The f32 values, row-major. FAILED_PRECONDITION for a read already
  // finished; the device's error where the copy failed.
  absl::StatusOr<std::vector<float>> Floats();

 private:
  friend class Tensor;
  PendingRead(const DeviceKernels* kernels, Device device, uint64_t ticket, int64_t n)
      : kernels_(kernels), device_(device), ticket_(ticket), n_(n) {}
  void Drop();

  const DeviceKernels* kernels_ = nullptr;
  Device device_;
  uint64_t ticket_ = 0;  // 0: finished (or moved from)
  int64_t n_ = 0;        // f32 values
};

class Tensor {
 public:
  // An empty f32 tensor of shape [0].
  Tensor();

  // Uninitialized / zero-filled tensors. INVALID_ARGUMENT for a negative
  // dimension, too many dims or too many bytes; FAILED_PRECONDITION for a CUDA device this process cannot use.
  static absl::StatusOr<Tensor> Empty(const Shape& shape, DType dtype, Device device = Device::Cpu());
  static absl::StatusOr<Tensor> Zeros(const Shape& shape, DType dtype, Device device = Device::Cpu());
  // Host tensors from values (To() moves them to a device), converted to
  // `dtype` (rounded for bf16/f16, truncated for ints).
  static absl::StatusOr<Tensor> FromFloats(const Shape& shape, absl::Span<const float> values,
                                           DType dtype = DType::kF32);
  static absl::StatusOr<Tensor> FromInt64s(const Shape& shape, absl::Span<const int64_t> values,
                                           DType dtype = DType::kI64);
  // Row-major little-endian bytes, exactly NumElements(shape) * SizeOf(dtype).
  static absl::StatusOr<Tensor> FromBytes(const Shape& shape, DType dtype, absl::string_view bytes);
  // Seeded initialization from the Philox streams (kernels/philox.h):
  // element i (row-major) of the global tensor is PhiloxNormal(seed, i) or
  // PhiloxUniform(seed, i), so a tensor made from the same seed is the same on
  // every rank and device. Float dtypes only.
  static absl::StatusOr<Tensor> RandomNormal(const Shape& shape, uint64_t seed, DType dtype = DType::kF32,
                                             Device device = Device::Cpu());
  static absl::StatusOr<Tensor> RandomUniform(const Shape& shape, uint64_t seed, DType dtype = DType::kF32,
                                              Device device = Device::Cpu());

  DType dtype() const { return dtype_; }
  Device device() const;
  const Shape& shape() const { return shape_; }
  const std::vector<int64_t>& strides() const { return strides_; }  // in elements
  int64_t dim() const { return static_cast<int64_t>(shape_.size()); }
  int64_t numel() const { return NumElements(shape_); }
  int64_t nbytes() const { return numel() * static_cast<int64_t>(SizeOf(dtype_)); }
  // Row-major without gaps (dims of size 1 may have any stride).
  bool is_contiguous() const;
  // True when this handle is its storage's only one and views all of it,
  // contiguously: nothing else can read or write these bytes, so the
  // handle may be kept as it is where a copy would otherwise be taken.
  bool IsSoleHandle() const;
  // True when both handles view the same bytes with the same layout.
  bool SharesStorageWith(const Tensor& other) const { return storage_ == other.storage_; }

  // Size of dimension d; negative d counts from the end. INVALID_ARGUMENT
  // naming d and the rank when out of range.
  absl::StatusOr<int64_t> Size(int64_t d) const;
  absl::StatusOr<int64_t> NormalizeDim(int64_t d) const;

  // Views (share storage).
  // Elements [start, start+length) of dimension d.
  absl::StatusOr<Tensor> Narrow(int64_t d, int64_t start, int64_t length) const;
  // Part `index` of `parts` equal parts along d. INVALID_ARGUMENT, naming the
  // dim, its size and the part count, when the size is not divisible.
  absl::StatusOr<Tensor> Chunk(int64_t d, int64_t parts, int64_t index) const;
  absl::StatusOr<Tensor> Transpose(int64_t d0, int64_t d1) const;
  // Element `index` of dimension d, that dimension removed (PyTorch's
  // select): a strided view, contiguous only where d's slices are.
  absl::StatusOr<Tensor> Select(int64_t d, int64_t index) const;

  // Copies.
  // A handle to this tensor if already contiguous, else a contiguous copy;
  // the copy's error (a device fault, no memory) returned.
  absl::StatusOr<Tensor> TryContiguous() const;
  // Always a fresh copy, its error returned.
  absl::StatusOr<Tensor> TryClone() const;
  // The same, ending the process where the copy fails: for tests, tools and
  // host tensors, never for device tensors on a daemon's path.
  Tensor Contiguous() const;
  Tensor Clone() const;
  // Same elements, new shape; the copy is made only if not contiguous.
  absl::StatusOr<Tensor> Reshape(const Shape& shape) const;
  absl::StatusOr<Tensor> ToDType(DType dtype) const;
  // Contiguous elements of `dtype`: a handle to this tensor where it already
  // is that, else one copy (converting as ToDType does).
  absl::StatusOr<Tensor> ContiguousAs(DType dtype) const;
  // A contiguous copy on `device`, or this handle if it is already there.
  absl::StatusOr<Tensor> To(Device device) const;
  // Concatenation along d; shapes must agree elsewhere and dtypes match.
  static absl::StatusOr<Tensor> Cat(const std::vector<Tensor>& parts, int64_t d);

  // Element values as float / int64 (row-major), any dtype and device,
  // converted as ToDType converts. A device tensor's copy can fail (an
  // earlier kernel's fault shows at this read): the error is returned.
  absl::StatusOr<std::vector<float>> ReadFloats() const;
  absl::StatusOr<std::vector<int64_t>> ReadInt64s() const;
  // Row-major bytes of a contiguous copy, the copy's error returned.
  absl::StatusOr<std::string> ReadBytes() const;
  // The same, ending the process where the copy fails: for tests and tools,
  // never on a daemon's path.
  std::vector<float> ToFloats() const;
  std::vector<int64_t> ToInt64s() const;
  std::string ToBytes() const;
  // Starts reading the values as f32 (converted on the device first where
  // they are not): PendingRead. At most kernels::kMaxStartedRead bytes
  // (16384 values; INVALID_ARGUMENT beyond).
  absl::StatusOr<PendingRead> StartRead() const;

  // Raw access for kernels: the first element of a view (a device pointer
  // for CUDA tensors). Only for the dtype, layout and device the caller checked.
  void* raw_data();
  const void* raw_data() const;
  template <typename T>
  T* data() { return static_cast<T*>(raw_data()); }
  template <typename T>
  const T* data() const { return static_cast<const T*>(raw_data()); }

  // Copies `src` (same shape and dtype, any device) into this tensor's
  // elements, which may be a view: writing through a Narrow writes into the
  // parent.
  absl::Status CopyFrom(const Tensor& src);

 private:
  Tensor(std::shared_ptr<Storage> storage, DType dtype, Shape shape, std::vector<int64_t> strides,
         int64_t offset);
  char* base() const;  // the storage's first byte

  std::shared_ptr<Storage> storage_;
  DType dtype_ = DType::kF32;
  Shape shape_;
  std::vector<int64_t> strides_;
  int64_t offset_ = 0;  // in elements
};

// Elementwise ops on tensors of equal shape, dtype and device (computed in
// f32 for bf16/f16), returning new contiguous tensors on that device.
// INVALID_ARGUMENT naming both otherwise.
absl::StatusOr<Tensor> Add(const Tensor& a, const Tensor& b);
absl::StatusOr<Tensor> Sub(const Tensor& a, const Tensor& b);
absl::StatusOr<Tensor> Mul(const Tensor& a, const Tensor& b);
absl::StatusOr<Tensor> Scale(const Tensor& a, float s);
// a * s as a new contiguous tensor of `dtype` on a's device, where s is one
// f32 element on that device (shape [] or [1]: a gradient, a loss scale),
// read there; computed in f32, rounded once. Float dtypes.
absl::StatusOr<Tensor> ScaleBy(const Tensor& a, const Tensor& s, DType dtype);
// a += b in place (gradient accumulation); a must be contiguous.
absl::Status AddInPlace(Tensor& a, const Tensor& b);
// Sum of all elements, accumulated in double.
double SumAll(const Tensor& a);
// acc += the sum of the squared elements of every tensor of `parts` (in
// double, added once in f32); `acc` is one f32 element on the parts' device
// and the parts float tensors. Nothing is read on the host, and on CUDA the
// whole list is two launches: a grad norm over every parameter is one
// reduction and one read of `acc`.
absl::Status AddSumOfSquares(const std::vector<Tensor>& parts, Tensor& acc);
// The sum of a float tensor's elements (in double, rounded to f32) as a
// one-element f32 tensor of shape [] on a's device; nothing is read on the host.
absl::StatusOr<Tensor> SumToTensor(const Tensor& a);
// A contiguous tensor of `shape` and `dtype` on t's device whose every
// element is t's one element (converted), made on the device.
absl::StatusOr<Tensor> BroadcastScalar(const Tensor& t, const Shape& shape, DType dtype);

}  // namespace colod

#endif  // COLOD_WORKER_TENSOR_TENSOR_H_
