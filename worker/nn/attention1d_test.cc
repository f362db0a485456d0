// A tensor-parallel attention block (q, k, v column-parallel, heads split
// over tp, output row-parallel) and a fused GPT-2 QKV projection, on real
// ranks against the unsharded computation from the same full tensors.
#include <cmath>

#include "gtest/gtest.h"
#include "worker/colo/testing.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear1d.h"

namespace colod::nn {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::TpDpMesh;
using ::colod::testing::ExpectAllClose;

constexpr double kTol = 1e-5;  // DESIGN.md section 7: 1e-5 for 1D

Tensor R(const Shape& s, uint64_t seed, float scale = 1.0f) { return *Scale(*Tensor::RandomNormal(s, seed), scale); }

struct AttentionCase {
  int tp, hq, hkv;
};

class Attention1D : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(Attention1D, HeadsSplitOverTpMatchTheUnshardedBlock) {
  // Named copies, not a structured binding: lambdas below capture them
  // (which C++17, and the fuzz pass's clang 14, do not allow of bindings).
  const int p = GetParam().tp;
  const int64_t hq = GetParam().hq, hkv = GetParam().hkv;
  const int64_t batch = 2, seq = 5, d = 4, h = hq * d, kvh = hkv * d;
  const float scale = 0.5f;  // 1 / sqrt(d)
  const Tensor x = R({batch, seq, h}, 1), wq = R({h, h}, 2, 0.3f), wk = R({kvh, h}, 3, 0.3f), wv = R({kvh, h}, 4, 0.3f),
               wo = R({h, h}, 5, 0.3f), bq = R({h}, 6), bk = R({kvh}, 7), bv = R({kvh}, 8), bo = R({h}, 9),
               r = R({batch, seq, h}, 10);
  // Unsharded.
  Variable vx(x, true), vwq(wq, true), vwk(wk, true), vwv(wv, true), vwo(wo, true);
  auto heads = [&](const Variable& t, int64_t n) { return *Reshape(t, {batch, seq, n, d}); };
  Variable o = *CausalAttention(heads(*Linear(vx, vwq, Variable(bq)), hq), heads(*Linear(vx, vwk, Variable(bk)), hkv),
                                heads(*Linear(vx, vwv, Variable(bv)), hkv), scale);
  Variable y = *Linear(*Reshape(o, {batch, seq, h}), vwo, Variable(bo));
  ASSERT_TRUE(Backward(*Sum(*Mul(y, Variable(r)))).ok());

  RunMesh(TpDpMesh(p), [&](int, ProcessGroup& pg) {
    const int k = *pg.tp_local_rank();
    auto q_proj = Linear1DCol::FromGlobal(wq, bq, &pg, {});
    auto k_proj = Linear1DCol::FromGlobal(wk, bk, &pg, {});
    auto v_proj = Linear1DCol::FromGlobal(wv, bv, &pg, {});
    auto o_proj = Linear1DRow::FromGlobal(wo, bo, &pg, {});
    ASSERT_TRUE(q_proj.ok() && k_proj.ok() && v_proj.ok() && o_proj.ok());
    auto in = ColoTensor::FromGlobal(x, DistSpec(), &pg, true);
    auto local_heads = [&](const ColoTensor& t, int64_t n) { return *Reshape(t.variable(), {batch, seq, n / p, d}); };
    Variable att = *CausalAttention(local_heads(*q_proj->Forward(*in), hq), local_heads(*k_proj->Forward(*in), hkv),
                                    local_heads(*v_proj->Forward(*in), hkv), scale);
    auto merged = ColoTensor::FromLocal(*Reshape(att, {batch, seq, h / p}),
                                        DistSpec().Set("tp", Placement::Shard({2}, {p})), &pg);
    auto out = o_proj->Forward(*merged);
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectAllClose(out->local(), y.value(), "output", kTol);
    ASSERT_TRUE(Backward(*Sum(*Mul(out->variable(), Variable(r)))).ok());
    ExpectAllClose(*in->variable().grad(), *vx.grad(), "input gradient", kTol);
    ExpectAllClose(*q_proj->weight().variable().grad(), *vwq.grad()->Chunk(0, p, k), "q weight gradient", kTol);
    ExpectAllClose(*k_proj->weight().variable().grad(), *vwk.grad()->Chunk(0, p, k), "k weight gradient", kTol);
    ExpectAllClose(*v_proj->weight().variable().grad(), *vwv.grad()->Chunk(0, p, k), "v weight gradient", kTol);
    ExpectAllClose(*o_proj->weight().variable().grad(), *vwo.grad()->Chunk(1, p, k), "o weight gradient", kTol);
  });
}

INSTANTIATE_TEST_SUITE_P(Heads, Attention1D,
                         ::testing::Values(AttentionCase{2, 4, 2},   // grouped-query: 2 q heads per kv head
                                           AttentionCase{4, 4, 4},   // multi-head
                                           AttentionCase{2, 6, 2}),  // 3 q heads per kv head
                         [](const auto& info) {
                           return "tp" + std::to_string(info.param.tp) + "_q" + std::to_string(info.param.hq) +
                                  "_kv" + std::to_string(info.param.hkv);
                         });

TEST(FusedQkv, Gpt2Conv1DLayoutKeepsQkvOrderWhenGathered) {
  const int64_t h = 12;
  const Tensor x = R({2, 3, h}, 11), c_attn = R({h, 3 * h}, 12), bias = R({3 * h}, 13);
  // GPT-2: y = x @ W + b with W [in, 3h]; columns are q | k | v.
  const Tensor want = *ops::BiasAdd(*ops::MatMul(x, c_attn), bias);
  RunMesh(TpDpMesh(2), [&](int, ProcessGroup& pg) {
    const int k = *pg.tp_local_rank();
    const Tensor w = *Conv1DToLinear(c_attn);
    auto gathered = Linear1DCol::FromGlobal(w, bias, &pg, {.gather_output = true, .fused = 3});
    auto sharded = Linear1DCol::FromGlobal(w, bias, &pg, {.fused = 3});
    ASSERT_TRUE(gathered.ok() && sharded.ok()) << gathered.status();
    EXPECT_EQ(sharded->weight().local().shape(), (Shape{3, h / 2, h}));
    auto in = ColoTensor::FromGlobal(x, DistSpec(), &pg);
    auto all = gathered->Forward(*in);
    ASSERT_TRUE(all.ok()) << all.status();
    ExpectAllClose(all->local(), want, "gathered q|k|v", kTol);
    // Sharded: this rank's heads of q, of k and of v.
    auto mine = sharded->Forward(*in);
    ASSERT_TRUE(mine.ok()) << mine.status();
    EXPECT_EQ(mine->local().shape(), (Shape{2, 3, 3, h / 2}));
    const Tensor by_part = *want.Reshape({2, 3, 3, h});
    ExpectAllClose(mine->local(), by_part.Chunk(3, 2, k)->Contiguous(), "local q|k|v", kTol);
    EXPECT_EQ(Linear1DCol::FromGlobal(*Tensor::Zeros({10, h}, DType::kF32), std::nullopt, &pg, {.fused = 3})
                  .status()
                  .code(),
              absl::StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace colod::nn
