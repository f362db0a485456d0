#include "worker/comm/gloo/gloo_communicator.h"

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <new>
#include <stdexcept>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "gloo/allgather.h"
#include "gloo/allreduce.h"
#include "gloo/alltoall.h"
#include "gloo/barrier.h"
#include "gloo/broadcast.h"
#include "gloo/common/error.h"
#include "gloo/common/logging.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/context.h"
#include "gloo/transport/pair.h"
#include "gloo/transport/tcp/device.h"
#include "gloo/transport/unbound_buffer.h"
#include "gloo/types.h"
#include "worker/comm/gloo/collective_algorithms.h"

namespace colod {
namespace {

std::chrono::milliseconds ToMillis(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// A rendezvous in progress, shared by Create and the thread that runs it.
struct Rendezvous {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::Status status ABSL_GUARDED_BY(mu);
  // Create returned without it: the store may be gone.
  bool abandoned ABSL_GUARDED_BY(mu) = false;
  int store_calls ABSL_GUARDED_BY(mu) = 0;  // in progress
};

// colod's Store seen through Gloo's rendezvous interface. Errors are thrown,
// as Gloo expects, with the Status text (which names missing keys). Once the
// rendezvous is abandoned every call throws without touching the store.
class StoreAdapter final : public gloo::rendezvous::Store {
 public:
  StoreAdapter(colod::Store& store, std::string prefix, absl::Duration timeout, std::shared_ptr<Rendezvous> r)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout), r_(std::move(r)) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    Call([&] { return store_.Set(Key(key), std::string(data.begin(), data.end())); });
  }
  std::vector<char> get(const std::string& key) override {
    std::vector<std::string> v;
    Call([&] {
      auto got = WaitFor({Key(key)}, timeout_);
      if (got.ok()) v = *std::move(got);
      return got.status();
    });
    return std::vector<char>(v[0].begin(), v[0].end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, ToMillis(timeout_)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(Key(k));
    Call([&] { return WaitFor(full, absl::Milliseconds(timeout.count())).status(); });
  }

 private:
  // The store's Wait in slices, so that an abandoned rendezvous (an abort:
  // a peer that failed will never set its keys) stops waiting within a
  // slice instead of at the timeout, whatever the store.
  absl::StatusOr<std::vector<std::string>> WaitFor(const std::vector<std::string>& keys, absl::Duration timeout) {
    constexpr absl::Duration kSlice = absl::Milliseconds(250);
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {  // a slice's RPC overran the deadline: no wait of 0 or less is asked
        return absl::DeadlineExceededError(
            absl::StrCat("the rendezvous keys did not arrive within ", absl::FormatDuration(timeout)));
      }
      absl::StatusOr<std::vector<std::string>> got = store_.Wait(keys, std::min(left, kSlice));
      if (got.ok() || !absl::IsDeadlineExceeded(got.status()) || left <= kSlice) return got;
      absl::MutexLock lock(&r_->mu);
      if (r_->abandoned) return absl::AbortedError("the rendezvous was aborted");
    }
  }
  template <typename Fn>
  void Call(Fn&& fn) {
    {
      absl::MutexLock lock(&r_->mu);
      if (r_->abandoned) throw gloo::IoException("the rendezvous was aborted");
      ++r_->store_calls;
    }
    const absl::Status s = fn();
    {
      absl::MutexLock lock(&r_->mu);
      --r_->store_calls;
    }
    if (!s.ok()) throw gloo::IoException(s.ToString());
  }
  std::string Key(const std::string& k) const { return absl::StrCat(prefix_, "/", k); }
  colod::Store& store_;
  const std::string prefix_;
  const absl::Duration timeout_;
  const std::shared_ptr<Rendezvous> r_;
};

// Calls fn with a null pointer of the element type Gloo moves for `dtype`.
// f16 and bf16 travel as 16-bit words and are reduced by our own functions.
template <typename Fn>
void WithStorageType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kF32: fn(static_cast<float*>(nullptr)); return;
    case DType::kBF16:
    case DType::kF16: fn(static_cast<uint16_t*>(nullptr)); return;
    case DType::kI32: fn(static_cast<int32_t*>(nullptr)); return;
    case DType::kI64: fn(static_cast<int64_t*>(nullptr)); return;
  }
}

template <typename T, typename Op>
gloo::AllreduceOptions::Func Elementwise(Op op) {
  return [op](void* c, const void* a, const void* b, size_t n) {
    T* cc = static_cast<T*>(c);
    const T* aa = static_cast<const T*>(a);
    const T* bb = static_cast<const T*>(b);
    for (size_t i = 0; i < n; ++i) cc[i] = op(aa[i], bb[i]);  // vectorized by the compiler
  };
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), typename Op>
gloo::AllreduceOptions::Func Elementwise16(Op op) {
  return [op](void* c, const void* a, const void* b, size_t n) {
    uint16_t* cc = static_cast<uint16_t*>(c);
    const uint16_t* aa = static_cast<const uint16_t*>(a);
    const uint16_t* bb = static_cast<const uint16_t*>(b);
    for (size_t i = 0; i < n; ++i) cc[i] = FromF(op(ToF(aa[i]), ToF(bb[i])));
  };
}

template <typename Op>
gloo::AllreduceOptions::Func ReduceFunction(DType dtype, Op op) {
  switch (dtype) {
    case DType::kF32: return Elementwise<float>(op);
    case DType::kBF16: return Elementwise16<BF16ToFloat, FloatToBF16>(op);
    case DType::kF16: return Elementwise16<F16ToFloat, FloatToF16>(op);
    case DType::kI32: return Elementwise<int32_t>(op);
    case DType::kI64: return Elementwise<int64_t>(op);
  }
  return nullptr;
}

gloo::AllreduceOptions::Func ReduceFunction(DType dtype, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kAvg:
      return ReduceFunction(dtype, [](auto x, auto y) { return x + y; });
    case ReduceOp::kMax:
      return ReduceFunction(dtype, [](auto x, auto y) { return x > y ? x : y; });
    case ReduceOp::kMin:
      return ReduceFunction(dtype, [](auto x, auto y) { return x < y ? x : y; });
  }
  return nullptr;
}

// data[i] /= n, for kAvg after the sum.
void DivideInPlace(void* data, int64_t count, DType dtype, int n) {
  switch (dtype) {
    case DType::kF32: {
      float* p = static_cast<float*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] /= static_cast<float>(n);
      return;
    }
    case DType::kBF16:
    case DType::kF16: {
      uint16_t* p = static_cast<uint16_t*>(data);
      const bool bf = dtype == DType::kBF16;
      for (int64_t i = 0; i < count; ++i) {
        const float v = (bf ? BF16ToFloat(p[i]) : F16ToFloat(p[i])) / static_cast<float>(n);
        p[i] = bf ? FloatToBF16(v) : FloatToF16(v);
      }
      return;
    }
    case DType::kI32: {
      int32_t* p = static_cast<int32_t*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] /= n;
      return;
    }
    case DType::kI64: {
      int64_t* p = static_cast<int64_t*>(data);
      for (int64_t i = 0; i < count; ++i) p[i] /= n;
      return;
    }
  }
}

// Slot prefixes for user point-to-point tags and colod's ring reduce-scatter
// (Gloo's collectives use 0x01..0x08).
constexpr uint8_t kP2PSlotPrefix = 0x5c;
constexpr uint8_t kReduceScatterSlotPrefix = 0x5d;
constexpr uint8_t kExchangeSlotPrefix = 0x5e;

}  // namespace

namespace gloo_detail {

// How Abort ends the waits of a collective in flight: closing a pair
// (transport::Pair::close, what Gloo's interface offers) wakes none of the
// operations pending on it, and even Gloo's internal signalException would
// miss the receive whose payload the pair is reading at that moment. So
// every unbound buffer the communicator's collectives make, Gloo's
// algorithms' included (TrackingContext creates them), goes through a
// TrackedBuffer, and Abort, after closing the pairs, ends the waits of the
// buffers alive at that moment (UnboundBuffer::abortWaitRecv and
// abortWaitSend) and fails any later operation on them at once.
//
// Thread-safe: buffers come and go on the communicator thread, AbortAll runs
// on the aborting one; a buffer leaves the set before it is destroyed.
class LiveBuffers {
 public:
  void Add(gloo::transport::UnboundBuffer* buffer) {
    absl::MutexLock lock(&mu_);
    live_.push_back(buffer);
  }
  void Remove(gloo::transport::UnboundBuffer* buffer) {
    absl::MutexLock lock(&mu_);
    live_.erase(std::find(live_.begin(), live_.end(), buffer));
  }
  // After it, aborted() is true and every wait of a live buffer returns.
  void AbortAll() {
    aborted_.store(true);
    absl::MutexLock lock(&mu_);
    for (gloo::transport::UnboundBuffer* buffer : live_) {
      buffer->abortWaitRecv();
      buffer->abortWaitSend();
    }
  }
  bool aborted() const { return aborted_.load(); }

 private:
  std::atomic<bool> aborted_{false};
  absl::Mutex mu_;
  // A handful at a time: the buffers of the one collective in flight.
  std::vector<gloo::transport::UnboundBuffer*> live_ ABSL_GUARDED_BY(mu_);
};

// One of the transport's unbound buffers, seen by LiveBuffers while it
// lives. Every call goes to the transport's buffer (which is what the pairs
// see); once aborted, a wait returns false (aborted, in Gloo's terms) and a
// send or receive throws, so the Gloo algorithm around it unwinds.
class TrackedBuffer final : public gloo::transport::UnboundBuffer {
 public:
  TrackedBuffer(std::unique_ptr<gloo::transport::UnboundBuffer> inner, std::shared_ptr<LiveBuffers> live)
      : gloo::transport::UnboundBuffer(inner->ptr, inner->size), inner_(std::move(inner)), live_(std::move(live)) {
    live_->Add(inner_.get());
  }
  ~TrackedBuffer() override { live_->Remove(inner_.get()); }

  bool waitRecv(int* rank, std::chrono::milliseconds timeout) override {
    return !live_->aborted() && inner_->waitRecv(rank, timeout);
  }
  bool waitSend(int* rank, std::chrono::milliseconds timeout) override {
    return !live_->aborted() && inner_->waitSend(rank, timeout);
  }
  void abortWaitRecv() override { inner_->abortWaitRecv(); }
  void abortWaitSend() override { inner_->abortWaitSend(); }
  void send(int dst, uint64_t slot, size_t offset, size_t nbytes) override {
    ThrowIfAborted();
    inner_->send(dst, slot, offset, nbytes);
  }
  void recv(int src, uint64_t slot, size_t offset, size_t nbytes) override {
    ThrowIfAborted();
    inner_->recv(src, slot, offset, nbytes);
  }
  void recv(std::vector<int> srcs, uint64_t slot, size_t offset, size_t nbytes) override {
    ThrowIfAborted();
    inner_->recv(std::move(srcs), slot, offset, nbytes);
  }

 private:
  void ThrowIfAborted() const {
    if (live_->aborted()) throw gloo::IoException("the communicator was aborted");
  }
  const std::unique_ptr<gloo::transport::UnboundBuffer> inner_;
  const std::shared_ptr<LiveBuffers> live_;
};

// The TCP transport context with its unbound buffers tracked: pairs are the
// transport's own.
class TrackingTransportContext final : public gloo::transport::Context {
 public:
  TrackingTransportContext(std::shared_ptr<gloo::transport::Context> inner, std::shared_ptr<LiveBuffers> live)
      : gloo::transport::Context(inner->rank, inner->size), inner_(std::move(inner)), live_(std::move(live)) {
    setTimeout(inner_->getTimeout());
  }
  std::unique_ptr<gloo::transport::Pair>& getPair(int rank) override { return inner_->getPair(rank); }
  std::unique_ptr<gloo::transport::Pair>& createPair(int rank) override { return inner_->createPair(rank); }
  std::unique_ptr<gloo::transport::UnboundBuffer> createUnboundBuffer(void* ptr, size_t size) override {
    return std::make_unique<TrackedBuffer>(inner_->createUnboundBuffer(ptr, size), live_);
  }

 private:
  const std::shared_ptr<gloo::transport::Context> inner_;
  const std::shared_ptr<LiveBuffers> live_;
};

// A rendezvous context whose transport context, once connected, tracks its
// unbound buffers (gloo::Context keeps the transport context protected).
class TrackingContext final : public gloo::rendezvous::Context {
 public:
  using gloo::rendezvous::Context::Context;
  // Call once, after connectFullMesh and before any collective.
  void TrackBuffers(std::shared_ptr<LiveBuffers> live) {
    transportContext_ = std::make_shared<TrackingTransportContext>(transportContext_, std::move(live));
  }
};

// The communicator a Work aborts when its Wait runs out, while it lives:
// its destructor clears `comm` before anything of it goes (and a Work's
// abort, under `mu`, holds the destructor back until it returned).
struct AbortHandle {
  absl::Mutex mu;
  Communicator* comm ABSL_GUARDED_BY(mu) = nullptr;
};

}  // namespace gloo_detail

class GlooCommunicator::GlooWork final : public Work {
 public:
  // A Wait that runs out aborts the communicator (Gloo times each of an op's
  // waits, not the op: a large op still making progress, or one a peer never
  // entered, runs on past it, writing into the caller's buffers), and then
  // waits for the op to end, which the abort makes prompt: so that, as the
  // interface says, the caller may free the op's buffers once Wait returned.
  absl::Status Wait(absl::Duration timeout) override {
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&done_), timeout)) return status_;
    }
    const absl::Status late = absl::DeadlineExceededError(
        absl::StrCat("gloo ", op_, ": not complete after ", absl::FormatDuration(timeout),
                     " (a peer never entered it, or is far behind); the communicator was aborted"));
    if (handle_ != nullptr) {
      absl::MutexLock lock(&handle_->mu);
      if (IsCompleted()) return Wait(absl::ZeroDuration());  // it ended meanwhile: its own outcome
      if (handle_->comm != nullptr) handle_->comm->Abort(late);
    }
    absl::MutexLock lock(&mu_);
    if (!mu_.AwaitWithTimeout(absl::Condition(&done_), kAbortedOpEnd)) {
      COLOD_LOG(ERROR) << "gloo " << op_ << " had not ended " << absl::FormatDuration(kAbortedOpEnd)
                       << " after its communicator was aborted; its buffers may still be written";
    }
    return late;
  }
  bool IsCompleted() override {
    absl::MutexLock lock(&mu_);
    return done_;
  }
  void Complete(absl::Status status) {
    absl::MutexLock lock(&mu_);
    status_ = std::move(status);
    done_ = true;
  }
  // Both set before the work is shared.
  void set_op(std::string op) { op_ = std::move(op); }
  void set_abort_handle(std::shared_ptr<gloo_detail::AbortHandle> handle) { handle_ = std::move(handle); }

 private:
  // How long a Wait that aborted the communicator waits for the op to end:
  // the abort ends each of its waits at once; a bound all the same.
  static constexpr absl::Duration kAbortedOpEnd = absl::Seconds(60);
  absl::Mutex mu_;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::string op_;
  std::shared_ptr<gloo_detail::AbortHandle> handle_;  // null: a work that failed before it ran
};

GlooCommunicator::GlooCommunicator(int rank, int size, Options options)
    : rank_(rank),
      size_(size),
      options_(std::move(options)),
      abort_handle_(std::make_shared<gloo_detail::AbortHandle>()) {
  absl::MutexLock lock(&abort_handle_->mu);
  abort_handle_->comm = this;
}

namespace {

// Gloo writes to its TCP pairs with writev, which has no MSG_NOSIGNAL: a
// write to a pair whose peer closed (a peer that failed, or aborted) would
// raise SIGPIPE and end this whole process, a healthy worker included,
// instead of failing the collective with EPIPE. Ignored once, process-wide,
// unless the program installed a handler of its own.
void IgnoreSigpipe() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction current {};
    if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
      ::signal(SIGPIPE, SIG_IGN);
    }
  });
}

}  // namespace

namespace {
constexpr uint32_t kConnectedBarrierTag = 0xfffffff0u;
}  // namespace

absl::StatusOr<std::unique_ptr<GlooCommunicator>> GlooCommunicator::Create(Store& store, int rank,
                                                                          int size, Options options) {
  IgnoreSigpipe();
  if (size < 1) return absl::InvalidArgumentError(absl::StrCat("gloo: size ", size, " must be >= 1"));
  if (rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("gloo: rank ", rank, " is outside [0, ", size, ")"));
  }
  if (options.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("gloo: timeout must be > 0");
  std::unique_ptr<GlooCommunicator> c(new GlooCommunicator(rank, size, options));
  const std::string what = absl::StrCat("rendezvous of rank ", rank, "/", size);
  std::shared_ptr<gloo_detail::TrackingContext> context;
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = options.hostname;
    c->device_ = gloo::transport::tcp::CreateDevice(attr);
    context = std::make_shared<gloo_detail::TrackingContext>(rank, size);
    context->setTimeout(ToMillis(options.timeout));
  } catch (const std::exception& e) {
    return gloo_detail::StatusFromGlooException(e, what);
  }
  // Gloo's connectFullMesh waits for every peer's TCP connection up to the
  // timeout and offers no way to end it sooner, so it runs on a thread of its
  // own while this one watches the abort signal. An aborted rendezvous is
  // abandoned to that thread, which holds what it uses (the context, the
  // device) and no longer calls the store.
  auto r = std::make_shared<Rendezvous>();
  auto adapter = std::make_shared<StoreAdapter>(store, options.prefix, options.timeout, r);
  std::thread connect([r, adapter, context, device = c->device_, what]() mutable {
    absl::Status status;
    try {
      context->connectFullMesh(*adapter, device);
      // connectFullMesh returns once this rank's side of every pair is
      // connected, possibly before a peer's event loop has handled its side;
      // a rank that then failed and closed its sockets would make that loop
      // throw (getpeername on a reset socket), ending the process. Every
      // rank's side is connected once a barrier completes (on a tag of its
      // own: all its messages are read before the collectives start).
      gloo::BarrierOptions connected(context);
      connected.setTag(kConnectedBarrierTag);
      connected.setTimeout(context->getTimeout());
      gloo::barrier(connected);
    } catch (const std::exception& e) {
      status = gloo_detail::StatusFromGlooException(e, what);
    }
    absl::MutexLock lock(&r->mu);
    r->done = true;
    r->status = std::move(status);
  });
  // A rendezvous that fails after the abort signal fired reports the abort:
  // its own error (a cancelled store wait, a closed peer) is the abort's
  // consequence, whichever of the two threads saw the end first.
  auto aborted = [&] {
    return absl::AbortedError(absl::StrCat("gloo ", what, ": aborted: ", options.abort_signal->Check().message()));
  };
  {
    absl::MutexLock lock(&r->mu);
    auto done = [&r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) { return r->done; };
    while (!r->mu.AwaitWithTimeout(absl::Condition(&done), absl::Milliseconds(20))) {
      if (options.abort_signal == nullptr || !options.abort_signal->fired()) continue;
      r->abandoned = true;
      // A store call in progress returns soon (an aborted generation's waits
      // are cancelled by the coordinator; each has its own deadline anyway).
      auto idle = [&r]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(r->mu) { return r->store_calls == 0 || r->done; };
      r->mu.Await(absl::Condition(&idle));
      if (!r->done) {
        connect.detach();
        return aborted();
      }
      break;
    }
  }
  connect.join();
  {
    absl::MutexLock lock(&r->mu);
    if (!r->status.ok()) {
      if (options.abort_signal != nullptr && options.abort_signal->fired()) return aborted();
      return r->status;
    }
  }
  c->live_buffers_ = std::make_shared<gloo_detail::LiveBuffers>();
  context->TrackBuffers(c->live_buffers_);
  c->context_ = std::move(context);
  c->thread_ = std::thread([raw = c.get()] { raw->Loop(); });
  return c;
}

GlooCommunicator::~GlooCommunicator() {
  {
    absl::MutexLock lock(&abort_handle_->mu);  // (a Work's abort in progress returns first)
    abort_handle_->comm = nullptr;
  }
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<Work> GlooCommunicator::Failed(absl::Status status) {
  auto w = std::make_shared<GlooWork>();
  w->Complete(std::move(status));
  return w;
}

std::shared_ptr<Work> GlooCommunicator::Submit(const char* op, std::function<void(uint32_t)> fn) {
  auto w = std::make_shared<GlooWork>();
  w->set_op(op);
  w->set_abort_handle(abort_handle_);
  absl::MutexLock lock(&mu_);
  if (stopping_) {
    w->Complete(absl::FailedPreconditionError("gloo: communicator is shutting down"));
    return w;
  }
  queue_.push_back(Task{op, std::move(fn), w});
  return w;
}

void GlooCommunicator::Loop() {
  absl::MutexLock lock(&mu_);
  for (;;) {
    auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || !queue_.empty(); };
    mu_.Await(absl::Condition(&ready));
    if (queue_.empty()) return;  // stopping, and drained
    Task task = std::move(queue_.front());
    queue_.pop_front();
    const absl::Status sticky = error_;
    const uint32_t tag = next_tag_++;
    mu_.Unlock();
    absl::Status status;
    if (!sticky.ok()) {
      status = absl::Status(sticky.code() == absl::StatusCode::kAborted ? sticky.code()
                                                                         : absl::StatusCode::kAborted,
                            absl::StrCat("gloo ", task.op, ": not run after an earlier error: ",
                                         sticky.message()));
    } else {
      try {
        task.fn(tag);
      } catch (const std::exception& e) {
        status = gloo_detail::StatusFromGlooException(e, task.op);
      }
    }
    mu_.Lock();
    // A collective that Abort ended reports the abort, not the pair closure;
    // one that returned after an abort ended its waits holds no result.
    if (sticky.ok() && absl::IsAborted(error_)) {
      status = absl::AbortedError(absl::StrCat("gloo ", task.op, ": ", error_.message()));
    }
    // Record the sticky error before the waiter can observe the failure.
    if (!status.ok() && error_.ok()) error_ = status;
    mu_.Unlock();
    task.work->Complete(status);
    mu_.Lock();
  }
}

void GlooCommunicator::Abort(const absl::Status& reason) {
  std::string message;
  {
    absl::MutexLock lock(&mu_);
    if (error_.ok()) error_ = absl::AbortedError(absl::StrCat("gloo: aborted: ", reason.message()));
    message = std::string(error_.message());
  }
  // Outside mu_. Every pair is closed through the interface Gloo declares
  // for it (transport::Pair::close; the TCP pair resets its socket, SO_LINGER
  // 0, under the pair's lock, so its device thread writes into no buffer
  // after it): the peers' collectives with this rank fail as their side of
  // the pair reads the reset, and any later operation on the pair throws
  // ("Socket closed"). Closing wakes no local wait, so then every wait of the
  // buffers alive (LiveBuffers: all of them, the context makes them) ends,
  // and the collective in flight fails at once instead of at
  // options_.timeout.
  for (int peer = 0; peer < size_; ++peer) {
    if (peer == rank_) continue;
    if (const std::unique_ptr<gloo::transport::Pair>& pair = context_->getPair(peer); pair != nullptr) pair->close();
  }
  live_buffers_->AbortAll();
}

absl::Status GlooCommunicator::AsyncError() {
  absl::MutexLock lock(&mu_);
  return error_;
}

std::shared_ptr<Work> GlooCommunicator::AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) {
  if (absl::Status s = CheckCollectiveCount("gloo AllReduce", count, dtype, 1); !s.ok()) return Failed(s);
  return Submit("AllReduce", [=](uint32_t tag) {
    if (count == 0) return;
    const size_t bytes = static_cast<size_t>(count) * SizeOf(dtype);
    if (size_ == 2 && bytes <= options_.two_rank_exchange_max_bytes) {
      // One exchange (collective_algorithms.h) where halving-doubling makes two.
      const gloo_algorithms::Call call{context_, gloo::Slot::build(kExchangeSlotPrefix, tag),
                                       ToMillis(options_.timeout), static_cast<size_t>(count), SizeOf(dtype),
                                       ReduceFunction(dtype, op)};
      gloo_algorithms::TwoRankAllReduce(call, data, Scratch(bytes));
    } else {
      gloo::AllreduceOptions opts(context_);
      WithStorageType(dtype, [&](auto* type) {
        using T = std::remove_pointer_t<decltype(type)>;
        opts.setOutput(static_cast<T*>(data), static_cast<size_t>(count));
      });
      opts.setReduceFunction(ReduceFunction(dtype, op));
      opts.setTag(tag);
      opts.setTimeout(ToMillis(options_.timeout));
      opts.setMaxSegmentSize(options_.max_segment_bytes);
      if (bytes <= options_.halving_doubling_max_bytes) {
        opts.setAlgorithm(gloo::AllreduceOptions::Algorithm::BCUBE);
      }
      gloo::allreduce(opts);
    }
    if (op == ReduceOp::kAvg) DivideInPlace(data, count, dtype, size_);
  });
}

std::shared_ptr<Work> GlooCommunicator::AllGather(const void* in, void* out, int64_t count, DType dtype) {
  if (absl::Status s = CheckCollectiveCount("gloo AllGather", count, dtype, size_); !s.ok()) return Failed(s);
  return Submit("AllGather", [=](uint32_t tag) {
    if (count == 0) return;
    gloo::AllgatherOptions opts(context_);
    WithStorageType(dtype, [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      opts.setInput(const_cast<T*>(static_cast<const T*>(in)), static_cast<size_t>(count));
      opts.setOutput(static_cast<T*>(out), static_cast<size_t>(count) * size_);
    });
    opts.setTag(tag);
    opts.setTimeout(ToMillis(options_.timeout));
    gloo::allgather(opts);
  });
}

char* GlooCommunicator::Scratch(size_t bytes) {
  if (scratch_bytes_ < bytes) {
    scratch_.reset(new char[bytes]);  // not zeroed: every byte is written before it is read
    scratch_bytes_ = bytes;
  }
  return scratch_.get();
}

std::shared_ptr<Work> GlooCommunicator::ReduceScatter(const void* in, void* out, int64_t count,
                                                      DType dtype, ReduceOp op) {
  if (absl::Status s = CheckCollectiveCount("gloo ReduceScatter", count, dtype, size_); !s.ok()) return Failed(s);
  // A ring over Gloo's pairs (collective_algorithms.h).
  return Submit("ReduceScatter", [=](uint32_t tag) {
    if (count == 0) return;
    const size_t chunk = static_cast<size_t>(count) * SizeOf(dtype);
    const gloo_algorithms::Call call{context_, gloo::Slot::build(kReduceScatterSlotPrefix, tag),
                                     ToMillis(options_.timeout), static_cast<size_t>(count), SizeOf(dtype),
                                     ReduceFunction(dtype, op)};
    gloo_algorithms::RingReduceScatter(call, in, out, Scratch(2 * chunk));
    if (scratch_bytes_ > options_.kept_scratch_bytes) {  // (Options::kept_scratch_bytes)
      scratch_.reset();
      scratch_bytes_ = 0;
    }
    if (op == ReduceOp::kAvg) DivideInPlace(out, count, dtype, size_);
  });
}

std::shared_ptr<Work> GlooCommunicator::Broadcast(void* data, int64_t count, DType dtype, int root) {
  if (absl::Status s = CheckCollectiveCount("gloo Broadcast", count, dtype, 1); !s.ok()) return Failed(s);
  if (root < 0 || root >= size_) {
    return Failed(absl::InvalidArgumentError(
        absl::StrCat("gloo Broadcast: root ", root, " is outside [0, ", size_, ")")));
  }
  return Submit("Broadcast", [=](uint32_t tag) {
    if (count == 0) return;
    gloo::BroadcastOptions opts(context_);
    WithStorageType(dtype, [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      opts.setOutput(static_cast<T*>(data), static_cast<size_t>(count));
    });
    opts.setRoot(root);
    opts.setTag(tag);
    opts.setTimeout(ToMillis(options_.timeout));
    gloo::broadcast(opts);
  });
}

std::shared_ptr<Work> GlooCommunicator::AllToAll(const void* in, void* out, int64_t count, DType dtype) {
  if (absl::Status s = CheckCollectiveCount("gloo AllToAll", count, dtype, size_); !s.ok()) return Failed(s);
  return Submit("AllToAll", [=](uint32_t tag) {
    if (count == 0) return;
    gloo::AlltoallOptions opts(context_);
    WithStorageType(dtype, [&](auto* type) {
      using T = std::remove_pointer_t<decltype(type)>;
      opts.setInput(const_cast<T*>(static_cast<const T*>(in)), static_cast<size_t>(count) * size_);
      opts.setOutput(static_cast<T*>(out), static_cast<size_t>(count) * size_);
    });
    opts.setTag(tag);
    opts.setTimeout(ToMillis(options_.timeout));
    gloo::alltoall(opts);
  });
}

std::shared_ptr<Work> GlooCommunicator::Send(const void* data, int64_t count, DType dtype, int dst,
                                             uint32_t tag) {
  if (absl::Status s = CheckCollectiveCount("gloo Send", count, dtype, 1); !s.ok()) return Failed(s);
  if (dst < 0 || dst >= size_ || dst == rank_) {
    return Failed(absl::InvalidArgumentError(
        absl::StrCat("gloo Send: need a peer in [0, ", size_, ") other than ", rank_, ", got ", dst)));
  }
  return Submit("Send", [=](uint32_t) {
    auto buf = context_->createUnboundBuffer(const_cast<void*>(data), count * SizeOf(dtype));
    buf->send(dst, gloo::Slot::build(kP2PSlotPrefix, tag));
    buf->waitSend(ToMillis(options_.timeout));
  });
}

std::shared_ptr<Work> GlooCommunicator::Recv(void* data, int64_t count, DType dtype, int src,
                                             uint32_t tag) {
  if (absl::Status s = CheckCollectiveCount("gloo Recv", count, dtype, 1); !s.ok()) return Failed(s);
  if (src < 0 || src >= size_ || src == rank_) {
    return Failed(absl::InvalidArgumentError(
        absl::StrCat("gloo Recv: need a peer in [0, ", size_, ") other than ", rank_, ", got ", src)));
  }
  return Submit("Recv", [=](uint32_t) {
    auto buf = context_->createUnboundBuffer(data, count * SizeOf(dtype));
    buf->recv(src, gloo::Slot::build(kP2PSlotPrefix, tag));
    buf->waitRecv(ToMillis(options_.timeout));
  });
}

std::shared_ptr<Work> GlooCommunicator::Barrier() {
  return Submit("Barrier", [=](uint32_t tag) {
    gloo::BarrierOptions opts(context_);
    opts.setTag(tag);
    opts.setTimeout(ToMillis(options_.timeout));
    gloo::barrier(opts);
  });
}

namespace gloo_detail {

absl::Status StatusFromGlooException(const std::exception& e, absl::string_view op) {
  const std::string msg = e.what();
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("gloo ", op, ": out of memory (", msg, ")"));
  }
  if (dynamic_cast<const ::gloo::EnforceNotMet*>(&e) != nullptr) {
    return absl::InternalError(absl::StrCat("gloo ", op, ": a check of Gloo's failed: ", msg));
  }
  // (A pair's listening side that no peer reached says "Connect timeout".)
  const bool timeout = absl::StrContains(msg, "Timed out") || absl::StrContains(msg, "timed out") ||
                       absl::StrContains(msg, "Connect timeout") || absl::StrContains(msg, "DEADLINE_EXCEEDED");
  return absl::Status(timeout ? absl::StatusCode::kDeadlineExceeded : absl::StatusCode::kUnavailable,
                      absl::StrCat("gloo ", op, ": ", msg));
}

}  // namespace gloo_detail

}  // namespace colod
