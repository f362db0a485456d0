#include "client/job_flags.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <limits>

#include "absl/flags/flag.h"
#include "absl/time/time.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "common/atomic_file.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "spec/job_validation.h"

ABSL_FLAG(std::string, model, "",
          "forward, train, submit, plan, tokenize: the model directory (config.json + model.safetensors or an "
          "index; plan needs only config.json).");
ABSL_FLAG(bool, upload, true,
          "submit, and train and forward on --coordinator: stream the model directory's files to the coordinator "
          "(the workers download them); --upload=false sends only its path, for workers that share this file "
          "system.");
ABSL_FLAG(absl::Duration, upload_timeout, absl::Hours(24),
          "submit, train, forward: give up streaming the model's files to the coordinator after this long (a "
          "deadline of its own: --timeout bounds each short call, --watch-timeout the watch).");
ABSL_FLAG(int32_t, tp, 1, "forward, train, submit, plan, tensor: tensor-parallel size.");
ABSL_FLAG(int32_t, dp, 1, "forward, train, submit, plan, tensor: data-parallel size (splits the batch).");
ABSL_FLAG(std::string, mode, "1d",
          "forward, train, submit, plan, tensor: tensor-parallel mode: 1d, 2d, 2.5d or 3d.");
ABSL_FLAG(int32_t, depth, 0, "forward, train, submit, plan, tensor: depth of 2.5d (tp = depth * q * q).");
ABSL_FLAG(bool, sequence_parallel, false,
          "forward, train, submit, plan: split activations along the sequence over tp (1d).");
ABSL_FLAG(int32_t, pp, 1,
          "train: pipeline stages (every family; world = dp * pp * tp): each holds a run of the layers (t5: the encoder's "
          "layers, then the decoder's, each stage one stack's), and each step runs the 1F1B schedule over --micro-batches.");
ABSL_FLAG(std::string, pp_layers, "",
          "train: the layers of each pipeline stage, first stage first (\"3,1\"); default: as even as they split. "
          "With --virtual-stages V, of each of the pp * V virtual stages.");
ABSL_FLAG(int32_t, virtual_stages, 1,
          "train: interleaved 1F1B (Megatron-LM's virtual pipeline stages): each of the --pp ranks holds V model "
          "chunks (virtual stages r, pp + r, ...), and the bubble falls from (pp - 1) / m to (pp - 1) / (V m) of the "
          "compute (of a step: (pp - 1) / (V m + pp - 1)). Needs --pp >= 2 and --micro-batches a multiple of --pp.");
ABSL_FLAG(std::string, data, "",
          "train: the corpus: a .bin of uint16 tokens, a .npy, a Megatron dataset (PREFIX), a .jsonl of "
          "{\"text\": ...} documents, or UTF-8 text (paragraphs tokenized by the model directory's tokenizer; "
          "byte-level when it has none); for an image classifier (ViT) the images, floats [N, channels, height, "
          "width] as .npy, with --labels; for an encoder-decoder (T5) the inputs, token ids [N, input_len] as .npy, "
          "with --labels.");
ABSL_FLAG(std::string, labels, "",
          "train, forward: an image classifier's integer labels as .npy, one per image ([N] for train's --data, "
          "[batch] for forward's --pixel-values; -100: none); the loss is their cross-entropy. forward: a masked "
          "language model's (BERT's) labels, integers shaped as --input (the token each position predicts, -100 "
          "where it predicts none); the loss is their cross-entropy, and without them there is none. train: an "
          "encoder-decoder's (T5's) targets, token ids [N, target_len] as .npy, one row per input of --data (-100: "
          "none, e.g. after a target's end); the decoder reads them shifted right.");
ABSL_FLAG(std::string, eval_data, "",
          "train: held-out data to evaluate on, read as --data is (its --data-format; an image classifier's or "
          "encoder-decoder's with --eval-labels).");
ABSL_FLAG(std::string, eval_labels, "", "train: the labels (targets) of --eval-data, as --labels are of --data.");
ABSL_FLAG(double, eval_split, 0,
          "train: hold out this fraction (0 < F < 1) of --data to evaluate on: its trailing documents (a corpus "
          "without documents: its trailing tokens; examples: its trailing rows); training never reads them.");
ABSL_FLAG(int64_t, eval_every, 0, "train: evaluate after every K steps and after the last (0: after the last only).");
ABSL_FLAG(int64_t, eval_steps, 0,
          "train: batches of --batch-size an evaluation reads, the same each time (0: the held-out data once, at "
          "most 100).");
ABSL_FLAG(bool, eval_only, false,
          "train: evaluate the model (or --resume's newest checkpoint) on the held-out data once and train "
          "nothing.");
ABSL_FLAG(std::string, data_format, "auto",
          "train, tokenize: auto, uint16, uint32, npy, text, jsonl or megatron (PREFIX.bin + PREFIX.idx, "
          "Megatron-LM's indexed dataset; auto picks it for a .bin with an .idx beside it).");
ABSL_FLAG(int64_t, steps, 10, "train: optimizer steps.");
ABSL_FLAG(int64_t, batch_size, 8, "train: sequences per step over all dp replicas (per pass with --grad-accum: a step reads batch-size x grad-accum).");
ABSL_FLAG(int64_t, seq_len, 64, "train: tokens per sequence.");
ABSL_FLAG(int64_t, micro_batches, 1,
          "train: each pass's per-replica rows in this many micro-batches (with --pp: the 1F1B schedule's).");
ABSL_FLAG(int64_t, grad_accum, 1,
          "train: gradient accumulation: this many passes of --batch-size sequences before each optimizer step, "
          "as one step on batch-size x grad-accum sequences (dp gradients reduced once a step).");
ABSL_FLAG(double, lr, 1e-3, "train: peak learning rate.");
ABSL_FLAG(double, min_lr, -1, "train: the cosine schedule's floor, >= 0 (-1, the default: lr / 10).");
ABSL_FLAG(int64_t, warmup_steps, 0, "train: linear warm-up steps.");
ABSL_FLAG(std::string, optimizer, "adamw", "train: adamw or sgd.");
ABSL_FLAG(double, weight_decay, 0.0, "train: AdamW's decoupled weight decay (SGD: L2 on the gradient).");
ABSL_FLAG(double, momentum, 0.9, "train: SGD momentum.");
ABSL_FLAG(double, clip_norm, 1.0, "train: clip the global gradient norm to this (0: no clipping).");
ABSL_FLAG(uint64_t, seed, 1,
          "train: the data sampler's seed; init-model: the weights'; tensor create, tensor demo: the N(0,1) "
          "values'.");
ABSL_FLAG(std::string, precision, "auto",
          "train: auto (fp32 on CPUs, bf16 on CUDA devices), fp32, or bf16 or fp16 mixed precision "
          "(parameters and compute in 16 bits, f32 master weights and optimizer state). fp16 scales its loss "
          "(--loss-scale); bf16 needs no scaling.");
// A string, so that leaving it out (GradScaler's 65536) is told from any
// scale given.
ABSL_FLAG(std::string, loss_scale, "",
          "train, submit: fp16's loss scale to start at, a power of two in [1, 2^24] (default 65536). A step "
          "whose gradients overflow updates nothing and halves it; --loss-scale-window steps in a row that do "
          "not double it. A resume goes on from its checkpoint's.");
ABSL_FLAG(int64_t, loss_scale_window, 0,
          "train, submit: fp16: steps in a row without overflow after which the loss scale doubles (default "
          "2000).");
ABSL_FLAG(bool, allow_tf32, false,
          "train: on CUDA devices, f32 GEMMs may round their operands to TF32 and run on tensor cores (CPUs "
          "compute in f32 either way).");
ABSL_FLAG(double, bucket_mb, 25, "train: MiB of gradients per dp all-reduce bucket.");
ABSL_FLAG(std::string, recompute, "none",
          "train: activation recomputation: none, full (keep each transformer block's input only and run the "
          "block again in the backward) or selective (keep all but attention's [S, S] probabilities). The "
          "losses are the plain run's. Not for encoder-decoders (T5).");
ABSL_FLAG(int32_t, zero, 0,
          "train: ZeRO over the dp replicas: 0 (none), 1 (each replica keeps and updates 1/dp of the optimizer "
          "state; the updated weights are all-gathered) or 2 (and keeps 1/dp of the reduced gradients). Losses "
          "are the plain run's; checkpoints resume at any --dp and --zero.");
ABSL_FLAG(std::string, save, "", "train: write a training checkpoint here every --save-every steps and at the end.");
ABSL_FLAG(int64_t, save_every, 0, "train: steps between checkpoints (with --save).");
// A string, so that leaving it out (keep all) is told from any number given.
ABSL_FLAG(std::string, keep_last, "",
          "train, submit: keep the newest K checkpoints of --save (K >= 1) and remove older ones after each save "
          "(default: keep all).");
// A string, so that leaving it out (not a masked language model) is told
// from any id given.
ABSL_FLAG(std::string, mask_token_id, "",
          "train, submit: a masked language model's (BERT's) [MASK] id: 103 in bert-base-uncased's vocab.txt. "
          "Required for one, which sees every position and so trains to predict masked tokens (15 % of each "
          "window's), not the next one.");
ABSL_FLAG(bool, keep_best, false,
          "train, submit: also keep the checkpoint of the lowest held-out loss (needs --eval-every dividing "
          "--save-every).");
ABSL_FLAG(std::string, resume, "",
          "train: continue from the newest complete checkpoint in this directory (a --save directory), or from "
          "this checkpoint (DIR/step-N, e.g. the best one `coloctl checkpoints` lists).");
ABSL_FLAG(int64_t, stop_after, 0, "train: stop after this step (a time-boxed run to --resume later).");
ABSL_FLAG(std::string, final, "", "train: write the trained model here as a Hugging Face directory.");
ABSL_FLAG(
    std::string, final_dtype, "auto",
    "train: the dtype of --final's model: auto (each tensor in the dtype it trained in: bf16 after a bf16 run), "
    "f32 (for readers without bf16, such as numpy; after a bf16 run the optimizer's f32 master weights, of "
    "which its bf16 weights are the rounding), bf16 or f16 (an fp32 run's weights, or a mixed-precision run's f32 "
    "master weights, rounded once; f16 fails the write where a weight passes 65504).");
ABSL_FLAG(std::string, dtype, "auto",
          "consolidate: the model's dtype: auto (each tensor in the dtype its parameters were saved in: a bf16 "
          "run's model is bf16), f32, bf16 or f16 (of a mixed-precision run's training checkpoint: its f32 master "
          "weights, rounded once).");
ABSL_FLAG(std::string, device, "cpu",
          "forward, train without --coordinator: cpu (an embedded cluster of worker processes over Gloo) or cuda "
          "(rank r on this machine's CUDA device r, over NCCL); on a cluster (--coordinator) the workers' devices "
          "decide, and cuda is refused; "
          "plan: the workers the job is planned for (cuda: the fused attention); "
          "local: the workers' device (cuda: worker i on CUDA device i, a process each).");
ABSL_FLAG(std::string, name, "", "forward, submit, train: the job's name (default: the model directory's name).");
ABSL_FLAG(int32_t, max_restarts, -1,
          "submit, train on a cluster: restarts after a failure (a lost worker, a failed rank) before the job "
          "fails; each restart resumes from the newest checkpoint (set --save-every). Default (-1): the "
          "coordinator's default, 3.");
ABSL_FLAG(absl::Duration, restart_wait, absl::ZeroDuration(),
          "submit, train on a cluster: how long a restarting job waits for enough workers before it fails (0: 5m).");
ABSL_FLAG(absl::Duration, comm_timeout, absl::Seconds(60),
          "forward, train with --device cuda: how long a rendezvous or collective may take; a rank that stops "
          "taking part fails the run with DEADLINE_EXCEEDED after it. On a cluster (--coordinator) each worker's "
          "own --comm-timeout decides, and this one is refused.");

// The flags of the commands that coloctl-run runs in its process: coloctl
// knows them too, so that it parses such a command line before it hands it
// over.
ABSL_FLAG(std::string, input, "",
          "forward: int64 (or int32/uint16/uint32) token ids [batch, seq] as .npy; tokenize: the text or .jsonl.");
ABSL_FLAG(std::string, pixel_values, "",
          "forward: an image classifier's (ViT) float pixel values [batch, channels, height, width] as .npy, in "
          "place of --input.");
ABSL_FLAG(std::string, decoder_input, "",
          "forward: an encoder-decoder's (T5's) decoder input ids [batch, seq] as .npy, beside --input.");
ABSL_FLAG(std::string, logits, "",
          "forward: where to write the f32 logits [batch, seq, vocab] (an image classifier's [batch, num_labels]) "
          "as .npy.");
ABSL_FLAG(std::string, checkpoint, "", "consolidate: the sharded checkpoint directory.");
ABSL_FLAG(std::string, model_type, "gpt2", "init-model: the model family (gpt2).");
ABSL_FLAG(int64_t, vocab_size, 257, "init-model: vocabulary size (257: byte-level text).");
ABSL_FLAG(int64_t, hidden_size, 64, "init-model: hidden size (n_embd).");
ABSL_FLAG(int64_t, layers, 2, "init-model: transformer blocks (n_layer).");
ABSL_FLAG(int64_t, heads, 4, "init-model: attention heads (n_head).");
ABSL_FLAG(int64_t, positions, 64, "init-model: maximum sequence length (n_positions).");

namespace colod::cli {
namespace {

absl::StatusOr<v1::TensorParallelMode> ParseMode(const std::string& mode) {
  if (mode == "1d") return v1::TENSOR_PARALLEL_MODE_1D;
  if (mode == "2d") return v1::TENSOR_PARALLEL_MODE_2D;
  if (mode == "2.5d") return v1::TENSOR_PARALLEL_MODE_2P5D;
  if (mode == "3d") return v1::TENSOR_PARALLEL_MODE_3D;
  return absl::InvalidArgumentError(absl::StrCat("--mode: '", mode, "' is not one of 1d, 2d, 2.5d, 3d"));
}

// A flag that a 32-bit field of the spec carries.
absl::StatusOr<int32_t> Int32Flag(const char* name, int64_t value) {
  if (value < 1 || value > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrCat(name, " must be between 1 and ", std::numeric_limits<int32_t>::max(),
                                                   ", got ", value));
  }
  return static_cast<int32_t>(value);
}

}  // namespace

absl::StatusOr<v1::ShardConfig> ShardFromFlags() {
  ASSIGN_OR_RETURN(const v1::TensorParallelMode mode, ParseMode(absl::GetFlag(FLAGS_mode)));
  v1::ShardConfig shard;
  shard.set_tensor_parallel_size(absl::GetFlag(FLAGS_tp));
  shard.set_data_parallel_size(absl::GetFlag(FLAGS_dp));
  shard.set_tensor_parallel_mode(mode);
  shard.set_depth(absl::GetFlag(FLAGS_depth));
  shard.set_sequence_parallel(absl::GetFlag(FLAGS_sequence_parallel));
  if (absl::GetFlag(FLAGS_pp) < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--pp must be >= 1, got ", absl::GetFlag(FLAGS_pp)));
  }
  shard.set_pipeline_parallel_size(absl::GetFlag(FLAGS_pp));
  if (absl::GetFlag(FLAGS_virtual_stages) < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--virtual-stages must be >= 1, got ", absl::GetFlag(FLAGS_virtual_stages)));
  }
  if (absl::GetFlag(FLAGS_virtual_stages) > 1) shard.set_virtual_stages(absl::GetFlag(FLAGS_virtual_stages));
  const std::string layers = absl::GetFlag(FLAGS_pp_layers);
  if (!layers.empty()) {
    for (absl::string_view part : absl::StrSplit(layers, ',')) {
      int32_t n = 0;
      if (!absl::SimpleAtoi(part, &n) || n < 1) {
        return absl::InvalidArgumentError(
            absl::StrCat("--pp-layers: '", layers, "' is not a comma-separated list of layer counts >= 1"));
      }
      shard.add_pipeline_stage_layers(n);
    }
  }
  return shard;
}

absl::StatusOr<bool> CudaFromFlags() {
  const std::string device = absl::GetFlag(FLAGS_device);
  if (device == "cpu") return false;
  if (device == "cuda") return true;
  return absl::InvalidArgumentError(absl::StrCat("--device: '", device, "' is not one of cpu, cuda"));
}

absl::StatusOr<absl::Duration> CommTimeoutFromFlags() {
  const absl::Duration t = absl::GetFlag(FLAGS_comm_timeout);
  if (t <= absl::ZeroDuration()) return absl::InvalidArgumentError("--comm-timeout must be positive");
  return t;
}

absl::StatusOr<v1::JobSpec> TrainSpecFromFlags(bool require_data) {
  if (absl::GetFlag(FLAGS_model).empty()) return absl::InvalidArgumentError("--model is required");
  if (absl::GetFlag(FLAGS_data).empty() && require_data) return absl::InvalidArgumentError("--data is required");
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_TRAIN);
  ASSIGN_OR_RETURN(*spec.mutable_shard(), ShardFromFlags());
  RETURN_IF_ERROR(CudaFromFlags().status());
  RETURN_IF_ERROR(CommTimeoutFromFlags().status());
  v1::TrainConfig& t = *spec.mutable_train();
  t.set_data_path(absl::GetFlag(FLAGS_data));
  t.set_labels_path(absl::GetFlag(FLAGS_labels));
  const std::string format = absl::GetFlag(FLAGS_data_format);
  if (absl::Status known = CheckDataFormat(format); !known.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--data-format: ", known.message()));
  }
  t.set_data_format(format);
  const std::string optimizer = absl::GetFlag(FLAGS_optimizer);
  if (optimizer == "adamw") {
    t.set_optimizer(v1::OPTIMIZER_ADAMW);
  } else if (optimizer == "sgd") {
    t.set_optimizer(v1::OPTIMIZER_SGD);
  } else {
    return absl::InvalidArgumentError(absl::StrCat("--optimizer: '", optimizer, "' is not one of adamw, sgd"));
  }
  t.set_weight_decay(absl::GetFlag(FLAGS_weight_decay));
  t.set_momentum(absl::GetFlag(FLAGS_momentum));
  t.set_steps(absl::GetFlag(FLAGS_steps));
  ASSIGN_OR_RETURN(const int32_t batch_size, Int32Flag("--batch-size", absl::GetFlag(FLAGS_batch_size)));
  ASSIGN_OR_RETURN(const int32_t seq_len, Int32Flag("--seq-len", absl::GetFlag(FLAGS_seq_len)));
  ASSIGN_OR_RETURN(const int32_t micro_batches, Int32Flag("--micro-batches", absl::GetFlag(FLAGS_micro_batches)));
  t.set_batch_size(batch_size);
  t.set_seq_len(seq_len);
  t.set_micro_batches(micro_batches);
  const int64_t grad_accum = absl::GetFlag(FLAGS_grad_accum);
  if (grad_accum < 1 || grad_accum > kMaxGradAccum) {
    return absl::InvalidArgumentError(
        absl::StrCat("--grad-accum: ", grad_accum, " is not in [1, ", kMaxGradAccum, "]"));
  }
  t.set_grad_accum(static_cast<int32_t>(grad_accum));
  const double lr = absl::GetFlag(FLAGS_lr);
  t.set_learning_rate(lr);
  const double min_lr = absl::GetFlag(FLAGS_min_lr);
  if (min_lr != -1 && !(min_lr >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("--min-lr: ", min_lr, " is not >= 0 (or -1: lr / 10)"));
  }
  t.set_min_learning_rate(min_lr == -1 ? lr / 10 : min_lr);
  t.set_warmup_steps(absl::GetFlag(FLAGS_warmup_steps));
  t.set_grad_clip_norm(absl::GetFlag(FLAGS_clip_norm));
  t.set_seed(absl::GetFlag(FLAGS_seed));
  t.set_final_dir(absl::GetFlag(FLAGS_final));
  const std::string final_dtype = absl::GetFlag(FLAGS_final_dtype);
  if (absl::Status s = CheckModelDType(final_dtype); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--final-dtype: ", s.message()));
  }
  if (final_dtype != "auto") t.set_final_dtype(final_dtype);
  const double bucket_mb = absl::GetFlag(FLAGS_bucket_mb);
  if (!(bucket_mb * (1 << 20) >= 1) || bucket_mb > 1 << 20) {
    return absl::InvalidArgumentError("--bucket-mb must be at least a byte (1e-6) and at most 1 TiB (1048576)");
  }
  t.set_bucket_bytes(static_cast<int64_t>(bucket_mb * (1 << 20)));
  const int32_t zero = absl::GetFlag(FLAGS_zero);
  if (zero < 0 || zero > 2) return absl::InvalidArgumentError(absl::StrCat("--zero: ", zero, " is not one of 0, 1, 2"));
  t.set_zero_stage(zero);
  const std::string recompute = absl::GetFlag(FLAGS_recompute);
  if (recompute == "none") {
    t.set_recompute(v1::RECOMPUTE_NONE);
  } else if (recompute == "full") {
    t.set_recompute(v1::RECOMPUTE_FULL);
  } else if (recompute == "selective") {
    t.set_recompute(v1::RECOMPUTE_SELECTIVE);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--recompute: '", recompute, "' is not one of none, full, selective"));
  }
  const std::string precision = absl::GetFlag(FLAGS_precision);
  if (precision == "auto") {
    t.set_precision(v1::PRECISION_UNSPECIFIED);
  } else if (precision == "bf16") {
    t.set_precision(v1::PRECISION_BF16_MIXED);
  } else if (precision == "fp16") {
    t.set_precision(v1::PRECISION_FP16_MIXED);
  } else if (precision == "fp32") {
    t.set_precision(v1::PRECISION_FP32);
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--precision: '", precision, "' is not one of auto, fp32, bf16, fp16"));
  }
  t.set_allow_tf32(absl::GetFlag(FLAGS_allow_tf32));
  if (const std::string scale = absl::GetFlag(FLAGS_loss_scale); !scale.empty()) {
    double value = 0;
    if (!absl::SimpleAtod(scale, &value)) {
      return absl::InvalidArgumentError(absl::StrCat("--loss-scale: '", scale, "' is not a number"));
    }
    t.set_loss_scale(value);  // (ValidateJobSpec checks it, and the precision)
  }
  t.set_loss_scale_window(absl::GetFlag(FLAGS_loss_scale_window));
  t.set_checkpoint_dir(absl::GetFlag(FLAGS_save));
  t.set_checkpoint_every(absl::GetFlag(FLAGS_save_every));
  t.set_resume_from(absl::GetFlag(FLAGS_resume));
  t.set_stop_after(absl::GetFlag(FLAGS_stop_after));
  t.set_eval_data_path(absl::GetFlag(FLAGS_eval_data));
  t.set_eval_labels_path(absl::GetFlag(FLAGS_eval_labels));
  t.set_eval_split(absl::GetFlag(FLAGS_eval_split));
  t.set_eval_every(absl::GetFlag(FLAGS_eval_every));
  t.set_eval_steps(absl::GetFlag(FLAGS_eval_steps));
  t.set_eval_only(absl::GetFlag(FLAGS_eval_only));
  const bool evaluates = !t.eval_data_path().empty() || t.eval_split() != 0;
  if (!t.eval_data_path().empty() && t.eval_split() != 0) {
    return absl::InvalidArgumentError("--eval-data and --eval-split: give one, not both");
  }
  if (t.eval_split() != 0 && !(t.eval_split() > 0 && t.eval_split() < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--eval-split: ", t.eval_split(), " is not in (0, 1)"));
  }
  if (t.eval_every() < 0) return absl::InvalidArgumentError("--eval-every must be >= 0 (0: after the last step)");
  if (t.eval_steps() < 0 || t.eval_steps() > kMaxEvalSteps) {
    return absl::InvalidArgumentError(absl::StrCat("--eval-steps must be in [0, ", kMaxEvalSteps, "]"));
  }
  if (!evaluates && (t.eval_every() != 0 || t.eval_steps() != 0 || t.eval_only() || !t.eval_labels_path().empty())) {
    return absl::InvalidArgumentError(
        "--eval-every, --eval-steps, --eval-only and --eval-labels need held-out data: --eval-split or --eval-data");
  }
  const std::string keep_text = absl::GetFlag(FLAGS_keep_last);
  int32_t keep_last = 0;  // all
  if (!keep_text.empty() && (!absl::SimpleAtoi(keep_text, &keep_last) || keep_last < 1)) {
    return absl::InvalidArgumentError(absl::StrCat("--keep-last: '", keep_text, "' is not a count of checkpoints in [1, ",
                                                   std::numeric_limits<int32_t>::max(),
                                                   "] (leave it out to keep all)"));
  }
  t.set_keep_last(keep_last);
  t.set_keep_best(absl::GetFlag(FLAGS_keep_best));
  if (const std::string mask = absl::GetFlag(FLAGS_mask_token_id); !mask.empty()) {
    int64_t id = 0;
    if (!absl::SimpleAtoi(mask, &id) || id < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--mask-token-id: '", mask, "' is not a token id (>= 0)"));
    }
    t.set_mask_token_id(id);
  }
  if ((t.keep_last() > 0 || t.keep_best()) && t.checkpoint_dir().empty()) {
    return absl::InvalidArgumentError("--keep-last and --keep-best prune the checkpoints of --save: give --save DIR");
  }
  if (t.keep_best() && (t.eval_every() < 1 || t.checkpoint_every() % t.eval_every() != 0)) {
    return absl::InvalidArgumentError(
        "--keep-best keeps the checkpoint of the lowest held-out loss: give --eval-split or --eval-data and an "
        "--eval-every that divides --save-every");
  }
  // (--stop-after N before the last step saves step N: --save alone then.)
  if (!t.checkpoint_dir().empty() && t.checkpoint_every() < 1 && !(t.stop_after() > 0 && t.stop_after() < t.steps())) {
    return absl::InvalidArgumentError("--save needs --save-every K (K >= 1), or --stop-after N before the last step");
  }
  return spec;
}

absl::Status RefuseCommTimeoutOnWorkers(const std::set<std::string>& given) {
  // With --device cuda on a cluster, that flag's own error says what to do.
  if (given.count("comm_timeout") == 0 || CudaFromFlags().value_or(false)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      "--comm-timeout applies to a run on this machine's GPUs (--device cuda) only: on worker daemons each worker's "
      "own --comm-timeout decides; drop it");
}

absl::StatusOr<v1::JobSpec> TrainJobSpecFromFlags() {
  ASSIGN_OR_RETURN(v1::JobSpec spec, TrainSpecFromFlags());
  if (*CudaFromFlags()) {
    return absl::InvalidArgumentError(
        "--device: on a cluster (--coordinator, or $COLOD_COORDINATOR) the workers' devices decide (CUDA workers "
        "run CUDA ranks); drop --device, or unset $COLOD_COORDINATOR to run on this machine's GPUs");
  }
  if (absl::Status set = SetModelFromDir(absl::GetFlag(FLAGS_model), spec); !set.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--model: ", set.message()));
  }
  v1::TrainConfig& t = *spec.mutable_train();
  for (std::string* path : {t.mutable_data_path(), t.mutable_labels_path(), t.mutable_final_dir(),
                            t.mutable_checkpoint_dir(), t.mutable_resume_from(), t.mutable_eval_data_path(),
                            t.mutable_eval_labels_path()}) {
    if (!path->empty()) *path = Absolute(*path);
  }
  const int32_t max_restarts = absl::GetFlag(FLAGS_max_restarts);
  if (max_restarts < -1) return absl::InvalidArgumentError("--max-restarts must be >= 0 (or -1: the default)");
  if (max_restarts >= 0) spec.mutable_restart()->set_max_restarts(max_restarts);
  const absl::Duration wait = absl::GetFlag(FLAGS_restart_wait);
  if (wait < absl::ZeroDuration()) return absl::InvalidArgumentError("--restart-wait must be >= 0");
  if (wait > absl::ZeroDuration()) *spec.mutable_restart()->mutable_worker_wait() = ToProtoDuration(wait);
  // What the coordinator would refuse (--tp 0, --steps -5, --lr nan, ...)
  // is a usage error here, before the model is uploaded.
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  if (absl::GetFlag(FLAGS_upload_timeout) <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--upload-timeout: must be > 0");
  }
  return spec;
}

absl::StatusOr<ForwardFiles> ForwardFilesFromFlags() {
  ForwardFiles f;
  f.model = absl::GetFlag(FLAGS_model);
  const std::string ids = absl::GetFlag(FLAGS_input), pixels = absl::GetFlag(FLAGS_pixel_values);
  f.labels = absl::GetFlag(FLAGS_labels);
  f.logits = absl::GetFlag(FLAGS_logits);
  f.decoder_input = absl::GetFlag(FLAGS_decoder_input);
  if (f.model.empty()) return absl::InvalidArgumentError("forward: --model is required");
  if (!ids.empty() && !pixels.empty()) {
    return absl::InvalidArgumentError("forward: give --input (token ids) or --pixel-values (images), not both");
  }
  f.images = !pixels.empty();
  f.input = f.images ? pixels : ids;
  if (f.input.empty()) {
    return absl::InvalidArgumentError("forward: --input (or --pixel-values for an image classifier) is required");
  }
  // (--labels with --input: a masked language model's; ValidateJobSpec, or
  // the run's own check, refuses them for another model.)
  return f;
}

absl::StatusOr<v1::Job> SubmitTensorJob(CoordinatorClient& client, const std::string& name,
                                        const std::string& request_id) {
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_TENSOR);
  spec.set_name(name);
  ASSIGN_OR_RETURN(*spec.mutable_shard(), ShardFromFlags());
  return client.SubmitJob(spec, request_id);
}

absl::Status UploadModelIfAsked(CoordinatorClient& client, v1::JobSpec& spec, bool json) {
  if (!absl::GetFlag(FLAGS_upload) || spec.model().weights_path().empty()) return absl::OkStatus();
  // The workers may not see this machine's files: send them along.
  const absl::Duration limit = absl::GetFlag(FLAGS_upload_timeout);
  const absl::Time start = absl::Now();
  absl::StatusOr<v1::UploadModelResponse> sent = client.UploadModel(spec.model().weights_path(), limit);
  if (absl::IsDeadlineExceeded(sent.status()) && absl::Now() - start >= limit) {
    // The upload's own limit, not an unreachable coordinator (exit 1, not
    // 69: trying again as it is ends the same way).
    return absl::DeadlineExceededError(absl::StrCat(
        "the upload of ", spec.model().weights_path(), " did not finish within --upload-timeout ",
        absl::FormatDuration(limit), " (", sent.status().message(), "): raise --upload-timeout, or give the workers ",
        "the model's directory on a file system they share and --upload=false"));
  }
  ASSIGN_OR_RETURN(const v1::UploadModelResponse uploaded, std::move(sent));
  if (!json) {
    std::fprintf(stderr, "coloctl: uploaded %d files (%lld bytes) of %s as %s%s\n", uploaded.files_size(),
                 static_cast<long long>(uploaded.bytes()), spec.model().weights_path().c_str(),
                 uploaded.upload_id().c_str(), uploaded.deduplicated() ? " (stored already: no new copy)" : "");
  }
  spec.mutable_model()->clear_weights_path();
  spec.mutable_model()->set_upload_id(uploaded.upload_id());
  return absl::OkStatus();
}

std::string Absolute(const std::string& path) {
  std::error_code ec;
  return std::filesystem::absolute(path, ec).lexically_normal().string();
}

absl::Status SetModelFromDir(const std::string& model_dir, v1::JobSpec& spec) {
  const std::string dir = Absolute(model_dir);
  auto config = ReadFileToString(dir + "/config.json");
  if (!config.ok()) return config.status();
  spec.mutable_model()->set_config_json(*config);
  spec.mutable_model()->set_weights_path(dir);
  // (`--model ./gpt2/` and `--model .` name the directory too.)
  std::filesystem::path named(dir);
  if (named.filename().empty()) named = named.parent_path();
  spec.set_name(absl::GetFlag(FLAGS_name).empty() ? named.filename().string() : absl::GetFlag(FLAGS_name));
  return absl::OkStatus();
}

}  // namespace colod::cli
