// Jobs on several CUDA worker daemons, one process per device as the
// product runs them: their NCCL communicators built from ids handed out
// through the coordinator's rendezvous store, in separate processes. Runs
// on GPUs, and without one under --config=cuda-emu, whose NCCL works across
// processes (kernels/cuda/emu/nccl.cc; docs/GPU.md).
#include <cuda_runtime.h>  // COLOD_CUDA_EMULATION under --config=cuda-emu

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "client/coordinator_client.h"
#include "common/proto_time.h"
#include "kernels/device.h"
#include "nlohmann/json.hpp"
#include "tests/jobs_fixture.h"
#include "tests/subprocess.h"
#include "tests/testing/prometheus_text.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"

namespace colod {
namespace {

using ::colod::testing::RunCommand;
using ::colod::testing::Runfile;
using ::colod::testing::TempPath;

struct Layout {
  std::string name, family;
  std::vector<std::string> flags;
};
void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

class CudaDaemons : public ::testing::TestWithParam<Layout> {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices, found " << kernels::CudaDeviceCount();
  }
};

// A job on 4 CUDA worker daemons (device ordinals 0-3, each daemon a
// process) gives the CPU run's losses, fp32, within 1e-5: tp=2 x dp=2 GPT-2
// (NCCL all-reduces between processes, the dp buckets), pp=2 x tp=2 LLaMA
// (activations and gradients by send/recv between daemons) and 2D GPT-2
// (SUMMA's broadcasts and reduce-scatters).
TEST_P(CudaDaemons, AJobOnFourDaemonsGivesTheCpuLosses) {
  const Layout& l = GetParam();
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  o.positions = 32;
  auto model = l.family == "llama" ? shardformer::testing::WriteTinyLlama(TempPath(l.name), o)
                                   : shardformer::testing::WriteTinyGpt2(TempPath(l.name), o);
  ASSERT_TRUE(model.ok()) << model.status();
  testing::Daemon coordinator = testing::StartTestCoordinator();
  ASSERT_FALSE(coordinator.grpc.empty()) << testing::ReadFile(coordinator.log);
  std::vector<testing::Daemon> workers = testing::StartTestWorkers(coordinator.grpc, 4, {"--device", "cuda"});
  for (const testing::Daemon& w : workers) ASSERT_FALSE(w.grpc.empty()) << testing::ReadFile(w.log);
  auto client = CoordinatorClient::Create(coordinator.grpc);
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Status registered = testing::WaitForWorkers(**client, 4);
  ASSERT_TRUE(registered.ok()) << registered << testing::DaemonLogs(coordinator, workers);
  std::vector<std::string> common = {"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3",
                                     "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3",
                                     "--seed", "5", "--precision", "fp32", "--output", "json"};
  common.insert(common.end(), l.flags.begin(), l.flags.end());
  std::vector<std::string> on_daemons = common, on_cpu = common;
  on_daemons.insert(on_daemons.end(), {"--coordinator", coordinator.grpc});
  on_cpu.insert(on_cpu.end(), {"--device", "cpu"});
  const auto d = testing::RunColoctl(on_daemons), c = testing::RunColoctl(on_cpu);
  ASSERT_EQ(d.code, 0) << d.err << testing::DaemonLogs(coordinator, workers);
  ASSERT_EQ(c.code, 0) << c.err;
  const std::vector<double> ld = testing::JsonLosses(d.out), lc = testing::JsonLosses(c.out);
  ASSERT_EQ(ld.size(), 4u) << d.out;
  ASSERT_EQ(lc.size(), 4u) << c.out;
  for (size_t i = 0; i < lc.size(); ++i) EXPECT_NEAR(ld[i], lc[i], 1e-5 * lc[i]) << "step " << i + 1;
  EXPECT_LT(ld.back(), ld.front());
  // Each daemon served its own CUDA device.
  auto info = kernels::GetCudaDeviceInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  for (int i = 0; i < 4; ++i) {
    EXPECT_NE(testing::ReadFile(workers[i].log).find(absl::StrCat("worker device ", info->name, " (ordinal ", i, ")")),
              std::string::npos)
        << testing::ReadFile(workers[i].log);
  }
  if (l.name != "gpt2_tp2_dp2") return;
  // Data parallelism across processes: the gradient buckets (32 KiB here,
  // many of them) are all-reduced between daemons, most enqueued on the dp
  // communicator's stream before backward's last kernel: the overlap the
  // workers export (colod_dp_bucket_bytes_total).
  double during = 0, after = 0;
  for (const testing::Daemon& w : workers) {
    auto body = testing::HttpGet(w.metrics, "/metrics");
    ASSERT_TRUE(body.ok()) << body.status();
    auto families = testing::ParsePrometheusText(*body);
    ASSERT_TRUE(families.ok()) << families.status();
    ASSERT_TRUE(families->count("colod_dp_bucket_bytes_total")) << *body;
    for (const testing::Sample& s : families->at("colod_dp_bucket_bytes_total").samples) {
      (s.labels.at("when") == "backward" ? during : after) += s.value;
    }
  }
  std::printf("dp buckets over 4 daemons, 4 steps: %.0f bytes enqueued during backward, %.0f after\n", during, after);
  EXPECT_GT(after, 0);  // the first layers' bucket: nothing of backward is left after it
  EXPECT_GE(during, 3 * after);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CudaDaemons,
    ::testing::Values(Layout{"gpt2_tp2_dp2", "gpt2", {"--tp", "2", "--dp", "2", "--mode", "1d", "--bucket-mb", "0.03125"}},
                      Layout{"llama_pp2_tp2", "llama", {"--tp", "2", "--pp", "2", "--micro-batches", "2"}},
                      Layout{"gpt2_2d", "gpt2", {"--tp", "4", "--mode", "2d"}}),
    [](const auto& info) { return info.param.name; });

// `coloctl local --device cuda`: the embedded cluster's workers are CUDA
// daemons, one per device, and a tp=2 x dp=2 job on them gives the CPU
// run's losses.
TEST(CudaLocalCluster, ItsCudaWorkersTrainWithTheCpuLosses) {
  if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices, found " << kernels::CudaDeviceCount();
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  o.positions = 32;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("gpt2_local"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  testing::Subprocess local({Runfile("client/coloctl"), "local", "--workers", "4", "--device", "cuda", "--listen",
                             "127.0.0.1:0", "--data-dir", TempPath("local-data")},
                            TempPath("local.out"), TempPath("local.err"));
  const std::string address = testing::LocalClusterAddress(TempPath("local.out"));
  ASSERT_FALSE(address.empty()) << testing::ReadFile(TempPath("local.err"));
  const std::vector<std::string> common = {
      "train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3", "--steps", "3", "--batch-size",
      "4", "--seq-len", "32", "--lr", "3e-3", "--seed", "5", "--tp", "2", "--dp", "2", "--precision", "fp32",
      "--output", "json"};
  std::vector<std::string> on_local = common, on_cpu = common;
  on_local.insert(on_local.end(), {"--coordinator", address});
  on_cpu.insert(on_cpu.end(), {"--device", "cpu"});
  const auto d = testing::RunColoctl(on_local), c = testing::RunColoctl(on_cpu);
  ASSERT_EQ(d.code, 0) << d.err;
  ASSERT_EQ(c.code, 0) << c.err;
  const std::vector<double> ld = testing::JsonLosses(d.out), lc = testing::JsonLosses(c.out);
  ASSERT_EQ(ld.size(), 3u) << d.out;
  ASSERT_EQ(lc.size(), 3u) << c.out;
  for (size_t i = 0; i < lc.size(); ++i) EXPECT_NEAR(ld[i], lc[i], 1e-5 * lc[i]) << "step " << i + 1;
  auto info = kernels::GetCudaDeviceInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  for (int i = 0; i < 4; ++i) {
    const std::string log = testing::ReadFile(TempPath(absl::StrCat("local-data/worker-", i, ".log")));
    EXPECT_NE(log.find(absl::StrCat("worker device ", info->name, " (ordinal ", i, ")")), std::string::npos) << log;
  }
  local.Signal(SIGTERM);
  const auto code = local.Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << testing::ReadFile(TempPath("local.err"));
}

// `coloctl local --device cuda` starts again a worker whose device faulted
// and that exited 70 for it, as Kubernetes would; the job it failed
// restarts on the new process (a sound context) and succeeds.
TEST(CudaLocalCluster, AWorkerWhoseDeviceFaultsIsStartedAgainAndItsJobSucceeds) {
#ifndef COLOD_CUDA_EMULATION
  GTEST_SKIP() << "the fault is the emulation's (COLOD_CUDA_EMU_FAULT_AT_LAUNCH); a GPU has none to inject";
#else
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  o.positions = 32;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("gpt2_local_fault"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string once = TempPath("local-fault-once");
  std::remove(once.c_str());
  // Worker 1 serves device 1: its first process faults at its 300th launch there.
  testing::Subprocess local({"/usr/bin/env", "COLOD_CUDA_EMU_FAULT_AT_LAUNCH=1:300", "COLOD_CUDA_EMU_FAULT_ONCE=" + once,
                             Runfile("client/coloctl"), "local", "--workers", "2", "--device", "cuda", "--listen",
                             "127.0.0.1:0", "--data-dir", TempPath("local-fault")},
                            TempPath("local-fault.out"), TempPath("local-fault.err"));
  const std::string address = testing::LocalClusterAddress(TempPath("local-fault.out"));
  ASSERT_FALSE(address.empty()) << testing::ReadFile(TempPath("local-fault.err"));
  const auto run = testing::RunColoctl({"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3",
                                        "--steps", "12", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3",
                                        "--seed", "5", "--tp", "2", "--precision", "fp32", "--output", "json",
                                        "--coordinator", address});
  const std::string err = testing::ReadFile(TempPath("local-fault.err"));
  const std::string worker1 = testing::ReadFile(TempPath("local-fault/worker-1.log"));
  EXPECT_EQ(run.code, 0) << run.err << "\n" << err << "\n" << worker1;
  EXPECT_TRUE(absl::StrContains(err, "worker 1 lost its CUDA device (exit 70); starting it again (1 of 3")) << err;
  EXPECT_TRUE(absl::StrContains(worker1, "CUDA device 1 is unusable: cudaErrorIllegalAddress")) << worker1;
  EXPECT_TRUE(std::filesystem::exists(once));
  EXPECT_GE(testing::JsonLosses(run.out).size(), 12u) << run.out;
  local.Signal(SIGTERM);
  const auto code = local.Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << testing::ReadFile(TempPath("local-fault.err"));
#endif
}

// The cluster fixture (tests/jobs_fixture.h) with four CUDA workers, each a
// process serving its device ordinal.
class CudaJobsTest : public testing::JobsTest {
 protected:
  CudaJobsTest() { worker_flags_ = {"--device", "cuda"}; }
  void SetUp() override {
    if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices, found " << kernels::CudaDeviceCount();
    JobsTest::SetUp();
  }
};

// kill -9 of the CUDA daemon of rank 1 after a checkpoint: the job restarts
// on a new CUDA daemon (on the freed device) from the newest checkpoint and succeeds with the
// losses of the uninterrupted run (ranks as threads on the devices of this
// process), every step.
TEST_F(CudaJobsTest, ADaemonKilledMidJobRestartsItWithTheUninterruptedLosses) {
  train::TrainOptions o = Options(14);
  o.cuda = true;  // fp32 (the options' param dtype), as the job's spec says
  std::vector<double> want;
  ASSERT_TRUE(train::Train(o, [&](const train::StepStats& s) { want.push_back(s.loss); }).ok());
  v1::JobSpec spec = Spec(o);
  spec.mutable_train()->set_checkpoint_every(5);
  spec.mutable_train()->set_checkpoint_dir(TempPath("ck-cuda"));
  auto job = client_->SubmitJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  v1::MeshSpec mesh;
  int victim = -1;
  ASSERT_TRUE(RunUntilStepThenStop(job->job_id(), 7, 1, &mesh, &victim));
  workers_[victim].process->Signal(SIGKILL);
  workers_[victim].process->Wait(absl::Seconds(10));
  // A new daemon on the freed device.
  workers_.push_back(testing::StartDaemon(
      "worker/daemon/colod-worker", "w4",
      {"--coordinator", coordinator_.grpc, "--device", "cuda", "--device-ordinal", absl::StrCat(victim), "--work-dir",
       TempPath("work4"), "--comm-timeout", "30s"}));
  ASSERT_FALSE(workers_.back().grpc.empty()) << testing::ReadFile(workers_.back().log);
  const std::vector<v1::JobEvent> events = Watch(job->job_id());
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok());
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  EXPECT_EQ(done->generation(), 2);
  ASSERT_EQ(done->attempt_failures_size(), 1);
  EXPECT_TRUE(absl::StrContains(done->attempt_failures(0), absl::StrCat("rank 1 (worker ", mesh.ranks(1).worker_id())))
      << done->attempt_failures(0);
  for (const v1::RankAssignment& a : done->mesh().ranks()) EXPECT_NE(a.worker_address(), workers_[victim].grpc);
  ASSERT_NO_FATAL_FAILURE(ExpectLastLosses(events, want));
}

// A CUDA daemon stopped cleanly (SIGTERM) mid-job drains it as a CPU one
// does (DrainMidRun): every rank, over NCCL with the host a step ahead,
// saves a checkpoint after the same step; the job goes on from it on a new
// daemon on the freed device, with the uninterrupted run's losses.
TEST_F(CudaJobsTest, ADaemonStoppedMidJobDrainsItWithTheUninterruptedLosses) {
  train::TrainOptions o = Options(14);
  o.cuda = true;
  ASSERT_NO_FATAL_FAILURE(DrainMidRun(o, [&](int leaving) {
    workers_.push_back(
        testing::StartDaemon("worker/daemon/colod-worker", "w4",
                             {"--coordinator", coordinator_.grpc, "--device", "cuda", "--device-ordinal",
                              absl::StrCat(leaving), "--work-dir", TempPath("work4"), "--comm-timeout", "30s"}));
    ASSERT_FALSE(workers_.back().grpc.empty()) << testing::ReadFile(workers_.back().log);
  }));
}

// A CUDA daemon whose device faults mid-job (an illegal address: its
// context is broken for good; the emulation injects it at the daemon's
// 400th kernel launch) fails its rank naming CUDA's error and the broken
// device, takes no other rank, deregisters and exits 70 for its supervisor
// to restart it; the job restarts on a healthy daemon in its place and
// succeeds. Before, the daemon stayed up, took the restarted job's ranks and
// failed each the same way.
TEST_F(CudaJobsTest, ADaemonWhoseDeviceFaultsLeavesAndTheJobRestartsWithoutIt) {
#ifndef COLOD_CUDA_EMULATION
  GTEST_SKIP() << "the fault is the emulation's (COLOD_CUDA_EMU_FAULT_AT_LAUNCH); a GPU has none to inject";
#else
  workers_[3].process->Signal(SIGTERM);
  ASSERT_TRUE(workers_[3].process->Wait(absl::Seconds(30)).has_value());
  const auto start_worker = [&](const std::string& name, const std::vector<std::string>& env) {
    return testing::StartDaemon("worker/daemon/colod-worker", name,
                                {"--coordinator", coordinator_.grpc, "--device", "cuda", "--device-ordinal", "3",
                                 "--work-dir", TempPath("work-" + name), "--comm-timeout", "30s"},
                                env);
  };
  workers_[3] = start_worker("faulty", {"COLOD_CUDA_EMU_FAULT_AT_LAUNCH=3:400"});
  ASSERT_FALSE(workers_[3].grpc.empty()) << testing::ReadFile(workers_[3].log);
  ASSERT_TRUE(testing::WaitForWorkers(*client_, 4).ok()) << Logs();
  train::TrainOptions o = Options(16);  // the fault comes at step 9
  o.cuda = true;
  v1::JobSpec spec = Spec(o);
  spec.mutable_restart()->set_max_restarts(2);
  auto job = client_->SubmitJob(spec);
  ASSERT_TRUE(job.ok()) << job.status();
  const std::optional<int> code = workers_[3].process->Wait(absl::Seconds(180));
  ASSERT_TRUE(code.has_value()) << "the faulty daemon is still up\n" << Logs();
  EXPECT_EQ(*code, 70) << Logs();
  const std::string log = testing::ReadFile(workers_[3].log);
  EXPECT_TRUE(absl::StrContains(log, "CUDA device 3 is unusable: cudaErrorIllegalAddress")) << log;
  const std::string faulty = workers_[3].grpc;
  // It left saying why.
  auto listed = client_->ListWorkers(/*include_lost=*/true);
  ASSERT_TRUE(listed.ok()) << listed.status();
  int left = 0;
  for (const v1::Worker& w : *listed) {
    if (w.info().address() != faulty) continue;
    ++left;
    EXPECT_EQ(w.state(), v1::WORKER_STATE_LOST);
    EXPECT_TRUE(absl::StrContains(w.lost_reason(), "CUDA device 3 is unusable")) << w.lost_reason();
  }
  EXPECT_EQ(left, 1);
  workers_.push_back(start_worker("healthy", {}));
  ASSERT_FALSE(workers_.back().grpc.empty()) << testing::ReadFile(workers_.back().log);
  Watch(job->job_id());
  auto done = client_->GetJob(job->job_id());
  ASSERT_TRUE(done.ok()) << done.status();
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << "\n" << Logs();
  ASSERT_GE(done->attempt_failures_size(), 1);
  EXPECT_TRUE(absl::StrContains(done->attempt_failures(0), "illegal memory access") &&
              absl::StrContains(done->attempt_failures(0), "CUDA device 3 is unusable"))
      << done->attempt_failures(0);
  for (const v1::RankAssignment& a : done->mesh().ranks()) EXPECT_NE(a.worker_address(), faulty);
#endif
}

class CudaJobsHangTest : public CudaJobsTest {
 protected:
  CudaJobsHangTest() { coordinator_flags_ = {"--hang-threshold", "1s", "--lease-duration", "5s"}; }
};

// SIGSTOP of the CUDA daemon of rank 2: its peers wait in NCCL collectives
// with it; within 2 s the coordinator reports a hang that names a group's
// collective and rank 2 (as not having entered it, or as silent); the job
// fails naming rank 2 when its lease runs out, and the healthy daemons
// (whose NCCL collectives are aborted, not waited out) are idle within 10 s
// of the end.
TEST_F(CudaJobsHangTest, AStoppedDaemonIsNamedAndTheHealthyOnesAreFreeWithinSeconds) {
  const LongJob run = StartLongJobOn(2);
  ASSERT_GE(run.worker, 0);
  const int stopped = run.worker;
  workers_[stopped].process->Signal(SIGSTOP);
  const absl::Time t0 = absl::Now();
  const std::string who = absl::StrCat("rank 2 (worker ", run.mesh.ranks(2).worker_id());
  const std::vector<v1::JobEvent> events = Watch(run.job_id);
  const absl::Time ended = absl::Now();
  absl::Time named = absl::InfiniteFuture();
  for (const v1::JobEvent& e : events) {
    if (!e.has_hang()) continue;
    const v1::HangReport& h = e.hang();
    const bool names_2 = std::count(h.missing_ranks().begin(), h.missing_ranks().end(), 2) > 0 ||
                         std::count(h.silent_ranks().begin(), h.silent_ranks().end(), 2) > 0;
    if (!names_2) continue;
    EXPECT_GT(h.sequence(), 0);
    EXPECT_FALSE(h.op().empty());
    EXPECT_TRUE(absl::StrContains(h.message(), "collective #") && absl::StrContains(h.message(), who)) << h.message();
    named = std::min(named, FromProtoTimestamp(e.time()));
  }
  ASSERT_NE(named, absl::InfiniteFuture()) << "no hang event names rank 2\n" << Logs();
  EXPECT_LE(named - t0, absl::Seconds(2));
  std::printf("stopped CUDA daemon named %.2f s after SIGSTOP (threshold 1 s)\n", absl::ToDoubleSeconds(named - t0));
  auto failed = client_->GetJob(run.job_id);
  ASSERT_TRUE(failed.ok());
  EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED) << failed->reason();
  EXPECT_TRUE(absl::StrContains(failed->reason(), who)) << failed->reason();
  EXPECT_TRUE(AllIdle(absl::Seconds(10), stopped)) << "healthy CUDA daemons still busy 10 s after the job ended\n"
                                                    << Logs();
  std::printf("stopped CUDA daemon: healthy ones idle %.2f s after the job ended\n",
              absl::ToDoubleSeconds(absl::Now() - ended));
  workers_[stopped].process->Signal(SIGCONT);
}

// A clean stop: a running job on CUDA daemons cancelled ends CANCELLED and
// frees every daemon within 10 s.
TEST_F(CudaJobsTest, ACancelledJobFreesEveryDaemon) {
  const std::string job_id = StartLongJob();
  ASSERT_FALSE(job_id.empty());
  auto cancelled = client_->CancelJob(job_id, "enough");
  ASSERT_TRUE(cancelled.ok()) << cancelled.status();
  Watch(job_id);
  EXPECT_EQ(client_->GetJob(job_id)->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_TRUE(AllIdle(absl::Seconds(10), -1)) << Logs();
}

}  // namespace
}  // namespace colod
