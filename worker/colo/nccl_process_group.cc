#include "worker/colo/nccl_process_group.h"

#include <memory>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/device.h"
#include "worker/colo/local_mesh.h"

#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"

namespace colod {
namespace {

// Owned by the factory's copies. A ProcessGroup destroys its communicators
// before its factory, so the world outlives its splits.
struct World {
  absl::Mutex mu;
  std::unique_ptr<NcclCommunicator> comm ABSL_GUARDED_BY(mu);
};

}  // namespace

ProcessGroup::CommFactory NcclFactory(Store* store, NcclCommunicator::Options options, int world_rank,
                                      int world_size) {
  auto world = std::make_shared<World>();
  return [store, options, world_rank, world_size,
          world](const ProcessGroup::GroupInfo& g) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    absl::MutexLock lock(&world->mu);
    if (world->comm == nullptr) {
      NcclCommunicator::Options o = options;
      o.prefix = options.prefix + "/world";
      ASSIGN_OR_RETURN(world->comm, NcclCommunicator::Create(*store, world_rank, world_size, o));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> split, world->comm->Split(g.color, g.rank, g.axis));
    return std::unique_ptr<Communicator>(std::move(split));
  };
}

absl::Status RunLocalNcclMesh(const DeviceMesh& mesh, const std::function<absl::Status(int, ProcessGroup&)>& body,
                              absl::Duration timeout) {
  const int n = mesh.world_size();
  const int devices = kernels::CudaDeviceCount();
  if (devices < n) {
    return absl::FailedPreconditionError(
        absl::StrCat(n, " ranks need ", n, " CUDA devices (NCCL puts one rank on a device); found ", devices));
  }
  InMemoryStore store;
  // One signal for the whole mesh: the first rank to fail aborts them all.
  auto signal = std::make_shared<AbortSignal>();
  std::vector<absl::Status> results(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      NcclCommunicator::Options o;
      o.device = r;
      o.timeout = timeout;
      o.abort_signal = signal;
      auto pg = ProcessGroup::Create(mesh, r, NcclFactory(&store, o, r, n), timeout, signal);
      if (!pg.ok()) {
        results[r] = pg.status();
      } else {
        results[r] = (*pg)->InitAxes();
        if (results[r].ok()) results[r] = body(r, **pg);
      }
      if (!results[r].ok()) {
        signal->Abort(absl::AbortedError(absl::StrCat("rank ", r, " failed: ", results[r].ToString())));
      }
    });
  }
  for (auto& t : threads) t.join();
  // The cause, not the aborts it triggered in the other ranks.
  for (size_t r = 0; r < results.size(); ++r) {
    if (!results[r].ok() && results[r].code() != absl::StatusCode::kAborted) {
      return absl::Status(results[r].code(), absl::StrCat("rank ", r, ": ", results[r].message()));
    }
  }
  return FirstRankError(results);
}

}  // namespace colod
