// ProcessGroups over NCCL: one world communicator per rank, and one
// ncclCommSplit of it per mesh axis group. Built where CUDA is
// (bazel/cuda.bzl); used for CUDA tensors.
#ifndef COLOD_WORKER_COLO_NCCL_PROCESS_GROUP_H_
#define COLOD_WORKER_COLO_NCCL_PROCESS_GROUP_H_

#include <functional>

#include "worker/colo/process_group.h"
#include "worker/comm/nccl/nccl_communicator.h"
#include "worker/comm/store.h"

namespace colod {

// A factory for ProcessGroup::Create: the first group it makes first creates
// the world communicator of `world_size` ranks (unique id through `store`,
// which must outlive the group); each group is then world.Split(color =
// the group's index, key = local rank, named after the axis). Pass the
// group's abort signal in options.abort_signal. Every rank of the mesh must make the
// same groups in the same order (ProcessGroup::InitAxes does), since a split
// is collective over the world. Thread-safe.
ProcessGroup::CommFactory NcclFactory(Store* store, NcclCommunicator::Options options, int world_rank,
                                      int world_size);

}  // namespace colod

#endif  // COLOD_WORKER_COLO_NCCL_PROCESS_GROUP_H_
