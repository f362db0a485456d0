#include "worker/colo/process_group.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace colod {

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::Create(DeviceMesh mesh, int rank,
                                                                  CommFactory factory,
                                                                  absl::Duration timeout,
                                                                  std::shared_ptr<AbortSignal> abort_signal) {
  if (rank < 0 || rank >= mesh.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank ", rank, " is outside the mesh of ", mesh.world_size(), " ranks"));
  }
  return std::unique_ptr<ProcessGroup>(
      new ProcessGroup(std::move(mesh), rank, std::move(factory), timeout, std::move(abort_signal)));
}

ProcessGroup::CommFactory ProcessGroup::GlooFactory(Store* store, GlooCommunicator::Options options) {
  return [store, options](const GroupInfo& g) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    GlooCommunicator::Options o = options;
    o.prefix = absl::StrCat(options.prefix, "/", g.prefix);
    ASSIGN_OR_RETURN(std::unique_ptr<GlooCommunicator> c, GlooCommunicator::Create(*store, g.rank, g.size, o));
    return std::unique_ptr<Communicator>(std::move(c));
  };
}

absl::StatusOr<Communicator*> ProcessGroup::Comm(const std::string& axis) {
  GroupInfo info;
  {
    absl::MutexLock lock(&mu_);
    // Another thread making this axis' communicator: wait for it.
    while (creating_.count(axis) > 0) made_cv_.Wait(&mu_);
    auto it = comms_.find(axis);
    if (it != comms_.end()) return it->second.get();
    RETURN_IF_ERROR(abort_signal_->Check());
    if (auto f = failed_.find(axis); f != failed_.end()) return f->second;
    // An axis the mesh does not have (a 2D layer's probe) is not a failure.
    // (The mesh's arithmetic: no blocking call under the lock.)
    ASSIGN_OR_RETURN(info, InfoOf(axis));
    creating_.insert(axis);
  }
  absl::StatusOr<std::unique_ptr<Communicator>> made = factory_(info);
  Communicator* raw = nullptr;
  {
    absl::MutexLock lock(&mu_);
    creating_.erase(axis);
    made_cv_.SignalAll();
    if (!made.ok()) {
      // Said as not made again: the job's group is broken (AsyncError).
      const absl::Status failed(made.status().code(), absl::StrCat(made.status().message(), " (the communicator of ",
                                                                   axis, " could not be made; it is not tried again)"));
      failed_.emplace(axis, failed);
      if (first_failed_.ok()) first_failed_ = failed;
      return failed;
    }
    raw = made->get();
    comms_.emplace(axis, *std::move(made));
  }
  // Aborted while it was being made: it must not outlive the abort (aborted
  // outside the lock, like every abort).
  absl::Status aborted = abort_signal_->Check();
  if (!aborted.ok()) raw->Abort(aborted);
  return raw;
}

absl::StatusOr<ProcessGroup::GroupInfo> ProcessGroup::InfoOf(const std::string& axis) const {
  // "pp#back": another communicator of the pp groups (its own rendezvous,
  // and its own thread on backends that have one).
  const std::string base = axis.substr(0, axis.find('#'));
  ASSIGN_OR_RETURN(auto groups, mesh_.Groups(base));
  GroupInfo info;
  info.axis = axis;
  for (size_t i = 0; i < groups.size(); ++i) {
    const std::vector<int>& group = groups[i];
    auto at = std::find(group.begin(), group.end(), rank_);
    if (at == group.end()) continue;
    info.rank = static_cast<int>(at - group.begin());
    info.size = static_cast<int>(group.size());
    info.color = static_cast<int>(i);
    // The member list names the group uniquely, whatever the axis is called.
    info.prefix = absl::StrCat(axis, "/", absl::StrJoin(group, "_"));
  }
  return info;
}

absl::Status ProcessGroup::Barrier() {
  for (const MeshAxis& axis : mesh_.axes()) {
    ASSIGN_OR_RETURN(Communicator * comm, Comm(axis.name));
    RETURN_IF_ERROR(comm->Barrier()->Wait(timeout_));
  }
  return absl::OkStatus();
}

absl::Status ProcessGroup::AsyncError() {
  std::vector<Communicator*> comms;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [axis, comm] : comms_) comms.push_back(comm.get());
  }
  // A communicator's own error first: it is the cause (a peer gone) where a
  // later axis' rendezvous then failed for want of that peer.
  for (Communicator* c : comms) RETURN_IF_ERROR(c->AsyncError());
  // A communicator that could not be made broke the group as one that
  // failed does: its calls all fail from then on.
  absl::MutexLock lock(&mu_);
  if (!first_failed_.ok()) return first_failed_;
  return absl::OkStatus();
}

void ProcessGroup::Abort(const absl::Status& reason) {
  // First the signal: communicators being made stop waiting, and NCCL's
  // watchdog aborts those a factory keeps (the world communicator).
  abort_signal_->Abort(reason);
  std::vector<Communicator*> comms;
  {
    absl::MutexLock lock(&mu_);  // never held while a communicator is made
    for (auto& [axis, comm] : comms_) comms.push_back(comm.get());
  }
  // Communicators live as long as the group, which the caller keeps alive.
  for (Communicator* c : comms) c->Abort(reason);
}

absl::Status ProcessGroup::InitAxes(std::vector<std::string> axes) {
  if (axes.empty()) {
    for (const MeshAxis& a : mesh_.axes()) axes.push_back(a.name);
    auto tp = mesh_.AxisIndices("tp");
    if (tp.ok() && tp->size() > 1) axes.push_back("tp");  // the whole split tp group
  }
  for (const std::string& axis : axes) RETURN_IF_ERROR(Comm(axis).status());
  return absl::OkStatus();
}

}  // namespace colod
