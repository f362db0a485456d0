#include "worker/colo/local_mesh.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/comm/rendezvous_store.h"
#include "worker/comm/instrumented_communicator.h"
#include "worker/comm/store.h"

namespace colod {

absl::Status RunLocalMesh(const DeviceMesh& mesh, const std::function<absl::Status(int, ProcessGroup&)>& body,
                          LocalMeshOptions options) {
  auto shared = std::make_shared<RendezvousStore>();
  const int n = mesh.world_size();
  std::vector<std::unique_ptr<InMemoryStore>> stores(n);
  std::vector<std::unique_ptr<ProcessGroup>> groups(n);
  for (int r = 0; r < n; ++r) {
    stores[r] = std::make_unique<InMemoryStore>(shared, "colo");
    GlooCommunicator::Options o;
    o.timeout = options.timeout;
    ProcessGroup::CommFactory gloo = ProcessGroup::GlooFactory(stores[r].get(), o);
    ProcessGroup::CommFactory factory = gloo;
    if (options.instrument) {
      factory = [gloo](const ProcessGroup::GroupInfo& g) -> absl::StatusOr<std::unique_ptr<Communicator>> {
        ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, gloo(g));
        return std::unique_ptr<Communicator>(new InstrumentedCommunicator(std::move(c)));
      };
    }
    ASSIGN_OR_RETURN(groups[r], ProcessGroup::Create(mesh, r, factory, options.timeout));
  }
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { results[r] = body(r, *groups[r]); });
  for (auto& t : threads) t.join();
  return FirstRankError(results);
}

absl::Status FirstRankError(const std::vector<absl::Status>& results) {
  for (size_t r = 0; r < results.size(); ++r) {
    if (!results[r].ok()) {
      return absl::Status(results[r].code(), absl::StrCat("rank ", r, ": ", results[r].message()));
    }
  }
  return absl::OkStatus();
}

}  // namespace colod
