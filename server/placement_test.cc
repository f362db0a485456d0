// Rank assignment: tp groups packed onto hosts (best fit), device-ordinal
// order, independence from the listing order, spanning when no host fits,
// and too few workers; the placement policy (PlaceJob): device kinds, the
// memory filter, busy and unavailable workers, why a job waits and whether
// it holds the queue.
#include "server/placement.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

v1::WorkerInfo W(const std::string& host, int ordinal) {
  v1::WorkerInfo w;
  w.set_worker_id(absl::StrCat(host, "-gpu", ordinal));
  w.set_address(absl::StrCat(host, ":", 7000 + ordinal));
  w.set_host(host);
  w.set_device_ordinal(ordinal);
  return w;
}

DeviceMesh Mesh(int tp, int dp, v1::TensorParallelMode mode = v1::TENSOR_PARALLEL_MODE_1D) {
  v1::ShardConfig s;
  s.set_tensor_parallel_size(tp);
  s.set_data_parallel_size(dp);
  s.set_tensor_parallel_mode(mode);
  return *DeviceMesh::FromShardConfig(s);
}

std::vector<std::string> Ids(const v1::MeshSpec& m) {
  std::vector<std::string> ids;
  for (const auto& r : m.ranks()) ids.push_back(r.worker_id());
  return ids;
}

TEST(Placement, TensorParallelGroupsStayOnOneHostInOrdinalOrder) {
  std::vector<v1::WorkerInfo> workers = {W("b", 1), W("a", 1), W("b", 0), W("a", 0)};
  auto m = AssignRanks(Mesh(2, 2), workers);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(Ids(*m), (std::vector<std::string>{"a-gpu0", "a-gpu1", "b-gpu0", "b-gpu1"}));
  EXPECT_EQ(m->world_size(), 4);
  EXPECT_EQ(m->ranks(3).worker_address(), "b:7001");
  EXPECT_EQ(m->ranks(2).rank(), 2);
  EXPECT_GT(m->groups_size(), 0);  // every group of every axis, from the mesh
  // Any listing order gives the same placement.
  std::mt19937 rng(1);
  for (int i = 0; i < 5; ++i) {
    std::shuffle(workers.begin(), workers.end(), rng);
    EXPECT_EQ(Ids(*AssignRanks(Mesh(2, 2), workers)), Ids(*m));
  }
}

TEST(Placement, BestFitKeepsLargerHostsWhole) {
  // Hosts with 3 and 2 free workers, two groups of 2: the first goes to the
  // 2-worker host, the second to the 3-worker host.
  auto m = AssignRanks(Mesh(2, 2), {W("big", 0), W("big", 1), W("big", 2), W("small", 0), W("small", 1)});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(Ids(*m), (std::vector<std::string>{"small-gpu0", "small-gpu1", "big-gpu0", "big-gpu1"}));
}

TEST(Placement, AGroupNoHostHoldsSpansHostsInOrder) {
  auto m = AssignRanks(Mesh(4, 1), {W("b", 0), W("a", 2), W("a", 0), W("b", 1), W("a", 1)});
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(Ids(*m), (std::vector<std::string>{"a-gpu0", "a-gpu1", "a-gpu2", "b-gpu0"}));
}

// Pipeline stages (dp, pp, tp): a stage's tp group on one host, and a
// replica's neighbouring stages on the same host while it has room.
TEST(Placement, NeighbouringPipelineStagesShareAHost) {
  v1::ShardConfig s;
  s.set_tensor_parallel_size(2);
  s.set_pipeline_parallel_size(2);
  s.set_data_parallel_size(2);
  const DeviceMesh mesh = *DeviceMesh::FromShardConfig(s);
  std::vector<v1::WorkerInfo> workers;
  for (const char* host : {"b", "a"}) {
    for (int i = 0; i < 4; ++i) workers.push_back(W(host, i));
  }
  auto m = AssignRanks(mesh, workers);
  ASSERT_TRUE(m.ok()) << m.status();
  // Ranks 0-3 are replica 0's stages 0 and 1, ranks 4-7 replica 1's.
  EXPECT_EQ(Ids(*m), (std::vector<std::string>{"a-gpu0", "a-gpu1", "a-gpu2", "a-gpu3", "b-gpu0", "b-gpu1", "b-gpu2",
                                               "b-gpu3"}));
  bool has_pp = false;
  for (const auto& g : m->groups()) has_pp = has_pp || g.axis() == "pp";
  EXPECT_TRUE(has_pp) << "the mesh's pp groups are in the spec";
}

TEST(Placement, TooFewWorkers) {
  auto m = AssignRanks(Mesh(2, 2), {W("a", 0), W("a", 1), W("b", 0)});
  EXPECT_EQ(m.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(m.status().message().find("4 ranks but only 3"), std::string::npos) << m.status();
}

TEST(Placement, A1024RankMeshOn128HostsOf8) {
  std::vector<v1::WorkerInfo> workers;
  for (int h = 0; h < 128; ++h) {
    for (int g = 7; g >= 0; --g) workers.push_back(W(absl::StrCat("node", 1000 + h), g));
  }
  auto m = AssignRanks(Mesh(8, 128, v1::TENSOR_PARALLEL_MODE_3D), workers);  // tp = 2 x 2 x 2
  ASSERT_TRUE(m.ok()) << m.status();
  ASSERT_EQ(m->ranks_size(), 1024);
  for (int r = 0; r < 1024; ++r) {
    EXPECT_EQ(m->ranks(r).host(), m->ranks(r - r % 8).host()) << r;  // the tp group of 8 on one host
    EXPECT_EQ(m->ranks(r).device_ordinal(), r % 8) << r;
  }
}

// A registered worker for PlaceJob: `kind` "cpu" or "cuda", its memory (0:
// not said), BUSY or IDLE.
v1::Worker Live(const std::string& id, const std::string& kind, int64_t memory = 0, bool busy = false) {
  v1::Worker w;
  *w.mutable_info() = W("host-" + kind, static_cast<int>(id.back() - '0'));
  w.mutable_info()->set_worker_id(id);
  w.mutable_info()->set_device_kind(kind == "cuda" ? v1::DEVICE_KIND_CUDA : v1::DEVICE_KIND_CPU);
  w.mutable_info()->set_memory_bytes(memory);
  w.mutable_status()->set_state(busy ? v1::WORKER_STATE_BUSY : v1::WORKER_STATE_IDLE);
  return w;
}

struct PlaceCase {
  std::string name;
  int ranks;
  int64_t need;
  std::vector<v1::Worker> live;
  std::set<std::string> unavailable;
  // Want: the workers placed (empty: it waits), else the waiting reason and
  // whether the job holds the queue.
  std::vector<std::string> placed;
  std::string waiting;
  bool fits_cluster = false;
};

TEST(PlaceJob, ChoosesADeviceKindFiltersAndSaysWhyAJobWaits) {
  constexpr int64_t kGiB = int64_t{1} << 30;
  const std::vector<PlaceCase> cases = {
      {"two idle cpu workers", 2, 0, {Live("c0", "cpu"), Live("c1", "cpu")}, {}, {"c0", "c1"}, "", false},
      {"enough cuda workers win over cpu ones", 2, 0,
       {Live("c0", "cpu"), Live("c1", "cpu"), Live("g0", "cuda"), Live("g1", "cuda")}, {}, {"g0", "g1"}, "", false},
      {"too few cuda workers: the cpu ones", 2, 0, {Live("c0", "cpu"), Live("c1", "cpu"), Live("g0", "cuda")}, {},
       {"c0", "c1"}, "", false},
      {"a busy worker waits for its heartbeat", 2, 0, {Live("c0", "cpu"), Live("c1", "cpu", 0, true)}, {}, {},
       "waiting for workers: needs 2 workers of one device kind; 2 registered (2 cpu, 0 cuda), 1 idle", true},
      {"one holding a rank or refused", 2, 0, {Live("c0", "cpu"), Live("c1", "cpu"), Live("c2", "cpu")}, {"c0", "c2"},
       {}, "waiting for workers: needs 2 workers of one device kind; 3 registered (3 cpu, 0 cuda), 1 idle", true},
      {"more ranks than workers: backfill", 4, 0, {Live("c0", "cpu"), Live("g0", "cuda")}, {}, {},
       "waiting for workers: needs 4 workers of one device kind; 2 registered (1 cpu, 1 cuda), 2 idle; jobs behind "
       "it that fit run first",
       false},
      {"the memory filter", 2, 2 * kGiB,
       {Live("c0", "cpu", 4 * kGiB), Live("c1", "cpu", kGiB), Live("c2", "cpu")}, {}, {"c0", "c2"}, "", false},
      {"too little memory anywhere", 2, 2 * kGiB, {Live("c0", "cpu", 4 * kGiB), Live("c1", "cpu", kGiB)}, {}, {},
       "waiting for workers: needs 2 workers of one device kind with 2.00 GiB of memory; 1 registered that have it "
       "(1 cpu, 0 cuda), 1 idle; 1 more with less memory; jobs behind it that fit run first",
       false},
  };
  for (const PlaceCase& c : cases) {
    SCOPED_TRACE(c.name);
    auto d = PlaceJob(Mesh(1, c.ranks), c.need, c.live, c.unavailable);
    ASSERT_TRUE(d.ok()) << d.status();
    if (!c.placed.empty()) {
      ASSERT_TRUE(d->placed.has_value()) << d->waiting;
      std::vector<std::string> got = Ids(*d->placed);
      std::sort(got.begin(), got.end());
      EXPECT_EQ(got, c.placed);
      continue;
    }
    EXPECT_FALSE(d->placed.has_value());
    EXPECT_EQ(d->waiting, c.waiting);
    EXPECT_EQ(d->fits_cluster, c.fits_cluster);
  }
}

// A job that trains a masked language model goes only to workers that say
// they train one: an older worker would drop TrainConfig.mask_token_id and
// train the model on next tokens, its replica's gradients of another loss.
TEST(PlaceJob, AMaskedLanguageModelGoesOnlyToWorkersThatTrainOne) {
  std::vector<v1::Worker> live = {Live("c0", "cpu"), Live("c1", "cpu"), Live("c2", "cpu")};
  live[0].mutable_info()->set_trains_masked_lm(true);
  live[2].mutable_info()->set_trains_masked_lm(true);
  auto d = PlaceJob(Mesh(1, 2), 0, live, {}, WorkerNeeds{.masked_lm = true});
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->placed.has_value()) << d->waiting;
  std::vector<std::string> got = Ids(*d->placed);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<std::string>{"c0", "c2"}));
  live[2].mutable_info()->set_trains_masked_lm(false);
  d = PlaceJob(Mesh(1, 2), 0, live, {}, WorkerNeeds{.masked_lm = true});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->placed.has_value());
  EXPECT_EQ(d->waiting,
            "waiting for workers: needs 2 workers of one device kind; 1 registered (1 cpu, 0 cuda), 1 idle; 2 more of "
            "an older colod, which trains no masked language model (upgrade them); jobs behind it that fit run first");
  // Another job takes any of them.
  d = PlaceJob(Mesh(1, 3), 0, live, {});
  ASSERT_TRUE(d.ok() && d->placed.has_value());
  // Which jobs those are: one training BERT (its [MASK] id), a forward pass
  // of one; not another model's, nor a tensor job.
  const std::string bert = R"({"model_type":"bert","vocab_size":50,"hidden_size":16,"num_hidden_layers":1,
      "num_attention_heads":2,"intermediate_size":32})";
  const std::string gpt2 = R"({"model_type":"gpt2","vocab_size":50,"n_embd":16,"n_layer":1,"n_head":2})";
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_TRAIN);
  spec.mutable_model()->set_config_json(bert);
  EXPECT_FALSE(RunsAMaskedLanguageModel(spec));  // (refused at submit without its id)
  spec.mutable_train()->set_mask_token_id(4);
  EXPECT_TRUE(RunsAMaskedLanguageModel(spec));
  spec.set_kind(v1::JOB_KIND_FORWARD);
  EXPECT_TRUE(RunsAMaskedLanguageModel(spec));
  spec.mutable_model()->set_config_json(gpt2);
  EXPECT_FALSE(RunsAMaskedLanguageModel(spec));
  spec.set_kind(v1::JOB_KIND_TENSOR);
  EXPECT_FALSE(RunsAMaskedLanguageModel(spec));
}

// A job that trains in fp16 goes only to workers that scale its loss: an
// older worker refuses it, or (older still) trains it unscaled, its
// replica's gradients then off by the scale.
TEST(PlaceJob, AnFp16TrainingJobGoesOnlyToWorkersThatScaleItsLoss) {
  std::vector<v1::Worker> live = {Live("c0", "cpu"), Live("c1", "cpu"), Live("c2", "cpu")};
  live[1].mutable_info()->set_scales_fp16_loss(true);
  live[2].mutable_info()->set_scales_fp16_loss(true);
  auto d = PlaceJob(Mesh(1, 2), 0, live, {}, WorkerNeeds{.fp16_loss_scaling = true});
  ASSERT_TRUE(d.ok()) << d.status();
  ASSERT_TRUE(d->placed.has_value()) << d->waiting;
  std::vector<std::string> got = Ids(*d->placed);
  std::sort(got.begin(), got.end());
  EXPECT_EQ(got, (std::vector<std::string>{"c1", "c2"}));
  // Needing both, only a worker with both will do.
  live[1].mutable_info()->set_trains_masked_lm(true);
  d = PlaceJob(Mesh(1, 1), 0, live, {}, WorkerNeeds{.masked_lm = true, .fp16_loss_scaling = true});
  ASSERT_TRUE(d.ok() && d->placed.has_value());
  EXPECT_EQ(Ids(*d->placed), std::vector<std::string>{"c1"});
  d = PlaceJob(Mesh(1, 2), 0, live, {}, WorkerNeeds{.masked_lm = true, .fp16_loss_scaling = true});
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE(d->placed.has_value());
  EXPECT_NE(d->waiting.find("2 more of an older colod, which trains no masked language model or scales no fp16 "
                            "run's loss (upgrade them)"),
            std::string::npos)
      << d->waiting;
  // Which jobs those are: training in fp16, not evaluating in it, nor
  // training at another precision.
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_TRAIN);
  EXPECT_FALSE(TrainsInFp16(spec));
  spec.mutable_train()->set_precision(v1::PRECISION_FP16_MIXED);
  EXPECT_TRUE(TrainsInFp16(spec));
  spec.mutable_train()->set_eval_only(true);
  EXPECT_FALSE(TrainsInFp16(spec));
  spec.mutable_train()->set_eval_only(false);
  spec.mutable_train()->set_precision(v1::PRECISION_BF16_MIXED);
  EXPECT_FALSE(TrainsInFp16(spec));
  spec.mutable_train()->set_precision(v1::PRECISION_UNSPECIFIED);  // auto, naming a scale: to resume fp16
  spec.mutable_train()->set_loss_scale(1024);
  EXPECT_TRUE(TrainsInFp16(spec));
  spec.mutable_train()->clear_loss_scale();
  spec.mutable_train()->set_loss_scale_window(10);
  EXPECT_TRUE(TrainsInFp16(spec));
  spec.mutable_train()->set_loss_scale_window(0);
  EXPECT_FALSE(TrainsInFp16(spec));
  spec.mutable_train()->set_precision(v1::PRECISION_FP16_MIXED);
  spec.set_kind(v1::JOB_KIND_FORWARD);
  EXPECT_FALSE(TrainsInFp16(spec));
}

}  // namespace
}  // namespace colod
