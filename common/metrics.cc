#include "common/metrics.h"

#include <exception>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/net.h"
#include "common/status_macros.h"
#include "common/version.h"
#include "prometheus/gauge.h"

namespace colod {

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    absl::string_view listen, std::shared_ptr<prometheus::Registry> registry) {
  ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(listen, "--metrics-listen", /*allow_zero_port=*/true));
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  try {
    server->exposer_ = std::make_unique<prometheus::Exposer>(hp.ToString(), /*num_threads=*/2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("cannot serve /metrics on ", hp.ToString(), ": ", e.what()));
  }
  std::vector<int> ports = server->exposer_->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    return absl::UnavailableError(absl::StrCat("cannot serve /metrics on ", hp.ToString(),
                                               ": no listening port was reported"));
  }
  server->port_ = ports[0];
  hp.port = ports[0];
  server->address_ = hp.ToString();
  server->registry_ = std::move(registry);
  server->exposer_->RegisterCollectable(server->registry_);
  return server;
}

void AddBuildInfo(prometheus::Registry& registry, absl::string_view component) {
#ifdef COLOD_WITH_CUDA
  const char* cuda = "true";
#else
  const char* cuda = "false";
#endif
  prometheus::BuildGauge()
      .Name("colod_build_info")
      .Help("Build of this colod binary: always 1, the facts are in the labels.")
      .Register(registry)
      .Add({{"component", std::string(component)}, {"version", kVersion}, {"cuda", cuda}})
      .Set(1);
}

}  // namespace colod
