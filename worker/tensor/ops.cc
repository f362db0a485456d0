// The Tensor-level layer ops (ops.h): validation, dtype handling and the
// device's kernel table; the math is in kernels/cpu and kernels/cuda.
#include "worker/tensor/ops.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/types.h"
#include "worker/tensor/device_kernels.h"

namespace colod::ops {
namespace {

kernels::ElemType Elem(DType t) { return static_cast<kernels::ElemType>(t); }

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

// The kernel table of `dev`, after checking that every operand is there.
absl::StatusOr<const DeviceKernels*> Kernels(const char* op, Device dev, std::initializer_list<const Tensor*> ts) {
  RETURN_IF_ERROR(SameDevice(op, dev, ts));
  return KernelsFor(dev);
}

const float* F(const Tensor& t) { return t.data<float>(); }
float* F(Tensor& t) { return t.data<float>(); }

// A contiguous f32 view or copy of a float tensor.
absl::StatusOr<Tensor> AsF32(const Tensor& t, const char* op) {
  if (!IsFloat(t.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": float tensors only, got ", DTypeName(t.dtype())));
  }
  return t.ContiguousAs(DType::kF32);
}

// A contiguous i64 view or copy of integer ids, on their device.
absl::StatusOr<Tensor> AsI64(const Tensor& ids, const char* op) {
  if (!IsInteger(ids.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ids must be i32 or i64, got ", DTypeName(ids.dtype())));
  }
  return ids.ContiguousAs(DType::kI64);
}

// A contiguous view or copy of a float tensor in float dtype `type`.
absl::StatusOr<Tensor> AsFloat(const Tensor& t, DType type, const char* op) {
  if (!IsFloat(t.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": float tensors only, got ", DTypeName(t.dtype())));
  }
  return t.ContiguousAs(type);
}

// The dtype the typed layer kernels compute an op on x in: x's own (f32,
// bf16 or f16), with the other operands brought to it.
absl::StatusOr<DType> KernelType(const Tensor& x, const char* op) {
  if (!IsFloat(x.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": float tensors only, got ", DTypeName(x.dtype())));
  }
  return x.dtype();
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

// y = kernel(x) elementwise, computed in f32 on x's dtype.
template <typename Call>
absl::StatusOr<Tensor> Elementwise(const Tensor& x, const char* op, Call call) {
  const Device dev = x.device();
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(dev));
  ASSIGN_OR_RETURN(DType type, KernelType(x, op));
  ASSIGN_OR_RETURN(const Tensor cx, x.TryContiguous());
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), type, dev));
  RETURN_IF_ERROR(call(*k, dev.index, Elem(type), cx.raw_data(), out.raw_data(), cx.numel()));
  return out;
}

// bias [n] for x [..., n].
absl::Status CheckBias(const Tensor& x, const Tensor& bias, const char* op) {
  if (bias.dim() != 1 || x.dim() == 0 || LastDim(x) != bias.shape()[0]) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": bias ", ShapeToString(bias.shape()),
                                                   " does not match the last dim of ", ShapeToString(x.shape())));
  }
  return absl::OkStatus();
}

// dx = kernel(dy, x) elementwise, computed in f32 on x's dtype.
template <typename Call>
absl::StatusOr<Tensor> ElementwiseBackward(const Tensor& dy, const Tensor& x, const char* op, Call call) {
  const Device dev = x.device();
  RETURN_IF_ERROR(SameShapes(dy, x, op));
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels(op, dev, {&dy}));
  ASSIGN_OR_RETURN(DType type, KernelType(x, op));
  ASSIGN_OR_RETURN(const Tensor cx, x.TryContiguous());
  ASSIGN_OR_RETURN(Tensor cd, AsFloat(dy, type, op));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), type, dev));
  RETURN_IF_ERROR(call(*k, dev.index, Elem(type), cd.raw_data(), cx.raw_data(), out.raw_data(), cx.numel()));
  return out;
}

}  // namespace

namespace {

// MatMul, and with a bias (not null) MatMulBias.
absl::StatusOr<Tensor> MatMulImpl(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, const Tensor* bias) {
  const Device dev = a.device();
  if (b.dim() != 2 || a.dim() < 2 || (trans_a && a.dim() != 2)) {
    return absl::InvalidArgumentError(absl::StrCat("matmul: ", ShapeToString(a.shape()), " @ ",
                                                   ShapeToString(b.shape()),
                                                   " needs b a matrix and a a matrix (or rows [..., K] untransposed)"));
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels("matmul", dev, {&b}));
  // Operands of one float dtype go to the GEMM as they are (cuBLAS computes
  // bf16/f16 with f32 accumulation, the CPU widens them); mixed dtypes are
  // computed in f32.
  const bool same = a.dtype() == b.dtype() && IsFloat(a.dtype());
  const DType type = same ? a.dtype() : DType::kF32;
  ASSIGN_OR_RETURN(Tensor fa, same ? a.TryContiguous() : AsF32(a, "matmul"));
  ASSIGN_OR_RETURN(Tensor fb, same ? b.TryContiguous() : AsF32(b, "matmul"));
  const int64_t a_rows = fa.numel() / std::max<int64_t>(LastDim(fa), 1), a_cols = LastDim(fa);
  const int64_t m = trans_a ? a_cols : a_rows, kk = trans_a ? a_rows : a_cols;
  const int64_t kb = trans_b ? b.shape()[1] : b.shape()[0], n = trans_b ? b.shape()[0] : b.shape()[1];
  if (kk != kb) {
    return absl::InvalidArgumentError(absl::StrCat("matmul: ", ShapeToString(a.shape()), (trans_a ? "^T" : ""), " @ ",
                                                   ShapeToString(b.shape()), (trans_b ? "^T" : ""),
                                                   ": inner dims ", kk, " and ", kb, " differ"));
  }
  Shape out_shape = {m, n};
  if (!trans_a) {
    out_shape = a.shape();
    out_shape.back() = n;
  }
  if (bias != nullptr) {
    if (bias->dim() != 1 || bias->shape()[0] != n) {
      return absl::InvalidArgumentError(absl::StrCat("matmul_bias: bias ", ShapeToString(bias->shape()),
                                                     " does not match the product's last dim ", n));
    }
    RETURN_IF_ERROR(SameDevice("matmul_bias", dev, {bias}));
  }
  // The bias in the GEMM's epilogue where the product is computed in a's own
  // dtype; otherwise added to the product (rounded to a's dtype) after it.
  const bool fused = bias != nullptr && kk > 0 && type == a.dtype();
  Tensor out;
  if (kk == 0) {
    ASSIGN_OR_RETURN(out, Tensor::Zeros(out_shape, a.dtype(), dev));
  } else {
    ASSIGN_OR_RETURN(out, Tensor::Empty(out_shape, type, dev));
    if (fused) {
      ASSIGN_OR_RETURN(Tensor cb, AsFloat(*bias, type, "matmul_bias"));
      RETURN_IF_ERROR(k->GemmBias(dev.index, Elem(type), trans_a, trans_b, m, n, kk, fa.raw_data(), fb.raw_data(),
                                  cb.raw_data(), out.raw_data()));
      return out;
    }
    RETURN_IF_ERROR(
        k->Gemm(dev.index, Elem(type), trans_a, trans_b, m, n, kk, fa.raw_data(), fb.raw_data(), out.raw_data()));
    ASSIGN_OR_RETURN(out, Back(out, a.dtype()));
  }
  if (bias != nullptr) RETURN_IF_ERROR(BiasAddInPlace(out, *bias));
  return out;
}

}  // namespace

absl::StatusOr<Tensor> MatMul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  return MatMulImpl(a, b, trans_a, trans_b, nullptr);
}

absl::StatusOr<Tensor> MatMulBias(const Tensor& a, const Tensor& b, const Tensor& bias, bool trans_a, bool trans_b) {
  return MatMulImpl(a, b, trans_a, trans_b, &bias);
}

absl::StatusOr<BiasGeluProduct> MatMulBiasGelu(const Tensor& a, const Tensor& b, const Tensor& bias, bool trans_b) {
  if (a.dtype() != b.dtype() || !IsFloat(a.dtype()) || b.dim() != 2 || a.dim() < 2) {
    return absl::InvalidArgumentError(absl::StrCat("matmul_bias_gelu: ", DTypeName(a.dtype()), ShapeToString(a.shape()),
                                                   " @ ", DTypeName(b.dtype()), ShapeToString(b.shape()),
                                                   " needs rows [..., K] and a matrix of one float dtype"));
  }
  const int64_t kk = a.shape().back(), kb = trans_b ? b.shape()[1] : b.shape()[0];
  const int64_t n = trans_b ? b.shape()[0] : b.shape()[1];
  if (kk != kb || bias.dim() != 1 || bias.shape()[0] != n) {
    return absl::InvalidArgumentError(absl::StrCat("matmul_bias_gelu: ", ShapeToString(a.shape()), " @ ",
                                                   ShapeToString(b.shape()), (trans_b ? "^T" : ""), " + bias ",
                                                   ShapeToString(bias.shape()), " do not match"));
  }
  const Device dev = a.device();
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels("matmul_bias_gelu", dev, {&b, &bias}));
  const int64_t m = kk == 0 ? 0 : a.numel() / kk;
  if (m == 0 || kk == 0 || n == 0) {  // nothing to multiply: the unfused ops
    ASSIGN_OR_RETURN(Tensor pre, MatMulBias(a, b, bias, false, trans_b));
    ASSIGN_OR_RETURN(Tensor y, Gelu(pre, GeluApprox::kTanh));
    return BiasGeluProduct{std::move(y), std::move(pre)};
  }
  Shape out_shape = a.shape();
  out_shape.back() = n;
  const DType type = a.dtype();
  ASSIGN_OR_RETURN(const Tensor fa, a.TryContiguous());
  ASSIGN_OR_RETURN(const Tensor fb, b.TryContiguous());
  ASSIGN_OR_RETURN(Tensor cb, AsFloat(bias, type, "matmul_bias_gelu"));
  ASSIGN_OR_RETURN(Tensor y, Tensor::Empty(out_shape, type, dev));
  ASSIGN_OR_RETURN(Tensor pre, Tensor::Empty(out_shape, type, dev));
  RETURN_IF_ERROR(k->GemmBiasGelu(dev.index, Elem(type), false, trans_b, m, n, kk, fa.raw_data(), fb.raw_data(),
                                  cb.raw_data(), y.raw_data(), pre.raw_data()));
  return BiasGeluProduct{std::move(y), std::move(pre)};
}

absl::StatusOr<Tensor> MatMulGeluBackward(const Tensor& dy, const Tensor& w, const Tensor& pre) {
  const int64_t n = dy.dim() == 0 ? 0 : dy.shape().back();
  if (dy.dtype() != w.dtype() || dy.dtype() != pre.dtype() || !IsFloat(dy.dtype()) || w.dim() != 2 || dy.dim() < 2 ||
      w.shape()[0] != n || pre.dim() != dy.dim() || pre.shape().back() != w.shape()[1] ||
      !std::equal(dy.shape().begin(), dy.shape().end() - 1, pre.shape().begin())) {
    return absl::InvalidArgumentError(absl::StrCat("matmul_gelu_backward: dy ", DTypeName(dy.dtype()),
                                                   ShapeToString(dy.shape()), " @ w ", DTypeName(w.dtype()),
                                                   ShapeToString(w.shape()), " through GELU's input ",
                                                   DTypeName(pre.dtype()), ShapeToString(pre.shape()),
                                                   " need rows [..., N] @ [N, K] -> pre's [..., K] of one float dtype"));
  }
  const Device dev = dy.device();
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels("matmul_gelu_backward", dev, {&w, &pre}));
  const int64_t kk = w.shape()[1];
  const int64_t m = n == 0 ? pre.numel() / std::max<int64_t>(kk, 1) : dy.numel() / n;
  const DType type = dy.dtype();
  ASSIGN_OR_RETURN(const Tensor fd, dy.TryContiguous());
  ASSIGN_OR_RETURN(const Tensor fw, w.TryContiguous());
  ASSIGN_OR_RETURN(const Tensor fp, pre.TryContiguous());
  ASSIGN_OR_RETURN(Tensor dx, Tensor::Empty(pre.shape(), type, dev));
  RETURN_IF_ERROR(k->GemmDGelu(dev.index, Elem(type), false, false, m, kk, n, fd.raw_data(), fw.raw_data(),
                               fp.raw_data(), dx.raw_data()));
  return dx;
}

bool FusesGemmEpilogues(Device device) {
  absl::StatusOr<const DeviceKernels*> k = KernelsFor(device);
  return k.ok() && (*k)->GemmEpilogues(device.index);
}

absl::StatusOr<LinearGrads> LinearWeightGrads(const Tensor& dy, const Tensor& x) {
  if (dy.dim() == 0 || x.dim() == 0) return absl::InvalidArgumentError("linear_weight_grads: dy and x need a last dim");
  const int64_t m = dy.shape().back(), n = x.shape().back();
  const int64_t rows = m == 0 ? 0 : dy.numel() / m, x_rows = n == 0 ? 0 : x.numel() / n;
  if ((m > 0 && n > 0 && rows != x_rows) || !IsFloat(dy.dtype()) || !IsFloat(x.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("linear_weight_grads: dy ", DTypeName(dy.dtype()),
                                                   ShapeToString(dy.shape()), " and x ", DTypeName(x.dtype()),
                                                   ShapeToString(x.shape()), " need float rows of one count"));
  }
  const Device dev = dy.device();
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels("linear_weight_grads", dev, {&x}));
  ASSIGN_OR_RETURN(Tensor dy2, dy.Reshape({rows, m}));
  ASSIGN_OR_RETURN(Tensor x2, x.Reshape({x_rows, n}));
  if (dy.dtype() != x.dtype() || rows == 0 || m == 0 || n == 0) {  // as the unfused ops compute them
    ASSIGN_OR_RETURN(Tensor dw, MatMul(dy2, x2, /*trans_a=*/true));
    ASSIGN_OR_RETURN(Tensor db, BiasGrad(dy2));
    return LinearGrads{std::move(dw), std::move(db)};
  }
  const DType type = dy.dtype();
  ASSIGN_OR_RETURN(const Tensor cd, dy2.TryContiguous());
  ASSIGN_OR_RETURN(const Tensor cx, x2.TryContiguous());
  ASSIGN_OR_RETURN(Tensor dw, Tensor::Empty({m, n}, type, dev));
  ASSIGN_OR_RETURN(Tensor db, Tensor::Empty({m}, type, dev));
  RETURN_IF_ERROR(k->GemmBiasGrad(dev.index, Elem(type), m, n, rows, cd.raw_data(), cx.raw_data(), dw.raw_data(),
                                  db.raw_data()));
  return LinearGrads{std::move(dw), std::move(db)};
}

absl::Status MatMulF32Into(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b, Tensor& c,
                           bool accumulate) {
  if (a.dim() != 2 || b.dim() != 2 || a.dtype() != b.dtype() || !IsFloat(a.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat("matmul into f32: ", DTypeName(a.dtype()), ShapeToString(a.shape()),
                                                   " @ ", DTypeName(b.dtype()), ShapeToString(b.shape()),
                                                   " needs two matrices of one float dtype"));
  }
  const int64_t m = trans_a ? a.shape()[1] : a.shape()[0], kk = trans_a ? a.shape()[0] : a.shape()[1];
  const int64_t kb = trans_b ? b.shape()[1] : b.shape()[0], n = trans_b ? b.shape()[0] : b.shape()[1];
  if (kk != kb || c.dtype() != DType::kF32 || !c.is_contiguous() || c.shape() != Shape{m, n}) {
    return absl::InvalidArgumentError(absl::StrCat("matmul into f32: ", ShapeToString(a.shape()), (trans_a ? "^T" : ""),
                                                   " @ ", ShapeToString(b.shape()), (trans_b ? "^T" : ""), " into ",
                                                   DTypeName(c.dtype()), ShapeToString(c.shape())));
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels("matmul into f32", a.device(), {&b, &c}));
  ASSIGN_OR_RETURN(const Tensor fa, a.TryContiguous());
  ASSIGN_OR_RETURN(const Tensor fb, b.TryContiguous());
  return k->GemmF32Out(a.device().index, Elem(a.dtype()), trans_a, trans_b, m, n, kk, fa.raw_data(), fb.raw_data(),
                       c.data<float>(), accumulate);
}

absl::Status SetAllowTf32(Device device, bool allow) {
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(device));
  return k->SetAllowTf32(device.index, allow);
}

namespace {

// out = kernel(x, bias) over [rows, n], bias [n] over x's last dim,
// computed on x's float dtype (the bias converted to it).
// With `in_place`, the result is written over x itself (x's dtype is the
// kernel's), which must then be contiguous.
template <typename Call>
absl::StatusOr<Tensor> WithBias(const Tensor& x, const Tensor& bias, const char* op, Call call,
                                bool in_place = false) {
  RETURN_IF_ERROR(CheckBias(x, bias, op));
  const Device dev = x.device();
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels(op, dev, {&bias}));
  ASSIGN_OR_RETURN(DType type, KernelType(x, op));
  if (in_place && !x.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": x must be contiguous to be written in place, got a view of ",
                                                   ShapeToString(x.shape())));
  }
  ASSIGN_OR_RETURN(const Tensor cx, x.TryContiguous());
  ASSIGN_OR_RETURN(Tensor cb, AsFloat(bias, type, op));
  Tensor out = cx;
  if (!in_place) {
    ASSIGN_OR_RETURN(out, Tensor::Empty(x.shape(), type, dev));
  }
  const int64_t n = LastDim(cx), rows = n == 0 ? 0 : cx.numel() / n;
  RETURN_IF_ERROR(call(*k, dev.index, Elem(type), cx.raw_data(), cb.raw_data(), out.raw_data(), rows, n));
  return out;
}

}  // namespace

absl::StatusOr<Tensor> BiasAdd(const Tensor& x, const Tensor& bias) {
  return WithBias(x, bias, "bias_add",
                  [](const DeviceKernels& k, int d, kernels::ElemType t, const void* in, const void* b, void* out,
                     int64_t rows, int64_t n) { return k.BiasAdd(d, t, in, b, out, rows, n); });
}

absl::Status BiasAddInPlace(Tensor& x, const Tensor& bias) {
  return WithBias(
             x, bias, "bias_add_in_place",
             [](const DeviceKernels& k, int d, kernels::ElemType t, const void* in, const void* b, void* out,
                int64_t rows, int64_t n) { return k.BiasAdd(d, t, in, b, out, rows, n); },
             /*in_place=*/true)
      .status();
}

absl::StatusOr<Tensor> BiasGrad(const Tensor& dy) {
  const Device dev = dy.device();
  if (dy.dim() == 0) return absl::InvalidArgumentError("bias_grad: dy must have a last dim");
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(dev));
  ASSIGN_OR_RETURN(DType type, KernelType(dy, "bias_grad"));
  ASSIGN_OR_RETURN(const Tensor c, dy.TryContiguous());
  const int64_t n = LastDim(c), rows = n == 0 ? 0 : c.numel() / n;
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({n}, type, dev));
  RETURN_IF_ERROR(k->BiasGrad(dev.index, Elem(type), c.raw_data(), out.raw_data(), rows, n));
  return out;
}

absl::StatusOr<Tensor> Gelu(const Tensor& x, GeluApprox approx) {
  return Elementwise(x, "gelu", [&](const DeviceKernels& k, int d, kernels::ElemType t, const void* in, void* out,
                                    int64_t n) {
    return k.Gelu(d, t, in, /*bias=*/nullptr, out, /*rows=*/1, n, approx == GeluApprox::kTanh);
  });
}

absl::StatusOr<Tensor> GeluBackward(const Tensor& dy, const Tensor& x, GeluApprox approx) {
  return ElementwiseBackward(dy, x, "gelu_backward",
                             [&](const DeviceKernels& k, int d, kernels::ElemType t, const void* g, const void* in,
                                 void* out, int64_t n) {
                               return k.GeluBackward(d, t, g, in, /*bias=*/nullptr, out, /*db=*/nullptr, 1, n,
                                                     approx == GeluApprox::kTanh);
                             });
}

absl::StatusOr<Tensor> BiasGelu(const Tensor& x, const Tensor& bias, GeluApprox approx) {
  return WithBias(x, bias, "bias_gelu",
                  [&](const DeviceKernels& k, int d, kernels::ElemType t, const void* in, const void* b, void* out,
                      int64_t rows, int64_t n) {
                    return k.Gelu(d, t, in, b, out, rows, n, approx == GeluApprox::kTanh);
                  });
}

absl::StatusOr<BiasGeluGrads> BiasGeluBackward(const Tensor& dy, const Tensor& x, const Tensor& bias,
                                               GeluApprox approx) {
  RETURN_IF_ERROR(CheckBias(x, bias, "bias_gelu_backward"));
  RETURN_IF_ERROR(SameShapes(dy, x, "bias_gelu_backward"));
  const Device dev = x.device();
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels("bias_gelu_backward", dev, {&dy, &bias}));
  ASSIGN_OR_RETURN(DType type, KernelType(x, "bias_gelu_backward"));
  ASSIGN_OR_RETURN(const Tensor cx, x.TryContiguous());
  ASSIGN_OR_RETURN(Tensor cd, AsFloat(dy, type, "bias_gelu_backward"));
  ASSIGN_OR_RETURN(Tensor cb, AsFloat(bias, type, "bias_gelu_backward"));
  const int64_t n = LastDim(cx), rows = n == 0 ? 0 : cx.numel() / n;
  ASSIGN_OR_RETURN(Tensor dx, Tensor::Empty(x.shape(), type, dev));
  ASSIGN_OR_RETURN(Tensor db, Tensor::Empty({n}, type, dev));
  RETURN_IF_ERROR(k->GeluBackward(dev.index, Elem(type), cd.raw_data(), cx.raw_data(), cb.raw_data(), dx.raw_data(),
                                  db.raw_data(), rows, n, approx == GeluApprox::kTanh));
  return BiasGeluGrads{std::move(dx), std::move(db)};
}

absl::StatusOr<Tensor> Activation(const Tensor& x, ActivationKind kind) {
  return Elementwise(x, "activation", [kind](const DeviceKernels& k, int d, kernels::ElemType t, const void* in,
                                             void* out, int64_t n) { return k.Activation(d, t, kind, in, out, n); });
}

absl::StatusOr<Tensor> ActivationBackward(const Tensor& dy, const Tensor& x, ActivationKind kind) {
  return ElementwiseBackward(dy, x, "activation_backward",
                             [kind](const DeviceKernels& k, int d, kernels::ElemType t, const void* g, const void* in,
                                    void* out, int64_t n) { return k.ActivationBackward(d, t, kind, g, in, out, n); });
}

namespace {

// A norm's residual in the kernel type, contiguous, and the sum's place
// (both empty without a residual).
struct ResidualArgs {
  bool present = false;
  Tensor residual, sum;
  const void* in() const { return present ? residual.raw_data() : nullptr; }
  void* out() { return present ? sum.raw_data() : nullptr; }
};

absl::StatusOr<ResidualArgs> Residual(const Tensor& x, const Tensor* residual, DType type, const char* op) {
  if (residual == nullptr) return ResidualArgs{};
  RETURN_IF_ERROR(SameShapes(x, *residual, op));
  RETURN_IF_ERROR(SameDevice(op, x.device(), {residual}));
  ASSIGN_OR_RETURN(Tensor r, AsFloat(*residual, type, op));
  ASSIGN_OR_RETURN(Tensor sum, Tensor::Empty(x.shape(), type, x.device()));
  return ResidualArgs{true, std::move(r), std::move(sum)};
}

}  // namespace

absl::StatusOr<LayerNormResult> LayerNorm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps,
                                          const Tensor* residual) {
  const Device dev = x.device();
  const int64_t n = LastDim(x);
  if (x.dim() == 0 || gamma.shape() != Shape{n} || beta.shape() != Shape{n}) {
    return absl::InvalidArgumentError(absl::StrCat("layer_norm: gamma ", ShapeToString(gamma.shape()), " and beta ",
                                                   ShapeToString(beta.shape()), " must be [", n, "] for input ",
                                                   ShapeToString(x.shape())));
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels("layer_norm", dev, {&gamma, &beta}));
  ASSIGN_OR_RETURN(DType type, KernelType(x, "layer_norm"));
  ASSIGN_OR_RETURN(const Tensor cx, x.TryContiguous());
  ASSIGN_OR_RETURN(Tensor cg, AsFloat(gamma, type, "layer_norm"));
  ASSIGN_OR_RETURN(Tensor cb, AsFloat(beta, type, "layer_norm"));
  const int64_t rows = n == 0 ? 0 : cx.numel() / n;
  ASSIGN_OR_RETURN(Tensor y, Tensor::Empty(x.shape(), type, dev));
  ASSIGN_OR_RETURN(Tensor mean, Tensor::Empty({rows}, DType::kF32, dev));
  ASSIGN_OR_RETURN(Tensor rstd, Tensor::Empty({rows}, DType::kF32, dev));
  ASSIGN_OR_RETURN(ResidualArgs res, Residual(x, residual, type, "layer_norm"));
  RETURN_IF_ERROR(k->LayerNorm(dev.index, Elem(type), cx.raw_data(), res.in(), cg.raw_data(), cb.raw_data(), eps,
                               y.raw_data(), res.out(), F(mean), F(rstd), rows, n));
  return LayerNormResult{std::move(y), std::move(mean), std::move(rstd), std::move(res.sum)};
}

bool FoldsInto(const Tensor& x, const Tensor& acc) {
  absl::StatusOr<DType> type = KernelType(x, "norm backward");
  return type.ok() && acc.dtype() == *type && acc.shape() == x.shape() && acc.device() == x.device() &&
         acc.is_contiguous();
}

namespace {

// The raw data of a norm backward's `acc`, checked (null when absent).
absl::StatusOr<const void*> FoldedData(const Tensor& x, const Tensor* acc, const char* op) {
  if (acc == nullptr) return nullptr;
  if (!FoldsInto(x, *acc)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": cannot fold a gradient ", DTypeName(acc->dtype()),
                                                   ShapeToString(acc->shape()), " on ", acc->device().ToString(),
                                                   " into the input ", DTypeName(x.dtype()),
                                                   ShapeToString(x.shape()), " on ", x.device().ToString()));
  }
  return acc->raw_data();
}

}  // namespace

absl::StatusOr<LayerNormGrads> LayerNormBackward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                                 const Tensor& mean, const Tensor& rstd, const Tensor* acc) {
  const Device dev = x.device();
  RETURN_IF_ERROR(SameShapes(dy, x, "layer_norm_backward"));
  const int64_t n = LastDim(x), rows = n == 0 ? 0 : x.numel() / n;
  if (gamma.shape() != Shape{n} || mean.shape() != Shape{rows} || rstd.shape() != Shape{rows}) {
    return absl::InvalidArgumentError("layer_norm_backward: gamma, mean or rstd does not match the input");
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels("layer_norm_backward", dev, {&dy, &gamma, &mean, &rstd}));
  ASSIGN_OR_RETURN(DType type, KernelType(x, "layer_norm_backward"));
  ASSIGN_OR_RETURN(const Tensor cx, x.TryContiguous());
  ASSIGN_OR_RETURN(Tensor cd, AsFloat(dy, type, "layer_norm_backward"));
  ASSIGN_OR_RETURN(Tensor cg, AsFloat(gamma, type, "layer_norm_backward"));
  ASSIGN_OR_RETURN(Tensor fm, AsF32(mean, "layer_norm_backward"));
  ASSIGN_OR_RETURN(Tensor fr, AsF32(rstd, "layer_norm_backward"));
  ASSIGN_OR_RETURN(const void* fold, FoldedData(x, acc, "layer_norm_backward"));
  ASSIGN_OR_RETURN(Tensor dx, Tensor::Empty(x.shape(), type, dev));
  ASSIGN_OR_RETURN(Tensor dgamma, Tensor::Empty({n}, type, dev));
  ASSIGN_OR_RETURN(Tensor dbeta, Tensor::Empty({n}, type, dev));
  RETURN_IF_ERROR(k->LayerNormBackward(dev.index, Elem(type), cd.raw_data(), cx.raw_data(), cg.raw_data(), F(fm),
                                       F(fr), fold, dx.raw_data(), dgamma.raw_data(), dbeta.raw_data(), rows, n));
  ASSIGN_OR_RETURN(dgamma, dgamma.ContiguousAs(gamma.dtype()));
  ASSIGN_OR_RETURN(dbeta, dbeta.ContiguousAs(gamma.dtype()));
  return LayerNormGrads{std::move(dx), std::move(dgamma), std::move(dbeta)};
}

absl::StatusOr<RmsNormResult> RmsNorm(const Tensor& x, const Tensor& gamma, float eps, const Tensor* residual) {
  const Device dev = x.device();
  const int64_t n = LastDim(x);
  if (x.dim() == 0 || gamma.shape() != Shape{n}) {
    return absl::InvalidArgumentError(absl::StrCat("rms_norm: gamma ", ShapeToString(gamma.shape()), " must be [", n,
                                                   "] for input ", ShapeToString(x.shape())));
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels("rms_norm", dev, {&gamma}));
  ASSIGN_OR_RETURN(DType type, KernelType(x, "rms_norm"));
  ASSIGN_OR_RETURN(const Tensor cx, x.TryContiguous());
  ASSIGN_OR_RETURN(Tensor cg, AsFloat(gamma, type, "rms_norm"));
  const int64_t rows = n == 0 ? 0 : cx.numel() / n;
  ASSIGN_OR_RETURN(Tensor y, Tensor::Empty(x.shape(), type, dev));
  ASSIGN_OR_RETURN(Tensor rstd, Tensor::Empty({rows}, DType::kF32, dev));
  ASSIGN_OR_RETURN(ResidualArgs res, Residual(x, residual, type, "rms_norm"));
  RETURN_IF_ERROR(k->RmsNorm(dev.index, Elem(type), cx.raw_data(), res.in(), cg.raw_data(), eps, y.raw_data(),
                             res.out(), F(rstd), rows, n));
  return RmsNormResult{std::move(y), std::move(rstd), std::move(res.sum)};
}

absl::StatusOr<RmsNormGrads> RmsNormBackward(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                             const Tensor& rstd, const Tensor* acc) {
  const Device dev = x.device();
  RETURN_IF_ERROR(SameShapes(dy, x, "rms_norm_backward"));
  const int64_t n = LastDim(x), rows = n == 0 ? 0 : x.numel() / n;
  if (gamma.shape() != Shape{n} || rstd.shape() != Shape{rows}) {
    return absl::InvalidArgumentError("rms_norm_backward: gamma or rstd does not match the input");
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels("rms_norm_backward", dev, {&dy, &gamma, &rstd}));
  ASSIGN_OR_RETURN(DType type, KernelType(x, "rms_norm_backward"));
  ASSIGN_OR_RETURN(const Tensor cx, x.TryContiguous());
  ASSIGN_OR_RETURN(Tensor cd, AsFloat(dy, type, "rms_norm_backward"));
  ASSIGN_OR_RETURN(Tensor cg, AsFloat(gamma, type, "rms_norm_backward"));
  ASSIGN_OR_RETURN(Tensor fr, AsF32(rstd, "rms_norm_backward"));
  ASSIGN_OR_RETURN(const void* fold, FoldedData(x, acc, "rms_norm_backward"));
  ASSIGN_OR_RETURN(Tensor dx, Tensor::Empty(x.shape(), type, dev));
  ASSIGN_OR_RETURN(Tensor dgamma, Tensor::Empty({n}, type, dev));
  RETURN_IF_ERROR(k->RmsNormBackward(dev.index, Elem(type), cd.raw_data(), cx.raw_data(), cg.raw_data(), F(fr), fold,
                                     dx.raw_data(), dgamma.raw_data(), rows, n));
  ASSIGN_OR_RETURN(dgamma, dgamma.ContiguousAs(gamma.dtype()));
  return RmsNormGrads{std::move(dx), std::move(dgamma)};
}

namespace {

// x's rows [rows, n] for the sharded-norm passes, with the f32 [rows]
// statistics made contiguous and checked: `stats` always present, `center`
// (the mean, or a pass's centre) where given (`center_data` null otherwise).
struct NormRows {
  Tensor x;
  int64_t rows, n;
  DType type;
  std::vector<Tensor> stats;  // contiguous, in the order given
  std::optional<Tensor> center;
  const float* center_data() const { return center.has_value() ? center->data<float>() : nullptr; }
};
absl::StatusOr<NormRows> NormPiece(const Tensor& x, const char* op, std::initializer_list<const Tensor*> stats,
                                   const std::optional<Tensor>& center) {
  if (x.dim() == 0) return absl::InvalidArgumentError(absl::StrCat(op, ": the input needs a last dim"));
  ASSIGN_OR_RETURN(DType type, KernelType(x, op));
  ASSIGN_OR_RETURN(Tensor dense, x.TryContiguous());
  NormRows p{std::move(dense), 0, LastDim(x), type, {}, std::nullopt};
  p.rows = p.n == 0 ? 0 : x.numel() / p.n;
  auto check = [&](const Tensor& t) -> absl::StatusOr<Tensor> {
    if (t.dtype() != DType::kF32 || t.numel() != p.rows || !(t.device() == x.device())) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": row statistics must be f32 [", p.rows, "] on ",
                                                     x.device().ToString(), ", got ", DTypeName(t.dtype()),
                                                     ShapeToString(t.shape())));
    }
    return t.TryContiguous();
  };
  for (const Tensor* t : stats) {
    ASSIGN_OR_RETURN(Tensor c, check(*t));
    p.stats.push_back(std::move(c));
  }
  if (center.has_value()) {
    ASSIGN_OR_RETURN(p.center, check(*center));
  }
  return p;
}

}  // namespace

absl::StatusOr<Tensor> NormRowSums(const Tensor& x, const std::optional<Tensor>& center, bool square) {
  const char* op = "norm_row_sums";
  ASSIGN_OR_RETURN(NormRows p, NormPiece(x, op, {}, center));
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(x.device()));
  ASSIGN_OR_RETURN(Tensor sums, Tensor::Empty({p.rows}, DType::kF32, x.device()));
  RETURN_IF_ERROR(k->NormRowSums(x.device().index, Elem(p.type), p.x.raw_data(), p.center_data(), square, p.rows,
                                 p.n,
                                 F(sums)));
  return sums;
}

absl::StatusOr<NormApplied> NormApply(const Tensor& x, const Tensor& gamma, const std::optional<Tensor>& beta,
                                      const std::optional<Tensor>& mean, const Tensor& sq_sums, int64_t h,
                                      float eps) {
  const char* op = "norm_apply";
  ASSIGN_OR_RETURN(NormRows p, NormPiece(x, op, {&sq_sums}, mean));
  const Tensor& sq = p.stats[0];
  if (gamma.shape() != Shape{p.n} || (beta.has_value() && beta->shape() != Shape{p.n}) || h < p.n) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": gamma and beta must be [", p.n, "] and h >= ", p.n));
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels(op, x.device(), {&gamma}));
  ASSIGN_OR_RETURN(Tensor g, AsFloat(gamma, p.type, op));
  std::optional<Tensor> b;
  if (beta.has_value()) {
    RETURN_IF_ERROR(SameDevice(op, x.device(), {&*beta}));
    ASSIGN_OR_RETURN(b, AsFloat(*beta, p.type, op));
  }
  NormApplied out;
  ASSIGN_OR_RETURN(out.y, Tensor::Empty(x.shape(), p.type, x.device()));
  ASSIGN_OR_RETURN(out.rstd, Tensor::Empty({p.rows}, DType::kF32, x.device()));
  RETURN_IF_ERROR(k->NormApply(x.device().index, Elem(p.type), p.x.raw_data(), g.raw_data(),
                               b.has_value() ? b->raw_data() : nullptr, p.center_data(), sq.data<float>(), h, eps,
                               p.rows, p.n,
                               out.y.raw_data(), F(out.rstd)));
  return out;
}

absl::StatusOr<Tensor> NormBackwardSums(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                        const std::optional<Tensor>& mean, const Tensor& rstd) {
  const char* op = "norm_backward_sums";
  RETURN_IF_ERROR(SameShapes(dy, x, op));
  ASSIGN_OR_RETURN(NormRows p, NormPiece(x, op, {&rstd}, mean));
  const Tensor& rs = p.stats[0];
  if (gamma.shape() != Shape{p.n}) return absl::InvalidArgumentError(absl::StrCat(op, ": gamma must be [", p.n, "]"));
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels(op, x.device(), {&dy, &gamma}));
  ASSIGN_OR_RETURN(Tensor d, AsFloat(dy, p.type, op));
  ASSIGN_OR_RETURN(Tensor g, AsFloat(gamma, p.type, op));
  ASSIGN_OR_RETURN(Tensor sums, Tensor::Empty({2, p.rows}, DType::kF32, x.device()));
  RETURN_IF_ERROR(k->NormBackwardSums(x.device().index, Elem(p.type), d.raw_data(), p.x.raw_data(), g.raw_data(),
                                      p.center_data(), rs.data<float>(), p.rows, p.n, F(sums)));
  return sums;
}

absl::StatusOr<Tensor> NormBackwardApply(const Tensor& dy, const Tensor& x, const Tensor& gamma,
                                         const std::optional<Tensor>& mean, const Tensor& rstd, const Tensor& sums,
                                         int64_t h) {
  const char* op = "norm_backward_apply";
  RETURN_IF_ERROR(SameShapes(dy, x, op));
  ASSIGN_OR_RETURN(NormRows p, NormPiece(x, op, {&rstd}, mean));
  const Tensor& rs = p.stats[0];
  ASSIGN_OR_RETURN(const Tensor su, sums.TryContiguous());
  if (gamma.shape() != Shape{p.n} || su.dtype() != DType::kF32 || su.numel() != 2 * p.rows || h < p.n) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": gamma must be [", p.n, "], sums f32 [2, ", p.rows,
                                                   "] and h >= ", p.n));
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels(op, x.device(), {&dy, &gamma, &su}));
  ASSIGN_OR_RETURN(Tensor d, AsFloat(dy, p.type, op));
  ASSIGN_OR_RETURN(Tensor g, AsFloat(gamma, p.type, op));
  ASSIGN_OR_RETURN(Tensor dx, Tensor::Empty(x.shape(), p.type, x.device()));
  RETURN_IF_ERROR(k->NormBackwardApply(x.device().index, Elem(p.type), d.raw_data(), p.x.raw_data(), g.raw_data(),
                                       p.center_data(), rs.data<float>(), F(su), h, p.rows, p.n, dx.raw_data()));
  return dx;
}

absl::StatusOr<NormParamGrads> NormParamGrad(const Tensor& dy, const Tensor& x, const std::optional<Tensor>& mean,
                                             const Tensor& rstd, bool beta) {
  const char* op = "norm_param_grad";
  RETURN_IF_ERROR(SameShapes(dy, x, op));
  ASSIGN_OR_RETURN(NormRows p, NormPiece(x, op, {&rstd}, mean));
  const Tensor& rs = p.stats[0];
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels(op, x.device(), {&dy}));
  ASSIGN_OR_RETURN(Tensor d, AsFloat(dy, p.type, op));
  NormParamGrads out;
  ASSIGN_OR_RETURN(out.dgamma, Tensor::Empty({p.n}, DType::kF32, x.device()));
  if (beta) {
    ASSIGN_OR_RETURN(out.dbeta, Tensor::Empty({p.n}, DType::kF32, x.device()));
  }
  RETURN_IF_ERROR(k->NormParamGrad(x.device().index, Elem(p.type), d.raw_data(), p.x.raw_data(), p.center_data(),
                                   rs.data<float>(),
                                   p.rows, p.n, F(out.dgamma), beta ? out.dbeta->data<float>() : nullptr));
  return out;
}

absl::StatusOr<Tensor> Softmax(const Tensor& x, bool causal) {
  const Device dev = x.device();
  if (x.dim() == 0 || (causal && x.dim() < 2)) {
    return absl::InvalidArgumentError(absl::StrCat("softmax: input ", ShapeToString(x.shape()),
                                                   causal ? " must be [..., Q, K]" : " needs a last dim"));
  }
  const int64_t k = LastDim(x), rows = k == 0 ? 0 : x.numel() / k;
  const int64_t q = causal ? x.shape()[x.dim() - 2] : 1;
  if (causal && k < q) {
    return absl::InvalidArgumentError(absl::StrCat("softmax: causal scores ", ShapeToString(x.shape()),
                                                   " have more queries than keys"));
  }
  ASSIGN_OR_RETURN(const DeviceKernels* kern, KernelsFor(dev));
  ASSIGN_OR_RETURN(Tensor f, AsF32(x, "softmax"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32, dev));
  RETURN_IF_ERROR(kern->Softmax(dev.index, F(f), F(out), rows, k, causal ? q : 0));
  return Back(out, x.dtype());
}

absl::StatusOr<Tensor> SoftmaxBackward(const Tensor& dy, const Tensor& y) {
  const Device dev = y.device();
  RETURN_IF_ERROR(SameShapes(dy, y, "softmax_backward"));
  ASSIGN_OR_RETURN(const DeviceKernels* kern, Kernels("softmax_backward", dev, {&dy}));
  ASSIGN_OR_RETURN(Tensor fy, AsF32(y, "softmax_backward"));
  ASSIGN_OR_RETURN(Tensor fd, AsF32(dy, "softmax_backward"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(y.shape(), DType::kF32, dev));
  const int64_t k = LastDim(fy), rows = k == 0 ? 0 : fy.numel() / k;
  RETURN_IF_ERROR(kern->SoftmaxBackward(dev.index, F(fd), F(fy), F(out), rows, k));
  return Back(out, y.dtype());
}

namespace {

absl::StatusOr<Tensor> ApplyDropout(const Tensor& x, float p, uint64_t seed, uint64_t offset, const char* op) {
  if (!(p >= 0.0f && p < 1.0f)) return absl::InvalidArgumentError(absl::StrCat(op, ": p = ", p, " is not in [0, 1)"));
  const Device dev = x.device();
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(dev));
  ASSIGN_OR_RETURN(Tensor f, AsF32(x, op));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32, dev));
  RETURN_IF_ERROR(k->Dropout(dev.index, F(f), F(out), f.numel(), p, seed, offset));
  return Back(out, x.dtype());
}

}  // namespace

absl::StatusOr<Tensor> Dropout(const Tensor& x, float p, uint64_t seed, uint64_t offset) {
  return ApplyDropout(x, p, seed, offset, "dropout");
}

absl::StatusOr<Tensor> DropoutBackward(const Tensor& dy, float p, uint64_t seed, uint64_t offset) {
  return ApplyDropout(dy, p, seed, offset, "dropout_backward");
}

absl::StatusOr<Tensor> Embedding(const Tensor& table, const Tensor& ids, int64_t row_offset, bool mask_out_of_range) {
  const Device dev = table.device();
  if (table.dim() != 2) {
    return absl::InvalidArgumentError(absl::StrCat("embedding: table must be [rows, H], got ",
                                                   ShapeToString(table.shape())));
  }
  if (!(ids.device() == dev) && !(ids.device() == Device::Cpu())) {
    return absl::InvalidArgumentError(absl::StrCat("embedding: ids on ", ids.device().ToString(),
                                                   " for a table on ", dev.ToString()));
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(dev));
  ASSIGN_OR_RETURN(Tensor id64, AsI64(ids, "embedding"));
  const int64_t rows = table.shape()[0], h = table.shape()[1];
  if (!mask_out_of_range) {
    ASSIGN_OR_RETURN(const std::vector<int64_t> idv, id64.ReadInt64s());  // free for host ids
    for (size_t i = 0; i < idv.size(); ++i) {
      if (idv[i] < row_offset || idv[i] - row_offset >= rows) {
        return absl::InvalidArgumentError(absl::StrCat("embedding: id ", idv[i], " at position ", i,
                                                       " is outside the vocabulary [", row_offset, ", ",
                                                       row_offset + rows, ")"));
      }
    }
  }
  ASSIGN_OR_RETURN(id64, id64.To(dev));  // stream ordered; host ids are staged
  // The table's rows copied in its dtype: no f32 copy of the table.
  ASSIGN_OR_RETURN(const DType type, KernelType(table, "embedding"));
  ASSIGN_OR_RETURN(Tensor ft, AsFloat(table, type, "embedding"));
  Shape shape = ids.shape();
  shape.push_back(h);
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(shape, type, dev));
  RETURN_IF_ERROR(k->Embedding(dev.index, Elem(type), ft.raw_data(), id64.data<int64_t>(), out.raw_data(),
                               id64.numel(), rows, h, row_offset));
  return out;
}

absl::StatusOr<Tensor> EmbeddingBackward(const Tensor& dy, const Tensor& ids, int64_t rows, int64_t row_offset) {
  const Device dev = dy.device();
  if (!IsInteger(ids.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("embedding_backward: ids must be i32 or i64, got ", DTypeName(ids.dtype())));
  }
  const int64_t h = LastDim(dy);
  if (dy.dim() != ids.dim() + 1 || dy.shape()[dy.dim() - 1] != h || rows < 0 ||
      !std::equal(ids.shape().begin(), ids.shape().end(), dy.shape().begin())) {
    return absl::InvalidArgumentError(absl::StrCat("embedding_backward: dy ", ShapeToString(dy.shape()),
                                                   " does not match ids ", ShapeToString(ids.shape())));
  }
  if (!(ids.device() == dev) && !(ids.device() == Device::Cpu())) {
    return absl::InvalidArgumentError(absl::StrCat("embedding_backward: ids on ", ids.device().ToString(),
                                                   " for dy on ", dev.ToString()));
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(dev));
  // dy read and the gradient written in dy's dtype (each sum in double,
  // rounded to f32 and then to the dtype, as an f32 gradient converted).
  ASSIGN_OR_RETURN(const DType type, KernelType(dy, "embedding_backward"));
  ASSIGN_OR_RETURN(Tensor fd, AsFloat(dy, type, "embedding_backward"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({rows, h}, type, dev));
  // The tokens grouped by their row (a counting sort), in token order within
  // a row: both twins sum each row's tokens in that order, without atomics.
  if (rows == 0 || h == 0) return out;
  ASSIGN_OR_RETURN(const std::vector<int64_t> idv, ids.ReadInt64s());
  const auto in_shard = [&](int64_t id) { return id >= row_offset && id < row_offset + rows; };
  std::vector<int64_t> start(rows + 1, 0);
  for (int64_t id : idv) {
    if (in_shard(id)) ++start[id - row_offset + 1];
  }
  for (int64_t r = 0; r < rows; ++r) start[r + 1] += start[r];
  std::vector<int64_t> tokens(start[rows]), cursor(start.begin(), start.end() - 1);
  for (size_t i = 0; i < idv.size(); ++i) {
    if (in_shard(idv[i])) tokens[cursor[idv[i] - row_offset]++] = static_cast<int64_t>(i);
  }
  std::vector<int64_t> seg_rows, seg_starts;
  for (int64_t r = 0; r < rows; ++r) {
    if (start[r + 1] == start[r]) continue;
    seg_rows.push_back(r);
    seg_starts.push_back(start[r]);
  }
  seg_starts.push_back(start[rows]);
  RETURN_IF_ERROR(k->EmbeddingBackward(dev.index, Elem(type), fd.raw_data(), seg_rows, seg_starts, tokens,
                                       out.raw_data(), rows, h));
  return out;
}

namespace {

struct CeInputs {
  Tensor logits;  // contiguous f32
  Tensor labels;  // contiguous i64
  int64_t n, v;
};

absl::StatusOr<CeInputs> CheckCe(const Tensor& logits, const Tensor& labels, int64_t ignore_index, const char* op) {
  if (logits.dim() != 2 || labels.dim() != 1 || labels.shape()[0] != logits.shape()[0]) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": logits ", ShapeToString(logits.shape()), " and labels ",
                                                   ShapeToString(labels.shape()), " must be [N, V] and [N]"));
  }
  // Labels on the host may go with device logits: checked there and copied
  // up stream ordered, so the loss reads nothing back (as ops::Embedding's ids).
  if (labels.device().is_cuda()) RETURN_IF_ERROR(SameDevice(op, logits.device(), {&labels}));
  ASSIGN_OR_RETURN(Tensor l64, AsI64(labels, op));
  const int64_t v = logits.shape()[1];
  ASSIGN_OR_RETURN(const std::vector<int64_t> lab, l64.ReadInt64s());  // free for host labels
  for (size_t i = 0; i < lab.size(); ++i) {
    if (lab[i] != ignore_index && (lab[i] < 0 || lab[i] >= v)) {
      return absl::InvalidArgumentError(
          absl::StrCat(op, ": label ", lab[i], " at row ", i, " is outside the vocabulary [0, ", v, ")"));
    }
  }
  ASSIGN_OR_RETURN(l64, l64.To(logits.device()));  // a handle where it is already there
  ASSIGN_OR_RETURN(Tensor f, AsF32(logits, op));
  return CeInputs{std::move(f), std::move(l64), logits.shape()[0], v};
}

}  // namespace

absl::StatusOr<Tensor> CrossEntropy(const Tensor& logits, const Tensor& labels, float label_smoothing,
                                    int64_t ignore_index) {
  const Device dev = logits.device();
  ASSIGN_OR_RETURN(CeInputs in, CheckCe(logits, labels, ignore_index, "cross_entropy"));
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(dev));
  ASSIGN_OR_RETURN(Tensor loss, Tensor::Empty({in.n}, DType::kF32, dev));
  RETURN_IF_ERROR(k->CrossEntropy(dev.index, F(in.logits), in.labels.data<int64_t>(), F(loss), in.n, in.v,
                                  label_smoothing, ignore_index));
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
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels("cross_entropy_backward", dev, {&dloss}));
  ASSIGN_OR_RETURN(Tensor dl32, AsF32(dloss, "cross_entropy_backward"));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({in.n, in.v}, DType::kF32, dev));
  RETURN_IF_ERROR(k->CrossEntropyBackward(dev.index, F(dl32), F(in.logits), in.labels.data<int64_t>(), F(out), in.n,
                                          in.v, label_smoothing, ignore_index));
  return Back(out, logits.dtype());
}

namespace {

absl::Status CheckVocabShard(const char* op, const Tensor& z, const Tensor& labels, int64_t real, int64_t start,
                             int64_t vocab) {
  if (z.dim() != 2 || labels.dim() != 1 || labels.shape()[0] != z.shape()[0] || labels.dtype() != DType::kI64) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": logits ", ShapeToString(z.shape()), " and labels ",
                                                   DTypeName(labels.dtype()), ShapeToString(labels.shape()),
                                                   " must be [rows, width] and i64 [rows]"));
  }
  if (real < 0 || real > z.shape()[1] || start < 0 || vocab < 1 || (real > 0 && start + real > vocab)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": columns [", start, ", ", start + real, ") of a ", vocab,
                                                   "-word vocabulary do not fit a shard of width ", z.shape()[1]));
  }
  return SameDevice(op, z.device(), {&labels});
}

}  // namespace

absl::StatusOr<VocabShardForward> VocabShardCrossEntropy(
    const Tensor& z, const Tensor& labels, int64_t real, int64_t start, int64_t vocab, float label_smoothing,
    int64_t ignore_index, int64_t shards, const std::function<absl::Status(const Tensor& in, Tensor& out)>& all_gather) {
  const char* op = "vocab_parallel_cross_entropy";
  RETURN_IF_ERROR(CheckVocabShard(op, z, labels, real, start, vocab));
  if (shards < 1) return absl::InvalidArgumentError(absl::StrCat(op, ": shards ", shards, " must be >= 1"));
  const Device dev = z.device();
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(dev));
  const int64_t rows = z.shape()[0], width = z.shape()[1];
  VocabShardForward out;
  ASSIGN_OR_RETURN(const DType type, KernelType(z, op));
  ASSIGN_OR_RETURN(out.z, AsFloat(z, type, op));  // the logits as they are (contiguous), no f32 copy
  ASSIGN_OR_RETURN(const Tensor lab, labels.TryContiguous());
  // This shard's (max, sums against it), then every shard's in one
  // all-gather: one collective where a max then a sum would take two.
  ASSIGN_OR_RETURN(Tensor mine, Tensor::Empty({4, rows}, DType::kF32, dev));
  RETURN_IF_ERROR(k->VocabShardStats(dev.index, Elem(type), out.z.raw_data(), lab.data<int64_t>(), rows, width,
                                     real, start, ignore_index, F(mine)));
  ASSIGN_OR_RETURN(Tensor gathered, Tensor::Empty({shards, 4, rows}, DType::kF32, dev));
  RETURN_IF_ERROR(all_gather(mine, gathered));
  ASSIGN_OR_RETURN(Tensor mx, Tensor::Empty({rows}, DType::kF32, dev));
  ASSIGN_OR_RETURN(Tensor stats, Tensor::Empty({3, rows}, DType::kF32, dev));
  RETURN_IF_ERROR(k->VocabShardCombine(dev.index, F(gathered), shards, rows, F(mx), F(stats)));
  ASSIGN_OR_RETURN(out.lse, Tensor::Empty({rows}, DType::kF32, dev));
  ASSIGN_OR_RETURN(out.loss, Tensor::Empty({rows}, DType::kF32, dev));
  RETURN_IF_ERROR(k->VocabShardLoss(dev.index, F(mx), F(stats), lab.data<int64_t>(), rows, vocab, label_smoothing,
                                    ignore_index, F(out.lse), F(out.loss)));
  return out;
}

absl::StatusOr<Tensor> VocabShardCrossEntropyBackward(const Tensor& dloss, const VocabShardForward& forward,
                                                      const Tensor& labels, int64_t real, int64_t start,
                                                      int64_t vocab, float label_smoothing, int64_t ignore_index,
                                                      DType dtype) {
  const char* op = "vocab_parallel_cross_entropy_backward";
  RETURN_IF_ERROR(CheckVocabShard(op, forward.z, labels, real, start, vocab));
  const int64_t rows = forward.z.shape()[0], width = forward.z.shape()[1];
  if (dloss.shape() != Shape{rows}) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": dloss ", ShapeToString(dloss.shape()), " must be [", rows,
                                                   "]"));
  }
  const Device dev = forward.z.device();
  ASSIGN_OR_RETURN(const DeviceKernels* k, Kernels(op, dev, {&dloss, &forward.lse}));
  ASSIGN_OR_RETURN(Tensor dl, AsF32(dloss, op));
  ASSIGN_OR_RETURN(const Tensor lab, labels.TryContiguous());
  // dz in the logits' type where that is what is asked for, else in f32
  // and converted: each value rounded once either way.
  const DType z_type = forward.z.dtype();
  if (!IsFloat(z_type) || !forward.z.is_contiguous()) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": the saved logits must be contiguous floats, got ",
                                                   DTypeName(z_type)));
  }
  const DType dz_type = dtype == z_type ? z_type : DType::kF32;
  ASSIGN_OR_RETURN(Tensor dz, Tensor::Empty({rows, width}, dz_type, dev));
  RETURN_IF_ERROR(k->VocabShardBackward(dev.index, Elem(z_type), forward.z.raw_data(), lab.data<int64_t>(),
                                        F(forward.lse), F(dl), rows, width, real, start, vocab, label_smoothing,
                                        ignore_index, Elem(dz_type), dz.raw_data()));
  if (dtype == dz_type) return dz;
  return dz.ToDType(dtype);
}

namespace {

absl::StatusOr<Tensor> Rotate(const Tensor& x, float theta, int64_t position_offset, float sign, const char* op) {
  const Device dev = x.device();
  if (x.dim() != 4 || x.shape()[3] % 2 != 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": input ", ShapeToString(x.shape()),
                                                   " must be [B, S, heads, D] with D even"));
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(dev));
  ASSIGN_OR_RETURN(Tensor f, AsF32(x, op));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(x.shape(), DType::kF32, dev));
  const int64_t b = x.shape()[0], s = x.shape()[1], heads = x.shape()[2], d = x.shape()[3];
  RETURN_IF_ERROR(k->Rope(dev.index, F(f), F(out), b, s, heads, d, theta, position_offset, sign));
  return Back(out, x.dtype());
}

}  // namespace

absl::StatusOr<Tensor> Rope(const Tensor& x, float theta, int64_t position_offset) {
  return Rotate(x, theta, position_offset, 1.0f, "rope");
}

absl::StatusOr<Tensor> RopeBackward(const Tensor& dy, float theta, int64_t position_offset) {
  return Rotate(dy, theta, position_offset, -1.0f, "rope_backward");
}

absl::Status CheckAttentionShapes(const Tensor& q, const Tensor& k, const Tensor& v, bool same_length) {
  const Shape& qs = q.shape();
  const Shape& ks = k.shape();
  if (qs.size() != 4 || ks.size() != 4 || ks != v.shape() || qs[0] != ks[0] || (same_length && qs[1] != ks[1]) ||
      qs[3] != ks[3] || ks[2] == 0 || qs[2] % ks[2] != 0) {
    return absl::InvalidArgumentError(absl::StrCat("attention: q ", ShapeToString(qs), ", k ", ShapeToString(ks),
                                                   ", v ", ShapeToString(v.shape()),
                                                   " must be [B, Sq, Hq, D] and [B, Sk, Hkv, D] with Hq a multiple of "
                                                   "Hkv", same_length ? " and Sq = Sk" : ""));
  }
  return absl::OkStatus();
}

namespace {

// Where the attention kernels find t's rows ([B, S, heads, D] of `type`:
// kernels::HeadRows), if they read it as it is: its elements of `type`, D
// contiguous, the batch S tokens apart, and every row starting at a 16-byte
// boundary (what the tensor-core kernels stage). A slice of packed q, k and
// v is such a view; a transposed or odd-strided one is not.
std::optional<kernels::HeadRows> HeadRowsOf(const Tensor& t, DType type) {
  const std::vector<int64_t>& st = t.strides();
  const int64_t size = static_cast<int64_t>(SizeOf(type));
  const auto whole = [&](int64_t stride) { return stride > 0 && stride * size % 16 == 0; };
  if (t.dtype() != type || t.dim() != 4 || st[3] != 1 || !whole(st[1]) || !whole(st[2]) ||
      (t.shape()[0] > 1 && st[0] != t.shape()[1] * st[1]) || reinterpret_cast<uintptr_t>(t.raw_data()) % 16 != 0) {
    return std::nullopt;
  }
  return kernels::HeadRows{st[1], st[2]};
}

}  // namespace

bool AttentionReadsInPlace(const Tensor& t) { return t.dim() == 4 && HeadRowsOf(t, t.dtype()).has_value(); }

namespace {

// q, k and v as the attention kernels read them, in their type (q's), after
// the shape and device checks: each as it is where the kernels can read it
// so (HeadRowsOf; k and v alike), else a contiguous copy; and where their
// rows are.
absl::Status AttentionOperands(const Tensor& q, const Tensor& k, const Tensor& v, const char* op, Tensor& qf,
                               Tensor& kf, Tensor& vf, kernels::AttentionLayout& layout) {
  RETURN_IF_ERROR(CheckAttentionShapes(q, k, v));
  RETURN_IF_ERROR(SameDevice(op, q.device(), {&k, &v}));
  if (q.shape()[3] > kernels::kMaxFusedHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": head dim ", q.shape()[3], " is over the fused kernel's ",
                                                   kernels::kMaxFusedHeadDim));
  }
  ASSIGN_OR_RETURN(DType type, KernelType(q, op));
  const int64_t hq = q.shape()[2], hkv = k.shape()[2], d = q.shape()[3];
  layout = kernels::ContiguousAttention(hq, hkv, d);
  if (std::optional<kernels::HeadRows> rows = HeadRowsOf(q, type)) {
    qf = q;
    layout.q = *rows;
  } else {
    ASSIGN_OR_RETURN(qf, AsFloat(q, type, op));
  }
  const std::optional<kernels::HeadRows> krows = HeadRowsOf(k, type), vrows = HeadRowsOf(v, type);
  if (krows.has_value() && vrows.has_value() && krows->token == vrows->token && krows->head == vrows->head) {
    kf = k;
    vf = v;
    layout.kv = *krows;
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(kf, AsFloat(k, type, op));
  ASSIGN_OR_RETURN(vf, AsFloat(v, type, op));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<AttentionQkv> AttentionInputs(const Tensor& q, const Tensor& k, const Tensor& v) {
  AttentionQkv in;
  kernels::AttentionLayout layout;
  RETURN_IF_ERROR(AttentionOperands(q, k, v, "fused_attention", in.q, in.k, in.v, layout));
  return in;
}

namespace {

// Where the backward's kernels can write a gradient into `place`
// (AttentionGradPlaces) as they go, if they can: rows they write (HeadRowsOf)
// that do not overlap. INVALID_ARGUMENT unless `place` has `shape` and
// `type` and is on `dev`.
absl::StatusOr<std::optional<kernels::HeadRows>> PlaceRows(const Tensor& place, const Shape& shape, DType type,
                                                           const Device& dev, const char* what, const char* op) {
  if (place.shape() != shape || place.dtype() != type || place.device() != dev) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", what, "'s place must be ", DTypeName(type),
                                                   ShapeToString(shape), " on ", dev.ToString(), ", not ",
                                                   DTypeName(place.dtype()), ShapeToString(place.shape()), " on ",
                                                   place.device().ToString()));
  }
  std::optional<kernels::HeadRows> rows = HeadRowsOf(place, type);
  const int64_t heads = shape[2], d = shape[3];
  if (rows.has_value() && (rows->head < d || rows->token < (heads - 1) * rows->head + d)) rows.reset();
  return rows;
}

// The kernels' view of `extras` (null pointers for what is not set), after
// checking each is a contiguous f32 tensor of its shape on q's device.
absl::StatusOr<kernels::AttentionBias> ExtrasOf(const AttentionExtras& extras, const Tensor& q, const char* op) {
  const int64_t hq = q.shape()[2], s = q.shape()[1];
  auto check = [&](const std::optional<Tensor>& t, const Shape& shape, const char* what) -> absl::Status {
    if (!t.has_value()) return absl::OkStatus();
    if (t->dtype() != DType::kF32 || t->shape() != shape || !t->is_contiguous() || t->device() != q.device()) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": ", what, " must be contiguous f32 ", ShapeToString(shape),
                                                     " on ", q.device().ToString(), ", not ", DTypeName(t->dtype()),
                                                     ShapeToString(t->shape()), " on ", t->device().ToString()));
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(check(extras.alibi, {hq}, "ALiBi slopes"));
  RETURN_IF_ERROR(check(extras.bias, {hq, s, s}, "an attention bias"));
  kernels::AttentionBias k;
  if (extras.alibi.has_value()) k.alibi = static_cast<const float*>(extras.alibi->raw_data());
  if (extras.bias.has_value()) k.bias = static_cast<const float*>(extras.bias->raw_data());
  return k;
}

}  // namespace

absl::StatusOr<AttentionForward> FusedAttention(const Tensor& q, const Tensor& k, const Tensor& v, float scale,
                                                bool causal, const AttentionExtras& extras) {
  const char* op = "fused_attention";
  Tensor qf, kf, vf;
  kernels::AttentionLayout layout;
  RETURN_IF_ERROR(AttentionOperands(q, k, v, op, qf, kf, vf, layout));
  ASSIGN_OR_RETURN(const kernels::AttentionBias added, ExtrasOf(extras, q, op));
  const Device dev = q.device();
  ASSIGN_OR_RETURN(const DeviceKernels* kern, KernelsFor(dev));
  const int64_t b = q.shape()[0], s = q.shape()[1], hq = q.shape()[2], hkv = k.shape()[2], d = q.shape()[3];
  AttentionForward f;
  ASSIGN_OR_RETURN(f.out, Tensor::Empty(q.shape(), qf.dtype(), dev));
  ASSIGN_OR_RETURN(f.lse, Tensor::Empty({b, hq, s}, DType::kF32, dev));
  RETURN_IF_ERROR(kern->FlashAttention(dev.index, Elem(qf.dtype()), qf.raw_data(), kf.raw_data(), vf.raw_data(),
                                       f.out.raw_data(), F(f.lse), b, s, hq, hkv, d, scale, causal, added,
                                       layout));
  return f;
}

absl::StatusOr<AttentionGrads> FusedAttentionBackward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                                      const Tensor& v, const AttentionForward& forward, float scale,
                                                      bool causal, const AttentionExtras& extras,
                                                      const AttentionGradPlaces& places_in) {
  AttentionGradPlaces places = places_in;  // views: copies share the elements
  const char* op = "fused_attention_backward";
  Tensor qf, kf, vf;
  kernels::AttentionLayout layout;
  RETURN_IF_ERROR(AttentionOperands(q, k, v, op, qf, kf, vf, layout));
  ASSIGN_OR_RETURN(kernels::AttentionBias added, ExtrasOf(extras, q, op));
  const int64_t b = q.shape()[0], s = q.shape()[1], hq = q.shape()[2], hkv = k.shape()[2], d = q.shape()[3];
  if (dout.shape() != q.shape() || forward.out.shape() != q.shape() || forward.lse.shape() != Shape{b, hq, s} ||
      forward.out.dtype() != qf.dtype() || forward.lse.dtype() != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": dout ", ShapeToString(dout.shape()), " and the forward's out ",
                                                   ShapeToString(forward.out.shape()), " must be ",
                                                   DTypeName(qf.dtype()), ShapeToString(q.shape()), ", its lse f32 [",
                                                   b, ", ", hq, ", ", s, "]"));
  }
  const Device dev = q.device();
  ASSIGN_OR_RETURN(const DeviceKernels* kern, Kernels(op, dev, {&dout, &forward.out, &forward.lse}));
  const DType type = qf.dtype();
  ASSIGN_OR_RETURN(Tensor dof, AsFloat(dout, type, op));
  ASSIGN_OR_RETURN(const Tensor out, forward.out.TryContiguous());
  ASSIGN_OR_RETURN(const Tensor lse, forward.lse.TryContiguous());
  AttentionGrads g;
  ASSIGN_OR_RETURN(Tensor delta, Tensor::Empty({b, hq, s}, DType::kF32, dev));
  // The gradients' places: the caller's (laid out as it chose: the kernels
  // read q, k and v, and write dq, dk and dv, each in its own layout), or
  // new contiguous tensors.
  const bool placed = places.dq.has_value() || places.dk.has_value() || places.dv.has_value();
  bool in_place = false;  // the kernels write into the places
  if (placed) {
    if (!places.dq.has_value() || !places.dk.has_value() || !places.dv.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(op, ": places for all of dq, dk and dv or for none"));
    }
    ASSIGN_OR_RETURN(const std::optional<kernels::HeadRows> dq_rows,
                     PlaceRows(*places.dq, q.shape(), type, dev, "dq", op));
    ASSIGN_OR_RETURN(const std::optional<kernels::HeadRows> dk_rows,
                     PlaceRows(*places.dk, k.shape(), type, dev, "dk", op));
    ASSIGN_OR_RETURN(const std::optional<kernels::HeadRows> dv_rows,
                     PlaceRows(*places.dv, v.shape(), type, dev, "dv", op));
    in_place = dq_rows.has_value() && dk_rows.has_value() && dv_rows.has_value() &&
               dk_rows->token == dv_rows->token && dk_rows->head == dv_rows->head;
    // The two-kernel backward writes dq before the second kernel reads q:
    // a place in the storage of what the kernels read takes a copy after.
    for (const Tensor* read : std::initializer_list<const Tensor*>{&qf, &kf, &vf, &dout, &forward.out}) {
      for (const std::optional<Tensor>* place : {&places.dq, &places.dk, &places.dv}) {
        if ((*place)->SharesStorageWith(*read)) in_place = false;
      }
    }
    if (in_place) {
      layout.dq = *dq_rows;
      layout.dkv = *dk_rows;
      g.dq = *places.dq;
      g.dk = *places.dk;
      g.dv = *places.dv;
    }
  }
  if (!in_place) {
    ASSIGN_OR_RETURN(g.dq, Tensor::Empty(q.shape(), type, dev));
    ASSIGN_OR_RETURN(g.dk, Tensor::Empty(k.shape(), type, dev));
    ASSIGN_OR_RETURN(g.dv, Tensor::Empty(v.shape(), type, dev));
  }
  std::optional<Tensor> dscores;  // [B, Hq, S, S]: each batch element's, 0 where masked
  if (extras.bias.has_value()) {
    ASSIGN_OR_RETURN(dscores, Tensor::Zeros({b, hq, s, s}, DType::kF32, dev));
    added.dbias = F(*dscores);
  }
  RETURN_IF_ERROR(kern->FlashAttentionBackward(dev.index, Elem(type), qf.raw_data(), kf.raw_data(), vf.raw_data(),
                                               out.raw_data(), dof.raw_data(), F(lse), F(delta), g.dq.raw_data(),
                                               g.dk.raw_data(), g.dv.raw_data(), b, s, hq, hkv, d, scale, causal,
                                               added, layout));
  if (placed && !in_place) {  // copied into places the kernels cannot write
    RETURN_IF_ERROR(places.dq->CopyFrom(g.dq));
    RETURN_IF_ERROR(places.dk->CopyFrom(g.dk));
    RETURN_IF_ERROR(places.dv->CopyFrom(g.dv));
    g.dq = *places.dq;
    g.dk = *places.dk;
    g.dv = *places.dv;
  }
  if (dscores.has_value()) {
    // The bias is shared by the batch: its gradient sums the batch's, in
    // batch order (the column reduction over [B, Hq S S]).
    ASSIGN_OR_RETURN(Tensor rows, dscores->Reshape({b, hq * s * s}));
    ASSIGN_OR_RETURN(Tensor sum, BiasGrad(rows));
    ASSIGN_OR_RETURN(g.dbias, sum.Reshape({hq, s, s}));
  }
  return g;
}

absl::Status AdamW(const std::vector<AdamWParam>& params, int64_t step, const AdamWOptions& o) {
  if (step < 1) return absl::InvalidArgumentError("adamw: step counts from 1");
  if (params.empty()) return absl::OkStatus();
  const Device dev = params[0].master.device();
  std::vector<kernels::AdamWTensor> list;
  for (const AdamWParam& p : params) {
    const Shape& shape = p.master.shape();
    for (const Tensor* t : {&p.master, &p.m, &p.v}) {
      if (t->dtype() != DType::kF32 || t->shape() != shape || !t->is_contiguous()) {
        return absl::InvalidArgumentError(absl::StrCat("adamw: master, m and v must be contiguous f32 of shape ",
                                                       ShapeToString(shape)));
      }
    }
    const bool held = p.held.has_value();
    for (const Tensor* t : {&p.grad, held ? &*p.held : &p.grad}) {
      if (!IsFloat(t->dtype()) || t->shape() != shape || !t->is_contiguous()) {
        return absl::InvalidArgumentError(absl::StrCat("adamw: the gradient and held weights must be contiguous ",
                                                       "float tensors of shape ", ShapeToString(shape)));
      }
    }
    RETURN_IF_ERROR(SameDevice("adamw", dev, {&p.master, &p.grad, &p.m, &p.v, held ? &*p.held : &p.grad}));
    kernels::AdamWTensor t;
    t.master = const_cast<Tensor&>(p.master).data<float>();
    t.param = held ? const_cast<Tensor&>(*p.held).raw_data() : nullptr;
    t.grad = p.grad.raw_data();
    t.m = const_cast<Tensor&>(p.m).data<float>();
    t.v = const_cast<Tensor&>(p.v).data<float>();
    t.n = p.master.numel();
    t.param_type = held ? Elem(p.held->dtype()) : kernels::ElemType::kF32;
    t.grad_type = Elem(p.grad.dtype());
    list.push_back(t);
  }
  kernels::AdamWHyper h;
  h.lr = o.lr;
  h.beta1 = o.beta1;
  h.beta2 = o.beta2;
  h.eps = o.eps;
  h.weight_decay = o.weight_decay;
  h.bias_correction1 = 1.0f - std::pow(o.beta1, static_cast<float>(step));
  h.bias_correction2 = 1.0f - std::pow(o.beta2, static_cast<float>(step));
  h.grad_scale = o.grad_scale;
  if (o.grad_scale_at.has_value()) {
    const Tensor& at = *o.grad_scale_at;
    if (at.dtype() != DType::kF32 || at.numel() != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("adamw: grad_scale_at must be one f32, got ", DTypeName(at.dtype()), ShapeToString(at.shape())));
    }
    RETURN_IF_ERROR(SameDevice("adamw", dev, {&at}));
    h.grad_scale_at = static_cast<const float*>(at.raw_data());
  }
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(dev));
  return k->AdamW(dev.index, list, h);
}

absl::StatusOr<Tensor> GradNormClip(const Tensor& squares, double max_norm, double loss_scale) {
  if (!(loss_scale >= 1) || !std::isfinite(loss_scale)) {
    return absl::InvalidArgumentError(
        absl::StrCat("grad norm: the loss scale ", loss_scale, " is not finite and >= 1"));
  }
  if (squares.dtype() != DType::kF32 || squares.dim() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("grad norm: the squares must be f32 [n], got ",
                                                   DTypeName(squares.dtype()), ShapeToString(squares.shape())));
  }
  ASSIGN_OR_RETURN(const Tensor in, squares.TryContiguous());
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty({2}, DType::kF32, in.device()));
  ASSIGN_OR_RETURN(const DeviceKernels* k, KernelsFor(in.device()));
  RETURN_IF_ERROR(
      k->GradNormClip(in.device().index, in.data<float>(), in.numel(), max_norm, loss_scale, out.data<float>()));
  return out;
}

}  // namespace colod::ops
