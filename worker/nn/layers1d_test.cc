// 1D embeddings, vocab-parallel cross-entropy and tensor-parallel dropout on
// 2 and 4 ranks (threads over Gloo on loopback) against the unsharded kernels
// on the same full tensors.
#include <cmath>
#include <mutex>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/colo/testing.h"
#include "worker/nn/dropout.h"
#include "worker/nn/embedding1d.h"
#include "worker/nn/functional.h"
#include "worker/nn/vocab_cross_entropy.h"
#include "worker/tensor/ops.h"

namespace colod::nn {
namespace {

using ::colod::testing::RunMesh;
using ::colod::testing::Stats;
using ::colod::testing::TpDpMesh;
using ::colod::testing::ExpectAllClose;

constexpr double kTol = 1e-5;  // DESIGN.md section 7: 1e-5 for 1D

// Ids that hit every shard of a 64-row padded vocabulary, and its edges.
Tensor Ids() { return *Tensor::FromInt64s({2, 5}, {0, 15, 16, 31, 32, 49, 47, 3, 16, 48}); }

class Layers1D : public ::testing::TestWithParam<int> {};

TEST_P(Layers1D, VocabParallelEmbeddingMatchesTheFullTableWithPadding) {
  const int p = GetParam();
  const Tensor table = *Tensor::RandomNormal({50, 12}, 1), r = *Tensor::RandomNormal({2, 5, 12}, 2);
  // Reference: lookup and the table's gradient for loss = sum(out * r).
  Variable full(table, true);
  Variable ref = *Embedding(full, Ids());
  ASSERT_TRUE(Backward(*Sum(*Mul(ref, Variable(r)))).ok());
  const Tensor padded_grad = *Tensor::Cat({*full.grad(), *Tensor::Zeros({14, 12}, DType::kF32)}, 0);
  RunMesh(TpDpMesh(p), [&](int, ProcessGroup& pg) {
    const int k = *pg.tp_local_rank();
    auto emb = VocabParallelEmbedding1D::FromGlobal(table, &pg, {.pad_to_multiple_of = 16 / p});
    ASSERT_TRUE(emb.ok()) << emb.status();
    EXPECT_EQ(emb->padded_vocab_size(), 64);  // 50 -> a multiple of 16
    EXPECT_EQ(emb->weight().local().shape(), (Shape{64 / p, 12}));
    EXPECT_EQ(emb->vocab_start(), k * 64 / p);
    auto out = emb->Forward(Ids());
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectAllClose(out->local(), ref.value(), "lookup", kTol);
    ASSERT_TRUE(Backward(*Sum(*Mul(out->variable(), Variable(r)))).ok());
    ExpectAllClose(*emb->weight().variable().grad(), *padded_grad.Chunk(0, p, k), "table gradient", kTol);
    auto bad = emb->Forward(*Tensor::FromInt64s({2}, {3, 50}));
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("token id 50 at position 1"), absl::string_view::npos) << bad.status();
  });
}

TEST_P(Layers1D, Embedding1DGathersTheHiddenShards) {
  const int p = GetParam();
  const Tensor table = *Tensor::RandomNormal({50, 12}, 3), r = *Tensor::RandomNormal({2, 5, 12}, 4);
  Variable full(table, true);
  Variable ref = *Embedding(full, Ids());
  ASSERT_TRUE(Backward(*Sum(*Mul(ref, Variable(r)))).ok());
  RunMesh(TpDpMesh(p), [&](int, ProcessGroup& pg) {
    const int k = *pg.tp_local_rank();
    auto emb = Embedding1D::FromGlobal(table, &pg);
    ASSERT_TRUE(emb.ok()) << emb.status();
    auto out = emb->Forward(Ids());
    ASSERT_TRUE(out.ok()) << out.status();
    ExpectAllClose(out->local(), ref.value(), "lookup", kTol);
    ASSERT_TRUE(Backward(*Sum(*Mul(out->variable(), Variable(r)))).ok());
    ExpectAllClose(*emb->weight().variable().grad(), *full.grad()->Chunk(1, p, k), "table gradient", kTol);
  });
}

TEST_P(Layers1D, VocabParallelCrossEntropyEqualsTheUnshardedLoss) {
  const int p = GetParam();
  const int64_t n = 7, v = 50, vp = 64;
  const Tensor logits = *Scale(*Tensor::RandomNormal({n, vp}, 5), 3.0f);
  const Tensor labels = *Tensor::FromInt64s({n}, {0, 49, 16, -100, 31, 32, 15});
  const Tensor dloss = *Tensor::RandomNormal({n}, 6);
  const Tensor real = logits.Narrow(1, 0, v)->Contiguous();
  for (float s : {0.0f, 0.1f}) {
    const Tensor want = *ops::CrossEntropy(real, labels, s);
    const Tensor want_grad =
        *Tensor::Cat({*ops::CrossEntropyBackward(dloss, real, labels, s), *Tensor::Zeros({n, vp - v}, DType::kF32)},
                     1);
    RunMesh(
        TpDpMesh(p),
        [&](int, ProcessGroup& pg) {
          const int k = *pg.tp_local_rank();
          auto z = ColoTensor::FromGlobal(logits, DistSpec().Set("tp", Placement::Shard({1}, {p})), &pg, true);
          auto loss = VocabParallelCrossEntropy(*z, labels, v, s);
          ASSERT_TRUE(loss.ok()) << loss.status();
          // One all-gather of each rank's (max, sums), nothing else.
          EXPECT_EQ(Stats(pg, "tp", "all_gather").calls, 1);
          EXPECT_EQ(Stats(pg, "tp", "all_reduce").calls, 0);
          ExpectAllClose(loss->value(), want, "loss", kTol);
          ASSERT_TRUE(Backward(*loss, dloss).ok());
          EXPECT_EQ(Stats(pg, "tp", "all_gather").calls, 1) << "the backward is local";
          EXPECT_EQ(Stats(pg, "tp", "all_reduce").calls, 0) << "the backward is local";
          ExpectAllClose(*z->variable().grad(), *want_grad.Chunk(1, p, k), "logits gradient", kTol);
          auto bad = VocabParallelCrossEntropy(*z, *Tensor::FromInt64s({n}, {0, 1, 2, 3, 50, 5, 6}), v, s);
          EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
          EXPECT_NE(bad.status().message().find("label 50 at row 4"), absl::string_view::npos) << bad.status();
        },
        /*instrument=*/true);
  }
}

// The fused LM head and loss on p ranks against the unfused head and loss on
// one (x W^T on the whole weight, the cross-entropy over the real vocabulary,
// their gradients by autograd): the loss, hidden's gradient and each rank's
// block of the weight's, with chunks that do not divide the rows and one
// chunk for all, label smoothing and an ignored row. Both heads:
// VocabParallelLinearCrossEntropy (per-row losses, a gradient per row, the
// logits recomputed in backward) and VocabParallelLinearCrossEntropySum (the
// losses' sum, the gradients taken in forward and scaled by the sum's
// gradient in backward). Collectives: one all-gather per chunk forward, one
// all-reduce of hidden's gradient backward (none at p = 1).
void ExpectFusedHeadMatchesTheUnfused(int p) {
  const int64_t n = 11, h = 12, v = 50, vp = 64;
  const Tensor hidden = *Tensor::RandomNormal({n, h}, 7), weight = *Scale(*Tensor::RandomNormal({vp, h}, 8), 0.5f);
  const Tensor labels = *Tensor::FromInt64s({n}, {0, 49, 16, -100, 31, 32, 15, 7, 48, 1, 33});
  const Tensor dloss = *Tensor::RandomNormal({n}, 9);
  const float g = 0.37f;  // the sum's gradient
  const Tensor dsum = *Tensor::FromFloats({}, {g});
  for (float s : {0.0f, 0.1f}) {
    // The references: per-row gradients dloss, and g at every row.
    Variable hv(hidden, true), wv(weight, true), hs(hidden, true), ws(weight, true);
    Variable want = *CrossEntropy(*Narrow(*Linear(hv, wv, std::nullopt), 1, 0, v), labels, s);
    ASSERT_TRUE(Backward(want, dloss).ok());
    Variable want_rows = *CrossEntropy(*Narrow(*Linear(hs, ws, std::nullopt), 1, 0, v), labels, s);
    ASSERT_TRUE(Backward(want_rows, *BroadcastScalar(dsum, {n}, DType::kF32)).ok());
    const Tensor want_sum = *Tensor::FromFloats({}, {static_cast<float>(SumAll(want_rows.value()))});
    for (auto [chunk, sum] : {std::pair{int64_t{4}, false}, std::pair{int64_t{4}, true}, std::pair{int64_t{100}, false},
                              std::pair{int64_t{100}, true}}) {
      SCOPED_TRACE(absl::StrCat("tp ", p, ", smoothing ", s, ", chunks of ", chunk, sum ? ", summed" : ""));
      RunMesh(
          TpDpMesh(p),
          [&](int, ProcessGroup& pg) {
            const int k = *pg.tp_local_rank();
            const DistSpec spec = p == 1 ? DistSpec() : DistSpec().Set("tp", Placement::Shard({0}, {p}));
            auto w = ColoTensor::FromGlobal(weight, spec, &pg, /*requires_grad=*/true);
            ASSERT_TRUE(w.ok()) << w.status();
            Variable x(hidden, true);
            auto loss = sum ? VocabParallelLinearCrossEntropySum(x, *w, labels, v, chunk, s)
                            : VocabParallelLinearCrossEntropy(x, *w, labels, v, chunk, s);
            ASSERT_TRUE(loss.ok()) << loss.status();
            const int chunks = static_cast<int>((n + chunk - 1) / chunk);
            if (p > 1) {
              EXPECT_EQ(Stats(pg, "tp", "all_gather").calls, chunks);
              EXPECT_EQ(Stats(pg, "tp", "all_reduce").calls, 0);
            }
            ExpectAllClose(loss->value(), sum ? want_sum : want.value(), "loss", kTol);
            ASSERT_TRUE(Backward(*loss, sum ? dsum : dloss).ok());
            if (p > 1) {
              EXPECT_EQ(Stats(pg, "tp", "all_gather").calls, chunks) << "the backward is local";
              EXPECT_EQ(Stats(pg, "tp", "all_reduce").calls, 1) << "hidden's gradient, once";
            }
            ExpectAllClose(*x.grad(), *(sum ? hs : hv).grad(), "hidden gradient", kTol);
            ExpectAllClose(*w->variable().grad(), *(sum ? ws : wv).grad()->Chunk(0, p, k), "weight gradient", kTol);
            // Refusals, before any collective.
            for (const bool summed : {false, true}) {
              auto head = [&](const Variable& xx, const Tensor& ll, int64_t vv, int64_t cc) {
                return summed ? VocabParallelLinearCrossEntropySum(xx, *w, ll, vv, cc, s)
                              : VocabParallelLinearCrossEntropy(xx, *w, ll, vv, cc, s);
              };
              EXPECT_EQ(head(x, labels, v, 0).status().code(), absl::StatusCode::kInvalidArgument);
              EXPECT_EQ(head(x, labels, vp + 1, chunk).status().code(), absl::StatusCode::kInvalidArgument);
              auto bad = head(x, *Tensor::FromInt64s({n}, {0, 1, 2, 3, 50, 5, 6, 7, 8, 9, 10}), v, chunk);
              EXPECT_NE(bad.status().message().find("label 50 at row 4"), absl::string_view::npos) << bad.status();
              EXPECT_EQ(head(Variable(*Tensor::Zeros({n, h + 1}, DType::kF32)), labels, v, chunk).status().code(),
                        absl::StatusCode::kInvalidArgument);
            }
          },
          /*instrument=*/true);
    }
  }
}

TEST_P(Layers1D, FusedLinearCrossEntropyEqualsTheUnfusedHeadAndLoss) { ExpectFusedHeadMatchesTheUnfused(GetParam()); }

TEST(Layers1DOneRank, FusedLinearCrossEntropyEqualsTheUnfusedHeadAndLoss) { ExpectFusedHeadMatchesTheUnfused(1); }

TEST_P(Layers1D, DropoutMasksDifferForParallelInputAndMatchForReplicatedInput) {
  const int p = GetParam();
  const Tensor x = *Tensor::RandomNormal({8, 9}, 7);
  std::mutex mu;
  std::vector<std::vector<float>> parallel(p), replicated(p), second(p);
  RunMesh(TpDpMesh(p), [&](int rank, ProcessGroup& pg) {
    auto t = ColoTensor::FromGlobal(x, DistSpec(), &pg);
    auto par = TensorParallelDropout::Create(0.5f, 1234, TensorParallelDropout::Input::kParallel);
    auto rep = TensorParallelDropout::Create(0.5f, 1234, TensorParallelDropout::Input::kReplicated);
    ASSERT_TRUE(par.ok() && rep.ok());
    auto a = par->Forward(*t);
    auto b = rep->Forward(*t);
    auto c = rep->Forward(*t);  // the next call draws a fresh mask
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    EXPECT_EQ(rep->Forward(*t, /*train=*/false)->local().ToFloats(), x.ToFloats());
    std::lock_guard<std::mutex> lock(mu);
    parallel[rank] = a->local().ToFloats();
    replicated[rank] = b->local().ToFloats();
    second[rank] = c->local().ToFloats();
  });
  for (int r = 1; r < p; ++r) {
    EXPECT_NE(parallel[r], parallel[0]) << "rank " << r;
    EXPECT_EQ(replicated[r], replicated[0]) << "rank " << r;
  }
  EXPECT_NE(second[0], replicated[0]);
  EXPECT_EQ(TensorParallelDropout::Create(1.0f, 1, TensorParallelDropout::Input::kParallel).status().code(),
            absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(Ranks, Layers1D, ::testing::Values(2, 4));

}  // namespace
}  // namespace colod::nn
