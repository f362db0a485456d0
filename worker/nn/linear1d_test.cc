// 1D tensor-parallel layers on 2 and 4 ranks (threads over Gloo on loopback)
// against the unsharded computation from the same full tensors.
#include "worker/nn/linear1d.h"

#include <cmath>

#include "gtest/gtest.h"
#include "worker/colo/testing.h"
#include "worker/nn/functional.h"
#include "worker/nn/norm.h"

namespace colod::nn {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::Stats;
using ::colod::testing::TpDpMesh;
using ::colod::testing::ExpectAllClose;

constexpr double kTol = 1e-5;  // DESIGN.md section 7: 1e-5 for 1D

struct Mlp {
  Tensor x, w1, b1, w2, b2, r;  // r weighs the output in the loss
};

Mlp MakeMlp(int64_t hidden, int64_t ffn) {
  return {*Tensor::RandomNormal({3, 5, hidden}, 1), *Scale(*Tensor::RandomNormal({ffn, hidden}, 2), 0.3f),
          *Tensor::RandomNormal({ffn}, 3), *Scale(*Tensor::RandomNormal({hidden, ffn}, 4), 0.2f),
          *Tensor::RandomNormal({hidden}, 5), *Tensor::RandomNormal({3, 5, hidden}, 6)};
}

struct Reference {
  Tensor y, dx, dw1, db1, dw2, db2;
};

// loss = sum(Linear(Gelu(Linear(x, w1, b1)), w2, b2) * r), on one rank.
Reference Unsharded(const Mlp& m) {
  Variable x(m.x, true), w1(m.w1, true), b1(m.b1, true), w2(m.w2, true), b2(m.b2, true);
  Variable h = *Gelu(*Linear(x, w1, b1), ops::GeluApprox::kTanh);
  Variable y = *Linear(h, w2, b2);
  EXPECT_TRUE(Backward(*Sum(*Mul(y, Variable(m.r)))).ok());
  return {y.value(), *x.grad(), *w1.grad(), *b1.grad(), *w2.grad(), *b2.grad()};
}

class Linear1D : public ::testing::TestWithParam<int> {};

TEST_P(Linear1D, ColThenRowMlpMatchesTheUnshardedModelWithOneAllReduceEachWay) {
  const int p = GetParam();
  const Mlp m = MakeMlp(12, 36);  // 36 = 3 * 12: not a power of two
  const Reference ref = Unsharded(m);
  RunMesh(
      TpDpMesh(p),
      [&](int rank, ProcessGroup& pg) {
        const int k = *pg.tp_local_rank();
        auto col = Linear1DCol::FromGlobal(m.w1, m.b1, &pg, {});
        auto row = Linear1DRow::FromGlobal(m.w2, m.b2, &pg, {});
        ASSERT_TRUE(col.ok() && row.ok()) << col.status() << row.status();
        EXPECT_EQ(col->weight().local().shape(), (Shape{36 / p, 12}));
        EXPECT_EQ(row->weight().local().shape(), (Shape{12, 36 / p}));
        auto x = ColoTensor::FromGlobal(m.x, DistSpec(), &pg, /*requires_grad=*/true);
        ASSERT_TRUE(x.ok());
        auto h = col->Forward(*x);
        ASSERT_TRUE(h.ok()) << h.status();
        EXPECT_EQ(h->local().shape(), (Shape{3, 5, 36 / p}));
        auto act = ColoTensor::FromLocal(*Gelu(h->variable(), ops::GeluApprox::kTanh), h->spec(), &pg);
        auto y = row->Forward(*act);
        ASSERT_TRUE(y.ok()) << y.status();
        EXPECT_EQ(Stats(pg, "tp", "all_reduce").calls, 1) << "forward";
        EXPECT_EQ(Stats(pg, "tp", "all_reduce").bytes, 3 * 5 * 12 * 4) << "the [3, 5, 12] f32 output";
        ExpectAllClose(y->local(), ref.y, "output", kTol);

        ASSERT_TRUE(Backward(*Sum(*Mul(y->variable(), Variable(m.r)))).ok());
        EXPECT_EQ(Stats(pg, "tp", "all_reduce").calls, 2) << "forward + backward";
        EXPECT_EQ(Stats(pg, "tp", "all_gather").calls, 0);
        ExpectAllClose(*x->variable().grad(), ref.dx, "input gradient", kTol);
        ExpectAllClose(*col->weight().variable().grad(), *ref.dw1.Chunk(0, p, k), "col weight gradient", kTol);
        ExpectAllClose(*col->bias()->variable().grad(), *ref.db1.Chunk(0, p, k), "col bias gradient", kTol);
        ExpectAllClose(*row->weight().variable().grad(), *ref.dw2.Chunk(1, p, k), "row weight gradient", kTol);
        ExpectAllClose(*row->bias()->variable().grad(), ref.db2, "row bias gradient", kTol);
        (void)rank;
      },
      /*instrument=*/true);
}

TEST_P(Linear1D, SumPartialAddBiasSumsInTheInputsOwnBufferAndPassesTheGradientThrough) {
  const int p = GetParam();
  std::vector<Tensor> parts;  // rank k's partial sums
  for (int k = 0; k < p; ++k) parts.push_back(*Tensor::RandomNormal({3, 5, 12}, 20 + k));
  const Tensor bias = *Tensor::RandomNormal({12}, 30), r = *Tensor::RandomNormal({3, 5, 12}, 31);
  std::vector<double> sum(3 * 5 * 12, 0.0), want_db(12, 0.0);
  for (const Tensor& t : parts) {
    const std::vector<float> v = t.ToFloats();
    for (size_t i = 0; i < v.size(); ++i) sum[i] += v[i];
  }
  const std::vector<float> bv = bias.ToFloats(), rv = r.ToFloats();
  std::vector<float> want(sum.size()), want_biased(sum.size());
  for (size_t i = 0; i < sum.size(); ++i) {
    want[i] = static_cast<float>(sum[i]);
    want_biased[i] = static_cast<float>(sum[i] + bv[i % 12]);
    want_db[i % 12] += rv[i];
  }
  RunMesh(TpDpMesh(p), [&](int, ProcessGroup& pg) {
    const int k = *pg.tp_local_rank();
    Communicator* comm = *pg.Comm("tp");
    for (bool with_bias : {true, false}) {
      const std::string what = with_bias ? "with the bias" : "without a bias";
      Variable x(parts[k].Clone(), /*requires_grad=*/true), b(bias, /*requires_grad=*/true);
      const void* buffer = x.value().raw_data();
      std::optional<Variable> maybe_b;
      if (with_bias) maybe_b = b;
      auto y = SumPartialAddBias(x, maybe_b, comm, pg.timeout());
      ASSERT_TRUE(y.ok()) << y.status();
      EXPECT_EQ(y->value().raw_data(), buffer) << what << ": the sum is written over the partial, not a copy";
      ExpectAllClose(y->value(), *Tensor::FromFloats({3, 5, 12}, with_bias ? want_biased : want), what, kTol);
      ASSERT_TRUE(Backward(*Sum(*Mul(*y, Variable(r)))).ok());
      ExpectAllClose(*x.grad(), r, what + ": dx = dy", 0);
      if (with_bias) {
        std::vector<float> db(want_db.begin(), want_db.end());
        ExpectAllClose(*b.grad(), *Tensor::FromFloats({12}, db), "db = dy summed over the rows", kTol);
      } else {
        EXPECT_FALSE(b.grad().has_value());
      }
    }
  });
}

TEST_P(Linear1D, GatherOutputAndReplicatedRowInputMatchTheUnshardedLayers) {
  const int p = GetParam();
  const Mlp m = MakeMlp(12, 36);
  // Col with gather_output, then Row slicing its replicated input itself.
  Variable x0(m.x, true), w1(m.w1, true), w2(m.w2, true);
  Variable ref_h = *Linear(x0, w1, std::nullopt);
  Variable ref_y = *Linear(ref_h, w2, std::nullopt);
  ASSERT_TRUE(Backward(*Sum(*Mul(ref_y, Variable(m.r)))).ok());
  RunMesh(TpDpMesh(p), [&](int, ProcessGroup& pg) {
    const int k = *pg.tp_local_rank();
    auto col = Linear1DCol::FromGlobal(m.w1, std::nullopt, &pg, {.gather_output = true});
    auto row = Linear1DRow::FromGlobal(m.w2, std::nullopt, &pg, {.parallel_input = false});
    auto x = ColoTensor::FromGlobal(m.x, DistSpec(), &pg, true);
    auto h = col->Forward(*x);
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_EQ(h->spec().Get("tp"), Placement::Replicate());
    ExpectAllClose(h->local(), ref_h.value(), "gathered output", kTol);
    auto y = row->Forward(*h);
    ASSERT_TRUE(y.ok()) << y.status();
    ExpectAllClose(y->local(), ref_y.value(), "output", kTol);
    ASSERT_TRUE(Backward(*Sum(*Mul(y->variable(), Variable(m.r)))).ok());
    ExpectAllClose(*x->variable().grad(), *x0.grad(), "input gradient", kTol);
    ExpectAllClose(*col->weight().variable().grad(), *w1.grad()->Chunk(0, p, k), "col weight gradient", kTol);
    ExpectAllClose(*row->weight().variable().grad(), *w2.grad()->Chunk(1, p, k), "row weight gradient", kTol);
    // A Row layer with parallel_input refuses a replicated input.
    auto strict = Linear1DRow::FromGlobal(m.w2, std::nullopt, &pg, {});
    EXPECT_EQ(strict->Forward(*h).status().code(), absl::StatusCode::kInvalidArgument);
  });
}

TEST_P(Linear1D, SequenceParallelNormAndMlpMatchTheUnshardedBlock) {
  const int p = GetParam();
  const int64_t batch = 2, seq = 8, hidden = 12, ffn = 36;
  const Tensor x = *Tensor::RandomNormal({batch, seq, hidden}, 11), gamma = *Tensor::RandomNormal({hidden}, 12),
               beta = *Tensor::RandomNormal({hidden}, 13), w1 = *Scale(*Tensor::RandomNormal({ffn, hidden}, 14), 0.3f),
               b1 = *Tensor::RandomNormal({ffn}, 15), w2 = *Scale(*Tensor::RandomNormal({hidden, ffn}, 16), 0.2f),
               b2 = *Tensor::RandomNormal({hidden}, 17), r = *Tensor::RandomNormal({batch, seq, hidden}, 18);
  for (Norm1D::Kind kind : {Norm1D::Kind::kLayerNorm, Norm1D::Kind::kRmsNorm}) {
    const bool ln = kind == Norm1D::Kind::kLayerNorm;
    Variable vx(x, true), vg(gamma, true), vb(beta, true), vw1(w1, true), vb1(b1, true), vw2(w2, true), vb2(b2, true);
    Variable h = ln ? *LayerNorm(vx, vg, vb, 1e-5f) : *RmsNorm(vx, vg, 1e-5f);
    Variable y = *Linear(*Gelu(*Linear(h, vw1, vb1), ops::GeluApprox::kTanh), vw2, vb2);
    ASSERT_TRUE(Backward(*Sum(*Mul(y, Variable(r)))).ok());
    RunMesh(
        TpDpMesh(p),
        [&](int, ProcessGroup& pg) {
          const int k = *pg.tp_local_rank();
          auto norm = Norm1D::FromGlobal(gamma, ln ? std::optional<Tensor>(beta) : std::nullopt, &pg,
                                         {.kind = kind, .sequence_parallel = true});
          auto col = Linear1DCol::FromGlobal(w1, b1, &pg, {.sequence_parallel = true});
          auto row = Linear1DRow::FromGlobal(w2, b2, &pg, {.sequence_parallel = true});
          ASSERT_TRUE(norm.ok() && col.ok() && row.ok()) << norm.status();
          auto in = ColoTensor::FromGlobal(x, DistSpec().Set("tp", Placement::Shard({1}, {p})), &pg, true);
          EXPECT_EQ(in->local().shape(), (Shape{batch, seq / p, hidden}));
          auto hn = norm->Forward(*in);
          ASSERT_TRUE(hn.ok()) << hn.status();
          auto mid = col->Forward(*hn);
          ASSERT_TRUE(mid.ok()) << mid.status();
          auto act = ColoTensor::FromLocal(*Gelu(mid->variable(), ops::GeluApprox::kTanh), mid->spec(), &pg);
          auto out = row->Forward(*act);
          ASSERT_TRUE(out.ok()) << out.status();
          EXPECT_EQ(out->spec().Get("tp"), Placement::Shard({1}, {p}));
          ExpectAllClose(out->local(), *y.value().Chunk(1, p, k), "output rows", kTol);
          // Forward: one all-gather into the tp region and one reduce-scatter out of it.
          EXPECT_EQ(Stats(pg, "tp", "all_gather").calls, 1);
          EXPECT_EQ(Stats(pg, "tp", "reduce_scatter").calls, 1);
          EXPECT_EQ(Stats(pg, "tp", "all_reduce").calls, 0);
          ASSERT_TRUE(Backward(*Sum(*Mul(out->variable(), Variable(*r.Chunk(1, p, k))))).ok());
          // Backward: the row-parallel output's gradient gathered, the
          // column-parallel input gathered again (only its shard was kept)
          // and its gradient reduce-scattered.
          EXPECT_EQ(Stats(pg, "tp", "all_gather").calls, 3);
          EXPECT_EQ(Stats(pg, "tp", "reduce_scatter").calls, 2);
          ExpectAllClose(*in->variable().grad(), *vx.grad()->Chunk(1, p, k), "input gradient", kTol);
          ExpectAllClose(*norm->gamma().variable().grad(), *vg.grad(), "gamma gradient", kTol);
          if (ln) ExpectAllClose(*norm->beta()->variable().grad(), *vb.grad(), "beta gradient", kTol);
          ExpectAllClose(*col->weight().variable().grad(), *vw1.grad()->Chunk(0, p, k), "col weight gradient", kTol);
          ExpectAllClose(*row->weight().variable().grad(), *vw2.grad()->Chunk(1, p, k), "row weight gradient", kTol);
          ExpectAllClose(*row->bias()->variable().grad(), *vb2.grad(), "row bias gradient", kTol);
        },
        /*instrument=*/true);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, Linear1D, ::testing::Values(2, 4));

TEST(Linear1DErrors, IndivisibleOrMisshapedWeightsAreInvalidArgument) {
  RunMesh(TpDpMesh(4), [](int, ProcessGroup& pg) {
    auto odd = Linear1DCol::FromGlobal(*Tensor::Zeros({6, 8}, DType::kF32), std::nullopt, &pg, {});
    EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(odd.status().message().find("weight"), absl::string_view::npos) << odd.status();
    EXPECT_NE(odd.status().message().find("dim 0 of size 6"), absl::string_view::npos) << odd.status();
    auto bias = Linear1DRow::FromGlobal(*Tensor::Zeros({8, 8}, DType::kF32), *Tensor::Zeros({7}, DType::kF32), &pg, {});
    EXPECT_EQ(bias.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bias.status().message().find("bias must be [8]"), absl::string_view::npos) << bias.status();
  });
}

}  // namespace
}  // namespace colod::nn
