// coloctl's model commands: forward and train as jobs (on --coordinator, or
// an embedded cluster started for the run), plan (from config.json alone),
// and the commands coloctl-run computes in its own process (forward and
// train --device cuda, init-model, tokenize, consolidate), whose usage is
// here and whose code is in cmd_run.cc.
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "client/cli.h"
#include "client/commands.h"
#include "client/format.h"
#include "client/job_flags.h"
#include "common/flags.h"
#include "common/json.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "spec/job_validation.h"
#include "spec/model_config.h"
#include "spec/plan.h"

ABSL_FLAG(int32_t, world, 0, "plan: list every layout of this many ranks that fits, by communication.");
ABSL_FLAG(std::string, memory_per_rank, "",
          "plan: with --world, the memory one rank has: bytes, or with a unit (80GiB, 24GB, 512MiB).");

namespace colod::cli {
namespace {

// The workers a layout needs: tp * pp * dp (an unset size counts as 1), at
// most one more than a mesh may have (the coordinator refuses such a job).
int WorkersFor(const v1::ShardConfig& layout) {
  int64_t n = 1;
  for (int32_t size : {layout.tensor_parallel_size(), layout.pipeline_parallel_size(), layout.data_parallel_size()}) {
    n = std::min<int64_t>(n * std::max(1, size), int64_t{kMaxWorldSize} + 1);
  }
  return static_cast<int>(n);
}

// A FORWARD job on the cluster at `address`, followed to its end: the
// pass's result, or the job's failure; `rank0_worker` gets the worker that
// ran rank 0 (which wrote the logits).
absl::StatusOr<v1::ForwardResult> ForwardOnCluster(const std::string& address, v1::JobSpec spec,
                                                   std::string* rank0_worker) {
  auto client = MakeClient(address);
  if (!client.ok()) return client.status();
  // On --coordinator's cluster the workers may not see this machine's files
  // (an embedded cluster's do).
  if (!ExplicitCoordinator().empty()) RETURN_IF_ERROR(UploadModelIfAsked(**client, spec, JsonOutput()));
  auto job = (*client)->SubmitJob(spec);
  if (!job.ok()) return job.status();
  RETURN_IF_ERROR((*client)->WatchJob(job->job_id(), 1, absl::GetFlag(FLAGS_watch_timeout),
                                      [](const v1::JobEvent&) { return true; }));
  auto ended = (*client)->GetJob(job->job_id());
  if (!ended.ok()) return ended.status();
  if (ended->state() != v1::JOB_STATE_SUCCEEDED) {
    return absl::AbortedError(
        absl::StrCat("job ", ended->job_id(), " ", JobStateLabel(ended->state()), ": ", ended->reason()));
  }
  if (ended->mesh().ranks_size() > 0) *rank0_worker = ended->mesh().ranks(0).worker_id();
  return ended->forward_result();
}

int RunForward(const std::vector<std::string>&) {
  auto cuda = CudaFromFlags();
  if (!cuda.ok()) return Usage(std::string(cuda.status().message()));
  if (*cuda && !ExplicitCoordinator().empty()) {  // as train: the workers' devices decide there
    return Usage("forward: --device: on a cluster (--coordinator, or $COLOD_COORDINATOR) the workers' devices decide "
                 "(CUDA workers run CUDA ranks); drop --device, or unset $COLOD_COORDINATOR to run on this machine's "
                 "GPUs");
  }
  if (*cuda) return RunInProcess();  // rank r on local GPU r, in coloctl-run's process
  if (absl::Status s = RefuseCommTimeoutOnWorkers(GivenFlags()); !s.ok()) {
    return Usage(absl::StrCat("forward: ", s.message()));
  }
  auto files = ForwardFilesFromFlags();
  if (!files.ok()) return Usage(std::string(files.status().message()));
  if (absl::GetFlag(FLAGS_upload_timeout) <= absl::ZeroDuration()) {
    return Usage("forward: --upload-timeout: must be > 0");
  }
  auto shard = ShardFromFlags();
  if (!shard.ok()) return Usage(std::string(shard.status().message()));
  // A FORWARD job on the daemons: --coordinator's, or an embedded cluster.
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_FORWARD);
  if (absl::Status set = SetModelFromDir(files->model, spec); !set.ok()) {
    return Usage(absl::StrCat("forward: --model: ", set.message()));
  }
  *spec.mutable_shard() = *shard;
  spec.mutable_forward()->set_input_path(Absolute(files->input));
  if (!files->logits.empty()) {
    // The worker writes a file there (atomically): a link's file, resolved
    // here, or a new file; not a FIFO or a device (coloctl's own writes,
    // --device cuda, take those).
    std::string logits = Absolute(files->logits);
    struct stat st;
    if (::stat(logits.c_str(), &st) == 0) {
      if (!S_ISREG(st.st_mode)) {
        return Usage(absl::StrCat("forward: --logits ", files->logits, " is not a file: a FORWARD job's worker "
                                  "writes the logits as a file (give a file path, or --device cuda)"));
      }
      char* real = ::realpath(logits.c_str(), nullptr);
      if (real != nullptr) {
        logits = real;
        std::free(real);
      }
    } else if (struct stat link; ::lstat(logits.c_str(), &link) == 0) {
      return Usage(absl::StrCat("forward: --logits ", files->logits, " is a link to nothing"));
    }
    spec.mutable_forward()->set_logits_path(logits);
  }
  if (!files->labels.empty()) spec.mutable_forward()->set_labels_path(Absolute(files->labels));
  if (!files->decoder_input.empty()) spec.mutable_forward()->set_decoder_input_path(Absolute(files->decoder_input));
  // What the coordinator would refuse (--tp 0, a layout the model cannot
  // take) is a usage error here, before a cluster starts for it.
  if (absl::Status valid = ValidateJobSpec(spec); !valid.ok()) {
    return Usage(absl::StrCat("forward: ", valid.message()));
  }
  v1::ForwardResult result;
  std::string rank0_worker;
  const int code = RunOnCoordinatorOrEmbeddedCluster(WorkersFor(spec.shard()), [&](const std::string& address) {
    auto run = ForwardOnCluster(address, spec, &rank0_worker);
    if (!run.ok()) return Fail(run.status());
    result = *run;
    return 0;
  });
  if (code != 0) return code;
  // On --coordinator's cluster the logits are on rank 0's worker's machine,
  // at the path as it resolved there (an embedded cluster's is this one).
  if (ExplicitCoordinator().empty()) rank0_worker.clear();
  const std::string logits =
      rank0_worker.empty() || result.logits_path().empty() ? files->logits : result.logits_path();
  return PrintForwardResult(result, files->images, !files->labels.empty(), logits, JsonOutput(), rank0_worker);
}

// coloctl train against a cluster: submit, then print the steps as the
// local run does.
int TrainOnCluster(v1::JobSpec spec, bool json, const std::string& address) {
  auto client = MakeClient(address);
  if (!client.ok()) return Usage(std::string(client.status().message()));
  // On --coordinator's cluster the workers may not see this machine's files
  // (an embedded cluster's do).
  if (!ExplicitCoordinator().empty()) {
    if (absl::Status s = UploadModelIfAsked(**client, spec, json); !s.ok()) return Fail(s);
  }
  auto job = (*client)->SubmitJob(spec);
  if (!job.ok()) return Fail(job.status());
  if (!ExplicitCoordinator().empty()) {
    std::fprintf(stderr, "coloctl: job %s on %s\n", job->job_id().c_str(), (*client)->address().c_str());
  }
  auto ended = WatchToEnd(**client, job->job_id(), json,
                          [&](const v1::StepProgress& p) { PrintStep(p, spec.train().steps(), json); });
  if (!ended.ok()) return Fail(ended.status());
  const v1::TrainConfig& t = spec.train();
  if (ended->state() == v1::JOB_STATE_SUCCEEDED && !json) {
    // (The job's newest checkpoint: its stop's where it trained to it.)
    PrintRunEnd(t.final_dir(), ended->step() == t.stop_after() ? ended->last_checkpoint() : "", t.steps(),
                t.stop_after());
  }
  return ExitForJob(*ended);
}

int RunTrain(const std::vector<std::string>&) {
  const bool json = JsonOutput();
  auto cuda = CudaFromFlags();
  if (!cuda.ok()) return Usage(absl::StrCat("train: ", cuda.status().message()));
  // This machine's GPUs: coloctl-run's, which checks the flags itself. On a
  // cluster the workers' devices decide (TrainJobSpecFromFlags rejects
  // --device cuda there).
  if (*cuda && ExplicitCoordinator().empty()) return RunInProcess();
  if (absl::Status s = RefuseCommTimeoutOnWorkers(GivenFlags()); !s.ok()) {
    return Usage(absl::StrCat("train: ", s.message()));
  }
  // The job, from the flags once, before any embedded cluster starts.
  auto spec = TrainJobSpecFromFlags();
  if (!spec.ok()) return Usage(absl::StrCat("train: ", spec.status().message()));
  return RunOnCoordinatorOrEmbeddedCluster(
      WorkersFor(spec->shard()), [&](const std::string& address) { return TrainOnCluster(*spec, json, address); });
}

// init-model, tokenize, consolidate: coloctl-run's.
int RunInProcessCommand(const std::vector<std::string>&) { return RunInProcess(); }

// "80GiB", "24GB", "512MiB", "1073741824": bytes.
// --memory-per-rank as the worker's --memory-limit reads it (ParseByteSize:
// GB is 10^9, GiB 2^30), so that a layout plan says fits is one the workers
// admit; a positive size.
absl::StatusOr<int64_t> ParseBytes(const std::string& text) {
  absl::StatusOr<int64_t> bytes = ParseByteSize(text);
  if (!bytes.ok() || *bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--memory-per-rank: '", text, "' is not a positive size (bytes, or 80GiB, 24GB, 512MiB)"));
  }
  return *bytes;
}

std::string Bytes(int64_t n) { return HumanBytes(n); }

nlohmann::json PlanJson(const JobPlan& p) {
  nlohmann::json comm = nlohmann::json::array();
  for (const PlanComm& c : p.comm) {
    comm.push_back({{"group", c.group}, {"op", c.op}, {"calls", c.calls}, {"bytes", c.bytes},
                    {"wire_bytes", c.wire_bytes}});
  }
  return {{"parameters", p.parameters},
          {"rank_parameters", p.rank_parameters},
          {"param_bytes", p.param_bytes},
          {"grad_bytes", p.grad_bytes},
          {"optimizer_bytes", p.optimizer_bytes},
          {"activation_bytes", p.activation_bytes},
          {"total_bytes", p.total_bytes},
          {"batch_size", p.batch_size},
          {"seq_len", p.seq_len},
          {"micro_batches", p.micro_batches},
          {"grad_accum", p.grad_accum},
          {"pipeline_stage", p.pipeline_stage},
          {"bubble_fraction", p.bubble_fraction},
          {"comm", comm},
          {"wire_bytes", p.wire_bytes},
          {"notes", p.notes}};
}

int RunPlan(const std::vector<std::string>&) {
  if (absl::GetFlag(FLAGS_model).empty()) return Usage("plan: --model is required (a directory with config.json)");
  // As a job on the workers: auto precision is fp32 on CPU workers, bf16 on GPUs.
  auto parsed = TrainSpecFromFlags(/*require_data=*/false);
  if (!parsed.ok()) return Usage(absl::StrCat("plan: ", parsed.status().message()));
  v1::JobSpec spec = *parsed;
  // The attention keeps less on CUDA workers (the fused kernel keeps no
  // probabilities).
  auto cuda = CudaFromFlags();
  if (!cuda.ok()) return Usage(absl::StrCat("plan: ", cuda.status().message()));
  const PlanDevice device = *cuda ? PlanDevice::kCuda : PlanDevice::kCpu;
  // Auto precision is what the workers planned for run at: bf16 mixed on
  // GPUs (planned in fp32 until 2026-12).
  const bool auto_precision = spec.train().precision() == v1::PRECISION_UNSPECIFIED;
  if (auto_precision && *cuda) spec.mutable_train()->set_precision(v1::PRECISION_BF16_MIXED);
  auto config = ReadModelConfig(absl::GetFlag(FLAGS_model));
  if (!config.ok()) return Fail(config.status());
  const int world = absl::GetFlag(FLAGS_world);
  const std::string memory_flag = absl::GetFlag(FLAGS_memory_per_rank);
  const bool json = JsonOutput();
  if (world != 0 || !memory_flag.empty()) {
    // The search sets the layout itself: a layout's flags would be ignored.
    if (world != 0) {
      std::vector<std::string> layout;
      const std::set<std::string> given = GivenFlags();
      for (const char* flag : {"tp", "dp", "pp", "mode", "depth", "pp_layers", "virtual_stages"}) {
        if (given.count(flag)) layout.push_back(absl::StrCat("--", absl::StrReplaceAll(flag, {{"_", "-"}})));
      }
      if (!layout.empty()) {
        return Usage(absl::StrCat("plan --world: ", absl::StrJoin(layout, ", "),
                                  " do not apply: --world ranks every layout of that many ranks (leave --world out "
                                  "to plan one layout)"));
      }
    }
    if (world < 1) {
      return Usage(world == 0 ? "plan: --memory-per-rank goes with --world N (N >= 1)"
                              : absl::StrCat("plan: --world ", world, " is not a number of ranks (N >= 1)"));
    }
    int64_t memory = 0;
    if (!memory_flag.empty()) {
      auto parsed = ParseBytes(memory_flag);
      if (!parsed.ok()) return Usage(std::string(parsed.status().message()));
      memory = *parsed;
    }
    auto search = RankLayouts(*config, spec, world, memory, device);
    if (!search.ok()) return Fail(search.status());
    if (json) {
      nlohmann::json fits = nlohmann::json::array();
      for (const RankedLayout& l : search->fits) {
        nlohmann::json j = PlanJson(l.plan);
        j["layout"] = LayoutName(l.shard);
        fits.push_back(std::move(j));
      }
      std::printf("%s\n", JsonText({{"fits", fits}, {"refused", search->refused}}, 2).c_str());
      return search->fits.empty() ? 1 : 0;  // as the table's
    }
    std::vector<std::vector<std::string>> rows;
    for (const RankedLayout& l : search->fits) {
      rows.push_back({LayoutName(l.shard), Bytes(l.plan.total_bytes), Bytes(l.plan.param_bytes + l.plan.grad_bytes +
                                                                             l.plan.optimizer_bytes),
                      Bytes(l.plan.activation_bytes), Bytes(l.plan.wire_bytes),
                      l.plan.pipeline_stage < 0 ? "-" : absl::StrFormat("%.0f%%", 100 * l.plan.bubble_fraction)});
    }
    std::printf("%d ranks%s: %zu layouts fit, least communication first\n", world,
                memory > 0 ? absl::StrCat(", ", Bytes(memory), " each").c_str() : "", search->fits.size());
    std::printf("%s", RenderTable({"LAYOUT", "MEMORY/RANK", "PARAMS+GRADS+OPTIMIZER", "ACTIVATIONS", "SENT/STEP", "BUBBLE"}, rows).c_str());
    for (const std::string& r : search->refused) std::printf("left out: %s\n", r.c_str());
    return search->fits.empty() ? 1 : 0;
  }
  auto plan = PlanJob(*config, spec, device);
  if (!plan.ok()) return Fail(plan.status());
  if (json) {
    nlohmann::json j = PlanJson(*plan);
    j["layout"] = LayoutName(spec.shard());
    std::printf("%s\n", JsonText(j, 2).c_str());
    return 0;
  }
  const v1::TrainConfig& t = spec.train();
  std::printf("%s, %lld parameters, %s: %lld sequences x %lld tokens a %s, %lld micro-batch%s, %s, %s\n",
              config->model_type.c_str(), static_cast<long long>(plan->parameters), LayoutName(spec.shard()).c_str(),
              static_cast<long long>(plan->batch_size), static_cast<long long>(plan->seq_len),
              plan->grad_accum > 1 ? absl::StrCat("pass, ", plan->grad_accum, " passes a step").c_str() : "step",
              static_cast<long long>(plan->micro_batches), plan->micro_batches == 1 ? "" : "es",
              auto_precision
                  ? (*cuda ? "bf16 mixed (auto, as on GPU workers)" : "fp32 (auto, as on CPU workers; bf16 on GPUs)")
              : t.precision() == v1::PRECISION_BF16_MIXED ? "bf16 mixed"
              : t.precision() == v1::PRECISION_FP16_MIXED ? "fp16 mixed"
                                                          : "fp32",
              t.optimizer() == v1::OPTIMIZER_SGD ? "sgd" : "adamw");
  std::printf("\nper rank (%lld parameters):\n", static_cast<long long>(plan->rank_parameters));
  std::printf("%s", RenderTable({"MEMORY", "BYTES"}, {{"parameters", Bytes(plan->param_bytes)},
                                                      {"gradients", Bytes(plan->grad_bytes)},
                                                      {"optimizer state", Bytes(plan->optimizer_bytes)},
                                                      {"activations (estimate)", Bytes(plan->activation_bytes)},
                                                      {"total", Bytes(plan->total_bytes)}})
                        .c_str());
  std::vector<std::vector<std::string>> rows;
  for (const PlanComm& c : plan->comm) {
    rows.push_back({c.group, c.op, absl::StrCat(c.calls), Bytes(c.bytes), Bytes(c.wire_bytes)});
  }
  if (rows.empty()) {
    std::printf("\nper step: no communication\n");
  } else {
    std::printf("\nper step, on each rank:\n%s", RenderTable({"GROUP", "OP", "CALLS", "PAYLOAD", "SENT"}, rows).c_str());
    std::printf("sent in all: %s (ring algorithms)\n", Bytes(plan->wire_bytes).c_str());
  }
  if (plan->pipeline_stage >= 0) {
    std::printf("pipeline bubble: %.0f%% of the step idle (%s, equal stages)\n", 100 * plan->bubble_fraction,
                spec.shard().virtual_stages() > 1 ? "(P - 1) / (V M + P - 1), interleaved" : "(P - 1) / (M + P - 1)");
  }
  for (const std::string& n : plan->notes) std::printf("note: %s\n", n.c_str());
  return 0;
}

constexpr Command kCommands[] = {
    {"forward", "", COLOD_FORWARD_FLAGS,
     "  forward     Run one forward pass of a Hugging Face-style model directory as a\n"
     "              FORWARD job on tp * dp workers (--coordinator's, else an embedded cluster\n"
     "              started for the run; --device cuda: local GPUs in this process) and print\n"
     "              the mean next-token cross-entropy.\n"
     "              --model DIR --input IDS.npy [--logits OUT.npy] [--tp T] [--dp D]\n"
     "              [--mode 1d|2d|2.5d|3d] [--depth D] [--sequence-parallel]\n"
     "              [--device cpu|cuda] [--comm-timeout D]. The ids are\n"
     "              integers [batch, seq]; the logits are written as f32 [batch, seq, vocab]\n"
     "              without vocabulary padding. An image classifier (ViT) takes\n"
     "              --pixel-values X.npy (floats [batch, channels, height, width]) instead of\n"
     "              --input and, with --labels L.npy (integers [batch]), prints their mean\n"
     "              cross-entropy; its logits are [batch, num_labels]. An encoder-decoder (T5)\n"
     "              takes --decoder-input DEC.npy (integers [batch, seq]) beside --input; the\n"
     "              logits and the next-token loss are over the decoder ids. A masked language\n"
     "              model (BERT) has no next-token loss: with --labels L.npy (integers shaped as\n"
     "              --input: the token each position predicts, -100 where none) it prints their\n"
     "              mean cross-entropy, without them none. --output json prints one\n"
     "              JSON object with loss (null without labels), tokens, logits and shape.\n"
     "              --comm-timeout (local --device cuda runs,\n"
     "              default 60s): a rank that stops taking part in a collective fails the run\n"
     "              with DEADLINE_EXCEEDED after it, and coloctl exits 1.\n",
     RunForward},
    {"train", "", COLOD_TRAIN_FLAGS,
     "  train       Train a model directory as a job on the daemons and print one line per\n"
     "              step: on --coordinator (or $COLOD_COORDINATOR) when given, else on an\n"
     "              embedded cluster of tp * pp * dp CPU workers (at most 256) started for\n"
     "              the run (--device cuda runs rank r on local GPU r in this process\n"
     "              instead). One line per\n"
     "              step (--output json: one JSON object per line with step, loss, lr,\n"
     "              grad_norm, tokens_per_second and the bytes of parameters, gradients and\n"
     "              optimizer state on rank 0; fp16: loss_scale, update_skipped).\n"
     "              --model DIR --data FILE [--steps N]\n"
     "              [--batch-size B] [--seq-len L] [--lr LR] [--optimizer adamw|sgd]\n"
     "              [--tp T] [--dp D] [--mode ...] [--micro-batches M] [--warmup-steps W]\n"
     "              [--grad-accum N (N passes of --batch-size sequences a step, as one step on\n"
     "              N times the batch; the dp gradients reduced once)]\n"
     "              [--pp P [--pp-layers N,N,...] (pipeline stages, every family: each holds a run of the\n"
     "              layers (t5: the encoder's, then the decoder's, one stack's each) and a step runs 1F1B\n"
     "              over the micro-batches; world = tp * pp * dp)]\n"
     "              [--virtual-stages V (interleaved 1F1B: V model chunks a pipeline rank, the bubble\n"
     "              (P - 1) / (V M) of the compute against 1F1B's (P - 1) / M; --micro-batches a\n"
     "              multiple of --pp)]\n"
     "              [--clip-norm C] [--seed S] [--device cpu|cuda]\n"
     "              [--precision auto|fp32|bf16|fp16 (auto: fp32 on CPUs, bf16 on GPUs)]\n"
     "              [--loss-scale S (fp16: the loss scale to start at, a power of two;\n"
     "              default 65536; a step that overflows updates nothing and halves it)]\n"
     "              [--loss-scale-window N (fp16: doubles after N steps without overflow;\n"
     "              default 2000)]\n"
     "              [--allow-tf32 (GPUs: f32 GEMMs on tensor cores in TF32)]\n"
     "              [--zero 0|1|2 (ZeRO over dp: 1 partitions the optimizer state, 2 the\n"
     "              gradients too; the losses are the plain run's)]\n"
     "              [--recompute none|full|selective (activation recomputation: full keeps\n"
     "              each block's input only, selective all but attention's probabilities)]\n"
     "              [--comm-timeout D (--device cuda; as for forward)]\n"
     "              [--final DIR [--final-dtype auto|f32|bf16|f16 (the model's dtype; auto:\n"
     "              a bf16 run's is bf16)]]\n"
     "              [--eval-split F | --eval-data FILE [--eval-labels FILE]] [--eval-every K]\n"
     "              [--eval-steps M] [--eval-only] (held-out evaluation: the trailing fraction F\n"
     "              of --data's documents, which training then never reads, or another file;\n"
     "              its loss, perplexity or accuracy after every K steps and the last, over M\n"
     "              batches of --batch-size (default: the held-out data once, at most 100);\n"
     "              --eval-only evaluates the model or --resume's checkpoint and trains nothing)\n"
     "              [--save DIR --save-every K [--keep-last N] [--keep-best] (retention after\n"
     "              each save: the newest N and the best by held-out loss; `coloctl\n"
     "              checkpoints JOB` lists what is kept)]\n"
     "              [--resume DIR] [--stop-after N]. A resumed run continues from the\n"
     "              newest complete checkpoint with the losses the uninterrupted run has,\n"
     "              at any --dp and --zero (the rest of the layout as written).\n"
     "              An image classifier (ViT) trains on --data IMAGES.npy (floats [N, channels,\n"
     "              height, width]) and --labels LABELS.npy (integers [N]); --seq-len is\n"
     "              unused and tokens_per_second counts images. An encoder-decoder (T5)\n"
     "              trains on (input, target) pairs: --data INPUTS.npy (token ids [N, input_len])\n"
     "              and --labels TARGETS.npy (token ids [N, target_len], -100 after a target's\n"
     "              end); the decoder reads the targets shifted right after the config's\n"
     "              decoder_start_token_id; --seq-len must be at least input_len and\n"
     "              target_len (memory admission and plan count both at it). A masked language\n"
     "              model (BERT) needs --mask-token-id ID (its tokenizer's [MASK]: 103 in\n"
     "              bert-base-uncased's vocab.txt): it sees every position, so 15 % of each\n"
     "              window's are drawn and predicted (read as ID 80 % of the time, a random\n"
     "              id 10 %, themselves 10 %), the others left out of the loss.\n",
     RunTrain},
    {"plan", "",
     "model world memory_per_rank device batch_size seq_len micro_batches grad_accum optimizer precision bucket_mb "
     "recompute zero " COLOD_LAYOUT_FLAGS COLOD_PIPELINE_FLAGS,
     "  plan        Dry-run a training job's layout without running it: per rank, the bytes\n"
     "              of parameters, gradients, optimizer state and (an estimate) activations,\n"
     "              and per step each process group's collectives (calls, payload, bytes\n"
     "              sent under ring algorithms). --model DIR (config.json is enough)\n"
     "              [--tp T] [--dp D] [--pp P [--pp-layers N,...] [--virtual-stages V]]\n"
     "              [--mode 1d|2d|2.5d|3d]\n"
     "              [--depth D] [--sequence-parallel] [--batch-size B] [--seq-len L]\n"
     "              [--micro-batches M] [--grad-accum N] [--precision auto|fp32|bf16|fp16] [--optimizer adamw|sgd]\n"
     "              [--bucket-mb MB] [--zero 0|1|2] [--recompute none|full|selective]\n"
     "              [--device cpu|cuda] [--output json]. With pipeline stages the plan is the\n"
     "              fullest stage's, with the 1F1B bubble (P - 1) / (M + P - 1) (interleaved:\n"
     "              (P - 1) / (V M + P - 1)). --device\n"
     "              cuda plans the fused attention (no [S, S] probabilities kept).\n"
     "              With --world N [--memory-per-rank 80GiB]: every layout of N ranks\n"
     "              (tp x pp x dp in 1d, 2d, 2.5d and 3d; pp for every family, equal stages\n"
     "              with the given --micro-batches) the model takes that fits, least\n"
     "              communication first, each with its bubble, and why each other one was\n"
     "              left out (exit 1 when none fits). The memory and communication match a real step (tested\n"
     "              within 5 %; the activation estimate at 80-100 % of a measured step).\n",
     RunPlan},
    {"init-model", "", COLOD_INIT_MODEL_FLAGS,
     "  init-model  Write a new GPT-2 (config.json + model.safetensors, GPT-2's published\n"
     "              initialization, seeded) to --out DIR: [--vocab-size 257] [--hidden-size 64]\n"
     "              [--layers 2] [--heads 4] [--positions 64] [--seed S]. A DIR that\n"
     "              already holds a model is refused, not written over.\n",
     RunInProcessCommand},
    {"tokenize", "", COLOD_TOKENIZE_FLAGS,
     "  tokenize    Encode text with a model directory's own tokenizer (tokenizer.model or\n"
     "              spiece.model: SentencePiece; tokenizer.json or vocab.json + merges.txt:\n"
     "              byte-level BPE) into Megatron-LM's indexed dataset, PREFIX.bin +\n"
     "              PREFIX.idx, one sequence per document, [bos] text [eos] as the\n"
     "              tokenizer_config.json says: --model DIR --input FILE --out PREFIX\n"
     "              [--data-format auto|text|jsonl]. Text's documents are its paragraphs\n"
     "              (up to a blank line); a .jsonl's are each line's \"text\" (the input of\n"
     "              Megatron's preprocess_data.py). `train --data PREFIX` reads the result,\n"
     "              and `train --data FILE` tokenizes the same way on the fly. A model\n"
     "              without a tokenizer (init-model's) has nothing to tokenize with: train\n"
     "              --data FILE reads text as bytes for it.\n",
     RunInProcessCommand},
    {"consolidate", "", COLOD_CONSOLIDATE_FLAGS,
     "  consolidate Assemble a sharded checkpoint (one file per rank + colod_checkpoint.json)\n"
     "              into a Hugging Face directory (config.json + model.safetensors) that\n"
     "              loads at any layout: --checkpoint DIR --out DIR. An --out that already\n"
     "              holds a model is refused, not written over. --dtype auto (a bf16 run's\n"
     "              model is bf16, an fp32 run's F32), f32, bf16 or f16.\n",
     RunInProcessCommand},
};

}  // namespace

CommandGroup ModelCommands() {
  return {"Model commands (forward and train --device cuda, init-model, tokenize and consolidate\n"
          "compute in this process: coloctl runs coloctl-run, installed beside it, for them):",
          kCommands};
}

}  // namespace colod::cli
