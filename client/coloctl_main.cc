// coloctl: the colod command line.
#include <unistd.h>

#include <csignal>
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
#include "client/local_cluster.h"
#include "common/grpc_server.h"
#include "colod/v1/coordinator.pb.h"
#include "common/security_flags.h"
#include "common/flags.h"
#include "common/version.h"
#include "nlohmann/json.hpp"
#include "worker/shardformer/checkpoint.h"
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
    "  forward     Run one forward pass of a Hugging Face-style model directory on tp * dp\n"
    "              local ranks (threads talking Gloo over loopback) and print the mean\n"
    "              next-token cross-entropy; does not need a coordinator.\n"
    "              --model DIR --input IDS.npy [--logits OUT.npy] [--tp T] [--dp D]\n"
    "              [--mode 1d|2d|2.5d|3d] [--depth D] [--sequence-parallel]\n"
    "              [--device cpu|cuda]. The ids are\n"
    "              integers [batch, seq]; the logits are written as f32 [batch, seq, vocab]\n"
    "              without vocabulary padding. --output json prints one JSON object with\n"
    "              loss, tokens, logits and shape.\n"
    "  train       Train a model directory on tp * dp local ranks and print one line per\n"
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
    "  consolidate Assemble a sharded checkpoint (one file per rank + colod_checkpoint.json)\n"
    "              into a Hugging Face directory (config.json + model.safetensors) that\n"
    "              loads at any layout: --checkpoint DIR --out DIR.\n"
    "\n"
    "Exit status: 0 on success, 1 when the command fails (the status code, e.g. the\n"
    "coordinator's gRPC code, and the message are printed), 2 for a usage error.\n"
    "\n"
    "Examples:\n"
    "  coloctl --coordinator 127.0.0.1:7070 workers\n"
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

int Train(bool json) {
  colod::train::TrainOptions o;
  o.model_dir = absl::GetFlag(FLAGS_model);
  o.data_path = absl::GetFlag(FLAGS_data);
  if (o.model_dir.empty()) return Usage("train: --model is required");
  if (o.data_path.empty()) return Usage("train: --data is required");
  auto shard = ShardFromFlags();
  if (!shard.ok()) return Usage(std::string(shard.status().message()));
  o.shard = *shard;
  auto cuda = CudaFromFlags();
  if (!cuda.ok()) return Usage(std::string(cuda.status().message()));
  o.cuda = *cuda;
  auto format = colod::train::ParseDataFormat(absl::GetFlag(FLAGS_data_format));
  if (!format.ok()) return Usage(std::string(format.status().message()));
  o.data_format = *format;
  auto kind = colod::train::ParseOptimizer(absl::GetFlag(FLAGS_optimizer));
  if (!kind.ok()) return Usage(std::string(kind.status().message()));
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
  if (absl::GetFlag(FLAGS_bucket_mb) <= 0) return Usage("train: --bucket-mb must be positive");
  o.bucket_bytes = static_cast<int64_t>(absl::GetFlag(FLAGS_bucket_mb) * (1 << 20));
  const std::string precision = absl::GetFlag(FLAGS_precision);
  if (precision == "bf16") {
    o.shard.param_dtype = colod::DType::kBF16;
  } else if (precision == "fp16") {
    o.shard.param_dtype = colod::DType::kF16;
  } else if (precision != "fp32") {
    return Usage(absl::StrCat("--precision: '", precision, "' is not one of fp32, bf16, fp16"));
  }
  o.save_dir = absl::GetFlag(FLAGS_save);
  o.save_every = absl::GetFlag(FLAGS_save_every);
  o.resume_dir = absl::GetFlag(FLAGS_resume);
  o.stop_after = absl::GetFlag(FLAGS_stop_after);
  if (!o.save_dir.empty() && o.save_every < 1) return Usage("train: --save needs --save-every K (K >= 1)");
  if (!o.resume_dir.empty()) {
    std::vector<std::string> skipped;
    auto latest = colod::train::LatestCheckpoint(o.resume_dir, &skipped);
    for (const std::string& s : skipped) std::fprintf(stderr, "coloctl: skipping damaged checkpoint %s\n", s.c_str());
    if (!latest.ok()) return Fail(latest.status());
    std::fprintf(stderr, "coloctl: resuming from %s\n", latest->c_str());
  }
  const absl::Status s = colod::train::Train(o, [&](const colod::train::StepStats& st) {
    if (json) {
      const nlohmann::json line = {{"step", st.step},
                                   {"loss", st.loss},
                                   {"lr", st.lr},
                                   {"grad_norm", st.grad_norm},
                                   {"tokens_per_second", st.tokens_per_second},
                                   {"param_bytes", st.param_bytes},
                                   {"grad_bytes", st.grad_bytes},
                                   {"optimizer_bytes", st.optimizer_bytes}};
      std::printf("%s\n", line.dump().c_str());
    } else {
      std::printf("step %lld/%lld  loss %.4f  lr %.3e  grad_norm %.4f  tokens/s %.0f\n",
                  static_cast<long long>(st.step), static_cast<long long>(o.steps), st.loss, st.lr, st.grad_norm,
                  st.tokens_per_second);
    }
    std::fflush(stdout);
  });
  if (!s.ok()) return Fail(s);
  if (!o.final_dir.empty() && !json) std::printf("wrote the trained model to %s\n", o.final_dir.c_str());
  return 0;
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
  auto ids = colod::ReadNpy(input);
  if (!ids.ok()) return Fail(ids.status());
  request.ids = *ids;
  auto result = colod::shardformer::RunForward(request);
  if (!result.ok()) return Fail(result.status());
  if (!logits_path.empty()) {
    const absl::Status written = colod::WriteNpy(logits_path, result->logits);
    if (!written.ok()) return Fail(written);
  }
  const colod::Shape& s = result->logits.shape();
  if (json) {
    nlohmann::json out = {{"loss", result->loss}, {"tokens", result->tokens}, {"shape", {s[0], s[1], s[2]}}};
    out["logits"] = logits_path.empty() ? nlohmann::json() : nlohmann::json(logits_path);
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("loss %.6f (mean next-token cross-entropy over %lld tokens)\n", result->loss,
                static_cast<long long>(result->tokens));
    if (!logits_path.empty()) {
      std::printf("logits f32 [%lld, %lld, %lld] written to %s\n", static_cast<long long>(s[0]),
                  static_cast<long long>(s[1]), static_cast<long long>(s[2]), logits_path.c_str());
    }
  }
  return 0;
}

int Local() {
  colod::BlockShutdownSignals();  // before any thread starts; the children unblock
  ::signal(SIGPIPE, SIG_IGN);     // a closed stdout must not skip the cleanup
  colod::LocalCluster::Options o;
  o.workers = absl::GetFlag(FLAGS_workers);
  o.listen = absl::GetFlag(FLAGS_listen);
  o.data_dir = absl::GetFlag(FLAGS_data_dir);
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  const std::string self = n > 0 ? std::string(exe, n) : "coloctl";
  auto coordinator = colod::FindDaemonBinary(self, "colod-coordinator");
  if (!coordinator.ok()) return Fail(coordinator.status());
  auto worker = colod::FindDaemonBinary(self, "colod-worker");
  if (!worker.ok()) return Fail(worker.status());
  o.coordinator_binary = *coordinator;
  o.worker_binary = *worker;
  if (o.workers < 1) return Usage("local: --workers must be at least 1");
  auto cluster = colod::LocalCluster::Start(o);
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
  if (cmd != "workers") return Usage(absl::StrCat("unknown command '", cmd, "'"));
  if (args.size() > 1) return Usage(absl::StrCat("unexpected argument '", args[1], "'"));
  colod::CoordinatorClient::Options opts;
  opts.timeout = absl::GetFlag(FLAGS_timeout);
  auto security = colod::SecurityFromFlags(/*token_from_env=*/true);
  if (!security.ok()) return Usage(std::string(security.status().message()));
  opts.tls = security->tls;
  opts.auth_token = security->auth_token;
  auto client = colod::CoordinatorClient::Create(CoordinatorAddress(), opts);
  if (!client.ok()) return Usage(std::string(client.status().message()));
  return Workers(**client, output == "json");
}
