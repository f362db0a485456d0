// `coloctl forward` as a user runs it: a tiny GPT-2 directory and an ids
// .npy file in, logits .npy and the loss out, at several layouts, against
// the unsharded reference; and the errors a user can make.
#include <cmath>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/subprocess.h"
#include "tests/testing/temp_dir.h"
#include "worker/colo/testing.h"
#include "worker/shardformer/checkpoint.h"
#include "worker/shardformer/testing.h"
#include "worker/tensor/npy.h"

namespace colod {
namespace {

using ::colod::testing::Runfile;
using ::colod::testing::TempPath;
using ::colod::testing::RunCommand;

class Forward : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = shardformer::testing::WriteTinyGpt2(TempPath("gpt2"));
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *m;
    ids_ = shardformer::testing::TokenIds(4, 8, model_.config.vocab_size, 11);
    ASSERT_TRUE(WriteNpy(TempPath("ids.npy"), ids_).ok());
    auto ref = shardformer::testing::ReferenceGpt2(model_, ids_);
    ASSERT_TRUE(ref.ok()) << ref.status();
    ref_ = *ref;
  }
  testing::CommandResult Coloctl(std::vector<std::string> args) {
    args.insert(args.begin(), Runfile("client/coloctl"));
    return RunCommand(args, std::getenv("TEST_TMPDIR"), absl::Seconds(120));
  }
  // `coloctl forward --output json` of `dir` on ids.npy at `layout`,
  // writing the logits to `logits_file` (under TEST_TMPDIR): its JSON
  // object and the logits read back.
  struct ForwardRun {
    nlohmann::json out;
    Tensor logits;
  };
  void ForwardAt(const std::string& dir, const std::vector<std::string>& layout, const std::string& logits_file,
                 ForwardRun* run) {
    const std::string what = absl::StrJoin(layout, " ");
    std::vector<std::string> args = {"forward", "--model", dir, "--input", TempPath("ids.npy"),
                                     "--logits", TempPath(logits_file), "--output", "json"};
    args.insert(args.end(), layout.begin(), layout.end());
    const auto r = Coloctl(args);
    ASSERT_EQ(r.code, 0) << what << ": " << r.err;
    run->out = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_TRUE(run->out.is_object()) << r.out;
    auto logits = ReadNpy(TempPath(logits_file));
    ASSERT_TRUE(logits.ok()) << logits.status();
    run->logits = *std::move(logits);
  }
  shardformer::testing::TinyModel model_;
  Tensor ids_;
  shardformer::testing::Reference ref_;
};

TEST_F(Forward, LogitsAndLossMatchTheUnshardedModelAtEveryLayout) {
  const std::vector<std::vector<std::string>> layouts = {
      {"--tp", "1", "--dp", "1", "--mode", "1d"},
      {"--tp", "2", "--dp", "2", "--mode", "1d"},
      {"--tp", "4", "--dp", "1", "--mode", "1d", "--sequence-parallel"},
      {"--tp", "4", "--dp", "1", "--mode", "2d"},
  };
  for (const auto& layout : layouts) {
    const std::string what = absl::StrJoin(layout, " ");
    ForwardRun run;
    ASSERT_NO_FATAL_FAILURE(ForwardAt(model_.dir, layout, "logits.npy", &run));
    EXPECT_NEAR(run.out["loss"].get<double>(), ref_.loss, 1e-5 * ref_.loss) << what;
    EXPECT_EQ(run.out["tokens"].get<int64_t>(), 4 * 7) << what;
    EXPECT_EQ(run.out["shape"], nlohmann::json::array({4, 8, model_.config.vocab_size})) << what;
    EXPECT_EQ(run.logits.dtype(), DType::kF32);
    ::colod::testing::ExpectAllClose(run.logits, ref_.logits, "logits " + what, 2e-4);
  }
  // The human-readable form names the loss and the file.
  const auto r = Coloctl({"forward", "--model", model_.dir, "--input", TempPath("ids.npy"), "--logits", TempPath("l.npy")});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("loss "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("l.npy"), std::string::npos) << r.out;
}

// On --coordinator's cluster rank 0's worker writes the logits on its own
// machine: coloctl says which worker, and the path as it resolved there.
// (Here the workers share this machine, so the file is read back.)
TEST_F(Forward, OnAClusterTheLogitsAreSaidToBeOnRankZerosWorker) {
  testing::Daemon coordinator = testing::StartTestCoordinator();
  ASSERT_FALSE(coordinator.grpc.empty()) << testing::ReadFile(coordinator.log);
  std::vector<testing::Daemon> workers = testing::StartTestWorkers(coordinator.grpc, 2);
  const std::vector<std::string> args = {
      "--coordinator", coordinator.grpc,       "forward", "--model", model_.dir, "--input", TempPath("ids.npy"),
      "--logits",      TempPath("remote.npy"), "--tp",    "2"};
  const auto text = Coloctl(args);
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_TRUE(absl::StrContains(text.out, "written to " + TempPath("remote.npy") + " on the machine of worker "))
      << text.out;
  EXPECT_TRUE(absl::StrContains(text.out, " (rank 0's)")) << text.out;
  std::vector<std::string> json_args = args;
  json_args.insert(json_args.end(), {"--output", "json"});
  const auto json = Coloctl(json_args);
  ASSERT_EQ(json.code, 0) << json.err;
  const nlohmann::json out = nlohmann::json::parse(json.out, nullptr, false);
  ASSERT_TRUE(out.is_object()) << json.out;
  EXPECT_EQ(out["logits"], TempPath("remote.npy"));
  ASSERT_TRUE(out["logits_worker"].is_string()) << json.out;
  const auto listed = Coloctl({"--coordinator", coordinator.grpc, "workers"});
  EXPECT_TRUE(absl::StrContains(listed.out, out["logits_worker"].get<std::string>())) << listed.out;
  auto logits = ReadNpy(TempPath("remote.npy"));
  ASSERT_TRUE(logits.ok()) << logits.status();
  ::colod::testing::ExpectAllClose(*logits, ref_.logits, "logits on a cluster", 2e-4);
  // On an embedded cluster (no --coordinator) the file is this machine's.
  const auto local = Coloctl({"forward", "--model", model_.dir, "--input", TempPath("ids.npy"), "--logits",
                              TempPath("local.npy"), "--output", "json"});
  ASSERT_EQ(local.code, 0) << local.err;
  EXPECT_FALSE(nlohmann::json::parse(local.out, nullptr, false).contains("logits_worker")) << local.out;
}

// A config.json of fewer layers than its weights loads (as Hugging Face
// does), and coloctl warns, naming what of the files was not loaded; the
// JSON carries the names and their count.
TEST_F(Forward, TensorsTheModelDidNotLoadAreNamed) {
  const std::string dir = TempPath("one_layer");
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(model_.dir + "/model.safetensors", dir + "/model.safetensors",
                             std::filesystem::copy_options::overwrite_existing);
  nlohmann::json config = nlohmann::json::parse(testing::ReadFile(model_.dir + "/config.json"));
  config["n_layer"] = 1;
  std::ofstream(dir + "/config.json") << config.dump();
  int64_t second = 0;
  for (const auto& [name, t] : model_.tensors) second += absl::StartsWith(name, "transformer.h.1.") ? 1 : 0;
  ASSERT_GT(second, 8);
  const auto text = Coloctl({"forward", "--model", dir, "--input", TempPath("ids.npy")});
  ASSERT_EQ(text.code, 0) << text.err;
  EXPECT_TRUE(absl::StrContains(text.err, absl::StrCat("coloctl: warning: tensors of the model's files not loaded: ",
                                                       second, " (not this model's")))
      << text.err;
  EXPECT_TRUE(absl::StrContains(text.err, "transformer.h.1.attn.c_attn.bias")) << text.err;
  EXPECT_TRUE(absl::StrContains(text.err, absl::StrCat(" and ", second - 8, " more"))) << text.err;
  const auto json = Coloctl({"forward", "--model", dir, "--input", TempPath("ids.npy"), "--output", "json"});
  ASSERT_EQ(json.code, 0) << json.err;
  const nlohmann::json out = nlohmann::json::parse(json.out, nullptr, false);
  ASSERT_TRUE(out.is_object()) << json.out;
  EXPECT_EQ(out["unread_tensor_count"], second);
  EXPECT_EQ(out["unread_tensors"].size(), static_cast<size_t>(second));
  // The model's own files: no warning.
  const auto whole = Coloctl({"forward", "--model", model_.dir, "--input", TempPath("ids.npy")});
  ASSERT_EQ(whole.code, 0) << whole.err;
  EXPECT_FALSE(absl::StrContains(whole.err, "not loaded")) << whole.err;
}

// Without --logits the ranks gather none (each keeps its replica's rows):
// the loss and the logits' shape are those of the gathered run.
TEST_F(Forward, TheLossAloneNeedsNoLogitsGathered) {
  for (const std::vector<std::string>& layout : std::vector<std::vector<std::string>>{
           {"--tp", "2", "--dp", "2", "--mode", "1d"}, {"--tp", "4", "--dp", "1", "--mode", "2d"}}) {
    const std::string what = absl::StrJoin(layout, " ");
    std::vector<std::string> args = {"forward", "--model", model_.dir, "--input", TempPath("ids.npy"), "--output",
                                     "json"};
    args.insert(args.end(), layout.begin(), layout.end());
    const auto r = Coloctl(args);
    ASSERT_EQ(r.code, 0) << what << ": " << r.err;
    const nlohmann::json out = nlohmann::json::parse(r.out, nullptr, false);
    ASSERT_TRUE(out.is_object()) << r.out;
    EXPECT_NEAR(out["loss"].get<double>(), ref_.loss, 1e-5 * ref_.loss) << what;
    EXPECT_EQ(out["tokens"].get<int64_t>(), 4 * 7) << what;
    EXPECT_EQ(out["shape"], nlohmann::json::array({4, 8, model_.config.vocab_size})) << what;
    EXPECT_TRUE(out["logits"].is_null()) << r.out;
  }
}

// An opt-350m-shaped OPT directory (post-norm, project_in/out) through the
// same command, at 1D with sequence parallelism, in 2D and in 3D.
TEST_F(Forward, OptMatchesItsUnshardedReference) {
  shardformer::testing::TinyOptions o;
  o.pre_norm = false;
  o.embed_dim = 32;
  o.tie = true;
  auto opt = shardformer::testing::WriteTinyOpt(TempPath("opt"), o);
  ASSERT_TRUE(opt.ok()) << opt.status();
  auto ref = shardformer::testing::ReferenceOpt(*opt, ids_);
  ASSERT_TRUE(ref.ok()) << ref.status();
  for (const std::vector<std::string>& layout : std::vector<std::vector<std::string>>{
           {"--tp", "2", "--dp", "2", "--mode", "1d", "--sequence-parallel"},
           {"--tp", "4", "--mode", "2d"},
           {"--tp", "8", "--mode", "3d"}}) {
    const std::string what = absl::StrJoin(layout, " ");
    ForwardRun run;
    ASSERT_NO_FATAL_FAILURE(ForwardAt(opt->dir, layout, "opt_logits.npy", &run));
    EXPECT_NEAR(run.out["loss"].get<double>(), ref->loss, 1e-5 * ref->loss) << what;
    ::colod::testing::ExpectAllClose(run.logits, ref->logits, "OPT logits " + what, 2e-4);
  }
}

// BERT (bidirectional, post-norm, the MLM head tied to the word table) in
// 2D on 4 workers, 3D on 8 (q = 2) and with sequence parallelism: its
// logits are the unsharded reference's, and so is its loss against the
// masked positions' labels (--labels). A masked language model has no
// next-token loss: without labels there is none.
TEST_F(Forward, BertIn2dAnd3dMatchesItsUnshardedReference) {
  auto bert = shardformer::testing::WriteTinyBert(TempPath("bert"));
  ASSERT_TRUE(bert.ok()) << bert.status();
  const Tensor labels = shardformer::testing::MaskedLabels(ids_);
  ASSERT_TRUE(WriteNpy(TempPath("bert_labels.npy"), labels).ok());
  auto ref = shardformer::testing::ReferenceBert(*bert, ids_, labels);
  ASSERT_TRUE(ref.ok()) << ref.status();
  for (const std::vector<std::string>& layout :
       std::vector<std::vector<std::string>>{{"--tp", "2", "--mode", "1d", "--labels", TempPath("bert_labels.npy")},
                                             {"--tp", "4", "--mode", "2d", "--labels", TempPath("bert_labels.npy")},
                                             {"--tp", "8", "--mode", "3d", "--labels", TempPath("bert_labels.npy")},
                                             {"--tp", "2", "--dp", "2", "--mode", "1d", "--sequence-parallel",
                                              "--labels", TempPath("bert_labels.npy")}}) {
    const std::string what = absl::StrJoin(layout, " ");
    ForwardRun run;
    ASSERT_NO_FATAL_FAILURE(ForwardAt(bert->dir, layout, "bert_logits.npy", &run));
    EXPECT_NEAR(run.out["loss"].get<double>(), ref->loss, 1e-5 * ref->loss) << what;
    EXPECT_EQ(run.out["tokens"].get<int64_t>(), ref->tokens) << what;
    ::colod::testing::ExpectAllClose(run.logits, ref->logits, "BERT logits " + what, 2e-4);
  }
  ForwardRun bare;
  ASSERT_NO_FATAL_FAILURE(ForwardAt(bert->dir, {"--tp", "2"}, "bert_logits.npy", &bare));
  EXPECT_TRUE(bare.out["loss"].is_null()) << bare.out;
  EXPECT_EQ(bare.out["tokens"].get<int64_t>(), 0) << bare.out;
  ::colod::testing::ExpectAllClose(bare.logits, ref->logits, "BERT logits without labels", 2e-4);
  // Labels of another shape, or that predict nothing: refused by the run.
  ASSERT_TRUE(WriteNpy(TempPath("bert_row_labels.npy"), *Tensor::FromInt64s({4}, {1, 2, 3, 4})).ok());
  const auto shaped = Coloctl(
      {"forward", "--model", bert->dir, "--input", TempPath("ids.npy"), "--labels", TempPath("bert_row_labels.npy")});
  EXPECT_EQ(shaped.code, 1) << shaped.err;
  EXPECT_NE(shaped.err.find("the labels must be integers shaped as the ids, [4, 8]"), std::string::npos) << shaped.err;
}

// BLOOM (6 heads: ALiBi's second series of slopes, 3 heads a rank) through
// the same command at tp = 2 with sequence parallelism.
TEST_F(Forward, BloomMatchesItsUnshardedReference) {
  shardformer::testing::TinyOptions o;
  o.heads = 6;
  o.hidden = 48;
  o.tie = true;
  auto bloom = shardformer::testing::WriteTinyBloom(TempPath("bloom"), o);
  ASSERT_TRUE(bloom.ok()) << bloom.status();
  auto ref = shardformer::testing::ReferenceBloom(*bloom, ids_);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto r = Coloctl({"forward", "--model", bloom->dir, "--input", TempPath("ids.npy"), "--logits",
                          TempPath("bloom_logits.npy"), "--output", "json", "--tp", "2", "--dp", "2",
                          "--sequence-parallel"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto out = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(out.is_object()) << r.out;
  EXPECT_NEAR(out["loss"].get<double>(), ref->loss, 1e-5 * ref->loss);
  auto logits = ReadNpy(TempPath("bloom_logits.npy"));
  ASSERT_TRUE(logits.ok()) << logits.status();
  ::colod::testing::ExpectAllClose(*logits, ref->logits, "BLOOM logits", 2e-4);
  // 2D: each rank's heads (over tp_row) keep their slopes.
  const auto two_d = Coloctl({"forward", "--model", bloom->dir, "--input", TempPath("ids.npy"), "--logits",
                              TempPath("bloom_2d_logits.npy"), "--output", "json", "--tp", "4", "--mode", "2d"});
  ASSERT_EQ(two_d.code, 0) << two_d.err;
  auto logits_2d = ReadNpy(TempPath("bloom_2d_logits.npy"));
  ASSERT_TRUE(logits_2d.ok()) << logits_2d.status();
  ::colod::testing::ExpectAllClose(*logits_2d, ref->logits, "BLOOM 2d logits", 2e-4);
}

// A ViT directory: pixel values and labels in, logits [batch, num_labels]
// and the classification loss out, at tp = 2 x dp = 2 on the daemons,
// against the unsharded reference; without labels, logits and no loss.
TEST_F(Forward, VitClassifiesImagesAsItsUnshardedReference) {
  shardformer::testing::TinyOptions o;
  auto vit = shardformer::testing::WriteTinyVit(TempPath("vit"), o);
  ASSERT_TRUE(vit.ok()) << vit.status();
  const Tensor pixels = shardformer::testing::PixelValues(4, o, 5);
  const Tensor labels = shardformer::testing::ImageLabels(4, o.labels, 6);
  ASSERT_TRUE(WriteNpy(TempPath("pixels.npy"), pixels).ok());
  ASSERT_TRUE(WriteNpy(TempPath("labels.npy"), labels).ok());
  auto ref = shardformer::testing::ReferenceVit(*vit, pixels, labels);
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto r = Coloctl({"forward", "--model", vit->dir, "--pixel-values", TempPath("pixels.npy"), "--labels",
                          TempPath("labels.npy"), "--logits", TempPath("vit_logits.npy"), "--output", "json", "--tp",
                          "2", "--dp", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto out = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(out.is_object()) << r.out;
  EXPECT_NEAR(out["loss"].get<double>(), ref->loss, 1e-5 * ref->loss);
  EXPECT_EQ(out["tokens"].get<int64_t>(), 4);
  EXPECT_EQ(out["shape"], nlohmann::json::array({4, o.labels}));
  auto logits = ReadNpy(TempPath("vit_logits.npy"));
  ASSERT_TRUE(logits.ok()) << logits.status();
  ::colod::testing::ExpectAllClose(*logits, *ref->logits.Reshape({4, o.labels}), "ViT logits", 2e-4);
  // 2D: the stream in 2D blocks from the replicated embeddings, the CLS
  // rows gathered for the replicated classifier.
  const auto two_d = Coloctl({"forward", "--model", vit->dir, "--pixel-values", TempPath("pixels.npy"), "--labels",
                              TempPath("labels.npy"), "--logits", TempPath("vit_2d_logits.npy"), "--output", "json",
                              "--tp", "4", "--mode", "2d"});
  ASSERT_EQ(two_d.code, 0) << two_d.err;
  auto logits_2d = ReadNpy(TempPath("vit_2d_logits.npy"));
  ASSERT_TRUE(logits_2d.ok()) << logits_2d.status();
  ::colod::testing::ExpectAllClose(*logits_2d, *ref->logits.Reshape({4, o.labels}), "ViT 2d logits", 2e-4);
  // No labels: the logits, no loss.
  const auto plain = Coloctl({"forward", "--model", vit->dir, "--pixel-values", TempPath("pixels.npy")});
  ASSERT_EQ(plain.code, 0) << plain.err;
  EXPECT_NE(plain.out.find("no loss (no --labels)"), std::string::npos) << plain.out;
  // What a user can get wrong.
  ASSERT_TRUE(WriteNpy(TempPath("bad_labels.npy"), *Tensor::FromInt64s({4}, {0, 1, 2, 10})).ok());
  ASSERT_TRUE(WriteNpy(TempPath("small.npy"), *Tensor::Zeros({4, 3, 4, 4}, DType::kF32)).ok());
  struct Bad {
    std::vector<std::string> args;
    int code;
    std::string says;
  };
  for (const Bad& b : std::vector<Bad>{
           {{"--pixel-values", TempPath("pixels.npy"), "--labels", TempPath("bad_labels.npy")}, 1,
            "label 10 of image 3 is outside the model's 10 labels"},
           {{"--pixel-values", TempPath("small.npy")}, 1, "float pixel values [batch, 3, 8, 8]"},
           {{"--input", TempPath("ids.npy")}, 1, "float pixel values [batch, 3, 8, 8]"},
           {{"--input", TempPath("ids.npy"), "--pixel-values", TempPath("pixels.npy")}, 2, "not both"},
           {{"--pixel-values", TempPath("pixels.npy"), "--tp", "2", "--sequence-parallel"}, 2,
            "the vit policy has no sequence_parallel: its sequence"},
       }) {
    std::vector<std::string> args = {"forward", "--model", vit->dir};
    args.insert(args.end(), b.args.begin(), b.args.end());
    const auto bad = Coloctl(args);
    EXPECT_EQ(bad.code, b.code) << absl::StrJoin(args, " ") << "\n" << bad.err;
    EXPECT_NE(bad.err.find(b.says), std::string::npos) << absl::StrJoin(args, " ") << "\n" << bad.err;
  }
  const auto lm_labels = Coloctl({"forward", "--model", model_.dir, "--input", TempPath("ids.npy"), "--labels",
                                  TempPath("labels.npy")});
  EXPECT_EQ(lm_labels.code, 2);
  EXPECT_NE(lm_labels.err.find("spec.forward.labels_path: is for image classifiers and masked language models"),
            std::string::npos)
      << lm_labels.err;
}

// A T5 directory (flan-t5's shape: gated GELU, untied head, heads * d_kv
// unlike d_model): token ids and decoder ids in, the decoder's logits and
// next-token loss out, at tp = 2 x dp = 2 on the daemons, against the
// unsharded reference; and what a user can get wrong.
TEST_F(Forward, T5MatchesItsUnshardedReference) {
  const shardformer::testing::TinyOptions o = shardformer::testing::TinyFlanT5();
  auto t5 = shardformer::testing::WriteTinyT5(TempPath("t5"), o);
  ASSERT_TRUE(t5.ok()) << t5.status();
  const Tensor decoder = shardformer::testing::TokenIds(4, 6, t5->config.vocab_size, 41);
  ASSERT_TRUE(WriteNpy(TempPath("decoder.npy"), decoder).ok());
  std::vector<int64_t> next(decoder.numel(), -100);
  const std::vector<int64_t> d = decoder.ToInt64s();
  for (int64_t b = 0; b < 4; ++b) {
    for (int64_t s = 0; s + 1 < 6; ++s) next[b * 6 + s] = d[b * 6 + s + 1];
  }
  auto ref = shardformer::testing::ReferenceT5(*t5, ids_, decoder, *Tensor::FromInt64s({4, 6}, next));
  ASSERT_TRUE(ref.ok()) << ref.status();
  const auto r = Coloctl({"forward", "--model", t5->dir, "--input", TempPath("ids.npy"), "--decoder-input",
                          TempPath("decoder.npy"), "--logits", TempPath("t5_logits.npy"), "--output", "json", "--tp",
                          "2", "--dp", "2"});
  ASSERT_EQ(r.code, 0) << r.err;
  const auto out = nlohmann::json::parse(r.out, nullptr, false);
  ASSERT_TRUE(out.is_object()) << r.out;
  EXPECT_NEAR(out["loss"].get<double>(), ref->loss, 1e-5 * ref->loss);
  EXPECT_EQ(out["tokens"].get<int64_t>(), 4 * 5);
  auto logits = ReadNpy(TempPath("t5_logits.npy"));
  ASSERT_TRUE(logits.ok()) << logits.status();
  ::colod::testing::ExpectAllClose(*logits, ref->logits, "T5 logits", 2e-4);
  const auto missing = Coloctl({"forward", "--model", t5->dir, "--input", TempPath("ids.npy")});
  EXPECT_EQ(missing.code, 1);
  EXPECT_NE(missing.err.find("encoder-decoder needs decoder input ids"), std::string::npos) << missing.err;
  const auto gpt2 = Coloctl({"forward", "--model", model_.dir, "--input", TempPath("ids.npy"), "--decoder-input",
                             TempPath("decoder.npy")});
  EXPECT_EQ(gpt2.code, 1);
  EXPECT_NE(gpt2.err.find("a gpt2 has no decoder input"), std::string::npos) << gpt2.err;
}

TEST_F(Forward, ACheckpointSavedAtTp2ConsolidatesAndRunsAt2d) {
  shardformer::ShardConfig shard;
  shard.layout.set_tensor_parallel_size(2);
  shard.layout.set_data_parallel_size(1);
  ::colod::testing::RunMesh(*DeviceMesh::FromShardConfig(shard.layout), [&](int, ProcessGroup& pg) {
    auto model = shardformer::ShardFormer(shard, &pg).Load(model_.dir);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_TRUE(shardformer::SaveShardedCheckpoint(**model, TempPath("sharded")).ok());
  });
  auto r = Coloctl({"consolidate", "--checkpoint", TempPath("sharded"), "--out", TempPath("hf")});
  ASSERT_EQ(r.code, 0) << r.err;
  r = Coloctl({"forward", "--model", TempPath("hf"), "--input", TempPath("ids.npy"), "--logits", TempPath("hf_logits.npy"), "--tp",
               "4", "--mode", "2d"});
  ASSERT_EQ(r.code, 0) << r.err;
  auto logits = ReadNpy(TempPath("hf_logits.npy"));
  ASSERT_TRUE(logits.ok()) << logits.status();
  ::colod::testing::ExpectAllClose(*logits, ref_.logits, "logits", 2e-4);
  r = Coloctl({"consolidate", "--checkpoint", TempPath("nowhere"), "--out", TempPath("hf2")});
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.err.find("NOT_FOUND"), std::string::npos) << r.err;
  EXPECT_EQ(Coloctl({"consolidate", "--out", TempPath("hf2")}).code, 2);
  // A model there is not written over.
  const std::string before = ::colod::testing::ReadFile(TempPath("hf") + "/model.safetensors");
  r = Coloctl({"consolidate", "--checkpoint", TempPath("sharded"), "--out", TempPath("hf")});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("consolidate: --out " + TempPath("hf") + " already holds a model (config.json)"),
            std::string::npos) << r.err;
  EXPECT_EQ(::colod::testing::ReadFile(TempPath("hf") + "/model.safetensors"), before);
}

TEST_F(Forward, MistakesAreReportedWithWhatIsWrong) {
  struct Bad {
    std::vector<std::string> args;
    int code;
    std::string says;
  };
  // An unknown model type and a config whose heads tp cannot split.
  ASSERT_EQ(::system(absl::StrCat("mkdir -p ", TempPath("mamba"), " && cp ", model_.dir, "/model.safetensors ", TempPath("mamba"))
                         .c_str()),
            0);
  std::ofstream(TempPath("mamba") + "/config.json") << R"({"model_type": "mamba", "vocab_size": 50})";
  ASSERT_TRUE(WriteNpy(TempPath("floats.npy"), *Tensor::Zeros({2, 3}, DType::kF32)).ok());
  ASSERT_TRUE(WriteNpy(TempPath("big.npy"), *Tensor::FromInt64s({1, 3}, std::vector<int64_t>{1, 2, 999})).ok());
  // What the spec or the model directory says is wrong is a usage error (2)
  // before any cluster starts, as in train; what only the ranks see (the
  // input's values) fails the job (1).
  const std::vector<Bad> cases = {
      {{"forward", "--input", TempPath("ids.npy")}, 2, "--model is required"},
      {{"forward", "--model", model_.dir}, 2, "--input (or --pixel-values for an image classifier) is required"},
      {{"forward", "--model", model_.dir, "--input", TempPath("ids.npy"), "--mode", "4d"}, 2, "'4d'"},
      {{"forward", "--model", model_.dir, "--input", TempPath("ids.npy"), "--tp", "3"}, 2, "attention heads"},
      {{"forward", "--model", model_.dir, "--input", TempPath("ids.npy"), "--dp", "3"}, 1, "data_parallel_size 3"},
      {{"forward", "--model", model_.dir, "--input", TempPath("ids.npy"), "--tp", "8", "--mode", "3d",
        "--sequence-parallel"},
       2,
       "1d only"},
      {{"forward", "--model", model_.dir, "--input", TempPath("ids.npy"), "--pp", "2"},
       2,
       "--pp is not a flag of forward"},
      {{"forward", "--model", TempPath("mamba"), "--input", TempPath("ids.npy")}, 2, "mamba"},
      {{"forward", "--model", TempPath("nowhere"), "--input", TempPath("ids.npy")}, 2, "nowhere/config.json"},
      {{"forward", "--model", model_.dir, "--input", TempPath("floats.npy")}, 1, "integer token ids"},
      {{"forward", "--model", model_.dir, "--input", TempPath("big.npy")}, 1, "999"},
  };
  for (const Bad& b : cases) {
    const auto r = Coloctl(b.args);
    const std::string what = absl::StrJoin(b.args, " ");
    EXPECT_EQ(r.code, b.code) << what << "\n" << r.err;
    EXPECT_NE(r.err.find(b.says), std::string::npos) << what << "\n" << r.err;
  }
}

}  // namespace
}  // namespace colod
