// coloctl-run: the coloctl commands that compute in this process, which is
// why they live in a binary of their own: forward and train on this
// machine's GPUs (--device cuda), init-model, tokenize and consolidate.
// coloctl hands their command lines to it (cli.h: RunInProcess), so their
// usage is coloctl's (cmd_model.cc); this file holds what they run.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli.h"
#include "client/in_process_commands.h"
#include "client/job_flags.h"
#include "colod/v1/job.pb.h"
#include "common/flags.h"
#include "common/json.h"
#include "common/model_layout.h"
#include "common/text.h"
#include "nlohmann/json.hpp"
#include "spec/job_validation.h"
#include "worker/shardformer/checkpoint.h"
#include "worker/shardformer/init_model.h"
#include "worker/shardformer/run_forward.h"
#include "worker/tensor/npy.h"
#include "worker/train/checkpoint.h"
#include "worker/train/data.h"
#include "worker/train/job_options.h"
#include "worker/train/megatron_writer.h"
#include "worker/train/tokenizer.h"
#include "worker/train/trainer.h"

namespace colod::cli {
namespace {

// --device cuda (and for train no --coordinator), as coloctl hands them over.
absl::Status CheckLocalGpus(const char* command, bool coordinator_allowed) {
  auto cuda = CudaFromFlags();
  if (!cuda.ok()) return cuda.status();
  if (!*cuda || (!coordinator_allowed && !ExplicitCoordinator().empty())) {
    return absl::InvalidArgumentError(absl::StrCat(command, ": ", kRunBinary,
                                                   " runs it on this machine's GPUs (--device cuda",
                                                   coordinator_allowed ? "" : ", no --coordinator", "); coloctl ",
                                                   command, " runs it on a cluster"));
  }
  // What only a job on workers reads: here nothing is uploaded, watched,
  // named or restarted.
  const std::set<std::string> given = GivenFlags();
  std::vector<std::string> jobs;
  for (const char* name : {"max_restarts", "name", "restart_wait", "upload", "upload_timeout", "watch_timeout"}) {
    if (given.count(name) > 0) jobs.push_back("--" + DashedName(name));
  }
  if (!jobs.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(command, " --device cuda: ", absl::StrJoin(jobs, ", "), jobs.size() == 1 ? " applies" : " apply",
                     " to a job on worker daemons only; drop ", jobs.size() == 1 ? "it" : "them"));
  }
  return absl::OkStatus();
}

// rank r on local GPU r, in this process.
int RunForwardOnGpus(const std::vector<std::string>&) {
  if (absl::Status local = CheckLocalGpus("forward", /*coordinator_allowed=*/true); !local.ok()) {
    return Usage(std::string(local.message()));
  }
  auto files = ForwardFilesFromFlags();
  if (!files.ok()) return Usage(std::string(files.status().message()));
  shardformer::ForwardRequest request;
  request.model_dir = files->model;
  request.cuda = true;
  auto shard = ShardFromFlags();
  if (!shard.ok()) return Usage(std::string(shard.status().message()));
  request.shard.layout = *shard;
  auto timeout = CommTimeoutFromFlags();
  if (!timeout.ok()) return Usage(std::string(timeout.status().message()));
  request.comm_timeout = *timeout;
  request.gather_logits = !files->logits.empty();
  // A command line may name a pipe (a shell's <(...)).
  auto read = ReadNpy(files->input, NpySource::kRegularFileOrPipe);
  if (!read.ok()) return Fail(read.status());
  request.input = *read;
  if (!files->labels.empty()) {
    auto labels = ReadNpy(files->labels, NpySource::kRegularFileOrPipe);
    if (!labels.ok()) return Fail(labels.status());
    request.labels = *labels;
  }
  if (!files->decoder_input.empty()) {
    auto decoder = ReadNpy(files->decoder_input, NpySource::kRegularFileOrPipe);
    if (!decoder.ok()) return Fail(decoder.status());
    request.decoder_input = *decoder;
  }
  auto run = shardformer::RunForward(request);
  if (!run.ok()) return Fail(run.status());
  if (!files->logits.empty()) {
    absl::StatusOr<std::string> npy = SerializeNpy(run->logits);
    const absl::Status written = npy.ok() ? WriteOutputFile(files->logits, *npy) : npy.status();
    if (!written.ok()) return Fail(written);
  }
  v1::ForwardResult result;
  result.set_loss(run->loss);
  result.set_tokens(run->tokens);
  for (int64_t d : run->logits_shape) result.add_logits_shape(d);
  shardformer::SetUnreadTensors(run->unread_tensors, result);
  return PrintForwardResult(result, files->images, !files->labels.empty(), files->logits, JsonOutput());
}

// rank r on local GPU r over NCCL, as threads of this process; the spec is
// read as a worker reads it (train::TrainOptionsFromSpec).
int RunTrainOnGpus(const std::vector<std::string>&) {
  if (absl::Status local = CheckLocalGpus("train", /*coordinator_allowed=*/false); !local.ok()) {
    return Usage(std::string(local.message()));
  }
  auto spec = TrainSpecFromFlags();
  if (!spec.ok()) return Usage(absl::StrCat("train: ", spec.status().message()));
  {
    // What a coordinator refuses is refused here too (a NaN learning rate,
    // a min_learning_rate above it, --save-every without --save, ...).
    v1::JobSpec checked = *spec;
    if (absl::Status set = SetModelFromDir(absl::GetFlag(FLAGS_model), checked); !set.ok()) {
      return Usage(absl::StrCat("train: --model: ", set.message()));
    }
    if (absl::Status valid = ValidateJobSpec(checked); !valid.ok()) {
      return Usage(absl::StrCat("train: ", valid.message()));
    }
  }
  auto options = train::TrainOptionsFromSpec(*spec, absl::GetFlag(FLAGS_model), /*cuda=*/true);
  if (!options.ok()) return Usage(absl::StrCat("train: ", options.status().message()));
  options->comm_timeout = *CommTimeoutFromFlags();
  const train::TrainOptions& o = *options;
  const bool json = JsonOutput();
  std::string checkpoint;  // the newest one the run saved
  const absl::Status s = train::Train(
      o,
      [&](const train::StepStats& st) {
        if (!st.checkpoint.empty()) checkpoint = st.checkpoint;
        PrintStep(train::StepProgressOf(st), o.steps, json);
      },
      [](const train::RankStart& start) {
        if (start.unread_tensors.empty()) return;
        std::fprintf(stderr, "coloctl: warning: %s\n", UnreadTensorsNote(start.unread_tensors).c_str());
      });
  if (!s.ok()) return Fail(s);
  if (!json) PrintRunEnd(o.final_dir, checkpoint, o.steps, o.stop_after);
  return 0;
}

// A model in `out` (or the shards of one) is not written over: new weights
// beside an old index would load as neither. Usage's exit status naming
// the file found there, or nullopt.
std::optional<int> RefuseAModelThere(absl::string_view command, const std::string& out) {
  if (const std::optional<std::string> name = ModelFileIn(out)) {
    return Usage(absl::StrCat(command, ": --out ", out, " already holds a model (", *name,
                              "): give a new or empty directory"));
  }
  return std::nullopt;
}

int RunInitModel(const std::vector<std::string>&) {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return Usage("init-model: --out is required");
  if (absl::GetFlag(FLAGS_model_type) != "gpt2") {
    return Usage(
        absl::StrCat("init-model: --model-type '", absl::GetFlag(FLAGS_model_type), "' is not supported (gpt2)"));
  }
  if (std::optional<int> refused = RefuseAModelThere("init-model", out)) return *refused;
  for (const auto& [flag, value] : std::vector<std::pair<const char*, int64_t>>{
           {"--vocab-size", absl::GetFlag(FLAGS_vocab_size)}, {"--hidden-size", absl::GetFlag(FLAGS_hidden_size)},
           {"--layers", absl::GetFlag(FLAGS_layers)}, {"--heads", absl::GetFlag(FLAGS_heads)},
           {"--positions", absl::GetFlag(FLAGS_positions)}}) {
    if (value < 1) return Usage(absl::StrCat("init-model: ", flag, " must be >= 1, got ", value));
  }
  if (absl::GetFlag(FLAGS_hidden_size) % absl::GetFlag(FLAGS_heads) != 0) {
    return Usage(absl::StrCat("init-model: --hidden-size ", absl::GetFlag(FLAGS_hidden_size),
                              " is not divisible by --heads ", absl::GetFlag(FLAGS_heads)));
  }
  shardformer::Gpt2Shape shape;
  shape.vocab_size = absl::GetFlag(FLAGS_vocab_size);
  shape.hidden_size = absl::GetFlag(FLAGS_hidden_size);
  shape.num_layers = absl::GetFlag(FLAGS_layers);
  shape.num_heads = absl::GetFlag(FLAGS_heads);
  shape.max_positions = absl::GetFlag(FLAGS_positions);
  const absl::Status s = shardformer::WriteInitializedGpt2(out, shape, absl::GetFlag(FLAGS_seed));
  if (!s.ok()) return Fail(s);
  std::printf("wrote a GPT-2 (vocab %lld, n_embd %lld, n_layer %lld, n_head %lld, n_positions %lld) to %s\n",
              static_cast<long long>(shape.vocab_size), static_cast<long long>(shape.hidden_size),
              static_cast<long long>(shape.num_layers), static_cast<long long>(shape.num_heads),
              static_cast<long long>(shape.max_positions), out.c_str());
  return 0;
}

int RunConsolidate(const std::vector<std::string>&) {
  const std::string checkpoint = absl::GetFlag(FLAGS_checkpoint), out = absl::GetFlag(FLAGS_out);
  if (checkpoint.empty()) return Usage("consolidate: --checkpoint is required");
  if (out.empty()) return Usage("consolidate: --out is required");
  // `train --save`'s directory (what --resume takes) holds checkpoints, one
  // a step: name the one to consolidate.
  if (struct stat st; ::stat((checkpoint + "/colod_checkpoint.json").c_str(), &st) != 0) {
    if (absl::StatusOr<std::string> newest = train::LatestCheckpoint(checkpoint); newest.ok()) {
      return Usage(absl::StrCat("consolidate: --checkpoint ", checkpoint, " holds training checkpoints, one a step: "
                                "give one of them, e.g. its newest, --checkpoint ", *newest,
                                " (coloctl checkpoints JOB lists a job's)"));
    }
  }
  auto dtype = shardformer::ParseModelDType(absl::GetFlag(FLAGS_dtype));
  if (!dtype.ok()) return Usage(absl::StrCat("consolidate: --dtype: ", dtype.status().message()));
  if (std::optional<int> refused = RefuseAModelThere("consolidate", out)) return *refused;
  const absl::Status s = train::ConsolidateTrainingCheckpoint(checkpoint, out, *dtype);
  if (!s.ok()) return Fail(s);
  std::printf("wrote %s/model.safetensors and %s/config.json\n", out.c_str(), out.c_str());
  return 0;
}

int RunTokenize(const std::vector<std::string>&) {
  const std::string model = absl::GetFlag(FLAGS_model), input = absl::GetFlag(FLAGS_input),
                    out = absl::GetFlag(FLAGS_out);
  if (model.empty()) return Usage("tokenize: --model is required (the directory whose tokenizer encodes the text)");
  if (input.empty()) return Usage("tokenize: --input is required");
  if (out.empty()) return Usage("tokenize: --out PREFIX is required");
  auto format = train::ParseDataFormat(absl::GetFlag(FLAGS_data_format));
  if (!format.ok()) return Usage(absl::StrCat("tokenize: ", format.status().message()));
  *format = train::ResolveDataFormat(input, *format);
  if (!train::IsTextFormat(*format)) {
    return Usage(absl::StrCat("tokenize: ", input, " is not text or jsonl (--data-format text or jsonl)"));
  }
  auto tokenizer = train::LoadTokenizer(model);
  if (struct stat st; absl::IsNotFound(tokenizer.status()) && ::stat(model.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return Fail(absl::NotFoundError(absl::StrCat(tokenizer.status().message(), ": nothing to tokenize with (train "
                                                 "--data FILE reads text as bytes for a model without one)")));
  }
  if (!tokenizer.ok()) return Fail(tokenizer.status());
  auto writer = train::MegatronWriter::Create(out, (*tokenizer)->vocab_size());
  if (!writer.ok()) return Fail(writer.status());
  const absl::Status s = train::ForEachTextDocument(
      input, *format, /*paragraphs=*/true, [&](absl::string_view doc, const std::string& where) -> absl::Status {
        absl::StatusOr<std::vector<int64_t>> ids = (*tokenizer)->EncodeDocument(doc);
        if (!ids.ok()) return absl::Status(ids.status().code(), absl::StrCat(where, ": ", ids.status().message()));
        return (*writer)->AddDocument(*ids);
      });
  if (!s.ok()) return Fail(s);
  if ((*writer)->documents() == 0) return Fail(absl::InvalidArgumentError(absl::StrCat(input, " holds no document")));
  if (const absl::Status f = (*writer)->Finish(); !f.ok()) return Fail(f);
  if (JsonOutput()) {
    nlohmann::json j = {{"bin", out + ".bin"},
                        {"idx", out + ".idx"},
                        {"documents", (*writer)->documents()},
                        {"tokens", (*writer)->tokens()},
                        {"dtype", (*writer)->dtype_name()},
                        {"tokenizer", (*tokenizer)->kind()},
                        {"vocab_size", (*tokenizer)->vocab_size()}};
    std::printf("%s\n", JsonText(j).c_str());
  } else {
    std::printf("wrote %s.bin and %s.idx: %lld documents, %lld tokens (%s), %s tokenizer of %s\n", out.c_str(),
                out.c_str(), static_cast<long long>((*writer)->documents()),
                static_cast<long long>((*writer)->tokens()), (*writer)->dtype_name(), (*tokenizer)->kind().c_str(),
                model.c_str());
  }
  return 0;
}

// The usage of each is coloctl's (cmd_model.cc).
constexpr Command kCommands[] = {
    {"forward", "", COLOD_FORWARD_FLAGS, "  forward     --device cuda: on this machine's GPUs, rank r on GPU r.\n",
     RunForwardOnGpus},
    {"train", "", COLOD_TRAIN_FLAGS, "  train       --device cuda: on this machine's GPUs, rank r on GPU r.\n",
     RunTrainOnGpus},
    {"init-model", "", COLOD_INIT_MODEL_FLAGS, "  init-model  Write a new GPT-2 to --out DIR.\n", RunInitModel},
    {"tokenize", "", COLOD_TOKENIZE_FLAGS, "  tokenize    Encode text into a Megatron-LM indexed dataset.\n",
     RunTokenize},
    {"consolidate", "", COLOD_CONSOLIDATE_FLAGS,
     "  consolidate Assemble a sharded checkpoint into a Hugging Face directory.\n", RunConsolidate},
};

}  // namespace

CommandGroup InProcessCommands() { return {"Commands (see coloctl --help for their flags):", kCommands}; }

}  // namespace colod::cli
