// colod_rpc_duration_seconds{method,code}: the coordinator's RPC latency
// histogram, shared by every service it serves (CoordinatorService,
// TensorService).
#ifndef COLOD_SERVER_RPC_METRICS_H_
#define COLOD_SERVER_RPC_METRICS_H_

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace colod {

// The family in `registry` (registered on first use; later calls return
// the same family). Thread-safe.
prometheus::Family<prometheus::Histogram>& RpcDurationFamily(prometheus::Registry& registry);

// Records one call of `method` that ended with `status` after `elapsed`.
void ObserveRpc(prometheus::Family<prometheus::Histogram>& family, const char* method, const absl::Status& status,
                absl::Duration elapsed);

}  // namespace colod

#endif  // COLOD_SERVER_RPC_METRICS_H_
