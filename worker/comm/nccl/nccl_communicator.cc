#include "worker/comm/nccl/nccl_communicator.h"

#include <cstring>

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

absl::Status CudaStatus(cudaError_t e, const char* call, const char* file, int line) {
  return absl::InternalError(absl::StrCat("cuda: ", call, ": ", cudaGetErrorString(e), " (", file, ":", line, ")"));
}

class NcclCommunicator::NcclWork final : public Work {
 public:
  NcclWork(NcclCommunicator* owner, std::string op, cudaEvent_t event, absl::Status failed)
      : owner_(owner), op_(std::move(op)), event_(event), failed_(std::move(failed)) {}
  ~NcclWork() override {
    if (event_ != nullptr) cudaEventDestroy(event_);
  }
  absl::Status Wait(absl::Duration timeout) override {
    if (!failed_.ok()) return failed_;
    const absl::Time deadline = absl::Now() + timeout;
    for (;;) {
      cudaError_t q = cudaEventQuery(event_);
      if (q == cudaSuccess) return absl::OkStatus();
      if (q != cudaErrorNotReady) return CudaStatus(q, "cudaEventQuery", __FILE__, __LINE__);
      absl::Status async = owner_->AsyncError();
      if (!async.ok()) return async;
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat("nccl ", op_, " (rank ", owner_->rank(), "/", owner_->size(),
                                                        "): not complete after ", absl::FormatDuration(timeout)));
      }
      absl::SleepFor(absl::Microseconds(50));
    }
  }
  bool IsCompleted() override { return !failed_.ok() || cudaEventQuery(event_) == cudaSuccess; }

 private:
  NcclCommunicator* owner_;  // a Work must not outlive its communicator
  const std::string op_;
  cudaEvent_t event_;
  const absl::Status failed_;
};

absl::Status NcclCommunicator::WaitReady(absl::Time deadline) {
  for (;;) {
    ncclResult_t state = ncclSuccess;
    NCCL_RETURN_IF_ERROR(ncclCommGetAsyncError(comm_, &state));
    if (state == ncclSuccess) return absl::OkStatus();
    if (state != ncclInProgress) return NcclStatus(state, "ncclCommGetAsyncError", __FILE__, __LINE__);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("nccl: rank ", rank_, "/", size_, " still in progress at the deadline (a peer never joined?)"));
    }
    absl::SleepFor(absl::Microseconds(100));
  }
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(Store& store, int rank, int size,
                                                                          Options options) {
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("nccl: rank ", rank, " / size ", size, " is not a valid rank"));
  }
  CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  const std::string key = absl::StrCat(options.prefix, "/unique_id");
  ncclUniqueId id;
  if (rank == 0) {
    NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
    RETURN_IF_ERROR(store.Set(key, std::string(reinterpret_cast<const char*>(&id), sizeof(id))));
  } else {
    ASSIGN_OR_RETURN(std::vector<std::string> v, store.Wait({key}, options.timeout));
    if (v[0].size() != sizeof(id)) return absl::DataLossError("nccl: the published unique id has the wrong size");
    std::memcpy(&id, v[0].data(), sizeof(id));
  }
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(rank, size, options));
  ncclConfig_t config = NonBlockingConfig();
  NCCL_RETURN_IF_ERROR(ncclCommInitRankConfig(&c->comm_, size, id, rank, &config));
  absl::Status ready = c->WaitReady(absl::Now() + options.timeout);
  if (!ready.ok()) {
    ncclCommAbort(c->comm_);
    c->comm_ = nullptr;
    return ready;
  }
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&c->scratch_, sizeof(int32_t)));
  return c;
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Split(int color, int key) {
  CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  ncclConfig_t config = NonBlockingConfig();
  ncclComm_t sub = nullptr;
  {
    absl::MutexLock lock(&mu_);
    NCCL_RETURN_IF_ERROR(ncclCommSplit(comm_, color, key, &sub, &config));
    RETURN_IF_ERROR(WaitReady(absl::Now() + options_.timeout));
  }
  if (sub == nullptr) return absl::InvalidArgumentError("nccl: split with NCCL_SPLIT_NOCOLOR gives no communicator");
  int sub_rank = 0, sub_size = 0;
  NCCL_RETURN_IF_ERROR(ncclCommUserRank(sub, &sub_rank));
  NCCL_RETURN_IF_ERROR(ncclCommCount(sub, &sub_size));
  std::unique_ptr<NcclCommunicator> c(new NcclCommunicator(sub_rank, sub_size, options_));
  c->comm_ = sub;
  RETURN_IF_ERROR(c->WaitReady(absl::Now() + options_.timeout));
  CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&c->stream_, cudaStreamNonBlocking));
  CUDA_RETURN_IF_ERROR(cudaMalloc(&c->scratch_, sizeof(int32_t)));
  return c;
}

NcclCommunicator::~NcclCommunicator() {
  cudaSetDevice(options_.device);
  // After ncclCommAbort the communicator is already freed; otherwise finish
  // outstanding work (finalize is non-blocking here) and destroy it.
  if (comm_ != nullptr && !aborted_) {
    ncclResult_t r = ncclCommFinalize(comm_);
    if (r == ncclSuccess || r == ncclInProgress) (void)WaitReady(absl::Now() + absl::Seconds(30));
    ncclCommDestroy(comm_);
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (scratch_ != nullptr) cudaFree(scratch_);
}

void NcclCommunicator::Abort(const absl::Status& reason) {
  absl::MutexLock lock(&mu_);
  if (aborted_.exchange(true)) return;
  abort_reason_ = absl::AbortedError(absl::StrCat("nccl: aborted: ", reason.message()));
  if (comm_ != nullptr) ncclCommAbort(comm_);
}

absl::Status NcclCommunicator::AsyncError() {
  if (aborted_) {
    absl::MutexLock lock(&mu_);
    return abort_reason_;
  }
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
  if (r != ncclSuccess) return NcclStatus(r, "ncclCommGetAsyncError", __FILE__, __LINE__);
  if (state != ncclSuccess && state != ncclInProgress) return NcclStatus(state, "async", __FILE__, __LINE__);
  return absl::OkStatus();
}

std::shared_ptr<Work> NcclCommunicator::Enqueue(const char* op, const std::function<absl::Status()>& enqueue) {
  auto fail = [&](absl::Status s) { return std::make_shared<NcclWork>(this, op, nullptr, std::move(s)); };
  absl::MutexLock lock(&mu_);
  if (aborted_) return fail(abort_reason_);
  cudaError_t e = cudaSetDevice(options_.device);
  if (e != cudaSuccess) return fail(CudaStatus(e, "cudaSetDevice", __FILE__, __LINE__));
  absl::Status s = enqueue();
  if (s.ok()) s = WaitReady(absl::Now() + options_.timeout);  // non-blocking enqueue finished
  if (!s.ok()) return fail(s);
  cudaEvent_t event = nullptr;
  e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(event, stream_);
  if (e != cudaSuccess) {
    if (event != nullptr) cudaEventDestroy(event);
    return fail(CudaStatus(e, "cudaEventRecord", __FILE__, __LINE__));
  }
  return std::make_shared<NcclWork>(this, op, event, absl::OkStatus());
}

std::shared_ptr<Work> NcclCommunicator::AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) {
  return Enqueue("AllReduce", [&]() -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclAllReduce(data, data, count, ToNccl(dtype), ToNccl(op), comm_, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::AllGather(const void* in, void* out, int64_t count, DType dtype) {
  return Enqueue("AllGather", [&]() -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclAllGather(in, out, count, ToNccl(dtype), comm_, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::ReduceScatter(const void* in, void* out, int64_t count, DType dtype,
                                                      ReduceOp op) {
  return Enqueue("ReduceScatter", [&]() -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclReduceScatter(in, out, count, ToNccl(dtype), ToNccl(op), comm_, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::Broadcast(void* data, int64_t count, DType dtype, int root) {
  if (root < 0 || root >= size_) {
    return std::make_shared<NcclWork>(this, "Broadcast", nullptr,
                                      absl::InvalidArgumentError(absl::StrCat("nccl Broadcast: root ", root,
                                                                              " is outside [0, ", size_, ")")));
  }
  return Enqueue("Broadcast", [&]() -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclBroadcast(data, data, count, ToNccl(dtype), root, comm_, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::AllToAll(const void* in, void* out, int64_t count, DType dtype) {
  return Enqueue("AllToAll", [&]() -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclAlltoAll(in, out, count, ToNccl(dtype), comm_, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::Send(const void* data, int64_t count, DType dtype, int dst, uint32_t) {
  return Enqueue("Send", [&]() -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclSend(data, count, ToNccl(dtype), dst, comm_, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::Recv(void* data, int64_t count, DType dtype, int src, uint32_t) {
  return Enqueue("Recv", [&]() -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclRecv(data, count, ToNccl(dtype), src, comm_, stream_));
    return absl::OkStatus();
  });
}

std::shared_ptr<Work> NcclCommunicator::Barrier() {
  return Enqueue("Barrier", [&]() -> absl::Status {
    NCCL_RETURN_IF_ERROR(ncclAllReduce(scratch_, scratch_, 1, ncclInt32, ncclSum, comm_, stream_));
    return absl::OkStatus();
  });
}

}  // namespace colod
