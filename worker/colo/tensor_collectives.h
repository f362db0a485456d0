// Collectives on Tensors along a group: the building blocks that DistSpec
// conversions (redistribute.h) and the sharded layers (worker/nn) share. Each
// waits for its collective with Work::WaitOnDevice: on CUDA the device waits,
// not the host, and a collective that fails later is reported by the
// communicator's AsyncError (checked where results are read on the host:
// the trainer's step, the grad norm). The tensors may be views; the results
// are new contiguous tensors on the input's device.
#ifndef COLOD_WORKER_COLO_TENSOR_COLLECTIVES_H_
#define COLOD_WORKER_COLO_TENSOR_COLLECTIVES_H_

#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "worker/colo/process_group.h"
#include "worker/comm/communicator.h"
#include "worker/tensor/tensor.h"

namespace colod {

// Every rank's `t` (all of one shape), in local-rank order.
absl::StatusOr<std::vector<Tensor>> AllGatherPieces(const Tensor& t, Communicator& comm, absl::Duration timeout);
// The pieces concatenated along `dim`: rank j's block lands at block j.
absl::StatusOr<Tensor> AllGatherDim(const Tensor& t, int64_t dim, Communicator& comm, absl::Duration timeout);

// blocks[k] (one per rank, all of one shape) reduced over the group and
// delivered to local rank k: this rank's reduced block.
absl::StatusOr<Tensor> ReduceScatterBlocks(const std::vector<Tensor>& blocks, Communicator& comm,
                                           absl::Duration timeout, ReduceOp op = ReduceOp::kSum);
// `t` split into equal blocks along `dim`, reduce-scattered.
absl::StatusOr<Tensor> ReduceScatterDim(const Tensor& t, int64_t dim, Communicator& comm, absl::Duration timeout,
                                        ReduceOp op = ReduceOp::kSum);

// Gloo moves host buffers and NCCL device buffers: FAILED_PRECONDITION for a
// tensor on the other kind of device, naming the group it needs.
absl::Status CheckBackend(const Tensor& t, const Communicator& comm);

// All-reduces contiguous `t` in place over the group, waited on by the
// device (Work::WaitOnDevice): on CUDA nothing is read on the host. A group
// of one leaves `t` as it is; otherwise `t` must be on the backend's kind of
// device (CheckBackend).
absl::Status AllReduceInPlace(Tensor& t, ReduceOp op, Communicator& comm, absl::Duration timeout);

// Local rank `root`'s `t` on every rank (`t` gives the shape elsewhere).
absl::StatusOr<Tensor> BroadcastFrom(const Tensor& t, int root, Communicator& comm, absl::Duration timeout);

// 1 where `mine` is true on any rank of the mesh, else 0: a one-element f32
// tensor on `device`, all-reduced (max) along each mesh axis in turn and
// never read on the host (a CUDA rank's stream waits for it; nothing
// waits for the device). Made on the device but for a true `mine` (a copy
// from the host). Collective over the whole mesh.
absl::StatusOr<Tensor> AnyOverMesh(ProcessGroup& pg, bool mine, const Device& device);

// A barrier that says whether every rank of the mesh got `mine` OK
// (AnyOverMesh of its failure, read on the host): it returns once every
// rank called it, so that no rank goes on (removes a directory the others
// still write into) while another is still at the work it agrees on.
// Returns `mine` where it is an error, whatever the agreement's outcome;
// else the agreement's error where it failed (a peer lost; a communicator's
// sticky error, ProcessGroup::AsyncError, included); else, where
// another rank's was an error, ABORTED with `peer_failed` as its message,
// marked IsPeerCaused (the peer's own error says why: the job's reason is
// the cause, not this consequence); else OK. Collective over the whole
// mesh.
absl::Status AgreeOverMesh(ProcessGroup& pg, const absl::Status& mine, const Device& device,
                           absl::string_view peer_failed);
// The same over one group of the mesh (ProcessGroup::Comm(`group`): "dp",
// say) instead of the whole mesh: collective over that group's ranks only,
// for work that only they do together (a sum over dp). A group of one
// returns `mine` (and the sticky error).
absl::Status AgreeOverGroup(ProcessGroup& pg, const std::string& group, const absl::Status& mine, const Device& device,
                            absl::string_view peer_failed);

// Whether every rank of the mesh holds the same `mine`: OK, else
// FAILED_PRECONDITION "`what`: this rank's `mine`, another's X" (the
// mesh's largest or smallest, whichever differs). Collective over the whole
// mesh (one all-reduce of two 64-bit values along each axis). `mine` is
// not INT64_MIN (INVALID_ARGUMENT).
absl::Status SameOverMesh(ProcessGroup& pg, int64_t mine, const Device& device, absl::string_view what);

}  // namespace colod

#endif  // COLOD_WORKER_COLO_TENSOR_COLLECTIVES_H_
