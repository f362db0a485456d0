#include "client/cli.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <set>
#include <thread>

#include "absl/algorithm/container.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/format.h"
#include "common/atomic_file.h"
#include "common/find_binary.h"
#include "common/flags.h"
#include "common/grpc_server.h"
#include "common/grpc_status.h"
#include "common/json.h"
#include "common/security_flags.h"
#include "common/text.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, coordinator, "",
          "Coordinator HOST:PORT (an empty one is a usage error). Default: $COLOD_COORDINATOR, else "
          "127.0.0.1:7070; forward and train without either run on an embedded cluster of their own.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10),
          "Deadline of each call, e.g. 10s. A tensor call, which the coordinator runs on every rank after the "
          "job's calls before it, gets at least 60s.");
ABSL_FLAG(std::string, output, "table",
          "Output format: table or json. In json, colod's protobuf messages (jobs, workers, meshes, events, "
          "tensor layouts) are proto3 JSON, with its lowerCamelCase names (jobId), as grpcurl prints them; "
          "coloctl's own summaries (train and forward results, plan, tokenize, delete, health, version) use "
          "snake_case names. init-model and consolidate print text only.");
ABSL_FLAG(absl::Duration, watch_timeout, absl::Hours(24),
          "watch, submit --watch, train, forward: give up after this long.");
ABSL_FLAG(std::string, out, "",
          "consolidate, init-model: the Hugging Face directory to write; tokenize: the dataset's PREFIX; "
          "tensor get: a .npy file for the value.");

namespace colod::cli {

int Fail(const absl::Status& status) {
  std::fprintf(stderr, "coloctl: error: %s: %s\n", absl::StatusCodeToString(status.code()).c_str(),
               std::string(status.message()).c_str());
  return IsUnreachable(status) ? kExitUnreachable : 1;
}

int Usage(const std::string& why) {
  std::fprintf(stderr, "coloctl: %s\nRun 'coloctl --help' for usage.\n", why.c_str());
  return 2;
}

int PrintJson(const google::protobuf::Message& message) {
  auto out = RenderJson(message, /*pretty=*/true);
  if (!out.ok()) return Fail(out.status());
  std::fputs(out->c_str(), stdout);
  return 0;
}

absl::Status WriteOutputFile(const std::string& path, absl::string_view bytes) {
  struct stat target;
  if (::stat(path.c_str(), &target) != 0) {
    struct stat link;
    if (errno == ENOENT && ::lstat(path.c_str(), &link) == 0) {
      return absl::FailedPreconditionError(absl::StrCat("cannot write '", path, "': a link to nothing"));
    }
    return WriteFileAtomically(path, bytes);  // a new file (or its error, named)
  }
  if (S_ISDIR(target.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat("cannot write '", path, "': a directory, not a file"));
  }
  // /dev/stdout (or stderr) redirected to a file: written through the
  // descriptor, after what it holds, not by replacing the file.
  int fd = -1;
  for (const int std_fd : {STDOUT_FILENO, STDERR_FILENO}) {
    struct stat open_file;
    if (::fstat(std_fd, &open_file) == 0 && open_file.st_dev == target.st_dev && open_file.st_ino == target.st_ino) {
      fd = std_fd;
    }
  }
  if (S_ISREG(target.st_mode) && fd < 0) {
    char* real = ::realpath(path.c_str(), nullptr);  // a link's file is replaced, not the link
    if (real == nullptr) return FileError("cannot resolve", path, errno);
    const std::string resolved(real);
    std::free(real);
    return WriteFileAtomically(resolved, bytes);
  }
  if (fd < 0 && !S_ISFIFO(target.st_mode) && !S_ISCHR(target.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot write '", path, "': a socket or a block device, not a file, a pipe or a terminal"));
  }
  // In place, opened without waiting: a FIFO without a reader is ENXIO, not
  // a wait without end.
  const bool own = fd < 0;
  if (own) {
    fd = OpenWithoutWaiting(path, O_WRONLY | O_NOCTTY);
    if (fd < 0) {
      if (errno == ENXIO) {
        return absl::FailedPreconditionError(absl::StrCat("cannot write '", path, "': a FIFO nothing reads from"));
      }
      return FileError("cannot open", path, errno);
    }
  }
  const absl::Status s = WriteAll(fd, bytes, path);  // EPIPE: the reader went away
  if (own) ::close(fd);
  return s;
}

bool JsonOutput() { return absl::GetFlag(FLAGS_output) == "json"; }

std::string ExplicitCoordinator() {
  std::string address = absl::GetFlag(FLAGS_coordinator);
  if (address.empty()) {
    const char* env = std::getenv("COLOD_COORDINATOR");
    if (env != nullptr) address = env;
  }
  return address;
}

std::string CoordinatorAddress() {
  const std::string address = ExplicitCoordinator();
  return address.empty() ? "127.0.0.1:7070" : address;
}

absl::StatusOr<std::unique_ptr<CoordinatorClient>> MakeClient(const std::string& address) {
  if (absl::GetFlag(FLAGS_watch_timeout) <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("--watch-timeout: must be > 0");
  }
  CoordinatorClient::Options options;
  options.timeout = absl::GetFlag(FLAGS_timeout);
  options.tensor_timeout = std::max(options.timeout, options.tensor_timeout);
  // The token file is read again every minute, as the daemons read theirs:
  // a long watch goes on through a rotation (docs/SECURITY.md).
  auto security = SecurityFromFlags(/*token_from_env=*/true, absl::Minutes(1));
  if (!security.ok()) return security.status();
  options.tls = security->tls;
  options.auth_token = security->auth_token;
  return CoordinatorClient::Create(address, options);
}

namespace {

// A script's COLOD_COORDINATOR="$COORD" with $COORD unset, no --coordinator
// given: a usage error, not this machine's coordinator (or embedded
// cluster) in place of the cluster meant.
bool EmptyCoordinatorEnv() {
  const char* env = std::getenv("COLOD_COORDINATOR");
  return absl::GetFlag(FLAGS_coordinator).empty() && env != nullptr && *env == '\0';
}

}  // namespace

int WithCoordinator(const std::function<int(CoordinatorClient&)>& fn) {
  if (EmptyCoordinatorEnv()) {
    return Usage("$COLOD_COORDINATOR is set but empty: give HOST:PORT, or unset it to call 127.0.0.1:7070");
  }
  auto client = MakeClient(CoordinatorAddress());
  if (!client.ok()) return Usage(std::string(client.status().message()));
  return fn(**client);
}

absl::StatusOr<std::unique_ptr<LocalCluster>> StartLocalCluster(int workers, const std::string& listen,
                                                                const std::string& data_dir, const std::string& device,
                                                                int* interrupted) {
  LocalCluster::Options options;
  if (interrupted != nullptr) {
    options.cancelled = [interrupted] {
      *interrupted = WaitForShutdownSignalFor(absl::ZeroDuration());
      return *interrupted != 0;
    };
  }
  options.workers = workers;
  options.device = device;
  options.listen = listen;
  options.data_dir = data_dir;
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  const std::string self = n > 0 ? std::string(exe, n) : "coloctl";
  auto coordinator = FindDaemonBinary(self, "colod-coordinator");
  if (!coordinator.ok()) return coordinator.status();
  auto worker = FindDaemonBinary(self, "colod-worker");
  if (!worker.ok()) return worker.status();
  options.coordinator_binary = *coordinator;
  options.worker_binary = *worker;
  return LocalCluster::Start(options);
}

bool StdoutReaderGone() {
  pollfd p{STDOUT_FILENO, 0, 0};  // no event asked for: POLLERR comes regardless
  return ::poll(&p, 1, 0) == 1 && (p.revents & POLLERR) != 0;
}

int RunOnCoordinatorOrEmbeddedCluster(int workers, const std::function<int(const std::string& address)>& fn) {
  const std::string explicit_address = ExplicitCoordinator();
  // The client's flags (--timeout, --watch-timeout, the token and TLS
  // files) are checked before a cluster starts or a model is uploaded: a
  // usage error, exit 2, whatever the command (the client connects lazily).
  if (auto client = MakeClient(explicit_address.empty() ? "127.0.0.1:7070" : explicit_address); !client.ok()) {
    return Usage(std::string(client.status().message()));
  }
  if (!explicit_address.empty()) return fn(explicit_address);
  if (EmptyCoordinatorEnv()) {
    return Usage("$COLOD_COORDINATOR is set but empty: give HOST:PORT, or unset it to run on an embedded cluster of "
                 "this machine");
  }
  if (absl::StatusOr<Security> security = SecurityFromFlags(/*token_from_env=*/true);
      security.ok() && security->tls.enabled()) {
    return Usage(
        "--tls-cert, --tls-key and --tls-ca are for a coordinator you name (--coordinator, or "
        "$COLOD_COORDINATOR): the embedded cluster of this machine runs without TLS");
  }
  // Ctrl-C, SIGTERM or SIGHUP stops the cluster (its daemons, and its
  // temporary directory with their state and logs), then exits 128 + the
  // signal. The signals are blocked before the cluster's threads start, and
  // taken while it starts, then by a thread of their own. A closed stdout
  // pipe does the same (SIGPIPE is ignored, so that it cannot end the
  // process before the cleanup; the thread sees the pipe's end).
  BlockShutdownSignals();
  ::signal(SIGPIPE, SIG_IGN);
  int interrupted = 0;
  auto cluster = StartLocalCluster(workers, "127.0.0.1:0", "", "cpu", &interrupted);
  if (!cluster.ok()) {
    if (interrupted != 0) {
      std::fprintf(stderr, "coloctl: %s: the embedded cluster's start was stopped\n", ::strsignal(interrupted));
      return 128 + interrupted;
    }
    if (absl::IsInvalidArgument(cluster.status())) return Usage(std::string(cluster.status().message()));
    return Fail(cluster.status());
  }
  absl::Notification done;
  std::thread stopper([&] {
    while (!done.HasBeenNotified()) {
      int sig = WaitForShutdownSignalFor(absl::Milliseconds(200));
      if (sig == 0 && StdoutReaderGone()) sig = SIGPIPE;
      if (sig == 0) continue;
      std::fprintf(stderr, "coloctl: %s: stopping the embedded cluster%s\n", ::strsignal(sig),
                   sig == SIGPIPE ? "" : " (again: at once)");
      (*cluster)->StopOnSignal();  // a signal during the stop (a first one after SIGPIPE) hurries it
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(128 + sig);  // the command's own thread may be in a call to the cluster it just lost
    }
  });
  const int code = fn((*cluster)->address());
  done.Notify();
  stopper.join();
  (*cluster)->StopOnSignal();
  return code;
}

absl::StatusOr<v1::Job> WatchToEnd(CoordinatorClient& client, const std::string& job_id, bool json,
                                   const std::function<void(const v1::StepProgress&)>& on_step) {
  auto job = client.GetJob(job_id);
  if (!job.ok()) return job.status();
  const int64_t steps = job->spec().train().steps();
  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  bool bar_open = false;
  std::vector<StepPoint> losses, evals;
  double tokens_per_second = 0;
  bool resume_said = false;  // a rank 0 that resumed said so: its first step need not again
  bool unread_said = false;  // a model's tensors not loaded, said once
  const absl::Status s = client.WatchJob(job_id, 1, absl::GetFlag(FLAGS_watch_timeout), [&](const v1::JobEvent& ev) {
    // Said once it is known, not only with the first step: a run resumed at
    // its last step reports none.
    if (ev.has_rank_status() && ev.rank_status().rank() == 0 && !ev.rank_status().resumed_from().empty()) {
      std::fprintf(stderr, "coloctl: resuming from %s (step %lld)\n", ev.rank_status().resumed_from().c_str(),
                   static_cast<long long>(ev.rank_status().resumed_step()));
      const std::string& message = ev.rank_status().message();
      if (const size_t at = message.find(kPassedOverDamaged); at != std::string::npos) {
        const size_t unread = message.find(absl::StrCat("; ", kUnreadTensors), at);  // said below
        std::fprintf(stderr, "coloctl: %s\n",
                     message.substr(at, unread == std::string::npos ? std::string::npos : unread - at).c_str());
      }
      resume_said = true;
    }
    // Once a watch (a restart loads the same files again).
    if (ev.has_rank_status() && ev.rank_status().rank() == 0 && ev.rank_status().phase() == v1::RANK_PHASE_TRAINING &&
        !unread_said) {
      const std::string& message = ev.rank_status().message();
      if (const size_t at = message.find(kUnreadTensors); at != std::string::npos) {
        std::fprintf(stderr, "coloctl: warning: %s\n", message.substr(at).c_str());
        unread_said = true;
      }
    }
    if (on_step && ev.has_step()) {
      if (resume_said && !ev.step().resumed_from().empty()) {
        v1::StepProgress quiet = ev.step();
        quiet.clear_resumed_from();
        on_step(quiet);
      } else {
        on_step(ev.step());
      }
    }
    if (json) {
      if (!on_step) {
        auto line = RenderJson(ev, /*pretty=*/false);
        if (line.ok()) std::fputs(line->c_str(), stdout);
      }
      std::fflush(stdout);
      return true;
    }
    // A step's evaluation, after its progress line (an eval_only run's
    // report has no step to show).
    const auto print_eval = [&](const v1::StepProgress& p) {
      if (!p.has_eval()) return;
      evals.push_back({p.eval().step(), p.eval().loss()});
      if (on_step) return;
      if (bar_open) std::printf("\n");
      bar_open = false;
      std::printf("eval %s\n", EvalSummary(p.eval()).c_str());
    };
    if (ev.has_step() && ev.step().has_eval() && !ev.step().has_step_duration()) {
      print_eval(ev.step());
      std::fflush(stdout);
      return true;
    }
    if (ev.has_step()) {
      const v1::StepProgress& p = ev.step();
      losses.push_back({p.step(), p.loss()});
      tokens_per_second += p.tokens_per_second();
      if (on_step) return true;
      const int width = 30;
      // The step comes from a worker's report: held to the bar.
      const int filled =
          steps > 0 ? static_cast<int>(width * (static_cast<double>(std::clamp<int64_t>(p.step(), 0, steps)) / steps))
                    : width;
      std::string bar = std::string(filled, '#') + std::string(width - filled, '.');
      const std::string scale = LossScaleSuffix(p);
      std::printf("%s[%s] step %lld/%lld  loss %.4f  tokens/s %.0f%s%s", tty ? "\r" : "", bar.c_str(),
                  static_cast<long long>(p.step()), static_cast<long long>(steps), p.loss(), p.tokens_per_second(),
                  scale.c_str(), tty ? "" : "\n");
      bar_open = tty;
      print_eval(p);
    } else if (ev.has_state_change()) {
      if (bar_open) std::printf("\n");
      bar_open = false;
      std::printf("%s %s%s\n", job_id.c_str(), JobStateLabel(ev.state_change().state()).c_str(),
                  ev.state_change().reason().empty() ? "" : (": " + ev.state_change().reason()).c_str());
    } else if (ev.has_hang()) {
      if (bar_open) std::printf("\n");
      bar_open = false;
      std::printf("%s stalled: %s\n", job_id.c_str(), ev.hang().message().c_str());
    }
    std::fflush(stdout);
    return true;
  });
  if (bar_open) std::printf("\n");
  // Named: a submit's watch may end before its first event (with --output
  // json nothing else printed the id).
  if (!s.ok()) return WithMessage(s, absl::StrCat("watching ", job_id, ": ", s.message()));
  job = client.GetJob(job_id);
  if (!job.ok()) return job.status();
  if (!json && !on_step) {
    const bool evaluated = !evals.empty();
    std::fputs(RenderRunCurves(std::move(losses), tokens_per_second, std::move(evals)).c_str(), stdout);
    if (evaluated && job->has_best_eval()) std::printf("best eval %s\n", EvalSummary(job->best_eval()).c_str());
  }
  return job;
}

int ExitForJob(const v1::Job& job) {
  if (job.state() == v1::JOB_STATE_SUCCEEDED) return 0;
  std::fprintf(stderr, "coloctl: job %s %s: %s\n", job.job_id().c_str(), JobStateLabel(job.state()).c_str(),
               job.reason().c_str());
  return 1;
}

void PrintRunEnd(const std::string& final_dir, const std::string& checkpoint, int64_t steps, int64_t stop_after) {
  if (stop_after > 0 && stop_after < steps) {
    if (checkpoint.empty()) {  // it resumed at or past its stop: trained nothing
      std::printf(
          "stopped at step %lld of %lld (--stop-after), where the run it resumed had stopped: nothing "
          "trained\n",
          static_cast<long long>(stop_after), static_cast<long long>(steps));
      return;
    }
    std::printf(
        "stopped after step %lld of %lld (--stop-after); its checkpoint is %s: --resume %s trains the rest%s%s\n",
        static_cast<long long>(stop_after), static_cast<long long>(steps), checkpoint.c_str(), checkpoint.c_str(),
        final_dir.empty() ? "" : " and writes the model to ", final_dir.c_str());
  } else if (!final_dir.empty()) {
    std::printf("wrote the trained model to %s\n", final_dir.c_str());
  }
}

void PrintStep(const v1::StepProgress& p, int64_t steps, bool json) {
  if (!p.resumed_from().empty()) std::fprintf(stderr, "coloctl: resuming from %s\n", p.resumed_from().c_str());
  const bool trained = !p.has_eval() || p.has_step_duration();  // not an eval_only run's report
  if (json) {
    nlohmann::json line = {{"step", p.step()}};
    if (trained) {
      line.update({{"loss", p.loss()},
                   {"lr", p.learning_rate()},
                   {"grad_norm", p.grad_norm()},
                   {"tokens_per_second", p.tokens_per_second()},
                   {"param_bytes", p.param_bytes()},
                   {"grad_bytes", p.grad_bytes()},
                   {"optimizer_bytes", p.optimizer_bytes()}});
      if (p.has_loss_scale()) {  // fp16 (a skipped step's grad_norm is not finite: null)
        line["loss_scale"] = p.loss_scale();
        line["update_skipped"] = p.update_skipped();
      }
    }
    if (p.has_eval()) {
      line["eval_loss"] = p.eval().loss();
      line["eval_tokens"] = p.eval().tokens();
      if (p.eval().has_perplexity()) line["eval_perplexity"] = p.eval().perplexity();
      if (p.eval().has_accuracy()) line["eval_accuracy"] = p.eval().accuracy();
    }
    if (!p.checkpoint().empty()) line["checkpoint"] = p.checkpoint();
    std::printf("%s\n", JsonText(line).c_str());
  } else {
    if (trained) {
      std::printf("step %lld/%lld  loss %.4f  lr %.3e  grad_norm %.4f  tokens/s %.0f%s\n",
                  static_cast<long long>(p.step()), static_cast<long long>(steps), p.loss(), p.learning_rate(),
                  p.grad_norm(), p.tokens_per_second(), LossScaleSuffix(p).c_str());
    }
    if (p.has_eval()) std::printf("eval %s\n", EvalSummary(p.eval()).c_str());
  }
  std::fflush(stdout);
}

int PrintForwardResult(const v1::ForwardResult& result, bool images, bool labels, const std::string& logits_path,
                       bool json, const std::string& writer) {
  const std::vector<int64_t> s(result.logits_shape().begin(), result.logits_shape().end());
  if (s.size() != (images ? 2u : 3u)) {
    return Fail(absl::InternalError("the forward pass returned no logits shape"));
  }
  if (result.unread_tensor_count() > 0) {
    const std::vector<std::string> names(result.unread_tensors().begin(), result.unread_tensors().end());
    std::fprintf(stderr, "coloctl: warning: %s\n", UnreadTensorsNote(result.unread_tensor_count(), names).c_str());
  }
  if (json) {
    nlohmann::json out = {{"loss", result.loss()}, {"tokens", result.tokens()}, {"shape", s}};
    if (result.tokens() == 0) out["loss"] = nlohmann::json();  // no labels, no loss
    out["logits"] = logits_path.empty() ? nlohmann::json() : nlohmann::json(logits_path);
    if (result.unread_tensor_count() > 0) {
      out["unread_tensors"] = std::vector<std::string>(result.unread_tensors().begin(), result.unread_tensors().end());
      out["unread_tensor_count"] = result.unread_tensor_count();
    }
    if (!logits_path.empty() && !writer.empty()) out["logits_worker"] = writer;
    std::printf("%s\n", JsonText(out).c_str());
    return 0;
  }
  if (!images && labels) {  // a masked language model's
    std::printf("loss %.6f (mean cross-entropy over %lld labelled positions)\n", result.loss(),
                static_cast<long long>(result.tokens()));
  } else if (!images && result.tokens() > 0) {
    std::printf("loss %.6f (mean next-token cross-entropy over %lld tokens)\n", result.loss(),
                static_cast<long long>(result.tokens()));
  } else if (!images) {
    std::printf("no loss (a masked language model: --labels L.npy gives its masked positions' tokens)\n");
  } else if (result.tokens() > 0) {
    std::printf("loss %.6f (mean cross-entropy over %lld labelled images)\n", result.loss(),
                static_cast<long long>(result.tokens()));
  } else {
    std::printf("no loss (no --labels)\n");
  }
  if (!logits_path.empty()) {
    std::printf("logits f32 [%s] written to %s%s\n", absl::StrJoin(s, ", ").c_str(), logits_path.c_str(),
                writer.empty() ? "" : absl::StrCat(" on the machine of worker ", writer, " (rank 0's)").c_str());
  }
  return 0;
}

std::string WrapUsage(const Command& command) {
  const absl::string_view usage = command.usage;
  // The first line's name and operands, where they end before the column.
  const std::string name =
      absl::StrCat("  ", command.name, command.operands != nullptr && command.operands[0] != '\0' ? " " : "",
                   command.operands != nullptr ? command.operands : "");
  constexpr size_t kColumn = 14;  // where the descriptions start
  std::string out, paragraph, head;
  const auto flush = [&] {
    if (paragraph.empty()) return;
    std::string wrapped = WrapText(paragraph, kColumn, kHelpWidth);
    if (!head.empty()) wrapped.replace(0, kColumn, head);
    out += wrapped;
    paragraph.clear();
    head.clear();
  };
  std::vector<absl::string_view> lines = absl::StrSplit(usage, '\n');
  if (!lines.empty() && lines.back().empty()) lines.pop_back();  // after the last '\n'
  for (size_t i = 0; i < lines.size(); ++i) {
    const absl::string_view line = lines[i];
    const bool at_column = line.size() > kColumn && line[kColumn] != ' ' && line[kColumn - 1] == ' ';
    if (at_column && i == 0 && name.size() < kColumn && absl::StartsWith(line, name)) {  // "  name OPERANDS text"
      head = std::string(line.substr(0, kColumn));
      paragraph = std::string(line.substr(kColumn));
    } else if (at_column && line.find_first_not_of(' ') == kColumn) {  // the text, continued
      absl::StrAppend(&paragraph, paragraph.empty() ? "" : " ", line.substr(kColumn));
    } else {  // a table, an example or a name wider than the column: as written
      flush();
      absl::StrAppend(&out, line, "\n");
    }
  }
  flush();
  return out;
}

namespace {

// The command line CommandLineMain was given, for RunInProcess.
std::vector<std::string>& CommandLine() {
  static auto* args = new std::vector<std::string>();
  return *args;
}

std::string HelpText(const std::string& intro, const std::string& epilogue, const std::vector<CommandGroup>& groups) {
  std::string out = intro;
  for (const CommandGroup& group : groups) {
    absl::StrAppend(&out, "\n", group.heading, "\n");
    for (const Command& command : group.commands) out += WrapUsage(command);
  }
  absl::StrAppend(&out, "\n", epilogue);
  return out;
}

const Command* FindCommand(const std::vector<CommandGroup>& groups, const std::string& name) {
  for (const CommandGroup& group : groups) {
    for (const Command& command : group.commands) {
      if (name == command.name) return &command;
    }
  }
  return nullptr;
}

std::set<std::string> FlagNames(const Command& command) {
  return absl::StrSplit(command.flags, ' ', absl::SkipEmpty());
}

// Every flag some command of `groups` reads: the flags that are not global.
std::set<std::string> CommandsFlags(const std::vector<CommandGroup>& groups) {
  std::set<std::string> out;
  for (const CommandGroup& group : groups) {
    for (const Command& c : group.commands) out.merge(FlagNames(c));
  }
  return out;
}

// Checks the flags and operands the command declares, then runs it.
int Dispatch(const std::vector<CommandGroup>& groups, const Command& command, const std::vector<std::string>& args) {
  // A flag some command reads, given to one that does not: refused, not
  // ignored (`status JOB --steps 5` did nothing with --steps). The flags no
  // command lists are everyone's (--coordinator, --timeout, TLS).
  const std::set<std::string> anyones = CommandsFlags(groups), own = FlagNames(command);
  std::vector<std::string> stray;
  for (const std::string& name : GivenFlags()) {
    if (anyones.count(name) > 0 && own.count(name) == 0) stray.push_back("--" + DashedName(name));
  }
  if (!stray.empty()) {
    return Usage(absl::StrCat(command.name, ": ", absl::StrJoin(stray, ", "),
                              stray.size() == 1 ? " is not a flag of " : " are not flags of ", command.name,
                              own.empty() ? ", which takes only the global flags"
                                          : absl::StrCat(" (coloctl ", command.name, " --help lists its flags)")));
  }
  const std::vector<std::string> operands(args.begin() + 1, args.end());
  // Operands name jobs, tensors and workers, which travel as protobuf
  // strings: UTF-8 only.
  for (size_t i = 0; i < operands.size(); ++i) {
    if (!IsValidUtf8(operands[i])) {
      return Usage(absl::StrCat(command.name, ": argument ", i + 1, " is not valid UTF-8"));
    }
  }
  if (command.operands != nullptr) {
    const std::vector<std::string> wanted = absl::StrSplit(command.operands, ' ', absl::SkipEmpty());
    if (operands.size() < wanted.size()) {
      return Usage(absl::StrCat(command.name, ": missing ", wanted[operands.size()]));
    }
    if (operands.size() > wanted.size()) {
      return Usage(absl::StrCat("unexpected argument '", operands[wanted.size()], "'"));
    }
  }
  return command.run(operands);
}

}  // namespace

std::set<std::string> GivenFlags() {
  std::set<std::string> out;
  for (const FlagArg& f : ScanFlags(CommandLine())) {
    if (f.flag != nullptr) out.insert(std::string(f.flag->Name()));
  }
  return out;
}

std::string FlagsOf(const std::set<std::string>& given, absl::string_view file, const std::set<std::string>& kept) {
  std::vector<std::string> out;
  for (const std::string& name : given) {
    const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
    if (flag == nullptr || kept.count(name) > 0 || !absl::EndsWith(flag->Filename(), file)) continue;
    out.push_back("--" + DashedName(name));
  }
  return absl::StrJoin(out, ", ");
}

int RunInProcess() {
  const std::vector<std::string>& line = CommandLine();
  auto binary = FindBinary(kRunBinary, {});
  if (!binary.ok()) {
    return Fail(absl::FailedPreconditionError(absl::StrCat(
        "this command runs the model in this process, which is ", kRunBinary, "'s work, and ", kRunBinary,
        " is not installed beside coloctl or on $PATH (", binary.status().message(), ")")));
  }
  // coloctl's flags that it does not define (--watch, --kind: every
  // command takes coloctl's flags) are let through, as coloctl lets them
  // through to any command, with those of the user's own --undefok (Abseil
  // keeps one --undefok, the last).
  std::vector<std::string> names;
  for (const auto& [name, flag] : absl::GetAllFlags()) names.emplace_back(name);
  // "--flag VALUE" becomes "--flag=VALUE": for a flag coloctl-run does not
  // define, Abseil there cannot know that it takes a value.
  std::vector<std::string> args(line.begin() + 1, line.end());
  const std::vector<FlagArg> flags = ScanFlags(line);
  for (auto f = flags.rbegin(); f != flags.rend(); ++f) {
    if (f->flag != nullptr && f->flag->Name() == "undefok" && f->value.has_value()) {
      for (absl::string_view n : absl::StrSplit(*f->value, ',', absl::SkipEmpty())) names.emplace_back(n);
      args.erase(args.begin() + static_cast<std::ptrdiff_t>(f->index - 1),
                 args.begin() + static_cast<std::ptrdiff_t>(f->index + (f->value_next ? 1 : 0)));
      continue;
    }
    if (!f->value_next) continue;
    args[f->index - 1] += "=" + *f->value;
    args.erase(args.begin() + static_cast<std::ptrdiff_t>(f->index));
  }
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  const std::string undefok = absl::StrCat("--undefok=", absl::StrJoin(names, ","));
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(kRunBinary));
  argv.push_back(const_cast<char*>(undefok.c_str()));
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  execv(binary->c_str(), argv.data());
  return Fail(absl::InternalError(absl::StrCat("cannot run ", *binary, ": ", std::strerror(errno))));
}

int CommandLineMain(int argc, char** argv, const std::string& intro, const std::string& epilogue,
                    const std::vector<CommandGroup>& groups) {
  // A --flagfile's or --fromenv's flags in its place, for every check below
  // as for the parse (and handed to coloctl-run as they are, not read again
  // there).
  absl::StatusOr<std::vector<std::string>> expanded = ExpandFlagSources(std::vector<std::string>(argv, argv + argc));
  if (!expanded.ok()) return Usage(std::string(expanded.status().message()));
  CommandLine() = *std::move(expanded);
  const std::vector<std::string> all = CommandLine();
  std::vector<char*> all_argv;
  for (const std::string& a : all) all_argv.push_back(const_cast<char*>(a.c_str()));
  all_argv.push_back(nullptr);
  RaiseOpenFileLimit();  // coloctl consolidate and local open a file or a socket per rank
  const std::string help = HelpText(intro, epilogue, groups);
  const std::vector<FlagArg> flags = ScanFlags(all);
  // An empty --coordinator (a script's "$COORD" unset) names no
  // coordinator: refused, never taken as unset (which trains on an
  // embedded cluster of this machine, or calls 127.0.0.1:7070). (An empty
  // $COLOD_COORDINATOR is refused where it would start an embedded
  // cluster: RunOnCoordinatorOrEmbeddedCluster.)
  for (const FlagArg& f : flags) {
    if (f.name == "coordinator" && f.value.has_value() && f.value->empty()) {
      return Usage(
          "--coordinator is empty: give HOST:PORT, or leave the flag out (then $COLOD_COORDINATOR, else "
          "127.0.0.1:7070; train and forward run on an embedded cluster)");
    }
  }
  // `COMMAND --help` and `help COMMAND`: that command's part of the help.
  std::vector<bool> taken(all.size(), false);
  bool asked = false;
  for (const FlagArg& f : flags) {
    taken[f.index] = true;
    if (f.value_next && f.index + 1 < taken.size()) taken[f.index + 1] = true;
    asked = asked || f.name == "help" || f.name == "h" || f.name == "helpfull";
  }
  const size_t end = flags.empty() ? 1 : flags.back().index + 1 + (flags.back().value_next ? 1 : 0);
  std::vector<std::string> positional;
  for (size_t i = 1; i < all.size(); ++i) {
    if (all[i] == "--" && i >= end) {  // the end of the flags: the rest is operands
      positional.insert(positional.end(), all.begin() + i + 1, all.end());
      break;
    }
    if (!taken[i]) positional.push_back(all[i]);
  }
  const bool help_command = !positional.empty() && positional[0] == "help";
  if (asked || help_command) {
    const size_t at = help_command ? 1 : 0;
    if (positional.size() > at) {
      const Command* command = FindCommand(groups, positional[at]);
      if (command == nullptr) return Usage(absl::StrCat("help: unknown command '", positional[at], "'"));
      const std::string program = all[0].substr(all[0].rfind('/') + 1);
      // Its flags: those it reads (the ones it accepts), and the global ones
      // its usage names (train's --coordinator); the other global ones
      // (--timeout, --output, TLS) are --help's.
      const std::string usage = WrapUsage(*command);
      const std::set<std::string> own = FlagNames(*command), anyones = CommandsFlags(groups);
      const auto applies = [&](const absl::CommandLineFlag& flag) {
        const std::string name(flag.Name());
        if (own.count(name) > 0) return true;
        if (anyones.count(name) > 0) return false;
        const std::string named = "--" + DashedName(name);
        for (size_t at = usage.find(named); at != std::string::npos; at = usage.find(named, at + 1)) {
          const size_t end = at + named.size();
          if (end == usage.size() || !(absl::ascii_isalnum(usage[end]) || usage[end] == '-')) return true;
        }
        return false;
      };
      PrintHelp(absl::StrCat("Usage: ", program, " [flags] ", command->name, "\n\n", usage, "\n",
                             "The global flags (--coordinator, --timeout, --output, --auth-token-file, --tls-*)\n"
                             "and every command and exit status: ", program, " --help."),
                applies);
      return 0;
    }
    if (help_command) {  // `help` alone: the whole help, as --help
      PrintHelp(help);
      return 0;
    }
  }
  const std::vector<std::string> args = ParseFlags(static_cast<int>(all.size()), all_argv.data(), help);
  if (args.empty()) return Usage("missing COMMAND");
  const std::string output = absl::GetFlag(FLAGS_output);
  if (output != "table" && output != "json") {
    return Usage(absl::StrCat("--output: '", output, "' is not one of table, json"));
  }
  const Command* command = FindCommand(groups, args[0]);
  if (command == nullptr) return Usage(absl::StrCat("unknown command '", args[0], "'"));
  try {
    return Dispatch(groups, *command, args);
  } catch (const std::exception& e) {
    // A backstop: commands return statuses, but a library may throw; an error
    // line and status 1 rather than an abort and a core.
    return Fail(absl::InternalError(absl::StrCat(args[0], " threw: ", e.what())));
  }
}

}  // namespace colod::cli
