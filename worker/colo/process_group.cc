#include "worker/colo/process_group.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace colod {

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Create(DeviceMesh mesh, int rank,
                                                                  CommFactory factory,
                                                                  absl::Duration timeout) {
  if (rank < 0 || rank >= mesh.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the mesh of ", mesh.world_size(), " ranks"));
  }
  return std::unique_ptr<ProcessGroup>(new ProcessGroup(std::move(mesh), rank, std::move(factory), timeout));
}

ProcessGroup::CommFactory ProcessGroup::GlooFactory(Store* store, GlooCommunicator::Options options) {
  return [store, options](const std::string& prefix, int rank,
                          int size) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    GlooCommunicator::Options o = options;
    o.prefix = absl::StrCat(options.prefix, "/", prefix);
    ASSIGN_OR_RETURN(std::unique_ptr<GlooCommunicator> c, GlooCommunicator::Create(*store, rank, size, o));
    return std::unique_ptr<Communicator>(std::move(c));
  };
}

absl::StatusOr<Communicator*> ProcessGroup::Comm(const std::string& axis) {
  absl::MutexLock lock(&mu_);
  auto it = comms_.find(axis);
  if (it != comms_.end()) return it->second.get();
  ASSIGN_OR_RETURN(std::vector<int> group, mesh_.GroupOf(axis, rank_));
  const int local = static_cast<int>(std::find(group.begin(), group.end(), rank_) - group.begin());
  // The member list names the group uniquely, whatever the axis is called.
  const std::string prefix = absl::StrCat(axis, "/", absl::StrJoin(group, "_"));
  ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c,
                   factory_(prefix, local, static_cast<int>(group.size())));
  Communicator* raw = c.get();
  comms_.emplace(axis, std::move(c));
  return raw;
}

}  // namespace colod
