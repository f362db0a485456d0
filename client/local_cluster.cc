#include "client/local_cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <system_error>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/coordinator_client.h"
#include "common/exit_codes.h"
#include "common/find_binary.h"
#include "common/grpc_server.h"
#include "common/net.h"
#include "common/status_macros.h"

namespace colod {
namespace {

// Starts `argv` with stderr to `log` (appended to where `append`, else
// truncated) and stdout to /dev/null, dying with this process.
absl::StatusOr<pid_t> Spawn(const std::vector<std::string>& argv, const std::string& log, bool append = false) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) return absl::InternalError("fork failed");
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec (another thread of
    // this process may have held a lock), and no stdio: freopen would flush
    // the parent's buffered stdout a second time, from the child.
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);
    // A process group of its own: the terminal's Ctrl-C (or SIGHUP) reaches
    // coloctl alone, which stops the workers first, with one SIGTERM each
    // (a second signal would end a worker's drain), then the coordinator.
    ::setpgid(0, 0);
    const int err = ::open(log.c_str(), O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC) | O_CLOEXEC, 0644);
    const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
    if (err < 0 || null < 0 || ::dup2(err, STDERR_FILENO) < 0 || ::dup2(null, STDOUT_FILENO) < 0) ::_exit(126);
    // The daemons wait for SIGTERM; the signal mask of a coloctl that blocked
    // it would otherwise carry over (and its handler run until the exec).
    RestoreShutdownSignalActionsInChild();
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    ::execv(args[0], args.data());
    ::_exit(127);
  }
  return pid;
}

// Reaps `pids` (SIGTERMed), SIGKILLing together whatever still runs 10 s
// on, or once `hurry` is set (LocalCluster::Hurry). Only pids not yet
// reaped are signalled: none can have been reused.
void ReapChildren(const std::vector<pid_t>& pids, const std::atomic<bool>& hurry) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  std::vector<pid_t> running = pids;
  while (!running.empty()) {
    std::vector<pid_t> still;
    for (pid_t pid : running) {
      int status = 0;
      if (::waitpid(pid, &status, WNOHANG) == 0) still.push_back(pid);
    }
    running = std::move(still);
    if (running.empty()) return;
    if (absl::Now() > deadline || hurry.load()) {
      for (pid_t pid : running) ::kill(pid, SIGKILL);
      for (pid_t pid : running) {
        int status = 0;
        ::waitpid(pid, &status, 0);
      }
      return;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
}

// SIGTERMs `pids` together and reaps them (ReapChildren).
void StopChildren(const std::vector<pid_t>& pids, const std::atomic<bool>& hurry) {
  for (pid_t pid : pids) ::kill(pid, SIGTERM);
  ReapChildren(pids, hurry);
}

// KEY=VALUE of a ready file, once it exists.
std::string ReadyValue(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    if (absl::StartsWith(line, key + "=")) return line.substr(key.size() + 1);
  }
  return "";
}

}  // namespace

absl::StatusOr<std::string> FindDaemonBinary(const std::string& self, const std::string& name) {
  return FindBinary(name, {"../server", "../worker/daemon"}, self);
}

absl::StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::Start(Options options) {
  if (options.workers < 1) return absl::InvalidArgumentError("a local cluster needs at least 1 worker");
  if (options.workers > kMaxWorkers) {
    return absl::InvalidArgumentError(absl::StrCat("a local cluster runs at most ", kMaxWorkers, " workers, not ",
                                                   options.workers, ": run a larger layout on a cluster (--coordinator)"));
  }
  if (options.coordinator_binary.empty() || options.worker_binary.empty()) {
    return absl::InvalidArgumentError("the daemon binaries are required");
  }
  if (options.max_worker_restarts < 0) return absl::InvalidArgumentError("max_worker_restarts must be >= 0");
  RETURN_IF_ERROR(ParseHostPort(options.listen, "--listen", /*allow_zero_port=*/true).status());
  RETURN_IF_ERROR(ParseHostPort(options.metrics_listen, "--metrics-listen", /*allow_zero_port=*/true).status());
  std::unique_ptr<LocalCluster> c(new LocalCluster());
  c->data_dir_ = options.data_dir;
  c->max_worker_restarts_ = options.max_worker_restarts;
  c->stop_pause_ = options.stop_pause_for_test;
  if (c->data_dir_.empty()) {
    const char* tmpdir = std::getenv("TMPDIR");
    std::string tmpl = absl::StrCat(tmpdir != nullptr && *tmpdir != '\0' ? tmpdir : "/tmp", "/colod-local-XXXXXX");
    if (::mkdtemp(tmpl.data()) == nullptr) {
      return absl::InternalError(absl::StrCat("cannot create a temporary directory ", tmpl, ": ", std::strerror(errno)));
    }
    c->data_dir_ = tmpl;
    c->temporary_ = true;
  } else {
    std::error_code ec;
    std::filesystem::create_directories(c->data_dir_, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("--data-dir: cannot create '", c->data_dir_, "': ", ec.message()));
    }
  }
  const std::string ready = c->data_dir_ + "/coordinator.ready";
  std::error_code stale;
  std::filesystem::remove(ready, stale);
  if (stale) return absl::FailedPreconditionError(absl::StrCat("cannot remove '", ready, "': ", stale.message()));
  auto fail = [&c](absl::Status s) {
    c->temporary_ = false;  // keep the logs
    c->Stop();
    return absl::Status(s.code(), absl::StrCat(s.message(), "; logs in ", c->data_dir_));
  };
  auto cancelled = [&options] { return options.cancelled && options.cancelled(); };
  auto cancel = [&c] {
    c->Stop();  // a temporary data dir goes with it
    return absl::CancelledError("the local cluster's start was cancelled");
  };
  std::vector<std::string> coordinator_argv = {options.coordinator_binary, "--data-dir", c->data_dir_ + "/coordinator",
                                               "--listen", options.listen, "--metrics-listen", options.metrics_listen,
                                               "--ready-file", ready};
  // A temporary data dir, removed when the cluster stops, keeps no room for
  // records no restart will read.
  if (c->temporary_) coordinator_argv.push_back("--data-dir-reserve=0");
  auto coordinator = Spawn(coordinator_argv, c->data_dir_ + "/coordinator.log");
  if (!coordinator.ok()) return fail(coordinator.status());
  {
    absl::MutexLock lock(&c->mu_);
    c->coordinator_pid_ = *coordinator;
  }
  const absl::Time deadline = absl::Now() + options.ready_timeout;
  while ((c->address_ = ReadyValue(ready, "grpc")).empty()) {
    // Before the daemons' deaths: one that died of a signal sent to the
    // whole tree is the cancel, not a failure.
    if (cancelled()) return cancel();
    int status = 0;
    if (::waitpid(*coordinator, &status, WNOHANG) == *coordinator) {
      {
        absl::MutexLock lock(&c->mu_);
        c->coordinator_pid_ = -1;  // reaped
      }
      return fail(absl::UnavailableError("the coordinator exited at start (is --listen in use?)"));
    }
    if (absl::Now() > deadline) return fail(absl::DeadlineExceededError("the coordinator did not start"));
    absl::SleepFor(absl::Milliseconds(10));
  }
  c->metrics_address_ = ReadyValue(ready, "metrics");
  for (int i = 0; i < options.workers; ++i) {
    // The machine's cores shared among the workers: a rank's GEMMs on its own.
    const int blas_threads = std::max(1, static_cast<int>(std::thread::hardware_concurrency()) / options.workers);
    Child w;
    // clang-format off
    w.argv = {options.worker_binary, "--coordinator", c->address_, "--listen", "127.0.0.1:0",
              "--metrics-listen", "127.0.0.1:0", "--device", options.device,
              "--device-ordinal", absl::StrCat(i), "--blas-threads", absl::StrCat(blas_threads),
              "--work-dir", absl::StrCat(c->data_dir_, "/worker-", i, ".work"),
              // A drain (its job's checkpoint at a stop) within Stop's 10 s
              // with the worker's own shutdown after it, and none where
              // nothing of the cluster is kept.
              "--drain-timeout", c->temporary_ ? "0" : "6s"};
    // clang-format on
    w.log = absl::StrCat(c->data_dir_, "/worker-", i, ".log");
    auto pid = Spawn(w.argv, w.log);
    if (!pid.ok()) return fail(pid.status());
    w.pid = *pid;
    absl::MutexLock lock(&c->mu_);
    c->workers_.push_back(std::move(w));
  }
  while (true) {
    if (cancelled()) return cancel();  // first, as above (a cancel asked as the workers registered wins)
    auto workers = c->workers();
    if (workers.ok() && static_cast<int>(workers->size()) >= options.workers) break;
    // A worker that exited will never register: say so now, with its log,
    // not at the deadline (no such device, a build without CUDA, ...).
    std::string dead;
    {
      absl::MutexLock lock(&c->mu_);
      for (size_t i = 0; i < c->workers_.size() && dead.empty(); ++i) {
        Child& w = c->workers_[i];
        int status = 0;
        if (w.pid <= 0 || ::waitpid(w.pid, &status, WNOHANG) != w.pid) continue;
        w.pid = -1;  // reaped
        dead = absl::StrCat("local worker ", i, " ",
                            WIFEXITED(status) ? absl::StrCat("exited with status ", WEXITSTATUS(status))
                                              : absl::StrCat("was killed by signal ", WTERMSIG(status)),
                            " before it registered (see ", w.log, ")");
      }
    }
    if (!dead.empty()) return fail(absl::UnavailableError(dead));  // (fail stops the cluster, which takes mu_)
    if (absl::Now() > deadline) {
      return fail(absl::DeadlineExceededError(absl::StrCat("the local workers did not register within ",
                                                           absl::FormatDuration(options.ready_timeout))));
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  try {
    c->supervisor_ = std::thread([raw = c.get()] { raw->Supervise(); });
  } catch (const std::system_error& e) {
    return fail(absl::ResourceExhaustedError(absl::StrCat("cannot start the workers' supervisor: ", e.what())));
  }
  return c;
}

void LocalCluster::Supervise() {
  // Once stopped, this thread waits for Stop to have reaped the workers
  // before it ends: a child's PR_SET_PDEATHSIG comes when the thread that
  // forked it ends (prctl(2)), not the process, and this one forked those it
  // started again. That SIGTERM beside the stop's would be a worker's second
  // signal, which ends its drain (or, after it, the worker).
  for (;;) {
    size_t n = 0;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopped_), absl::Milliseconds(200))) {
        mu_.Await(absl::Condition(&workers_stopped_));
        return;
      }
      n = workers_.size();
    }
    for (size_t i = 0; i < n; ++i) {
      int status = 0;
      std::vector<std::string> argv;
      std::string log;
      int restarts = 0;
      bool asks = false;
      {
        // Reaped under mu_, and never once stopped: Stop signals the pids it
        // took under mu_, none of which can have been reaped (and reused).
        absl::MutexLock lock(&mu_);
        if (stopped_) break;
        Child& w = workers_[i];
        if (w.pid < 0 || ::waitpid(w.pid, &status, WNOHANG) != w.pid) continue;
        w.pid = -1;
        asks = WIFEXITED(status) && AsksForRestart(WEXITSTATUS(status));
        log = w.log;
        if (asks && w.restarts < max_worker_restarts_) {
          argv = w.argv;
          restarts = ++w.restarts;
          ++restarts_;
        }
      }
      if (argv.empty()) {
        const std::string how = WIFEXITED(status) ? absl::StrCat("exited ", WEXITSTATUS(status))
                                                  : absl::StrCat("was killed by signal ", WTERMSIG(status));
        std::fprintf(stderr, "coloctl local: worker %zu %s%s; it stays down (its log: %s)\n", i, how.c_str(),
                     asks ? ", asking for a restart once too often" : "", log.c_str());
        continue;
      }
      std::fprintf(stderr, "coloctl local: worker %zu %s (exit %d); starting it again (%d of %d; its log: %s)\n", i,
                   WEXITSTATUS(status) == kExitDeviceLost ? "lost its CUDA device" : "ended on an uncaught exception",
                   WEXITSTATUS(status), restarts, max_worker_restarts_, log.c_str());
      const absl::StatusOr<pid_t> again = Spawn(argv, log, /*append=*/true);
      if (!again.ok()) {
        std::fprintf(stderr, "coloctl local: worker %zu cannot be started again: %s\n", i,
                     std::string(again.status().message()).c_str());
        continue;
      }
      bool stopping = false;
      {
        absl::MutexLock lock(&mu_);
        stopping = stopped_;
        if (!stopping) workers_[i].pid = *again;  // Stop ends it
      }
      if (stopping) StopChildren({*again}, hurry_);  // Stop's signals came before it
    }
  }
}

void LocalCluster::Hurry() { hurry_ = true; }

void LocalCluster::StopOnSignal() {
  // Shared with the helper, which may outlive an exception of Stop's.
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread hurrier;
  try {
    hurrier = std::thread([this, done] {
      while (!*done) {
        const int sig = WaitForShutdownSignalFor(absl::Milliseconds(100));
        if (sig == 0 || *done) continue;  // (one after the stop is left for the caller's wait: none)
        std::fprintf(stderr, "coloctl: %s again: killing the daemons now (a worker's drain is lost)\n",
                     ::strsignal(sig));
        Hurry();
        return;
      }
    });
  } catch (const std::system_error&) {
    // No thread: a further signal waits for the stop.
  }
  struct Join {
    std::thread& t;
    std::atomic<bool>& done;
    ~Join() {
      done = true;
      if (t.joinable()) t.join();
    }
  } join{hurrier, *done};
  Stop();
}

std::vector<pid_t> LocalCluster::pids() const {
  absl::MutexLock lock(&mu_);
  std::vector<pid_t> out = {coordinator_pid_};
  for (const Child& w : workers_) out.push_back(w.pid);
  return out;
}

int LocalCluster::restarts() const {
  absl::MutexLock lock(&mu_);
  return restarts_;
}

absl::StatusOr<std::vector<v1::Worker>> LocalCluster::workers() const {
  ASSIGN_OR_RETURN(auto client, CoordinatorClient::Create(address_));
  return client->ListWorkers(/*include_lost=*/false);
}

LocalCluster::~LocalCluster() { Stop(); }

void LocalCluster::Stop() {
  std::vector<pid_t> workers;
  pid_t coordinator = -1;
  {
    // The workers together first (their last calls reach a live
    // coordinator), then the coordinator. The workers are signalled under
    // mu_, with stopped_ set: the supervisor reaps none after it (a pid it
    // reaped could have been reused), starts none again, and ends only once
    // they were reaped (Supervise says why).
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    stopped_ = true;
    for (const Child& w : workers_) {
      if (w.pid > 0) workers.push_back(w.pid);
    }
    coordinator = coordinator_pid_;
    if (stop_pause_ > absl::ZeroDuration()) {  // (mu_ released meanwhile)
      const bool never = false;
      mu_.AwaitWithTimeout(absl::Condition(&never), stop_pause_);
    }
    for (pid_t pid : workers) ::kill(pid, SIGTERM);
  }
  ReapChildren(workers, hurry_);
  {
    absl::MutexLock lock(&mu_);
    workers_stopped_ = true;
  }
  if (supervisor_.joinable() && supervisor_.get_id() != std::this_thread::get_id()) supervisor_.join();
  if (coordinator > 0) StopChildren({coordinator}, hurry_);
  if (temporary_) {
    std::error_code ec;
    std::filesystem::remove_all(data_dir_, ec);
  }
}

}  // namespace colod
