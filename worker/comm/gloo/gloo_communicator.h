// The Gloo backend: CPU collectives over TCP (Debian's libgloo).
#ifndef COLOD_WORKER_COMM_GLOO_GLOO_COMMUNICATOR_H_
#define COLOD_WORKER_COMM_GLOO_GLOO_COMMUNICATOR_H_

#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"

namespace gloo {
class Context;
namespace transport {
class Device;
}  // namespace transport
}  // namespace gloo

namespace colod {

namespace gloo_detail {
class LiveBuffers;
struct AbortHandle;

// Gloo reports failures as exceptions; this is the one place they become a
// Status: a timeout DEADLINE_EXCEEDED; out of memory (a scratch buffer,
// Gloo's own) RESOURCE_EXHAUSTED, no peer's doing and none a restart mends;
// a check of Gloo's own that failed (GLOO_ENFORCE) INTERNAL; anything else
// (a peer that closed its connection, a refused connect) UNAVAILABLE.
absl::Status StatusFromGlooException(const std::exception& e, absl::string_view op);
}  // namespace gloo_detail

// Collectives run one at a time on the communicator's own thread, in
// submission order. Thread-safe.
class GlooCommunicator final : public Communicator {
 public:
  struct Options {
    // Address this rank listens on and advertises to its peers.
    std::string hostname = "127.0.0.1";
    // Rendezvous and per-collective timeout.
    absl::Duration timeout = absl::Seconds(60);
    // Key prefix in the store, so several groups can share one store.
    std::string prefix = "gloo";
    // Segment size of the pipelined (ring) all-reduce.
    size_t max_segment_bytes = 4 << 20;
    // All-reduces of at most this many bytes run Gloo's bcube algorithm
    // (recursive halving and doubling where the size is a power of two: a
    // reduce-scatter and an all-gather in log2(p) exchanges each, the whole
    // half-buffer at a time); larger ones its ring, which pipelines
    // segments. 0: always the ring. docs/PERFORMANCE.md has the crossover.
    size_t halving_doubling_max_bytes = 4 << 20;
    // Between two ranks, all-reduces of at most this many bytes are one
    // exchange of the whole buffer (each rank reduces both) instead of
    // Gloo's algorithms, which take two exchanges of half of it. 0: never.
    // docs/PERFORMANCE.md has the measurements.
    size_t two_rank_exchange_max_bytes = 4 << 20;
    // If set, firing it ends a Create in progress (ABORTED) within
    // milliseconds, even while Gloo waits for a dead peer's TCP connection.
    std::shared_ptr<AbortSignal> abort_signal;
    // A ReduceScatter's scratch (twice its result) is kept for the next one
    // up to this many bytes, and released after the call above it: a
    // training step's buckets reuse it, while a tensor job's one-off
    // reshard of gigabytes need not hold it, unseen by the worker's budget.
    size_t kept_scratch_bytes = std::numeric_limits<size_t>::max();
  };

  // Connects `size` ranks through `store` (every rank calls it with the same
  // prefix). DEADLINE_EXCEEDED naming the missing ranks if some never join
  // within options.timeout; INVALID_ARGUMENT for a bad rank or size; ABORTED
  // when options.abort_signal fires first. An aborted rendezvous is left to
  // Gloo's own timeout on a thread of its own, which no longer touches
  // `store` once Create returned.
  static absl::StatusOr<std::unique_ptr<GlooCommunicator>> Create(Store& store, int rank, int size,
                                                                  Options options);
  // Finishes every submitted collective, then closes the connections. Peers
  // should pass a final Barrier before any rank destroys its communicator.
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "gloo"; }

  std::shared_ptr<Work> AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) override;
  std::shared_ptr<Work> AllGather(const void* in, void* out, int64_t count, DType dtype) override;
  std::shared_ptr<Work> ReduceScatter(const void* in, void* out, int64_t count, DType dtype,
                                      ReduceOp op) override;
  std::shared_ptr<Work> Broadcast(void* data, int64_t count, DType dtype, int root) override;
  std::shared_ptr<Work> AllToAll(const void* in, void* out, int64_t count, DType dtype) override;
  std::shared_ptr<Work> Send(const void* data, int64_t count, DType dtype, int dst, uint32_t tag) override;
  std::shared_ptr<Work> Recv(void* data, int64_t count, DType dtype, int src, uint32_t tag) override;
  std::shared_ptr<Work> Barrier() override;
  void Abort(const absl::Status& reason) override;
  absl::Status AsyncError() override;

 private:
  class GlooWork;
  GlooCommunicator(int rank, int size, Options options);
  // Queues `fn` (run on the communicator thread, exceptions converted).
  std::shared_ptr<Work> Submit(const char* op, std::function<void(uint32_t tag)> fn);
  // A Work that failed before running (bad arguments).
  std::shared_ptr<Work> Failed(absl::Status status);
  void Loop();
  // On the communicator thread: scratch_ grown to at least `bytes`.
  char* Scratch(size_t bytes);

  const int rank_;
  const int size_;
  const Options options_;
  std::shared_ptr<gloo::transport::Device> device_;
  std::shared_ptr<gloo::Context> context_;
  // The unbound buffers of the collective in flight, which Abort ends.
  std::shared_ptr<gloo_detail::LiveBuffers> live_buffers_;
  // How a Work whose Wait ran out aborts this communicator: this, until the
  // destructor begins.
  std::shared_ptr<gloo_detail::AbortHandle> abort_handle_;
  std::thread thread_;
  // ReduceScatter's running sum and incoming chunk, and the two-rank
  // exchange's incoming buffer, kept between calls so that each call does
  // not fault in fresh pages; only the communicator thread touches them.
  std::unique_ptr<char[]> scratch_;
  size_t scratch_bytes_ = 0;

  struct Task {
    std::string op;
    std::function<void(uint32_t)> fn;
    std::shared_ptr<GlooWork> work;
  };
  absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  absl::Status error_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  uint32_t next_tag_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace colod

#endif  // COLOD_WORKER_COMM_GLOO_GLOO_COMMUNICATOR_H_
