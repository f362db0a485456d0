// `coloctl train` as a user runs it: a tiny GPT-2 trained on the GPL's text
// at two layouts with the same losses, one JSON object per step, the final
// model written as a Hugging Face directory that `coloctl forward` runs (2D
// and 3D); the other families at their layouts, LLaMA in 3D.
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/subprocess.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"
#include "worker/tensor/npy.h"
#include "worker/train/data.h"
#include "worker/train/tokenizer.h"
#include "worker/train/tokenizer_testing.h"

namespace colod {
namespace {

using ::colod::testing::Runfile;
using ::colod::testing::TempPath;
using ::colod::testing::RunCommand;
using ::colod::testing::ReadFile;

testing::CommandResult Coloctl(std::vector<std::string> args) {
  args.insert(args.begin(), Runfile("client/coloctl"));
  return RunCommand(args, std::getenv("TEST_TMPDIR"), absl::Seconds(240));
}

std::vector<nlohmann::json> Lines(const std::string& out) {
  std::vector<nlohmann::json> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line, nullptr, false));
  return lines;
}

// Runs `common` (a coloctl train command line with --steps 4 and --output
// json) at each of `layouts`, and expects every run's 4 losses to be the
// first's, and the first's to fall.
void ExpectSameLossesAtEveryLayout(const std::vector<std::string>& common,
                                   const std::vector<std::vector<std::string>>& layouts) {
  std::vector<std::vector<nlohmann::json>> runs;
  for (const std::vector<std::string>& layout : layouts) {
    std::vector<std::string> args = common;
    args.insert(args.end(), layout.begin(), layout.end());
    const auto r = Coloctl(args);
    ASSERT_EQ(r.code, 0) << r.err;
    runs.push_back(Lines(r.out));
    ASSERT_EQ(runs.back().size(), 4u) << r.out;
  }
  for (size_t run = 1; run < runs.size(); ++run) {
    for (size_t i = 0; i < 4; ++i) {
      const double want = runs[0][i]["loss"].get<double>();
      EXPECT_NEAR(runs[run][i]["loss"].get<double>(), want, 1e-4 * want) << "run " << run << " step " << i + 1;
    }
  }
  EXPECT_LT(runs[0][3]["loss"].get<double>(), runs[0][0]["loss"].get<double>());
}

// A mistake in the client's own flags is a usage error before an embedded
// cluster starts (before, a coordinator and its workers started and were
// torn down first), and TLS flags, which only a named coordinator takes,
// are refused for the embedded one.
TEST(Train, ClientFlagMistakesAreRefusedBeforeAClusterStarts) {
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("gpt2-flags"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<std::string> train = {"train",
                                          "--model",
                                          model->dir,
                                          "--data",
                                          "/usr/share/common-licenses/GPL-3",
                                          "--steps",
                                          "1",
                                          "--batch-size",
                                          "8",
                                          "--seq-len",
                                          "16",
                                          "--tp",
                                          "1",
                                          "--dp",
                                          "8"};
  std::vector<std::string> args = train;
  args.insert(args.end(), {"--watch-timeout", "0s"});
  absl::Time start = absl::Now();
  auto r = Coloctl(args);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--watch-timeout: must be > 0"), std::string::npos) << r.err;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5)) << "8 workers started first?";
  // (A PEM block: the file is read before the embedded cluster is refused.)
  std::ofstream(TempPath("ca.pem")) << "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIU\n-----END CERTIFICATE-----\n";
  args = train;
  args.insert(args.begin(), {"--tls-ca", TempPath("ca.pem")});
  r = Coloctl(args);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("the embedded cluster of this machine runs without TLS"), std::string::npos) << r.err;
}

// Ctrl-C during `coloctl tokenize` (coloctl-run) exits 130 and leaves
// none of the dataset it was writing: before, its PREFIX.bin.tmp.PID.N
// stayed, as large as what it had tokenized.
TEST(Train, AnInterruptedTokenizeLeavesNoUnfinishedFile) {
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("gpt2_interrupted"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  train::testing::WriteSmallGpt2Tokenizer(model->dir);
  const std::string gpl = ReadFile("/usr/share/common-licenses/GPL-3");
  const std::string dir = TempPath("interrupted");
  std::filesystem::create_directories(dir);
  {
    std::ofstream big(dir + "/big.txt");
    for (int i = 0; i < 800; ++i) big << gpl;  // about 28 MB: seconds to tokenize
  }
  testing::Subprocess tokenize({Runfile("client/coloctl"), "tokenize", "--model", model->dir, "--input",
                                dir + "/big.txt", "--out", dir + "/big"},
                               TempPath("interrupted.out"), TempPath("interrupted.err"));
  const auto unfinished = [&] {
    std::vector<std::string> found;
    for (const auto& e : std::filesystem::directory_iterator(dir)) {
      if (e.path().filename().string().find(".tmp.") != std::string::npos) found.push_back(e.path().string());
    }
    return found;
  };
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (unfinished().empty() && absl::Now() < deadline) absl::SleepFor(absl::Milliseconds(10));
  ASSERT_FALSE(unfinished().empty()) << ReadFile(TempPath("interrupted.err"));
  tokenize.Signal(SIGINT);
  const std::optional<int> code = tokenize.Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 130) << ReadFile(TempPath("interrupted.err"));
  EXPECT_NE(ReadFile(TempPath("interrupted.err")).find("removed 1 unfinished file"), std::string::npos)
      << ReadFile(TempPath("interrupted.err"));
  EXPECT_EQ(unfinished(), std::vector<std::string>{});
  EXPECT_FALSE(std::filesystem::exists(dir + "/big.bin"));
}

TEST(Train, TwoLayoutsOneRunAndAModelThatRunsAgain) {
  shardformer::testing::TinyOptions o;
  o.vocab = 257;  // byte-level text
  o.positions = 32;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("gpt2"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<std::string> common = {"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3",
                                           "--steps", "5", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3",
                                           "--optimizer", "adamw", "--seed", "3", "--output", "json"};
  std::vector<std::string> single = common, sharded = common;
  single.insert(single.end(), {"--tp", "1", "--dp", "1", "--mode", "1d"});
  sharded.insert(sharded.end(), {"--tp", "2", "--dp", "2", "--mode", "1d", "--final", TempPath("trained")});
  const auto a = Coloctl(single), b = Coloctl(sharded);
  ASSERT_EQ(a.code, 0) << a.err;
  ASSERT_EQ(b.code, 0) << b.err;
  const auto la = Lines(a.out), lb = Lines(b.out);
  ASSERT_EQ(la.size(), 5u) << a.out;
  ASSERT_EQ(lb.size(), 5u) << b.out;
  for (size_t i = 0; i < 5; ++i) {
    for (const char* key : {"step", "loss", "lr", "grad_norm", "tokens_per_second", "param_bytes"}) {
      ASSERT_TRUE(la[i].contains(key)) << key << " missing from " << la[i];
    }
    EXPECT_EQ(la[i]["step"], i + 1);
    EXPECT_NEAR(lb[i]["loss"].get<double>(), la[i]["loss"].get<double>(), 1e-4 * la[i]["loss"].get<double>());
  }
  EXPECT_LT(la[4]["loss"].get<double>(), la[0]["loss"].get<double>());
  // fp16 through the coordinator and a worker: each step says its loss
  // scale, which doubles after every 2 steps without overflow (1024 is far
  // from f16's overflow here), and the losses are the f32 run's within 1 %.
  std::vector<std::string> fp16 = single;
  fp16.insert(fp16.end(), {"--precision", "fp16", "--loss-scale", "1024", "--loss-scale-window", "2"});
  const auto h = Coloctl(fp16);
  ASSERT_EQ(h.code, 0) << h.err;
  const auto lh = Lines(h.out);
  ASSERT_EQ(lh.size(), 5u) << h.out;
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(lh[i]["loss_scale"], 1024 << (i / 2)) << lh[i];
    EXPECT_EQ(lh[i]["update_skipped"], false) << lh[i];
    EXPECT_NEAR(lh[i]["loss"].get<double>(), la[i]["loss"].get<double>(), 1e-2 * la[i]["loss"].get<double>());
    EXPECT_FALSE(la[i].contains("loss_scale")) << la[i];
  }
  // A scale for another precision, or one that is not a power of two, is a
  // usage error naming the field.
  std::vector<std::string> wrong = single;
  wrong.insert(wrong.end(), {"--precision", "bf16", "--loss-scale", "1024"});
  const auto w = Coloctl(wrong);
  EXPECT_EQ(w.code, 2) << w.err;
  EXPECT_NE(w.err.find("loss_scale: only fp16 training"), std::string::npos) << w.err;
  wrong = single;
  wrong.insert(wrong.end(), {"--precision", "fp16", "--loss-scale", "1000"});
  const auto n = Coloctl(wrong);
  EXPECT_EQ(n.code, 2) << n.err;
  EXPECT_NE(n.err.find("loss_scale: 1000 is not a power of two"), std::string::npos) << n.err;
  // Parameters split over tp = 2: rank 0 holds about half of them.
  EXPECT_LT(lb[0]["param_bytes"].get<int64_t>(), la[0]["param_bytes"].get<int64_t>());
  EXPECT_EQ(la[0]["optimizer_bytes"].get<int64_t>(), 2 * la[0]["param_bytes"].get<int64_t>());  // AdamW: m and v

  // `coloctl plan` of the sharded run, from config.json alone, says what its ranks held.
  const auto plan = Coloctl({"plan", "--model", model->dir, "--batch-size", "4", "--seq-len", "32", "--tp", "2",
                             "--dp", "2", "--output", "json"});
  ASSERT_EQ(plan.code, 0) << plan.err;
  const nlohmann::json p = nlohmann::json::parse(plan.out, nullptr, false);
  ASSERT_TRUE(p.is_object()) << plan.out;
  EXPECT_EQ(p["layout"], "tp2 x dp2 1d");
  for (const char* key : {"param_bytes", "grad_bytes", "optimizer_bytes"}) {
    EXPECT_EQ(p[key].get<int64_t>(), lb[0][key].get<int64_t>()) << key;
  }
  EXPECT_GT(p["activation_bytes"].get<int64_t>(), 0);
  ASSERT_TRUE(p["comm"].is_array() && !p["comm"].empty()) << plan.out;
  const auto layouts = Coloctl({"plan", "--model", model->dir, "--batch-size", "4", "--seq-len", "32", "--world", "4"});
  ASSERT_EQ(layouts.code, 0) << layouts.err;
  EXPECT_NE(layouts.out.find("tp2 x dp2 1d"), std::string::npos) << layouts.out;
  EXPECT_NE(layouts.out.find("tp1 x dp4 1d"), std::string::npos) << layouts.out;
  // Two pipeline stages of the 2 layers, one micro-batch: half the step idle.
  EXPECT_NE(layouts.out.find("tp2 x pp2 x dp1 1d"), std::string::npos) << layouts.out;
  EXPECT_NE(layouts.out.find("50%"), std::string::npos) << layouts.out;
  const auto staged = Coloctl({"plan", "--model", model->dir, "--batch-size", "4", "--seq-len", "32", "--pp", "2",
                               "--micro-batches", "2"});
  ASSERT_EQ(staged.code, 0) << staged.err;
  EXPECT_NE(staged.out.find("pipeline bubble: 33%"), std::string::npos) << staged.out;
  const auto tiny =
      Coloctl({"plan", "--model", model->dir, "--seq-len", "32", "--world", "4", "--memory-per-rank", "1KiB"});
  EXPECT_EQ(tiny.code, 1) << "nothing fits in 1 KiB: " << tiny.out;
  EXPECT_NE(tiny.out.find("more than"), std::string::npos) << tiny.out;
  const auto tiny_json = Coloctl({"plan", "--model", model->dir, "--seq-len", "32", "--world", "4", "--memory-per-rank",
                                  "1KiB", "--output", "json"});
  EXPECT_EQ(tiny_json.code, 1) << "nothing fits in 1 KiB, as JSON too: " << tiny_json.out;
  EXPECT_NE(tiny_json.out.find("\"fits\": []"), std::string::npos) << tiny_json.out;
  const auto unsized = Coloctl({"plan", "--model", model->dir, "--world", "4", "--memory-per-rank", "lots"});
  EXPECT_EQ(unsized.code, 2) << unsized.err;
  // --world ranks every layout: a layout's flags would be ignored.
  const auto fixed = Coloctl({"plan", "--model", model->dir, "--world", "4", "--tp", "2", "--mode", "1d"});
  EXPECT_EQ(fixed.code, 2) << fixed.err;
  EXPECT_NE(fixed.err.find("plan --world: --tp, --mode do not apply"), std::string::npos) << fixed.err;
  // On GPU workers auto precision is bf16 mixed: planned so (2-byte parameters).
  const auto on_gpus = Coloctl({"plan", "--model", model->dir, "--batch-size", "4", "--seq-len", "32", "--tp", "2",
                                "--dp", "2", "--device", "cuda", "--output", "json"});
  ASSERT_EQ(on_gpus.code, 0) << on_gpus.err;
  const nlohmann::json g = nlohmann::json::parse(on_gpus.out, nullptr, false);
  ASSERT_TRUE(g.is_object()) << on_gpus.out;
  EXPECT_EQ(g["param_bytes"].get<int64_t>() * 2, p["param_bytes"].get<int64_t>());
  const auto gpu_text = Coloctl({"plan", "--model", model->dir, "--seq-len", "32", "--device", "cuda"});
  ASSERT_EQ(gpu_text.code, 0) << gpu_text.err;
  EXPECT_NE(gpu_text.out.find("bf16 mixed (auto, as on GPU workers)"), std::string::npos) << gpu_text.out;

  // The trained model loads again, at another layout, and is not the initial one.
  ASSERT_TRUE(WriteNpy(TempPath("ids.npy"), shardformer::testing::TokenIds(2, 16, 257, 1)).ok());
  const auto before = Coloctl({"forward", "--model", model->dir, "--input", TempPath("ids.npy"), "--output", "json"});
  const auto after = Coloctl({"forward", "--model", TempPath("trained"), "--input", TempPath("ids.npy"), "--tp", "4",
                              "--mode", "2d", "--output", "json"});
  ASSERT_EQ(before.code, 0) << before.err;
  ASSERT_EQ(after.code, 0) << after.err;
  EXPECT_NE(Lines(before.out)[0]["loss"], Lines(after.out)[0]["loss"]);
  // ... and at 3D on 8 workers, whose batch splits q*q = 4 ways, with the 2D run's loss.
  ASSERT_TRUE(WriteNpy(TempPath("ids4.npy"), shardformer::testing::TokenIds(4, 16, 257, 1)).ok());
  const auto in_2d = Coloctl({"forward", "--model", TempPath("trained"), "--input", TempPath("ids4.npy"), "--tp", "4",
                              "--mode", "2d", "--output", "json"});
  const auto in_3d = Coloctl({"forward", "--model", TempPath("trained"), "--input", TempPath("ids4.npy"), "--tp", "8",
                              "--mode", "3d", "--output", "json"});
  ASSERT_EQ(in_2d.code, 0) << in_2d.err;
  ASSERT_EQ(in_3d.code, 0) << in_3d.err;
  const double loss_2d = Lines(in_2d.out)[0]["loss"].get<double>();
  EXPECT_NEAR(Lines(in_3d.out)[0]["loss"].get<double>(), loss_2d, 1e-4 * loss_2d);
  const auto odd_3d = Coloctl({"forward", "--model", TempPath("trained"), "--input", TempPath("ids.npy"), "--tp", "8",
                               "--mode", "3d", "--output", "json"});
  EXPECT_EQ(odd_3d.code, 1);
  EXPECT_NE(odd_3d.err.find("must divide into 4 blocks"), std::string::npos) << odd_3d.err;

  // Saved every 2 steps and stopped after 3, which saves step 3 too;
  // resumed, steps 4 and 5 repeat the uninterrupted losses.
  std::vector<std::string> cut = single;
  cut.insert(cut.end(), {"--save", TempPath("ck"), "--save-every", "2", "--stop-after", "3"});
  const auto c = Coloctl(cut);
  ASSERT_EQ(c.code, 0) << c.err;
  ASSERT_EQ(Lines(c.out).size(), 3u);
  std::vector<std::string> resume = single;
  resume.insert(resume.end(), {"--resume", TempPath("ck")});
  const auto r = Coloctl(resume);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.err.find("resuming from " + TempPath("ck") + "/step-000003"), std::string::npos) << r.err;
  const auto lr = Lines(r.out);
  ASSERT_EQ(lr.size(), 2u) << r.out;
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(lr[i]["step"], i + 4);
    EXPECT_EQ(lr[i]["loss"], la[i + 3]["loss"]);
  }
  // Without --save, a stop before the last step would keep nothing.
  std::vector<std::string> unsaved = single;
  unsaved.insert(unsaved.end(), {"--stop-after", "3"});
  const auto u = Coloctl(unsaved);
  EXPECT_EQ(u.code, 2) << u.err;
  EXPECT_NE(u.err.find("required with stop_after 3"), std::string::npos) << u.err;
  // --save alone (no --save-every): the stop's checkpoint is its one.
  // In text, coloctl says where the stop's checkpoint is.
  unsaved.insert(unsaved.end(), {"--save", TempPath("ck_stop_only")});
  const auto json_flag = std::find(unsaved.begin(), unsaved.end(), "--output");
  ASSERT_NE(json_flag, unsaved.end());
  unsaved.erase(json_flag, json_flag + 2);
  const auto only = Coloctl(unsaved);
  ASSERT_EQ(only.code, 0) << only.err;
  EXPECT_TRUE(std::filesystem::exists(TempPath("ck_stop_only") + "/step-000003/train_state.json"));
  EXPECT_NE(only.out.find("stopped after step 3 of 5 (--stop-after); its checkpoint is " + TempPath("ck_stop_only") +
                          "/step-000003: --resume"),
            std::string::npos)
      << only.out;
  // Resumed at its last step (--steps 2, the step-2 checkpoint): nothing to
  // train; it says where it resumed all the same, and succeeds.
  std::vector<std::string> done = resume;
  done.back() = TempPath("ck") + "/step-000002";
  done[6] = "2";  // --steps 2
  const auto d = Coloctl(done);
  ASSERT_EQ(d.code, 0) << d.err;
  EXPECT_TRUE(Lines(d.out).empty()) << d.out;
  EXPECT_NE(d.err.find("resuming from " + TempPath("ck") + "/step-000002 (step 2)"), std::string::npos) << d.err;
  // The --save directory is not a checkpoint: consolidate names its newest.
  const auto whole_dir = Coloctl({"consolidate", "--checkpoint", TempPath("ck"), "--out", TempPath("ck_hf")});
  EXPECT_EQ(whole_dir.code, 2) << whole_dir.err;
  EXPECT_NE(whole_dir.err.find("holds training checkpoints, one a step: give one of them, e.g. its newest, "
                               "--checkpoint " +
                               TempPath("ck") + "/step-000003"),
            std::string::npos)
      << whole_dir.err;

  // Text output, and usage errors.
  std::vector<std::string> text = common;
  text.resize(text.size() - 2);  // no --output json
  text[6] = "2";                 // --steps 2
  const auto t = Coloctl(text);
  ASSERT_EQ(t.code, 0) << t.err;
  EXPECT_NE(t.out.find("step 2/2  loss "), std::string::npos) << t.out;
  EXPECT_EQ(Coloctl({"train", "--model", model->dir}).code, 2);
  EXPECT_EQ(Coloctl({"train", "--model", model->dir, "--data", "x", "--optimizer", "lion"}).code, 2);
  // --min-lr: -1 is the default's lr / 10; any other negative is refused, not taken for it.
  // --keep-last: a count of checkpoints; -1 is not "all" (leaving it out is).
  for (const char* keep : {"-1", "0", "x"}) {
    const auto kept = Coloctl({"train", "--model", model->dir, "--data", "x", "--save", TempPath("k"), "--save-every",
                               "1", "--keep-last", keep});
    EXPECT_EQ(kept.code, 2) << kept.err;
    EXPECT_NE(kept.err.find("--keep-last: '" + std::string(keep) + "' is not a count of checkpoints"), std::string::npos)
        << kept.err;
  }
  const auto floor = Coloctl({"train", "--model", model->dir, "--data", "x", "--min-lr", "-0.5"});
  EXPECT_EQ(floor.code, 2) << floor.err;
  EXPECT_NE(floor.err.find("--min-lr: -0.5 is not >= 0 (or -1: lr / 10)"), std::string::npos) << floor.err;
  const auto bad = Coloctl({"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3",
                            "--dp", "3", "--batch-size", "4", "--seq-len", "32"});
  EXPECT_EQ(bad.code, 2) << bad.err;  // refused as the coordinator would, before anything starts
  EXPECT_NE(bad.err.find("data_parallel_size 3"), std::string::npos) << bad.err;
}

// OPT (opt-350m's shape) trains with the same losses at 1D with sequence
// parallelism and in 3D (its projections lone Linear3Ds) as unsharded, and
// its loss falls.
// Ctrl-C on a run on an embedded cluster stops the cluster: its daemons and
// its temporary directory (their state and logs) are gone, and coloctl
// exits 128 + SIGINT.
TEST(Train, AnInterruptedRunStopsItsEmbeddedCluster) {
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  o.positions = 32;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("gpt2-interrupted"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string tmp = TempPath("interrupted-tmp");
  std::filesystem::create_directories(tmp);
  ::setenv("TMPDIR", tmp.c_str(), 1);  // where the embedded cluster's directory goes
  testing::Subprocess run({Runfile("client/coloctl"), "train", "--model", model->dir, "--data",
                           "/usr/share/common-licenses/GPL-3", "--steps", "100000", "--batch-size", "2", "--seq-len",
                           "16", "--output", "json"},
                          TempPath("interrupted.out"), TempPath("interrupted.err"));
  ::unsetenv("TMPDIR");
  for (int i = 0; i < 1200 && ReadFile(TempPath("interrupted.out")).empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  ASSERT_FALSE(ReadFile(TempPath("interrupted.out")).empty()) << ReadFile(TempPath("interrupted.err"));
  int dirs = 0;
  for (const auto& e : std::filesystem::directory_iterator(tmp)) {
    dirs += absl::StartsWith(e.path().filename().string(), "colod-local-");
  }
  EXPECT_EQ(dirs, 1);
  run.Signal(SIGINT);
  const std::optional<int> code = run.Wait(absl::Seconds(60));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 128 + SIGINT) << ReadFile(TempPath("interrupted.err"));
  EXPECT_TRUE(absl::StrContains(ReadFile(TempPath("interrupted.err")), "stopping the embedded cluster"));
  EXPECT_TRUE(std::filesystem::is_empty(tmp)) << "the embedded cluster's directory was left behind";
}

TEST(Train, OptTrainsAlikeAtEveryLayout) {
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  o.positions = 32;
  o.pre_norm = false;
  o.embed_dim = 32;
  o.tie = true;
  auto model = shardformer::testing::WriteTinyOpt(TempPath("opt"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<std::string> common = {"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3",
                                           "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3",
                                           "--optimizer", "adamw", "--seed", "5", "--output", "json"};
  ExpectSameLossesAtEveryLayout(common, {{"--tp", "1", "--dp", "1"},
                                         {"--tp", "2", "--dp", "2", "--mode", "1d", "--sequence-parallel"},
                                         {"--tp", "8", "--dp", "1", "--mode", "3d"}});
}

// LLaMA (grouped-query attention, untied head) trains with the same losses
// at 3D and at tp 2 x pp 2 x dp 2 on 8 workers as unsharded, and GPT-2 (its
// head tied: to the 3D embedding, and across the first and last stages) at
// the same two layouts; the losses fall.
TEST(Train, ThreeDimensionalAndPipelineLayoutsTrainAlike) {
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  o.positions = 32;
  o.tie = false;
  auto model = shardformer::testing::WriteTinyLlama(TempPath("llama"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<std::string> common = {"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3",
                                           "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3",
                                           "--optimizer", "adamw", "--seed", "9", "--output", "json"};
  ExpectSameLossesAtEveryLayout(common, {{"--tp", "1", "--dp", "1"},
                                         {"--tp", "8", "--dp", "1", "--mode", "3d"},
                                         {"--tp", "2", "--pp", "2", "--dp", "2", "--micro-batches", "2"}});
  auto gpt2 = shardformer::testing::WriteTinyGpt2(TempPath("gpt2_pp"), o);
  ASSERT_TRUE(gpt2.ok()) << gpt2.status();
  std::vector<std::string> gpt2_common = common;
  gpt2_common[2] = gpt2->dir;
  ExpectSameLossesAtEveryLayout(gpt2_common, {{"--tp", "1", "--dp", "1"},
                                              {"--tp", "8", "--dp", "1", "--mode", "3d"},
                                              {"--tp", "2", "--pp", "2", "--dp", "2", "--micro-batches", "2"}});
  // Usage errors, and what the coordinator refuses.
  std::vector<std::string> bad = gpt2_common;
  bad.insert(bad.end(), {"--pp", "2", "--pp-layers", "2,x"});
  EXPECT_EQ(Coloctl(bad).code, 2);
  // A pipelined run's final model is a Hugging Face directory like any other.
  std::vector<std::string> final_run = gpt2_common;
  final_run.insert(final_run.end(), {"--pp", "2", "--micro-batches", "2", "--final", TempPath("pp_final")});
  const auto with_final = Coloctl(final_run);
  ASSERT_EQ(with_final.code, 0) << with_final.err;
  ASSERT_TRUE(WriteNpy(TempPath("pp_ids.npy"), shardformer::testing::TokenIds(2, 16, 257, 1)).ok());
  const auto reloaded =
      Coloctl({"forward", "--model", TempPath("pp_final"), "--input", TempPath("pp_ids.npy"), "--output", "json"});
  ASSERT_EQ(reloaded.code, 0) << reloaded.err;
  const auto initial =
      Coloctl({"forward", "--model", gpt2->dir, "--input", TempPath("pp_ids.npy"), "--output", "json"});
  ASSERT_EQ(initial.code, 0) << initial.err;
  EXPECT_NE(Lines(reloaded.out)[0]["loss"], Lines(initial.out)[0]["loss"]) << "the trained model, not the initial one";
}

// BLOOM trains with the same losses at tp = 2 x dp = 2 with sequence
// parallelism and in 2D (tp = 4) as unsharded, and its loss falls (every
// layout's step, 3D's too, is held to the reference in bloom_test).
TEST(Train, BloomTrainsAlikeUnshardedAndSharded) {
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  o.positions = 32;
  o.tie = true;
  auto model = shardformer::testing::WriteTinyBloom(TempPath("bloom"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<std::string> common = {"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3",
                                           "--steps", "4", "--batch-size", "4", "--seq-len", "32", "--lr", "3e-3",
                                           "--optimizer", "adamw", "--seed", "7", "--output", "json"};
  ExpectSameLossesAtEveryLayout(common, {{"--tp", "1", "--dp", "1"},
                                         {"--tp", "2", "--dp", "2", "--sequence-parallel"},
                                         {"--tp", "4", "--mode", "2d"}});
}

// A model whose config.json has fewer layers than its weights trains (as
// Hugging Face loads it), and coloctl warns, from rank 0's TRAINING status,
// what of the files was not loaded.
TEST(Train, TensorsTheModelDidNotLoadAreWarnedOf) {
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  o.positions = 32;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("gpt2_unread"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  nlohmann::json config = nlohmann::json::parse(ReadFile(model->dir + "/config.json"));
  config["n_layer"] = 1;
  std::ofstream(model->dir + "/config.json") << config.dump();
  const auto r = Coloctl({"train", "--model", model->dir, "--data", "/usr/share/common-licenses/GPL-3", "--steps", "1",
                          "--batch-size", "2", "--seq-len", "16", "--tp", "2", "--output", "json"});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(Lines(r.out).size(), 1u) << r.out;
  EXPECT_TRUE(absl::StrContains(r.err, "coloctl: warning: tensors of the model's files not loaded: ")) << r.err;
  EXPECT_TRUE(absl::StrContains(r.err, "transformer.h.1.")) << r.err;
}

// A ViT directory trains on images and labels from .npy files, as jobs on
// the daemons, with the same losses unsharded, at tp2 x dp2 and in 3D;
// without
// labels (or with labels for a language model) the coordinator says which
// field is wrong.
TEST(Train, AnImageClassifierTrainsOnImagesAndLabels) {
  shardformer::testing::TinyOptions o;
  auto vit = shardformer::testing::WriteTinyVit(TempPath("vit"), o);
  ASSERT_TRUE(vit.ok()) << vit.status();
  ASSERT_TRUE(WriteNpy(TempPath("images.npy"), shardformer::testing::PixelValues(16, o, 3)).ok());
  ASSERT_TRUE(WriteNpy(TempPath("labels.npy"), shardformer::testing::ImageLabels(16, o.labels, 5)).ok());
  const std::vector<std::string> common = {"train", "--model", vit->dir, "--data", TempPath("images.npy"),
                                           "--labels", TempPath("labels.npy"), "--steps", "4", "--batch-size", "4",
                                           "--lr", "3e-3", "--optimizer", "adamw", "--seed", "2", "--output", "json"};
  ExpectSameLossesAtEveryLayout(common, {{"--tp", "1", "--dp", "1"}, {"--tp", "2", "--dp", "2"},
                                         {"--tp", "8", "--mode", "3d"}});
  std::vector<std::string> no_labels = {"train", "--model", vit->dir, "--data", TempPath("images.npy"),
                                        "--steps", "1", "--batch-size", "4"};
  const auto r = Coloctl(no_labels);
  EXPECT_EQ(r.code, 2) << r.err;  // a usage error: refused before any cluster starts
  EXPECT_NE(r.err.find("spec.train.labels_path: required for an image classifier"), std::string::npos) << r.err;
}

// A T5 directory (flan-t5's shape) trains on (input, target) pairs from
// .npy files, as jobs on the daemons, with the same losses unsharded, at
// tp2 x dp2, in 2D, in encoder and decoder stages (pp 2) and interleaved
// (pp 2, V 2); the trained model is written as a Hugging Face directory that
// `coloctl forward` runs; pairs without targets are refused naming the field.
TEST(Train, AnEncoderDecoderTrainsOnInputTargetPairs) {
  const shardformer::testing::TinyOptions o = shardformer::testing::TinyFlanT5();
  auto t5 = shardformer::testing::WriteTinyT5(TempPath("t5"), o);
  ASSERT_TRUE(t5.ok()) << t5.status();
  const int64_t n = 16, sd = 5;
  std::vector<int64_t> targets = shardformer::testing::TokenIds(n, sd, t5->config.vocab_size, 7).ToInt64s();
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t s = 2 + i % 4; s < sd; ++s) targets[i * sd + s] = -100;
  }
  ASSERT_TRUE(WriteNpy(TempPath("t5_in.npy"), shardformer::testing::TokenIds(n, 8, t5->config.vocab_size, 3)).ok());
  ASSERT_TRUE(WriteNpy(TempPath("t5_out.npy"), *Tensor::FromInt64s({n, sd}, targets)).ok());
  const std::vector<std::string> common = {"train", "--model", t5->dir, "--data", TempPath("t5_in.npy"),
                                           "--labels", TempPath("t5_out.npy"), "--steps", "4", "--batch-size", "4",
                                           "--lr", "3e-3", "--optimizer", "adamw", "--seed", "2", "--output", "json"};
  ExpectSameLossesAtEveryLayout(common, {{"--tp", "1", "--dp", "1"}, {"--tp", "2", "--dp", "2"},
                                         {"--tp", "4", "--mode", "2d"},
                                         {"--pp", "2", "--micro-batches", "2"},
                                         {"--pp", "2", "--virtual-stages", "2", "--micro-batches", "2"}});
  std::vector<std::string> final_run = common;
  final_run.insert(final_run.end(), {"--tp", "2", "--final", TempPath("t5_trained")});
  const auto trained = Coloctl(final_run);
  ASSERT_EQ(trained.code, 0) << trained.err;
  ASSERT_TRUE(WriteNpy(TempPath("t5_dec.npy"), shardformer::testing::TokenIds(4, sd, t5->config.vocab_size, 9)).ok());
  ASSERT_TRUE(WriteNpy(TempPath("t5_ids.npy"), shardformer::testing::TokenIds(4, 8, t5->config.vocab_size, 5)).ok());
  // The trained model loads again, unsharded, and is not the initial one.
  const auto before = Coloctl({"forward", "--model", t5->dir, "--input", TempPath("t5_ids.npy"), "--decoder-input",
                               TempPath("t5_dec.npy"), "--output", "json"});
  const auto after = Coloctl({"forward", "--model", TempPath("t5_trained"), "--input", TempPath("t5_ids.npy"),
                              "--decoder-input", TempPath("t5_dec.npy"), "--output", "json"});
  ASSERT_EQ(before.code, 0) << before.err;
  ASSERT_EQ(after.code, 0) << after.err;
  EXPECT_NE(Lines(before.out)[0]["loss"], Lines(after.out)[0]["loss"]);
  const auto r = Coloctl({"train", "--model", t5->dir, "--data", TempPath("t5_in.npy"), "--steps", "1",
                          "--batch-size", "4"});
  EXPECT_EQ(r.code, 2) << r.err;  // a usage error: refused before any cluster starts
  EXPECT_NE(r.err.find("spec.train.labels_path: required for an encoder-decoder"), std::string::npos) << r.err;
}

// A run killed with SIGKILL while it checkpoints every step resumes from its
// newest complete checkpoint with the uninterrupted run's losses.
TEST(Train, KilledMidRunResumesFromTheNewestCompleteCheckpoint) {
  shardformer::testing::TinyOptions o;
  o.vocab = 257;
  o.positions = 32;
  auto model = shardformer::testing::WriteTinyGpt2(TempPath("gpt2_kill"), o);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::vector<std::string> args = {Runfile("client/coloctl"), "train", "--model", model->dir, "--data",
                                         "/usr/share/common-licenses/GPL-3", "--steps", "40", "--batch-size", "4",
                                         "--seq-len", "32", "--tp", "2", "--dp", "2", "--seed", "5", "--output", "json"};
  const auto full = Coloctl(std::vector<std::string>(args.begin() + 1, args.end()));
  ASSERT_EQ(full.code, 0) << full.err;
  const auto want = Lines(full.out);
  ASSERT_EQ(want.size(), 40u);
  std::vector<std::string> saving = args;
  saving.insert(saving.end(), {"--save", TempPath("ck_kill"), "--save-every", "1"});
  {
    testing::Subprocess run(saving, TempPath("kill.out"), TempPath("kill.err"));
    // Kill it once a few checkpoints exist, most likely in the middle of writing one.
    const absl::Time deadline = absl::Now() + absl::Seconds(120);
    while (!std::filesystem::exists(TempPath("ck_kill") + "/step-000004") && absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(5));
    }
    run.Signal(SIGKILL);
    ASSERT_TRUE(run.Wait(absl::Seconds(30)).has_value());
  }
  std::vector<std::string> resume(args.begin() + 1, args.end());
  resume.insert(resume.end(), {"--resume", TempPath("ck_kill")});
  const auto r = Coloctl(resume);
  ASSERT_EQ(r.code, 0) << r.err;
  const auto got = Lines(r.out);
  ASSERT_FALSE(got.empty()) << r.err;
  ASSERT_LE(got.size(), 37u);  // at least steps 1-3 were done and checkpointed
  for (const auto& line : got) {
    const int step = line["step"].get<int>();
    EXPECT_EQ(line["loss"], want[step - 1]["loss"]) << "step " << step;
  }
  EXPECT_EQ(got.back()["step"], 40);
}

// Both tokenizer kinds end to end: `coloctl tokenize` writes a Megatron
// dataset of the GPL's paragraphs with the model directory's tokenizer,
// which Megatron's layout reader takes back document for document; and
// `coloctl train` on the daemons gives, bitwise, the same losses on that
// dataset as on the text, which the workers tokenize themselves (their job
// directory links the tokenizer beside the weights).
TEST(Train, TokenizeThenTrainOnTheDaemonsForBothTokenizerKinds) {
  const std::string gpl = "/usr/share/common-licenses/GPL-3";
  for (const std::string kind : {"sentencepiece", "byte-level BPE"}) {
    SCOPED_TRACE(kind);
    const bool spm = kind == "sentencepiece";
    shardformer::testing::TinyOptions o;
    o.vocab = spm ? 400 : 260;
    o.positions = 32;
    auto model = shardformer::testing::WriteTinyGpt2(TempPath(spm ? "gpt2_spm" : "gpt2_bpe"), o);
    ASSERT_TRUE(model.ok()) << model.status();
    if (spm) {
      ASSERT_EQ(train::testing::TrainSentencePiece(model->dir + "/tokenizer", ReadFile(gpl),
                                                   "--vocab_size=400 --model_type=bpe --byte_fallback=true "
                                                   "--normalization_rule_name=identity --remove_extra_whitespaces=false"),
                "");
    } else {
      train::testing::WriteSmallGpt2Tokenizer(model->dir);
    }
    const std::string prefix = TempPath(spm ? "gpl_spm" : "gpl_bpe");
    const auto t = Coloctl({"tokenize", "--model", model->dir, "--input", gpl, "--out", prefix, "--output", "json"});
    ASSERT_EQ(t.code, 0) << t.err;
    const nlohmann::json summary = Lines(t.out)[0];
    EXPECT_EQ(summary["tokenizer"], kind);
    EXPECT_EQ(summary["dtype"], "uint16");
    auto corpus = train::TokenCorpus::Open(prefix);
    ASSERT_TRUE(corpus.ok()) << corpus.status();
    EXPECT_EQ(static_cast<int64_t>((*corpus)->documents().size()), summary["documents"].get<int64_t>());
    EXPECT_GT((*corpus)->documents().size(), 100u);  // the GPL's paragraphs
    EXPECT_EQ((*corpus)->size(), summary["tokens"].get<int64_t>());
    EXPECT_LT((*corpus)->size(), static_cast<int64_t>(ReadFile(gpl).size()));
    // Each document ends with the tokenizer's eos.
    auto tok = train::LoadTokenizer(model->dir);
    ASSERT_TRUE(tok.ok()) << tok.status();
    const std::vector<int64_t>& docs = (*corpus)->documents();
    for (size_t d = 1; d < docs.size(); ++d) {
      int64_t last = -1;
      ASSERT_TRUE((*corpus)->Read(docs[d] - 1, 1, &last).ok());
      EXPECT_EQ(last, *(*tok)->eos_id());
    }
    // The first paragraph decodes back to the GPL's first paragraph.
    const std::vector<int64_t> first = (*corpus)->Window(0, docs[1])->ToInt64s();
    const size_t skip = (*tok)->add_bos() ? 1 : 0;
    auto text = (*tok)->Decode(absl::MakeConstSpan(first).subspan(skip, first.size() - skip - 1));
    ASSERT_TRUE(text.ok()) << text.status();
    EXPECT_EQ(*text, ReadFile(gpl).substr(0, ReadFile(gpl).find("\n\n")));

    const std::vector<std::string> common = {"train", "--model", model->dir, "--steps", "3", "--batch-size", "4",
                                             "--seq-len", "32", "--seed", "5", "--tp", "2", "--output", "json"};
    std::vector<std::string> from_text = common, from_dataset = common;
    from_text.insert(from_text.end(), {"--data", gpl});
    from_dataset.insert(from_dataset.end(), {"--data", prefix});
    const auto a = Coloctl(from_text), b = Coloctl(from_dataset);
    ASSERT_EQ(a.code, 0) << a.err;
    ASSERT_EQ(b.code, 0) << b.err;
    const auto la = Lines(a.out), lb = Lines(b.out);
    ASSERT_EQ(la.size(), 3u) << a.out;
    ASSERT_EQ(lb.size(), 3u) << b.out;
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(la[i]["loss"], lb[i]["loss"]) << "step " << i + 1;
  }
  // Refused, with a reason: no tokenizer, no input, not text.
  const auto none = Coloctl({"tokenize", "--model", TempPath("nowhere"), "--input", gpl, "--out", TempPath("x")});
  EXPECT_EQ(none.code, 1);
  EXPECT_NE(none.err.find("no tokenizer"), std::string::npos) << none.err;
  const auto usage = Coloctl({"tokenize", "--model", TempPath("gpt2_bpe")});
  EXPECT_EQ(usage.code, 2);
  EXPECT_NE(usage.err.find("--input"), std::string::npos) << usage.err;
}

}  // namespace
}  // namespace colod
