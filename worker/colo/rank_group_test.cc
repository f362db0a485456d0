// CreateRankGroup and RunLocalRanks: real ranks as threads over Gloo on
// loopback (and over NCCL where CUDA is: the emulation in CI), checked
// against closed-form sums.
#include "worker/colo/rank_group.h"

#include <atomic>
#include <map>
#include <thread>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "common/rendezvous_store.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/colo/testing.h"

namespace colod {
namespace {

using ::colod::testing::TpDpMesh;

// Sums (rank + 1) over the group along `axis`: the group's ranks are known
// from the mesh, so the sum is a closed form.
absl::Status CheckSum(ProcessGroup& pg, const std::string& axis, const Device& device) {
  auto comm = pg.Comm(axis);
  if (!comm.ok()) return comm.status();
  Tensor t = *Tensor::FromFloats({3}, {float(pg.rank() + 1), 2.0f * (pg.rank() + 1), 0.5f});
  t = *t.To(device);
  if (absl::Status s = AllReduceInPlace(t, ReduceOp::kSum, **comm, pg.timeout()); !s.ok()) return s;
  auto group = pg.mesh().GroupOf(axis, pg.rank());
  if (!group.ok()) return group.status();
  float want = 0;
  for (int r : *group) want += r + 1;
  const std::vector<float> got = t.ToFloats();
  const std::vector<float> expect = {want, 2 * want, 0.5f * group->size()};
  if (got != expect) return absl::InternalError(absl::StrCat("rank ", pg.rank(), " along ", axis, ": wrong sum"));
  return absl::OkStatus();
}

TEST(CreateRankGroup, WrapsEveryCommunicatorItMakesAndTheyReduce) {
  const DeviceMesh mesh = TpDpMesh(2, 2);
  auto shared = std::make_shared<RendezvousStore>();
  absl::Mutex mu;
  std::map<std::pair<int, std::string>, ProcessGroup::GroupInfo> wrapped;  // (rank, axis) -> group
  std::vector<absl::Status> results(4);
  std::vector<std::thread> threads;
  for (int r = 0; r < 4; ++r) {
    threads.emplace_back([&, r] {
      InMemoryStore store(shared, "job-1");
      RankGroupOptions o;
      o.timeout = absl::Seconds(30);
      o.wrap = [&, r](std::unique_ptr<Communicator> c, const ProcessGroup::GroupInfo& g) {
        absl::MutexLock lock(&mu);
        wrapped[{r, g.axis}] = g;
        return c;
      };
      auto pg = CreateRankGroup(mesh, r, &store, std::move(o));
      if (!pg.ok()) {
        results[r] = pg.status();
        return;
      }
      results[r] = CheckSum(**pg, "tp", Device::Cpu());
      if (results[r].ok()) results[r] = CheckSum(**pg, "dp", Device::Cpu());
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(results[r].ok()) << results[r];
  ASSERT_EQ(wrapped.size(), 8u);
  for (int r = 0; r < 4; ++r) {
    // tp groups are {0,1} and {2,3}; dp groups {0,2} and {1,3} (rank % tp, rank / tp).
    EXPECT_EQ((wrapped[{r, "tp"}].rank), r % 2);
    EXPECT_EQ((wrapped[{r, "tp"}].color), r / 2);
    EXPECT_EQ((wrapped[{r, "dp"}].rank), r / 2);
    EXPECT_EQ((wrapped[{r, "dp"}].color), r % 2);
    EXPECT_EQ((wrapped[{r, "dp"}].size), 2);
  }
}

TEST(CreateRankGroup, RefusesARankOutsideTheMesh) {
  InMemoryStore store;
  EXPECT_EQ(CreateRankGroup(TpDpMesh(2, 1), 2, &store, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RunLocalRanks, AFailingRankStopsTheOthersLongBeforeTheTimeout) {
  // Ranks 0, 1 and 3 reduce in a loop; rank 2 fails after its first
  // reductions. Without the abort the others would wait out the 60 s
  // timeout in their next collective.
  LocalRanksOptions options;
  options.timeout = absl::Seconds(60);
  std::atomic<int> aborted{0};
  const absl::Time start = absl::Now();
  const absl::Status s = RunLocalRanks(
      TpDpMesh(2, 2),
      [&](int rank, ProcessGroup& pg) -> absl::Status {
        for (int i = 0; i < 100000; ++i) {
          if (rank == 2 && i == 3) return absl::InvalidArgumentError("a bad batch");
          absl::Status c = CheckSum(pg, i % 2 == 0 ? "tp" : "dp", Device::Cpu());
          if (!c.ok()) {
            if (c.code() == absl::StatusCode::kAborted) ++aborted;
            return c;
          }
        }
        return absl::OkStatus();
      },
      options);
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(s.message(), "rank 2: a bad batch");
  EXPECT_LT(took, absl::Seconds(20)) << "the others waited for the failed rank";
  EXPECT_GE(aborted.load(), 1) << "no rank saw the abort";
}

// Rank 0 fails first with a failure that follows a peer's (a save another
// rank could not write its part of: it aborts nobody); rank 1, whose own
// error it is, reports it after, and its abort ends ranks 2 and 3 in their
// collectives. The run's error is rank 1's, with its marks. (Of ranks 2
// and 3, the one aborted first ends ABORTED; the other may end first on the
// connection its aborted peer closed, an error Gloo words as its own.)
TEST(RunLocalRanks, ARanksOwnFailureIsTheRunsThoughAPeersConsequenceCameFirst) {
  std::atomic<bool> rank0_ended{false};
  std::atomic<int> aborted{0}, ended{0};
  const absl::Status s = RunLocalRanks(TpDpMesh(2, 2), [&](int rank, ProcessGroup& pg) -> absl::Status {
    switch (rank) {
      case 0:
        rank0_ended = true;
        return MarkPeerCaused(absl::AbortedError("the checkpoint was not saved: another rank could not write"));
      case 1:
        for (int i = 0; i < 2000 && !rank0_ended.load(); ++i) absl::SleepFor(absl::Milliseconds(5));
        absl::SleepFor(absl::Milliseconds(100));  // rank 0's end recorded
        if (!pg.Aborted().ok()) return absl::InternalError("rank 0's end aborted rank 1's group");
        return MarkWorkerFault(absl::ResourceExhaustedError("cannot write optim-1.safetensors: no space left"));
      default:
        for (int i = 0; i < 100000; ++i) {
          const absl::Status c = CheckSum(pg, "tp", Device::Cpu());
          if (!c.ok()) {
            ++ended;
            if (c.code() == absl::StatusCode::kAborted) ++aborted;
            return c;
          }
        }
        return absl::OkStatus();
    }
  });
  EXPECT_EQ(ended.load(), 2) << "ranks 2 and 3 did not end in their collectives";
  EXPECT_GE(aborted.load(), 1) << "neither of ranks 2 and 3 was aborted";
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(s.message(), "rank 1: cannot write optim-1.safetensors: no space left");
  EXPECT_TRUE(IsWorkerFault(s)) << "the rank's marks are kept";
  EXPECT_FALSE(IsPeerCaused(s));
}

// AgreeOverMesh: the rank whose work failed gets its own error back, every
// other rank of the mesh ABORTED marked as following a peer's; with no
// failure, every rank OK. Over Gloo, and over NCCL where there are devices
// (the emulation in CI).
TEST(AgreeOverMesh, EveryRankLearnsThatOneFailedWhichKeepsItsOwnError) {
  for (const bool cuda : {false, true}) {
#ifdef COLOD_WITH_CUDA
    if (cuda && kernels::CudaDeviceCount() < 4) continue;
#else
    if (cuda) continue;
#endif
    SCOPED_TRACE(cuda ? "nccl" : "gloo");
    LocalRanksOptions options;
    options.cuda = cuda;
    for (const int failing : {-1, 2}) {
      absl::Mutex mu;
      std::map<int, absl::Status> got;
      const absl::Status run = RunLocalRanks(
          TpDpMesh(2, 2),
          [&](int rank, ProcessGroup& pg) -> absl::Status {
            const absl::Status mine = rank == failing ? absl::DataLossError("cannot write my part") : absl::OkStatus();
            const absl::Status s =
                AgreeOverMesh(pg, mine, cuda ? Device::Cuda(rank) : Device::Cpu(), "another rank failed");
            absl::MutexLock lock(&mu);
            got[rank] = s;
            return absl::OkStatus();
          },
          options);
      ASSERT_TRUE(run.ok()) << run;
      ASSERT_EQ(got.size(), 4u);
      for (const auto& [rank, s] : got) {
        if (failing < 0) {
          EXPECT_TRUE(s.ok()) << rank << ": " << s;
        } else if (rank == failing) {
          EXPECT_EQ(s, absl::DataLossError("cannot write my part"));
        } else {
          EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << rank << ": " << s;
          EXPECT_EQ(s.message(), "another rank failed");
          EXPECT_TRUE(IsPeerCaused(s)) << rank;
        }
      }
    }
  }
}

// Over NCCL an agreement whose peer never came fails with the
// communicator's error (the watchdog's), never OK on the rank's own flag
// (on a device the stream runs past a collective that was aborted, leaving
// the flag as it was: AgreeOverMesh checks the communicators' sticky error).
TEST(AgreeOverMesh, AnAgreementAPeerNeverJoinedIsNotOkOverNccl) {
#ifdef COLOD_WITH_CUDA
  if (kernels::CudaDeviceCount() < 2) GTEST_SKIP() << "needs 2 CUDA devices";
  LocalRanksOptions options;
  options.cuda = true;
  options.timeout = absl::Seconds(2);
  absl::Status rank0 = absl::UnknownError("not run");
  (void)RunLocalRanks(
      TpDpMesh(2, 1),
      [&](int rank, ProcessGroup& pg) -> absl::Status {
        if (rank == 1) return absl::OkStatus();  // never joins
        rank0 = AgreeOverMesh(pg, absl::OkStatus(), Device::Cuda(0), "another rank failed");
        return absl::OkStatus();
      },
      options);
  EXPECT_EQ(rank0.code(), absl::StatusCode::kDeadlineExceeded) << rank0;
  EXPECT_FALSE(IsPeerCaused(rank0)) << rank0;
#else
  GTEST_SKIP() << "a build without CUDA";
#endif
}

TEST(RunLocalRanks, CudaRanksReduceOnTheirDevicesOrSayThereIsNoCuda) {
  LocalRanksOptions options;
  options.cuda = true;
  options.timeout = absl::Seconds(60);
  const absl::Status s = RunLocalRanks(
      TpDpMesh(2, 1),
      [&](int rank, ProcessGroup& pg) -> absl::Status {
        if (auto c = pg.Comm("tp"); !c.ok() || (*c)->backend() != "nccl") {
          return absl::InternalError("not an NCCL communicator");
        }
        return CheckSum(pg, "tp", Device::Cuda(rank));
      },
      options);
#ifdef COLOD_WITH_CUDA
  if (kernels::CudaDeviceCount() >= 2) {
    EXPECT_TRUE(s.ok()) << s;
  } else {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
    EXPECT_NE(s.message().find("CUDA devices"), std::string::npos) << s;
  }
#else
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("no CUDA"), std::string::npos) << s;
#endif
}

}  // namespace
}  // namespace colod
