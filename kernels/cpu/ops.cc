// CPU implementations of kernels/ops.h.
#include <cblas.h>

#include <atomic>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/ops.h"

namespace colod::kernels {
namespace {

std::atomic<int> blas_threads{1};

absl::Status HostOnly(const Tensor& t, const char* op) {
  if (!t.device().is_cuda()) return absl::OkStatus();
  return absl::UnimplementedError(absl::StrCat(op, " on ", t.device().ToString(), " is not implemented yet"));
}

bool IsFloat(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

// A contiguous f32 view or copy of a float tensor.
absl::StatusOr<Tensor> AsF32(const Tensor& t, const char* op) {
  RETURN_IF_ERROR(HostOnly(t, op));
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
  if (b.dim() != 2 || a.dim() < 2 || (trans_a && a.dim() != 2)) {
    return absl::InvalidArgumentError(absl::StrCat("matmul: ", ShapeToString(a.shape()), " @ ",
                                                   ShapeToString(b.shape()),
                                                   " needs b a matrix and a a matrix (or rows [..., K] untransposed)"));
  }
  ASSIGN_OR_RETURN(Tensor fa, AsF32(a, "matmul"));
  ASSIGN_OR_RETURN(Tensor fb, AsF32(b, "matmul"));
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
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(out_shape, DType::kF32));
  if (m > 0 && n > 0) {
    if (k == 0) return Tensor::Zeros(out_shape, a.dtype());
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), 1.0f, fa.data<float>(),
                static_cast<int>(a_cols), fb.data<float>(), static_cast<int>(fb.shape()[1]), 0.0f, out.data<float>(),
                static_cast<int>(n));
  }
  return Back(out, a.dtype());
}

absl::StatusOr<Tensor> BiasAdd(const Tensor& x, const Tensor& bias) {
  if (bias.dim() != 1 || LastDim(x) != bias.shape()[0] || x.dim() == 0) {
    return absl::InvalidArgumentError(absl::StrCat("bias_add: bias ", ShapeToString(bias.shape()),
                                                   " does not match the last dim of ", ShapeToString(x.shape())));
  }
  ASSIGN_OR_RETURN(Tensor fx, AsF32(x, "bias_add"));
  ASSIGN_OR_RETURN(Tensor fb, AsF32(bias, "bias_add"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32));
  const int64_t n = LastDim(fx), rows = fx.numel() / std::max<int64_t>(n, 1);
  const float* px = fx.data<float>();
  const float* pb = fb.data<float>();
  float* po = out.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) po[r * n + j] = px[r * n + j] + pb[j];
  }
  return Back(out, x.dtype());
}

absl::StatusOr<Tensor> BiasGrad(const Tensor& dy) {
  if (dy.dim() == 0) return absl::InvalidArgumentError("bias_grad: dy must have a last dim");
  ASSIGN_OR_RETURN(Tensor f, AsF32(dy, "bias_grad"));
  const int64_t n = LastDim(f), rows = n == 0 ? 0 : f.numel() / n;
  std::vector<double> acc(n, 0.0);
  const float* p = f.data<float>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < n; ++j) acc[j] += p[r * n + j];
  }
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({n}, DType::kF32));
  for (int64_t j = 0; j < n; ++j) out.data<float>()[j] = static_cast<float>(acc[j]);
  return Back(out, dy.dtype());
}

absl::StatusOr<Tensor> Gelu(const Tensor& x, GeluApprox approx) {
  ASSIGN_OR_RETURN(Tensor f, AsF32(x, "gelu"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32));
  const float* p = f.data<float>();
  float* o = out.data<float>();
  const int64_t n = f.numel();
  if (approx == GeluApprox::kTanh) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = p[i];
      o[i] = 0.5f * v * (1.0f + std::tanh(kSqrt2OverPi * (v + kGeluC * v * v * v)));
    }
  } else {
    for (int64_t i = 0; i < n; ++i) o[i] = 0.5f * p[i] * (1.0f + std::erf(p[i] * kInvSqrt2));
  }
  return Back(out, x.dtype());
}

absl::StatusOr<Tensor> GeluBackward(const Tensor& dy, const Tensor& x, GeluApprox approx) {
  RETURN_IF_ERROR(SameShapes(dy, x, "gelu_backward"));
  ASSIGN_OR_RETURN(Tensor fx, AsF32(x, "gelu_backward"));
  ASSIGN_OR_RETURN(Tensor fd, AsF32(dy, "gelu_backward"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32));
  const float* p = fx.data<float>();
  const float* d = fd.data<float>();
  float* o = out.data<float>();
  const int64_t n = fx.numel();
  if (approx == GeluApprox::kTanh) {
    for (int64_t i = 0; i < n; ++i) {
      const float v = p[i];
      const float u = kSqrt2OverPi * (v + kGeluC * v * v * v);
      const float t = std::tanh(u);
      const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluC * v * v);
      o[i] = d[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float v = p[i];
      const float cdf = 0.5f * (1.0f + std::erf(v * kInvSqrt2));
      const float pdf = kInvSqrt2Pi * std::exp(-0.5f * v * v);
      o[i] = d[i] * (cdf + v * pdf);
    }
  }
  return Back(out, x.dtype());
}

absl::StatusOr<LayerNormResult> LayerNorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps) {
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
  ASSIGN_OR_RETURN(Tensor y, Tensor::Empty(x.shape(), DType::kF32));
  ASSIGN_OR_RETURN(Tensor mean, Tensor::Empty({rows}, DType::kF32));
  ASSIGN_OR_RETURN(Tensor rstd, Tensor::Empty({rows}, DType::kF32));
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
  ASSIGN_OR_RETURN(Tensor dx, Tensor::Empty(x.shape(), DType::kF32));
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
  ASSIGN_OR_RETURN(Tensor dgamma, Tensor::Empty({n}, DType::kF32));
  ASSIGN_OR_RETURN(Tensor dbeta, Tensor::Empty({n}, DType::kF32));
  for (int64_t j = 0; j < n; ++j) {
    dgamma.data<float>()[j] = static_cast<float>(dg[j]);
    dbeta.data<float>()[j] = static_cast<float>(db[j]);
  }
  ASSIGN_OR_RETURN(dx, Back(dx, x.dtype()));
  ASSIGN_OR_RETURN(dgamma, Back(dgamma, gamma.dtype()));
  ASSIGN_OR_RETURN(dbeta, Back(dbeta, gamma.dtype()));
  return LayerNormGrads{std::move(dx), std::move(dgamma), std::move(dbeta)};
}

}  // namespace colod::kernels
