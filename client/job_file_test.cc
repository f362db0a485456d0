#include "client/job_file.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

constexpr char kYaml[] = R"(
name: tiny
kind: JOB_KIND_TRAIN
model:
  configJson: '{"model_type": "gpt2"}'
  weightsPath: /models/tiny
shard:
  tensor_parallel_size: 2
  dataParallelSize: 2
  tensorParallelMode: TENSOR_PARALLEL_MODE_1D
  sequenceParallel: true
train:
  steps: 100
  batchSize: 8
  seqLen: 64
  learningRate: 3e-4
  dataPath: /data/train.bin
labels:
  team: "42"
)";

constexpr char kJson[] = R"({
  "name": "tiny", "kind": "JOB_KIND_TRAIN",
  "model": {"configJson": "{\"model_type\": \"gpt2\"}", "weightsPath": "/models/tiny"},
  "shard": {"tensorParallelSize": 2, "dataParallelSize": 2, "tensorParallelMode": "TENSOR_PARALLEL_MODE_1D",
            "sequenceParallel": true},
  "train": {"steps": 100, "batchSize": 8, "seqLen": 64, "learningRate": 0.0003, "dataPath": "/data/train.bin"},
  "labels": {"team": "42"}
})";

TEST(JobFile, YamlAndJsonGiveTheSameSpec) {
  auto from_yaml = ParseJobSpec(kYaml, /*yaml=*/true);
  auto from_json = ParseJobSpec(kJson, /*yaml=*/false);
  ASSERT_TRUE(from_yaml.ok()) << from_yaml.status();
  ASSERT_TRUE(from_json.ok()) << from_json.status();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(*from_yaml, *from_json))
      << from_yaml->DebugString() << "\nvs\n" << from_json->DebugString();
  EXPECT_EQ(from_yaml->shard().tensor_parallel_size(), 2);
  EXPECT_TRUE(from_yaml->shard().sequence_parallel());
  EXPECT_DOUBLE_EQ(from_yaml->train().learning_rate(), 3e-4);
  EXPECT_EQ(from_yaml->labels().at("team"), "42");
}

TEST(JobFile, MistakesNameTheFileAndTheProblem) {
  auto unknown = ParseJobSpec("shard:\n  tensor_parallel_sise: 2\n", true, "job.yaml");
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unknown.status().message().find("job.yaml"), absl::string_view::npos) << unknown.status();
  EXPECT_NE(unknown.status().message().find("tensor_parallel_sise"), absl::string_view::npos) << unknown.status();
  auto syntax = ParseJobSpec("shard: [1, 2\n", true, "job.yaml");
  EXPECT_EQ(syntax.status().code(), absl::StatusCode::kInvalidArgument);
  auto type = ParseJobSpec(R"({"train": {"steps": "many"}})", false, "job.json");
  EXPECT_EQ(type.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadJobFile("/nonexistent/job.yaml").status().code(), absl::StatusCode::kNotFound);
}

// Aliases are references: ten lines that nest them would expand to 10^9
// values, and a node aliased inside itself has no end. Both are refused
// after a bounded walk.
TEST(JobFile, AliasBombsAndSelfReferencesAreRefused) {
  std::string bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n";
  for (int i = 1; i < 10; ++i) {
    bomb += absl::StrCat("a", i, ": &a", i, " [");
    for (int k = 0; k < 10; ++k) absl::StrAppend(&bomb, k > 0 ? ", " : "", "*a", i - 1);
    bomb += "]\n";
  }
  auto laughs = ParseJobSpec(bomb, true, "job.yaml");
  EXPECT_EQ(laughs.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(laughs.status().message().find("aliases count each time"), absl::string_view::npos) << laughs.status();
  auto deep = ParseJobSpec(std::string(200, '[') + std::string(200, ']'), true, "job.yaml");
  EXPECT_EQ(deep.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(deep.status().message().find("nested over 64 deep"), absl::string_view::npos) << deep.status();
  // A node aliased inside itself: refused whether YAML takes it or not.
  EXPECT_EQ(ParseJobSpec("a: &a [x, *a]\n", true, "job.yaml").status().code(), absl::StatusCode::kInvalidArgument);
  // Aliases within the bounds are what YAML users write: accepted.
  auto fine = ParseJobSpec("labels: &l {team: \"42\"}\nname: tiny\n", true, "job.yaml");
  EXPECT_TRUE(fine.ok()) << fine.status();
}

}  // namespace
}  // namespace colod
