#include "worker/colo/testing.h"

#include <cmath>

#include "common/status_macros.h"
#include "gtest/gtest.h"
#include "worker/colo/rank_group.h"

namespace colod::testing {

namespace {

void Run(const DeviceMesh& mesh, const std::function<void(int, ProcessGroup&)>& body, LocalRanksOptions options) {
  const absl::Status s = RunLocalRanks(
      mesh,
      [&body](int rank, ProcessGroup& pg) {
        body(rank, pg);
        return absl::OkStatus();
      },
      options);
  ASSERT_TRUE(s.ok()) << s;
}

}  // namespace

void RunMesh(const DeviceMesh& mesh, const std::function<void(int, ProcessGroup&)>& body, bool instrument) {
  LocalRanksOptions options;
  options.timeout = absl::Seconds(30);
  if (instrument) {
    options.wrap = [](std::unique_ptr<Communicator> c, const ProcessGroup::GroupInfo&) {
      return std::unique_ptr<Communicator>(new InstrumentedCommunicator(std::move(c)));
    };
  }
  Run(mesh, body, std::move(options));
}

void RunCudaMesh(const DeviceMesh& mesh, const std::function<void(int, ProcessGroup&)>& body) {
  LocalRanksOptions options;
  options.cuda = true;
  options.timeout = absl::Seconds(60);
  Run(mesh, body, std::move(options));
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
