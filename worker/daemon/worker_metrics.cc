#include "worker/daemon/worker_metrics.h"

namespace colod {
namespace {

prometheus::Histogram::BucketBoundaries StepBuckets() {
  return {0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100};
}

prometheus::Histogram::BucketBoundaries CollectiveBuckets() {
  return {0.00001, 0.00003, 0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10};
}

}  // namespace

WorkerMetrics::WorkerMetrics(prometheus::Registry& registry)
    : step_duration_(prometheus::BuildHistogram()
                         .Name("colod_step_duration_seconds")
                         .Help("Wall time of each training step on this worker.")
                         .Register(registry)
                         .Add({}, StepBuckets())),
      tokens_(prometheus::BuildCounter()
                  .Name("colod_tokens_total")
                  .Help("Tokens this worker's rank trained on (its data-parallel replica's share).")
                  .Register(registry)
                  .Add({})),
      loss_(prometheus::BuildGauge()
                .Name("colod_loss")
                .Help("Loss of the last training step (mean next-token cross-entropy of the global batch).")
                .Register(registry)
                .Add({})),
      tensor_bytes_(prometheus::BuildGauge()
                        .Name("colod_tensor_bytes")
                        .Help("Bytes this worker's rank holds, by kind: params, grads, optimizer_state.")
                        .Register(registry)),
      collective_duration_(prometheus::BuildHistogram()
                               .Name("colod_collective_duration_seconds")
                               .Help("Time from submitting a collective to seeing it complete, by op and mesh axis.")
                               .Register(registry)),
      collective_bytes_(prometheus::BuildCounter()
                            .Name("colod_collective_bytes_total")
                            .Help("Input bytes of this rank's collectives, by op and mesh axis.")
                            .Register(registry)) {
  for (const char* kind : {"params", "grads", "optimizer_state"}) tensor_bytes_.Add({{"kind", kind}}).Set(0);
}

void WorkerMetrics::ObserveStep(double seconds, int64_t tokens, double loss, int64_t param_bytes, int64_t grad_bytes,
                                int64_t optimizer_bytes) {
  step_duration_.Observe(seconds);
  tokens_.Increment(static_cast<double>(tokens));
  loss_.Set(loss);
  tensor_bytes_.Add({{"kind", "params"}}).Set(static_cast<double>(param_bytes));
  tensor_bytes_.Add({{"kind", "grads"}}).Set(static_cast<double>(grad_bytes));
  tensor_bytes_.Add({{"kind", "optimizer_state"}}).Set(static_cast<double>(optimizer_bytes));
}

InstrumentedCommunicator::Observer WorkerMetrics::CollectiveObserver(const std::string& group) {
  return [this, group](const char* op, int64_t bytes, absl::Duration elapsed) {
    collective_duration_.Add({{"op", op}, {"group", group}}, CollectiveBuckets())
        .Observe(absl::ToDoubleSeconds(elapsed));
    collective_bytes_.Add({{"op", op}, {"group", group}}).Increment(static_cast<double>(bytes));
  };
}

}  // namespace colod
