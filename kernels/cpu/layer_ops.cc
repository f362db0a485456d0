#include "kernels/cpu/layer_ops.h"

#include <cblas.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <system_error>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/activation.h"
#include "kernels/clip.h"
#include "kernels/gelu.h"
#include "kernels/half.h"
#include "kernels/philox.h"
#include "kernels/cpu/tensor_ops.h"
#include "kernels/cpu/vec_math.h"

namespace colod::kernels::cpu {
namespace {

std::atomic<int> blas_threads{1};

// Runs fn(begin, end) over [0, n) split across BlasThreads() threads (the
// calling one included) when n is large enough to pay for the threads.
template <typename Fn>
void ParallelFor(int64_t n, Fn fn) {
  constexpr int64_t kMinPerThread = 1 << 16;
  const int threads = static_cast<int>(std::min<int64_t>(blas_threads.load(), n / kMinPerThread));
  if (threads <= 1) {
    fn(int64_t{0}, n);
    return;
  }
  std::vector<std::thread> pool;
  pool.reserve(threads);  // no reallocation (bad_alloc) with threads started
  const int64_t chunk = (n + threads - 1) / threads;
  for (int t = 1; t < threads; ++t) {
    const int64_t b = t * chunk, e = std::min(n, b + chunk);
    if (b >= e) continue;
    try {
      pool.emplace_back([=] { fn(b, e); });
    } catch (const std::system_error&) {
      fn(b, e);  // no thread to be had: this one does the chunk
    }
  }
  fn(int64_t{0}, std::min(n, chunk));
  for (auto& th : pool) th.join();
}

// Calls span(offset, column, len) over the elements [begin, end) of a
// [rows, n] matrix cut at row ends, so that each span's columns run
// contiguously from `column`.
template <typename Span>
void ByRowSpans(int64_t begin, int64_t end, int64_t n, Span span) {
  for (int64_t i = begin; i < end;) {
    const int64_t column = i % n, len = std::min(end - i, n - column);
    span(i, column, len);
    i += len;
  }
}

// A bf16/f16 buffer widened to f32.
std::vector<float> Widen(ElemType type, const void* p, int64_t n) {
  std::vector<float> out(n);
  const uint16_t* h = static_cast<const uint16_t*>(p);
  for (int64_t i = 0; i < n; ++i) out[i] = type == ElemType::kBF16 ? BF16ToFloat(h[i]) : F16ToFloat(h[i]);
  return out;
}


// log(sum(exp(row))) in double.
double LogSumExp(const float* row, int64_t v) {
  float mx = row[0];
  for (int64_t j = 1; j < v; ++j) mx = std::max(mx, row[j]);
  double s = 0;
  for (int64_t j = 0; j < v; ++j) s += std::exp(static_cast<double>(row[j]) - mx);
  return mx + std::log(s);
}

}  // namespace

// OpenBLAS starts with a thread per core, whose helpers spin between calls
// (sched_yield); colod's CPU ranks each use one unless SetBlasThreads says
// otherwise, and ranks that are threads of one process would otherwise queue
// on OpenBLAS's lock for its threaded path.
[[maybe_unused]] static const bool kOneBlasThreadAtStart = [] {
  SetBlasThreads(1);
  return true;
}();

void PreferAvx512Blas(char** argv) {
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr) return;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512cd") ||
      !__builtin_cpu_supports("avx512bw") || !__builtin_cpu_supports("avx512dq") ||
      !__builtin_cpu_supports("avx512vl")) {
    return;
  }
  const char* core = openblas_get_corename();
  if (core == nullptr || (std::strcmp(core, "Haswell") != 0 && std::strcmp(core, "Zen") != 0)) return;
  ::setenv("OPENBLAS_CORETYPE", "SKYLAKEX", 1);
  ::execv("/proc/self/exe", argv);  // returns only on failure: run on with the kernels there are
}

void SetBlasThreads(int n) {
  blas_threads = n < 1 ? 1 : n;
  openblas_set_num_threads(blas_threads);
}

int BlasThreads() { return blas_threads; }

namespace {

// Gemm's checks: INVALID_ARGUMENT for operands that are not float or
// dimensions BLAS's ints cannot hold.
absl::Status CheckGemm(ElemType type, int64_t m, int64_t n, int64_t k) {
  if (type != ElemType::kF32 && type != ElemType::kBF16 && type != ElemType::kF16) {
    return absl::InvalidArgumentError("Gemm: f32, bf16 or f16 operands only");
  }
  if (m < 0 || n < 0 || k < 0 || m > INT_MAX || n > INT_MAX || k > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("Gemm: [", m, ", ", k, "] @ [", k, ", ", n,
                                                   "] exceeds BLAS's int dimensions"));
  }
  return absl::OkStatus();
}

// out [m, n] f32 = op(A) op(B) + beta * out, the operands widened from `type`.
void WidenedSgemm(ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a,
                  const void* b, float* out, float beta) {
  std::vector<float> wa, wb;
  const float* pa = static_cast<const float*>(a);
  const float* pb = static_cast<const float*>(b);
  if (type != ElemType::kF32) {
    wa = Widen(type, a, m * k);
    wb = Widen(type, b, k * n);
    pa = wa.data();
    pb = wb.data();
  }
  if (k == 0) {
    if (beta == 0.0f) std::fill(out, out + m * n, 0.0f);
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, pa,
              static_cast<int>(trans_a ? m : k), pb, static_cast<int>(trans_b ? k : n), beta, out, static_cast<int>(n));
}

}  // namespace

absl::Status Gemm(int, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a,
                  const void* b, void* c) {
  if (absl::Status s = CheckGemm(type, m, n, k); !s.ok()) return s;
  if (m == 0 || n == 0) return absl::OkStatus();
  if (type == ElemType::kF32) {
    WidenedSgemm(type, trans_a, trans_b, m, n, k, a, b, static_cast<float*>(c), 0.0f);
    return absl::OkStatus();
  }
  std::vector<float> wc(m * n);
  WidenedSgemm(type, trans_a, trans_b, m, n, k, a, b, wc.data(), 0.0f);
  uint16_t* h = static_cast<uint16_t*>(c);
  for (int64_t i = 0; i < m * n; ++i) h[i] = type == ElemType::kBF16 ? FloatToBF16(wc[i]) : FloatToF16(wc[i]);
  return absl::OkStatus();
}

absl::Status GemmF32Out(int, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                        const void* a, const void* b, float* c, bool accumulate) {
  if (absl::Status s = CheckGemm(type, m, n, k); !s.ok()) return s;
  if (m == 0 || n == 0) return absl::OkStatus();
  WidenedSgemm(type, trans_a, trans_b, m, n, k, a, b, c, accumulate ? 1.0f : 0.0f);
  return absl::OkStatus();
}

absl::Status GeluF32(int, const float* x, const float* bias, float* y, int64_t rows, int64_t n, bool tanh_approx);
absl::Status GeluBackwardF32(int d, const float* dy, const float* x, const float* bias, float* dx, float* db,
                             int64_t rows, int64_t n, bool tanh_approx);

namespace {

// out [m, n] f32 = op(A) op(B) + bias, the bias widened from `type`.
void ProductsPlusBias(ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a,
                      const void* b, const void* bias, float* out) {
  WidenedSgemm(type, trans_a, trans_b, m, n, k, a, b, out, 0.0f);
  std::vector<float> wbias;
  const float* fb = static_cast<const float*>(bias);
  if (type != ElemType::kF32) {
    wbias = Widen(type, bias, n);
    fb = wbias.data();
  }
  ParallelFor(m * n, [&](int64_t begin, int64_t end) {
    ByRowSpans(begin, end, n, [&](int64_t i, int64_t j, int64_t len) {
      for (int64_t e = 0; e < len; ++e) out[i + e] += fb[j + e];
    });
  });
}

// dst (of bf16 or f16 `type`) <- the f32 values rounded to nearest even.
void RoundInto(ElemType type, const float* f, void* dst, int64_t count) {
  uint16_t* h = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < count; ++i) h[i] = type == ElemType::kBF16 ? FloatToBF16(f[i]) : FloatToF16(f[i]);
}

}  // namespace

absl::Status GemmBias(int, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void* a,
                      const void* b, const void* bias, void* c) {
  if (absl::Status s = CheckGemm(type, m, n, k); !s.ok()) return s;
  if (m == 0 || n == 0) return absl::OkStatus();
  // The products in f32 (C itself where it is f32), the bias added there,
  // each element rounded to `type` once.
  if (type == ElemType::kF32) {
    ProductsPlusBias(type, trans_a, trans_b, m, n, k, a, b, bias, static_cast<float*>(c));
    return absl::OkStatus();
  }
  std::vector<float> wc(static_cast<size_t>(m * n));
  ProductsPlusBias(type, trans_a, trans_b, m, n, k, a, b, bias, wc.data());
  RoundInto(type, wc.data(), c, m * n);
  return absl::OkStatus();
}

absl::Status GemmBiasGelu(int d, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                          const void* a, const void* b, const void* bias, void* c, void* pre) {
  if (absl::Status s = CheckGemm(type, m, n, k); !s.ok()) return s;
  if (m == 0 || n == 0) return absl::OkStatus();
  if (type == ElemType::kF32) {
    ProductsPlusBias(type, trans_a, trans_b, m, n, k, a, b, bias, static_cast<float*>(pre));
    return GeluF32(d, static_cast<const float*>(pre), nullptr, static_cast<float*>(c), 1, m * n, true);
  }
  std::vector<float> v(static_cast<size_t>(m * n)), y(static_cast<size_t>(m * n));
  ProductsPlusBias(type, trans_a, trans_b, m, n, k, a, b, bias, v.data());
  if (absl::Status s = GeluF32(d, v.data(), nullptr, y.data(), 1, m * n, true); !s.ok()) return s;
  RoundInto(type, v.data(), pre, m * n);
  RoundInto(type, y.data(), c, m * n);
  return absl::OkStatus();
}

absl::Status GemmDGelu(int d, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                       const void* a, const void* b, const void* pre, void* c) {
  if (absl::Status s = CheckGemm(type, m, n, k); !s.ok()) return s;
  if (m == 0 || n == 0) return absl::OkStatus();
  // The f32 products times GELU's slope, GeluBackward's arithmetic: at f32
  // the bits of Gemm then GeluBackward.
  if (type == ElemType::kF32) {
    float* out = static_cast<float*>(c);
    WidenedSgemm(type, trans_a, trans_b, m, n, k, a, b, out, 0.0f);
    return GeluBackwardF32(d, out, static_cast<const float*>(pre), nullptr, out, nullptr, 1, m * n, true);
  }
  std::vector<float> v(static_cast<size_t>(m * n));
  WidenedSgemm(type, trans_a, trans_b, m, n, k, a, b, v.data(), 0.0f);
  const std::vector<float> wpre = Widen(type, pre, m * n);
  if (absl::Status s = GeluBackwardF32(d, v.data(), wpre.data(), nullptr, v.data(), nullptr, 1, m * n, true);
      !s.ok()) {
    return s;
  }
  RoundInto(type, v.data(), c, m * n);
  return absl::OkStatus();
}

absl::Status GemmBiasGrad(int d, ElemType type, int64_t m, int64_t n, int64_t k, const void* dy, const void* x,
                          void* dw, void* db) {
  if (absl::Status s = CheckGemm(type, m, n, k); !s.ok()) return s;
  if (absl::Status s = Gemm(d, type, /*trans_a=*/true, /*trans_b=*/false, m, n, k, dy, x, dw); !s.ok()) return s;
  return BiasGrad(d, type, dy, db, k, m);  // dy [k, m]: its column sums, in double
}

absl::Status SetAllowTf32(int, bool) { return absl::OkStatus(); }  // OpenBLAS has no TF32

bool GemmEpilogues(int) { return true; }  // the bias added to the f32 products saves a pass and a rounding

absl::Status BiasAddF32(int, const float* x, const float* bias, float* out, int64_t rows, int64_t n) {
  ParallelFor(rows * n, [&](int64_t begin, int64_t end) {
    ByRowSpans(begin, end, n, [&](int64_t i, int64_t j, int64_t len) {
      for (int64_t k = 0; k < len; ++k) out[i + k] = x[i + k] + bias[j + k];
    });
  });
  return absl::OkStatus();
}

absl::Status BiasGradF32(int, const float* dy, float* db, int64_t rows, int64_t n) {
  std::vector<double> acc(n, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) acc[j] += dy[r * n + j];
  }
  for (int64_t j = 0; j < n; ++j) db[j] = static_cast<float>(acc[j]);
  return absl::OkStatus();
}

namespace {

// The tanh-GELU spans: y[i] = GELU(x[i] (+ b[i])) and dx[i] = dy[i] *
// GELU'(x[i] (+ b[i])) over contiguous elements, with VecTanh so that the
// loops vectorize; an AVX2 build of each where the CPU has it
// (COLOD_AVX2_OR_GENERIC).
template <bool kBias>
__attribute__((always_inline)) inline void GeluTanhLoop(const float* x, const float* b, float* y, int64_t len) {
  for (int64_t i = 0; i < len; ++i) {
    const float v = kBias ? x[i] + b[i] : x[i];
    y[i] = 0.5f * v * (1.0f + VecTanh(kGeluSqrt2OverPi * (v + kGeluC * v * v * v)));
  }
}

template <bool kBias>
__attribute__((always_inline)) inline void GeluTanhSlopeLoop(const float* dy, const float* x, const float* b,
                                                             float* dx, int64_t len) {
  for (int64_t i = 0; i < len; ++i) {
    const float v = kBias ? x[i] + b[i] : x[i];
    const float t = VecTanh(kGeluSqrt2OverPi * (v + kGeluC * v * v * v));
    const float du = kGeluSqrt2OverPi * (1.0f + 3.0f * kGeluC * v * v);
    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
  }
}

COLOD_AVX2_OR_GENERIC(void, GeluTanhSpan, (const float* x, const float* b, float* y, int64_t len), {
  if (b == nullptr) return GeluTanhLoop<false>(x, nullptr, y, len);
  GeluTanhLoop<true>(x, b, y, len);
}, (x, b, y, len))

COLOD_AVX2_OR_GENERIC(void, GeluTanhSlopeSpan,
                      (const float* dy, const float* x, const float* b, float* dx, int64_t len), {
  if (b == nullptr) return GeluTanhSlopeLoop<false>(dy, x, nullptr, dx, len);
  GeluTanhSlopeLoop<true>(dy, x, b, dx, len);
}, (dy, x, b, dx, len))

}  // namespace

// y = GELU(x + bias) over [rows, n] (bias null: GELU(x)).
absl::Status GeluF32(int, const float* x, const float* bias, float* y, int64_t rows, int64_t n, bool tanh_approx) {
  if (n == 0) return absl::OkStatus();
  ParallelFor(rows * n, [&](int64_t begin, int64_t end) {
    if (bias == nullptr) {
      if (tanh_approx) return GeluTanhSpan(x + begin, nullptr, y + begin, end - begin);
      for (int64_t i = begin; i < end; ++i) y[i] = GeluAt(x[i], false);
      return;
    }
    ByRowSpans(begin, end, n, [&](int64_t i, int64_t j, int64_t len) {
      if (tanh_approx) return GeluTanhSpan(x + i, bias + j, y + i, len);
      for (int64_t k = 0; k < len; ++k) y[i + k] = GeluAt(x[i + k] + bias[j + k], false);
    });
  });
  return absl::OkStatus();
}

// dx = dy * GELU'(x + bias); db (if not null) = the column sums of dx.
absl::Status GeluBackwardF32(int d, const float* dy, const float* x, const float* bias, float* dx, float* db,
                             int64_t rows, int64_t n, bool tanh_approx) {
  if (n == 0) return absl::OkStatus();
  ParallelFor(rows * n, [&](int64_t begin, int64_t end) {
    if (bias == nullptr) {
      if (tanh_approx) return GeluTanhSlopeSpan(dy + begin, x + begin, nullptr, dx + begin, end - begin);
      for (int64_t i = begin; i < end; ++i) dx[i] = dy[i] * GeluSlopeAt(x[i], false);
      return;
    }
    ByRowSpans(begin, end, n, [&](int64_t i, int64_t j, int64_t len) {
      if (tanh_approx) return GeluTanhSlopeSpan(dy + i, x + i, bias + j, dx + i, len);
      for (int64_t k = 0; k < len; ++k) dx[i + k] = dy[i + k] * GeluSlopeAt(x[i + k] + bias[j + k], false);
    });
  });
  return db == nullptr ? absl::OkStatus() : BiasGradF32(d, dx, db, rows, n);
}

absl::Status ActivationF32(int, ActivationKind kind, const float* x, float* y, int64_t n) {
  ParallelFor(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) y[i] = ActivationAt(x[i], kind);
  });
  return absl::OkStatus();
}

absl::Status ActivationBackwardF32(int, ActivationKind kind, const float* dy, const float* x, float* dx, int64_t n) {
  ParallelFor(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dx[i] = dy[i] * ActivationSlopeAt(x[i], kind);
  });
  return absl::OkStatus();
}

namespace {

// The sum over j < n of term(j) in double, kept as 16 interleaved partial
// sums added at the end. One running sum is a chain of dependent adds that
// the compiler may not reorder (4 cycles an element, and the norms and
// softmaxes are row reductions); independent partial sums vectorize.
template <typename Term>
__attribute__((always_inline)) inline double RowSum(int64_t n, Term term) {
  constexpr int64_t kLanes = 16;
  double part[kLanes] = {};
  const int64_t body = n - n % kLanes;
  for (int64_t j = 0; j < body; j += kLanes) {
    for (int64_t k = 0; k < kLanes; ++k) part[k] += term(j + k);
  }
  double s = 0;
  for (int64_t k = 0; k < kLanes; ++k) s += part[k];
  for (int64_t j = body; j < n; ++j) s += term(j);
  return s;
}

COLOD_AVX2_OR_GENERIC(void, LayerNormRows,
                      (const float* x, const float* g, const float* b, float eps, float* y, float* mean,
                       float* rstd, int64_t rows, int64_t n), {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    const double mu = RowSum(n, [row](int64_t j) { return static_cast<double>(row[j]); }) / n;
    const double v = RowSum(n, [row, mu](int64_t j) { return (row[j] - mu) * (row[j] - mu); });
    const float rs = static_cast<float>(1.0 / std::sqrt(v / n + eps));
    const float m = static_cast<float>(mu);
    float* out = y + r * n;
    for (int64_t j = 0; j < n; ++j) out[j] = (row[j] - m) * rs * g[j] + b[j];
    mean[r] = m;
    rstd[r] = rs;
  }
}, (x, g, b, eps, y, mean, rstd, rows, n))

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat =
// dy * gamma; acc_g and acc_b gain each row's dy * xhat and dy.
COLOD_AVX2_OR_GENERIC(void, LayerNormBackwardRows,
                      (const float* dy, const float* x, const float* g, const float* mean, const float* rstd,
                       float* dx, double* acc_g, double* acc_b, int64_t rows, int64_t n), {
  for (int64_t r = 0; r < rows; ++r) {
    const float m = mean[r];
    const float rs = rstd[r];
    const float* row = x + r * n;
    const float* drow = dy + r * n;
    const double sum_dxhat = RowSum(n, [drow, g](int64_t j) { return static_cast<double>(drow[j] * g[j]); });
    const double sum_dxhat_xhat = RowSum(n, [drow, g, row, m, rs](int64_t j) {
      return static_cast<double>(drow[j] * g[j]) * ((row[j] - m) * rs);
    });
    for (int64_t j = 0; j < n; ++j) {
      acc_g[j] += static_cast<double>(drow[j]) * ((row[j] - m) * rs);
      acc_b[j] += drow[j];
    }
    const float a = static_cast<float>(sum_dxhat / n);
    const float c = static_cast<float>(sum_dxhat_xhat / n);
    float* out = dx + r * n;
    for (int64_t j = 0; j < n; ++j) out[j] = rs * (drow[j] * g[j] - a - (row[j] - m) * rs * c);
  }
}, (dy, x, g, mean, rstd, dx, acc_g, acc_b, rows, n))

COLOD_AVX2_OR_GENERIC(void, RmsNormRows,
                      (const float* x, const float* g, float eps, float* y, float* rstd, int64_t rows, int64_t n), {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    const double ss = RowSum(n, [row](int64_t j) { return static_cast<double>(row[j]) * row[j]; });
    const float rs = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
    float* out = y + r * n;
    for (int64_t j = 0; j < n; ++j) out[j] = row[j] * rs * g[j];
    rstd[r] = rs;
  }
}, (x, g, eps, y, rstd, rows, n))

// y = x * rs * g; dx = rs * (dy*g - x * rs^2 * mean(dy*g*x)); acc gains
// each row's dy * x * rs.
COLOD_AVX2_OR_GENERIC(void, RmsNormBackwardRows,
                      (const float* dy, const float* x, const float* g, const float* rstd, float* dx, double* acc,
                       int64_t rows, int64_t n), {
  for (int64_t r = 0; r < rows; ++r) {
    const float rs = rstd[r];
    const float* row = x + r * n;
    const float* drow = dy + r * n;
    const double dot = RowSum(n, [drow, g, row](int64_t j) { return static_cast<double>(drow[j]) * g[j] * row[j]; });
    for (int64_t j = 0; j < n; ++j) acc[j] += static_cast<double>(drow[j]) * row[j] * rs;
    const float c = static_cast<float>(dot / n) * rs * rs;
    float* out = dx + r * n;
    for (int64_t j = 0; j < n; ++j) out[j] = rs * (drow[j] * g[j] - row[j] * c);
  }
}, (dy, x, g, rstd, dx, acc, rows, n))

}  // namespace

absl::Status LayerNormF32(int, const float* x, const float* g, const float* b, float eps, float* y, float* mean,
                       float* rstd, int64_t rows, int64_t n) {
  LayerNormRows(x, g, b, eps, y, mean, rstd, rows, n);
  return absl::OkStatus();
}

absl::Status LayerNormBackwardF32(int, const float* dy, const float* x, const float* g, const float* mean,
                               const float* rstd, float* dx, float* dg, float* db, int64_t rows, int64_t n) {
  std::vector<double> acc_g(n, 0.0), acc_b(n, 0.0);
  LayerNormBackwardRows(dy, x, g, mean, rstd, dx, acc_g.data(), acc_b.data(), rows, n);
  for (int64_t j = 0; j < n; ++j) {
    dg[j] = static_cast<float>(acc_g[j]);
    db[j] = static_cast<float>(acc_b[j]);
  }
  return absl::OkStatus();
}

absl::Status RmsNormF32(int, const float* x, const float* g, float eps, float* y, float* rstd, int64_t rows,
                     int64_t n) {
  RmsNormRows(x, g, eps, y, rstd, rows, n);
  return absl::OkStatus();
}

absl::Status RmsNormBackwardF32(int, const float* dy, const float* x, const float* g, const float* rstd, float* dx,
                             float* dg, int64_t rows, int64_t n) {
  std::vector<double> acc(n, 0.0);
  RmsNormBackwardRows(dy, x, g, rstd, dx, acc.data(), rows, n);
  for (int64_t j = 0; j < n; ++j) dg[j] = static_cast<float>(acc[j]);
  return absl::OkStatus();
}

absl::Status Softmax(int, const float* x, float* y, int64_t rows, int64_t k, int64_t causal_q) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = causal_q > 0 ? (r % causal_q) + (k - causal_q) + 1 : k;
    const float* row = x + r * k;
    float* orow = y + r * k;
    float mx = row[0];
    for (int64_t j = 1; j < visible; ++j) mx = std::max(mx, row[j]);
    for (int64_t j = 0; j < visible; ++j) orow[j] = std::exp(row[j] - mx);
    const double sum = RowSum(visible, [orow](int64_t j) { return static_cast<double>(orow[j]); });
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j < visible; ++j) orow[j] *= inv;
    for (int64_t j = visible; j < k; ++j) orow[j] = 0.0f;
  }
  return absl::OkStatus();
}

absl::Status SoftmaxBackward(int, const float* dy, const float* y, float* dx, int64_t rows, int64_t k) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* py = y + r * k;
    const float* pd = dy + r * k;
    const double dot = RowSum(k, [pd, py](int64_t j) { return static_cast<double>(pd[j]) * py[j]; });
    for (int64_t j = 0; j < k; ++j) dx[r * k + j] = py[j] * (pd[j] - static_cast<float>(dot));
  }
  return absl::OkStatus();
}

absl::Status Dropout(int, const float* x, float* y, int64_t n, float p, uint64_t seed, uint64_t offset) {
  const float scale = 1.0f / (1.0f - p);
  for (int64_t i = 0; i < n; ++i) {
    y[i] = PhiloxUniform(seed, offset + static_cast<uint64_t>(i)) >= p ? x[i] * scale : 0.0f;
  }
  return absl::OkStatus();
}

absl::Status CrossEntropy(int, const float* logits, const int64_t* labels, float* loss, int64_t n, int64_t v,
                          float smoothing, int64_t ignore_index) {
  for (int64_t r = 0; r < n; ++r) {
    if (labels[r] == ignore_index) {
      loss[r] = 0.0f;
      continue;
    }
    const float* row = logits + r * v;
    const double lse = LogSumExp(row, v);
    double mean_logit = 0;
    for (int64_t j = 0; j < v; ++j) mean_logit += row[j];
    mean_logit /= v;
    loss[r] = static_cast<float>(lse - (1.0 - smoothing) * row[labels[r]] - smoothing * mean_logit);
  }
  return absl::OkStatus();
}

absl::Status CrossEntropyBackward(int, const float* dloss, const float* logits, const int64_t* labels,
                                  float* dlogits, int64_t n, int64_t v, float smoothing, int64_t ignore_index) {
  for (int64_t r = 0; r < n; ++r) {
    float* o = dlogits + r * v;
    if (labels[r] == ignore_index) {
      std::fill(o, o + v, 0.0f);
      continue;
    }
    const float* row = logits + r * v;
    const double lse = LogSumExp(row, v);
    for (int64_t j = 0; j < v; ++j) {
      const double target = smoothing / v + (j == labels[r] ? 1.0 - smoothing : 0.0);
      o[j] = static_cast<float>(dloss[r] * (std::exp(row[j] - lse) - target));
    }
  }
  return absl::OkStatus();
}

namespace {

// Row r's first n logits as f32: z itself for f32, else widened into `scratch`.
const float* LogitsRow(const void* z, ElemType type, int64_t r, int64_t width, int64_t n, std::vector<float>& scratch) {
  if (type == ElemType::kF32) return static_cast<const float*>(z) + r * width;
  scratch.resize(n);
  for (int64_t j = 0; j < n; ++j) scratch[j] = LoadF(z, r * width + j, type);
  return scratch.data();
}

}  // namespace

absl::Status VocabShardStats(int, ElemType type, const void* z, const int64_t* labels, int64_t rows, int64_t width,
                             int64_t real, int64_t start, int64_t ignore_index, float* mine) {
  float* const mx = mine;
  float* const stats = mine + rows;
  std::vector<float> scratch;
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = LogitsRow(z, type, r, width, real, scratch);
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < real; ++j) m = std::max(m, row[j]);
    mx[r] = m;
    double se = 0, sl = 0;
    for (int64_t j = 0; j < real; ++j) {
      se += std::exp(row[j] - m);
      sl += row[j];
    }
    stats[r] = static_cast<float>(se);
    stats[2 * rows + r] = static_cast<float>(sl);
    const int64_t t = labels[r] - start;
    stats[rows + r] = labels[r] != ignore_index && labels[r] >= start && t < real ? row[t] : 0.0f;
  }
  return absl::OkStatus();
}

absl::Status VocabShardCombine(int, const float* gathered, int64_t shards, int64_t rows, float* mx, float* stats) {
  for (int64_t r = 0; r < rows; ++r) {
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < shards; ++k) m = std::max(m, gathered[k * 4 * rows + r]);
    double se = 0, target = 0, sl = 0;
    for (int64_t k = 0; k < shards; ++k) {
      const float* g = gathered + k * 4 * rows;
      se += g[rows + r] * std::exp(static_cast<double>(g[r]) - m);
      target += g[2 * rows + r];
      sl += g[3 * rows + r];
    }
    mx[r] = m;
    stats[r] = static_cast<float>(se);
    stats[rows + r] = static_cast<float>(target);
    stats[2 * rows + r] = static_cast<float>(sl);
  }
  return absl::OkStatus();
}

absl::Status VocabShardLoss(int, const float* mx, const float* stats, const int64_t* labels, int64_t rows,
                            int64_t vocab, float smoothing, int64_t ignore_index, float* lse, float* loss) {
  for (int64_t r = 0; r < rows; ++r) {
    lse[r] = mx[r] + std::log(stats[r]);
    loss[r] = labels[r] == ignore_index ? 0.0f
                                        : lse[r] - (1.0f - smoothing) * stats[rows + r] -
                                              smoothing * stats[2 * rows + r] / static_cast<float>(vocab);
  }
  return absl::OkStatus();
}

absl::Status VocabShardBackward(int, ElemType type, const void* z, const int64_t* labels, const float* lse,
                                const float* dloss, int64_t rows, int64_t width, int64_t real, int64_t start,
                                int64_t vocab, float smoothing, int64_t ignore_index, ElemType dz_type, void* dz) {
  if (dz_type != ElemType::kF32 && dz_type != type) {  // as the CUDA twin
    return absl::InvalidArgumentError("VocabShardBackward: dz must be f32 or the logits' type");
  }
  const float smooth = smoothing / static_cast<float>(vocab);
  std::vector<float> scratch, wide(dz_type == ElemType::kF32 ? 0 : width);
  for (int64_t r = 0; r < rows; ++r) {
    float* out = dz_type == ElemType::kF32 ? static_cast<float*>(dz) + r * width : wide.data();
    std::fill(out, out + width, 0.0f);
    if (labels[r] != ignore_index) {
      const float* row = LogitsRow(z, type, r, width, real, scratch);
      for (int64_t j = 0; j < real; ++j) {
        const float target = smooth + (start + j == labels[r] ? 1.0f - smoothing : 0.0f);
        out[j] = dloss[r] * (std::exp(row[j] - lse[r]) - target);
      }
    }
    if (dz_type != ElemType::kF32) {
      for (int64_t j = 0; j < width; ++j) StoreF(dz, r * width + j, dz_type, out[j]);
    }
  }
  return absl::OkStatus();
}

absl::Status Rope(int, const float* x, float* y, int64_t b, int64_t s, int64_t heads, int64_t d, float theta,
                  int64_t position_offset, float sign) {
  const int64_t half = d / 2;
  std::vector<float> inv_freq(half), cosv(half), sinv(half);
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[i] = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(d));
  }
  for (int64_t t = 0; t < s; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(position_offset + t) * inv_freq[i];
      cosv[i] = std::cos(angle);
      sinv[i] = sign * std::sin(angle);
    }
    for (int64_t bi = 0; bi < b; ++bi) {
      for (int64_t hh = 0; hh < heads; ++hh) {
        const int64_t base = ((bi * s + t) * heads + hh) * d;
        const float* px = x + base;
        float* o = y + base;
        for (int64_t i = 0; i < half; ++i) {
          o[i] = px[i] * cosv[i] - px[i + half] * sinv[i];
          o[i + half] = px[i + half] * cosv[i] + px[i] * sinv[i];
        }
      }
    }
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckAttention(int64_t hq, int64_t hkv, int64_t d, const char* op,
                            const AttentionLayout& layout = AttentionLayout{{1, 1}, {1, 1}, {1, 1}, {1, 1}}) {
  if (hkv < 1 || hq % hkv != 0 || d < 1 || d > kMaxFusedHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", hq, " query heads over ", hkv, " kv heads of dim ", d,
                                                   " (at most ", kMaxFusedHeadDim, ")"));
  }
  if (!StridesPositive(layout)) return absl::InvalidArgumentError(absl::StrCat(op, ": a stride below 1"));
  return absl::OkStatus();
}

// What score (i, j) of head h gains after the scaling (AttentionBias).
float Added(const AttentionBias& extra, float slope, int64_t h, int64_t s, int64_t i, int64_t j) {
  float a = slope * static_cast<float>(j - i);
  if (extra.bias != nullptr) a += extra.bias[(h * s + i) * s + j];
  return a;
}

float Dot(const float* a, const float* b, int64_t d) {
  float s = 0;
  for (int64_t c = 0; c < d; ++c) s += a[c] * b[c];
  return s;
}

}  // namespace

// The twin of the CUDA kernels, row by row: the scores of one query row at a
// time (s floats), so the [s, s] matrix never exists here either.
absl::Status FlashAttentionF32(int, const float* q, const float* k, const float* v, float* out, float* lse, int64_t b,
                            int64_t s, int64_t hq, int64_t hkv, int64_t d, float scale, bool causal,
                            AttentionBias extra) {
  if (absl::Status st = CheckAttention(hq, hkv, d, "FlashAttention"); !st.ok()) return st;
  const int64_t group = hq / hkv;
  std::vector<float> p(s);
  std::vector<double> acc(d);
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kvh = h / group;
      const float slope = extra.alibi != nullptr ? extra.alibi[h] : 0.0f;
      for (int64_t i = 0; i < s; ++i) {
        const float* qi = q + ((bi * s + i) * hq + h) * d;
        const int64_t visible = causal ? i + 1 : s;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < visible; ++j) {
          p[j] = scale * Dot(qi, k + ((bi * s + j) * hkv + kvh) * d, d) + Added(extra, slope, h, s, i, j);
          mx = std::max(mx, p[j]);
        }
        double l = 0;
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int64_t j = 0; j < visible; ++j) {
          const double e = std::exp(static_cast<double>(p[j]) - mx);
          l += e;
          const float* vj = v + ((bi * s + j) * hkv + kvh) * d;
          for (int64_t c = 0; c < d; ++c) acc[c] += e * vj[c];
        }
        float* oi = out + ((bi * s + i) * hq + h) * d;
        for (int64_t c = 0; c < d; ++c) oi[c] = static_cast<float>(acc[c] / l);
        lse[(bi * hq + h) * s + i] = static_cast<float>(mx + std::log(l));
      }
    }
  }
  return absl::OkStatus();
}

absl::Status FlashAttentionBackwardF32(int, const float* q, const float* k, const float* v, const float* out,
                                    const float* dout, const float* lse, float* delta, float* dq, float* dk,
                                    float* dv, int64_t b, int64_t s, int64_t hq, int64_t hkv, int64_t d, float scale,
                                    bool causal, AttentionBias extra) {
  if (absl::Status st = CheckAttention(hq, hkv, d, "FlashAttentionBackward"); !st.ok()) return st;
  const int64_t group = hq / hkv;
  std::fill(dk, dk + b * s * hkv * d, 0.0f);
  std::fill(dv, dv + b * s * hkv * d, 0.0f);
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t kvh = h / group;
      const float slope = extra.alibi != nullptr ? extra.alibi[h] : 0.0f;
      for (int64_t i = 0; i < s; ++i) {
        const int64_t row = (bi * s + i) * hq + h;
        delta[(bi * hq + h) * s + i] = Dot(dout + row * d, out + row * d, d);
      }
      for (int64_t i = 0; i < s; ++i) {
        const int64_t row = (bi * s + i) * hq + h;
        const float* qi = q + row * d;
        const float* doi = dout + row * d;
        const float li = lse[(bi * hq + h) * s + i], di = delta[(bi * hq + h) * s + i];
        float* dqi = dq + row * d;
        std::fill(dqi, dqi + d, 0.0f);
        for (int64_t j = 0; j < (causal ? i + 1 : s); ++j) {
          const int64_t kv = ((bi * s + j) * hkv + kvh) * d;
          const float p = std::exp(scale * Dot(qi, k + kv, d) + Added(extra, slope, h, s, i, j) - li);
          const float ds = p * (Dot(doi, v + kv, d) - di);
          if (extra.dbias != nullptr) extra.dbias[((bi * hq + h) * s + i) * s + j] = ds;
          for (int64_t c = 0; c < d; ++c) {
            dqi[c] += scale * ds * k[kv + c];
            dk[kv + c] += scale * ds * qi[c];
            dv[kv + c] += p * doi[c];
          }
        }
      }
    }
  }
  return absl::OkStatus();
}

// ---- The typed entry points (layer_ops.inc): f32 buffers go straight to
// the f32 implementations above; bf16/f16 ones are widened into scratch and
// the outputs rounded once, as the CUDA twin rounds as it writes.
namespace {

absl::Status CheckFloatType(ElemType type, const char* op) {
  if (type == ElemType::kF32 || type == ElemType::kBF16 || type == ElemType::kF16) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, ": float types only"));
}

// Where element i of a contiguous [tokens, heads, d] operand is in one laid
// out as HeadRows (an attention operand; kernels/types.h); the identity for
// every other operand.
class Placement {
 public:
  Placement() = default;
  Placement(int64_t heads, int64_t d, HeadRows rows)
      : heads_(heads), d_(d), rows_(rows), strided_(rows.token != heads * d || rows.head != d) {}
  bool strided() const { return strided_; }
  int64_t operator()(int64_t i) const {
    if (!strided_) return i;
    const int64_t row = i / d_;
    return row / heads_ * rows_.token + row % heads_ * rows_.head + i % d_;
  }

 private:
  int64_t heads_ = 1, d_ = 1;
  HeadRows rows_;
  bool strided_ = false;
};

// An f32 view of a typed input of n elements (where `at` places them).
class F32In {
 public:
  F32In(const void* p, int64_t n, ElemType type, Placement at = {}) {
    if ((type == ElemType::kF32 && !at.strided()) || p == nullptr) {
      p_ = static_cast<const float*>(p);
      return;
    }
    buf_.resize(n);
    for (int64_t i = 0; i < n; ++i) buf_[i] = LoadF(p, at(i), type);
    p_ = buf_.data();
  }
  const float* get() const { return p_; }

 private:
  std::vector<float> buf_;
  const float* p_ = nullptr;
};

// An f32 place for a typed output of n elements (null stays null); Commit
// rounds it into the output (where `at` places them).
class F32Out {
 public:
  F32Out(void* p, int64_t n, ElemType type, Placement at = {}) : out_(p), n_(n), type_(type), at_(at) {
    if (Direct() || p == nullptr) return;
    buf_.resize(n);
  }
  float* get() { return out_ == nullptr ? nullptr : (Direct() ? static_cast<float*>(out_) : buf_.data()); }
  void Commit() {
    if (out_ == nullptr || Direct()) return;
    for (int64_t i = 0; i < n_; ++i) StoreF(out_, at_(i), type_, buf_[i]);
  }

 private:
  bool Direct() const { return type_ == ElemType::kF32 && !at_.strided(); }
  void* out_;
  int64_t n_;
  ElemType type_;
  Placement at_;
  std::vector<float> buf_;
};

// A norm's input in f32: x, or with a residual x + residual, which is
// written to `sum` (rounded to the type) and read back as rounded, so the
// norm sees what an add before it would have given.
class ResidualSum {
 public:
  ResidualSum(const void* x, const void* residual, void* sum, int64_t n, ElemType type) : fx_(x, n, type) {
    if (residual == nullptr) return;
    F32In fr(residual, n, type);
    buf_.resize(n);
    const float *a = fx_.get(), *b = fr.get();
    ParallelFor(n, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        StoreF(sum, i, type, a[i] + b[i]);
        buf_[i] = LoadF(sum, i, type);
      }
    });
  }
  const float* get() const { return buf_.empty() ? fx_.get() : buf_.data(); }

 private:
  F32In fx_;
  std::vector<float> buf_;
};

// Runs body() and commits every output after it succeeded.
template <typename Body>
absl::Status Typed(std::initializer_list<F32Out*> outs, Body body) {
  absl::Status s = body();
  if (!s.ok()) return s;
  for (F32Out* o : outs) o->Commit();
  return absl::OkStatus();
}

}  // namespace

absl::Status BiasAdd(int d, ElemType type, const void* x, const void* bias, void* out, int64_t rows, int64_t n) {
  if (absl::Status st = CheckFloatType(type, "BiasAdd"); !st.ok()) return st;
  F32In fx(x, rows * n, type), fb(bias, n, type);
  F32Out fo(out, rows * n, type);
  return Typed({&fo}, [&] { return BiasAddF32(d, fx.get(), fb.get(), fo.get(), rows, n); });
}

absl::Status BiasGrad(int d, ElemType type, const void* dy, void* db, int64_t rows, int64_t n) {
  if (absl::Status st = CheckFloatType(type, "BiasGrad"); !st.ok()) return st;
  F32In fd(dy, rows * n, type);
  F32Out fo(db, n, type);
  return Typed({&fo}, [&] { return BiasGradF32(d, fd.get(), fo.get(), rows, n); });
}

absl::Status Gelu(int d, ElemType type, const void* x, const void* bias, void* y, int64_t rows, int64_t n,
                  bool tanh_approx) {
  if (absl::Status st = CheckFloatType(type, "Gelu"); !st.ok()) return st;
  F32In fx(x, rows * n, type), fb(bias, n, type);
  F32Out fy(y, rows * n, type);
  return Typed({&fy}, [&] { return GeluF32(d, fx.get(), fb.get(), fy.get(), rows, n, tanh_approx); });
}

absl::Status GeluBackward(int d, ElemType type, const void* dy, const void* x, const void* bias, void* dx,
                          void* db, int64_t rows, int64_t n, bool tanh_approx) {
  if (absl::Status st = CheckFloatType(type, "GeluBackward"); !st.ok()) return st;
  F32In fd(dy, rows * n, type), fx(x, rows * n, type), fb(bias, n, type);
  F32Out fo(dx, rows * n, type), fdb(db, n, type);
  return Typed({&fo, &fdb}, [&] {
    return GeluBackwardF32(d, fd.get(), fx.get(), fb.get(), fo.get(), fdb.get(), rows, n, tanh_approx);
  });
}

absl::Status Activation(int d, ElemType type, ActivationKind kind, const void* x, void* y, int64_t n) {
  if (absl::Status st = CheckFloatType(type, "Activation"); !st.ok()) return st;
  F32In fx(x, n, type);
  F32Out fy(y, n, type);
  return Typed({&fy}, [&] { return ActivationF32(d, kind, fx.get(), fy.get(), n); });
}

absl::Status ActivationBackward(int d, ElemType type, ActivationKind kind, const void* dy, const void* x, void* dx,
                                int64_t n) {
  if (absl::Status st = CheckFloatType(type, "ActivationBackward"); !st.ok()) return st;
  F32In fd(dy, n, type), fx(x, n, type);
  F32Out fo(dx, n, type);
  return Typed({&fo}, [&] { return ActivationBackwardF32(d, kind, fd.get(), fx.get(), fo.get(), n); });
}

absl::Status LayerNorm(int d, ElemType type, const void* x, const void* residual, const void* g, const void* b,
                       float eps, void* y, void* sum, float* mean, float* rstd, int64_t rows, int64_t n) {
  if (absl::Status st = CheckFloatType(type, "LayerNorm"); !st.ok()) return st;
  ResidualSum in(x, residual, sum, rows * n, type);
  F32In fg(g, n, type), fb(b, n, type);
  F32Out fy(y, rows * n, type);
  return Typed({&fy}, [&] { return LayerNormF32(d, in.get(), fg.get(), fb.get(), eps, fy.get(), mean, rstd, rows, n); });
}

absl::Status LayerNormBackward(int d, ElemType type, const void* dy, const void* x, const void* g,
                               const float* mean, const float* rstd, const void* acc, void* dx, void* dg, void* db,
                               int64_t rows, int64_t n) {
  if (absl::Status st = CheckFloatType(type, "LayerNormBackward"); !st.ok()) return st;
  {
    F32In fd(dy, rows * n, type), fx(x, rows * n, type), fg(g, n, type);
    F32Out fdx(dx, rows * n, type), fdg(dg, n, type), fdb(db, n, type);
    const absl::Status st = Typed({&fdx, &fdg, &fdb}, [&] {
      return LayerNormBackwardF32(d, fd.get(), fx.get(), fg.get(), mean, rstd, fdx.get(), fdg.get(), fdb.get(), rows,
                                  n);
    });
    if (!st.ok()) return st;
  }  // dx rounded to `type` and written
  return acc == nullptr ? absl::OkStatus() : Binary(d, BinaryOp::kAdd, type, acc, dx, dx, rows * n);
}

absl::Status RmsNorm(int d, ElemType type, const void* x, const void* residual, const void* g, float eps, void* y,
                     void* sum, float* rstd, int64_t rows, int64_t n) {
  if (absl::Status st = CheckFloatType(type, "RmsNorm"); !st.ok()) return st;
  ResidualSum in(x, residual, sum, rows * n, type);
  F32In fg(g, n, type);
  F32Out fy(y, rows * n, type);
  return Typed({&fy}, [&] { return RmsNormF32(d, in.get(), fg.get(), eps, fy.get(), rstd, rows, n); });
}

absl::Status RmsNormBackward(int d, ElemType type, const void* dy, const void* x, const void* g,
                             const float* rstd, const void* acc, void* dx, void* dg, int64_t rows, int64_t n) {
  if (absl::Status st = CheckFloatType(type, "RmsNormBackward"); !st.ok()) return st;
  {
    F32In fd(dy, rows * n, type), fx(x, rows * n, type), fg(g, n, type);
    F32Out fdx(dx, rows * n, type), fdg(dg, n, type);
    const absl::Status st = Typed({&fdx, &fdg}, [&] {
      return RmsNormBackwardF32(d, fd.get(), fx.get(), fg.get(), rstd, fdx.get(), fdg.get(), rows, n);
    });
    if (!st.ok()) return st;
  }  // dx rounded to `type` and written
  return acc == nullptr ? absl::OkStatus() : Binary(d, BinaryOp::kAdd, type, acc, dx, dx, rows * n);
}

absl::Status NormRowSums(int, ElemType type, const void* x, const float* center, bool square, int64_t rows,
                         int64_t n, float* sums) {
  if (absl::Status st = CheckFloatType(type, "NormRowSums"); !st.ok()) return st;
  for (int64_t r = 0; r < rows; ++r) {
    const float c = center ? center[r] : 0.0f;
    double s = 0;
    for (int64_t j = 0; j < n; ++j) {
      const float v = LoadF(x, r * n + j, type) - c;
      s += square ? static_cast<double>(v) * v : v;
    }
    sums[r] = static_cast<float>(s);
  }
  return absl::OkStatus();
}

absl::Status NormApply(int, ElemType type, const void* x, const void* g, const void* b, const float* mean,
                       const float* sq_sums, int64_t h, float eps, int64_t rows, int64_t n, void* y, float* rstd) {
  if (absl::Status st = CheckFloatType(type, "NormApply"); !st.ok()) return st;
  F32In fg(g, n, type), fb(b, n, type);
  for (int64_t r = 0; r < rows; ++r) {
    const float m = mean ? mean[r] : 0.0f;
    const float rs = 1.0f / std::sqrt(sq_sums[r] / static_cast<float>(h) + eps);
    for (int64_t j = 0; j < n; ++j) {
      const float v = (LoadF(x, r * n + j, type) - m) * rs * fg.get()[j] + (b ? fb.get()[j] : 0.0f);
      StoreF(y, r * n + j, type, v);
    }
    rstd[r] = rs;
  }
  return absl::OkStatus();
}

absl::Status NormBackwardSums(int, ElemType type, const void* dy, const void* x, const void* g, const float* mean,
                              const float* rstd, int64_t rows, int64_t n, float* sums) {
  if (absl::Status st = CheckFloatType(type, "NormBackwardSums"); !st.ok()) return st;
  F32In fg(g, n, type);
  for (int64_t r = 0; r < rows; ++r) {
    const float m = mean ? mean[r] : 0.0f;
    double a = 0, c = 0;
    for (int64_t j = 0; j < n; ++j) {
      const float dxhat = LoadF(dy, r * n + j, type) * fg.get()[j];
      a += dxhat;
      c += static_cast<double>(dxhat) * ((LoadF(x, r * n + j, type) - m) * rstd[r]);
    }
    sums[r] = static_cast<float>(a);
    sums[rows + r] = static_cast<float>(c);
  }
  return absl::OkStatus();
}

absl::Status NormBackwardApply(int, ElemType type, const void* dy, const void* x, const void* g, const float* mean,
                               const float* rstd, const float* sums, int64_t h, int64_t rows, int64_t n, void* dx) {
  if (absl::Status st = CheckFloatType(type, "NormBackwardApply"); !st.ok()) return st;
  F32In fg(g, n, type);
  const float inv_h = 1.0f / static_cast<float>(h);
  for (int64_t r = 0; r < rows; ++r) {
    const float m = mean ? mean[r] : 0.0f, rs = rstd[r];
    const float a = mean ? sums[r] * inv_h : 0.0f, c = sums[rows + r] * inv_h;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t i = r * n + j;
      StoreF(dx, i, type, rs * (LoadF(dy, i, type) * fg.get()[j] - a - (LoadF(x, i, type) - m) * rs * c));
    }
  }
  return absl::OkStatus();
}

absl::Status NormParamGrad(int, ElemType type, const void* dy, const void* x, const float* mean, const float* rstd,
                           int64_t rows, int64_t n, float* dg, float* db) {
  if (absl::Status st = CheckFloatType(type, "NormParamGrad"); !st.ok()) return st;
  std::vector<double> sg(n, 0.0), sb(n, 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const float m = mean ? mean[r] : 0.0f;
    for (int64_t j = 0; j < n; ++j) {
      const float d = LoadF(dy, r * n + j, type), xhat = (LoadF(x, r * n + j, type) - m) * rstd[r];
      sg[j] += static_cast<double>(d) * xhat;
      sb[j] += d;
    }
  }
  for (int64_t j = 0; j < n; ++j) {
    dg[j] = static_cast<float>(sg[j]);
    if (db) db[j] = static_cast<float>(sb[j]);
  }
  return absl::OkStatus();
}

// The embeddings work in the table's type, as the CUDA twin does: rows are
// copied as they are (another shard's row is zeros), and each gradient row
// is its tokens' rows summed in double, rounded to f32 and then to the type;
// the rest of the table's gradient is zeros. Nothing of the table is
// widened.
absl::Status Embedding(int, ElemType type, const void* table, const int64_t* ids, void* out, int64_t count,
                       int64_t rows, int64_t h, int64_t row_offset) {
  if (absl::Status st = CheckFloatType(type, "Embedding"); !st.ok()) return st;
  const size_t row_bytes = static_cast<size_t>(h) * ElemBytes(type);
  const char* from = static_cast<const char*>(table);
  char* to = static_cast<char*>(out);
  for (int64_t i = 0; i < count; ++i) {
    if (ids[i] < row_offset || ids[i] >= row_offset + rows) {  // masked: another shard's row
      std::memset(to + i * row_bytes, 0, row_bytes);         // +0 in every float type
    } else {
      std::memcpy(to + i * row_bytes, from + (ids[i] - row_offset) * row_bytes, row_bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status EmbeddingBackward(int, ElemType type, const void* dy, const std::vector<int64_t>& seg_rows,
                               const std::vector<int64_t>& seg_starts, const std::vector<int64_t>& tokens,
                               void* dtable, int64_t rows, int64_t h) {
  if (absl::Status st = CheckFloatType(type, "EmbeddingBackward"); !st.ok()) return st;
  std::memset(dtable, 0, static_cast<size_t>(rows * h) * ElemBytes(type));
  std::vector<double> acc(h);
  for (size_t s = 0; s < seg_rows.size(); ++s) {
    std::fill(acc.begin(), acc.end(), 0.0);
    for (int64_t t = seg_starts[s]; t < seg_starts[s + 1]; ++t) {
      for (int64_t j = 0; j < h; ++j) acc[j] += LoadF(dy, tokens[t] * h + j, type);
    }
    for (int64_t j = 0; j < h; ++j) StoreF(dtable, seg_rows[s] * h + j, type, static_cast<float>(acc[j]));
  }
  return absl::OkStatus();
}

absl::Status FlashAttention(int dev, ElemType type, const void* q, const void* k, const void* v, void* out,
                            float* lse, int64_t b, int64_t s, int64_t hq, int64_t hkv, int64_t d, float scale,
                            bool causal, AttentionBias extra, AttentionLayout layout) {
  if (absl::Status st = CheckFloatType(type, "FlashAttention"); !st.ok()) return st;
  if (absl::Status st = CheckAttention(hq, hkv, d, "FlashAttention", layout); !st.ok()) return st;
  const Placement at_q(hq, d, layout.q), at_kv(hkv, d, layout.kv);
  F32In fq(q, b * s * hq * d, type, at_q), fk(k, b * s * hkv * d, type, at_kv), fv(v, b * s * hkv * d, type, at_kv);
  F32Out fo(out, b * s * hq * d, type);
  return Typed({&fo}, [&] {
    return FlashAttentionF32(dev, fq.get(), fk.get(), fv.get(), fo.get(), lse, b, s, hq, hkv, d, scale, causal,
                             extra);
  });
}

absl::Status FlashAttentionBackward(int dev, ElemType type, const void* q, const void* k, const void* v,
                                    const void* out, const void* dout, const float* lse, float* delta, void* dq,
                                    void* dk, void* dv, int64_t b, int64_t s, int64_t hq, int64_t hkv, int64_t d,
                                    float scale, bool causal, AttentionBias extra, AttentionLayout layout) {
  if (absl::Status st = CheckFloatType(type, "FlashAttentionBackward"); !st.ok()) return st;
  if (absl::Status st = CheckAttention(hq, hkv, d, "FlashAttentionBackward", layout); !st.ok()) return st;
  const int64_t nq = b * s * hq * d, nkv = b * s * hkv * d;
  const Placement at_q(hq, d, layout.q), at_kv(hkv, d, layout.kv);
  F32In fq(q, nq, type, at_q), fk(k, nkv, type, at_kv), fv(v, nkv, type, at_kv), fo(out, nq, type),
      fdo(dout, nq, type);
  const Placement at_dq(hq, d, layout.dq), at_dkv(hkv, d, layout.dkv);
  F32Out fdq(dq, nq, type, at_dq), fdk(dk, nkv, type, at_dkv), fdv(dv, nkv, type, at_dkv);
  return Typed({&fdq, &fdk, &fdv}, [&] {
    return FlashAttentionBackwardF32(dev, fq.get(), fk.get(), fv.get(), fo.get(), fdo.get(), lse, delta, fdq.get(),
                                     fdk.get(), fdv.get(), b, s, hq, hkv, d, scale, causal, extra);
  });
}

namespace {

// AdamW's f32 case (f32 gradients, no 16-bit copy of the parameters): the
// same operations in the same order as the general loop below, vectorized.
COLOD_AVX2_OR_GENERIC(void, AdamWF32,
                      (float* p, float* m, float* v, const float* grad, int64_t n, const AdamWHyper& h), {
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * h.grad_scale;
    p[i] -= h.lr * h.weight_decay * p[i];
    m[i] = h.beta1 * m[i] + (1.0f - h.beta1) * g;
    v[i] = h.beta2 * v[i] + (1.0f - h.beta2) * g * g;
    p[i] -= h.lr * (m[i] / h.bias_correction1) / (std::sqrt(v[i] / h.bias_correction2) + h.eps);
  }
}, (p, m, v, grad, n, h))

}  // namespace

absl::Status AdamW(int, const std::vector<AdamWTensor>& tensors, const AdamWHyper& hyper) {
  AdamWHyper h = hyper;
  if (h.grad_scale_at != nullptr) h.grad_scale = *h.grad_scale_at;  // host memory here
  for (const AdamWTensor& t : tensors) {
    if (t.grad_type == ElemType::kF32 && t.param == nullptr) {
      AdamWF32(t.master, t.m, t.v, static_cast<const float*>(t.grad), t.n, h);
      continue;
    }
    float* p = t.master;
    float* m = t.m;
    float* v = t.v;
    for (int64_t i = 0; i < t.n; ++i) {
      const float g = LoadF(t.grad, i, t.grad_type) * h.grad_scale;
      p[i] -= h.lr * h.weight_decay * p[i];
      m[i] = h.beta1 * m[i] + (1.0f - h.beta1) * g;
      v[i] = h.beta2 * v[i] + (1.0f - h.beta2) * g * g;
      p[i] -= h.lr * (m[i] / h.bias_correction1) / (std::sqrt(v[i] / h.bias_correction2) + h.eps);
      if (t.param != nullptr) StoreF(t.param, i, t.param_type, p[i]);
    }
  }
  return absl::OkStatus();
}

absl::Status GradNormClip(int, const float* squares, int64_t n, double max_norm, double loss_scale, float* out) {
  NormAndClipFactor(squares, n, max_norm, loss_scale, out);
  return absl::OkStatus();
}

}  // namespace colod::kernels::cpu
