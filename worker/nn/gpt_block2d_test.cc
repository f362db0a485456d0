// A GPT model in 2D and 2.5D tensor parallelism, end to end: tied embedding,
// LayerNorm, causal attention (q, k, v and output projections as Linear2D,
// heads split over tp_row), MLP, residuals, tied LM head and cross-entropy,
// against the unsharded model on the same full tensors.
#include <cmath>

#include "gtest/gtest.h"
#include "worker/colo/testing.h"
#include "worker/nn/embedding2d.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear2d.h"

namespace colod::nn {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::ExpectAllClose;

// DESIGN.md section 7 allows rtol/atol 1e-5 for 1D and 1e-3/1e-2 for the SUMMA
// family; these sums are short enough to hold the tighter bound.
constexpr double kTol = 1e-4;

constexpr int64_t kBatch = 4, kSeq = 6, kVocab = 40, kHidden = 16, kHeads = 4, kHeadDim = 4;

Tensor R(const Shape& s, uint64_t seed, float scale) { return *Scale(*Tensor::RandomNormal(s, seed), scale); }
Tensor T(const Tensor& m) { return m.Transpose(0, 1)->Contiguous(); }

struct Weights {
  Tensor wte, ln1_g, ln1_b, wq, wk, wv, wo, ln2_g, ln2_b, fc, proj;  // linears [in, out]
  Tensor bq, bk, bv, bo, bfc, bproj;
};

Weights MakeWeights() {
  Weights w;
  w.wte = R({kVocab, kHidden}, 1, 0.5f);
  w.ln1_g = R({kHidden}, 2, 1.0f), w.ln1_b = R({kHidden}, 3, 0.1f);
  w.ln2_g = R({kHidden}, 4, 1.0f), w.ln2_b = R({kHidden}, 5, 0.1f);
  w.wq = R({kHidden, kHidden}, 6, 0.3f), w.wk = R({kHidden, kHidden}, 7, 0.3f);
  w.wv = R({kHidden, kHidden}, 8, 0.3f), w.wo = R({kHidden, kHidden}, 9, 0.3f);
  w.fc = R({kHidden, 4 * kHidden}, 10, 0.3f), w.proj = R({4 * kHidden, kHidden}, 11, 0.2f);
  w.bq = R({kHidden}, 12, 0.1f), w.bk = R({kHidden}, 13, 0.1f), w.bv = R({kHidden}, 14, 0.1f);
  w.bo = R({kHidden}, 15, 0.1f), w.bfc = R({4 * kHidden}, 16, 0.1f), w.bproj = R({kHidden}, 17, 0.1f);
  return w;
}

Tensor Ids(uint64_t salt) {
  std::vector<int64_t> v(kBatch * kSeq);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>((i * 7 + salt) % kVocab);
  return *Tensor::FromInt64s({kBatch, kSeq}, v);
}

struct MeshCase {
  int q, depth;
};

class GptBlock2D : public ::testing::TestWithParam<MeshCase> {};

TEST_P(GptBlock2D, LogitsLossAndGradientsMatchTheUnshardedModel) {
  const int q = GetParam().q, depth = GetParam().depth;  // not a binding: lambdas capture them
  const Weights w = MakeWeights();
  const Tensor ids = Ids(3), labels = *Ids(5).Reshape({kBatch * kSeq});
  const float scale = 0.5f;  // 1 / sqrt(head dim)

  // Unsharded (Linear takes [out, in], so the [in, out] weights go in transposed).
  Variable wte(w.wte, true), wq(T(w.wq), true), wfc(T(w.fc), true), ln1g(w.ln1_g, true);
  auto heads = [](const Variable& t) { return *Reshape(t, {kBatch, kSeq, kHeads, kHeadDim}); };
  Variable x0 = *Embedding(wte, ids);
  Variable h = *LayerNorm(x0, ln1g, Variable(w.ln1_b), 1e-5f);
  Variable att = *CausalAttention(heads(*Linear(h, wq, Variable(w.bq))), heads(*Linear(h, Variable(T(w.wk)), Variable(w.bk))),
                                  heads(*Linear(h, Variable(T(w.wv)), Variable(w.bv))), scale);
  Variable x1 = *Add(x0, *Linear(*Reshape(att, {kBatch, kSeq, kHidden}), Variable(T(w.wo)), Variable(w.bo)));
  Variable h2 = *LayerNorm(x1, Variable(w.ln2_g), Variable(w.ln2_b), 1e-5f);
  Variable mlp = *Linear(*Gelu(*Linear(h2, wfc, Variable(w.bfc)), ops::GeluApprox::kTanh),
                         Variable(T(w.proj)), Variable(w.bproj));
  Variable x2 = *Add(x1, mlp);
  Variable logits = *Linear(x2, wte, std::nullopt);
  Variable loss = *Sum(*CrossEntropy(*Reshape(logits, {kBatch * kSeq, kVocab}), labels));
  ASSERT_TRUE(Backward(loss).ok());

  v1::ShardConfig s;
  s.set_tensor_parallel_size(depth * q * q);
  s.set_data_parallel_size(1);
  s.set_tensor_parallel_mode(depth > 1 ? v1::TENSOR_PARALLEL_MODE_2P5D : v1::TENSOR_PARALLEL_MODE_2D);
  if (depth > 1) s.set_depth(depth);
  std::vector<double> losses(depth * q * q);
  RunMesh(*DeviceMesh::FromShardConfig(s), [&](int rank, ProcessGroup& pg) {
    const int dep = rank / (q * q), i = (rank / q) % q, j = rank % q;
    const int blocks = depth * q, b = dep * q + i;  // this rank's batch block
    auto emb = Embedding2D::FromGlobal(w.wte, &pg);
    auto ln1 = Norm2D::FromGlobal(w.ln1_g, w.ln1_b, &pg, {Norm2D::Kind::kLayerNorm, 1e-5f});
    auto ln2 = Norm2D::FromGlobal(w.ln2_g, w.ln2_b, &pg, {Norm2D::Kind::kLayerNorm, 1e-5f});
    auto lq = Linear2D::FromGlobal(w.wq, w.bq, &pg), lk = Linear2D::FromGlobal(w.wk, w.bk, &pg),
         lv = Linear2D::FromGlobal(w.wv, w.bv, &pg), lo = Linear2D::FromGlobal(w.wo, w.bo, &pg),
         lfc = Linear2D::FromGlobal(w.fc, w.bfc, &pg), lproj = Linear2D::FromGlobal(w.proj, w.bproj, &pg);
    ASSERT_TRUE(emb.ok() && ln1.ok() && lq.ok() && lfc.ok()) << emb.status();
    auto x0s = emb->Forward(ids);
    ASSERT_TRUE(x0s.ok()) << x0s.status();
    EXPECT_EQ(x0s->local().shape(), (Shape{kBatch / blocks, kSeq, kHidden / q}));
    auto hs = ln1->Forward(*x0s);
    // Heads split over tp_row: this rank's kHeads / q heads.
    auto local_heads = [&](const ColoTensor& t) {
      return *Reshape(t.variable(), {kBatch / blocks, kSeq, kHeads / q, kHeadDim});
    };
    Variable atts = *CausalAttention(local_heads(*lq->Forward(*hs)), local_heads(*lk->Forward(*hs)),
                                     local_heads(*lv->Forward(*hs)), scale);
    auto merged = ColoTensor::FromLocal(*Reshape(atts, {kBatch / blocks, kSeq, kHidden / q}), x0s->spec(), &pg);
    auto o = lo->Forward(*merged);
    ASSERT_TRUE(o.ok()) << o.status();
    auto x1s = ColoTensor::FromLocal(*Add(x0s->variable(), o->variable()), x0s->spec(), &pg);
    auto h2s = ln2->Forward(*x1s);
    auto f = lfc->Forward(*h2s);
    auto g = ColoTensor::FromLocal(*Gelu(f->variable(), ops::GeluApprox::kTanh), f->spec(), &pg);
    auto m = lproj->Forward(*g);
    auto x2s = ColoTensor::FromLocal(*Add(x1s->variable(), m->variable()), x0s->spec(), &pg);
    auto lg = emb->TiedLogits(*x2s);
    ASSERT_TRUE(lg.ok()) << lg.status();
    const Tensor want_logits = logits.value().Chunk(0, blocks, b)->Contiguous();
    ExpectAllClose(lg->local(), want_logits, "logits", kTol);
    const Tensor my_labels = labels.Chunk(0, blocks, b)->Contiguous();
    Variable my_loss =
        *Sum(*CrossEntropy(*Reshape(lg->variable(), {kBatch / blocks * kSeq, kVocab}), my_labels));
    losses[rank] = SumAll(my_loss.value());
    ASSERT_TRUE(Backward(my_loss).ok());
    ExpectAllClose(*emb->weight().variable().grad(), *wte.grad()->Chunk(1, q, j), "tied embedding gradient", kTol);
    ExpectAllClose(*lq->weight().variable().grad(), *T(*wq.grad()).Chunk(0, q, i)->Chunk(1, q, j), "wq gradient", kTol);
    ExpectAllClose(*lfc->weight().variable().grad(), *T(*wfc.grad()).Chunk(0, q, i)->Chunk(1, q, j), "fc gradient", kTol);
    ExpectAllClose(*ln1->gamma().variable().grad(), *ln1g.grad()->Chunk(0, q, j), "ln1 gamma gradient", kTol);
  });
  // The batch blocks' losses add up to the whole loss (each row of ranks holds one block).
  double total = 0;
  for (int r = 0; r < depth * q * q; r += q) total += losses[r];
  EXPECT_NEAR(total, SumAll(loss.value()), 1e-3 * std::fabs(SumAll(loss.value())));
}

INSTANTIATE_TEST_SUITE_P(Modes, GptBlock2D, ::testing::Values(MeshCase{2, 1}, MeshCase{2, 2}),
                         [](const auto& info) { return info.param.depth == 1 ? "2d" : "2p5d"; });

}  // namespace
}  // namespace colod::nn
