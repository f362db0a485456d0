// coloctl: the colod command line.
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <functional>
#include <iterator>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "client/format.h"
#include "client/job_file.h"
#include "client/local_cluster.h"
#include "common/grpc_server.h"
#include "colod/v1/coordinator.pb.h"
#include "common/security_flags.h"
#include "common/flags.h"
#include "common/version.h"
#include "nlohmann/json.hpp"
#include "worker/shardformer/checkpoint.h"
#include "worker/shardformer/init_model.h"
#include "worker/train/job_options.h"
#include "common/atomic_file.h"
#include "google/protobuf/util/json_util.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_split.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/numbers.h"
#include "worker/colo/tensor_proto.h"
#include "common/status_macros.h"
#include "worker/shardformer/run_forward.h"
#include "worker/train/checkpoint.h"
#include "worker/train/trainer.h"
#include "worker/tensor/npy.h"

ABSL_FLAG(std::string, coordinator, "",
          "Coordinator HOST:PORT. Default: $COLOD_COORDINATOR, else 127.0.0.1:7070.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "Deadline of each call, e.g. 10s.");
ABSL_FLAG(std::string, output, "table", "Output format: table or json.");
ABSL_FLAG(bool, all, false, "workers: also list workers whose lease expired (lost).");
ABSL_FLAG(std::string, model, "", "forward: the model directory (config.json + model.safetensors or an index).");
ABSL_FLAG(std::string, input, "", "forward: int64 (or int32/uint16/uint32) token ids [batch, seq] as .npy.");
ABSL_FLAG(std::string, logits, "", "forward: where to write the f32 logits [batch, seq, vocab] as .npy.");
ABSL_FLAG(int32_t, tp, 1, "forward: tensor-parallel size.");
ABSL_FLAG(int32_t, dp, 1, "forward: data-parallel size (splits the batch).");
ABSL_FLAG(std::string, mode, "1d", "forward: tensor-parallel mode: 1d, 2d, 2.5d or 3d.");
ABSL_FLAG(int32_t, depth, 0, "forward: depth of 2.5d (tp = depth * q * q).");
ABSL_FLAG(int, workers, 2, "local: CPU workers to start.");
ABSL_FLAG(std::string, listen, "127.0.0.1:7070", "local: the coordinator's gRPC address (port 0 picks one).");
ABSL_FLAG(std::string, data_dir, "",
          "local: coordinator state and worker logs (default: a temporary directory removed on exit).");
ABSL_FLAG(std::string, checkpoint, "", "consolidate: the sharded checkpoint directory.");
ABSL_FLAG(std::string, out, "", "consolidate: the Hugging Face directory to write.");
ABSL_FLAG(std::string, data, "", "train: the corpus: a .bin of uint16 tokens, a .npy, or UTF-8 text (byte-level).");
ABSL_FLAG(std::string, data_format, "auto", "train: auto, uint16, uint32, npy or text.");
ABSL_FLAG(int64_t, steps, 10, "train: optimizer steps.");
ABSL_FLAG(int64_t, batch_size, 8, "train: sequences per step over all dp replicas.");
ABSL_FLAG(int64_t, seq_len, 64, "train: tokens per sequence.");
ABSL_FLAG(int64_t, micro_batches, 1, "train: gradient accumulation passes per step.");
ABSL_FLAG(double, lr, 1e-3, "train: peak learning rate.");
ABSL_FLAG(double, min_lr, -1, "train: the cosine schedule's floor (default lr / 10).");
ABSL_FLAG(int64_t, warmup_steps, 0, "train: linear warm-up steps.");
ABSL_FLAG(std::string, optimizer, "adamw", "train: adamw or sgd.");
ABSL_FLAG(double, weight_decay, 0.0, "train: AdamW's decoupled weight decay (SGD: L2 on the gradient).");
ABSL_FLAG(double, momentum, 0.9, "train: SGD momentum.");
ABSL_FLAG(double, clip_norm, 1.0, "train: clip the global gradient norm to this (0: no clipping).");
ABSL_FLAG(uint64_t, seed, 1, "train: the data sampler's seed.");
ABSL_FLAG(std::string, precision, "fp32",
          "train: fp32, or bf16 / fp16 mixed precision (parameters and compute in 16 bits, f32 master weights "
          "and optimizer state).");
ABSL_FLAG(double, bucket_mb, 25, "train: MiB of gradients per dp all-reduce bucket.");
ABSL_FLAG(std::string, save, "", "train: write a training checkpoint here every --save-every steps and at the end.");
ABSL_FLAG(int64_t, save_every, 0, "train: steps between checkpoints (with --save).");
ABSL_FLAG(std::string, resume, "", "train: continue from the newest complete checkpoint in this directory.");
ABSL_FLAG(int64_t, stop_after, 0, "train: stop after this step (a time-boxed run to --resume later).");
ABSL_FLAG(std::string, final, "", "train: write the trained model here as a Hugging Face directory.");
ABSL_FLAG(std::string, device, "cpu",
          "forward, train: cpu (ranks as threads over Gloo) or cuda (rank r on CUDA device r, over NCCL).");
ABSL_FLAG(std::string, job_file, "",
          "submit: a colod.v1.JobSpec as JSON, or YAML (.yaml/.yml), instead of --model and the train flags.");
ABSL_FLAG(std::string, name, "", "submit, train: the job's name (default: the model directory's name).");
ABSL_FLAG(std::string, request_id, "", "submit: idempotency key; a retried submit with it returns the first job.");
ABSL_FLAG(bool, upload, true,
          "submit: stream the model directory's files to the coordinator (the workers download them); "
          "--upload=false sends only its path, for workers that share this file system.");
ABSL_FLAG(bool, watch, false, "submit: follow the job to its end, as `coloctl watch`.");
ABSL_FLAG(absl::Duration, watch_timeout, absl::Hours(24), "watch, submit --watch, train: give up after this long.");
ABSL_FLAG(std::string, state, "", "jobs: only jobs in these states, comma-separated (pending,running,...).");
ABSL_FLAG(std::string, reason, "", "cancel: why (recorded on the job).");
ABSL_FLAG(std::string, kind, "train", "submit: train (a model and data) or tensor (a mesh hosting ColoTensors).");
ABSL_FLAG(std::string, spec, "R",
          "tensor create/reshard: placements AXIS=R|S(DIM)|S(D1,D2|N1,N2)|P joined by ';', e.g. 'tp=S(-1)'.");
ABSL_FLAG(std::string, shape, "", "tensor create: the global shape, e.g. 2,3,2 (values N(0,1) from --seed).");
ABSL_FLAG(int32_t, rank, -1, "tensor get: only this rank's shard (default: the gathered global value).");
ABSL_FLAG(std::string, model_type, "gpt2", "init-model: the model family (gpt2).");
ABSL_FLAG(int64_t, vocab_size, 257, "init-model: vocabulary size (257: byte-level text).");
ABSL_FLAG(int64_t, hidden_size, 64, "init-model: hidden size (n_embd).");
ABSL_FLAG(int64_t, layers, 2, "init-model: transformer blocks (n_layer).");
ABSL_FLAG(int64_t, heads, 4, "init-model: attention heads (n_head).");
ABSL_FLAG(int64_t, positions, 64, "init-model: maximum sequence length (n_positions).");
ABSL_FLAG(bool, sequence_parallel, false, "forward: split activations along the sequence over tp (1d).");

namespace {

constexpr char kUsage[] =
    "coloctl: drive a colod cluster.\n"
    "\n"
    "Usage:\n"
    "  coloctl [flags] COMMAND\n"
    "\n"
    "Commands:\n"
    "  workers     List the workers registered with the coordinator: id, address, host,\n"
    "              device, state and heartbeat age. --all includes lost workers;\n"
    "              --output json prints the ListWorkersResponse as proto3 JSON.\n"
    "  version     Print the colod version.\n"
    "  local       Run an embedded cluster on this machine: a coordinator on --listen\n"
    "              (127.0.0.1:7070) and --workers N CPU workers as child processes on\n"
    "              loopback. Prints the coordinator's address once every worker has\n"
    "              registered, stays in the foreground, and stops everything on Ctrl-C or\n"
    "              SIGTERM. --data-dir keeps the coordinator's state and the worker logs.\n"
    "  forward     Run one forward pass of a Hugging Face-style model directory as a\n"
    "              FORWARD job on tp * dp workers (--coordinator's, else an embedded cluster\n"
    "              started for the run; --device cuda: local GPUs in this process) and print\n"
    "              the mean next-token cross-entropy.\n"
    "              --model DIR --input IDS.npy [--logits OUT.npy] [--tp T] [--dp D]\n"
    "              [--mode 1d|2d|2.5d|3d] [--depth D] [--sequence-parallel]\n"
    "              [--device cpu|cuda]. The ids are\n"
    "              integers [batch, seq]; the logits are written as f32 [batch, seq, vocab]\n"
    "              without vocabulary padding. --output json prints one JSON object with\n"
    "              loss, tokens, logits and shape.\n"
    "  train       Train a model directory as a job on the daemons and print one line per\n"
    "              step: on --coordinator (or $COLOD_COORDINATOR) when given, else on an\n"
    "              embedded cluster of tp * dp CPU workers started for the run (--device\n"
    "              cuda runs rank r on local GPU r in this process instead). One line per\n"
    "              step (--output json: one JSON object per line with step, loss, lr,\n"
    "              grad_norm, tokens_per_second and the bytes of parameters, gradients and\n"
    "              optimizer state on rank 0). --model DIR --data FILE [--steps N]\n"
    "              [--batch-size B] [--seq-len L] [--lr LR] [--optimizer adamw|sgd]\n"
    "              [--tp T] [--dp D] [--mode ...] [--micro-batches M] [--warmup-steps W]\n"
    "              [--clip-norm C] [--seed S] [--precision fp32|bf16|fp16] [--device cpu|cuda]\n"
    "              [--final DIR]\n"
    "              [--save DIR --save-every K]\n"
    "              [--resume DIR] [--stop-after N]. A resumed run continues from the\n"
    "              newest complete checkpoint with the losses the uninterrupted run has.\n"
    "  init-model  Write a new GPT-2 (config.json + model.safetensors, GPT-2's published\n"
    "              initialization, seeded) to --out DIR: [--vocab-size 257] [--hidden-size 64]\n"
    "              [--layers 2] [--heads 4] [--positions 64] [--seed S].\n"
    "  consolidate Assemble a sharded checkpoint (one file per rank + colod_checkpoint.json)\n"
    "              into a Hugging Face directory (config.json + model.safetensors) that\n"
    "              loads at any layout: --checkpoint DIR --out DIR.\n"
    "\n"
    "Cluster commands (talk to --coordinator, or $COLOD_COORDINATOR, or 127.0.0.1:7070;\n"
    "every call has the --timeout deadline):\n"

    "  submit      Submit a TRAIN job: --model DIR --data FILE and the train flags above;\n"
    "              the model's files are streamed to the coordinator and the workers\n"
    "              download them (--upload=false: the workers read DIR themselves). --data\n"
    "              and other paths must be readable by the workers; relative ones are made\n"
    "              absolute. Or --job-file FILE: a colod.v1.JobSpec as JSON, or YAML for\n"
    "              .yaml/.yml, sent as it is. Prints the job id; --watch follows it.\n"
    "  jobs        List jobs: id, name, state, layout, step, loss, reason. --state running,...\n"
    "  status JOB  One job in detail (--output json: the Job).\n"
    "  watch JOB   Follow a job to its end: state changes and a progress bar with step,\n"
    "              loss and tokens/s, then the loss curve; --output json prints every event\n"
    "              as one JSON line. Exits 0 when the job succeeded, 1 otherwise.\n"
    "  cancel JOB  Cancel a job [--reason TEXT]; its ranks are aborted and the workers freed.\n"
    "  tensor ...  ColoTensors of a TENSOR job (coloctl submit --kind tensor --tp T --dp D):\n"
    "                tensor demo                the ColoTensor document's example: a [2,3,2]\n"
    "                                           tensor sharded on its last dim over tp, made\n"
    "                                           replicated, resharded on dim 0; each rank's shape\n"
    "                tensor create JOB NAME --shape 2,3,2 [--seed S] [--spec 'tp=S(-1)']\n"
    "                tensor reshard JOB NAME --spec 'tp=S(0)'   (R: replicated)\n"
    "                tensor get JOB NAME [--rank R] [--out FILE.npy]\n"
    "                tensor list JOB | tensor delete JOB NAME\n"
    "  mesh JOB    The job's rank grid (a row per dp replica, a column per tp rank, each\n"
    "              cell the rank's worker) and every process group per axis.\n"
    "\n"
    "Exit status: 0 on success, 1 when the command fails (the status code, e.g. the\n"
    "coordinator's gRPC code, and the message are printed), 2 for a usage error.\n"
    "\n"
    "Examples:\n"
    "  coloctl --coordinator 127.0.0.1:7070 workers\n"
    "  coloctl init-model --out ./gpt2-tiny\n"
    "  coloctl submit --model ./gpt2-tiny --data /usr/share/common-licenses/GPL-3 --tp 2 --dp 2 --steps 40 --watch\n"
    "  coloctl jobs --state running --output json\n"
    "  coloctl mesh job-000001\n"
    "  COLOD_COORDINATOR=10.0.0.5:7070 coloctl workers --output json\n"
    "  coloctl forward --model ./gpt2 --input ids.npy --logits logits.npy --tp 2 --dp 1 --mode 1d\n"
    "  coloctl train --model ./gpt2 --data train.bin --steps 100 --batch-size 16 --seq-len 256 \\\n"
    "      --lr 3e-4 --optimizer adamw --tp 2 --dp 2 --mode 1d --output json\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "coloctl: error: %s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
               std::string(s.message()).c_str());
  return 1;
}

int Usage(const std::string& why) {
  std::fprintf(stderr, "coloctl: %s\nRun 'coloctl --help' for usage.\n", why.c_str());
  return 2;
}

std::string CoordinatorAddress() {
  std::string addr = absl::GetFlag(FLAGS_coordinator);
  if (addr.empty()) {
    const char* env = std::getenv("COLOD_COORDINATOR");
    addr = (env != nullptr && env[0] != '\0') ? env : "127.0.0.1:7070";
  }
  return addr;
}

int Workers(colod::CoordinatorClient& client, bool json) {
  auto workers = client.ListWorkers(absl::GetFlag(FLAGS_all));
  if (!workers.ok()) return Fail(workers.status());
  if (json) {
    colod::v1::ListWorkersResponse resp;
    for (const auto& w : *workers) *resp.add_workers() = w;
    auto out = colod::RenderJson(resp, /*pretty=*/true);
    if (!out.ok()) return Fail(out.status());
    std::fputs(out->c_str(), stdout);
  } else {
    std::fputs(colod::RenderWorkersTable(*workers, absl::Now()).c_str(), stdout);
  }
  return 0;
}

absl::StatusOr<colod::v1::TensorParallelMode> ParseMode(const std::string& mode) {
  if (mode == "1d") return colod::v1::TENSOR_PARALLEL_MODE_1D;
  if (mode == "2d") return colod::v1::TENSOR_PARALLEL_MODE_2D;
  if (mode == "2.5d") return colod::v1::TENSOR_PARALLEL_MODE_2P5D;
  if (mode == "3d") return colod::v1::TENSOR_PARALLEL_MODE_3D;
  return absl::InvalidArgumentError(absl::StrCat("--mode: '", mode, "' is not one of 1d, 2d, 2.5d, 3d"));
}

// --tp, --dp, --mode, --depth, --sequence-parallel.
absl::StatusOr<colod::shardformer::ShardConfig> ShardFromFlags() {
  auto mode = ParseMode(absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) return mode.status();
  colod::shardformer::ShardConfig shard;
  shard.layout.set_tensor_parallel_size(absl::GetFlag(FLAGS_tp));
  shard.layout.set_data_parallel_size(absl::GetFlag(FLAGS_dp));
  shard.layout.set_tensor_parallel_mode(*mode);
  shard.layout.set_depth(absl::GetFlag(FLAGS_depth));
  shard.layout.set_sequence_parallel(absl::GetFlag(FLAGS_sequence_parallel));
  return shard;
}

// --device: false for cpu, true for cuda.
absl::StatusOr<bool> CudaFromFlags() {
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device == "cpu") return false;
  if (device == "cuda") return true;
  return absl::InvalidArgumentError(absl::StrCat("--device: '", device, "' is not one of cpu, cuda"));
}

std::string ExplicitCoordinator();
int TrainOnCluster(const colod::train::TrainOptions& o, bool json, const std::string& address);
absl::StatusOr<std::unique_ptr<colod::LocalCluster>> StartLocalCluster(int workers, const std::string& listen,
                                                                      const std::string& data_dir);
absl::StatusOr<std::unique_ptr<colod::CoordinatorClient>> MakeClient(const std::string& address);
absl::StatusOr<colod::v1::Job> SubmitTensorJob(colod::CoordinatorClient& client, const std::string& name);

// The train flags (--model, --data, --steps, ...) as training options.
// INVALID_ARGUMENT (a usage error) for a missing or bad flag.
absl::StatusOr<colod::train::TrainOptions> TrainOptionsFromFlags() {
  colod::train::TrainOptions o;
  o.model_dir = absl::GetFlag(FLAGS_model);
  o.data_path = absl::GetFlag(FLAGS_data);
  if (o.model_dir.empty()) return absl::InvalidArgumentError("--model is required");
  if (o.data_path.empty()) return absl::InvalidArgumentError("--data is required");
  auto shard = ShardFromFlags();
  if (!shard.ok()) return shard.status();
  o.shard = *shard;
  auto cuda = CudaFromFlags();
  if (!cuda.ok()) return cuda.status();
  o.cuda = *cuda;
  auto format = colod::train::ParseDataFormat(absl::GetFlag(FLAGS_data_format));
  if (!format.ok()) return format.status();
  o.data_format = *format;
  auto kind = colod::train::ParseOptimizer(absl::GetFlag(FLAGS_optimizer));
  if (!kind.ok()) return kind.status();
  o.optimizer.kind = *kind;
  o.optimizer.weight_decay = absl::GetFlag(FLAGS_weight_decay);
  o.optimizer.momentum = absl::GetFlag(FLAGS_momentum);
  o.steps = absl::GetFlag(FLAGS_steps);
  o.batch_size = absl::GetFlag(FLAGS_batch_size);
  o.seq_len = absl::GetFlag(FLAGS_seq_len);
  o.micro_batches = absl::GetFlag(FLAGS_micro_batches);
  o.lr = absl::GetFlag(FLAGS_lr);
  o.min_lr = absl::GetFlag(FLAGS_min_lr) < 0 ? o.lr / 10 : absl::GetFlag(FLAGS_min_lr);
  o.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  o.clip_norm = absl::GetFlag(FLAGS_clip_norm);
  o.seed = absl::GetFlag(FLAGS_seed);
  o.final_dir = absl::GetFlag(FLAGS_final);
  if (absl::GetFlag(FLAGS_bucket_mb) <= 0) return absl::InvalidArgumentError("--bucket-mb must be positive");
  o.bucket_bytes = static_cast<int64_t>(absl::GetFlag(FLAGS_bucket_mb) * (1 << 20));
  const std::string precision = absl::GetFlag(FLAGS_precision);
  if (precision == "bf16") {
    o.shard.param_dtype = colod::DType::kBF16;
  } else if (precision == "fp16") {
    o.shard.param_dtype = colod::DType::kF16;
  } else if (precision != "fp32") {
    return absl::InvalidArgumentError(absl::StrCat("--precision: '", precision, "' is not one of fp32, bf16, fp16"));
  }
  o.save_dir = absl::GetFlag(FLAGS_save);
  o.save_every = absl::GetFlag(FLAGS_save_every);
  o.resume_dir = absl::GetFlag(FLAGS_resume);
  o.stop_after = absl::GetFlag(FLAGS_stop_after);
  if (!o.save_dir.empty() && o.save_every < 1) return absl::InvalidArgumentError("--save needs --save-every K (K >= 1)");
  return o;
}

void PrintStep(const nlohmann::json& line, int64_t steps, bool json) {
  if (json) {
    std::printf("%s\n", line.dump().c_str());
  } else {
    std::printf("step %lld/%lld  loss %.4f  lr %.3e  grad_norm %.4f  tokens/s %.0f\n",
                static_cast<long long>(line["step"].get<int64_t>()), static_cast<long long>(steps),
                line["loss"].get<double>(), line["lr"].get<double>(), line["grad_norm"].get<double>(),
                line["tokens_per_second"].get<double>());
  }
  std::fflush(stdout);
}

int Train(bool json) {
  auto options = TrainOptionsFromFlags();
  if (!options.ok()) return Usage(absl::StrCat("train: ", options.status().message()));
  colod::train::TrainOptions& o = *options;
  if (!o.resume_dir.empty()) {
    std::vector<std::string> skipped;
    auto latest = colod::train::LatestCheckpoint(o.resume_dir, &skipped);
    for (const std::string& s : skipped) std::fprintf(stderr, "coloctl: skipping damaged checkpoint %s\n", s.c_str());
    if (!latest.ok()) return Fail(latest.status());
    std::fprintf(stderr, "coloctl: resuming from %s\n", latest->c_str());
  }
  if (!ExplicitCoordinator().empty()) return TrainOnCluster(o, json, ExplicitCoordinator());
  if (!o.cuda) {
    // Through the daemons, as on a real cluster: an embedded one of tp * dp
    // CPU workers that lives as long as this command.
    const int world = std::max(1, o.shard.layout.tensor_parallel_size()) *
                      std::max(1, o.shard.layout.data_parallel_size());
    auto cluster = StartLocalCluster(world, "127.0.0.1:0", "");
    if (!cluster.ok()) return Fail(cluster.status());
    const int code = TrainOnCluster(o, json, (*cluster)->address());
    (*cluster)->Stop();
    return code;
  }
  // --device cuda: rank r on local GPU r over NCCL, as threads of this process.
  const absl::Status s = colod::train::Train(o, [&](const colod::train::StepStats& st) {
    PrintStep({{"step", st.step},
               {"loss", st.loss},
               {"lr", st.lr},
               {"grad_norm", st.grad_norm},
               {"tokens_per_second", st.tokens_per_second},
               {"param_bytes", st.param_bytes},
               {"grad_bytes", st.grad_bytes},
               {"optimizer_bytes", st.optimizer_bytes}},
              o.steps, json);
  });
  if (!s.ok()) return Fail(s);
  if (!o.final_dir.empty() && !json) std::printf("wrote the trained model to %s\n", o.final_dir.c_str());
  return 0;
}

// `path` made absolute and normal: paths the workers open must not depend on
// coloctl's working directory.
std::string Absolute(const std::string& path) {
  std::error_code ec;
  return std::filesystem::absolute(path, ec).lexically_normal().string();
}

// The model of `spec` from a Hugging Face directory: its config.json, the
// directory's absolute path as the weights, and (unless --name is given) its
// name as the job's. NOT_FOUND when config.json cannot be read.
absl::Status SetModelFromDir(const std::string& model_dir, colod::v1::JobSpec& spec) {
  const std::string dir = Absolute(model_dir);
  auto config = colod::ReadFileToString(dir + "/config.json");
  if (!config.ok()) return config.status();
  spec.mutable_model()->set_config_json(*config);
  spec.mutable_model()->set_weights_path(dir);
  spec.set_name(absl::GetFlag(FLAGS_name).empty() ? std::filesystem::path(dir).filename().string()
                                                  : absl::GetFlag(FLAGS_name));
  return absl::OkStatus();
}

// A FORWARD job on the cluster at `address`, followed to its end: the
// pass's result, or the job's failure.
absl::StatusOr<colod::v1::ForwardResult> ForwardOnCluster(const std::string& address, colod::v1::JobSpec spec) {
  auto client = MakeClient(address);
  if (!client.ok()) return client.status();
  auto job = (*client)->SubmitJob(spec);
  if (!job.ok()) return job.status();
  RETURN_IF_ERROR((*client)->WatchJob(job->job_id(), 1, absl::GetFlag(FLAGS_watch_timeout),
                                      [](const colod::v1::JobEvent&) { return true; }));
  auto ended = (*client)->GetJob(job->job_id());
  if (!ended.ok()) return ended.status();
  if (ended->state() != colod::v1::JOB_STATE_SUCCEEDED) {
    return absl::AbortedError(absl::StrCat("job ", ended->job_id(), " ", colod::JobStateLabel(ended->state()), ": ",
                                           ended->reason()));
  }
  return ended->forward_result();
}

int Forward(bool json) {
  const std::string model = absl::GetFlag(FLAGS_model), input = absl::GetFlag(FLAGS_input),
                    logits_path = absl::GetFlag(FLAGS_logits);
  if (model.empty()) return Usage("forward: --model is required");
  if (input.empty()) return Usage("forward: --input is required");
  colod::shardformer::ForwardRequest request;
  request.model_dir = model;
  auto shard = ShardFromFlags();
  if (!shard.ok()) return Usage(std::string(shard.status().message()));
  request.shard = *shard;
  auto cuda = CudaFromFlags();
  if (!cuda.ok()) return Usage(std::string(cuda.status().message()));
  request.cuda = *cuda;
  colod::v1::ForwardResult result;
  if (request.cuda) {  // rank r on local GPU r, in this process
    auto ids = colod::ReadNpy(input);
    if (!ids.ok()) return Fail(ids.status());
    request.ids = *ids;
    auto run = colod::shardformer::RunForward(request);
    if (!run.ok()) return Fail(run.status());
    if (!logits_path.empty()) {
      const absl::Status written = colod::WriteNpy(logits_path, run->logits);
      if (!written.ok()) return Fail(written);
    }
    result.set_loss(run->loss);
    result.set_tokens(run->tokens);
    for (int64_t d : run->logits.shape()) result.add_logits_shape(d);
  } else {
    // A FORWARD job on the daemons: --coordinator's, or an embedded cluster.
    colod::v1::JobSpec spec;
    spec.set_kind(colod::v1::JOB_KIND_FORWARD);
    if (absl::Status set = SetModelFromDir(model, spec); !set.ok()) return Fail(set);
    *spec.mutable_shard() = request.shard.layout;
    spec.mutable_forward()->set_input_path(Absolute(input));
    if (!logits_path.empty()) spec.mutable_forward()->set_logits_path(Absolute(logits_path));
    absl::StatusOr<colod::v1::ForwardResult> run;
    if (!ExplicitCoordinator().empty()) {
      run = ForwardOnCluster(ExplicitCoordinator(), spec);
    } else {
      const int world = std::max(1, spec.shard().tensor_parallel_size()) * std::max(1, spec.shard().data_parallel_size());
      auto cluster = StartLocalCluster(world, "127.0.0.1:0", "");
      if (!cluster.ok()) return Fail(cluster.status());
      run = ForwardOnCluster((*cluster)->address(), spec);
      (*cluster)->Stop();
    }
    if (!run.ok()) return Fail(run.status());
    result = *run;
  }
  const std::vector<int64_t> s(result.logits_shape().begin(), result.logits_shape().end());
  if (s.size() != 3) return Fail(absl::InternalError("the forward pass returned no logits shape"));
  if (json) {
    nlohmann::json out = {{"loss", result.loss()}, {"tokens", result.tokens()}, {"shape", {s[0], s[1], s[2]}}};
    out["logits"] = logits_path.empty() ? nlohmann::json() : nlohmann::json(logits_path);
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("loss %.6f (mean next-token cross-entropy over %lld tokens)\n", result.loss(),
                static_cast<long long>(result.tokens()));
    if (!logits_path.empty()) {
      std::printf("logits f32 [%lld, %lld, %lld] written to %s\n", static_cast<long long>(s[0]),
                  static_cast<long long>(s[1]), static_cast<long long>(s[2]), logits_path.c_str());
    }
  }
  return 0;
}

// --coordinator or $COLOD_COORDINATOR; empty when neither is set.
std::string ExplicitCoordinator() {
  std::string addr = absl::GetFlag(FLAGS_coordinator);
  if (addr.empty()) {
    const char* env = std::getenv("COLOD_COORDINATOR");
    if (env != nullptr) addr = env;
  }
  return addr;
}

absl::StatusOr<std::unique_ptr<colod::CoordinatorClient>> MakeClient(const std::string& address) {
  colod::CoordinatorClient::Options opts;
  opts.timeout = absl::GetFlag(FLAGS_timeout);
  auto security = colod::SecurityFromFlags(/*token_from_env=*/true);
  if (!security.ok()) return security.status();
  opts.tls = security->tls;
  opts.auth_token = security->auth_token;
  return colod::CoordinatorClient::Create(address, opts);
}

// A TRAIN job from the train flags: the model directory's config.json and
// its absolute path as the weights every worker reads.
absl::StatusOr<colod::v1::JobSpec> JobSpecFromFlags() {
  auto options = TrainOptionsFromFlags();
  if (!options.ok()) return options.status();
  if (options->cuda) {
    return absl::InvalidArgumentError(
        "--device: on a cluster the workers' devices decide (CUDA workers run CUDA ranks); drop --device");
  }
  colod::v1::JobSpec spec = colod::train::SpecFromTrainOptions(*options);
  if (absl::Status set = SetModelFromDir(options->model_dir, spec); !set.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--model: ", set.message()));
  }
  // Paths the workers open must not depend on coloctl's working directory.
  colod::v1::TrainConfig& t = *spec.mutable_train();
  for (std::string* path : {t.mutable_data_path(), t.mutable_final_dir(), t.mutable_checkpoint_dir(),
                            t.mutable_resume_from()}) {
    if (!path->empty()) *path = Absolute(*path);
  }
  return spec;
}

int PrintJson(const google::protobuf::Message& m) {
  auto out = colod::RenderJson(m, /*pretty=*/true);
  if (!out.ok()) return Fail(out.status());
  std::fputs(out->c_str(), stdout);
  return 0;
}

// Follows a job to its end. Table mode draws a progress bar (step, loss,
// tokens/s) and state changes; json prints each event as one JSON line.
// Returns the job as it ended, or the watch's error.
absl::StatusOr<colod::v1::Job> WatchToEnd(colod::CoordinatorClient& client, const std::string& job_id, bool json,
                                          const std::function<void(const colod::v1::StepProgress&)>& on_step) {
  auto job = client.GetJob(job_id);
  if (!job.ok()) return job.status();
  const int64_t steps = job->spec().train().steps();
  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  bool bar_open = false;
  std::vector<double> losses;
  double tokens_per_second = 0;
  const absl::Status s = client.WatchJob(job_id, 1, absl::GetFlag(FLAGS_watch_timeout), [&](const colod::v1::JobEvent& ev) {
    if (on_step && ev.has_step()) on_step(ev.step());
    if (json) {
      if (!on_step) {
        auto line = colod::RenderJson(ev, /*pretty=*/false);
        if (line.ok()) std::fputs(line->c_str(), stdout);
      }
      std::fflush(stdout);
      return true;
    }
    if (ev.has_step()) {
      const colod::v1::StepProgress& p = ev.step();
      losses.push_back(p.loss());
      tokens_per_second += p.tokens_per_second();
      if (on_step) return true;
      const int width = 30;
      const int filled = steps > 0 ? static_cast<int>(width * p.step() / steps) : width;
      std::string bar = std::string(filled, '#') + std::string(width - filled, '.');
      std::printf("%s[%s] step %lld/%lld  loss %.4f  tokens/s %.0f%s", tty ? "\r" : "", bar.c_str(),
                  static_cast<long long>(p.step()), static_cast<long long>(steps), p.loss(), p.tokens_per_second(),
                  tty ? "" : "\n");
      bar_open = tty;
    } else if (ev.has_state_change()) {
      if (bar_open) std::printf("\n");
      bar_open = false;
      std::printf("%s %s%s\n", job_id.c_str(), colod::JobStateLabel(ev.state_change().state()).c_str(),
                  ev.state_change().reason().empty() ? "" : (": " + ev.state_change().reason()).c_str());
    }
    std::fflush(stdout);
    return true;
  });
  if (bar_open) std::printf("\n");
  if (!s.ok()) return s;
  job = client.GetJob(job_id);
  if (!job.ok()) return job.status();
  if (!json && !losses.empty() && !on_step) {
    const double min_loss = *std::min_element(losses.begin(), losses.end());
    std::printf("loss %.4f -> %.4f over %zu steps (min %.4f), mean %.0f tokens/s\n", losses.front(), losses.back(),
                losses.size(), min_loss, tokens_per_second / static_cast<double>(losses.size()));
    std::printf("loss curve %s\n", colod::Sparkline(losses, 60).c_str());
  }
  return job;
}

int ExitForJob(const colod::v1::Job& job) {
  if (job.state() == colod::v1::JOB_STATE_SUCCEEDED) return 0;
  std::fprintf(stderr, "coloctl: job %s %s: %s\n", job.job_id().c_str(), colod::JobStateLabel(job.state()).c_str(),
               job.reason().c_str());
  return 1;
}

int Submit(colod::CoordinatorClient& client, bool json) {
  const std::string kind = absl::GetFlag(FLAGS_kind);
  if (kind != "train" && kind != "tensor") return Usage(absl::StrCat("--kind: '", kind, "' is not one of train, tensor"));
  if (kind == "tensor") {
    auto job = SubmitTensorJob(client, absl::GetFlag(FLAGS_name));
    if (!job.ok()) return Fail(job.status());
    if (json) return PrintJson(*job);
    std::printf("%s\n", job->job_id().c_str());
    return 0;
  }
  absl::StatusOr<colod::v1::JobSpec> spec = absl::GetFlag(FLAGS_job_file).empty()
                                                ? JobSpecFromFlags()
                                                : colod::ReadJobFile(absl::GetFlag(FLAGS_job_file));
  if (!spec.ok()) {
    if (absl::IsInvalidArgument(spec.status())) return Usage(absl::StrCat("submit: ", spec.status().message()));
    return Fail(spec.status());
  }
  if (absl::GetFlag(FLAGS_job_file).empty() && absl::GetFlag(FLAGS_upload)) {
    // The workers may not see this machine's files: send them along.
    auto uploaded = client.UploadModel(spec->model().weights_path(), absl::GetFlag(FLAGS_watch_timeout));
    if (!uploaded.ok()) return Fail(uploaded.status());
    if (!json) {
      std::fprintf(stderr, "coloctl: uploaded %d files (%lld bytes) of %s as %s\n", uploaded->files_size(),
                   static_cast<long long>(uploaded->bytes()), spec->model().weights_path().c_str(),
                   uploaded->upload_id().c_str());
    }
    spec->mutable_model()->clear_weights_path();
    spec->mutable_model()->set_upload_id(uploaded->upload_id());
  }
  auto job = client.SubmitJob(*spec, absl::GetFlag(FLAGS_request_id));
  if (!job.ok()) return Fail(job.status());
  if (!absl::GetFlag(FLAGS_watch)) {
    if (json) return PrintJson(*job);
    std::printf("%s\n", job->job_id().c_str());
    return 0;
  }
  if (!json) std::printf("submitted %s (%s)\n", job->job_id().c_str(), colod::LayoutName(job->spec().shard()).c_str());
  auto ended = WatchToEnd(client, job->job_id(), json, nullptr);
  if (!ended.ok()) return Fail(ended.status());
  return ExitForJob(*ended);
}

// coloctl train against a cluster: submit, then print the steps as the
// local run does.
int TrainOnCluster(const colod::train::TrainOptions& o, bool json, const std::string& address) {
  auto client = MakeClient(address);
  if (!client.ok()) return Usage(std::string(client.status().message()));
  auto spec = JobSpecFromFlags();
  if (!spec.ok()) return Usage(absl::StrCat("train: ", spec.status().message()));
  auto job = (*client)->SubmitJob(*spec);
  if (!job.ok()) return Fail(job.status());
  if (!ExplicitCoordinator().empty()) {
    std::fprintf(stderr, "coloctl: job %s on %s\n", job->job_id().c_str(), (*client)->address().c_str());
  }
  auto ended = WatchToEnd(**client, job->job_id(), json, [&](const colod::v1::StepProgress& p) {
    PrintStep({{"step", p.step()},
               {"loss", p.loss()},
               {"lr", p.learning_rate()},
               {"grad_norm", p.grad_norm()},
               {"tokens_per_second", p.tokens_per_second()},
               {"param_bytes", p.param_bytes()},
               {"grad_bytes", p.grad_bytes()},
               {"optimizer_bytes", p.optimizer_bytes()}},
              o.steps, json);
  });
  if (!ended.ok()) return Fail(ended.status());
  if (ended->state() == colod::v1::JOB_STATE_SUCCEEDED && !o.final_dir.empty() && !json) {
    std::printf("wrote the trained model to %s\n", o.final_dir.c_str());
  }
  return ExitForJob(*ended);
}

absl::StatusOr<std::vector<colod::v1::JobState>> StatesFromFlag() {
  std::vector<colod::v1::JobState> states;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_state), ',', absl::SkipEmpty())) {
    colod::v1::JobState s;
    if (!colod::v1::JobState_Parse(absl::StrCat("JOB_STATE_", absl::AsciiStrToUpper(name)), &s) ||
        s == colod::v1::JOB_STATE_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--state: '", name, "' is not one of pending, scheduled, running, succeeded, failed, cancelled"));
    }
    states.push_back(s);
  }
  return states;
}

int Jobs(colod::CoordinatorClient& client, bool json) {
  auto states = StatesFromFlag();
  if (!states.ok()) return Usage(std::string(states.status().message()));
  auto jobs = client.ListJobs(*states);
  if (!jobs.ok()) return Fail(jobs.status());
  if (json) {
    colod::v1::ListJobsResponse resp;
    for (const auto& j : *jobs) *resp.add_jobs() = j;
    return PrintJson(resp);
  }
  std::fputs(colod::RenderJobsTable(*jobs, absl::Now()).c_str(), stdout);
  return 0;
}

int InitModel() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return Usage("init-model: --out is required");
  if (absl::GetFlag(FLAGS_model_type) != "gpt2") {
    return Usage(absl::StrCat("init-model: --model-type '", absl::GetFlag(FLAGS_model_type), "' is not supported (gpt2)"));
  }
  colod::shardformer::Gpt2Shape shape;
  shape.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  shape.hidden_size = absl::GetFlag(FLAGS_hidden_size);
  shape.num_layers = absl::GetFlag(FLAGS_layers);
  shape.num_heads = absl::GetFlag(FLAGS_heads);
  shape.max_positions = absl::GetFlag(FLAGS_positions);
  const absl::Status s = colod::shardformer::WriteInitializedGpt2(out, shape, absl::GetFlag(FLAGS_seed));
  if (!s.ok()) return Fail(s);
  std::printf("wrote a GPT-2 (vocab %lld, n_embd %lld, n_layer %lld, n_head %lld, n_positions %lld) to %s\n",
              static_cast<long long>(shape.vocab_size), static_cast<long long>(shape.hidden_size),
              static_cast<long long>(shape.num_layers), static_cast<long long>(shape.num_heads),
              static_cast<long long>(shape.max_positions), out.c_str());
  return 0;
}

// Nested brackets of a small tensor's values ("[[0.1, 0.2], ...]").
std::string FormatValues(const colod::v1::TensorValue& value) {
  auto t = colod::TensorFromProto(value);
  if (!t.ok()) return std::string(t.status().message());
  const std::vector<float> v = t->ToFloats();
  const colod::Shape shape = t->shape();
  if (v.size() > 4096) return absl::StrCat("(", v.size(), " values; use --out FILE.npy)");
  std::function<std::string(size_t, size_t, size_t)> rec = [&](size_t d, size_t offset,
                                                                 size_t stride) -> std::string {
    if (d == shape.size()) return absl::StrFormat("%.4f", v[offset]);
    const size_t inner = stride / static_cast<size_t>(shape[d]);
    std::vector<std::string> parts;
    for (int64_t i = 0; i < shape[d]; ++i) parts.push_back(rec(d + 1, offset + i * inner, inner));
    return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
  };
  return rec(0, 0, v.size());
}

absl::StatusOr<std::vector<int64_t>> ParseShape(const std::string& text) {
  std::vector<int64_t> shape;
  for (absl::string_view d : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v;
    if (!absl::SimpleAtoi(d, &v) || v < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--shape: '", text, "' is not sizes like 2,3,2"));
    }
    shape.push_back(v);
  }
  if (shape.empty()) return absl::InvalidArgumentError("--shape is required, e.g. --shape 2,3,2");
  return shape;
}

// Waits until `job_id` runs (TENSOR jobs run until cancelled).
absl::Status WaitRunning(colod::CoordinatorClient& client, const std::string& job_id, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    auto job = client.GetJob(job_id);
    if (!job.ok()) return job.status();
    if (job->state() == colod::v1::JOB_STATE_RUNNING) return absl::OkStatus();
    if (colod::v1::JobState_IsValid(job->state()) && job->state() >= colod::v1::JOB_STATE_SUCCEEDED) {
      return absl::FailedPreconditionError(absl::StrCat("job ", job_id, " ", colod::JobStateLabel(job->state()), ": ",
                                                        job->reason()));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("job ", job_id, " is still ",
                                                      colod::JobStateLabel(job->state()), ": ", job->reason()));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

absl::StatusOr<colod::v1::Job> SubmitTensorJob(colod::CoordinatorClient& client, const std::string& name) {
  auto shard = ShardFromFlags();
  if (!shard.ok()) return shard.status();
  colod::v1::JobSpec spec;
  spec.set_kind(colod::v1::JOB_KIND_TENSOR);
  spec.set_name(name);
  *spec.mutable_shard() = shard->layout;
  return client.SubmitJob(spec);
}

// The ColoTensor document's example over gRPC: a TENSOR job on tp x dp
// workers; a random [2, 3, 2] tensor sharded on its last dim over tp, made
// replicated, then resharded on dim 0; every rank's shape at each stage.
int TensorDemo(colod::CoordinatorClient& c, bool json) {
  auto job = SubmitTensorJob(c, "colotensor-example");
  if (!job.ok()) return Fail(job.status());
  const std::string id = job->job_id();
  auto run = [&]() -> absl::Status {
    RETURN_IF_ERROR(WaitRunning(c, id, absl::GetFlag(FLAGS_timeout) * 6));
    auto mesh = c.GetMesh(id);
    if (!mesh.ok()) return mesh.status();
    nlohmann::json stages = nlohmann::json::array();
    auto show = [&](const std::string& what, const colod::v1::TensorLayout& layout) -> absl::Status {
      nlohmann::json ranks = nlohmann::json::array();
      if (!json) std::printf("%s\n", what.c_str());
      for (const colod::v1::ShardLayout& s : layout.shards()) {
        auto shard = c.GetShard(id, layout.name(), s.rank());
        if (!shard.ok()) return shard.status();
        std::vector<int64_t> shape(shard->value().shape().begin(), shard->value().shape().end());
        ranks.push_back({{"rank", s.rank()}, {"shape", shape}});
        if (!json) {
          std::printf("  rank %d: shape [%s] %s\n", s.rank(), absl::StrJoin(shape, ", ").c_str(),
                      FormatValues(shard->value()).c_str());
        }
      }
      stages.push_back({{"stage", what}, {"spec", colod::DistSpecText(layout.dist_spec())}, {"ranks", ranks}});
      return absl::OkStatus();
    };
    colod::v1::CreateTensorRequest create;
    create.set_job_id(id);
    create.set_name("t1");
    create.mutable_random()->set_seed(absl::GetFlag(FLAGS_seed));
    for (int64_t d : {2, 3, 2}) create.mutable_random()->add_shape(d);
    create.mutable_random()->set_dtype(colod::v1::DTYPE_F32);
    create.mutable_random()->set_distribution(colod::v1::RandomInit::DISTRIBUTION_NORMAL);
    create.set_compute_pattern(colod::v1::COMPUTE_PATTERN_TP1D);
    auto spec = colod::ParseDistSpecText("tp=S(-1)", *mesh);
    if (!spec.ok()) return spec.status();
    *create.mutable_dist_spec() = *spec;
    auto layout = c.CreateTensor(create);
    if (!layout.ok()) return layout.status();
    RETURN_IF_ERROR(show("t1 = ColoTensor(randn(2, 3, 2), ShardSpec(dims=[-1], num_partitions=[tp]))", *layout));
    layout = c.SetDistSpec(id, "t1", colod::v1::DistSpec());
    if (!layout.ok()) return layout.status();
    RETURN_IF_ERROR(show("t1 = t1.to_replicate()", *layout));
    spec = colod::ParseDistSpecText("tp=S(0)", *mesh);
    if (!spec.ok()) return spec.status();
    layout = c.SetDistSpec(id, "t1", *spec);
    if (!layout.ok()) return layout.status();
    RETURN_IF_ERROR(show("t1.set_dist_spec(ShardSpec([0], [tp]))", *layout));
    if (json) std::printf("%s\n", nlohmann::json{{"job_id", id}, {"stages", stages}}.dump().c_str());
    return absl::OkStatus();
  };
  const absl::Status s = run();
  auto cancelled = c.CancelJob(id, "tensor demo finished");  // a TENSOR job runs until cancelled
  if (!s.ok()) return Fail(s);
  if (!cancelled.ok()) return Fail(cancelled.status());
  return 0;
}

int TensorCommand(colod::CoordinatorClient& c, const std::vector<std::string>& args, bool json) {
  if (args.size() < 2) return Usage("tensor: missing SUBCOMMAND (demo, create, reshard, list, get, delete)");
  const std::string& sub = args[1];
  auto need = [&](size_t n, const char* what) {
    return args.size() == n ? 0 : Usage(absl::StrCat("tensor ", sub, ": expected ", what));
  };
  if (sub == "demo") {
    if (int u = need(2, "no arguments")) return u;
    return TensorDemo(c, json);
  }
  if (sub == "list") {
    if (int u = need(3, "JOB")) return u;
    auto list = c.ListTensors(args[2]);
    if (!list.ok()) return Fail(list.status());
    if (json) {
      colod::v1::ListTensorsResponse resp;
      for (const auto& l : *list) *resp.add_tensors() = l;
      return PrintJson(resp);
    }
    for (const auto& l : *list) std::fputs(colod::RenderTensorLayout(l).c_str(), stdout);
    return 0;
  }
  if (sub == "delete") {
    if (int u = need(4, "JOB NAME")) return u;
    const absl::Status s = c.DeleteTensor(args[2], args[3]);
    return s.ok() ? 0 : Fail(s);
  }
  if (sub == "get") {
    if (int u = need(4, "JOB NAME")) return u;
    absl::StatusOr<colod::v1::TensorValue> value;
    if (absl::GetFlag(FLAGS_rank) >= 0) {
      auto shard = c.GetShard(args[2], args[3], absl::GetFlag(FLAGS_rank));
      if (!shard.ok()) return Fail(shard.status());
      value = shard->value();
    } else {
      value = c.GetGlobal(args[2], args[3]);
    }
    if (!value.ok()) return Fail(value.status());
    if (!absl::GetFlag(FLAGS_out).empty()) {
      auto t = colod::TensorFromProto(*value);
      if (!t.ok()) return Fail(t.status());
      const absl::Status s = colod::WriteNpy(absl::GetFlag(FLAGS_out), *t);
      return s.ok() ? 0 : Fail(s);
    }
    if (json) return PrintJson(*value);
    std::printf("[%s] %s\n", absl::StrJoin(value->shape(), ", ").c_str(), FormatValues(*value).c_str());
    return 0;
  }
  if (sub != "create" && sub != "reshard") return Usage(absl::StrCat("tensor: unknown subcommand '", sub, "'"));
  if (int u = need(4, "JOB NAME")) return u;
  auto mesh = c.GetMesh(args[2]);
  if (!mesh.ok()) return Fail(mesh.status());
  auto spec = colod::ParseDistSpecText(absl::GetFlag(FLAGS_spec), *mesh);
  if (!spec.ok()) return Usage(absl::StrCat("--spec: ", spec.status().message()));
  absl::StatusOr<colod::v1::TensorLayout> layout;
  if (sub == "reshard") {
    layout = c.SetDistSpec(args[2], args[3], *spec);
  } else {
    auto shape = ParseShape(absl::GetFlag(FLAGS_shape));
    if (!shape.ok()) return Usage(std::string(shape.status().message()));
    colod::v1::CreateTensorRequest req;
    req.set_job_id(args[2]);
    req.set_name(args[3]);
    req.mutable_random()->set_seed(absl::GetFlag(FLAGS_seed));
    for (int64_t d : *shape) req.mutable_random()->add_shape(d);
    req.mutable_random()->set_dtype(colod::v1::DTYPE_F32);
    *req.mutable_dist_spec() = *spec;
    layout = c.CreateTensor(req);
  }
  if (!layout.ok()) return Fail(layout.status());
  if (json) return PrintJson(*layout);
  std::fputs(colod::RenderTensorLayout(*layout).c_str(), stdout);
  return 0;
}

// Commands that talk to a coordinator: workers, submit, jobs, status,
// watch, cancel, mesh.
int ClusterCommand(const std::vector<std::string>& args, bool json) {
  const std::string& cmd = args[0];
  auto client = MakeClient(CoordinatorAddress());
  if (!client.ok()) return Usage(std::string(client.status().message()));
  colod::CoordinatorClient& c = **client;
  if (cmd == "tensor") return TensorCommand(c, args, json);
  const bool takes_job = cmd == "status" || cmd == "watch" || cmd == "cancel" || cmd == "mesh";
  const size_t want = takes_job ? 2 : 1;
  if (args.size() < want) return Usage(absl::StrCat(cmd, ": missing JOB"));
  if (args.size() > want) return Usage(absl::StrCat("unexpected argument '", args[want], "'"));
  if (cmd == "workers") return Workers(c, json);
  if (cmd == "submit") return Submit(c, json);
  if (cmd == "jobs") return Jobs(c, json);
  const std::string& job_id = args[1];
  if (cmd == "status") {
    auto job = c.GetJob(job_id);
    if (!job.ok()) return Fail(job.status());
    if (json) return PrintJson(*job);
    std::fputs(colod::RenderJob(*job, absl::Now()).c_str(), stdout);
    return 0;
  }
  if (cmd == "watch") {
    auto ended = WatchToEnd(c, job_id, json, nullptr);
    if (!ended.ok()) return Fail(ended.status());
    return ExitForJob(*ended);
  }
  if (cmd == "cancel") {
    auto job = c.CancelJob(job_id, absl::GetFlag(FLAGS_reason));
    if (!job.ok()) return Fail(job.status());
    if (json) return PrintJson(*job);
    std::printf("%s %s: %s\n", job->job_id().c_str(), colod::JobStateLabel(job->state()).c_str(), job->reason().c_str());
    return 0;
  }
  auto mesh = c.GetMesh(job_id);
  if (!mesh.ok()) return Fail(mesh.status());
  if (json) return PrintJson(*mesh);
  std::printf("mesh of %s: ", job_id.c_str());
  std::fputs(colod::RenderMesh(*mesh).c_str(), stdout);
  return 0;
}

// A coordinator and `workers` CPU workers as children of this process
// (found next to this coloctl), every worker registered.
absl::StatusOr<std::unique_ptr<colod::LocalCluster>> StartLocalCluster(int workers, const std::string& listen,
                                                                      const std::string& data_dir) {
  colod::LocalCluster::Options o;
  o.workers = workers;
  o.listen = listen;
  o.data_dir = data_dir;
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  const std::string self = n > 0 ? std::string(exe, n) : "coloctl";
  auto coordinator = colod::FindDaemonBinary(self, "colod-coordinator");
  if (!coordinator.ok()) return coordinator.status();
  auto worker = colod::FindDaemonBinary(self, "colod-worker");
  if (!worker.ok()) return worker.status();
  o.coordinator_binary = *coordinator;
  o.worker_binary = *worker;
  return colod::LocalCluster::Start(o);
}

int Local() {
  colod::BlockShutdownSignals();  // before any thread starts; the children unblock
  ::signal(SIGPIPE, SIG_IGN);     // a closed stdout must not skip the cleanup
  if (absl::GetFlag(FLAGS_workers) < 1) return Usage("local: --workers must be at least 1");
  auto cluster = StartLocalCluster(absl::GetFlag(FLAGS_workers), absl::GetFlag(FLAGS_listen),
                                   absl::GetFlag(FLAGS_data_dir));
  if (!cluster.ok()) return Fail(cluster.status());
  std::printf("coordinator %s (metrics http://%s/metrics), data dir %s\n", (*cluster)->address().c_str(),
              (*cluster)->metrics_address().c_str(), (*cluster)->data_dir().c_str());
  const auto listed = (*cluster)->workers();
  if (!listed.ok()) return Fail(listed.status());
  const std::vector<colod::v1::Worker>& workers = *listed;
  for (size_t i = 0; i < workers.size(); ++i) {
    std::printf("worker %s at %s (metrics http://%s/metrics)\n", workers[i].info().worker_id().c_str(),
                workers[i].info().address().c_str(), workers[i].info().metrics_address().c_str());
  }
  std::printf("ready: %zu workers registered; export COLOD_COORDINATOR=%s; Ctrl-C stops the cluster\n",
              workers.size(), (*cluster)->address().c_str());
  std::fflush(stdout);
  const int sig = colod::WaitForShutdownSignal();
  std::fprintf(stderr, "coloctl: signal %d: stopping the local cluster\n", sig);
  (*cluster)->Stop();
  return 0;
}

int Consolidate() {
  const std::string checkpoint = absl::GetFlag(FLAGS_checkpoint), out = absl::GetFlag(FLAGS_out);
  if (checkpoint.empty()) return Usage("consolidate: --checkpoint is required");
  if (out.empty()) return Usage("consolidate: --out is required");
  const absl::Status s = colod::shardformer::ConsolidateCheckpoint(checkpoint, out);
  if (!s.ok()) return Fail(s);
  std::printf("wrote %s/model.safetensors and %s/config.json\n", out.c_str(), out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args = colod::ParseFlags(argc, argv, kUsage);
  if (args.empty()) return Usage("missing COMMAND");
  const std::string output = absl::GetFlag(FLAGS_output);
  if (output != "table" && output != "json") {
    return Usage(absl::StrCat("--output: '", output, "' is not one of table, json"));
  }
  const std::string& cmd = args[0];
  if (cmd == "local") {
    if (args.size() > 1) return Usage(absl::StrCat("unexpected argument '", args[1], "'"));
    return Local();
  }
  if (cmd == "version") {
    std::printf("colod %s\n", colod::kVersion);
    return 0;
  }
  if (cmd == "consolidate") {
    if (args.size() > 1) return Usage(absl::StrCat("unexpected argument '", args[1], "'"));
    return Consolidate();
  }
  if (cmd == "train") {
    if (args.size() > 1) return Usage(absl::StrCat("unexpected argument '", args[1], "'"));
    return Train(output == "json");
  }
  if (cmd == "forward") {
    if (args.size() > 1) return Usage(absl::StrCat("unexpected argument '", args[1], "'"));
    return Forward(output == "json");
  }
  if (cmd == "init-model") {
    if (args.size() > 1) return Usage(absl::StrCat("unexpected argument '", args[1], "'"));
    return InitModel();
  }
  static const char* const kClusterCommands[] = {"workers", "submit", "jobs",  "status",
                                                 "watch",   "cancel", "mesh", "tensor"};
  if (std::find(std::begin(kClusterCommands), std::end(kClusterCommands), cmd) == std::end(kClusterCommands)) {
    return Usage(absl::StrCat("unknown command '", cmd, "'"));
  }
  return ClusterCommand(args, output == "json");
}
