// How a rank's process group gets its communicators: the one place that
// picks Gloo (host tensors) or NCCL (CUDA tensors) and wires the abort
// signal through. Shared by the worker daemon's ranks (JobRunner, over the
// coordinator's store) and by ranks run as threads of one process
// (RunLocalRanks: `coloctl forward` / `coloctl train`, the multi-rank tests).
#ifndef COLOD_WORKER_COLO_RANK_GROUP_H_
#define COLOD_WORKER_COLO_RANK_GROUP_H_

#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "spec/mesh.h"
#include "worker/colo/process_group.h"
#include "worker/comm/abort_signal.h"
#include "worker/comm/communicator.h"
#include "worker/comm/store.h"
#include "worker/tensor/device.h"

namespace colod {

// Wraps each communicator a group makes (metrics, a flight recorder); it
// must return a communicator that owns `inner`.
using CommWrapper =
    std::function<std::unique_ptr<Communicator>(std::unique_ptr<Communicator> inner, const ProcessGroup::GroupInfo&)>;

struct RankGroupOptions {
  // The CPU: host tensors over Gloo. A CUDA device: device tensors over
  // NCCL on it.
  Device device = Device::Cpu();
  // Gloo: the address this rank's pairs listen on and advertise to peers.
  std::string host = "127.0.0.1";
  // Bounds each rendezvous and each collective.
  absl::Duration timeout = absl::Seconds(60);
  // ProcessGroup::Abort fires it; communicators being made (a Gloo
  // rendezvous, NCCL init and splits) check it. Null: one of the group's own.
  std::shared_ptr<AbortSignal> abort_signal;
  // May be empty.
  CommWrapper wrap;
  // Gloo: GlooCommunicator::Options::kept_scratch_bytes (a TENSOR job's
  // groups keep little; a training job's buckets reuse theirs).
  size_t kept_scratch_bytes = std::numeric_limits<size_t>::max();
};

// Rank `rank` of `mesh`, rendezvousing through `store` (which must outlive
// the group). Communicators are made on first use of an axis; over NCCL
// they are splits of one world communicator, which every rank must make in
// the same order: call InitAxes() before the first collective. INVALID_ARGUMENT
// for a rank outside the mesh; FAILED_PRECONDITION for a CUDA device in a
// build without CUDA.
absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateRankGroup(const DeviceMesh& mesh, int rank, Store* store,
                                                              RankGroupOptions options);

struct LocalRanksOptions {
  // Rank r on CUDA device r over NCCL (FAILED_PRECONDITION with fewer
  // devices than ranks, or without CUDA); else host tensors over Gloo on
  // loopback.
  bool cuda = false;
  // Each rendezvous and collective.
  absl::Duration timeout = absl::Seconds(60);
  // May be empty.
  CommWrapper wrap;
};

// Runs body(rank, pg) on every rank of `mesh` as threads of this process,
// rendezvousing through an in-memory store, and joins them; the groups
// outlive every rank, and over NCCL every axis is made before `body` runs.
// When a rank fails, every rank's group is aborted with its error, so the
// others stop at their current or next collective instead of waiting out
// the timeout; not for a drained end (IsDrained: every rank stops on its
// own after the same step), nor for a failure that followed a peer's
// (IsPeerCaused: the peer fails of its own too, and aborts the others).
// Returns OK, or the error of the rank that failed first, prefixed with its
// number, its marks kept: first of those that failed of their own, then of
// those whose failure followed a peer's, then of those drained (only where
// no rank failed otherwise, still marked drained). Thread-safe.
absl::Status RunLocalRanks(const DeviceMesh& mesh, const std::function<absl::Status(int rank, ProcessGroup& pg)>& body,
                           LocalRanksOptions options = {});

}  // namespace colod

#endif  // COLOD_WORKER_COLO_RANK_GROUP_H_
