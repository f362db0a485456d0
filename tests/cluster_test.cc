// The three real binaries as separate processes on loopback: a coordinator,
// two workers and coloctl, exactly as the README's demo runs them.
#include <signal.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <utility>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/coordinator_client.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/subprocess.h"
#include "tests/testing/temp_dir.h"
#include "tests/testing/grpc_probe.h"
#include "tests/testing/prometheus_text.h"

namespace colod {
namespace {

using ::colod::testing::Runfile;
using ::colod::testing::TempPath;
using testing::RunCommand;
using testing::Daemon;
using testing::StartDaemon;
using testing::Subprocess;

const std::string kCoordinator = "server/colod-coordinator";
const std::string kWorker = "worker/daemon/colod-worker";
const std::string kColoctl = "client/coloctl";

void ExpectHealthyDaemon(const Daemon& d, const std::string& service, const std::string& component) {
  ASSERT_FALSE(d.grpc.empty()) << testing::ReadFile(d.log);
  EXPECT_EQ(*testing::WaitServing(d.grpc, service), testing::ServingStatus::kServing);
  auto services = testing::ListServicesByReflection(d.grpc);
  ASSERT_TRUE(services.ok()) << services.status();
  EXPECT_NE(std::find(services->begin(), services->end(), service), services->end());
  auto body = testing::HttpGet(d.metrics, "/metrics");
  ASSERT_TRUE(body.ok()) << body.status();
  auto families = testing::ParsePrometheusText(*body);
  ASSERT_TRUE(families.ok()) << families.status();
  const auto& info = families->at("colod_build_info");
  ASSERT_EQ(info.samples.size(), 1u);
  EXPECT_EQ(info.samples[0].labels.at("component"), component);
  EXPECT_EQ(info.samples[0].value, 1);
}

TEST(Cluster, CoordinatorTwoWorkersAndColoctl) {
  Daemon coordinator = StartDaemon(kCoordinator, "coordinator",
                                   {"--data-dir", TempPath("data"), "--heartbeat-interval", "100ms"});
  ASSERT_FALSE(coordinator.grpc.empty()) << testing::ReadFile(coordinator.log);
  Daemon w1 = StartDaemon(kWorker, "w1", {"--coordinator", coordinator.grpc, "--device", "cpu", "--labels",
                                          "zone=a,rack=r12"});
  Daemon w2 = StartDaemon(kWorker, "w2", {"--coordinator", coordinator.grpc, "--device", "cpu"});

  auto client = CoordinatorClient::Create(coordinator.grpc);
  ASSERT_TRUE(client.ok());
  std::vector<v1::Worker> workers;
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    auto list = (*client)->ListWorkers(false);
    ASSERT_TRUE(list.ok()) << list.status();
    workers = *list;
    if (workers.size() == 2) break;
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_EQ(workers.size(), 2u) << testing::ReadFile(w1.log) << testing::ReadFile(w2.log);
  std::set<std::string> addresses = {workers[0].info().address(), workers[1].info().address()};
  EXPECT_EQ(addresses, (std::set<std::string>{w1.grpc, w2.grpc}));

  ExpectHealthyDaemon(coordinator, "colod.v1.CoordinatorService", "coordinator");
  ExpectHealthyDaemon(w1, "colod.v1.WorkerService", "worker");
  ExpectHealthyDaemon(w2, "colod.v1.WorkerService", "worker");

  // coloctl, table and JSON.
  auto table = RunCommand({Runfile(kColoctl), "--coordinator", coordinator.grpc, "workers"}, TempPath(""));
  ASSERT_EQ(table.code, 0) << table.err;
  std::vector<std::string> lines = absl::StrSplit(table.out, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 3u) << table.out;
  EXPECT_TRUE(absl::StartsWith(lines[0], "ID ")) << lines[0];
  EXPECT_TRUE(absl::StrContains(table.out, w1.grpc) && absl::StrContains(table.out, w2.grpc));

  auto json = RunCommand(
      {Runfile(kColoctl), "--coordinator", coordinator.grpc, "workers", "--output", "json"}, TempPath(""));
  ASSERT_EQ(json.code, 0) << json.err;
  nlohmann::json parsed = nlohmann::json::parse(json.out, nullptr, false);
  ASSERT_FALSE(parsed.is_discarded()) << json.out;
  ASSERT_EQ(parsed["workers"].size(), 2u);
  std::set<std::string> json_addresses;
  for (const auto& w : parsed["workers"]) {
    json_addresses.insert(w["info"]["address"].get<std::string>());
    EXPECT_EQ(w["state"], "WORKER_STATE_IDLE");
    EXPECT_EQ(w["info"]["deviceKind"], "DEVICE_KIND_CPU");
    if (w["info"]["address"] == w1.grpc) {
      EXPECT_EQ(w["info"]["labels"], (nlohmann::json{{"zone", "a"}, {"rack", "r12"}})) << w;
    } else {
      EXPECT_TRUE(w["info"]["labels"].empty()) << w;
    }
  }
  EXPECT_EQ(json_addresses, addresses);

  // A job's life through coloctl: submitted, cancelled, deleted (JSON).
  const std::vector<std::string> base = {Runfile(kColoctl), "--coordinator", coordinator.grpc};
  auto with = [&](std::vector<std::string> args) {
    args.insert(args.begin(), base.begin(), base.end());
    return RunCommand(args, TempPath(""));
  };
  auto submitted = with({"submit", "--kind", "tensor", "--tp", "2", "--dp", "1"});
  ASSERT_EQ(submitted.code, 0) << submitted.err;
  const std::string job_id(absl::StripAsciiWhitespace(submitted.out));
  // Its tensors at once: the command waits for the job's ranks to run.
  auto created = with({"tensor", "create", job_id, "t", "--shape", "2,4", "--spec", "tp=S(-1)"});
  EXPECT_EQ(created.code, 0) << created.err;
  auto listed = with({"tensor", "list", job_id});
  EXPECT_EQ(listed.code, 0) << listed.err;
  EXPECT_TRUE(absl::StrContains(listed.out, "t")) << listed.out;
  ASSERT_EQ(with({"tensor", "create", job_id, "u", "--shape", "2"}).code, 0);
  auto tensor_deleted = with({"tensor", "delete", job_id, "u", "--output", "json"});
  EXPECT_EQ(tensor_deleted.code, 0) << tensor_deleted.err;
  EXPECT_EQ(nlohmann::json::parse(tensor_deleted.out, nullptr, false),
            (nlohmann::json{{"job_id", job_id}, {"name", "u"}, {"deleted", true}}))
      << tensor_deleted.out;
  // A TENSOR job runs until cancelled: a watch gives up at its timeout,
  // the coordinator having answered all along (1, not 69).
  auto watched = with({"watch", job_id, "--watch-timeout", "1s"});
  EXPECT_EQ(watched.code, 1) << watched.err;
  EXPECT_TRUE(absl::StrContains(watched.err, "the job did not end within the watch's 1s")) << watched.err;
  auto running_delete = with({"delete", job_id, "--output", "json"});
  EXPECT_EQ(running_delete.code, 1) << running_delete.out;  // not ended: FAILED_PRECONDITION
  EXPECT_TRUE(running_delete.out.empty()) << running_delete.out;
  auto cancelled = with({"cancel", job_id, "--output", "json"});
  ASSERT_EQ(cancelled.code, 0) << cancelled.err;
  EXPECT_EQ(nlohmann::json::parse(cancelled.out, nullptr, false)["state"], "JOB_STATE_CANCELLED") << cancelled.out;
  auto ended = with({"tensor", "list", job_id});
  EXPECT_EQ(ended.code, 1) << ended.err;
  EXPECT_TRUE(absl::StrContains(ended.err, "cancelled")) << ended.err;
  auto deleted = with({"delete", job_id, "--output", "json"});
  ASSERT_EQ(deleted.code, 0) << deleted.err;
  EXPECT_EQ(nlohmann::json::parse(deleted.out, nullptr, false), (nlohmann::json{{"job_id", job_id}, {"deleted", true}}))
      << deleted.out;
  auto gone = with({"status", job_id});
  EXPECT_EQ(gone.code, 1);  // the coordinator's answer: NOT_FOUND
  EXPECT_TRUE(absl::StrContains(gone.err, "NOT_FOUND")) << gone.err;
  EXPECT_TRUE(absl::StrContains(gone.err, job_id)) << gone.err;
  // A coordinator that does not answer in time (stopped) is another exit
  // status, one a script may retry on: 69.
  coordinator.process->Signal(SIGSTOP);
  auto stopped = with({"--timeout", "1s", "status", job_id});
  coordinator.process->Signal(SIGCONT);
  EXPECT_EQ(stopped.code, 69) << stopped.err;
  EXPECT_TRUE(absl::StrContains(stopped.err, "DEADLINE_EXCEEDED")) << stopped.err;
  EXPECT_EQ(with({"status", job_id}).code, 1);  // answering again

  // A stopped worker exits 0 on SIGTERM, and the coordinator on SIGINT.
  w1.process->Signal(SIGTERM);
  EXPECT_EQ(w1.process->Wait(absl::Seconds(20)), 0) << testing::ReadFile(w1.log);
  w2.process->Signal(SIGINT);
  EXPECT_EQ(w2.process->Wait(absl::Seconds(20)), 0) << testing::ReadFile(w2.log);
  coordinator.process->Signal(SIGTERM);
  EXPECT_EQ(coordinator.process->Wait(absl::Seconds(20)), 0) << testing::ReadFile(coordinator.log);
  EXPECT_TRUE(absl::StrContains(testing::ReadFile(coordinator.log), "coordinator stopped"));
}

TEST(Cluster, BinariesHelpAndRejectBadInput) {
  for (const std::string& bin : {kCoordinator, kWorker, kColoctl}) {
    auto help = RunCommand({Runfile(bin), "--help"}, TempPath(""));
    EXPECT_EQ(help.code, 0) << bin;
    EXPECT_TRUE(absl::StrContains(help.out, "Usage:")) << help.out;
    EXPECT_TRUE(absl::StrContains(help.out, "--")) << help.out;
    EXPECT_FALSE(absl::StrContains(help.out, "--flagfile")) << "Abseil's own flags leak into --help";
    auto version = RunCommand({Runfile(bin), "--version"}, TempPath(""));
    EXPECT_EQ(version.code, 0);
    EXPECT_TRUE(absl::StartsWith(version.out, "colod ")) << version.out;
  }
  // One command's help: its part of the usage and the flags it takes (its
  // Command::flags, and the global ones its usage names), as `help CMD` or
  // `CMD --help`.
  const auto whole = RunCommand({Runfile(kColoctl), "--help"}, TempPath(""));
  for (const std::vector<std::string>& asked :
       {std::vector<std::string>{"help", "train"}, std::vector<std::string>{"train", "--help"},
        std::vector<std::string>{"--coordinator", "h:1", "train", "--steps", "3", "-h"}}) {
    std::vector<std::string> argv = {Runfile(kColoctl)};
    argv.insert(argv.end(), asked.begin(), asked.end());
    const auto one = RunCommand(argv, TempPath(""));
    EXPECT_EQ(one.code, 0) << one.err;
    EXPECT_TRUE(absl::StartsWith(one.out, "Usage: coloctl [flags] train\n")) << one.out;
    EXPECT_TRUE(absl::StrContains(one.out, "--steps")) << one.out;        // train's
    EXPECT_TRUE(absl::StrContains(one.out, "\n  --coordinator")) << one.out;  // its usage names it
    EXPECT_FALSE(absl::StrContains(one.out, "--vocab-size")) << one.out;  // init-model's
    EXPECT_FALSE(absl::StrContains(one.out, "tensor demo")) << one.out;   // another command's usage
    EXPECT_LT(one.out.size(), whole.out.size() / 2);
  }
  // init-model: its flags (--seed's help names it after train's) and not the
  // coordinator's; submit takes train's flags.
  const auto init = RunCommand({Runfile(kColoctl), "help", "init-model"}, TempPath(""));
  EXPECT_TRUE(absl::StrContains(init.out, "--seed")) << init.out;
  EXPECT_TRUE(absl::StrContains(init.out, "--heads")) << init.out;
  EXPECT_FALSE(absl::StrContains(init.out, "\n  --coordinator")) << init.out;
  const auto submit = RunCommand({Runfile(kColoctl), "help", "submit"}, TempPath(""));
  for (const char* flag : {"--steps", "--batch-size", "--save-every", "--job-file", "--upload"}) {
    EXPECT_TRUE(absl::StrContains(submit.out, flag)) << flag << "\n" << submit.out;
  }
  // Not train's flags that only a run on this machine reads ("train with
  // --device cuda", "train without --coordinator"), which submit refuses;
  // train itself and forward list them.
  EXPECT_FALSE(absl::StrContains(submit.out, "\n  --comm-timeout")) << submit.out;
  EXPECT_FALSE(absl::StrContains(submit.out, "\n  --device")) << submit.out;
  for (const char* command : {"train", "forward"}) {
    const auto own = RunCommand({Runfile(kColoctl), "help", command}, TempPath(""));
    EXPECT_TRUE(absl::StrContains(own.out, "\n  --comm-timeout")) << own.out;
    EXPECT_TRUE(absl::StrContains(own.out, "\n  --device")) << own.out;
  }
  // Nor another command's flag that a usage cites: tokenize's names
  // "`train --data PREFIX`", tensor's "coloctl submit --kind tensor".
  const auto tokenize = RunCommand({Runfile(kColoctl), "help", "tokenize"}, TempPath(""));
  EXPECT_TRUE(absl::StrContains(tokenize.out, "\n  --data-format")) << tokenize.out;
  EXPECT_FALSE(absl::StrContains(tokenize.out, "\n  --data\n")) << tokenize.out;
  const auto tensor = RunCommand({Runfile(kColoctl), "help", "tensor"}, TempPath(""));
  EXPECT_TRUE(absl::StrContains(tensor.out, "\n  --tp")) << tensor.out;
  EXPECT_FALSE(absl::StrContains(tensor.out, "\n  --kind")) << tensor.out;
  // A flag whose help mentions a command in passing ("health and reflection
  // stay open"), not as the head of its part, is not that command's.
  const auto health = RunCommand({Runfile(kColoctl), "help", "health"}, TempPath(""));
  EXPECT_TRUE(absl::StrContains(health.out, "Usage: coloctl [flags] health\n")) << health.out;
  EXPECT_FALSE(absl::StrContains(health.out, "\n  --auth-token-file")) << health.out;
  const auto workers = RunCommand({Runfile(kColoctl), "help", "workers"}, TempPath(""));
  EXPECT_FALSE(absl::StrContains(workers.out, "\n  --device")) << workers.out;  // "...). plan: the workers"
  const auto all_help = RunCommand({Runfile(kColoctl), "help"}, TempPath(""));
  EXPECT_EQ(all_help.code, 0);
  EXPECT_EQ(all_help.out, whole.out);
  const auto no_such = RunCommand({Runfile(kColoctl), "help", "trian"}, TempPath(""));
  EXPECT_EQ(no_such.code, 2);
  EXPECT_TRUE(absl::StrContains(no_such.err, "help: unknown command 'trian'")) << no_such.err;
  auto plain = RunCommand({Runfile(kColoctl), "version"}, TempPath(""));
  auto as_json = RunCommand({Runfile(kColoctl), "version", "--output", "json"}, TempPath(""));
  ASSERT_EQ(as_json.code, 0) << as_json.err;
  const nlohmann::json version = nlohmann::json::parse(as_json.out, nullptr, false);
  ASSERT_TRUE(version.contains("version")) << as_json.out;
  EXPECT_EQ(plain.out, absl::StrCat("colod ", version["version"].get<std::string>(), "\n"));
  auto coord_help = RunCommand({Runfile(kCoordinator), "--help"}, TempPath(""));
  for (const char* flag : {"--listen", "--metrics-listen", "--data-dir"}) {
    EXPECT_TRUE(absl::StrContains(coord_help.out, flag)) << flag;
  }
  auto worker_help = RunCommand({Runfile(kWorker), "--help"}, TempPath(""));
  EXPECT_TRUE(absl::StrContains(worker_help.out, "--coordinator"));
  EXPECT_TRUE(absl::StrContains(worker_help.out, "--blas-threads"));
  auto bad_blas = RunCommand({Runfile(kWorker), "--blas-threads", "-3"}, TempPath(""));
  EXPECT_EQ(bad_blas.code, 2);
  EXPECT_TRUE(absl::StrContains(bad_blas.err, "--blas-threads must be in [0, 1024]")) << bad_blas.err;
  EXPECT_TRUE(absl::StrContains(worker_help.out, "--peak-tflops")) << worker_help.out;
  for (const char* peak : {"-1", "nan", "1e7", "1e-9"}) {
    auto bad_peak = RunCommand({Runfile(kWorker), "--peak-tflops", peak, "--listen", "127.0.0.1:0",
                                "--metrics-listen", "127.0.0.1:0", "--device", "cpu"},
                               TempPath(""));
    EXPECT_NE(bad_peak.code, 0) << peak;
    EXPECT_TRUE(absl::StrContains(bad_peak.err, "--peak-tflops: must be 0 (the datasheet's) or in [1e-6, 1e6] TFLOP/s"))
        << bad_peak.err;
  }

  // Labels the coordinator would refuse at every registration are refused at start.
  std::string many;
  for (int i = 0; i <= 64; ++i) absl::StrAppend(&many, many.empty() ? "" : ",", "k", i, "=v");
  for (const std::string& labels : {many, "zone=" + std::string(1025, 'a'), std::string(129, 'k') + "=v"}) {
    auto bad_labels = RunCommand({Runfile(kWorker), "--labels", labels, "--listen", "127.0.0.1:0",
                                  "--metrics-listen", "127.0.0.1:0", "--device", "cpu"},
                                 TempPath(""));
    EXPECT_EQ(bad_labels.code, 2) << labels.size();
    EXPECT_TRUE(absl::StrContains(bad_labels.err, "--labels: ")) << bad_labels.err;
  }

  auto no_dir = RunCommand({Runfile(kCoordinator), "--listen", "127.0.0.1:0", "--metrics-listen",
                            "127.0.0.1:0"},
                           TempPath(""));
  EXPECT_EQ(no_dir.code, 2);  // a usage error, as the usage says
  EXPECT_TRUE(absl::StrContains(no_dir.err, "--data-dir: required")) << no_dir.err;
  auto no_workers = RunCommand({Runfile(kCoordinator), "--data-dir", TempPath("no-workers"), "--max-workers", "0",
                                "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"},
                               TempPath(""));
  EXPECT_EQ(no_workers.code, 2);
  EXPECT_TRUE(absl::StrContains(no_workers.err, "--max-workers: must be >= 1")) << no_workers.err;

  auto bad_listen = RunCommand({Runfile(kWorker), "--listen", "nowhere", "--metrics-listen", "127.0.0.1:0"},
                               TempPath(""));
  EXPECT_EQ(bad_listen.code, 2);  // "nowhere" has no port
  EXPECT_TRUE(absl::StrContains(bad_listen.err, "--listen")) << bad_listen.err;

  // A flag that is unknown or does not parse is a usage error, on every binary.
  auto unknown_flag = RunCommand({Runfile(kColoctl), "--bogus", "workers"}, TempPath(""));
  EXPECT_EQ(unknown_flag.code, 2);
  EXPECT_TRUE(absl::StrContains(unknown_flag.err, "coloctl: --bogus: no such flag")) << unknown_flag.err;
  auto bad_value = RunCommand({Runfile(kColoctl), "--timeout", "soon", "workers"}, TempPath(""));
  EXPECT_EQ(bad_value.code, 2);
  EXPECT_TRUE(absl::StrContains(bad_value.err, "--timeout: ")) << bad_value.err;
  for (const std::string& daemon : {kCoordinator, kWorker}) {
    auto bad = RunCommand({Runfile(daemon), "--lease-duration=x", "--comm-timeout=x"}, TempPath(""));
    EXPECT_EQ(bad.code, 2) << daemon;
    EXPECT_TRUE(absl::StrContains(bad.err, "Run '")) << bad.err;
  }
  // So is one a --flagfile holds, and a flagfile that cannot be read or
  // holds other lines; what it holds is read as the command line is (a
  // comment, names with dashes, a flagfile of its own).
  std::ofstream(TempPath("bogus.flags")) << "# a comment\n--bogus=1\n";
  std::ofstream(TempPath("text.flags")) << "--output=json\nversion\n";
  std::ofstream(TempPath("inner.flags")) << "  --output=json\n";
  std::ofstream(TempPath("outer.flags")) << "# the output\n\n--flagfile=" << TempPath("inner.flags") << "\n";
  std::ofstream(TempPath("self.flags")) << "--flagfile=" << TempPath("self.flags") << "\n";
  std::ofstream(TempPath("dash.flags")) << "-\n";
  std::ofstream(TempPath("end.flags")) << "--=x\n";
  // A value-taking flag alone on a file's last line takes nothing after the file.
  std::ofstream(TempPath("last.flags")) << "--auth-token-file=\n--tls-ca\n";
  std::ofstream(TempPath("empty.flags")) << "# nothing\n";
  std::string wide = "--flagfile=";
  for (int i = 0; i < 65; ++i) absl::StrAppend(&wide, i == 0 ? "" : ",", TempPath("empty.flags"));
  std::ofstream(TempPath("wide.flags")) << wide << "\n";
  for (const auto& [flagfile, says] : std::vector<std::pair<std::string, std::string>>{
           {"/nonexistent.flags", "--flagfile: cannot open '/nonexistent.flags': No such file or directory"},
           {TempPath("bogus.flags"), "--bogus: no such flag"},
           {TempPath("text.flags"), "line 2 is not a flag"},
           {TempPath("self.flags"), "--flagfile: nested more than 4 deep"},
           {"/dev/zero", "over 1 MiB"},
           {TempPath("dash.flags"), "line 1 is not a flag"},
           {TempPath("end.flags"), "line 1 is not a flag"},
           {TempPath("last.flags"), "last.flags: --tls-ca: missing its value"},
           {TempPath("wide.flags"), "--flagfile: more than 64 files"}}) {
    for (const std::string& bin : {kColoctl, kWorker}) {
      const auto r = RunCommand({Runfile(bin), "--flagfile", flagfile, "version"}, TempPath(""));
      EXPECT_EQ(r.code, 2) << bin << " " << flagfile << ": " << r.err;
      EXPECT_TRUE(absl::StrContains(r.err, says)) << r.err;
    }
  }
  const auto from_file = RunCommand({Runfile(kColoctl), "--flagfile=" + TempPath("outer.flags"), "version"},
                                    TempPath(""));
  EXPECT_EQ(from_file.code, 0) << from_file.err;
  EXPECT_TRUE(absl::StartsWith(from_file.out, "{")) << from_file.out;  // --output=json, two files deep
  std::ofstream(TempPath("version.flags")) << "--version\n";
  for (const std::string& bin : {kCoordinator, kWorker}) {
    const auto r = RunCommand({Runfile(bin), "--flagfile", TempPath("version.flags")}, TempPath(""));
    EXPECT_EQ(r.code, 0) << bin << ": " << r.err;
    EXPECT_TRUE(absl::StartsWith(r.out, "colod ")) << r.out;
  }
  // coloctl checks a flagfile's flags as the command line's: another
  // command's flag, an empty --coordinator.
  std::ofstream(TempPath("steps.flags")) << "--steps=5\n";
  std::ofstream(TempPath("nowhere.flags")) << "--coordinator=\n";
  for (const auto& [flagfile, says] : std::vector<std::pair<std::string, std::string>>{
           {TempPath("steps.flags"), "status: --steps is not a flag of status"},
           {TempPath("nowhere.flags"), "--coordinator is empty"}}) {
    const auto r = RunCommand({Runfile(kColoctl), "--flagfile", flagfile, "status", "job-000001"}, TempPath(""));
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_TRUE(absl::StrContains(r.err, says)) << r.err;
  }
  // --fromenv's flags are read and checked as the command line's: a value
  // that does not parse and an unset variable are usage errors (Abseil
  // exited 1 on both), and what they hold counts.
  for (const std::string& bin : {kCoordinator, kWorker}) {
    const auto bad =
        RunCommand({"/usr/bin/env", "FLAGS_tls_refresh_interval=soon", Runfile(bin), "--fromenv=tls-refresh-interval"},
                   TempPath(""));
    EXPECT_EQ(bad.code, 2) << bin << ": " << bad.err;
    EXPECT_TRUE(absl::StrContains(bad.err, "--tls_refresh_interval: ")) << bad.err;
    const auto unset =
        RunCommand({"/usr/bin/env", "-u", "FLAGS_data_dir", Runfile(bin), "--fromenv=data-dir"}, TempPath(""));
    EXPECT_EQ(unset.code, 2) << bin << ": " << unset.err;
    EXPECT_TRUE(absl::StrContains(unset.err, "--fromenv: FLAGS_data_dir is not set")) << unset.err;
  }
  const auto from_env =
      RunCommand({"/usr/bin/env", "FLAGS_output=json", Runfile(kColoctl), "--fromenv=output", "version"}, TempPath(""));
  EXPECT_EQ(from_env.code, 0) << from_env.err;
  EXPECT_TRUE(absl::StartsWith(from_env.out, "{")) << from_env.out;
  auto unknown_cmd = RunCommand({Runfile(kColoctl), "frobnicate"}, TempPath(""));
  EXPECT_EQ(unknown_cmd.code, 2);
  EXPECT_TRUE(absl::StrContains(unknown_cmd.err, "unknown command")) << unknown_cmd.err;
  auto bad_output = RunCommand({Runfile(kColoctl), "workers", "--output", "yaml"}, TempPath(""));
  EXPECT_EQ(bad_output.code, 2);
  // A layout far past one machine is a usage error before any process starts
  // (512 ranks would have meant as many worker processes).
  std::filesystem::create_directories(TempPath("wide-model"));
  std::ofstream(TempPath("wide-model/config.json"))
      << R"({"model_type": "gpt2", "vocab_size": 257, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64})";
  auto too_wide = RunCommand({Runfile(kColoctl), "forward", "--model", TempPath("wide-model"), "--input",
                              TempPath("ids.npy"), "--tp", "4", "--dp", "128"},
                             TempPath(""), absl::Seconds(30));
  EXPECT_EQ(too_wide.code, 2) << too_wide.err;
  EXPECT_TRUE(absl::StrContains(too_wide.err, "at most 256 workers")) << too_wide.err;
  auto too_many = RunCommand({Runfile(kColoctl), "local", "--workers", "257"}, TempPath(""), absl::Seconds(30));
  EXPECT_EQ(too_many.code, 2) << too_many.err;

  // Nothing listens on port 1: a clear UNAVAILABLE naming the address, exit 69.
  auto down = RunCommand({Runfile(kColoctl), "--coordinator", "127.0.0.1:1", "--timeout", "2s",
                          "workers"},
                         TempPath(""));
  EXPECT_EQ(down.code, 69);
  EXPECT_TRUE(absl::StrContains(down.err, "UNAVAILABLE")) << down.err;
  EXPECT_TRUE(absl::StrContains(down.err, "127.0.0.1:1")) << down.err;
}

}  // namespace
}  // namespace colod
