// The plumbing every coloctl command shares, written once: the command table's
// entry, exit codes and error lines, the coordinator's address, clients with
// TLS and the bearer token, embedded clusters, and following a job.
//
// Exit codes: 0 success, 1 the command failed (Fail), 2 a usage error (Usage,
// and ParseFlags' for a flag that is unknown or does not parse).
#ifndef COLOD_CLIENT_CLI_H_
#define COLOD_CLIENT_CLI_H_

#include <functional>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/coordinator_client.h"
#include "client/local_cluster.h"
#include "colod/v1/job.pb.h"
#include "google/protobuf/message.h"

ABSL_DECLARE_FLAG(std::string, coordinator);
ABSL_DECLARE_FLAG(absl::Duration, timeout);
ABSL_DECLARE_FLAG(std::string, output);
ABSL_DECLARE_FLAG(absl::Duration, watch_timeout);
ABSL_DECLARE_FLAG(std::string, out);

namespace colod::cli {

// One coloctl command. CommandLineMain builds --help from the entries and
// checks `operands` and `flags` before calling `run`, so a command never
// sees a missing or stray operand unless it checks them itself, nor a flag
// it does not read.
struct Command {
  const char* name;  // "status"
  // Space-separated operand names after the command ("JOB", "JOB NAME"); ""
  // for none; nullptr when `run` checks its operands itself (tensor).
  const char* operands;
  // The flags it reads, space-separated by their Abseil names ("reason";
  // "" for none), beyond the global ones (--coordinator, --timeout,
  // --output, TLS and the token: flags no command lists). Another
  // command's flag given to it is a usage error (exit 2) before `run`:
  // `coloctl status JOB --steps 5` is refused, not silently ignored.
  // `COMMAND --help` shows these, and the global flags its usage names. A
  // flag listed is read in one of the command's ways to run, and may be
  // refused in another (submit --job-file with the train flags, train
  // --device cuda with --max-restarts), or ignored where it cannot matter
  // (--upload on an embedded cluster, whose workers read the model where
  // it is).
  const char* flags;
  // The command's --help entry, each line ending in '\n': "  status JOB  One job
  // in detail ..." (two spaces, the name, then the description column).
  const char* usage;
  // The operands after the command's name; returns the exit code.
  int (*run)(const std::vector<std::string>& operands);
};

// A command's usage as --help prints it: the description (the lines that
// start at its column, 14) rewrapped to 88 columns at that column; lines
// indented otherwise (tables, examples) and a first line whose name and
// operands pass the column stay as written. Every line ends in '\n'.
std::string WrapUsage(const Command& command);

// Commands under one --help heading; a file per group (cmd_*.cc).
struct CommandGroup {
  const char* heading;  // ends in ':'
  absl::Span<const Command> commands;
};


// coloctl's exit status when it could not reach the coordinator (or the
// daemon `health` probes), or got no answer in time: a status that
// IsUnreachable (common/grpc_status.h). sysexits' EX_UNAVAILABLE; a retry
// may succeed, where exit 1 is the coordinator's own answer (NOT_FOUND, a
// refused spec, a failed job).
inline constexpr int kExitUnreachable = 69;
// "coloctl: error: CODE: message" on stderr; returns 1, or kExitUnreachable.
int Fail(const absl::Status& status);
// "coloctl: why" and a pointer to --help on stderr; returns 2.
int Usage(const std::string& why);
// `message` as pretty proto3 JSON on stdout; returns 0 (1 if it cannot be rendered).
int PrintJson(const google::protobuf::Message& message);
// Writes a command's output file (--out, --logits): a regular file, or a
// new one, atomically (WriteFileAtomically); a link to a file replaces the
// file it names; a FIFO or a character device (/dev/stdout, a shell's
// >(...)) is written in place, FAILED_PRECONDITION at once when a FIFO has
// no reader; this process's stdout or stderr (/dev/stdout redirected to a
// file) is written through its descriptor. A directory, or a link to
// nothing, is FAILED_PRECONDITION.
absl::Status WriteOutputFile(const std::string& path, absl::string_view bytes);
// --output json (main rejects anything but table and json before a command runs).
bool JsonOutput();

// --coordinator or $COLOD_COORDINATOR; empty when neither is set (commands
// that can run an embedded cluster instead ask this).
std::string ExplicitCoordinator();
// ExplicitCoordinator(), else 127.0.0.1:7070.
std::string CoordinatorAddress();

// A client of the coordinator at `address` with the --timeout deadline, the
// TLS flags and the bearer token (--auth-token-file or $COLOD_AUTH_TOKEN_FILE).
// INVALID_ARGUMENT / NOT_FOUND for a bad address or security flag: usage errors.
absl::StatusOr<std::unique_ptr<CoordinatorClient>> MakeClient(const std::string& address);
// Runs `fn` with a client of CoordinatorAddress(); a client that cannot be
// made is a usage error.
int WithCoordinator(const std::function<int(CoordinatorClient&)>& fn);

// A coordinator and `workers` workers of `device` ("cpu", or "cuda": worker
// i on CUDA device i) as children of this process (found next to this
// coloctl), every worker registered. With `interrupted`, the shutdown
// signals (blocked by the caller: BlockShutdownSignals) are looked for while
// it starts: one stops what was started, is stored there, and the start is
// CANCELLED.
absl::StatusOr<std::unique_ptr<LocalCluster>> StartLocalCluster(int workers, const std::string& listen,
                                                                const std::string& data_dir,
                                                                const std::string& device = "cpu",
                                                                int* interrupted = nullptr);
// True when this process's stdout is a pipe whose reader went away (the
// head of `coloctl train | head -1`), as poll(2) says without a write.
bool StdoutReaderGone();
// Runs `fn` with the address of ExplicitCoordinator() when one is given, else
// with that of an embedded cluster of `workers` CPU workers on loopback,
// started for the call and stopped after it (as on a real cluster, through
// the daemons). Returns fn's exit code, or 1 when the cluster cannot start
// (2 when it may not: more than LocalCluster::kMaxWorkers). SIGINT, SIGTERM
// or SIGHUP, while it starts or runs, stops the cluster and exits 128 + the
// signal; so does a stdout pipe whose reader went away (141, SIGPIPE's).
int RunOnCoordinatorOrEmbeddedCluster(int workers, const std::function<int(const std::string& address)>& fn);

// Follows a job to its end. Table mode draws a progress bar (step, loss,
// tokens/s) and state changes; json prints each event as one JSON line. With
// `on_step`, steps go to it instead (and json prints nothing itself). Gives up
// after --watch-timeout. Returns the job as it ended, or the watch's error.
absl::StatusOr<v1::Job> WatchToEnd(CoordinatorClient& client, const std::string& job_id, bool json,
                                   const std::function<void(const v1::StepProgress&)>& on_step);
// 0 for a job that succeeded; otherwise says how it ended on stderr and returns 1.
int ExitForJob(const v1::Job& job);

// One training step as `train` prints it: "step 3/10  loss ..." (on stdout),
// or with `json` one JSON object with step, loss, lr, grad_norm,
// tokens_per_second, param_bytes, grad_bytes and optimizer_bytes (fp16:
// loss_scale and update_skipped, a skipped step's grad_norm null); first
// "coloctl: resuming from DIR" on stderr where the step says it resumed.
void PrintStep(const v1::StepProgress& step, int64_t steps, bool json);
// After a train run that succeeded: for a time-boxed run (stop_after <
// steps), the checkpoint it saved at its stop (`checkpoint`, the newest it
// reported; empty: none, it resumed at or past its stop) and how to go on;
// else, with a --final DIR, that the model was written there.
void PrintRunEnd(const std::string& final_dir, const std::string& checkpoint, int64_t steps, int64_t stop_after);
// A forward pass's result as `forward` prints it (`images`: an image
// classifier's, whose loss needs labels; `labels`: labels were given, of
// images or a masked language model's positions; `logits_path`: where the logits were
// written, if anywhere; `writer`: the worker that wrote them on its machine,
// on a cluster this machine may not be part of, else ""). Returns the exit
// code.
int PrintForwardResult(const v1::ForwardResult& result, bool images, bool labels, const std::string& logits_path,
                       bool json, const std::string& writer = "");

// The program that runs the commands that compute in this process (a model
// on this machine's GPUs, init-model, tokenize, consolidate): coloctl-run,
// installed beside coloctl. coloctl links none of the trainer, the models or
// the kernels; it hands such a command line to coloctl-run.
inline constexpr char kRunBinary[] = "coloctl-run";
// Replaces this process with kRunBinary (beside this program, else on $PATH)
// on the same command line. Returns only when it cannot: 1, saying why.
int RunInProcess();
// The flags given on this command line (before any "--"), by their Abseil
// names (--job-file: "job_file"; --nowatch: "watch").
std::set<std::string> GivenFlags();
// Those of `given` that are defined in `file` (a source path as compiled,
// "client/job_flags.cc") and not in `kept`, as "--job-file, --steps" for a
// message; empty when there are none.
std::string FlagsOf(const std::set<std::string>& given, absl::string_view file, const std::set<std::string>& kept);

// main() of coloctl and of coloctl-run: parses the flags (--help prints
// `intro`, every group's usages and `epilogue`), checks --output and the
// command's operands, and runs it. Returns the exit code.
int CommandLineMain(int argc, char** argv, const std::string& intro, const std::string& epilogue,
                    const std::vector<CommandGroup>& groups);

}  // namespace colod::cli

#endif  // COLOD_CLIENT_CLI_H_
