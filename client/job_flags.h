// Jobs from coloctl's flags: the layout (--tp, --dp, --mode, --depth,
// --sequence-parallel), --device, the model directory and the train flags,
// shared by `submit` and `train` (and the layout by `forward` and TENSOR jobs).
// Every error is INVALID_ARGUMENT naming the flag (a usage error) unless said
// otherwise.
#ifndef COLOD_CLIENT_JOB_FLAGS_H_
#define COLOD_CLIENT_JOB_FLAGS_H_

#include <set>
#include <string>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/coordinator_client.h"
#include "absl/time/time.h"
#include "colod/v1/job.pb.h"

ABSL_DECLARE_FLAG(std::string, model);
ABSL_DECLARE_FLAG(absl::Duration, upload_timeout);
ABSL_DECLARE_FLAG(std::string, name);
ABSL_DECLARE_FLAG(uint64_t, seed);
ABSL_DECLARE_FLAG(std::string, data_format);
ABSL_DECLARE_FLAG(std::string, labels);
ABSL_DECLARE_FLAG(std::string, precision);
ABSL_DECLARE_FLAG(std::string, data);
ABSL_DECLARE_FLAG(std::string, input);
ABSL_DECLARE_FLAG(std::string, checkpoint);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, model_type);
ABSL_DECLARE_FLAG(int64_t, vocab_size);
ABSL_DECLARE_FLAG(int64_t, hidden_size);
ABSL_DECLARE_FLAG(int64_t, layers);
ABSL_DECLARE_FLAG(int64_t, heads);
ABSL_DECLARE_FLAG(int64_t, positions);

// The flags of the commands that build jobs, for their Command::flags
// (space-separated, each ending in a space, so that they concatenate).
// The layout (ShardFromFlags) without the pipeline: forward's and plan's and
// train's; TENSOR jobs take the first four.
#define COLOD_LAYOUT_FLAGS "tp dp mode depth sequence_parallel "
#define COLOD_PIPELINE_FLAGS "pp pp_layers virtual_stages "
// TrainSpecFromFlags' own (with the layout and --model): what a run reads.
#define COLOD_TRAIN_RUN_FLAGS                                                                                  \
  "data labels data_format eval_data eval_labels eval_split eval_every eval_steps eval_only steps batch_size " \
  "seq_len micro_batches grad_accum lr min_lr warmup_steps optimizer weight_decay momentum clip_norm seed "    \
  "precision allow_tf32 bucket_mb recompute zero save save_every keep_last keep_best resume stop_after final " \
  "final_dtype mask_token_id loss_scale loss_scale_window "
// A TRAIN job's (TrainJobSpecFromFlags', --upload's, and following it):
// `submit` takes these and its own; `train` these and what a run on this
// machine's GPUs reads (--device, --comm-timeout), which a job on workers
// does not.
#define COLOD_TRAIN_JOB_FLAGS                                                                                         \
  "model name upload upload_timeout max_restarts restart_wait watch_timeout " COLOD_LAYOUT_FLAGS COLOD_PIPELINE_FLAGS \
      COLOD_TRAIN_RUN_FLAGS
#define COLOD_TRAIN_FLAGS COLOD_TRAIN_JOB_FLAGS "device comm_timeout "
// `forward`'s: ForwardFilesFromFlags', the layout, and the job's.
#define COLOD_FORWARD_FLAGS                                                                              \
  "model input pixel_values labels decoder_input logits name device comm_timeout upload upload_timeout " \
  "watch_timeout " COLOD_LAYOUT_FLAGS
// The model tools' (coloctl-run's, which coloctl hands them to).
#define COLOD_INIT_MODEL_FLAGS "out model_type vocab_size hidden_size layers heads positions seed "
#define COLOD_TOKENIZE_FLAGS "model input out data_format "
#define COLOD_CONSOLIDATE_FLAGS "checkpoint out dtype "

namespace colod::cli {

// --tp, --dp, --pp, --pp-layers, --mode, --depth, --sequence-parallel.
absl::StatusOr<v1::ShardConfig> ShardFromFlags();
// --device: false for cpu, true for cuda.
absl::StatusOr<bool> CudaFromFlags();
// --comm-timeout (INVALID_ARGUMENT unless positive).
absl::StatusOr<absl::Duration> CommTimeoutFromFlags();

// The train flags (--data, --steps, --lr, --precision, ...) and the layout
// as a TRAIN job, written directly: every enum is parsed here, once
// (--precision auto is PRECISION_UNSPECIFIED, which the ranks' devices
// decide, job.proto); paths as given; no model. A local run and the worker
// both read it with train::TrainOptionsFromSpec. `require_data` false for a
// plan, which reads no data.
absl::StatusOr<v1::JobSpec> TrainSpecFromFlags(bool require_data = true);
// A TRAIN job for the workers: TrainSpecFromFlags with the model directory's
// config.json and its absolute path as the weights, every path absolute,
// and the restart policy (--max-restarts, --restart-wait). Refuses --device
// cuda: on a cluster the workers' devices decide.
absl::StatusOr<v1::JobSpec> TrainJobSpecFromFlags();
// For a run on worker daemons (a cluster's, or an embedded one): INVALID_ARGUMENT
// where `given` (the flags on the command line, GivenFlags) holds
// --comm-timeout, which only a run on this machine's GPUs reads: each
// worker's own --comm-timeout decides there, and the flag would be ignored.
absl::Status RefuseCommTimeoutOnWorkers(const std::set<std::string>& given);
// forward's files: --model, and --input (token ids) or --pixel-values
// (images, with optional --labels), --decoder-input, --logits. A usage
// error (INVALID_ARGUMENT "forward: ...") for a missing or wrong combination.
struct ForwardFiles {
  std::string model, input, labels, decoder_input, logits;
  bool images = false;  // --pixel-values: an image classifier's input
};
absl::StatusOr<ForwardFiles> ForwardFilesFromFlags();

// With --upload (the default), streams the directory spec.model.weights_path
// names to the coordinator (--upload-timeout) and names the upload in its
// place (said on stderr unless `json`): the workers of a remote cluster may
// not see this machine's files. Nothing without a weights_path.
absl::Status UploadModelIfAsked(CoordinatorClient& client, v1::JobSpec& spec, bool json);

// Submits a TENSOR job named `name` on the layout of the flags.
absl::StatusOr<v1::Job> SubmitTensorJob(CoordinatorClient& client, const std::string& name,
                                        const std::string& request_id = "");

// `path` made absolute and normal: paths the workers open must not depend on
// coloctl's working directory.
std::string Absolute(const std::string& path);
// The model of `spec` from a Hugging Face directory: its config.json, the
// directory's absolute path as the weights, and (unless --name is given) its
// name as the job's. NOT_FOUND when config.json cannot be read.
absl::Status SetModelFromDir(const std::string& model_dir, v1::JobSpec& spec);

}  // namespace colod::cli

#endif  // COLOD_CLIENT_JOB_FLAGS_H_
