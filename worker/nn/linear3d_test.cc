// 3D layers on 8 ranks (q = 2, threads over Gloo on loopback): the reference
// document's MLP 256 -> 1024 -> 256 with its partition shapes (input [4,128],
// weights [128,256] and [512,64], outputs [4,512] and [4,128]) and a
// LayerNorm3D in front, against the unsharded computation.
#include "worker/nn/linear3d.h"

#include <cmath>

#include "gtest/gtest.h"
#include "worker/colo/testing.h"
#include "worker/nn/embedding3d.h"
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
  const Tensor dat1 = *va1.grad(), dat2 = *va2.grad();  // of A^T, as the layers hold it

  RunMesh(Mesh3D(q), [&](int rank, ProcessGroup& pg) {
    // Coordinates: local rank weight + q*input + q*q*output.
    const int o = rank / (q * q), n = (rank / q) % q, w = rank % q;
    // Rows split (outer, inner) q*q ways, columns q ways.
    auto block = [&](const Tensor& m, int outer, int inner, int col) {
      return m.Chunk(0, q * q, outer * q + inner)->Chunk(1, q, col)->Contiguous();
    };
    // A weight's block: A^T [out, in] as the view [q, out/q, in] at (k, r, c).
    auto wblock = [&](const Tensor& at, int k, int rr, int c) {
      return at.Reshape({q, at.shape()[0] / q, at.shape()[1]})->Chunk(0, q, k)->Chunk(1, q, rr)->Chunk(2, q, c)->Contiguous();
    };
    auto norm = Norm3D::FromGlobal(gamma, beta, &pg, {});
    auto l1 = Linear3D::FromGlobal(a1, b1, &pg, {});
    auto l2 = Linear3D::FromGlobal(a2, b2, &pg, {.swap = true});
    ASSERT_TRUE(norm.ok() && l1.ok() && l2.ok()) << l1.status() << l2.status();
    // The document's [128, 256] and [512, 64] blocks, held transposed.
    EXPECT_EQ(l1->weight().local().shape(), (Shape{1, 256, 128}));
    EXPECT_EQ(l2->weight().local().shape(), (Shape{1, 64, 512}));
    ExpectAllClose(l1->weight().local(), wblock(T(a1), n, o, w), "A1 block", 0);
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
    ExpectAllClose(*l1->weight().variable().grad(), wblock(dat1, n, o, w), "A1 gradient", kTol);
    ExpectAllClose(*l2->weight().variable().grad(), wblock(dat2, w, o, n), "A2 gradient", kTol);
    ExpectAllClose(*l1->bias()->variable().grad(), *vb1.grad()->Reshape({q, 512})->Chunk(0, q, n), "b1 gradient", kTol);
    ExpectAllClose(*l2->bias()->variable().grad(), *vb2.grad()->Reshape({q, 128})->Chunk(0, q, w), "b2 gradient", kTol);
    ExpectAllClose(*norm->gamma().variable().grad(), *vg.grad()->Chunk(0, q, w), "gamma gradient", kTol);
    ExpectAllClose(*norm->beta()->variable().grad(), *vb.grad()->Chunk(0, q, w), "beta gradient", kTol);
  });
}

// RMSNorm3D: the statistics over the hidden split, gamma's gradient summed
// over the rows' ranks; and the parameter checks.
TEST(Norm3D, RmsNormMatchesTheUnshardedNormOnEightRanks) {
  const int q = 2;
  const Tensor x = *Tensor::RandomNormal({4, 2, 3, 64}, 11), gamma = *Tensor::RandomNormal({64}, 12),
               r = *Tensor::RandomNormal({4, 2, 3, 64}, 13);
  Variable vx(x, true), vg(gamma, true);
  Variable y = *RmsNorm(vx, vg, 1e-6f);
  ASSERT_TRUE(Backward(*Sum(*Mul(y, Variable(r)))).ok());
  RunMesh(Mesh3D(q), [&](int rank, ProcessGroup& pg) {
    const int o = rank / (q * q), n = (rank / q) % q, w = rank % q;
    auto block = [&](const Tensor& m) {
      return m.Chunk(0, q * q, o * q + n)->Chunk(3, q, w)->Contiguous();
    };
    EXPECT_FALSE(Norm3D::FromGlobal(gamma, gamma, &pg, {.kind = NormKind::kRmsNorm}).ok());
    EXPECT_FALSE(Norm3D::FromGlobal(gamma, std::nullopt, &pg, {}).ok());  // LayerNorm without beta
    auto norm = Norm3D::FromGlobal(gamma, std::nullopt, &pg, {.kind = NormKind::kRmsNorm, .eps = 1e-6f});
    ASSERT_TRUE(norm.ok()) << norm.status();
    auto in = ColoTensor::FromGlobal(x, *StreamSpec3D(4, &pg), &pg, true);
    ASSERT_TRUE(in.ok()) << in.status();
    EXPECT_EQ(in->local().shape(), (Shape{1, 2, 3, 32}));
    auto out = norm->Forward(*in);
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectAllClose(out->local(), block(y.value()), "output", kTol);
    ASSERT_TRUE(Backward(*Sum(*Mul(out->variable(), Variable(block(r))))).ok());
    ExpectAllClose(*in->variable().grad(), block(*vx.grad()), "input gradient", kTol);
    ExpectAllClose(*norm->gamma().variable().grad(), *vg.grad()->Chunk(0, q, w), "gamma gradient", kTol);
  });
}

// Embedding3D: the lookup gives the stream's block with no communication,
// the head's logits are whole per batch block, and the table's gradient sums
// both uses over every batch block.
TEST(Embedding3D, LookupAndTiedLogitsMatchTheUnshardedTableOnEightRanks) {
  const int q = 2;
  const int64_t vocab = 11, hidden = 64;
  const Tensor table = *Tensor::RandomNormal({vocab, hidden}, 21), r = *Tensor::RandomNormal({8, 5, vocab}, 22);
  std::vector<int64_t> id_values;
  for (int i = 0; i < 8 * 5; ++i) id_values.push_back((i * 7 + 3) % vocab);
  const Tensor ids = *Tensor::FromInt64s({8, 5}, id_values);
  Variable vt(table, true);
  Variable logits = *Linear(*Embedding(vt, ids), vt, std::nullopt);
  ASSERT_TRUE(Backward(*Sum(*Mul(logits, Variable(r)))).ok());
  RunMesh(Mesh3D(q), [&](int rank, ProcessGroup& pg) {
    const int o = rank / (q * q), n = (rank / q) % q, w = rank % q;
    auto e = Embedding3D::FromGlobal(table, &pg);
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->weight().local().shape(), (Shape{vocab, hidden / q}));
    EXPECT_FALSE(e->Forward(*Tensor::FromInt64s({6, 5}, std::vector<int64_t>(30, 0))).ok());  // 6 rows, 4 blocks
    EXPECT_FALSE(e->Forward(*Tensor::FromInt64s({4, 1}, {0, 1, vocab, 2})).ok());           // id out of range
    auto h = e->Forward(ids);
    ASSERT_TRUE(h.ok()) << h.status();
    const Tensor emb = Embedding(Variable(table), ids)->value().Contiguous();
    ExpectAllClose(h->local(), emb.Chunk(0, q * q, o * q + n)->Chunk(2, q, w)->Contiguous(), "embedding block", 0);
    auto out = e->TiedLogits(*h);
    ASSERT_TRUE(out.ok()) << out.status();
    const Tensor mine = logits.value().Chunk(0, q * q, o * q + n)->Contiguous();
    ExpectAllClose(out->local(), mine, "logits", kTol);
    ASSERT_TRUE(
        Backward(*Sum(*Mul(out->variable(), Variable(r.Chunk(0, q * q, o * q + n)->Contiguous())))).ok());
    ExpectAllClose(*e->weight().variable().grad(), vt.grad()->Chunk(1, q, w)->Contiguous(), "table gradient", kTol);
  });
}

}  // namespace
}  // namespace colod::nn
