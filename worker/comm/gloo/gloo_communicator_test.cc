// Real ranks (threads) over real Gloo on loopback, rendezvous through an
// in-memory store. Every result is checked against the closed form computed
// here from the same inputs.
#include "worker/comm/gloo/gloo_communicator.h"

#include <linux/tcp.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "common/rendezvous_store.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gtest/gtest.h"
#include "worker/comm/store.h"
#include "worker/comm/store_testing.h"

namespace colod {
namespace {

constexpr absl::Duration kWait = absl::Seconds(30);

// `n` ranks connected over a store of their own (each made on a thread of
// its own, as ranks are), `timeout` each (and `configure`'s options); empty
// where one could not connect.
std::vector<std::unique_ptr<GlooCommunicator>> ConnectedRanks(
    int n, absl::Duration timeout, const std::function<void(GlooCommunicator::Options&)>& configure = nullptr) {
  auto shared = std::make_shared<RendezvousStore>();
  std::vector<std::unique_ptr<GlooCommunicator>> comms(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      InMemoryStore store(shared, "test");
      GlooCommunicator::Options o;
      o.timeout = timeout;
      if (configure) configure(o);
      auto c = GlooCommunicator::Create(store, r, n, o);
      ASSERT_TRUE(c.ok()) << c.status();
      comms[r] = std::move(*c);
    });
  }
  for (auto& t : threads) t.join();
  for (const auto& c : comms) {
    if (c == nullptr) return {};
  }
  return comms;
}

// Connects `n` ranks, runs body(rank, comm) on a thread each, then a final
// barrier; keeps every communicator alive until all ranks are done (Gloo
// teardown rule).
void RunRanks(int n, const std::function<void(int, Communicator&)>& body, absl::Duration timeout = absl::Seconds(30),
              const std::function<void(GlooCommunicator::Options&)>& configure = nullptr) {
  std::vector<std::unique_ptr<GlooCommunicator>> comms = ConnectedRanks(n, timeout, configure);
  ASSERT_EQ(comms.size(), static_cast<size_t>(n)) << "the ranks did not connect";
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      body(r, *comms[r]);
      ASSERT_TRUE(comms[r]->Barrier()->Wait(kWait).ok());
    });
  }
  for (auto& t : threads) t.join();
}

// Element i of rank r: small integers, exact in every dtype, never all zero.
double Value(int rank, int64_t i) { return static_cast<double>((rank + 1) * (i % 7) - 3 + rank); }

std::vector<char> Encode(const std::vector<double>& v, DType t) {
  std::vector<char> out(v.size() * SizeOf(t));
  for (size_t i = 0; i < v.size(); ++i) {
    char* p = out.data() + i * SizeOf(t);
    switch (t) {
      case DType::kF32: { float x = static_cast<float>(v[i]); std::memcpy(p, &x, 4); break; }
      case DType::kBF16: { uint16_t x = FloatToBF16(static_cast<float>(v[i])); std::memcpy(p, &x, 2); break; }
      case DType::kF16: { uint16_t x = FloatToF16(static_cast<float>(v[i])); std::memcpy(p, &x, 2); break; }
      case DType::kI32: { int32_t x = static_cast<int32_t>(v[i]); std::memcpy(p, &x, 4); break; }
      case DType::kI64: { int64_t x = static_cast<int64_t>(v[i]); std::memcpy(p, &x, 8); break; }
    }
  }
  return out;
}

std::vector<double> Decode(const std::vector<char>& b, DType t) {
  std::vector<double> out(b.size() / SizeOf(t));
  for (size_t i = 0; i < out.size(); ++i) {
    const char* p = b.data() + i * SizeOf(t);
    switch (t) {
      case DType::kF32: { float x; std::memcpy(&x, p, 4); out[i] = x; break; }
      case DType::kBF16: { uint16_t x; std::memcpy(&x, p, 2); out[i] = BF16ToFloat(x); break; }
      case DType::kF16: { uint16_t x; std::memcpy(&x, p, 2); out[i] = F16ToFloat(x); break; }
      case DType::kI32: { int32_t x; std::memcpy(&x, p, 4); out[i] = x; break; }
      case DType::kI64: { int64_t x; std::memcpy(&x, p, 8); out[i] = static_cast<double>(x); break; }
    }
  }
  return out;
}

// What reducing the ranks' values gives in dtype t (integers are exact, so
// only kAvg rounds: once, like the implementation).
double Expected(int n, int64_t i, ReduceOp op, DType t) {
  double sum = 0, mx = -1e300, mn = 1e300;
  for (int r = 0; r < n; ++r) {
    sum += Value(r, i);
    mx = std::max(mx, Value(r, i));
    mn = std::min(mn, Value(r, i));
  }
  switch (op) {
    case ReduceOp::kSum: return sum;
    case ReduceOp::kMax: return mx;
    case ReduceOp::kMin: return mn;
    case ReduceOp::kAvg:
      if (t == DType::kI32 || t == DType::kI64) return static_cast<double>(static_cast<int64_t>(sum) / n);
      return Decode(Encode({static_cast<double>(static_cast<float>(sum) / static_cast<float>(n))}, t), t)[0];
  }
  return 0;
}

const DType kDTypes[] = {DType::kF32, DType::kBF16, DType::kF16, DType::kI32, DType::kI64};

class GlooRanks : public ::testing::TestWithParam<int> {};

// Each algorithm the communicator picks between (between two ranks colod's
// exchange up to two_rank_exchange_max_bytes; else Gloo's bcube up to
// halving_doubling_max_bytes and its ring above), each on counts that do not
// split evenly, fewer elements than ranks, and one segment or several.
TEST_P(GlooRanks, AllReduceEveryDTypeAndOp) {
  const int n = GetParam();
  // Gloo's ring, Gloo's bcube, and (two ranks only) colod's exchange.
  for (const std::string algorithm : {"ring", "bcube", "exchange"}) {
    if (algorithm == "exchange" && n != 2) continue;
    RunRanks(
        n,
        [&](int rank, Communicator& comm) {
          for (const int64_t count : {int64_t{1003}, int64_t{n - 1}, int64_t{1}}) {
            for (DType t : kDTypes) {
              for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
                std::vector<double> mine(count);
                for (int64_t i = 0; i < count; ++i) mine[i] = Value(rank, i);
                std::vector<char> buf = Encode(mine, t);
                ASSERT_TRUE(comm.AllReduce(buf.data(), count, t, op)->Wait(kWait).ok());
                std::vector<double> got = Decode(buf, t);
                for (int64_t i = 0; i < count; ++i) {
                  ASSERT_EQ(got[i], Expected(n, i, op, t))
                      << algorithm << " " << DTypeName(t) << " op " << static_cast<int>(op)
                      << " count " << count << " i " << i << " rank " << rank;
                }
              }
            }
          }
          // 3 MiB of f32: several ring segments in flight, or bcube's halves.
          const int64_t big = 3 << 18;
          std::vector<float> v(big);
          for (int64_t i = 0; i < big; ++i) v[i] = static_cast<float>((i % 97) * (rank + 1));
          ASSERT_TRUE(comm.AllReduce(v.data(), big, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());
          for (int64_t i = 0; i < big; ++i) {
            ASSERT_EQ(v[i], static_cast<float>((i % 97) * n * (n + 1) / 2)) << "i " << i;
          }
        },
        absl::Seconds(30), [&](GlooCommunicator::Options& o) {
          o.halving_doubling_max_bytes = algorithm == "ring" ? 0 : std::numeric_limits<size_t>::max();
          o.two_rank_exchange_max_bytes = algorithm == "exchange" ? std::numeric_limits<size_t>::max() : 0;
        });
  }
}

// The two-rank exchange reduces op(rank 0's, rank 1's) on both ranks, so they
// end with the same bits even where the op is not commutative: the max of a
// NaN and a number depends on the order of its operands.
// What a Gloo exception becomes: out of memory is RESOURCE_EXHAUSTED (which
// no restart retries, as the worker's own bad_alloc), not UNAVAILABLE (a
// peer's closed connection, which restarts the job until its policy is
// spent); a failed check of Gloo's INTERNAL; a timeout DEADLINE_EXCEEDED.
TEST(Gloo, AnExceptionBecomesTheStatusThatSaysWhatHappened) {
  using gloo_detail::StatusFromGlooException;
  const absl::Status memory = StatusFromGlooException(std::bad_alloc(), "reduce_scatter");
  EXPECT_EQ(memory.code(), absl::StatusCode::kResourceExhausted) << memory;
  EXPECT_TRUE(absl::StartsWith(memory.message(), "gloo reduce_scatter: out of memory")) << memory;
  const absl::Status check = StatusFromGlooException(::gloo::EnforceNotMet("f.cc", 3, "n == m", "sizes differ"), "x");
  EXPECT_EQ(check.code(), absl::StatusCode::kInternal) << check;
  EXPECT_TRUE(absl::StrContains(check.message(), "sizes differ")) << check;
  const absl::Status closed = StatusFromGlooException(::gloo::IoException("Connection closed by peer"), "all_reduce");
  EXPECT_EQ(closed.code(), absl::StatusCode::kUnavailable) << closed;
  EXPECT_EQ(closed.message(), "gloo all_reduce: Connection closed by peer");
  const absl::Status late = StatusFromGlooException(::gloo::IoException("Timed out waiting 2000ms"), "barrier");
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded) << late;
  const absl::Status unreached =
      StatusFromGlooException(::gloo::IoException("Connect timeout [127.0.0.1]:40123"), "rendezvous");
  EXPECT_EQ(unreached.code(), absl::StatusCode::kDeadlineExceeded) << unreached;
}

TEST(Gloo, TheTwoRankExchangeLeavesBothRanksTheSameBits) {
  constexpr int64_t kCount = 4;
  std::vector<std::vector<float>> v(2);
  RunRanks(2, [&](int rank, Communicator& comm) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    // Element 0: NaN on rank 0; element 1: NaN on rank 1; 2 and 3: numbers.
    v[rank] = rank == 0 ? std::vector<float>{nan, 1.0f, 2.0f, -0.0f} : std::vector<float>{5.0f, nan, 3.0f, 0.0f};
    ASSERT_TRUE(comm.AllReduce(v[rank].data(), kCount, DType::kF32, ReduceOp::kMax)->Wait(kWait).ok());
  });
  ASSERT_EQ(v[0].size(), static_cast<size_t>(kCount));
  ASSERT_EQ(v[1].size(), static_cast<size_t>(kCount));
  EXPECT_EQ(std::memcmp(v[0].data(), v[1].data(), kCount * sizeof(float)), 0)
      << v[0][0] << " " << v[0][1] << " " << v[0][3] << " / " << v[1][0] << " " << v[1][1] << " " << v[1][3];
  EXPECT_EQ(v[0][2], 3.0f);
}

TEST_P(GlooRanks, AllGatherReduceScatterBroadcastAllToAll) {
  const int n = GetParam();
  const int64_t count = 37;
  RunRanks(n, [&](int rank, Communicator& comm) {
    for (DType t : kDTypes) {
      std::vector<double> mine(count);
      for (int64_t i = 0; i < count; ++i) mine[i] = Value(rank, i);
      std::vector<char> in = Encode(mine, t);

      std::vector<char> gathered(in.size() * n);
      ASSERT_TRUE(comm.AllGather(in.data(), gathered.data(), count, t)->Wait(kWait).ok());
      std::vector<double> g = Decode(gathered, t);
      for (int r = 0; r < n; ++r) {
        for (int64_t i = 0; i < count; ++i) ASSERT_EQ(g[r * count + i], Value(r, i)) << DTypeName(t);
      }

      // Reduce-scatter of n chunks: element (c, i) of rank r is Value(r, c*count + i).
      std::vector<double> big(count * n);
      for (int64_t j = 0; j < count * n; ++j) big[j] = Value(rank, j);
      std::vector<char> big_in = Encode(big, t);
      std::vector<char> chunk(in.size());
      ASSERT_TRUE(comm.ReduceScatter(big_in.data(), chunk.data(), count, t, ReduceOp::kSum)->Wait(kWait).ok());
      std::vector<double> rs = Decode(chunk, t);
      for (int64_t i = 0; i < count; ++i) {
        ASSERT_EQ(rs[i], Expected(n, rank * count + i, ReduceOp::kSum, t)) << DTypeName(t);
      }

      const int root = n - 1;
      std::vector<char> b = in;
      ASSERT_TRUE(comm.Broadcast(b.data(), count, t, root)->Wait(kWait).ok());
      std::vector<double> bd = Decode(b, t);
      for (int64_t i = 0; i < count; ++i) ASSERT_EQ(bd[i], Value(root, i));

      // All-to-all: rank r sends chunk d (elements Value(r, d*count + i)) to rank d.
      std::vector<char> a2a(big_in.size());
      ASSERT_TRUE(comm.AllToAll(big_in.data(), a2a.data(), count, t)->Wait(kWait).ok());
      std::vector<double> at = Decode(a2a, t);
      for (int src = 0; src < n; ++src) {
        for (int64_t i = 0; i < count; ++i) ASSERT_EQ(at[src * count + i], Value(src, rank * count + i));
      }
    }
  });
}

// Bytes every TCP socket of this process has received (the kernel's
// tcpi_bytes_received): with every rank a thread here, both ends of each
// Gloo pair are ours, so this is what the ranks sent each other.
int64_t TcpBytesReceived() {
  int64_t total = 0;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    const int fd = std::atoi(e.path().filename().c_str());
    int type = 0;
    socklen_t len = sizeof(type);
    if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) != 0 || type != SOCK_STREAM) continue;
    tcp_info info{};
    len = sizeof(info);
    if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, &info, &len) == 0) total += static_cast<int64_t>(info.tcpi_bytes_received);
  }
  return total;
}

// The ring reduce-scatter moves (p - 1)/p of the data: over the wire each
// rank sends p - 1 chunks (plus Gloo's message headers), where an all-reduce
// of the whole input, measured the same way, sends about twice that. Mean,
// max and min are reduced too.
TEST_P(GlooRanks, ReduceScatterSendsEachRankPMinus1Chunks) {
  const int n = GetParam();
  const int64_t count = 1 << 16;  // 256 KiB of f32 per chunk
  std::atomic<int64_t> rs_bytes{0}, ar_bytes{0};
  RunRanks(n, [&](int rank, Communicator& comm) {
    std::vector<double> big(count * n);
    for (int64_t j = 0; j < count * n; ++j) big[j] = Value(rank, j);
    const std::vector<char> in = Encode(big, DType::kF32);
    std::vector<char> chunk(count * 4);
    auto measure = [&](std::atomic<int64_t>& bytes, const std::function<void()>& op) {
      ASSERT_TRUE(comm.Barrier()->Wait(kWait).ok());
      const int64_t before = rank == 0 ? TcpBytesReceived() : 0;
      ASSERT_TRUE(comm.Barrier()->Wait(kWait).ok());
      op();
      ASSERT_TRUE(comm.Barrier()->Wait(kWait).ok());
      if (rank == 0) bytes = TcpBytesReceived() - before;
    };
    measure(rs_bytes, [&] {
      ASSERT_TRUE(comm.ReduceScatter(in.data(), chunk.data(), count, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());
    });
    std::vector<char> copy = in;
    measure(ar_bytes, [&] {
      ASSERT_TRUE(comm.AllReduce(copy.data(), count * n, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());
    });
    for (ReduceOp op : {ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin}) {
      ASSERT_TRUE(comm.ReduceScatter(in.data(), chunk.data(), count, DType::kF32, op)->Wait(kWait).ok());
      const std::vector<double> got = Decode(chunk, DType::kF32);
      for (int64_t i = 0; i < count; i += 997) {
        ASSERT_EQ(got[i], Expected(n, rank * count + i, op, DType::kF32)) << static_cast<int>(op) << " " << i;
      }
    }
  });
  // The barriers around each measurement send a few bytes too.
  const double ideal = static_cast<double>(n) * (n - 1) * count * 4;
  EXPECT_GE(static_cast<double>(rs_bytes), ideal) << "reduce-scatter, " << n << " ranks";
  EXPECT_LT(static_cast<double>(rs_bytes), 1.05 * ideal) << "reduce-scatter, " << n << " ranks";
  EXPECT_GT(static_cast<double>(ar_bytes), 1.8 * ideal) << "all-reduce, " << n << " ranks";
}

INSTANTIATE_TEST_SUITE_P(Ranks, GlooRanks, ::testing::Values(2, 3, 4));

TEST(Gloo, SendRecvRing) {
  const int n = 3;
  RunRanks(n, [&](int rank, Communicator& comm) {
    std::vector<int64_t> out(100), in(100);
    for (int i = 0; i < 100; ++i) out[i] = rank * 1000 + i;
    const int next = (rank + 1) % n, prev = (rank + n - 1) % n;
    // Even ranks send first, odd ranks receive first, so no pair waits on itself.
    std::shared_ptr<Work> a, b;
    if (rank % 2 == 0) {
      ASSERT_TRUE(comm.Send(out.data(), 100, DType::kI64, next, 7)->Wait(kWait).ok());
      ASSERT_TRUE(comm.Recv(in.data(), 100, DType::kI64, prev, 7)->Wait(kWait).ok());
    } else {
      ASSERT_TRUE(comm.Recv(in.data(), 100, DType::kI64, prev, 7)->Wait(kWait).ok());
      ASSERT_TRUE(comm.Send(out.data(), 100, DType::kI64, next, 7)->Wait(kWait).ok());
    }
    for (int i = 0; i < 100; ++i) ASSERT_EQ(in[i], prev * 1000 + i);
  });
}

// Gloo writes to its pairs with writev, which raises SIGPIPE when the peer
// closed: a process with Gloo communicators must take a write to a closed
// socket as EPIPE, not die of the signal (a healthy worker died when a
// failed or aborted peer closed its pairs; AbortEndsACollectiveInFlight hit
// it under load, as exit code 141).
TEST(Gloo, AWriteToAClosedPeerIsAnErrorNotADeadProcess) {
  RunRanks(2, [](int, Communicator& comm) { ASSERT_TRUE(comm.Barrier()->Wait(kWait).ok()); });
  int fds[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
  ::close(fds[1]);
  const char byte = 'x';
  iovec iov{const_cast<char*>(&byte), 1};
  errno = 0;
  EXPECT_EQ(::writev(fds[0], &iov, 1), -1);  // as Gloo writes; without the fix the process ends here
  EXPECT_EQ(errno, EPIPE);
  ::close(fds[0]);
}

TEST(Gloo, AMissingRankFailsRendezvousWithDeadlineExceeded) {
  auto shared = std::make_shared<RendezvousStore>();
  const absl::Duration timeout = absl::Milliseconds(500);
  std::vector<absl::Status> st(2);
  std::vector<absl::Duration> took(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {  // rank 2 of 3 never joins
    threads.emplace_back([&, r] {
      InMemoryStore store(shared, "test");
      GlooCommunicator::Options o;
      o.timeout = timeout;
      const absl::Time start = absl::Now();
      st[r] = GlooCommunicator::Create(store, r, 3, o).status();
      took[r] = absl::Now() - start;
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(st[r].code(), absl::StatusCode::kDeadlineExceeded) << st[r];
    EXPECT_NE(st[r].message().find("gloo/2"), absl::string_view::npos) << st[r];
    EXPECT_LT(took[r], timeout + absl::Seconds(1));
  }
}

TEST(Gloo, ACollectiveAPeerNeverJoinsTimesOutAndPoisonsTheCommunicator) {
  auto shared = std::make_shared<RendezvousStore>();
  const absl::Duration timeout = absl::Milliseconds(500);
  std::vector<std::unique_ptr<GlooCommunicator>> comms(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      InMemoryStore store(shared, "test");
      GlooCommunicator::Options o;
      o.timeout = timeout;
      auto c = GlooCommunicator::Create(store, r, 2, o);
      ASSERT_TRUE(c.ok()) << c.status();
      comms[r] = std::move(*c);
    });
  }
  for (auto& t : threads) t.join();
  std::vector<float> x(16, 1.0f);
  const absl::Time start = absl::Now();
  absl::Status s = comms[0]->AllReduce(x.data(), 16, DType::kF32, ReduceOp::kSum)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(absl::Now() - start, timeout + absl::Seconds(1));
  EXPECT_EQ(comms[0]->AsyncError().code(), absl::StatusCode::kDeadlineExceeded);
  absl::Status later = comms[0]->Barrier()->Wait(kWait);
  EXPECT_EQ(later.code(), absl::StatusCode::kAborted) << later;
}

// Rank 2 of 3 connects but never enters the all-reduce (a stopped peer).
// Aborting ranks 0 and 1 ends their all-reduces in flight at once, ABORTED
// with the reason, long before the collective timeout; later work fails too.
// Abort ends each kind of collective while it waits on a rank that never
// joins: Gloo's all-reduce and all-gather, and colod's ring reduce-scatter
// over the same pairs.
class AbortInFlight : public ::testing::TestWithParam<std::string> {};

TEST_P(AbortInFlight, AbortEndsACollectiveInFlight) {
  const std::string op = GetParam();
  std::vector<std::unique_ptr<GlooCommunicator>> comms = ConnectedRanks(3, absl::Seconds(60));
  ASSERT_EQ(comms.size(), 3u);
  // Big enough to need every rank's data in every segment.
  constexpr int64_t kCount = 1 << 16;
  std::vector<std::vector<float>> x(2, std::vector<float>(3 * kCount, 1.0f)), y(2, std::vector<float>(3 * kCount));
  std::vector<std::shared_ptr<Work>> work;
  for (int r = 0; r < 2; ++r) {
    if (op == "all_reduce") work.push_back(comms[r]->AllReduce(x[r].data(), kCount, DType::kF32, ReduceOp::kSum));
    if (op == "reduce_scatter") {
      work.push_back(comms[r]->ReduceScatter(x[r].data(), y[r].data(), kCount, DType::kF32, ReduceOp::kSum));
    }
    if (op == "all_gather") work.push_back(comms[r]->AllGather(x[r].data(), y[r].data(), kCount, DType::kF32));
  }
  ASSERT_EQ(work.size(), 2u) << op;
  absl::SleepFor(absl::Milliseconds(300));
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(work[r]->IsCompleted()) << "rank " << r << " ended without rank 2";
  const absl::Time start = absl::Now();
  for (int r = 0; r < 2; ++r) comms[r]->Abort(absl::CancelledError("job cancelled"));
  for (int r = 0; r < 2; ++r) {
    const absl::Status s = work[r]->Wait(absl::Seconds(10));
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << "rank " << r << ": " << s;
    EXPECT_NE(s.message().find("job cancelled"), absl::string_view::npos) << s;
  }
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(comms[0]->Barrier()->Wait(kWait).code(), absl::StatusCode::kAborted);
  // Rank 2's side of its pairs closed: its next collective fails at once.
  const absl::Time late = absl::Now();
  EXPECT_FALSE(comms[2]->AllReduce(x[0].data(), 4, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());
  EXPECT_LT(absl::Now() - late, absl::Seconds(5));
  // Destroying an aborted communicator does not wait for the timeout.
  const absl::Time teardown = absl::Now();
  comms.clear();
  EXPECT_LT(absl::Now() - teardown, absl::Seconds(5));
}

INSTANTIATE_TEST_SUITE_P(Ops, AbortInFlight, ::testing::Values("all_reduce", "reduce_scatter", "all_gather"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// A Wait that runs out (a peer never entered the op; Gloo times each of an
// op's waits, not the op, so it would run on) aborts the communicator and
// returns once the op has ended: its buffers, which the caller frees on the
// error, are written no more. Every later op fails with the sticky error.
TEST(Gloo, AWaitThatRunsOutEndsTheOpBeforeItReturns) {
  std::vector<std::unique_ptr<GlooCommunicator>> comms = ConnectedRanks(2, absl::Seconds(60));
  ASSERT_EQ(comms.size(), 2u);
  constexpr int64_t kCount = 1 << 16;
  auto buffer = std::make_unique<std::vector<float>>(kCount, 1.0f);
  std::shared_ptr<Work> lone = comms[0]->AllReduce(buffer->data(), kCount, DType::kF32, ReduceOp::kSum);
  const absl::Time start = absl::Now();
  const absl::Status s = lone->Wait(absl::Milliseconds(300));
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "the communicator was aborted")) << s;
  EXPECT_TRUE(lone->IsCompleted()) << "Wait returned while the op could still write its buffer";
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  buffer.reset();  // what a caller does on the error
  EXPECT_EQ(comms[0]->AsyncError().code(), absl::StatusCode::kAborted);
  float one = 1.0f;
  EXPECT_EQ(comms[0]->AllReduce(&one, 1, DType::kF32, ReduceOp::kSum)->Wait(kWait).code(), absl::StatusCode::kAborted);
  // The peer's next op fails too (its pairs with rank 0 were closed), at once.
  const absl::Time late = absl::Now();
  EXPECT_FALSE(comms[1]->AllReduce(&one, 1, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());
  EXPECT_LT(absl::Now() - late, absl::Seconds(5));
}

// Bytes the process `pid` has passed to write(2) and writev(2) (sockets
// included), from /proc/PID/io; -1 if unreadable.
int64_t BytesWritten(pid_t pid) {
  std::ifstream io("/proc/" + std::to_string(pid) + "/io");
  std::string key;
  int64_t value = 0;
  while (io >> key >> value) {
    if (key == "wchar:") return value;
  }
  return -1;
}

// The sender (another process) is stopped (SIGSTOP) or killed (SIGKILL)
// partway through one large message. The receive in flight is the one
// operation Gloo's pair signalling does not reach (tcp::Pair::signalException
// wakes the pending operations, not the buffer whose payload it is reading),
// so without colod's own tracking of its buffers this Recv waited out the
// whole timeout after Abort, and so did the communicator's destructor.
class PeerGoneMidMessage : public ::testing::TestWithParam<int> {};

TEST_P(PeerGoneMidMessage, AbortEndsTheReceiveInFlight) {
  const std::string dir = ::testing::TempDir() + "/stopped-peer-store";
  std::filesystem::remove_all(dir);
  constexpr int64_t kCount = int64_t{64} << 20;  // 256 MiB of f32: one message
  const absl::Duration timeout = absl::Seconds(40);
  GlooCommunicator::Options o;
  o.timeout = timeout;
  // The child uses only what it makes after the fork (its own store,
  // communicator and threads), never a lock another thread of this test
  // binary may have held at the fork.
  const pid_t child = ::fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    auto store = FileStore::Open(dir);
    if (!store.ok()) ::_exit(10);
    auto c = GlooCommunicator::Create(**store, 1, 2, o);
    if (!c.ok()) ::_exit(11);
    std::vector<float> x(kCount, 2.0f);
    const absl::Status s = (*c)->Send(x.data(), kCount, DType::kF32, 0, 7)->Wait(timeout);
    ::_exit(s.ok() ? 0 : 12);
  }
  struct Reap {
    pid_t pid;
    ~Reap() {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{child};
  auto store = FileStore::Open(dir);
  ASSERT_TRUE(store.ok()) << store.status();
  auto c = GlooCommunicator::Create(**store, 0, 2, o);
  ASSERT_TRUE(c.ok()) << c.status();
  const int64_t before = BytesWritten(child);
  ASSERT_GE(before, 0);
  std::vector<float> y(kCount);
  std::shared_ptr<Work> recv = (*c)->Recv(y.data(), kCount, DType::kF32, 1, 7);
  // Stop the sender once 8 MiB of the message has left it.
  const absl::Time give_up = absl::Now() + absl::Seconds(20);
  while (BytesWritten(child) - before < (8 << 20) && absl::Now() < give_up && !recv->IsCompleted()) {
    absl::SleepFor(absl::Microseconds(200));
  }
  const int64_t sent = BytesWritten(child) - before;
  ASSERT_EQ(::kill(child, GetParam()), 0);
  ASSERT_GE(sent, 8 << 20) << "the sender never started";
  ASSERT_LT(sent, kCount * 4) << "the whole message left before the sender stopped";
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_FALSE(recv->IsCompleted()) << "received all of the message from a stopped sender";
  const absl::Time start = absl::Now();
  (*c)->Abort(absl::CancelledError("job cancelled"));
  const absl::Status s = recv->Wait(absl::Seconds(10));
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("job cancelled"), absl::string_view::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  std::printf("%s sender, %lld of %lld bytes sent: the receive ended %.3f s after the abort\n",
              GetParam() == SIGSTOP ? "stopped" : "killed", static_cast<long long>(sent),
              static_cast<long long>(kCount * 4), absl::ToDoubleSeconds(absl::Now() - start));
  const absl::Time teardown = absl::Now();
  c->reset();
  EXPECT_LT(absl::Now() - teardown, absl::Seconds(5));
}

INSTANTIATE_TEST_SUITE_P(Signals, PeerGoneMidMessage, ::testing::Values(SIGSTOP, SIGKILL),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return std::string(info.param == SIGSTOP ? "Stopped" : "Killed");
                         });

// A store whose waits for rank 0's address fail: rank 1 dies right after it
// published its own. What it sets reaches the shared store at Publish(),
// once rank 1 is gone: rank 0 never connects while rank 1's sockets are
// closing (Gloo's event loop throws, ending the process, where a peer
// resets a connection between the handshake and its getpeername:
// docs/RELIABILITY.md).
class DiesAfterPublishing final : public Store {
 public:
  DiesAfterPublishing(std::shared_ptr<RendezvousStore> shared, std::string scope) : inner_(std::move(shared), std::move(scope)) {}
  absl::Status Set(absl::string_view key, std::string value) override {
    set_.emplace_back(std::string(key), std::move(value));
    return absl::OkStatus();
  }
  absl::Status Publish() {
    for (auto& [key, value] : set_) {
      if (absl::Status s = inner_.Set(key, value); !s.ok()) return s;
    }
    return absl::OkStatus();
  }
  absl::StatusOr<std::string> Get(absl::string_view key) override { return inner_.Get(key); }
  absl::StatusOr<std::vector<std::string>> Wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    for (const std::string& k : keys) {
      if (absl::EndsWith(k, "/0")) return absl::UnavailableError("rank 1 died");
    }
    return inner_.Wait(keys, timeout);
  }

 private:
  InMemoryStore inner_;
  std::vector<std::pair<std::string, std::string>> set_;
};

// An abort signal ends a rendezvous in progress within milliseconds:
// - waiting in the store for a peer that never publishes (the coordinator
//   cancels an aborted generation's scope, which ends the store call);
// - waiting in Gloo's TCP connect for a peer that published its address and
//   died before it connected. Which side of a pair listens is decided by the
//   pairs' ports, so the scenario runs until rank 0 was the listening side
//   once (a connecting side fails at once with "connection refused").
TEST(Gloo, AnAbortSignalEndsARendezvousInProgress) {
  {
    auto shared = std::make_shared<RendezvousStore>();
    InMemoryStore store(shared, "scope");
    GlooCommunicator::Options o;
    o.timeout = absl::Seconds(60);
    o.abort_signal = std::make_shared<AbortSignal>();
    std::thread aborter([&] {
      absl::SleepFor(absl::Milliseconds(300));
      o.abort_signal->Abort(absl::CancelledError("job cancelled"));
      absl::SleepFor(absl::Milliseconds(200));
      shared->CancelScope("scope");
    });
    const absl::Time start = absl::Now();
    const absl::Status s = GlooCommunicator::Create(store, 0, 2, o).status();
    aborter.join();
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_NE(s.message().find("job cancelled"), absl::string_view::npos) << s;
    EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  }
  int aborted = 0;
  for (int trial = 0; trial < 40 && aborted == 0; ++trial) {
    auto shared = std::make_shared<RendezvousStore>();
    InMemoryStore store(shared, "scope");
    GlooCommunicator::Options o;
    o.timeout = absl::Seconds(60);
    o.abort_signal = std::make_shared<AbortSignal>();
    absl::Status s;
    absl::Duration took;
    std::thread rank0([&] {
      const absl::Time start = absl::Now();
      s = GlooCommunicator::Create(store, 0, 2, o).status();
      took = absl::Now() - start;
    });
    {
      // Rank 1 publishes its address, then dies (its wait for rank 0's
      // address fails) and closes its sockets before it connects.
      DiesAfterPublishing dying(shared, "scope");
      GlooCommunicator::Options o1;
      o1.timeout = absl::Seconds(10);
      ASSERT_FALSE(GlooCommunicator::Create(dying, 1, 2, o1).ok());
      ASSERT_TRUE(dying.Publish().ok());  // its address, now that its sockets are closed
    }
    absl::SleepFor(absl::Milliseconds(200));
    o.abort_signal->Abort(absl::CancelledError("job cancelled"));
    rank0.join();
    EXPECT_LT(took, absl::Seconds(5)) << s;
    if (s.code() == absl::StatusCode::kAborted) {
      EXPECT_NE(s.message().find("job cancelled"), absl::string_view::npos) << s;
      ++aborted;
    } else if (!s.ok()) {
      EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;  // the connecting side: refused at once
    }
  }
  EXPECT_EQ(aborted, 1) << "rank 0 never was the listening side";
}

// A rendezvous wait whose slice ran past the deadline ends as a timeout,
// never with a wait of a negative time (which the store refuses
// INVALID_ARGUMENT).
TEST(Gloo, AStallingStoreTimesOutAndIsNeverAskedForANegativeWait) {
  testing::OverrunningStore store(absl::Milliseconds(500));
  GlooCommunicator::Options o;
  o.timeout = absl::Milliseconds(400);
  const absl::Status s = GlooCommunicator::Create(store, 1, 2, o).status();
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(s.message().find("INVALID_ARGUMENT"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("did not arrive within"), absl::string_view::npos) << s;
}

// A store whose wait fires the job's abort signal and fails at once, as the
// coordinator's cancelled scope does when it aborts a generation.
class AbortsWhileWaiting final : public Store {
 public:
  AbortsWhileWaiting(std::shared_ptr<RendezvousStore> shared, std::shared_ptr<AbortSignal> abort)
      : inner_(std::move(shared), "scope"), abort_(std::move(abort)) {}
  absl::Status Set(absl::string_view key, std::string value) override { return inner_.Set(key, std::move(value)); }
  absl::StatusOr<std::string> Get(absl::string_view key) override { return inner_.Get(key); }
  absl::StatusOr<std::vector<std::string>> Wait(const std::vector<std::string>&, absl::Duration) override {
    abort_->Abort(absl::CancelledError("job cancelled"));
    return absl::CancelledError("scope 'scope' was aborted");
  }

 private:
  InMemoryStore inner_;
  std::shared_ptr<AbortSignal> abort_;
};

// The rendezvous ends with the store's error before the watching thread
// looks at the abort signal (it looks every 20 ms): the failure still
// reports the abort and its reason, not the store's consequence of it.
TEST(Gloo, ARendezvousThatFailsBecauseOfAnAbortReportsTheAbort) {
  GlooCommunicator::Options o;
  o.timeout = absl::Seconds(10);
  o.abort_signal = std::make_shared<AbortSignal>();
  AbortsWhileWaiting store(std::make_shared<RendezvousStore>(), o.abort_signal);
  const absl::Status s = GlooCommunicator::Create(store, 0, 2, o).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
  EXPECT_NE(s.message().find("job cancelled"), absl::string_view::npos) << s;
}

TEST(Gloo, AbortFailsQueuedWorkAndBadArgumentsFailAtOnce) {
  RunRanks(2, [&](int rank, Communicator& comm) {
    std::vector<float> x(4, 1.0f);
    EXPECT_EQ(comm.Broadcast(x.data(), 4, DType::kF32, 5)->Wait(kWait).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm.Send(x.data(), 4, DType::kF32, rank, 1)->Wait(kWait).code(),
              absl::StatusCode::kInvalidArgument);
    // Counts no buffer can hold fail before a size is derived from them
    // (count x size() x element bytes past int64_t), on both ranks alike,
    // and the communicator stays usable.
    const int64_t per_rank_overflow = std::numeric_limits<int64_t>::max() / 4 / 2 + 1;
    std::vector<float> out(8, 0.0f);
    EXPECT_EQ(comm.AllReduce(x.data(), -1, DType::kF32, ReduceOp::kSum)->Wait(kWait).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm.AllReduce(x.data(), std::numeric_limits<int64_t>::max() / 2, DType::kF32, ReduceOp::kSum)
                  ->Wait(kWait)
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm.AllGather(x.data(), out.data(), per_rank_overflow, DType::kF32)->Wait(kWait).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm.ReduceScatter(out.data(), x.data(), per_rank_overflow, DType::kF32, ReduceOp::kSum)
                  ->Wait(kWait)
                  .code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm.AllToAll(x.data(), out.data(), per_rank_overflow, DType::kF32)->Wait(kWait).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(comm.Recv(x.data(), -3, DType::kF32, 1 - rank, 1)->Wait(kWait).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(comm.AsyncError().ok());
    ASSERT_TRUE(comm.AllReduce(x.data(), 4, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());
    EXPECT_EQ(x[0], 2.0f);
    EXPECT_EQ(comm.backend(), "gloo");
  });
  auto shared = std::make_shared<RendezvousStore>();
  InMemoryStore store(shared, "solo");
  auto solo = GlooCommunicator::Create(store, 0, 1, GlooCommunicator::Options());
  ASSERT_TRUE(solo.ok()) << solo.status();
  std::vector<float> x(4, 2.0f);
  ASSERT_TRUE((*solo)->AllReduce(x.data(), 4, DType::kF32, ReduceOp::kSum)->Wait(kWait).ok());
  EXPECT_EQ(x[0], 2.0f);  // one rank: the sum is itself
  (*solo)->Abort(absl::CancelledError("job cancelled"));
  absl::Status s = (*solo)->AllReduce(x.data(), 4, DType::kF32, ReduceOp::kSum)->Wait(kWait);
  EXPECT_EQ(s.code(), absl::StatusCode::kAborted);
  EXPECT_NE(s.message().find("job cancelled"), absl::string_view::npos) << s;
  EXPECT_EQ(GlooCommunicator::Create(store, 1, 1, GlooCommunicator::Options()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace colod
