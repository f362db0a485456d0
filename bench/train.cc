// Whole-model training throughput: GPT-2 and LLaMA shapes trained by the
// real training loop (train::Train: ShardFormer policies, autograd, the dp
// gradient buckets, clipping, AdamW) on random tokens, in tokens/s and model
// FLOP utilization against the GEMM peak measured in the same run.
//
//   bazel run -c opt //bench:train [-- --rows cpu|gpu|all|smoke] [-- --model NAME] [-- --layout "tp=T dp=D"]
//       [-- --sequence_parallel] [-- --steps N] [-- --batch B] [-- --json]
//
// CPU rows (f32), as `coloctl train` runs them: an embedded cluster
// (client/local_cluster.h: a coordinator and tp * pp * dp CPU worker
// daemons on loopback, over Gloo) that shares this machine's cores (each
// worker's BLAS gets cores / ranks threads; with --pin_workers each worker
// daemon's threads run on cores of their own), the TRAIN job submitted over
// gRPC, each step's time (and pipeline wait) from rank 0's progress events,
// the very figure coloctl's tokens/s is made from:
//   gpt2-tiny   4 layers, hidden 256, 4 heads, vocab 256, seq 128, batch 8:
//               tp=1, tp=2, dp=2
//   gpt2-pipe   8 layers, hidden 256, 4 heads, vocab 64 (even stages: the
//               head is 1 % of a layer), seq 128, batch 32: two pipeline
//               stages (pp=2) with 4 and 8 micro-batches, 1F1B and
//               interleaved (2 virtual stages a rank, v=2), whose bubble
//               (the stages' mean idle time in the pipeline's span, the
//               median timed step's) is printed over the span beside the
//               schedule's (p - 1) / (V m + p - 1), and over the stages'
//               busy time (Megatron-LM's bubble time fraction) beside
//               (p - 1) / (V m) (1F1B: V = 1)
//   gpt2-small  GPT-2 124M's shape (12 layers, hidden 768, 12 heads, vocab
//               50257), seq 128, batch 4, fewer steps: tp=1, tp=2, dp=2
// GPU rows (bf16 mixed precision, rank r on CUDA device r over NCCL), where
// devices are (tp=2 needs 2):
//   gpt2-124m   seq 1024, batch 8: tp=1, tp=2; and one process per device
//               as colod's worker daemons run ("procs": this binary started
//               again as each rank, the rendezvous through a FileStore):
//               tp=2, dp=2, and two pipeline stages with 4 micro-batches
//   llama-1b    hidden 2048, 16 layers, 32 heads over 8 kv heads, MLP 5632,
//               vocab 32000 (787M parameters by the PARAMS column), seq 2048,
//               batch 4: tp=1, tp=2, and tp=2 in processes
// --rows smoke: tiny GPT-2 and LLaMA (2 layers of hidden 128) on the GPU
// path (seq 32, 2 steps), to
// check the GPU rows run at all, e.g. under --config=cuda-emu, whose devices
// would take hours over the real rows and time nothing; with tiny GPT-2's
// tp=2, dp=2 and pp=2 rows in processes.
//
// Model FLOPs per token (PaLM's MFU convention, no credit for recomputation,
// causal attention counted whole): 6 N + 12 L S H, N the parameters of every
// matrix multiply (the layers' and the LM head's, not the embedding
// lookups), L layers, S the sequence length, H the hidden size. tokens/s is
// the global batch's tokens over the mean step time after --warmup steps
// (each step ends when rank 0 read its loss, which waits for the step's
// device work). The peak is the same run's best GEMM: OpenBLAS sgemm with
// every core of the machine (CPU: every row shares them, so a layout's "vs
// tp=1" is its speed-up on the same machine, not on more cores), cuBLAS bf16
// 8192^3 times the devices (GPU).
#include <sched.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>
#include <map>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "bench/corpus.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "bench/peak.h"
#include "bench/self_ranks.h"
#include "client/coordinator_client.h"
#include "client/local_cluster.h"
#include "common/atomic_file.h"
#include "common/flags.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "kernels/cpu/layer_ops.h"
#include "kernels/cuda/cudnn_attention.h"
#include "kernels/device.h"
#include "spec/mesh.h"
#include "worker/colo/rank_group.h"
#include "worker/comm/store.h"
#include "worker/shardformer/init_model.h"
#include "worker/train/job_options.h"
#include "worker/train/trainer.h"

ABSL_FLAG(std::string, rows, "all",
          "Which rows: cpu, gpu (where CUDA devices are), all, or smoke (tiny models on the GPU path).");
ABSL_FLAG(int, steps, 0, "Timed steps per row (default: each row's own, 2 to 10).");
ABSL_FLAG(int, batch, 0,
          "Sequences per step, the global batch (default: each row's own; must divide by dp and the micro-batches).");
ABSL_FLAG(int, warmup, 2, "Untimed steps before them (pools, connections, optimizer state).");
ABSL_FLAG(bool, json, false, "Print one JSON object per row instead of a table.");
ABSL_FLAG(std::string, model, "", "Only the rows of this model (gpt2-tiny, gpt2-small, ...); default: every row.");
ABSL_FLAG(std::string, layout, "",
          "Only the rows of this layout (\"tp=2 dp=1\", \"tp=1 pp=2 dp=1 m=4\", ...); default: every row.");
ABSL_FLAG(bool, sequence_parallel, false, "tp rows with sequence parallelism (norms and residuals split over tp).");
ABSL_FLAG(std::string, work_dir, "", "Where the models and the corpus go (default: a temporary directory).");
ABSL_FLAG(bool, pin_workers, false,
          "CPU rows: each worker daemon (every one of its threads) on cores of its own, cores / workers each, so "
          "that no two ranks (pipeline stages) share a core; the coordinator and this process float. Needs at "
          "least as many cores as the row has ranks.");
ABSL_FLAG(int, train_rank, -1, "Internal: run rank N of a \"procs\" row (bench:train starts these).");
ABSL_FLAG(std::string, train_store, "", "Internal: the rank processes' FileStore directory.");


namespace colod {
namespace {

struct ModelShape {
  std::string family;  // "gpt2" or "llama"
  int64_t vocab = 0, hidden = 0, layers = 0, heads = 0, kv_heads = 0, intermediate = 0;

  // Parameters of the matrix multiplies: every layer's and the LM head.
  double MatMulParams() const {
    const double h = static_cast<double>(hidden), kv = static_cast<double>(kv_heads * (hidden / heads));
    const double per_layer = family == "gpt2" ? 12 * h * h : h * (h + 2 * kv) + h * h + 3 * h * intermediate;
    return layers * per_layer + h * static_cast<double>(vocab);
  }
  double TrainFlopsPerToken(int64_t seq) const {
    return 6 * MatMulParams() + 12.0 * static_cast<double>(layers) * static_cast<double>(seq) * hidden;
  }
};

struct Row {
  std::string name;
  ModelShape shape;
  bool cuda = false;
  int tp = 1, dp = 1;
  int64_t seq = 128, batch = 8;
  int steps = 5;
  int pp = 1, micro = 1;  // pipeline stages and the micro-batches they run
  bool processes = false;  // a process per rank (device), as worker daemons run, not threads of one
  int v = 1;               // model chunks a pipeline stage holds (interleaved 1F1B)
  bool bias_apart = false;  // COLOD_GEMM_EPILOGUES=0: the linears' bias kernels apart from their GEMMs
  bool read_each_step = false;  // TrainOptions::read_each_step: the host not a step ahead
};

std::string LayoutOf(const Row& row) {
  return absl::StrCat(row.pp > 1 ? absl::StrCat("tp=", row.tp, " pp=", row.pp, " dp=", row.dp, " m=", row.micro,
                                               row.v > 1 ? absl::StrCat(" v=", row.v) : "")
                                 : absl::StrCat("tp=", row.tp, " dp=", row.dp),
                      row.processes ? " procs" : "", row.bias_apart ? " bias apart" : "",
                      row.read_each_step ? " read each step" : "");
}

std::vector<Row> Rows(const std::string& which) {
  const ModelShape tiny{"gpt2", 256, 256, 4, 4, 4, 1024};
  // The pipeline rows' model: 8 layers, and a head of a 64-token
  // vocabulary (1 % of a layer's multiplies), so that the stages are
  // even, as the schedules' closed forms assume.
  const ModelShape pipe{"gpt2", 64, 256, 8, 4, 4, 1024};
  const ModelShape small{"gpt2", 50257, 768, 12, 12, 12, 3072};
  const ModelShape llama{"llama", 32000, 2048, 16, 32, 8, 5632};
  std::vector<Row> rows;
  if (which == "cpu" || which == "all") {
    for (auto [tp, dp] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{1, 2}}) {
      rows.push_back({"gpt2-tiny", tiny, false, tp, dp, 128, 8, 10});
    }
    // Two pipeline stages of 4 layers, 4 and 8 micro-batches of 32
    // sequences, under 1F1B and interleaved (two chunks of 2 layers a
    // stage): the bubble against the schedule's (p - 1) / (V m + p - 1).
    for (int v : {1, 2}) {
      for (int micro : {4, 8}) rows.push_back({"gpt2-pipe", pipe, false, 1, 1, 128, 32, 15, 2, micro, false, v});
    }
    for (auto [tp, dp] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{1, 2}}) {
      rows.push_back({"gpt2-small", small, false, tp, dp, 128, 4, 2});
    }
  }
  if (which == "smoke") {
    // Smaller than the CPU rows' gpt2-tiny (2 layers of hidden 128): the
    // emulation runs each kernel on the CPU, and the rows time nothing there.
    const ModelShape tiny_gpt2{"gpt2", 256, 128, 2, 4, 4, 512};
    const ModelShape tiny_llama{"llama", 256, 128, 2, 4, 2, 256};
    for (int tp : {1, 2}) rows.push_back({"gpt2-tiny", tiny_gpt2, true, tp, 1, 32, 4, 2});
    rows.push_back({"gpt2-tiny", tiny_gpt2, true, 1, 1, 32, 4, 2, 1, 1, false, 1, true});
    rows.push_back({"gpt2-tiny", tiny_gpt2, true, 1, 1, 32, 4, 2, 1, 1, false, 1, false, true});
    for (int tp : {1, 2}) rows.push_back({"llama-tiny", tiny_llama, true, tp, 1, 32, 4, 2});
    rows.push_back({"gpt2-tiny", tiny_gpt2, true, 2, 1, 32, 4, 2, 1, 1, true});
    rows.push_back({"gpt2-tiny", tiny_gpt2, true, 1, 2, 32, 4, 2, 1, 1, true});
    rows.push_back({"gpt2-tiny", tiny_gpt2, true, 1, 1, 32, 4, 2, 2, 2, true});
    return rows;
  }
  if (which != "cpu") {
    for (int tp : {1, 2}) rows.push_back({"gpt2-124m", small, true, tp, 1, 1024, 8, 10});
    // The A/B of the bias in the GEMMs' epilogues, beside the row above.
    rows.push_back({"gpt2-124m", small, true, 1, 1, 1024, 8, 10, 1, 1, false, 1, true});
    // The A/B of the host running a step ahead of the device.
    rows.push_back({"gpt2-124m", small, true, 1, 1, 1024, 8, 10, 1, 1, false, 1, false, true});
    rows.push_back({"gpt2-124m", small, true, 2, 1, 1024, 8, 10, 1, 1, true});
    rows.push_back({"gpt2-124m", small, true, 1, 2, 1024, 8, 10, 1, 1, true});
    rows.push_back({"gpt2-124m", small, true, 1, 1, 1024, 8, 10, 2, 4, true});
    for (int tp : {1, 2}) rows.push_back({"llama-1b", llama, true, tp, 1, 2048, 4, 5});
    rows.push_back({"llama-1b", llama, true, 2, 1, 2048, 4, 5, 1, 1, true});
  }
  return rows;
}

absl::Status WriteModel(const ModelShape& s, int64_t positions, const std::string& dir) {
  if (std::filesystem::exists(dir + "/config.json")) return absl::OkStatus();
  if (s.family == "gpt2") {
    shardformer::Gpt2Shape g;
    g.vocab_size = s.vocab;
    g.hidden_size = s.hidden;
    g.num_layers = s.layers;
    g.num_heads = s.heads;
    g.max_positions = positions;
    return shardformer::WriteInitializedGpt2(dir, g, 1);
  }
  shardformer::LlamaShape l;
  l.vocab_size = s.vocab;
  l.hidden_size = s.hidden;
  l.num_layers = s.layers;
  l.num_heads = s.heads;
  l.num_kv_heads = s.kv_heads;
  l.intermediate_size = s.intermediate;
  l.max_positions = positions;
  return shardformer::WriteInitializedLlama(dir, l, 1);
}


struct Measured {
  double step_seconds = 0;  // mean over the timed steps
  double loss = 0;          // the last step's
  // Pipeline stages, the median timed step's: the stages' mean idle time
  // over the pipeline's span (StepProgress.pipeline_span), and over their
  // mean busy time (Megatron-LM's bubble time fraction).
  double bubble = 0, bubble_work = 0;
  // CUDA rows run in this process: the mean of the timed steps' host waits
  // for the device (StepStats::device_wait_seconds); -1 where not measured.
  double device_wait = -1;
  // The same rows: the mean of the timed steps' enqueue times
  // (StepStats::enqueue_seconds); -1 where not measured.
  double enqueue = -1;
};

// The row's training options, its model and corpus written under `dir`
// (once: the rank processes of a row find them there).
absl::StatusOr<train::TrainOptions> OptionsOf(const Row& row, const std::string& dir, int steps, int warmup) {
  const int64_t positions = std::max<int64_t>(row.seq, 64);
  // Named by its positions too: the smoke rows' model of the same name is
  // shorter, and a directory once written is reused.
  const std::string model = absl::StrCat(dir, "/", row.name, "-", row.shape.family, "-", positions);
  RETURN_IF_ERROR(WriteModel(row.shape, positions, model));
  const std::string corpus = absl::StrCat(dir, "/tokens-", row.shape.vocab, ".bin");
  RETURN_IF_ERROR(bench::WriteRandomCorpus(corpus, row.shape.vocab, int64_t{1} << 22));
  train::TrainOptions o;
  o.model_dir = model;
  o.data_path = corpus;
  o.data_format = train::DataFormat::kU16;
  o.steps = warmup + steps;
  o.batch_size = row.batch;
  o.seq_len = row.seq;
  o.lr = 1e-4;
  o.min_lr = 1e-4;
  o.clip_norm = 1.0;
  o.cuda = row.cuda;
  o.shard.param_dtype = row.cuda ? DType::kBF16 : DType::kF32;
  o.shard.layout.set_tensor_parallel_size(row.tp);
  o.shard.layout.set_data_parallel_size(row.dp);
  o.shard.layout.set_sequence_parallel(row.tp > 1 && row.pp == 1 && absl::GetFlag(FLAGS_sequence_parallel));
  o.shard.layout.set_pipeline_parallel_size(row.pp);
  if (row.v > 1) o.shard.layout.set_virtual_stages(row.v);
  o.micro_batches = row.micro;
  o.comm_timeout = absl::Minutes(10);
  o.read_each_step = row.read_each_step;
  return o;
}

// What rank 0 reports of each step, in order: when it ended, its loss, its
// pipeline wait and its time.
struct StepEnd {
  absl::Time end;
  double loss = 0, wait = 0, seconds = 0;
  double span = 0;  // the pipeline's part of `seconds`
  double device_wait = -1;  // StepStats::device_wait_seconds, where reported
  double enqueue = -1;      // StepStats::enqueue_seconds, where device_wait is
};

absl::StatusOr<Measured> Summarize(const std::vector<StepEnd>& ends, int steps, int warmup) {
  Measured m;
  // The bubble of the median timed step (by its waiting's share of it): a
  // step that the machine's other work (the coordinator, another row's
  // daemons exiting, Gloo's threads on a shared core) held up is an outlier
  // here, not a tenth of the mean.
  std::vector<std::pair<double, double>> bubbles;  // (of the step, of the rest of it)
  for (size_t i = warmup; i < ends.size(); ++i) {
    if (ends[i].span <= 0) continue;
    const double busy = ends[i].span - ends[i].wait;
    bubbles.push_back({ends[i].wait / ends[i].span, busy > 0 ? ends[i].wait / busy : 0});
  }
  if (!ends.empty()) m.loss = ends.back().loss;
  if (!bubbles.empty()) {
    std::nth_element(bubbles.begin(), bubbles.begin() + bubbles.size() / 2, bubbles.end());
    std::tie(m.bubble, m.bubble_work) = bubbles[bubbles.size() / 2];
  }
  if (ends.size() != static_cast<size_t>(warmup + steps) || warmup < 1) {
    return absl::InternalError("the run reported fewer steps than it ran");
  }
  m.step_seconds = absl::ToDoubleSeconds(ends.back().end - ends[warmup - 1].end) / steps;
  if (ends.back().device_wait >= 0) {
    double sum = 0, enqueue = 0;
    for (size_t i = warmup; i < ends.size(); ++i) {
      sum += ends[i].device_wait;
      enqueue += ends[i].enqueue;
    }
    m.device_wait = sum / steps;
    m.enqueue = enqueue / steps;
  }
  return m;
}

absl::StatusOr<Measured> RunRow(const Row& row, const std::string& dir, int steps, int warmup) {
  ASSIGN_OR_RETURN(train::TrainOptions o, OptionsOf(row, dir, steps, warmup));
  std::vector<StepEnd> ends;
  RETURN_IF_ERROR(train::Train(o, [&](const train::StepStats& s) {
    ends.push_back({absl::Now(), s.loss, s.pipeline_wait_seconds, s.seconds, s.pipeline_span_seconds,
                    s.cuda ? s.device_wait_seconds : -1, s.cuda ? s.enqueue_seconds : -1});
  }));
  return Summarize(ends, steps, warmup);
}

// --pin_workers: worker i's threads (pids[i + 1]; pids[0] is the
// coordinator) on cores [i k, (i + 1) k), k = cores / workers. Threads a
// pinned thread starts later inherit its cores. FAILED_PRECONDITION where
// there are fewer cores than workers.
absl::Status PinWorkers(const std::vector<pid_t>& pids) {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  const int workers = static_cast<int>(pids.size()) - 1;
  if (workers < 1 || cores < workers) {
    return absl::FailedPreconditionError(
        absl::StrCat("--pin_workers: ", workers, " workers on ", cores, " cores cannot have cores of their own"));
  }
  const int each = cores / workers;
  for (int w = 0; w < workers; ++w) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int c = w * each; c < (w + 1) * each; ++c) CPU_SET(c, &set);
    std::error_code ec;
    int pinned = 0;
    for (const auto& task : std::filesystem::directory_iterator(absl::StrCat("/proc/", pids[w + 1], "/task"), ec)) {
      const pid_t tid = static_cast<pid_t>(std::strtol(task.path().filename().c_str(), nullptr, 10));
      if (tid > 0 && sched_setaffinity(tid, sizeof(set), &set) == 0) ++pinned;
    }
    if (ec || pinned == 0) {
      return absl::InternalError(absl::StrCat("--pin_workers: could not pin worker ", w, " (pid ", pids[w + 1], ")"));
    }
  }
  return absl::OkStatus();
}

// A CPU row as `coloctl train` runs it (see the top): the job on an
// embedded cluster of the row's ranks, the daemons found beside this binary
// (`self`) as coloctl finds them; each step's time is rank 0's
// step_duration.
absl::StatusOr<Measured> RunRowOnCluster(const Row& row, const std::string& dir, int steps, int warmup,
                                         const std::string& self) {
  ASSIGN_OR_RETURN(train::TrainOptions o, OptionsOf(row, dir, steps, warmup));
  v1::JobSpec spec = train::SpecFromTrainOptions(o);
  spec.set_name(absl::StrCat("bench-", row.name));
  ASSIGN_OR_RETURN(std::string config, ReadFileToString(o.model_dir + "/config.json"));
  spec.mutable_model()->set_config_json(config);
  spec.mutable_model()->set_weights_path(o.model_dir);
  LocalCluster::Options c;
  c.workers = row.tp * row.pp * row.dp;
  ASSIGN_OR_RETURN(c.coordinator_binary, FindDaemonBinary(self, "colod-coordinator"));
  ASSIGN_OR_RETURN(c.worker_binary, FindDaemonBinary(self, "colod-worker"));
  ASSIGN_OR_RETURN(std::unique_ptr<LocalCluster> cluster, LocalCluster::Start(c));
  if (absl::GetFlag(FLAGS_pin_workers)) RETURN_IF_ERROR(PinWorkers(cluster->pids()));
  ASSIGN_OR_RETURN(std::unique_ptr<CoordinatorClient> client, CoordinatorClient::Create(cluster->address()));
  ASSIGN_OR_RETURN(v1::Job job, client->SubmitJob(spec));
  std::vector<StepEnd> ends;
  absl::Time at = absl::UnixEpoch();  // the steps' durations laid end to end
  RETURN_IF_ERROR(client->WatchJob(job.job_id(), 0, absl::Hours(2), [&](const v1::JobEvent& e) {
    if (!e.has_step()) return true;
    StepEnd end;
    end.seconds = absl::ToDoubleSeconds(FromProtoDuration(e.step().step_duration()));
    end.wait = absl::ToDoubleSeconds(FromProtoDuration(e.step().pipeline_wait()));
    end.span = absl::ToDoubleSeconds(FromProtoDuration(e.step().pipeline_span()));
    end.loss = e.step().loss();
    at += FromProtoDuration(e.step().step_duration());
    end.end = at;
    ends.push_back(end);
    return true;
  }));
  ASSIGN_OR_RETURN(job, client->GetJob(job.job_id()));
  if (job.state() != v1::JOB_STATE_SUCCEEDED) {
    return absl::InternalError(absl::StrCat("the job ended ", v1::JobState_Name(job.state()), ": ", job.reason(),
                                            "; logs in ", cluster->data_dir()));
  }
  return Summarize(ends, steps, warmup);
}

// Rank `rank` of a "procs" row in this process, on CUDA device `rank`; rank 0
// prints "step UNIX_SECONDS LOSS WAIT SECONDS" after each step.
absl::Status RunRank(const Row& row, const std::string& dir, const std::string& store_dir, int rank, int steps,
                     int warmup) {
  ASSIGN_OR_RETURN(train::TrainOptions o, OptionsOf(row, dir, steps, warmup));
  ASSIGN_OR_RETURN(std::shared_ptr<const train::PreparedTrain> run, train::PrepareTrain(o));
  ASSIGN_OR_RETURN(DeviceMesh mesh, DeviceMesh::FromShardConfig(o.shard.layout));
  ASSIGN_OR_RETURN(std::unique_ptr<FileStore> store, FileStore::Open(store_dir));
  shardformer::ShardConfig shard = o.shard;
  shard.device = Device::Cuda(rank);
  RankGroupOptions group;
  group.device = shard.device;
  group.timeout = o.comm_timeout;
  ASSIGN_OR_RETURN(std::unique_ptr<ProcessGroup> pg, CreateRankGroup(mesh, rank, store.get(), std::move(group)));
  RETURN_IF_ERROR(pg->InitAxes());
  train::RankHooks hooks;
  hooks.on_step = [rank](const train::StepStats& s) {
    if (rank != 0) return;
    std::printf("step %.6f %.9g %.9g %.9g %.9g\n", absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch()), s.loss,
                s.pipeline_wait_seconds, s.seconds, s.pipeline_span_seconds);
    std::fflush(stdout);
  };
  return train::RunTrainRank(*run, rank, *pg, shard, hooks);
}

// A "procs" row: this binary started again as each rank (a process per
// device), rank 0's steps read from its stdout.
absl::StatusOr<Measured> RunRowInProcesses(const Row& row, const std::string& dir, int steps, int warmup) {
  RETURN_IF_ERROR(OptionsOf(row, dir, steps, warmup).status());  // the model and corpus, once
  const int ranks = row.tp * row.pp * row.dp;
  std::vector<StepEnd> ends;
  RETURN_IF_ERROR(bench::RunSelfAsRanks(
      ranks,
      [&](int r, const std::string& store) -> std::vector<std::string> {
        return {absl::StrCat("--train_rank=", r),
                "--train_store=" + store,
                "--work_dir=" + dir,
                "--rows=" + absl::GetFlag(FLAGS_rows),
                "--model=" + row.name,
                "--layout=" + LayoutOf(row),
                absl::StrCat("--steps=", steps),
                absl::StrCat("--warmup=", warmup),
                absl::StrCat("--batch=", row.batch)};
      },
      [&](const std::string& line) {
        double t = 0;
        StepEnd e;
        if (std::sscanf(line.c_str(), "step %lf %lf %lf %lf %lf", &t, &e.loss, &e.wait, &e.seconds, &e.span) == 5) {
          e.end = absl::UnixEpoch() + absl::Seconds(t);
          ends.push_back(e);
        }
      }));
  return Summarize(ends, steps, warmup);
}

int Main(int argc, char** argv) {
  ParseFlags(argc, argv,
            "train: whole-model training throughput (tokens/s, MFU) vs the same run's GEMM peak.\n\nUsage:\n"
            "  bazel run -c opt //bench:train [-- --rows cpu|gpu|all|smoke] [-- --model NAME] [-- --layout L] "
            "[-- --steps N] [-- --batch B] "
            "[-- --json]\n");
  const std::string which = absl::GetFlag(FLAGS_rows);
  if (which != "cpu" && which != "gpu" && which != "all" && which != "smoke") {
    std::fprintf(stderr, "--rows: '%s' is not one of cpu, gpu, all, smoke\n", which.c_str());
    return 2;
  }
  const bool json = absl::GetFlag(FLAGS_json);
  if (absl::GetFlag(FLAGS_batch) < 0 || absl::GetFlag(FLAGS_steps) < 0) {
    std::fprintf(stderr, "--batch and --steps must be >= 0 (0: the row's own)\n");
    return 2;
  }
  const int warmup = std::max(1, absl::GetFlag(FLAGS_warmup));
  std::string dir = absl::GetFlag(FLAGS_work_dir);
  if (dir.empty()) dir = (std::filesystem::temp_directory_path() / "colod-bench-train").string();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (absl::GetFlag(FLAGS_train_rank) >= 0) {  // a rank of a "procs" row
    for (Row row : Rows(which)) {
      if (row.name != absl::GetFlag(FLAGS_model) || LayoutOf(row) != absl::GetFlag(FLAGS_layout)) continue;
      if (absl::GetFlag(FLAGS_batch) > 0) row.batch = absl::GetFlag(FLAGS_batch);
      const absl::Status s = RunRank(row, dir, absl::GetFlag(FLAGS_train_store), absl::GetFlag(FLAGS_train_rank),
                                     absl::GetFlag(FLAGS_steps), warmup);
      if (!s.ok()) std::fprintf(stderr, "rank %d: %s\n", absl::GetFlag(FLAGS_train_rank), s.ToString().c_str());
      return s.ok() ? 0 : 1;
    }
    std::fprintf(stderr, "no row %s %s\n", absl::GetFlag(FLAGS_model).c_str(), absl::GetFlag(FLAGS_layout).c_str());
    return 2;
  }
  const int gpus = kernels::CudaDeviceCount();
  // The CPU rows' ranks share the machine's cores, as coloctl's embedded
  // cluster shares them (LocalCluster); the peak is all of them.
  const int cores = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  const double cpu_peak = bench::SgemmPeak(cores, 1024, 1024, 1024);
  kernels::cpu::SetBlasThreads(1);  // the in-process GPU rows' host work, as before
  double gpu_peak = 0;
  if (gpus > 0 && which != "cpu") {
    const int64_t n = which == "smoke" ? 256 : 8192;
    absl::StatusOr<double> p = bench::CublasBf16Peak(0, n, n, n);
    if (!p.ok()) {
      std::fprintf(stderr, "cuBLAS bf16 peak: %s\n", p.status().ToString().c_str());
      return 1;
    }
    gpu_peak = *p;
  }
  if (!json) {
    std::printf("OpenBLAS sgemm 1024^3, %d threads (every core): %.1f GFLOP/s", cores, cpu_peak / 1e9);
    if (gpu_peak > 0) std::printf("; cuBLAS bf16 GEMM on cuda:0: %.1f TFLOP/s", gpu_peak / 1e12);
    std::printf(" (same run)\n%-10s  %-4s  %-25s  %-4s  %8s  %6s  %10s  %10s  %11s  %11s  %6s  %8s  %s\n",
                "model", "dev", "layout", "prec", "params", "tokens", "step (ms)", "tokens/s", "model FLOP/s",
                "peak FLOP/s", "MFU", "vs tp=1", "bubble of the span; of the work (schedule's)");
  }
  std::map<std::string, double> base;  // tokens/s of the first row of each model on each device
  int failed = 0;
  for (const Row& row : Rows(which)) {
    if (!absl::GetFlag(FLAGS_model).empty() && row.name != absl::GetFlag(FLAGS_model)) continue;
    if (!absl::GetFlag(FLAGS_layout).empty() && LayoutOf(row) != absl::GetFlag(FLAGS_layout)) continue;
    const int ranks = row.tp * row.pp * row.dp;
    if (row.cuda && gpus < ranks) {
      if (!json) std::printf("%-10s  cuda  %s: skipped, %d CUDA device(s)\n", row.name.c_str(), LayoutOf(row).c_str(),
                             gpus);
      continue;
    }
    const int steps = absl::GetFlag(FLAGS_steps) > 0 ? absl::GetFlag(FLAGS_steps) : row.steps;
    Row sized = row;
    if (absl::GetFlag(FLAGS_batch) > 0) sized.batch = absl::GetFlag(FLAGS_batch);
    if (row.bias_apart) {  // read at each GEMM by this process's kernels (in-process rows only)
      setenv("COLOD_GEMM_EPILOGUES", "0", 1);
    } else {
      unsetenv("COLOD_GEMM_EPILOGUES");
    }
    absl::StatusOr<Measured> m = !row.cuda     ? RunRowOnCluster(sized, dir, steps, warmup, argv[0])
                                 : row.processes ? RunRowInProcesses(sized, dir, steps, warmup)
                                                 : RunRow(sized, dir, steps, warmup);
    unsetenv("COLOD_GEMM_EPILOGUES");
    if (!m.ok()) {
      std::fprintf(stderr, "%s %s: %s\n", row.name.c_str(), LayoutOf(row).c_str(), m.status().ToString().c_str());
      ++failed;
      continue;
    }
    const double tokens = static_cast<double>(sized.batch * row.seq);
    const double tps = tokens / m->step_seconds;
    const double flops = tps * row.shape.TrainFlopsPerToken(row.seq);
    const double peak = row.cuda ? gpu_peak * ranks : cpu_peak;
    const double vs = tps / base.emplace(row.name + (row.cuda ? "/cuda" : "/cpu"), tps).first->second;
    const std::string layout = LayoutOf(row);
    const double params = row.shape.MatMulParams();
    // The schedule's bubble with even stages: (p - 1) / (V m + p - 1) of the
    // step, which is (p - 1) / (V m) of the work (1F1B: V = 1).
    const double closed_form =
        row.pp > 1 ? static_cast<double>(row.pp - 1) / (row.v * row.micro + row.pp - 1) : 0;
    const double closed_form_work = row.pp > 1 ? static_cast<double>(row.pp - 1) / (row.v * row.micro) : 0;
    if (json) {
      std::printf("{\"bench\":\"train\",\"model\":\"%s\",\"device\":\"%s\",\"tp\":%d,\"pp\":%d,\"dp\":%d,"
                  "\"micro_batches\":%d,\"virtual_stages\":%d,\"precision\":\"%s\","
                  "\"matmul_params\":%.0f,\"seq_len\":%lld,\"batch\":%lld,\"steps\":%d,\"step_seconds\":%.6f,"
                  "\"tokens_per_second\":%.1f,\"model_flops_per_second\":%.4g,\"peak_flops_per_second\":%.4g,"
                  "\"mfu\":%.4f,\"loss\":%.4f,\"bubble\":%.4f,\"bubble_schedule\":%.4f,\"bubble_over_work\":%.4f,"
                  "\"bubble_over_work_schedule\":%.4f,\"device_wait_seconds\":%s,\"enqueue_seconds\":%s,\"pinned\":%s,"
                  "\"gemm_epilogues\":%s}\n",
                  row.name.c_str(), row.cuda ? "cuda" : "cpu", row.tp, row.pp, row.dp, row.micro, row.v,
                  row.cuda ? "bf16" : "fp32", params, static_cast<long long>(row.seq),
                  static_cast<long long>(sized.batch), steps, m->step_seconds, tps, flops, peak, flops / peak, m->loss,
                  m->bubble, closed_form, m->bubble_work, closed_form_work,
                  m->device_wait >= 0 ? absl::StrFormat("%.6f", m->device_wait).c_str() : "null",
                  m->enqueue >= 0 ? absl::StrFormat("%.6f", m->enqueue).c_str() : "null",
                  !row.cuda && absl::GetFlag(FLAGS_pin_workers) ? "true" : "false", row.bias_apart ? "false" : "true");
    } else {
      const std::string bubble =
          row.pp > 1 ? absl::StrFormat("%.1f%% (%.1f%%); %.1f%% (%.1f%%)", 100 * m->bubble, 100 * closed_form,
                                       100 * m->bubble_work, 100 * closed_form_work)
                     : std::string("-");
      std::printf("%-10s  %-4s  %-25s  %-4s  %7.1fM  %6.0f  %10.1f  %10.0f  %11.3g  %11.3g  %5.1f%%  %7.2fx  %s\n",
                  row.name.c_str(), row.cuda ? "cuda" : "cpu", layout.c_str(), row.cuda ? "bf16" : "fp32",
                  params / 1e6, tokens, m->step_seconds * 1e3, tps, flops, peak, 100 * flops / peak, vs,
                  bubble.c_str());
      if (m->device_wait >= 0) {
        // Where the host's wait for the device in a step's read is near 0
        // (and its enqueue near the step's time), the host, not the device,
        // sets the pace.
        std::printf("%-10s  the host enqueued a step in %.2f ms and waited %.2f ms a step for the device in its "
                    "read\n",
                    "", m->enqueue * 1e3, m->device_wait * 1e3);
      }
    }
    std::fflush(stdout);
  }
  if (gpus == 0 && which != "cpu" && !json) std::printf("no CUDA device: the GPU rows are skipped\n");
#ifdef COLOD_WITH_CUDA
  // Which attention kernels the in-process rows ran (a process row's ranks
  // say so on their own stderr where cuDNN could not serve).
  if (kernels::cuda::CudnnAttentionRequested() && !json) {
    const int64_t served = kernels::cuda::CudnnAttentionCalls();
    std::printf("COLOD_ATTENTION=cudnn: cuDNN's fused attention served %lld calls of this process's rows%s\n",
                static_cast<long long>(served), served == 0 ? " (none: colod's kernels ran; the reason is above)" : "");
  }
#endif
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace colod

int main(int argc, char** argv) {
  colod::kernels::cpu::PreferAvx512Blas(argv);
  return colod::Main(argc, argv);
}
