// `coloctl local`: an embedded cluster of a coordinator and N CPU workers as
// child processes, announced once every worker registered, stopped by
// SIGTERM, and gone with coloctl even when coloctl is killed.
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "client/local_cluster.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/subprocess.h"
#include "tests/testing/grpc_probe.h"
#include "tests/testing/temp_dir.h"

namespace colod {
namespace {

using ::colod::testing::Runfile;
using ::colod::testing::TempPath;
using ::colod::testing::RunCommand;
using ::colod::testing::Subprocess;

bool Reachable(const std::string& address) {
  return testing::HealthCheck(address, "").ok();
}

TEST(Local, AnnouncesServesAndStopsItsCluster) {
  Subprocess local({Runfile("client/coloctl"), "local", "--workers", "3", "--listen", "127.0.0.1:0"},
                   TempPath("local.out"), TempPath("local.err"));
  const std::string address = testing::LocalClusterAddress(TempPath("local.out"));
  ASSERT_FALSE(address.empty()) << testing::ReadFile(TempPath("local.err"));
  const auto r = RunCommand({Runfile("client/coloctl"), "--coordinator", address, "workers", "--output", "json"},
                            std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(r.code, 0) << r.err;
  const auto listed = nlohmann::json::parse(r.out);
  ASSERT_EQ(listed["workers"].size(), 3u) << r.out;
  std::vector<std::string> workers;
  for (const auto& w : listed["workers"]) {
    EXPECT_EQ(w["state"], "WORKER_STATE_IDLE");
    workers.push_back(w["info"]["address"]);
    EXPECT_TRUE(Reachable(workers.back()));
  }
  local.Signal(SIGTERM);
  const auto code = local.Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << testing::ReadFile(TempPath("local.err"));
  EXPECT_FALSE(Reachable(address));
  for (const std::string& w : workers) EXPECT_FALSE(Reachable(w)) << w;
}

// --output json announces the cluster on one line, once every worker
// registered: addresses a script can dial at once.
TEST(Local, JsonOutputAnnouncesTheClusterOnOneLine) {
  Subprocess local(
      {Runfile("client/coloctl"), "local", "--workers", "2", "--listen", "127.0.0.1:0", "--output", "json"},
      TempPath("local-json.out"), TempPath("local-json.err"));
  nlohmann::json ready;
  for (const absl::Time deadline = absl::Now() + absl::Seconds(60); absl::Now() < deadline && ready.is_null();) {
    std::ifstream in(TempPath("local-json.out"));
    std::string line;
    if (std::getline(in, line) && in.good()) ready = nlohmann::json::parse(line);  // a whole line
    absl::SleepFor(absl::Milliseconds(20));
  }
  ASSERT_TRUE(ready.is_object()) << testing::ReadFile(TempPath("local-json.err"));
  const std::string address = ready["coordinator"];
  EXPECT_TRUE(Reachable(address)) << ready;
  EXPECT_TRUE(absl::StartsWith(ready["metrics"].get<std::string>(), "http://127.0.0.1:")) << ready;
  EXPECT_TRUE(std::filesystem::is_directory(ready["data_dir"].get<std::string>())) << ready;
  ASSERT_EQ(ready["workers"].size(), 2u) << ready;
  const auto listed = RunCommand({Runfile("client/coloctl"), "--coordinator", address, "workers", "--output", "json"},
                                 std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(listed.code, 0) << listed.err;
  const auto workers = nlohmann::json::parse(listed.out)["workers"];
  for (const auto& w : ready["workers"]) {
    EXPECT_TRUE(Reachable(w["address"])) << w;
    const bool registered = std::any_of(workers.begin(), workers.end(), [&](const nlohmann::json& r) {
      return r["info"].value("workerId", "") == w["worker_id"] && r["info"].value("address", "") == w["address"];
    });
    EXPECT_TRUE(registered) << w << " not in " << listed.out;
  }
  EXPECT_EQ(testing::ReadFile(TempPath("local-json.out")).find("ready:"), std::string::npos);
  local.Signal(SIGTERM);
  const auto code = local.Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << testing::ReadFile(TempPath("local-json.err"));
}

// A worker that exits before it registers (no such device, a build without
// CUDA) fails the cluster at once, naming it and its log, instead of at the
// registration deadline (60 s) with "did not register".
TEST(Local, AWorkerThatExitsAtStartFailsTheClusterAtOnce) {
  LocalCluster::Options o;
  o.workers = 2;
  o.coordinator_binary = Runfile("server/colod-coordinator");
  o.worker_binary = "/bin/false";
  o.data_dir = TempPath("dead-worker");
  const absl::Time start = absl::Now();
  const absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kUnavailable) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), "exited with status 1 before it registered")) << c.status();
  // Both workers exit: whichever is seen first is named, with its own log.
  const bool first = absl::StrContains(c.status().message(), "local worker 0 exited");
  const bool second = absl::StrContains(c.status().message(), "local worker 1 exited");
  EXPECT_TRUE(first || second) << c.status();
  EXPECT_TRUE(absl::StrContains(c.status().message(), first ? "worker-0.log" : "worker-1.log")) << c.status();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

// A worker that exits 71 (an exception escaped every handler: Gloo's own
// thread throws when a peer resets a connection mid-handshake, and
// ExitOnUncaughtExceptions ends the process so) is started again, as one
// whose device faulted (70, tests/cuda_daemons_test.cc). Its first life here
// is a real worker under a shell that, on SIGUSR1, kills it and exits 71.
// A worker script (TempPath(name + ".sh")) whose first life, under the
// first of its workers to start, is a real worker under a shell that, on
// SIGUSR1, kills it and exits 71 (the exit that asks coloctl local to start
// it again), its pid in TempPath(name)/pid (and TempPath(name)/died once it
// exited 71); its later lives run `later` (shell, "$@" the worker's flags).
std::string WorkerThatAsksForARestart(const std::string& name, const std::string& later) {
  const std::string once = TempPath(name);
  const std::string script = TempPath(name + ".sh");
  std::filesystem::remove_all(once);
  {
    std::ofstream f(script);
    f << "#!/bin/sh\n"
      << "if mkdir '" << once << "' 2>/dev/null; then\n"
      << "  echo $$ > '" << once << "/pid'\n"
      << "  trap 'kill -9 $child; wait $child; touch " << once << "/died; exit 71' USR1\n"
      << "  '" << Runfile("worker/daemon/colod-worker") << "' \"$@\" & child=$!\n"
      << "  wait $child\n"
      << "  exit 1\n"
      << "fi\n"
      << later << "\n";
  }
  std::filesystem::permissions(script, std::filesystem::perms::owner_all);
  return script;
}

TEST(Local, AWorkerThatAnUncaughtExceptionEndedIsStartedAgain) {
  const std::string once = TempPath("uncaught-once");
  const std::string script = WorkerThatAsksForARestart(
      "uncaught-once", absl::StrCat("exec '", Runfile("worker/daemon/colod-worker"), "' \"$@\""));
  LocalCluster::Options o;
  o.workers = 2;
  o.coordinator_binary = Runfile("server/colod-coordinator");
  o.worker_binary = script;
  o.data_dir = TempPath("uncaught");
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  LocalCluster& cluster = **c;
  const absl::StatusOr<std::vector<v1::Worker>> before = cluster.workers();
  ASSERT_TRUE(before.ok()) << before.status();
  ASSERT_EQ(before->size(), 2u);
  // Whichever worker made the marker first is the one that will exit 71.
  int victim = 0;
  ASSERT_TRUE(absl::SimpleAtoi(testing::ReadFile(once + "/pid"), &victim));
  const std::vector<pid_t> pids = cluster.pids();
  const size_t index = std::find(pids.begin(), pids.end(), victim) - pids.begin();
  ASSERT_TRUE(index == 1 || index == 2) << victim;
  const pid_t first = pids[index];
  const pid_t other = pids[3 - index];
  ASSERT_EQ(::kill(first, SIGUSR1), 0);
  bool again = false;
  for (int i = 0; i < 300 && !again; ++i) {  // 30 s
    absl::SleepFor(absl::Milliseconds(100));
    const absl::StatusOr<std::vector<v1::Worker>> now = cluster.workers();
    if (cluster.restarts() != 1 || !now.ok()) continue;
    for (const v1::Worker& w : *now) {
      again |=
          w.info().address() != (*before)[0].info().address() && w.info().address() != (*before)[1].info().address();
    }
  }
  EXPECT_TRUE(again) << "no new worker registered; restarts: " << cluster.restarts();
  EXPECT_EQ(cluster.restarts(), 1);
  EXPECT_NE(cluster.pids()[index], first);
  EXPECT_GT(cluster.pids()[index], 0);
  EXPECT_EQ(cluster.pids()[3 - index], other) << "the other worker is left alone";
  cluster.Stop();
}

// A worker started again (by the supervisor's thread, after it exited 71)
// drains its job at the stop as the others do, with the one SIGTERM of the
// stop: the supervisor's thread, whose end sends the children it forked
// their PR_SET_PDEATHSIG (a SIGTERM beside the stop's; a second signal ends
// a drain), ends only after the workers were reaped. Stop pauses 300 ms
// after it ended the supervision: the worker's first signal must come after
// that pause (with the supervisor ending first, its PR_SET_PDEATHSIG came at
// once, and the stop's SIGTERM 300 ms later was a second).
TEST(Local, AWorkerStartedAgainDrainsItsJobAtTheStop) {
  const std::string coloctl = Runfile("client/coloctl");
  const std::string once = TempPath("restarted-once");
  const std::string script = WorkerThatAsksForARestart(
      "restarted-once", absl::StrCat("exec '", Runfile("worker/daemon/colod-worker"), "' \"$@\""));
  auto init = RunCommand({coloctl, "init-model", "--out", TempPath("restarted-model"), "--positions", "32"},
                         std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(init.code, 0) << init.err;
  LocalCluster::Options o;
  o.workers = 2;
  o.coordinator_binary = Runfile("server/colod-coordinator");
  o.worker_binary = script;
  o.data_dir = TempPath("restarted");
  o.stop_pause_for_test = absl::Milliseconds(300);
  std::filesystem::remove_all(o.data_dir);
  absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  ASSERT_TRUE(c.ok()) << c.status();
  LocalCluster& cluster = **c;
  int victim = 0;
  ASSERT_TRUE(absl::SimpleAtoi(testing::ReadFile(once + "/pid"), &victim));
  const std::vector<pid_t> pids = cluster.pids();
  const size_t index = std::find(pids.begin(), pids.end(), victim) - pids.begin();
  ASSERT_TRUE(index == 1 || index == 2) << victim;
  ASSERT_EQ(::kill(victim, SIGUSR1), 0);
  absl::StatusOr<std::vector<v1::Worker>> registered = cluster.workers();
  for (int i = 0; i < 300 && (cluster.restarts() != 1 || !registered.ok() || registered->size() != 2); ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    registered = cluster.workers();
  }
  ASSERT_EQ(cluster.restarts(), 1);
  ASSERT_TRUE(registered.ok() && registered->size() == 2) << "the worker started again did not register";
  const auto submitted = RunCommand({coloctl,
                                     "--coordinator",
                                     cluster.address(),
                                     "submit",
                                     "--model",
                                     TempPath("restarted-model"),
                                     "--data",
                                     "/usr/share/common-licenses/GPL-3",
                                     "--tp",
                                     "2",
                                     "--batch-size",
                                     "4",
                                     "--seq-len",
                                     "16",
                                     "--steps",
                                     "100000",
                                     "--save",
                                     TempPath("restarted-ck"),
                                     "--save-every",
                                     "100000"},
                                    std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(submitted.code, 0) << submitted.err;
  const std::string job_id(absl::StripAsciiWhitespace(submitted.out));
  auto client = CoordinatorClient::Create(cluster.address());
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<v1::Job> job = (*client)->GetJob(job_id);
  for (int i = 0; i < 12000 && job.ok() && job->step() < 3 && job->state() != v1::JOB_STATE_FAILED; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
    job = (*client)->GetJob(job_id);
  }
  ASSERT_TRUE(job.ok() && job->step() >= 3) << (job.ok() ? job->ShortDebugString() : job.status().ToString());
  const std::string log_path = absl::StrCat(o.data_dir, "/worker-", index - 1, ".log");
  auto signals = [&log_path] {
    return std::vector<std::string>(absl::StrSplit(testing::ReadFile(log_path), "received signal")).size() - 1;
  };
  const size_t before = signals();
  const absl::Time called = absl::Now();
  std::thread stopper([&cluster] { cluster.Stop(); });
  absl::Time signalled = absl::InfiniteFuture();
  for (int i = 0; i < 10000 && signalled == absl::InfiniteFuture(); ++i) {  // 20 s
    if (signals() > before) {
      signalled = absl::Now();
    } else {
      absl::SleepFor(absl::Milliseconds(2));
    }
  }
  stopper.join();
  const std::string log = testing::ReadFile(log_path);
  EXPECT_GE(signalled - called, absl::Milliseconds(290))
      << "the worker started again was signalled before the stop signalled the workers:\n"
      << log;
  EXPECT_EQ(signals(), before + 1) << log;
  EXPECT_TRUE(absl::StrContains(log, "drained: the job's rank here ended")) << log;
  EXPECT_FALSE(absl::StrContains(log, "the drain was interrupted")) << log;
}

// The pids of `parent`'s children named `comm` (/proc/PID/stat).
std::vector<pid_t> ChildrenOf(pid_t parent, const std::string& comm) {
  std::vector<pid_t> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    pid_t pid = 0;
    if (!absl::SimpleAtoi(e.path().filename().string(), &pid)) continue;
    const std::string stat = testing::ReadFile(e.path().string() + "/stat");
    const size_t open = stat.find('('), close = stat.rfind(')');
    if (open == std::string::npos || close == std::string::npos || close < open) continue;
    const std::vector<std::string> rest = absl::StrSplit(stat.substr(close + 2), ' ');
    pid_t ppid = 0;
    if (stat.substr(open + 1, close - open - 1) == comm && rest.size() > 1 && absl::SimpleAtoi(rest[1], &ppid) &&
        ppid == parent) {
      out.push_back(pid);
    }
  }
  return out;
}

// A second Ctrl-C while `coloctl local` stops (here its worker SIGSTOPped,
// so that its stop would wait 10 s for it) ends the stop at once: the
// daemons still running are SIGKILLed, and coloctl says so.
TEST(Local, ASecondCtrlCStopsTheClusterAtOnce) {
  Subprocess local({Runfile("client/coloctl"), "local", "--workers", "1", "--listen", "127.0.0.1:0", "--data-dir",
                    TempPath("hurried-data")},
                   TempPath("hurried.out"), TempPath("hurried.err"));
  ASSERT_FALSE(testing::LocalClusterAddress(TempPath("hurried.out")).empty())
      << testing::ReadFile(TempPath("hurried.err"));
  const std::vector<pid_t> workers = ChildrenOf(local.pid(), "colod-worker");
  ASSERT_EQ(workers.size(), 1u);
  ASSERT_EQ(::kill(workers[0], SIGSTOP), 0);
  struct KillOnFailure {  // a failed ASSERT below leaves no worker stopped for good
    pid_t pid;
    ~KillOnFailure() {
      if (::testing::Test::HasFailure()) ::kill(pid, SIGKILL);
    }
  } kill_on_failure{workers[0]};
  local.Signal(SIGINT);
  for (int i = 0; i < 2000 && !absl::StrContains(testing::ReadFile(TempPath("hurried.err")), "stopping"); ++i) {
    absl::SleepFor(absl::Milliseconds(5));
  }
  ASSERT_TRUE(absl::StrContains(testing::ReadFile(TempPath("hurried.err")), "stopping"))
      << testing::ReadFile(TempPath("hurried.err"));
  absl::SleepFor(absl::Milliseconds(300));  // the stop waits for the stopped worker
  const absl::Time again = absl::Now();
  local.Signal(SIGINT);
  const auto code = local.Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0);
  EXPECT_LT(absl::Now() - again, absl::Seconds(5)) << "not the 10 s the stop gives a worker";
  const std::string err = testing::ReadFile(TempPath("hurried.err"));
  EXPECT_TRUE(absl::StrContains(err, "Interrupt again: killing the daemons now")) << err;
}

TEST(Local, ItsDaemonsDieWithAKilledColoctl) {
  Subprocess local({Runfile("client/coloctl"), "local", "--workers", "2", "--listen", "127.0.0.1:0"},
                   TempPath("killed.out"), TempPath("killed.err"));
  const std::string address = testing::LocalClusterAddress(TempPath("killed.out"));
  ASSERT_FALSE(address.empty()) << testing::ReadFile(TempPath("killed.err"));
  local.Signal(SIGKILL);
  ASSERT_TRUE(local.Wait(absl::Seconds(10)).has_value());
  bool gone = false;
  for (int i = 0; i < 100 && !gone; ++i) {
    absl::SleepFor(absl::Milliseconds(100));
    gone = !Reachable(address);
  }
  EXPECT_TRUE(gone) << "the coordinator outlived coloctl";
  EXPECT_EQ(RunCommand({Runfile("client/coloctl"), "local", "--workers", "0"}, std::getenv("TEST_TMPDIR")).code, 2);
}

// The names in `dir` that an embedded cluster leaves when it is not cleaned
// up: its data dir (colod-local-*) and its workers' scratch dirs.
std::vector<std::string> Leftovers(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (absl::StartsWith(name, "colod-")) out.push_back(name);
  }
  return out;
}

std::string FreshDir(const std::string& name) {
  const std::string dir = TempPath(name);
  std::filesystem::create_directories(dir);
  return dir;
}

// `coloctl train ... | head -c 1`: once the reader of its stdout goes away,
// coloctl stops its embedded cluster and exits 141 (SIGPIPE's), leaving
// nothing in $TMPDIR; killed by SIGPIPE, it left the cluster's data dir and
// the workers' scratch dirs behind.
TEST(Local, AClosedStdoutStopsTheEmbeddedClusterAndLeavesNothing) {
  const std::string coloctl = Runfile("client/coloctl");
  const std::string tmp = FreshDir("pipe-tmp");
  auto init = RunCommand({coloctl, "init-model", "--out", TempPath("pipe-model"), "--positions", "32"},
                         std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(init.code, 0) << init.err;
  const std::string script = absl::StrCat(
      "TMPDIR=", tmp, " ", coloctl, " train --model ", TempPath("pipe-model"),
      " --data /usr/share/common-licenses/GPL-3 --steps 100000 --batch-size 2 --seq-len 16 | head -c 1 >/dev/null; "
      "exit ${PIPESTATUS[0]}");
  const absl::Time start = absl::Now();
  const auto r = RunCommand({"/bin/bash", "-c", script}, std::getenv("TEST_TMPDIR"), absl::Seconds(120));
  EXPECT_EQ(r.code, 141) << r.err;
  EXPECT_NE(r.err.find("stopping the embedded cluster"), std::string::npos) << r.err;
  EXPECT_LT(absl::Now() - start, absl::Seconds(60)) << "it trained on instead of stopping";
  EXPECT_EQ(Leftovers(tmp), std::vector<std::string>{});
}

// Ctrl-C while `coloctl train`'s embedded cluster of 12 workers starts: the
// start stops there (it does not wait for the workers), and coloctl exits
// 130 with nothing left in $TMPDIR.
TEST(Local, CtrlCWhileTheEmbeddedClusterStartsStopsItThere) {
  const std::string coloctl = Runfile("client/coloctl");
  const std::string tmp = FreshDir("start-tmp");
  auto init = RunCommand({coloctl, "init-model", "--out", TempPath("start-model"), "--positions", "32"},
                         std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(init.code, 0) << init.err;
  Subprocess train({"/usr/bin/env", "TMPDIR=" + tmp, coloctl, "train", "--model", TempPath("start-model"), "--data",
                    "/usr/share/common-licenses/GPL-3", "--tp", "2", "--dp", "6", "--batch-size", "12", "--seq-len",
                    "16", "--steps", "100000"},
                   TempPath("start.out"), TempPath("start.err"));
  // Once the cluster's data dir is there, its start is under way.
  for (int i = 0; i < 1000 && Leftovers(tmp).empty(); ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_FALSE(Leftovers(tmp).empty()) << testing::ReadFile(TempPath("start.err"));
  train.Signal(SIGINT);
  const auto code = train.Wait(absl::Seconds(60));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 130) << testing::ReadFile(TempPath("start.err"));
  const std::string err = testing::ReadFile(TempPath("start.err"));
  EXPECT_NE(err.find("the embedded cluster's start was stopped"), std::string::npos) << err;
  EXPECT_EQ(testing::ReadFile(TempPath("start.out")), "") << "no step trained";
  EXPECT_EQ(Leftovers(tmp), std::vector<std::string>{});
}

// Ctrl-C (here SIGHUP) while a cluster starts stops it there and then: the
// start is CANCELLED, what it started is stopped and its temporary data
// dir, with the workers' scratch dirs in it, removed. (Cancelled once the
// workers are started, which the start's next look for their registration
// sees before they can have registered: a count of polls let a quick start
// finish first.)
TEST(Local, AStartCancelledMidwayLeavesNothing) {
  const std::string tmp = FreshDir("cancel-tmp");
  ASSERT_EQ(::setenv("TMPDIR", tmp.c_str(), 1), 0);
  LocalCluster::Options o;
  o.workers = 2;
  o.coordinator_binary = Runfile("server/colod-coordinator");
  o.worker_binary = Runfile("worker/daemon/colod-worker");
  int cancels = 0;
  o.cancelled = [&tmp, &cancels] {
    for (const std::string& dir : Leftovers(tmp)) {
      if (std::filesystem::exists(absl::StrCat(tmp, "/", dir, "/worker-1.log"))) {
        ++cancels;
        return true;
      }
    }
    return false;
  };
  const absl::StatusOr<std::unique_ptr<LocalCluster>> c = LocalCluster::Start(o);
  ::unsetenv("TMPDIR");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kCancelled) << c.status();
  EXPECT_EQ(cancels, 1) << "asked once, and stopped there";
  EXPECT_EQ(Leftovers(tmp), std::vector<std::string>{});

  // coloctl local, stopped by SIGHUP (its terminal closed), removes its data
  // dir, the workers' scratch dirs included.
  Subprocess local({"/usr/bin/env", "TMPDIR=" + tmp, Runfile("client/coloctl"), "local", "--workers", "1",
                    "--listen", "127.0.0.1:0"},
                   TempPath("hup.out"), TempPath("hup.err"));
  ASSERT_FALSE(testing::LocalClusterAddress(TempPath("hup.out")).empty()) << testing::ReadFile(TempPath("hup.err"));
  const std::vector<std::string> running = Leftovers(tmp);
  ASSERT_EQ(running.size(), 1u) << "the data dir only";
  EXPECT_TRUE(std::filesystem::is_directory(absl::StrCat(tmp, "/", running[0], "/worker-0.work")));
  local.Signal(SIGHUP);
  const auto code = local.Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << testing::ReadFile(TempPath("hup.err"));
  EXPECT_EQ(Leftovers(tmp), std::vector<std::string>{});
}

// `coloctl local --data-dir` stopped by Ctrl-C (SIGINT, to coloctl alone:
// its daemons run in a process group of their own) while a job that saves
// checkpoints trains drains the job: its workers (one SIGTERM each) save a
// checkpoint after the same step and the coordinator keeps the job PENDING.
// The next `coloctl local` on that data dir places it again from that
// checkpoint: it succeeds with no restart counted and no step trained twice.
TEST(Local, CtrlCDrainsARunningJobThatTheNextStartGoesOnWith) {
  const std::string coloctl = Runfile("client/coloctl");
  const std::string data = TempPath("drain-data");
  std::filesystem::remove_all(data);
  auto init = RunCommand({coloctl, "init-model", "--out", TempPath("drain-model"), "--positions", "32"},
                         std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(init.code, 0) << init.err;
  auto start = [&](const std::string& name, std::string* address) {
    auto local = std::make_unique<Subprocess>(
        std::vector<std::string>{coloctl, "local", "--workers", "2", "--listen", "127.0.0.1:0", "--data-dir", data},
        TempPath(name + ".out"), TempPath(name + ".err"));
    *address = testing::LocalClusterAddress(TempPath(name + ".out"));
    EXPECT_FALSE(address->empty()) << testing::ReadFile(TempPath(name + ".err"));
    return local;
  };
  std::string address;
  std::unique_ptr<Subprocess> local = start("drain-first", &address);
  ASSERT_FALSE(address.empty());
  const auto submitted = RunCommand({coloctl,          "--coordinator",
                                     address,          "submit",
                                     "--model",        TempPath("drain-model"),
                                     "--data",         "/usr/share/common-licenses/GPL-3",
                                     "--tp",           "2",
                                     "--batch-size",   "4",
                                     "--seq-len",      "16",
                                     "--steps",        "120",
                                     "--save",         TempPath("drain-ck"),
                                     "--save-every",   "1000",
                                     "--max-restarts", "0"},
                                    std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(submitted.code, 0) << submitted.err;
  const std::string job_id(absl::StripAsciiWhitespace(submitted.out));
  auto client = CoordinatorClient::Create(address);
  ASSERT_TRUE(client.ok()) << client.status();
  absl::StatusOr<v1::Job> job = (*client)->GetJob(job_id);
  for (int i = 0; i < 12000 && job.ok() && job->step() < 3 && job->state() != v1::JOB_STATE_FAILED; ++i) {
    absl::SleepFor(absl::Milliseconds(5));
    job = (*client)->GetJob(job_id);
  }
  ASSERT_TRUE(job.ok() && job->step() >= 3 && job->state() == v1::JOB_STATE_RUNNING)
      << (job.ok() ? job->ShortDebugString() : job.status().ToString());
  const int64_t at_interrupt = job->step();
  const absl::Time interrupted = absl::Now();
  local->Signal(SIGINT);
  const auto code = local->Wait(absl::Seconds(60));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 0) << testing::ReadFile(TempPath("drain-first.err"));
  const absl::Duration stop = absl::Now() - interrupted;
  EXPECT_LT(stop, absl::Seconds(10)) << "no daemon was killed at the stop's deadline";
  int drained_logs = 0;
  for (int w = 0; w < 2; ++w) {
    const std::string log = testing::ReadFile(absl::StrCat(data, "/worker-", w, ".log"));
    drained_logs += absl::StrContains(log, "drained: the job's rank here ended");
    EXPECT_FALSE(absl::StrContains(log, "received signal 2")) << "the Ctrl-C reached coloctl alone:\n" << log;
  }
  EXPECT_GE(drained_logs, 1) << "the worker whose drain ended the job's ranks says so";

  local = start("drain-second", &address);
  ASSERT_FALSE(address.empty());
  client = CoordinatorClient::Create(address);
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<v1::JobEvent> events;
  const absl::Status watched = (*client)->WatchJob(job_id, 1, absl::Seconds(120), [&](const v1::JobEvent& e) {
    events.push_back(e);
    return true;
  });
  ASSERT_TRUE(watched.ok()) << watched;
  job = (*client)->GetJob(job_id);
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << job->reason();
  EXPECT_EQ(job->restarts(), 0);
  EXPECT_EQ(job->generation(), 2);
  int64_t drained_at = -1;
  for (const v1::JobEvent& e : events) {
    if (!e.has_state_change() || e.state_change().state() != v1::JOB_STATE_PENDING) continue;
    const std::string& why = e.state_change().reason();
    const size_t at = why.find("stopped after step ");
    if (at == std::string::npos || !absl::StrContains(why, "(a drain, not counted against the job)")) continue;
    ASSERT_TRUE(absl::SimpleAtoi(absl::string_view(why).substr(at + 19, why.find(' ', at + 19) - at - 19), &drained_at))
        << why;
  }
  ASSERT_GE(drained_at, 3) << "no PENDING event names the drain";
  int resumed = 0;
  std::vector<int64_t> steps;
  for (const v1::JobEvent& e : events) {
    if (e.has_rank_status() && e.rank_status().phase() == v1::RANK_PHASE_TRAINING &&
        e.rank_status().resumed_step() > 0) {
      EXPECT_EQ(e.rank_status().resumed_step(), drained_at) << e.rank_status().ShortDebugString();
      ++resumed;
    }
    if (e.has_step()) steps.push_back(e.step().step());
  }
  EXPECT_EQ(resumed, 2) << "both ranks of generation 2 resumed from the drain's checkpoint";
  ASSERT_EQ(steps.size(), 120u) << "each step once";
  for (size_t i = 0; i < steps.size(); ++i) EXPECT_EQ(steps[i], static_cast<int64_t>(i + 1));
  std::printf("coloctl local: Ctrl-C at step %lld drained the job (stopped after step %lld) and stopped in %.2f s\n",
              static_cast<long long>(at_interrupt), static_cast<long long>(drained_at), absl::ToDoubleSeconds(stop));
  local->Signal(SIGTERM);
  EXPECT_EQ(local->Wait(absl::Seconds(30)), 0);
}

// `coloctl tensor demo` interrupted (Ctrl-C) while its TENSOR job waits
// for workers: the job, which would run and hold its workers until
// cancelled, is cancelled before coloctl exits 130.
TEST(Local, AnInterruptedTensorDemoCancelsItsJob) {
  testing::Daemon coordinator =
      testing::StartDaemon("server/colod-coordinator", "demo-coordinator", {"--data-dir", TempPath("demo-data")});
  ASSERT_FALSE(coordinator.grpc.empty());
  Subprocess demo({Runfile("client/coloctl"), "--coordinator", coordinator.grpc, "tensor", "demo", "--tp", "2"},
                  TempPath("demo.out"), TempPath("demo.err"));
  auto client = CoordinatorClient::Create(coordinator.grpc, CoordinatorClient::Options());
  ASSERT_TRUE(client.ok()) << client.status();
  std::vector<v1::Job> jobs;
  for (int i = 0; i < 300 && jobs.empty(); ++i) {
    absl::SleepFor(absl::Milliseconds(20));
    jobs = (*client)->ListJobs().value_or(std::vector<v1::Job>{});
  }
  ASSERT_EQ(jobs.size(), 1u) << testing::ReadFile(TempPath("demo.err"));
  EXPECT_EQ(jobs[0].state(), v1::JOB_STATE_PENDING) << "no worker: it waits";
  demo.Signal(SIGINT);
  const auto code = demo.Wait(absl::Seconds(30));
  ASSERT_TRUE(code.has_value());
  EXPECT_EQ(*code, 130) << testing::ReadFile(TempPath("demo.err"));
  const absl::StatusOr<v1::Job> job = (*client)->GetJob(jobs[0].job_id());
  ASSERT_TRUE(job.ok()) << job.status();
  EXPECT_EQ(job->state(), v1::JOB_STATE_CANCELLED);
  EXPECT_NE(job->reason().find("tensor demo interrupted"), std::string::npos) << job->reason();
}

// An empty --coordinator (a script's unset "$COORD") is a usage error: no
// embedded cluster starts, and no call goes to the default address.
TEST(Local, AnEmptyCoordinatorIsAUsageErrorNotTheEmbeddedCluster) {
  const auto init = RunCommand({Runfile("client/coloctl"), "init-model", "--out", TempPath("empty-coord-model")},
                               std::getenv("TEST_TMPDIR"));
  ASSERT_EQ(init.code, 0) << init.err;
  for (const std::vector<std::string>& flag : std::vector<std::vector<std::string>>{
           {"--coordinator", ""}, {"--coordinator="}, {"-coordinator="}, {"-coordinator", ""}, {"env"}}) {
    // (env: $COLOD_COORDINATOR set to nothing, and no flag)
    std::vector<std::string> argv = {"/usr/bin/env", "COLOD_COORDINATOR=", Runfile("client/coloctl")};
    if (flag[0] != "env") argv.insert(argv.end(), flag.begin(), flag.end());
    for (const std::string& a : {std::string("train"), std::string("--model"), TempPath("empty-coord-model"),
                                 std::string("--data"), std::string("/usr/share/common-licenses/GPL-3")}) {
      argv.push_back(a);
    }
    const auto r = RunCommand(argv, std::getenv("TEST_TMPDIR"), absl::Seconds(30));
    EXPECT_EQ(r.code, 2) << r.out << r.err;
    EXPECT_NE(r.err.find(flag[0] == "env" ? "$COLOD_COORDINATOR is set but empty" : "--coordinator is empty"),
              std::string::npos)
        << r.err;
    EXPECT_TRUE(r.out.empty()) << r.out;  // no cluster announced, nothing trained
  }
  // A command that calls a coordinator (127.0.0.1:7070 where none is
  // named): not the default in place of the cluster meant either.
  for (const char* command : {"jobs", "cancel"}) {
    std::vector<std::string> argv = {"/usr/bin/env", "COLOD_COORDINATOR=", Runfile("client/coloctl"), command};
    if (std::string(command) == "cancel") argv.push_back("job-000001");
    const auto r = RunCommand(argv, std::getenv("TEST_TMPDIR"), absl::Seconds(30));
    EXPECT_EQ(r.code, 2) << command << ": " << r.out << r.err;
    EXPECT_NE(r.err.find("$COLOD_COORDINATOR is set but empty"), std::string::npos) << command << ": " << r.err;
  }
  // Where no coordinator is called, an empty $COLOD_COORDINATOR is as good
  // as unset.
  const auto version =
      RunCommand({"/usr/bin/env", "COLOD_COORDINATOR=", Runfile("client/coloctl"), "version"}, std::getenv("TEST_TMPDIR"));
  EXPECT_EQ(version.code, 0) << version.err;
}

// What a command would ignore or could not send is refused as a usage
// error (2) before anything is done: flags a submit does not read, an
// operand that is not UTF-8, a model directory init-model would write
// over, an address that is not HOST:PORT, a flag of another command;
// the global flags on a command coloctl-run carries out are let through,
// as on every command.
TEST(Local, CommandsRefuseWhatTheyWouldIgnore) {
  const std::string coloctl = Runfile("client/coloctl");
  const auto run = [&](std::vector<std::string> args) {
    args.insert(args.begin(), coloctl);
    return RunCommand(args, std::getenv("TEST_TMPDIR"), absl::Seconds(30));
  };
  const std::string nowhere = "127.0.0.1:1";
  auto r = run({"--coordinator", nowhere, "submit", "--kind", "tensor", "--steps", "5", "--model", "/m", "--watch"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--model, --steps, --watch do not apply"), std::string::npos) << r.err;
  // --nowatch (or --watch=false) says what a tensor submit does anyway.
  r = run({"--coordinator", nowhere, "--timeout", "1s", "submit", "--kind", "tensor", "--nowatch", "--tp", "2"});
  EXPECT_EQ(r.code, 69) << r.err;  // unreachable
  EXPECT_NE(r.err.find("UNAVAILABLE"), std::string::npos) << r.err;
  // --watch-timeout bounds a watch: without --watch there is none.
  r = run({"--coordinator", nowhere, "submit", "--model", "/m", "--watch-timeout", "1h"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("submit: --watch-timeout bounds the watch of --watch"), std::string::npos) << r.err;
  r = run({"--coordinator", nowhere, "submit", "--job-file", "/nonexistent.json", "--tp", "2", "--name", "x"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("submit --job-file: --name, --tp do not apply"), std::string::npos) << r.err;
  // A tensor subcommand given another's flag: refused before any call.
  r = run({"--coordinator", nowhere, "tensor", "create", "job-000001", "x", "--shape", "4,6", "--tp", "4"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("tensor create: --tp does not apply to it"), std::string::npos) << r.err;
  r = run({"--coordinator", nowhere, "tensor", "list", "job-000001", "--rank", "1", "--spec", "tp=R"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("tensor list: --rank, --spec do not apply to it"), std::string::npos) << r.err;
  r = run({"--coordinator", nowhere, "tensor", "get", "job-000001", "x", "--rank", "-5"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("tensor get: --rank -5 is not a rank"), std::string::npos) << r.err;
  // A job file the coordinator would refuse: refused here (2), no call made
  // to the unreachable coordinator (69).
  const std::string bad_file = std::string(std::getenv("TEST_TMPDIR")) + "/bad-job.json";
  std::ofstream(bad_file) << R"({"kind": "JOB_KIND_TRAIN", "shard": {"tensorParallelSize": 2}})";
  r = run({"--coordinator", nowhere, "submit", "--job-file", bad_file});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("submit --job-file " + bad_file + ": spec."), std::string::npos) << r.err;
  // --comm-timeout is read by a run on this machine's GPUs alone: on worker
  // daemons each worker's own decides.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"--coordinator", nowhere, "train", "--model", "/m", "--data", "/d"},
        std::vector<std::string>{"train", "--model", "/m", "--data", "/d"},
        std::vector<std::string>{"forward", "--model", "/m", "--input", "/i.npy"}}) {
    std::vector<std::string> with = args;
    with.insert(with.end(), {"--comm-timeout", "5s"});
    r = run(with);
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_NE(r.err.find(": --comm-timeout applies to a run on this machine's GPUs (--device cuda) only"),
              std::string::npos)
        << r.err;
  }
  // A flag of another command is refused before anything is done (no
  // call to the unreachable coordinator: exit 2, not 69), whichever
  // command reads it; the global ones pass everywhere.
  r = run({"--coordinator", nowhere, "submit", "--model", "/m", "--data", "/d", "--comm-timeout", "5s"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("submit: --comm-timeout is not a flag of submit (coloctl submit --help lists its flags)"),
            std::string::npos)
      << r.err;
  r = run({"--coordinator", nowhere, "status", "job-000001", "--steps", "5"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("status: --steps is not a flag of status, which takes only the global flags"), std::string::npos)
      << r.err;
  r = run({"--coordinator", nowhere, "--timeout", "1s", "cancel", "job-000001", "--reason", "r", "--all", "--nowatch"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("cancel: --all, --watch are not flags of cancel"), std::string::npos) << r.err;
  r = run({"--coordinator", nowhere, "--timeout", "1s", "cancel", "job-000001", "--reason", "r"});
  EXPECT_EQ(r.code, 69) << r.err;  // its own flags and the global ones: it called
  // A run on this machine's GPUs is no job: what only a job reads is
  // refused there too (coloctl-run's check, before any GPU is used).
  r = run({"train", "--device", "cuda", "--model", "/m", "--data", "/d", "--max-restarts", "2", "--name", "n"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("train --device cuda: --max-restarts, --name apply to a job on worker daemons only"),
            std::string::npos)
      << r.err;
  r = run({"plan", "--model", "/nonexistent", "--steps", "5", "--lr", "1"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("plan: --lr, --steps are not flags of plan"), std::string::npos) << r.err;
  r = run({"--coordinator", nowhere, "status", "job-\xff"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("status: argument 1 is not valid UTF-8"), std::string::npos) << r.err;
  r = run({"local", "--listen", "bogus"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--listen: 'bogus' is not HOST:PORT"), std::string::npos) << r.err;

  const std::string model = TempPath("refused-model");
  r = run({"init-model", "--out", model, "--positions", "32", "--watch", "--kind", "train"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("init-model: --kind, --watch are not flags of init-model"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(model));
  // The global flags pass to the commands coloctl-run carries out.
  r = run({"init-model", "--out", model, "--positions", "32", "--timeout", "5s"});
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string before = testing::ReadFile(model + "/model.safetensors");
  r = run({"init-model", "--out", model, "--seed", "9"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("already holds a model (config.json)"), std::string::npos) << r.err;
  EXPECT_EQ(testing::ReadFile(model + "/model.safetensors"), before) << "written over";
  // A config.json that is a link, even to nothing, is a model there.
  std::filesystem::create_directories(TempPath("linked-model"));
  std::filesystem::create_symlink(TempPath("nothing.json"), TempPath("linked-model") + "/config.json");
  r = run({"init-model", "--out", TempPath("linked-model")});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_FALSE(std::filesystem::exists(TempPath("linked-model") + "/model.safetensors"));
  r = run({"init-model", "--out", TempPath("negative-model"), "--vocab-size", "-5"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--vocab-size must be >= 1, got -5"), std::string::npos) << r.err;
  r = run({"init-model", "--out", TempPath("odd-heads-model"), "--heads", "3"});
  EXPECT_EQ(r.code, 2) << r.err;  // a shape that cannot be: usage, before anything is written
  EXPECT_NE(r.err.find("--hidden-size 64 is not divisible by --heads 3"), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(TempPath("odd-heads-model")));
}

// tensor create checks its --shape before any call: a missing or
// overflowing one is a usage error (2) even where no coordinator answers.
TEST(Local, TensorCreateChecksItsShapeBeforeAnyCall) {
  for (const std::string& shape : std::vector<std::string>{"", "--shape=4611686018427387904,4", "--shape=2,0"}) {
    std::vector<std::string> argv = {Runfile("client/coloctl"), "--coordinator", "127.0.0.1:1", "--timeout", "2s",
                                     "tensor", "create", "job-000001", "t"};
    if (!shape.empty()) argv.push_back(shape);
    const auto r = RunCommand(argv, std::getenv("TEST_TMPDIR"), absl::Seconds(30));
    EXPECT_EQ(r.code, 2) << shape << ": " << r.err;
    EXPECT_NE(r.err.find("--shape"), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace colod
