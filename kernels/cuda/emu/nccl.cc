// NCCL in colod's CUDA emulation (include/nccl.h). A communicator's clique
// lives in the process whose ncclGetUniqueId made its id. A collective is a
// task on the caller's stream that deposits its buffers in the clique's slot
// for its sequence number, waits for every rank, computes its output from
// all inputs, waits again (so in-place outputs are written only after every
// rank read every input) and writes it. A point-to-point call waits for its
// peer's matching call.
//
// Connections are made at first use, as NCCL makes them (its runtime
// connection, the default since 2.22, and point-to-point connections
// always): a communicator's first collective connects its ranks, and a
// rank's first send to a peer, or receive from one, connects that pair in
// that direction. The call (or ncclGroupEnd) that needs a connection holds
// its host thread until the peer reaches the other end, or, on a
// non-blocking communicator, returns ncclInProgress and enqueues its work
// only once connected; ncclCommGetAsyncError says ncclInProgress until
// then, and a call on the communicator meanwhile is a misuse (reported).
// Pairs are connected in NCCL's order (ConnectLinks), so host code that
// reaches its first uses of pairs in orders that cross hangs here as on
// GPUs. Stricter than NCCL in one way: the first collective waits for every
// rank, where NCCL's ring and tree connections wait for their neighbours
// (a deadlock on GPUs is one here too). Not modelled: NCCL connects each
// algorithm at its first use, so a later collective that first uses
// another one can hold the host again.
//
// Waits end when every peer arrived or the rank's
// communicator was aborted, never by themselves: a lost peer hangs its
// peers' streams as it does on GPUs, up to a safety limit that ends the
// test process (COLOD_NCCL_EMU_HANG_LIMIT seconds, default 600).
//
// Ranks in other processes (worker daemons, each with its own emulated
// device) join over the id's address (nccl_wire.h): the clique's process
// keeps a stand-in rank for each, which takes part in the slots exactly as
// a local rank does with the remote rank's input copied over, and sends its
// output back; the remote rank's stream task waits for that answer, so
// stream order, groups, abort and injected faults behave as in one process.
// A remote rank that destroys or aborts its communicator says so; one whose
// connection ends without that (its process died) breaks the clique: a rank
// that waits for its peers then, or later, reports ncclRemoteError through
// ncclCommGetAsyncError, as NCCL reports a lost peer, and its wait goes on
// until it is aborted; a rank whose collectives all completed reports
// nothing.
//
// Thread-safety: every entry point may be called from any thread; clique
// state is guarded by its mutex, which is never held while copying data,
// on a socket or waiting for a stream. Handles are never freed (a destroyed
// or aborted one is marked dead), so a use after destroy is reported, not
// undefined.
#include <nccl.h>
#include <nccl_emu.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kernels/cuda/emu/nccl_wire.h"
#include "kernels/cuda/emu/runtime_internal.h"

namespace colod_nccl_emu {
namespace {

using Clock = std::chrono::steady_clock;

std::chrono::seconds HangLimit() {
  static const long limit = [] {
    const char* v = getenv("COLOD_NCCL_EMU_HANG_LIMIT");
    const long n = v != nullptr ? atol(v) : 0;
    return n > 0 ? n : 600;
  }();
  return std::chrono::seconds(limit);
}

// SetConnectEndPause's pause, in milliseconds.
std::atomic<int> connect_end_pause_ms{0};

// SetAbortPause's pause, in milliseconds, and AbortsBegun's count.
std::atomic<int> abort_pause_ms{0};
std::atomic<long> aborts_begun{0};

std::mutex fault_mu;
Fault& CurrentFault() {
  static Fault* f = [] {
    auto* fault = new Fault();
    const char* v = getenv("COLOD_NCCL_EMU_FAULT");
    if (v != nullptr && *v != '\0') {
      char kind[16] = {0};
      int rank = 0, size = 0;
      long op = 0;
      const int n = sscanf(v, "%15[a-z]:%d:%ld:%d", kind, &rank, &op, &size);
      if (n >= 3 && (strcmp(kind, "hang") == 0 || strcmp(kind, "error") == 0) && op >= 1) {
        fault->kind = strcmp(kind, "hang") == 0 ? FaultKind::kHang : FaultKind::kError;
        fault->rank = rank;
        fault->op = op;
        fault->comm_size = n == 4 ? size : 0;
      } else {
        colod_cuda_emu::Fatal(std::string("COLOD_NCCL_EMU_FAULT=") + v + " is not KIND:RANK:OP[:COMM_SIZE]");
      }
    }
    return fault;
  }();
  return *f;
}

size_t TypeBytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8: return 1;
    case ncclFloat16:
    case ncclBfloat16: return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32: return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64: return 8;
    default: return 0;
  }
}

// One collective's meeting point.
struct CollSlot {
  std::string op;
  size_t count = 0;
  ncclDataType_t type = ncclFloat32;
  ncclRedOp_t red = ncclSum;
  int root = 0;
  std::vector<const void*> send;
  std::vector<void*> recv;
  int arrived = 0, computed = 0, finished = 0;
};

// One send/recv pair's meeting point.
struct P2PSlot {
  const void* src = nullptr;
  void* dst = nullptr;
  size_t bytes_sent = 0, bytes_wanted = 0;
  bool sender = false, receiver = false, copied = false;
};

struct SplitSlot {
  std::vector<int> color, key;
  std::vector<bool> arrived_rank;
  int arrived = 0;
  std::vector<std::shared_ptr<struct RankState>> children;  // by parent rank
  bool done = false;
};

struct Clique {
  explicit Clique(int n) : nranks(n), devices(n, -1) {}
  const int nranks;
  std::vector<int> devices;
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, std::shared_ptr<CollSlot>> colls;
  std::map<std::tuple<int, int, uint64_t>, std::shared_ptr<P2PSlot>> p2p;
  std::map<uint64_t, std::shared_ptr<SplitSlot>> splits;
  // Connections at first use (ConnectLinks): the ranks that reached their
  // first collective, and each directed pair's ends that arrived
  // (kSenderEnd | kReceiverEnd once connected).
  int collective_links = 0;
  std::map<std::pair<int, int>, int> links;
  std::vector<std::weak_ptr<struct RankState>> members;
  // A member's process is gone (BreakClique): a rank that waits for its
  // peers from then on reports ncclRemoteError.
  bool broken = false;
};

// A rank's link to a clique in another process: requests numbered on one
// connection, answered by number (a group's ops are in flight together).
struct Remote {
  std::shared_ptr<Conn> conn;
  std::string address;  // the clique's process, for a split's child
  std::mutex mu;
  std::condition_variable cv;
  uint64_t next_req = 1;
  std::map<uint64_t, Frame> answers;
  bool closed = false;   // the connection ended
  bool leaving = false;  // destroyed or aborted here: the end is expected
};

struct RankState {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  int nranks = 0;
  int device = 0;
  std::atomic<int> state{ncclInProgress};
  std::atomic<bool> aborted{false};
  std::atomic<int> pending{0};
  // ncclConfig_t.blocking of this process's handle: whether a call that
  // needs a connection waits for it, or returns ncclInProgress.
  bool blocking = true;
  // A non-blocking group's connections are being made (Launch): no call
  // but an abort may come until they are.
  std::atomic<bool> connecting{false};
  // Sequence numbers, advanced by the calling thread at enqueue (ops of one
  // communicator must be issued in one order, as NCCL requires), and the
  // connections this rank's calls asked for so far.
  std::mutex seq_mu;
  uint64_t next_coll = 0, next_split = 0;
  long ops = 0;
  std::map<int, uint64_t> next_send, next_recv;
  bool collectives_linked = false;
  std::set<int> sent_to, received_from;
  // A rank whose clique is in another process; its `clique` is then a
  // clique of its own, only a place to wait.
  std::shared_ptr<Remote> remote;
  // In the clique's process, the stand-in of a remote rank: its connection.
  std::shared_ptr<Conn> stand_in_for;
  std::atomic<bool> told_lost{false};  // the lost peer reported (to the remote rank too)
};

}  // namespace
}  // namespace colod_nccl_emu

struct ncclComm {
  std::shared_ptr<colod_nccl_emu::RankState> st;
  std::atomic<bool> dead{false};
};

namespace colod_nccl_emu {
namespace {

std::mutex handles_mu;
std::map<ncclComm*, bool>& Handles() {  // handle -> live
  static auto* h = new std::map<ncclComm*, bool>();
  return *h;
}

ncclComm* NewHandle(std::shared_ptr<RankState> st) {
  auto* c = new ncclComm();
  c->st = std::move(st);
  std::lock_guard<std::mutex> l(handles_mu);
  Handles()[c] = true;
  return c;
}

// The state of a live handle; reports a dead or unknown one.
std::shared_ptr<RankState> Live(ncclComm_t comm, const char* call) {
  if (comm == nullptr) return nullptr;
  std::lock_guard<std::mutex> l(handles_mu);
  auto it = Handles().find(comm);
  if (it == Handles().end()) colod_cuda_emu::Fatal(std::string(call) + ": not a communicator");
  if (!it->second) {
    colod_cuda_emu::Fatal(std::string(call) + ": the communicator was destroyed or aborted (a use after free)");
  }
  return comm->st;
}

void Kill(ncclComm_t comm) {
  std::lock_guard<std::mutex> l(handles_mu);
  Handles()[comm] = false;
}

// A rank that waits on a peer whose process is gone reports it, as NCCL
// does: ncclRemoteError from ncclCommGetAsyncError (a stand-in tells its
// remote rank, without waiting). Its wait goes on until it is aborted.
void ReportLostPeer(RankState& st) {
  if (st.told_lost.exchange(true)) return;
  int expected = ncclSuccess;
  st.state.compare_exchange_strong(expected, ncclRemoteError);
  expected = ncclInProgress;
  st.state.compare_exchange_strong(expected, ncclRemoteError);
  if (st.stand_in_for != nullptr) st.stand_in_for->TryWrite(Kind::kAsyncError, {ncclRemoteError});
}

// Waits on the clique until `ready` or the rank is aborted; false if aborted.
template <typename Pred>
bool WaitFor(std::unique_lock<std::mutex>& l, RankState& st, const std::string& what, Pred ready) {
  const auto deadline = Clock::now() + HangLimit();
  while (!ready()) {
    if (st.aborted) return false;
    if (st.clique->broken && !st.told_lost) {
      l.unlock();  // no socket under the clique's lock
      ReportLostPeer(st);
      l.lock();
      continue;
    }
    if (Clock::now() >= deadline) {
      colod_cuda_emu::Fatal("NCCL " + what + " (rank " + std::to_string(st.rank) + "/" + std::to_string(st.nranks) +
                            ") waited " + std::to_string(HangLimit().count()) +
                            " s for its peers and was never aborted: a hang");
    }
    st.clique->cv.wait_for(l, std::chrono::milliseconds(100));
  }
  return !st.aborted;
}

// Pending rendezvous of ncclCommInitRank, by unique id.
std::mutex init_mu;
std::map<std::string, std::shared_ptr<Clique>>& Pending() {
  static auto* p = new std::map<std::string, std::shared_ptr<Clique>>();
  return *p;
}
// Ids whose communicator is complete: NCCL cannot rendezvous on one again.
std::set<std::string>& UsedIds() {
  static auto* u = new std::set<std::string>();
  return *u;
}
std::map<std::string, std::vector<std::shared_ptr<RankState>>>& PendingRanks() {
  static auto* p = new std::map<std::string, std::vector<std::shared_ptr<RankState>>>();
  return *p;
}

bool CheckBuffer(const void* p, size_t bytes, int device) {
  if (bytes == 0) return true;
  auto range = colod_cuda_emu::FindDeviceRange(p, bytes);
  return range.has_value() && range->device == device;
}

template <typename T>
void ReduceTyped(const std::vector<const void*>& in, size_t offset, size_t count, ncclRedOp_t op, T* out) {
  const int n = static_cast<int>(in.size());
  for (size_t i = 0; i < count; ++i) {
    T acc = static_cast<const T*>(in[0])[offset + i];
    for (int r = 1; r < n; ++r) {
      const T v = static_cast<const T*>(in[r])[offset + i];
      switch (op) {
        case ncclSum:
        case ncclAvg: acc = acc + v; break;
        case ncclProd: acc = acc * v; break;
        case ncclMax: acc = v > acc ? v : acc; break;
        case ncclMin: acc = v < acc ? v : acc; break;
        default: break;
      }
    }
    if (op == ncclAvg) acc = static_cast<T>(acc / static_cast<T>(n));
    out[i] = acc;
  }
}

float LoadHalfish(const void* p, size_t i, ncclDataType_t t) {
  const uint16_t bits = static_cast<const uint16_t*>(p)[i];
  return t == ncclBfloat16 ? __bfloat162float(__ushort_as_bfloat16(bits)) : __half2float(__ushort_as_half(bits));
}

uint16_t StoreHalfish(float v, ncclDataType_t t) {
  return t == ncclBfloat16 ? __bfloat16_as_ushort(__float2bfloat16_rn(v)) : __half_as_ushort(__float2half_rn(v));
}

// out[0..count) = reduction over ranks of in[r][offset..offset+count).
void Reduce(const std::vector<const void*>& in, size_t offset, size_t count, ncclDataType_t t, ncclRedOp_t op,
            void* out) {
  switch (t) {
    case ncclInt8: ReduceTyped(in, offset, count, op, static_cast<int8_t*>(out)); return;
    case ncclUint8: ReduceTyped(in, offset, count, op, static_cast<uint8_t*>(out)); return;
    case ncclInt32: ReduceTyped(in, offset, count, op, static_cast<int32_t*>(out)); return;
    case ncclUint32: ReduceTyped(in, offset, count, op, static_cast<uint32_t*>(out)); return;
    case ncclInt64: ReduceTyped(in, offset, count, op, static_cast<int64_t*>(out)); return;
    case ncclUint64: ReduceTyped(in, offset, count, op, static_cast<uint64_t*>(out)); return;
    case ncclFloat32: ReduceTyped(in, offset, count, op, static_cast<float*>(out)); return;
    case ncclFloat64: ReduceTyped(in, offset, count, op, static_cast<double*>(out)); return;
    case ncclFloat16:
    case ncclBfloat16: {
      // Widened to f32 in rank order, rounded once.
      std::vector<std::vector<float>> wide(in.size(), std::vector<float>(count));
      std::vector<const void*> ptrs;
      for (size_t r = 0; r < in.size(); ++r) {
        for (size_t i = 0; i < count; ++i) wide[r][i] = LoadHalfish(in[r], offset + i, t);
        ptrs.push_back(wide[r].data());
      }
      std::vector<float> acc(count);
      ReduceTyped(ptrs, 0, count, op, acc.data());
      for (size_t i = 0; i < count; ++i) static_cast<uint16_t*>(out)[i] = StoreHalfish(acc[i], t);
      return;
    }
    default: return;
  }
}

// Whether the injected fault hits this op of this rank.
FaultKind FaultFor(const RankState& st, long op) {
  std::lock_guard<std::mutex> l(fault_mu);
  const Fault& f = CurrentFault();
  if (f.kind == FaultKind::kNone || f.rank != st.rank || (f.comm_size != 0 && f.comm_size != st.nranks)) {
    return FaultKind::kNone;
  }
  if (f.kind == FaultKind::kHang && op == f.op) return FaultKind::kHang;
  if (f.kind == FaultKind::kError && op >= f.op) return FaultKind::kError;
  return FaultKind::kNone;
}

// A faulty op: never enters; the communicator reports `error` if set.
void Stall(RankState& st, ncclResult_t error, const std::string& what) {
  if (error != ncclSuccess) st.state = error;
  std::unique_lock<std::mutex> l(st.clique->mu);
  WaitFor(l, st, what + " (injected fault)", [] { return false; });
}

// The connections an operation needs before it runs (the header comment).
struct Links {
  bool collectives = false;
  std::vector<int> to, from;  // the peers of a first send, of a first receive
  bool empty() const { return !collectives && to.empty() && from.empty(); }
};

constexpr int kSenderEnd = 1, kReceiverEnd = 2;

// Sends a request of a remote rank and waits for its answer (below).
bool RemoteCall(RankState& st, Kind kind, std::initializer_list<int64_t> args, const void* payload, size_t bytes,
                Frame* answer, const std::string& what);

// Rank st makes `links` as NCCL's transport setup does: first the
// collectives' (every rank takes part), then its pairs by distance
// d = 1..n-1, the send to rank+d together with the receive from rank-d,
// each end waiting for the peer to reach the other. A rank held at one
// distance makes no later one. False if the rank was aborted first.
bool ConnectLinks(const std::shared_ptr<RankState>& st, const Links& links) {
  if (st->remote != nullptr) {  // made by its stand-in in the clique's process
    std::vector<int32_t> peers(links.to.begin(), links.to.end());
    peers.insert(peers.end(), links.from.begin(), links.from.end());
    Frame answer;
    return RemoteCall(*st, Kind::kConnect,
                      {links.collectives ? 1 : 0, static_cast<int64_t>(links.to.size()),
                       static_cast<int64_t>(links.from.size())},
                      peers.data(), peers.size() * sizeof(int32_t), &answer, "connection setup");
  }
  Clique& c = *st->clique;
  const int n = st->nranks, r = st->rank;
  std::unique_lock<std::mutex> l(c.mu);
  if (links.collectives) {
    c.collective_links++;
    c.cv.notify_all();
    if (!WaitFor(l, *st, "the first collective's connection setup", [&] { return c.collective_links >= n; })) {
      return false;
    }
  }
  for (int d = 1; d < n; ++d) {
    const int to = (r + d) % n, from = (r - d + n) % n;
    const bool s = std::find(links.to.begin(), links.to.end(), to) != links.to.end();
    const bool q = std::find(links.from.begin(), links.from.end(), from) != links.from.end();
    if (!s && !q) continue;
    if (s) c.links[{r, to}] |= kSenderEnd;
    if (q) c.links[{from, r}] |= kReceiverEnd;
    c.cv.notify_all();
    const std::string what = "connection setup (" +
                             (s ? "a first send to " + std::to_string(to) + (q ? ", " : "") : std::string()) +
                             (q ? "a first receive from " + std::to_string(from) : std::string()) + ")";
    const int both = kSenderEnd | kReceiverEnd;
    if (!WaitFor(l, *st, what, [&] { return (!s || c.links[{r, to}] == both) && (!q || c.links[{from, r}] == both); })) {
      return false;
    }
  }
  return true;
}

// ---- Group calls: ops issued between ncclGroupStart and ncclGroupEnd ----
struct GroupOp {
  std::shared_ptr<colod_cuda_emu::Stream> stream;
  std::function<void()> run;
  std::shared_ptr<RankState> st;
  Links links;
};
thread_local int group_depth = 0;
thread_local std::vector<GroupOp> group_ops;

// Enqueues one call's or one group's ops: those on one stream become one
// task that runs them concurrently, as one fused NCCL kernel progresses
// all of them.
void EnqueueOps(std::vector<GroupOp> ops) {
  std::map<colod_cuda_emu::Stream*, std::vector<std::function<void()>>> by_stream;
  std::map<colod_cuda_emu::Stream*, std::shared_ptr<colod_cuda_emu::Stream>> streams;
  for (auto& op : ops) {
    by_stream[op.stream.get()].push_back(std::move(op.run));
    streams[op.stream.get()] = op.stream;
  }
  for (auto& [key, runs] : by_stream) {
    colod_cuda_emu::Enqueue(streams[key], [runs = std::move(runs)] {
      std::vector<std::thread> threads;
      for (size_t i = 1; i < runs.size(); ++i) threads.emplace_back(runs[i]);
      if (!runs.empty()) runs[0]();
      for (auto& t : threads) t.join();
    });
  }
}

// Enqueues `ops` once the connections they need are made: a blocking
// group's call waits for them; a non-blocking one's returns ncclInProgress,
// and every communicator of the group says so until they are made and the
// ops enqueued, as NCCL's group launch does. Each communicator connects on
// a thread of its own, as NCCL runs each one's connection as a job of its
// own. An abort of any of them ends the waits: no op of the group runs, and
// the group's other communicators report ncclInvalidUsage.
ncclResult_t Launch(std::vector<GroupOp> ops) {
  std::vector<std::pair<std::shared_ptr<RankState>, Links>> needs;
  std::vector<std::shared_ptr<RankState>> members;
  for (const GroupOp& op : ops) {
    if (std::find(members.begin(), members.end(), op.st) == members.end()) members.push_back(op.st);
    if (op.links.empty()) continue;
    auto it = std::find_if(needs.begin(), needs.end(), [&](const auto& n) { return n.first == op.st; });
    if (it == needs.end()) it = needs.insert(needs.end(), {op.st, Links()});
    it->second.collectives |= op.links.collectives;
    it->second.to.insert(it->second.to.end(), op.links.to.begin(), op.links.to.end());
    it->second.from.insert(it->second.from.end(), op.links.from.begin(), op.links.from.end());
  }
  for (const auto& m : members) {
    if (m->blocking != members.front()->blocking) {
      for (const GroupOp& op : ops) op.st->pending--;  // never run
      return ncclInvalidUsage;  // NCCL: blocking and non-blocking communicators in one group
    }
  }
  // A group's kernels launch at ncclGroupEnd: a context that broke since
  // its calls fails that launch, and none of its ops runs.
  for (const GroupOp& op : ops) {
    if (colod_cuda_emu::StickyError(colod_cuda_emu::DeviceOf(*op.stream)) != cudaSuccess) {
      for (const GroupOp& o : ops) o.st->pending--;  // never run
      return ncclUnhandledCudaError;
    }
  }
  if (needs.empty()) {
    EnqueueOps(std::move(ops));
    return ncclSuccess;
  }
  auto shared = std::make_shared<std::vector<GroupOp>>(std::move(ops));
  auto connect_and_enqueue = [needs, members, shared] {
    std::vector<char> made(needs.size(), 0);
    std::vector<std::thread> others;
    for (size_t i = 1; i < needs.size(); ++i) {
      others.emplace_back([&, i] { made[i] = ConnectLinks(needs[i].first, needs[i].second); });
    }
    made[0] = ConnectLinks(needs[0].first, needs[0].second);
    for (auto& t : others) t.join();
    bool ok = std::all_of(made.begin(), made.end(), [](char m) { return m != 0; });
    for (const auto& m : members) ok = ok && !m->aborted;  // an abort before the enqueue
    if (!ok) {
      for (const GroupOp& op : *shared) op.st->pending--;  // never run
      return false;
    }
    EnqueueOps(std::move(*shared));
    return true;
  };
  if (members.front()->blocking) return connect_and_enqueue() ? ncclSuccess : ncclInvalidUsage;
  for (const auto& m : members) {
    m->connecting = true;
    int expected = ncclSuccess;
    m->state.compare_exchange_strong(expected, ncclInProgress);
  }
  std::thread([members, connect_and_enqueue] {
    const bool ok = connect_and_enqueue();
    for (const auto& m : members) {
      // The mark of the connection goes first: a caller that sees the state
      // leave ncclInProgress may call again at once, and CheckNotInProgress
      // must not find the connection still being made.
      m->connecting = false;
      std::this_thread::sleep_for(std::chrono::milliseconds(connect_end_pause_ms.load()));
      int expected = ncclInProgress;
      m->state.compare_exchange_strong(expected, ok ? ncclSuccess : ncclInvalidUsage);
    }
  }).detach();
  return ncclInProgress;
}

// A call on a communicator whose last call is still in progress: NCCL
// requires waiting for ncclCommGetAsyncError to leave ncclInProgress first.
void CheckNotInProgress(const RankState& st, const char* call) {
  if (st.state == ncclInProgress || st.connecting) {
    colod_cuda_emu::Fatal(std::string("NCCL: ") + call + " on rank " + std::to_string(st.rank) + "/" +
                          std::to_string(st.nranks) +
                          " while the communicator's last call is in progress (ncclCommGetAsyncError says "
                          "ncclInProgress): NCCL requires waiting for it to end first");
  }
}

// Runs `run` on `stream` now (once its connections are made), or with the
// group's other ops at ncclGroupEnd.
ncclResult_t Submit(std::shared_ptr<colod_cuda_emu::Stream> stream, std::shared_ptr<RankState> st, Links links,
                    std::function<void()> run) {
  st->pending++;
  auto task = [st, run = std::move(run)] {
    if (!st->aborted) run();  // an aborted rank's op touches no buffer
    st->pending--;
  };
  GroupOp op{std::move(stream), std::move(task), std::move(st), std::move(links)};
  if (group_depth > 0) {
    group_ops.push_back(std::move(op));
    return ncclSuccess;
  }
  std::vector<GroupOp> ops;
  ops.push_back(std::move(op));
  return Launch(std::move(ops));
}

// The collectives by code, as a remote rank names them.
const char* const kOps[] = {"AllReduce", "Broadcast", "Reduce", "AllGather", "ReduceScatter", "AlltoAll"};
constexpr int kNumOps = 6;

int OpCode(const std::string& op) {
  for (int i = 0; i < kNumOps; ++i) {
    if (op == kOps[i]) return i;
  }
  return -1;
}

// A collective's byte extents on rank `rank` of `n`, and whether it reads
// its input and writes its output there.
struct Extents {
  size_t send_bytes, recv_bytes;
  bool sends, recvs;
};
Extents ExtentsOf(const std::string& op, size_t count, size_t es, int n, int rank, int root) {
  Extents e{count * es, count * es, op != "Broadcast" || rank == root, op != "Reduce" || rank == root};
  if (op == "AllGather") e.recv_bytes *= n;
  if (op == "ReduceScatter" || op == "AlltoAll") e.send_bytes *= n;
  if (op == "AlltoAll") e.recv_bytes *= n;
  return e;
}

// Rank st's part of collective #seq+1 of its clique: deposits `send`,
// waits for every rank, computes its output and, once every rank read every
// input, writes it to `recv`. False if the rank was aborted first.
bool RunCollective(const std::shared_ptr<RankState>& st, const std::string& op, uint64_t seq, const void* send,
                   void* recv, size_t count, ncclDataType_t type, ncclRedOp_t red, int root) {
  const std::string what = op + " #" + std::to_string(seq + 1);
  const int n = st->nranks;
  const size_t es = TypeBytes(type);
  Clique& c = *st->clique;
  std::shared_ptr<CollSlot> slot;
  {
    std::unique_lock<std::mutex> l(c.mu);
    std::shared_ptr<CollSlot>& sp = c.colls[seq];
    if (sp == nullptr) {
      sp = std::make_shared<CollSlot>();
      sp->op = op;
      sp->count = count;
      sp->type = type;
      sp->red = red;
      sp->root = root;
      sp->send.assign(n, nullptr);
      sp->recv.assign(n, nullptr);
    } else if (sp->op != op || sp->count != count || sp->type != type || sp->red != red || sp->root != root) {
      colod_cuda_emu::Fatal("NCCL: rank " + std::to_string(st->rank) + " issued " + op + "(count " +
                            std::to_string(count) + ") as collective #" + std::to_string(seq + 1) +
                            " where a peer issued " + sp->op + "(count " + std::to_string(sp->count) +
                            "): ranks disagree on the order of collectives, which hangs or corrupts a GPU run");
    }
    slot = sp;
    slot->send[st->rank] = send;
    slot->recv[st->rank] = recv;
    slot->arrived++;
    c.cv.notify_all();
    if (!WaitFor(l, *st, what, [&] { return slot->arrived == n; })) return false;
  }
  // Every input is in place: compute this rank's output into a buffer of its own.
  const int r = st->rank;
  std::vector<char> out;
  if (op == "AllReduce" || (op == "Reduce" && r == root)) {
    out.resize(count * es);
    Reduce(slot->send, 0, count, type, red, out.data());
  } else if (op == "ReduceScatter") {
    out.resize(count * es);
    Reduce(slot->send, static_cast<size_t>(r) * count, count, type, red, out.data());
  } else if (op == "Broadcast") {
    out.assign(static_cast<const char*>(slot->send[root]), static_cast<const char*>(slot->send[root]) + count * es);
  } else if (op == "AllGather") {
    out.resize(count * es * n);
    for (int j = 0; j < n; ++j) memcpy(out.data() + j * count * es, slot->send[j], count * es);
  } else if (op == "AlltoAll") {
    out.resize(count * es * n);
    for (int j = 0; j < n; ++j) {
      memcpy(out.data() + j * count * es, static_cast<const char*>(slot->send[j]) + r * count * es, count * es);
    }
  }
  {
    std::unique_lock<std::mutex> l(c.mu);
    slot->computed++;
    c.cv.notify_all();
    // No rank writes its output before every rank read every input.
    if (!WaitFor(l, *st, what, [&] { return slot->computed == n; })) return false;
  }
  if (!out.empty()) memcpy(recv, out.data(), out.size());
  std::lock_guard<std::mutex> l(c.mu);
  if (++slot->finished == n) c.colls.erase(seq);
  return true;
}

// Rank st's send #seq+1 to `peer`: returns once the receiver copied `src`.
bool RunSend(const std::shared_ptr<RankState>& st, int peer, uint64_t seq, const void* src, size_t bytes) {
  const std::string what = "Send to " + std::to_string(peer);
  const auto key = std::make_tuple(st->rank, peer, seq);
  Clique& c = *st->clique;
  std::unique_lock<std::mutex> l(c.mu);
  std::shared_ptr<P2PSlot>& sp = c.p2p[key];
  if (sp == nullptr) sp = std::make_shared<P2PSlot>();
  std::shared_ptr<P2PSlot> slot = sp;
  slot->src = src;
  slot->bytes_sent = bytes;
  slot->sender = true;
  c.cv.notify_all();
  // The sender's buffer must stay until the receiver copied it.
  if (!WaitFor(l, *st, what, [&] { return slot->copied; })) return false;
  c.p2p.erase(key);
  return true;
}

// Rank st's receive #seq+1 from `peer` into `dst`.
bool RunRecv(const std::shared_ptr<RankState>& st, int peer, uint64_t seq, void* dst, size_t bytes) {
  const std::string what = "Recv from " + std::to_string(peer);
  const auto key = std::make_tuple(peer, st->rank, seq);
  Clique& c = *st->clique;
  std::unique_lock<std::mutex> l(c.mu);
  std::shared_ptr<P2PSlot>& sp = c.p2p[key];
  if (sp == nullptr) sp = std::make_shared<P2PSlot>();
  std::shared_ptr<P2PSlot> slot = sp;
  slot->dst = dst;
  slot->bytes_wanted = bytes;
  slot->receiver = true;
  c.cv.notify_all();
  if (!WaitFor(l, *st, what, [&] { return slot->sender; })) return false;
  if (slot->bytes_sent != slot->bytes_wanted) {
    colod_cuda_emu::Fatal("NCCL: rank " + std::to_string(peer) + " sends " + std::to_string(slot->bytes_sent) +
                          " bytes to rank " + std::to_string(st->rank) + ", which receives " +
                          std::to_string(slot->bytes_wanted));
  }
  l.unlock();
  memcpy(dst, slot->src, slot->bytes_wanted);
  l.lock();
  slot->copied = true;
  c.cv.notify_all();
  return true;
}

// Sends a request of a remote rank and waits for its answer, until the rank
// is aborted (false). A connection that ended leaves the wait to the abort,
// as a lost peer does; the reader marked the communicator's error.
bool RemoteCall(RankState& st, Kind kind, std::initializer_list<int64_t> args, const void* payload, size_t bytes,
                Frame* answer, const std::string& what) {
  Remote& rm = *st.remote;
  uint64_t req;
  {
    std::lock_guard<std::mutex> l(rm.mu);
    req = rm.next_req++;
  }
  rm.conn->Write(kind, req, args, payload, bytes);  // a broken connection shows as `closed`
  const auto deadline = Clock::now() + HangLimit();
  std::unique_lock<std::mutex> l(rm.mu);
  for (;;) {
    auto it = rm.answers.find(req);
    if (it != rm.answers.end()) {
      *answer = std::move(it->second);
      rm.answers.erase(it);
      return true;
    }
    if (st.aborted) return false;
    if (rm.closed && !st.told_lost) {  // the clique's process is gone: this wait is on a lost peer
      l.unlock();
      ReportLostPeer(st);
      l.lock();
      continue;
    }
    if (Clock::now() >= deadline) {
      colod_cuda_emu::Fatal("NCCL " + what + " (rank " + std::to_string(st.rank) + "/" + std::to_string(st.nranks) +
                            ", remote) waited " + std::to_string(HangLimit().count()) +
                            " s for its peers and was never aborted: a hang");
    }
    rm.cv.wait_for(l, std::chrono::milliseconds(100));
  }
}

ncclResult_t Collective(const char* name, const void* send, void* recv, size_t count, ncclDataType_t type,
                        ncclRedOp_t red, int root, ncclComm_t comm, cudaStream_t stream) {
  std::shared_ptr<RankState> st = Live(comm, name);
  if (st == nullptr) return ncclInvalidArgument;
  if (st->aborted) return ncclInvalidUsage;
  const size_t es = TypeBytes(type);
  if (es == 0 || red < ncclSum || red >= ncclNumOps) return ncclInvalidArgument;
  const std::string op = name;
  const int n = st->nranks;
  // Buffer extents, checked as NCCL checks its pointers.
  const Extents e = ExtentsOf(op, count, es, n, st->rank, root);
  if ((e.sends && !CheckBuffer(send, e.send_bytes, st->device)) ||
      (e.recvs && !CheckBuffer(recv, e.recv_bytes, st->device))) {
    return ncclInvalidArgument;
  }
  if ((op == "Broadcast" || op == "Reduce") && (root < 0 || root >= n)) return ncclInvalidArgument;
  auto s = colod_cuda_emu::Resolve(stream);
  if (s == nullptr) return ncclInvalidArgument;
  // A broken context fails NCCL's kernel launch.
  if (colod_cuda_emu::StickyError(colod_cuda_emu::DeviceOf(*s)) != cudaSuccess) return ncclUnhandledCudaError;
  CheckNotInProgress(*st, name);
  uint64_t seq;
  long opno;
  Links links;
  {
    std::lock_guard<std::mutex> l(st->seq_mu);
    seq = st->next_coll++;
    opno = ++st->ops;
    links.collectives = n > 1 && !st->collectives_linked;
    st->collectives_linked = true;
  }
  const FaultKind fault = FaultFor(*st, opno);
  return Submit(s, st, std::move(links), [=] {
    const std::string what = op + " #" + std::to_string(seq + 1);
    if (fault != FaultKind::kNone) return Stall(*st, fault == FaultKind::kError ? ncclRemoteError : ncclSuccess, what);
    if (st->remote == nullptr) {
      RunCollective(st, op, seq, send, recv, count, type, red, root);
      return;
    }
    // The input goes to the clique's process; the output comes back.
    Frame answer;
    if (!RemoteCall(*st, Kind::kCollective,
                    {static_cast<int64_t>(seq), static_cast<int64_t>(count), type, red, root, OpCode(op)},
                    e.sends ? send : nullptr, e.sends ? e.send_bytes : 0, &answer, what)) {
      return;
    }
    if (e.recvs && answer.payload.size() == e.recv_bytes) memcpy(recv, answer.payload.data(), e.recv_bytes);
  });
}

ncclResult_t PointToPoint(bool is_send, void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                          cudaStream_t stream) {
  const char* name = is_send ? "Send" : "Recv";
  std::shared_ptr<RankState> st = Live(comm, name);
  if (st == nullptr) return ncclInvalidArgument;
  if (st->aborted) return ncclInvalidUsage;
  const size_t es = TypeBytes(type);
  if (es == 0 || peer < 0 || peer >= st->nranks) return ncclInvalidArgument;
  if (!CheckBuffer(buf, count * es, st->device)) return ncclInvalidArgument;
  auto s = colod_cuda_emu::Resolve(stream);
  if (s == nullptr) return ncclInvalidArgument;
  // A broken context fails NCCL's kernel launch.
  if (colod_cuda_emu::StickyError(colod_cuda_emu::DeviceOf(*s)) != cudaSuccess) return ncclUnhandledCudaError;
  CheckNotInProgress(*st, name);
  uint64_t seq;
  long opno;
  Links links;
  {
    std::lock_guard<std::mutex> l(st->seq_mu);
    seq = is_send ? st->next_send[peer]++ : st->next_recv[peer]++;
    opno = ++st->ops;
    // A rank's sends to itself need no connection.
    if (peer != st->rank && (is_send ? st->sent_to : st->received_from).insert(peer).second) {
      (is_send ? links.to : links.from).push_back(peer);
    }
  }
  const FaultKind fault = FaultFor(*st, opno);
  const size_t bytes = count * es;
  return Submit(s, st, std::move(links), [=] {
    const std::string what = std::string(name) + (is_send ? " to " : " from ") + std::to_string(peer);
    if (fault != FaultKind::kNone) return Stall(*st, fault == FaultKind::kError ? ncclRemoteError : ncclSuccess, what);
    if (st->remote == nullptr) {
      is_send ? RunSend(st, peer, seq, buf, bytes) : RunRecv(st, peer, seq, buf, bytes);
      return;
    }
    Frame answer;
    const int64_t p = peer, q = static_cast<int64_t>(seq), b = static_cast<int64_t>(bytes);
    if (is_send) {
      RemoteCall(*st, Kind::kSend, {p, q}, buf, bytes, &answer, what);
    } else if (RemoteCall(*st, Kind::kRecv, {p, q, b}, nullptr, 0, &answer, what) && answer.payload.size() == bytes) {
      memcpy(buf, answer.payload.data(), bytes);
    }
  });
}

// Joins rank `rank` of an `nranks` communicator on `id` in this process's
// clique for it; the rank's state is ncclInProgress until every rank joined.
ncclResult_t Join(const std::string& id, int nranks, int rank, int device, std::shared_ptr<RankState>* out) {
  auto st = std::make_shared<RankState>();
  st->rank = rank;
  st->nranks = nranks;
  st->device = device;
  std::shared_ptr<Clique> clique;
  {
    std::lock_guard<std::mutex> l(init_mu);
    if (UsedIds().count(id)) return ncclInvalidUsage;  // a unique id serves one communicator
    std::shared_ptr<Clique>& c = Pending()[id];
    if (c == nullptr) c = std::make_shared<Clique>(nranks);
    if (c->nranks != nranks || c->devices[rank] != -1) return ncclInvalidUsage;
    c->devices[rank] = device;
    clique = c;
    st->clique = c;
    auto& joined = PendingRanks()[id];
    joined.push_back(st);
    if (static_cast<int>(joined.size()) == nranks) {
      for (auto& r : joined) r->state = ncclSuccess;
      Pending().erase(id);
      PendingRanks().erase(id);
      UsedIds().insert(id);
    }
  }
  {
    std::lock_guard<std::mutex> l(clique->mu);
    clique->members.push_back(st);
    clique->cv.notify_all();
  }
  *out = std::move(st);
  return ncclSuccess;
}

// Enters split #seq of `parent`'s clique with (color, key); the last rank
// to enter builds every child clique.
std::shared_ptr<SplitSlot> EnterSplit(const std::shared_ptr<RankState>& parent, uint64_t seq, int color, int key) {
  Clique& c = *parent->clique;
  const int n = parent->nranks;
  std::lock_guard<std::mutex> l(c.mu);
  auto& sp = c.splits[seq];
  if (sp == nullptr) {
    sp = std::make_shared<SplitSlot>();
    sp->color.assign(n, 0);
    sp->key.assign(n, 0);
    sp->arrived_rank.assign(n, false);
    sp->children.assign(n, nullptr);
  }
  std::shared_ptr<SplitSlot> slot = sp;
  slot->color[parent->rank] = color;
  slot->key[parent->rank] = key;
  slot->arrived_rank[parent->rank] = true;
  if (++slot->arrived == n) {
    // The last to arrive builds every child: ranks of one color, ordered by (key, parent rank).
    std::map<int, std::vector<int>> members;
    for (int r = 0; r < n; ++r) {
      if (slot->color[r] != NCCL_SPLIT_NOCOLOR) members[slot->color[r]].push_back(r);
    }
    for (auto& [col, ranks] : members) {
      std::stable_sort(ranks.begin(), ranks.end(), [&](int a, int b) { return slot->key[a] < slot->key[b]; });
      auto child_clique = std::make_shared<Clique>(static_cast<int>(ranks.size()));
      for (size_t i = 0; i < ranks.size(); ++i) {
        auto ch = std::make_shared<RankState>();
        ch->clique = child_clique;
        ch->rank = static_cast<int>(i);
        ch->nranks = static_cast<int>(ranks.size());
        ch->state = ncclSuccess;
        slot->children[ranks[i]] = ch;
        child_clique->members.push_back(ch);  // not yet shared: no lock needed
      }
    }
    slot->done = true;
    c.splits.erase(seq);
    c.cv.notify_all();
  }
  return slot;
}

// Waits for every rank of the split; `child` is this rank's (nullptr for
// NCCL_SPLIT_NOCOLOR). False if the parent was aborted first.
bool AwaitSplit(const std::shared_ptr<RankState>& parent, const std::shared_ptr<SplitSlot>& slot,
                std::shared_ptr<RankState>* child) {
  std::unique_lock<std::mutex> l(parent->clique->mu);
  if (!WaitFor(l, *parent, "ncclCommSplit", [&] { return slot->done; })) return false;
  *child = slot->children[parent->rank];
  return true;
}

// Split children that remote ranks have yet to attach to, by token.
std::mutex tokens_mu;
int64_t next_token = 0;
std::map<int64_t, std::shared_ptr<RankState>>& Children() {
  static auto* c = new std::map<int64_t, std::shared_ptr<RankState>>();
  return *c;
}

// A peer's process is gone: the clique is broken, and every rank that waits
// for its peers, now or later, reports ncclRemoteError (WaitFor); a rank
// whose collectives all completed reports nothing, as with NCCL.
void BreakClique(RankState& st) {
  std::lock_guard<std::mutex> l(st.clique->mu);
  st.clique->broken = true;
  st.clique->cv.notify_all();
}

void Release(RankState& st) {
  st.aborted = true;
  std::lock_guard<std::mutex> l(st.clique->mu);
  st.clique->cv.notify_all();
}

// A request of a remote rank, run by its stand-in `st` on a thread of its
// own (a group's requests are in flight together); the answer goes back
// unless the rank was aborted first.
void Handle(const std::shared_ptr<RankState>& st, Conn& conn, const Frame& f) {
  switch (f.kind) {
    case Kind::kCollective: {
      const int code = static_cast<int>(f.a[5]);
      const auto type = static_cast<ncclDataType_t>(f.a[2]);
      const size_t count = static_cast<size_t>(f.a[1]), es = TypeBytes(type);
      if (code < 0 || code >= kNumOps || es == 0) colod_cuda_emu::Fatal("NCCL: a malformed remote collective");
      const std::string op = kOps[code];
      const int root = static_cast<int>(f.a[4]);
      const Extents e = ExtentsOf(op, count, es, st->nranks, st->rank, root);
      if (e.sends && f.payload.size() != e.send_bytes) colod_cuda_emu::Fatal("NCCL: a remote input of the wrong size");
      std::vector<char> out(e.recvs ? e.recv_bytes : 0);
      if (!RunCollective(st, op, static_cast<uint64_t>(f.a[0]), e.sends ? f.payload.data() : nullptr,
                         e.recvs ? out.data() : nullptr, count, type, static_cast<ncclRedOp_t>(f.a[3]), root)) {
        return;
      }
      conn.Write(Kind::kDone, f.req, {}, out.data(), out.size());
      return;
    }
    case Kind::kSend:
      if (RunSend(st, static_cast<int>(f.a[0]), static_cast<uint64_t>(f.a[1]), f.payload.data(), f.payload.size())) {
        conn.Write(Kind::kDone, f.req, {});
      }
      return;
    case Kind::kRecv: {
      std::vector<char> out(static_cast<size_t>(f.a[2]));
      if (RunRecv(st, static_cast<int>(f.a[0]), static_cast<uint64_t>(f.a[1]), out.data(), out.size())) {
        conn.Write(Kind::kDone, f.req, {}, out.data(), out.size());
      }
      return;
    }
    case Kind::kConnect: {
      const int64_t to = f.a[1], from = f.a[2];
      if (to < 0 || from < 0 || to >= st->nranks || from >= st->nranks ||
          f.payload.size() != static_cast<size_t>(to + from) * sizeof(int32_t)) {
        colod_cuda_emu::Fatal("NCCL: a malformed remote connection request");
      }
      std::vector<int32_t> peers(static_cast<size_t>(to + from));
      if (!peers.empty()) memcpy(peers.data(), f.payload.data(), f.payload.size());
      Links links;
      links.collectives = f.a[0] != 0;
      for (size_t i = 0; i < peers.size(); ++i) {
        if (peers[i] < 0 || peers[i] >= st->nranks || peers[i] == st->rank) {
          colod_cuda_emu::Fatal("NCCL: a remote connection to no rank or to itself");
        }
        (static_cast<int64_t>(i) < to ? links.to : links.from).push_back(peers[i]);
      }
      if (ConnectLinks(st, links)) conn.Write(Kind::kDone, f.req, {});
      return;
    }
    case Kind::kSplit: {
      std::shared_ptr<SplitSlot> slot =
          EnterSplit(st, static_cast<uint64_t>(f.a[0]), static_cast<int>(f.a[1]), static_cast<int>(f.a[2]));
      std::shared_ptr<RankState> child;
      if (!AwaitSplit(st, slot, &child)) return;
      if (child == nullptr) {
        conn.Write(Kind::kSplitDone, f.req, {-1, 0, 0});
        return;
      }
      child->device = static_cast<int>(f.a[3]);
      int64_t token;
      {
        std::lock_guard<std::mutex> l(tokens_mu);
        token = next_token++;
        Children()[token] = child;
      }
      conn.Write(Kind::kSplitDone, f.req, {token, child->rank, child->nranks});
      return;
    }
    default:
      colod_cuda_emu::Fatal("NCCL: a remote rank sent an unknown request");
  }
}

// A connection from a rank in another process: its hello names a
// communicator to join (or a split's child to attach to); then its
// requests, until it leaves or its process is gone.
void ServeRemote(std::shared_ptr<Conn> conn) {
  Frame hello;
  if (!conn->Read(&hello)) return;
  std::shared_ptr<RankState> st;
  if (hello.kind == Kind::kHelloInit) {
    const int nranks = static_cast<int>(hello.a[0]), rank = static_cast<int>(hello.a[1]);
    const std::string id(hello.payload.begin(), hello.payload.end());
    const ncclResult_t r = nranks < 1 || rank < 0 || rank >= nranks
                               ? ncclInvalidArgument
                               : Join(id, nranks, rank, static_cast<int>(hello.a[2]), &st);
    if (r != ncclSuccess) {
      conn->Write(Kind::kReady, 0, {r});
      return;
    }
    st->stand_in_for = conn;
    // Ready once every rank joined, told from a thread of its own so that
    // this one reads on (a rank that leaves before then releases it).
    std::thread([st, conn] {
      std::unique_lock<std::mutex> l(st->clique->mu);
      if (!WaitFor(l, *st, "ncclCommInitRank", [&] { return st->state != ncclInProgress; })) return;
      l.unlock();
      conn->Write(Kind::kReady, 0, {st->state.load()});
    }).detach();
  } else if (hello.kind == Kind::kHelloChild) {
    {
      std::lock_guard<std::mutex> l(tokens_mu);
      auto it = Children().find(hello.a[0]);
      if (it != Children().end()) {
        st = it->second;
        Children().erase(it);
      }
    }
    if (st == nullptr) {
      conn->Write(Kind::kReady, 0, {ncclInvalidUsage});
      return;
    }
    st->stand_in_for = conn;
    conn->Write(Kind::kReady, 0, {ncclSuccess});
  } else {
    return;
  }
  Frame f;
  bool farewell = false;
  while (conn->Read(&f)) {
    if (f.kind == Kind::kBye || f.kind == Kind::kAbort) {
      farewell = true;
      break;
    }
    auto req = std::make_shared<Frame>(std::move(f));
    f = Frame();
    std::thread([st, conn, req] { Handle(st, *conn, *req); }).detach();
  }
  if (!farewell) BreakClique(*st);
  Release(*st);  // its stand-in's waits end, as an abort ends a local rank's
}

// The listener's address, started with the first id this process makes.
std::string HubAddress() { return ListenerAddress(ServeRemote); }

// The reader of a remote rank's connection: answers by request number, the
// readiness and async errors into the rank's state.
void ReadAnswers(std::shared_ptr<Remote> rm, std::weak_ptr<RankState> weak) {
  Frame f;
  while (rm->conn->Read(&f)) {
    std::shared_ptr<RankState> st = weak.lock();
    if (f.kind == Kind::kReady || f.kind == Kind::kAsyncError) {
      if (st != nullptr) {
        if (f.kind == Kind::kReady) {
          st->state = static_cast<int>(f.a[0]);
        } else {
          int expected = ncclSuccess;
          st->state.compare_exchange_strong(expected, static_cast<int>(f.a[0]));
        }
      }
      std::lock_guard<std::mutex> l(rm->mu);
      rm->cv.notify_all();
      continue;
    }
    std::lock_guard<std::mutex> l(rm->mu);
    rm->answers[f.req] = std::move(f);
    f = Frame();
    rm->cv.notify_all();
  }
  // The clique's process is gone (or this rank left): a request waiting for
  // its answer, or a communicator still being made, reports the lost peer
  // (RemoteCall, below); one with nothing in flight reports nothing.
  std::shared_ptr<RankState> st = weak.lock();
  std::lock_guard<std::mutex> l(rm->mu);
  rm->closed = true;
  if (!rm->leaving && st != nullptr) {
    int expected = ncclInProgress;
    st->state.compare_exchange_strong(expected, ncclRemoteError);
  }
  rm->cv.notify_all();
}

// A rank whose clique is at `address`: connects, says `hello`, and starts
// the reader. nullptr if the address cannot be reached.
std::shared_ptr<RankState> ConnectRemote(const std::string& address, int rank, int nranks, int device) {
  std::shared_ptr<Conn> conn = Connect(address);
  if (conn == nullptr) return nullptr;
  auto st = std::make_shared<RankState>();
  st->rank = rank;
  st->nranks = nranks;
  st->device = device;
  st->clique = std::make_shared<Clique>(1);  // only a place to wait (Stall)
  st->remote = std::make_shared<Remote>();
  st->remote->conn = conn;
  st->remote->address = address;
  std::thread(ReadAnswers, st->remote, std::weak_ptr<RankState>(st)).detach();
  return st;
}

// Waits until a remote rank's communicator is ready or failed.
ncclResult_t AwaitReady(RankState& st) {
  std::unique_lock<std::mutex> l(st.remote->mu);
  while (st.state == ncclInProgress && !st.aborted) st.remote->cv.wait_for(l, std::chrono::milliseconds(100));
  return static_cast<ncclResult_t>(st.state.load());
}

// A remote rank leaves: says so (without blocking: a stopped clique process
// must not hang an abort; unsaid, the end reads as a lost peer there) and
// ends the connection.
void Leave(RankState& st, Kind why) {
  {
    std::lock_guard<std::mutex> l(st.remote->mu);
    st.remote->leaving = true;
  }
  st.remote->conn->TryWrite(why, {});
  st.remote->conn->Shutdown();
  std::lock_guard<std::mutex> l(st.remote->mu);
  st.remote->cv.notify_all();
}

}  // namespace

void SetFault(const Fault& fault) {
  std::lock_guard<std::mutex> l(fault_mu);
  CurrentFault() = fault;
}

void SetConnectEndPause(int ms) { connect_end_pause_ms = ms > 0 ? ms : 0; }

void SetAbortPause(int ms) { abort_pause_ms = ms > 0 ? ms : 0; }

long AbortsBegun() { return aborts_begun.load(); }

}  // namespace colod_nccl_emu

using colod_nccl_emu::Clique;
using colod_nccl_emu::RankState;

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* unique_id) {
  if (unique_id == nullptr) return ncclInvalidArgument;
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  memset(unique_id->internal, 0, sizeof unique_id->internal);
  // pid:counter:nonce, then where ranks of other processes reach this
  // process's cliques (as a real id carries its bootstrap root's address).
  snprintf(unique_id->internal, sizeof unique_id->internal, "colod-nccl-emu:%d:%llu:%08x%08x@%s",
           static_cast<int>(getpid()), static_cast<unsigned long long>(++counter), rd(), rd(),
           colod_nccl_emu::HubAddress().c_str());
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t) { return ""; }

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId comm_id, int rank,
                                    ncclConfig_t* config) {
  if (comm == nullptr || nranks < 1 || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  const std::string full(comm_id.internal, strnlen(comm_id.internal, sizeof comm_id.internal));
  const size_t at = full.find('@');
  const std::string id = full.substr(0, at), address = at == std::string::npos ? "" : full.substr(at + 1);
  const std::string mine = "colod-nccl-emu:" + std::to_string(getpid()) + ":";
  const bool blocking = config == nullptr || config->blocking != 0;
  const int device = colod_cuda_emu::CurrentDevice();
  std::shared_ptr<RankState> st;
  if (id.compare(0, mine.size(), mine) != 0) {
    // Another process's clique: joined over the id's address.
    if (id.compare(0, 15, "colod-nccl-emu:") != 0 || address.empty()) return ncclInvalidUsage;
    st = colod_nccl_emu::ConnectRemote(address, rank, nranks, device);
    if (st == nullptr) return ncclSystemError;  // as NCCL when its bootstrap root cannot be reached
    st->blocking = blocking;
    st->remote->conn->Write(colod_nccl_emu::Kind::kHelloInit, 0, {nranks, rank, device}, id.data(), id.size());
    *comm = colod_nccl_emu::NewHandle(st);
    if (!blocking) return ncclSuccess;  // ncclCommGetAsyncError says when it is ready
    return colod_nccl_emu::AwaitReady(*st);
  }
  const ncclResult_t joined = colod_nccl_emu::Join(id, nranks, rank, device, &st);
  if (joined != ncclSuccess) return joined;
  st->blocking = blocking;
  *comm = colod_nccl_emu::NewHandle(st);
  if (!blocking) return ncclSuccess;  // ncclCommGetAsyncError says when it is ready
  std::unique_lock<std::mutex> l(st->clique->mu);
  colod_nccl_emu::WaitFor(l, *st, "ncclCommInitRank", [&] { return st->state != ncclInProgress; });
  return st->state == ncclSuccess ? ncclSuccess : static_cast<ncclResult_t>(st->state.load());
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId comm_id, int rank) {
  return ncclCommInitRankConfig(comm, nranks, comm_id, rank, nullptr);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  std::shared_ptr<RankState> parent = colod_nccl_emu::Live(comm, "ncclCommSplit");
  if (parent == nullptr || newcomm == nullptr || (color < 0 && color != NCCL_SPLIT_NOCOLOR)) {
    return ncclInvalidArgument;
  }
  if (parent->aborted || parent->state != ncclSuccess || parent->connecting) return ncclInvalidUsage;
  // A null config is the parent's (NCCL 2.18 on): the split, and its child.
  const bool blocking = config == nullptr ? parent->blocking : config->blocking != 0;
  uint64_t seq;
  {
    std::lock_guard<std::mutex> l(parent->seq_mu);
    seq = parent->next_split++;
  }
  const int device = colod_cuda_emu::CurrentDevice();
  std::function<void()> finish;
  if (parent->remote == nullptr) {
    std::shared_ptr<colod_nccl_emu::SplitSlot> slot = colod_nccl_emu::EnterSplit(parent, seq, color, key);
    // Completes when every parent rank arrived, writing *newcomm then:
    // NCCL's non-blocking split does the same, so the caller's pointer must
    // stay valid.
    finish = [parent, slot, newcomm, device, blocking] {
      std::shared_ptr<RankState> child;
      if (!colod_nccl_emu::AwaitSplit(parent, slot, &child)) return;
      if (child != nullptr) {
        child->device = device;
        child->blocking = blocking;
        *newcomm = colod_nccl_emu::NewHandle(child);
      } else {
        *newcomm = nullptr;
      }
      parent->state = ncclSuccess;
    };
  } else {
    // The clique's process splits it; this rank's child (if any) attaches
    // there over a connection of its own.
    finish = [parent, seq, color, key, newcomm, device, blocking] {
      colod_nccl_emu::Frame answer;
      if (!colod_nccl_emu::RemoteCall(*parent, colod_nccl_emu::Kind::kSplit, {static_cast<int64_t>(seq), color, key,
                                      device}, nullptr, 0, &answer, "ncclCommSplit")) {
        return;
      }
      if (answer.a[0] < 0) {
        *newcomm = nullptr;
        parent->state = ncclSuccess;
        return;
      }
      std::shared_ptr<RankState> child = colod_nccl_emu::ConnectRemote(
          parent->remote->address, static_cast<int>(answer.a[1]), static_cast<int>(answer.a[2]), device);
      if (child == nullptr) {
        parent->state = ncclSystemError;
        return;
      }
      child->blocking = blocking;
      child->remote->conn->Write(colod_nccl_emu::Kind::kHelloChild, 0, {answer.a[0]});
      const ncclResult_t ready = colod_nccl_emu::AwaitReady(*child);
      *newcomm = colod_nccl_emu::NewHandle(child);
      parent->state = ready;
    };
  }
  parent->state = ncclInProgress;
  if (blocking) {
    finish();
    return parent->aborted ? ncclInvalidUsage : static_cast<ncclResult_t>(parent->state.load());
  }
  std::thread(finish).detach();
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  std::shared_ptr<RankState> st = colod_nccl_emu::Live(comm, "ncclCommGetAsyncError");
  if (st == nullptr || async_error == nullptr) return ncclInvalidArgument;
  *async_error = static_cast<ncclResult_t>(st->state.load());
  return ncclSuccess;
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  std::shared_ptr<RankState> st = colod_nccl_emu::Live(comm, "ncclCommFinalize");
  if (st == nullptr) return ncclInvalidArgument;
  colod_nccl_emu::CheckNotInProgress(*st, "ncclCommFinalize");
  if (st->pending == 0) return ncclSuccess;
  // Non-blocking: ncclCommGetAsyncError reports ncclInProgress until the
  // communicator's outstanding operations completed.
  int expected = ncclSuccess;
  if (!st->state.compare_exchange_strong(expected, ncclInProgress)) return ncclSuccess;
  std::thread([st] {
    while (st->pending > 0 && !st->aborted) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    int in_progress = ncclInProgress;
    st->state.compare_exchange_strong(in_progress, ncclSuccess);
  }).detach();
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  std::shared_ptr<RankState> st = colod_nccl_emu::Live(comm, "ncclCommDestroy");
  if (st == nullptr) return ncclInvalidArgument;
  if (st->connecting) colod_nccl_emu::CheckNotInProgress(*st, "ncclCommDestroy");
  if (st->remote != nullptr) colod_nccl_emu::Leave(*st, colod_nccl_emu::Kind::kBye);
  colod_nccl_emu::Kill(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  std::shared_ptr<RankState> st = colod_nccl_emu::Live(comm, "ncclCommAbort");
  if (st == nullptr) return ncclInvalidArgument;
  colod_nccl_emu::aborts_begun.fetch_add(1);
  if (const int pause = colod_nccl_emu::abort_pause_ms.load(); pause > 0) {
    std::this_thread::sleep_for(std::chrono::milliseconds(pause));
  }
  st->aborted = true;
  {
    std::lock_guard<std::mutex> l(st->clique->mu);
    st->clique->cv.notify_all();
  }
  if (st->remote != nullptr) colod_nccl_emu::Leave(*st, colod_nccl_emu::Kind::kAbort);
  colod_nccl_emu::Kill(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  std::shared_ptr<RankState> st = colod_nccl_emu::Live(comm, "ncclCommCount");
  if (st == nullptr || count == nullptr) return ncclInvalidArgument;
  *count = st->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  std::shared_ptr<RankState> st = colod_nccl_emu::Live(comm, "ncclCommCuDevice");
  if (st == nullptr || device == nullptr) return ncclInvalidArgument;
  *device = st->device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  std::shared_ptr<RankState> st = colod_nccl_emu::Live(comm, "ncclCommUserRank");
  if (st == nullptr || rank == nullptr) return ncclInvalidArgument;
  *rank = st->rank;
  return ncclSuccess;
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return colod_nccl_emu::Collective("AllReduce", sendbuff, recvbuff, count, datatype, op, 0, comm, stream);
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  return colod_nccl_emu::Collective("Broadcast", sendbuff, recvbuff, count, datatype, ncclSum, root, comm, stream);
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  return colod_nccl_emu::Collective("Reduce", sendbuff, recvbuff, count, datatype, op, root, comm, stream);
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  return colod_nccl_emu::Collective("AllGather", sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm, stream);
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  return colod_nccl_emu::Collective("ReduceScatter", sendbuff, recvbuff, recvcount, datatype, op, 0, comm, stream);
}

ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                          ncclComm_t comm, cudaStream_t stream) {
  return colod_nccl_emu::Collective("AlltoAll", sendbuff, recvbuff, count, datatype, ncclSum, 0, comm, stream);
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return colod_nccl_emu::PointToPoint(true, const_cast<void*>(sendbuff), count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return colod_nccl_emu::PointToPoint(false, recvbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclGroupStart() {
  ++colod_nccl_emu::group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (colod_nccl_emu::group_depth == 0) return ncclInvalidUsage;
  if (--colod_nccl_emu::group_depth > 0) return ncclSuccess;
  std::vector<colod_nccl_emu::GroupOp> ops = std::move(colod_nccl_emu::group_ops);
  colod_nccl_emu::group_ops.clear();
  return colod_nccl_emu::Launch(std::move(ops));
}
