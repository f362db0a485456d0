// NCCL on the machine's GPUs, or on the CUDA emulation (docs/GPU.md). NCCL
// refuses two ranks of one communicator on one device: the multi-rank cases
// need one device per rank (the emulation has 4). Failure handling: a rank
// that never enters a collective fails its peers with DEADLINE_EXCEEDED
// within the timeout + 2 s, naming rank, op, group and sequence number; a
// peer that never splits; SendRecv exchanges; AsyncError racing Abort; a
// communicator destroyed with a collective still waiting is aborted, never
// left waiting.
#include "worker/comm/nccl/nccl_communicator.h"

#include <atomic>
#include <limits>
#include <thread>
#include <vector>

#if defined(COLOD_CUDA_EMULATION)
#include <nccl_emu.h>
#endif

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "kernels/cuda/tensor_ops.h"
#include "kernels/device.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/flight_recorder.h"
#include "worker/comm/instrumented_communicator.h"
#include "worker/comm/store.h"
#include "worker/comm/store_testing.h"

namespace colod {
namespace {

constexpr absl::Duration kWait = absl::Seconds(60);

TEST(Nccl, BadRanksAreRefusedBeforeTouchingTheGpu) {
  InMemoryStore store;
  EXPECT_EQ(NcclCommunicator::Create(store, 2, 2, {}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(NcclCommunicator::Create(store, 0, 0, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

class NcclGpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
  }
};

TEST_F(NcclGpu, OneRankCollectivesMatchTheHostValues) {
  InMemoryStore store;
  auto comm = NcclCommunicator::Create(store, 0, 1, {});
  ASSERT_TRUE(comm.ok()) << comm.status();
  const int n = 1000;
  std::vector<float> host(n);
  for (int i = 0; i < n; ++i) host[i] = 0.25f * (i % 17) - 1.5f;
  float *dev = nullptr, *out = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&dev), n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&out), n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
    ASSERT_TRUE((*comm)->AllReduce(dev, n, DType::kF32, op)->Wait(kWait).ok());
  }
  ASSERT_TRUE((*comm)->AllGather(dev, out, n, DType::kF32)->Wait(kWait).ok());
  ASSERT_TRUE((*comm)->Barrier()->Wait(kWait).ok());
  std::vector<float> got(n);
  ASSERT_EQ(cudaMemcpy(got.data(), out, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, host);  // one rank: every reduction is the identity
  EXPECT_TRUE((*comm)->AsyncError().ok());

  auto sub = (*comm)->Split(/*color=*/0, /*key=*/0);
  ASSERT_TRUE(sub.ok()) << sub.status();
  EXPECT_EQ((*sub)->size(), 1);
  ASSERT_TRUE((*sub)->AllReduce(dev, n, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());

  // Counts no buffer can hold fail before NCCL sees them (a negative count
  // would reach it as a huge size_t), and leave the communicator usable.
  const int64_t huge = std::numeric_limits<int64_t>::max() / 4;
  EXPECT_EQ((*comm)->AllReduce(dev, -1, DType::kF32, ReduceOp::kSum)->Wait(kWait).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*comm)->AllReduce(dev, huge, DType::kI64, ReduceOp::kSum)->Wait(kWait).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*comm)->Send(dev, -5, DType::kF32, 0, 1)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE((*comm)->AsyncError().ok());
  ASSERT_TRUE((*comm)->AllReduce(dev, n, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());

  (*comm)->Abort(absl::CancelledError("job cancelled"));
  absl::Status after = (*comm)->AllReduce(dev, n, DType::kF32, ReduceOp::kSum)->Wait(kWait);
  EXPECT_EQ(after.code(), absl::StatusCode::kAborted) << after;
  EXPECT_EQ((*comm)->AsyncError().code(), absl::StatusCode::kAborted);
  cudaFree(dev);
  cudaFree(out);
}

TEST_F(NcclGpu, APeerThatNeverJoinsIsDeadlineExceeded) {
  InMemoryStore store;
  NcclCommunicator::Options o;
  o.timeout = absl::Seconds(3);
  const absl::Time start = absl::Now();
  auto comm = NcclCommunicator::Create(store, 0, 2, o);  // rank 1 never comes
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kDeadlineExceeded) << comm.status();
  EXPECT_LT(absl::Now() - start, o.timeout + absl::Seconds(1));
  InMemoryStore empty;
  auto waiting = NcclCommunicator::Create(empty, 1, 2, o);  // rank 0 never publishes the id
  EXPECT_EQ(waiting.status().code(), absl::StatusCode::kDeadlineExceeded) << waiting.status();
}

// A wait for rank 0's id whose slice ran past the deadline ends
// DEADLINE_EXCEEDED (a restart may mend it), never with a wait of a
// negative time, which the store refuses INVALID_ARGUMENT and the
// coordinator takes for the job's own error (never restarted).
TEST_F(NcclGpu, AStallingStoreIsDeadlineExceededNotInvalidArgument) {
  testing::OverrunningStore store(absl::Milliseconds(1100));
  NcclCommunicator::Options o;
  o.timeout = absl::Seconds(1);
  const absl::Status s = NcclCommunicator::Create(store, 1, 2, o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
}

// Runs body(rank, comm) on `n` threads, rank r on device r, each owning a
// world communicator made with options(r) (its device set to r); the body
// may destroy it.
void OnOwnedRanks(int n, const std::function<NcclCommunicator::Options(int)>& options,
                  const std::function<void(int, std::unique_ptr<NcclCommunicator>&)>& body) {
  InMemoryStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      NcclCommunicator::Options o = options(r);
      o.device = r;
      auto comm = NcclCommunicator::Create(store, r, n, o);
      ASSERT_TRUE(comm.ok()) << comm.status();
      body(r, *comm);
    });
  }
  for (auto& t : threads) t.join();
}

// OnOwnedRanks with communicators of `timeout`, which outlive the body.
void OnRanks(int n, absl::Duration timeout,
             const std::function<void(int, NcclCommunicator&)>& body) {
  OnOwnedRanks(
      n,
      [&](int) {
        NcclCommunicator::Options o;
        o.timeout = timeout;
        return o;
      },
      [&](int r, std::unique_ptr<NcclCommunicator>& comm) { body(r, *comm); });
}

float* DeviceFloats(const std::vector<float>& host) {
  float* d = nullptr;
  EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&d), host.size() * sizeof(float)), cudaSuccess);
  EXPECT_EQ(cudaMemcpy(d, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  return d;
}

std::vector<float> HostFloats(const float* d, size_t n) {
  std::vector<float> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

class NcclRanks : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() < 3) GTEST_SKIP() << "needs 3 CUDA devices, found " << kernels::CudaDeviceCount();
  }
};

TEST_F(NcclRanks, ARankThatNeverEntersFailsItsPeersWithinTheTimeout) {
  const absl::Duration timeout = absl::Seconds(2);
  OnRanks(3, timeout, [&](int r, NcclCommunicator& comm) {
    float* x = DeviceFloats({1.0f});
    ASSERT_TRUE(comm.AllReduce(x, 1, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());  // #1: everyone
    EXPECT_EQ(HostFloats(x, 1)[0], 3.0f);
    if (r == 2) {
      // Never enters #2; its peers' watchdog and waits end them.
      absl::SleepFor(timeout + absl::Seconds(1));
      comm.Abort(absl::CancelledError("rank 2 gives up"));
    } else {
      const absl::Time start = absl::Now();
      const absl::Status s = comm.AllReduce(x, 1, DType::kF32, ReduceOp::kSum)->Wait(kWait);  // #2
      const absl::Duration took = absl::Now() - start;
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_LT(took, timeout + absl::Seconds(2)) << s;
      for (const std::string& part : {absl::StrCat("AllReduce #2 on group world (rank ", r, "/3")}) {
        EXPECT_TRUE(absl::StrContains(s.message(), part)) << s;
      }
      // Sticky: the communicator stays failed with the same error.
      EXPECT_EQ(comm.AsyncError(), s);
      EXPECT_EQ(comm.AllReduce(x, 1, DType::kF32, ReduceOp::kSum)->Wait(kWait), s);
    }
    cudaFree(x);
  });
}

// Stream order: the collective sees what the compute stream wrote before it
// was submitted (in memory the compute stream's pool just handed out), and
// work issued after WaitOnDevice sees the collective's result; the host
// waits only for the final read. Under the emulation streams run on their own
// host threads, so a missing event shows as wrong values.
TEST_F(NcclRanks, CollectivesAreOrderedWithTheComputeStreamByEvents) {
  const int64_t n = 1 << 16;
  OnRanks(2, absl::Seconds(20), [&](int r, NcclCommunicator& comm) {
    std::vector<float> host(n);
    for (int64_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 7 + 1);
    for (int round = 0; round < 3; ++round) {
      auto a = kernels::cuda::Malloc(r, n * sizeof(float));
      auto b = kernels::cuda::Malloc(r, n * sizeof(float));
      ASSERT_TRUE(a.ok() && b.ok());
      float* x = static_cast<float*>(*a);
      float* y = static_cast<float*>(*b);
      ASSERT_TRUE(kernels::cuda::Memcpy(r, x, host.data(), n * sizeof(float)).ok());
      ASSERT_TRUE(kernels::cuda::Scale(r, kernels::ElemType::kF32, x, static_cast<float>(r + 1), x, n).ok());
      const absl::Time start = absl::Now();
      ASSERT_TRUE(comm.AllReduce(x, n, DType::kF32, ReduceOp::kSum)->WaitOnDevice(kWait).ok());
      EXPECT_LT(absl::Now() - start, absl::Seconds(5));
      ASSERT_TRUE(kernels::cuda::Scale(r, kernels::ElemType::kF32, x, 0.5f, y, n).ok());
      kernels::cuda::Free(r, x);  // in stream order, after the collective
      std::vector<float> got(n);
      ASSERT_TRUE(kernels::cuda::Memcpy(r, got.data(), y, n * sizeof(float)).ok());
      kernels::cuda::Free(r, y);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(got[i], 0.5f * 3.0f * host[i]) << "rank " << r << " round " << round << " element " << i;
      }
    }
    EXPECT_TRUE(comm.AsyncError().ok());
  });
}

// WaitOnDevice does not block the host; when a peer never enters, the
// watchdog aborts the communicator at the deadline, the device moves on, the
// host's next read returns, and AsyncError names the collective.
TEST_F(NcclRanks, AHangWaitedOnTheDeviceEndsAtTheWatchdogsDeadline) {
  const absl::Duration timeout = absl::Seconds(2);
  OnRanks(3, timeout, [&](int r, NcclCommunicator& comm) {
    float* x = DeviceFloats({1.0f});
    ASSERT_TRUE(comm.AllReduce(x, 1, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());  // #1: everyone
    if (r == 2) {
      absl::SleepFor(timeout + absl::Seconds(1));  // never enters #2
      comm.Abort(absl::CancelledError("rank 2 gives up"));
    } else {
      const absl::Time start = absl::Now();
      ASSERT_TRUE(comm.AllReduce(x, 1, DType::kF32, ReduceOp::kSum)->WaitOnDevice(kWait).ok());  // #2
      EXPECT_LT(absl::Now() - start, absl::Milliseconds(500)) << "the host waited";
      float got = 0;
      ASSERT_TRUE(kernels::cuda::Memcpy(r, &got, x, sizeof(float)).ok());  // waits for the device
      EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(2));
      const absl::Status s = comm.AsyncError();
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), absl::StrCat("AllReduce #2 on group world (rank ", r, "/3"))) << s;
      EXPECT_EQ(comm.AllReduce(x, 1, DType::kF32, ReduceOp::kSum)->WaitOnDevice(kWait), s);  // sticky
    }
    cudaFree(x);
  });
}

// The metrics' observer sees a collective the device waited for once it has
// completed: at the communicator's next AsyncError, not at WaitOnDevice.
TEST_F(NcclGpu, AnInstrumentedCollectiveWaitedOnTheDeviceIsReportedOnce) {
  InMemoryStore store;
  auto comm = NcclCommunicator::Create(store, 0, 1, {});
  ASSERT_TRUE(comm.ok()) << comm.status();
  std::atomic<int> reports{0};
  std::atomic<int64_t> bytes{0};
  InstrumentedCommunicator inst(*std::move(comm), [&](const char*, int64_t b, absl::Duration) {
    ++reports;
    bytes += b;
  });
  float* x = DeviceFloats(std::vector<float>(1000, 1.0f));
  ASSERT_TRUE(inst.AllReduce(x, 1000, DType::kF32, ReduceOp::kSum)->WaitOnDevice(kWait).ok());
  float got = 0;
  ASSERT_TRUE(kernels::cuda::Memcpy(0, &got, x, sizeof(float)).ok());  // the device passed the collective
  EXPECT_EQ(got, 1.0f);
  ASSERT_TRUE(inst.AsyncError().ok());
  EXPECT_EQ(reports.load(), 1);
  EXPECT_EQ(bytes.load(), 4000);
  ASSERT_TRUE(inst.AsyncError().ok());
  EXPECT_EQ(reports.load(), 1);  // once
  cudaFree(x);
}

TEST_F(NcclRanks, SendRecvExchangesWithoutDeadlock) {
  OnRanks(2, absl::Seconds(20), [&](int r, NcclCommunicator& comm) {
    float* out = DeviceFloats({10.0f * (r + 1), 10.0f * (r + 1) + 1});
    float* in = DeviceFloats({0, 0});
    const int peer = 1 - r;
    // A peer outside the group, or oneself outside a group, is refused
    // before NCCL sees it: the communicator stays usable.
    for (const int bad : {-1, 2, r}) {
      const absl::Status send = comm.Send(out, 2, DType::kF32, bad, 0)->Wait(kWait);
      EXPECT_EQ(send.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << send;
      const absl::Status recv = comm.Recv(in, 2, DType::kF32, bad, 0)->Wait(kWait);
      EXPECT_EQ(recv.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << recv;
    }
    EXPECT_EQ(comm.SendRecv(out, 2, in, peer, 2, DType::kF32)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
    // Oneself one way only: the other end would wait forever.
    EXPECT_EQ(comm.SendRecv(out, r, in, peer, 2, DType::kF32)->Wait(kWait).code(), absl::StatusCode::kInvalidArgument);
    ASSERT_TRUE(comm.AsyncError().ok()) << comm.AsyncError();
    // Both ranks send first: only a grouped exchange completes.
    ASSERT_TRUE(comm.SendRecv(out, peer, in, peer, 2, DType::kF32)->Wait(kWait).ok());
    EXPECT_EQ(HostFloats(in, 2), (std::vector<float>{10.0f * (peer + 1), 10.0f * (peer + 1) + 1}));
    cudaFree(out);
    cudaFree(in);
  });
}

// NCCL connects a pair at its first send and receive, holding the caller
// until the peer reaches its end (the emulation's NCCL too). A first Send
// whose receiver never comes is in the flight recorder while it waits, as
// the hang detector must see it, and fails with DEADLINE_EXCEEDED within
// the timeout, saying what it waited for.
TEST_F(NcclRanks, AFirstSendWhosePeerNeverReceivesIsRecordedAndFailsWithinTheTimeout) {
  const absl::Duration timeout = absl::Seconds(2);
  InMemoryStore store;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      NcclCommunicator::Options o;
      o.device = r;
      o.timeout = timeout;
      auto made = NcclCommunicator::Create(store, r, 2, o);
      ASSERT_TRUE(made.ok()) << made.status();
      if (r == 1) {  // never receives
        absl::SleepFor(timeout + absl::Seconds(1));
        (*made)->Abort(absl::CancelledError("rank 1 gives up"));
        return;
      }
      auto recorder = std::make_shared<FlightRecorder>();
      InstrumentedCommunicator comm(*std::move(made), nullptr, recorder, "pp");
      std::atomic<bool> seen{false};
      std::thread watcher([&] {
        for (int i = 0; i < 100 && !seen; ++i) {
          for (const v1::CollectiveProgress& g : recorder->Progress(absl::Now())) {
            if (g.group() == "pp" && g.pending_sequence() == 1 && g.pending_op() == "send") seen = true;
          }
          absl::SleepFor(absl::Milliseconds(10));
        }
      });
      float* x = DeviceFloats({1.0f});
      const absl::Time start = absl::Now();
      const absl::Status s = comm.Send(x, 1, DType::kF32, 1, 0)->Wait(kWait);
      watcher.join();
      EXPECT_TRUE(seen) << "the send was not pending in the flight recorder while it connected";
      EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
      EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(2)) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "Send #1 on group world (rank 0/2")) << s;
      EXPECT_TRUE(absl::StrContains(s.message(), "a pair at its first send and receive")) << s;
      cudaFree(x);
    });
  }
  for (auto& t : threads) t.join();
}

TEST_F(NcclRanks, APeerThatNeverSplitsFailsTheSplitAndAbortsTheParent) {
  const absl::Duration timeout = absl::Seconds(2);
  OnRanks(3, timeout, [&](int r, NcclCommunicator& comm) {
    if (r == 2) {
      absl::SleepFor(timeout + absl::Seconds(1));
      comm.Abort(absl::CancelledError("rank 2 never splits"));
      return;
    }
    const absl::Time start = absl::Now();
    auto sub = comm.Split(0, r, "tp");
    EXPECT_EQ(sub.status().code(), absl::StatusCode::kDeadlineExceeded) << sub.status();
    EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(2));
    EXPECT_FALSE(comm.AsyncError().ok());  // the parent is aborted
  });
}

// A split NCCL refuses at once (here a color it cannot take) aborts the
// parent, as the header says and as a split that fails later does (it
// returned with the parent live, and its rank's next collective waited for
// peers that had gone on into the split). The peer, in the split alone,
// fails at its timeout with its parent aborted too.
TEST_F(NcclRanks, ASplitRefusedAtOnceAbortsTheParentToo) {
  const absl::Duration timeout = absl::Seconds(2);
  OnRanks(2, timeout, [&](int r, NcclCommunicator& comm) {
    const absl::Time start = absl::Now();
    auto sub = comm.Split(r == 0 ? -7 : 0, r, "tp");
    EXPECT_FALSE(sub.ok());
    if (r == 0) {
      EXPECT_EQ(sub.status().code(), absl::StatusCode::kInvalidArgument) << sub.status();
      EXPECT_LT(absl::Now() - start, absl::Seconds(1));
    }
    EXPECT_FALSE(comm.AsyncError().ok()) << "rank " << r << ": the parent is not aborted";
  });
}

// Destroys `comm` (device `device`) and waits for the device on a thread of
// its own; false if they did not return within `limit` (the thread is then
// left waiting, holding the communicator).
bool DestroyAndSyncWithin(std::unique_ptr<NcclCommunicator> comm, int device, absl::Duration limit) {
  auto done = std::make_shared<absl::Notification>();
  std::thread([c = std::move(comm), device, done]() mutable {
    c.reset();
    cudaSetDevice(device);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    done->Notify();
  }).detach();
  return done->WaitForNotificationWithTimeout(limit);
}

// Two ranks after a collective together: rank 1 enqueues collective #2,
// which rank 0 never enters, makes the device wait for it, and is destroyed
// at once (no Abort: a rank that failed on its own and unwinds), with
// `signal` (if any) as its abort signal, fired `fire_after` into the
// destruction. Expects the destructor to return and the device to be idle
// within `limit`.
void DestroyWhileACollectiveWaits(absl::Duration timeout, std::shared_ptr<AbortSignal> signal,
                                  absl::Duration fire_after, absl::Duration limit) {
  absl::Notification rank1_done;
  auto options = [&](int r) {
    NcclCommunicator::Options o;
    o.timeout = timeout;
    if (r == 1) o.abort_signal = signal;
    return o;
  };
  OnOwnedRanks(2, options, [&](int r, std::unique_ptr<NcclCommunicator>& comm) {
    float* x = DeviceFloats({1.0f});
    ASSERT_TRUE(comm->AllReduce(x, 1, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());  // #1: both
    if (r == 0) {
      // Never enters #2; destroyed (cleanly: nothing outstanding) once rank 1 was.
      rank1_done.WaitForNotificationWithTimeout(kWait);
      EXPECT_TRUE(DestroyAndSyncWithin(std::move(comm), r, absl::Seconds(10)));
      cudaFree(x);
      return;
    }
    // #2, waited on the device (a Work waited on the host would abort it
    // at the timeout itself).
    ASSERT_TRUE(comm->AllReduce(x, 1, DType::kF32, ReduceOp::kSum)->WaitOnDevice(kWait).ok());
    const absl::Time start = absl::Now();
    std::thread firer;
    if (signal != nullptr) {
      firer = std::thread([&] {
        absl::SleepFor(fire_after);
        signal->Abort(absl::CancelledError("the job was aborted"));
      });
    }
    EXPECT_TRUE(DestroyAndSyncWithin(std::move(comm), r, limit))
        << "the destructor or the device still waits for collective #2 after "
        << absl::FormatDuration(absl::Now() - start);
    if (firer.joinable()) firer.join();
    rank1_done.Notify();
    cudaFree(x);
  });
}

// The destructor gives outstanding work the timeout to finish, then aborts
// it. Destroying the handle instead left the collective waiting on the
// device, and the destructor with it.
TEST_F(NcclRanks, ACommunicatorDestroyedWithACollectiveWaitingOnAPeerAbortsItAtTheTimeout) {
  const absl::Duration timeout = absl::Seconds(2);
  DestroyWhileACollectiveWaits(timeout, nullptr, absl::ZeroDuration(), timeout + absl::Seconds(3));
}

// The job's abort signal, fired while the destructor waits (its process
// group no longer reaches the communicator), ends the wait at once.
TEST_F(NcclRanks, TheJobsAbortEndsTheWaitOfACommunicatorBeingDestroyed) {
  DestroyWhileACollectiveWaits(absl::Seconds(60), std::make_shared<AbortSignal>(), absl::Milliseconds(300),
                               absl::Seconds(3));
}

#if defined(COLOD_CUDA_EMULATION)
// The lost peer of a worker whose clique's process died, as the emulation
// reports it (ncclRemoteError from ncclCommGetAsyncError, the collective
// waiting until aborted): a communicator destroyed then is aborted at once,
// without waiting for its timeout.
TEST_F(NcclRanks, ACommunicatorDestroyedAfterAnAsyncErrorAbortsItAtOnce) {
  colod_nccl_emu::SetFault({colod_nccl_emu::FaultKind::kError, /*rank=*/1, /*op=*/2, /*comm_size=*/2});
  auto options = [](int) {
    NcclCommunicator::Options o;
    o.timeout = absl::Seconds(20);
    return o;
  };
  OnOwnedRanks(2, options, [&](int r, std::unique_ptr<NcclCommunicator>& comm) {
    float* x = DeviceFloats({1.0f});
    ASSERT_TRUE(comm->AllReduce(x, 1, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());  // #1: both
    // #2 on rank 1 only: it reports the error and waits until aborted.
    // Destroyed at once, so the watchdog cannot abort it first.
    // (Its submission may already see the error and abort the
    // communicator; the destruction must be prompt either way.)
    if (r == 1) (void)comm->AllReduce(x, 1, DType::kF32, ReduceOp::kSum)->WaitOnDevice(kWait);
    EXPECT_TRUE(DestroyAndSyncWithin(std::move(comm), r, absl::Seconds(5))) << "rank " << r;
    cudaFree(x);
  });
  colod_nccl_emu::SetFault({});
}
#endif

#if defined(COLOD_CUDA_EMULATION)
// The watchdog aborts a communicator whose job's signal fired, and an abort
// may take seconds. It used to do so under the lock that every
// communicator's creation and destruction takes, so one slow abort held up
// every other group of the process.
TEST_F(NcclGpu, ASlowAbortByTheWatchdogHoldsUpNoOtherCommunicator) {
  colod_nccl_emu::SetAbortPause(2000);
  const long begun = colod_nccl_emu::AbortsBegun();
  InMemoryStore store;
  NcclCommunicator::Options o;
  o.abort_signal = std::make_shared<AbortSignal>();
  auto aborted = NcclCommunicator::Create(store, 0, 1, o);
  ASSERT_TRUE(aborted.ok()) << aborted.status();
  o.abort_signal->Abort(absl::CancelledError("job cancelled"));
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (colod_nccl_emu::AbortsBegun() == begun && absl::Now() < until) absl::SleepFor(absl::Milliseconds(2));
  ASSERT_GT(colod_nccl_emu::AbortsBegun(), begun) << "the watchdog never aborted the communicator";

  // While the abort runs, another communicator is made, used and destroyed.
  const absl::Time start = absl::Now();
  {
    InMemoryStore other_store;
    auto other = NcclCommunicator::Create(other_store, 0, 1, {});
    ASSERT_TRUE(other.ok()) << other.status();
    float* x = nullptr;
    ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&x), sizeof(float)), cudaSuccess);
    EXPECT_TRUE((*other)->AllReduce(x, 1, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());
    other->reset();
    cudaFree(x);
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  colod_nccl_emu::SetAbortPause(0);

  // The aborted one's destructor waits for the watchdog's visit to end.
  EXPECT_EQ((*aborted)->AsyncError().code(), absl::StatusCode::kCancelled);
  aborted->reset();
}
#endif

TEST_F(NcclRanks, AbortAndAsyncErrorRaceSafely) {
  OnRanks(3, absl::Seconds(20), [&](int r, NcclCommunicator& comm) {
    std::atomic<bool> stop{false};
    std::thread poller([&] {
      while (!stop) (void)comm.AsyncError();  // never touches a freed handle
    });
    absl::SleepFor(absl::Milliseconds(20));
    comm.Abort(absl::CancelledError(absl::StrCat("rank ", r, " stops")));
    absl::SleepFor(absl::Milliseconds(20));
    stop = true;
    poller.join();
    EXPECT_EQ(comm.AsyncError().code(), absl::StatusCode::kAborted);
  });
}

// Abort reaches a rendezvous in progress: a peer that never joins would keep
// init waiting for the whole timeout; the group's abort signal ends it.
TEST_F(NcclRanks, AnAbortEndsInitPromptly) {
  InMemoryStore store;
  NcclCommunicator::Options o;
  o.timeout = absl::Seconds(60);
  o.abort_signal = std::make_shared<AbortSignal>();
  std::thread aborter([&] {
    absl::SleepFor(absl::Milliseconds(300));
    o.abort_signal->Abort(absl::CancelledError("job cancelled during init"));
  });
  const absl::Time start = absl::Now();
  auto comm = NcclCommunicator::Create(store, 0, 2, o);  // rank 1 never comes
  aborter.join();
  EXPECT_EQ(comm.status().code(), absl::StatusCode::kCancelled) << comm.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  // A rank waiting for rank 0's unique id stops too.
  InMemoryStore empty;
  NcclCommunicator::Options fired = o;
  fired.abort_signal = std::make_shared<AbortSignal>();
  fired.abort_signal->Abort(absl::CancelledError("already cancelled"));
  EXPECT_EQ(NcclCommunicator::Create(empty, 1, 2, fired).status().code(), absl::StatusCode::kCancelled);
}

TEST_F(NcclRanks, AnAbortEndsASplitInProgressPromptly) {
  auto signal = std::make_shared<AbortSignal>();
  auto options = [&](int) {
    NcclCommunicator::Options o;
    o.timeout = absl::Seconds(60);
    o.abort_signal = signal;
    return o;
  };
  OnOwnedRanks(2, options, [&](int r, std::unique_ptr<NcclCommunicator>& comm) {
    if (r == 1) {
    absl::SleepFor(absl::Milliseconds(300));  // never splits
    signal->Abort(absl::CancelledError("job cancelled during a split"));
    return;
    }
    const absl::Time start = absl::Now();
    auto sub = comm->Split(0, 0, "tp");
    EXPECT_EQ(sub.status().code(), absl::StatusCode::kCancelled) << sub.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  });
}

}  // namespace
}  // namespace colod
