#include "worker/tensor/tensor.h"

#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "kernels/philox.h"

#ifdef COLOD_WITH_CUDA
#include "kernels/cuda/tensor_ops.h"
#endif

namespace colod {

class Storage {
 public:
  // Host bytes are 64-byte aligned; `zero` fills them with zero bytes.
  static absl::StatusOr<std::shared_ptr<Storage>> Allocate(size_t nbytes, Device device, bool zero);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  char* data() const { return data_; }
  Device device() const { return device_; }

 private:
  Storage(char* data, Device device) : data_(data), device_(device) {}
  char* const data_;
  const Device device_;
};

namespace {

#ifdef COLOD_WITH_CUDA
namespace cu = kernels::cuda;
static_assert(static_cast<int>(cu::ElemType::kI64) == static_cast<int>(DType::kI64), "ElemType follows DType");
cu::ElemType Elem(DType t) { return static_cast<cu::ElemType>(t); }
#endif

[[maybe_unused]] absl::Status NoCuda(Device d) {
  return absl::FailedPreconditionError(absl::StrCat(
      d.ToString(), ": this binary was built without CUDA (bazel/cuda.bzl found no toolkit); "
                    "only cpu tensors are available"));
}

// The infallible calls stop the process on a CUDA failure, as on a failed
// host allocation.
template <typename T>
T OrDie(absl::StatusOr<T> v, const char* what) {
  if (!v.ok()) {
    COLOD_LOG(ERROR) << what << ": " << v.status();
    std::abort();
  }
  return *std::move(v);
}
void OrDie(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    COLOD_LOG(ERROR) << what << ": " << s;
    std::abort();
  }
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

absl::Status ValidateShape(const Shape& shape) {
  for (int64_t d : shape) {
    if (d < 0) return absl::InvalidArgumentError(absl::StrCat("shape ", ShapeToString(shape), " has a negative dimension"));
  }
  return absl::OkStatus();
}

float LoadFloat(const char* p, DType t) {
  switch (t) {
    case DType::kF32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::kBF16: { uint16_t v; std::memcpy(&v, p, 2); return BF16ToFloat(v); }
    case DType::kF16: { uint16_t v; std::memcpy(&v, p, 2); return F16ToFloat(v); }
    case DType::kI32: { int32_t v; std::memcpy(&v, p, 4); return static_cast<float>(v); }
    case DType::kI64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<float>(v); }
  }
  return 0;
}

void StoreFloat(char* p, DType t, float f) {
  switch (t) {
    case DType::kF32: std::memcpy(p, &f, 4); return;
    case DType::kBF16: { uint16_t v = FloatToBF16(f); std::memcpy(p, &v, 2); return; }
    case DType::kF16: { uint16_t v = FloatToF16(f); std::memcpy(p, &v, 2); return; }
    case DType::kI32: { int32_t v = static_cast<int32_t>(f); std::memcpy(p, &v, 4); return; }
    case DType::kI64: { int64_t v = static_cast<int64_t>(f); std::memcpy(p, &v, 8); return; }
  }
}

int64_t LoadInt(const char* p, DType t) {
  switch (t) {
    case DType::kI32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case DType::kI64: { int64_t v; std::memcpy(&v, p, 8); return v; }
    default: return static_cast<int64_t>(LoadFloat(p, t));
  }
}

void StoreInt(char* p, DType t, int64_t v) {
  switch (t) {
    case DType::kI32: { int32_t x = static_cast<int32_t>(v); std::memcpy(p, &x, 4); return; }
    case DType::kI64: std::memcpy(p, &v, 8); return;
    default: StoreFloat(p, t, static_cast<float>(v));
  }
}

absl::Status CheckFills(size_t n, const Tensor& t) {
  if (static_cast<int64_t>(n) != t.numel()) {
    return absl::InvalidArgumentError(absl::StrCat(n, " values do not fill shape ", ShapeToString(t.shape()),
                                                   " (", t.numel(), " elements)"));
  }
  return absl::OkStatus();
}

bool IsFloat(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

}  // namespace

int64_t NumElements(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

std::string ShapeToString(const Shape& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

absl::StatusOr<std::shared_ptr<Storage>> Storage::Allocate(size_t nbytes, Device device, bool zero) {
  if (device.is_cuda()) {
#ifdef COLOD_WITH_CUDA
    ASSIGN_OR_RETURN(void* p, cu::Malloc(device.index, nbytes));
    std::shared_ptr<Storage> s(new Storage(static_cast<char*>(p), device));
    if (zero) RETURN_IF_ERROR(cu::Memset0(device.index, p, nbytes));
    return s;
#else
    return NoCuda(device);
#endif
  }
  constexpr size_t kAlign = 64;
  const size_t rounded = (nbytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, rounded == 0 ? kAlign : rounded);
  if (p == nullptr) return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", nbytes, " host bytes"));
  if (zero) std::memset(p, 0, nbytes);
  return std::shared_ptr<Storage>(new Storage(static_cast<char*>(p), device));
}

Storage::~Storage() {
  if (device_.is_cuda()) {
#ifdef COLOD_WITH_CUDA
    cu::Free(device_.index, data_);
#endif
    return;
  }
  std::free(data_);
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
  ASSIGN_OR_RETURN(Tensor t, Empty(shape, dtype));
  RETURN_IF_ERROR(CheckFills(values.size(), t));
  char* p = t.base();
  for (size_t i = 0; i < values.size(); ++i) StoreFloat(p + i * SizeOf(dtype), dtype, values[i]);
  return t;
}

absl::StatusOr<Tensor> Tensor::FromInt64s(const Shape& shape, absl::Span<const int64_t> values, DType dtype) {
  ASSIGN_OR_RETURN(Tensor t, Empty(shape, dtype));
  RETURN_IF_ERROR(CheckFills(values.size(), t));
  char* p = t.base();
  for (size_t i = 0; i < values.size(); ++i) StoreInt(p + i * SizeOf(dtype), dtype, values[i]);
  return t;
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
#ifdef COLOD_WITH_CUDA
  if (device.is_cuda()) {
    RETURN_IF_ERROR(cu::FillRandom(device.index, t.base(), Elem(dtype), t.numel(), seed, /*normal=*/true));
    return t;
  }
#endif
  char* p = t.base();
  for (int64_t i = 0; i < t.numel(); ++i) StoreFloat(p + i * SizeOf(dtype), dtype, kernels::PhiloxNormal(seed, i));
  return t;
}

absl::StatusOr<Tensor> Tensor::RandomUniform(const Shape& shape, uint64_t seed, DType dtype, Device device) {
  if (!IsFloat(dtype)) return absl::InvalidArgumentError("RandomUniform: dtype must be f32, bf16 or f16");
  ASSIGN_OR_RETURN(Tensor t, Empty(shape, dtype, device));
#ifdef COLOD_WITH_CUDA
  if (device.is_cuda()) {
    RETURN_IF_ERROR(cu::FillRandom(device.index, t.base(), Elem(dtype), t.numel(), seed, /*normal=*/false));
    return t;
  }
#endif
  char* p = t.base();
  for (int64_t i = 0; i < t.numel(); ++i) StoreFloat(p + i * SizeOf(dtype), dtype, kernels::PhiloxUniform(seed, i));
  return t;
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

template <typename Fn>
void Tensor::ForEachOffset(Fn&& fn) const {
  const int64_t n = numel();
  if (n == 0) return;
  if (is_contiguous()) {
    for (int64_t i = 0; i < n; ++i) fn(offset_ + i);
    return;
  }
  std::vector<int64_t> idx(shape_.size(), 0);
  int64_t off = offset_;
  for (int64_t i = 0; i < n; ++i) {
    fn(off);
    for (int64_t d = dim() - 1; d >= 0; --d) {  // odometer
      if (++idx[d] < shape_[d]) {
        off += strides_[d];
        break;
      }
      off -= strides_[d] * (shape_[d] - 1);
      idx[d] = 0;
    }
  }
}

Tensor Tensor::Clone() const {
  Tensor out = OrDie(Empty(shape_, dtype_, device()), "Tensor::Clone");
  const size_t es = SizeOf(dtype_);
  if (device().is_cuda()) {
    OrDie(out.CopyFrom(*this), "Tensor::Clone");
    return out;
  }
  if (is_contiguous()) {
    if (nbytes() > 0) std::memcpy(out.base(), base() + offset_ * es, nbytes());
    return out;
  }
  char* dst = out.base();
  const char* src = base();
  ForEachOffset([&](int64_t off) {
    std::memcpy(dst, src + off * es, es);
    dst += es;
  });
  return out;
}

Tensor Tensor::Contiguous() const { return is_contiguous() ? *this : Clone(); }

absl::StatusOr<Tensor> Tensor::Reshape(const Shape& shape) const {
  RETURN_IF_ERROR(ValidateShape(shape));
  if (NumElements(shape) != numel()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot reshape ", ShapeToString(shape_), " (", numel(),
                                                   " elements) to ", ShapeToString(shape)));
  }
  Tensor c = Contiguous();
  return Tensor(c.storage_, dtype_, shape, RowMajorStrides(shape), c.offset_);
}

#ifdef COLOD_WITH_CUDA
namespace {
cu::Layout LayoutOf(const Tensor& t) {
  cu::Layout l;
  l.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < l.ndim; ++d) {
    l.shape[d] = t.shape()[d];
    l.strides[d] = t.strides()[d];
  }
  return l;
}

// dst[...] <- convert(src[...]) on one CUDA device; a contiguous pair of any
// rank is copied as one flat run.
absl::Status CudaCopy(const Tensor& src, Tensor& dst) {
  const int device = dst.device().index;
  if (src.is_contiguous() && dst.is_contiguous()) {
    if (src.dtype() == dst.dtype()) return cu::Memcpy(device, dst.raw_data(), src.raw_data(), dst.nbytes());
    cu::Layout flat;
    flat.ndim = 1;
    flat.shape[0] = src.numel();
    flat.strides[0] = 1;
    return cu::StridedCopy(device, src.raw_data(), flat, Elem(src.dtype()), dst.raw_data(), flat, Elem(dst.dtype()));
  }
  if (src.dim() > cu::kMaxDims) {
    return absl::UnimplementedError(absl::StrCat("strided CUDA copies of more than ", cu::kMaxDims, " dims"));
  }
  return cu::StridedCopy(device, src.raw_data(), LayoutOf(src), Elem(src.dtype()), dst.raw_data(), LayoutOf(dst),
                         Elem(dst.dtype()));
}
}  // namespace
#endif

absl::StatusOr<Tensor> Tensor::ToDType(DType dtype) const {
  if (dtype == dtype_) return Clone();
  ASSIGN_OR_RETURN(Tensor out, Empty(shape_, dtype, device()));
#ifdef COLOD_WITH_CUDA
  if (device().is_cuda()) {
    RETURN_IF_ERROR(CudaCopy(*this, out));
    return out;
  }
#endif
  const size_t es = SizeOf(dtype_), eo = SizeOf(dtype);
  char* dst = out.base();
  const char* src = base();
  const bool ints = !IsFloat(dtype_) && !IsFloat(dtype);
  ForEachOffset([&](int64_t off) {
    if (ints) {
      StoreInt(dst, dtype, LoadInt(src + off * es, dtype_));
    } else {
      StoreFloat(dst, dtype, LoadFloat(src + off * es, dtype_));
    }
    dst += eo;
  });
  return out;
}

absl::StatusOr<Tensor> Tensor::To(Device device) const {
  if (device == this->device()) return *this;
  const Tensor c = Contiguous();
  ASSIGN_OR_RETURN(Tensor out, Empty(shape_, dtype_, device));
#ifdef COLOD_WITH_CUDA
  // cudaMemcpyDefault tells host from device pointers (unified addressing).
  const int ordinal = device.is_cuda() ? device.index : c.device().index;
  RETURN_IF_ERROR(cu::Memcpy(ordinal, out.raw_data(), c.raw_data(), out.nbytes()));
  return out;
#else
  return NoCuda(device.is_cuda() ? device : c.device());
#endif
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
  if (device().is_cuda()) {
#ifdef COLOD_WITH_CUDA
    // The source, on this device and not overlapping the destination.
    Tensor s = src;
    if (src.device() != device()) {
      ASSIGN_OR_RETURN(s, src.To(device()));
    } else if (src.SharesStorageWith(*this)) {
      s = src.Clone();
    }
    return CudaCopy(s, *this);
#else
    return NoCuda(device());
#endif
  }
  ASSIGN_OR_RETURN(Tensor s, src.To(device()));
  s = s.Contiguous();
  const size_t es = SizeOf(dtype_);
  const char* from = s.base() + s.offset_ * es;
  if (is_contiguous()) {
    if (nbytes() > 0) std::memmove(base() + offset_ * es, from, nbytes());
    return absl::OkStatus();
  }
  char* dst_base = base();
  ForEachOffset([&](int64_t off) {
    std::memcpy(dst_base + off * es, from, es);
    from += es;
  });
  return absl::OkStatus();
}

std::vector<float> Tensor::ToFloats() const {
  if (device().is_cuda()) return OrDie(To(Device::Cpu()), "Tensor::ToFloats").ToFloats();
  std::vector<float> out;
  out.reserve(numel());
  const size_t es = SizeOf(dtype_);
  ForEachOffset([&](int64_t off) { out.push_back(LoadFloat(base() + off * es, dtype_)); });
  return out;
}

std::vector<int64_t> Tensor::ToInt64s() const {
  if (device().is_cuda()) return OrDie(To(Device::Cpu()), "Tensor::ToInt64s").ToInt64s();
  std::vector<int64_t> out;
  out.reserve(numel());
  const size_t es = SizeOf(dtype_);
  ForEachOffset([&](int64_t off) { out.push_back(LoadInt(base() + off * es, dtype_)); });
  return out;
}

std::string Tensor::ToBytes() const {
  Tensor c = OrDie(To(Device::Cpu()), "Tensor::ToBytes").Contiguous();
  return std::string(c.base() + c.offset_ * SizeOf(dtype_), nbytes());
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

template <typename T, typename Op>
void BinaryLoop(const Tensor& a, const Tensor& b, Tensor& out, Op op) {
  const T* x = a.data<T>();
  const T* y = b.data<T>();
  T* z = out.data<T>();
  const int64_t n = out.numel();
  for (int64_t i = 0; i < n; ++i) z[i] = op(x[i], y[i]);  // vectorized by the compiler
}

template <typename Op>
absl::StatusOr<Tensor> Binary(const Tensor& a, const Tensor& b, absl::string_view name, int cuda_op, Op op) {
  RETURN_IF_ERROR(SameShape(a, b, name));
  Tensor ca = a.Contiguous(), cb = b.Contiguous();
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(a.shape(), a.dtype(), a.device()));
  if (a.device().is_cuda()) {
#ifdef COLOD_WITH_CUDA
    RETURN_IF_ERROR(cu::Binary(a.device().index, static_cast<cu::BinaryOp>(cuda_op), Elem(a.dtype()), ca.raw_data(),
                               cb.raw_data(), out.raw_data(), out.numel()));
    return out;
#else
    (void)cuda_op;
    return NoCuda(a.device());
#endif
  }
  switch (a.dtype()) {
    case DType::kF32: BinaryLoop<float>(ca, cb, out, op); break;
    case DType::kI32: BinaryLoop<int32_t>(ca, cb, out, op); break;
    case DType::kI64: BinaryLoop<int64_t>(ca, cb, out, op); break;
    case DType::kBF16:
    case DType::kF16: {  // computed in f32, rounded once
      std::vector<float> x = ca.ToFloats(), y = cb.ToFloats(), z(x.size());
      for (size_t i = 0; i < z.size(); ++i) z[i] = op(x[i], y[i]);
      return Tensor::FromFloats(a.shape(), z, a.dtype());
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<Tensor> Add(const Tensor& a, const Tensor& b) {
  return Binary(a, b, "add", 0, [](auto x, auto y) { return x + y; });
}
absl::StatusOr<Tensor> Sub(const Tensor& a, const Tensor& b) {
  return Binary(a, b, "sub", 1, [](auto x, auto y) { return x - y; });
}
absl::StatusOr<Tensor> Mul(const Tensor& a, const Tensor& b) {
  return Binary(a, b, "mul", 2, [](auto x, auto y) { return x * y; });
}

absl::StatusOr<Tensor> Scale(const Tensor& a, float s) {
  if (!IsFloat(a.dtype())) return absl::InvalidArgumentError("scale: float dtypes only");
#ifdef COLOD_WITH_CUDA
  if (a.device().is_cuda()) {
    const Tensor ca = a.Contiguous();
    ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(a.shape(), a.dtype(), a.device()));
    RETURN_IF_ERROR(cu::Scale(a.device().index, Elem(a.dtype()), ca.raw_data(), s, out.raw_data(), out.numel()));
    return out;
  }
#endif
  std::vector<float> v = a.ToFloats();
  for (float& x : v) x *= s;
  return Tensor::FromFloats(a.shape(), v, a.dtype());
}

absl::Status AddInPlace(Tensor& a, const Tensor& b) {
  RETURN_IF_ERROR(SameShape(a, b, "add_"));
  if (!a.is_contiguous()) return absl::InvalidArgumentError("add_: the destination must be contiguous");
  ASSIGN_OR_RETURN(Tensor sum, Add(a, b));
  return a.CopyFrom(sum);
}

double SumAll(const Tensor& a) {
#ifdef COLOD_WITH_CUDA
  if (a.device().is_cuda()) {
    const Tensor ca = a.Contiguous();
    return OrDie(cu::Sum(a.device().index, Elem(a.dtype()), ca.raw_data(), ca.numel()), "SumAll");
  }
#endif
  double s = 0;
  for (float v : a.ToFloats()) s += v;
  return s;
}

}  // namespace colod
