// ColoTensor conversions on real ranks (threads) over Gloo on loopback, each
// checked against slicing or summing the global tensor.
#include "worker/colo/colo_tensor.h"

#include <functional>
#include <thread>

#include "gtest/gtest.h"
#include "common/rendezvous_store.h"
#include "worker/colo/testing.h"

namespace colod {
namespace {

using ::colod::testing::RunMesh;

DeviceMesh TpMesh(int tp, int dp = 1) { return ::colod::testing::TpDpMesh(tp, dp); }

// Small integers: every sum below is exact in f32.
Tensor IntTensor(const Shape& shape, int salt = 0) {
  std::vector<float> v(NumElements(shape));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>((i * 7 + salt) % 13) - 6.0f;
  return *Tensor::FromFloats(shape, v);
}

DistSpec Tp(Placement p) { return DistSpec().Set("tp", std::move(p)); }

void ExpectSame(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  ASSERT_EQ(got.ToFloats(), want.ToFloats()) << what;
}

TEST(ColoTensor, ColoTensorDocumentExampleOnFourRanks) {
  // tp=2, dp=2; every rank draws the same local [2,3,1] from seed 0 and
  // declares it its shard of the last dim (as the document does).
  RunMesh(TpMesh(2, 2), [](int rank, ProcessGroup& pg) {
    Tensor local = *Tensor::RandomNormal({2, 3, 1}, 0);
    auto t1 = ColoTensor::FromLocal(local, Tp(Placement::Shard({-1}, {2})), &pg);
    ASSERT_TRUE(t1.ok()) << t1.status();
    EXPECT_EQ(t1->global_shape(), (Shape{2, 3, 2}));
    auto rep = t1->ToReplicate();
    ASSERT_TRUE(rep.ok()) << rep.status();
    Tensor global = *Tensor::Cat({local, local}, 2);
    ExpectSame(rep->local(), global, "replicated");
    ASSERT_TRUE(rep->SetDistSpec(Tp(Placement::Shard({0}, {2}))).ok());
    ExpectSame(rep->local(), *global.Narrow(0, rank % 2, 1), "sharded on dim 0");
    // The compute spec travels with the tensor through conversions.
    t1->set_compute_spec({ComputePattern::kTP1D});
    auto again = t1->ToReplicate();
    EXPECT_EQ(again->compute_spec().pattern, ComputePattern::kTP1D);
    EXPECT_EQ(rep->local().shape(), (Shape{1, 3, 2}));
  });
}

class ColoConversions : public ::testing::TestWithParam<int> {};

TEST_P(ColoConversions, EveryConversionMatchesTheGlobalTensor) {
  const int n = GetParam();
  const Shape shape = {12, 12, 5};
  RunMesh(TpMesh(n), [&](int rank, ProcessGroup& pg) {
    const Tensor global = IntTensor(shape);
    const int k = *pg.tp_local_rank();
    auto s0 = ColoTensor::FromGlobal(global, Tp(Placement::Shard({0}, {n})), &pg);
    ASSERT_TRUE(s0.ok()) << s0.status();
    ExpectSame(s0->local(), *global.Chunk(0, n, k), "R -> S(0)");
    EXPECT_EQ(s0->local().nbytes(), global.nbytes() / n);

    auto r = s0->ToReplicate();
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectSame(r->local(), global, "S(0) -> R");

    auto s1 = s0->Redistribute(Tp(Placement::Shard({1}, {n})));
    ASSERT_TRUE(s1.ok()) << s1.status();
    ExpectSame(s1->local(), *global.Chunk(1, n, k), "S(0) -> S(1)");

    // Partial: rank k holds (k+1) * global; the value is sum_k (k+1) * global.
    Tensor mine = *Scale(global, static_cast<float>(k + 1));
    auto p = ColoTensor::FromLocal(mine, Tp(Placement::Partial()), &pg);
    ASSERT_TRUE(p.ok());
    const Tensor total = *Scale(global, n * (n + 1) / 2.0f);
    ExpectSame(p->ToReplicate()->local(), total, "P -> R");
    auto ps = p->Redistribute(Tp(Placement::Shard({1}, {n})));
    ASSERT_TRUE(ps.ok()) << ps.status();
    ExpectSame(ps->local(), *total.Chunk(1, n, k), "P -> S(1)");

    auto rp = r->Redistribute(Tp(Placement::Partial()));
    ASSERT_TRUE(rp.ok());
    ExpectSame(rp->local(), k == 0 ? global : *Tensor::Zeros(shape, DType::kF32), "R -> P");
    ExpectSame(rp->ToReplicate()->local(), global, "R -> P -> R");
    (void)rank;
  });
}

// loss = sum(out ⊙ w) on every rank; the gradient of the summed loss with
// respect to the unsharded input is known in closed form (W or a slice of it).
Tensor LossGrad(const ColoTensor& out, const Tensor& w, const Variable& input) {
  Variable loss = *Sum(*Mul(out.variable(), Variable(w)));
  absl::Status s = Backward(loss);
  EXPECT_TRUE(s.ok()) << s;
  return input.grad().value_or(Tensor());
}

TEST_P(ColoConversions, BackwardRunsTheReverseCollective) {
  const int n = GetParam();
  const Shape shape = {12, 12, 5};
  RunMesh(TpMesh(n), [&](int rank, ProcessGroup& pg) {
    const Tensor x = *Tensor::RandomNormal(shape, 1);
    const Tensor w = *Tensor::RandomNormal(shape, 2);  // the same on every rank
    const int k = *pg.tp_local_rank();
    const Tensor w0 = *w.Chunk(0, n, k), w1 = *w.Chunk(1, n, k);

    // S(0) -> R (all-gather); backward slices: the shard's gradient is W's slice.
    Variable xs(x.Chunk(0, n, k)->Clone(), true);
    auto r = ColoTensor::FromLocal(xs, Tp(Placement::Shard({0}, {n})), &pg)->ToReplicate();
    ASSERT_TRUE(r.ok()) << r.status();
    ExpectSame(LossGrad(*r, w, xs), w0, "S -> R backward");

    // R -> S(1) (slice); backward all-gathers: the replicated input's gradient is W.
    Variable xr(x.Clone(), true);
    auto s1 = ColoTensor::FromLocal(xr, DistSpec(), &pg)->Redistribute(Tp(Placement::Shard({1}, {n})));
    ASSERT_TRUE(s1.ok());
    ExpectSame(LossGrad(*s1, w1, xr), w, "R -> S backward");

    // S(0) -> S(1): one all-to-all, reversed (S(1) -> S(0)) in backward.
    Variable xs2(x.Chunk(0, n, k)->Clone(), true);
    auto moved = ColoTensor::FromLocal(xs2, Tp(Placement::Shard({0}, {n})), &pg)
                     ->Redistribute(Tp(Placement::Shard({1}, {n})));
    ASSERT_TRUE(moved.ok());
    const std::string ns = std::to_string(n);
    EXPECT_EQ(moved->variable().op_name(), "redistribute tp S(0|" + ns + ")->S(1|" + ns + ")");
    ExpectSame(LossGrad(*moved, w1, xs2), w0, "S(0) -> S(1) backward");

    // P -> S(1) (reduce-scatter); backward all-gathers: each operand's gradient is W.
    Variable xp(*Scale(x, static_cast<float>(k + 1)), true);
    auto ps = ColoTensor::FromLocal(xp, Tp(Placement::Partial()), &pg)->Redistribute(Tp(Placement::Shard({1}, {n})));
    ASSERT_TRUE(ps.ok());
    ExpectSame(LossGrad(*ps, w1, xp), w, "P -> S backward");

    // P -> R (all-reduce); backward is the identity.
    Variable xp2(*Scale(x, static_cast<float>(k + 1)), true);
    auto pr = ColoTensor::FromLocal(xp2, Tp(Placement::Partial()), &pg)->ToReplicate();
    ASSERT_TRUE(pr.ok());
    ExpectSame(LossGrad(*pr, w, xp2), w, "P -> R backward");
    (void)rank;
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, ColoConversions, ::testing::Values(2, 3, 4));

TEST(ColoTensor, TwoDimShardGivesRowMajorBlocks) {
  RunMesh(TpMesh(4), [](int rank, ProcessGroup& pg) {
    const Tensor global = IntTensor({32, 32}, 3);
    auto t = ColoTensor::FromGlobal(global, Tp(Placement::Shard({0, 1}, {2, 2})), &pg);
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->local().shape(), (Shape{16, 16}));
    EXPECT_EQ(t->local().nbytes(), global.nbytes() / 4);
    ExpectSame(t->local(), *global.Narrow(0, 16 * (rank / 2), 16)->Narrow(1, 16 * (rank % 2), 16), "block");
    ExpectSame(t->ToReplicate()->local(), global, "gathered blocks");
  });
}

TEST(ColoTensor, ShardsOnTwoAxesOfATpDpMesh) {
  // tp shards dim 0, dp shards dim 1: rank r holds block (r % 2, r / 2).
  RunMesh(TpMesh(2, 2), [](int rank, ProcessGroup& pg) {
    const Tensor global = IntTensor({6, 10}, 1);
    DistSpec spec = DistSpec().Set("tp", Placement::Shard({0}, {2})).Set("dp", Placement::Shard({1}, {2}));
    auto t = ColoTensor::FromGlobal(global, spec, &pg);
    ASSERT_TRUE(t.ok()) << t.status();
    ExpectSame(t->local(), *global.Narrow(0, 3 * (rank % 2), 3)->Narrow(1, 5 * (rank / 2), 5), "2-axis shard");
    ExpectSame(t->ToReplicate()->local(), global, "2-axis gather");
    // Move the dim-0 shard from tp to dp: dp's dim 1 must be gathered first.
    auto moved = t->Redistribute(DistSpec().Set("dp", Placement::Shard({0}, {2})));
    ASSERT_TRUE(moved.ok()) << moved.status();
    ExpectSame(moved->local(), *global.Chunk(0, 2, rank / 2), "dp shard of dim 0");
  });
}

// Replaces Partial by Replicate: the gradient of a partial operand is the
// gradient of the value.
DistSpec GradSpec(const DistSpec& spec) {
  DistSpec out;
  for (const auto& [axis, p] : spec.placements()) {
    out.Set(axis, p.kind == Placement::Kind::kPartial ? Placement::Replicate() : p);
  }
  return out;
}

// Every pair (a, b) of `specs`: Redistribute(a -> b) equals slicing the
// global tensor under b (forward), and the input's gradient equals W sliced
// under a when each rank's loss is sum(out ⊙ W sliced under b) (backward).
void SweepAllPairs(const DeviceMesh& mesh, const Shape& shape, const std::vector<DistSpec>& specs) {
  RunMesh(mesh, [&](int rank, ProcessGroup& pg) {
    const Tensor x = IntTensor(shape, 5);
    const Tensor w = IntTensor(shape, 2);
    for (const DistSpec& a : specs) {
      for (const DistSpec& b : specs) {
        const std::string what = a.ToString() + " -> " + b.ToString() + " on rank " + std::to_string(rank);
        auto src = ColoTensor::FromGlobal(x, a, &pg, /*requires_grad=*/true);
        ASSERT_TRUE(src.ok()) << what << ": " << src.status();
        auto got = src->Redistribute(b);
        ASSERT_TRUE(got.ok()) << what << ": " << got.status();
        ExpectSame(got->local(), ColoTensor::FromGlobal(x, b, &pg)->local(), what);
        EXPECT_EQ(got->global_shape(), shape);
        const Tensor wb = ColoTensor::FromGlobal(w, GradSpec(b), &pg)->local();
        const Variable input = src->variable();
        ExpectSame(LossGrad(*got, wb, input), ColoTensor::FromGlobal(w, GradSpec(a), &pg)->local(),
                   what + " (gradient)");
      }
    }
  });
}

TEST(ColoTensor, AllPairsOnADpTpMeshIncludingNestedShards) {
  using P = Placement;
  auto spec = [](std::initializer_list<std::pair<std::string, Placement>> l) {
    DistSpec s;
    for (const auto& [axis, p] : l) s.Set(axis, p);
    return s;
  };
  const std::vector<DistSpec> specs = {
      DistSpec(),
      spec({{"tp", P::Shard({0}, {2})}}),
      spec({{"tp", P::Shard({1}, {2})}}),
      spec({{"dp", P::Shard({0}, {2})}}),
      spec({{"dp", P::Shard({0}, {2})}, {"tp", P::Shard({0}, {2})}}),  // dim 0 in quarters
      spec({{"tp", P::Shard({0}, {2})}, {"dp", P::Shard({0}, {2})}}),  // the same, listed the other way
      spec({{"dp", P::Shard({0}, {2})}, {"tp", P::Shard({1}, {2})}}),
      spec({{"dp", P::Shard({1}, {2})}, {"tp", P::Shard({1}, {2})}}),
      spec({{"tp", P::Partial()}}),
      spec({{"dp", P::Partial()}, {"tp", P::Shard({0}, {2})}}),
      spec({{"dp", P::Shard({1}, {2})}, {"tp", P::Partial()}}),
  };
  SweepAllPairs(TpMesh(2, 2), {12, 20, 3}, specs);
}

TEST(ColoTensor, AllPairsOnATwoDimensionalTensorParallelMesh) {
  // dp=2 and 2D tp (tp_col x tp_row = 2 x 2): 8 ranks, three axes.
  v1::ShardConfig s;
  s.set_tensor_parallel_size(4);
  s.set_data_parallel_size(2);
  s.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
  using P = Placement;
  auto spec = [](std::initializer_list<std::pair<std::string, Placement>> l) {
    DistSpec d;
    for (const auto& [axis, p] : l) d.Set(axis, p);
    return d;
  };
  const std::vector<DistSpec> specs = {
      DistSpec(),
      spec({{"tp_col", P::Shard({0}, {2})}, {"tp_row", P::Shard({1}, {2})}}),  // SUMMA blocks
      spec({{"tp_row", P::Shard({0}, {2})}, {"tp_col", P::Shard({1}, {2})}}),  // transposed blocks
      spec({{"tp", P::Shard({0, 1}, {2, 2})}}),
      spec({{"dp", P::Shard({0}, {2})}, {"tp_col", P::Shard({0}, {2})}, {"tp_row", P::Shard({0}, {2})}}),
      spec({{"dp", P::Shard({1}, {2})}, {"tp_row", P::Partial()}}),
  };
  SweepAllPairs(*DeviceMesh::FromShardConfig(s), {24, 6}, specs);
}

TEST(ColoTensor, NestedShardsHoldMeshOrderedBlocks) {
  // {dp: S(0|2), tp: S(0|2)}: dp takes the half, tp the quarter inside it,
  // whatever order the spec lists them in; rank r holds quarter r.
  RunMesh(TpMesh(2, 2), [](int rank, ProcessGroup& pg) {
    const Tensor global = IntTensor({8, 3});
    for (bool dp_first : {true, false}) {
      DistSpec s;
      if (dp_first) s.Set("dp", Placement::Shard({0}, {2}));
      s.Set("tp", Placement::Shard({0}, {2}));
      if (!dp_first) s.Set("dp", Placement::Shard({0}, {2}));
      auto t = ColoTensor::FromGlobal(global, s, &pg);
      ASSERT_TRUE(t.ok()) << t.status();
      ExpectSame(t->local(), *global.Narrow(0, 2 * rank, 2), "quarter");
    }
    auto odd = ColoTensor::FromGlobal(IntTensor({6, 3}), DistSpec()
                                                             .Set("dp", Placement::Shard({0}, {2}))
                                                             .Set("tp", Placement::Shard({0}, {2})),
                                      &pg);
    EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(odd.status().message().find("dim 0 of size 6 is not divisible by 4"), absl::string_view::npos)
        << odd.status();
  });
}

TEST(ProcessGroup, InitAxesMakesEachGroupsCommunicatorOnce) {
  // dp=2 with 2D tp (tp_col x tp_row = 2 x 2): groups are made for dp,
  // tp_col, tp_row and the whole tp, once each, with ColossalAI's layout.
  v1::ShardConfig s;
  s.set_tensor_parallel_size(4);
  s.set_data_parallel_size(2);
  s.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
  const DeviceMesh mesh = *DeviceMesh::FromShardConfig(s);
  auto shared = std::make_shared<RendezvousStore>();
  std::vector<std::unique_ptr<InMemoryStore>> stores(8);
  std::vector<std::vector<ProcessGroup::GroupInfo>> made(8);
  std::vector<std::thread> threads;
  for (int r = 0; r < 8; ++r) {
    stores[r] = std::make_unique<InMemoryStore>(shared, "init");
    threads.emplace_back([&, r] {
      GlooCommunicator::Options o;
      o.timeout = absl::Seconds(30);
      auto gloo = ProcessGroup::GlooFactory(stores[r].get(), o);
      auto counting = [&, r, gloo](const ProcessGroup::GroupInfo& g) {
        made[r].push_back(g);
        return gloo(g);
      };
      auto pg = ProcessGroup::Create(mesh, r, counting);
      ASSERT_TRUE(pg.ok());
      ASSERT_TRUE((*pg)->InitAxes().ok());
      Communicator* row = *(*pg)->Comm("tp_row");
      EXPECT_EQ(*(*pg)->Comm("tp_row"), row);
      EXPECT_EQ(row->size(), 2);
      // Every rank shares the group's collectives.
      float one = 1.0f;
      ASSERT_TRUE((*(*pg)->Comm("tp"))->AllReduce(&one, 1, DType::kF32, ReduceOp::kSum)->Wait(absl::Seconds(30)).ok());
      EXPECT_EQ(one, 4.0f);
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 8; ++r) {
    ASSERT_EQ(made[r].size(), 4u) << "rank " << r;
    EXPECT_EQ(made[r][0].axis, "dp");
    EXPECT_EQ(made[r][0].color, r % 4);  // dp groups {0,4}, {1,5}, ...
    EXPECT_EQ(made[r][0].rank, r / 4);
    EXPECT_EQ(made[r][3].axis, "tp");
    EXPECT_EQ(made[r][3].color, r / 4);  // tp groups {0..3}, {4..7}
    EXPECT_EQ(made[r][3].rank, r % 4);
    EXPECT_EQ(made[r][3].size, 4);
  }
  EXPECT_EQ(made[5][0].prefix, "dp/1_5");
}

TEST(ColoTensor, BadSpecsAreInvalidArgumentNamingTheProblem) {
  RunMesh(TpMesh(4), [](int rank, ProcessGroup& pg) {
    const Tensor global = IntTensor({6, 8});
    auto indivisible = ColoTensor::FromGlobal(global, Tp(Placement::Shard({0}, {4})), &pg);
    EXPECT_EQ(indivisible.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(indivisible.status().message().find("dim 0 of size 6"), absl::string_view::npos)
        << indivisible.status();
    EXPECT_NE(indivisible.status().message().find("4"), absl::string_view::npos);
    auto wrong_parts = ColoTensor::FromGlobal(global, Tp(Placement::Shard({1}, {2})), &pg);
    EXPECT_EQ(wrong_parts.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(wrong_parts.status().message().find("axis has 4 ranks"), absl::string_view::npos);
    auto no_axis = ColoTensor::FromGlobal(global, DistSpec().Set("pp", Placement::Shard({1}, {4})), &pg);
    EXPECT_EQ(no_axis.status().code(), absl::StatusCode::kInvalidArgument);
    auto bad_dim = ColoTensor::FromGlobal(global, Tp(Placement::Shard({2}, {4})), &pg);
    EXPECT_EQ(bad_dim.status().code(), absl::StatusCode::kInvalidArgument);
    auto ok = ColoTensor::FromGlobal(global, Tp(Placement::Shard({1}, {4})), &pg);
    ASSERT_TRUE(ok.ok());
    EXPECT_EQ(ok->Redistribute(Tp(Placement::Shard({0}, {4}))).status().code(),
              absl::StatusCode::kInvalidArgument);  // refused before any collective
    (void)rank;
  });
}

}  // namespace
}  // namespace colod
