// Child processes for integration tests: started with fork/exec, stderr to a
// file, always reaped (the destructor kills a child that is still running).
#ifndef COLOD_TESTS_SUBPROCESS_H_
#define COLOD_TESTS_SUBPROCESS_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/coordinator_client.h"

namespace colod::testing {

class Subprocess {
 public:
  // Starts argv[0] with argv; stdout goes to `stdout_path` (if non-empty) and
  // stderr to `stderr_path`.
  Subprocess(std::vector<std::string> argv, const std::string& stdout_path,
             const std::string& stderr_path);
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  pid_t pid() const { return pid_; }
  void Signal(int sig);
  // The exit code, 128+signal if killed by one, or nullopt after `timeout`.
  std::optional<int> Wait(absl::Duration timeout);

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
};

struct CommandResult {
  int code = -1;  // -1 if it did not finish in time
  std::string out;
  std::string err;
};

// Runs a command to completion.
CommandResult RunCommand(std::vector<std::string> argv, const std::string& tmpdir,
                                       absl::Duration timeout = absl::Seconds(60));

// client/coloctl (a runfile) with `args`, in TEST_TMPDIR, within `timeout`.
CommandResult RunColoctl(std::vector<std::string> args, absl::Duration timeout = absl::Seconds(240));

// The "loss" of each JSON line of `out` that has one (`coloctl train
// --output json`'s steps), in order.
std::vector<double> JsonLosses(const std::string& out);

// Reads KEY=VALUE lines of a --ready-file, waiting up to `timeout` for it.
std::optional<std::string> ReadyValue(const std::string& path, const std::string& key,
                                      absl::Duration timeout);

std::string ReadFile(const std::string& path);

// The coordinator address of a `coloctl local` whose stdout goes to
// `out_path`, from its "ready:" line once printed; "" if none within 60 s.
std::string LocalClusterAddress(const std::string& out_path);

// A data dependency of the test (e.g. "client/coloctl") in its runfiles.
std::string Runfile(const std::string& path);

// A colod daemon binary started on loopback with free ports.
struct Daemon {
  std::unique_ptr<Subprocess> process;
  std::string grpc;     // HOST:PORT from its ready file; empty if it never got ready
  std::string metrics;  // HOST:PORT of /metrics
  std::string log;      // its stderr
};

// Starts `binary` (a runfile, e.g. "server/colod-coordinator") with
// --listen/--metrics-listen 127.0.0.1:0 and a ready file under the test's
// temp dir named after `name`, plus `flags`; waits up to 30 s for it.
// `env` (NAME=VALUE) is added to its environment only (through env(1): the
// test's own is never changed while its threads run).
Daemon StartDaemon(const std::string& binary, const std::string& name, std::vector<std::string> flags,
                   const std::vector<std::string>& env = {});

// A coordinator for cluster tests: data under the test's temp dir ("data"),
// heartbeats every 200 ms and a 1.5 s lease (a lost worker shows fast),
// listening on `listen` (a restart reuses the address the workers know),
// plus `flags`.
Daemon StartTestCoordinator(const std::string& listen = "127.0.0.1:0", std::vector<std::string> flags = {});

// `n` CPU workers "w{first}".."w{first+n-1}" registering at `coordinator`,
// device ordinals first..first+n-1, work dirs "work{i}" under the test's temp
// dir, a 30 s --comm-timeout, plus `flags`.
std::vector<Daemon> StartTestWorkers(const std::string& coordinator, int n, const std::vector<std::string>& flags = {},
                                     int first = 0);

// Waits up to `timeout` until the coordinator lists `n` live workers; the
// last error or count if it never does.
absl::Status WaitForWorkers(CoordinatorClient& client, size_t n, absl::Duration timeout = absl::Seconds(30));

// The stderr of every daemon, for failure messages.
std::string DaemonLogs(const Daemon& coordinator, const std::vector<Daemon>& workers);

}  // namespace colod::testing

#endif  // COLOD_TESTS_SUBPROCESS_H_
