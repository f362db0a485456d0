// The NCCL backend: collectives on CUDA device buffers.
//
// Built where the CUDA toolkit is present (bazel/cuda.bzl); tests run where a
// GPU is present and skip elsewhere. Communicators are created non-blocking
// (ncclConfig_t.blocking = 0) and every wait polls ncclCommGetAsyncError with
// a deadline, so no init or collective waits forever: on timeout the caller
// gets DEADLINE_EXCEEDED and Abort() tears the communicator down.
#ifndef COLOD_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_
#define COLOD_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"

namespace colod {

// Turns an NCCL result into a Status naming the call and file:line.
absl::Status NcclStatus(ncclResult_t r, const char* call, const char* file, int line);
absl::Status CudaStatus(cudaError_t e, const char* call, const char* file, int line);

#define NCCL_RETURN_IF_ERROR(call)                                                         \
  do {                                                                                     \
    ncclResult_t colod_nccl_r_ = (call);                                                   \
    if (colod_nccl_r_ != ncclSuccess && colod_nccl_r_ != ncclInProgress)                   \
      return ::colod::NcclStatus(colod_nccl_r_, #call, __FILE__, __LINE__);                \
  } while (0)

#define CUDA_RETURN_IF_ERROR(call)                                                         \
  do {                                                                                     \
    cudaError_t colod_cuda_e_ = (call);                                                    \
    if (colod_cuda_e_ != cudaSuccess) return ::colod::CudaStatus(colod_cuda_e_, #call, __FILE__, __LINE__); \
  } while (0)

// Thread-safe. Collectives are enqueued on the communicator's own CUDA stream
// in submission order; buffers are device pointers on `device`.
class NcclCommunicator final : public Communicator {
 public:
  struct Options {
    int device = 0;
    // Init, split and per-collective wait limit.
    absl::Duration timeout = absl::Minutes(5);
    // Key prefix of the unique id in the store.
    std::string prefix = "nccl";
  };

  // Rank 0 creates the unique id and publishes it through `store`; the others
  // wait for it (DEADLINE_EXCEEDED after options.timeout). Then all ranks
  // join; a rank that never joins makes the others fail with
  // DEADLINE_EXCEEDED (and their half-made communicators are aborted).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(Store& store, int rank, int size,
                                                                  Options options);
  ~NcclCommunicator() override;

  // ncclCommSplit: ranks with the same `color` form a new communicator,
  // ordered by `key`. Collective over this communicator.
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> Split(int color, int key);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }

  std::shared_ptr<Work> AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) override;
  std::shared_ptr<Work> AllGather(const void* in, void* out, int64_t count, DType dtype) override;
  std::shared_ptr<Work> ReduceScatter(const void* in, void* out, int64_t count, DType dtype,
                                      ReduceOp op) override;
  std::shared_ptr<Work> Broadcast(void* data, int64_t count, DType dtype, int root) override;
  std::shared_ptr<Work> AllToAll(const void* in, void* out, int64_t count, DType dtype) override;
  // NCCL has no tags: a Send matches the peer's Recv posted in the same order.
  std::shared_ptr<Work> Send(const void* data, int64_t count, DType dtype, int dst, uint32_t tag) override;
  std::shared_ptr<Work> Recv(void* data, int64_t count, DType dtype, int src, uint32_t tag) override;
  std::shared_ptr<Work> Barrier() override;
  void Abort(const absl::Status& reason) override;
  absl::Status AsyncError() override;

 private:
  class NcclWork;
  NcclCommunicator(int rank, int size, Options options) : rank_(rank), size_(size), options_(options) {}
  // Finishes a non-blocking NCCL call: polls the async error until the
  // communicator is no longer in progress or the deadline passes.
  absl::Status WaitReady(absl::Time deadline);
  // Runs `enqueue` (NCCL calls on stream_) and returns a Work for its completion.
  std::shared_ptr<Work> Enqueue(const char* op, const std::function<absl::Status()>& enqueue);

  const int rank_;
  const int size_;
  const Options options_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;  // 4 bytes for Barrier
  absl::Mutex mu_;           // serializes enqueues so every rank's order is its submission order
  std::atomic<bool> aborted_{false};
  absl::Status abort_reason_ ABSL_GUARDED_BY(mu_);
};

}  // namespace colod

#endif  // COLOD_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_
