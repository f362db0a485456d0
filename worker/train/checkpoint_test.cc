// Checkpoint retention (PruneCheckpoints, TrainOptions::keep_last and
// keep_best): the newest K and the best by held-out loss are kept, nothing
// being written or unreadable is touched, a crashed removal's leftovers go,
// and a full disk during a save loses no checkpoint.
#include "worker/train/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>

#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/grpc_status.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "spec/job_validation.h"
#include "tests/testing/full_disk.h"
#include "tests/testing/no_rename_exchange.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/model_files.h"
#include "worker/shardformer/run_forward.h"
#include "worker/shardformer/safetensors.h"
#include "worker/shardformer/testing.h"
#include "worker/train/train_testing.h"
#include "worker/train/trainer.h"

namespace colod::train {
namespace {

namespace fs = std::filesystem;
using ::colod::testing::TempPath;

std::set<std::string> Entries(const std::string& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

// Two dp ranks of generation 2 of job-000007 training a tiny GPT-2 for
// `steps` steps, saving at each into a fresh TempPath(name).
absl::StatusOr<TrainOptions> GenerationRun(const std::string& name, int64_t steps) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath(name + "_gpt2"), testing::TinyByteLevel());
  if (!model.ok()) return model.status();
  TrainOptions o = testing::SmallRun(model->dir, 1, 2, steps);
  o.seq_len = 16;
  o.save_dir = TempPath(name);
  o.save_every = 1;
  o.job = "job-000007";
  o.generation = 2;
  return o;
}

// Rank `rank`'s file of the model's parameters in the checkpoint of step 2
// under `dir` (two ranks).
std::string RankFileOfStep2(const std::string& dir, int rank) {
  return absl::StrFormat("%s/rank-%05d-of-00002.safetensors", StepDir(dir, 2), rank);
}

// DIR/step-NNNNNN as a save leaves it, as far as retention reads it: its
// state (with the eval loss, if any) and `bytes` bytes of files.
void FakeCheckpoint(const std::string& dir, int64_t step, std::optional<double> eval_loss, int64_t bytes,
                    const std::string& job = "") {
  const std::string path = StepDir(dir, step);
  fs::create_directories(path);
  std::ofstream(path + "/train_state.json")
      << "{\"step\": " << step << (eval_loss ? absl::StrFormat(", \"eval_loss\": %.17g", *eval_loss) : "")
      << (job.empty() ? "" : absl::StrFormat(", \"job\": \"%s\"", job)) << "}";
  std::ofstream(path + "/rank-00000-of-00001.safetensors") << std::string(bytes, 'x');
}

TEST(Retention, KeepsTheNewestAndTheBestAndTouchesNothingElse) {
  const std::string dir = TempPath("retention");
  const std::vector<double> evals = {3.0, 2.0, 2.5, 2.0, 2.75, 2.9};  // the best: step 2 (the earlier of two 2.0s)
  for (int64_t step = 1; step <= 6; ++step) FakeCheckpoint(dir, step, evals[step - 1], 100 * step);
  fs::create_directories(dir + "/step-000007.tmp");  // being written
  fs::create_directories(dir + "/step-000009");      // unreadable: no state
  fs::create_directories(dir + "/.trash-step-000000/x");  // a crashed removal's leftovers
  auto listed = ListCheckpoints(dir);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 6u);
  EXPECT_EQ((*listed)[1].step, 2);
  EXPECT_EQ((*listed)[1].eval_loss, 2.0);
  EXPECT_GE((*listed)[1].bytes, 200);

  auto kept = PruneCheckpoints(dir, Retention{.keep_last = 2, .keep_best = true});
  ASSERT_TRUE(kept.ok()) << kept.status();
  std::vector<int64_t> steps;
  for (const CheckpointInfo& c : *kept) steps.push_back(c.step);
  EXPECT_EQ(steps, (std::vector<int64_t>{2, 5, 6}));
  EXPECT_EQ(Entries(dir), (std::set<std::string>{"step-000002", "step-000005", "step-000006", "step-000007.tmp",
                                                 "step-000009"}));
  // Without keep_best: the newest only; with nothing set: everything.
  auto all = PruneCheckpoints(dir, Retention{});
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->size(), 3u);
  auto newest = PruneCheckpoints(dir, Retention{.keep_last = 1});
  ASSERT_TRUE(newest.ok());
  ASSERT_EQ(newest->size(), 1u);
  EXPECT_EQ(newest->at(0).path, StepDir(dir, 6));
  EXPECT_EQ(Entries(dir), (std::set<std::string>{"step-000006", "step-000007.tmp", "step-000009"}));
  EXPECT_EQ(PruneCheckpoints(TempPath("no_such_dir"), Retention{.keep_last = 1}).status().code(),
            absl::StatusCode::kNotFound);

  // A directory an earlier run left a higher-numbered checkpoint in: the
  // one just written is kept all the same (as is the newest), and a
  // checkpoint with an unreadable file inside is listed without its size
  // rather than failing the listing.
  const std::string reused = TempPath("retention_reused");
  FakeCheckpoint(reused, 10, std::nullopt, 10);  // the earlier run's
  FakeCheckpoint(reused, 2, std::nullopt, 10);
  FakeCheckpoint(reused, 3, std::nullopt, 10);  // just written
  fs::create_symlink("/no/such/target", StepDir(reused, 3) + "/dangling");
  auto after = PruneCheckpoints(reused, Retention{.keep_last = 1}, StepDir(reused, 3));
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(Entries(reused), (std::set<std::string>{"step-000003", "step-000010"}));

  // Another writer's checkpoints (another job's, a run the directory held
  // before) are neither counted nor removed nor reported: a job keeps the
  // newest K of its own, of any generation, and its own best.
  const std::string shared = TempPath("retention_shared");
  const std::string me = "job-000002_00000000000000aa", other = "job-000002_00000000000000bb";
  FakeCheckpoint(shared, 1, 1.0, 10, other);  // the best of all, not this job's
  FakeCheckpoint(shared, 2, 3.0, 10, me);
  FakeCheckpoint(shared, 3, 2.0, 10, me);  // its best
  FakeCheckpoint(shared, 4, 2.5, 10, me);
  FakeCheckpoint(shared, 8, 2.7, 10, other);
  FakeCheckpoint(shared, 9, std::nullopt, 10);  // outside a coordinator
  FakeCheckpoint(shared, 5, 2.6, 10, me);  // just written
  auto own = PruneCheckpoints(shared, Retention{.keep_last = 1, .keep_best = true}, StepDir(shared, 5),
                              CheckpointWriter{.job = me, .generation = 3});
  ASSERT_TRUE(own.ok()) << own.status();
  std::vector<int64_t> own_steps;
  for (const CheckpointInfo& c : *own) {
    own_steps.push_back(c.step);
    EXPECT_EQ(c.job, me);
  }
  EXPECT_EQ(own_steps, (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(Entries(shared),
            (std::set<std::string>{"step-000001", "step-000003", "step-000005", "step-000008", "step-000009"}));
  // A run continued from another writer's checkpoint (--resume D --save D)
  // counts that writer's as its own: the newest (8) and the best (1) of
  // both, and the one just written.
  auto lineage = PruneCheckpoints(shared, Retention{.keep_last = 1, .keep_best = true}, StepDir(shared, 5),
                                  CheckpointWriter{.job = me, .generation = 3, .lineage = {other}});
  ASSERT_TRUE(lineage.ok()) << lineage.status();
  std::vector<int64_t> lineage_steps;
  for (const CheckpointInfo& c : *lineage) lineage_steps.push_back(c.step);
  EXPECT_EQ(lineage_steps, (std::vector<int64_t>{1, 5, 8}));
  EXPECT_EQ(Entries(shared), (std::set<std::string>{"step-000001", "step-000005", "step-000008", "step-000009"}));
}

// A run that evaluates and saves every step keeps the newest 2 and its
// best (by its own reported evaluations); each save reports what is kept.
// A full disk fails the next save with its error and removes nothing but
// the save's own temporary directory; the newest checkpoint stays the one a
// resume picks, and the resume runs.
TEST(Retention, ATrainingRunKeepsItsNewestAndBestAndAFullDiskLosesNothing) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("retention_gpt2"), testing::TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions o = testing::SmallRun(model->dir, 1, 1, 6);
  o.seq_len = 16;
  o.lr = 3e-2;  // large: the held-out loss need not fall every step
  o.eval_split = 0.1;
  o.eval_every = 1;
  o.eval_steps = 1;
  o.save_dir = TempPath("retention_ck");
  o.save_every = 1;
  o.keep_last = 2;
  o.keep_best = true;
  const std::vector<StepStats> run = testing::Losses(o);
  ASSERT_EQ(run.size(), 6u);
  int64_t best = 0;
  double best_loss = INFINITY;
  for (const StepStats& s : run) {
    ASSERT_TRUE(s.eval.has_value());
    if (s.eval->loss < best_loss) best = s.step, best_loss = s.eval->loss;
    std::set<int64_t> reported;
    for (const CheckpointInfo& c : s.checkpoints) reported.insert(c.step);
    EXPECT_TRUE(reported.count(s.step)) << "step " << s.step;
    EXPECT_LE(reported.size(), 3u) << "step " << s.step;
  }
  std::set<std::string> want = {"step-000005", "step-000006", absl::StrFormat("step-%06d", best)};
  EXPECT_EQ(Entries(o.save_dir), want);
  std::set<std::string> last;
  for (const CheckpointInfo& c : run.back().checkpoints) last.insert(fs::path(c.path).filename().string());
  EXPECT_EQ(last, want);

  TrainOptions more = o;
  more.steps = 8;
  more.resume_dir = o.save_dir;
  absl::Status full;
  std::vector<StepStats> unsaved;
  {
    ::colod::testing::FullDisk disk(0);
    full = Train(more, [&](const StepStats& s) { unsaved.push_back(s); });
  }
  EXPECT_FALSE(full.ok());
  // Step 7 trained and is reported, naming no checkpoint: a save that fails
  // after rank 0 put it in place (a peer stopped at the last agreement) would
  // otherwise leave a hole in the job's history.
  ASSERT_EQ(unsaved.size(), 1u) << full;
  EXPECT_EQ(unsaved[0].step, 7);
  EXPECT_TRUE(unsaved[0].checkpoint.empty());
  // Nothing removed, and the failed save's temporary directory went with it.
  EXPECT_EQ(Entries(o.save_dir), want) << full;
  auto latest = LatestCheckpoint(o.save_dir);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, StepDir(o.save_dir, 6));
  const std::vector<StepStats> resumed = testing::Losses(more);
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_EQ(resumed[0].step, 7);
}

// A bf16 run's training checkpoint consolidated in another dtype is made of
// its f32 master weights (the optimizer state, put together over the dp
// ranks that hold its pieces under ZeRO): the same model the run's own
// --final-dtype f32 writes, bit for bit, and its f16 is those rounded once.
// Auto (and an fp32 run's) is the parameters as saved.
TEST(Consolidation, ATrainingCheckpointInAnotherDTypeIsItsMasterWeights) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("masters_gpt2"), testing::TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  for (const int zero : {0, 2}) {
    TrainOptions o = testing::SmallRun(model->dir, 2, 2, 1);
    o.seq_len = 16;
    o.warmup_steps = 0;
    o.shard.param_dtype = DType::kBF16;
    o.zero_stage = zero;
    o.save_dir = TempPath(absl::StrCat("masters_ck", zero));
    o.save_every = 1;
    o.final_dir = TempPath(absl::StrCat("masters_final", zero));
    o.final_dtype = DType::kF32;
    ASSERT_EQ(testing::Losses(o).size(), 1u);
    const std::string step = StepDir(o.save_dir, 1);
    const auto read = [](const std::string& dir) {
      std::map<std::string, Tensor> out;
      auto files = shardformer::ModelFiles::Open(dir);
      EXPECT_TRUE(files.ok()) << files.status();
      if (!files.ok()) return out;
      for (const std::string& name : (*files)->Names()) out[name] = *(*files)->Read(name);
      return out;
    };
    const std::string f32 = TempPath(absl::StrCat("masters_f32_", zero));
    ASSERT_TRUE(ConsolidateTrainingCheckpoint(step, f32, DType::kF32).ok());
    const std::map<std::string, Tensor> from_checkpoint = read(f32), from_run = read(o.final_dir);
    ASSERT_EQ(from_checkpoint.size(), from_run.size());
    ASSERT_FALSE(from_run.empty());
    for (const auto& [name, t] : from_run) {
      const Tensor& got = from_checkpoint.at(name);
      ASSERT_EQ(got.dtype(), DType::kF32) << name;
      ASSERT_EQ(got.shape(), t.shape()) << name;
      EXPECT_EQ(std::memcmp(got.raw_data(), t.raw_data(), t.nbytes()), 0) << name << " (ZeRO " << zero << ")";
    }
    // A checkpoint of before 2026-12-07 records no param_dtype: its index's
    // bf16 tensors say it was a bf16 run's, and f32 is still its masters
    // (read as f32, it was the bf16 parameters widened).
    const std::string old = TempPath(absl::StrCat("masters_old_", zero));
    fs::copy(step, old, fs::copy_options::recursive);
    {
      std::ifstream in(old + "/train_state.json");
      nlohmann::json s = nlohmann::json::parse(in);
      ASSERT_EQ(s.erase("param_dtype"), 1u);
      std::ofstream(old + "/train_state.json", std::ios::trunc) << s.dump();
    }
    const absl::StatusOr<Resumed> old_state = ReadTrainState(old);
    ASSERT_TRUE(old_state.ok()) << old_state.status();
    EXPECT_EQ(old_state->param_dtype, std::optional<DType>(DType::kBF16));
    const std::string old_f32 = TempPath(absl::StrCat("masters_old_f32_", zero));
    ASSERT_TRUE(ConsolidateTrainingCheckpoint(old, old_f32, DType::kF32).ok());
    for (const auto& [name, t] : read(old_f32)) {
      EXPECT_EQ(std::memcmp(from_run.at(name).raw_data(), t.raw_data(), t.nbytes()), 0)
          << name << " (ZeRO " << zero << ")";
    }
    const std::string f16 = TempPath(absl::StrCat("masters_f16_", zero));
    ASSERT_TRUE(ConsolidateTrainingCheckpoint(step, f16, DType::kF16).ok());
    for (const auto& [name, t] : read(f16)) {
      const Tensor rounded = *from_run.at(name).ToDType(DType::kF16);
      EXPECT_EQ(std::memcmp(rounded.raw_data(), t.raw_data(), t.nbytes()), 0) << name << " (ZeRO " << zero << ")";
    }
    // Auto: the bf16 parameters as saved, the masters' rounding.
    const std::string automatic = TempPath(absl::StrCat("masters_auto_", zero));
    ASSERT_TRUE(ConsolidateTrainingCheckpoint(step, automatic, std::nullopt).ok());
    int64_t elements = 0, finer = 0;
    for (const auto& [name, t] : read(automatic)) {
      ASSERT_EQ(t.dtype(), DType::kBF16) << name;
      const Tensor rounded = *from_run.at(name).ToDType(DType::kBF16);
      EXPECT_EQ(std::memcmp(rounded.raw_data(), t.raw_data(), t.nbytes()), 0) << name;
      const Tensor wide = *t.ToDType(DType::kF32);
      for (int64_t e = 0; e < t.numel(); ++e) finer += wide.data<float>()[e] != from_run.at(name).data<float>()[e];
      elements += t.numel();
    }
    EXPECT_GT(finer, elements / 2) << "the masters hold more than the bf16 parameters";
  }
  // A checkpoint whose optimizer state lacks a rank's master weights is
  // refused, naming what is missing, and writes nothing.
  const std::string step = StepDir(TempPath("masters_ck2"), 1);
  const std::string optim = step + "/optim-rank-00001-of-00004.safetensors";
  auto state = shardformer::SafetensorsFile::Open(optim);
  ASSERT_TRUE(state.ok()) << state.status();
  std::vector<std::pair<std::string, Tensor>> kept;
  for (const auto& [name, info] : (*state)->tensors()) {
    if (name.find(".master") == std::string::npos) kept.emplace_back(name, *(*state)->Read(name));
  }
  ASSERT_LT(kept.size(), (*state)->tensors().size());
  state->reset();
  ASSERT_TRUE(shardformer::WriteSafetensors(optim, kept).ok());
  const std::string refused_out = TempPath("masters_refused");
  const absl::Status refused = ConsolidateTrainingCheckpoint(step, refused_out, DType::kF32);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find(".master from element"), std::string::npos) << refused;
  EXPECT_FALSE(fs::exists(refused_out + "/model.safetensors"));
  // Without an optimizer file, f32 says what it needs, and auto writes the
  // parameters; so does a state that does not read (a checkpoint a resume
  // passes over, salvaged).
  fs::remove(optim);
  const absl::Status no_optim = ConsolidateTrainingCheckpoint(step, refused_out, DType::kF32);
  EXPECT_NE(no_optim.message().find("--dtype auto writes its parameters as saved"), std::string::npos) << no_optim;
  std::ofstream(step + "/train_state.json", std::ios::trunc) << "{\"step\": ";
  EXPECT_TRUE(ConsolidateTrainingCheckpoint(step, TempPath("masters_salvaged"), std::nullopt).ok());
  const absl::Status unknown = ConsolidateTrainingCheckpoint(step, TempPath("masters_salvaged_f32"), DType::kF32);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kFailedPrecondition) << unknown;
  EXPECT_NE(unknown.message().find("precision"), std::string::npos) << "not a silent widening: " << unknown;
}

// A run killed after every step and resumed in the same directory is one
// run: each link counts every earlier link's checkpoints as its own (the
// lineage its checkpoints record), not only the one it resumed from, so
// the directory keeps the newest K whatever the chain's length.
TEST(Retention, AChainOfResumesPrunesWhatEveryEarlierRunWrote) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("retention_chain_gpt2"), testing::TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  TrainOptions o = testing::SmallRun(model->dir, 1, 1, 2);
  o.seq_len = 16;
  o.save_dir = TempPath("retention_chain_ck");
  o.save_every = 1;
  o.keep_last = 2;
  ASSERT_EQ(testing::Losses(o).size(), 2u);
  EXPECT_EQ(Entries(o.save_dir), (std::set<std::string>{"step-000001", "step-000002"}));
  o.resume_dir = o.save_dir;
  std::vector<std::string> writers;
  std::map<int64_t, std::string> writer_of;  // each step's checkpoint's
  for (int64_t step : {1, 2}) writer_of[step] = ReadTrainState(StepDir(o.save_dir, step))->job;
  for (int64_t last = 3; last <= 5; ++last) {  // three more runs of one step each
    o.steps = last;
    const std::vector<StepStats> link = testing::Losses(o);
    ASSERT_EQ(link.size(), 1u);
    EXPECT_EQ(Entries(o.save_dir),
              (std::set<std::string>{absl::StrFormat("step-%06d", last - 1), absl::StrFormat("step-%06d", last)}));
    auto state = ReadTrainState(StepDir(o.save_dir, last));
    ASSERT_TRUE(state.ok()) << state.status();
    // The earlier links whose checkpoints the directory held as it started
    // (steps last - 2 and last - 1), oldest first: a link whose checkpoints
    // are all gone is not carried on.
    std::vector<std::string> held = {writer_of[last - 2]};
    if (writer_of[last - 1] != held.back()) held.push_back(writer_of[last - 1]);
    EXPECT_EQ(state->lineage, held) << "link " << last;
    writer_of[last] = state->job;
    writers.push_back(state->job);
  }
  EXPECT_EQ(std::set<std::string>(writers.begin(), writers.end()).size(), 3u) << "a job each";
  // Saving elsewhere carries only the run resumed from (its own are its
  // history's there), and so does coming back: a run that resumes from the
  // other directory and saves here prunes none of the chain's.
  const std::string chain = o.save_dir;
  o.save_dir = TempPath("retention_chain_elsewhere");
  o.steps = 6;
  ASSERT_EQ(testing::Losses(o).size(), 1u);
  auto elsewhere = ReadTrainState(StepDir(o.save_dir, 6));
  ASSERT_TRUE(elsewhere.ok()) << elsewhere.status();
  EXPECT_EQ(elsewhere->lineage, std::vector<std::string>{writers.back()});
  o.resume_dir = o.save_dir;
  o.save_dir = chain;
  o.steps = 7;
  o.keep_last = 1;
  ASSERT_EQ(testing::Losses(o).size(), 1u);
  EXPECT_EQ(Entries(chain), (std::set<std::string>{"step-000004", "step-000005", "step-000007"}));
  o.keep_last = 2;
  o.save_dir = chain;
  // Resuming the checkpoint named (not the directory) continues no lineage:
  // the run it came from may have newer ones here.
  o.resume_dir = StepDir(o.save_dir, 4);
  o.steps = 5;
  o.save_dir = TempPath("retention_chain_named");
  ASSERT_EQ(testing::Losses(o).size(), 1u);
  auto named = ReadTrainState(StepDir(o.save_dir, 5));
  ASSERT_TRUE(named.ok()) << named.status();
  EXPECT_TRUE(named->lineage.empty());

  // A lineage that does not read is none (a hand-edited state file).
  const std::string odd = TempPath("retention_chain_odd");
  for (const std::string& lineage : {std::string("[\"a\", 7]"), std::string("[\"../x\"]"), std::string("\"a\"")}) {
    fs::remove_all(odd);
    FakeCheckpoint(odd, 1, std::nullopt, 1, "me");
    std::ofstream(StepDir(odd, 1) + "/train_state.json")
        << "{\"step\": 1, \"seed\": 1, \"job\": \"me\", \"lineage\": " << lineage << "}";
    auto r = ReadTrainState(StepDir(odd, 1));
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_TRUE(r->lineage.empty()) << lineage;
  }
  EXPECT_EQ(ContinuedLineage({"a", "b", "me"}, "b", "me"), (std::vector<std::string>{"a", "b"}));
  // Of a lineage, the writers that have a checkpoint in the directory.
  const std::string held = TempPath("retention_chain_held");
  FakeCheckpoint(held, 1, 1.0, 1, "w0");
  FakeCheckpoint(held, 9, 2.0, 1, "w9");
  FakeCheckpoint(held, 10, 2.0, 1, "other");
  std::vector<std::string> ten;
  for (int i = 0; i < 10; ++i) ten.push_back(absl::StrCat("w", i));
  EXPECT_EQ(LineageWithCheckpointsIn(ten, held), (std::vector<std::string>{"w0", "w9"}));
  EXPECT_EQ(LineageWithCheckpointsIn(ten, TempPath("retention_chain_none")), ten) << "a directory that does not list";
  std::vector<std::string> long_chain;
  for (size_t i = 0; i < kMaxCheckpointLineage; ++i) long_chain.push_back(absl::StrCat("w", i));
  const std::vector<std::string> capped = ContinuedLineage(long_chain, "last", "me");
  ASSERT_EQ(capped.size(), kMaxCheckpointLineage);
  EXPECT_EQ(capped.front(), "w1");
  EXPECT_EQ(capped.back(), "last");
}

TEST(Retention, SettingsThatCannotWorkAreRefused) {
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("retention_bad"), testing::TinyByteLevel());
  ASSERT_TRUE(model.ok()) << model.status();
  const TrainOptions base = testing::SmallRun(model->dir, 1, 1, 2);
  TrainOptions o = base;
  o.keep_last = -1;
  EXPECT_EQ(Train(o, [](const StepStats&) {}).code(), absl::StatusCode::kInvalidArgument);
  o = base;
  o.keep_last = 2;  // no checkpoints to prune
  EXPECT_EQ(Train(o, [](const StepStats&) {}).code(), absl::StatusCode::kInvalidArgument);
  o.save_dir = TempPath("retention_bad_ck");
  o.save_every = 2;
  o.keep_best = true;  // no evaluation
  absl::Status s = Train(o, [](const StepStats&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("keep_best"), std::string::npos) << s;
  o.eval_split = 0.1;
  o.eval_every = 3;  // does not divide save_every: some checkpoints unevaluated
  s = Train(o, [](const StepStats&) {});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("eval_every"), std::string::npos) << s;
}

// Each generation of a job writes its checkpoints through a temporary
// directory of its own (step-N.JOB.gen-G.tmp), so what a stale earlier
// generation writes is never renamed in with this generation's files; once
// a save is in place the other temporary directories go, but those of the
// job's later generations. A checkpoint of the same step already in place
// is replaced whole, unless a later generation of the same job wrote it:
// then the save is ABORTED and the checkpoint left as it is.
TEST(Checkpoints, AGenerationWritesOnlyThroughItsOwnTemporaryDirectory) {
  auto run = GenerationRun("ck_gen", 3);
  ASSERT_TRUE(run.ok()) << run.status();
  const TrainOptions& o = *run;
  const CheckpointWriter me{.job = o.job, .generation = 2};
  EXPECT_EQ(StepTmpDir(o.save_dir, 3, me), o.save_dir + "/step-000003.job-000007.gen-2.tmp");
  EXPECT_EQ(StepTmpDir(o.save_dir, 3, {}), o.save_dir + "/step-000003.gen-0.tmp");
  const auto stale_dir = [&](const std::string& d, const std::string& state) {
    fs::create_directories(d);
    std::ofstream(d + "/stale-rank-file") << "a stale rank's file";
    if (!state.empty()) std::ofstream(d + "/train_state.json") << state;
  };
  // Another writer's temporary directory unchanged for two hours: crashed.
  const auto aged = [](const std::string& d) {
    fs::last_write_time(d, fs::file_time_type::clock::now() - std::chrono::hours(2));
  };
  stale_dir(StepTmpDir(o.save_dir, 2, {.job = o.job, .generation = 1}), "");  // given up on mid-save
  stale_dir(StepTmpDir(o.save_dir, 2, {.job = "job-000003", .generation = 9}), "");  // another job's
  aged(StepTmpDir(o.save_dir, 2, {.job = "job-000003", .generation = 9}));
  stale_dir(o.save_dir + "/step-000001.tmp", "");  // colod before 2026-12
  aged(o.save_dir + "/step-000001.tmp");
  // Another job's save in progress (a rank the coordinator gave up on still
  // writing): left alone.
  const std::string writing = StepTmpDir(o.save_dir, 4, {.job = "job-000004", .generation = 1});
  stale_dir(writing, "");
  stale_dir(StepTmpDir(o.save_dir, 3, {.job = o.job, .generation = 7}), "");  // later: this run is the stale one there
  stale_dir(StepDir(o.save_dir, 3), R"({"step": 3, "job": "job-000007", "generation": 1})");  // earlier: replaced
  // Checkpoints moved aside mid-replace (a file system that cannot
  // exchange): an earlier generation's leftover goes, a later one's stays.
  stale_dir(o.save_dir + "/.trash-step-000009.job-000007.gen-1", "");
  stale_dir(o.save_dir + "/.trash-step-000009.job-000007.gen-7", "");
  ASSERT_TRUE(testing::Losses(o).size() == 3u);
  const std::string later = "step-000003.job-000007.gen-7.tmp", later_aside = ".trash-step-000009.job-000007.gen-7";
  EXPECT_EQ(Entries(o.save_dir), (std::set<std::string>{"step-000001", "step-000002", "step-000003", later,
                                                         later_aside, fs::path(writing).filename().string()}));
  fs::remove_all(writing);
  for (int64_t step = 1; step <= 3; ++step) {
    EXPECT_FALSE(fs::exists(StepDir(o.save_dir, step) + "/stale-rank-file")) << "step " << step;
  }
  auto latest = LatestCheckpoint(o.save_dir);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, StepDir(o.save_dir, 3));
  std::ifstream state_file(*latest + "/train_state.json");
  const std::string state((std::istreambuf_iterator<char>(state_file)), std::istreambuf_iterator<char>());
  EXPECT_NE(state.find("\"job\": \"job-000007\""), std::string::npos) << state;
  EXPECT_NE(state.find("\"generation\": 2"), std::string::npos) << state;

  // An earlier generation of the job, still running, never replaces what a
  // later one saved: its first save is refused and nothing changes.
  TrainOptions stale = o;
  stale.generation = 1;
  const std::set<std::string> before = Entries(o.save_dir);
  const absl::Status refused = Train(stale, [](const StepStats&) {});
  EXPECT_EQ(refused.code(), absl::StatusCode::kAborted) << refused;
  EXPECT_NE(refused.message().find("generation 2"), std::string::npos) << refused;
  EXPECT_EQ(Entries(o.save_dir), before);
  // Another job's run (a directory reused) replaces it, and takes the
  // temporary directories the last job left.
  TrainOptions other = o;
  other.job = "job-000008";
  other.generation = 1;
  other.steps = 1;
  aged(o.save_dir + "/" + later);
  ASSERT_TRUE(testing::Losses(other).size() == 1u);
  EXPECT_EQ(Entries(o.save_dir), (std::set<std::string>{"step-000001", "step-000002", "step-000003"}));
  auto first = ReadTrainState(StepDir(o.save_dir, 1));
  ASSERT_TRUE(first.ok()) << first.status();

  for (const auto& [job, generation] :
       std::vector<std::pair<std::string, int64_t>>{{"../x", 1}, {"a b", 1}, {std::string(129, 'j'), 1}, {"", -1}}) {
    TrainOptions bad = o;
    bad.job = job;
    bad.generation = generation;
    EXPECT_EQ(Train(bad, [](const StepStats&) {}).code(), absl::StatusCode::kInvalidArgument) << job;
  }
}

// The race a save can lose: a later generation of the job puts its
// checkpoint of the step in place between this save's check and its
// exchange (the seam runs there). The exchange brings the later one out; it
// goes back and the save is ABORTED, or, where putting it back fails, this
// save's checkpoint stays in place whole and the later one is kept aside as
// .conflict-step-N.JOB.gen-G, where no cleanup or listing looks, both named
// in the error.
TEST(Checkpoints, ALaterGenerationsCheckpointThatWentInMidSaveIsPutBackOrKeptAside) {
  struct Unhook {
    ~Unhook() { internal::SetCheckpointExchangeHookForTesting({}); }
  } unhook;
  for (const bool back_fails : {false, true}) {
    SCOPED_TRACE(back_fails ? "putting it back fails" : "put back");
    auto run = GenerationRun(back_fails ? "ck_race_conflict" : "ck_race_back", 1);
    ASSERT_TRUE(run.ok()) << run.status();
    const TrainOptions& o = *run;
    const std::string step = StepDir(o.save_dir, 1);
    const auto write_state = [&](int generation, const std::string& marker) {
      fs::remove_all(step);
      fs::create_directories(step);
      std::ofstream(step + "/train_state.json")
          << R"({"step": 1, "job": "job-000007", "generation": )" << generation << "}";
      std::ofstream(step + "/" + marker) << marker;
    };
    write_state(1, "generation-1-file");  // an earlier generation's: to be replaced
    std::vector<int> exchanges;
    internal::SetCheckpointExchangeHookForTesting([&](int n) {
      exchanges.push_back(n);
      if (n == 1) write_state(7, "generation-7-file");  // generation 7 replaced it meanwhile
      return n == 2 && back_fails ? EBUSY : 0;
    });
    const absl::Status saved = Train(o, [](const StepStats&) {});
    internal::SetCheckpointExchangeHookForTesting({});
    EXPECT_EQ(exchanges, (std::vector<int>{1, 2}));
    EXPECT_EQ(saved.code(), absl::StatusCode::kAborted) << saved;
    EXPECT_NE(saved.message().find("generation 7"), std::string::npos) << saved;
    const std::string aside = o.save_dir + "/.conflict-step-000001.job-000007.gen-7";
    if (!back_fails) {
      // Generation 7's is in place; this save's is gone, nothing else left.
      EXPECT_EQ(Entries(o.save_dir), (std::set<std::string>{"step-000001"}));
      EXPECT_TRUE(fs::exists(step + "/generation-7-file"));
      continue;
    }
    EXPECT_NE(saved.message().find("cannot be put back"), std::string::npos) << saved;
    EXPECT_NE(saved.message().find(aside), std::string::npos) << saved;
    EXPECT_EQ(Entries(o.save_dir), (std::set<std::string>{"step-000001", ".conflict-step-000001.job-000007.gen-7"}));
    EXPECT_TRUE(fs::exists(aside + "/generation-7-file"));
    // This save's checkpoint is in place, whole: it is the one to resume from.
    EXPECT_FALSE(fs::exists(step + "/generation-7-file"));
    auto latest = LatestCheckpoint(o.save_dir);
    ASSERT_TRUE(latest.ok()) << latest.status();
    EXPECT_EQ(*latest, step);
    auto state = ReadTrainState(step);
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(state->step, 1);
  }
}

// A rank the coordinator gave up on (aborted, and still running) while it
// wrote or checked its checkpoint: the directory's next job may have saved
// the same step by then. The rank replaces no other job's checkpoint: the
// newer job's stays and the rank's temporary directory goes, whether the
// abort came before the install (the seam before it) or during it (the
// exchange's seam: what went out is put back). Where nothing is in place
// its whole checkpoint goes in all the same (a restart of its own job
// resumes from it). The save of the step before, un-aborted, went in.
TEST(Checkpoints, ARankAbortedBeforeItsCheckpointGoesInReplacesNoOtherJobs) {
  struct Unhook {
    ~Unhook() {
      internal::SetCheckpointBeforeInstallHookForTesting({});
      internal::SetCheckpointExchangeHookForTesting({});
    }
  } unhook;
  const std::string newer = "job-000008_00000000000000ee";
  for (const bool during : {false, true}) {
    SCOPED_TRACE(during ? "aborted during the exchange" : "aborted before the install");
    auto run = GenerationRun(during ? "ck_aborted_during" : "ck_aborted_before", 2);
    ASSERT_TRUE(run.ok()) << run.status();
    TrainOptions o = *run;
    o.shard.layout.set_data_parallel_size(1);  // one rank: its error is the run's
    // The newer job's checkpoint of step 2, already in place.
    FakeCheckpoint(o.save_dir, 2, std::nullopt, 10, newer);
    std::ofstream(StepDir(o.save_dir, 2) + "/newer-job-file") << "kept";
    int installs = 0;
    ProcessGroup* group = nullptr;
    std::vector<int> exchanges;
    internal::SetCheckpointBeforeInstallHookForTesting([&](ProcessGroup& pg) {
      group = &pg;
      if (++installs == 2 && !during) pg.Abort(absl::AbortedError("given up on by the coordinator"));
    });
    internal::SetCheckpointExchangeHookForTesting([&](int n) {
      exchanges.push_back(n);
      if (n == 1 && during) group->Abort(absl::AbortedError("given up on by the coordinator"));
      return 0;
    });
    const absl::Status saved = Train(o, [](const StepStats&) {});
    internal::SetCheckpointBeforeInstallHookForTesting({});
    internal::SetCheckpointExchangeHookForTesting({});
    EXPECT_EQ(installs, 2);
    EXPECT_EQ(exchanges, (during ? std::vector<int>{1, 2} : std::vector<int>{}));
    EXPECT_EQ(saved.code(), absl::StatusCode::kAborted) << saved;
    EXPECT_NE(saved.message().find("was written by " + newer +
                                   ", and this rank was aborted (given up on by the coordinator): left in place"),
              std::string::npos)
        << saved;
    EXPECT_EQ(Entries(o.save_dir), (std::set<std::string>{"step-000001", "step-000002"}));
    EXPECT_TRUE(fs::exists(StepDir(o.save_dir, 2) + "/newer-job-file"));
    auto listed = ListCheckpoints(o.save_dir);
    ASSERT_TRUE(listed.ok()) << listed.status();
    ASSERT_EQ(listed->size(), 2u);
    EXPECT_EQ((*listed)[0].job, o.job);
    EXPECT_EQ((*listed)[1].job, newer);
  }

  // Nothing in place: the aborted rank's whole checkpoint goes in, and the
  // next save, which it does not start, fails with the abort.
  auto run = GenerationRun("ck_aborted_nothing_there", 2);
  ASSERT_TRUE(run.ok()) << run.status();
  TrainOptions o = *run;
  o.shard.layout.set_data_parallel_size(1);
  internal::SetCheckpointBeforeInstallHookForTesting(
      [](ProcessGroup& pg) { pg.Abort(absl::AbortedError("given up on by the coordinator")); });
  const absl::Status saved = Train(o, [](const StepStats&) {});
  internal::SetCheckpointBeforeInstallHookForTesting({});
  EXPECT_EQ(saved.code(), absl::StatusCode::kAborted) << saved;
  EXPECT_EQ(Entries(o.save_dir), (std::set<std::string>{"step-000001"}));
  auto state = ReadTrainState(StepDir(o.save_dir, 1));
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->job, o.job);
}

// A step whose update leaves weights that are not finite (a learning rate
// past float's range: the step's loss and gradient norm were finite, so the
// step itself passed) saves no checkpoint: the run fails
// FAILED_PRECONDITION (the coordinator does not restart it) naming a
// parameter, and no checkpoint or temporary directory is left, where the
// save wrote the overflowed weights for a restart to resume from.
TEST(Checkpoints, WeightsThatAreNotFiniteAreNeverSaved) {
  auto run = GenerationRun("ck_not_finite", 3);
  ASSERT_TRUE(run.ok()) << run.status();
  TrainOptions o = *run;
  o.lr = 1e39;
  o.warmup_steps = 0;
  o.clip_norm = 0;
  std::vector<StepStats> steps;
  const absl::Status s = Train(o, [&](const StepStats& st) { steps.push_back(st); });
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_NE(s.message().find("the weights are not finite (parameter "), absl::string_view::npos) << s;
  ASSERT_EQ(steps.size(), 1u);  // the step trained and is reported; its checkpoint is not saved
  EXPECT_TRUE(std::isfinite(steps[0].loss));
  EXPECT_TRUE(std::isfinite(steps[0].grad_norm));
  EXPECT_TRUE(!fs::exists(o.save_dir) || Entries(o.save_dir).empty());
}

// A rank that cannot write its part of a checkpoint (here a directory in
// the way of rank 0's file at step 2: a real error of the real write) fails
// the save with its own error, naming the file; its peer, whose write went
// through, fails with one marked as following a peer's (IsPeerCaused), so
// that the job's reason is the cause. Rank 1 writes late: the temporary
// directory stays until no rank writes there (it was removed under rank 1,
// whose "No such file or directory" could be reported first). Nothing but
// the failed save's temporary directory is removed.
TEST(Checkpoints, ARankThatCannotWriteItsPartFailsTheSaveWithItsOwnErrorItsPeersFollowing) {
  struct Unhook {
    ~Unhook() { internal::SetCheckpointBeforeWriteHookForTesting({}); }
  } unhook;
  auto run = GenerationRun("ck_one_rank_fails", 3);
  ASSERT_TRUE(run.ok()) << run.status();
  const TrainOptions o = *run;
  const std::string blocked = RankFileOfStep2(o.save_dir, 0);
  internal::SetCheckpointBeforeWriteHookForTesting([&](ProcessGroup& pg, const std::string& tmp) {
    if (!absl::StrContains(tmp, "step-000002")) return;
    if (pg.rank() == 0) {
      fs::create_directories(tmp + "/" + fs::path(blocked).filename().string() + "/in-the-way");
    } else {
      absl::SleepFor(absl::Milliseconds(300));
    }
  });
  auto prepared = PrepareTrain(o);
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  absl::Mutex mu;
  std::vector<absl::Status> ends(2);
  const absl::Status s = shardformer::RunOnLocalRanks(
      o.shard, /*cuda=*/false,
      [&](int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard) {
        const absl::Status end = RunTrainRank(**prepared, rank, pg, shard, RankHooks{});
        absl::MutexLock lock(&mu);
        ends[rank] = end;
        return end;
      },
      o.comm_timeout);
  EXPECT_FALSE(ends[0].ok());
  EXPECT_FALSE(IsPeerCaused(ends[0])) << ends[0];
  EXPECT_TRUE(absl::StrContains(ends[0].message(), fs::path(blocked).filename().string())) << ends[0];
  // Rank 1 learns of it in the agreement, or (where rank 0 got through the
  // agreement first and its end aborted the others) from rank 0's abort.
  EXPECT_EQ(ends[1].code(), absl::StatusCode::kAborted) << ends[1];
  EXPECT_TRUE(
      (IsPeerCaused(ends[1]) && absl::StrContains(ends[1].message(), "another rank could not write its part")) ||
      absl::StrContains(ends[1].message(), "rank 0 failed: "))
      << ends[1];
  EXPECT_EQ(s.code(), ends[0].code()) << s;
  EXPECT_TRUE(absl::StartsWith(s.message(), "rank 0: ")) << s;
  EXPECT_EQ(Entries(o.save_dir), (std::set<std::string>{"step-000001"}));
  EXPECT_TRUE(LatestCheckpoint(o.save_dir).ok());
}

// Each rank chooses the newest checkpoint on its own (a worker daemon's
// ranks prepare their runs apart): where they chose different ones (a save
// came between two ranks' listings, or one host's view of the directory
// lagged), every rank fails ABORTED (a restart retries it) saying so before
// it restores anything, rather than training from different weights and
// steps.
TEST(Checkpoints, RanksThatChoseDifferentCheckpointsToResumeFromRefuseToGoOn) {
  auto run = GenerationRun("ck_resume_differ", 3);
  ASSERT_TRUE(run.ok()) << run.status();
  TrainOptions o = *run;
  ASSERT_TRUE(Train(o, nullptr).ok());
  TrainOptions again = o;
  again.save_dir.clear();
  again.save_every = 0;
  again.resume_dir = o.save_dir;
  again.steps = 5;
  auto newest = PrepareTrain(again);  // step 3
  ASSERT_TRUE(newest.ok()) << newest.status();
  fs::rename(StepDir(o.save_dir, 3), o.save_dir + "/aside");
  auto lagging = PrepareTrain(again);  // step 2: step 3 not listed yet
  ASSERT_TRUE(lagging.ok()) << lagging.status();
  fs::rename(o.save_dir + "/aside", StepDir(o.save_dir, 3));
  absl::Mutex mu;
  std::vector<absl::Status> ends(2);
  std::vector<int> trained(2, 0);
  const absl::Status run_status = shardformer::RunOnLocalRanks(
      again.shard, /*cuda=*/false,
      [&](int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard) {
        RankHooks hooks;
        hooks.on_step = [&, rank](const StepStats&) {
          absl::MutexLock lock(&mu);
          ++trained[rank];
        };
        const absl::Status end = RunTrainRank(rank == 0 ? **newest : **lagging, rank, pg, shard, hooks);
        absl::MutexLock lock(&mu);
        ends[rank] = end;
        return end;
      },
      again.comm_timeout);
  // Each rank fails with the agreement's error, or (where the other got
  // there first and its end aborted the group) with the abort that names it.
  int own = 0;
  for (int rank = 0; rank < 2; ++rank) {
    EXPECT_TRUE(absl::StrContains(ends[rank].message(), "the ranks chose different checkpoints in " + o.save_dir +
                                                            " to resume from (its step; -1: none)"))
        << ends[rank];
    // ABORTED either way: a restart retries it (a listing that lagged has
    // caught up by then), not the job's own error.
    EXPECT_EQ(ends[rank].code(), absl::StatusCode::kAborted) << ends[rank];
    const std::string mine = rank == 0 ? "this rank's 3, another's 2" : "this rank's 2, another's 3";
    const std::string theirs = rank == 0 ? "this rank's 2, another's 3" : "this rank's 3, another's 2";
    const bool own_error = absl::StrContains(ends[rank].message(), mine);
    EXPECT_TRUE(own_error || (absl::StrContains(ends[rank].message(), absl::StrCat("rank ", 1 - rank, " failed: ")) &&
                              absl::StrContains(ends[rank].message(), theirs)))
        << ends[rank];
    own += own_error ? 1 : 0;
    EXPECT_EQ(trained[rank], 0);
  }
  EXPECT_GE(own, 1);
  EXPECT_EQ(run_status.code(), absl::StatusCode::kAborted) << run_status;
  EXPECT_TRUE(IsRetryableRankError(run_status.code()));
  // Ranks that agree resume as ever.
  auto same = PrepareTrain(again);
  ASSERT_TRUE(same.ok()) << same.status();
  const absl::Status agreed = shardformer::RunOnLocalRanks(
      again.shard, /*cuda=*/false,
      [&](int rank, ProcessGroup& pg, const shardformer::ShardConfig& shard) {
        return RunTrainRank(**same, rank, pg, shard, RankHooks{});
      },
      again.comm_timeout);
  EXPECT_TRUE(agreed.ok()) << agreed;
}

// A worker's --allow-path policy covers what a resume opens inside the
// directory it names: a checkpoint directory that is a link out of the
// allowed paths, or a file in one that is, ends the search with the
// policy's error before anything of it is read; checkpoints inside are
// found as always.
TEST(Checkpoints, AResumeChecksEachCheckpointAndFileAgainstThePathPolicy) {
  // (Checkpoints of fake bytes: the search reads and passes them over as
  // damaged, which shows what it read.)
  const std::string dir = TempPath("policy_ck"), outside = TempPath("policy_outside");
  FakeCheckpoint(dir, 1, std::nullopt, 10);
  FakeCheckpoint(outside, 5, std::nullopt, 10);
  std::vector<std::string> asked;
  std::error_code ec;
  const std::string root = fs::weakly_canonical(dir, ec).string();
  const PathCheck check = [&](const std::string& path) -> absl::Status {
    asked.push_back(path);
    std::error_code resolve;
    return absl::StartsWith(fs::weakly_canonical(path, resolve).string(), root)
               ? absl::OkStatus()
               : absl::PermissionDeniedError(absl::StrCat(path, " is outside"));
  };
  std::vector<std::string> skipped;
  auto inside = LatestCheckpoint(dir, &skipped, std::nullopt, check);
  EXPECT_EQ(inside.status().code(), absl::StatusCode::kNotFound) << inside.status();
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_TRUE(absl::StartsWith(skipped[0], "step-000001: ")) << skipped[0];
  EXPECT_NE(std::find(asked.begin(), asked.end(), StepDir(dir, 1) + "/rank-00000-of-00001.safetensors"), asked.end())
      << "each file is checked";
  // A newer step that is a link out: refused before it is read.
  fs::create_directory_symlink(StepDir(outside, 5), StepDir(dir, 5));
  skipped.clear();
  auto linked = LatestCheckpoint(dir, &skipped, std::nullopt, check);
  EXPECT_EQ(linked.status().code(), absl::StatusCode::kPermissionDenied) << linked.status();
  EXPECT_TRUE(skipped.empty()) << "nothing of it was read";
  skipped.clear();
  EXPECT_FALSE(LatestCheckpoint(dir, &skipped).ok());
  ASSERT_EQ(skipped.size(), 2u) << "without a policy it is read";
  EXPECT_TRUE(absl::StartsWith(skipped[0], "step-000005: ")) << skipped[0];
  // A file of a checkpoint inside that links out.
  fs::remove(StepDir(dir, 5));
  fs::remove(StepDir(dir, 1) + "/rank-00000-of-00001.safetensors");
  fs::create_symlink(StepDir(outside, 5) + "/rank-00000-of-00001.safetensors",
                     StepDir(dir, 1) + "/rank-00000-of-00001.safetensors");
  auto file_out = LatestCheckpoint(StepDir(dir, 1), nullptr, std::nullopt, check);
  EXPECT_EQ(file_out.status().code(), absl::StatusCode::kPermissionDenied) << file_out.status();
  auto dir_out = LatestCheckpoint(dir, nullptr, std::nullopt, check);
  EXPECT_EQ(dir_out.status().code(), absl::StatusCode::kPermissionDenied) << dir_out.status();
}

// A job the coordinator restarts resumes from the newest checkpoint it
// wrote itself (TrainOptions::resume_writers), not from a later step another
// job left in the same directory: another coordinator's job of the same
// id (a uid apart), or an earlier run's. The filter passes over the other
// writers' checkpoints, complete or not, and still skips its own damaged
// ones; a user's resume of the directory takes the newest of any writer.
// Only step-N directories whose state says step N are checkpoints: a copy
// a user keeps (step-000002-keep, step-000002.best) is never counted,
// pruned or resumed from, nor is one renamed to another step. Resuming
// picks the newest by number (step-1000000 after step-999999, which sorts
// after it as text) and skips a state whose step is negative or past
// int64, or whose seed, optimizer_steps or layout a restore could not read.
TEST(Checkpoints, OnlyAStepDirectoryOfItsOwnStepIsACheckpoint) {
  auto run = GenerationRun("ck_names", 2);
  ASSERT_TRUE(run.ok()) << run.status();
  TrainOptions o = *run;
  o.job.clear();
  o.generation = 0;
  ASSERT_EQ(testing::Losses(o).size(), 2u);
  const std::string dir = o.save_dir;
  const auto plant = [&](const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
    fs::copy(StepDir(dir, 2), dir + "/" + name, fs::copy_options::recursive);
    std::ifstream in(dir + "/" + name + "/train_state.json");
    nlohmann::json state = nlohmann::json::parse(in);
    edit(state);
    std::ofstream(dir + "/" + name + "/train_state.json", std::ios::trunc) << state.dump();
  };
  plant("step-000002-keep", [](nlohmann::json&) {});
  plant("step-000002.best", [](nlohmann::json&) {});
  plant("step-000003", [](nlohmann::json&) {});  // says step 2
  // (A run outside a coordinator writes as an id of its own: local-...)
  const absl::StatusOr<Resumed> written = ReadTrainState(StepDir(dir, 2));
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_TRUE(absl::StartsWith(written->job, "local-")) << written->job;
  auto kept = PruneCheckpoints(dir, Retention{.keep_last = 1}, "", CheckpointWriter{.job = written->job});
  ASSERT_TRUE(kept.ok()) << kept.status();
  ASSERT_EQ(kept->size(), 1u);
  EXPECT_EQ(kept->at(0).path, StepDir(dir, 2));
  EXPECT_EQ(Entries(dir), (std::set<std::string>{"step-000002", "step-000002-keep", "step-000002.best",
                                                 "step-000003"}));
  std::vector<std::string> skipped;
  auto latest = LatestCheckpoint(dir, &skipped);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, StepDir(dir, 2));
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_NE(skipped[0].find("step 2 is not the directory's 3"), std::string::npos) << skipped[0];

  plant("step-999999", [](nlohmann::json& s) { s["step"] = 999999; });
  plant("step-1000000", [](nlohmann::json& s) { s["step"] = 1000000; });
  plant("step-1000001", [](nlohmann::json& s) { s["step"] = -3; });
  plant("step-1000002", [](nlohmann::json& s) { s["step"] = std::numeric_limits<uint64_t>::max(); });
  plant("step-1000003", [](nlohmann::json& s) {
    s["step"] = 1000003;
    s["seed"] = "1";
  });
  plant("step-1000004", [](nlohmann::json& s) {
    s["step"] = 1000004;
    s["optimizer_steps"] = -1;
  });
  plant("step-1000005", [](nlohmann::json& s) {
    s["step"] = 1000005;
    s.erase("layout");
  });
  plant("step-1000006", [](nlohmann::json& s) {
    s["step"] = 1000006;
    s["param_dtype"] = "i32";  // (it would load the weights as integers)
  });
  plant("step-1000009", [](nlohmann::json& s) {
    s["step"] = 1000009;
    s["optimizer_steps"] = std::numeric_limits<int64_t>::max();  // (the next update would overflow it)
  });
  // A train_state.json past its bound (one of a terabyte, or a link to
  // one, was read whole): read no further.
  plant("step-1000007", [](nlohmann::json& s) { s["step"] = 1000007; });
  fs::resize_file(dir + "/step-1000007/train_state.json", (uintmax_t{16} << 20) + 1);
  skipped.clear();
  latest = LatestCheckpoint(dir, &skipped);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, dir + "/step-1000000");
  ASSERT_EQ(skipped.size(), 8u) << absl::StrJoin(skipped, "\n");
  const std::string reasons = absl::StrJoin(skipped, "\n");
  for (const char* why : {"step -3 is negative", "step is not an integer", "seed is not an unsigned integer",
                          "optimizer_steps -1 is negative", "layout is not an object",
                          "param_dtype: i32 is not a float dtype", "bytes, more than the 16777216 expected",
                          "optimizer_steps 9223372036854775807 is past the checkpoint's step 1000009"}) {
    EXPECT_NE(reasons.find(why), std::string::npos) << why << " in " << reasons;
  }
  auto resumed = ReadTrainState(*latest);
  ASSERT_TRUE(resumed.ok()) << resumed.status();
  EXPECT_EQ(resumed->step, 1000000);

  // A rank file whose header says U32 where colod wrote F32 (the same
  // size: the file still parses) is a damaged checkpoint, passed over, not
  // one that fails the resume at its first read.
  plant("step-1000008", [](nlohmann::json& s) { s["step"] = 1000008; });
  const std::string rank0 = dir + "/step-1000008/rank-00000-of-00002.safetensors";
  std::string bytes;
  {
    std::ifstream in(rank0, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  const size_t at = bytes.find(R"("dtype":"F32")");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 13, R"("dtype":"U32")");
  std::ofstream(rank0, std::ios::binary | std::ios::trunc) << bytes;
  skipped.clear();
  latest = LatestCheckpoint(dir, &skipped);
  ASSERT_TRUE(latest.ok()) << latest.status();
  EXPECT_EQ(*latest, dir + "/step-1000000");
  ASSERT_EQ(skipped.size(), 9u) << absl::StrJoin(skipped, "\n");
  EXPECT_NE(absl::StrJoin(skipped, "\n").find("is U32, a dtype colod's checkpoints never hold"), std::string::npos)
      << absl::StrJoin(skipped, "\n");
}

TEST(Checkpoints, ARestartResumesFromItsOwnJobsNewestCheckpoint) {
  auto run = GenerationRun("ck_own", 3);
  ASSERT_TRUE(run.ok()) << run.status();
  TrainOptions o = *run;
  o.job = "job-000007_00000000000000aa";
  o.steps = 5;
  const std::vector<StepStats> want = testing::Losses(o);  // uninterrupted, 5 steps saved
  ASSERT_EQ(want.size(), 5u);
  // Another job's checkpoints of later steps: a copy of step 5 as step 9,
  // written by another coordinator's job-000007, and a damaged step 8 of
  // a run outside a coordinator.
  const auto plant = [&](int64_t step, const std::string& writer) {
    const std::string to = StepDir(o.save_dir, step);
    fs::copy(StepDir(o.save_dir, 5), to, fs::copy_options::recursive);
    std::ifstream in(to + "/train_state.json");
    nlohmann::json state = nlohmann::json::parse(in);  // step 5's, as its writer wrote it
    in.close();
    state["step"] = step;
    state.erase("job");
    state.erase("generation");
    state.update(nlohmann::json::parse(writer));
    std::ofstream(to + "/train_state.json", std::ios::trunc) << state.dump();
  };
  plant(9, R"({"job": "job-000007_00000000000000bb", "generation": 4})");
  plant(8, "{}");
  fs::resize_file(StepDir(o.save_dir, 8) + "/rank-00001-of-00002.safetensors", 10);
  // Its own step 5 cut short: it falls back to its step 4.
  const std::string own5 = StepDir(o.save_dir, 5) + "/rank-00000-of-00002.safetensors";
  fs::resize_file(own5, fs::file_size(own5) - 100);

  std::vector<std::string> skipped;
  auto any = LatestCheckpoint(o.save_dir, &skipped);
  ASSERT_TRUE(any.ok()) << any.status();
  EXPECT_EQ(*any, StepDir(o.save_dir, 9));
  skipped.clear();
  auto own = LatestCheckpoint(o.save_dir, &skipped, std::vector<std::string>{o.job});
  ASSERT_TRUE(own.ok()) << own.status();
  EXPECT_EQ(*own, StepDir(o.save_dir, 4));
  ASSERT_EQ(skipped.size(), 1u);  // its own damaged one; the others' are not its concern
  EXPECT_NE(skipped[0].find("step-000005"), std::string::npos) << skipped[0];
  auto none = LatestCheckpoint(o.save_dir, nullptr, std::vector<std::string>{"job-000007"});
  EXPECT_EQ(none.status().code(), absl::StatusCode::kNotFound) << none.status();
  EXPECT_NE(none.status().message().find("no complete checkpoint of job-000007 in"), std::string::npos)
      << none.status();
  EXPECT_NE(none.status().message().find("7 checkpoints of other writers passed over"), std::string::npos)
      << none.status();
  // A second writer counts as the first (the bare id workers before the
  // uid recorded): the other coordinator's job's step 9 is then the newest.
  auto either = LatestCheckpoint(o.save_dir, nullptr, std::vector<std::string>{o.job, "job-000007_00000000000000bb"});
  ASSERT_TRUE(either.ok()) << either.status();
  EXPECT_EQ(*either, StepDir(o.save_dir, 9));

  // Generation 3 resumes from step 4 and trains step 5 as the
  // uninterrupted run did.
  TrainOptions restarted = o;
  restarted.generation = 3;
  restarted.resume_dir = o.save_dir;
  restarted.resume_writers = std::vector<std::string>{o.job, "job-000007"};
  restarted.save_dir.clear();
  const std::vector<StepStats> rest = testing::Losses(restarted);
  ASSERT_EQ(rest.size(), 1u);
  EXPECT_EQ(rest[0].step, 5);
  EXPECT_EQ(rest[0].loss, want[4].loss);
  // Another job restarted with its own checkpoints gone is NOT_FOUND,
  // never another writer's.
  TrainOptions stranger = restarted;
  stranger.job = "job-000007_00000000000000cc";
  stranger.resume_writers = std::vector<std::string>{stranger.job, "job-000007"};
  EXPECT_EQ(Train(stranger, nullptr).code(), absl::StatusCode::kNotFound);
}

// Where the file system cannot exchange two directories in one rename, the
// checkpoint in place is moved aside, the new one renamed in, and the old
// one removed; the same generations are refused and kept as with the
// exchange.
TEST(Checkpoints, AFileSystemThatCannotExchangeGetsTheOldCheckpointMovedAside) {
  auto run = GenerationRun("ck_aside", 2);
  ASSERT_TRUE(run.ok()) << run.status();
  const TrainOptions& o = *run;
  for (int64_t step = 1; step <= 2; ++step) {  // an earlier generation's, replaced
    fs::create_directories(StepDir(o.save_dir, step));
    std::ofstream(StepDir(o.save_dir, step) + "/stale-rank-file") << "generation 1's";
    std::ofstream(StepDir(o.save_dir, step) + "/train_state.json")
        << R"({"step": )" << step << R"(, "job": "job-000007", "generation": 1})";
  }
  // Leftovers of interrupted replacements: an earlier generation's goes, a
  // later one's stays.
  fs::create_directories(o.save_dir + "/.trash-step-000001.job-000007.gen-1");
  fs::create_directories(o.save_dir + "/.trash-step-000009.job-000007.gen-7");
  fs::create_directories(o.save_dir + "/a");
  fs::create_directories(o.save_dir + "/b");

  int exchange_errno = 0;
  std::vector<StepStats> steps;
  absl::Status trained, stale;
  const absl::Status filtered = colod::testing::WithoutRenameExchange([&] {
    // The fault is there: the exchange the save would use fails as on vfat.
    if (::renameat2(AT_FDCWD, (o.save_dir + "/a").c_str(), AT_FDCWD, (o.save_dir + "/b").c_str(),
                    RENAME_EXCHANGE) != 0) {
      exchange_errno = errno;
    }
    trained = Train(o, [&](const StepStats& st) { steps.push_back(st); });
    TrainOptions earlier = o;
    earlier.generation = 1;
    stale = Train(earlier, [](const StepStats&) {});
  });
  if (absl::IsUnimplemented(filtered) || absl::IsFailedPrecondition(filtered)) {
    GTEST_SKIP() << "no file system without RENAME_EXCHANGE can be made here: " << filtered;
  }
  ASSERT_TRUE(filtered.ok()) << filtered;
  ASSERT_EQ(exchange_errno, EINVAL) << "the filter did not take";
  ASSERT_TRUE(trained.ok()) << trained;
  EXPECT_EQ(steps.size(), 2u);
  // Off that thread the exchange works: the fault was the thread's alone.
  EXPECT_EQ(::renameat2(AT_FDCWD, (o.save_dir + "/a").c_str(), AT_FDCWD, (o.save_dir + "/b").c_str(),
                        RENAME_EXCHANGE),
            0)
      << std::strerror(errno);
  fs::remove(o.save_dir + "/a");
  fs::remove(o.save_dir + "/b");

  EXPECT_EQ(Entries(o.save_dir),
            (std::set<std::string>{"step-000001", "step-000002", ".trash-step-000009.job-000007.gen-7"}));
  for (int64_t step = 1; step <= 2; ++step) {
    EXPECT_FALSE(fs::exists(StepDir(o.save_dir, step) + "/stale-rank-file")) << "step " << step;
    auto state = ReadTrainState(StepDir(o.save_dir, step));
    ASSERT_TRUE(state.ok()) << state.status();
    std::ifstream in(StepDir(o.save_dir, step) + "/train_state.json");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_NE(text.find("\"generation\": 2"), std::string::npos) << text;
  }
  // The earlier generation, still running, replaced nothing.
  EXPECT_EQ(stale.code(), absl::StatusCode::kAborted) << stale;
  EXPECT_FALSE(fs::exists(StepDir(o.save_dir, 1) + "/stale-rank-file"));
}

// A save on a file system that cannot exchange moves the old checkpoint of
// its step aside, then renames the new one in. A process that died between
// the two left the step's only copy aside: the restart resumes from it and
// keeps it, and another job's prune puts back its own the same way. A later
// generation's (whose save may be running) stays where it is.
TEST(Checkpoints, ACheckpointMovedAsideByASaveThatDiedIsPutBackNotRemoved) {
  auto run = GenerationRun("ck_aside_died", 4);
  ASSERT_TRUE(run.ok()) << run.status();
  const TrainOptions& o = *run;
  const std::vector<StepStats> want = testing::Losses(o);  // uninterrupted, every step saved
  ASSERT_EQ(want.size(), 4u);
  // Generation 2 died replacing step 3, before step 4 was saved: step 3 is
  // aside, its replacement half written. Generation 4 is replacing step 2.
  fs::remove_all(StepDir(o.save_dir, 4));
  fs::rename(StepDir(o.save_dir, 3), o.save_dir + "/.trash-step-000003.job-000007.gen-2");
  fs::create_directories(StepTmpDir(o.save_dir, 3, CheckpointWriter{.job = o.job, .generation = 2}));
  fs::rename(StepDir(o.save_dir, 2), o.save_dir + "/.trash-step-000002.job-000007.gen-4");

  TrainOptions restarted = o;
  restarted.generation = 3;
  restarted.resume_dir = o.save_dir;
  restarted.resume_writers = std::vector<std::string>{o.job};
  std::vector<StepStats> rest;
  const absl::Status trained = Train(restarted, [&](const StepStats& s) { rest.push_back(s); });
  ASSERT_TRUE(trained.ok()) << trained;
  ASSERT_EQ(rest.size(), 1u) << "it resumed from " << (rest.empty() ? "" : rest[0].resumed_from);
  EXPECT_EQ(rest[0].resumed_from, StepDir(o.save_dir, 3));
  EXPECT_EQ(rest[0].step, 4);
  EXPECT_EQ(rest[0].loss, want[3].loss);
  EXPECT_EQ(Entries(o.save_dir), (std::set<std::string>{"step-000001", "step-000003", "step-000004",
                                                         ".trash-step-000002.job-000007.gen-4"}));
  auto state = ReadTrainState(StepDir(o.save_dir, 3));
  ASSERT_TRUE(state.ok()) << state.status();
  EXPECT_EQ(state->step, 3);

  // Another job's prune puts back any writer's whole checkpoint aside
  // whose step has none (generation 4's too: it is not that job's), and
  // removes leftovers: a copy whose step is there, a prune's removal, a
  // half-removed one, one of another step.
  const std::string half = o.save_dir + "/.trash-step-000004.job-000007.gen-1";
  fs::copy(StepDir(o.save_dir, 4), half, fs::copy_options::recursive);
  ASSERT_TRUE(fs::remove(half + "/rank-00001-of-00002.safetensors"));
  fs::rename(StepDir(o.save_dir, 4), o.save_dir + "/.trash-step-000004.job-000007.gen-3");
  fs::copy(StepDir(o.save_dir, 3), o.save_dir + "/.trash-step-000003.job-000007.gen-3", fs::copy_options::recursive);
  fs::copy(StepDir(o.save_dir, 1), o.save_dir + "/.trash-step-000001", fs::copy_options::recursive);
  fs::copy(StepDir(o.save_dir, 1), o.save_dir + "/.trash-step-000005.job-000007.gen-1", fs::copy_options::recursive);
  auto kept = PruneCheckpoints(o.save_dir, Retention{.keep_last = 1}, "", CheckpointWriter{.job = "job-000009"});
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_TRUE(kept->empty());  // none is its own
  EXPECT_EQ(Entries(o.save_dir), (std::set<std::string>{"step-000001", "step-000002", "step-000003", "step-000004"}));
  auto listed = ListCheckpoints(o.save_dir);
  ASSERT_TRUE(listed.ok()) << listed.status();
  ASSERT_EQ(listed->size(), 4u);
  for (int64_t step = 1; step <= 4; ++step) EXPECT_EQ((*listed)[step - 1].step, step);
  EXPECT_TRUE(fs::exists(StepDir(o.save_dir, 4) + "/rank-00001-of-00002.safetensors"));
}

}  // namespace
}  // namespace colod::train
