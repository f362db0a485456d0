// The NCCL backend: collectives on CUDA device buffers.
//
// Built where the CUDA toolkit is present, or against the CUDA emulation
// (bazel/cuda.bzl, docs/GPU.md), where its tests run without a GPU.
// Communicators are created non-blocking (ncclConfig_t.blocking = 0) and
// every wait polls ncclCommGetAsyncError with a deadline, so no init or
// collective waits forever: on timeout the caller gets DEADLINE_EXCEEDED and
// the communicator is aborted.
#ifndef COLOD_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_
#define COLOD_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "kernels/cuda/status.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"

namespace colod {

// Turns an NCCL result into a Status naming the call and file:line.
absl::Status NcclStatus(ncclResult_t r, const char* call, const char* file, int line);

#define NCCL_RETURN_IF_ERROR(call)                                                         \
  do {                                                                                     \
    ncclResult_t colod_nccl_r_ = (call);                                                   \
    if (colod_nccl_r_ != ncclSuccess && colod_nccl_r_ != ncclInProgress)                   \
      return ::colod::NcclStatus(colod_nccl_r_, #call, __FILE__, __LINE__);                \
  } while (0)

// Thread-safe. Collectives are enqueued on the communicator's own CUDA stream
// in submission order; buffers are device pointers on `device`.
//
// Stream order (docs/GPU.md): before each collective the communicator's
// stream waits on an event recorded on the device's compute stream
// (kernels/cuda/stream.h), so the collective sees every kernel and
// stream-ordered allocation enqueued there before it was submitted, and
// Work::WaitOnDevice makes the compute stream wait on the collective's
// completion event. Neither blocks the host; events come from a pool. The
// exception is a first use: NCCL connects the ranks at a communicator's
// first collective and a pair at its first send and receive, and the
// submission waits (WaitReady, under the op's deadline) until the peers
// reach their ends; a later submission on this communicator waits behind it
// on `enqueue_mu_`, as NCCL allows no call while one is in progress.
//
// Failure handling (c10d's ProcessGroupNCCL pattern): every collective has a
// sequence number and a deadline (options.timeout from its enqueue). A
// process-wide watchdog thread aborts a communicator whose collective passed
// its deadline or whose NCCL reports an asynchronous error, and a Wait that
// reaches its timeout aborts it too, so when Wait returns the collective has
// completed or can no longer touch its buffers. The error is sticky and names
// the rank, op, group and sequence number. No lock is held across a wait:
// enqueues are ordered by `enqueue_mu_`, which Abort never takes, and the
// NCCL handle is guarded by `mu_` only for the length of one non-blocking
// call, so Abort always gets through. The destructor lets outstanding work
// finish (up to the timeout, at most 30 s) and destroys the handle; it
// aborts one whose work reports an error or is still running then, so a
// collective that waits for a lost peer never outlives its communicator.
class NcclCommunicator final : public Communicator {
 public:
  struct Options {
    int device = 0;
    // Init, split and per-collective limit.
    absl::Duration timeout = absl::Minutes(5);
    // Key prefix of the unique id in the store.
    std::string prefix = "nccl";
    // The group's name in errors (e.g. "tp", "world").
    std::string group = "world";
    // If set and fired: init and split stop waiting, and the watchdog aborts
    // the communicator (ProcessGroup::Abort reaches it this way).
    std::shared_ptr<AbortSignal> abort_signal;
  };

  // Rank 0 creates the unique id and publishes it through `store`; the others
  // wait for it (DEADLINE_EXCEEDED after options.timeout). Then all ranks
  // join; a rank that never joins makes the others fail with
  // DEADLINE_EXCEEDED (and their half-made communicators are aborted).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(Store& store, int rank, int size,
                                                                  Options options);
  ~NcclCommunicator() override;

  // ncclCommSplit: ranks with the same `color` form a new communicator,
  // ordered by `key`, named `group` in errors. Collective over this
  // communicator. On failure both the parent and a half-made child are
  // aborted.
  absl::StatusOr<std::unique_ptr<NcclCommunicator>> Split(int color, int key, const std::string& group = "");

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
  // A two-way exchange needs SendRecv: NCCL blocks a lone Send until the
  // peer's Recv runs.
  std::shared_ptr<Work> Send(const void* data, int64_t count, DType dtype, int dst, uint32_t tag) override;
  std::shared_ptr<Work> Recv(void* data, int64_t count, DType dtype, int src, uint32_t tag) override;
  // Sends `send` to `dst` and receives `recv` from `src` as one NCCL group,
  // so two ranks may exchange with each other without deadlock.
  std::shared_ptr<Work> SendRecv(const void* send, int dst, void* recv, int src, int64_t count, DType dtype);
  std::shared_ptr<Work> Barrier() override;
  void Abort(const absl::Status& reason) override;
  absl::Status AsyncError() override;

  // The watchdog's pass over this communicator: aborts it if its oldest
  // unfinished collective passed its deadline or NCCL reports an error.
  // Returns true if it aborted.
  bool CheckHealth(absl::Time now);

 private:
  class NcclWork;
  class EventPool;
  // A collective's completion event, shared by its Work and the watchdog's
  // record; back to the pool when both let go.
  struct Completion;
  struct InFlight {
    uint64_t seq;
    std::string op;
    absl::Time deadline;
    std::shared_ptr<Completion> done;
  };
  NcclCommunicator(int rank, int size, Options options) : rank_(rank), size_(size), options_(std::move(options)) {}
  // Takes a just-made (init or split) handle: registers with the watchdog,
  // waits until NCCL finished making it (aborting it on failure), and makes
  // the stream and the Barrier scratch.
  absl::Status Adopt(ncclComm_t comm, const std::string& what);
  // "AllReduce #17 on group tp (rank 1/2, device 1)"
  std::string Describe(const std::string& op, uint64_t seq) const;
  // `what`, its group, rank and device.
  std::string Describe(const std::string& what) const;
  // Finishes a non-blocking NCCL call: polls the async error until the
  // communicator is no longer in progress; at `deadline` aborts it with
  // DEADLINE_EXCEEDED naming `what` (a description: Describe) and what it
  // waited for: the peers to join (init, split: `joining`), or the peer's
  // end of a connection (NCCL connects at first use: a communicator's first
  // collective, a pair's first send and receive, hold the caller until the
  // peers make theirs).
  absl::Status WaitReady(absl::Time deadline, const std::string& what, bool joining);
  // Runs `enqueue` (NCCL calls on stream_, given the handle) and returns a
  // Work for its completion.
  std::shared_ptr<Work> Enqueue(const char* op, const std::function<absl::Status(ncclComm_t)>& enqueue);
  // Aborts with `error` as the sticky error (the first one wins).
  void AbortWith(const absl::Status& error);

  const int rank_;
  const int size_;
  const Options options_;
  cudaStream_t stream_ = nullptr;
  void* scratch_ = nullptr;  // 4 bytes for Barrier
  std::shared_ptr<EventPool> events_;
  // Orders enqueues, so every rank's NCCL order is its submission order.
  // Held across a non-blocking call's completion; never taken by Abort.
  absl::Mutex enqueue_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  uint64_t next_seq_ ABSL_GUARDED_BY(enqueue_mu_) = 0;
  // Recorded on the compute stream before each collective; stream_ waits on it.
  cudaEvent_t ready_ ABSL_GUARDED_BY(enqueue_mu_) = nullptr;
  // Where NCCL may still write a non-blocking split's child: kept for the
  // communicator's life.
  std::vector<std::shared_ptr<ncclComm_t>> split_slots_ ABSL_GUARDED_BY(enqueue_mu_);
  // Guards the handle for the length of one NCCL call (readers) and its
  // release (Abort, the writer).
  absl::Mutex mu_;
  ncclComm_t comm_ ABSL_GUARDED_BY(mu_) = nullptr;
  absl::Status error_ ABSL_GUARDED_BY(mu_);  // sticky: the abort's reason
  // Collectives not yet seen complete, oldest first: the watchdog checks
  // their deadlines and drops them once their events are reached.
  std::vector<InFlight> in_flight_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> aborted_{false};
};

}  // namespace colod

#endif  // COLOD_WORKER_COMM_NCCL_NCCL_COMMUNICATOR_H_
