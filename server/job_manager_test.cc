#include "server/job_manager.h"

#include <algorithm>
#include <cmath>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <thread>

#include "common/atomic_file.h"
#include "common/proto_time.h"
#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "spec/job_validation.h"
#include "tests/testing/full_disk.h"

namespace colod {
namespace {

v1::JobSpec TrainSpec() {
  v1::JobSpec s;
  s.set_name("gpt2-tiny");
  s.set_kind(v1::JOB_KIND_TRAIN);
  s.mutable_model()->set_config_json(
      R"({"model_type": "gpt2", "vocab_size": 257, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64})");
  s.mutable_model()->set_weights_path("/models/gpt2-tiny");
  s.mutable_shard()->set_tensor_parallel_size(2);
  s.mutable_shard()->set_data_parallel_size(2);
  auto* t = s.mutable_train();
  t->set_steps(10);
  t->set_batch_size(8);
  t->set_seq_len(32);
  t->set_learning_rate(1e-3);
  t->set_data_path("/usr/share/common-licenses/GPL-3");
  return s;
}

// TrainSpec's model FLOPs a token at seq_len 32 (spec/plan.h): 6 (L (12 h^2 +
// 9 h) + V h) + 12 L S h, h = 64, L = 2, V = 257, S = 32.
constexpr double kTinyFlopsPerToken = 6.0 * (2 * (12 * 64 * 64 + 9 * 64) + 257 * 64) + 12.0 * 2 * 32 * 64;

void ExpectInvalid(const v1::JobSpec& spec, const std::string& field) {
  absl::Status s = ValidateJobSpec(spec);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
  EXPECT_EQ(s.message().substr(0, field.size()), field) << s;
}

TEST(ValidateJobSpec, AcceptsAWellFormedSpecInEveryMode) {
  EXPECT_TRUE(ValidateJobSpec(TrainSpec()).ok()) << ValidateJobSpec(TrainSpec());
  struct Mode {
    v1::TensorParallelMode mode;
    int tp;
    int depth;
  };
  for (Mode m : {Mode{v1::TENSOR_PARALLEL_MODE_1D, 3, 0}, Mode{v1::TENSOR_PARALLEL_MODE_2D, 4, 0},
                 Mode{v1::TENSOR_PARALLEL_MODE_2D, 9, 0}, Mode{v1::TENSOR_PARALLEL_MODE_2P5D, 8, 2},
                 Mode{v1::TENSOR_PARALLEL_MODE_3D, 8, 0}, Mode{v1::TENSOR_PARALLEL_MODE_3D, 27, 0}}) {
    v1::ShardConfig s;
    s.set_tensor_parallel_mode(m.mode);
    s.set_tensor_parallel_size(m.tp);
    s.set_data_parallel_size(2);
    s.set_depth(m.depth);
    EXPECT_TRUE(ValidateShardConfig(s, "shard").ok()) << ValidateShardConfig(s, "shard");
  }
}

TEST(ValidateJobSpec, RejectsBadFieldsByName) {
  v1::JobSpec s = TrainSpec();
  s.set_kind(v1::JOB_KIND_UNSPECIFIED);
  ExpectInvalid(s, "spec.kind");

  s = TrainSpec();
  s.mutable_shard()->set_tensor_parallel_size(0);
  ExpectInvalid(s, "spec.shard.tensor_parallel_size");

  // Text that is not UTF-8 (protobuf's parse would refuse the request, as
  // INTERNAL), named by its field, nested and in a map too.
  s = TrainSpec();
  s.mutable_train()->set_data_path("/data/\xff\xfe.bin");
  ExpectInvalid(s, "spec.train.data_path: not valid UTF-8");
  s = TrainSpec();
  (*s.mutable_labels())["team"] = "caf\xe9";
  ExpectInvalid(s, "spec.labels[0].value: not valid UTF-8");

  s = TrainSpec();
  s.mutable_shard()->set_data_parallel_size(-1);
  ExpectInvalid(s, "spec.shard.data_parallel_size");

  s = TrainSpec();
  s.mutable_shard()->set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
  s.mutable_shard()->set_tensor_parallel_size(8);
  ExpectInvalid(s, "spec.shard.tensor_parallel_size");

  s = TrainSpec();
  s.mutable_shard()->set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_3D);
  s.mutable_shard()->set_tensor_parallel_size(4);
  ExpectInvalid(s, "spec.shard.tensor_parallel_size");

  s = TrainSpec();
  s.mutable_shard()->set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2P5D);
  s.mutable_shard()->set_tensor_parallel_size(8);
  s.mutable_shard()->set_depth(0);
  ExpectInvalid(s, "spec.shard.depth");

  s = TrainSpec();
  s.mutable_shard()->set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2P5D);
  s.mutable_shard()->set_tensor_parallel_size(6);
  s.mutable_shard()->set_depth(2);
  ExpectInvalid(s, "spec.shard.tensor_parallel_size");

  s = TrainSpec();
  s.mutable_shard()->set_depth(2);
  ExpectInvalid(s, "spec.shard.depth");

  s = TrainSpec();
  s.mutable_shard()->set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
  s.mutable_shard()->set_tensor_parallel_size(4);
  s.mutable_shard()->set_sequence_parallel(true);
  ExpectInvalid(s, "spec.shard.sequence_parallel");

  s = TrainSpec();
  s.mutable_model()->set_config_json("");
  ExpectInvalid(s, "spec.model.config_json");
  s.mutable_model()->set_config_json("{not json");
  ExpectInvalid(s, "spec.model.config_json");
  s.mutable_model()->set_config_json(R"({"n_embd": 64})");
  ExpectInvalid(s, "spec.model.config_json");

  s = TrainSpec();
  s.mutable_train()->set_batch_size(6);
  s.mutable_shard()->set_data_parallel_size(4);
  ExpectInvalid(s, "spec.train.batch_size");

  // A stop before the last step keeps its steps in its checkpoint alone.
  s = TrainSpec();
  s.mutable_train()->set_steps(10);
  s.mutable_train()->set_stop_after(4);
  ExpectInvalid(s, "spec.train.checkpoint_dir");
  s.mutable_train()->set_checkpoint_dir("/tmp/ck");
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  s.mutable_train()->set_checkpoint_dir("");
  s.mutable_train()->set_stop_after(10);  // a whole run
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);

  // A micro-batch a replica must split into the layout's batch blocks: q
  // in 2d, q * depth in 2.5d, q * q in 3d (dp = 2 here).
  struct Blocks {
    v1::TensorParallelMode mode;
    int tp, depth, batch, micro_batches;
    bool ok;
  };
  for (const Blocks b : {Blocks{v1::TENSOR_PARALLEL_MODE_2D, 4, 0, 6, 1, false},   // 3 rows, 2 blocks
                         Blocks{v1::TENSOR_PARALLEL_MODE_2D, 4, 0, 8, 1, true},
                         Blocks{v1::TENSOR_PARALLEL_MODE_2D, 4, 0, 8, 4, false},   // 1 row a micro-batch
                         Blocks{v1::TENSOR_PARALLEL_MODE_2D, 4, 0, 8, 2, true},
                         Blocks{v1::TENSOR_PARALLEL_MODE_2P5D, 8, 2, 4, 1, false},  // 2 rows, 4 blocks
                         Blocks{v1::TENSOR_PARALLEL_MODE_2P5D, 8, 2, 8, 1, true},
                         Blocks{v1::TENSOR_PARALLEL_MODE_3D, 8, 0, 4, 1, false},   // 2 rows, 4 blocks
                         Blocks{v1::TENSOR_PARALLEL_MODE_3D, 8, 0, 8, 1, true}}) {
    s = TrainSpec();
    s.mutable_shard()->set_tensor_parallel_mode(b.mode);
    s.mutable_shard()->set_tensor_parallel_size(b.tp);
    s.mutable_shard()->set_depth(b.depth);
    s.mutable_train()->set_batch_size(b.batch);
    s.mutable_train()->set_micro_batches(b.micro_batches);
    const absl::Status v = ValidateJobSpec(s);
    EXPECT_EQ(v.ok(), b.ok) << b.mode << " tp " << b.tp << " batch " << b.batch << ": " << v;
    if (!b.ok) {
      EXPECT_TRUE(absl::StrContains(v.message(), "spec.train.batch_size: ")) << v;
    }
  }
  s = TrainSpec();
  s.mutable_shard()->set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_2D);
  s.mutable_shard()->set_tensor_parallel_size(4);
  s.mutable_train()->set_batch_size(6);
  ExpectInvalid(s, "spec.train.batch_size: 6 makes micro-batches of 3 sequences a replica (over data_parallel_size "
                   "2), which 2d tp 4 splits into 2 blocks: make them a multiple of 2");
  // Sequence parallelism splits each sequence over tp.
  s = TrainSpec();
  s.mutable_shard()->set_sequence_parallel(true);
  s.mutable_train()->set_seq_len(31);
  ExpectInvalid(s, "spec.train.seq_len: 31 is not divisible by tensor_parallel_size 2");
  s.mutable_train()->set_seq_len(32);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);

  s = TrainSpec();
  s.mutable_train()->set_learning_rate(0);
  ExpectInvalid(s, "spec.train.learning_rate");

  s = TrainSpec();
  s.mutable_train()->set_steps(0);
  ExpectInvalid(s, "spec.train.steps");

  s = TrainSpec();
  s.mutable_train()->set_micro_batches(3);
  ExpectInvalid(s, "spec.train.micro_batches");

  s = TrainSpec();
  s.mutable_train()->set_checkpoint_every(5);
  ExpectInvalid(s, "spec.train.checkpoint_dir");

  for (int zero : {-1, 3}) {
    s = TrainSpec();
    s.mutable_train()->set_zero_stage(zero);
    ExpectInvalid(s, "spec.train.zero_stage");
  }

  for (int accum : {-1, 65537}) {
    s = TrainSpec();
    s.mutable_train()->set_grad_accum(accum);
    ExpectInvalid(s, "spec.train.grad_accum");
  }
  s = TrainSpec();
  s.mutable_train()->set_batch_size(1 << 20);
  s.mutable_train()->set_grad_accum(1 << 12);  // 2^32 sequences a step
  ExpectInvalid(s, "spec.train.grad_accum");
  // Every micro-batch's loss is read at the step's end: at most 8,192 a step.
  s = TrainSpec();
  s.mutable_train()->set_batch_size(16384);  // 8,192 rows a replica (dp = 2)
  s.mutable_train()->set_micro_batches(8192);
  ASSERT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  s.mutable_train()->set_grad_accum(2);
  ExpectInvalid(s, "spec.train.grad_accum: grad_accum 2 x micro_batches 8192 is 16384 micro-batches a step");
  s.mutable_train()->set_grad_accum(1);
  s.mutable_train()->set_batch_size(32768);
  s.mutable_train()->set_micro_batches(16384);
  ExpectInvalid(s, "spec.train.micro_batches");

  s = TrainSpec();
  s.mutable_train()->clear_data_path();
  ExpectInvalid(s, "spec.train.data_path");

  // Held-out evaluation: a split in (0, 1), one source, settings that need
  // held-out data, labels a language model cannot take.
  for (double split : {1.0, 1.5, -0.25, std::nan("")}) {
    s = TrainSpec();
    s.mutable_train()->set_eval_split(split);
    ExpectInvalid(s, "spec.train.eval_split");
  }
  s = TrainSpec();
  s.mutable_train()->set_eval_split(0.1);
  s.mutable_train()->set_eval_data_path("/data/val.bin");
  ExpectInvalid(s, "spec.train.eval_split");
  for (const char* field : {"eval_every", "eval_steps", "eval_only"}) {
    s = TrainSpec();
    if (std::string(field) == "eval_every") s.mutable_train()->set_eval_every(10);
    if (std::string(field) == "eval_steps") s.mutable_train()->set_eval_steps(10);
    if (std::string(field) == "eval_only") s.mutable_train()->set_eval_only(true);
    ExpectInvalid(s, absl::StrCat("spec.train.", field));
  }
  for (int64_t steps : {int64_t{-1}, kMaxEvalSteps + 1}) {
    s = TrainSpec();
    s.mutable_train()->set_eval_split(0.1);
    s.mutable_train()->set_eval_steps(steps);
    ExpectInvalid(s, "spec.train.eval_steps");
  }
  s = TrainSpec();
  s.mutable_train()->set_eval_split(0.1);
  s.mutable_train()->set_eval_every(-1);
  ExpectInvalid(s, "spec.train.eval_every");
  s = TrainSpec();
  s.mutable_train()->set_eval_data_path("/data/val.bin");
  s.mutable_train()->set_eval_labels_path("/data/val_labels.npy");
  ExpectInvalid(s, "spec.train.eval_labels_path");
  s = TrainSpec();
  s.mutable_train()->set_eval_split(0.1);
  s.mutable_train()->set_eval_every(5);
  s.mutable_train()->set_eval_steps(3);
  s.mutable_train()->set_eval_only(true);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  s.mutable_train()->set_final_dir("/models/out");  // an evaluation writes no model
  ExpectInvalid(s, "spec.train.final_dir");

  // Retention: keep_last >= 0 with checkpoints to prune; keep_best with an
  // evaluation at every checkpoint.
  s = TrainSpec();
  s.mutable_train()->set_keep_last(-1);
  ExpectInvalid(s, "spec.train.keep_last");
  s = TrainSpec();
  s.mutable_train()->set_keep_last(2);
  ExpectInvalid(s, "spec.train.keep_last");
  s.mutable_train()->set_checkpoint_every(4);
  s.mutable_train()->set_checkpoint_dir("/ck");
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  s.mutable_train()->set_keep_best(true);
  ExpectInvalid(s, "spec.train.keep_best");  // nothing evaluated
  s.mutable_train()->set_eval_split(0.1);
  s.mutable_train()->set_eval_every(3);
  ExpectInvalid(s, "spec.train.keep_best");  // checkpoints 4 and 8 unevaluated
  s.mutable_train()->set_eval_every(2);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);

  // Interleaved 1F1B: V in [0, 4096] over pp >= 2 stages of at least a
  // layer each, micro-batches in groups of pp, the stage list pp * V long.
  auto interleaved = [] {
    v1::JobSpec spec = TrainSpec();
    spec.mutable_model()->set_config_json(
        R"({"model_type": "gpt2", "vocab_size": 257, "n_embd": 64, "n_layer": 4, "n_head": 4, "n_positions": 64})");
    spec.mutable_shard()->set_tensor_parallel_size(1);
    spec.mutable_shard()->set_pipeline_parallel_size(2);
    spec.mutable_shard()->set_virtual_stages(2);
    spec.mutable_train()->set_micro_batches(2);
    return spec;
  };
  s = interleaved();
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  for (int v : {-1, kMaxVirtualStages + 1}) {
    s = interleaved();
    s.mutable_shard()->set_virtual_stages(v);
    ExpectInvalid(s, "spec.shard.virtual_stages");
  }
  s = interleaved();
  s.mutable_shard()->set_pipeline_parallel_size(1);
  ExpectInvalid(s, "spec.shard.virtual_stages");
  s = interleaved();
  s.mutable_shard()->set_virtual_stages(3);  // 6 stages of 4 layers
  ExpectInvalid(s, "spec.shard");
  s = interleaved();
  for (int n : {1, 1, 2}) s.mutable_shard()->add_pipeline_stage_layers(n);
  ExpectInvalid(s, "spec.shard.pipeline_stage_layers");
  s.mutable_shard()->add_pipeline_stage_layers(1);
  ExpectInvalid(s, "spec.shard");  // 4 stages of 5 layers
  s.mutable_shard()->set_pipeline_stage_layers(2, 1);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  s = interleaved();
  s.mutable_train()->set_micro_batches(1);
  ExpectInvalid(s, "spec.train.micro_batches");
  s = interleaved();
  s.mutable_train()->set_checkpoint_every(2);
  s.mutable_train()->set_checkpoint_dir("/ck");
  s.mutable_train()->set_final_dir("/final");
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);

  // The model must load at the layout: 4 heads do not split over tp = 3.
  s = TrainSpec();
  s.mutable_shard()->set_tensor_parallel_size(3);
  s.mutable_train()->set_batch_size(6);
  ExpectInvalid(s, "spec.shard");
  s = TrainSpec();
  s.mutable_model()->set_config_json(R"({"model_type": "gpt3", "n_embd": 64})");
  ExpectInvalid(s, "spec.model.config_json");
  s = TrainSpec();
  s.mutable_model()->clear_weights_path();
  ExpectInvalid(s, "spec.model.weights_path");
  s.mutable_model()->set_upload_id("upload-000001");
  EXPECT_TRUE(ValidateJobSpec(s).ok());
  s.mutable_model()->set_weights_path("/models/x");
  ExpectInvalid(s, "spec.model.weights_path");  // not both
  s = TrainSpec();
  s.mutable_train()->set_seq_len(65);
  ExpectInvalid(s, "spec.train.seq_len");
  s = TrainSpec();
  s.mutable_train()->set_data_format("csv");
  ExpectInvalid(s, "spec.train.data_format");
  s = TrainSpec();
  s.mutable_train()->set_final_dtype("f32");
  ExpectInvalid(s, "spec.train.final_dtype: it is the dtype of final_dir's model");  // no final_dir
  s.mutable_train()->set_final_dir("/out/final");
  for (const char* dtype : {"", "auto", "f32", "bf16", "f16"}) {
    s.mutable_train()->set_final_dtype(dtype);
    EXPECT_TRUE(ValidateJobSpec(s).ok()) << dtype;
  }
  s.mutable_train()->set_final_dtype("f64");
  ExpectInvalid(s, "spec.train.final_dtype: 'f64' is not one of auto, f32, bf16, f16");
  // Labels: a language model has none; an image classifier and an
  // encoder-decoder need theirs.
  s = TrainSpec();
  s.mutable_train()->set_labels_path("/data/labels.npy");
  ExpectInvalid(s, "spec.train.labels_path");
  for (const char* config :
       {R"({"model_type":"vit","hidden_size":64,"num_hidden_layers":1,"num_attention_heads":4,"intermediate_size":96,
            "image_size":8,"patch_size":4})",
        R"({"model_type":"t5","vocab_size":50,"d_model":64,"d_kv":16,"d_ff":96,"num_layers":1,"num_heads":4})"}) {
    s = TrainSpec();
    s.mutable_model()->set_config_json(config);
    s.mutable_train()->set_seq_len(4096);  // unused: the arrays' lengths hold
    ExpectInvalid(s, "spec.train.labels_path");
    s.mutable_train()->set_labels_path("/data/labels.npy");
    EXPECT_TRUE(ValidateJobSpec(s).ok()) << config << "\n" << ValidateJobSpec(s);
    s.mutable_train()->set_recompute(v1::RECOMPUTE_FULL);  // T5's blocks take two inputs
    if (absl::StrContains(config, "t5")) {
      ExpectInvalid(s, "spec.train.recompute");
    } else {
      EXPECT_TRUE(ValidateJobSpec(s).ok()) << config << "\n" << ValidateJobSpec(s);
    }
  }
  s = TrainSpec();
  s.mutable_train()->set_recompute(static_cast<v1::Recompute>(9));
  ExpectInvalid(s, "spec.train.recompute");
  // A masked language model (BERT sees every position) trains with its
  // [MASK] id, an id of its vocabulary; another model is given none.
  s = TrainSpec();
  s.mutable_model()->set_config_json(
      R"({"model_type":"bert","vocab_size":50,"hidden_size":64,"num_hidden_layers":1,"num_attention_heads":4,
          "intermediate_size":96,"max_position_embeddings":64,"type_vocab_size":2})");
  ExpectInvalid(s, "spec.train.mask_token_id: required for a masked language model (bert");
  s.mutable_train()->set_mask_token_id(50);
  ExpectInvalid(s, "spec.train.mask_token_id: 50 is not an id of the model's vocabulary [0, 50)");
  s.mutable_train()->set_mask_token_id(-1);
  ExpectInvalid(s, "spec.train.mask_token_id: -1 is not an id");
  s.mutable_train()->set_mask_token_id(0);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  s = TrainSpec();
  s.mutable_train()->set_mask_token_id(3);
  ExpectInvalid(s, "spec.train.mask_token_id: is for a masked language model (bert); a gpt2 predicts its next");
  // fp16 trains with its loss scaled: the scale a power of two in
  // [1, 2^24], the window in [1, 1e9]; neither for another precision (auto
  // takes them: a resume may be of an fp16 checkpoint).
  s = TrainSpec();
  s.mutable_train()->set_precision(v1::PRECISION_FP16_MIXED);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  s.mutable_train()->set_loss_scale(1024);
  s.mutable_train()->set_loss_scale_window(100);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
  s.mutable_train()->set_loss_scale(1000);
  ExpectInvalid(s, "spec.train.loss_scale: 1000 is not a power of two");
  s.mutable_train()->set_loss_scale(0.5);
  ExpectInvalid(s, "spec.train.loss_scale: 0.5 is outside [1, 16777216] (2^0 to 2^24)");
  s.mutable_train()->set_loss_scale(std::nan(""));
  ExpectInvalid(s, "spec.train.loss_scale: nan is outside [1, 16777216]");
  s.mutable_train()->set_loss_scale(33554432);  // 2^25
  ExpectInvalid(s, "spec.train.loss_scale: 33554432 is outside [1, 16777216]");
  s.mutable_train()->set_loss_scale(1);
  s.mutable_train()->set_loss_scale_window(-1);
  ExpectInvalid(s, "spec.train.loss_scale_window: -1 steps is not in [1, 1000000000]");
  s.mutable_train()->set_loss_scale_window(1000000001);
  ExpectInvalid(s, "spec.train.loss_scale_window: 1000000001 steps is not in [1, 1000000000]");
  s.mutable_train()->set_loss_scale_window(0);
  s.mutable_train()->set_precision(v1::PRECISION_BF16_MIXED);
  ExpectInvalid(s, "spec.train.loss_scale: only fp16 training (PRECISION_FP16_MIXED) scales its loss");
  s.mutable_train()->clear_loss_scale();
  s.mutable_train()->set_loss_scale_window(10);
  ExpectInvalid(s, "spec.train.loss_scale_window: only fp16 training");
  s.mutable_train()->set_precision(v1::PRECISION_UNSPECIFIED);
  EXPECT_TRUE(ValidateJobSpec(s).ok()) << ValidateJobSpec(s);
}

TEST(JobManager, SubmitGetListCancel) {
  FakeClock clock;
  JobManager jobs(&clock);
  auto a = jobs.Submit(TrainSpec(), "");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->job_id(), "job-000001");
  EXPECT_EQ(a->state(), v1::JOB_STATE_PENDING);
  auto b = jobs.Submit(TrainSpec(), "req-1");
  auto b_again = jobs.Submit(TrainSpec(), "req-1");
  ASSERT_TRUE(b.ok() && b_again.ok());
  EXPECT_EQ(b->job_id(), b_again->job_id());  // idempotent retry
  EXPECT_EQ(b->uid(), b_again->uid());
  EXPECT_EQ(jobs.List({}).size(), 2u);
  // Another spec under a request id already used: refused, not the old job
  // (a script's "nightly" id the next night).
  v1::JobSpec other_spec = TrainSpec();
  other_spec.mutable_train()->set_steps(other_spec.train().steps() + 1);
  const absl::StatusOr<v1::Job> reused = jobs.Submit(other_spec, "req-1");
  EXPECT_EQ(reused.status().code(), absl::StatusCode::kAlreadyExists) << reused.status();
  EXPECT_EQ(reused.status().message(),
            "request id 'req-1' was used by " + b->job_id() + " for another spec: give this one a new request id");
  EXPECT_EQ(jobs.List({}).size(), 2u);
  // Each job draws a uid of 16 hex digits, its identity beyond this
  // manager's numbering (a second manager numbers from 1 again).
  JobManager other(&clock);
  auto a2 = other.Submit(TrainSpec(), "");
  ASSERT_TRUE(a2.ok()) << a2.status();
  EXPECT_EQ(a2->job_id(), a->job_id());
  for (const v1::Job* j : {&*a, &*b, &*a2}) {
    EXPECT_EQ(j->uid().size(), 16u) << j->uid();
    EXPECT_EQ(j->uid().find_first_not_of("0123456789abcdef"), std::string::npos) << j->uid();
  }
  EXPECT_NE(a->uid(), b->uid());
  EXPECT_NE(a->uid(), a2->uid());

  auto cancelled = jobs.Cancel(a->job_id(), "");
  ASSERT_TRUE(cancelled.ok());
  EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(jobs.Cancel(a->job_id(), "").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(jobs.Cancel("job-999", "").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(jobs.Get("job-999").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(jobs.List({v1::JOB_STATE_PENDING}).size(), 1u);
  EXPECT_EQ(jobs.CountByState()["cancelled"], 1);
  EXPECT_EQ(jobs.CountByState()["pending"], 1);
  // Jobs that ended here, counted once each, every final state named.
  EXPECT_EQ(jobs.FinishedCounts(),
            (std::map<std::string, int64_t>{{"cancelled", 1}, {"failed", 0}, {"succeeded", 0}}));
  ASSERT_TRUE(jobs.SetState(b->job_id(), v1::JOB_STATE_FAILED, "rank 1 failed").ok());
  EXPECT_FALSE(jobs.SetState(b->job_id(), v1::JOB_STATE_FAILED, "again").ok());
  EXPECT_EQ(jobs.FinishedCounts(),
            (std::map<std::string, int64_t>{{"cancelled", 1}, {"failed", 1}, {"succeeded", 0}}));

  v1::JobSpec bad = TrainSpec();
  bad.mutable_shard()->set_tensor_parallel_size(0);
  EXPECT_EQ(jobs.Submit(bad, "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(jobs.List({}).size(), 2u);  // nothing half-created
}

// The same spec of an uploaded model, uploaded again for the retry (a new
// upload id): the same submission, unless the two uploads' files are known
// to differ (another model under yesterday's request id).
TEST(JobManager, ARequestIdRepeatedForAnotherUploadIsARetryUnlessItsFilesDiffer) {
  FakeClock clock;
  JobManager jobs(&clock);
  v1::JobSpec uploaded = TrainSpec();
  uploaded.mutable_model()->clear_weights_path();
  uploaded.mutable_model()->set_upload_id("upload-000001-00000000000000aa");
  const absl::StatusOr<v1::Job> first = jobs.Submit(uploaded, "req-up");
  ASSERT_TRUE(first.ok()) << first.status();
  std::vector<std::pair<std::string, std::string>> compared;
  bool differ = false;
  jobs.SetUploadsDiffer([&](const std::string& a, const std::string& b) {
    compared.emplace_back(a, b);
    return differ;
  });
  uploaded.mutable_model()->set_upload_id("upload-000002-00000000000000bb");
  const absl::StatusOr<v1::Job> retried = jobs.Submit(uploaded, "req-up");
  ASSERT_TRUE(retried.ok()) << retried.status();
  EXPECT_EQ(retried->job_id(), first->job_id());
  EXPECT_EQ(compared, (std::vector<std::pair<std::string, std::string>>{
                          {"upload-000001-00000000000000aa", "upload-000002-00000000000000bb"}}));
  differ = true;
  const absl::StatusOr<v1::Job> other_model = jobs.Submit(uploaded, "req-up");
  EXPECT_EQ(other_model.status().code(), absl::StatusCode::kAlreadyExists) << other_model.status();
  EXPECT_EQ(jobs.List({}).size(), 1u);
}

// Jobs not ended are bounded (--max-active-jobs): a submit past it is
// RESOURCE_EXHAUSTED, and one that ended makes room; a repeated request id
// still returns its job.
TEST(JobManager, JobsNotEndedAreBounded) {
  FakeClock clock;
  JobManager jobs(&clock);
  jobs.SetMaxActiveJobs(2);
  auto a = jobs.Submit(TrainSpec(), "req-a");
  auto b = jobs.Submit(TrainSpec(), "");
  ASSERT_TRUE(a.ok() && b.ok());
  const absl::StatusOr<v1::Job> over = jobs.Submit(TrainSpec(), "req-c");
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted) << over.status();
  EXPECT_NE(over.status().message().find("2 jobs have not ended"), std::string::npos) << over.status();
  auto again = jobs.Submit(TrainSpec(), "req-a");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->job_id(), a->job_id());
  ASSERT_TRUE(jobs.Cancel(b->job_id(), "room").ok());
  auto c = jobs.Submit(TrainSpec(), "req-c");  // the refused request id is free again
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(jobs.List({}).size(), 3u);
}

// Two jobs saving into one checkpoint directory remove each other's saves
// in progress: a job whose checkpoint_dir (or final_dir) is that of a job
// not yet ended (compared as a normal path) is refused naming that job;
// once the holder ended, the directory is free (a next run resumes from
// it).
TEST(JobManager, OneActiveJobSavesIntoACheckpointDirectory) {
  FakeClock clock;
  JobManager jobs(&clock);
  v1::JobSpec saving = TrainSpec();
  saving.mutable_train()->set_checkpoint_every(5);
  saving.mutable_train()->set_checkpoint_dir("/data/ck");
  auto a = jobs.Submit(saving, "");
  ASSERT_TRUE(a.ok()) << a.status();
  for (const std::string dir : {"/data/ck", "/data/ck/", "/data/./x/../ck"}) {
    v1::JobSpec again = saving;
    again.mutable_train()->set_checkpoint_dir(dir);
    auto refused = jobs.Submit(again, "");
    ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition) << dir;
    EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                  "spec.train.checkpoint_dir: " + dir + " is the checkpoint_dir of " + a->job_id() +
                                      " (pending)"))
        << refused.status();
  }
  // So does a final directory (two jobs would mix their rank files there).
  v1::JobSpec finishing = TrainSpec();
  finishing.mutable_train()->set_final_dir("/data/out");
  auto f = jobs.Submit(finishing, "");
  ASSERT_TRUE(f.ok()) << f.status();
  finishing.mutable_train()->set_final_dir("/data/out/");
  auto refused = jobs.Submit(finishing, "");
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(absl::StrContains(refused.status().message(),
                                "spec.train.final_dir: /data/out/ is the final_dir of " + f->job_id()))
      << refused.status();
  ASSERT_TRUE(jobs.Cancel(f->job_id(), "").ok());
  EXPECT_TRUE(jobs.Submit(finishing, "").ok());
  // Another directory and a job that saves nothing are not refused; a new
  // request for the directory is.
  v1::JobSpec elsewhere = saving;
  elsewhere.mutable_train()->set_checkpoint_dir("/data/ck2");
  EXPECT_TRUE(jobs.Submit(elsewhere, "").ok());
  EXPECT_TRUE(jobs.Submit(TrainSpec(), "").ok());
  EXPECT_EQ(jobs.Submit(saving, "req-a").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(jobs.List({}).size(), 5u);
  ASSERT_TRUE(jobs.SetState(a->job_id(), v1::JOB_STATE_SUCCEEDED, "done").ok());
  v1::JobSpec next = saving;
  next.mutable_train()->set_resume_from("/data/ck");
  auto b = jobs.Submit(next, "req-b");
  ASSERT_TRUE(b.ok()) << b.status();
  auto b_again = jobs.Submit(next, "req-b");  // the same request: its job, not a refusal
  ASSERT_TRUE(b_again.ok()) << b_again.status();
  EXPECT_EQ(b_again->job_id(), b->job_id());
  EXPECT_EQ(jobs.Submit(saving, "").status().code(), absl::StatusCode::kFailedPrecondition);

  // A submit of the directory still writing its record (which may yet
  // fail): another is UNAVAILABLE, to try again; then refused as above.
  auto recorded = JobManager::Open(std::string(std::getenv("TEST_TMPDIR")) + "/jobs-dirs", &clock);
  ASSERT_TRUE(recorded.ok()) << recorded.status();
  absl::Notification writing, release;
  (*recorded)->SetBeforeWriteForTest([&](const std::string&) {
    if (!writing.HasBeenNotified()) {
      writing.Notify();
      release.WaitForNotification();
    }
  });
  absl::StatusOr<v1::Job> first;
  std::thread submitter([&] { first = (*recorded)->Submit(saving, ""); });
  writing.WaitForNotification();
  auto meanwhile = (*recorded)->Submit(saving, "");
  EXPECT_EQ(meanwhile.status().code(), absl::StatusCode::kUnavailable) << meanwhile.status();
  EXPECT_TRUE(absl::StrContains(meanwhile.status().message(), "/data/ck is named by a job being submitted"))
      << meanwhile.status();
  release.Notify();
  submitter.join();
  ASSERT_TRUE(first.ok()) << first.status();
  EXPECT_EQ((*recorded)->Submit(saving, "").status().code(), absl::StatusCode::kFailedPrecondition);
  // Jobs that write nothing there take no directory: an evaluation, and
  // checkpoint_dir without checkpoint_every.
  v1::JobSpec evaluating = saving;
  evaluating.mutable_train()->set_eval_only(true);
  evaluating.mutable_train()->set_eval_split(0.1);
  evaluating.mutable_train()->set_checkpoint_every(0);
  EXPECT_TRUE((*recorded)->Submit(evaluating, "").ok());
  v1::JobSpec unsaved = saving;
  unsaved.mutable_train()->set_checkpoint_every(0);
  EXPECT_TRUE((*recorded)->Submit(unsaved, "").ok());

  // A directory is one whatever names it: another job's checkpoint_dir as
  // a final_dir, and through a link the coordinator can resolve (before,
  // a link let a second job replace the first's checkpoints).
  const std::string real = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-real-ck";
  std::filesystem::create_directories(real);
  std::filesystem::create_directory_symlink(real, real + "-link");
  v1::JobSpec owner = saving;
  owner.mutable_train()->set_checkpoint_dir(real);
  auto o = jobs.Submit(owner, "");
  ASSERT_TRUE(o.ok()) << o.status();
  v1::JobSpec linked = saving;
  linked.mutable_train()->set_checkpoint_dir(real + "-link");
  auto through_link = jobs.Submit(linked, "");
  EXPECT_EQ(through_link.status().code(), absl::StatusCode::kFailedPrecondition) << through_link.status();
  EXPECT_TRUE(absl::StrContains(through_link.status().message(), " is the checkpoint_dir of " + o->job_id()))
      << through_link.status();
  v1::JobSpec as_final = TrainSpec();
  as_final.mutable_train()->set_final_dir(real);
  auto final_there = jobs.Submit(as_final, "");
  EXPECT_EQ(final_there.status().code(), absl::StatusCode::kFailedPrecondition) << final_there.status();
  EXPECT_TRUE(absl::StrContains(final_there.status().message(),
                                "spec.train.final_dir: " + real + " is the checkpoint_dir of " + o->job_id()))
      << final_there.status();
}

// A job stores the memory floor it was submitted with, computed once: the
// GPT-2 closed form's parameters (V*E + P*E + L*(12E^2 + 13E) + 2E =
// 120,640 for the tiny config), and bytes that add up. A floor the caller
// computed is stored as given; one a record lacks (written before jobs
// stored it) is filled in when the coordinator opens its records.
TEST(JobManager, AJobStoresItsMemoryFloorComputedOnceAtSubmit) {
  FakeClock clock;
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/memory-floor";
  std::filesystem::remove_all(dir);
  v1::MemoryFloor given;
  given.set_total_bytes(int64_t{7} << 30);
  std::string old_record_path;
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    auto job = (*jobs)->Submit(TrainSpec(), "");
    ASSERT_TRUE(job.ok()) << job.status();
    const v1::MemoryFloor& f = job->memory_floor();
    EXPECT_EQ(f.parameters(), 257 * 64 + 64 * 64 + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64);
    EXPECT_GT(f.rank_parameters(), 0);
    EXPECT_LT(f.rank_parameters(), f.parameters());  // tp = 2
    EXPECT_EQ(f.total_bytes(), f.param_bytes() + f.grad_bytes() + f.optimizer_bytes() + f.activation_bytes());
    EXPECT_EQ(f.total_bytes(), RankMemoryFloorBytes(TrainSpec()));
    auto as_given = (*jobs)->Submit(TrainSpec(), "", given);
    ASSERT_TRUE(as_given.ok()) << as_given.status();
    EXPECT_EQ(as_given->memory_floor().total_bytes(), given.total_bytes());
    // A third job's record as an older coordinator wrote it: no floor.
    auto old = (*jobs)->Submit(TrainSpec(), "");
    ASSERT_TRUE(old.ok()) << old.status();
    old_record_path = dir + "/" + old->job_id() + ".pb";
    v1::JobRecord record;
    auto bytes = ReadFileToString(old_record_path);
    ASSERT_TRUE(bytes.ok() && record.ParseFromString(*bytes));
    record.mutable_job()->clear_memory_floor();
    ASSERT_TRUE(WriteFileAtomically(old_record_path, record.SerializeAsString()).ok());
  }
  auto reopened = JobManager::Open(dir, &clock);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  const std::vector<v1::Job> listed = (*reopened)->List({});
  ASSERT_EQ(listed.size(), 3u);
  EXPECT_EQ(listed[0].memory_floor().total_bytes(), RankMemoryFloorBytes(TrainSpec()));
  EXPECT_EQ(listed[1].memory_floor().total_bytes(), given.total_bytes());
  EXPECT_EQ(listed[2].memory_floor().total_bytes(), RankMemoryFloorBytes(TrainSpec()));
}

// A record file planted with a number near INT64_MAX (or a next-id
// like it) does not make the next ids overflow into negative numbers: it is
// not taken, and the ids go on from the real ones.
TEST(JobManager, JobNumbersNearTheirLimitAreNotTaken) {
  FakeClock clock;
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/job-numbers";
  std::filesystem::remove_all(dir);
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    ASSERT_EQ((*jobs)->Submit(TrainSpec(), "")->job_id(), "job-000001");
  }
  ASSERT_TRUE(WriteFileAtomically(dir + "/job-9223372036854775806.pb", "").ok());
  ASSERT_TRUE(WriteFileAtomically(dir + "/next-id", "9223372036854775807\n").ok());
  // And a snapshot's temporary file, as a coordinator killed mid-write
  // leaves it: removed at start.
  ASSERT_TRUE(WriteFileAtomically(dir + "/job-000001.pb.tmp.4242.0", "half a record").ok());
  auto reopened = JobManager::Open(dir, &clock);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_FALSE(std::filesystem::exists(dir + "/job-000001.pb.tmp.4242.0"));
  for (const char* want : {"job-000002", "job-000003"}) {
    auto job = (*reopened)->Submit(TrainSpec(), "");
    ASSERT_TRUE(job.ok()) << job.status();
    EXPECT_EQ(job->job_id(), want);
  }
}

// Past job-999999 the ids have seven digits: job-1000000 is listed (and
// queued) after job-999999, not among job-1000xx as a string would sort,
// before and after a reopen, and a page ends and goes on in that order.
TEST(JobManager, AJobOfSevenDigitsComesAfterThoseOfSix) {
  FakeClock clock;
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/job-digits";
  std::filesystem::remove_all(dir);
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    ASSERT_EQ((*jobs)->Submit(TrainSpec(), "")->job_id(), "job-000001");
  }
  ASSERT_TRUE(WriteFileAtomically(dir + "/next-id", "999999\n").ok());
  const std::vector<std::string> want = {"job-000001", "job-999999", "job-1000000", "job-1000001"};
  for (int open = 0; open < 2; ++open) {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    if (open == 0) {
      for (size_t i = 1; i < want.size(); ++i) {
        auto job = (*jobs)->Submit(TrainSpec(), "");
        ASSERT_TRUE(job.ok()) << job.status();
        EXPECT_EQ(job->job_id(), want[i]);
      }
    }
    std::vector<std::string> listed;
    for (const v1::Job& j : (*jobs)->List({})) listed.push_back(j.job_id());
    EXPECT_EQ(listed, want) << "open " << open;
    for (const std::string& id : listed) EXPECT_TRUE(JobManager::IsJobId(id)) << id;
    const JobManager::Page first = (*jobs)->ListPage({}, "", 2, nullptr);
    ASSERT_EQ(first.jobs.size(), 2u);
    EXPECT_TRUE(first.more);
    const JobManager::Page rest = (*jobs)->ListPage({}, first.jobs.back().job_id(), 10, nullptr);
    ASSERT_EQ(rest.jobs.size(), 2u);
    EXPECT_EQ(rest.jobs[0].job_id(), "job-1000000");
    EXPECT_EQ(rest.jobs[1].job_id(), "job-1000001");
    EXPECT_FALSE(rest.more);
    // A page ends after the job that brings it to its bytes (ListJobs':
    // 1 MiB), the last one without more.
    const JobManager::Page by_bytes = (*jobs)->ListPage({}, "", 10, nullptr, /*max_bytes=*/1);
    ASSERT_EQ(by_bytes.jobs.size(), 1u);
    EXPECT_TRUE(by_bytes.more);
    const JobManager::Page last = (*jobs)->ListPage({}, "job-1000000", 10, nullptr, /*max_bytes=*/1);
    ASSERT_EQ(last.jobs.size(), 1u);
    EXPECT_EQ(last.jobs[0].job_id(), "job-1000001");
    EXPECT_FALSE(last.more);
  }
}

// The shape ListJobs' page tokens must name, and the order assumes.
TEST(JobManager, AJobIdIsJobAndSixDigitsOrMore) {
  for (const char* id : {"job-000001", "job-1000000", "job-4611686018427387903"}) {
    EXPECT_TRUE(JobManager::IsJobId(id)) << id;
  }
  for (const char* id :
       {"", "job-", "job-00001", "job-00000a", "job-+00001", "Job-000001", "jobs-000001", "job-000001 ", "w-000001"}) {
    EXPECT_FALSE(JobManager::IsJobId(id)) << id;
  }
}

// Past max_ended ended jobs the oldest ended go (their records too), however
// recent: a coordinator running many short jobs keeps bounded memory. Jobs
// not ended are never counted or deleted; retention still applies first.
TEST(JobManager, PastTheMostEndedJobsTheOldestEndedGo) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-max-ended";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  auto jobs = JobManager::Open(dir, &clock);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  std::vector<std::string> ids;
  for (int i = 0; i < 6; ++i) {
    auto job = (*jobs)->Submit(TrainSpec(), "");
    ASSERT_TRUE(job.ok()) << job.status();
    ids.push_back(job->job_id());
  }
  // Ended in the order 3, 1, 0, 4, a minute apart; 2 and 5 still queued.
  for (int i : {3, 1, 0, 4}) {
    ASSERT_TRUE((*jobs)->Cancel(ids[i], "").ok());
    clock.Advance(absl::Minutes(1));
  }
  EXPECT_TRUE((*jobs)->Expire(absl::ZeroDuration(), 0).empty());  // keeps everything
  EXPECT_TRUE((*jobs)->Expire(absl::Hours(1), 4).empty());        // 4 ended, within both
  EXPECT_EQ((*jobs)->Expire(absl::ZeroDuration(), 2), (std::vector<std::string>{ids[3], ids[1]}));
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + ids[3] + ".pb"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/" + ids[0] + ".pb"));
  std::vector<std::string> left;
  for (const v1::Job& j : (*jobs)->List({})) left.push_back(j.job_id());
  EXPECT_EQ(left, (std::vector<std::string>{ids[0], ids[2], ids[4], ids[5]}));
  // The retention alone: 0 ended 2 minutes ago, past 90 s; then one ended
  // job is within a bound of one.
  EXPECT_EQ((*jobs)->Expire(absl::Seconds(90), 0), std::vector<std::string>{ids[0]});
  EXPECT_TRUE((*jobs)->Expire(absl::ZeroDuration(), 1).empty());
  EXPECT_TRUE((*jobs)->Get(ids[4]).ok());
  EXPECT_TRUE((*jobs)->Get(ids[2]).ok());
}

// A job whose record cannot be written (a full disk) is refused
// RESOURCE_EXHAUSTED and leaves nothing: not listed, its request id free,
// not there after a reopen. Accepted jobs are durable.
TEST(JobManager, AJobThatCannotBeRecordedIsNotAccepted) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-full";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    absl::StatusOr<v1::Job> refused;
    {
      testing::FullDisk disk(16);
      refused = (*jobs)->Submit(TrainSpec(), "req-full");
    }
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
    EXPECT_NE(refused.status().message().find("cannot be recorded"), std::string::npos) << refused.status();
    EXPECT_TRUE((*jobs)->List({}).empty());
    auto accepted = (*jobs)->Submit(TrainSpec(), "req-full");  // the id is free again
    ASSERT_TRUE(accepted.ok()) << accepted.status();
    EXPECT_EQ((*jobs)->List({}).size(), 1u);
  }
  auto reopened = JobManager::Open(dir, &clock);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  ASSERT_EQ((*reopened)->List({}).size(), 1u);
  EXPECT_EQ((*reopened)->List({})[0].state(), v1::JOB_STATE_PENDING);
}

// Job records are never kept forever: DeleteJob forgets an ended job at
// once, Expire those that ended longer ago than the retention; ids are never
// handed out again, not even after a reopen.
TEST(JobManager, EndedJobsAreDeletedAndExpireWithoutReusingTheirIds) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-delete";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    auto a = (*jobs)->Submit(TrainSpec(), "req-a");
    auto b = (*jobs)->Submit(TrainSpec(), "");
    auto c = (*jobs)->Submit(TrainSpec(), "");
    ASSERT_TRUE(a.ok() && b.ok() && c.ok());
    EXPECT_EQ((*jobs)->Delete(a->job_id()).code(), absl::StatusCode::kFailedPrecondition);  // still pending
    EXPECT_EQ((*jobs)->Delete("job-999999").code(), absl::StatusCode::kNotFound);
    ASSERT_TRUE((*jobs)->Cancel(a->job_id(), "").ok());
    // A watcher of the job sees it go.
    std::thread deleter([&] {
      absl::SleepFor(absl::Milliseconds(30));
      EXPECT_TRUE((*jobs)->Delete(a->job_id()).ok());
    });
    auto waited = (*jobs)->WaitForEvents(a->job_id(), 3, absl::Seconds(10));
    deleter.join();
    // The job had ended: the wait returned at once, or found it gone.
    if (!waited.ok()) {
      EXPECT_EQ(waited.status().code(), absl::StatusCode::kNotFound);
    }
    EXPECT_EQ((*jobs)->Get(a->job_id()).status().code(), absl::StatusCode::kNotFound);
    EXPECT_FALSE(std::filesystem::exists(dir + "/" + a->job_id() + ".pb"));
    // Its request id is free again: a new job.
    auto again = (*jobs)->Submit(TrainSpec(), "req-a");
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(again->job_id(), "job-000004");

    // Retention: c ends now, b an hour later; after 90 minutes more with a
    // retention of 2 hours, only c has been over it.
    ASSERT_TRUE((*jobs)->SetState(c->job_id(), v1::JOB_STATE_FAILED, "x").ok());
    clock.Advance(absl::Hours(1));
    ASSERT_TRUE((*jobs)->SetState(b->job_id(), v1::JOB_STATE_SUCCEEDED, "").ok());
    clock.Advance(absl::Minutes(90));
    EXPECT_TRUE((*jobs)->Expire(absl::ZeroDuration()).empty());  // keeps everything
    EXPECT_EQ((*jobs)->Expire(absl::Hours(2)), std::vector<std::string>{c->job_id()});
    EXPECT_TRUE((*jobs)->Get(b->job_id()).ok());
    EXPECT_TRUE((*jobs)->Get(again->job_id()).ok());  // pending: never expires
    clock.Advance(absl::Hours(1));
    EXPECT_EQ((*jobs)->Expire(absl::Hours(2)), std::vector<std::string>{b->job_id()});
    // The newest job is deleted too: its id must not come back.
    ASSERT_TRUE((*jobs)->Cancel(again->job_id(), "").ok());
    ASSERT_TRUE((*jobs)->Delete(again->job_id()).ok());
  }
  auto reopened = JobManager::Open(dir, &clock);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_TRUE((*reopened)->List({}).empty());
  auto next = (*reopened)->Submit(TrainSpec(), "");
  ASSERT_TRUE(next.ok());
  EXPECT_EQ(next->job_id(), "job-000005");
}

// Records are written outside the jobs' lock, so changes of one job from
// several threads may reach the writer out of order: the file must still end
// as the newest record, a deleted job's file must not come back, and two
// submits of one request id at once must make one job.
TEST(JobManager, ConcurrentChangesLeaveTheNewestRecordOnDisk) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-concurrent";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  std::map<std::string, v1::Job> in_memory;
  std::map<std::string, size_t> events;
  {
    auto opened = JobManager::Open(dir, &clock);
    ASSERT_TRUE(opened.ok()) << opened.status();
    JobManager& jobs = **opened;
    constexpr int kThreads = 4, kJobsEach = 6, kStatuses = 8;
    std::vector<std::string> same_request(2);
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        // Threads 0 and 1 submit the same request id at once first.
        if (t < 2) {
          auto j = jobs.Submit(TrainSpec(), "req-shared");
          ASSERT_TRUE(j.ok()) << j.status();
          same_request[t] = j->job_id();
        }
        for (int k = 0; k < kJobsEach; ++k) {
          auto j = jobs.Submit(TrainSpec(), "");
          ASSERT_TRUE(j.ok()) << j.status();
          // Another thread changes this job at the same time.
          std::thread other([&jobs, id = j->job_id()] {
            for (int i = 0; i < kStatuses; ++i) {
              v1::RankStatus r;
              r.set_rank(1);
              r.set_phase(v1::RANK_PHASE_TRAINING);
              (void)jobs.AddRankStatus(id, r);  // FAILED_PRECONDITION once it ended
            }
          });
          for (int i = 0; i < kStatuses; ++i) {
            v1::RankStatus r;
            r.set_rank(0);
            r.set_phase(v1::RANK_PHASE_TRAINING);
            EXPECT_TRUE(jobs.AddRankStatus(j->job_id(), r).ok());
            (void)jobs.List({});  // readers meanwhile
          }
          // Ended (and deleted) while the other thread may still be writing it.
          if (k % 3 == 0) {
            EXPECT_TRUE(jobs.Cancel(j->job_id(), "").ok());
            EXPECT_TRUE(jobs.Delete(j->job_id()).ok());
          } else if (k % 3 == 1) {
            EXPECT_TRUE(jobs.SetState(j->job_id(), v1::JOB_STATE_SUCCEEDED, "done").ok());
          }
          other.join();
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(same_request[0], same_request[1]);
    for (const v1::Job& j : jobs.List({})) {
      in_memory[j.job_id()] = j;
      auto e = jobs.WaitForEvents(j.job_id(), 1, absl::ZeroDuration());
      ASSERT_TRUE(e.ok()) << e.status();
      events[j.job_id()] = e->events.size();
    }
    // One shared job, and two of every three of each thread's.
    EXPECT_EQ(in_memory.size(), 1u + kThreads * (kJobsEach - kJobsEach / 3));
  }
  auto reopened = JobManager::Open(dir, &clock);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  std::map<std::string, v1::Job> on_disk;
  for (const v1::Job& j : (*reopened)->List({})) on_disk[j.job_id()] = j;
  ASSERT_EQ(on_disk.size(), in_memory.size());
  for (const auto& [id, job] : in_memory) {
    ASSERT_EQ(on_disk.count(id), 1u) << id;
    EXPECT_EQ(on_disk[id].state(), job.state()) << id;
    auto e = (*reopened)->WaitForEvents(id, 1, absl::ZeroDuration());
    ASSERT_TRUE(e.ok()) << e.status();
    EXPECT_EQ(e->events.size(), events[id]) << id;  // the newest record, every event in it
  }
}

// The state in the job's record files in `dir`.
v1::JobState StateOnDisk(const std::string& dir, const std::string& id) {
  absl::StatusOr<v1::JobRecord> record = JobManager::ReadRecord(dir, id);
  return record.ok() ? record->job().state() : v1::JOB_STATE_UNSPECIFIED;
}

// Changes made inside a DeferredWrites scope are visible at once and on disk
// once the outermost scope of that manager ends, each job's newest record
// written once; a change outside any scope, or through another manager, is
// written before it returns.
TEST(JobManager, DeferredWritesReachTheDiskWhenTheOutermostScopeEnds) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-deferred";
  const std::string other_dir = dir + "-other";
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(other_dir);
  FakeClock clock;
  auto opened = JobManager::Open(dir, &clock);
  auto other_opened = JobManager::Open(other_dir, &clock);
  ASSERT_TRUE(opened.ok() && other_opened.ok());
  JobManager& jobs = **opened;
  JobManager& other = **other_opened;
  std::map<std::string, int> writes;
  jobs.SetBeforeWriteForTest([&](const std::string& id) { ++writes[id]; });
  const std::string a = jobs.Submit(TrainSpec(), "")->job_id();
  const std::string b = jobs.Submit(TrainSpec(), "")->job_id();
  const std::string c = other.Submit(TrainSpec(), "")->job_id();
  EXPECT_EQ(writes[a], 1);  // a submit writes at once, scope or not
  {
    JobManager::DeferredWrites outer(jobs);
    {
      JobManager::DeferredWrites inner(jobs);
      ASSERT_TRUE(jobs.SetState(a, v1::JOB_STATE_RUNNING, "go").ok());
      ASSERT_TRUE(other.SetState(c, v1::JOB_STATE_RUNNING, "go").ok());
    }
    ASSERT_TRUE(jobs.SetState(a, v1::JOB_STATE_SUCCEEDED, "done").ok());
    ASSERT_TRUE(jobs.SetState(b, v1::JOB_STATE_FAILED, "broken").ok());
    EXPECT_EQ(jobs.Get(a)->state(), v1::JOB_STATE_SUCCEEDED);  // visible at once
    EXPECT_EQ(StateOnDisk(dir, a), v1::JOB_STATE_PENDING) << "written before the outermost scope ended";
    EXPECT_EQ(StateOnDisk(dir, b), v1::JOB_STATE_PENDING);
    EXPECT_EQ(StateOnDisk(other_dir, c), v1::JOB_STATE_RUNNING) << "another manager's change waits for nothing";
    EXPECT_EQ(writes[a], 1);
  }
  EXPECT_EQ(StateOnDisk(dir, a), v1::JOB_STATE_SUCCEEDED);
  EXPECT_EQ(StateOnDisk(dir, b), v1::JOB_STATE_FAILED);
  EXPECT_EQ(writes[a], 2) << "one write of a's newest record for its two changes";
  EXPECT_EQ(writes[b], 2);
}

TEST(JobManager, WaitForEventsDeliversInOrderAndFinishes) {
  JobManager jobs;
  auto a = jobs.Submit(TrainSpec(), "");
  ASSERT_TRUE(a.ok());
  auto first = jobs.WaitForEvents(a->job_id(), 0, absl::Milliseconds(10));
  ASSERT_TRUE(first.ok());
  ASSERT_EQ(first->events.size(), 1u);
  EXPECT_EQ(first->events[0].sequence(), 1);
  EXPECT_EQ(first->events[0].state_change().state(), v1::JOB_STATE_PENDING);
  EXPECT_FALSE(first->finished);

  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(30));
    ASSERT_TRUE(jobs.Cancel(a->job_id(), "operator").ok());
  });
  auto next = jobs.WaitForEvents(a->job_id(), 2, absl::Seconds(10));
  canceller.join();
  ASSERT_TRUE(next.ok());
  ASSERT_EQ(next->events.size(), 1u);
  EXPECT_EQ(next->events[0].sequence(), 2);
  EXPECT_EQ(next->events[0].state_change().state(), v1::JOB_STATE_CANCELLED);
  EXPECT_EQ(next->events[0].state_change().reason(), "operator");
  EXPECT_TRUE(next->finished);
}

// Evaluations: the job keeps the newest and the lowest (the earliest of
// equals; never a loss that is not finite), across a reopen; an eval_only run's
// report (an evaluation without step_duration) leaves the trained step and
// loss alone.
TEST(JobManager, AJobKeepsItsLastAndBestEvaluation) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-eval";
  FakeClock clock;
  std::string id;
  auto report = [](int64_t step, double loss, double eval, bool trained) {
    v1::StepProgress p;
    p.set_step(step);
    p.set_loss(loss);
    if (trained) p.mutable_step_duration()->set_nanos(1000);
    p.mutable_eval()->set_step(step);
    p.mutable_eval()->set_loss(eval);
    p.mutable_eval()->set_checkpoint(absl::StrCat("/ck/step-", step));
    return p;
  };
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    auto job = (*jobs)->Submit(TrainSpec(), "");
    ASSERT_TRUE(job.ok());
    id = job->job_id();
    ASSERT_TRUE((*jobs)->Schedule(id, v1::MeshSpec()).ok());
    ASSERT_TRUE((*jobs)->SetState(id, v1::JOB_STATE_RUNNING, "training").ok());
    for (const auto& [step, eval] : std::vector<std::pair<int64_t, double>>{
             {2, std::nan("")}, {3, std::numeric_limits<double>::infinity()}, {4, 3.0}, {6, 2.5}, {8, 2.5},
             {10, 2.75}}) {
      ASSERT_TRUE((*jobs)->AddStep(id, report(step, 4.0 - step / 10.0, eval, true)).ok());
      if (step == 3) {  // a loss that is not finite is never the best, even the only one
        auto so_far = (*jobs)->Get(id);
        ASSERT_TRUE(so_far.ok());
        EXPECT_FALSE(so_far->has_best_eval()) << so_far->best_eval().loss();
        EXPECT_EQ(so_far->last_eval().step(), 3);
      }
    }
    auto got = (*jobs)->Get(id);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->last_eval().step(), 10);
    EXPECT_EQ(got->best_eval().step(), 6);
    EXPECT_EQ(got->best_eval().checkpoint(), "/ck/step-6");
    ASSERT_TRUE((*jobs)->SetState(id, v1::JOB_STATE_SUCCEEDED, "").ok());
  }
  auto jobs = JobManager::Open(dir, &clock);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  auto got = (*jobs)->Get(id);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->best_eval().loss(), 2.5);
  EXPECT_EQ(got->best_eval().step(), 6);
  EXPECT_EQ(got->step(), 10);
  // An eval_only job: its one report names the checkpoint's step and
  // trains nothing.
  auto only = (*jobs)->Submit(TrainSpec(), "");
  ASSERT_TRUE(only.ok());
  ASSERT_TRUE((*jobs)->Schedule(only->job_id(), v1::MeshSpec()).ok());
  ASSERT_TRUE((*jobs)->SetState(only->job_id(), v1::JOB_STATE_RUNNING, "").ok());
  ASSERT_TRUE((*jobs)->AddStep(only->job_id(), report(40, 0, 1.5, false)).ok());
  got = (*jobs)->Get(only->job_id());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->step(), 0);
  EXPECT_EQ(got->last_eval().step(), 40);
  EXPECT_EQ(got->best_eval().loss(), 1.5);
}

// Each trained step once: a resumed run's re-run steps add no event and
// leave the step and loss alone (a re-run's checkpoint list is taken); a
// step reported late, after later ones, fills its hole; across a reopen.
TEST(JobManager, EachStepIsRecordedOnce) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-once";
  FakeClock clock;
  auto step = [](int64_t n, double loss) {
    v1::StepProgress p;
    p.set_step(n);
    p.set_loss(loss);
    p.mutable_step_duration()->set_nanos(1000);
    p.set_tokens(1000);
    p.set_tokens_per_second(1e9);
    return p;
  };
  std::string id;
  auto steps_of = [&](JobManager& jobs) {
    std::vector<int64_t> out;
    jobs.Flush();  // watchers see the steps of the last second once written
    auto events = jobs.WaitForEvents(id, 1, absl::ZeroDuration());
    EXPECT_TRUE(events.ok());
    for (const v1::JobEvent& e : events->events) {
      if (e.has_step()) out.push_back(e.step().step());
    }
    return out;
  };
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    auto job = (*jobs)->Submit(TrainSpec(), "");
    ASSERT_TRUE(job.ok());
    id = job->job_id();
    ASSERT_TRUE((*jobs)->Schedule(id, v1::MeshSpec(), /*peak_flops=*/1e12).ok());
    for (int64_t n : {1, 2, 3, 5, 6}) {
      v1::StepProgress p = step(n, 10.0 - n);
      p.set_update_skipped(n == 5);  // fp16: its gradients overflowed
      ASSERT_TRUE((*jobs)->AddStep(id, p).ok());
    }
    const v1::RunSummary first = (*jobs)->Get(id)->summary();
    EXPECT_EQ(first.model_flops_per_token(), kTinyFlopsPerToken);
    EXPECT_EQ(first.peak_flops_per_second(), 1e12);
    EXPECT_DOUBLE_EQ(first.mfu(), first.mean_tokens_per_second() * kTinyFlopsPerToken / 1e12);
    v1::StepProgress rerun = step(3, 99);  // resumed from step 2's checkpoint
    v1::CheckpointInfo* kept = rerun.add_checkpoints();
    kept->set_step(3);
    kept->set_path("/ck/step-000003");
    ASSERT_TRUE((*jobs)->AddStep(id, rerun).ok());
    EXPECT_EQ((*jobs)->Get(id)->checkpoints_size(), 0);  // an earlier step's list does not roll the job back
    v1::StepProgress rerun6 = step(6, 99);  // the newest step, re-run: its save's list is news
    *rerun6.mutable_checkpoints() = rerun.checkpoints();
    rerun6.mutable_checkpoints(0)->set_step(6);
    ASSERT_TRUE((*jobs)->AddStep(id, rerun6).ok());
    ASSERT_TRUE((*jobs)->AddStep(id, step(4, 6.0)).ok());  // late: after 5 and 6
    auto got = (*jobs)->Get(id);
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(got->step(), 6);
    EXPECT_EQ(got->loss(), 4.0);
    ASSERT_EQ(got->checkpoints_size(), 1);
    EXPECT_EQ(got->checkpoints(0).step(), 6);
    EXPECT_EQ(steps_of(**jobs), (std::vector<int64_t>{1, 2, 3, 5, 6, 4}));
    clock.Advance(absl::Seconds(2));
    ASSERT_TRUE((*jobs)->AddStep(id, step(7, 3.0)).ok());  // written: more than a second on
  }
  auto jobs = JobManager::Open(dir, &clock);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  EXPECT_EQ((*jobs)->Get(id)->summary().peak_flops_per_second(), 1e12) << "kept with the record";
  ASSERT_TRUE((*jobs)->Schedule(id, v1::MeshSpec(), /*peak_flops=*/3e12).ok());  // other devices
  // Rank 0 says it trains at another precision than the spec's default:
  // that precision's peak counts, for this attempt only.
  const int64_t generation = (*jobs)->Get(id)->generation();
  ASSERT_TRUE((*jobs)->SetPeakFlops(id, generation, 2e12).ok());
  ASSERT_TRUE((*jobs)->SetPeakFlops(id, generation - 1, 7e12).ok());               // an earlier attempt's: ignored
  for (int64_t n : {5, 6, 7}) {  // the restart re-runs them (5 overflowing again)
    v1::StepProgress p = step(n, 0);
    p.set_update_skipped(n == 5);
    ASSERT_TRUE((*jobs)->AddStep(id, p).ok());
  }
  ASSERT_TRUE((*jobs)->AddStep(id, step(8, 2.0)).ok());
  // Steps the job does not have (of 10): refused, not remembered.
  for (int64_t n : {int64_t{11}, int64_t{-1}, std::numeric_limits<int64_t>::max()}) {
    EXPECT_EQ((*jobs)->AddStep(id, step(n, 1.0)).code(), absl::StatusCode::kInvalidArgument) << n;
  }
  EXPECT_EQ(steps_of(**jobs), (std::vector<int64_t>{1, 2, 3, 5, 6, 4, 7, 8}));
  EXPECT_EQ((*jobs)->Get(id)->loss(), 2.0);
  // The run's summary counts each step once: 8 steps of 1000 tokens and
  // 1 us each.
  const v1::RunSummary sum = (*jobs)->Get(id)->summary();
  EXPECT_EQ(sum.steps(), 8);
  EXPECT_EQ(sum.skipped_updates(), 1);  // step 5, once
  EXPECT_EQ(sum.tokens(), 8000);
  EXPECT_EQ(FromProtoDuration(sum.train_time()), absl::Microseconds(8));
  EXPECT_DOUBLE_EQ(sum.mean_tokens_per_second(), 8000 / 8e-6);
  EXPECT_EQ(sum.last_tokens_per_second(), 1e9);
  // MFU against the latest attempt's devices.
  EXPECT_EQ(sum.peak_flops_per_second(), 2e12);
  EXPECT_DOUBLE_EQ(sum.mfu(), 8000 / 8e-6 * kTinyFlopsPerToken / 2e12);
  ASSERT_TRUE((*jobs)->Cancel(id, "").ok());
  EXPECT_EQ((*jobs)->SetPeakFlops(id, generation, 5e12).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*jobs)->SetPeakFlops("job-999999", 1, 5e12).code(), absl::StatusCode::kNotFound);
}

// A late step (of an earlier generation) is recorded only from the worker
// that held rank 0 of that generation, across a reopen.
TEST(JobManager, ALateStepIsTakenOnlyFromItsGenerationsRankZeroWorker) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-late";
  FakeClock clock;
  auto mesh_on = [](const std::string& rank0, const std::string& rank1) {
    v1::MeshSpec mesh;
    mesh.set_world_size(2);
    mesh.add_ranks()->set_worker_id(rank0);
    mesh.add_ranks()->set_worker_id(rank1);
    return mesh;
  };
  auto step = [](int64_t n) {
    v1::StepProgress p;
    p.set_step(n);
    p.set_loss(1.0);
    p.mutable_step_duration()->set_nanos(1000);
    return p;
  };
  std::string id;
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    auto job = (*jobs)->Submit(TrainSpec(), "");
    ASSERT_TRUE(job.ok());
    id = job->job_id();
    ASSERT_TRUE((*jobs)->Schedule(id, mesh_on("w-a", "w-b")).ok());
    ASSERT_TRUE((*jobs)->Restart(id, "rank 1 was lost", "restarting").ok());
    ASSERT_TRUE((*jobs)->Schedule(id, mesh_on("w-b", "w-c")).ok());
    EXPECT_EQ((*jobs)->Get(id)->rank0_workers().at(1), "w-a");
    EXPECT_EQ((*jobs)->Get(id)->rank0_workers().at(2), "w-b");
  }
  auto jobs = JobManager::Open(dir, &clock);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  // Generation 1's rank 1, generation 2's rank 0, a generation never placed.
  EXPECT_EQ((*jobs)->AddLateStep(id, 1, "w-b", step(3)).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ((*jobs)->AddLateStep(id, 7, "w-a", step(3)).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ((*jobs)->Get(id)->summary().steps(), 0);
  ASSERT_TRUE((*jobs)->AddLateStep(id, 1, "w-a", step(3)).ok());
  EXPECT_EQ((*jobs)->Get(id)->summary().steps(), 1);
  EXPECT_EQ((*jobs)->Get(id)->step(), 3);
  EXPECT_EQ((*jobs)->Get(id)->rank0_first_generation(), 1);
}

// A job placed before Job.rank0_workers existed (its record names no
// worker for its generation 1), placed again by an upgraded coordinator:
// generation 1's late steps are trusted, generation 2's are checked; the
// map keeps the newest kMaxRank0Workers generations.
TEST(JobManager, ALateStepOfAGenerationPlacedBeforeTheRecordNamedWorkersIsTrusted) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-late-upgrade";
  FakeClock clock;
  auto jobs = JobManager::Open(dir, &clock);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  auto job = (*jobs)->Submit(TrainSpec(), "");
  ASSERT_TRUE(job.ok());
  const std::string id = job->job_id();
  ASSERT_TRUE((*jobs)->Schedule(id, v1::MeshSpec()).ok());  // no ranks: nothing recorded, as an older coordinator
  ASSERT_TRUE((*jobs)->Restart(id, "the coordinator restarted", "restarting").ok());
  v1::MeshSpec mesh;
  mesh.set_world_size(1);
  mesh.add_ranks()->set_worker_id("w-new");
  ASSERT_TRUE((*jobs)->Schedule(id, mesh).ok());
  EXPECT_EQ((*jobs)->Get(id)->rank0_first_generation(), 2);
  v1::StepProgress p;
  p.set_step(4);
  p.set_loss(1.0);
  p.mutable_step_duration()->set_nanos(1000);
  EXPECT_TRUE((*jobs)->AddLateStep(id, 1, "w-old", p).ok());
  p.set_step(5);
  EXPECT_EQ((*jobs)->AddLateStep(id, 2, "w-old", p).code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ((*jobs)->Get(id)->summary().steps(), 1);
  for (size_t g = 0; g < JobManager::kMaxRank0Workers + 5; ++g) {
    ASSERT_TRUE((*jobs)->Restart(id, "lost", "restarting").ok());
    ASSERT_TRUE((*jobs)->Schedule(id, mesh).ok());
  }
  const v1::Job j = *(*jobs)->Get(id);
  EXPECT_EQ(j.rank0_workers_size(), static_cast<int>(JobManager::kMaxRank0Workers));
  EXPECT_EQ(j.rank0_workers().count(2), 0u);  // the oldest went
  EXPECT_EQ(j.rank0_workers().count(j.generation()), 1u);
}

// A trained step of `n` (as rank 0 reports it).
v1::StepProgress TrainedStep(int64_t n) {
  v1::StepProgress p;
  p.set_step(n);
  p.set_loss(1.0 / static_cast<double>(n));
  p.mutable_step_duration()->set_nanos(1000);
  p.set_tokens(1000);
  return p;
}

// A long job's record is written as it grows, not again whole at each
// step: what each step writes is about the job and the step (a log entry),
// however long the history, so a run of N steps costs O(N) in bytes, not
// O(N^2) (before, every second's write was the whole history). The history
// reopens whole.
TEST(JobManager, ALongHistoryIsWrittenAsItGrowsNotWholeEachTime) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-long";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  constexpr int kSteps = 1500;
  std::string id;
  int64_t written = 0, job_bytes = 0;
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    v1::JobSpec spec = TrainSpec();
    spec.mutable_train()->set_steps(kSteps);
    id = (*jobs)->Submit(spec, "")->job_id();
    ASSERT_TRUE((*jobs)->Schedule(id, v1::MeshSpec()).ok());
    ASSERT_TRUE((*jobs)->SetState(id, v1::JOB_STATE_RUNNING, "go").ok());
    const int64_t before = (*jobs)->RecordBytesWritten();
    for (int n = 1; n <= kSteps; ++n) {
      clock.Advance(absl::Seconds(2));  // every step is written (at most one a second is)
      ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(n)).ok());
    }
    written = (*jobs)->RecordBytesWritten() - before;
    job_bytes = static_cast<int64_t>((*jobs)->Get(id)->ByteSizeLong());
    // The log is folded into the snapshot once it outgrows it.
    const int64_t log = static_cast<int64_t>(std::filesystem::file_size(dir + "/" + id + ".log"));
    const int64_t snapshot = static_cast<int64_t>(std::filesystem::file_size(dir + "/" + id + ".pb"));
    EXPECT_LE(log, std::max<int64_t>(JobManager::kMinLogBytes, snapshot) + 2 * job_bytes + 1024);
  }
  // Each step's entry is the job and one event; the snapshots add a
  // constant factor. The whole history each time would be ~kSteps/2 events
  // a step (about 50 KB).
  EXPECT_LT(written / kSteps, 4 * (job_bytes + 200)) << written << " bytes for " << kSteps << " steps";
  auto reopened = JobManager::Open(dir, &clock);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ((*reopened)->Get(id)->step(), kSteps);
  auto events = (*reopened)->WaitForEvents(id, 1, absl::ZeroDuration());
  ASSERT_TRUE(events.ok());
  int steps = 0;
  for (size_t i = 0; i < events->events.size(); ++i) {
    EXPECT_EQ(events->events[i].sequence(), static_cast<int64_t>(i) + 1);
    steps += events->events[i].has_step();
  }
  EXPECT_EQ(steps, kSteps);
  // Open folded the log into a new snapshot.
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + id + ".log"));
}

// A watcher sees only events written to the data dir: a step of the last
// second waits for its write (the next change past the second, FlushStale,
// or Flush). So a coordinator killed before the write (here: a manager
// dropped without Flush) takes back nothing a watcher saw, and the
// sequence numbers it hands out next were never seen with other events.
TEST(JobManager, AWatcherSeesOnlyWhatACrashCannotTakeBack) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-published";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  std::string id;
  std::vector<v1::JobEvent> seen;
  auto watch = [&](JobManager& jobs) {
    auto got = jobs.WaitForEvents(id, static_cast<int64_t>(seen.size()) + 1, absl::ZeroDuration());
    ASSERT_TRUE(got.ok()) << got.status();
    seen.insert(seen.end(), got->events.begin(), got->events.end());
  };
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    id = (*jobs)->Submit(TrainSpec(), "")->job_id();
    ASSERT_TRUE((*jobs)->Schedule(id, v1::MeshSpec()).ok());
    ASSERT_TRUE((*jobs)->SetState(id, v1::JOB_STATE_RUNNING, "go").ok());
    watch(**jobs);
    ASSERT_EQ(seen.size(), 3u);  // PENDING, SCHEDULED, RUNNING: state changes are written at once
    clock.Advance(absl::Seconds(2));
    ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(1)).ok());  // written: a second since the last write
    ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(2)).ok());  // within the second: waits
    watch(**jobs);
    ASSERT_EQ(seen.size(), 4u);
    EXPECT_EQ(seen.back().step().step(), 1);
    (*jobs)->FlushStale();  // not a second yet
    watch(**jobs);
    EXPECT_EQ(seen.size(), 4u);
    clock.Advance(JobManager::kStepWriteInterval);
    (*jobs)->FlushStale();
    watch(**jobs);
    ASSERT_EQ(seen.size(), 5u);
    EXPECT_EQ(seen.back().step().step(), 2);
    // A waiting watcher wakes once the step is written.
    ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(3)).ok());
    std::thread writer([&] {
      absl::SleepFor(absl::Milliseconds(50));
      clock.Advance(JobManager::kStepWriteInterval);
      (*jobs)->FlushStale();
    });
    auto woke = (*jobs)->WaitForEvents(id, 6, absl::Seconds(30));
    writer.join();
    ASSERT_TRUE(woke.ok());
    ASSERT_EQ(woke->events.size(), 1u);
    seen.push_back(woke->events[0]);
    EXPECT_EQ(seen.back().step().step(), 3);
    ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(4)).ok());  // never written: the "crash" takes it
    watch(**jobs);
    EXPECT_EQ(seen.size(), 6u);
  }
  auto reopened = JobManager::Open(dir, &clock);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  auto after = (*reopened)->WaitForEvents(id, 1, absl::ZeroDuration());
  ASSERT_TRUE(after.ok());
  // Every event seen is there under its sequence number; the next ones
  // (the restart's) follow them.
  ASSERT_GT(after->events.size(), seen.size());
  for (size_t i = 0; i < seen.size(); ++i) {
    EXPECT_EQ(after->events[i].SerializeAsString(), seen[i].SerializeAsString()) << "sequence " << i + 1;
  }
  EXPECT_EQ(after->events[seen.size()].state_change().state(), v1::JOB_STATE_RESTARTING);
}

// A watcher's batch: at most max_events events at a time, in order, and
// `finished` only with the batch that reaches the ended job's last event.
TEST(JobManager, WaitForEventsHandsOutAtMostItsBatch) {
  JobManager jobs;
  auto a = jobs.Submit(TrainSpec(), "");
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(jobs.Schedule(a->job_id(), v1::MeshSpec()).ok());
  ASSERT_TRUE(jobs.SetState(a->job_id(), v1::JOB_STATE_RUNNING, "go").ok());
  for (int n = 1; n <= 6; ++n) ASSERT_TRUE(jobs.AddStep(a->job_id(), TrainedStep(n)).ok());
  ASSERT_TRUE(jobs.Cancel(a->job_id(), "operator").ok());  // 10 events in all
  int64_t next = 1;
  int batches = 0;
  for (bool finished = false; !finished; ++batches) {
    ASSERT_LT(batches, 10);
    auto got = jobs.WaitForEvents(a->job_id(), next, absl::ZeroDuration(), 3);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_FALSE(got->events.empty());
    EXPECT_LE(got->events.size(), 3u);
    for (const v1::JobEvent& e : got->events) EXPECT_EQ(e.sequence(), next++);
    finished = got->finished;
    EXPECT_EQ(finished, next == 11) << "after event " << next - 1;
  }
  EXPECT_EQ(batches, 4);
}

// Each trained step is recorded once, whatever order its reports come in
// and however often (a resumed run's re-run steps, late reports of an
// earlier attempt): the history holds each step once, and the summary
// counts it once.
TEST(JobManager, EachTrainedStepIsRecordedOnceInWhateverOrderItComes) {
  JobManager jobs;
  v1::JobSpec spec = TrainSpec();
  spec.mutable_train()->set_steps(300);
  auto a = jobs.Submit(spec, "");
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(jobs.Schedule(a->job_id(), v1::MeshSpec()).ok());
  ASSERT_TRUE(jobs.SetState(a->job_id(), v1::JOB_STATE_RUNNING, "go").ok());
  std::vector<int64_t> reports;
  for (int64_t n = 1; n <= 300; n += 3) reports.push_back(n);  // runs with holes, filled later in any order
  for (int64_t n = 300; n >= 1; --n) reports.push_back(n);
  std::mt19937 rng(7);
  for (int i = 0; i < 200; ++i) reports.push_back(1 + static_cast<int64_t>(rng() % 300));
  std::shuffle(reports.begin() + 100, reports.end(), rng);
  for (int64_t n : reports) ASSERT_TRUE(jobs.AddStep(a->job_id(), TrainedStep(n)).ok()) << n;
  auto events = jobs.WaitForEvents(a->job_id(), 1, absl::ZeroDuration());
  ASSERT_TRUE(events.ok());
  std::vector<int64_t> steps;
  for (const v1::JobEvent& e : events->events) {
    if (e.has_step()) steps.push_back(e.step().step());
  }
  std::sort(steps.begin(), steps.end());
  std::vector<int64_t> want(300);
  std::iota(want.begin(), want.end(), 1);
  EXPECT_EQ(steps, want);
  EXPECT_EQ(jobs.Get(a->job_id())->summary().steps(), 300);
  EXPECT_EQ(jobs.Get(a->job_id())->step(), 300);
}

// Steps are written at most once a second; Flush (the coordinator's
// clean stop) writes the ones of the last second, so a restart after a
// clean stop has every step watchers saw, and nothing else is written.
TEST(JobManager, FlushWritesTheStepsOfTheLastSecond) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-flush";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  auto jobs = JobManager::Open(dir, &clock);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  const std::string id = (*jobs)->Submit(TrainSpec(), "")->job_id();
  const std::string idle = (*jobs)->Submit(TrainSpec(), "")->job_id();
  ASSERT_TRUE((*jobs)->SetState(id, v1::JOB_STATE_RUNNING, "go").ok());
  ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(1)).ok());
  ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(2)).ok());
  EXPECT_EQ(JobManager::ReadRecord(dir, id)->job().step(), 0);  // within the second: not yet
  std::map<std::string, int> writes;
  (*jobs)->SetBeforeWriteForTest([&](const std::string& job) { ++writes[job]; });
  (*jobs)->Flush();
  absl::StatusOr<v1::JobRecord> record = JobManager::ReadRecord(dir, id);
  ASSERT_TRUE(record.ok()) << record.status();
  EXPECT_EQ(record->job().step(), 2);
  int steps = 0;
  for (const v1::JobEvent& e : record->events()) steps += e.has_step();
  EXPECT_EQ(steps, 2);
  EXPECT_EQ(writes, (std::map<std::string, int>{{id, 1}}));  // not `idle`'s: nothing new
  (*jobs)->Flush();  // nothing new at all
  EXPECT_EQ(writes, (std::map<std::string, int>{{id, 1}}));
  (*jobs)->SetBeforeWriteForTest(nullptr);
}

// What a crash can leave in a job's log: an entry cut short at its end is
// not taken (the record is what was whole before it); entries older than
// the snapshot (a crash between a snapshot's rename and the log's removal)
// are passed over rather than rolling the job back; a log whose snapshot
// is gone (a delete cut short) is removed. A failed append (a full disk)
// loses nothing: the next write takes every change since.
TEST(JobManager, ALogCutShortOrOlderThanItsSnapshotIsReadBackSafely) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-log-crash";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  std::string id;
  const std::string saved = dir + "-saved.log";
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    id = (*jobs)->Submit(TrainSpec(), "")->job_id();
    ASSERT_TRUE((*jobs)->Schedule(id, v1::MeshSpec()).ok());
    ASSERT_TRUE((*jobs)->SetState(id, v1::JOB_STATE_RUNNING, "go").ok());
    for (int n = 1; n <= 3; ++n) {
      clock.Advance(absl::Seconds(2));
      ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(n)).ok());
    }
    std::filesystem::copy_file(dir + "/" + id + ".log", saved);
    {
      testing::FullDisk disk(16);  // the log is longer: the append fails
      clock.Advance(absl::Seconds(2));
      ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(4)).ok());  // logged; the change stands in memory
    }
    EXPECT_EQ(JobManager::ReadRecord(dir, id)->job().step(), 3);
    clock.Advance(absl::Seconds(2));
    ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(5)).ok());  // writes steps 4 and 5
    EXPECT_EQ(JobManager::ReadRecord(dir, id)->job().step(), 5);
  }
  const std::string log = dir + "/" + id + ".log";
  {
    std::ofstream out(log, std::ios::binary | std::ios::app);
    out << std::string("\x40\x00\x00\x00partial", 11);  // an entry of 64 bytes, 7 of them written
  }
  std::string tail;
  absl::StatusOr<v1::JobRecord> read = JobManager::ReadRecord(dir, id, &tail);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->job().step(), 5);
  EXPECT_EQ(tail.size(), 11u);
  int64_t events = read->events_size();
  {
    auto jobs = JobManager::Open(dir, &clock);  // folds the log in: the snapshot is newer than `saved`'s entries
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    EXPECT_EQ((*jobs)->Get(id)->step(), 5);
    events = (*jobs)->WaitForEvents(id, 1, absl::ZeroDuration())->events.size();
  }
  EXPECT_FALSE(std::filesystem::exists(log));
  std::filesystem::copy_file(saved, log);  // older entries beside a newer snapshot
  read = JobManager::ReadRecord(dir, id, &tail);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->job().step(), 5);  // not rolled back to step 3
  EXPECT_EQ(read->events_size(), events);
  EXPECT_TRUE(tail.empty());
  // A log alone is removed; a snapshot that does not parse is set aside with its log.
  std::ofstream(dir + "/job-000077.log") << "orphan";
  std::ofstream(dir + "/job-000078.pb") << "not a record";
  std::ofstream(dir + "/job-000078.log") << "its log";
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    EXPECT_EQ((*jobs)->Get(id)->step(), 5);
  }
  EXPECT_FALSE(std::filesystem::exists(dir + "/job-000077.log"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/job-000078.pb.damaged"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/job-000078.log.damaged"));
}

// A log folded into its snapshot at start (here one ending in a torn
// entry, a crash mid-append) whose rewrite fails (a full disk) is folded
// by the next write, whole: a change appended after the torn entry would
// never be read back (the job's cancel, a new generation, lost at the next
// start).
TEST(JobManager, AFoldThatFailsAtStartLeavesTheNextWriteWhole) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-fold-fails";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  std::string id;
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    id = (*jobs)->Submit(TrainSpec(), "")->job_id();
    ASSERT_TRUE((*jobs)->Schedule(id, v1::MeshSpec()).ok());
    ASSERT_TRUE((*jobs)->SetState(id, v1::JOB_STATE_RUNNING, "go").ok());
    clock.Advance(absl::Seconds(2));
    ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(1)).ok());
  }
  const std::string log = dir + "/" + id + ".log";
  ASSERT_TRUE(std::filesystem::exists(log));
  {
    std::ofstream out(log, std::ios::binary | std::ios::app);
    out << std::string("\x40\x00\x00\x00partial", 11);  // an entry of 64 bytes, 7 of them written
  }
  {
    std::optional<testing::FullDisk> disk(std::in_place, 16);  // the fold cannot be written
    auto jobs = JobManager::Open(dir, &clock);
    disk.reset();
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    ASSERT_TRUE(std::filesystem::exists(log)) << "the fold was written after all";
    ASSERT_TRUE((*jobs)->Cancel(id, "after the restart").ok());
    EXPECT_FALSE(std::filesystem::exists(log)) << "the change was appended after the torn entry";
  }
  auto reopened = JobManager::Open(dir, &clock);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  const v1::Job job = *(*reopened)->Get(id);
  EXPECT_EQ(job.state(), v1::JOB_STATE_CANCELLED) << job.reason();
}

// A record that cannot be written for want of room asks for room (the
// coordinator gives up its reserve): the write, tried again, puts on disk
// what watchers are sent, so a crash then takes nothing back. Meanwhile no
// new job is admitted; a submit's own first record never asks for room.
TEST(JobManager, AFullDiskAsksForRoomSoThatWhatWatchersSeeIsOnDisk) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-room";
  FakeClock clock;
  auto jobs = JobManager::Open(dir, &clock);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  std::optional<testing::FullDisk> disk;
  int asked = 0;
  bool admitting = true;
  JobManager::RoomHooks room;
  room.make_room = [&] {  // the reserve's file removed: the disk has room again
    ++asked;
    const bool made = disk.has_value();
    disk.reset();
    return made;
  };
  room.admit = [&]() -> absl::Status {
    return admitting ? absl::OkStatus() : absl::ResourceExhaustedError("the data dir is full");
  };
  (*jobs)->SetRoomHooks(room);
  const std::string id = (*jobs)->Submit(TrainSpec(), "")->job_id();
  ASSERT_TRUE((*jobs)->Schedule(id, v1::MeshSpec()).ok());
  ASSERT_TRUE((*jobs)->SetState(id, v1::JOB_STATE_RUNNING, "go").ok());
  clock.Advance(absl::Seconds(2));
  ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(1)).ok());
  disk.emplace(16);  // no record grows now
  clock.Advance(absl::Seconds(2));
  ASSERT_TRUE((*jobs)->AddStep(id, TrainedStep(2)).ok());
  EXPECT_EQ(asked, 1);
  EXPECT_FALSE(disk.has_value());
  EXPECT_EQ(JobManager::ReadRecord(dir, id)->job().step(), 2) << "the step watchers are sent is on disk";
  absl::StatusOr<JobManager::Events> seen = (*jobs)->WaitForEvents(id, 1, absl::ZeroDuration());
  ASSERT_TRUE(seen.ok()) << seen.status();
  EXPECT_EQ(static_cast<int64_t>(seen->events.size()), JobManager::ReadRecord(dir, id)->events_size());
  // While the room is short, no new job.
  admitting = false;
  const absl::StatusOr<v1::Job> refused = (*jobs)->Submit(TrainSpec(), "");
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_EQ(refused.status().message(), "the data dir is full");
  // A submit whose record cannot be written does not take the room.
  admitting = true;
  {
    testing::FullDisk full(16);
    const absl::StatusOr<v1::Job> unrecorded = (*jobs)->Submit(TrainSpec(), "");
    EXPECT_EQ(unrecorded.status().code(), absl::StatusCode::kResourceExhausted) << unrecorded.status();
  }
  EXPECT_EQ(asked, 1);
}

// A change whose record cannot be written (a CancelJob on a full disk)
// stands, and reaches the disk once the disk has room: FlushStale tries
// again, the wait doubling with each failure, so that a coordinator that
// restarts then finds the job cancelled, not running (which it would
// restart).
TEST(JobManager, AChangeThatCannotBeWrittenIsWrittenOnceTheDiskHasRoom) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-retry";
  std::filesystem::remove_all(dir);
  FakeClock clock;
  std::string id;
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    id = (*jobs)->Submit(TrainSpec(), "")->job_id();
    ASSERT_TRUE((*jobs)->Schedule(id, v1::MeshSpec()).ok());
    ASSERT_TRUE((*jobs)->SetState(id, v1::JOB_STATE_RUNNING, "go").ok());
    auto on_disk = [&] { return JobManager::ReadRecord(dir, id)->job().state(); };
    {
      testing::FullDisk disk(16);
      const absl::StatusOr<v1::Job> cancelled = (*jobs)->Cancel(id, "stop");
      ASSERT_TRUE(cancelled.ok()) << cancelled.status();
      EXPECT_EQ(cancelled->state(), v1::JOB_STATE_CANCELLED);
      EXPECT_EQ((*jobs)->Get(id)->state(), v1::JOB_STATE_CANCELLED) << "the cancel stands";
      EXPECT_EQ(on_disk(), v1::JOB_STATE_RUNNING);
      clock.Advance(JobManager::kStepWriteInterval);
      (*jobs)->FlushStale();  // one failure: it waits twice the interval
      EXPECT_EQ(on_disk(), v1::JOB_STATE_RUNNING);
      clock.Advance(JobManager::kStepWriteInterval);
      (*jobs)->FlushStale();  // tried, and failed again: four times the interval now
      EXPECT_EQ(on_disk(), v1::JOB_STATE_RUNNING);
    }
    clock.Advance(3 * JobManager::kStepWriteInterval);
    (*jobs)->FlushStale();
    EXPECT_EQ(on_disk(), v1::JOB_STATE_RUNNING) << "tried again before its wait";
    clock.Advance(JobManager::kStepWriteInterval);
    (*jobs)->FlushStale();
    EXPECT_EQ(on_disk(), v1::JOB_STATE_CANCELLED);
    // Written: it waits for no further try.
    int writes = 0;
    (*jobs)->SetBeforeWriteForTest([&](const std::string&) { ++writes; });
    clock.Advance(JobManager::kMaxWriteRetryInterval);
    (*jobs)->FlushStale();
    EXPECT_EQ(writes, 0);
    (*jobs)->SetBeforeWriteForTest(nullptr);
  }
  auto reopened = JobManager::Open(dir, &clock);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ((*reopened)->Get(id)->state(), v1::JOB_STATE_CANCELLED);
}

TEST(JobManager, RecordsSurviveAReopenAndRunningJobsRestartOrFailWithTheirCheckpoint) {
  const std::string dir = std::string(std::getenv("TEST_TMPDIR")) + "/jobs-reopen";
  FakeClock clock;
  std::string r_uid;
  {
    auto jobs = JobManager::Open(dir, &clock);
    ASSERT_TRUE(jobs.ok()) << jobs.status();
    auto a = (*jobs)->Submit(TrainSpec(), "submit-a");  // stays pending
    v1::JobSpec no_restarts = TrainSpec();
    no_restarts.mutable_restart()->set_max_restarts(0);
    auto b = (*jobs)->Submit(no_restarts, "");  // runs, checkpoints, then the coordinator dies
    auto r = (*jobs)->Submit(TrainSpec(), "");  // the same with the default policy, restarted once before
    ASSERT_TRUE(a.ok() && b.ok() && r.ok());
    r_uid = r->uid();
    v1::MeshSpec mesh;
    mesh.set_world_size(4);
    ASSERT_TRUE((*jobs)->Schedule(r->job_id(), mesh).ok());
    auto restarting = (*jobs)->Restart(r->job_id(), "rank 1 (worker w1 at x) was lost", "restarting (restart 1 of 3)");
    ASSERT_TRUE(restarting.ok()) << restarting.status();
    EXPECT_EQ(restarting->state(), v1::JOB_STATE_RESTARTING);
    EXPECT_EQ(restarting->restarts(), 1);
    ASSERT_TRUE((*jobs)->Schedule(r->job_id(), mesh).ok());  // placed again from RESTARTING
    ASSERT_TRUE((*jobs)->SetState(r->job_id(), v1::JOB_STATE_RUNNING, "training").ok());
    ASSERT_TRUE((*jobs)->Schedule(b->job_id(), mesh).ok());
    ASSERT_TRUE((*jobs)->SetState(b->job_id(), v1::JOB_STATE_RUNNING, "training").ok());
    v1::StepProgress step;
    step.set_step(3);
    step.set_loss(2.5);
    step.set_checkpoint("/ck/step-000003");
    ASSERT_TRUE((*jobs)->AddStep(b->job_id(), step).ok());
    // Steps are recorded at most once a second: step 4 at once is not,
    // step 5 two seconds later is (with step 4 in its history).
    step.clear_checkpoint();
    step.set_step(4);
    ASSERT_TRUE((*jobs)->AddStep(b->job_id(), step).ok());
    clock.Advance(absl::Seconds(2));
    step.set_step(5);
    ASSERT_TRUE((*jobs)->AddStep(b->job_id(), step).ok());
    step.set_step(6);  // within the second again: only in memory when the coordinator dies
    ASSERT_TRUE((*jobs)->AddStep(b->job_id(), step).ok());
    EXPECT_EQ((*jobs)->Schedule(b->job_id(), mesh).status().code(), absl::StatusCode::kFailedPrecondition);
  }
  auto jobs = JobManager::Open(dir, &clock);
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  // The job without restarts failed by the coordinator's restart counts as
  // one that ended in this process; the pending one has not ended, and the
  // other running one restarts (a coordinator restart is not counted
  // against its policy).
  EXPECT_EQ((*jobs)->FinishedCounts(),
            (std::map<std::string, int64_t>{{"cancelled", 0}, {"failed", 1}, {"succeeded", 0}}));
  const std::vector<v1::Job> all = (*jobs)->List({});
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].state(), v1::JOB_STATE_PENDING);
  EXPECT_EQ(all[1].state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(all[1].reason(), "the coordinator restarted while the job ran; resume from /ck/step-000003");
  EXPECT_EQ(all[1].step(), 5);
  EXPECT_EQ(all[1].generation(), 1);
  EXPECT_EQ(all[2].state(), v1::JOB_STATE_RESTARTING);
  EXPECT_EQ(all[2].uid(), r_uid);  // recorded: its checkpoints stay its own
  EXPECT_EQ(all[2].reason(), "the coordinator restarted while the job ran; placing it again");
  EXPECT_EQ(all[2].restarts(), 1);
  EXPECT_EQ(all[2].generation(), 2);
  EXPECT_EQ(std::vector<std::string>(all[2].attempt_failures().begin(), all[2].attempt_failures().end()),
            std::vector<std::string>{"rank 1 (worker w1 at x) was lost"});
  ASSERT_TRUE((*jobs)->Schedule(all[2].job_id(), v1::MeshSpec()).ok());
  // A submit retried with its request id after the restart is recognized.
  auto again = (*jobs)->Submit(TrainSpec(), "submit-a");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->job_id(), all[0].job_id());
  // The whole history is there, and new ids do not reuse old ones.
  auto events = (*jobs)->WaitForEvents(all[1].job_id(), 1, absl::ZeroDuration());
  ASSERT_TRUE(events.ok());
  ASSERT_EQ(events->events.size(), 7u);  // pending, scheduled, running, steps 3-5, failed
  EXPECT_EQ(events->events[3].step().loss(), 2.5);
  EXPECT_TRUE(events->finished);
  // An ended job's history is closed.
  EXPECT_EQ((*jobs)->AddStep(all[1].job_id(), v1::StepProgress()).code(), absl::StatusCode::kFailedPrecondition);
  v1::RankStatus phase;
  phase.set_phase(v1::RANK_PHASE_TRAINING);
  EXPECT_EQ((*jobs)->AddRankStatus(all[1].job_id(), phase).code(), absl::StatusCode::kFailedPrecondition);
  auto c = (*jobs)->Submit(TrainSpec(), "");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->job_id(), "job-000004");

  // A damaged record is set aside and the others load; its id is not reused.
  std::ofstream(dir + "/job-000009.pb") << "not a record";
  auto reopened = JobManager::Open(dir, &clock);
  ASSERT_TRUE(reopened.ok()) << reopened.status();
  EXPECT_EQ((*reopened)->List({}).size(), 4u);
  EXPECT_TRUE(std::filesystem::exists(dir + "/job-000009.pb.damaged"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/job-000009.pb"));
  auto d = (*reopened)->Submit(TrainSpec(), "");
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->job_id(), "job-000010");
  reopened->reset();
  // So is a directory of a record's name; a next-id that is there but
  // cannot be read fails the start (ids of deleted jobs could come back).
  std::filesystem::create_directory(dir + "/job-000011.pb");
  auto with_dir = JobManager::Open(dir, &clock);
  ASSERT_TRUE(with_dir.ok()) << with_dir.status();
  EXPECT_EQ((*with_dir)->List({}).size(), 5u);
  EXPECT_TRUE(std::filesystem::is_directory(dir + "/job-000011.pb.damaged"));
  with_dir->reset();
  std::filesystem::remove(dir + "/next-id");
  std::filesystem::create_directory(dir + "/next-id");
  EXPECT_EQ(JobManager::Open(dir, &clock).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ValidateJobSpec, RestartPolicy) {
  v1::JobSpec s = TrainSpec();
  EXPECT_EQ(RestartLimitsOf(s).max_restarts, 3);
  EXPECT_EQ(RestartLimitsOf(s).worker_wait, absl::Minutes(5));
  s.mutable_restart()->set_max_restarts(0);
  EXPECT_EQ(RestartLimitsOf(s).max_restarts, 0);  // set to 0: none, not the default
  s.mutable_restart()->set_max_restarts(101);
  ExpectInvalid(s, "spec.restart.max_restarts");
  EXPECT_EQ(RestartLimitsOf(s).max_restarts, kMaxRestarts);  // a record no longer checked is bounded still
  s.mutable_restart()->set_max_restarts(-1);
  ExpectInvalid(s, "spec.restart.max_restarts");
  EXPECT_EQ(RestartLimitsOf(s).max_restarts, 0);  // found by job_validation_fuzz
  s = TrainSpec();
  s.mutable_restart()->mutable_worker_wait()->set_seconds(-5);
  ExpectInvalid(s, "spec.restart.worker_wait");
  s.mutable_restart()->mutable_worker_wait()->set_seconds(8 * 24 * 3600);
  ExpectInvalid(s, "spec.restart.worker_wait");
  EXPECT_EQ(RestartLimitsOf(s).worker_wait, kMaxWorkerWait);
  s.mutable_restart()->mutable_worker_wait()->set_seconds(30);
  EXPECT_TRUE(ValidateJobSpec(s).ok());
  EXPECT_EQ(RestartLimitsOf(s).worker_wait, absl::Seconds(30));
  v1::JobSpec tensor;
  tensor.set_kind(v1::JOB_KIND_TENSOR);
  tensor.mutable_shard()->set_tensor_parallel_size(2);
  tensor.mutable_shard()->set_data_parallel_size(1);
  EXPECT_EQ(RestartLimitsOf(tensor).max_restarts, 0);
  tensor.mutable_restart()->set_max_restarts(1);
  ExpectInvalid(tensor, "spec.restart.max_restarts");
  EXPECT_TRUE(IsRetryableRankError(absl::StatusCode::kUnavailable));
  EXPECT_TRUE(IsRetryableRankError(absl::StatusCode::kDeadlineExceeded));
  EXPECT_TRUE(IsRetryableRankError(absl::StatusCode::kAborted));
  EXPECT_FALSE(IsRetryableRankError(absl::StatusCode::kInvalidArgument));
  EXPECT_FALSE(IsRetryableRankError(absl::StatusCode::kNotFound));
  EXPECT_FALSE(IsRetryableRankError(absl::StatusCode::kResourceExhausted));
}

}  // namespace
}  // namespace colod
