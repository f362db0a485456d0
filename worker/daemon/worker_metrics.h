// The worker's training and communication metrics (Prometheus, base units).
#ifndef COLOD_WORKER_DAEMON_WORKER_METRICS_H_
#define COLOD_WORKER_DAEMON_WORKER_METRICS_H_

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "worker/comm/instrumented_communicator.h"

namespace colod {

// Registers, on construction, these families; their series are labelled by
// the job rank that feeds them, {job_id, rank} (never `job`, which is
// Prometheus' own target label):
//   colod_rank_running{job_id,rank,kind}          gauge, 1 while the rank runs here
//                                                 (kind: train, forward, tensor)
//   colod_rank_last_step_timestamp_seconds{job_id,rank}
//                                                 gauge, Unix time of the rank's last
//                                                 training step (of the start of its
//                                                 training loop before the first step)
//   colod_step_duration_seconds{job_id,rank}      histogram of training steps
//   colod_tokens_total{job_id,rank}               counter, the rank's share of the tokens
//                                                 trained on: its data-parallel replica's
//                                                 tokens divided by the replica's ranks, so
//                                                 sum by (job_id) is the job's tokens
//   colod_loss{job_id,rank}                       gauge, the last step's loss
//   colod_eval_loss{job_id,rank}                  gauge, the last held-out evaluation's loss
//   colod_loss_scale{job_id,rank}                 gauge, fp16: the last step's loss scale
//   colod_skipped_updates_total{job_id,rank}      counter, fp16: steps whose gradients
//                                                 overflowed, so that they updated nothing
//   colod_tensor_bytes{job_id,rank,kind}          gauge: params, grads, optimizer_state
//   colod_device_pool_bytes{job_id,rank,kind}     gauge, a CUDA rank's device memory pool:
//                                                 reserved (taken from the device),
//                                                 used (by live tensors)
//   colod_collective_duration_seconds{job_id,rank,op,group}
//                                                 histogram, submission to completion
//   colod_collective_bytes_total{job_id,rank,op,group}
//                                                 counter, this rank's input bytes
// `group` is the mesh axis ("tp", "dp", "tp_row", ...), `op` the collective
// ("all_reduce", "all_gather", ...): bounded.
//
// Cardinality stays bounded: a worker runs one rank at a time, and a rank's
// series are removed after it ends. colod_rank_running and
// colod_rank_last_step_timestamp_seconds go at once (nothing runs, nothing
// can stall); the others stay `linger` longer, so that a scrape still sees
// a rank's final counts and loss, and are removed by RemoveExpired() (which
// the worker calls periodically) or when a later rank of the same job and
// rank number takes them over.
//
// Thread-safe (prometheus-cpp metrics are).
class WorkerMetrics {
 public:
  explicit WorkerMetrics(prometheus::Registry& registry, absl::Duration linger = absl::Minutes(1),
                         Clock* clock = Clock::Real());
  ~WorkerMetrics();

  // The series of one job rank. Destroying it ends the rank (see above); it
  // must outlive every communicator given one of its CollectiveObservers.
  class Rank {
   public:
    ~Rank();
    Rank(const Rank&) = delete;
    Rank& operator=(const Rank&) = delete;

    // TrainingStarted and ObserveStep are called by the rank's thread.
    // The training loop starts: the last step's timestamp is now.
    void TrainingStarted();
    // `replica_tokens`: the tokens the rank's data-parallel replica trained
    // on in the step (each of its ranks sees them all).
    void ObserveStep(double seconds, int64_t replica_tokens, double loss, int64_t param_bytes, int64_t grad_bytes,
                     int64_t optimizer_bytes);
    // A held-out evaluation's loss (called by the rank's thread).
    void ObserveEval(double loss);
    // An fp16 rank's training loop starts: its skipped updates count from 0,
    // so that increase() sees the first one too (called by the rank's thread).
    void LossScalingStarted();
    // An fp16 step's loss scale, and whether its gradients overflowed at it
    // (its update skipped; called by the rank's thread).
    void ObserveLossScale(double scale, bool update_skipped);
    // A CUDA rank's memory pool after a step (called by the rank's thread).
    void ObserveDevicePool(int64_t reserved_bytes, int64_t used_bytes);
    // A data-parallel step's gradient buckets: all their bytes, and those
    // whose all-reduce was enqueued during backward (called by the rank's
    // thread).
    void ObserveGradSync(int64_t bucket_bytes, int64_t overlapped_bytes);
    // An observer for the rank's communicators of mesh axis `group`.
    InstrumentedCommunicator::Observer CollectiveObserver(const std::string& group);

   private:
    friend class WorkerMetrics;
    Rank(WorkerMetrics* metrics, std::string job_id, int rank, std::string kind, int replica_ranks);
    void ObserveCollective(const std::string& group, const char* op, int64_t bytes, absl::Duration elapsed);

    WorkerMetrics* const metrics_;
    const prometheus::Labels labels_;  // {job_id, rank}
    const double replica_ranks_;
    prometheus::Gauge* running_;
    prometheus::Gauge* last_step_ = nullptr;  // from TrainingStarted on
    prometheus::Histogram* step_duration_ = nullptr;
    prometheus::Counter* tokens_ = nullptr;
    prometheus::Gauge* loss_ = nullptr;
    prometheus::Gauge* eval_loss_ = nullptr;
    prometheus::Gauge* loss_scale_ = nullptr;
    prometheus::Counter* skipped_updates_ = nullptr;
    absl::Mutex mu_;
    // The {op, group} pairs of the collective series this rank fed.
    std::set<std::pair<std::string, std::string>> collectives_ ABSL_GUARDED_BY(mu_);
  };

  // Starts the series of rank `rank` of job `job_id` (of `kind`: "train",
  // "forward", "tensor"); `replica_ranks` is the number of ranks in its
  // data-parallel replica (the tensor-parallel size), among which its
  // tokens are shared. Also removes what has expired.
  std::unique_ptr<Rank> StartRank(const std::string& job_id, int rank, const std::string& kind, int replica_ranks);

  // Removes the series of ranks that ended `linger` ago or more.
  void RemoveExpired();

 private:
  // The series of an ended rank, removed at `expires`.
  struct Ended {
    prometheus::Labels labels;  // {job_id, rank}
    std::set<std::pair<std::string, std::string>> collectives;
    absl::Time expires;
  };
  void EndRank(Ended ended);
  void RemoveLocked(const Ended& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const absl::Duration linger_;
  Clock* const clock_;
  prometheus::Family<prometheus::Gauge>& running_;
  prometheus::Family<prometheus::Gauge>& last_step_;
  prometheus::Family<prometheus::Histogram>& step_duration_;
  prometheus::Family<prometheus::Counter>& tokens_;
  prometheus::Family<prometheus::Gauge>& loss_;
  prometheus::Family<prometheus::Gauge>& eval_loss_;
  prometheus::Family<prometheus::Gauge>& loss_scale_;
  prometheus::Family<prometheus::Counter>& skipped_updates_;
  prometheus::Family<prometheus::Gauge>& tensor_bytes_;
  prometheus::Family<prometheus::Gauge>& device_pool_bytes_;
  prometheus::Family<prometheus::Counter>& dp_bucket_bytes_;
  prometheus::Family<prometheus::Histogram>& collective_duration_;
  prometheus::Family<prometheus::Counter>& collective_bytes_;
  absl::Mutex mu_;
  std::vector<Ended> ended_ ABSL_GUARDED_BY(mu_);
};

}  // namespace colod

#endif  // COLOD_WORKER_DAEMON_WORKER_METRICS_H_
