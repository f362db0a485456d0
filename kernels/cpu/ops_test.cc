// The CPU kernels against independent references in double precision:
// naive GEMM loops, the closed forms of GELU and LayerNorm, and central
// differences of the double forward for every backward.
#include "kernels/ops.h"

#include <cmath>
#include <functional>

#include "gtest/gtest.h"

namespace colod::kernels {
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

}  // namespace
}  // namespace colod::kernels
