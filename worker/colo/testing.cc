#include "worker/colo/testing.h"

#include <cmath>
#include <memory>
#include <thread>
#include <vector>

#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "server/rendezvous_store.h"
#include "worker/comm/store.h"

namespace colod::testing {

void RunMesh(const DeviceMesh& mesh, const std::function<void(int, ProcessGroup&)>& body, bool instrument) {
  auto shared = std::make_shared<RendezvousStore>();
  const int n = mesh.world_size();
  std::vector<std::unique_ptr<InMemoryStore>> stores(n);
  std::vector<std::unique_ptr<ProcessGroup>> groups(n);
  for (int r = 0; r < n; ++r) {
    stores[r] = std::make_unique<InMemoryStore>(shared, "colo");
    GlooCommunicator::Options o;
    o.timeout = absl::Seconds(30);
    ProcessGroup::CommFactory gloo = ProcessGroup::GlooFactory(stores[r].get(), o);
    ProcessGroup::CommFactory factory = gloo;
    if (instrument) {
      factory = [gloo](const ProcessGroup::GroupInfo& g) -> absl::StatusOr<std::unique_ptr<Communicator>> {
        ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, gloo(g));
        return std::unique_ptr<Communicator>(new InstrumentedCommunicator(std::move(c)));
      };
    }
    auto pg = ProcessGroup::Create(mesh, r, factory, absl::Seconds(30));
    ASSERT_TRUE(pg.ok()) << pg.status();
    groups[r] = std::move(*pg);
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back([&, r] { body(r, *groups[r]); });
  for (auto& t : threads) t.join();
}

InstrumentedCommunicator::OpStats Stats(ProcessGroup& pg, const std::string& axis, const std::string& op) {
  auto comm = pg.Comm(axis);
  auto* inst = comm.ok() ? dynamic_cast<InstrumentedCommunicator*>(*comm) : nullptr;
  EXPECT_NE(inst, nullptr) << "RunMesh(..., instrument = true) makes instrumented communicators";
  return inst == nullptr ? InstrumentedCommunicator::OpStats() : inst->Stats(op);
}

void ExpectAllClose(const Tensor& got, const Tensor& want, const std::string& what, double tol) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  const std::vector<float> g = got.ToFloats(), w = want.ToFloats();
  for (size_t i = 0; i < g.size(); ++i) {
    ASSERT_NEAR(g[i], w[i], tol + tol * std::fabs(w[i])) << what << " at " << i;
  }
}

DeviceMesh TpDpMesh(int tp, int dp) {
  v1::ShardConfig s;
  s.set_tensor_parallel_size(tp);
  s.set_data_parallel_size(dp);
  return *DeviceMesh::FromShardConfig(s);
}

}  // namespace colod::testing
