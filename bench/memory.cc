// What one rank holds in a training step under ZeRO, activation
// recomputation and sequence parallelism, measured on CPU ranks (threads
// over Gloo) against the planner's figures: the parameter, gradient and
// optimizer bytes rank 0 reports after a step (StepStats, what
// colod_tensor_bytes exports) and the activations a training forward leaves
// alive for its backward (the heap's growth from before the forward to
// after the loss, over the ranks), each beside PlanJob's. The table of
// docs/TRAINING.md comes from here.
//
//   bazel run -c opt //bench:memory -- --model gpt2-124m
//   bazel run -c opt //bench:memory -- --model llama-1b --layers 1
//
// Rows: dp=4 plain, ZeRO 1, ZeRO 2, full and selective recomputation, ZeRO
// 2 with full recomputation; tp=2 x dp=2 without and with sequence
// parallelism. Every row's model is the same, written once under
// --work_dir (random weights in the family's initialization).
#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/corpus.h"
#include "absl/flags/parse.h"
#include "absl/flags/marshalling.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "spec/model_config.h"
#include "spec/plan.h"
#include "tests/testing/heap.h"
#include "worker/shardformer/init_model.h"
#include "worker/shardformer/run_forward.h"
#include "worker/shardformer/shardformer.h"
#include "worker/train/job_options.h"
#include "worker/train/trainer.h"

ABSL_FLAG(std::string, model, "gpt2-124m", "gpt2-124m (GPT-2 small's shape) or llama-1b (hidden 2048, 16 heads, "
                                           "MLP 5632, vocabulary 32000: LLaMA 1B's shape).");
ABSL_FLAG(int, layers, 0, "Layers (default: the model's own: 12 for gpt2-124m, 16 for llama-1b).");
ABSL_FLAG(int, seq_len, 0, "Tokens per sequence (default 256 for gpt2-124m, 512 for llama-1b); one a replica.");
ABSL_FLAG(std::string, work_dir, "", "Where the model and the corpus go (default: a temporary directory).");
ABSL_FLAG(bool, json, false, "Print one JSON object per row instead of a table.");
ABSL_FLAG(std::vector<std::string>, rows, {},
          "Only these rows, by name (comma-separated): dp4, dp4/zero1, dp4/zero2, dp4/full, dp4/selective, "
          "dp4/zero2+full, tp2dp2, tp2dp2/sp (default: every row).");

namespace colod {
namespace {

struct Row {
  std::string name;
  int tp = 1, dp = 4;
  bool sp = false;
  int zero = 0;
  shardformer::Recompute recompute = shardformer::Recompute::kNone;
};

struct Measured {
  train::StepStats step;    // rank 0's after one step
  int64_t activations = 0;  // per rank
  JobPlan plan;
};


train::TrainOptions OptionsOf(const Row& r, const std::string& model, const std::string& corpus, int64_t seq) {
  train::TrainOptions o;
  o.model_dir = model;
  o.data_path = corpus;
  o.steps = 1;
  o.batch_size = r.dp;  // one sequence a replica
  o.seq_len = seq;
  o.lr = 1e-4;
  o.shard.layout.set_tensor_parallel_size(r.tp);
  o.shard.layout.set_data_parallel_size(r.dp);
  o.shard.layout.set_sequence_parallel(r.sp);
  o.shard.recompute = r.recompute;
  o.zero_stage = r.zero;
  o.comm_timeout = absl::Minutes(10);
  return o;
}

// The heap a training forward leaves alive, per rank (every rank a thread
// of this process: the growth over all of them, divided).
absl::StatusOr<int64_t> Activations(const train::TrainOptions& o, int64_t vocab) {
  std::atomic<int64_t> before{0}, after{0};
  const int world = o.shard.tp() * o.shard.layout.data_parallel_size();
  const Tensor ids = *Tensor::FromInt64s({1, o.seq_len}, [&] {
    std::vector<int64_t> v(static_cast<size_t>(o.seq_len));
    for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>((i * 7919) % static_cast<size_t>(vocab));
    return v;
  }());
  RETURN_IF_ERROR(shardformer::RunOnLocalRanks(
      o.shard, false,
      [&](int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard) -> absl::Status {
        ASSIGN_OR_RETURN(std::unique_ptr<shardformer::ShardedModel> model,
                         shardformer::ShardFormer(shard, &pg).Load(o.model_dir));
        auto step = [&]() -> absl::StatusOr<shardformer::LmLoss> {
          ASSIGN_OR_RETURN(ColoTensor logits, model->Forward(ids));
          return model->NextTokenLoss(logits, ids);
        };
        {  // a first step makes the gradients and the communicators
          ASSIGN_OR_RETURN(shardformer::LmLoss l, step());
          RETURN_IF_ERROR(Backward(l.loss));
        }
        RETURN_IF_ERROR(pg.Barrier());
        if (rank == 0) before = testing::HeapInUse();
        RETURN_IF_ERROR(pg.Barrier());
        ASSIGN_OR_RETURN(shardformer::LmLoss l, step());
        RETURN_IF_ERROR(pg.Barrier());
        if (rank == 0) after = testing::HeapInUse();
        RETURN_IF_ERROR(pg.Barrier());
        return Backward(l.loss);
      },
      o.comm_timeout));
  return (after - before) / world;
}

absl::StatusOr<Measured> Measure(const Row& r, const std::string& model, const std::string& corpus, int64_t seq,
                                 const ModelConfig& config, const std::string& config_json) {
  Measured m;
  const train::TrainOptions o = OptionsOf(r, model, corpus, seq);
  RETURN_IF_ERROR(train::Train(o, [&](const train::StepStats& s) { m.step = s; }));
  ASSIGN_OR_RETURN(m.activations, Activations(o, config.vocab_size));
  v1::JobSpec spec = train::SpecFromTrainOptions(o);
  spec.mutable_model()->set_config_json(config_json);
  ASSIGN_OR_RETURN(m.plan, PlanJob(config, spec));
  return m;
}

double MiB(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }
double Ratio(int64_t measured, int64_t planned) {
  return planned > 0 ? static_cast<double>(measured) / static_cast<double>(planned) : 0;
}

absl::Status Run() {
  const std::string name = absl::GetFlag(FLAGS_model);
  const bool llama = name == "llama-1b";
  if (!llama && name != "gpt2-124m") {
    return absl::InvalidArgumentError(absl::StrCat("--model: '", name, "' is not one of gpt2-124m, llama-1b"));
  }
  const int layers = absl::GetFlag(FLAGS_layers) > 0 ? absl::GetFlag(FLAGS_layers) : (llama ? 16 : 12);
  const int64_t seq = absl::GetFlag(FLAGS_seq_len) > 0 ? absl::GetFlag(FLAGS_seq_len) : (llama ? 512 : 256);
  std::string work = absl::GetFlag(FLAGS_work_dir);
  if (work.empty()) work = (std::filesystem::temp_directory_path() / "colod-bench-memory").string();
  const std::string model = absl::StrCat(work, "/", name, "-", layers, "l-", seq);
  if (!std::filesystem::exists(model + "/config.json")) {
    if (llama) {
      shardformer::LlamaShape s;
      s.num_layers = layers;
      s.max_positions = seq;
      RETURN_IF_ERROR(shardformer::WriteInitializedLlama(model, s, 1));
    } else {
      shardformer::Gpt2Shape s;
      s.vocab_size = 50257;
      s.hidden_size = 768;
      s.num_heads = 12;
      s.num_layers = layers;
      s.max_positions = seq;
      RETURN_IF_ERROR(shardformer::WriteInitializedGpt2(model, s, 1));
    }
  }
  std::ifstream in(model + "/config.json");
  const std::string config_json((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  ASSIGN_OR_RETURN(ModelConfig config, ParseModelConfig(config_json));
  const std::string corpus = absl::StrCat(work, "/corpus-", config.vocab_size, ".bin");
  RETURN_IF_ERROR(bench::WriteRandomCorpus(corpus, config.vocab_size, 1 << 20));

  using shardformer::Recompute;
  const std::vector<Row> rows = {
      {"dp4", 1, 4},
      {"dp4/zero1", 1, 4, false, 1},
      {"dp4/zero2", 1, 4, false, 2},
      {"dp4/full", 1, 4, false, 0, Recompute::kFull},
      {"dp4/selective", 1, 4, false, 0, Recompute::kSelective},
      {"dp4/zero2+full", 1, 4, false, 2, Recompute::kFull},
      {"tp2dp2", 2, 2},
      {"tp2dp2/sp", 2, 2, true},
  };
  const std::vector<std::string> only = absl::GetFlag(FLAGS_rows);
  for (const std::string& name : only) {
    if (std::none_of(rows.begin(), rows.end(), [&](const Row& r) { return r.name == name; })) {
      return absl::InvalidArgumentError(absl::StrCat("--rows: no row is named '", name, "'"));
    }
  }
  if (!absl::GetFlag(FLAGS_json)) {
    std::printf("%s (%d layers, %lld tokens a replica), f32, AdamW: MiB per rank, measured / planned\n",
                name.c_str(), layers, static_cast<long long>(seq));
    std::printf("%-24s %9s %20s %20s %20s\n", "setting", "params", "gradients", "optimizer", "activations");
  }
  for (const Row& r : rows) {
    if (!only.empty() && std::find(only.begin(), only.end(), r.name) == only.end()) continue;
    ASSIGN_OR_RETURN(Measured m, Measure(r, model, corpus, seq, config, config_json));
    const train::StepStats& s = m.step;
    if (absl::GetFlag(FLAGS_json)) {
      std::printf(
          "{\"model\":\"%s\",\"layers\":%d,\"seq_len\":%lld,\"setting\":\"%s\",\"param_bytes\":%lld,"
          "\"grad_bytes\":%lld,\"planned_grad_bytes\":%lld,\"optimizer_bytes\":%lld,\"planned_optimizer_bytes\":%lld,"
          "\"activation_bytes\":%lld,\"planned_activation_bytes\":%lld}\n",
          name.c_str(), layers, static_cast<long long>(seq), r.name.c_str(), static_cast<long long>(s.param_bytes),
          static_cast<long long>(s.grad_bytes), static_cast<long long>(m.plan.grad_bytes),
          static_cast<long long>(s.optimizer_bytes), static_cast<long long>(m.plan.optimizer_bytes),
          static_cast<long long>(m.activations), static_cast<long long>(m.plan.activation_bytes));
    } else {
      auto cell = [](int64_t got, int64_t want) {
        return absl::StrFormat("%7.1f / %7.1f %4.2f", MiB(got), MiB(want), Ratio(got, want));
      };
      std::printf("%-24s %9.1f %20s %20s %20s\n", r.name.c_str(), MiB(s.param_bytes),
                  cell(s.grad_bytes, m.plan.grad_bytes).c_str(), cell(s.optimizer_bytes, m.plan.optimizer_bytes).c_str(),
                  cell(m.activations, m.plan.activation_bytes).c_str());
    }
    std::fflush(stdout);
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace colod

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const absl::Status s = colod::Run();
  if (!s.ok()) {
    std::fprintf(stderr, "bench:memory: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
