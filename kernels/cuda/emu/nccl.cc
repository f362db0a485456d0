// NCCL in colod's CUDA emulation (include/nccl.h): communicators of ranks
// that are threads of this process. A collective is a task on the caller's
// stream that deposits its buffers in the clique's slot for its sequence
// number, waits for every rank, computes its output from all inputs, waits
// again (so in-place outputs are written only after every rank read every
// input) and writes it. A point-to-point call waits for its peer's matching
// call. Waits end when every peer arrived or the rank's communicator was
// aborted, never by themselves: a lost peer hangs its peers' streams as it
// does on GPUs, up to a safety limit that ends the test process
// (COLOD_NCCL_EMU_HANG_LIMIT seconds, default 600).
//
// Thread-safety: every entry point may be called from any thread; clique
// state is guarded by its mutex, which is never held while copying data or
// waiting for a stream. Handles are never freed (a destroyed or aborted one
// is marked dead), so a use after destroy is reported, not undefined.
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
};

struct RankState {
  std::shared_ptr<Clique> clique;
  int rank = 0;
  int nranks = 0;
  int device = 0;
  std::atomic<int> state{ncclInProgress};
  std::atomic<bool> aborted{false};
  std::atomic<int> pending{0};
  // Sequence numbers, advanced by the calling thread at enqueue (ops of one
  // communicator must be issued in one order, as NCCL requires).
  std::mutex seq_mu;
  uint64_t next_coll = 0, next_split = 0;
  long ops = 0;
  std::map<int, uint64_t> next_send, next_recv;
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

// Waits on the clique until `ready` or the rank is aborted; false if aborted.
template <typename Pred>
bool WaitFor(std::unique_lock<std::mutex>& l, RankState& st, const std::string& what, Pred ready) {
  const auto deadline = Clock::now() + HangLimit();
  while (!ready()) {
    if (st.aborted) return false;
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

// ---- Group calls: ops issued between ncclGroupStart and ncclGroupEnd ----
struct GroupOp {
  std::shared_ptr<colod_cuda_emu::Stream> stream;
  std::function<void()> run;
};
thread_local int group_depth = 0;
thread_local std::vector<GroupOp> group_ops;

// Runs `run` on `stream` now, or with the group's other ops on the same
// stream, concurrently, at ncclGroupEnd.
void Submit(std::shared_ptr<colod_cuda_emu::Stream> stream, std::shared_ptr<RankState> st, std::function<void()> run) {
  st->pending++;
  auto task = [st, run = std::move(run)] {
    run();
    st->pending--;
  };
  if (group_depth > 0) {
    group_ops.push_back(GroupOp{std::move(stream), std::move(task)});
  } else {
    colod_cuda_emu::Enqueue(stream, std::move(task));
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
  size_t send_bytes = count * es, recv_bytes = count * es;
  if (op == "AllGather") recv_bytes *= n;
  if (op == "ReduceScatter" || op == "AlltoAll") send_bytes *= n;
  if (op == "AlltoAll") recv_bytes *= n;
  const bool sends = op != "Broadcast" || st->rank == root;
  const bool recvs = op != "Reduce" || st->rank == root;
  if ((sends && !CheckBuffer(send, send_bytes, st->device)) || (recvs && !CheckBuffer(recv, recv_bytes, st->device))) {
    return ncclInvalidArgument;
  }
  if ((op == "Broadcast" || op == "Reduce") && (root < 0 || root >= n)) return ncclInvalidArgument;
  auto s = colod_cuda_emu::Resolve(stream);
  if (s == nullptr) return ncclInvalidArgument;
  uint64_t seq;
  long opno;
  {
    std::lock_guard<std::mutex> l(st->seq_mu);
    seq = st->next_coll++;
    opno = ++st->ops;
  }
  const FaultKind fault = FaultFor(*st, opno);
  Submit(s, st, [=] {
    const std::string what = op + " #" + std::to_string(seq + 1);
    if (fault != FaultKind::kNone) return Stall(*st, fault == FaultKind::kError ? ncclRemoteError : ncclSuccess, what);
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
      if (!WaitFor(l, *st, what, [&] { return slot->arrived == n; })) return;
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
      if (!WaitFor(l, *st, what, [&] { return slot->computed == n; })) return;
    }
    if (!out.empty()) memcpy(recv, out.data(), out.size());
    std::lock_guard<std::mutex> l(c.mu);
    if (++slot->finished == n) c.colls.erase(seq);
  });
  return ncclSuccess;
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
  uint64_t seq;
  long opno;
  {
    std::lock_guard<std::mutex> l(st->seq_mu);
    seq = is_send ? st->next_send[peer]++ : st->next_recv[peer]++;
    opno = ++st->ops;
  }
  const FaultKind fault = FaultFor(*st, opno);
  const int me = st->rank;
  const auto key = is_send ? std::make_tuple(me, peer, seq) : std::make_tuple(peer, me, seq);
  Submit(s, st, [=] {
    const std::string what = std::string(name) + (is_send ? " to " : " from ") + std::to_string(peer);
    if (fault != FaultKind::kNone) return Stall(*st, fault == FaultKind::kError ? ncclRemoteError : ncclSuccess, what);
    Clique& c = *st->clique;
    std::unique_lock<std::mutex> l(c.mu);
    std::shared_ptr<P2PSlot>& sp = c.p2p[key];
    if (sp == nullptr) sp = std::make_shared<P2PSlot>();
    std::shared_ptr<P2PSlot> slot = sp;
    if (is_send) {
      slot->src = buf;
      slot->bytes_sent = count * es;
      slot->sender = true;
      c.cv.notify_all();
      // The sender's buffer must stay until the receiver copied it.
      if (!WaitFor(l, *st, what, [&] { return slot->copied; })) return;
      c.p2p.erase(key);
    } else {
      slot->dst = buf;
      slot->bytes_wanted = count * es;
      slot->receiver = true;
      c.cv.notify_all();
      if (!WaitFor(l, *st, what, [&] { return slot->sender; })) return;
      if (slot->bytes_sent != slot->bytes_wanted) {
        colod_cuda_emu::Fatal("NCCL: rank " + std::to_string(peer) + " sends " + std::to_string(slot->bytes_sent) +
                              " bytes to rank " + std::to_string(me) + ", which receives " +
                              std::to_string(slot->bytes_wanted));
      }
      l.unlock();
      memcpy(buf, slot->src, slot->bytes_wanted);
      l.lock();
      slot->copied = true;
      c.cv.notify_all();
    }
  });
  return ncclSuccess;
}

}  // namespace

void SetFault(const Fault& fault) {
  std::lock_guard<std::mutex> l(fault_mu);
  CurrentFault() = fault;
}

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
  snprintf(unique_id->internal, sizeof unique_id->internal, "colod-nccl-emu:%d:%llu:%08x%08x",
           static_cast<int>(getpid()), static_cast<unsigned long long>(++counter), rd(), rd());
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
  const std::string id(comm_id.internal, strnlen(comm_id.internal, sizeof comm_id.internal));
  const std::string mine = "colod-nccl-emu:" + std::to_string(getpid()) + ":";
  if (id.compare(0, mine.size(), mine) != 0) {
    // Another process's id (or none): the emulation has no network transport.
    return ncclInvalidUsage;
  }
  const bool blocking = config == nullptr || config->blocking != 0;
  auto st = std::make_shared<RankState>();
  st->rank = rank;
  st->nranks = nranks;
  st->device = colod_cuda_emu::CurrentDevice();
  std::shared_ptr<Clique> clique;
  {
    std::lock_guard<std::mutex> l(colod_nccl_emu::init_mu);
    if (colod_nccl_emu::UsedIds().count(id)) return ncclInvalidUsage;  // a unique id serves one communicator
    std::shared_ptr<Clique>& c = colod_nccl_emu::Pending()[id];
    if (c == nullptr) c = std::make_shared<Clique>(nranks);
    if (c->nranks != nranks || c->devices[rank] != -1) return ncclInvalidUsage;
    c->devices[rank] = st->device;
    clique = c;
    st->clique = c;
    auto& joined = colod_nccl_emu::PendingRanks()[id];
    joined.push_back(st);
    if (static_cast<int>(joined.size()) == nranks) {
      for (auto& r : joined) r->state = ncclSuccess;
      colod_nccl_emu::Pending().erase(id);
      colod_nccl_emu::PendingRanks().erase(id);
      colod_nccl_emu::UsedIds().insert(id);
    }
  }
  {
    std::lock_guard<std::mutex> l(clique->mu);
    clique->cv.notify_all();
  }
  *comm = colod_nccl_emu::NewHandle(st);
  if (!blocking) return ncclSuccess;  // ncclCommGetAsyncError says when it is ready
  std::unique_lock<std::mutex> l(clique->mu);
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
  if (parent->aborted || parent->state != ncclSuccess) return ncclInvalidUsage;
  const bool blocking = config == nullptr || config->blocking != 0;
  uint64_t seq;
  {
    std::lock_guard<std::mutex> l(parent->seq_mu);
    seq = parent->next_split++;
  }
  Clique& c = *parent->clique;
  const int n = parent->nranks;
  std::shared_ptr<colod_nccl_emu::SplitSlot> slot;
  {
    std::lock_guard<std::mutex> l(c.mu);
    auto& sp = c.splits[seq];
    if (sp == nullptr) {
      sp = std::make_shared<colod_nccl_emu::SplitSlot>();
      sp->color.assign(n, 0);
      sp->key.assign(n, 0);
      sp->arrived_rank.assign(n, false);
      sp->children.assign(n, nullptr);
    }
    slot = sp;
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
        }
      }
      slot->done = true;
      c.splits.erase(seq);
      c.cv.notify_all();
    }
  }
  const int device = colod_cuda_emu::CurrentDevice();
  parent->state = ncclInProgress;
  // Completes when every parent rank arrived, writing *newcomm then: NCCL's
  // non-blocking split does the same, so the caller's pointer must stay valid.
  auto finish = [parent, slot, newcomm, device] {
    std::unique_lock<std::mutex> l(parent->clique->mu);
    if (!colod_nccl_emu::WaitFor(l, *parent, "ncclCommSplit", [&] { return slot->done; })) return;
    std::shared_ptr<RankState> child = slot->children[parent->rank];
    l.unlock();
    if (child != nullptr) {
      child->device = device;
      *newcomm = colod_nccl_emu::NewHandle(child);
    } else {
      *newcomm = nullptr;
    }
    parent->state = ncclSuccess;
  };
  if (blocking) {
    finish();
    return parent->aborted ? ncclInvalidUsage : ncclSuccess;
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
  if (colod_nccl_emu::Live(comm, "ncclCommDestroy") == nullptr) return ncclInvalidArgument;
  colod_nccl_emu::Kill(comm);
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  std::shared_ptr<RankState> st = colod_nccl_emu::Live(comm, "ncclCommAbort");
  if (st == nullptr) return ncclInvalidArgument;
  st->aborted = true;
  {
    std::lock_guard<std::mutex> l(st->clique->mu);
    st->clique->cv.notify_all();
  }
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
  // The group's ops on each stream become one task that runs them
  // concurrently, as one fused NCCL kernel progresses all of them.
  std::vector<colod_nccl_emu::GroupOp> ops = std::move(colod_nccl_emu::group_ops);
  colod_nccl_emu::group_ops.clear();
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
  return ncclSuccess;
}
