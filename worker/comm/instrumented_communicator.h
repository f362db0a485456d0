// A Communicator decorator that counts every collective and the bytes it
// moves, per op: what the worker's colod_collective_* metrics and the layer
// tests ("one all-reduce per MLP forward") read; and, given one, keeps a
// rank's flight recorder.
#ifndef COLOD_WORKER_COMM_INSTRUMENTED_COMMUNICATOR_H_
#define COLOD_WORKER_COMM_INSTRUMENTED_COMMUNICATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "worker/comm/communicator.h"
#include "worker/comm/flight_recorder.h"

namespace colod {

// Thread-safe.
class InstrumentedCommunicator final : public Communicator {
 public:
  struct OpStats {
    int64_t calls = 0;
    int64_t bytes = 0;  // the op's input payload on this rank
  };

  // Called once per collective when it is first seen complete, with the op
  // name, this rank's input bytes and the time from submission; from the
  // thread that saw it. Must be thread-safe. A collective is seen complete by
  // Work::Wait, IsCompleted, or, for one waited on the device
  // (WaitOnDevice), by the sweep at this communicator's next submission,
  // AsyncError or destruction: its time is then an upper bound.
  using Observer = std::function<void(const char* op, int64_t bytes, absl::Duration elapsed)>;

  // With a `recorder`, every collective is recorded there under `group`
  // (its enqueue, and its end once seen, as the observer sees it).
  explicit InstrumentedCommunicator(std::unique_ptr<Communicator> inner, Observer observer = nullptr,
                                    std::shared_ptr<FlightRecorder> recorder = nullptr, std::string group = "")
      : inner_(std::move(inner)),
        observer_(std::move(observer)),
        recorder_(std::move(recorder)),
        group_(std::move(group)) {}

  // Ops are "all_reduce", "all_gather", "reduce_scatter", "broadcast",
  // "all_to_all", "send", "recv", "barrier".
  OpStats Stats(const std::string& op) const;
  std::map<std::string, OpStats> AllStats() const;

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  std::shared_ptr<Work> AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) override;
  std::shared_ptr<Work> AllGather(const void* in, void* out, int64_t count, DType dtype) override;
  std::shared_ptr<Work> ReduceScatter(const void* in, void* out, int64_t count, DType dtype, ReduceOp op) override;
  std::shared_ptr<Work> Broadcast(void* data, int64_t count, DType dtype, int root) override;
  std::shared_ptr<Work> AllToAll(const void* in, void* out, int64_t count, DType dtype) override;
  std::shared_ptr<Work> Send(const void* data, int64_t count, DType dtype, int dst, uint32_t tag) override;
  std::shared_ptr<Work> Recv(void* data, int64_t count, DType dtype, int src, uint32_t tag) override;
  std::shared_ptr<Work> Barrier() override;
  void Abort(const absl::Status& reason) override { inner_->Abort(reason); }
  absl::Status AsyncError() override {
    Sweep();
    return inner_->AsyncError();
  }
  ~InstrumentedCommunicator() override;

  // A work waited on the device, reported by a later sweep (internal).
  void Defer(std::shared_ptr<Work> work);

 private:
  // Reports the deferred works that have completed.
  void Sweep();

  // Counts the op (`count` elements, `copies` times), records it, submits
  // it (`submit`: the backend's call) and wraps its work for the observer.
  // A count the backend refuses (negative, or overflowing as bytes) is
  // submitted uncounted: the backend's work carries its error.
  std::shared_ptr<Work> Observe(const char* op, int64_t count, int64_t copies, DType dtype,
                                const std::function<std::shared_ptr<Work>()>& submit);

  const std::unique_ptr<Communicator> inner_;
  const Observer observer_;
  const std::shared_ptr<FlightRecorder> recorder_;
  const std::string group_;
  mutable absl::Mutex mu_;
  std::map<std::string, OpStats> stats_ ABSL_GUARDED_BY(mu_);
  // Destroyed before inner_ (a backend's Work must not outlive it).
  std::vector<std::shared_ptr<Work>> deferred_ ABSL_GUARDED_BY(mu_);
};

}  // namespace colod

#endif  // COLOD_WORKER_COMM_INSTRUMENTED_COMMUNICATOR_H_
