// The 1D tensor-parallel MLP block (Linear1D_Col -> GELU -> Linear1D_Row,
// forward + backward, f32) on the CPU, next to OpenBLAS sgemm peak measured
// in the same run.
//
//   bazel run -c opt //bench:layers [-- --json] [-- --steps N] [-- --tokens T --hidden H]
//
// Rows: tp=1 with 1 and 2 BLAS threads in this process, and tp=2 as two
// processes (this binary re-executed with --rank) with one thread each,
// talking Gloo over loopback through a file store. Step time is the median of
// --steps timed steps after one warm-up, each started after a barrier; for
// tp=2 it is the slower rank's. Communication is the payload this rank's
// collectives carried per step, next to the 1D cost formula (Megatron: one
// all-reduce of the [T, H] activations forward and one backward).
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/flags.h"
#include "common/status_macros.h"
#include "kernels/ops.h"
#include "server/rendezvous_store.h"
#include "worker/colo/process_group.h"
#include "worker/comm/instrumented_communicator.h"
#include "worker/comm/store.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear1d.h"

ABSL_FLAG(bool, json, false, "Print one JSON object per row instead of a table.");
ABSL_FLAG(int, steps, 3, "Timed steps per row (after one warm-up).");
ABSL_FLAG(int, tokens, 2048, "Tokens (rows) per step.");
ABSL_FLAG(int, hidden, 1024, "Hidden size; the MLP's inner size is 4x this.");
ABSL_FLAG(int, rank, -1, "Internal: run as rank N of a multi-process row.");
ABSL_FLAG(int, world, 2, "Internal: ranks of a multi-process row.");
ABSL_FLAG(std::string, store_dir, "", "Internal: the file store of a multi-process row.");

extern char** environ;

namespace colod {
namespace {

struct BlockResult {
  double step_seconds = 0;
  int64_t comm_bytes_per_step = 0;
};

double MatMulFlops(int64_t m, int64_t k, int64_t n) { return 2.0 * m * k * n; }

// Forward 2 GEMMs, backward 4, each 2*T*H*4H flops.
double BlockFlops(int64_t t, int64_t h) { return 6 * MatMulFlops(t, h, 4 * h); }

// Best of five GEMMs of the block's own shape [T, H] x [H, 4H].
double SgemmPeak(int threads, int64_t t, int64_t h) {
  kernels::SetBlasThreads(threads);
  const Tensor a = *Tensor::RandomNormal({t, h}, 1), b = *Tensor::RandomNormal({h, 4 * h}, 2);
  (void)kernels::MatMul(a, b);
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const absl::Time t0 = absl::Now();
    (void)kernels::MatMul(a, b);
    best = std::max(best, MatMulFlops(t, h, 4 * h) / absl::ToDoubleSeconds(absl::Now() - t0));
  }
  return best / 1e9;
}

absl::StatusOr<BlockResult> RunBlock(int rank, int world, int threads, Store* store) {
  kernels::SetBlasThreads(threads);
  const int64_t t = absl::GetFlag(FLAGS_tokens), h = absl::GetFlag(FLAGS_hidden);
  v1::ShardConfig shard;
  shard.set_tensor_parallel_size(world);
  shard.set_data_parallel_size(1);
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromShardConfig(shard));
  GlooCommunicator::Options o;
  o.timeout = absl::Minutes(5);
  ProcessGroup::CommFactory gloo = ProcessGroup::GlooFactory(store, o);
  auto factory = [gloo](const ProcessGroup::GroupInfo& g) -> absl::StatusOr<std::unique_ptr<Communicator>> {
    ASSIGN_OR_RETURN(std::unique_ptr<Communicator> c, gloo(g));
    return std::unique_ptr<Communicator>(new InstrumentedCommunicator(std::move(c)));
  };
  ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> pg, ProcessGroup::Create(mesh, rank, factory, absl::Minutes(5)));
  ASSIGN_OR_RETURN(Communicator * tp, pg->Comm("tp"));
  auto* counted = static_cast<InstrumentedCommunicator*>(tp);

  ASSIGN_OR_RETURN(Tensor w1, Tensor::RandomNormal({4 * h, h}, 11));
  ASSIGN_OR_RETURN(Tensor w2, Tensor::RandomNormal({h, 4 * h}, 12));
  ASSIGN_OR_RETURN(Tensor b1, Tensor::RandomNormal({4 * h}, 13));
  ASSIGN_OR_RETURN(Tensor b2, Tensor::RandomNormal({h}, 14));
  ASSIGN_OR_RETURN(nn::Linear1DCol col, nn::Linear1DCol::FromGlobal(*Scale(w1, 0.02f), b1, pg.get(), {}));
  ASSIGN_OR_RETURN(nn::Linear1DRow row, nn::Linear1DRow::FromGlobal(*Scale(w2, 0.02f), b2, pg.get(), {}));
  ASSIGN_OR_RETURN(Tensor xt, Tensor::RandomNormal({t, h}, 15));
  ASSIGN_OR_RETURN(Tensor dy, Tensor::RandomNormal({t, h}, 16));

  auto step = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(ColoTensor x, ColoTensor::FromGlobal(xt, DistSpec(), pg.get(), /*requires_grad=*/true));
    ASSIGN_OR_RETURN(ColoTensor mid, col.Forward(x));
    ASSIGN_OR_RETURN(Variable act, nn::Gelu(mid.variable(), kernels::GeluApprox::kTanh));
    ASSIGN_OR_RETURN(ColoTensor a, ColoTensor::FromLocal(act, mid.spec(), pg.get()));
    ASSIGN_OR_RETURN(ColoTensor y, row.Forward(a));
    RETURN_IF_ERROR(Backward(y.variable(), dy));
    for (const ColoParameter* p : {&col.weight(), &*col.bias(), &row.weight(), &*row.bias()}) {
      Variable v = p->variable();
      v.ZeroGrad();
    }
    return absl::OkStatus();
  };
  RETURN_IF_ERROR(step());  // warm-up: connections, page faults
  const int64_t bytes_before = counted->Stats("all_reduce").bytes;
  const int steps = std::max(1, absl::GetFlag(FLAGS_steps));
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) {
    RETURN_IF_ERROR(tp->Barrier()->Wait(absl::Minutes(5)));
    const absl::Time t0 = absl::Now();
    RETURN_IF_ERROR(step());
    times.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
  }
  RETURN_IF_ERROR(tp->Barrier()->Wait(absl::Minutes(5)));
  std::sort(times.begin(), times.end());
  BlockResult r;
  r.step_seconds = times[times.size() / 2];
  r.comm_bytes_per_step = (counted->Stats("all_reduce").bytes - bytes_before) / steps;
  return r;
}

// Runs `world` copies of this binary as ranks; the slowest rank's result.
absl::StatusOr<BlockResult> RunProcesses(int world) {
  char dir_template[] = "/tmp/colod-bench-layers-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return absl::InternalError("mkdtemp failed");
  const std::string dir = dir_template;
  std::vector<pid_t> pids;
  for (int r = 0; r < world; ++r) {
    std::vector<std::string> args = {"/proc/self/exe",
                                     absl::StrCat("--rank=", r),
                                     absl::StrCat("--world=", world),
                                     "--store_dir=" + dir,
                                     absl::StrCat("--steps=", absl::GetFlag(FLAGS_steps)),
                                     absl::StrCat("--tokens=", absl::GetFlag(FLAGS_tokens)),
                                     absl::StrCat("--hidden=", absl::GetFlag(FLAGS_hidden))};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid;
    if (posix_spawn(&pid, "/proc/self/exe", nullptr, nullptr, argv.data(), environ) != 0) {
      return absl::InternalError("posix_spawn failed");
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  if (!ok) return absl::InternalError("a rank process failed (see its stderr)");
  BlockResult worst;
  for (int r = 0; r < world; ++r) {
    std::ifstream in(absl::StrCat(dir, "/result.", r));
    BlockResult one;
    in >> one.step_seconds >> one.comm_bytes_per_step;
    worst.step_seconds = std::max(worst.step_seconds, one.step_seconds);
    worst.comm_bytes_per_step = std::max(worst.comm_bytes_per_step, one.comm_bytes_per_step);
  }
  std::string cleanup = "rm -rf " + dir;
  (void)std::system(cleanup.c_str());
  return worst;
}

int RankMain() {
  const int rank = absl::GetFlag(FLAGS_rank), world = absl::GetFlag(FLAGS_world);
  auto store = FileStore::Open(absl::GetFlag(FLAGS_store_dir));
  if (!store.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, store.status().ToString().c_str());
    return 1;
  }
  auto r = RunBlock(rank, world, 1, store->get());
  if (!r.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, r.status().ToString().c_str());
    return 1;
  }
  std::ofstream out(absl::StrCat(absl::GetFlag(FLAGS_store_dir), "/result.", rank));
  out << r->step_seconds << " " << r->comm_bytes_per_step << "\n";
  return out.good() ? 0 : 1;
}

}  // namespace
}  // namespace colod

int main(int argc, char** argv) {
  colod::ParseFlags(argc, argv,
                    "layers: the 1D tensor-parallel MLP block, forward + backward, vs sgemm peak.\n\nUsage:\n"
                    "  bazel run -c opt //bench:layers [-- --json] [-- --steps N] [-- --tokens T --hidden H]\n");
  if (absl::GetFlag(FLAGS_rank) >= 0) return colod::RankMain();
  const bool json = absl::GetFlag(FLAGS_json);
  const int64_t t = absl::GetFlag(FLAGS_tokens), h = absl::GetFlag(FLAGS_hidden);
  const double flops = colod::BlockFlops(t, h);
  const double peak1 = colod::SgemmPeak(1, t, h), peak2 = colod::SgemmPeak(2, t, h);
  // The 1D formula: one all-reduce of [T, H] f32 forward and one backward.
  const int64_t formula_bytes = 2 * t * h * 4;
  if (!json) {
    std::printf("MLP block (Linear1D_Col -> GELU -> Linear1D_Row), f32, tokens %lld, hidden %lld, inner %lld: "
                "%.1f GFLOP per step (fwd+bwd)\nOpenBLAS sgemm peak, same run, [T,H]x[H,4H]: 1 thread %.1f "
                "GFLOP/s, 2 threads %.1f GFLOP/s\n\n",
                static_cast<long long>(t), static_cast<long long>(h), static_cast<long long>(4 * h), flops / 1e9,
                peak1, peak2);
    std::printf("%4s  %3s  %-22s  %9s  %8s  %9s  %16s  %16s  %10s\n", "mode", "tp", "ranks x threads", "step (ms)",
                "GFLOP/s", "% of peak", "comm B/rank/step", "1D formula B", "vs tp=1x1");
  }
  double base = 0;
  struct Config {
    int tp, threads;
    const char* layout;
  };
  for (Config c : {Config{1, 1, "1 process x 1 thread"}, Config{1, 2, "1 process x 2 threads"},
                   Config{2, 1, "2 processes x 1 thread"}}) {
    absl::StatusOr<colod::BlockResult> r;
    if (c.tp == 1) {
      auto shared = std::make_shared<colod::RendezvousStore>();
      colod::InMemoryStore store(shared, "bench");
      r = colod::RunBlock(0, 1, c.threads, &store);
    } else {
      r = colod::RunProcesses(c.tp);
    }
    if (!r.ok()) {
      std::fprintf(stderr, "tp=%d: %s\n", c.tp, r.status().ToString().c_str());
      return 1;
    }
    if (c.tp == 1 && c.threads == 1) base = r->step_seconds;
    // Work per rank is flops / tp; peak is per rank with its thread count.
    const double achieved = flops / c.tp / r->step_seconds / 1e9;
    const double peak = c.threads == 1 ? peak1 : peak2;
    const int64_t formula = c.tp == 1 ? 0 : formula_bytes;
    if (json) {
      std::printf("{\"bench\":\"mlp_block\",\"mode\":\"1d\",\"dtype\":\"f32\",\"tokens\":%lld,\"hidden\":%lld,"
                  "\"tp\":%d,\"threads_per_rank\":%d,\"step_seconds\":%.6f,\"gflops_per_rank\":%.3f,"
                  "\"sgemm_peak_gflops\":%.3f,\"fraction_of_peak\":%.4f,\"comm_bytes_per_rank_step\":%lld,"
                  "\"formula_bytes\":%lld,\"step_vs_tp1_1thread\":%.4f}\n",
                  static_cast<long long>(t), static_cast<long long>(h), c.tp, c.threads, r->step_seconds, achieved,
                  peak, achieved / peak, static_cast<long long>(r->comm_bytes_per_step),
                  static_cast<long long>(formula), r->step_seconds / base);
    } else {
      std::printf("%4s  %3d  %-22s  %9.1f  %8.1f  %8.1f%%  %16lld  %16lld  %9.2fx\n", "1d", c.tp, c.layout,
                  r->step_seconds * 1e3, achieved, 100 * achieved / peak,
                  static_cast<long long>(r->comm_bytes_per_step), static_cast<long long>(formula),
                  r->step_seconds / base);
    }
    std::fflush(stdout);
  }
  return 0;
}
