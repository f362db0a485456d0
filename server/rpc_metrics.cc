#include "server/rpc_metrics.h"

namespace colod {
namespace {

// Buckets from 100us to ~100s, for RPCs from KvGet to long KvWaits.
const prometheus::Histogram::BucketBoundaries& RpcBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries{
      0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3, 10, 30, 100};
  return *buckets;
}

}  // namespace

prometheus::Family<prometheus::Histogram>& RpcDurationFamily(prometheus::Registry& registry) {
  return prometheus::BuildHistogram()
      .Name("colod_rpc_duration_seconds")
      .Help("Coordinator RPC handling time, by method and status code.")
      .Register(registry);  // the registry merges a family registered again
}

void ObserveRpc(prometheus::Family<prometheus::Histogram>& family, const char* method, const absl::Status& status,
                absl::Duration elapsed) {
  family.Add({{"method", method}, {"code", absl::StatusCodeToString(status.code())}}, RpcBuckets())
      .Observe(absl::ToDoubleSeconds(elapsed));
}

}  // namespace colod
