#include "worker/comm/nccl/nccl_communicator.h"

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

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
// caller and unregister in their destructor, under `mu`, so the watchdog
// never visits a destroyed one.
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
  }

 private:
  void Run() {
    for (;;) {
      absl::SleepFor(absl::Milliseconds(100));
      absl::MutexLock lock(&mu_);  // CheckHealth holds no lock across a wait; Abort is prompt
      for (NcclCommunicator* c : comms_) c->CheckHealth(absl::Now());
    }
  }
  absl::Mutex mu_;
  bool started_ ABSL_GUARDED_BY(mu_) = false;
  std::set<NcclCommunicator*> comms_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

class NcclCommunicator::NcclWork final : public Work {
 public:
  NcclWork(NcclCommunicator* owner, std::string what, uint64_t seq, cudaEvent_t event, absl::Status failed)
      : owner_(owner), what_(std::move(what)), seq_(seq), event_(event), failed_(std::move(failed)) {}
  ~NcclWork() override {
    // The buffers may go once this returns: finish or abort first.
    if (event_ != nullptr && !Done()) (void)Wait(owner_->options_.timeout);
    if (event_ != nullptr) {
      owner_->Forget(seq_);
      cudaEventDestroy(event_);
    }
  }
  absl::Status Wait(absl::Duration timeout) override {
    if (!failed_.ok()) return failed_;
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      const cudaError_t q = cudaEventQuery(event_);
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
  bool IsCompleted() override { return !failed_.ok() || Done(); }

 private:
  bool Done() { return cudaEventQuery(event_) == cudaSuccess; }
  NcclCommunicator* owner_;  // a Work must not outlive its communicator
  const std::string what_;
  const uint64_t seq_;
  cudaEvent_t event_;
  const absl::Status failed_;
};

std::string NcclCommunicator::Describe(const std::string& op, uint64_t seq) const {
  return absl::StrCat(op, " #", seq, " on group ", options_.group, " (rank ", rank_, "/", size_, ", device ",
                      options_.device, ")");
}

absl::Status NcclCommunicator::WaitReady(absl::Time deadline, const std::string& what) {
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
      AbortWith(absl::DeadlineExceededError(absl::StrCat("nccl ", what, " (rank ", rank_, "/", size_, " of group ",
                                                         options_.group, "): still in progress after ",
                                                         absl::FormatDuration(options_.timeout),
                                                         " (a peer never joined?); the communicator was aborted")));
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
  NCCL_RETURN_IF_ERROR(ncclCommInitRankConfig(&comm, size, id, rank, &config));
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
  RETURN_IF_ERROR(WaitReady(absl::Now() + options_.timeout, what));
  COLOD_RETURN_IF_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  COLOD_RETURN_IF_CUDA(cudaMalloc(&scratch_, sizeof(int32_t)));
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
  {
    absl::ReaderMutexLock lock(&mu_);
    if (comm_ == nullptr) return error_;
    NCCL_RETURN_IF_ERROR(ncclCommSplit(comm_, color, key, slot.get(), &config));
  }
  const std::string what = absl::StrCat("split into group ", group.empty() ? "?" : group);
  absl::Status ready = WaitReady(absl::Now() + options_.timeout, what);
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
  // After an abort the handle is gone; otherwise finish outstanding work
  // (finalize is non-blocking here) and destroy it.
  if (comm != nullptr) {
    ncclResult_t r = ncclCommFinalize(comm);
    const absl::Time deadline = absl::Now() + absl::Seconds(30);
    while ((r == ncclSuccess || r == ncclInProgress) && absl::Now() < deadline) {
      ncclResult_t state = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &state) != ncclSuccess || state != ncclInProgress) break;
      absl::SleepFor(absl::Milliseconds(1));
    }
    ncclCommDestroy(comm);
  }
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
  std::string late;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (comm_ == nullptr) return false;
    for (const InFlight& f : in_flight_) {
      if (now >= f.deadline && cudaEventQuery(f.event) == cudaErrorNotReady) {
        late = Describe(f.op, f.seq);
        break;
      }
    }
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

void NcclCommunicator::Forget(uint64_t seq) {
  absl::MutexLock lock(&mu_);
  for (auto it = in_flight_.begin(); it != in_flight_.end(); ++it) {
    if (it->seq == seq) {
      in_flight_.erase(it);
      return;
    }
  }
}

std::shared_ptr<Work> NcclCommunicator::Enqueue(const char* op,
                                                const std::function<absl::Status(ncclComm_t)>& enqueue) {
  absl::MutexLock order(&enqueue_mu_);
  const uint64_t seq = ++next_seq_;
  const std::string what = Describe(op, seq);
  auto fail = [&](absl::Status s) { return std::make_shared<NcclWork>(this, what, seq, nullptr, std::move(s)); };
  cudaError_t e = cudaSetDevice(options_.device);
  if (e != cudaSuccess) return fail(kernels::cuda::CudaStatus(e, "cudaSetDevice"));
  cudaEvent_t event = nullptr;
  e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (e != cudaSuccess) return fail(kernels::cuda::CudaStatus(e, "cudaEventCreateWithFlags"));
  absl::Status s;
  {
    absl::ReaderMutexLock lock(&mu_);
    if (comm_ == nullptr) {
      s = error_;
    } else {
      s = enqueue(comm_);
    }
  }
  if (s.ok()) s = WaitReady(absl::Now() + options_.timeout, what);  // the non-blocking enqueue finished
  if (s.ok()) {
    e = cudaEventRecord(event, stream_);
    if (e != cudaSuccess) s = kernels::cuda::CudaStatus(e, "cudaEventRecord");
  }
  if (!s.ok()) {
    cudaEventDestroy(event);
    return fail(s);
  }
  {
    absl::MutexLock lock(&mu_);
    in_flight_.push_back(InFlight{seq, op, absl::Now() + options_.timeout, event});
  }
  return std::make_shared<NcclWork>(this, what, seq, event, absl::OkStatus());
}

std::shared_ptr<Work> NcclCommunicator::AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) {
  return Enqueue("AllReduce", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclAllReduce(data, data, count, ToNccl(dtype), ToNccl(op), comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::AllGather(const void* in, void* out, int64_t count, DType dtype) {
  return Enqueue("AllGather", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclAllGather(in, out, count, ToNccl(dtype), comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::ReduceScatter(const void* in, void* out, int64_t count, DType dtype,
                                                      ReduceOp op) {
  return Enqueue("ReduceScatter", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclReduceScatter(in, out, count, ToNccl(dtype), ToNccl(op), comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::Broadcast(void* data, int64_t count, DType dtype, int root) {
  if (root < 0 || root >= size_) {
    return std::make_shared<NcclWork>(this, "Broadcast", 0, nullptr,
                                      absl::InvalidArgumentError(absl::StrCat("nccl Broadcast: root ", root,
                                                                              " is outside [0, ", size_, ")")));
  }
  return Enqueue("Broadcast", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclBroadcast(data, data, count, ToNccl(dtype), root, comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::AllToAll(const void* in, void* out, int64_t count, DType dtype) {
  return Enqueue("AllToAll", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclAlltoAll(in, out, count, ToNccl(dtype), comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::Send(const void* data, int64_t count, DType dtype, int dst, uint32_t) {
  return Enqueue("Send", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclSend(data, count, ToNccl(dtype), dst, comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::Recv(void* data, int64_t count, DType dtype, int src, uint32_t) {
  return Enqueue("Recv", [&](ncclComm_t comm) -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclRecv(data, count, ToNccl(dtype), src, comm, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::SendRecv(const void* send, int dst, void* recv, int src, int64_t count,
                                                 DType dtype) {
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
