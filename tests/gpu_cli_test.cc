// `coloctl train --device cuda` and `coloctl forward --device cuda` as a
// user runs them (rank r on GPU r over NCCL, inside coloctl) against the
// same runs on CPUs: GPT-2 and LLaMA trained at tp=2 dp=2, and GPT-2 at
// tp=2 x pp=2, with the CPU run's losses, and a forward pass with the unsharded reference's loss and logits.
// The GPU default precision is bf16, and --allow-tf32 reaches cuBLAS.
// Runs on GPUs, and without one under --config=cuda-emu (docs/GPU.md).
#include <cuda_runtime.h>  // COLOD_CUDA_EMULATION under --config=cuda-emu

#include <cstdlib>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "client/coordinator_client.h"
#include "kernels/device.h"
#include "nlohmann/json.hpp"
#include "tests/subprocess.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/testing.h"
#include "worker/tensor/npy.h"

namespace colod {
namespace {

using ::colod::testing::RunCommand;
using ::colod::testing::Runfile;
using ::colod::testing::TempPath;

testing::CommandResult Coloctl(std::vector<std::string> args) {
  return testing::RunColoctl(std::move(args), absl::Seconds(280));
}

// A tiny model of `family` ("Gpt2" or "Llama") for byte-level text (the GPL).
absl::StatusOr<shardformer::testing::TinyModel> ByteLevelModel(const std::string& family, const std::string& name) {
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  o.positions = 32;
  return family == "Llama" ? shardformer::testing::WriteTinyLlama(TempPath(name), o)
                           : shardformer::testing::WriteTinyGpt2(TempPath(name), o);
}

void TrainOnBothDevices(const std::string& model_dir, const std::string& what,
                        const std::vector<std::string>& layout = {"--tp", "2", "--dp", "2", "--mode", "1d"}) {
  std::vector<std::string> common = {"train", "--model", model_dir, "--data", "/usr/share/common-licenses/GPL-3",
                                     "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3",
                                     "--seed", "5", "--output", "json", "--precision", "fp32"};
  common.insert(common.end(), layout.begin(), layout.end());
  std::vector<std::string> cpu = common, gpu = common;
  cpu.insert(cpu.end(), {"--device", "cpu"});
  gpu.insert(gpu.end(), {"--device", "cuda"});
  const auto c = Coloctl(cpu), g = Coloctl(gpu);
  ASSERT_EQ(c.code, 0) << what << " cpu: " << c.err;
  ASSERT_EQ(g.code, 0) << what << " cuda: " << g.err;
  const std::vector<double> lc = testing::JsonLosses(c.out), lg = testing::JsonLosses(g.out);
  ASSERT_EQ(lc.size(), 4u) << c.out;
  ASSERT_EQ(lg.size(), 4u) << g.out;
  for (size_t i = 0; i < lc.size(); ++i) EXPECT_NEAR(lg[i], lc[i], 1e-4 * lc[i]) << what << " step " << i + 1;
  EXPECT_LT(lg.back(), lg.front()) << what;
}

class GpuCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (kernels::CudaDeviceCount() < 4) GTEST_SKIP() << "needs 4 CUDA devices, found " << kernels::CudaDeviceCount();
  }
};

TEST_F(GpuCli, Gpt2TrainsAtTp2Dp2WithTheCpuLosses) {
  auto model = ByteLevelModel("Gpt2", "gpt2");
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOnBothDevices(model->dir, "GPT-2");
}

// Pipeline stages on the devices: activations and their gradients over
// NCCL send/recv, the tied table's gradient summed between the stages.
TEST_F(GpuCli, Gpt2TrainsAtTp2Pp2WithTheCpuLosses) {
  auto model = ByteLevelModel("Gpt2", "gpt2_pp");
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOnBothDevices(model->dir, "GPT-2 pp", {"--tp", "2", "--pp", "2", "--micro-batches", "2"});
}

TEST_F(GpuCli, LlamaTrainsAtTp2Dp2WithTheCpuLosses) {
  auto model = ByteLevelModel("Llama", "llama");
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOnBothDevices(model->dir, "LLaMA");
}

// Without --precision a GPU run is bf16 mixed precision (a CPU run fp32),
// and --allow-tf32 lets f32 GEMMs round their operands: close to the fp32
// run, and (under the emulation, which always takes TF32 when allowed) not
// equal to it.
TEST_F(GpuCli, Bf16IsTheGpuDefaultAndTf32IsAnOption) {
  auto model = ByteLevelModel("Gpt2", "gpt2_precision");
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<std::string> common = {"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3",
                                           "--steps", "3", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3",
                                           "--seed", "5", "--output", "json"};
  const auto run = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = common;
    args.insert(args.end(), extra.begin(), extra.end());
    const auto r = Coloctl(args);
    EXPECT_EQ(r.code, 0) << absl::StrJoin(extra, " ") << ": " << r.err;
    std::vector<double> l = testing::JsonLosses(r.out);
    EXPECT_EQ(l.size(), 3u) << absl::StrJoin(extra, " ") << ": " << r.out;
    l.resize(3);
    return l;
  };
  const std::vector<double> gpu_default = run({"--device", "cuda"});
  const std::vector<double> gpu_bf16 = run({"--device", "cuda", "--precision", "bf16"});
  const std::vector<double> gpu_fp32 = run({"--device", "cuda", "--precision", "fp32"});
  const std::vector<double> gpu_tf32 = run({"--device", "cuda", "--precision", "fp32", "--allow-tf32"});
  const std::vector<double> cpu_default = run({"--device", "cpu"});
  EXPECT_EQ(gpu_default, gpu_bf16) << "the GPU default is bf16";
  EXPECT_NE(gpu_default, gpu_fp32);
  for (int i = 0; i < 3; ++i) {
    EXPECT_NEAR(cpu_default[i], gpu_fp32[i], 1e-4 * gpu_fp32[i]) << "the CPU default is fp32, step " << i + 1;
    EXPECT_NEAR(gpu_tf32[i], gpu_fp32[i], 1e-2 * gpu_fp32[i]) << "TF32, step " << i + 1;
  }
#ifdef COLOD_CUDA_EMULATION
  EXPECT_NE(gpu_tf32, gpu_fp32) << "--allow-tf32 did not reach cuBLAS";
#endif
  const auto bad = Coloctl({"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3",
                            "--precision", "fp64"});
  EXPECT_EQ(bad.code, 2) << bad.err;
  EXPECT_NE(bad.err.find("auto, fp32, bf16, fp16"), std::string::npos) << bad.err;
}

// A run on this machine's GPUs refuses what a coordinator refuses, before
// it starts a rank: it trained on with a NaN learning rate, or one that rose
// to a min_learning_rate above it.
TEST_F(GpuCli, ATrainRunRefusesTheSpecACoordinatorRefuses) {
  auto model = ByteLevelModel("Gpt2", "gpt2_refused");
  ASSERT_TRUE(model.ok()) << model.status();
  for (const auto& [flags, field] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--lr", "nan"}, "spec.train.learning_rate"},
           {{"--lr", "1e-3", "--min-lr", "5"}, "spec.train.min_learning_rate"},
           {{"--batch-size", "16384", "--micro-batches", "16384"}, "spec.train.micro_batches"}}) {
    std::vector<std::string> args = {"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3",
                                     "--steps", "2", "--seq-len", "32", "--device", "cuda"};
    args.insert(args.end(), flags.begin(), flags.end());
    const auto r = Coloctl(args);
    EXPECT_EQ(r.code, 2) << absl::StrJoin(flags, " ") << ": " << r.err;
    EXPECT_NE(r.err.find(field), std::string::npos) << absl::StrJoin(flags, " ") << ": " << r.err;
    EXPECT_EQ(r.out.find("step 1"), std::string::npos) << r.out;
  }
}

TEST_F(GpuCli, ForwardMatchesTheUnshardedReference) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("fwd"));
  ASSERT_TRUE(model.ok()) << model.status();
  const Tensor ids = shardformer::testing::TokenIds(4, 8, model->config.vocab_size, 11);
  ASSERT_TRUE(WriteNpy(TempPath("ids.npy"), ids).ok());
  auto ref = shardformer::testing::ReferenceGpt2(*model, ids);
  ASSERT_TRUE(ref.ok()) << ref.status();
  for (const std::vector<std::string>& layout : {std::vector<std::string>{"--tp", "1", "--dp", "1"},
                                                 std::vector<std::string>{"--tp", "2", "--dp", "2"}}) {
    const std::string what = absl::StrJoin(layout, " ");
    std::vector<std::string> args = {"forward", "--model", model->dir, "--input", TempPath("ids.npy"),
                                     "--logits", TempPath("logits.npy"), "--output", "json", "--device", "cuda"};
    args.insert(args.end(), layout.begin(), layout.end());
    const auto r = Coloctl(args);
    ASSERT_EQ(r.code, 0) << what << ": " << r.err;
    const auto out = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_TRUE(out.is_object()) << r.out;
    EXPECT_NEAR(out["loss"].get<double>(), ref->loss, 1e-5 * ref->loss) << what;
    auto logits = ReadNpy(TempPath("logits.npy"));
    ASSERT_TRUE(logits.ok()) << logits.status();
    ::colod::testing::ExpectAllClose(*logits, ref->logits, "logits " + what, 2e-4);
  }
}

// The CUDA worker daemon's path: a TRAIN job on a worker started with
// --device cuda (one rank; jobs over several CUDA daemons are
// cuda_daemons_test's) gives the CPU run's losses.
TEST_F(GpuCli, ACudaWorkerDaemonTrainsWithTheCpuLosses) {
  auto model = ByteLevelModel("Gpt2", "daemon");
  ASSERT_TRUE(model.ok()) << model.status();
  testing::Daemon coordinator = testing::StartTestCoordinator();
  ASSERT_FALSE(coordinator.grpc.empty()) << testing::ReadFile(coordinator.log);
  testing::Daemon worker = testing::StartDaemon(
      "worker/daemon/colod-worker", "cuda0",
      {"--coordinator", coordinator.grpc, "--device", "cuda", "--device-ordinal", "0", "--work-dir", TempPath("w0"),
       "--comm-timeout", "30s"});
  ASSERT_FALSE(worker.grpc.empty()) << testing::ReadFile(worker.log);
  auto client = CoordinatorClient::Create(coordinator.grpc);
  ASSERT_TRUE(client.ok()) << client.status();
  const absl::Status registered = testing::WaitForWorkers(**client, 1);
  ASSERT_TRUE(registered.ok()) << registered << testing::DaemonLogs(coordinator, {});
  const std::vector<std::string> common = {"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3",
                                           "--steps", "3", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3",
                                           "--seed", "5", "--tp", "1", "--dp", "1", "--output", "json"};
  std::vector<std::string> on_daemon = common, embedded = common;
  on_daemon.insert(on_daemon.end(), {"--coordinator", coordinator.grpc, "--precision", "fp32"});
  const auto d = Coloctl(on_daemon), c = Coloctl(embedded);
  ASSERT_EQ(d.code, 0) << d.err << testing::ReadFile(worker.log);
  ASSERT_EQ(c.code, 0) << c.err;
  const std::vector<double> ld = testing::JsonLosses(d.out), lc = testing::JsonLosses(c.out);
  ASSERT_EQ(ld.size(), 3u) << d.out;
  ASSERT_EQ(lc.size(), 3u) << c.out;
  for (size_t i = 0; i < lc.size(); ++i) EXPECT_NEAR(ld[i], lc[i], 1e-4 * lc[i]) << "step " << i + 1;
  // A spec without a precision is the worker's device default: bf16 on a
  // CUDA worker (close to the fp32 run, not equal to it).
  std::vector<std::string> on_daemon_default = common;
  on_daemon_default.insert(on_daemon_default.end(), {"--coordinator", coordinator.grpc});
  const auto b = Coloctl(on_daemon_default);
  ASSERT_EQ(b.code, 0) << b.err << testing::ReadFile(worker.log);
  const std::vector<double> lb = testing::JsonLosses(b.out);
  ASSERT_EQ(lb.size(), 3u) << b.out;
  EXPECT_NE(lb, ld);
  for (size_t i = 0; i < lb.size(); ++i) EXPECT_NEAR(lb[i], ld[i], 0.03 * ld[i]) << "bf16 step " << i + 1;
  // The worker serves its CUDA device (not the CPU).
  auto info = kernels::GetCudaDeviceInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_NE(testing::ReadFile(worker.log).find("worker device " + info->name + " (ordinal 0)"), std::string::npos)
      << testing::ReadFile(worker.log);
}

// A rank that never enters a collective (injected by the emulation, which is
// what makes this testable without a broken GPU) ends the run: every rank
// fails within --comm-timeout, and coloctl exits 1 naming the deadline
// instead of hanging.
TEST_F(GpuCli, ARankThatNeverEntersACollectiveEndsTheRunWithinTheTimeout) {
  auto info = kernels::GetCudaDeviceInfo(0);
  ASSERT_TRUE(info.ok()) << info.status();
  if (info->name != "colod CUDA emulation") GTEST_SKIP() << "fault injection needs the CUDA emulation";
  auto model = ByteLevelModel("Gpt2", "hang");
  ASSERT_TRUE(model.ok()) << model.status();
  const absl::Time start = absl::Now();
  // In every two-rank group, local rank 1's 5th operation never starts.
  const auto r = RunCommand({"/usr/bin/env", "COLOD_NCCL_EMU_FAULT=hang:1:5:2", Runfile("client/coloctl"), "train",
                             "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3", "--steps", "20",
                             "--batch-size", "4", "--seq-len", "32", "--tp", "2", "--dp", "2", "--device", "cuda",
                             "--comm-timeout", "3s", "--output", "json"},
                            std::getenv("TEST_TMPDIR"), absl::Seconds(120));
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_NE(r.err.find("DEADLINE_EXCEEDED"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did not complete within 3s"), std::string::npos) << r.err;
  EXPECT_LT(took, absl::Seconds(25)) << "the default 60 s timeout, not --comm-timeout 3s, ended it?\n" << r.err;
}

}  // namespace
}  // namespace colod
