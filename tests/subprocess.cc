#include "tests/subprocess.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace colod::testing {

Subprocess::Subprocess(std::vector<std::string> argv, const std::string& stdout_path,
                       const std::string& stderr_path) {
  pid_ = ::fork();
  if (pid_ == 0) {
    // Child: the test runner may block signals; the daemon must see them.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);
    if (!stdout_path.empty()) {
      int out = ::open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(out, 1);
    }
    int err = ::open(stderr_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(err, 2);
    std::vector<char*> args;
    for (auto& a : argv) args.push_back(a.data());
    args.push_back(nullptr);
    ::execv(args[0], args.data());
    _exit(127);
  }
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && !status_) {
    ::kill(pid_, SIGKILL);
    Wait(absl::Seconds(10));
  }
}

void Subprocess::Signal(int sig) {
  if (pid_ > 0 && !status_) ::kill(pid_, sig);
}

std::optional<int> Subprocess::Wait(absl::Duration timeout) {
  if (status_) return status_;
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    int st = 0;
    pid_t r = ::waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      return status_;
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  return std::nullopt;
}

std::string Runfile(const std::string& path) {
  const char* dir = std::getenv("TEST_SRCDIR");
  return absl::StrCat(dir != nullptr ? dir : ".", "/colod/", path);
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

CommandResult RunCommand(std::vector<std::string> argv, const std::string& tmpdir,
                         absl::Duration timeout) {
  static int counter = 0;
  const std::string out = absl::StrCat(tmpdir, "/cmd", ++counter, ".out");
  const std::string err = absl::StrCat(tmpdir, "/cmd", counter, ".err");
  Subprocess p(std::move(argv), out, err);
  std::optional<int> code = p.Wait(timeout);
  return {code.value_or(-1), ReadFile(out), ReadFile(err)};
}

std::optional<std::string> ReadyValue(const std::string& path, const std::string& key,
                                      absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (::access(path.c_str(), R_OK) == 0) {
      for (absl::string_view line : absl::StrSplit(ReadFile(path), '\n')) {
        std::pair<std::string, std::string> kv = absl::StrSplit(line, absl::MaxSplits('=', 1));
        if (kv.first == key) return kv.second;
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return std::nullopt;
}

Daemon StartDaemon(const std::string& binary, const std::string& name, std::vector<std::string> flags,
                   const std::vector<std::string>& env) {
  Daemon d;
  const std::string ready = TempPath(name + ".ready");
  d.log = TempPath(name + ".log");
  std::remove(ready.c_str());  // a restart must not read the last run's ports
  std::vector<std::string> argv;
  if (!env.empty()) {  // env execs the daemon: the pid is the daemon's
    argv.push_back("/usr/bin/env");
    argv.insert(argv.end(), env.begin(), env.end());
  }
  argv.insert(argv.end(), {Runfile(binary), "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                           "--ready-file", ready});
  argv.insert(argv.end(), flags.begin(), flags.end());
  d.process = std::make_unique<Subprocess>(argv, "", d.log);
  d.grpc = ReadyValue(ready, "grpc", absl::Seconds(30)).value_or("");
  d.metrics = ReadyValue(ready, "metrics", absl::Seconds(30)).value_or("");
  return d;
}

Daemon StartTestCoordinator(const std::string& listen, std::vector<std::string> flags) {
  std::vector<std::string> argv = {"--data-dir", TempPath("data"), "--heartbeat-interval", "200ms",
                                   "--lease-duration", "1500ms", "--listen", listen};
  argv.insert(argv.end(), flags.begin(), flags.end());
  return StartDaemon("server/colod-coordinator", "coordinator", std::move(argv));
}

std::vector<Daemon> StartTestWorkers(const std::string& coordinator, int n, const std::vector<std::string>& flags,
                                     int first) {
  std::vector<Daemon> workers;
  for (int i = first; i < first + n; ++i) {
    std::vector<std::string> argv = {"--coordinator", coordinator, "--device", "cpu", "--device-ordinal",
                                     absl::StrCat(i), "--work-dir", TempPath(absl::StrCat("work", i)),
                                     "--comm-timeout", "30s"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    workers.push_back(StartDaemon("worker/daemon/colod-worker", absl::StrCat("w", i), std::move(argv)));
  }
  return workers;
}

absl::Status WaitForWorkers(CoordinatorClient& client, size_t n, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::Status last = absl::OkStatus();
  size_t got = 0;
  while (absl::Now() < deadline) {
    auto list = client.ListWorkers(/*include_lost=*/false);
    if (list.ok() && list->size() == n) return absl::OkStatus();
    if (list.ok()) got = list->size();
    last = list.status();
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError(absl::StrCat(got, " of ", n, " workers registered within ",
                                                  absl::FormatDuration(timeout), "; last error: ", last.ToString()));
}

std::string DaemonLogs(const Daemon& coordinator, const std::vector<Daemon>& workers) {
  std::string out = ReadFile(coordinator.log);
  for (const Daemon& w : workers) out += ReadFile(w.log);
  return out;
}

std::string LocalClusterAddress(const std::string& out_path) {
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    std::ifstream in(out_path);
    for (std::string line; std::getline(in, line);) {
      const std::string key = "export COLOD_COORDINATOR=";
      const size_t at = line.find(key);
      if (line.rfind("ready:", 0) == 0 && at != std::string::npos) {
        const std::string rest = line.substr(at + key.size());
        return rest.substr(0, rest.find(';'));
      }
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return "";
}

CommandResult RunColoctl(std::vector<std::string> args, absl::Duration timeout) {
  args.insert(args.begin(), Runfile("client/coloctl"));
  const char* tmp = std::getenv("TEST_TMPDIR");
  return RunCommand(std::move(args), tmp != nullptr ? tmp : "/tmp", timeout);
}

std::vector<double> JsonLosses(const std::string& out) {
  std::vector<double> losses;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_object() && j.contains("loss") && j["loss"].is_number()) losses.push_back(j["loss"].get<double>());
  }
  return losses;
}

}  // namespace colod::testing
