// A soak of the daemons under load and failures (not part of CI):
//
//   bazel run -c opt //bench:soak -- --minutes 10
//
// An embedded cluster on loopback (a coordinator and --workers CPU workers,
// real processes, the test cluster's 200 ms heartbeats and 1.5 s lease)
// runs for --minutes while
//   - --fake-workers simulated workers heartbeat at --heartbeats-per-second
//     in all (BUSY with a job the coordinator does not run, so they are never
//     placed on);
//   - small TRAIN jobs (tiny GPT-2, tp and dp 1 or 2, checkpoints every 5
//     steps, the default restart policy) are submitted, at most three at a
//     time, and one in ten is cancelled;
//   - every --chaos-seconds one failure: a worker SIGKILLed and started
//     again, a worker stopped (SIGTERM) and started again, a worker SIGSTOPped
//     for 3 s, or the coordinator SIGKILLed and started again on its data dir
//     (never in the last 40 % of the run, the window RSS and fds are
//     measured over).
// Then it stops submitting and waits for every job to end, and checks: no
// job lost (each submitted id is listed) or stuck (all final); the
// coordinator's RSS (per job submitted meanwhile: it keeps every job's record
// and events in memory) and open file descriptors over the quiet window; the
// coordinator's colod_jobs{state} equal `ListJobs` per state; every worker's
// colod_rank_running is 0 once nothing runs. Prints a table; exits 1 if a
// check fails.
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "common/flags.h"
#include "common/proto_time.h"
#include "server/job_manager.h"
#include "tests/subprocess.h"
#include "tests/testing/prometheus_text.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"
#include "worker/train/job_options.h"

ABSL_FLAG(double, minutes, 10, "How long the load and the failures go on.");
ABSL_FLAG(int, workers, 4, "Real CPU worker daemons.");
ABSL_FLAG(int, fake_workers, 200, "Simulated workers that only heartbeat.");
ABSL_FLAG(int, heartbeats_per_second, 2000, "Heartbeats per second of the simulated workers, in all.");
ABSL_FLAG(double, chaos_seconds, 20, "Seconds between failures.");
ABSL_FLAG(uint64_t, seed, 1, "Seed of the job sizes and the failures.");

namespace colod {
namespace {

using testing::Daemon;

constexpr char kGpl[] = "/usr/share/common-licenses/GPL-3";

struct Usage {
  int64_t rss_kb = 0;
  int fds = 0;
};

Usage UsageOf(pid_t pid) {
  Usage u;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) {
      std::vector<std::string> parts = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (parts.size() >= 2) (void)absl::SimpleAtoi(parts[1], &u.rss_kb);
    }
  }
  std::error_code ec;
  for (auto it = std::filesystem::directory_iterator(absl::StrCat("/proc/", pid, "/fd"), ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++u.fds;
  }
  return u;
}

// Sum of a metric's samples on a daemon's /metrics; -1 if unreadable.
double MetricSum(const std::string& address, const std::string& name, const std::string& label = "",
                 const std::string& value = "") {
  auto body = testing::HttpGet(address, "/metrics");
  if (!body.ok()) return -1;
  auto families = testing::ParsePrometheusText(*body);
  if (!families.ok()) return -1;
  auto it = families->find(name);
  if (it == families->end()) return 0;
  double sum = 0;
  for (const testing::Sample& s : it->second.samples) {
    if (!label.empty() && (!s.labels.count(label) || s.labels.at(label) != value)) continue;
    sum += s.value;
  }
  return sum;
}

class Soak {
 public:
  Soak() : rng_(absl::GetFlag(FLAGS_seed)) {}

  int Run() {
    shardformer::testing::TinyOptions tiny;
    tiny.vocab = 257;
    tiny.positions = 32;
    if (!shardformer::testing::WriteTinyGpt2(testing::TempPath("gpt2"), tiny).ok()) return Fail("cannot write the model");
    StartCoordinator("127.0.0.1:0");
    if (coordinator_.grpc.empty()) return Fail("the coordinator did not start");
    const int n = absl::GetFlag(FLAGS_workers);
    workers_ = testing::StartTestWorkers(coordinator_.grpc, n);
    if (!testing::WaitForWorkers(*Client(), n).ok()) return Fail("the workers did not register");

    const absl::Duration total = absl::Seconds(absl::GetFlag(FLAGS_minutes) * 60);
    const absl::Time start = absl::Now();
    const absl::Time quiet = start + total * 0.6;  // no coordinator restart after this
    const absl::Time end = start + total;
    address_ = coordinator_.grpc;
    std::atomic<bool> done{false};
    std::thread heartbeats([&] { HeartbeatLoad(done); });
    Usage at_quiet;
    size_t jobs_at_quiet = 0;
    bool measured = false;
    absl::Time next_chaos = start + absl::Seconds(absl::GetFlag(FLAGS_chaos_seconds));
    while (absl::Now() < end) {
      SubmitOrCancel();
      if (absl::Now() >= next_chaos) {
        Chaos(/*coordinator_too=*/absl::Now() < quiet - absl::Seconds(30));
        next_chaos = absl::Now() + absl::Seconds(absl::GetFlag(FLAGS_chaos_seconds));
      }
      if (!measured && absl::Now() >= quiet) {
        at_quiet = UsageOf(coordinator_.process->pid());
        jobs_at_quiet = submitted_.size();
        measured = true;
      }
      absl::SleepFor(absl::Milliseconds(500));
    }
    const Usage at_end = UsageOf(coordinator_.process->pid());
    // Let every job end (a restarting one may wait for workers a while).
    const absl::Time drain = absl::Now() + absl::Minutes(5);
    std::vector<v1::Job> jobs;
    int open = 0;
    while (absl::Now() < drain) {
      auto listed = Client()->ListJobs();
      if (listed.ok()) {
        jobs = *listed;
        open = 0;
        for (const v1::Job& j : jobs) open += !JobManager::IsFinal(j.state());
        if (open == 0) break;
      }
      absl::SleepFor(absl::Seconds(1));
    }
    done = true;
    heartbeats.join();
    absl::SleepFor(absl::Seconds(2));  // the gauges refresh every second

    std::map<std::string, int> by_state;
    std::set<std::string> listed;
    for (const v1::Job& j : jobs) {
      ++by_state[JobStateName(j.state())];
      listed.insert(j.job_id());
    }
    int lost = 0;
    for (const std::string& id : submitted_) lost += !listed.count(id);
    bool gauges_agree = true;
    for (const auto& [state, count] : by_state) {
      gauges_agree = gauges_agree && MetricSum(coordinator_.metrics, "colod_jobs", "state", state) == count;
    }
    double running_ranks = 0;
    for (const Daemon& w : workers_) running_ranks += std::max(0.0, MetricSum(w.metrics, "colod_rank_running"));

    std::printf("soak: %.1f min, %d workers, %d simulated workers at %d heartbeats/s (%lld sent, %lld failed)\n",
                absl::ToDoubleMinutes(end - start), n, absl::GetFlag(FLAGS_fake_workers),
                absl::GetFlag(FLAGS_heartbeats_per_second), static_cast<long long>(heartbeats_sent_.load()),
                static_cast<long long>(heartbeats_failed_.load()));
    std::printf("%-44s %s\n", "failures injected", absl::StrJoin(chaos_log_, ", ").c_str());
    std::printf("%-44s %zu (cancel requests: %d)\n", "jobs submitted", submitted_.size(), cancels_);
    std::string states;
    for (const auto& [state, count] : by_state) absl::StrAppend(&states, state, " ", count, "  ");
    std::printf("%-44s %s\n", "jobs by state at the end", states.c_str());
    std::printf("%-44s %d\n", "jobs lost (submitted, not listed)", lost);
    std::printf("%-44s %d\n", "jobs stuck (not final 5 min after the load)", open);
    const size_t window_jobs = submitted_.size() - jobs_at_quiet;
    std::printf("%-44s %lld -> %lld KiB (%zu jobs submitted meanwhile: %.1f KiB per job)\n",
                "coordinator RSS over the quiet window", static_cast<long long>(at_quiet.rss_kb),
                static_cast<long long>(at_end.rss_kb), window_jobs,
                window_jobs > 0 ? static_cast<double>(at_end.rss_kb - at_quiet.rss_kb) / window_jobs : 0.0);
    std::printf("%-44s %d -> %d\n", "coordinator open fds over the quiet window", at_quiet.fds, at_end.fds);
    std::printf("%-44s %s\n", "colod_jobs{state} == ListJobs per state", gauges_agree ? "yes" : "NO");
    std::printf("%-44s %.0f\n", "workers' colod_rank_running once idle", running_ranks);
    const bool ok = lost == 0 && open == 0 && gauges_agree && running_ranks == 0 && at_end.fds <= at_quiet.fds + 8 &&
                    at_end.rss_kb <= at_quiet.rss_kb * 1.25 + 4096;
    std::printf("%s\n", ok ? "PASS" : "FAIL");
    for (Daemon& w : workers_) w.process->Signal(SIGTERM);
    coordinator_.process->Signal(SIGTERM);
    return ok ? 0 : 1;
  }

 private:
  int Fail(const std::string& why) {
    std::fprintf(stderr, "soak: %s\n", why.c_str());
    return 1;
  }

  void StartCoordinator(const std::string& listen) {
    coordinator_ = testing::StartTestCoordinator(listen, {"--hang-threshold", "5s"});
    auto client = CoordinatorClient::Create(coordinator_.grpc);
    if (client.ok()) {
      absl::MutexLock lock(&mu_);
      client_ = std::move(*client);
    }
  }

  // Simulated workers: registered, then heartbeating BUSY with a job the
  // coordinator does not run, at the flag's rate in all; registered again
  // when the coordinator forgot them (its restart).
  void HeartbeatLoad(const std::atomic<bool>& done) {
    const int n = absl::GetFlag(FLAGS_fake_workers);
    const int rate = absl::GetFlag(FLAGS_heartbeats_per_second);
    if (n <= 0 || rate <= 0) return;
    std::vector<std::string> ids(n);
    // The coordinator restarts on the same address; the channel reconnects.
    auto made = CoordinatorClient::Create(address_);
    if (!made.ok()) return;
    std::unique_ptr<CoordinatorClient> client = std::move(*made);
    v1::WorkerStatus busy;  // registered and heartbeating BUSY: never placed on
    busy.set_state(v1::WORKER_STATE_BUSY);
    busy.set_job_id("soak-load");
    const absl::Duration gap = absl::Seconds(1) / rate;
    absl::Time next = absl::Now();
    for (int64_t i = 0; !done; ++i) {
      const int w = static_cast<int>(i % n);
      if (client) {
        if (ids[w].empty()) {
          v1::WorkerInfo info;
          info.set_address(absl::StrCat("127.0.0.2:", 30000 + w));  // nothing listens: never placed on
          info.set_device_kind(v1::DEVICE_KIND_CPU);
          auto r = client->RegisterWorker(info, busy);
          if (r.ok()) ids[w] = r->worker_id();
        } else {
          auto hb = client->Heartbeat(ids[w], busy);
          ++heartbeats_sent_;
          if (!hb.ok()) {
            ++heartbeats_failed_;
            if (absl::IsNotFound(hb.status())) ids[w].clear();  // a restarted coordinator forgot it
          }
        }
      }
      next += gap;
      const absl::Time now = absl::Now();
      if (next > now) absl::SleepFor(next - now);
      if (now - next > absl::Seconds(1)) next = now;  // fell behind (a restart): do not burst
    }
  }

  CoordinatorClient* Client() {
    absl::MutexLock lock(&mu_);
    return client_.get();
  }

  void SubmitOrCancel() {
    CoordinatorClient* client = Client();
    if (client == nullptr) return;
    auto jobs = client->ListJobs();
    if (!jobs.ok()) return;
    int open = 0;
    std::vector<std::string> running;
    for (const v1::Job& j : *jobs) {
      if (JobManager::IsFinal(j.state())) continue;
      ++open;
      if (j.state() == v1::JOB_STATE_RUNNING) running.push_back(j.job_id());
    }
    if (!running.empty() && std::uniform_int_distribution<int>(0, 99)(rng_) < 3) {
      const std::string& victim = running[std::uniform_int_distribution<size_t>(0, running.size() - 1)(rng_)];
      if (client->CancelJob(victim, "soak").ok()) ++cancels_;
    }
    if (open >= 3) return;
    train::TrainOptions o;
    o.model_dir = testing::TempPath("gpt2");
    o.data_path = kGpl;
    o.steps = std::uniform_int_distribution<int>(20, 60)(rng_);
    o.batch_size = 4;
    o.seq_len = 32;
    o.lr = 3e-3;
    o.min_lr = 3e-4;
    o.seed = rng_();
    o.shard.layout.set_tensor_parallel_size(std::uniform_int_distribution<int>(1, 2)(rng_));
    o.shard.layout.set_data_parallel_size(std::uniform_int_distribution<int>(1, 2)(rng_));
    o.shard.layout.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_1D);
    o.save_dir = testing::TempPath(absl::StrCat("ck-", submitted_.size()));
    o.save_every = 5;
    v1::JobSpec spec = train::SpecFromTrainOptions(o);
    spec.set_name("soak");
    spec.mutable_model()->set_config_json(testing::ReadFile(o.model_dir + "/config.json"));
    spec.mutable_model()->set_weights_path(o.model_dir);
    *spec.mutable_restart()->mutable_worker_wait() = ToProtoDuration(absl::Seconds(60));
    auto job = client->SubmitJob(spec, absl::StrCat("soak-", submitted_.size()));
    if (job.ok()) submitted_.push_back(job->job_id());
  }

  // Every fourth failure outside the quiet window is the coordinator's;
  // the others are drawn among the workers' kinds.
  void Chaos(bool coordinator_too) {
    ++chaos_count_;
    const int kind = coordinator_too && chaos_count_ % 4 == 0 ? 3 : std::uniform_int_distribution<int>(0, 2)(rng_);
    if (kind == 3) {
      const std::string address = coordinator_.grpc;
      coordinator_.process->Signal(SIGKILL);
      coordinator_.process->Wait(absl::Seconds(10));
      StartCoordinator(address);
      chaos_log_.push_back("coordinator SIGKILL");
      return;
    }
    const int w = std::uniform_int_distribution<int>(0, static_cast<int>(workers_.size()) - 1)(rng_);
    if (kind == 2) {
      workers_[w].process->Signal(SIGSTOP);
      absl::SleepFor(absl::Seconds(3));
      workers_[w].process->Signal(SIGCONT);
      chaos_log_.push_back(absl::StrCat("w", w, " SIGSTOP 3s"));
      return;
    }
    workers_[w].process->Signal(kind == 0 ? SIGKILL : SIGTERM);
    workers_[w].process->Wait(absl::Seconds(30));
    std::vector<Daemon> again = testing::StartTestWorkers(coordinator_.grpc, 1, {}, /*first=*/w);
    if (!again.empty()) workers_[w] = std::move(again[0]);
    chaos_log_.push_back(absl::StrCat("w", w, kind == 0 ? " SIGKILL" : " SIGTERM"));
  }

  std::string address_;  // the coordinator's, kept across its restarts
  std::mt19937_64 rng_;
  Daemon coordinator_;
  std::vector<Daemon> workers_;
  absl::Mutex mu_;
  std::unique_ptr<CoordinatorClient> client_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> submitted_;
  std::vector<std::string> chaos_log_;
  int cancels_ = 0;
  int chaos_count_ = 0;
  std::atomic<int64_t> heartbeats_sent_{0}, heartbeats_failed_{0};
};

}  // namespace
}  // namespace colod

int main(int argc, char** argv) {
  colod::ParseFlags(argc, argv, "soak: the daemons under load and failures (see bench/soak.cc)\n");
  setvbuf(stdout, nullptr, _IOLBF, 0);
  // The daemons and scratch files, found and kept as the test helpers expect.
  std::string runfiles = std::getenv("RUNFILES_DIR") != nullptr ? std::getenv("RUNFILES_DIR")
                                                                 : std::string(argv[0]) + ".runfiles";
  setenv("TEST_SRCDIR", runfiles.c_str(), 1);
  char dir[] = "/tmp/colod-soak-XXXXXX";
  if (mkdtemp(dir) == nullptr) return 1;
  setenv("TEST_TMPDIR", dir, 1);
  std::printf("soak: scratch and daemon logs in %s\n", dir);
  return colod::Soak().Run();
}
