// Rank assignment: which worker runs each global rank of a job's mesh.
//
// Deterministic and stable: the result depends only on the set of workers
// (not on the order they are listed in), so the same cluster gives the same
// placement every time. Tensor-parallel groups are consecutive ranks (tp is
// the innermost axis, worker/colo/mesh.h); each is packed onto one host where
// one has enough free workers — the host with the fewest free workers that
// still fits (best fit, ties by host name), keeping larger hosts whole for
// later groups — and within a host ranks follow device ordinal. A group no
// single host can hold takes the free workers in (host, ordinal) order.
//
// Thread-safety: a pure function.
#ifndef COLOD_SERVER_PLACEMENT_H_
#define COLOD_SERVER_PLACEMENT_H_

#include <vector>

#include "absl/status/statusor.h"
#include "colod/v1/mesh.pb.h"
#include "colod/v1/worker.pb.h"
#include "worker/colo/mesh.h"

namespace colod {

// `mesh`'s MeshSpec (axes, groups) with `ranks` filled from `workers` (the
// idle ones to choose from). RESOURCE_EXHAUSTED naming both numbers when
// there are fewer workers than ranks.
absl::StatusOr<v1::MeshSpec> AssignRanks(const DeviceMesh& mesh, const std::vector<v1::WorkerInfo>& workers);

}  // namespace colod

#endif  // COLOD_SERVER_PLACEMENT_H_
