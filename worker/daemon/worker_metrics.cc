#include "worker/daemon/worker_metrics.h"

#include <algorithm>
#include <type_traits>

#include "absl/strings/str_cat.h"

namespace colod {
namespace {

prometheus::Histogram::BucketBoundaries StepBuckets() {
  return {0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100};
}

prometheus::Histogram::BucketBoundaries CollectiveBuckets() {
  return {0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10};
}

constexpr const char* kTensorKinds[] = {"params", "grads", "optimizer_state"};

prometheus::Labels With(prometheus::Labels labels, const prometheus::Labels& more) {
  for (const auto& [k, v] : more) labels[k] = v;
  return labels;
}

template <typename T>
void RemoveIfPresent(prometheus::Family<T>& family, const prometheus::Labels& labels) {
  if (!family.Has(labels)) return;
  if constexpr (std::is_same_v<T, prometheus::Histogram>) {
    family.Remove(&family.Add(labels, prometheus::Histogram::BucketBoundaries{}));
  } else {
    family.Remove(&family.Add(labels));
  }
}

}  // namespace

WorkerMetrics::WorkerMetrics(prometheus::Registry& registry, absl::Duration linger, Clock* clock)
    : linger_(linger),
      clock_(clock),
      running_(prometheus::BuildGauge()
                   .Name("colod_rank_running")
                   .Help("1 while a rank of a job runs on this worker, by job_id, rank and kind (train, forward, "
                         "tensor); the series goes when the rank ends.")
                   .Register(registry)),
      last_step_(prometheus::BuildGauge()
                     .Name("colod_rank_last_step_timestamp_seconds")
                     .Help("Unix time of this rank's last training step (of the start of its training loop before "
                           "the first one); the series goes when the rank ends.")
                     .Register(registry)),
      step_duration_(prometheus::BuildHistogram()
                         .Name("colod_step_duration_seconds")
                         .Help("Wall time of each training step of a job rank on this worker.")
                         .Register(registry)),
      tokens_(prometheus::BuildCounter()
                  .Name("colod_tokens_total")
                  .Help("Tokens trained on, this rank's share: its data-parallel replica's tokens divided by the "
                        "replica's ranks, so that the sum over a job's ranks is the job's tokens.")
                  .Register(registry)),
      loss_(prometheus::BuildGauge()
                .Name("colod_loss")
                .Help("Loss of the rank's last training step (mean next-token cross-entropy of the global batch).")
                .Register(registry)),
      eval_loss_(prometheus::BuildGauge()
                     .Name("colod_eval_loss")
                     .Help("Loss of the rank's last held-out evaluation (mean cross-entropy over its labelled "
                           "positions, all dp replicas; TrainConfig.eval_*).")
                     .Register(registry)),
      loss_scale_(prometheus::BuildGauge()
                      .Name("colod_loss_scale")
                      .Help("fp16 mixed precision: the loss scale of the rank's last training step (halved after "
                            "a step whose gradients overflowed, doubled after TrainConfig.loss_scale_window "
                            "steps without).")
                      .Register(registry)),
      skipped_updates_(prometheus::BuildCounter()
                           .Name("colod_skipped_updates_total")
                           .Help("fp16 mixed precision: training steps whose gradients overflowed at their loss "
                                 "scale, so that they updated no weight.")
                           .Register(registry)),
      tensor_bytes_(prometheus::BuildGauge()
                        .Name("colod_tensor_bytes")
                        .Help("Bytes a job rank holds on this worker, by kind: params, grads, optimizer_state.")
                        .Register(registry)),
      device_pool_bytes_(prometheus::BuildGauge()
                             .Name("colod_device_pool_bytes")
                             .Help("A CUDA job rank's device memory pool after its last step, by kind: reserved "
                                   "(taken from the device and kept for reuse), used (by live tensors).")
                             .Register(registry)),
      dp_bucket_bytes_(prometheus::BuildCounter()
                           .Name("colod_dp_bucket_bytes_total")
                           .Help("Bytes of a job rank's data-parallel gradient buckets all-reduced, by when the "
                                 "all-reduce was enqueued: during (backward: overlapping the rest of backward) or "
                                 "after backward (after).")
                           .Register(registry)),
      collective_duration_(prometheus::BuildHistogram()
                               .Name("colod_collective_duration_seconds")
                               .Help("Time from submitting a collective to seeing it complete, by job rank, op and "
                                     "mesh axis.")
                               .Register(registry)),
      collective_bytes_(prometheus::BuildCounter()
                            .Name("colod_collective_bytes_total")
                            .Help("Input bytes of a job rank's collectives, by op and mesh axis.")
                            .Register(registry)) {}

WorkerMetrics::~WorkerMetrics() = default;

std::unique_ptr<WorkerMetrics::Rank> WorkerMetrics::StartRank(const std::string& job_id, int rank,
                                                              const std::string& kind, int replica_ranks) {
  RemoveExpired();
  std::unique_ptr<Rank> r(new Rank(this, job_id, rank, kind, std::max(replica_ranks, 1)));
  absl::MutexLock lock(&mu_);
  // A new rank with the labels of one that ended (the job was scheduled
  // again here) continues its series: they are no longer due for removal.
  for (auto it = ended_.begin(); it != ended_.end();) {
    if (it->labels == r->labels_) {
      absl::MutexLock rank_lock(&r->mu_);
      r->collectives_.insert(it->collectives.begin(), it->collectives.end());
      it = ended_.erase(it);
    } else {
      ++it;
    }
  }
  return r;
}

void WorkerMetrics::RemoveExpired() {
  const absl::Time now = clock_->Now();
  absl::MutexLock lock(&mu_);
  auto expired = [now](const Ended& e) { return e.expires <= now; };
  for (const Ended& e : ended_) {
    if (expired(e)) RemoveLocked(e);
  }
  ended_.erase(std::remove_if(ended_.begin(), ended_.end(), expired), ended_.end());
}

void WorkerMetrics::EndRank(Ended ended) {
  ended.expires = clock_->Now() + linger_;
  absl::MutexLock lock(&mu_);
  if (linger_ <= absl::ZeroDuration()) {
    RemoveLocked(ended);
    return;
  }
  ended_.push_back(std::move(ended));
}

void WorkerMetrics::RemoveLocked(const Ended& e) {
  RemoveIfPresent(step_duration_, e.labels);
  RemoveIfPresent(tokens_, e.labels);
  RemoveIfPresent(loss_, e.labels);
  RemoveIfPresent(eval_loss_, e.labels);
  RemoveIfPresent(loss_scale_, e.labels);
  RemoveIfPresent(skipped_updates_, e.labels);
  for (const char* kind : kTensorKinds) RemoveIfPresent(tensor_bytes_, With(e.labels, {{"kind", kind}}));
  for (const char* kind : {"reserved", "used"}) RemoveIfPresent(device_pool_bytes_, With(e.labels, {{"kind", kind}}));
  for (const char* when : {"backward", "after"}) RemoveIfPresent(dp_bucket_bytes_, With(e.labels, {{"when", when}}));
  for (const auto& [op, group] : e.collectives) {
    const prometheus::Labels labels = With(e.labels, {{"op", op}, {"group", group}});
    RemoveIfPresent(collective_duration_, labels);
    RemoveIfPresent(collective_bytes_, labels);
  }
}

WorkerMetrics::Rank::Rank(WorkerMetrics* metrics, std::string job_id, int rank, std::string kind, int replica_ranks)
    : metrics_(metrics),
      labels_{{"job_id", std::move(job_id)}, {"rank", absl::StrCat(rank)}},
      replica_ranks_(replica_ranks),
      running_(&metrics->running_.Add(With(labels_, {{"kind", std::move(kind)}}))) {
  running_->Set(1);
}

WorkerMetrics::Rank::~Rank() {
  metrics_->running_.Remove(running_);
  if (last_step_ != nullptr) metrics_->last_step_.Remove(last_step_);
  Ended ended;
  ended.labels = labels_;
  {
    absl::MutexLock lock(&mu_);
    ended.collectives = collectives_;
  }
  metrics_->EndRank(std::move(ended));
}

void WorkerMetrics::Rank::TrainingStarted() {
  if (last_step_ == nullptr) last_step_ = &metrics_->last_step_.Add(labels_);
  last_step_->Set(absl::ToDoubleSeconds(metrics_->clock_->Now() - absl::UnixEpoch()));
  // The counters exist from 0 on, so that rate() and increase() see the
  // first step too.
  if (step_duration_ == nullptr) step_duration_ = &metrics_->step_duration_.Add(labels_, StepBuckets());
  if (tokens_ == nullptr) tokens_ = &metrics_->tokens_.Add(labels_);
}

void WorkerMetrics::Rank::ObserveStep(double seconds, int64_t replica_tokens, double loss, int64_t param_bytes,
                                      int64_t grad_bytes, int64_t optimizer_bytes) {
  TrainingStarted();  // sets the last step's timestamp (and the series, if the loop did not say it started)
  step_duration_->Observe(seconds);
  tokens_->Increment(static_cast<double>(replica_tokens) / replica_ranks_);
  if (loss_ == nullptr) loss_ = &metrics_->loss_.Add(labels_);
  loss_->Set(loss);
  const int64_t bytes[] = {param_bytes, grad_bytes, optimizer_bytes};
  for (int i = 0; i < 3; ++i) {
    metrics_->tensor_bytes_.Add(With(labels_, {{"kind", kTensorKinds[i]}})).Set(static_cast<double>(bytes[i]));
  }
}

void WorkerMetrics::Rank::ObserveEval(double loss) {
  if (eval_loss_ == nullptr) eval_loss_ = &metrics_->eval_loss_.Add(labels_);
  eval_loss_->Set(loss);
}

void WorkerMetrics::Rank::LossScalingStarted() {
  if (skipped_updates_ == nullptr) skipped_updates_ = &metrics_->skipped_updates_.Add(labels_);
}

void WorkerMetrics::Rank::ObserveLossScale(double scale, bool update_skipped) {
  LossScalingStarted();
  if (loss_scale_ == nullptr) loss_scale_ = &metrics_->loss_scale_.Add(labels_);
  loss_scale_->Set(scale);
  if (update_skipped) skipped_updates_->Increment();
}

void WorkerMetrics::Rank::ObserveDevicePool(int64_t reserved_bytes, int64_t used_bytes) {
  metrics_->device_pool_bytes_.Add(With(labels_, {{"kind", "reserved"}})).Set(static_cast<double>(reserved_bytes));
  metrics_->device_pool_bytes_.Add(With(labels_, {{"kind", "used"}})).Set(static_cast<double>(used_bytes));
}

void WorkerMetrics::Rank::ObserveGradSync(int64_t bucket_bytes, int64_t overlapped_bytes) {
  metrics_->dp_bucket_bytes_.Add(With(labels_, {{"when", "backward"}})).Increment(static_cast<double>(overlapped_bytes));
  metrics_->dp_bucket_bytes_.Add(With(labels_, {{"when", "after"}}))
      .Increment(static_cast<double>(std::max<int64_t>(bucket_bytes - overlapped_bytes, 0)));
}

InstrumentedCommunicator::Observer WorkerMetrics::Rank::CollectiveObserver(const std::string& group) {
  return [this, group](const char* op, int64_t bytes, absl::Duration elapsed) {
    ObserveCollective(group, op, bytes, elapsed);
  };
}

void WorkerMetrics::Rank::ObserveCollective(const std::string& group, const char* op, int64_t bytes,
                                            absl::Duration elapsed) {
  {
    absl::MutexLock lock(&mu_);
    collectives_.emplace(op, group);
  }
  const prometheus::Labels labels = With(labels_, {{"op", op}, {"group", group}});
  metrics_->collective_duration_.Add(labels, CollectiveBuckets()).Observe(absl::ToDoubleSeconds(elapsed));
  metrics_->collective_bytes_.Add(labels).Increment(static_cast<double>(bytes));
}

}  // namespace colod
