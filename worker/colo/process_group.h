// One rank's view of a device mesh, with a communicator per axis.
#ifndef COLOD_WORKER_COLO_PROCESS_GROUP_H_
#define COLOD_WORKER_COLO_PROCESS_GROUP_H_

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "spec/mesh.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/communicator.h"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/store.h"

namespace colod {

// For rank `rank` of `mesh`: the communicator of its group along each axis,
// created on first use and cached (each group's communicator exists once).
// Every rank of a group must first use an axis at the same point of its
// program, as collectives require anyway; with NCCL (worker/colo/
// nccl_process_group.h) the first use of an axis splits the world
// communicator and so is collective over the whole mesh: call InitAxes.
//
// Thread-safe.
class ProcessGroup {
 public:
  // The group a communicator is made for.
  struct GroupInfo {
    std::string axis;
    std::string prefix;  // names the group uniquely in a rendezvous store
    int rank = 0;        // local rank in the group
    int size = 1;
    int color = 0;       // the group's index among the axis' groups
  };
  using CommFactory = std::function<absl::StatusOr<std::unique_ptr<Communicator>>(const GroupInfo& group)>;

  // INVALID_ARGUMENT for a rank outside the mesh. `abort_signal`, if set, is
  // the one the factory's communicators were given (e.g.
  // NcclCommunicator::Options::abort_signal): Abort fires it, which ends
  // communicators still being made and those the factory keeps.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> Create(DeviceMesh mesh, int rank,
                                                              CommFactory factory,
                                                              absl::Duration timeout = absl::Minutes(5),
                                                              std::shared_ptr<AbortSignal> abort_signal = nullptr);
  // Gloo communicators rendezvousing through `store` (which must outlive the group).
  static CommFactory GlooFactory(Store* store, GlooCommunicator::Options options);

  const DeviceMesh& mesh() const { return mesh_; }
  int rank() const { return rank_; }
  // How long a collective may take before it is DEADLINE_EXCEEDED.
  absl::Duration timeout() const { return timeout_; }
  absl::StatusOr<int> LocalRank(const std::string& axis) const { return mesh_.LocalRank(axis, rank_); }
  absl::StatusOr<int> AxisSize(const std::string& axis) const { return mesh_.AxisSize(axis); }
  // ColossalAI's names: rank % tp and rank / tp on a {dp, tp} mesh.
  absl::StatusOr<int> tp_local_rank() const { return LocalRank("tp"); }
  absl::StatusOr<int> dp_local_rank() const { return LocalRank("dp"); }

  // The communicator of this rank's group along `axis`. "AXIS#NAME" is
  // another communicator of the same groups, e.g. a pipeline's gradients
  // ("pp#back") on their own channel beside its activations ("pp"), so that
  // a send one way never waits behind a send the other way. Made at first
  // use; one that could not be made is that error from then on.
  absl::StatusOr<Communicator*> Comm(const std::string& axis);
  // Creates the communicators of `axes` now, in order (all of the mesh's
  // axes, and "tp" where it is split, when empty). Collective.
  absl::Status InitAxes(std::vector<std::string> axes = {});
  // Returns once every rank of the mesh has called it: a barrier along each
  // mesh axis in turn. Collective over the whole mesh.
  absl::Status Barrier();
  // The first sticky error of this rank's communicators (Communicator::
  // AsyncError), else the first communicator that could not be made, or OK.
  // Collectives waited on the device fail here: check it after reading a
  // result on the host.
  absl::Status AsyncError();
  // Aborts every communicator created so far (Communicator::Abort) and the
  // ones being created (the abort signal): their collectives fail with
  // `reason`. Never waits for a communicator to be made: for stopping a rank
  // from another thread; the group is unusable afterwards.
  void Abort(const absl::Status& reason);
  // OK, or the reason of the first Abort: a rank checks it before what a
  // collective does not fence, such as putting a checkpoint in place (a
  // rank the coordinator gave up on may still be running). Never blocks.
  absl::Status Aborted() const { return abort_signal_->Check(); }

 private:
  ProcessGroup(DeviceMesh mesh, int rank, CommFactory factory, absl::Duration timeout,
               std::shared_ptr<AbortSignal> abort_signal)
      : mesh_(std::move(mesh)),
        rank_(rank),
        factory_(std::move(factory)),
        timeout_(timeout),
        abort_signal_(abort_signal != nullptr ? std::move(abort_signal) : std::make_shared<AbortSignal>()) {}

  // The group of this rank along `axis` (NOT_FOUND for an axis the mesh
  // lacks).
  absl::StatusOr<GroupInfo> InfoOf(const std::string& axis) const;

  const DeviceMesh mesh_;
  const int rank_;
  const CommFactory factory_;  // destroyed after comms_ (NCCL splits before their world)
  const absl::Duration timeout_;
  const std::shared_ptr<AbortSignal> abort_signal_;
  absl::Mutex mu_;
  // Communicators are made outside `mu_` (a rendezvous can take the whole
  // timeout); `creating_` names the axes being made.
  std::map<std::string, std::unique_ptr<Communicator>> comms_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> creating_ ABSL_GUARDED_BY(mu_);
  // Axes whose communicator could not be made, and why: a second rendezvous
  // under the same keys would read the first one's peer addresses (dead or
  // abandoned listeners) and wait out the timeout again.
  std::map<std::string, absl::Status> failed_ ABSL_GUARDED_BY(mu_);
  absl::Status first_failed_ ABSL_GUARDED_BY(mu_);  // the first of failed_ in time
  absl::CondVar made_cv_;  // signalled when an axis leaves creating_
};

}  // namespace colod

#endif  // COLOD_WORKER_COLO_PROCESS_GROUP_H_
