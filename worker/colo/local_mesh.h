// Every rank of a mesh as a thread of this process, communicating with Gloo
// over loopback TCP and rendezvousing through an in-memory store: how
// `coloctl forward` runs a model before jobs run on the daemons, and how the
// multi-rank tests run theirs.
#ifndef COLOD_WORKER_COLO_LOCAL_MESH_H_
#define COLOD_WORKER_COLO_LOCAL_MESH_H_

#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "worker/colo/mesh.h"
#include "worker/colo/process_group.h"

namespace colod {

struct LocalMeshOptions {
  // Rendezvous and per-collective timeout.
  absl::Duration timeout = absl::Seconds(60);
  // Wrap each communicator in an InstrumentedCommunicator (per-op counts).
  bool instrument = false;
};

// Runs body(rank, pg) on every rank of `mesh` at once and joins them; the
// process groups (and their Gloo contexts) outlive every rank. Returns OK
// or the error of the lowest failing rank, prefixed with its number. Thread-safe.
// OK, or the error of the lowest failing rank prefixed with its number.
absl::Status FirstRankError(const std::vector<absl::Status>& results);

absl::Status RunLocalMesh(const DeviceMesh& mesh, const std::function<absl::Status(int rank, ProcessGroup& pg)>& body,
                          LocalMeshOptions options = {});

}  // namespace colod

#endif  // COLOD_WORKER_COLO_LOCAL_MESH_H_
