#include "worker/tensor/tensor.h"

#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/int_math.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/types.h"
#include "worker/tensor/device_kernels.h"

namespace colod {

class Storage {
 public:
  // Bytes from the device's kernels (host bytes are 64-byte aligned); `zero`
  // fills them with zero bytes.
  static absl::StatusOr<std::shared_ptr<Storage>> Allocate(size_t nbytes, Device device, bool zero);
  ~Storage() { kernels_->Free(device_.index, data_); }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  char* data() const { return data_; }
  size_t nbytes() const { return nbytes_; }
  Device device() const { return device_; }
  const DeviceKernels& kernels() const { return *kernels_; }

 private:
  Storage(char* data, size_t nbytes, Device device, const DeviceKernels* kernels)
      : data_(data), nbytes_(nbytes), device_(device), kernels_(kernels) {}
  char* const data_;
  const size_t nbytes_;
  const Device device_;
  const DeviceKernels* const kernels_;
};

namespace {

static_assert(static_cast<int>(kernels::ElemType::kI64) == static_cast<int>(DType::kI64), "ElemType follows DType");
kernels::ElemType Elem(DType t) { return static_cast<kernels::ElemType>(t); }

// The infallible calls stop the process on a device failure, as on a failed
// host allocation.
template <typename T>
T OrDie(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    COLOD_LOG(ERROR) << what << ": " << v.status();
    std::abort();
  }
  return *std::move(v);
}

std::vector<int64_t> RowMajorStrides(const Shape& shape) {
  std::vector<int64_t> s(shape.size());
  int64_t acc = 1;
  for (int64_t i = static_cast<int64_t>(shape.size()) - 1; i >= 0; --i) {
    s[i] = acc;
    acc *= shape[i];
  }
  return s;
}

// INVALID_ARGUMENT for a negative dimension, more than kernels::kMaxDims
// dims, or a size whose bytes overflow int64 (shapes come from requests).
absl::Status ValidateShape(const Shape& shape) {
  if (shape.size() > static_cast<size_t>(kernels::kMaxDims)) {
    return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeToString(shape), " has ", shape.size(),
                                                   " dimensions; tensors have at most ", kernels::kMaxDims));
  }
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeToString(shape), " has a negative dimension"));
    }
  }
  // In the widest dtype (8 bytes), whatever the tensor's, so that no
  // conversion of a valid tensor overflows (npy_fuzz found an empty i32
  // shape whose i64 bytes did).
  if (!CheckedBytes(shape, 8).has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("shape ", ShapeToString(shape), " is too large (its bytes overflow int64)"));
  }
  return absl::OkStatus();
}

kernels::Layout LayoutOf(const Tensor& t) {
  kernels::Layout l;
  l.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < l.ndim; ++d) {
    l.shape[d] = t.shape()[d];
    l.strides[d] = t.strides()[d];
  }
  return l;
}

// dst[...] <- convert(src[...]), both on dst's device and not overlapping; a
// contiguous pair of any rank is copied as one flat run.
absl::Status CopyOnDevice(const DeviceKernels& k, const Tensor& src, Tensor& dst) {
  const int device = dst.device().index;
  if (src.is_contiguous() && dst.is_contiguous()) {
    if (src.dtype() == dst.dtype()) return k.Memcpy(device, dst.raw_data(), src.raw_data(), dst.nbytes());
    kernels::Layout flat;
    flat.ndim = 1;
    flat.shape[0] = src.numel();
    flat.strides[0] = 1;
    return k.StridedCopy(device, src.raw_data(), flat, Elem(src.dtype()), dst.raw_data(), flat, Elem(dst.dtype()));
  }
  return k.StridedCopy(device, src.raw_data(), LayoutOf(src), Elem(src.dtype()), dst.raw_data(), LayoutOf(dst),
                       Elem(dst.dtype()));
}

// A host tensor of `want` from `values` of `have` (the bytes of a contiguous
// buffer), converted on the CPU.
absl::StatusOr<Tensor> FromHostValues(const Shape& shape, const void* values, size_t count, DType have, DType want) {
  RETURN_IF_ERROR(ValidateShape(shape));
  if (static_cast<int64_t>(count) != NumElements(shape)) {
    return absl::InvalidArgumentError(absl::StrCat(count, " values do not fill shape ", ShapeToString(shape), " (",
                                                   NumElements(shape), " elements)"));
  }
  const absl::string_view bytes(static_cast<const char*>(values), count * SizeOf(have));
  ASSIGN_OR_RETURN(Tensor t, Tensor::FromBytes(shape, have, bytes));
  if (have == want) return t;
  return t.ToDType(want);
}

// The elements as a host vector of T (f32 or i64), converted like ToDType.
template <typename T>
absl::StatusOr<std::vector<T>> HostValues(const Tensor& t, DType as) {
  ASSIGN_OR_RETURN(const Tensor host, t.To(Device::Cpu()));
  ASSIGN_OR_RETURN(const Tensor h, host.ContiguousAs(as));
  const T* p = h.data<T>();
  return std::vector<T>(p, p + h.numel());
}

}  // namespace

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeToString(const Shape& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::StatusOr<std::shared_ptr<Storage>> Storage::Allocate(size_t nbytes, Device device, bool zero) {
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(device));
  ASSIGN_OR_RETURN(void* p, k->Malloc(device.index, nbytes));
  std::shared_ptr<Storage> s(new Storage(static_cast<char*>(p), nbytes, device, k));
  if (zero) RETURN_IF_ERROR(k->Memset0(device.index, p, nbytes));
  return s;
}

Tensor::Tensor() : Tensor(OrDie(Storage::Allocate(0, Device::Cpu(), false), "tensor"), DType::kF32, {0}, {1}, 0) {}

Tensor::Tensor(std::shared_ptr<Storage> storage, DType dtype, Shape shape, std::vector<int64_t> strides,
               int64_t offset)
    : storage_(std::move(storage)),
      dtype_(dtype),
      shape_(std::move(shape)),
      strides_(std::move(strides)),
      offset_(offset) {}

Device Tensor::device() const { return storage_->device(); }

char* Tensor::base() const { return storage_->data(); }

absl::StatusOr<Tensor> Tensor::Empty(const Shape& shape, DType dtype, Device device) {
  RETURN_IF_ERROR(ValidateShape(shape));
  ASSIGN_OR_RETURN(auto storage, Storage::Allocate(NumElements(shape) * SizeOf(dtype), device, false));
  return Tensor(std::move(storage), dtype, shape, RowMajorStrides(shape), 0);
}

absl::StatusOr<Tensor> Tensor::Zeros(const Shape& shape, DType dtype, Device device) {
  RETURN_IF_ERROR(ValidateShape(shape));
  ASSIGN_OR_RETURN(auto storage, Storage::Allocate(NumElements(shape) * SizeOf(dtype), device, true));
  return Tensor(std::move(storage), dtype, shape, RowMajorStrides(shape), 0);
}

absl::StatusOr<Tensor> Tensor::FromFloats(const Shape& shape, absl::Span<const float> values, DType dtype) {
  return FromHostValues(shape, values.data(), values.size(), DType::kF32, dtype);
}

absl::StatusOr<Tensor> Tensor::FromInt64s(const Shape& shape, absl::Span<const int64_t> values, DType dtype) {
  return FromHostValues(shape, values.data(), values.size(), DType::kI64, dtype);
}

absl::StatusOr<Tensor> Tensor::FromBytes(const Shape& shape, DType dtype, absl::string_view bytes) {
  ASSIGN_OR_RETURN(Tensor t, Empty(shape, dtype));
  if (static_cast<int64_t>(bytes.size()) != t.nbytes()) {
    return absl::InvalidArgumentError(absl::StrCat(bytes.size(), " bytes given for ", DTypeName(dtype),
                                                   ShapeToString(shape), ", which needs ", t.nbytes()));
  }
  if (!bytes.empty()) std::memcpy(t.base(), bytes.data(), bytes.size());
  return t;
}

absl::StatusOr<Tensor> Tensor::RandomNormal(const Shape& shape, uint64_t seed, DType dtype, Device device) {
  if (!IsFloat(dtype)) return absl::InvalidArgumentError("RandomNormal: dtype must be f32, bf16 or f16");
  ASSIGN_OR_RETURN(Tensor t, Empty(shape, dtype, device));
  RETURN_IF_ERROR(t.storage_->kernels().FillRandom(device.index, t.base(), Elem(dtype), t.numel(), seed, true));
  return t;
}

absl::StatusOr<Tensor> Tensor::RandomUniform(const Shape& shape, uint64_t seed, DType dtype, Device device) {
  if (!IsFloat(dtype)) return absl::InvalidArgumentError("RandomUniform: dtype must be f32, bf16 or f16");
  ASSIGN_OR_RETURN(Tensor t, Empty(shape, dtype, device));
  RETURN_IF_ERROR(t.storage_->kernels().FillRandom(device.index, t.base(), Elem(dtype), t.numel(), seed, false));
  return t;
}

bool Tensor::IsSoleHandle() const {
  return storage_.use_count() == 1 && offset_ == 0 && is_contiguous() && nbytes() == storage_->nbytes();
}

bool Tensor::is_contiguous() const {
  // Row-major, ignoring the stride of any dim of size 1 (it is never stepped).
  int64_t expected = 1;
  for (int64_t d = dim() - 1; d >= 0; --d) {
    if (shape_[d] == 1) continue;
    if (strides_[d] != expected) return false;
    expected *= shape_[d];
  }
  return true;
}

absl::StatusOr<int64_t> Tensor::NormalizeDim(int64_t d) const {
  const int64_t n = dim();
  if (d < -n || d >= n) {
    return absl::InvalidArgumentError(absl::StrCat("dim ", d, " is out of range for a ", n,
                                                   "-d tensor of shape ", ShapeToString(shape_)));
  }
  return d < 0 ? d + n : d;
}

absl::StatusOr<int64_t> Tensor::Size(int64_t d) const {
  ASSIGN_OR_RETURN(int64_t nd, NormalizeDim(d));
  return shape_[nd];
}

absl::StatusOr<Tensor> Tensor::Narrow(int64_t d, int64_t start, int64_t length) const {
  ASSIGN_OR_RETURN(int64_t nd, NormalizeDim(d));
  if (start < 0 || length < 0 || start + length > shape_[nd]) {
    return absl::InvalidArgumentError(absl::StrCat("narrow [", start, ", ", start + length, ") of dim ", nd,
                                                   " with size ", shape_[nd]));
  }
  Shape shape = shape_;
  shape[nd] = length;
  return Tensor(storage_, dtype_, std::move(shape), strides_, offset_ + start * strides_[nd]);
}

absl::StatusOr<Tensor> Tensor::Chunk(int64_t d, int64_t parts, int64_t index) const {
  ASSIGN_OR_RETURN(int64_t nd, NormalizeDim(d));
  if (parts < 1 || index < 0 || index >= parts) {
    return absl::InvalidArgumentError(absl::StrCat("chunk ", index, " of ", parts, " is out of range"));
  }
  if (shape_[nd] % parts != 0) {
    return absl::InvalidArgumentError(absl::StrCat("dim ", nd, " of size ", shape_[nd],
                                                   " is not divisible into ", parts, " equal parts"));
  }
  const int64_t len = shape_[nd] / parts;
  return Narrow(nd, index * len, len);
}

absl::StatusOr<Tensor> Tensor::Transpose(int64_t d0, int64_t d1) const {
  ASSIGN_OR_RETURN(int64_t a, NormalizeDim(d0));
  ASSIGN_OR_RETURN(int64_t b, NormalizeDim(d1));
  Shape shape = shape_;
  std::vector<int64_t> strides = strides_;
  std::swap(shape[a], shape[b]);
  std::swap(strides[a], strides[b]);
  return Tensor(storage_, dtype_, std::move(shape), std::move(strides), offset_);
}

absl::StatusOr<Tensor> Tensor::Select(int64_t d, int64_t index) const {
  ASSIGN_OR_RETURN(int64_t nd, NormalizeDim(d));
  if (index < 0 || index >= shape_[nd]) {
    return absl::InvalidArgumentError(
        absl::StrCat("select ", index, " of dim ", nd, " with size ", shape_[nd]));
  }
  Shape shape = shape_;
  std::vector<int64_t> strides = strides_;
  const int64_t offset = offset_ + index * strides_[nd];
  shape.erase(shape.begin() + nd);
  strides.erase(strides.begin() + nd);
  return Tensor(storage_, dtype_, std::move(shape), std::move(strides), offset);
}

absl::StatusOr<Tensor> Tensor::TryClone() const {
  ASSIGN_OR_RETURN(Tensor out, Empty(shape_, dtype_, device()));
  RETURN_IF_ERROR(CopyOnDevice(storage_->kernels(), *this, out));
  return out;
}

absl::StatusOr<Tensor> Tensor::TryContiguous() const {
  if (is_contiguous()) return *this;
  return TryClone();
}

Tensor Tensor::Clone() const { return OrDie(TryClone(), "Tensor::Clone"); }

Tensor Tensor::Contiguous() const { return OrDie(TryContiguous(), "Tensor::Contiguous"); }

absl::StatusOr<Tensor> Tensor::Reshape(const Shape& shape) const {
  RETURN_IF_ERROR(ValidateShape(shape));
  if (NumElements(shape) != numel()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot reshape ", ShapeToString(shape_), " (", numel(),
                                                   " elements) to ", ShapeToString(shape)));
  }
  ASSIGN_OR_RETURN(Tensor c, TryContiguous());
  return Tensor(c.storage_, dtype_, shape, RowMajorStrides(shape), c.offset_);
}

absl::StatusOr<Tensor> Tensor::ToDType(DType dtype) const {
  if (dtype == dtype_) return TryClone();
  ASSIGN_OR_RETURN(Tensor out, Empty(shape_, dtype, device()));
  RETURN_IF_ERROR(CopyOnDevice(storage_->kernels(), *this, out));
  return out;
}

absl::StatusOr<Tensor> Tensor::ContiguousAs(DType dtype) const {
  if (dtype == dtype_) return TryContiguous();
  return ToDType(dtype);
}

absl::StatusOr<Tensor> Tensor::To(Device device) const {
  if (device == this->device()) return *this;
  ASSIGN_OR_RETURN(const Tensor c, TryContiguous());
  ASSIGN_OR_RETURN(Tensor out, Empty(shape_, dtype_, device));
  // The device side's copy: CUDA's tells host from device pointers (unified
  // addressing). Between two CPUs there is nothing to move.
  const Device side = device.is_cuda() ? device : c.device();
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(side));
  if (device.is_cuda() && !c.device().is_cuda()) {  // host to device: staged, the host does not wait
    RETURN_IF_ERROR(k->Upload(side.index, out.raw_data(), c.raw_data(), out.nbytes()));
  } else {
    RETURN_IF_ERROR(k->Memcpy(side.index, out.raw_data(), c.raw_data(), out.nbytes()));
  }
  return out;
}

absl::StatusOr<Tensor> Tensor::Cat(const std::vector<Tensor>& parts, int64_t d) {
  if (parts.empty()) return absl::InvalidArgumentError("cat: no tensors");
  ASSIGN_OR_RETURN(int64_t nd, parts[0].NormalizeDim(d));
  Shape shape = parts[0].shape();
  int64_t total = 0;
  for (const Tensor& p : parts) {
    if (p.dtype() != parts[0].dtype() || p.dim() != parts[0].dim()) {
      return absl::InvalidArgumentError("cat: tensors differ in dtype or rank");
    }
    for (int64_t i = 0; i < p.dim(); ++i) {
      if (i != nd && p.shape()[i] != shape[i]) {
        return absl::InvalidArgumentError(absl::StrCat("cat along dim ", nd, ": shapes ", ShapeToString(shape),
                                                       " and ", ShapeToString(p.shape()), " differ elsewhere"));
      }
    }
    total += p.shape()[nd];
  }
  shape[nd] = total;
  ASSIGN_OR_RETURN(Tensor out, Empty(shape, parts[0].dtype(), parts[0].device()));
  int64_t at = 0;
  for (const Tensor& p : parts) {
    ASSIGN_OR_RETURN(Tensor slot, out.Narrow(nd, at, p.shape()[nd]));
    RETURN_IF_ERROR(slot.CopyFrom(p));
    at += p.shape()[nd];
  }
  return out;
}

absl::Status Tensor::CopyFrom(const Tensor& src) {
  if (src.shape() != shape_ || src.dtype() != dtype_) {
    return absl::InvalidArgumentError(absl::StrCat("copy from ", DTypeName(src.dtype()), ShapeToString(src.shape()),
                                                   " into ", DTypeName(dtype_), ShapeToString(shape_)));
  }
  // The source, on this device and not overlapping the destination.
  Tensor s = src;
  if (src.device() != device()) {
    ASSIGN_OR_RETURN(s, src.To(device()));
  } else if (src.SharesStorageWith(*this)) {
    ASSIGN_OR_RETURN(s, src.TryClone());
  }
  return CopyOnDevice(storage_->kernels(), s, *this);
}

absl::StatusOr<std::vector<float>> Tensor::ReadFloats() const { return HostValues<float>(*this, DType::kF32); }

absl::StatusOr<std::vector<int64_t>> Tensor::ReadInt64s() const { return HostValues<int64_t>(*this, DType::kI64); }

absl::StatusOr<std::string> Tensor::ReadBytes() const {
  ASSIGN_OR_RETURN(const Tensor host, To(Device::Cpu()));
  ASSIGN_OR_RETURN(const Tensor c, host.TryContiguous());
  return std::string(c.base() + c.offset_ * SizeOf(dtype_), nbytes());
}

std::vector<float> Tensor::ToFloats() const { return OrDie(ReadFloats(), "Tensor::ToFloats"); }

std::vector<int64_t> Tensor::ToInt64s() const { return OrDie(ReadInt64s(), "Tensor::ToInt64s"); }

std::string Tensor::ToBytes() const { return OrDie(ReadBytes(), "Tensor::ToBytes"); }

absl::StatusOr<PendingRead> Tensor::StartRead() const {
  if (static_cast<uint64_t>(numel()) > kernels::kMaxStartedRead / sizeof(float)) {
    return absl::InvalidArgumentError(absl::StrCat("StartRead: ", numel(), " values (at most ",
                                                   kernels::kMaxStartedRead / sizeof(float), ")"));
  }
  ASSIGN_OR_RETURN(const Tensor f, ContiguousAs(DType::kF32));
  const DeviceKernels& k = storage_->kernels();
  const int64_t n = f.numel();
  ASSIGN_OR_RETURN(const uint64_t ticket,
                   k.StartRead(device().index, f.raw_data(), static_cast<size_t>(n) * sizeof(float)));
  return PendingRead(&k, device(), ticket, n);
}

PendingRead::PendingRead(PendingRead&& other) noexcept
    : kernels_(other.kernels_), device_(other.device_), ticket_(other.ticket_), n_(other.n_) {
  other.ticket_ = 0;
}

PendingRead& PendingRead::operator=(PendingRead&& other) noexcept {
  if (this != &other) {
    Drop();
    kernels_ = other.kernels_;
    device_ = other.device_;
    ticket_ = other.ticket_;
    n_ = other.n_;
    other.ticket_ = 0;
  }
  return *this;
}

PendingRead::~PendingRead() { Drop(); }

void PendingRead::Drop() {
  if (ticket_ != 0) kernels_->DropRead(device_.index, ticket_);
  ticket_ = 0;
}

absl::StatusOr<std::vector<float>> PendingRead::Floats() {
  if (ticket_ == 0) return absl::FailedPreconditionError("this read was finished already");
  std::vector<float> values(static_cast<size_t>(n_));
  const uint64_t ticket = ticket_;
  ticket_ = 0;  // FinishRead frees it, whatever it returns
  RETURN_IF_ERROR(kernels_->FinishRead(device_.index, ticket, values.data(), values.size() * sizeof(float)));
  return values;
}

void* Tensor::raw_data() { return base() + offset_ * SizeOf(dtype_); }
const void* Tensor::raw_data() const { return base() + offset_ * SizeOf(dtype_); }

namespace {

absl::Status SameShape(const Tensor& a, const Tensor& b, absl::string_view op) {
  if (a.shape() != b.shape() || a.dtype() != b.dtype() || a.device() != b.device()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", DTypeName(a.dtype()), ShapeToString(a.shape()), " on ",
                                                   a.device().ToString(), " and ", DTypeName(b.dtype()),
                                                   ShapeToString(b.shape()), " on ", b.device().ToString(),
                                                   " differ"));
  }
  return absl::OkStatus();
}

absl::StatusOr<Tensor> Binary(const Tensor& a, const Tensor& b, absl::string_view name, kernels::BinaryOp op) {
  RETURN_IF_ERROR(SameShape(a, b, name));
  ASSIGN_OR_RETURN(const Tensor ca, a.TryContiguous());
  ASSIGN_OR_RETURN(const Tensor cb, b.TryContiguous());
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(a.shape(), a.dtype(), a.device()));
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(a.device()));
  RETURN_IF_ERROR(k->Binary(a.device().index, op, Elem(a.dtype()), ca.raw_data(), cb.raw_data(), out.raw_data(),
                            out.numel()));
  return out;
}

}  // namespace

absl::StatusOr<Tensor> Add(const Tensor& a, const Tensor& b) { return Binary(a, b, "add", kernels::BinaryOp::kAdd); }
absl::StatusOr<Tensor> Sub(const Tensor& a, const Tensor& b) { return Binary(a, b, "sub", kernels::BinaryOp::kSub); }
absl::StatusOr<Tensor> Mul(const Tensor& a, const Tensor& b) { return Binary(a, b, "mul", kernels::BinaryOp::kMul); }

absl::StatusOr<Tensor> Scale(const Tensor& a, float s) {
  if (!IsFloat(a.dtype())) return absl::InvalidArgumentError("scale: float dtypes only");
  ASSIGN_OR_RETURN(const Tensor ca, a.TryContiguous());
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(a.shape(), a.dtype(), a.device()));
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(a.device()));
  RETURN_IF_ERROR(k->Scale(a.device().index, Elem(a.dtype()), ca.raw_data(), s, out.raw_data(), out.numel()));
  return out;
}

absl::StatusOr<Tensor> ScaleBy(const Tensor& a, const Tensor& s, DType dtype) {
  if (!IsFloat(a.dtype()) || !IsFloat(dtype)) return absl::InvalidArgumentError("scale_by: float dtypes only");
  if (s.numel() != 1 || s.dtype() != DType::kF32 || !(s.device() == a.device())) {
    return absl::InvalidArgumentError(absl::StrCat("scale_by: the factor must be one f32 on ", a.device().ToString(),
                                                   ", got ", DTypeName(s.dtype()), ShapeToString(s.shape()), " on ",
                                                   s.device().ToString()));
  }
  ASSIGN_OR_RETURN(const Tensor ca, a.TryContiguous());
  ASSIGN_OR_RETURN(const Tensor cs, s.TryContiguous());
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(a.shape(), dtype, a.device()));
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(a.device()));
  RETURN_IF_ERROR(k->ScaleBy(a.device().index, Elem(a.dtype()), ca.raw_data(), static_cast<const float*>(cs.raw_data()),
                             Elem(dtype), out.raw_data(), out.numel()));
  return out;
}

absl::Status AddInPlace(Tensor& a, const Tensor& b) {
  RETURN_IF_ERROR(SameShape(a, b, "add_"));
  if (!a.is_contiguous()) return absl::InvalidArgumentError("add_: the destination must be contiguous");
  if (b.dtype() != a.dtype() || !(b.device() == a.device()) || b.SharesStorageWith(a)) {
    ASSIGN_OR_RETURN(Tensor sum, Add(a, b));
    return a.CopyFrom(sum);
  }
  // Elementwise, so the kernel may write where it reads: one pass, no temporary.
  ASSIGN_OR_RETURN(const Tensor cb, b.TryContiguous());
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(a.device()));
  return k->Binary(a.device().index, kernels::BinaryOp::kAdd, Elem(a.dtype()), a.raw_data(), cb.raw_data(),
                   a.raw_data(), a.numel());
}

absl::Status AddSumOfSquares(const std::vector<Tensor>& parts, Tensor& acc) {
  if (acc.dtype() != DType::kF32 || acc.numel() != 1 || !acc.is_contiguous()) {
    return absl::InvalidArgumentError("sum of squares: the accumulator must be one contiguous f32");
  }
  std::vector<Tensor> held;  // contiguous copies live until the kernels are enqueued
  std::vector<kernels::BufferRef> refs;
  for (const Tensor& a : parts) {
    if (!IsFloat(a.dtype())) return absl::InvalidArgumentError("sum of squares: float dtypes only");
    if (!(acc.device() == a.device())) {
      return absl::InvalidArgumentError(absl::StrCat("sum of squares: a tensor on ", a.device().ToString(),
                                                     " and the accumulator on ", acc.device().ToString()));
    }
    ASSIGN_OR_RETURN(Tensor dense, a.TryContiguous());
    held.push_back(std::move(dense));
    refs.push_back({held.back().raw_data(), a.numel(), Elem(a.dtype())});
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(acc.device()));
  return k->AccumulateSum(acc.device().index, refs, /*square=*/true, static_cast<float*>(acc.raw_data()));
}

absl::StatusOr<Tensor> SumToTensor(const Tensor& a) {
  if (!IsFloat(a.dtype())) return absl::InvalidArgumentError("sum: float dtypes only");
  ASSIGN_OR_RETURN(Tensor out, Tensor::Zeros({}, DType::kF32, a.device()));
  ASSIGN_OR_RETURN(const Tensor ca, a.TryContiguous());
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(a.device()));
  RETURN_IF_ERROR(k->AccumulateSum(a.device().index, {{ca.raw_data(), ca.numel(), Elem(a.dtype())}},
                                   /*square=*/false, static_cast<float*>(out.raw_data())));
  return out;
}

absl::StatusOr<Tensor> BroadcastScalar(const Tensor& t, const Shape& shape, DType dtype) {
  if (t.numel() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("broadcast: ", ShapeToString(t.shape()), " is not one element"));
  }
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(shape, dtype, t.device()));
  if (out.numel() == 0) return out;
  kernels::Layout src = LayoutOf(out);
  for (int d = 0; d < src.ndim; ++d) src.strides[d] = 0;  // every element reads the one
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(t.device()));
  RETURN_IF_ERROR(k->StridedCopy(t.device().index, t.raw_data(), src, Elem(t.dtype()), out.raw_data(),
                                 LayoutOf(out), Elem(dtype)));
  return out;
}

double SumAll(const Tensor& a) {
  const Tensor ca = a.Contiguous();
  const DeviceKernels* k = OrDie(KernelsFor(a.device()), "SumAll");
  return OrDie(k->Sum(a.device().index, Elem(a.dtype()), ca.raw_data(), ca.numel()), "SumAll");
}

}  // namespace colod
