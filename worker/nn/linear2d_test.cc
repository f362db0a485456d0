// 2D (SUMMA) layers on 4 ranks (q = 2) and 2.5D on 8 (q = 2, d = 2), threads
// over Gloo on loopback: the reference document's MLP 256 -> 1024 -> 256 with
// its partition shapes, and a LayerNorm or an RMSNorm (Norm2D) in front,
// against the unsharded computation.
#include "worker/nn/linear2d.h"

#include <cmath>

#include "gtest/gtest.h"
#include "worker/colo/testing.h"
#include "worker/nn/functional.h"

namespace colod::nn {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::Stats;
using ::colod::testing::ExpectAllClose;

// DESIGN.md section 7 allows rtol/atol 1e-5 for 1D and 1e-3/1e-2 for the SUMMA
// family; these sums are short enough to hold the tighter bound.
constexpr double kTol = 1e-4;

// q x q (2D), or d x q x q (2.5D) when depth > 1.
DeviceMesh Mesh2D(int q, int depth = 1) {
  v1::ShardConfig s;
  s.set_tensor_parallel_size(depth * q * q);
  s.set_data_parallel_size(1);
  s.set_tensor_parallel_mode(depth > 1 ? v1::TENSOR_PARALLEL_MODE_2P5D : v1::TENSOR_PARALLEL_MODE_2D);
  if (depth > 1) s.set_depth(depth);
  return *DeviceMesh::FromShardConfig(s);
}

Tensor T(const Tensor& m) { return m.Transpose(0, 1)->Contiguous(); }

// Block (i, j) of a matrix split q x q.
Tensor Block(const Tensor& m, int q, int i, int j) { return m.Chunk(0, q, i)->Chunk(1, q, j)->Contiguous(); }

struct MlpCase {
  int q, depth;
  Norm2D::Kind norm = Norm2D::Kind::kLayerNorm;
};

class Mlp2D : public ::testing::TestWithParam<MlpCase> {};

// 2D on 4 ranks: input [16,256] -> [8,128], weights [128,512] and [512,128],
// outputs [8,512] and [8,128]. 2.5D on 8 ranks (d = 2): the rows split once
// more, so [4,128], [4,512] and [4,128], with the same weight blocks.
TEST_P(Mlp2D, ReferenceMlpShapesAndValues) {
  const int q = GetParam().q, depth = GetParam().depth;  // not a binding: lambdas capture them
  const bool layer_norm = GetParam().norm == Norm2D::Kind::kLayerNorm;
  const int64_t rows = 16 / (q * depth);
  const Tensor x = *Tensor::RandomNormal({16, 256}, 1), gamma = *Tensor::RandomNormal({256}, 2),
               beta = *Tensor::RandomNormal({256}, 3), a1 = *Scale(*Tensor::RandomNormal({256, 1024}, 4), 0.05f),
               b1 = *Tensor::RandomNormal({1024}, 5), a2 = *Scale(*Tensor::RandomNormal({1024, 256}, 6), 0.03f),
               b2 = *Tensor::RandomNormal({256}, 7), r = *Tensor::RandomNormal({16, 256}, 8);
  // Unsharded: the norm, then y = GELU(h A1 + b1) A2 + b2 (Linear takes A^T).
  Variable vx(x, true), vg(gamma, true), vb(beta, true), va1(T(a1), true), vb1(b1, true), va2(T(a2), true),
      vb2(b2, true);
  Variable h = layer_norm ? *LayerNorm(vx, vg, vb, 1e-5f) : *RmsNorm(vx, vg, 1e-5f);
  Variable y = *Linear(*Gelu(*Linear(h, va1, vb1), ops::GeluApprox::kTanh), va2, vb2);
  ASSERT_TRUE(Backward(*Sum(*Mul(y, Variable(r)))).ok());
  const Tensor da1 = T(*va1.grad()), da2 = T(*va2.grad());

  RunMesh(
      Mesh2D(q, depth),
      [&](int rank, ProcessGroup& pg) {
        // tp_dep, tp_col and tp_row coordinates (local rank row + q*col + q*q*dep).
        const int dep = rank / (q * q), i = (rank / q) % q, j = rank % q;
        ASSERT_EQ(*pg.LocalRank("tp_col"), i);
        ASSERT_EQ(*pg.LocalRank("tp_row"), j);
        // Activation block: row slab dep*q + i of d*q, column block j of q.
        auto act_block = [&](const Tensor& m) {
          return m.Chunk(0, depth * q, dep * q + i)->Chunk(1, q, j)->Contiguous();
        };
        auto norm = Norm2D::FromGlobal(gamma, layer_norm ? std::optional<Tensor>(beta) : std::nullopt, &pg,
                                       {GetParam().norm, 1e-5f});
        auto l1 = Linear2D::FromGlobal(a1, b1, &pg);
        auto l2 = Linear2D::FromGlobal(a2, b2, &pg);
        ASSERT_TRUE(norm.ok() && l1.ok() && l2.ok()) << l1.status();
        EXPECT_EQ(l1->weight().local().shape(), (Shape{128, 512}));
        EXPECT_EQ(l2->weight().local().shape(), (Shape{512, 128}));
        auto in = ColoTensor::FromGlobal(x, Activation2D(2, q, depth), &pg, true);
        ASSERT_TRUE(in.ok()) << in.status();
        EXPECT_EQ(in->local().shape(), (Shape{rows, 128}));
        auto hn = norm->Forward(*in);
        ASSERT_TRUE(hn.ok()) << hn.status();
        auto o1 = l1->Forward(*hn);
        ASSERT_TRUE(o1.ok()) << o1.status();
        EXPECT_EQ(o1->local().shape(), (Shape{rows, 512}));
        auto act = ColoTensor::FromLocal(*Gelu(o1->variable(), ops::GeluApprox::kTanh), o1->spec(), &pg);
        auto o2 = l2->Forward(*act);
        ASSERT_TRUE(o2.ok()) << o2.status();
        EXPECT_EQ(o2->local().shape(), (Shape{rows, 128}));
        ExpectAllClose(o2->local(), act_block(y.value()), "output block", kTol);
        // SUMMA: q broadcasts of X along the row and q of A along the column, per layer.
        EXPECT_EQ(Stats(pg, "tp_row", "broadcast").calls, 2 * q);
        EXPECT_EQ(Stats(pg, "tp_col", "broadcast").calls, 2 * q);

        ASSERT_TRUE(Backward(*Sum(*Mul(o2->variable(), Variable(act_block(r))))).ok());
        ExpectAllClose(*in->variable().grad(), act_block(*vx.grad()), "input gradient", kTol);
        ExpectAllClose(*l1->weight().variable().grad(), Block(da1, q, i, j), "A1 gradient", kTol);
        ExpectAllClose(*l2->weight().variable().grad(), Block(da2, q, i, j), "A2 gradient", kTol);
        ExpectAllClose(*l1->bias()->variable().grad(), *vb1.grad()->Chunk(0, q, j), "b1 gradient", kTol);
        ExpectAllClose(*l2->bias()->variable().grad(), *vb2.grad()->Chunk(0, q, j), "b2 gradient", kTol);
        ExpectAllClose(*norm->gamma().variable().grad(), *vg.grad()->Chunk(0, q, j), "gamma gradient", kTol);
        if (layer_norm) {
          ExpectAllClose(*norm->beta()->variable().grad(), *vb.grad()->Chunk(0, q, j), "beta gradient", kTol);
        } else {
          EXPECT_FALSE(norm->beta().has_value());
        }
      },
      /*instrument=*/true);
}

INSTANTIATE_TEST_SUITE_P(Modes, Mlp2D,
                         ::testing::Values(MlpCase{2, 1}, MlpCase{2, 2}, MlpCase{2, 1, Norm2D::Kind::kRmsNorm},
                                           MlpCase{2, 2, Norm2D::Kind::kRmsNorm}),
                         [](const auto& info) {
                           return std::string(info.param.depth == 1 ? "2d_q2" : "2p5d_q2_d2") +
                                  (info.param.norm == Norm2D::Kind::kLayerNorm ? "_layernorm" : "_rmsnorm");
                         });

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
