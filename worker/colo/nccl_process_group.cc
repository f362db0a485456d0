#include "worker/colo/nccl_process_group.h"

#include <memory>

#include "absl/synchronization/mutex.h"
#include "common/status_macros.h"

namespace colod {
namespace {

// Owned by the factory's copies. A ProcessGroup destroys its communicators
// before its factory, so the world outlives its splits.
struct World {
  absl::Mutex mu;
  std::unique_ptr<NcclCommunicator> comm ABSL_GUARDED_BY(mu);
  // Why it could not be made: not made again under the same keys (a second
  // rendezvous would read the first one's stale peers).
  absl::Status failed ABSL_GUARDED_BY(mu);
};

}  // namespace

ProcessGroup::CommFactory NcclFactory(Store* store, NcclCommunicator::Options options, int world_rank,
                                      int world_size) {
  auto world = std::make_shared<World>();
  return [store, options, world_rank, world_size,
          world](const ProcessGroup::GroupInfo& g) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    absl::MutexLock lock(&world->mu);
    RETURN_IF_ERROR(world->failed);
    if (world->comm == nullptr) {
      NcclCommunicator::Options o = options;
      o.prefix = options.prefix + "/world";
      absl::StatusOr<std::unique_ptr<NcclCommunicator>> made =
          NcclCommunicator::Create(*store, world_rank, world_size, o);
      if (!made.ok()) {
        world->failed = made.status();
        return made.status();
      }
      world->comm = *std::move(made);
    }
    ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> split, world->comm->Split(g.color, g.rank, g.axis));
    return std::unique_ptr<Communicator>(std::move(split));
  };
}

}  // namespace colod
