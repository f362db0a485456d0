// TensorHost (tensor_host.h) on the 2 ranks of a tp mesh over Gloo on
// loopback: a collective call holds only the ordering lock, so while one
// rank's GetGlobal waits for its peer its other calls answer at once; the
// gather gives the unsharded value, SetDistSpec stores the redistributed
// tensor, and a tensor deleted and made again meanwhile is not overwritten.
#include "worker/daemon/tensor_host.h"

#include <algorithm>
#include <atomic>
#include <optional>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "worker/colo/tensor_proto.h"
#include "worker/colo/testing.h"

namespace colod {
namespace {

// Tensor "w": [4, 6] of N(0, 1) from seed 7, its rows split over tp 2.
v1::CreateTensorRequest SeededW() {
  v1::CreateTensorRequest create;
  create.set_name("w");
  create.mutable_random()->set_seed(7);
  create.mutable_random()->add_shape(4);
  create.mutable_random()->add_shape(6);
  *create.mutable_dist_spec() = DistSpecToProto(DistSpec().Set("tp", Placement::Shard({0}, {2})));
  return create;
}

// The tensors a rank holds are bounded by its budget (the worker's memory),
// each counted at its global size and its bookkeeping (TensorHost::Cost:
// an empty or tiny tensor is not free): one that would pass it is refused
// before anything is allocated (a shape of 2^40 floats is not tried), a
// delete gives its bytes back. A name is at most 256 bytes.
TEST(TensorHost, TensorsAreBoundedByTheBudgetBeforeAnythingIsAllocated) {
  const auto cost = [](int64_t data) { return TensorHost::Cost(data, "x"); };  // one-letter names
  testing::RunMesh(testing::TpDpMesh(1), [&](int, ProcessGroup& pg) {
    // Room for a and c, and for c's making beside a (the whole value beside
    // the part: 200 bytes more while it is made).
    const int64_t budget = cost(800) + cost(200) + 200;
    TensorHost host(&pg, Device::Cpu(), budget);
    const auto random = [](const std::string& name, std::vector<int64_t> shape) {
      v1::CreateTensorRequest r;
      r.set_name(name);
      for (int64_t d : shape) r.mutable_random()->add_shape(d);
      return r;
    };
    ASSERT_TRUE(host.Create(random("a", {10, 20})).ok());  // 800 bytes
    const absl::StatusOr<v1::TensorLayout> over = host.Create(random("b", {10, 6}));  // 240 more
    EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
    EXPECT_NE(over.status().message().find(absl::StrCat("hold ", cost(800), " of the ", budget)), std::string::npos)
        << over.status();
    EXPECT_NE(over.status().message().find(absl::StrCat("and ", cost(240) + 240, " while it is made")),
              std::string::npos)
        << over.status();
    const absl::StatusOr<v1::TensorLayout> huge = host.Create(random("h", {1 << 20, 1 << 20}));
    EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
    EXPECT_EQ(host.Create(random("o", {int64_t{1} << 40, int64_t{1} << 40})).status().code(),
              absl::StatusCode::kInvalidArgument);  // its bytes overflow
    // Bytes just below 2^63: with the bookkeeping past int64, still refused.
    EXPECT_EQ(host.Create(random("m", {(int64_t{1} << 61) - 1})).status().code(), absl::StatusCode::kResourceExhausted);
    ASSERT_TRUE(host.Create(random("c", {10, 5})).ok());  // 200, and 200 more while made: exactly the budget
    ASSERT_TRUE(host.Delete("a").ok());
    EXPECT_EQ(host.Create(random("c", {1})).status().code(), absl::StatusCode::kAlreadyExists);
    EXPECT_TRUE(host.Create(random("b", {10, 6})).ok());
    // What is held is exactly c and b: the refused ones gave their
    // reservations back.
    const absl::StatusOr<v1::TensorLayout> full = host.Create(random("d", {1}));
    EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted) << full.status();
    EXPECT_NE(full.status().message().find(absl::StrCat("hold ", cost(200) + cost(240), " of")), std::string::npos)
        << full.status();
    // A name taken is ALREADY_EXISTS whatever the budget (a retry of a
    // create that went through), and a spec that does not fit the shape,
    // or an integer random init, is refused naming the field before
    // anything is drawn, however large.
    EXPECT_EQ(host.Create(random("c", {10, 5})).status().code(), absl::StatusCode::kAlreadyExists);
    v1::CreateTensorRequest misfit = random("g", {int64_t{1} << 20, int64_t{1} << 19});
    *misfit.mutable_dist_spec() = DistSpecToProto(DistSpec().Set("tp", Placement::Shard({2}, {1})));
    const absl::Time start = absl::Now();
    const absl::Status bad_spec = host.Create(misfit).status();
    EXPECT_EQ(bad_spec.code(), absl::StatusCode::kInvalidArgument) << bad_spec;
    EXPECT_TRUE(absl::StrContains(bad_spec.message(), "dist_spec: ")) << bad_spec;
    EXPECT_LT(absl::Now() - start, absl::Seconds(1));
    v1::CreateTensorRequest ints = random("i", {1});
    ints.mutable_random()->set_dtype(v1::DTYPE_I64);
    const absl::Status int_init = host.Create(ints).status();
    EXPECT_EQ(int_init.code(), absl::StatusCode::kInvalidArgument) << int_init;
    EXPECT_TRUE(absl::StrContains(int_init.message(), "random.dtype: ")) << int_init;
    ASSERT_TRUE(host.Delete("b").ok());
    // 1000 bytes and one tensor's bookkeeping free: one tiny tensor fits, a
    // second is refused for its bookkeeping alone.
    ASSERT_LT(1000, TensorHost::kPerTensorBytes);
    EXPECT_TRUE(host.Create(random("e", {1})).ok());
    EXPECT_EQ(host.Create(random("f", {1})).status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_EQ(host.Create(random(std::string(257, 'n'), {1})).status().code(), absl::StatusCode::kInvalidArgument);
    // Enum values the protos do not have are refused, not taken as the
    // default (a normal distribution, a sum).
    ASSERT_TRUE(host.Delete("e").ok());
    v1::CreateTensorRequest odd = random("u", {1});
    odd.mutable_random()->set_distribution(static_cast<v1::RandomInit::Distribution>(99));
    EXPECT_EQ(host.Create(odd).status().code(), absl::StatusCode::kInvalidArgument);
    odd = random("u", {1});
    v1::AxisPlacement* partial = odd.mutable_dist_spec()->add_placements();
    partial->set_axis("tp");
    partial->mutable_placement()->mutable_partial()->set_op(static_cast<v1::ReduceOp>(99));
    const absl::StatusOr<v1::TensorLayout> bad_op = host.Create(odd);
    EXPECT_EQ(bad_op.status().code(), absl::StatusCode::kInvalidArgument) << bad_op.status();
    EXPECT_NE(bad_op.status().message().find("partial.op: unknown value 99"), std::string::npos) << bad_op.status();
  });
}

// Create makes its shard without the map's lock: of creates of one name at
// once, one makes it and the rest are ALREADY_EXISTS, their reservations
// given back; Close waits for the creates in flight, and none comes after.
TEST(TensorHost, CreatesAtOnceMakeANameOnceAndCloseWaitsForThem) {
  testing::RunMesh(testing::TpDpMesh(1), [&](int, ProcessGroup& pg) {
    const int64_t one = TensorHost::Cost(256 * 256 * 4, "same");
    TensorHost host(&pg, Device::Cpu(), 2 * one + 256 * 256 * 4);  // two, and the second's making
    v1::CreateTensorRequest same;
    same.set_name("same");
    same.mutable_random()->add_shape(256);
    same.mutable_random()->add_shape(256);
    std::vector<absl::Status> got(8);
    {
      std::vector<std::thread> threads;
      for (size_t i = 0; i < got.size(); ++i) threads.emplace_back([&, i] { got[i] = host.Create(same).status(); });
      for (std::thread& t : threads) t.join();
    }
    int made = 0;
    for (const absl::Status& s : got) {
      made += s.ok();
      if (!s.ok()) {
        EXPECT_TRUE(s.code() == absl::StatusCode::kAlreadyExists || s.code() == absl::StatusCode::kResourceExhausted)
            << s;  // a reservation of a losing create may still be held when another asks
      }
    }
    EXPECT_EQ(made, 1);
    EXPECT_EQ(host.List().size(), 1u);
    v1::CreateTensorRequest other = same;
    other.set_name("samf");
    EXPECT_TRUE(host.Create(other).ok()) << "a losing create kept its reservation";  // exactly the budget left
    ASSERT_TRUE(host.Delete("samf").ok());

    std::vector<std::thread> creates;
    std::atomic<int> unavailable{0}, ok{0};
    for (int i = 0; i < 4; ++i) {
      creates.emplace_back([&, i] {
        v1::CreateTensorRequest r = same;
        r.set_name(absl::StrCat("late", i));
        const absl::Status s = host.Create(r).status();
        (s.ok() ? ok : unavailable) += 1;
        EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kUnavailable ||
                    s.code() == absl::StatusCode::kResourceExhausted)
            << s;
      });
    }
    host.Close();
    EXPECT_TRUE(host.List().empty());  // what went in before Close went with it
    for (std::thread& t : creates) t.join();
    EXPECT_TRUE(host.List().empty()) << "a create went in after Close";
    EXPECT_EQ(host.Create(other).status().code(), absl::StatusCode::kUnavailable);
  });
}

TEST(TensorHost, ItsCallsDoNotWaitForACollectiveInProgressAndTheCollectivesGiveTheWhole) {
  auto want = Tensor::RandomNormal({4, 6}, /*seed=*/7);
  ASSERT_TRUE(want.ok()) << want.status();
  testing::RunMesh(testing::TpDpMesh(2), [&](int rank, ProcessGroup& pg) {
    TensorHost host(&pg, Device::Cpu(), int64_t{1} << 30);
    const v1::CreateTensorRequest create = SeededW();
    ASSERT_TRUE(host.Create(create).ok());
    v1::GetShardRequest shard;
    shard.set_name("w");
    shard.set_rank(rank);
    if (rank == 0) {
      std::atomic<bool> done{false};
      absl::StatusOr<v1::TensorValue> whole;
      std::thread gather([&] {
        whole = host.GetGlobal("w");
        done = true;
      });
      absl::SleepFor(absl::Milliseconds(300));  // the gather waits for rank 1 (1 s)
      const absl::Time start = absl::Now();
      EXPECT_TRUE(host.Describe("w").ok());
      EXPECT_EQ(host.List().size(), 1u);
      EXPECT_TRUE(host.GetShard(shard).ok());
      v1::CreateTensorRequest other = create;
      other.set_name("b");
      EXPECT_TRUE(host.Create(other).ok());
      EXPECT_TRUE(host.Delete("b").ok());
      EXPECT_LT(absl::Now() - start, absl::Milliseconds(500)) << "the calls waited for the collective";
      EXPECT_FALSE(done) << "the gather completed before its peer entered it";
      gather.join();
      ASSERT_TRUE(whole.ok()) << whole.status();
      auto got = TensorFromProto(*whole);
      ASSERT_TRUE(got.ok()) << got.status();
      testing::ExpectAllClose(*got, *want, "GetGlobal", 0);
    } else {
      absl::SleepFor(absl::Seconds(1));
      // It takes part in the gather and, not asked to answer with the value
      // (the coordinator's calls but rank 0's), holds none.
      const absl::StatusOr<v1::TensorValue> joined = host.GetGlobal("w", /*answer=*/false);
      ASSERT_TRUE(joined.ok()) << joined.status();
      EXPECT_TRUE(joined->data().empty());
      EXPECT_EQ(joined->shape_size(), 0);
    }
    // Replicated on both ranks: each shard is the whole.
    v1::SetDistSpecRequest set;
    set.set_name("w");
    auto layout = host.SetDistSpec(set);
    ASSERT_TRUE(layout.ok()) << layout.status();
    auto mine = host.GetShard(shard);
    ASSERT_TRUE(mine.ok()) << mine.status();
    auto value = TensorFromProto(mine->value());
    ASSERT_TRUE(value.ok()) << value.status();
    testing::ExpectAllClose(*value, *want, "the replicated shard", 0);
    // A tensor deleted and made again while it is redistributed keeps the
    // new one: the SetDistSpec is NOT_FOUND on that rank.
    v1::CreateTensorRequest v = create;
    v.set_name("v");
    ASSERT_TRUE(host.Create(v).ok());
    v1::SetDistSpecRequest replicate_v;
    replicate_v.set_name("v");
    if (rank == 0) {
      absl::StatusOr<v1::TensorLayout> set_v;
      std::thread redistribute([&] { set_v = host.SetDistSpec(replicate_v); });
      absl::SleepFor(absl::Milliseconds(300));  // rank 1 enters after 1 s
      ASSERT_TRUE(host.Delete("v").ok());
      v.mutable_random()->set_seed(8);
      ASSERT_TRUE(host.Create(v).ok());
      redistribute.join();
      EXPECT_EQ(set_v.status().code(), absl::StatusCode::kNotFound) << set_v.status();
      v1::GetShardRequest shard_v = shard;
      shard_v.set_name("v");
      auto kept = host.GetShard(shard_v);
      ASSERT_TRUE(kept.ok()) << kept.status();
      auto kept_value = TensorFromProto(kept->value());
      auto made = Tensor::RandomNormal({4, 6}, /*seed=*/8);
      ASSERT_TRUE(kept_value.ok() && made.ok());
      ASSERT_EQ(kept_value->shape(), (Shape{2, 6})) << "the new tensor's rank-0 shard";
      const std::vector<float> all = made->ToFloats(), first = kept_value->ToFloats();
      EXPECT_EQ(first, std::vector<float>(all.begin(), all.begin() + 12));
    } else {
      absl::SleepFor(absl::Seconds(1));
      ASSERT_TRUE(host.SetDistSpec(replicate_v).ok());
    }
    host.Close();
    EXPECT_EQ(host.Describe("w").status().code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(host.GetShard(shard).status().code(), absl::StatusCode::kUnavailable);
    // A closed host runs no collective (its group is about to go): a call
    // that reached one rank only answers at once, where it used to enter
    // the agreement and wait for its peer (or, once the group was freed,
    // use it).
    if (rank == 0) {
      const absl::Time start = absl::Now();
      for (const absl::Status s : {host.GetGlobal("w").status(), host.SetDistSpec(replicate_v).status()}) {
        EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
        EXPECT_TRUE(absl::StrContains(s.message(), "the job's rank has stopped")) << s;
      }
      EXPECT_LT(absl::Now() - start, absl::Seconds(1));
    } else {
      absl::SleepFor(absl::Seconds(2));  // the peer stays, its group open, past rank 0's calls
    }
  });
}

// Ranks that do not hold a tensor alike (a call of the coordinator's that
// reached one rank and not the other, a create one rank refused, tensors of
// one name from two creates, a client calling a worker directly) refuse its collectives on every rank, with
// the same answer, before any data moves: before, a gather of two sizes
// aborted the worker (a Gloo size mismatch) or left a rank waiting alone.
// Where no rank holds it, NOT_FOUND; held alike again, it is gathered.
TEST(TensorHost, RanksThatDoNotHoldATensorAlikeRefuseItsCollectivesOnEveryRank) {
  // One axis, and two (the disagreement spread from the first axis's groups
  // to the second's).
  for (const DeviceMesh& mesh : {testing::TpDpMesh(2), testing::TpDpMesh(2, 2)}) {
    const int world = mesh.world_size();
    testing::RunMesh(mesh, [&](int rank, ProcessGroup& pg) {
      TensorHost host(&pg, Device::Cpu(), int64_t{1} << 30);
      const auto create = [&](int64_t rows, uint64_t creation_id = 0) {
        v1::CreateTensorRequest c;
        c.set_name("x");
        c.set_creation_id(creation_id);
        c.mutable_random()->set_seed(3);
        c.mutable_random()->add_shape(rows);
        c.mutable_random()->add_shape(4);
        *c.mutable_dist_spec() = DistSpecToProto(DistSpec().Set("tp", Placement::Shard({0}, {2})));
        return host.Create(c);
      };
      const auto refused = [&](absl::string_view what) {
        const absl::StatusOr<v1::TensorValue> whole = host.GetGlobal("x");
        EXPECT_EQ(whole.status().code(), absl::StatusCode::kFailedPrecondition) << what << ": " << whole.status();
        EXPECT_NE(whole.status().message().find("do not all hold tensor 'x' alike"), std::string::npos)
            << whole.status();
        v1::SetDistSpecRequest replicate;
        replicate.set_name("x");
        *replicate.mutable_dist_spec() = DistSpecToProto(DistSpec::Replicate());
        const absl::StatusOr<v1::TensorLayout> set = host.SetDistSpec(replicate);
        EXPECT_EQ(set.status().code(), absl::StatusCode::kFailedPrecondition) << what << ": " << set.status();
      };
      ASSERT_TRUE(create(rank == world - 1 ? 64 : 4).ok());  // the last rank's [32, 4] shard, the others' [2, 4]
      refused("one shape apart");
      ASSERT_TRUE(host.Delete("x").ok());
      if (world == 4) {  // each tp slice alike within, the two slices apart
        ASSERT_TRUE(create(rank % 2 == 0 ? 4 : 8).ok());
        refused("two slices");
        ASSERT_TRUE(host.Delete("x").ok());
      }
      if (rank == 0) ASSERT_TRUE(create(4).ok());  // on one rank only
      refused("one rank");
      if (rank == 0) ASSERT_TRUE(host.Delete("x").ok());
      // The same shape and spec from two of the coordinator's creates (a
      // delete that reached only some ranks, then a create the others
      // refused as ALREADY_EXISTS): the values may differ, so they refuse.
      ASSERT_TRUE(create(4, rank == 0 ? 17 : 18).ok());
      refused("two creates");
      ASSERT_TRUE(host.Delete("x").ok());
      EXPECT_EQ(host.GetGlobal("x").status().code(), absl::StatusCode::kNotFound);  // on none
      ASSERT_TRUE(create(4).ok());
      const absl::StatusOr<v1::TensorValue> whole = host.GetGlobal("x");
      ASSERT_TRUE(whole.ok()) << whole.status();
      auto want = Tensor::RandomNormal({4, 4}, /*seed=*/3);
      ASSERT_TRUE(want.ok());
      auto got = TensorFromProto(*whole);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_EQ(got->ToFloats(), want->ToFloats());
    });
  }
}

// A conversion's temporaries (twice the rank's part after it) count
// against the budget while it runs, and are given back after it: where one
// rank lacks the room, every rank refuses it (RESOURCE_EXHAUSTED, in the
// agreement before any data moves), rather than that rank failing alone in
// the collective, or the worker being killed for its memory; the tensor is
// kept as it was.
TEST(TensorHost, AConversionARankHasNoRoomForIsRefusedOnEveryRank) {
  const int64_t tensor = TensorHost::Cost(4 * 6 * 4, "w");
  testing::RunMesh(testing::TpDpMesh(2), [&](int rank, ProcessGroup& pg) {
    // Rank 1 has room to make the tensor, not to convert it.
    TensorHost host(&pg, Device::Cpu(), rank == 1 ? tensor + 4 * 6 * 4 : int64_t{1} << 30);
    const v1::CreateTensorRequest create = SeededW();
    ASSERT_TRUE(host.Create(create).ok());
    // To columns and back: each needs twice a half (96 bytes), which rank 1
    // has, and has again after the first gave its reservation back.
    for (const int dim : {1, 0}) {
      v1::SetDistSpecRequest shard;
      shard.set_name("w");
      *shard.mutable_dist_spec() = DistSpecToProto(DistSpec().Set("tp", Placement::Shard({dim}, {2})));
      const absl::StatusOr<v1::TensorLayout> moved = host.SetDistSpec(shard);
      ASSERT_TRUE(moved.ok()) << "to dim " << dim << ": " << moved.status();
    }
    // Replicated, its part is the whole: twice that is more than rank 1 has.
    v1::SetDistSpecRequest replicate;
    replicate.set_name("w");
    *replicate.mutable_dist_spec() = DistSpecToProto(DistSpec::Replicate());
    const absl::StatusOr<v1::TensorLayout> refused = host.SetDistSpec(replicate);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
    EXPECT_TRUE(absl::StrContains(refused.status().message(), "a rank of the job lacks the room")) << refused.status();
    const absl::StatusOr<v1::TensorLayout> kept = host.Describe("w");
    ASSERT_TRUE(kept.ok()) << kept.status();
    EXPECT_EQ(kept->shards(rank).shape(0), 2) << "the tensor changed";
    // The gather needs no such room (its answer is bounded).
    const absl::StatusOr<v1::TensorValue> whole = host.GetGlobal("w");
    ASSERT_TRUE(whole.ok()) << whole.status();
    host.Close();
  });
}

// A conversion's reservation follows its plan: on tp x dp, rows over tp and
// columns over dp to the other way round gathers to the whole and then cuts
// (2.5 times the tensor at its middle step, beside the part it starts
// from), which twice the final quarter would undercount; a conversion of
// one step (columns gathered over dp) reserves only what it holds.
TEST(TensorHost, AConversionReservesWhatItsPlansStepsHold) {
  const int64_t data = 8 * 8 * 4;
  const int64_t tensor = TensorHost::Cost(data, "w");
  const auto spec = [](int64_t tp_dim, std::optional<int64_t> dp_dim) {
    DistSpec s;
    s.Set("tp", Placement::Shard({tp_dim}, {2}));
    if (dp_dim.has_value()) s.Set("dp", Placement::Shard({*dp_dim}, {2}));
    return DistSpecToProto(s);
  };
  testing::RunMesh(testing::TpDpMesh(2, 2), [&](int, ProcessGroup& pg) {
    // After the create: room for twice the whole, not for 2.5 times.
    TensorHost host(&pg, Device::Cpu(), tensor + 2 * data);
    v1::CreateTensorRequest create;
    create.set_name("w");
    create.mutable_random()->set_seed(5);
    create.mutable_random()->add_shape(8);
    create.mutable_random()->add_shape(8);
    *create.mutable_dist_spec() = spec(0, 1);
    ASSERT_TRUE(host.Create(create).ok());
    v1::SetDistSpecRequest set;
    set.set_name("w");
    *set.mutable_dist_spec() = spec(0, std::nullopt);  // columns gathered over dp: one step
    const absl::StatusOr<v1::TensorLayout> gathered = host.SetDistSpec(set);
    ASSERT_TRUE(gathered.ok()) << gathered.status();
    *set.mutable_dist_spec() = spec(0, 1);
    ASSERT_TRUE(host.SetDistSpec(set).ok());
    *set.mutable_dist_spec() = spec(1, 0);  // through the whole
    const absl::StatusOr<v1::TensorLayout> swapped = host.SetDistSpec(set);
    EXPECT_EQ(swapped.status().code(), absl::StatusCode::kResourceExhausted) << swapped.status();
    host.Close();
  });
}

// A value over what an answer carries (gRPC's 4 MiB) is refused before it
// is gathered or copied, on every rank: before, every rank gathered it
// whole (three times its size at the peak) and the answer then failed.
TEST(TensorHost, ValuesOverAnAnswersSizeAreRefusedBeforeTheyAreGathered) {
  testing::RunMesh(testing::TpDpMesh(2), [&](int rank, ProcessGroup& pg) {
    TensorHost host(&pg, Device::Cpu(), int64_t{1} << 30);
    const auto create = [&](const std::string& name, int64_t rows) {
      v1::CreateTensorRequest c;
      c.set_name(name);
      c.mutable_random()->add_shape(rows);
      c.mutable_random()->add_shape(1024);
      *c.mutable_dist_spec() = DistSpecToProto(DistSpec().Set("tp", Placement::Shard({0}, {2})));
      return host.Create(c);
    };
    // 1100 x 1024 floats: 4.3 MiB whole, 2.15 MiB a shard.
    ASSERT_TRUE(create("big", 1100).ok());
    const absl::StatusOr<v1::TensorValue> whole = host.GetGlobal("big");
    EXPECT_EQ(whole.status().code(), absl::StatusCode::kResourceExhausted) << whole.status();
    EXPECT_NE(whole.status().message().find("read it a shard at a time"), std::string::npos) << whole.status();
    v1::GetShardRequest shard;
    shard.set_name("big");
    shard.set_rank(rank);
    EXPECT_TRUE(host.GetShard(shard).ok());
    // 2200 x 1024: 4.3 MiB a shard.
    ASSERT_TRUE(create("bigger", 2200).ok());
    shard.set_name("bigger");
    EXPECT_EQ(host.GetShard(shard).status().code(), absl::StatusCode::kResourceExhausted);
    // One within it is gathered.
    ASSERT_TRUE(create("fits", 1000).ok());
    EXPECT_TRUE(host.GetGlobal("fits").ok());
  });
}

// A listing comes in pages of at most 3.5 MiB of layouts, in name order:
// before, 11,600 tensors with long names made every ListTensors too large
// to send. Each page goes on after the last name of the one before.
TEST(TensorHost, ListingsComeInPagesThatHoldEveryTensorOnce) {
  testing::RunMesh(testing::TpDpMesh(1), [&](int, ProcessGroup& pg) {
    TensorHost host(&pg, Device::Cpu(), int64_t{1} << 30);
    constexpr int kTensors = 16000;
    for (int i = 0; i < kTensors; ++i) {
      v1::CreateTensorRequest c;
      c.set_name(absl::StrCat(std::string(240, 'n'), i));
      c.mutable_random()->add_shape(1);
      ASSERT_TRUE(host.Create(c).ok());
    }
    std::vector<std::string> seen;
    std::string after;
    int pages = 0;
    do {
      std::string next;
      const std::vector<v1::TensorLayout> page = host.List(after, &next);
      ++pages;
      v1::ListTensorsResponse resp;
      for (const v1::TensorLayout& l : page) *resp.add_tensors() = l;
      EXPECT_LE(resp.ByteSizeLong(), TensorHost::kMaxListBytes);
      for (const v1::TensorLayout& l : page) seen.push_back(l.name());
      if (!next.empty()) EXPECT_EQ(next, page.back().name());
      after = next;
    } while (!after.empty() && pages < 100);
    EXPECT_GT(pages, 1);
    ASSERT_EQ(seen.size(), static_cast<size_t>(kTensors));
    EXPECT_TRUE(std::is_sorted(seen.begin(), seen.end()));
    EXPECT_EQ(std::adjacent_find(seen.begin(), seen.end()), seen.end());
  });
}

}  // namespace
}  // namespace colod
