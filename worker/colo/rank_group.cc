#include "worker/colo/rank_group.h"

#include <optional>
#include <system_error>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/grpc_status.h"
#include "common/rendezvous_store.h"
#include "common/status_macros.h"
#include "worker/comm/gloo/gloo_communicator.h"
#ifdef COLOD_WITH_CUDA
#include "kernels/device.h"
#include "worker/colo/nccl_process_group.h"
#endif

namespace colod {

absl::StatusOr<std::unique_ptr<ProcessGroup>> CreateRankGroup(const DeviceMesh& mesh, int rank, Store* store,
                                                              RankGroupOptions options) {
  if (options.abort_signal == nullptr) options.abort_signal = std::make_shared<AbortSignal>();
  ProcessGroup::CommFactory inner;
  if (options.device.is_cuda()) {
#ifdef COLOD_WITH_CUDA
    NcclCommunicator::Options o;
    o.device = options.device.index;
    o.timeout = options.timeout;
    o.abort_signal = options.abort_signal;  // reaches NCCL init and splits in progress
    inner = NcclFactory(store, o, rank, mesh.world_size());
#else
    return absl::FailedPreconditionError(
        "this build has no CUDA, so it cannot run ranks on a CUDA device: run them on the CPU");
#endif
  } else {
    GlooCommunicator::Options o;
    o.hostname = options.host;
    o.timeout = options.timeout;
    o.abort_signal = options.abort_signal;  // reaches a rendezvous waiting for a dead peer
    o.kept_scratch_bytes = options.kept_scratch_bytes;
    inner = ProcessGroup::GlooFactory(store, o);
  }
  ProcessGroup::CommFactory factory = std::move(inner);
  if (options.wrap) {
    factory = [made = std::move(factory), wrap = std::move(options.wrap)](const ProcessGroup::GroupInfo& g)
        -> absl::StatusOr<std::unique_ptr<Communicator>> {
      ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, made(g));
      return wrap(std::move(c), g);
    };
  }
  return ProcessGroup::Create(mesh, rank, std::move(factory), options.timeout, std::move(options.abort_signal));
}

absl::Status RunLocalRanks(const DeviceMesh& mesh, const std::function<absl::Status(int, ProcessGroup&)>& body,
                           LocalRanksOptions options) {
  const int n = mesh.world_size();
  if (options.cuda) {
#ifdef COLOD_WITH_CUDA
    const int devices = kernels::CudaDeviceCount();
    if (devices < n) {
      return absl::FailedPreconditionError(
          absl::StrCat(n, " ranks need ", n, " CUDA devices (NCCL puts one rank on a device); found ", devices));
    }
#else
    return absl::FailedPreconditionError("this build has no CUDA: run on the CPU (without --device cuda)");
#endif
  }
  auto shared = std::make_shared<RendezvousStore>();
  std::vector<std::unique_ptr<InMemoryStore>> stores(n);
  std::vector<std::unique_ptr<ProcessGroup>> groups(n);
  for (int r = 0; r < n; ++r) {
    stores[r] = std::make_unique<InMemoryStore>(shared, "colo");
    RankGroupOptions o;
    o.device = options.cuda ? Device::Cuda(r) : Device::Cpu();
    o.timeout = options.timeout;
    o.wrap = options.wrap;
    ASSIGN_OR_RETURN(groups[r], CreateRankGroup(mesh, r, stores[r].get(), std::move(o)));
  }
  absl::Mutex mu;
  // The first failure of a rank's own, prefixed with its rank (its marks
  // kept), and the first that followed a peer's (IsPeerCaused): the peer's
  // own error, which it returns too, is the run's, whichever came first.
  std::optional<absl::Status> first, consequence;
  std::optional<absl::Status> drained;  // the first drained end (MarkDrained), likewise
  const auto fail = [&](int r, const absl::Status& s) {
    const absl::Status cause = WithMessage(s, absl::StrCat("rank ", r, ": ", s.message()));
    {
      absl::MutexLock lock(&mu);
      // A drain (train::RankHooks::drain) stops every rank on its own after
      // the same step: no abort, which could end a peer still saving it.
      if (IsDrained(s)) {
        if (!drained.has_value()) drained = MarkDrained(cause);
        return;
      }
      // Nor for a failure that followed a peer's: the peer, which failed of
      // its own, aborts the others with its error (an abort now would end
      // it with this rank's instead, were it still at a collective).
      if (IsPeerCaused(s)) {
        if (!consequence.has_value()) consequence = cause;
        return;
      }
      if (first.has_value()) return;  // most likely a consequence of the first
      first = cause;
    }
    // Outside the lock (an abort never waits).
    for (auto& g : groups) g->Abort(absl::AbortedError(absl::StrCat("rank ", r, " failed: ", s.message())));
  };
  std::vector<std::thread> threads;
  threads.reserve(n);  // no reallocation (bad_alloc) with threads started
  for (int r = 0; r < n; ++r) {
    try {
      threads.emplace_back([&, r] {
        absl::Status s = options.cuda ? groups[r]->InitAxes() : absl::OkStatus();
        if (s.ok()) s = body(r, *groups[r]);
        if (!s.ok()) fail(r, s);
      });
    } catch (const std::system_error& e) {
      // The ranks started wait for this one: aborted, and joined below.
      fail(r, absl::ResourceExhaustedError(absl::StrCat("cannot start its thread: ", e.what())));
      break;
    }
  }
  for (auto& t : threads) t.join();
  absl::MutexLock lock(&mu);
  return first.value_or(consequence.value_or(drained.value_or(absl::OkStatus())));
}

}  // namespace colod
