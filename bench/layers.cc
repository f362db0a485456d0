// The 1D tensor-parallel MLP block (Linear1D_Col -> GELU -> Linear1D_Row,
// forward + backward, f32) on the CPU, next to OpenBLAS sgemm peak measured
// in the same run.
//
//   bazel run -c opt //bench:layers [-- --json] [-- --steps N] [-- --tokens T --hidden H]
//
// Rows: 1d with tp=1 (1 and 2 BLAS threads in this process) and tp=2, then
// 2d (q=2, 4 ranks), 2.5d (q=2, d=2, 8 ranks) and 3d (q=2, 8 ranks): the same
// block built from Linear2D / Linear3D. A second table runs a whole GPT-2
// block (ln_1, causal attention, ln_2, MLP, the residuals: the block the
// ShardFormer policy builds from a 1-layer GPT-2 written with GPT-2's
// initialization) in the same layouts. Multi-rank rows run this binary as
// rank processes (re-executed with --rank) with one thread each, talking Gloo
// over loopback through a file store. Step time is the median of --steps
// timed steps after one warm-up, each started after a barrier, of the slowest
// rank. Communication is the payload this rank's collectives carried per step
// (all groups), next to the payload the layers' algorithm implies (the cost
// formulas; docs/PERFORMANCE.md derives them).
#include <unistd.h>

#include <algorithm>
#include <memory>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/flags.h"
#include "common/int_math.h"
#include "bench/peak.h"
#include "bench/self_ranks.h"
#include "common/status_macros.h"
#include "kernels/cpu/layer_ops.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/device.h"
#include "common/rendezvous_store.h"
#include "worker/colo/process_group.h"
#include "worker/colo/rank_group.h"
#include "worker/comm/instrumented_communicator.h"
#include "worker/comm/store.h"
#include "worker/nn/functional.h"
#include "worker/nn/vocab_cross_entropy.h"
#include "worker/nn/linear1d.h"
#include "worker/nn/linear2d.h"
#include "worker/nn/linear3d.h"
#include "worker/shardformer/init_model.h"
#include "worker/shardformer/shardformer.h"
#include "worker/shardformer/shardformer.h"
#include "worker/tensor/ops.h"

ABSL_FLAG(bool, json, false, "Print one JSON object per row instead of a table.");
ABSL_FLAG(int, steps, 3, "Timed steps per row (after one warm-up).");
ABSL_FLAG(int, tokens, 2048, "Tokens (rows) per step.");
ABSL_FLAG(int, hidden, 1024, "Hidden size; the MLP's inner size is 4x this.");
ABSL_FLAG(int, rank, -1, "Internal: run as rank N of a multi-process row.");
ABSL_FLAG(int, world, 2, "Internal: ranks of a multi-process row.");
ABSL_FLAG(std::string, mode, "1d", "Internal: the tensor-parallel mode of a multi-process row.");
ABSL_FLAG(bool, all_modes, true, "Also run the 2d, 2.5d and 3d rows (8 processes at most).");
ABSL_FLAG(std::string, store_dir, "", "Internal: the file store of a multi-process row.");
ABSL_FLAG(int, seq, 128, "The GPT-2 block's sequence length (tokens / seq sequences a step).");
ABSL_FLAG(bool, gpt2_block, true, "Also run the whole GPT-2 block's table.");
ABSL_FLAG(bool, attention, true, "On a GPU, also run the fused attention's rows (bf16, causal).");
ABSL_FLAG(int, attention_seq, 2048, "The attention rows' sequence length.");
ABSL_FLAG(int, attention_batch, 4, "The attention rows' batch.");
ABSL_FLAG(bool, bandwidth, true,
          "On a GPU, also run the column reductions' rows (bias and norm-parameter gradients, GELU backward "
          "with the bias gradient) against the device's copy bandwidth.");
ABSL_FLAG(int, bandwidth_rows, 8192, "The bandwidth rows' token count (GPT-2 124M's 8 x 1024).");
ABSL_FLAG(bool, lm_head, true,
          "On a GPU, also run the LM head and loss rows: unfused, fused with the logits recomputed in backward "
          "(VocabParallelLinearCrossEntropy, chunks of --lm_head_chunk) and fused with the gradients taken in forward "
          "(VocabParallelLinearCrossEntropySum, the default chunks), time and peak device memory.");
ABSL_FLAG(int, lm_head_rows, 8192, "The LM head rows' token count (GPT-2 124M's 8 x 1024).");
ABSL_FLAG(int, lm_head_vocab, 50304, "The LM head rows' vocabulary (GPT-2's 50257 padded to a multiple of 64).");
ABSL_FLAG(int, lm_head_chunk, 2048, "The fused LM head row's chunk of rows.");
ABSL_FLAG(bool, cpu_rows, true,
          "Run the CPU tables (false: only the GPU row, e.g. at --hidden 4096 --tokens 8192 on a GPU machine).");
ABSL_FLAG(std::string, block, "mlp", "Internal: the block of a multi-process row (mlp or gpt2).");
ABSL_FLAG(std::string, model_dir, "", "Internal: the 1-layer GPT-2 of the gpt2 rows.");

namespace colod {
namespace {

struct BlockResult {
  double step_seconds = 0;
  int64_t comm_bytes_per_step = 0;
};

using bench::MatMulFlops;

// Forward 2 GEMMs, backward 4, each 2*T*H*4H flops.
double BlockFlops(int64_t t, int64_t h) { return 6 * MatMulFlops(t, h, 4 * h); }

// GPT-2's block, forward: q|k|v, the output projection and the MLP's two
// GEMMs (2 T H^2 (3 + 1 + 4 + 4)), and the attention's scores and their
// product with v over the whole S x S square (2 * 2 T S H); backward twice
// that.
double Gpt2BlockFlops(int64_t t, int64_t s, int64_t h) {
  return 3 * (24.0 * static_cast<double>(t) * h * h + 4.0 * static_cast<double>(t) * s * h);
}

// Best of five GEMMs of the block's own shape [T, H] x [H, 4H], in GFLOP/s.
double SgemmPeak(int threads, int64_t t, int64_t h) { return bench::SgemmPeak(threads, t, h, 4 * h) / 1e9; }

absl::StatusOr<v1::ShardConfig> ShardFor(const std::string& mode, int world) {
  v1::ShardConfig shard;
  shard.set_tensor_parallel_size(world);
  shard.set_data_parallel_size(1);
  if (mode == "1d") {
    shard.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_1D);
  } else if (mode == "2d") {
    shard.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
  } else if (mode == "2.5d") {
    shard.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2P5D);
    shard.set_depth(2);
  } else if (mode == "3d") {
    shard.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_3D);
  } else {
    return absl::InvalidArgumentError("mode must be 1d, 2d, 2.5d or 3d");
  }
  return shard;
}

// One step of a block: its forward from a fixed input `x` (in `x_spec`),
// backward from a fixed output gradient, the parameters' gradients cleared.
class Block {
 public:
  Block(Tensor x, DistSpec x_spec, Tensor dy_full, ProcessGroup* pg)
      : x_(std::move(x)), x_spec_(std::move(x_spec)), dy_full_(std::move(dy_full)), pg_(pg) {}
  virtual ~Block() = default;
  absl::Status Step() {
    ASSIGN_OR_RETURN(ColoTensor x, ColoTensor::FromGlobal(x_, x_spec_, pg_, /*requires_grad=*/true));
    ASSIGN_OR_RETURN(ColoTensor y, Forward(x));
    if (!dy_.has_value()) {
      ASSIGN_OR_RETURN(dy_, ColoTensor::FromGlobal(dy_full_, y.spec(), pg_));
    }
    RETURN_IF_ERROR(Backward(y.variable(), dy_->local()));
    for (const ColoParameter& p : Params()) {
      Variable v = p.variable();
      v.ZeroGrad();
    }
    return absl::OkStatus();
  }

 protected:
  virtual absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) = 0;
  virtual std::vector<ColoParameter> Params() const = 0;
  ProcessGroup* pg() const { return pg_; }

 private:
  Tensor x_;
  DistSpec x_spec_;
  Tensor dy_full_;
  std::optional<ColoTensor> dy_;
  ProcessGroup* pg_;
};

// Two linears with a tanh-GELU between them.
template <typename L1, typename L2>
class LayerBlock final : public Block {
 public:
  LayerBlock(L1 l1, L2 l2, Tensor x, DistSpec x_spec, Tensor dy_full, ProcessGroup* pg)
      : Block(std::move(x), std::move(x_spec), std::move(dy_full), pg), l1_(std::move(l1)), l2_(std::move(l2)) {}

 protected:
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override {
    ASSIGN_OR_RETURN(ColoTensor mid, l1_.Forward(x));
    ASSIGN_OR_RETURN(Variable act, nn::Gelu(mid.variable(), ops::GeluApprox::kTanh));
    ASSIGN_OR_RETURN(ColoTensor a, ColoTensor::FromLocal(act, mid.spec(), pg()));
    return l2_.Forward(a);
  }
  std::vector<ColoParameter> Params() const override {
    return {l1_.weight(), *l1_.bias(), l2_.weight(), *l2_.bias()};
  }

 private:
  L1 l1_;
  L2 l2_;
};

// transformer.h.0 of a 1-layer GPT-2 sharded as `mode`: x [B, S, H] in the
// spec its ln_1 takes, the fixed output gradient in the spec it gives.
class Gpt2Block final : public Block {
 public:
  Gpt2Block(std::unique_ptr<shardformer::ShardedModel> model, shardformer::Module* block, Tensor x, DistSpec spec,
            Tensor dy_full, ProcessGroup* pg)
      : Block(std::move(x), std::move(spec), std::move(dy_full), pg), model_(std::move(model)), block_(block) {}

 protected:
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) override { return block_->Forward(x); }
  std::vector<ColoParameter> Params() const override {
    std::vector<ColoParameter> out;
    for (const shardformer::NamedParam& p : model_->Parameters()) out.push_back(p.bound.param);
    return out;
  }

 private:
  std::unique_ptr<shardformer::ShardedModel> model_;
  shardformer::Module* block_;
};

absl::StatusOr<std::unique_ptr<Block>> MakeGpt2Block(const std::string& mode, ProcessGroup* pg, int64_t t,
                                                     int64_t h, Device device, DType dtype) {
  const int64_t s = absl::GetFlag(FLAGS_seq);
  if (s < 1 || t % s != 0) return absl::InvalidArgumentError("--seq must divide --tokens");
  shardformer::ShardConfig shard;
  shard.device = device;
  shard.param_dtype = dtype;  // bf16: 16-bit parameters and compute, as the trainer's mixed precision
  ASSIGN_OR_RETURN(shard.layout, ShardFor(mode, pg->mesh().world_size()));
  ASSIGN_OR_RETURN(std::unique_ptr<shardformer::ShardedModel> model,
                   shardformer::ShardFormer(shard, pg).Load(absl::GetFlag(FLAGS_model_dir)));
  ASSIGN_OR_RETURN(shardformer::Module * block, model->root().Get("transformer.h.0"));
  ASSIGN_OR_RETURN(shardformer::Module * ln_1, block->Get("ln_1"));
  if (ln_1->layer() == nullptr) return absl::InternalError("ln_1 has no layer");
  ASSIGN_OR_RETURN(DistSpec spec, ln_1->layer()->InputSpec(3));
  ASSIGN_OR_RETURN(Tensor x, Tensor::RandomNormal({t / s, s, h}, 15, dtype, device));
  ASSIGN_OR_RETURN(Tensor dy, Tensor::RandomNormal({t / s, s, h}, 16, dtype, device));
  return std::unique_ptr<Block>(new Gpt2Block(std::move(model), block, std::move(x), std::move(spec), std::move(dy), pg));
}

absl::StatusOr<std::unique_ptr<Block>> MakeBlock(const std::string& mode, ProcessGroup* pg, int64_t t, int64_t h,
                                                 Device device, DType dtype) {
  if (absl::GetFlag(FLAGS_block) == "gpt2") return MakeGpt2Block(mode, pg, t, h, device, dtype);
  // Full tensors from fixed seeds: every rank takes its shards of the same model.
  auto make = [&](const Shape& shape, uint64_t seed, float scale) -> absl::StatusOr<Tensor> {
    ASSIGN_OR_RETURN(Tensor v, Tensor::RandomNormal(shape, seed, dtype, device));
    return Scale(v, scale);
  };
  ASSIGN_OR_RETURN(Tensor w1, make({4 * h, h}, 11, 0.02f));  // [out, in]
  ASSIGN_OR_RETURN(Tensor w2, make({h, 4 * h}, 12, 0.02f));
  ASSIGN_OR_RETURN(Tensor b1, make({4 * h}, 13, 1.0f));
  ASSIGN_OR_RETURN(Tensor b2, make({h}, 14, 1.0f));
  ASSIGN_OR_RETURN(Tensor x, make({t, h}, 15, 1.0f));
  ASSIGN_OR_RETURN(Tensor dy, make({t, h}, 16, 1.0f));
  if (mode == "1d") {
    ASSIGN_OR_RETURN(nn::Linear1DCol col, nn::Linear1DCol::FromGlobal(w1, b1, pg, {}));
    ASSIGN_OR_RETURN(nn::Linear1DRow row, nn::Linear1DRow::FromGlobal(w2, b2, pg, {}));
    return std::unique_ptr<Block>(new LayerBlock<nn::Linear1DCol, nn::Linear1DRow>(
        std::move(col), std::move(row), x, DistSpec(), dy, pg));
  }
  // 2D, 2.5D and 3D take weights as [in, out].
  ASSIGN_OR_RETURN(Tensor a1, w1.Transpose(0, 1));
  ASSIGN_OR_RETURN(Tensor a2, w2.Transpose(0, 1));
  a1 = a1.Contiguous();
  a2 = a2.Contiguous();
  if (mode == "3d") {
    ASSIGN_OR_RETURN(nn::Linear3D l1, nn::Linear3D::FromGlobal(a1, b1, pg, {}));
    ASSIGN_OR_RETURN(nn::Linear3D l2, nn::Linear3D::FromGlobal(a2, b2, pg, {.swap = true}));
    DistSpec spec = l1.InputSpec(2);
    return std::unique_ptr<Block>(
        new LayerBlock<nn::Linear3D, nn::Linear3D>(std::move(l1), std::move(l2), x, spec, dy, pg));
  }
  ASSIGN_OR_RETURN(nn::Linear2D l1, nn::Linear2D::FromGlobal(a1, b1, pg));
  ASSIGN_OR_RETURN(nn::Linear2D l2, nn::Linear2D::FromGlobal(a2, b2, pg));
  const int q = mode == "2d" ? IntegerRoot(pg->mesh().world_size(), 2) : IntegerRoot(pg->mesh().world_size() / 2, 2);
  const DistSpec spec = nn::Activation2D(2, q, mode == "2d" ? 1 : 2);
  return std::unique_ptr<Block>(
      new LayerBlock<nn::Linear2D, nn::Linear2D>(std::move(l1), std::move(l2), x, spec, dy, pg));
}

// Payload bytes per rank per step the block's algorithm implies (in the
// conventions InstrumentedCommunicator counts: all_reduce/all_gather/
// broadcast their count, reduce_scatter its input).
int64_t FormulaBytes(const std::string& mode, int world, int64_t t, int64_t h) {
  const int64_t f = 4;  // bytes per f32
  if (world == 1) return 0;
  if (mode == "1d") return 2 * t * h * f;  // one all-reduce of [T, H] forward, one backward
  // A linear layer in -> out.
  auto layer = [&](int64_t in, int64_t out) -> int64_t {
    if (mode == "3d") {
      const int64_t q = 2;  // the bench runs q = 2
      const int64_t x = t / (q * q) * in / q, a = in / q * out / (q * q), y = t / (q * q) * out / q;
      // fwd: gather X, gather A, reduce-scatter q*Y; bwd: gather dY, reduce-scatter q*dX and q*dA;
      // bias: all-reduce over R and over C.
      return x + a + q * y + y + q * x + q * a + 2 * (out / q);
    }
    const int64_t d = mode == "2.5d" ? 2 : 1, q = 2;
    const int64_t x = t / (d * q) * in / q, a = in / q * out / q;
    // SUMMA: q broadcasts of X and of A forward, again backward, and the
    // reduce-scatters of q partial dX and q partial dA; depth: all-reduce of
    // dA; bias: all-reduce over tp_col (and depth).
    return 2 * q * (x + a) + q * x + q * a + (d > 1 ? a : 0) + (out / q) * d;
  };
  return (layer(h, 4 * h) + layer(4 * h, h)) * f;
}

absl::StatusOr<BlockResult> RunBlock(const std::string& mode, int rank, int world, int threads, Store* store,
                                     Device device = Device::Cpu(), DType dtype = DType::kF32) {
  kernels::cpu::SetBlasThreads(threads);
  const int64_t t = absl::GetFlag(FLAGS_tokens), h = absl::GetFlag(FLAGS_hidden);
  ASSIGN_OR_RETURN(v1::ShardConfig shard, ShardFor(mode, world));
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromShardConfig(shard));
  // Gloo for host tensors, NCCL on the device for CUDA ones; every
  // communicator counted.
  RankGroupOptions o;
  o.device = device;
  o.timeout = absl::Minutes(5);
  std::vector<InstrumentedCommunicator*> counted;
  o.wrap = [&counted](std::unique_ptr<Communicator> inner, const ProcessGroup::GroupInfo&) {
    auto* inst = new InstrumentedCommunicator(std::move(inner));
    counted.push_back(inst);
    return std::unique_ptr<Communicator>(inst);
  };
  ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> pg, CreateRankGroup(mesh, rank, store, std::move(o)));
  RETURN_IF_ERROR(pg->InitAxes());
  ASSIGN_OR_RETURN(Communicator * all, pg->Comm(mesh.AxisIndices("tp").ok() ? "tp" : mesh.axes().back().name));
  ASSIGN_OR_RETURN(std::unique_ptr<Block> block, MakeBlock(mode, pg.get(), t, h, device, dtype));
  auto bytes = [&] {
    int64_t b = 0;
    for (InstrumentedCommunicator* c : counted) {
      for (const auto& [op, st] : c->AllStats()) {
        if (op != "barrier") b += st.bytes;
      }
    }
    return b;
  };
  RETURN_IF_ERROR(block->Step());  // warm-up: connections, page faults
  const int64_t bytes_before = bytes();
  const int steps = std::max(1, absl::GetFlag(FLAGS_steps));
  std::vector<double> times;
  for (int i = 0; i < steps; ++i) {
    RETURN_IF_ERROR(all->Barrier()->Wait(absl::Minutes(5)));
    const absl::Time t0 = absl::Now();
    RETURN_IF_ERROR(block->Step());
    // Device ops only enqueue: the step ends when the device finished it.
    if (device.is_cuda()) RETURN_IF_ERROR(kernels::CudaSynchronize(device.index));
    times.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
  }
  RETURN_IF_ERROR(all->Barrier()->Wait(absl::Minutes(5)));
  std::sort(times.begin(), times.end());
  BlockResult r;
  r.step_seconds = times[times.size() / 2];
  r.comm_bytes_per_step = (bytes() - bytes_before) / steps;
  return r;
}

// Runs `world` copies of this binary as ranks; the slowest rank's result.
absl::StatusOr<BlockResult> RunProcesses(const std::string& mode, int world) {
  BlockResult worst;
  RETURN_IF_ERROR(bench::RunSelfAsRanks(
      world,
      [&](int r, const std::string& dir) -> std::vector<std::string> {
        return {absl::StrCat("--rank=", r),
                absl::StrCat("--world=", world),
                "--mode=" + mode,
                "--store_dir=" + dir,
                "--block=" + absl::GetFlag(FLAGS_block),
                "--model_dir=" + absl::GetFlag(FLAGS_model_dir),
                absl::StrCat("--seq=", absl::GetFlag(FLAGS_seq)),
                absl::StrCat("--steps=", absl::GetFlag(FLAGS_steps)),
                absl::StrCat("--tokens=", absl::GetFlag(FLAGS_tokens)),
                absl::StrCat("--hidden=", absl::GetFlag(FLAGS_hidden))};
      },
      [](const std::string& line) { std::fputs(line.c_str(), stdout); },  // rank 0's output, as before
      [&](const std::string& dir) {
        for (int r = 0; r < world; ++r) {
          std::ifstream in(absl::StrCat(dir, "/result.", r));
          BlockResult one;
          in >> one.step_seconds >> one.comm_bytes_per_step;
          worst.step_seconds = std::max(worst.step_seconds, one.step_seconds);
          worst.comm_bytes_per_step = std::max(worst.comm_bytes_per_step, one.comm_bytes_per_step);
        }
      }));
  return worst;
}

int RankMain() {
  const int rank = absl::GetFlag(FLAGS_rank), world = absl::GetFlag(FLAGS_world);
  auto store = FileStore::Open(absl::GetFlag(FLAGS_store_dir));
  if (!store.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, store.status().ToString().c_str());
    return 1;
  }
  auto r = RunBlock(absl::GetFlag(FLAGS_mode), rank, world, 1, store->get());
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

namespace colod {
namespace {

struct Config {
  std::string mode;
  int ranks, threads;
  const char* layout;
};

// One table: `block` (mlp or gpt2) in each layout, with its flops per step;
// false when a row failed (its error on stderr).
bool RunTable(const std::string& block, const std::vector<Config>& configs, double flops, double peak1,
              double peak2) {
  absl::SetFlag(&FLAGS_block, block);
  const bool json = absl::GetFlag(FLAGS_json);
  const int64_t t = absl::GetFlag(FLAGS_tokens), h = absl::GetFlag(FLAGS_hidden);
  if (!json) {
    std::printf("%4s  %5s  %-22s  %9s  %8s  %9s  %16s  %16s  %10s\n", "mode", "ranks", "layout", "step (ms)",
                "GFLOP/s", "% of peak", "comm B/rank/step", "formula B", "vs tp=1x1");
  }
  double base = 0;
  for (const Config& c : configs) {
    absl::StatusOr<BlockResult> r;
    if (c.ranks == 1) {
      auto shared = std::make_shared<RendezvousStore>();
      InMemoryStore store(shared, "bench");
      r = RunBlock(c.mode, 0, 1, c.threads, &store);
    } else {
      r = RunProcesses(c.mode, c.ranks);
    }
    if (!r.ok()) {
      std::fprintf(stderr, "%s %s on %d ranks: %s\n", block.c_str(), c.mode.c_str(), c.ranks,
                   r.status().ToString().c_str());
      return false;
    }
    if (c.ranks == 1 && c.threads == 1) base = r->step_seconds;
    // Work per rank is flops / ranks; peak is per rank with its thread count.
    const double achieved = flops / c.ranks / r->step_seconds / 1e9;
    const double peak = c.threads == 1 ? peak1 : peak2;
    // The MLP's formula; the whole block's is the planner's business (coloctl plan).
    const int64_t formula = block == "mlp" ? FormulaBytes(c.mode, c.ranks, t, h) : -1;
    if (json) {
      std::printf("{\"bench\":\"%s\",\"mode\":\"%s\",\"dtype\":\"f32\",\"tokens\":%lld,\"hidden\":%lld,"
                  "\"ranks\":%d,\"threads_per_rank\":%d,\"step_seconds\":%.6f,\"gflops_per_rank\":%.3f,"
                  "\"sgemm_peak_gflops\":%.3f,\"fraction_of_peak\":%.4f,\"comm_bytes_per_rank_step\":%lld,"
                  "\"formula_bytes\":%lld,\"step_vs_tp1_1thread\":%.4f}\n",
                  block == "mlp" ? "mlp_block" : "gpt2_block", c.mode.c_str(), static_cast<long long>(t),
                  static_cast<long long>(h), c.ranks, c.threads, r->step_seconds, achieved, peak, achieved / peak,
                  static_cast<long long>(r->comm_bytes_per_step), static_cast<long long>(formula),
                  r->step_seconds / base);
    } else {
      std::printf("%4s  %5d  %-22s  %9.1f  %8.1f  %8.1f%%  %16lld  %16s  %9.2fx\n", c.mode.c_str(), c.ranks,
                  c.layout, r->step_seconds * 1e3, achieved, 100 * achieved / peak,
                  static_cast<long long>(r->comm_bytes_per_step),
                  formula >= 0 ? absl::StrCat(formula).c_str() : "-", r->step_seconds / base);
    }
    std::fflush(stdout);
  }
  return true;
}

}  // namespace
}  // namespace colod

namespace colod {

// A 1-layer GPT-2 of hidden size h, 64-wide heads, in a new temporary
// directory (--model_dir names it, for every rank to load); "" on failure.
std::string WriteGpt2Block(int64_t h, int64_t seq) {
  char dir_template[] = "/tmp/colod-bench-gpt2-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) return "";
  const std::string dir = dir_template;
  shardformer::Gpt2Shape shape;
  shape.hidden_size = h;
  shape.num_layers = 1;
  shape.num_heads = std::max<int64_t>(1, h / 64);
  shape.max_positions = seq;
  const absl::Status written = shardformer::WriteInitializedGpt2(dir, shape, 1);
  if (!written.ok()) {
    std::fprintf(stderr, "writing the GPT-2 block: %s\n", written.ToString().c_str());
    return "";
  }
  absl::SetFlag(&FLAGS_model_dir, dir);
  return dir;
}

// The MLP block's table and, with --gpt2_block, the GPT-2 block's, on the CPU.
bool RunCpuTables(int64_t t, int64_t h, double flops, bool json) {
  const double peak1 = SgemmPeak(1, t, h), peak2 = SgemmPeak(2, t, h);
  if (!json) {
    std::printf("MLP block (Linear1D_Col -> GELU -> Linear1D_Row), f32, tokens %lld, hidden %lld, inner %lld: "
                "%.1f GFLOP per step (fwd+bwd)\nOpenBLAS sgemm peak, same run, [T,H]x[H,4H]: 1 thread %.1f "
                "GFLOP/s, 2 threads %.1f GFLOP/s\n\n",
                static_cast<long long>(t), static_cast<long long>(h), static_cast<long long>(4 * h), flops / 1e9,
                peak1, peak2);
  }
  std::vector<colod::Config> configs = {{"1d", 1, 1, "1 process x 1 thread"},
                                        {"1d", 1, 2, "1 process x 2 threads"},
                                        {"1d", 2, 1, "2 processes x 1 thread"}};
  if (absl::GetFlag(FLAGS_all_modes)) {
    configs.push_back({"2d", 4, 1, "4 processes x 1 thread"});
    configs.push_back({"2.5d", 8, 1, "8 processes x 1 thread"});
    configs.push_back({"3d", 8, 1, "8 processes x 1 thread"});
  }
  if (!colod::RunTable("mlp", configs, flops, peak1, peak2)) return false;
  if (absl::GetFlag(FLAGS_gpt2_block)) {
    const int64_t seq = absl::GetFlag(FLAGS_seq);
    const std::string dir = WriteGpt2Block(h, seq);
    if (dir.empty()) return false;
    const double block_flops = colod::Gpt2BlockFlops(t, seq, h);
    if (!json) {
      std::printf("\nGPT-2 block (ln_1 -> causal attention -> ln_2 -> MLP, residuals; the policy's layers), f32, "
                  "%lld sequences x %lld tokens, hidden %lld, %lld heads: %.1f GFLOP per step (fwd+bwd, the "
                  "attention's whole S x S)\n\n",
                  static_cast<long long>(t / std::max<int64_t>(1, seq)), static_cast<long long>(seq),
                  static_cast<long long>(h), static_cast<long long>(std::max<int64_t>(1, h / 64)), block_flops / 1e9);
    }
    const bool ok = colod::RunTable("gpt2", configs, block_flops, peak1, peak2);
    std::string cleanup = "rm -rf " + dir;
    (void)std::system(cleanup.c_str());
    if (!ok) return false;
  }
  return true;
}

// Calls cuDNN's attention served (none in a build without CUDA).
int64_t CudnnCalls() {
#ifdef COLOD_WITH_CUDA
  return kernels::cuda::CudnnAttentionCalls();
#else
  return 0;
#endif
}

// The fused attention alone on `gpu`, bf16, causal, at --attention_seq
// (2048: issue 44's shapes, 16 heads of 128 and 32 heads of 64, batch
// --attention_batch, 4): forward, and
// forward + backward, medians of --steps timed runs after a warm-up, each
// ended by a device synchronization. FLOPs as FlashAttention-2 counts them:
// the forward's two matmuls 4 b h s^2 d, halved by the causal mask; the
// backward 2.5 times the forward.
bool RunAttentionRows(Device gpu, double gpu_peak, bool json) {
  struct Shape {
    int64_t b, s, heads, d;
    bool one_row_tile = false;  // COLOD_ATTENTION_ROW_TILES=1: the kernels' 64-row blocks at head dim 64
    bool deterministic = false;  // COLOD_DETERMINISTIC=1: the two-kernel backward without atomics
    bool cudnn = false;          // COLOD_ATTENTION=cudnn: cuDNN's fused attention (kernels/cuda/cudnn_attention.h)
  };
  const int steps = std::max(1, absl::GetFlag(FLAGS_steps));
  if (!json) {
    std::printf("\nGPU (cuda:0) fused attention, bf16, causal (FlashAttention-2's FLOP count; backward = "
                "forward + backward - forward):\n%6s %6s %6s %5s  %9s %9s  %9s %9s\n",
                "batch", "seq", "heads", "dim", "fwd (ms)", "TFLOP/s", "bwd (ms)", "TFLOP/s");
  }
  const int64_t b = std::max(1, absl::GetFlag(FLAGS_attention_batch)), s = std::max(1, absl::GetFlag(FLAGS_attention_seq));
  // Each head dim with the one-pass backward (the default), with the
  // deterministic two kernels, and with the forward's 64-row blocks (one row
  // tile of 16 a warp, where the default takes two), to compare them on this
  // GPU, and cuDNN's fused attention in its place. The rows set the
  // switches themselves; the table ends with them unset.
  struct UnsetAtExit {
    ~UnsetAtExit() {
      unsetenv("COLOD_ATTENTION_ROW_TILES");
      unsetenv("COLOD_DETERMINISTIC");
      unsetenv("COLOD_ATTENTION");
    }
  } unset_at_exit;
  for (Shape sh : {Shape{b, s, 16, 128}, Shape{b, s, 16, 128, false, true}, Shape{b, s, 16, 128, true},
                   Shape{b, s, 16, 128, false, false, true}, Shape{b, s, 32, 64}, Shape{b, s, 32, 64, false, true},
                   Shape{b, s, 32, 64, true}, Shape{b, s, 32, 64, false, false, true}}) {
    if (sh.cudnn) {
      setenv("COLOD_ATTENTION", "cudnn", 1);
    } else {
      unsetenv("COLOD_ATTENTION");
    }
    const int64_t cudnn_calls = CudnnCalls();
    if (sh.one_row_tile) {
      setenv("COLOD_ATTENTION_ROW_TILES", "1", 1);
    } else {
      unsetenv("COLOD_ATTENTION_ROW_TILES");
    }
    if (sh.deterministic) {
      setenv("COLOD_DETERMINISTIC", "1", 1);
    } else {
      unsetenv("COLOD_DETERMINISTIC");
    }
    const double fwd_flops = 2.0 * sh.b * sh.heads * static_cast<double>(sh.s) * sh.s * sh.d;
    auto make = [&](uint64_t seed) -> absl::StatusOr<Tensor> {
      return Tensor::RandomNormal({sh.b, sh.s, sh.heads, sh.d}, seed, DType::kBF16, gpu);
    };
    auto q = make(1), k = make(2), v = make(3), dout = make(4);
    for (const auto* t : {&q, &k, &v, &dout}) {
      if (!t->ok()) {
        std::fprintf(stderr, "attention row: %s\n", t->status().ToString().c_str());
        return false;
      }
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(sh.d));
    // One timed run: the forward (and, with `backward`, its backward) and a synchronization.
    auto run = [&](bool backward) -> absl::StatusOr<double> {
      Variable vq(*q, backward), vk(*k, backward), vv(*v, backward);
      RETURN_IF_ERROR(kernels::CudaSynchronize(gpu.index));
      const absl::Time start = absl::Now();
      ASSIGN_OR_RETURN(Variable out, nn::Attention(vq, vk, vv, scale, /*causal=*/true));
      if (backward) RETURN_IF_ERROR(Backward(out, *dout));
      RETURN_IF_ERROR(kernels::CudaSynchronize(gpu.index));
      return absl::ToDoubleSeconds(absl::Now() - start);
    };
    std::vector<double> fwd, both;
    for (int i = 0; i <= steps; ++i) {
      absl::StatusOr<double> f = run(false), fb = run(true);
      if (!f.ok() || !fb.ok()) {
        std::fprintf(stderr, "attention row: %s\n", (f.ok() ? fb.status() : f.status()).ToString().c_str());
        return false;
      }
      if (i > 0) {  // the first is the warm-up
        fwd.push_back(*f);
        both.push_back(*fb);
      }
    }
    std::sort(fwd.begin(), fwd.end());
    std::sort(both.begin(), both.end());
    // Whether cuDNN ran every call of a cuDNN row (else it said why on
    // stderr, and colod's kernels ran).
    const bool cudnn_ran = CudnnCalls() - cudnn_calls == 3 * (steps + 1);
    const double tf = fwd[fwd.size() / 2], tb = std::max(1e-9, both[both.size() / 2] - tf);
    const double fwd_tflops = fwd_flops / tf / 1e12, bwd_tflops = 2.5 * fwd_flops / tb / 1e12;
    if (json) {
      std::printf("{\"bench\":\"attention\",\"dtype\":\"bf16\",\"device\":\"cuda:0\",\"causal\":true,"
                  "\"batch\":%lld,\"seq\":%lld,\"heads\":%lld,\"head_dim\":%lld,\"forward_seconds\":%.6f,"
                  "\"forward_tflops\":%.3f,\"backward_seconds\":%.6f,\"backward_tflops\":%.3f,"
                  "\"row_tiles_a_warp\":%d,\"deterministic_backward\":%s,\"kernels\":\"%s\","
                  "\"cublas_bf16_peak_tflops\":%.3f}\n",
                  static_cast<long long>(sh.b), static_cast<long long>(sh.s), static_cast<long long>(sh.heads),
                  static_cast<long long>(sh.d), tf, fwd_tflops, tb, bwd_tflops, (sh.d == 64 || sh.d == 128) && !sh.one_row_tile ? 2 : 1,
                  sh.deterministic ? "true" : "false",
                  !sh.cudnn ? "colod" : cudnn_ran ? "cudnn" : "colod (cuDNN unavailable)", gpu_peak);
    } else {
      std::printf("%6lld %6lld %6lld %5lld  %9.3f %9.1f  %9.3f %9.1f%s\n", static_cast<long long>(sh.b),
                  static_cast<long long>(sh.s), static_cast<long long>(sh.heads), static_cast<long long>(sh.d),
                  tf * 1e3, fwd_tflops, tb * 1e3, bwd_tflops,
                  sh.one_row_tile   ? "  (one row tile a warp: COLOD_ATTENTION_ROW_TILES=1)"
                  : sh.deterministic ? "  (two backward kernels, no atomics: COLOD_DETERMINISTIC=1)"
                  : !sh.cudnn        ? ""
                  : cudnn_ran        ? "  (cuDNN's fused attention: COLOD_ATTENTION=cudnn)"
                                     : "  (COLOD_ATTENTION=cudnn, cuDNN unavailable: colod's kernels ran)");
    }
    std::fflush(stdout);
  }
  return true;
}

// The memory-bound kernels outside the GEMMs and the attention on `gpu`, in
// bf16 at GPT-2 124M's shapes (--bandwidth_rows tokens, hidden 768, MLP
// 3072): each one's bytes read and written once per second, against the
// device's copy bandwidth measured in the same run (a device-to-device copy
// of 256 MiB at the default token count, read + write). Medians of --steps timed runs after a warm-up,
// each between device synchronizations.
bool RunBandwidthRows(Device gpu, bool json) {
  const int steps = std::max(1, absl::GetFlag(FLAGS_steps));
  auto time = [&](auto fn) -> absl::StatusOr<double> {
    std::vector<double> t;
    for (int i = 0; i <= steps; ++i) {
      RETURN_IF_ERROR(kernels::CudaSynchronize(gpu.index));
      const absl::Time start = absl::Now();
      RETURN_IF_ERROR(fn());
      RETURN_IF_ERROR(kernels::CudaSynchronize(gpu.index));
      if (i > 0) t.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "bandwidth row: %s\n", s.ToString().c_str());
    return false;
  };
  const int64_t rows = std::max(1, absl::GetFlag(FLAGS_bandwidth_rows));
  // The copy: 128 Mi bf16 elements (less for a small --bandwidth_rows), read and written.
  const int64_t copy_elems = std::min(int64_t{128} << 20, 16 * rows * 3072);
  absl::StatusOr<Tensor> src = Tensor::Zeros({copy_elems}, DType::kBF16, gpu);
  absl::StatusOr<Tensor> dst = Tensor::Zeros({copy_elems}, DType::kBF16, gpu);
  if (!src.ok() || !dst.ok()) return fail(src.ok() ? dst.status() : src.status());
  absl::StatusOr<double> copy = time([&] { return dst->CopyFrom(*src); });
  if (!copy.ok()) return fail(copy.status());
  const double copy_gbs = 2.0 * copy_elems * 2 / *copy / 1e9;
  src = dst = absl::CancelledError("freed");  // the copy's 512 MiB back to the pool
  if (!json) {
    std::printf("\nGPU (cuda:0) memory-bound kernels, bf16, %d tokens (copy bandwidth %.0f GB/s, same run):\n"
                "%-34s %14s  %9s %9s %9s\n",
                absl::GetFlag(FLAGS_bandwidth_rows), copy_gbs, "kernel", "shape", "time (us)", "GB/s", "of copy");
  }
  struct Row {
    const char* name;
    int64_t n;
  };
  // GPT-2 124M's shapes: the QKV projection's bias (2304), the MLP's bias
  // and GELU (3072), the residual add (768), the head split (one of Q, K, V
  // of [tokens, 3, 12, 64] heads first), the bias and norm gradients (the
  // sharded norm's NormParamGrad alone; the unsharded norms' backward, dx
  // with dgamma and dbeta in one pass, and RMSNorm's at LLaMA 1B's 2048).
  for (Row row : {Row{"bias_add", 2304}, Row{"bias_gelu", 3072}, Row{"add (residual)", 768},
                  Row{"head_split", 768}, Row{"bias_grad", 768}, Row{"bias_grad", 3072},
                  Row{"bias_gelu_backward", 3072}, Row{"norm_param_grad (layer norm)", 768},
                  Row{"layer_norm_backward", 768}, Row{"rms_norm_backward", 2048}}) {
    auto make = [&](const Shape& shape, uint64_t seed) { return Tensor::RandomNormal(shape, seed, DType::kBF16, gpu); };
    absl::StatusOr<Tensor> dy = make({rows, row.n}, 1), x = make({rows, row.n}, 2), b = make({row.n}, 3);
    absl::StatusOr<Tensor> mean = Tensor::RandomNormal({rows}, 4, DType::kF32, gpu);
    absl::StatusOr<Tensor> rstd = Tensor::RandomNormal({rows}, 5, DType::kF32, gpu);
    for (const auto* t : {&dy, &x, &b, &mean, &rstd}) {
      if (!t->ok()) return fail(t->status());
    }
    const double elems = static_cast<double>(rows) * row.n;
    double bytes = 0;  // read and written once
    absl::StatusOr<double> t = absl::UnknownError("no kernel");
    const std::string name = row.name;
    if (name == "bias_add" || name == "bias_gelu") {
      bytes = elems * 2 * 2 + row.n * 2.0;  // x read, y written; b read
      t = time([&]() -> absl::Status {
        return (name == "bias_add" ? ops::BiasAdd(*x, *b) : ops::BiasGelu(*x, *b, ops::GeluApprox::kTanh)).status();
      });
    } else if (name == "add (residual)") {
      bytes = elems * 2 * 3;
      t = time([&]() -> absl::Status { return Add(*x, *dy).status(); });
    } else if (name == "head_split") {
      absl::StatusOr<Tensor> qkv = make({rows, 3, 12, 64}, 6);
      if (!qkv.ok()) return fail(qkv.status());
      bytes = elems * 2 * 2;  // one third of qkv read, written heads first
      t = time([&]() -> absl::Status {
        ASSIGN_OR_RETURN(Tensor k, qkv->Narrow(1, 1, 1));
        ASSIGN_OR_RETURN(Tensor heads_first, k.Transpose(0, 2));
        (void)heads_first.Contiguous();  // a device error shows at time()'s synchronization
        return absl::OkStatus();
      });
    } else if (name == "bias_grad") {
      bytes = elems * 2 + row.n * 2.0;
      t = time([&]() -> absl::Status { return ops::BiasGrad(*dy).status(); });
    } else if (name == "bias_gelu_backward") {
      bytes = elems * 2 * 3 + row.n * 2.0 * 2;  // dy, x read, dx written; b read, db written
      t = time([&]() -> absl::Status { return ops::BiasGeluBackward(*dy, *x, *b, ops::GeluApprox::kTanh).status(); });
    } else if (name == "layer_norm_backward") {
      // dy, x read, dx written; mean, rstd; gamma read, dgamma and dbeta written in the same pass.
      bytes = elems * 2 * 3 + rows * 4.0 * 2 + row.n * 2.0 * 3;
      t = time([&]() -> absl::Status { return ops::LayerNormBackward(*dy, *x, *b, *mean, *rstd).status(); });
    } else if (name == "rms_norm_backward") {
      // LLaMA 1B's width: dy, x read, dx written; rstd; gamma read, dgamma written in the same pass.
      bytes = elems * 2 * 3 + rows * 4.0 + row.n * 2.0 * 2;
      t = time([&]() -> absl::Status { return ops::RmsNormBackward(*dy, *x, *b, *rstd).status(); });
    } else {
      bytes = elems * 2 * 2 + rows * 4.0 * 2 + row.n * 4.0 * 2;  // dy, x; mean, rstd; dgamma, dbeta (f32)
      t = time([&]() -> absl::Status { return ops::NormParamGrad(*dy, *x, *mean, *rstd, /*beta=*/true).status(); });
    }
    if (!t.ok()) return fail(t.status());
    const double gbs = bytes / *t / 1e9;
    if (json) {
      std::printf("{\"bench\":\"memory_bound\",\"kernel\":\"%s\",\"dtype\":\"bf16\",\"device\":\"cuda:0\","
                  "\"rows\":%lld,\"cols\":%lld,\"seconds\":%.7f,\"gb_per_s\":%.1f,\"copy_gb_per_s\":%.1f,"
                  "\"fraction_of_copy\":%.4f}\n",
                  row.name, static_cast<long long>(rows), static_cast<long long>(row.n), *t, gbs, copy_gbs,
                  gbs / copy_gbs);
    } else {
      std::printf("%-34s %14s  %9.1f %9.0f %8.1f%%\n", row.name,
                  absl::StrCat("[", rows, ", ", row.n, "]").c_str(), *t * 1e6, gbs, 100 * gbs / copy_gbs);
    }
    std::fflush(stdout);
  }
  return true;
}

// A one-rank tp=1 group on `gpu` (NCCL).
absl::StatusOr<std::unique_ptr<ProcessGroup>> MakeGpuGroup(Store* store, Device gpu) {
  ASSIGN_OR_RETURN(v1::ShardConfig shard, ShardFor("1d", 1));
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromShardConfig(shard));
  RankGroupOptions o;
  o.device = gpu;
  o.timeout = absl::Minutes(5);
  ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> pg, CreateRankGroup(mesh, 0, store, std::move(o)));
  RETURN_IF_ERROR(pg->InitAxes());
  return pg;
}

// GPT-2 124M's LM head and loss on `gpu` in bf16 at tp=1 (--lm_head_rows
// tokens of hidden 768 over --lm_head_vocab words): the head as a linear and
// VocabParallelCrossEntropy on its logits, against
// VocabParallelLinearCrossEntropy in chunks of --lm_head_chunk rows (the
// logits recomputed in backward: the head with pipeline stages) and
// VocabParallelLinearCrossEntropySum in the product's default chunks (the
// gradients taken in forward: the head without them); forward + backward,
// medians of --steps timed runs after a warm-up, and the peak pool memory
// above what was in use before (the logits, their f32 copy and their
// gradient, against one chunk's).
bool RunLmHeadRows(Device gpu, bool json) {
  const int steps = std::max(1, absl::GetFlag(FLAGS_steps));
  const int64_t rows = std::max(1, absl::GetFlag(FLAGS_lm_head_rows)), h = 768;
  const int64_t vocab = std::max(1, absl::GetFlag(FLAGS_lm_head_vocab));
  const int64_t chunk = std::max(1, absl::GetFlag(FLAGS_lm_head_chunk));
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "LM head row: %s\n", s.ToString().c_str());
    return false;
  };
  auto shared = std::make_shared<RendezvousStore>();
  InMemoryStore store(shared, "bench-lm-head");
  absl::StatusOr<std::unique_ptr<ProcessGroup>> pg = MakeGpuGroup(&store, gpu);
  if (!pg.ok()) return fail(pg.status());
  absl::StatusOr<Tensor> hidden = Tensor::RandomNormal({rows, h}, 1, DType::kBF16, gpu);
  absl::StatusOr<Tensor> weight = Tensor::RandomNormal({vocab, h}, 2, DType::kBF16, gpu);
  absl::StatusOr<Tensor> dloss = Tensor::RandomNormal({rows}, 3, DType::kF32, gpu);
  std::vector<int64_t> lab(rows);
  for (int64_t i = 0; i < rows; ++i) lab[i] = (i * 7919) % vocab;
  absl::StatusOr<Tensor> labels = Tensor::FromInt64s({rows}, lab);
  for (const auto* t : {&hidden, &weight, &dloss, &labels}) {
    if (!t->ok()) return fail(t->status());
  }
  if (!json) {
    std::printf("\nGPU (cuda:0) LM head + cross-entropy, bf16, %lld tokens x %lld hidden x %lld vocab, forward + "
                "backward:\n%-52s %9s %16s\n",
                static_cast<long long>(rows), static_cast<long long>(h), static_cast<long long>(vocab), "path",
                "time (ms)", "peak memory (MiB)");
  }
  // The product's default chunk (ShardedModel's kFusedHeadByBytes: the
  // rows whose bf16 logits fit kFusedHeadChunkBytes).
  const int64_t by_bytes = std::min<int64_t>(
      rows, std::max<int64_t>(1, shardformer::ShardedModel::kFusedHeadChunkBytes / (vocab * static_cast<int64_t>(2))));
  absl::StatusOr<Tensor> dsum = dloss->Narrow(0, 0, 1);
  if (dsum.ok()) dsum = dsum->Reshape({});
  if (!dsum.ok()) return fail(dsum.status());
  for (int fused = 0; fused < 3; ++fused) {
    const int64_t rows_a_chunk = fused == 2 ? by_bytes : chunk;
    std::vector<double> times;
    int64_t peak = 0;
    for (int i = 0; i <= steps; ++i) {
      absl::Status s = kernels::CudaSynchronize(gpu.index);
      absl::StatusOr<kernels::CudaPoolBytes> before = kernels::GetCudaPoolBytes(gpu.index);
      if (s.ok() && !before.ok()) s = before.status();
      if (s.ok()) s = kernels::ResetCudaPoolPeak(gpu.index);
      if (!s.ok()) return fail(s);
      const absl::Time start = absl::Now();
      s = [&]() -> absl::Status {
        ASSIGN_OR_RETURN(ColoTensor w, ColoTensor::FromGlobal(*weight, DistSpec().Set("tp", Placement::Shard({0}, {1})),
                                                              pg->get(), /*requires_grad=*/true));
        Variable x(*hidden, true);
        Variable loss;
        if (fused == 2) {  // as without pipeline stages
          ASSIGN_OR_RETURN(loss, nn::VocabParallelLinearCrossEntropySum(x, w, *labels, vocab, rows_a_chunk));
          RETURN_IF_ERROR(Backward(loss, *dsum));
          return kernels::CudaSynchronize(gpu.index);
        }
        if (fused == 1) {  // as with them
          ASSIGN_OR_RETURN(loss, nn::VocabParallelLinearCrossEntropy(x, w, *labels, vocab, rows_a_chunk));
        } else {
          ASSIGN_OR_RETURN(Variable z, nn::Linear(x, w.variable(), std::nullopt));
          ASSIGN_OR_RETURN(ColoTensor logits,
                           ColoTensor::FromLocal(z, DistSpec().Set("tp", Placement::Shard({1}, {1})), pg->get()));
          ASSIGN_OR_RETURN(loss, nn::VocabParallelCrossEntropy(logits, *labels, vocab));
        }
        RETURN_IF_ERROR(Backward(loss, *dloss));
        return kernels::CudaSynchronize(gpu.index);
      }();
      if (!s.ok()) return fail(s);
      if (i > 0) times.push_back(absl::ToDoubleSeconds(absl::Now() - start));
      absl::StatusOr<kernels::CudaPoolBytes> after = kernels::GetCudaPoolBytes(gpu.index);
      if (!after.ok()) return fail(after.status());
      peak = std::max(peak, after->used_high - before->used);
    }
    std::sort(times.begin(), times.end());
    const double t = times[times.size() / 2];
    const char* path = fused == 2 ? "fused_grads_in_forward" : fused ? "fused" : "unfused";
    if (json) {
      std::printf("{\"bench\":\"lm_head_loss\",\"path\":\"%s\",\"dtype\":\"bf16\",\"device\":\"cuda:0\","
                  "\"rows\":%lld,\"hidden\":%lld,\"vocab\":%lld,\"chunk_rows\":%lld,\"seconds\":%.6f,"
                  "\"peak_bytes\":%lld}\n",
                  path, static_cast<long long>(rows), static_cast<long long>(h), static_cast<long long>(vocab),
                  static_cast<long long>(fused ? rows_a_chunk : rows), t, static_cast<long long>(peak));
    } else {
      const std::string name =
          !fused       ? std::string("unfused (linear, then loss)")
          : fused == 1 ? absl::StrCat("fused, chunks of ", chunk, " (pipeline stages)")
                       : absl::StrCat("fused, grads in forward, chunks of ", by_bytes, " (the default)");
      std::printf("%-52s %9.2f %16.1f\n", name.c_str(), t * 1e3, peak / 1048576.0);
    }
    std::fflush(stdout);
  }
  return true;
}

// Where a GPU is present, on cuda:0 in bf16 at tp=1: the MLP block, and with
// --gpt2_block the whole GPT-2 block (attention included), each against
// cuBLAS's bf16 GEMM on the MLP's shape in the same run. Returns main's exit
// code.
int RunGpuRow(int64_t t, int64_t h, double flops, bool json) {
  if (kernels::CudaDeviceCount() == 0) {
    if (!json) std::printf("\nno CUDA device: the GPU bf16 rows are skipped\n");
    return 0;
  }
  const Device gpu = Device::Cuda(0);
  absl::StatusOr<double> peak = bench::CublasBf16Peak(0, t, h, 4 * h);
  if (!peak.ok()) {
    std::fprintf(stderr, "cuBLAS bf16 peak: %s\n", peak.status().ToString().c_str());
    return 1;
  }
  const double gpu_peak = *peak / 1e12;
  const int64_t seq = absl::GetFlag(FLAGS_seq);
  struct Row {
    const char* block;  // FLAGS_block
    const char* bench;  // the JSON's and the line's name
    double flops;
    bool bias_apart;  // COLOD_GEMM_EPILOGUES=0: the linear layers' bias kernels apart from their GEMMs
  };
  // Each block twice: the bias in cuBLASLt's epilogues (the default), then
  // apart, the A/B that decides the default on a GPU.
  std::vector<Row> rows = {{"mlp", "mlp_block", flops, false}, {"mlp", "mlp_block", flops, true}};
  std::string dir;
  if (absl::GetFlag(FLAGS_gpt2_block)) {
    dir = WriteGpt2Block(h, seq);
    if (dir.empty()) return 1;
    rows.push_back({"gpt2", "gpt2_block", Gpt2BlockFlops(t, seq, h), false});
    rows.push_back({"gpt2", "gpt2_block", Gpt2BlockFlops(t, seq, h), true});
  }
  struct UnsetAtExit {  // the switch is this process's own
    ~UnsetAtExit() { unsetenv("COLOD_GEMM_EPILOGUES"); }
  } unset_at_exit;
  int rc = 0;
  for (const Row& row : rows) {
    if (row.bias_apart) {
      setenv("COLOD_GEMM_EPILOGUES", "0", 1);
    } else {
      unsetenv("COLOD_GEMM_EPILOGUES");
    }
    absl::SetFlag(&FLAGS_block, row.block);
    auto shared = std::make_shared<RendezvousStore>();
    InMemoryStore store(shared, "bench-gpu");
    auto r = RunBlock("1d", 0, 1, 1, &store, gpu, DType::kBF16);
    if (!r.ok()) {
      std::fprintf(stderr, "GPU %s row: %s\n", row.bench, r.status().ToString().c_str());
      rc = 1;
      continue;
    }
    const double achieved = row.flops / r->step_seconds / 1e12;
    if (json) {
      std::printf("{\"bench\":\"%s\",\"mode\":\"1d\",\"dtype\":\"bf16\",\"device\":\"cuda:0\",\"tokens\":%lld,"
                  "\"hidden\":%lld,\"ranks\":1,\"step_seconds\":%.6f,\"tflops\":%.3f,"
                  "\"cublas_bf16_peak_tflops\":%.3f,\"fraction_of_peak\":%.4f,\"gemm_epilogues\":%s}\n",
                  row.bench, static_cast<long long>(t), static_cast<long long>(h), r->step_seconds, achieved,
                  gpu_peak, achieved / gpu_peak, row.bias_apart ? "false" : "true");
    } else {
      std::printf("%sGPU (cuda:0), bf16, tp=1, %s%s: step %.2f ms, %.1f TFLOP/s = %.1f%% of cuBLAS bf16 GEMM "
                  "%.1f TFLOP/s (same run)%s\n",
                  row.bias_apart ? "" : "\n", row.bench,
                  row.block == std::string("gpt2") ? absl::StrCat(" (seq ", seq, ")").c_str() : "",
                  r->step_seconds * 1e3, achieved, 100 * achieved / gpu_peak, gpu_peak,
                  row.bias_apart ? "  (bias apart: COLOD_GEMM_EPILOGUES=0)" : "");
    }
    std::fflush(stdout);
  }
  if (!dir.empty()) (void)std::system(("rm -rf " + dir).c_str());
  if (absl::GetFlag(FLAGS_attention) && !RunAttentionRows(gpu, gpu_peak, json)) rc = 1;
  if (absl::GetFlag(FLAGS_bandwidth) && !RunBandwidthRows(gpu, json)) rc = 1;
  if (absl::GetFlag(FLAGS_lm_head) && !RunLmHeadRows(gpu, json)) rc = 1;
  return rc;
}

}  // namespace colod

int main(int argc, char** argv) {
  colod::kernels::cpu::PreferAvx512Blas(argv);
  colod::ParseFlags(argc, argv,
                    "layers: the tensor-parallel MLP block and the whole GPT-2 block, forward + backward,\n"
                    "in 1d, 2d, 2.5d and 3d, vs sgemm peak.\n\nUsage:\n"
                    "  bazel run -c opt //bench:layers [-- --json] [-- --steps N] [-- --tokens T --hidden H]\n"
                    "    [-- --seq S] [-- --all_modes=false] [-- --gpt2_block=false] [-- --cpu_rows=false]\n"
                    "    [-- --attention=false] [-- --attention_seq S --attention_batch B]\n"
                    "    [-- --bandwidth=false] [-- --bandwidth_rows T]\n"
                    "    [-- --lm_head=false] [-- --lm_head_rows T --lm_head_vocab V --lm_head_chunk C]\n");
  if (absl::GetFlag(FLAGS_rank) >= 0) return colod::RankMain();
  const bool json = absl::GetFlag(FLAGS_json);
  const int64_t t = absl::GetFlag(FLAGS_tokens), h = absl::GetFlag(FLAGS_hidden);
  const double flops = colod::BlockFlops(t, h);
  if (absl::GetFlag(FLAGS_cpu_rows) && !colod::RunCpuTables(t, h, flops, json)) return 1;
  return colod::RunGpuRow(t, h, flops, json);
}
