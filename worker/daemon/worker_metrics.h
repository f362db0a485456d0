// The worker's training and communication metrics (Prometheus, base units).
#ifndef COLOD_WORKER_DAEMON_WORKER_METRICS_H_
#define COLOD_WORKER_DAEMON_WORKER_METRICS_H_

#include <cstdint>
#include <string>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"
#include "worker/comm/instrumented_communicator.h"

namespace colod {

// Registers, on construction:
//   colod_step_duration_seconds                  histogram of training steps
//   colod_tokens_total                           tokens this rank trained on
//   colod_loss                                   the last step's loss
//   colod_tensor_bytes{kind}                     params, grads, optimizer_state
//   colod_collective_duration_seconds{op,group}  histogram, submission to completion
//   colod_collective_bytes_total{op,group}       this rank's input bytes
// `group` is the mesh axis ("tp", "dp", "tp_row", ...): bounded.
//
// Thread-safe (prometheus-cpp metrics are).
class WorkerMetrics {
 public:
  explicit WorkerMetrics(prometheus::Registry& registry);

  void ObserveStep(double seconds, int64_t tokens, double loss, int64_t param_bytes, int64_t grad_bytes,
                   int64_t optimizer_bytes);
  // An observer for the communicators of mesh axis `group`.
  InstrumentedCommunicator::Observer CollectiveObserver(const std::string& group);

 private:
  prometheus::Histogram& step_duration_;
  prometheus::Counter& tokens_;
  prometheus::Gauge& loss_;
  prometheus::Family<prometheus::Gauge>& tensor_bytes_;
  prometheus::Family<prometheus::Histogram>& collective_duration_;
  prometheus::Family<prometheus::Counter>& collective_bytes_;
};

}  // namespace colod

#endif  // COLOD_WORKER_DAEMON_WORKER_METRICS_H_
