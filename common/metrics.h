// Prometheus /metrics endpoint shared by every daemon.
#ifndef COLOD_COMMON_METRICS_H_
#define COLOD_COMMON_METRICS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "CivetServer.h"
#include "prometheus/registry.h"

namespace colod {

// Serves a registry's metrics over HTTP at /metrics in the Prometheus text
// format (prometheus-cpp's serializer on a civetweb server). Only the
// registry's own families are served: prometheus-cpp's Exposer would add its
// exposer_* self-metrics, one of them in microseconds, against the
// base-units rule. Start() binds immediately; port 0 picks a free port,
// reported by port(). Thread-safe; metrics are read on civetweb's threads.
class MetricsServer {
 public:
  // `listen` is HOST:PORT. UNAVAILABLE if the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      absl::string_view listen, std::shared_ptr<prometheus::Registry> registry);

  ~MetricsServer();

  int port() const { return port_; }
  // HOST:PORT with the bound port.
  const std::string& address() const { return address_; }

 private:
  class Handler;
  MetricsServer() = default;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<Handler> handler_;
  std::unique_ptr<CivetServer> server_;  // stopped (first) by its destructor
  int port_ = 0;
  std::string host_;  // as listened on, without brackets
  std::string address_;
};

// Adds colod_build_info{component, version, cuda} = 1 to `registry`.
// `cuda` says whether the binary was built with CUDA.
void AddBuildInfo(prometheus::Registry& registry, absl::string_view component);

}  // namespace colod

#endif  // COLOD_COMMON_METRICS_H_
