// 3D layers on 8 ranks (q = 2, threads over Gloo on loopback): the reference
// document's MLP 256 -> 1024 -> 256 with its partition shapes (input [4,128],
// weights [128,256] and [512,64], outputs [4,512] and [4,128]) and a
// LayerNorm3D in front, against the unsharded computation.
#include "worker/nn/linear3d.h"

#include <cmath>

#include "gtest/gtest.h"
#include "worker/colo/testing.h"
#include "worker/nn/functional.h"

namespace colod::nn {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::ExpectAllClose;

// DESIGN.md section 7 allows rtol/atol 1e-5 for 1D and 1e-3/1e-2 for the SUMMA
// family; these sums are short enough to hold the tighter bound.
constexpr double kTol = 1e-4;

DeviceMesh Mesh3D(int q) {
  v1::ShardConfig s;
  s.set_tensor_parallel_size(q * q * q);
  s.set_data_parallel_size(1);
  s.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_3D);
  return *DeviceMesh::FromShardConfig(s);
}

Tensor T(const Tensor& m) { return m.Transpose(0, 1)->Contiguous(); }

TEST(Linear3D, ReferenceMlpShapesAndValuesOnEightRanks) {
  const int q = 2;
  const Tensor x = *Tensor::RandomNormal({16, 256}, 1), gamma = *Tensor::RandomNormal({256}, 2),
               beta = *Tensor::RandomNormal({256}, 3), a1 = *Scale(*Tensor::RandomNormal({256, 1024}, 4), 0.05f),
               b1 = *Tensor::RandomNormal({1024}, 5), a2 = *Scale(*Tensor::RandomNormal({1024, 256}, 6), 0.03f),
               b2 = *Tensor::RandomNormal({256}, 7), r = *Tensor::RandomNormal({16, 256}, 8);
  Variable vx(x, true), vg(gamma, true), vb(beta, true), va1(T(a1), true), vb1(b1, true), va2(T(a2), true),
      vb2(b2, true);
  Variable y = *Linear(*Gelu(*Linear(*LayerNorm(vx, vg, vb, 1e-5f), va1, vb1), ops::GeluApprox::kTanh), va2, vb2);
  ASSERT_TRUE(Backward(*Sum(*Mul(y, Variable(r)))).ok());
  const Tensor da1 = T(*va1.grad()), da2 = T(*va2.grad());

  RunMesh(Mesh3D(q), [&](int rank, ProcessGroup& pg) {
    // Coordinates: local rank weight + q*input + q*q*output.
    const int o = rank / (q * q), n = (rank / q) % q, w = rank % q;
    // Rows split (outer, inner) q*q ways, columns q ways.
    auto block = [&](const Tensor& m, int outer, int inner, int col) {
      return m.Chunk(0, q * q, outer * q + inner)->Chunk(1, q, col)->Contiguous();
    };
    // A weight's block: the view [in, q, out/q] at (c, k, r).
    auto wblock = [&](const Tensor& a, int c, int k, int rr) {
      return a.Reshape({a.shape()[0], q, a.shape()[1] / q})->Chunk(0, q, c)->Chunk(1, q, k)->Chunk(2, q, rr)->Contiguous();
    };
    auto norm = LayerNorm3D::FromGlobal(gamma, beta, 1e-5f, &pg, "tp_input", "tp_weight");
    auto l1 = Linear3D::FromGlobal(a1, b1, &pg, {});
    auto l2 = Linear3D::FromGlobal(a2, b2, &pg, {.swap = true});
    ASSERT_TRUE(norm.ok() && l1.ok() && l2.ok()) << l1.status() << l2.status();
    EXPECT_EQ(l1->weight().local().numel(), 128 * 256);  // [128, 256] as the document prints it
    EXPECT_EQ(l1->weight().local().shape(), (Shape{128, 1, 256}));
    EXPECT_EQ(l2->weight().local().shape(), (Shape{512, 1, 64}));
    auto in = ColoTensor::FromGlobal(x, l1->InputSpec(2), &pg, true);
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_EQ(in->local().shape(), (Shape{4, 128}));
    ExpectAllClose(in->local(), block(x, o, n, w), "input block", kTol);
    auto h = norm->Forward(*in);
    ASSERT_TRUE(h.ok()) << h.status();
    auto o1 = l1->Forward(*h);
    ASSERT_TRUE(o1.ok()) << o1.status();
    EXPECT_EQ(o1->local().shape(), (Shape{4, 512}));
    auto act = ColoTensor::FromLocal(*Gelu(o1->variable(), ops::GeluApprox::kTanh), o1->spec(), &pg);
    auto o2 = l2->Forward(*act);
    ASSERT_TRUE(o2.ok()) << o2.status();
    EXPECT_EQ(o2->local().shape(), (Shape{4, 128}));
    ExpectAllClose(o2->local(), block(y.value(), o, n, w), "output block", kTol);

    ASSERT_TRUE(Backward(*Sum(*Mul(o2->variable(), Variable(block(r, o, n, w))))).ok());
    ExpectAllClose(*in->variable().grad(), block(*vx.grad(), o, n, w), "input gradient", kTol);
    // Layer 1: C = tp_weight, K = tp_input; layer 2 swaps them.
    ExpectAllClose(*l1->weight().variable().grad(), wblock(da1, w, n, o), "A1 gradient", kTol);
    ExpectAllClose(*l2->weight().variable().grad(), wblock(da2, n, w, o), "A2 gradient", kTol);
    ExpectAllClose(*l1->bias()->variable().grad(), *vb1.grad()->Reshape({q, 512})->Chunk(0, q, n), "b1 gradient", kTol);
    ExpectAllClose(*l2->bias()->variable().grad(), *vb2.grad()->Reshape({q, 128})->Chunk(0, q, w), "b2 gradient", kTol);
    ExpectAllClose(*norm->gamma().variable().grad(), *vg.grad()->Chunk(0, q, w), "gamma gradient", kTol);
  });
}

}  // namespace
}  // namespace colod::nn
