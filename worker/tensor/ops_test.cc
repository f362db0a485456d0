// The CPU kernels against independent references in double precision:
// naive GEMM loops, the closed forms of GELU and LayerNorm, and central
// differences of the double forward for every backward.
#include "worker/tensor/ops.h"

#include <cmath>
#include <functional>
#include <string>

#include "gtest/gtest.h"
#include "kernels/cpu/layer_ops.h"
#include "kernels/philox.h"

namespace colod::ops {
namespace {

Tensor Random(const Shape& shape, uint64_t seed, float scale = 1.0f) {
  return *Scale(*Tensor::RandomNormal(shape, seed), scale);
}

void ExpectNear(const std::vector<float>& got, const std::vector<double>& want, double rtol, double atol,
                const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], atol + rtol * std::fabs(want[i])) << what << " at " << i;
  }
}

std::vector<double> RefMatMul(const Tensor& a, const Tensor& b, int64_t m, int64_t k, int64_t n, bool ta, bool tb) {
  const std::vector<float> x = a.ToFloats(), y = b.ToFloats();
  std::vector<double> out(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (int64_t p = 0; p < k; ++p) {
        const double av = ta ? x[p * m + i] : x[i * k + p];
        const double bv = tb ? y[j * k + p] : y[p * n + j];
        s += av * bv;
      }
      out[i * n + j] = s;
    }
  }
  return out;
}

TEST(CpuKernels, MatMulMatchesNaiveLoopsForEveryTransposition) {
  const int64_t m = 37, k = 53, n = 29;  // odd sizes
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      const Tensor a = Random(ta ? Shape{k, m} : Shape{m, k}, 1);
      const Tensor b = Random(tb ? Shape{n, k} : Shape{k, n}, 2);
      auto c = MatMul(a, b, ta, tb);
      ASSERT_TRUE(c.ok()) << c.status();
      EXPECT_EQ(c->shape(), (Shape{m, n}));
      ExpectNear(c->ToFloats(), RefMatMul(a, b, m, k, n, ta, tb), 1e-5, 1e-5, "matmul");
    }
  }
}

TEST(CpuKernels, MatMulKeepsLeadingDimsAndTakesViewsAndHalfTypes) {
  const Tensor a = Random({3, 5, 8}, 3), b = Random({8, 6}, 4);
  auto c = MatMul(a, b);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->shape(), (Shape{3, 5, 6}));
  ExpectNear(c->ToFloats(), RefMatMul(a, b, 15, 8, 6, false, false), 1e-5, 1e-5, "batched rows");
  // A transposed view is the same as the transposed flag.
  const Tensor bt = *Random({6, 8}, 5).Transpose(0, 1);
  ExpectNear(MatMul(a, bt)->ToFloats(), RefMatMul(a, bt.Contiguous(), 15, 8, 6, false, false), 1e-5, 1e-5, "view");
  // bf16 inputs, f32 accumulation, one rounding at the end.
  const Tensor ah = *a.ToDType(DType::kBF16), bh = *b.ToDType(DType::kBF16);
  auto ch = MatMul(ah, bh);
  ASSERT_TRUE(ch.ok());
  EXPECT_EQ(ch->dtype(), DType::kBF16);
  ExpectNear(ch->ToFloats(), RefMatMul(ah, bh, 15, 8, 6, false, false), 8e-3, 1e-3, "bf16");
  auto bad = MatMul(a, Random({7, 6}, 6));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("inner dims 8 and 7"), absl::string_view::npos) << bad.status();
}

TEST(CpuKernels, ThreadedLoopsGiveTheSameBitsAsOneThread) {
  const Tensor x = Random({1 << 9, 1 << 9}, 40), dy = Random({1 << 9, 1 << 9}, 41), b = Random({1 << 9}, 42);
  kernels::cpu::SetBlasThreads(1);
  const std::string g1 = Gelu(x, GeluApprox::kTanh)->ToBytes(), d1 = GeluBackward(dy, x, GeluApprox::kNone)->ToBytes(),
                    b1 = BiasAdd(x, b)->ToBytes();
  kernels::cpu::SetBlasThreads(3);
  EXPECT_EQ(Gelu(x, GeluApprox::kTanh)->ToBytes(), g1);
  EXPECT_EQ(GeluBackward(dy, x, GeluApprox::kNone)->ToBytes(), d1);
  EXPECT_EQ(BiasAdd(x, b)->ToBytes(), b1);
  kernels::cpu::SetBlasThreads(1);
}

TEST(CpuKernels, BiasAddAndItsGradient) {
  const Tensor x = Random({4, 3, 7}, 7), b = Random({7}, 8);
  const std::vector<float> xv = x.ToFloats(), bv = b.ToFloats();
  std::vector<double> want(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) want[i] = static_cast<double>(xv[i]) + bv[i % 7];
  ExpectNear(BiasAdd(x, b)->ToFloats(), want, 0, 1e-6, "bias_add");
  std::vector<double> g(7, 0.0);
  for (size_t i = 0; i < xv.size(); ++i) g[i % 7] += xv[i];
  ExpectNear(BiasGrad(x)->ToFloats(), g, 1e-6, 1e-6, "bias_grad");
  EXPECT_EQ(BiasAdd(x, Random({6}, 9)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuKernels, BiasAddInPlaceWritesTheSumOverItsInput) {
  for (DType dtype : {DType::kF32, DType::kBF16}) {
    const Tensor x = *Random({4, 3, 7}, 7).ToDType(dtype), b = Random({7}, 8);
    Tensor y = x.Clone();
    const void* buffer = y.raw_data();
    ASSERT_TRUE(BiasAddInPlace(y, b).ok());
    EXPECT_EQ(y.raw_data(), buffer);
    EXPECT_EQ(y.dtype(), dtype);
    EXPECT_EQ(y.ToBytes(), BiasAdd(x, b)->ToBytes()) << DTypeName(dtype) << ": the same bits as BiasAdd";
  }
  Tensor x = Random({4, 7}, 7);
  EXPECT_EQ(BiasAddInPlace(x, Random({6}, 9)).code(), absl::StatusCode::kInvalidArgument) << "the bias's size";
  Tensor view = *x.Narrow(1, 0, 6);  // rows of 6 with a stride of 7
  const std::vector<float> before = x.ToFloats();
  EXPECT_EQ(BiasAddInPlace(view, Random({6}, 9)).code(), absl::StatusCode::kInvalidArgument) << "a strided view";
  EXPECT_EQ(x.ToFloats(), before) << "a refused call writes nothing";
  Tensor ids = *Tensor::Zeros({4, 7}, DType::kI32, x.device());
  EXPECT_EQ(BiasAddInPlace(ids, Random({7}, 9)).code(), absl::StatusCode::kInvalidArgument) << "integers";
}

double GeluRef(double v, GeluApprox a) {
  if (a == GeluApprox::kTanh) return 0.5 * v * (1 + std::tanh(std::sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
  return 0.5 * v * (1 + std::erf(v / std::sqrt(2.0)));
}

TEST(CpuKernels, GeluForwardAndBackwardBothApproximations) {
  const Tensor x = Random({5, 41}, 10, 2.0f), dy = Random({5, 41}, 11);
  const std::vector<float> xv = x.ToFloats(), dv = dy.ToFloats();
  for (GeluApprox a : {GeluApprox::kNone, GeluApprox::kTanh}) {
    std::vector<double> y(xv.size()), dx(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) {
      y[i] = GeluRef(xv[i], a);
      const double h = 1e-5;
      dx[i] = dv[i] * (GeluRef(xv[i] + h, a) - GeluRef(xv[i] - h, a)) / (2 * h);
    }
    ExpectNear(Gelu(x, a)->ToFloats(), y, 1e-5, 1e-6, "gelu");
    ExpectNear(GeluBackward(dy, x, a)->ToFloats(), dx, 1e-4, 1e-5, "gelu backward");
  }
}

// GELU fused with the bias before it: the closed form at x + b, the slope by
// central differences, and the bias gradient the column sums of dx. Also the
// same bits as the unfused ops in f32 (x + b rounds the same either way) and
// clear errors for a bias that does not fit.
TEST(CpuKernels, BiasGeluIsGeluOfTheSumAndGivesTheBiasGradient) {
  const Tensor x = Random({3, 5, 37}, 12, 2.0f), b = Random({37}, 13), dy = Random({3, 5, 37}, 14);
  const std::vector<float> xv = x.ToFloats(), bv = b.ToFloats(), dv = dy.ToFloats();
  for (GeluApprox a : {GeluApprox::kNone, GeluApprox::kTanh}) {
    std::vector<double> y(xv.size()), dx(xv.size()), db(37, 0.0);
    for (size_t i = 0; i < xv.size(); ++i) {
      const double v = static_cast<double>(xv[i]) + bv[i % 37], h = 1e-5;
      y[i] = GeluRef(v, a);
      dx[i] = dv[i] * (GeluRef(v + h, a) - GeluRef(v - h, a)) / (2 * h);
      db[i % 37] += dx[i];
    }
    auto fused = BiasGelu(x, b, a);
    ASSERT_TRUE(fused.ok()) << fused.status();
    EXPECT_EQ(fused->shape(), x.shape());
    ExpectNear(fused->ToFloats(), y, 1e-5, 1e-6, "bias_gelu");
    auto g = BiasGeluBackward(dy, x, b, a);
    ASSERT_TRUE(g.ok()) << g.status();
    ExpectNear(g->dx.ToFloats(), dx, 1e-4, 1e-5, "bias_gelu dx");
    ExpectNear(g->db.ToFloats(), db, 1e-4, 1e-4, "bias_gelu db");
    const Tensor sum = *BiasAdd(x, b);
    EXPECT_EQ(fused->ToBytes(), Gelu(sum, a)->ToBytes());
    EXPECT_EQ(g->dx.ToBytes(), GeluBackward(dy, sum, a)->ToBytes());
  }
  EXPECT_EQ(BiasGelu(x, Random({36}, 15), GeluApprox::kNone).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BiasGeluBackward(Random({3, 5, 36}, 16), x, b, GeluApprox::kNone).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Empty rows: an empty output and a zero bias gradient.
  auto empty = BiasGeluBackward(Random({0, 37}, 17), Random({0, 37}, 18), b, GeluApprox::kNone);
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->db.ToFloats(), std::vector<float>(37, 0.0f));
}

TEST(CpuKernels, SiluForwardAndBackwardAgainstTheClosedForm) {
  const Tensor x = Random({3, 29}, 16, 4.0f), dy = Random({3, 29}, 17);
  const std::vector<float> xv = x.ToFloats(), dv = dy.ToFloats();
  auto silu = [](double v) { return v / (1 + std::exp(-v)); };
  std::vector<double> y(xv.size()), dx(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) {
    y[i] = silu(xv[i]);
    const double h = 1e-5;
    dx[i] = dv[i] * (silu(xv[i] + h) - silu(xv[i] - h)) / (2 * h);
  }
  ExpectNear(Activation(x, ActivationKind::kSilu)->ToFloats(), y, 1e-5, 1e-6, "silu");
  ExpectNear(ActivationBackward(dy, x, ActivationKind::kSilu)->ToFloats(), dx, 1e-4, 1e-5, "silu backward");
  EXPECT_EQ(ActivationBackward(Random({3, 28}, 1), x, ActivationKind::kSilu).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CpuKernels, ReluForwardAndBackwardAgainstTheDefinition) {
  // Exact zeros among the values: torch's derivative there is 0.
  std::vector<float> xv = Random({4, 25}, 18, 3.0f).ToFloats();
  for (size_t i = 0; i < xv.size(); i += 7) xv[i] = 0.0f;
  const Tensor x = *Tensor::FromFloats({4, 25}, xv), dy = Random({4, 25}, 19);
  const std::vector<float> dv = dy.ToFloats();
  std::vector<double> y(xv.size()), dx(xv.size());
  for (size_t i = 0; i < xv.size(); ++i) {
    y[i] = xv[i] > 0 ? xv[i] : 0.0;
    dx[i] = xv[i] > 0 ? dv[i] : 0.0;
  }
  ExpectNear(Activation(x, ActivationKind::kRelu)->ToFloats(), y, 0, 0, "relu");
  ExpectNear(ActivationBackward(dy, x, ActivationKind::kRelu)->ToFloats(), dx, 0, 0, "relu backward");
}

// LayerNorm of one row in double.
std::vector<double> LayerNormRow(const std::vector<double>& x, const std::vector<double>& g,
                                 const std::vector<double>& b, double eps) {
  const size_t n = x.size();
  double mu = 0, var = 0;
  for (double v : x) mu += v;
  mu /= n;
  for (double v : x) var += (v - mu) * (v - mu);
  var /= n;
  std::vector<double> y(n);
  for (size_t j = 0; j < n; ++j) y[j] = (x[j] - mu) / std::sqrt(var + eps) * g[j] + b[j];
  return y;
}

TEST(CpuKernels, LayerNormForwardAndBackwardAgainstFiniteDifferences) {
  const int64_t rows = 6, n = 19;
  const double eps = 1e-5;
  const Tensor x = Random({2, 3, n}, 12, 3.0f), g = Random({n}, 13), b = Random({n}, 14), dy = Random({2, 3, n}, 15);
  auto out = LayerNorm(x, g, b, static_cast<float>(eps));
  ASSERT_TRUE(out.ok()) << out.status();
  const std::vector<float> xv = x.ToFloats(), dv = dy.ToFloats(), gv = g.ToFloats(), bv = b.ToFloats();
  const std::vector<double> gd(gv.begin(), gv.end()), bd(bv.begin(), bv.end());
  std::vector<double> want_y, want_dx(rows * n), want_dg(n, 0.0), want_db(n, 0.0);
  const double h = 1e-6;
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<double> row(xv.begin() + r * n, xv.begin() + (r + 1) * n);
    const std::vector<double> y = LayerNormRow(row, gd, bd, eps);
    want_y.insert(want_y.end(), y.begin(), y.end());
    // L = sum_j dy_j * y_j; dL/dx_i, dL/dgamma_i, dL/dbeta_i by central differences.
    auto loss = [&](const std::vector<double>& xr, const std::vector<double>& gr, const std::vector<double>& br) {
      const std::vector<double> yr = LayerNormRow(xr, gr, br, eps);
      double l = 0;
      for (int64_t j = 0; j < n; ++j) l += dv[r * n + j] * yr[j];
      return l;
    };
    for (int64_t i = 0; i < n; ++i) {
      std::vector<double> up = row, down = row;
      up[i] += h;
      down[i] -= h;
      want_dx[r * n + i] = (loss(up, gd, bd) - loss(down, gd, bd)) / (2 * h);
      std::vector<double> gu = gd, gdn = gd;
      gu[i] += h;
      gdn[i] -= h;
      want_dg[i] += (loss(row, gu, bd) - loss(row, gdn, bd)) / (2 * h);
      want_db[i] += dv[r * n + i];
    }
  }
  ExpectNear(out->y.ToFloats(), want_y, 1e-5, 1e-5, "layer_norm");
  auto grads = LayerNormBackward(dy, x, g, out->mean, out->rstd);
  ASSERT_TRUE(grads.ok()) << grads.status();
  ExpectNear(grads->dx.ToFloats(), want_dx, 1e-4, 1e-4, "dx");
  ExpectNear(grads->dgamma.ToFloats(), want_dg, 1e-4, 1e-4, "dgamma");
  ExpectNear(grads->dbeta.ToFloats(), want_db, 1e-5, 1e-5, "dbeta");
  EXPECT_EQ(LayerNorm(x, Random({n + 1}, 1), b, 1e-5f).status().code(), absl::StatusCode::kInvalidArgument);
}

// Central differences of a scalar function of a float vector, in double.
std::vector<double> NumericGrad(const std::vector<float>& x0, const std::function<double(const std::vector<double>&)>& f,
                                double h = 1e-6) {
  std::vector<double> x(x0.begin(), x0.end()), g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = f(x);
    x[i] = keep - h;
    const double down = f(x);
    x[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

// A norm given a residual is Add then the norm, bit for bit, in f32 and in
// bf16 (the sum is rounded before it is normalized, as the add's output is);
// the sum comes back too. A residual that does not match is an error.
TEST(CpuKernels, NormsOfAResidualStreamAreAddThenNorm) {
  for (DType t : {DType::kF32, DType::kBF16}) {
    const Tensor x = *Random({4, 3, 50}, 60).ToDType(t), r = *Random({4, 3, 50}, 61).ToDType(t);
    const Tensor g = *Random({50}, 62).ToDType(t), b = *Random({50}, 63).ToDType(t);
    const Tensor sum = *Add(x, r);
    auto ln = LayerNorm(x, g, b, 1e-5f, &r);
    ASSERT_TRUE(ln.ok()) << ln.status();
    const LayerNormResult want = *LayerNorm(sum, g, b, 1e-5f);
    EXPECT_EQ(ln->sum.ToBytes(), sum.ToBytes()) << DTypeName(t);
    EXPECT_EQ(ln->y.ToBytes(), want.y.ToBytes()) << DTypeName(t);
    EXPECT_EQ(ln->mean.ToBytes(), want.mean.ToBytes()) << DTypeName(t);
    EXPECT_EQ(ln->rstd.ToBytes(), want.rstd.ToBytes()) << DTypeName(t);
    auto rn = RmsNorm(x, g, 1e-6f, &r);
    ASSERT_TRUE(rn.ok()) << rn.status();
    const RmsNormResult rwant = *RmsNorm(sum, g, 1e-6f);
    EXPECT_EQ(rn->sum.ToBytes(), sum.ToBytes()) << DTypeName(t);
    EXPECT_EQ(rn->y.ToBytes(), rwant.y.ToBytes()) << DTypeName(t);
    EXPECT_EQ(rn->rstd.ToBytes(), rwant.rstd.ToBytes()) << DTypeName(t);
    const Tensor bad = *Random({4, 3, 49}, 64).ToDType(t);
    EXPECT_EQ(LayerNorm(x, g, b, 1e-5f, &bad).status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(RmsNorm(x, g, 1e-6f, &bad).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

// A norm backward given the gradient its input already has (a residual
// stream's, from the skip connection) folds it into dx with the bits of Add
// after the unfolded backward (dx rounded to the dtype, then the add rounded
// once); the parameter gradients are the unfolded ones. A gradient of
// another dtype or shape is refused (FoldsInto says no: Backward adds).
TEST(CpuKernels, NormBackwardsFoldTheResidualGradientWithTheAddsBits) {
  for (DType t : {DType::kF32, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(t));
    auto in = [t](const Shape& shape, uint64_t seed) { return *Random(shape, seed).ToDType(t); };
    const Tensor x = in({4, 3, 50}, 70), dy = in({4, 3, 50}, 71), acc = in({4, 3, 50}, 72);
    const Tensor g = in({50}, 73), b = in({50}, 74);
    ASSERT_TRUE(FoldsInto(x, acc));
    const LayerNormResult ln = *LayerNorm(x, g, b, 1e-5f);
    const LayerNormGrads plain = *LayerNormBackward(dy, x, g, ln.mean, ln.rstd);
    auto folded = LayerNormBackward(dy, x, g, ln.mean, ln.rstd, &acc);
    ASSERT_TRUE(folded.ok()) << folded.status();
    EXPECT_EQ(folded->dx.ToBytes(), Add(acc, plain.dx)->ToBytes());
    EXPECT_EQ(folded->dgamma.ToBytes(), plain.dgamma.ToBytes());
    EXPECT_EQ(folded->dbeta.ToBytes(), plain.dbeta.ToBytes());
    const RmsNormResult rn = *RmsNorm(x, g, 1e-6f);
    const RmsNormGrads rplain = *RmsNormBackward(dy, x, g, rn.rstd);
    auto rfolded = RmsNormBackward(dy, x, g, rn.rstd, &acc);
    ASSERT_TRUE(rfolded.ok()) << rfolded.status();
    EXPECT_EQ(rfolded->dx.ToBytes(), Add(acc, rplain.dx)->ToBytes());
    EXPECT_EQ(rfolded->dgamma.ToBytes(), rplain.dgamma.ToBytes());
    const Tensor other = *acc.ToDType(t == DType::kF32 ? DType::kBF16 : DType::kF32);
    const Tensor narrow = in({4, 3, 49}, 75);
    const Tensor strided = *in({3, 4, 50}, 76).Transpose(0, 1);
    for (const Tensor* bad : {&other, &narrow, &strided}) {
      EXPECT_FALSE(FoldsInto(x, *bad));
      EXPECT_EQ(LayerNormBackward(dy, x, g, ln.mean, ln.rstd, bad).status().code(),
                absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(RmsNormBackward(dy, x, g, rn.rstd, bad).status().code(), absl::StatusCode::kInvalidArgument);
    }
  }
}

TEST(CpuKernels, RmsNormForwardAndBackward) {
  const int64_t n = 13;
  const Tensor x = Random({4, n}, 20, 2.0f), g = Random({n}, 21), dy = Random({4, n}, 22);
  const double eps = 1e-6;
  auto fwd = [&](const std::vector<double>& xv, const std::vector<double>& gv) {
    std::vector<double> y(xv.size());
    for (int64_t r = 0; r < 4; ++r) {
      double ss = 0;
      for (int64_t j = 0; j < n; ++j) ss += xv[r * n + j] * xv[r * n + j];
      const double rs = 1 / std::sqrt(ss / n + eps);
      for (int64_t j = 0; j < n; ++j) y[r * n + j] = xv[r * n + j] * rs * gv[j];
    }
    return y;
  };
  const std::vector<float> xv = x.ToFloats(), gv = g.ToFloats(), dv = dy.ToFloats();
  const std::vector<double> gd(gv.begin(), gv.end()), xd(xv.begin(), xv.end());
  auto out = RmsNorm(x, g, static_cast<float>(eps));
  ASSERT_TRUE(out.ok());
  ExpectNear(out->y.ToFloats(), fwd(xd, gd), 1e-5, 1e-6, "rms_norm");
  auto loss_x = [&](const std::vector<double>& v) {
    const auto y = fwd(v, gd);
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += dv[i] * y[i];
    return l;
  };
  auto loss_g = [&](const std::vector<double>& v) {
    const auto y = fwd(xd, v);
    double l = 0;
    for (size_t i = 0; i < y.size(); ++i) l += dv[i] * y[i];
    return l;
  };
  auto grads = RmsNormBackward(dy, x, g, out->rstd);
  ASSERT_TRUE(grads.ok());
  ExpectNear(grads->dx.ToFloats(), NumericGrad(xv, loss_x), 1e-4, 1e-4, "dx");
  ExpectNear(grads->dgamma.ToFloats(), NumericGrad(gv, loss_g), 1e-4, 1e-4, "dgamma");
}

TEST(CpuKernels, CausalSoftmaxMasksTheFutureAndDifferentiates) {
  // [2 heads, 3 queries, 5 keys]: a cached prefix of 2 keys.
  const Tensor x = Random({2, 3, 5}, 23, 3.0f), dy = Random({2, 3, 5}, 24);
  const std::vector<float> xv = x.ToFloats(), dv = dy.ToFloats();
  auto fwd = [&](const std::vector<double>& v) {
    std::vector<double> y(v.size(), 0.0);
    for (int64_t r = 0; r < 6; ++r) {
      const int64_t visible = (r % 3) + 2 + 1;
      double s = 0;
      for (int64_t j = 0; j < visible; ++j) s += std::exp(v[r * 5 + j]);
      for (int64_t j = 0; j < visible; ++j) y[r * 5 + j] = std::exp(v[r * 5 + j]) / s;
    }
    return y;
  };
  auto y = Softmax(x, /*causal=*/true);
  ASSERT_TRUE(y.ok()) << y.status();
  ExpectNear(y->ToFloats(), fwd(std::vector<double>(xv.begin(), xv.end())), 1e-5, 1e-7, "softmax");
  EXPECT_EQ(y->ToFloats()[4], 0.0f);  // query 0 cannot see key 4
  auto dx = SoftmaxBackward(dy, *y);
  ASSERT_TRUE(dx.ok());
  ExpectNear(dx->ToFloats(), NumericGrad(xv, [&](const std::vector<double>& v) {
               const auto p = fwd(v);
               double l = 0;
               for (size_t i = 0; i < p.size(); ++i) l += dv[i] * p[i];
               return l;
             }),
             1e-4, 1e-5, "softmax backward");
  // Plain softmax rows sum to one.
  const std::vector<float> plain = Softmax(x, false)->ToFloats();
  for (int r = 0; r < 6; ++r) {
    double s = 0;
    for (int j = 0; j < 5; ++j) s += plain[r * 5 + j];
    EXPECT_NEAR(s, 1.0, 1e-6);
  }
}

TEST(CpuKernels, DropoutMaskIsThePhiloxStreamAndBackwardReusesIt) {
  const Tensor x = Random({64, 33}, 25);
  const float p = 0.3f;
  auto y = Dropout(x, p, /*seed=*/99, /*offset=*/1000);
  ASSERT_TRUE(y.ok());
  const std::vector<float> xv = x.ToFloats(), yv = y->ToFloats();
  int64_t kept = 0;
  for (size_t i = 0; i < xv.size(); ++i) {
    const bool keep = kernels::PhiloxUniform(99, 1000 + i) >= p;
    ASSERT_EQ(yv[i], keep ? xv[i] * (1.0f / (1.0f - p)) : 0.0f) << i;
    kept += keep;
  }
  // 2112 Bernoulli(0.7) draws: within 5 standard deviations (~105) of 1478.
  EXPECT_NEAR(static_cast<double>(kept), 0.7 * xv.size(), 5 * std::sqrt(0.21 * xv.size()));
  const Tensor ones = *Tensor::FromFloats({64, 33}, std::vector<float>(64 * 33, 1.0f));
  const std::vector<float> mask = DropoutBackward(ones, p, 99, 1000)->ToFloats();
  for (size_t i = 0; i < xv.size(); ++i) ASSERT_EQ(mask[i] != 0.0f, yv[i] != 0.0f || xv[i] == 0.0f) << i;
  EXPECT_NE(Dropout(x, p, 99, 1001)->ToFloats(), yv);  // another offset, another mask
  EXPECT_EQ(Dropout(x, 1.0f, 1, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CpuKernels, EmbeddingGathersMasksAndScatterAdds) {
  const Tensor table = Random({6, 4}, 26);
  const Tensor ids = *Tensor::FromInt64s({2, 3}, {0, 5, 2, 2, 7, 3});
  EXPECT_EQ(Embedding(table, ids).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(Embedding(table, ids).status().message().find("id 7"), absl::string_view::npos);
  // As the shard holding vocabulary rows [2, 8): ids 0 and 1 are masked.
  auto y = Embedding(table, ids, /*row_offset=*/2, /*mask_out_of_range=*/true);
  ASSERT_TRUE(y.ok()) << y.status();
  EXPECT_EQ(y->shape(), (Shape{2, 3, 4}));
  const std::vector<float> t = table.ToFloats(), yv = y->ToFloats();
  const int64_t local[6] = {-1, 3, 0, 0, 5, 1};
  for (int i = 0; i < 6; ++i) {
    for (int j = 0; j < 4; ++j) EXPECT_EQ(yv[i * 4 + j], local[i] < 0 ? 0.0f : t[local[i] * 4 + j]);
  }
  const Tensor dy = Random({2, 3, 4}, 27);
  const std::vector<float> dv = dy.ToFloats(), dt = EmbeddingBackward(dy, ids, 6, 2)->ToFloats();
  std::vector<double> want(24, 0.0);
  for (int i = 0; i < 6; ++i) {
    if (local[i] >= 0) {
      for (int j = 0; j < 4; ++j) want[local[i] * 4 + j] += dv[i * 4 + j];
    }
  }
  ExpectNear(dt, want, 1e-6, 1e-6, "embedding backward");  // row 0 got two ids' gradients
}

TEST(CpuKernels, CrossEntropyWithLabelSmoothingAndIgnoredRows) {
  const int64_t n = 5, v = 11;
  const Tensor logits = Random({n, v}, 28, 2.0f);
  const Tensor labels = *Tensor::FromInt64s({n}, {3, 0, -100, 10, 7});
  const std::vector<float> lv = logits.ToFloats();
  const std::vector<float> dloss = {0.5f, -1.0f, 2.0f, 1.5f, 0.25f};
  for (float s : {0.0f, 0.1f}) {
    auto loss_of = [&](const std::vector<double>& z, int64_t r) {
      if (r == 2) return 0.0;
      const int64_t label = labels.ToInt64s()[r];
      double mx = z[r * v], sum = 0;
      for (int64_t j = 0; j < v; ++j) mx = std::max(mx, z[r * v + j]);
      for (int64_t j = 0; j < v; ++j) sum += std::exp(z[r * v + j] - mx);
      double l = 0;
      for (int64_t j = 0; j < v; ++j) {
        const double logp = z[r * v + j] - mx - std::log(sum);
        l -= (s / v + (j == label ? 1 - s : 0)) * logp;
      }
      return l;
    };
    std::vector<double> want(n);
    const std::vector<double> ld(lv.begin(), lv.end());
    for (int64_t r = 0; r < n; ++r) want[r] = loss_of(ld, r);
    auto loss = CrossEntropy(logits, labels, s);
    ASSERT_TRUE(loss.ok()) << loss.status();
    ExpectNear(loss->ToFloats(), want, 1e-5, 1e-6, "cross entropy");
    auto dl = CrossEntropyBackward(*Tensor::FromFloats({n}, dloss), logits, labels, s);
    ASSERT_TRUE(dl.ok());
    ExpectNear(dl->ToFloats(), NumericGrad(lv, [&](const std::vector<double>& z) {
                 double total = 0;
                 for (int64_t r = 0; r < n; ++r) total += dloss[r] * loss_of(z, r);
                 return total;
               }),
               1e-4, 1e-5, "cross entropy backward");
  }
  auto bad = CrossEntropy(logits, *Tensor::FromInt64s({n}, {3, 0, 1, 11, 7}));
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("label 11 at row 3"), absl::string_view::npos) << bad.status();
}

TEST(CpuKernels, RopeRotatesPairsHalfADimensionApart) {
  const int64_t b = 2, s = 3, heads = 2, d = 8;
  const float theta = 10000.0f;
  const Tensor x = Random({b, s, heads, d}, 29);
  auto y = Rope(x, theta, /*position_offset=*/5);
  ASSERT_TRUE(y.ok()) << y.status();
  const std::vector<float> xv = x.ToFloats(), yv = y->ToFloats();
  for (int64_t bi = 0; bi < b; ++bi) {
    for (int64_t t = 0; t < s; ++t) {
      for (int64_t hh = 0; hh < heads; ++hh) {
        const int64_t base = ((bi * s + t) * heads + hh) * d;
        for (int64_t i = 0; i < d / 2; ++i) {
          const double angle = (5.0 + t) * std::pow(10000.0, -2.0 * i / d);
          const double x1 = xv[base + i], x2 = xv[base + i + d / 2];
          EXPECT_NEAR(yv[base + i], x1 * std::cos(angle) - x2 * std::sin(angle), 2e-5);
          EXPECT_NEAR(yv[base + i + d / 2], x2 * std::cos(angle) + x1 * std::sin(angle), 2e-5);
        }
      }
    }
  }
  // The backward is the transpose: <Rope(x), dy> == <x, RopeBackward(dy)>.
  const Tensor dy = Random({b, s, heads, d}, 30);
  EXPECT_NEAR(SumAll(*Mul(*y, dy)), SumAll(*Mul(x, *RopeBackward(dy, theta, 5))), 1e-4);
  EXPECT_EQ(Rope(Random({2, 3, 4}, 1), theta).status().code(), absl::StatusCode::kInvalidArgument);
}

// The sharded norm's passes on a row split in two column pieces, with the
// all-reduces done by hand (adding the pieces' statistics), give the
// unsharded LayerNorm and RMSNorm: values and every gradient.
TEST(CpuKernels, NormPassesOverSplitRowsMatchTheWholeNorm) {
  const int64_t rows = 5, h = 12, half = 6;
  const Tensor x = Random({rows, h}, 51), dy = Random({rows, h}, 52), g = Random({h}, 53), b = Random({h}, 54);
  auto piece = [&](const Tensor& t, int i) { return t.Narrow(t.dim() - 1, i * half, half)->Contiguous(); };
  auto add = [](const Tensor& a, const Tensor& c) { return *Add(a, c); };
  for (bool rms : {false, true}) {
    const std::string what = rms ? "rms" : "layer";
    std::optional<Tensor> mean;
    if (!rms) {
      const Tensor sums = add(*NormRowSums(piece(x, 0), std::nullopt, false),
                              *NormRowSums(piece(x, 1), std::nullopt, false));
      mean = *Scale(sums, 1.0f / h);
    }
    const Tensor sq = add(*NormRowSums(piece(x, 0), mean, true), *NormRowSums(piece(x, 1), mean, true));
    std::optional<Tensor> b0, b1;
    if (!rms) {
      b0 = piece(b, 0);
      b1 = piece(b, 1);
    }
    const NormApplied a0 = *NormApply(piece(x, 0), piece(g, 0), b0, mean, sq, h, 1e-5f);
    const NormApplied a1 = *NormApply(piece(x, 1), piece(g, 1), b1, mean, sq, h, 1e-5f);
    const Tensor y = *Tensor::Cat({a0.y, a1.y}, 1);
    const Tensor bsum = add(*NormBackwardSums(piece(dy, 0), piece(x, 0), piece(g, 0), mean, a0.rstd),
                            *NormBackwardSums(piece(dy, 1), piece(x, 1), piece(g, 1), mean, a1.rstd));
    const Tensor dx = *Tensor::Cat({*NormBackwardApply(piece(dy, 0), piece(x, 0), piece(g, 0), mean, a0.rstd, bsum, h),
                                    *NormBackwardApply(piece(dy, 1), piece(x, 1), piece(g, 1), mean, a1.rstd, bsum, h)},
                                   1);
    const NormParamGrads p0 = *NormParamGrad(piece(dy, 0), piece(x, 0), mean, a0.rstd, !rms);
    const NormParamGrads p1 = *NormParamGrad(piece(dy, 1), piece(x, 1), mean, a1.rstd, !rms);
    const Tensor dg = *Tensor::Cat({p0.dgamma, p1.dgamma}, 0);
    auto doubles = [](const Tensor& t) {
      const std::vector<float> v = t.ToFloats();
      return std::vector<double>(v.begin(), v.end());
    };
    if (rms) {
      const RmsNormResult want = *RmsNorm(x, g, 1e-5f);
      const RmsNormGrads wg = *RmsNormBackward(dy, x, g, want.rstd);
      ExpectNear(y.ToFloats(), doubles(want.y), 1e-5, 1e-6, what + " y");
      ExpectNear(dx.ToFloats(), doubles(wg.dx), 1e-5, 1e-6, what + " dx");
      ExpectNear(dg.ToFloats(), doubles(wg.dgamma), 1e-5, 1e-6, what + " dgamma");
      EXPECT_FALSE(p0.dbeta.has_value());
    } else {
      const LayerNormResult want = *LayerNorm(x, g, b, 1e-5f);
      const LayerNormGrads wg = *LayerNormBackward(dy, x, g, want.mean, want.rstd);
      ExpectNear(y.ToFloats(), doubles(want.y), 1e-5, 1e-6, what + " y");
      ExpectNear(dx.ToFloats(), doubles(wg.dx), 1e-5, 1e-6, what + " dx");
      ExpectNear(dg.ToFloats(), doubles(wg.dgamma), 1e-5, 1e-6, what + " dgamma");
      ExpectNear(Tensor::Cat({*p0.dbeta, *p1.dbeta}, 0)->ToFloats(), doubles(wg.dbeta), 1e-5, 1e-6, what + " dbeta");
    }
  }
  // Statistics of the wrong length or dtype are refused.
  EXPECT_EQ(NormApply(x, g, b, std::nullopt, *Tensor::Zeros({rows + 1}, DType::kF32), h, 1e-5f).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NormRowSums(x, *Tensor::Zeros({rows}, DType::kBF16), true).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CpuKernels, AdamWMatchesTheDoublePrecisionUpdate) {
  // Two parameters in one step: an f32 one, and a bf16 one with f32 master
  // weights and a bf16 gradient (mixed precision); gradients scaled by 0.5
  // as they are read (clipping), and left as they are.
  const Tensor p0 = Random({7, 5}, 31), g = Random({7, 5}, 32);
  const Tensor q0 = Random({3, 4}, 33), gq = *Random({3, 4}, 34).ToDType(DType::kBF16);
  Tensor p = p0.Clone(), m = *Tensor::Zeros({7, 5}, DType::kF32), v = *Tensor::Zeros({7, 5}, DType::kF32);
  Tensor q = q0.Clone(), held = *q0.ToDType(DType::kBF16);
  Tensor qm = *Tensor::Zeros({3, 4}, DType::kF32), qv = *Tensor::Zeros({3, 4}, DType::kF32);
  AdamWOptions o;
  o.lr = 0.01f;
  o.weight_decay = 0.1f;
  o.grad_scale = 0.5f;
  struct Ref {
    std::vector<double> p, m, v, g;
  };
  auto ref = [](const Tensor& p, const Tensor& g) {
    const std::vector<float> pv = p.ToFloats(), gv = g.ToFloats();
    return Ref{std::vector<double>(pv.begin(), pv.end()), std::vector<double>(pv.size(), 0.0),
               std::vector<double>(pv.size(), 0.0), std::vector<double>(gv.begin(), gv.end())};
  };
  Ref rp = ref(p0, g), rq = ref(q0, gq);
  const std::string g_before = g.ToBytes();
  for (int step = 1; step <= 3; ++step) {
    ASSERT_TRUE(AdamW({{p, std::nullopt, g, m, v}, {q, held, gq, qm, qv}}, step, o).ok());
    for (Ref* r : {&rp, &rq}) {
      for (size_t i = 0; i < r->p.size(); ++i) {
        const double gi = 0.5 * r->g[i];
        r->p[i] -= 0.01 * 0.1 * r->p[i];
        r->m[i] = 0.9 * r->m[i] + 0.1 * gi;
        r->v[i] = 0.999 * r->v[i] + 0.001 * gi * gi;
        const double mh = r->m[i] / (1 - std::pow(0.9, step)), vh = r->v[i] / (1 - std::pow(0.999, step));
        r->p[i] -= 0.01 * mh / (std::sqrt(vh) + 1e-8);
      }
    }
  }
  ExpectNear(p.ToFloats(), rp.p, 1e-5, 1e-6, "adamw f32");
  ExpectNear(q.ToFloats(), rq.p, 1e-5, 1e-6, "adamw master");
  // The held copy is the master rounded to bf16.
  EXPECT_EQ(held.ToBytes(), q.ToDType(DType::kBF16)->ToBytes());
  EXPECT_EQ(g.ToBytes(), g_before) << "the step changed a gradient";
  Tensor wrong = *Tensor::Zeros({5, 7}, DType::kF32);
  EXPECT_EQ(AdamW({{p, std::nullopt, g, wrong, v}}, 4, o).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AdamW({{q, held, *Tensor::Zeros({3, 5}, DType::kBF16), qm, qv}}, 4, o).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(AdamW({{p, std::nullopt, g, m, v}}, 0, o).code(), absl::StatusCode::kInvalidArgument);
  // The factor read from a tensor (the trainer's, computed where the
  // gradients are) instead of grad_scale: the same bits as grad_scale.
  Tensor p2 = p.Clone(), m2 = m.Clone(), v2 = v.Clone();
  ASSERT_TRUE(AdamW({{p, std::nullopt, g, m, v}}, 4, o).ok());
  AdamWOptions at = o;
  at.grad_scale = 3.0f;  // not read
  at.grad_scale_at = *Tensor::FromFloats({1}, {0.5f});
  ASSERT_TRUE(AdamW({{p2, std::nullopt, g, m2, v2}}, 4, at).ok());
  EXPECT_EQ(p2.ToBytes(), p.ToBytes());
  EXPECT_EQ(v2.ToBytes(), v.ToBytes());
  at.grad_scale_at = *Tensor::FromFloats({2}, {0.5f, 0.5f});
  EXPECT_EQ(AdamW({{p2, std::nullopt, g, m2, v2}}, 5, at).code(), absl::StatusCode::kInvalidArgument);
}

// MatMulF32Into: bf16 products written, then added, into f32, against the
// double-precision sums of the widened operands (a bf16 GEMM's output would
// be rounded to bf16, 2^-8 relative: the tolerance here is f32's).
TEST(CpuKernels, MatMulF32IntoWritesThenAccumulatesInF32) {
  const int64_t m = 7, n = 5, k = 9;
  const Tensor a0 = *Random({k, m}, 71).ToDType(DType::kBF16), b0 = *Random({k, n}, 72).ToDType(DType::kBF16);
  const Tensor a1 = *Random({k, m}, 73).ToDType(DType::kBF16), b1 = *Random({k, n}, 74).ToDType(DType::kBF16);
  Tensor c = *Tensor::FromFloats({m, n}, std::vector<float>(m * n, 1e9f));  // overwritten, not added to
  ASSERT_TRUE(MatMulF32Into(a0, b0, true, false, c, /*accumulate=*/false).ok());
  ASSERT_TRUE(MatMulF32Into(a1, b1, true, false, c, /*accumulate=*/true).ok());
  const std::vector<float> av0 = a0.ToFloats(), bv0 = b0.ToFloats(), av1 = a1.ToFloats(), bv1 = b1.ToFloats();
  std::vector<double> want(m * n, 0.0);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      for (int64_t p = 0; p < k; ++p) {
        want[i * n + j] += double{av0[p * m + i]} * bv0[p * n + j] + double{av1[p * m + i]} * bv1[p * n + j];
      }
    }
  }
  ExpectNear(c.ToFloats(), want, 1e-5, 1e-5, "matmul into f32");
  EXPECT_EQ(c.dtype(), DType::kF32);
  Tensor wrong = *Tensor::Zeros({m, n + 1}, DType::kF32);
  EXPECT_EQ(MatMulF32Into(a0, b0, true, false, wrong, false).code(), absl::StatusCode::kInvalidArgument);
  Tensor half = *Tensor::Zeros({m, n}, DType::kBF16);
  EXPECT_EQ(MatMulF32Into(a0, b0, true, false, half, false).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MatMulF32Into(a0, *b0.ToDType(DType::kF32), true, false, c, false).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MatMulF32Into(a0, b0, false, false, c, false).code(), absl::StatusCode::kInvalidArgument);
}

// GradNormClip against its closed form: the norm of the squares added in
// double, and torch's clip_grad_norm_ factor.
TEST(CpuKernels, GradNormClipIsTheNormAndTorchsFactor) {
  const std::vector<float> sq = {2.5f, 1e-7f, 6.25f, 3.0f};
  double sum = 0;
  for (float v : sq) sum += v;
  const double norm = std::sqrt(sum);  // 3.4278...
  const Tensor squares = *Tensor::FromFloats({4}, sq);
  for (double max_norm : {0.0, -1.0, 100.0, norm, 1.0}) {
    const absl::StatusOr<Tensor> out = GradNormClip(squares, max_norm);
    ASSERT_TRUE(out.ok()) << out.status();
    const std::vector<float> got = out->ToFloats();
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0], static_cast<float>(norm));
    const double want = max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
    EXPECT_EQ(got[1], static_cast<float>(want)) << "max_norm " << max_norm;
  }
  EXPECT_NEAR(GradNormClip(squares, 1.0)->ToFloats()[1], 1.0 / 3.4278273, 1e-6);
  // A NaN among the squares gives a NaN norm and factor, as torch's does.
  const std::vector<float> nan = GradNormClip(*Tensor::FromFloats({2}, {1.0f, NAN}), 1.0)->ToFloats();
  EXPECT_TRUE(std::isnan(nan[0]) && std::isnan(nan[1]));
  EXPECT_EQ(GradNormClip(*Tensor::Zeros({2, 2}, DType::kF32), 1.0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GradNormClip(*Tensor::Zeros({2}, DType::kBF16), 1.0).status().code(),
            absl::StatusCode::kInvalidArgument);
  // Squares of gradients scaled by a loss scale S (fp16): the norm is
  // theirs over S, the factor torch's of that norm over S (what turns the
  // scaled gradients into the clipped ones), exact for a power of two.
  for (const double scale : {2.0, 1024.0, 65536.0}) {
    for (const double max_norm : {0.0, 1.0, 100.0}) {
      const absl::StatusOr<Tensor> out = GradNormClip(squares, max_norm, scale);
      ASSERT_TRUE(out.ok()) << out.status();
      const std::vector<float> got = out->ToFloats();
      const double unscaled = norm / scale;
      EXPECT_EQ(got[0], static_cast<float>(unscaled)) << scale;
      const double want = (max_norm > 0 && unscaled > max_norm ? max_norm / (unscaled + 1e-6) : 1.0) / scale;
      EXPECT_EQ(got[1], static_cast<float>(want)) << scale << " " << max_norm;
    }
  }
  for (const double bad : {0.5, 0.0, -2.0, static_cast<double>(NAN), static_cast<double>(INFINITY)}) {
    EXPECT_EQ(GradNormClip(squares, 1.0, bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

// The fused attention reads q, k and v in place where they are slices of one
// packed projection (GPT-2's [B, S, 3, H, D], BLOOM's [B, S, H, 3, D]) and
// writes dq, dk and dv into the slices of one packed buffer: the bits of the
// same attention over contiguous copies, and no copy made of the gradients
// (they are the buffer's slices). At D = 3 (rows of 12 or 6 bytes, not the
// kernels' 16-byte aligned ones) both are copied, to the same bits. Places
// of another shape or dtype are refused; a place sharing q's storage is
// written after the kernels, which read q, are done.
TEST(Ops, FusedAttentionReadsAndWritesPackedSlicesInPlace) {
  for (DType type : {DType::kF32, DType::kBF16}) {
    for (int64_t d : {8, 3}) {
      for (bool bloom : {false, true}) {
        const std::string what = std::string(DTypeName(type)) + " d" + std::to_string(d) + (bloom ? " bloom" : " gpt2");
        const int64_t dim = bloom ? 3 : 2, heads = 2;
        const Shape shape = bloom ? Shape{2, 7, heads, 3, d} : Shape{2, 7, 3, heads, d};
        const Tensor qkv = *Tensor::RandomNormal(shape, 91, type);
        const Tensor dout = *Tensor::RandomNormal({2, 7, heads, d}, 92, type);
        Tensor parts[3], copies[3];
        for (int i = 0; i < 3; ++i) {
          parts[i] = *qkv.Select(dim, i);
          copies[i] = parts[i].Contiguous();
        }
        ASSERT_FALSE(parts[0].is_contiguous()) << what;
        EXPECT_EQ(AttentionReadsInPlace(parts[0]), d == 8) << what;
        EXPECT_EQ(AttentionReadsInPlace(parts[1]), d == 8) << what;
        const absl::StatusOr<AttentionForward> f = FusedAttention(parts[0], parts[1], parts[2], 0.4f, true);
        const absl::StatusOr<AttentionForward> want = FusedAttention(copies[0], copies[1], copies[2], 0.4f, true);
        ASSERT_TRUE(f.ok() && want.ok()) << what << ": " << f.status() << " " << want.status();
        EXPECT_EQ(f->out.ToBytes(), want->out.ToBytes()) << what;
        EXPECT_EQ(f->lse.ToBytes(), want->lse.ToBytes()) << what;
        Tensor buffer = *Tensor::Zeros(shape, type);
        AttentionGradPlaces places;
        places.dq = *buffer.Select(dim, 0);
        places.dk = *buffer.Select(dim, 1);
        places.dv = *buffer.Select(dim, 2);
        const absl::StatusOr<AttentionGrads> g =
            FusedAttentionBackward(dout, parts[0], parts[1], parts[2], *f, 0.4f, true, {}, places);
        const absl::StatusOr<AttentionGrads> g_want =
            FusedAttentionBackward(dout, copies[0], copies[1], copies[2], *want, 0.4f, true);
        ASSERT_TRUE(g.ok() && g_want.ok()) << what << ": " << g.status() << " " << g_want.status();
        EXPECT_EQ(g->dq.raw_data(), places.dq->raw_data()) << what;
        EXPECT_EQ(g->dv.raw_data(), places.dv->raw_data()) << what;
        const Tensor* got[3] = {&g->dq, &g->dk, &g->dv};
        const Tensor* wanted[3] = {&g_want->dq, &g_want->dk, &g_want->dv};
        for (int i = 0; i < 3; ++i) {
          EXPECT_EQ(buffer.Select(dim, i)->ToBytes(), wanted[i]->ToBytes()) << what << " gradient " << i;
          EXPECT_EQ(got[i]->ToBytes(), wanted[i]->ToBytes()) << what << " gradient " << i;
        }
      }
    }
  }
  const Tensor q = *Tensor::RandomNormal({1, 4, 2, 8}, 93);
  const absl::StatusOr<AttentionForward> f = FusedAttention(q, q, q, 0.4f, false);
  ASSERT_TRUE(f.ok()) << f.status();
  AttentionGradPlaces wrong;
  wrong.dq = *Tensor::Zeros({1, 4, 2, 8}, DType::kF32);
  wrong.dk = *Tensor::Zeros({1, 4, 2, 8}, DType::kF32);
  wrong.dv = *Tensor::Zeros({1, 4, 2, 8}, DType::kBF16);
  EXPECT_EQ(FusedAttentionBackward(q, q, q, q, *f, 0.4f, false, {}, wrong).status().code(),
            absl::StatusCode::kInvalidArgument);
  wrong.dv.reset();
  EXPECT_EQ(FusedAttentionBackward(q, q, q, q, *f, 0.4f, false, {}, wrong).status().code(),
            absl::StatusCode::kInvalidArgument);
  // dq, dk and dv written over q, k and v themselves (packed in one tensor).
  const Tensor qkv = *Tensor::RandomNormal({1, 6, 3, 2, 8}, 94), dout = *Tensor::RandomNormal({1, 6, 2, 8}, 95);
  Tensor parts[3];
  for (int i = 0; i < 3; ++i) parts[i] = *qkv.Select(2, i);
  const absl::StatusOr<AttentionForward> fwd = FusedAttention(parts[0], parts[1], parts[2], 0.4f, true);
  ASSERT_TRUE(fwd.ok()) << fwd.status();
  const absl::StatusOr<AttentionGrads> want =
      FusedAttentionBackward(dout, parts[0].Contiguous(), parts[1].Contiguous(), parts[2].Contiguous(), *fwd, 0.4f,
                             true);
  ASSERT_TRUE(want.ok()) << want.status();
  AttentionGradPlaces over;
  over.dq = parts[0];
  over.dk = parts[1];
  over.dv = parts[2];
  const absl::StatusOr<AttentionGrads> got = FusedAttentionBackward(dout, parts[0], parts[1], parts[2], *fwd, 0.4f,
                                                                    true, {}, over);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(parts[0].ToBytes(), want->dq.ToBytes());
  EXPECT_EQ(parts[1].ToBytes(), want->dk.ToBytes());
  EXPECT_EQ(parts[2].ToBytes(), want->dv.ToBytes());
}

}  // namespace
}  // namespace colod::ops
