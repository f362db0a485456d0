// The emulated NCCL across processes: ranks in peer processes (nccl_peer)
// join communicators whose id this process made, or this process joins one
// a peer made, over the id's address; collectives, groups and splits give
// their definitions, and a peer killed, stopped or aborting behaves as on
// GPUs (nccl.cc).
#include <cuda_runtime.h>
#include <nccl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/cuda/emu/nccl_ranks.h"

extern char** environ;

namespace {

using colod_nccl_emu_test::Connect;
using colod_nccl_emu_test::IdFromHex;
using colod_nccl_emu_test::IdToHex;
using colod_nccl_emu_test::RunCollectives;

// A peer process with its stdout on a pipe; killed and reaped at the end.
class Peer {
 public:
  explicit Peer(std::vector<std::string> args) {
    const char* srcdir = getenv("TEST_SRCDIR");
    const char* workspace = getenv("TEST_WORKSPACE");
    std::string binary = "kernels/cuda/emu/nccl_peer";
    if (srcdir != nullptr && workspace != nullptr) binary = std::string(srcdir) + "/" + workspace + "/" + binary;
    args.insert(args.begin(), binary);
    int fds[2];
    if (pipe(fds) != 0) return;
    posix_spawn_file_actions_t files;
    posix_spawn_file_actions_init(&files);
    posix_spawn_file_actions_adddup2(&files, fds[1], 1);
    posix_spawn_file_actions_addclose(&files, fds[0]);
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    if (posix_spawn(&pid_, binary.c_str(), &files, nullptr, argv.data(), environ) != 0) pid_ = -1;
    posix_spawn_file_actions_destroy(&files);
    close(fds[1]);
    out_ = fds[0];
  }
  ~Peer() {
    if (pid_ > 0 && !reaped_) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    if (out_ >= 0) close(out_);
  }
  bool started() const { return pid_ > 0; }
  void Signal(int sig) { kill(pid_, sig); }

  // The next line of its stdout, or "" after 30 s or at its end.
  std::string ReadLine() {
    std::string line;
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (std::chrono::steady_clock::now() < deadline) {
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, 100) <= 0) continue;
      char ch;
      if (read(out_, &ch, 1) != 1) return line;
      if (ch == '\n') return line;
      line += ch;
    }
    return line;
  }

  // Its exit code (128 + signal if one ended it); -1 if it runs on after 30 s.
  int Wait() {
    for (int i = 0; i < 3000; ++i) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        reaped_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  bool reaped_ = false;
};

// ncclCommGetAsyncError until it is not ncclSuccess, at most 10 s.
ncclResult_t AwaitAsyncError(ncclComm_t comm) {
  ncclResult_t state = ncclSuccess;
  for (int i = 0; i < 1000 && state == ncclSuccess; ++i) {
    EXPECT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
    if (state == ncclSuccess) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return state;
}

// With an all-reduce of `comm` waiting on `peer`: kills the peer, and
// expects the communicator to report the lost peer while the all-reduce
// waits on, as NCCL's kernel does, until the abort ends it.
void KillPeerMidAllReduce(Peer& peer, ncclComm_t comm) {
  float* x = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&x), sizeof(float)), cudaSuccess);
  ASSERT_EQ(ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, comm, cudaStreamPerThread), ncclSuccess);
  peer.Signal(SIGKILL);
  EXPECT_EQ(peer.Wait(), 128 + SIGKILL);
  EXPECT_EQ(AwaitAsyncError(comm), ncclRemoteError);
  EXPECT_EQ(cudaStreamQuery(cudaStreamPerThread), cudaErrorNotReady);
  ASSERT_EQ(ncclCommAbort(comm), ncclSuccess);
  EXPECT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  cudaFree(x);
}

TEST(NcclAcrossProcesses, CollectivesGroupsAndSplitsMatchTheirDefinitions) {
  // Ranks 0 and 2 are threads here, 1 and 3 peer processes.
  const int n = 4;
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  Peer p1({"collectives", IdToHex(id), "1", "4"}), p3({"collectives", IdToHex(id), "3", "4"});
  ASSERT_TRUE(p1.started() && p3.started());
  std::string errors[n];
  std::vector<std::thread> here;
  for (int r : {0, 2}) here.emplace_back([&, r] { errors[r] = RunCollectives(id, r, n, r); });
  for (auto& t : here) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[2], "");
  EXPECT_EQ(p1.Wait(), 0);
  EXPECT_EQ(p3.Wait(), 0);
}

TEST(NcclAcrossProcesses, AKilledPeerIsALostPeerAndAbortFreesTheWait) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  Peer peer({"join", IdToHex(id), "1", "2"});
  ASSERT_TRUE(peer.started());
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ncclComm_t comm;
  ASSERT_EQ(ncclCommInitRank(&comm, 2, id, 0), ncclSuccess);
  ASSERT_TRUE(Connect(comm));
  ASSERT_EQ(peer.ReadLine(), "joined");
  KillPeerMidAllReduce(peer, comm);
}

TEST(NcclAcrossProcesses, AStoppedPeerHangsItsPeersWithoutAnErrorUntilTheyAbort) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  Peer peer({"join", IdToHex(id), "1", "2"});
  ASSERT_TRUE(peer.started());
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ncclComm_t comm;
  ASSERT_EQ(ncclCommInitRank(&comm, 2, id, 0), ncclSuccess);
  ASSERT_TRUE(Connect(comm));
  ASSERT_EQ(peer.ReadLine(), "joined");
  peer.Signal(SIGSTOP);
  float* x = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&x), sizeof(float)), cudaSuccess);
  ASSERT_EQ(ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, comm, cudaStreamPerThread), ncclSuccess);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ncclResult_t state = ncclInternalError;
  ASSERT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
  EXPECT_EQ(state, ncclSuccess);  // a hang: only a watchdog's timeout tells
  EXPECT_EQ(cudaStreamQuery(cudaStreamPerThread), cudaErrorNotReady);
  ASSERT_EQ(ncclCommAbort(comm), ncclSuccess);
  EXPECT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  peer.Signal(SIGKILL);
  EXPECT_EQ(peer.Wait(), 128 + SIGKILL);
  cudaFree(x);
}

TEST(NcclAcrossProcesses, ARemoteRankThatAbortsIsFreedAndNoLostPeer) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  Peer peer({"abort", IdToHex(id), "1", "2"});
  ASSERT_TRUE(peer.started());
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ncclComm_t comm;
  ASSERT_EQ(ncclCommInitRank(&comm, 2, id, 0), ncclSuccess);
  ASSERT_TRUE(Connect(comm));
  // The peer's next all-reduce waits for this rank, which never enters; its
  // abort frees it.
  EXPECT_EQ(peer.ReadLine(), "released");
  EXPECT_EQ(peer.Wait(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  ncclResult_t state = ncclInternalError;
  ASSERT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
  EXPECT_EQ(state, ncclSuccess);  // an abort is not a lost process
  ncclCommDestroy(comm);
}

// A peer that exits after its last collective completed is no lost peer
// until a rank waits for it again, as on GPUs: a job's ranks do not end at
// the same moment.
TEST(NcclAcrossProcesses, APeerThatExitsAfterItsLastCollectiveIsLostOnlyToTheNextOne) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  Peer peer({"exit", IdToHex(id), "1", "2"});
  ASSERT_TRUE(peer.started());
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ncclComm_t comm;
  ASSERT_EQ(ncclCommInitRank(&comm, 2, id, 0), ncclSuccess);
  float* x = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&x), sizeof(float)), cudaSuccess);
  const float two = 2.0f;
  ASSERT_EQ(cudaMemcpy(x, &two, sizeof two, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, comm, cudaStreamPerThread), ncclSuccess);
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  float got = 0;
  ASSERT_EQ(cudaMemcpy(&got, x, sizeof got, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(got, 3.0f);
  EXPECT_EQ(peer.Wait(), 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ncclResult_t state = ncclInternalError;
  ASSERT_EQ(ncclCommGetAsyncError(comm, &state), ncclSuccess);
  EXPECT_EQ(state, ncclSuccess);
  // The next collective waits for the gone peer: a lost peer now.
  ASSERT_EQ(ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, comm, cudaStreamPerThread), ncclSuccess);
  EXPECT_EQ(AwaitAsyncError(comm), ncclRemoteError);
  ASSERT_EQ(ncclCommAbort(comm), ncclSuccess);
  EXPECT_EQ(cudaStreamSynchronize(cudaStreamPerThread), cudaSuccess);
  cudaFree(x);
}

TEST(NcclAcrossProcesses, ARankLosesTheProcessThatHoldsItsClique) {
  Peer host({"host", "2"});
  ASSERT_TRUE(host.started());
  ncclUniqueId id;
  ASSERT_TRUE(IdFromHex(host.ReadLine(), &id));
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ncclComm_t comm;
  ASSERT_EQ(ncclCommInitRank(&comm, 2, id, 1), ncclSuccess);  // over the id's address
  ASSERT_TRUE(Connect(comm));
  ASSERT_EQ(host.ReadLine(), "joined");
  KillPeerMidAllReduce(host, comm);
}

TEST(NcclAcrossProcesses, AnUnreachableAddressFailsTheInit) {
  ncclUniqueId id{};
  snprintf(id.internal, sizeof id.internal, "colod-nccl-emu:1:1:0@127.0.0.1:1");
  ncclComm_t comm = nullptr;
  EXPECT_EQ(ncclCommInitRank(&comm, 2, id, 1), ncclSystemError);
}

}  // namespace
