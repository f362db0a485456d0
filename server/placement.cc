#include "server/placement.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace colod {

absl::StatusOr<v1::MeshSpec> AssignRanks(const DeviceMesh& mesh, const std::vector<v1::WorkerInfo>& workers) {
  const int world = mesh.world_size();
  if (static_cast<int>(workers.size()) < world) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the mesh has ", world, " ranks but only ", workers.size(), " idle workers"));
  }
  ASSIGN_OR_RETURN(int tp, mesh.AxisSize("tp"));
  // Free workers per host, each host's in device-ordinal order.
  std::map<std::string, std::vector<const v1::WorkerInfo*>> free;
  for (const v1::WorkerInfo& w : workers) free[w.host()].push_back(&w);
  auto by_ordinal = [](const v1::WorkerInfo* a, const v1::WorkerInfo* b) {
    return std::make_tuple(a->device_ordinal(), a->worker_id(), a->address()) <
           std::make_tuple(b->device_ordinal(), b->worker_id(), b->address());
  };
  for (auto& [host, list] : free) std::sort(list.begin(), list.end(), by_ordinal);

  v1::MeshSpec spec = mesh.ToProto();
  std::vector<const v1::WorkerInfo*> placed;
  for (int group = 0; group < world / tp; ++group) {
    // Best fit: the host with the fewest free workers that holds the group.
    std::string best;
    size_t best_free = 0;
    for (const auto& [host, list] : free) {
      if (list.size() >= static_cast<size_t>(tp) && (best.empty() || list.size() < best_free)) {
        best = host;
        best_free = list.size();
      }
    }
    for (int k = 0; k < tp; ++k) {
      std::string host = best;
      if (host.empty()) {  // no host holds the whole group: (host, ordinal) order
        for (const auto& [h, list] : free) {
          if (!list.empty()) {
            host = h;
            break;
          }
        }
      }
      auto& list = free[host];
      placed.push_back(list.front());
      list.erase(list.begin());
      if (list.empty()) free.erase(host);
    }
  }
  spec.clear_ranks();
  for (int r = 0; r < world; ++r) {
    v1::RankAssignment* a = spec.add_ranks();
    a->set_rank(r);
    a->set_worker_id(placed[r]->worker_id());
    a->set_worker_address(placed[r]->address());
    a->set_host(placed[r]->host());
    a->set_device_ordinal(placed[r]->device_ordinal());
  }
  return spec;
}

}  // namespace colod
