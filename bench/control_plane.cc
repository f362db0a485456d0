// Control-plane throughput and latency of the coordinator, in-process over
// loopback gRPC (issue 7's targets on the 2-core machine):
//
//   bazel run -c opt //bench:control_plane [-- --json] [-- --seconds S]
//
//   register   1,000 simulated workers call RegisterWorker (8 client threads)
//              target: all in under 1 s
//   mesh       rank assignment for a 1,024-rank mesh (tp 8 x dp 128) on
//              128 hosts of 8 devices, with every process group listed
//   heartbeat  p50/p99 latency of Heartbeat at a steady 2,000 calls/s
//              target: p99 under 5 ms
//   floor      the same for GetJob of an unknown job: a unary call that does
//              almost no work, the transport's floor on this machine
//   history    a TRAIN job's record of --history_steps steps (rank 0's
//              reports, every field a worker fills): the coordinator's memory
//              and disk per step, AddStep's cost, and how long a restarted
//              coordinator takes to read the history back and a watcher to
//              get it from the start
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "common/flags.h"
#include "server/coordinator.h"
#include "server/job_manager.h"
#include "server/placement.h"

ABSL_FLAG(bool, json, false, "Print one JSON object per row instead of a table.");
ABSL_FLAG(double, seconds, 3, "Duration of each steady-rate latency run.");
ABSL_FLAG(int, workers, 1000, "Simulated workers that register.");
ABSL_FLAG(int, rate, 2000, "Calls per second of the latency runs.");
ABSL_FLAG(int64_t, history_steps, 1000000, "Steps of the job whose history the history rows measure (0: none).");

namespace colod {
namespace {

struct Row {
  std::string name, value, target;
  bool ok = true;
};

v1::WorkerInfo Sim(int i) {
  v1::WorkerInfo w;
  w.set_address(absl::StrCat("127.0.0.1:", 20000 + i));
  w.set_host(absl::StrCat("sim-host-", i / 8));
  w.set_device_ordinal(i % 8);
  w.set_device_kind(v1::DEVICE_KIND_CPU);
  return w;
}

// `threads` clients each making calls at rate/threads per second for
// `seconds`, open loop (a late call does not delay the schedule); returns
// the latencies in ms, sorted.
std::vector<double> SteadyRate(const std::string& address, int rate, double seconds, int threads,
                               const std::function<void(CoordinatorClient&, int)>& call) {
  std::vector<double> all;
  absl::Mutex mu;
  std::vector<std::thread> pool;
  const absl::Duration period = absl::Seconds(static_cast<double>(threads) / rate);
  const int calls = static_cast<int>(rate * seconds / threads);
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      auto client = CoordinatorClient::Create(address);
      std::vector<double> mine;
      absl::Time next = absl::Now();
      for (int i = 0; i < calls; ++i) {
        absl::SleepFor(next - absl::Now());
        const absl::Time start = absl::Now();
        call(**client, t * calls + i);
        mine.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
        next += period;
      }
      absl::MutexLock lock(&mu);
      all.insert(all.end(), mine.begin(), mine.end());
    });
  }
  for (auto& th : pool) th.join();
  std::sort(all.begin(), all.end());
  return all;
}

// The process's resident bytes.
int64_t RssBytes() {
  std::ifstream statm("/proc/self/statm");
  int64_t pages = 0, resident = 0;
  statm >> pages >> resident;
  return resident * ::sysconf(_SC_PAGESIZE);
}

// What rank 0 reports for step `n` (worker/daemon/progress_reporter.cc):
// every field it fills each step, an eval every 500 steps and a checkpoint
// every 1,000.
v1::StepProgress ReportedStep(int64_t n) {
  v1::StepProgress p;
  p.set_step(n);
  p.set_loss(3.0 + 1.0 / static_cast<double>(n));
  p.set_learning_rate(6e-4);
  p.set_grad_norm(0.8);
  p.set_tokens_per_second(65000.5);
  p.mutable_step_duration()->set_nanos(499000000);
  p.set_param_bytes(int64_t{497} << 20);
  p.set_grad_bytes(int64_t{497} << 20);
  p.set_optimizer_bytes(int64_t{994} << 20);
  p.set_tokens(8192);
  if (n % 500 == 0) {
    p.mutable_eval()->set_step(n);
    p.mutable_eval()->set_loss(3.1);
    p.mutable_eval()->set_tokens(65536);
  }
  if (n % 1000 == 0) {
    p.set_checkpoint(absl::StrCat("/ckpt/gpt2/step-", n));
    auto* c = p.add_checkpoints();
    c->set_step(n);
    c->set_path(p.checkpoint());
  }
  return p;
}

// The history rows: a job of `steps` steps recorded in `dir`.
bool HistoryRows(const std::string& dir, int64_t steps, std::vector<Row>& rows) {
  std::string id;
  int64_t grew = 0;
  double add_us = 0;
  {
    auto jobs = JobManager::Open(dir);
    if (!jobs.ok()) return false;
    v1::JobSpec spec;
    spec.set_kind(v1::JOB_KIND_TRAIN);
    spec.mutable_model()->set_config_json(
        R"({"model_type": "gpt2", "vocab_size": 257, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64})");
    spec.mutable_model()->set_weights_path("/models/gpt2-tiny");
    spec.mutable_shard()->set_tensor_parallel_size(1);
    spec.mutable_shard()->set_data_parallel_size(1);
    spec.mutable_train()->set_steps(steps);
    spec.mutable_train()->set_batch_size(8);
    spec.mutable_train()->set_seq_len(32);
    spec.mutable_train()->set_learning_rate(6e-4);
    spec.mutable_train()->set_data_path("/usr/share/common-licenses/GPL-3");
    auto job = (*jobs)->Submit(spec, "");
    if (!job.ok()) {
      std::fprintf(stderr, "submit: %s\n", job.status().ToString().c_str());
      return false;
    }
    id = job->job_id();
    if (!(*jobs)->Schedule(id, v1::MeshSpec()).ok() || !(*jobs)->SetState(id, v1::JOB_STATE_RUNNING, "").ok()) {
      return false;
    }
    const int64_t before = RssBytes();
    const absl::Time start = absl::Now();
    for (int64_t n = 1; n <= steps; ++n) {
      if (absl::Status s = (*jobs)->AddStep(id, ReportedStep(n)); !s.ok()) {
        std::fprintf(stderr, "step %lld: %s\n", static_cast<long long>(n), s.ToString().c_str());
        return false;
      }
    }
    add_us = absl::ToDoubleMicroseconds(absl::Now() - start) / static_cast<double>(steps);
    grew = RssBytes() - before;
    (*jobs)->Flush();
  }
  int64_t disk = 0;
  for (const auto& f : std::filesystem::directory_iterator(dir)) {
    if (f.is_regular_file()) disk += static_cast<int64_t>(f.file_size());
  }
  const int64_t before_open = RssBytes();
  const absl::Time open_start = absl::Now();
  auto reopened = JobManager::Open(dir);
  if (!reopened.ok()) return false;
  const double open_s = absl::ToDoubleSeconds(absl::Now() - open_start);
  const int64_t reopened_grew = RssBytes() - before_open;
  // As WatchJob takes them (coordinator_service.cc's kWatchBatch).
  const absl::Time watch_start = absl::Now();
  size_t watched = 0;
  for (int64_t next = 1;;) {
    auto batch = (*reopened)->WaitForEvents(id, next, absl::ZeroDuration(), 1024);
    if (!batch.ok()) return false;
    watched += batch->events.size();
    if (batch->events.empty()) break;
    next = batch->events.back().sequence() + 1;
  }
  const double watch_s = absl::ToDoubleSeconds(absl::Now() - watch_start);
  const double per = static_cast<double>(steps);
  rows.push_back({absl::StrFormat("history of %lld steps: memory while recorded", static_cast<long long>(steps)),
                  absl::StrFormat("%.1f MiB (%.0f B/step)", grew / 1048576.0, grew / per), "-", true});
  rows.push_back({"history: on disk, memory after a restart",
                  absl::StrFormat("%.1f MiB, %.1f MiB", disk / 1048576.0, reopened_grew / 1048576.0), "-", true});
  rows.push_back({"history: AddStep, a restart's Open, a watch from 1",
                  absl::StrFormat("%.2f us, %.2f s, %.2f s (%zu events)", add_us, open_s, watch_s, watched),
                  "-", true});
  return true;
}

double Quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return 0;
  return sorted[std::min(sorted.size() - 1, static_cast<size_t>(q * sorted.size()))];
}

int Run() {
  const int n = absl::GetFlag(FLAGS_workers), rate = absl::GetFlag(FLAGS_rate);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  Coordinator::Options o;
  o.data_dir = absl::StrCat("/tmp/colod-bench-control-plane-", getpid());
  o.lease_duration = absl::Minutes(10);
  auto coordinator = Coordinator::Start(o);
  if (!coordinator.ok()) {
    std::fprintf(stderr, "coordinator: %s\n", coordinator.status().ToString().c_str());
    return 1;
  }
  const std::string address = (*coordinator)->address();
  std::vector<Row> rows;

  // 1. Registrations.
  std::vector<std::string> ids(n);
  const int threads = 8;
  const absl::Time t0 = absl::Now();
  {
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        auto client = CoordinatorClient::Create(address);
        for (int i = t; i < n; i += threads) {
          auto r = (*client)->RegisterWorker(Sim(i));
          if (r.ok()) ids[i] = r->worker_id();
        }
      });
    }
    for (auto& th : pool) th.join();
  }
  const double reg_ms = absl::ToDoubleMilliseconds(absl::Now() - t0);
  const int registered = static_cast<int>(std::count_if(ids.begin(), ids.end(), [](auto& s) { return !s.empty(); }));
  rows.push_back({absl::StrFormat("register %d workers (%d ok)", n, registered),
                  absl::StrFormat("%.0f ms (%.0f/s)", reg_ms, n / reg_ms * 1e3), "< 1000 ms",
                  reg_ms < 1000 && registered == n});

  // 2. Rank assignment for 1,024 ranks.
  {
    std::vector<v1::WorkerInfo> infos;
    for (int i = 0; i < 1024; ++i) {
      infos.push_back(Sim(i));
      infos.back().set_worker_id(absl::StrCat("w", i));
    }
    v1::ShardConfig s;
    s.set_tensor_parallel_size(8);
    s.set_data_parallel_size(128);
    std::vector<double> ms;
    for (int rep = 0; rep < 5; ++rep) {
      const absl::Time start = absl::Now();
      auto mesh = DeviceMesh::FromShardConfig(s);
      auto spec = AssignRanks(*mesh, infos);
      ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
      if (!spec.ok()) return 1;
    }
    std::sort(ms.begin(), ms.end());
    rows.push_back({"mesh + placement, 1,024 ranks (tp 8 x dp 128)", absl::StrFormat("%.2f ms (median of 5)", ms[2]),
                    "-", true});
  }

  // 3. Heartbeat latency at a steady rate, and the unary-call floor.
  const auto hb = SteadyRate(address, rate, seconds, 4, [&](CoordinatorClient& c, int i) {
    (void)c.Heartbeat(ids[i % n], v1::WorkerStatus());
  });
  rows.push_back({absl::StrFormat("Heartbeat p50 / p99 at %d/s (%zu calls)", rate, hb.size()),
                  absl::StrFormat("%.3f / %.3f ms", Quantile(hb, 0.5), Quantile(hb, 0.99)), "p99 < 5 ms",
                  Quantile(hb, 0.99) < 5});
  const auto floor = SteadyRate(address, rate, seconds, 4, [](CoordinatorClient& c, int) { (void)c.GetJob("none"); });
  rows.push_back({absl::StrFormat("floor: GetJob(unknown) p50 / p99 at %d/s", rate),
                  absl::StrFormat("%.3f / %.3f ms", Quantile(floor, 0.5), Quantile(floor, 0.99)), "(transport)",
                  true});
  (*coordinator)->Shutdown();
  std::error_code ec;
  std::filesystem::remove_all(o.data_dir, ec);

  // 4. A long job's history.
  if (const int64_t steps = absl::GetFlag(FLAGS_history_steps); steps > 0) {
    const std::string dir = o.data_dir + "-history";
    if (!HistoryRows(dir, steps, rows)) rows.push_back({"history", "failed", "-", false});
    std::filesystem::remove_all(dir, ec);
  }

  if (absl::GetFlag(FLAGS_json)) {
    for (const Row& r : rows) {
      std::printf("{\"measurement\": \"%s\", \"value\": \"%s\", \"target\": \"%s\", \"met\": %s}\n", r.name.c_str(),
                  r.value.c_str(), r.target.c_str(), r.ok ? "true" : "false");
    }
  } else {
    std::printf("%-52s %-28s %-12s %s\n", "measurement", "value", "target", "met");
    for (const Row& r : rows) {
      std::printf("%-52s %-28s %-12s %s\n", r.name.c_str(), r.value.c_str(), r.target.c_str(), r.ok ? "yes" : "NO");
    }
  }
  return 0;
}

}  // namespace
}  // namespace colod

int main(int argc, char** argv) {
  colod::ParseFlags(argc, argv,
                    "control_plane: coordinator registration throughput, mesh build time and Heartbeat latency.\n");
  return colod::Run();
}
