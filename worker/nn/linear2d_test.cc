// 2D (SUMMA) layers on 4 ranks (q = 2, threads over Gloo on loopback): the
// reference document's MLP 256 -> 1024 -> 256 with its partition shapes, and
// a LayerNorm2D in front, against the unsharded computation.
#include "worker/nn/linear2d.h"

#include <cmath>

#include "gtest/gtest.h"
#include "worker/colo/testing.h"
#include "worker/nn/functional.h"

namespace colod::nn {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::Stats;

DeviceMesh Mesh2D(int q) {
  v1::ShardConfig s;
  s.set_tensor_parallel_size(q * q);
  s.set_data_parallel_size(1);
  s.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
  return *DeviceMesh::FromShardConfig(s);
}

// DESIGN.md section 7: rtol 1e-3, atol 1e-2 for the SUMMA family; these
// sums are short enough to hold 1e-4.
void ExpectClose(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<float> g = got.ToFloats(), w = want.ToFloats();
  for (size_t i = 0; i < g.size(); ++i) ASSERT_NEAR(g[i], w[i], 1e-4 + 1e-4 * std::fabs(w[i])) << what << " at " << i;
}

Tensor T(const Tensor& m) { return m.Transpose(0, 1)->Contiguous(); }

// Block (i, j) of a matrix split q x q.
Tensor Block(const Tensor& m, int q, int i, int j) { return m.Chunk(0, q, i)->Chunk(1, q, j)->Contiguous(); }

TEST(Linear2D, ReferenceMlpShapesAndValuesOnFourRanks) {
  const int q = 2;
  const Tensor x = *Tensor::RandomNormal({16, 256}, 1), gamma = *Tensor::RandomNormal({256}, 2),
               beta = *Tensor::RandomNormal({256}, 3), a1 = *Scale(*Tensor::RandomNormal({256, 1024}, 4), 0.05f),
               b1 = *Tensor::RandomNormal({1024}, 5), a2 = *Scale(*Tensor::RandomNormal({1024, 256}, 6), 0.03f),
               b2 = *Tensor::RandomNormal({256}, 7), r = *Tensor::RandomNormal({16, 256}, 8);
  // Unsharded: LayerNorm, then y = GELU(h A1 + b1) A2 + b2 (Linear takes A^T).
  Variable vx(x, true), vg(gamma, true), vb(beta, true), va1(T(a1), true), vb1(b1, true), va2(T(a2), true),
      vb2(b2, true);
  Variable h = *LayerNorm(vx, vg, vb, 1e-5f);
  Variable y = *Linear(*Gelu(*Linear(h, va1, vb1), kernels::GeluApprox::kTanh), va2, vb2);
  ASSERT_TRUE(Backward(*Sum(*Mul(y, Variable(r)))).ok());
  const Tensor da1 = T(*va1.grad()), da2 = T(*va2.grad());

  RunMesh(
      Mesh2D(q),
      [&](int rank, ProcessGroup& pg) {
        const int i = rank / q, j = rank % q;  // tp_col and tp_row coordinates
        ASSERT_EQ(*pg.LocalRank("tp_col"), i);
        ASSERT_EQ(*pg.LocalRank("tp_row"), j);
        auto norm = LayerNorm2D::FromGlobal(gamma, beta, 1e-5f, &pg);
        auto l1 = Linear2D::FromGlobal(a1, b1, &pg);
        auto l2 = Linear2D::FromGlobal(a2, b2, &pg);
        ASSERT_TRUE(norm.ok() && l1.ok() && l2.ok()) << l1.status();
        EXPECT_EQ(l1->weight().local().shape(), (Shape{128, 512}));
        EXPECT_EQ(l2->weight().local().shape(), (Shape{512, 128}));
        auto in = ColoTensor::FromGlobal(x, Activation2D(2, q), &pg, true);
        ASSERT_TRUE(in.ok());
        EXPECT_EQ(in->local().shape(), (Shape{8, 128}));
        auto hn = norm->Forward(*in);
        ASSERT_TRUE(hn.ok()) << hn.status();
        auto o1 = l1->Forward(*hn);
        ASSERT_TRUE(o1.ok()) << o1.status();
        EXPECT_EQ(o1->local().shape(), (Shape{8, 512}));
        auto act = ColoTensor::FromLocal(*Gelu(o1->variable(), kernels::GeluApprox::kTanh), o1->spec(), &pg);
        auto o2 = l2->Forward(*act);
        ASSERT_TRUE(o2.ok()) << o2.status();
        EXPECT_EQ(o2->local().shape(), (Shape{8, 128}));
        ExpectClose(o2->local(), Block(y.value(), q, i, j), "output block");
        // SUMMA: q broadcasts of X along the row and q of A along the column, per layer.
        EXPECT_EQ(Stats(pg, "tp_row", "broadcast").calls, 2 * q);
        EXPECT_EQ(Stats(pg, "tp_col", "broadcast").calls, 2 * q);

        ASSERT_TRUE(Backward(*Sum(*Mul(o2->variable(), Variable(Block(r, q, i, j))))).ok());
        ExpectClose(*in->variable().grad(), Block(*vx.grad(), q, i, j), "input gradient");
        ExpectClose(*l1->weight().variable().grad(), Block(da1, q, i, j), "A1 gradient");
        ExpectClose(*l2->weight().variable().grad(), Block(da2, q, i, j), "A2 gradient");
        ExpectClose(*l1->bias()->variable().grad(), *vb1.grad()->Chunk(0, q, j), "b1 gradient");
        ExpectClose(*l2->bias()->variable().grad(), *vb2.grad()->Chunk(0, q, j), "b2 gradient");
        ExpectClose(*norm->gamma().variable().grad(), *vg.grad()->Chunk(0, q, j), "gamma gradient");
        ExpectClose(*norm->beta().variable().grad(), *vb.grad()->Chunk(0, q, j), "beta gradient");
      },
      /*instrument=*/true);
}

TEST(Linear2D, NeedsATwoDimensionalMeshAndDivisibleWeights) {
  RunMesh(::colod::testing::TpDpMesh(4), [](int, ProcessGroup& pg) {
    auto l = Linear2D::FromGlobal(*Tensor::Zeros({8, 8}, DType::kF32), std::nullopt, &pg);
    EXPECT_EQ(l.status().code(), absl::StatusCode::kFailedPrecondition);
  });
  RunMesh(Mesh2D(2), [](int, ProcessGroup& pg) {
    auto l = Linear2D::FromGlobal(*Tensor::Zeros({7, 8}, DType::kF32), std::nullopt, &pg);
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(l.status().message().find("dim 0 of size 7"), absl::string_view::npos) << l.status();
  });
}

}  // namespace
}  // namespace colod::nn
