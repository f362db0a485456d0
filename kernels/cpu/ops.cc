// CPU implementations of kernels/ops.h.
#include <cblas.h>

#include <atomic>
#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "kernels/philox.h"

#ifdef COLOD_WITH_CUDA
#include "kernels/cuda/layer_ops.h"
#endif

namespace colod::kernels {
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
  const int64_t chunk = (n + threads - 1) / threads;
  for (int t = 1; t < threads; ++t) {
    const int64_t b = t * chunk, e = std::min(n, b + chunk);
    if (b < e) pool.emplace_back([=] { fn(b, e); });
  }
  fn(int64_t{0}, std::min(n, chunk));
  for (auto& th : pool) th.join();
}

#ifdef COLOD_WITH_CUDA
namespace gpu = ::colod::kernels::cuda;
gpu::ElemType Elem(DType t) { return static_cast<gpu::ElemType>(t); }
#define COLOD_GPU(call) RETURN_IF_ERROR(call)
#else
// A build without CUDA has no CUDA tensors, so these branches never run.
#define COLOD_GPU(call) return absl::InternalError("CUDA kernels are not built in")
#endif

// INVALID_ARGUMENT unless every tensor is on `dev`.
absl::Status SameDevice(const char* op, Device dev, std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (t->device() != dev) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": operands on ", dev.ToString(), " and ",
                                                     t->device().ToString()));
    }
  }
  return absl::OkStatus();
}

template <typename T>
const T* P(const Tensor& t) { return t.data<T>(); }
template <typename T>
T* P(Tensor& t) { return t.data<T>(); }

bool IsFloat(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// A contiguous f32 view or copy of a float tensor.
absl::StatusOr<Tensor> AsF32(const Tensor& t, const char* op) {
  if (!IsFloat(t.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": float tensors only, got ", DTypeName(t.dtype())));
  }
  if (t.dtype() == DType::kF32) return t.Contiguous();
  return t.ToDType(DType::kF32);
}

// The result in `like`'s dtype.
absl::StatusOr<Tensor> Back(const Tensor& f32, DType like) {
  if (like == DType::kF32) return f32;
  return f32.ToDType(like);
}

int64_t LastDim(const Tensor& t) { return t.dim() == 0 ? 1 : t.shape().back(); }

absl::Status SameShapes(const Tensor& a, const Tensor& b, const char* op) {
  if (a.shape() == b.shape()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": shapes ", ShapeToString(a.shape()), " and ", ShapeToString(b.shape()), " differ"));
}

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluC = 0.044715f;
constexpr float kInvSqrt2 = 0.7071067811865476f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;

}  // namespace

void SetBlasThreads(int n) {
  blas_threads = n < 1 ? 1 : n;
  openblas_set_num_threads(blas_threads);
}

int BlasThreads() { return blas_threads; }

absl::StatusOr<Tensor> MatMul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  const Device dev = a.device();
  if (b.dim() != 2 || a.dim() < 2 || (trans_a && a.dim() != 2)) {
    return absl::InvalidArgumentError(absl::StrCat("matmul: ", ShapeToString(a.shape()), " @ ",
                                                   ShapeToString(b.shape()),
                                                   " needs b a matrix and a a matrix (or rows [..., K] untransposed)"));
  }
  RETURN_IF_ERROR(SameDevice("matmul", dev, {&b}));
  if (dev.is_cuda() && a.dtype() != b.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("matmul: ", DTypeName(a.dtype()), " and ", DTypeName(b.dtype())));
  }
  // cuBLAS takes bf16/f16 operands as they are; the CPU converts them to f32.
  ASSIGN_OR_RETURN(Tensor fa, dev.is_cuda() && IsFloat(a.dtype()) ? a.Contiguous() : AsF32(a, "matmul"));
  ASSIGN_OR_RETURN(Tensor fb, dev.is_cuda() && IsFloat(b.dtype()) ? b.Contiguous() : AsF32(b, "matmul"));
  const int64_t a_rows = fa.numel() / LastDim(fa), a_cols = LastDim(fa);
  const int64_t m = trans_a ? a_cols : a_rows, k = trans_a ? a_rows : a_cols;
  const int64_t kb = trans_b ? b.shape()[1] : b.shape()[0], n = trans_b ? b.shape()[0] : b.shape()[1];
  if (k != kb) {
    return absl::InvalidArgumentError(absl::StrCat("matmul: ", ShapeToString(a.shape()), (trans_a ? "^T" : ""), " @ ",
                                                   ShapeToString(b.shape()), (trans_b ? "^T" : ""),
                                                   ": inner dims ", k, " and ", kb, " differ"));
  }
  Shape out_shape = {m, n};
  if (!trans_a) {
    out_shape = a.shape();
    out_shape.back() = n;
  }
  if (k == 0) return Tensor::Zeros(out_shape, a.dtype(), dev);
  if (dev.is_cuda()) {
    ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(out_shape, a.dtype(), dev));
    COLOD_GPU(gpu::Gemm(dev.index, Elem(a.dtype()), trans_a, trans_b, m, n, k, fa.raw_data(), fb.raw_data(),
                        out.raw_data()));
    return out;
  }
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(out_shape, DType::kF32, dev));
  if (m > 0 && n > 0) {
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, fa.data<float>(),
                static_cast<int>(a_cols), fb.data<float>(), static_cast<int>(fb.shape()[1]), 0.0f, out.data<float>(),
                static_cast<int>(n));
  }
  return Back(out, a.dtype());
}

absl::StatusOr<Tensor> BiasAdd(const Tensor& x, const Tensor& bias) {
  const Device dev = x.device();
  if (bias.dim() != 1 || LastDim(x) != bias.shape()[0] || x.dim() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("bias_add: bias ", ShapeToString(bias.shape()),
                                                   " does not match the last dim of ", ShapeToString(x.shape())));
  }
  ASSIGN_OR_RETURN(Tensor fx, AsF32(x, "bias_add"));
  ASSIGN_OR_RETURN(Tensor fb, AsF32(bias, "bias_add"));
  RETURN_IF_ERROR(SameDevice("bias_add", dev, {&bias}));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32, dev));
  const int64_t n = LastDim(fx), rows = fx.numel() / std::max<int64_t>(n, 1);
  if (dev.is_cuda()) {
    COLOD_GPU(gpu::BiasAdd(dev.index, P<float>(fx), P<float>(fb), P<float>(out), rows, n));
    return Back(out, x.dtype());
  }
  const float* px = fx.data<float>();
  const float* pb = fb.data<float>();
  float* po = out.data<float>();
  ParallelFor(rows * n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) po[i] = px[i] + pb[i % n];
  });
  return Back(out, x.dtype());
}

absl::StatusOr<Tensor> BiasGrad(const Tensor& dy) {
  const Device dev = dy.device();
  if (dy.dim() == 0) return absl::InvalidArgumentError("bias_grad: dy must have a last dim");
  ASSIGN_OR_RETURN(Tensor f, AsF32(dy, "bias_grad"));
  const int64_t n = LastDim(f), rows = n == 0 ? 0 : f.numel() / n;
  if (dev.is_cuda()) {
    ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({n}, DType::kF32, dev));
    COLOD_GPU(gpu::BiasGrad(dev.index, P<float>(f), P<float>(out), rows, n));
    return Back(out, dy.dtype());
  }
  std::vector<double> acc(n, 0.0);
  const float* p = f.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) acc[j] += p[r * n + j];
  }
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({n}, DType::kF32, dev));
  for (int64_t j = 0; j < n; ++j) out.data<float>()[j] = static_cast<float>(acc[j]);
  return Back(out, dy.dtype());
}

absl::StatusOr<Tensor> Gelu(const Tensor& x, GeluApprox approx) {
  const Device dev = x.device();
  ASSIGN_OR_RETURN(Tensor f, AsF32(x, "gelu"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32, dev));
  const int64_t n = f.numel();
  if (dev.is_cuda()) {
    COLOD_GPU(gpu::Gelu(dev.index, P<float>(f), P<float>(out), n, approx == GeluApprox::kTanh));
    return Back(out, x.dtype());
  }
  const float* p = f.data<float>();
  float* o = out.data<float>();
  ParallelFor(n, [&](int64_t begin, int64_t end) {
    if (approx == GeluApprox::kTanh) {
      for (int64_t i = begin; i < end; ++i) {
        const float v = p[i];
        o[i] = 0.5f * v * (1.0f + std::tanh(kSqrt2OverPi * (v + kGeluC * v * v * v)));
      }
    } else {
      for (int64_t i = begin; i < end; ++i) o[i] = 0.5f * p[i] * (1.0f + std::erf(p[i] * kInvSqrt2));
    }
  });
  return Back(out, x.dtype());
}

absl::StatusOr<Tensor> Silu(const Tensor& x) {
  const Device dev = x.device();
  ASSIGN_OR_RETURN(Tensor f, AsF32(x, "silu"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32, dev));
  const int64_t n = f.numel();
  if (dev.is_cuda()) {
    COLOD_GPU(gpu::Silu(dev.index, P<float>(f), P<float>(out), n));
    return Back(out, x.dtype());
  }
  const float* p = f.data<float>();
  float* o = out.data<float>();
  ParallelFor(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) o[i] = p[i] / (1.0f + std::exp(-p[i]));
  });
  return Back(out, x.dtype());
}

absl::StatusOr<Tensor> SiluBackward(const Tensor& dy, const Tensor& x) {
  const Device dev = x.device();
  RETURN_IF_ERROR(SameShapes(dy, x, "silu_backward"));
  RETURN_IF_ERROR(SameDevice("silu_backward", dev, {&dy}));
  ASSIGN_OR_RETURN(Tensor fx, AsF32(x, "silu_backward"));
  ASSIGN_OR_RETURN(Tensor fd, AsF32(dy, "silu_backward"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32, dev));
  const int64_t n = fx.numel();
  if (dev.is_cuda()) {
    COLOD_GPU(gpu::SiluBackward(dev.index, P<float>(fd), P<float>(fx), P<float>(out), n));
    return Back(out, x.dtype());
  }
  const float* p = fx.data<float>();
  const float* d = fd.data<float>();
  float* o = out.data<float>();
  ParallelFor(n, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float s = 1.0f / (1.0f + std::exp(-p[i]));
      o[i] = d[i] * s * (1.0f + p[i] * (1.0f - s));
    }
  });
  return Back(out, x.dtype());
}

absl::StatusOr<Tensor> GeluBackward(const Tensor& dy, const Tensor& x, GeluApprox approx) {
  const Device dev = x.device();
  RETURN_IF_ERROR(SameShapes(dy, x, "gelu_backward"));
  ASSIGN_OR_RETURN(Tensor fx, AsF32(x, "gelu_backward"));
  ASSIGN_OR_RETURN(Tensor fd, AsF32(dy, "gelu_backward"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32, dev));
  RETURN_IF_ERROR(SameDevice("gelu_backward", dev, {&dy}));
  const int64_t n = fx.numel();
  if (dev.is_cuda()) {
    COLOD_GPU(gpu::GeluBackward(dev.index, P<float>(fd), P<float>(fx), P<float>(out), n, approx == GeluApprox::kTanh));
    return Back(out, x.dtype());
  }
  const float* p = fx.data<float>();
  const float* d = fd.data<float>();
  float* o = out.data<float>();
  ParallelFor(n, [&](int64_t begin, int64_t end) {
    if (approx == GeluApprox::kTanh) {
      for (int64_t i = begin; i < end; ++i) {
        const float v = p[i];
        const float u = kSqrt2OverPi * (v + kGeluC * v * v * v);
        const float t = std::tanh(u);
        const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluC * v * v);
        o[i] = d[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
      }
    } else {
      for (int64_t i = begin; i < end; ++i) {
        const float v = p[i];
        const float cdf = 0.5f * (1.0f + std::erf(v * kInvSqrt2));
        const float pdf = kInvSqrt2Pi * std::exp(-0.5f * v * v);
        o[i] = d[i] * (cdf + v * pdf);
      }
    }
  });
  return Back(out, x.dtype());
}

absl::StatusOr<LayerNormResult> LayerNorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps) {
  const Device dev = x.device();
  const int64_t n = LastDim(x);
  if (x.dim() == 0 || gamma.shape() != Shape{n} || beta.shape() != Shape{n}) {
    return absl::InvalidArgumentError(absl::StrCat("layer_norm: gamma ", ShapeToString(gamma.shape()), " and beta ",
                                                   ShapeToString(beta.shape()), " must be [", n, "] for input ",
                                                   ShapeToString(x.shape())));
  }
  ASSIGN_OR_RETURN(Tensor fx, AsF32(x, "layer_norm"));
  ASSIGN_OR_RETURN(Tensor fg, AsF32(gamma, "layer_norm"));
  ASSIGN_OR_RETURN(Tensor fb, AsF32(beta, "layer_norm"));
  const int64_t rows = n == 0 ? 0 : fx.numel() / n;
  ASSIGN_OR_RETURN(Tensor y, Tensor::Empty(x.shape(), DType::kF32, dev));
  ASSIGN_OR_RETURN(Tensor mean, Tensor::Empty({rows}, DType::kF32, dev));
  ASSIGN_OR_RETURN(Tensor rstd, Tensor::Empty({rows}, DType::kF32, dev));
  RETURN_IF_ERROR(SameDevice("layer_norm", dev, {&gamma, &beta}));
  if (dev.is_cuda()) {
    COLOD_GPU(gpu::LayerNorm(dev.index, P<float>(fx), P<float>(fg), P<float>(fb), eps, P<float>(y), P<float>(mean),
                             P<float>(rstd), rows, n));
    ASSIGN_OR_RETURN(y, Back(y, x.dtype()));
    return LayerNormResult{std::move(y), std::move(mean), std::move(rstd)};
  }
  const float* px = fx.data<float>();
  const float* g = fg.data<float>();
  const float* b = fb.data<float>();
  float* py = y.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = px + r * n;
    double s = 0;
    for (int64_t j = 0; j < n; ++j) s += row[j];
    const double mu = s / n;
    double v = 0;
    for (int64_t j = 0; j < n; ++j) v += (row[j] - mu) * (row[j] - mu);
    const float rs = static_cast<float>(1.0 / std::sqrt(v / n + eps));
    const float m = static_cast<float>(mu);
    for (int64_t j = 0; j < n; ++j) py[r * n + j] = (row[j] - m) * rs * g[j] + b[j];
    mean.data<float>()[r] = m;
    rstd.data<float>()[r] = rs;
  }
  ASSIGN_OR_RETURN(y, Back(y, x.dtype()));
  return LayerNormResult{std::move(y), std::move(mean), std::move(rstd)};
}

absl::StatusOr<LayerNormGrads> LayerNormBackward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                                 const Tensor& mean, const Tensor& rstd) {
  const Device dev = x.device();
  RETURN_IF_ERROR(SameShapes(dy, x, "layer_norm_backward"));
  const int64_t n = LastDim(x), rows = n == 0 ? 0 : x.numel() / n;
  if (gamma.shape() != Shape{n} || mean.shape() != Shape{rows} || rstd.shape() != Shape{rows}) {
    return absl::InvalidArgumentError("layer_norm_backward: gamma, mean or rstd does not match the input");
  }
  ASSIGN_OR_RETURN(Tensor fx, AsF32(x, "layer_norm_backward"));
  ASSIGN_OR_RETURN(Tensor fd, AsF32(dy, "layer_norm_backward"));
  ASSIGN_OR_RETURN(Tensor fg, AsF32(gamma, "layer_norm_backward"));
  ASSIGN_OR_RETURN(Tensor fm, AsF32(mean, "layer_norm_backward"));
  ASSIGN_OR_RETURN(Tensor fr, AsF32(rstd, "layer_norm_backward"));
  ASSIGN_OR_RETURN(Tensor dx, Tensor::Empty(x.shape(), DType::kF32, dev));
  RETURN_IF_ERROR(SameDevice("layer_norm_backward", dev, {&dy, &gamma, &mean, &rstd}));
  if (dev.is_cuda()) {
    ASSIGN_OR_RETURN(Tensor dgamma, Tensor::Empty({n}, DType::kF32, dev));
    ASSIGN_OR_RETURN(Tensor dbeta, Tensor::Empty({n}, DType::kF32, dev));
    COLOD_GPU(gpu::LayerNormBackward(dev.index, P<float>(fd), P<float>(fx), P<float>(fg), P<float>(fm), P<float>(fr),
                                     P<float>(dx), P<float>(dgamma), P<float>(dbeta), rows, n));
    ASSIGN_OR_RETURN(dx, Back(dx, x.dtype()));
    ASSIGN_OR_RETURN(dgamma, Back(dgamma, gamma.dtype()));
    ASSIGN_OR_RETURN(dbeta, Back(dbeta, gamma.dtype()));
    return LayerNormGrads{std::move(dx), std::move(dgamma), std::move(dbeta)};
  }
  std::vector<double> dg(n, 0.0), db(n, 0.0);
  const float* px = fx.data<float>();
  const float* pd = fd.data<float>();
  const float* g = fg.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float m = fm.data<float>()[r], rs = fr.data<float>()[r];
    const float* row = px + r * n;
    const float* drow = pd + r * n;
    // dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * gamma.
    double sum_dxhat = 0, sum_dxhat_xhat = 0;
    for (int64_t j = 0; j < n; ++j) {
      const float xhat = (row[j] - m) * rs;
      const float dxhat = drow[j] * g[j];
      sum_dxhat += dxhat;
      sum_dxhat_xhat += static_cast<double>(dxhat) * xhat;
      dg[j] += static_cast<double>(drow[j]) * xhat;
      db[j] += drow[j];
    }
    const float a = static_cast<float>(sum_dxhat / n), c = static_cast<float>(sum_dxhat_xhat / n);
    for (int64_t j = 0; j < n; ++j) {
      const float xhat = (row[j] - m) * rs;
      dx.data<float>()[r * n + j] = rs * (drow[j] * g[j] - a - xhat * c);
    }
  }
  ASSIGN_OR_RETURN(Tensor dgamma, Tensor::Empty({n}, DType::kF32, dev));
  ASSIGN_OR_RETURN(Tensor dbeta, Tensor::Empty({n}, DType::kF32, dev));
  for (int64_t j = 0; j < n; ++j) {
    dgamma.data<float>()[j] = static_cast<float>(dg[j]);
    dbeta.data<float>()[j] = static_cast<float>(db[j]);
  }
  ASSIGN_OR_RETURN(dx, Back(dx, x.dtype()));
  ASSIGN_OR_RETURN(dgamma, Back(dgamma, gamma.dtype()));
  ASSIGN_OR_RETURN(dbeta, Back(dbeta, gamma.dtype()));
  return LayerNormGrads{std::move(dx), std::move(dgamma), std::move(dbeta)};
}

absl::StatusOr<RmsNormResult> RmsNorm(const Tensor& x, const Tensor& gamma, float eps) {
  const Device dev = x.device();
  const int64_t n = LastDim(x);
  if (x.dim() == 0 || gamma.shape() != Shape{n}) {
    return absl::InvalidArgumentError(absl::StrCat("rms_norm: gamma ", ShapeToString(gamma.shape()), " must be [", n,
                                                   "] for input ", ShapeToString(x.shape())));
  }
  ASSIGN_OR_RETURN(Tensor fx, AsF32(x, "rms_norm"));
  ASSIGN_OR_RETURN(Tensor fg, AsF32(gamma, "rms_norm"));
  const int64_t rows = n == 0 ? 0 : fx.numel() / n;
  ASSIGN_OR_RETURN(Tensor y, Tensor::Empty(x.shape(), DType::kF32, dev));
  ASSIGN_OR_RETURN(Tensor rstd, Tensor::Empty({rows}, DType::kF32, dev));
  RETURN_IF_ERROR(SameDevice("rms_norm", dev, {&gamma}));
  if (dev.is_cuda()) {
    COLOD_GPU(gpu::RmsNorm(dev.index, P<float>(fx), P<float>(fg), eps, P<float>(y), P<float>(rstd), rows, n));
    ASSIGN_OR_RETURN(y, Back(y, x.dtype()));
    return RmsNormResult{std::move(y), std::move(rstd)};
  }
  const float* px = fx.data<float>();
  const float* g = fg.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < n; ++j) ss += static_cast<double>(px[r * n + j]) * px[r * n + j];
    const float rs = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
    for (int64_t j = 0; j < n; ++j) y.data<float>()[r * n + j] = px[r * n + j] * rs * g[j];
    rstd.data<float>()[r] = rs;
  }
  ASSIGN_OR_RETURN(y, Back(y, x.dtype()));
  return RmsNormResult{std::move(y), std::move(rstd)};
}

absl::StatusOr<RmsNormGrads> RmsNormBackward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                             const Tensor& rstd) {
  const Device dev = x.device();
  RETURN_IF_ERROR(SameShapes(dy, x, "rms_norm_backward"));
  const int64_t n = LastDim(x), rows = n == 0 ? 0 : x.numel() / n;
  if (gamma.shape() != Shape{n} || rstd.shape() != Shape{rows}) {
    return absl::InvalidArgumentError("rms_norm_backward: gamma or rstd does not match the input");
  }
  ASSIGN_OR_RETURN(Tensor fx, AsF32(x, "rms_norm_backward"));
  ASSIGN_OR_RETURN(Tensor fd, AsF32(dy, "rms_norm_backward"));
  ASSIGN_OR_RETURN(Tensor fg, AsF32(gamma, "rms_norm_backward"));
  ASSIGN_OR_RETURN(Tensor fr, AsF32(rstd, "rms_norm_backward"));
  ASSIGN_OR_RETURN(Tensor dx, Tensor::Empty(x.shape(), DType::kF32, dev));
  RETURN_IF_ERROR(SameDevice("rms_norm_backward", dev, {&dy, &gamma, &rstd}));
  if (dev.is_cuda()) {
    ASSIGN_OR_RETURN(Tensor dgamma, Tensor::Empty({n}, DType::kF32, dev));
    COLOD_GPU(gpu::RmsNormBackward(dev.index, P<float>(fd), P<float>(fx), P<float>(fg), P<float>(fr), P<float>(dx),
                                   P<float>(dgamma), rows, n));
    ASSIGN_OR_RETURN(dx, Back(dx, x.dtype()));
    ASSIGN_OR_RETURN(dgamma, Back(dgamma, gamma.dtype()));
    return RmsNormGrads{std::move(dx), std::move(dgamma)};
  }
  std::vector<double> dg(n, 0.0);
  const float* px = fx.data<float>();
  const float* pd = fd.data<float>();
  const float* g = fg.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float rs = fr.data<float>()[r];
    // y = x * rs * g; dx = rs * (dy*g - x * rs^2 * mean(dy*g*x)).
    double dot = 0;
    for (int64_t j = 0; j < n; ++j) {
      dot += static_cast<double>(pd[r * n + j]) * g[j] * px[r * n + j];
      dg[j] += static_cast<double>(pd[r * n + j]) * px[r * n + j] * rs;
    }
    const float c = static_cast<float>(dot / n) * rs * rs;
    for (int64_t j = 0; j < n; ++j) dx.data<float>()[r * n + j] = rs * (pd[r * n + j] * g[j] - px[r * n + j] * c);
  }
  ASSIGN_OR_RETURN(Tensor dgamma, Tensor::Empty({n}, DType::kF32, dev));
  for (int64_t j = 0; j < n; ++j) dgamma.data<float>()[j] = static_cast<float>(dg[j]);
  ASSIGN_OR_RETURN(dx, Back(dx, x.dtype()));
  ASSIGN_OR_RETURN(dgamma, Back(dgamma, gamma.dtype()));
  return RmsNormGrads{std::move(dx), std::move(dgamma)};
}

absl::StatusOr<Tensor> Softmax(const Tensor& x, bool causal) {
  const Device dev = x.device();
  if (x.dim() == 0 || (causal && x.dim() < 2)) {
    return absl::InvalidArgumentError(absl::StrCat("softmax: input ", ShapeToString(x.shape()),
                                                   causal ? " must be [..., Q, K]" : " needs a last dim"));
  }
  ASSIGN_OR_RETURN(Tensor f, AsF32(x, "softmax"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32, dev));
  const int64_t k = LastDim(f), rows = k == 0 ? 0 : f.numel() / k;
  const int64_t q = causal ? x.shape()[x.dim() - 2] : 1;
  const int64_t prefix = causal ? k - q : 0;
  if (causal && prefix < 0) {
    return absl::InvalidArgumentError(absl::StrCat("softmax: causal scores ", ShapeToString(x.shape()),
                                                   " have more queries than keys"));
  }
  if (dev.is_cuda()) {
    COLOD_GPU(gpu::Softmax(dev.index, P<float>(f), P<float>(out), rows, k, causal ? q : 0));
    return Back(out, x.dtype());
  }
  const float* p = f.data<float>();
  float* o = out.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t visible = causal ? (r % q) + prefix + 1 : k;
    const float* row = p + r * k;
    float* orow = o + r * k;
    float mx = row[0];
    for (int64_t j = 1; j < visible; ++j) mx = std::max(mx, row[j]);
    double sum = 0;
    for (int64_t j = 0; j < visible; ++j) {
      orow[j] = std::exp(row[j] - mx);
      sum += orow[j];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t j = 0; j < visible; ++j) orow[j] *= inv;
    for (int64_t j = visible; j < k; ++j) orow[j] = 0.0f;
  }
  return Back(out, x.dtype());
}

absl::StatusOr<Tensor> SoftmaxBackward(const Tensor& dy, const Tensor& y) {
  const Device dev = y.device();
  RETURN_IF_ERROR(SameShapes(dy, y, "softmax_backward"));
  ASSIGN_OR_RETURN(Tensor fy, AsF32(y, "softmax_backward"));
  ASSIGN_OR_RETURN(Tensor fd, AsF32(dy, "softmax_backward"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(y.shape(), DType::kF32, dev));
  const int64_t k = LastDim(fy), rows = k == 0 ? 0 : fy.numel() / k;
  RETURN_IF_ERROR(SameDevice("softmax_backward", dev, {&dy}));
  if (dev.is_cuda()) {
    COLOD_GPU(gpu::SoftmaxBackward(dev.index, P<float>(fd), P<float>(fy), P<float>(out), rows, k));
    return Back(out, y.dtype());
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float* py = fy.data<float>() + r * k;
    const float* pd = fd.data<float>() + r * k;
    double dot = 0;
    for (int64_t j = 0; j < k; ++j) dot += static_cast<double>(pd[j]) * py[j];
    for (int64_t j = 0; j < k; ++j) out.data<float>()[r * k + j] = py[j] * (pd[j] - static_cast<float>(dot));
  }
  return Back(out, y.dtype());
}

namespace {

absl::StatusOr<Tensor> ApplyDropout(const Tensor& x, float p, uint64_t seed, uint64_t offset, const char* op) {
  const Device dev = x.device();
  if (!(p >= 0.0f && p < 1.0f)) return absl::InvalidArgumentError(absl::StrCat(op, ": p = ", p, " is not in [0, 1)"));
  ASSIGN_OR_RETURN(Tensor f, AsF32(x, op));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32, dev));
  if (dev.is_cuda()) {
    COLOD_GPU(gpu::Dropout(dev.index, P<float>(f), P<float>(out), f.numel(), p, seed, offset));
    return Back(out, x.dtype());
  }
  const float scale = 1.0f / (1.0f - p);
  const float* px = f.data<float>();
  float* o = out.data<float>();
  for (int64_t i = 0; i < f.numel(); ++i) {
    o[i] = PhiloxUniform(seed, offset + static_cast<uint64_t>(i)) >= p ? px[i] * scale : 0.0f;
  }
  return Back(out, x.dtype());
}

}  // namespace

absl::StatusOr<Tensor> Dropout(const Tensor& x, float p, uint64_t seed, uint64_t offset) {
  return ApplyDropout(x, p, seed, offset, "dropout");
}

absl::StatusOr<Tensor> DropoutBackward(const Tensor& dy, float p, uint64_t seed, uint64_t offset) {
  return ApplyDropout(dy, p, seed, offset, "dropout_backward");
}

namespace {

absl::StatusOr<std::vector<int64_t>> Ids(const Tensor& ids, const char* op) {
  if (ids.dtype() != DType::kI64 && ids.dtype() != DType::kI32) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ids must be i32 or i64, got ", DTypeName(ids.dtype())));
  }
  return ids.ToInt64s();
}

}  // namespace

absl::StatusOr<Tensor> Embedding(const Tensor& table, const Tensor& ids, int64_t row_offset, bool mask_out_of_range) {
  const Device dev = table.device();
  if (table.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("embedding: table must be [rows, H], got ",
                                                   ShapeToString(table.shape())));
  }
  ASSIGN_OR_RETURN(std::vector<int64_t> idv, Ids(ids, "embedding"));
  ASSIGN_OR_RETURN(Tensor ft, AsF32(table, "embedding"));
  const int64_t rows = table.shape()[0], h = table.shape()[1];
  Shape shape = ids.shape();
  shape.push_back(h);
  if (!mask_out_of_range) {
    for (size_t i = 0; i < idv.size(); ++i) {
      if (idv[i] < row_offset || idv[i] >= row_offset + rows) {
        return absl::InvalidArgumentError(absl::StrCat("embedding: id ", idv[i], " at position ", i,
                                                       " is outside the vocabulary [", row_offset, ", ",
                                                       row_offset + rows, ")"));
      }
    }
  }
  ASSIGN_OR_RETURN(Tensor out, Tensor::Zeros(shape, DType::kF32, dev));
  if (dev.is_cuda()) {
    RETURN_IF_ERROR(SameDevice("embedding", dev, {&ids}));
    ASSIGN_OR_RETURN(Tensor id64, ids.ToDType(DType::kI64));
    COLOD_GPU(gpu::Embedding(dev.index, P<float>(ft), P<int64_t>(id64), P<float>(out),
                             static_cast<int64_t>(idv.size()), rows, h, row_offset));
    return Back(out, table.dtype());
  }
  for (size_t i = 0; i < idv.size(); ++i) {
    const int64_t local = idv[i] - row_offset;
    if (local < 0 || local >= rows) continue;  // masked: another shard's row
    std::copy(ft.data<float>() + local * h, ft.data<float>() + (local + 1) * h, out.data<float>() + i * h);
  }
  return Back(out, table.dtype());
}

absl::StatusOr<Tensor> EmbeddingBackward(const Tensor& dy, const Tensor& ids, int64_t rows, int64_t row_offset) {
  const Device dev = dy.device();
  ASSIGN_OR_RETURN(std::vector<int64_t> idv, Ids(ids, "embedding_backward"));
  const int64_t h = LastDim(dy);
  if (dy.dim() != ids.dim() + 1 || static_cast<int64_t>(idv.size()) * h != dy.numel()) {
    return absl::InvalidArgumentError(absl::StrCat("embedding_backward: dy ", ShapeToString(dy.shape()),
                                                   " does not match ids ", ShapeToString(ids.shape())));
  }
  ASSIGN_OR_RETURN(Tensor fd, AsF32(dy, "embedding_backward"));
  if (dev.is_cuda()) {
    RETURN_IF_ERROR(SameDevice("embedding_backward", dev, {&ids}));
    // The tokens grouped by their row, in token order within a row: the GPU
    // sums each row's tokens in the CPU loop's order below, without atomics.
    std::vector<std::vector<int64_t>> by_row(rows);
    for (size_t i = 0; i < idv.size(); ++i) {
      const int64_t local = idv[i] - row_offset;
      if (local >= 0 && local < rows) by_row[local].push_back(static_cast<int64_t>(i));
    }
    std::vector<int64_t> seg_rows, seg_starts = {0}, tokens;
    for (int64_t r = 0; r < rows; ++r) {
      if (by_row[r].empty()) continue;
      seg_rows.push_back(r);
      tokens.insert(tokens.end(), by_row[r].begin(), by_row[r].end());
      seg_starts.push_back(static_cast<int64_t>(tokens.size()));
    }
    ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({rows, h}, DType::kF32, dev));
    COLOD_GPU(gpu::EmbeddingBackward(dev.index, P<float>(fd), seg_rows, seg_starts, tokens, P<float>(out), rows, h));
    return Back(out, dy.dtype());
  }
  std::vector<double> acc(rows * h, 0.0);
  for (size_t i = 0; i < idv.size(); ++i) {
    const int64_t local = idv[i] - row_offset;
    if (local < 0 || local >= rows) continue;
    for (int64_t j = 0; j < h; ++j) acc[local * h + j] += fd.data<float>()[i * h + j];
  }
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({rows, h}, DType::kF32, dev));
  for (int64_t i = 0; i < rows * h; ++i) out.data<float>()[i] = static_cast<float>(acc[i]);
  return Back(out, dy.dtype());
}

namespace {

struct CeInputs {
  Tensor logits;
  std::vector<int64_t> labels;
  int64_t n, v;
};

absl::StatusOr<CeInputs> CheckCe(const Tensor& logits, const Tensor& labels, int64_t ignore_index, const char* op) {
  if (logits.dim() != 2 || labels.dim() != 1 || labels.shape()[0] != logits.shape()[0]) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": logits ", ShapeToString(logits.shape()), " and labels ",
                                                   ShapeToString(labels.shape()), " must be [N, V] and [N]"));
  }
  ASSIGN_OR_RETURN(std::vector<int64_t> lab, Ids(labels, op));
  const int64_t v = logits.shape()[1];
  for (size_t i = 0; i < lab.size(); ++i) {
    if (lab[i] != ignore_index && (lab[i] < 0 || lab[i] >= v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": label ", lab[i], " at row ", i, " is outside the vocabulary [0, ", v, ")"));
    }
  }
  ASSIGN_OR_RETURN(Tensor f, AsF32(logits, op));
  return CeInputs{f, std::move(lab), logits.shape()[0], v};
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

absl::StatusOr<Tensor> CrossEntropy(const Tensor& logits, const Tensor& labels, float label_smoothing,
                                    int64_t ignore_index) {
  const Device dev = logits.device();
  ASSIGN_OR_RETURN(CeInputs in, CheckCe(logits, labels, ignore_index, "cross_entropy"));
  ASSIGN_OR_RETURN(Tensor loss, Tensor::Zeros({in.n}, DType::kF32, dev));
  if (dev.is_cuda()) {
    RETURN_IF_ERROR(SameDevice("cross_entropy", dev, {&labels}));
    ASSIGN_OR_RETURN(Tensor l64, labels.ToDType(DType::kI64));
    COLOD_GPU(gpu::CrossEntropy(dev.index, P<float>(in.logits), P<int64_t>(l64), P<float>(loss), in.n, in.v,
                                label_smoothing, ignore_index));
    return loss;
  }
  for (int64_t r = 0; r < in.n; ++r) {
    if (in.labels[r] == ignore_index) continue;
    const float* row = in.logits.data<float>() + r * in.v;
    const double lse = LogSumExp(row, in.v);
    double mean_logit = 0;
    for (int64_t j = 0; j < in.v; ++j) mean_logit += row[j];
    mean_logit /= in.v;
    loss.data<float>()[r] = static_cast<float>(lse - (1.0 - label_smoothing) * row[in.labels[r]] -
                                               label_smoothing * mean_logit);
  }
  return loss;
}

absl::StatusOr<Tensor> CrossEntropyBackward(const Tensor& dloss, const Tensor& logits, const Tensor& labels,
                                            float label_smoothing, int64_t ignore_index) {
  const Device dev = logits.device();
  ASSIGN_OR_RETURN(CeInputs in, CheckCe(logits, labels, ignore_index, "cross_entropy_backward"));
  if (dloss.shape() != Shape{in.n}) {
    return absl::InvalidArgumentError(absl::StrCat("cross_entropy_backward: dloss ", ShapeToString(dloss.shape()),
                                                   " must be [", in.n, "]"));
  }
  ASSIGN_OR_RETURN(Tensor out, Tensor::Zeros({in.n, in.v}, DType::kF32, dev));
  if (dev.is_cuda()) {
    RETURN_IF_ERROR(SameDevice("cross_entropy_backward", dev, {&labels, &dloss}));
    ASSIGN_OR_RETURN(Tensor l64, labels.ToDType(DType::kI64));
    ASSIGN_OR_RETURN(Tensor dl32, AsF32(dloss, "cross_entropy_backward"));
    COLOD_GPU(gpu::CrossEntropyBackward(dev.index, P<float>(dl32), P<float>(in.logits), P<int64_t>(l64), P<float>(out),
                                        in.n, in.v, label_smoothing, ignore_index));
    return Back(out, logits.dtype());
  }
  const std::vector<float> dl = dloss.ToFloats();
  for (int64_t r = 0; r < in.n; ++r) {
    if (in.labels[r] == ignore_index) continue;
    const float* row = in.logits.data<float>() + r * in.v;
    float* o = out.data<float>() + r * in.v;
    const double lse = LogSumExp(row, in.v);
    for (int64_t j = 0; j < in.v; ++j) {
      const double target = label_smoothing / in.v + (j == in.labels[r] ? 1.0 - label_smoothing : 0.0);
      o[j] = static_cast<float>(dl[r] * (std::exp(row[j] - lse) - target));
    }
  }
  return Back(out, logits.dtype());
}

namespace {

absl::StatusOr<Tensor> Rotate(const Tensor& x, float theta, int64_t position_offset, float sign, const char* op) {
  const Device dev = x.device();
  if (x.dim() != 4 || x.shape()[3] % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": input ", ShapeToString(x.shape()),
                                                   " must be [B, S, heads, D] with D even"));
  }
  ASSIGN_OR_RETURN(Tensor f, AsF32(x, op));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32, dev));
  const int64_t b = x.shape()[0], s = x.shape()[1], heads = x.shape()[2], d = x.shape()[3], half = d / 2;
  if (dev.is_cuda()) {
    COLOD_GPU(gpu::Rope(dev.index, P<float>(f), P<float>(out), b, s, heads, d, theta, position_offset, sign));
    return Back(out, x.dtype());
  }
  std::vector<float> inv_freq(half);
  for (int64_t i = 0; i < half; ++i) {
    inv_freq[i] = 1.0f / std::pow(theta, static_cast<float>(2 * i) / static_cast<float>(d));
  }
  std::vector<float> cosv(half), sinv(half);
  for (int64_t t = 0; t < s; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(position_offset + t) * inv_freq[i];
      cosv[i] = std::cos(angle);
      sinv[i] = sign * std::sin(angle);
    }
    for (int64_t bi = 0; bi < b; ++bi) {
      for (int64_t hh = 0; hh < heads; ++hh) {
        const int64_t base = ((bi * s + t) * heads + hh) * d;
        const float* px = f.data<float>() + base;
        float* o = out.data<float>() + base;
        for (int64_t i = 0; i < half; ++i) {
          o[i] = px[i] * cosv[i] - px[i + half] * sinv[i];
          o[i + half] = px[i + half] * cosv[i] + px[i] * sinv[i];
        }
      }
    }
  }
  return Back(out, x.dtype());
}

}  // namespace

absl::StatusOr<Tensor> Rope(const Tensor& x, float theta, int64_t position_offset) {
  return Rotate(x, theta, position_offset, 1.0f, "rope");
}

absl::StatusOr<Tensor> RopeBackward(const Tensor& dy, float theta, int64_t position_offset) {
  return Rotate(dy, theta, position_offset, -1.0f, "rope_backward");
}

absl::Status AdamW(Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, int64_t step, const AdamWOptions& o) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &grad, &m, &v}) {
    RETURN_IF_ERROR(SameDevice("adamw", param.device(), {t}));
    if (t->dtype() != DType::kF32 || t->shape() != param.shape() || !t->is_contiguous()) {
      return absl::InvalidArgumentError(absl::StrCat("adamw: param, grad, m and v must be contiguous f32 of shape ",
                                                     ShapeToString(param.shape())));
    }
  }
  if (step < 1) return absl::InvalidArgumentError("adamw: step counts from 1");
  const float bc1 = 1.0f - std::pow(o.beta1, static_cast<float>(step));
  const float bc2 = 1.0f - std::pow(o.beta2, static_cast<float>(step));
  if (param.device().is_cuda()) {
    COLOD_GPU(gpu::AdamW(param.device().index, P<float>(param), P<float>(grad), P<float>(m), P<float>(v),
                         param.numel(), o.lr, o.beta1, o.beta2, o.eps, o.weight_decay, bc1, bc2));
    return absl::OkStatus();
  }
  float* p = param.data<float>();
  const float* g = grad.data<float>();
  float* pm = m.data<float>();
  float* pv = v.data<float>();
  for (int64_t i = 0; i < param.numel(); ++i) {
    p[i] -= o.lr * o.weight_decay * p[i];
    pm[i] = o.beta1 * pm[i] + (1.0f - o.beta1) * g[i];
    pv[i] = o.beta2 * pv[i] + (1.0f - o.beta2) * g[i] * g[i];
    p[i] -= o.lr * (pm[i] / bc1) / (std::sqrt(pv[i] / bc2) + o.eps);
  }
  return absl::OkStatus();
}

}  // namespace colod::kernels
