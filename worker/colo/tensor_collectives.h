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
#include "absl/time/time.h"
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

}  // namespace colod

#endif  // COLOD_WORKER_COLO_TENSOR_COLLECTIVES_H_
