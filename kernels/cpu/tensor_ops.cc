#include "kernels/cpu/tensor_ops.h"

#include <malloc.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "kernels/half.h"
#include "kernels/philox.h"

namespace colod::kernels::cpu {
namespace {

bool IsInt(ElemType t) { return t == ElemType::kI32 || t == ElemType::kI64; }

int64_t LoadI(const char* p, ElemType t) {
  if (t == ElemType::kI32) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
  }
  int64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

void StoreI(char* p, ElemType t, int64_t v) {
  if (t == ElemType::kI32) {
    const int32_t x = static_cast<int32_t>(v);
    std::memcpy(p, &x, 4);
  } else {
    std::memcpy(p, &v, 8);
  }
}

// Copies one run of n elements (strides in elements) with conversion.
void CopyRun(const char* src, int64_t ss, ElemType st, char* dst, int64_t ds, ElemType dt, int64_t n) {
  const int sb = ElemBytes(st), db = ElemBytes(dt);
  if (st == dt) {
    if (ss == 1 && ds == 1) {
      std::memcpy(dst, src, static_cast<size_t>(n) * sb);
      return;
    }
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * ds * db, src + i * ss * sb, sb);
  } else if (IsInt(st) && IsInt(dt)) {
    for (int64_t i = 0; i < n; ++i) StoreI(dst + i * ds * db, dt, LoadI(src + i * ss * sb, st));
  } else {
    for (int64_t i = 0; i < n; ++i) StoreF(dst, i * ds, dt, LoadF(src, i * ss, st));
  }
}

bool Contiguous(const Layout& l) {
  int64_t expected = 1;
  for (int d = l.ndim - 1; d >= 0; --d) {
    if (l.shape[d] == 1) continue;
    if (l.strides[d] != expected) return false;
    expected *= l.shape[d];
  }
  return true;
}

template <typename T, typename Op>
void Loop(const void* a, const void* b, void* out, int64_t n, Op op) {
  const T* x = static_cast<const T*>(a);
  const T* y = static_cast<const T*>(b);
  T* z = static_cast<T*>(out);
  for (int64_t i = 0; i < n; ++i) z[i] = op(x[i], y[i]);  // vectorized by the compiler
}

template <typename T>
void ApplyBinary(BinaryOp op, const void* a, const void* b, void* out, int64_t n) {
  switch (op) {
    case BinaryOp::kAdd: Loop<T>(a, b, out, n, [](T x, T y) { return x + y; }); return;
    case BinaryOp::kSub: Loop<T>(a, b, out, n, [](T x, T y) { return x - y; }); return;
    case BinaryOp::kMul: Loop<T>(a, b, out, n, [](T x, T y) { return x * y; }); return;
  }
}

// glibc hands out large blocks with mmap and gives freed heap tops back to
// the kernel, so a training step's activations (the same sizes every step)
// fault in fresh zeroed pages each time: about a tenth of a CPU step. Keep
// blocks up to glibc's largest mmap threshold (32 MiB) on the heap, and keep
// up to 1 GiB of freed heap for the next step, as a caching allocator would.
[[maybe_unused]] const bool kHeapKeptForReuse = [] {
  mallopt(M_MMAP_THRESHOLD, 32 << 20);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  return true;
}();

}  // namespace

absl::StatusOr<void*> Malloc(int, size_t nbytes) {
  constexpr size_t kAlign = 64;
  if (nbytes > SIZE_MAX - kAlign) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", nbytes, " host bytes"));
  }
  const size_t rounded = (nbytes + kAlign - 1) / kAlign * kAlign;
  void* p = std::aligned_alloc(kAlign, rounded == 0 ? kAlign : rounded);
  if (p == nullptr) return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", nbytes, " host bytes"));
  return p;
}

void Free(int, void* p) { std::free(p); }

absl::Status Memset0(int, void* p, size_t nbytes) {
  if (nbytes > 0) std::memset(p, 0, nbytes);
  return absl::OkStatus();
}

absl::Status Memcpy(int, void* dst, const void* src, size_t nbytes) {
  if (nbytes > 0) std::memmove(dst, src, nbytes);
  return absl::OkStatus();
}

absl::Status Upload(int, void* dst, const void* src, size_t nbytes) {
  if (nbytes > 0) std::memcpy(dst, src, nbytes);
  return absl::OkStatus();
}

namespace {

// The CPU twin's started reads: their bytes, copied at StartRead.
struct StartedReads {
  absl::Mutex mu;
  uint64_t next ABSL_GUARDED_BY(mu) = 1;
  std::map<uint64_t, std::string> bytes ABSL_GUARDED_BY(mu);
};

StartedReads& Started() {
  static auto* reads = new StartedReads;  // kept until exit
  return *reads;
}

}  // namespace

absl::StatusOr<uint64_t> StartRead(int, const void* src, size_t nbytes) {
  if (nbytes > kMaxStartedRead) {
    return absl::InvalidArgumentError(absl::StrCat("StartRead: ", nbytes, " bytes (at most ", kMaxStartedRead, ")"));
  }
  std::string copy(static_cast<const char*>(src), nbytes);
  StartedReads& r = Started();
  absl::MutexLock lock(&r.mu);
  const uint64_t ticket = r.next++;
  r.bytes.emplace(ticket, std::move(copy));
  return ticket;
}

absl::Status FinishRead(int, uint64_t ticket, void* dst, size_t nbytes) {
  std::string copy;
  {
    StartedReads& r = Started();
    absl::MutexLock lock(&r.mu);
    auto it = r.bytes.find(ticket);
    if (it == r.bytes.end()) return absl::InvalidArgumentError(absl::StrCat("FinishRead: no read ", ticket));
    copy = std::move(it->second);
    r.bytes.erase(it);
  }
  if (copy.size() != nbytes) {
    return absl::InvalidArgumentError(absl::StrCat("FinishRead: read ", ticket, " holds ", copy.size(), " bytes, not ",
                                                   nbytes));
  }
  if (nbytes > 0) std::memcpy(dst, copy.data(), nbytes);
  return absl::OkStatus();
}

void DropRead(int, uint64_t ticket) {
  StartedReads& r = Started();
  absl::MutexLock lock(&r.mu);
  r.bytes.erase(ticket);
}

absl::Status StridedCopy(int, const void* src, const Layout& sl, ElemType st, void* dst, const Layout& dl,
                         ElemType dt) {
  if (sl.ndim != dl.ndim || sl.ndim > kMaxDims || sl.ndim < 0) {
    return absl::InvalidArgumentError("StridedCopy: layouts differ in rank or exceed kMaxDims");
  }
  int64_t n = 1;
  for (int d = 0; d < sl.ndim; ++d) {
    if (sl.shape[d] != dl.shape[d]) return absl::InvalidArgumentError("StridedCopy: shapes differ");
    n *= sl.shape[d];
  }
  if (n == 0) return absl::OkStatus();
  const char* s = static_cast<const char*>(src);
  char* o = static_cast<char*>(dst);
  if (Contiguous(sl) && Contiguous(dl)) {
    CopyRun(s, 1, st, o, 1, dt, n);
    return absl::OkStatus();
  }
  // An odometer over every dim but the last; the last dim is one run.
  const int last = sl.ndim - 1;
  const int64_t run = sl.shape[last];
  const int sb = ElemBytes(st), db = ElemBytes(dt);
  int64_t idx[kMaxDims] = {};
  int64_t so = 0, dof = 0;
  for (int64_t done = 0; done < n; done += run) {
    CopyRun(s + so * sb, sl.strides[last], st, o + dof * db, dl.strides[last], dt, run);
    for (int d = last - 1; d >= 0; --d) {
      if (++idx[d] < sl.shape[d]) {
        so += sl.strides[d];
        dof += dl.strides[d];
        break;
      }
      so -= sl.strides[d] * (sl.shape[d] - 1);
      dof -= dl.strides[d] * (dl.shape[d] - 1);
      idx[d] = 0;
    }
  }
  return absl::OkStatus();
}

absl::Status FillRandom(int, void* p, ElemType type, int64_t n, uint64_t seed, bool normal) {
  if (IsInt(type)) return absl::InvalidArgumentError("FillRandom: float types only");
  char* o = static_cast<char*>(p);
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t k = static_cast<uint64_t>(i);
    StoreF(o, i, type, normal ? PhiloxNormal(seed, k) : PhiloxUniform(seed, k));
  }
  return absl::OkStatus();
}

absl::Status Binary(int, BinaryOp op, ElemType type, const void* a, const void* b, void* out, int64_t n) {
  switch (type) {
    case ElemType::kF32: ApplyBinary<float>(op, a, b, out, n); break;
    case ElemType::kI32: ApplyBinary<int32_t>(op, a, b, out, n); break;
    case ElemType::kI64: ApplyBinary<int64_t>(op, a, b, out, n); break;
    case ElemType::kBF16:
    case ElemType::kF16: {  // computed in f32, rounded once
      const char* x = static_cast<const char*>(a);
      const char* y = static_cast<const char*>(b);
      char* z = static_cast<char*>(out);
      for (int64_t i = 0; i < n; ++i) {
        const float u = LoadF(x, i, type), v = LoadF(y, i, type);
        StoreF(z, i, type, op == BinaryOp::kAdd ? u + v : (op == BinaryOp::kSub ? u - v : u * v));
      }
      break;
    }
  }
  return absl::OkStatus();
}

absl::Status ScaleBy(int, ElemType type, const void* a, const float* s, ElemType out_type, void* out, int64_t n) {
  if (IsInt(type) || IsInt(out_type)) return absl::InvalidArgumentError("ScaleBy: float types only");
  const char* x = static_cast<const char*>(a);
  char* z = static_cast<char*>(out);
  const float f = *s;
  for (int64_t i = 0; i < n; ++i) StoreF(z, i, out_type, LoadF(x, i, type) * f);
  return absl::OkStatus();
}

absl::Status Scale(int, ElemType type, const void* a, float s, void* out, int64_t n) {
  if (IsInt(type)) return absl::InvalidArgumentError("Scale: float types only");
  const char* x = static_cast<const char*>(a);
  char* z = static_cast<char*>(out);
  if (type == ElemType::kF32) {
    const float* xf = static_cast<const float*>(a);
    float* zf = static_cast<float*>(out);
    for (int64_t i = 0; i < n; ++i) zf[i] = xf[i] * s;
    return absl::OkStatus();
  }
  for (int64_t i = 0; i < n; ++i) StoreF(z, i, type, LoadF(x, i, type) * s);
  return absl::OkStatus();
}

absl::StatusOr<double> Sum(int, ElemType type, const void* a, int64_t n) {
  const char* x = static_cast<const char*>(a);
  const int eb = ElemBytes(type);
  double s = 0;
  for (int64_t i = 0; i < n; ++i) {
    s += IsInt(type) ? static_cast<double>(LoadI(x + i * eb, type)) : static_cast<double>(LoadF(x, i, type));
  }
  return s;
}

absl::Status AccumulateSum(int, const std::vector<BufferRef>& parts, bool square, float* acc) {
  for (const BufferRef& p : parts) {
    if (IsInt(p.type)) return absl::InvalidArgumentError("AccumulateSum: float types only");
  }
  double s = 0;
  for (const BufferRef& p : parts) {
    for (int64_t i = 0; i < p.n; ++i) {
      const double v = LoadF(p.data, i, p.type);
      s += square ? v * v : v;
    }
  }
  acc[0] += static_cast<float>(s);
  return absl::OkStatus();
}

}  // namespace colod::kernels::cpu
