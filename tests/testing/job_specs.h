// Job specs for tests that validate, schedule or admit jobs without running
// them on a model of their own: a tiny GPT-2 (257 tokens, 64 wide, 2 layers)
// trained on the GPL-3 text, and a TENSOR job.
#ifndef COLOD_TESTS_TESTING_JOB_SPECS_H_
#define COLOD_TESTS_TESTING_JOB_SPECS_H_

#include <string>

#include "colod/v1/job.pb.h"

namespace colod::testing {

inline constexpr char kTinyGpt2Config[] =
    R"({"model_type": "gpt2", "vocab_size": 257, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64})";

// One step of batch 2 and 16 tokens at tp x dp, the model at /models/gpt2-tiny
// (not read: these jobs never reach a worker that loads it).
inline v1::JobSpec TinyTrainSpec(int tp = 1, int dp = 1, const std::string& config_json = kTinyGpt2Config) {
  v1::JobSpec s;
  s.set_kind(v1::JOB_KIND_TRAIN);
  s.mutable_model()->set_config_json(config_json);
  s.mutable_model()->set_weights_path("/models/gpt2-tiny");
  s.mutable_shard()->set_tensor_parallel_size(tp);
  s.mutable_shard()->set_data_parallel_size(dp);
  v1::TrainConfig& t = *s.mutable_train();
  t.set_steps(1);
  t.set_batch_size(2 * dp);
  t.set_seq_len(16);
  t.set_learning_rate(1e-3);
  t.set_data_path("/usr/share/common-licenses/GPL-3");
  return s;
}

inline v1::JobSpec TensorJobSpec(int tp = 1, int dp = 1) {
  v1::JobSpec s;
  s.set_kind(v1::JOB_KIND_TENSOR);
  s.mutable_shard()->set_tensor_parallel_size(tp);
  s.mutable_shard()->set_data_parallel_size(dp);
  return s;
}

}  // namespace colod::testing

#endif  // COLOD_TESTS_TESTING_JOB_SPECS_H_
