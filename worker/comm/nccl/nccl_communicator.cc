#include "worker/comm/nccl/nccl_communicator.h"

#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "kernels/cuda/stream.h"

namespace colod {
namespace {

ncclDataType_t ToNccl(DType t) {
  switch (t) {
    case DType::kF32: return ncclFloat32;
    case DType::kBF16: return ncclBfloat16;
    case DType::kF16: return ncclFloat16;
    case DType::kI32: return ncclInt32;
    case DType::kI64: return ncclInt64;
  }
  return ncclFloat32;
}

ncclRedOp_t ToNccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return ncclSum;
    case ReduceOp::kAvg: return ncclAvg;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kMin: return ncclMin;
  }
  return ncclSum;
}

ncclConfig_t NonBlockingConfig() {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  return config;
}


}  // namespace

absl::Status NcclStatus(ncclResult_t r, const char* call, const char* file, int line) {
  const absl::StatusCode code = r == ncclInvalidArgument || r == ncclInvalidUsage
                                    ? absl::StatusCode::kInvalidArgument
                                    : (r == ncclRemoteError || r == ncclSystemError ? absl::StatusCode::kUnavailable
                                                                                   : absl::StatusCode::kInternal);
  return absl::Status(code, absl::StrCat("nccl: ", call, ": ", ncclGetErrorString(r), " (", file, ":", line, ")"));
}

// The process's watchdog: a thread that visits every live communicator
// every 100 ms (CheckHealth). Communicators register in their constructor's
// caller and unregister in their destructor. The watchdog holds its lock
// only to pick the next communicator: a visit may abort one, and an abort
// may take seconds, which no other communicator's creation or destruction
// waits for. Remove waits only while its own communicator is visited, so
// the watchdog never visits a destroyed one.
namespace {

class Watchdog {
 public:
  static Watchdog& Get() {
    static Watchdog* w = new Watchdog();  // never destroyed: its thread runs until exit
    return *w;
  }
  void Add(NcclCommunicator* c) {
    absl::MutexLock lock(&mu_);
    comms_.insert(c);
    if (!started_) {
      started_ = true;
      std::thread([this] { Run(); }).detach();
    }
  }
  void Remove(NcclCommunicator* c) {
    absl::MutexLock lock(&mu_);
    comms_.erase(c);
    auto not_visited = [this, c]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return visiting_ != c; };
    mu_.Await(absl::Condition(&not_visited));
  }

 private:
  void Run() {
    std::vector<NcclCommunicator*> round;
    for (;;) {
      absl::SleepFor(absl::Milliseconds(100));
      {
        absl::MutexLock lock(&mu_);
        round.assign(comms_.begin(), comms_.end());
      }
      for (NcclCommunicator* c : round) {
        {
          absl::MutexLock lock(&mu_);
          if (comms_.count(c) == 0) continue;  // destroyed since the round began
          visiting_ = c;
        }
        c->CheckHealth(absl::Now());  // may abort `c`, which may take long
        absl::MutexLock lock(&mu_);
        visiting_ = nullptr;
      }
    }
  }
  absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::set<NcclCommunicator*> comms_ ABSL_GUARDED_BY(mu_);
  NcclCommunicator* visiting_ ABSL_GUARDED_BY(mu_) = nullptr;  // whose CheckHealth runs
};

}  // namespace

// Completion events for reuse: creating one per collective cost a driver call
// each. Thread-safe; destroys its events when the last Completion is gone.
class NcclCommunicator::EventPool {
 public:
  ~EventPool() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  absl::StatusOr<cudaEvent_t> Take() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    COLOD_RETURN_IF_CUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }
  // A reused event is recorded anew; waits enqueued before then still wait
  // for the record they saw (CUDA's semantics).
  void Put(cudaEvent_t e) {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(e);
  }

 private:
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

struct NcclCommunicator::Completion {
  Completion(cudaEvent_t e, std::shared_ptr<EventPool> p) : event(e), pool(std::move(p)) {}
  ~Completion() { pool->Put(event); }
  const cudaEvent_t event;
  const std::shared_ptr<EventPool> pool;
};

class NcclCommunicator::NcclWork final : public Work {
 public:
  NcclWork(NcclCommunicator* owner, std::string what, std::shared_ptr<Completion> done, absl::Status failed)
      : owner_(owner), what_(std::move(what)), done_(std::move(done)), failed_(std::move(failed)) {}
  ~NcclWork() override {
    // The buffers may go once this returns: unless the compute stream waits
    // for the collective, finish it (or abort) first.
    if (done_ != nullptr && !waited_on_device_ && !Done()) (void)Wait(owner_->options_.timeout);
  }
  absl::Status Wait(absl::Duration timeout) override {
    if (!failed_.ok()) return failed_;
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      const cudaError_t q = cudaEventQuery(done_->event);
      // After an abort the stream moves on without the collective having
      // run: a reached event means success only on a live communicator.
      if (q == cudaSuccess) return owner_->aborted_ ? owner_->AsyncError() : absl::OkStatus();
      if (q != cudaErrorNotReady) return kernels::cuda::CudaStatus(q, "cudaEventQuery");
      absl::Status async = owner_->AsyncError();
      if (!async.ok()) {
        // Aborted (by the watchdog, a peer's failure or the caller): the
        // collective can no longer touch its buffers once its stream drains.
        owner_->AbortWith(async);
        return async;
      }
      if (absl::Now() >= deadline) {
        const absl::Status late = absl::DeadlineExceededError(absl::StrCat(
            "nccl ", what_, " did not complete within ", absl::FormatDuration(timeout),
            " (a peer never entered it, or is far behind); the communicator was aborted"));
        owner_->AbortWith(late);
        return owner_->AsyncError();  // the sticky error: this one, or an earlier one
      }
      absl::SleepFor(absl::Microseconds(50));
    }
  }
  absl::Status WaitOnDevice(absl::Duration) override {
    if (!failed_.ok()) return failed_;
    if (owner_->aborted_) return owner_->AsyncError();
    absl::StatusOr<cudaStream_t> compute = kernels::cuda::ComputeStream(owner_->options_.device);
    if (!compute.ok()) return compute.status();
    // The watchdog bounds the wait: at the deadline it aborts the
    // communicator, whose stream then drains past the collective.
    COLOD_RETURN_IF_CUDA(cudaStreamWaitEvent(*compute, done_->event, 0));
    waited_on_device_ = true;
    return absl::OkStatus();
  }
  bool IsCompleted() override { return !failed_.ok() || Done(); }

 private:
  bool Done() { return cudaEventQuery(done_->event) == cudaSuccess; }
  NcclCommunicator* owner_;  // a Work must not outlive its communicator
  const std::string what_;
  const std::shared_ptr<Completion> done_;
  const absl::Status failed_;
  std::atomic<bool> waited_on_device_{false};
};

std::string NcclCommunicator::Describe(const std::string& op, uint64_t seq) const {
  return Describe(absl::StrCat(op, " #", seq));
}

std::string NcclCommunicator::Describe(const std::string& what) const {
  return absl::StrCat(what, " on group ", options_.group, " (rank ", rank_, "/", size_, ", device ", options_.device,
                      ")");
}

absl::Status NcclCommunicator::WaitReady(absl::Time deadline, const std::string& what, bool joining) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    {
      absl::ReaderMutexLock lock(&mu_);
      if (comm_ == nullptr) return error_;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) state = r;
    }
    if (state == ncclSuccess) return absl::OkStatus();
    if (options_.abort_signal != nullptr && options_.abort_signal->fired()) {
      AbortWith(options_.abort_signal->Check());
      return AsyncError();
    }
    if (state != ncclInProgress) {
      const absl::Status error = NcclStatus(state, what.c_str(), __FILE__, __LINE__);
      AbortWith(error);
      return AsyncError();
    }
    if (absl::Now() >= deadline) {
      AbortWith(absl::DeadlineExceededError(absl::StrCat(
          "nccl ", what, ": still in progress after ", absl::FormatDuration(options_.timeout), " (",
          joining ? "a peer never joined?"
                  : "NCCL connects a communicator's ranks at its first collective, and a pair at its first send "
                    "and receive: a peer that never reached its end?",
          "); the communicator was aborted")));
      return AsyncError();
    }
    absl::SleepFor(absl::Microseconds(100));
  }
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(Store& store, int rank, int size,
                                                                          Options options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("nccl: rank ", rank, " / size ", size, " is not a valid rank"));
  }
  COLOD_RETURN_IF_CUDA(cudaSetDevice(options.device));
  const std::string key = absl::StrCat(options.prefix, "/unique_id");
  ncclUniqueId id;
  if (rank == 0) {
    NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
    RETURN_IF_ERROR(store.Set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id))));
  } else {
    // In slices, so an abort ends the wait for rank 0's id too.
    const absl::Time deadline = absl::Now() + options.timeout;
    absl::StatusOr<std::vector<std::string>> got;
    for (;;) {
      if (options.abort_signal != nullptr) RETURN_IF_ERROR(options.abort_signal->Check());
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {  // a slice's RPC overran the deadline: no wait of 0 or less is asked
        got = absl::DeadlineExceededError(absl::StrCat("nccl: rank 0's unique id did not arrive within ",
                                                       absl::FormatDuration(options.timeout)));
        break;
      }
      got = store.Wait({key}, std::min(left, absl::Milliseconds(500)));
      if (got.ok() || got.status().code() != absl::StatusCode::kDeadlineExceeded || left <= absl::Milliseconds(500)) {
        break;
      }
    }
    ASSIGN_OR_RETURN(std::vector<std::string> v, std::move(got));
    if (v[0].size() != sizeof(id)) return absl::DataLossError("nccl: the published unique id has the wrong size");
    std::memcpy(&id, v[0].data(), sizeof(id));
  }
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(rank, size, options));
  ncclConfig_t config = NonBlockingConfig();
  ncclComm_t comm = nullptr;
  if (const ncclResult_t r = ncclCommInitRankConfig(&comm, size, id, rank, &config);
      r != ncclSuccess && r != ncclInProgress) {
    if (comm != nullptr) ncclCommAbort(comm);  // a half-made handle: nobody else would release it
    return NcclStatus(r, "ncclCommInitRankConfig", __FILE__, __LINE__);
  }
  RETURN_IF_ERROR(c->Adopt(comm, "init"));
  return c;
}

absl::Status NcclCommunicator::Adopt(ncclComm_t comm, const std::string& what) {
  {
    absl::MutexLock lock(&mu_);
    comm_ = comm;
  }
  Watchdog::Get().Add(this);
  // On failure WaitReady has aborted the half-made communicator.
  RETURN_IF_ERROR(WaitReady(absl::Now() + options_.timeout, Describe(what), /*joining=*/true));
  COLOD_RETURN_IF_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  COLOD_RETURN_IF_CUDA(cudaMalloc(&scratch_, sizeof(int32_t)));
  events_ = std::make_shared<EventPool>();
  {
    absl::MutexLock order(&enqueue_mu_);
    COLOD_RETURN_IF_CUDA(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Split(int color, int key,
                                                                         const std::string& group) {
  COLOD_RETURN_IF_CUDA(cudaSetDevice(options_.device));
  ncclConfig_t config = NonBlockingConfig();
  absl::MutexLock order(&enqueue_mu_);
  // A non-blocking split may write the child after this call returns (or
  // after a timeout here): into a slot that lives as long as this communicator.
  auto slot = std::make_shared<ncclComm_t>(nullptr);
  split_slots_.push_back(slot);
  ncclResult_t split = ncclSuccess;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (comm_ == nullptr) return error_;
    split = ncclCommSplit(comm_, color, key, slot.get(), &config);
  }
  if (split != ncclSuccess && split != ncclInProgress) {
    // As a split that fails later (below): the parent aborted (the header's
    // contract: this rank's next collective would wait for peers gone on
    // into the split), and a half-made child too.
    const absl::Status failed = NcclStatus(split, "ncclCommSplit", __FILE__, __LINE__);
    AbortWith(failed);
    if (*slot != nullptr) ncclCommAbort(*slot);
    *slot = nullptr;
    return failed;
  }
  const std::string what = absl::StrCat("split into group ", group.empty() ? "?" : group);
  absl::Status ready = WaitReady(absl::Now() + options_.timeout, Describe(what), /*joining=*/true);
  if (!ready.ok()) {
    // The parent is aborted, which ends the split; a child NCCL already made is aborted too.
    if (*slot != nullptr) ncclCommAbort(*slot);
    *slot = nullptr;
    return ready;
  }
  ncclComm_t sub = *slot;
  if (sub == nullptr) return absl::InvalidArgumentError("nccl: split with NCCL_SPLIT_NOCOLOR gives no communicator");
  int sub_rank = 0, sub_size = 0;
  ncclResult_t r = ncclCommUserRank(sub, &sub_rank);
  if (r == ncclSuccess) r = ncclCommCount(sub, &sub_size);
  if (r != ncclSuccess) {
    ncclCommAbort(sub);  // not handed to a communicator: nobody else would release it
    *slot = nullptr;
    return NcclStatus(r, "ncclCommUserRank/ncclCommCount", __FILE__, __LINE__);
  }
  Options o = options_;
  if (!group.empty()) o.group = group;
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(sub_rank, sub_size, o));
  *slot = nullptr;  // owned by `c` from here
  RETURN_IF_ERROR(c->Adopt(sub, "split child init"));
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  Watchdog::Get().Remove(this);
  cudaSetDevice(options_.device);
  ncclComm_t comm;
  {
    absl::MutexLock lock(&mu_);
    comm = comm_;
    comm_ = nullptr;
    if (error_.ok()) error_ = absl::FailedPreconditionError("nccl: the communicator was destroyed");
  }
  // After an abort the handle is gone. Otherwise outstanding work may
  // finish (finalize is non-blocking here) and the handle is destroyed, but
  // only if it finished cleanly: work that reports an asynchronous error (a
  // lost peer) or is still running at the deadline waits on the device for
  // peers that may never come, and only an abort ends it. (Destroying it
  // would leave the kernels, and here the stream, waiting for good; that is
  // how a rank that failed on its own, before its job's abort reached it,
  // once kept its worker busy forever.)
  if (comm != nullptr) {
    const ncclResult_t r = ncclCommFinalize(comm);
    bool finished = false;
    if (r == ncclSuccess || r == ncclInProgress) {
      const absl::Time deadline = absl::Now() + std::min(options_.timeout, absl::Seconds(30));
      for (;;) {
        ncclResult_t state = ncclInternalError;
        if (ncclCommGetAsyncError(comm, &state) != ncclSuccess) break;
        if (state != ncclInProgress) {
          finished = state == ncclSuccess;
          break;
        }
        // The deadline, or the job's abort (which no longer reaches a
        // communicator its process group is destroying).
        if (absl::Now() >= deadline || (options_.abort_signal != nullptr && options_.abort_signal->fired())) break;
        absl::SleepFor(absl::Milliseconds(1));
      }
    }
    if (finished) {
      ncclCommDestroy(comm);
    } else {
      ncclCommAbort(comm);
    }
  }
  {
    absl::MutexLock lock(&mu_);
    in_flight_.clear();  // their events go back to the pool, which the Works may still share
  }
  if (ready_ != nullptr) cudaEventDestroy(ready_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (scratch_ != nullptr) cudaFree(scratch_);
}

void NcclCommunicator::AbortWith(const absl::Status& error) {
  ncclComm_t comm;
  {
    // Waits only for a reader inside one non-blocking NCCL call.
    absl::MutexLock lock(&mu_);
    if (error_.ok()) error_ = error;
    comm = comm_;
    comm_ = nullptr;
    aborted_ = true;
  }
  // Nobody can reach the handle any more: abort it outside the lock.
  if (comm != nullptr) ncclCommAbort(comm);
}

void NcclCommunicator::Abort(const absl::Status& reason) {
  AbortWith(absl::AbortedError(absl::StrCat("nccl: aborted: ", reason.message())));
}

absl::Status NcclCommunicator::AsyncError() {
  absl::ReaderMutexLock lock(&mu_);
  if (comm_ == nullptr) return error_.ok() ? absl::AbortedError("nccl: the communicator was aborted") : error_;
  ncclResult_t state = ncclSuccess;
  const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
  if (r != ncclSuccess) return NcclStatus(r, "ncclCommGetAsyncError", __FILE__, __LINE__);
  if (state != ncclSuccess && state != ncclInProgress) return NcclStatus(state, "async", __FILE__, __LINE__);
  return absl::OkStatus();
}

bool NcclCommunicator::CheckHealth(absl::Time now) {
  if (options_.abort_signal != nullptr && options_.abort_signal->fired() && !aborted_) {
    AbortWith(options_.abort_signal->Check());
    return true;
  }
  // The collectives in flight, queried outside mu_ (a query is a driver
  // call, and Enqueue and Abort take mu_): each Completion keeps its event
  // alive however in_flight_ changes meanwhile.
  std::vector<InFlight> flying;
  {
    absl::MutexLock lock(&mu_);
    if (comm_ == nullptr) return false;
    flying = in_flight_;
  }
  // Drop what completed; the oldest unfinished collective past its deadline
  // is late.
  std::string late;
  absl::flat_hash_set<uint64_t> completed;
  for (const InFlight& f : flying) {
    const cudaError_t q = cudaEventQuery(f.done->event);
    if (q == cudaSuccess) {
      completed.insert(f.seq);
    } else if (late.empty() && now >= f.deadline && q == cudaErrorNotReady) {
      late = Describe(f.op, f.seq);
    }
  }
  if (!completed.empty()) {
    absl::MutexLock lock(&mu_);
    in_flight_.erase(std::remove_if(in_flight_.begin(), in_flight_.end(),
                                    [&](const InFlight& f) { return completed.contains(f.seq); }),
                     in_flight_.end());
  }
  if (!late.empty()) {
    AbortWith(absl::DeadlineExceededError(absl::StrCat("nccl ", late, " did not complete within ",
                                                       absl::FormatDuration(options_.timeout),
                                                       "; the watchdog aborted the communicator")));
    return true;
  }
  absl::Status async = AsyncError();
  if (!async.ok() && !aborted_) {
    AbortWith(async);
    return true;
  }
  return false;
}

std::shared_ptr<Work> NcclCommunicator::Enqueue(const char* op,
                                                const std::function<absl::Status(ncclComm_t)>& enqueue) {
  absl::MutexLock order(&enqueue_mu_);
  const uint64_t seq = ++next_seq_;
  const std::string what = Describe(op, seq);
  auto fail = [&](absl::Status s) { return std::make_shared<NcclWork>(this, what, nullptr, std::move(s)); };
  // Selects the device too.
  absl::StatusOr<cudaStream_t> compute = kernels::cuda::ComputeStream(options_.device);
  if (!compute.ok()) return fail(compute.status());
  if (ready_ == nullptr) return fail(absl::FailedPreconditionError("nccl: the communicator was never made"));
  // The collective reads what the compute stream wrote, in memory its pool
  // may have just handed out: it starts after everything enqueued there.
  cudaError_t e = cudaEventRecord(ready_, *compute);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(stream_, ready_, 0);
  if (e != cudaSuccess) return fail(kernels::cuda::CudaStatus(e, "cudaEventRecord/cudaStreamWaitEvent"));
  absl::StatusOr<cudaEvent_t> event = events_->Take();
  if (!event.ok()) return fail(event.status());
  auto done = std::make_shared<Completion>(*event, events_);
  absl::Status s;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (comm_ == nullptr) {
      s = error_;
    } else {
      s = enqueue(comm_);
    }
  }
  // The non-blocking enqueue finished: at once, or once the connection of a
  // first use was made (both ends).
  if (s.ok()) s = WaitReady(absl::Now() + options_.timeout, what, /*joining=*/false);
  if (s.ok()) {
    e = cudaEventRecord(done->event, stream_);
    if (e != cudaSuccess) s = kernels::cuda::CudaStatus(e, "cudaEventRecord");
  }
  if (!s.ok()) return fail(s);
  {
    absl::MutexLock lock(&mu_);
    in_flight_.push_back(InFlight{seq, op, absl::Now() + options_.timeout, done});
  }
  return std::make_shared<NcclWork>(this, what, std::move(done), absl::OkStatus());
}

std::shared_ptr<Work> NcclCommunicator::AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) {
  if (absl::Status s = CheckCollectiveCount("nccl AllReduce", count, dtype, 1); !s.ok()) {
    return std::make_shared<NcclWork>(this, "AllReduce", nullptr, s);
  }
  return Enqueue("AllReduce", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclAllReduce(data, data, count, ToNccl(dtype), ToNccl(op), comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::AllGather(const void* in, void* out, int64_t count, DType dtype) {
  if (absl::Status s = CheckCollectiveCount("nccl AllGather", count, dtype, size_); !s.ok()) {
    return std::make_shared<NcclWork>(this, "AllGather", nullptr, s);
  }
  return Enqueue("AllGather", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclAllGather(in, out, count, ToNccl(dtype), comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::ReduceScatter(const void* in, void* out, int64_t count, DType dtype,
                                                      ReduceOp op) {
  if (absl::Status s = CheckCollectiveCount("nccl ReduceScatter", count, dtype, size_); !s.ok()) {
    return std::make_shared<NcclWork>(this, "ReduceScatter", nullptr, s);
  }
  return Enqueue("ReduceScatter", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclReduceScatter(in, out, count, ToNccl(dtype), ToNccl(op), comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::Broadcast(void* data, int64_t count, DType dtype, int root) {
  if (absl::Status s = CheckCollectiveCount("nccl Broadcast", count, dtype, 1); !s.ok()) {
    return std::make_shared<NcclWork>(this, "Broadcast", nullptr, s);
  }
  if (root < 0 || root >= size_) {
    return std::make_shared<NcclWork>(this, "Broadcast", nullptr,
                                      absl::InvalidArgumentError(absl::StrCat("nccl Broadcast: root ", root,
                                                                              " is outside [0, ", size_, ")")));
  }
  return Enqueue("Broadcast", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclBroadcast(data, data, count, ToNccl(dtype), root, comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::AllToAll(const void* in, void* out, int64_t count, DType dtype) {
  if (absl::Status s = CheckCollectiveCount("nccl AllToAll", count, dtype, size_); !s.ok()) {
    return std::make_shared<NcclWork>(this, "AllToAll", nullptr, s);
  }
  return Enqueue("AllToAll", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclAlltoAll(in, out, count, ToNccl(dtype), comm, stream_));
    return absl::OkStatus();
  });
}

namespace {

// A point-to-point call's peer, checked before NCCL sees it: NCCL poisons a
// non-blocking communicator on an argument error (every later op fails),
// and a send to oneself outside a group waits until the watchdog fires.
absl::Status CheckPeer(const char* op, int peer, int rank, int size, bool self) {
  if (peer >= 0 && peer < size && (self || peer != rank)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("nccl ", op, ": need a peer in [0, ", size, ")",
                                                 self ? "" : absl::StrCat(" other than ", rank), ", got ", peer));
}

}  // namespace

std::shared_ptr<Work> NcclCommunicator::Send(const void* data, int64_t count, DType dtype, int dst, uint32_t) {
  if (absl::Status s = CheckCollectiveCount("nccl Send", count, dtype, 1); !s.ok()) {
    return std::make_shared<NcclWork>(this, "Send", nullptr, s);
  }
  if (absl::Status s = CheckPeer("Send", dst, rank_, size_, /*self=*/false); !s.ok()) {
    return std::make_shared<NcclWork>(this, "Send", nullptr, s);
  }
  return Enqueue("Send", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclSend(data, count, ToNccl(dtype), dst, comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::Recv(void* data, int64_t count, DType dtype, int src, uint32_t) {
  if (absl::Status s = CheckCollectiveCount("nccl Recv", count, dtype, 1); !s.ok()) {
    return std::make_shared<NcclWork>(this, "Recv", nullptr, s);
  }
  if (absl::Status s = CheckPeer("Recv", src, rank_, size_, /*self=*/false); !s.ok()) {
    return std::make_shared<NcclWork>(this, "Recv", nullptr, s);
  }
  return Enqueue("Recv", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclRecv(data, count, ToNccl(dtype), src, comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::SendRecv(const void* send, int dst, void* recv, int src, int64_t count,
                                                 DType dtype) {
  if (absl::Status s = CheckCollectiveCount("nccl SendRecv", count, dtype, 1); !s.ok()) {
    return std::make_shared<NcclWork>(this, "SendRecv", nullptr, s);
  }
  // (Grouped, a send to oneself meets its receive: both ends or neither.)
  for (const int peer : {dst, src}) {
    if (absl::Status s = CheckPeer("SendRecv", peer, rank_, size_, /*self=*/true); !s.ok()) {
      return std::make_shared<NcclWork>(this, "SendRecv", nullptr, s);
    }
  }
  if ((dst == rank_) != (src == rank_)) {
    return std::make_shared<NcclWork>(
        this, "SendRecv", nullptr,
        absl::InvalidArgumentError(absl::StrCat("nccl SendRecv: a send to rank ", dst, " and a receive from rank ", src,
                                                ": to oneself both or neither (the other would wait forever)")));
  }
  return Enqueue("SendRecv", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclGroupStart());
    const ncclResult_t a = ncclSend(send, count, ToNccl(dtype), dst, comm, stream_);
    const ncclResult_t b = ncclRecv(recv, count, ToNccl(dtype), src, comm, stream_);
    NCCL_RETURN_IF_ERROR(ncclGroupEnd());  // always closes the group
    NCCL_RETURN_IF_ERROR(a);
    NCCL_RETURN_IF_ERROR(b);
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::Barrier() {
  return Enqueue("Barrier", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm, stream_));
    return absl::OkStatus();
  });
}

}  // namespace colod
