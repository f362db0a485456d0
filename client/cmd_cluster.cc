// Commands that talk to a coordinator about its workers and jobs: workers,
// submit, jobs, status, checkpoints, watch, cancel, delete, mesh.
#include <cstdio>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/cli.h"
#include "client/commands.h"
#include "client/format.h"
#include "client/job_file.h"
#include "client/job_flags.h"
#include "colod/v1/coordinator.pb.h"
#include "common/json.h"
#include "nlohmann/json.hpp"
#include "spec/job_validation.h"
#include "spec/plan.h"

ABSL_FLAG(bool, all, false, "workers: also list workers whose lease expired (lost).");
ABSL_FLAG(std::string, job_file, "",
          "submit: a colod.v1.JobSpec as JSON, or YAML (.yaml/.yml), instead of --model and the train flags.");
ABSL_FLAG(std::string, request_id, "",
          "submit: idempotency key; a retried submit with it returns the first job (another spec "
          "under it is refused, ALREADY_EXISTS).");
ABSL_FLAG(bool, watch, false, "submit: follow the job to its end, as `coloctl watch`.");
ABSL_FLAG(std::string, state, "", "jobs: only jobs in these states, comma-separated (pending,running,...).");
ABSL_FLAG(std::string, reason, "", "cancel: why (recorded on the job).");
ABSL_FLAG(std::string, kind, "train", "submit: train (a model and data) or tensor (a mesh hosting ColoTensors).");

namespace colod::cli {
namespace {

int RunWorkers(const std::vector<std::string>&) {
  return WithCoordinator([](CoordinatorClient& client) {
    auto workers = client.ListWorkers(absl::GetFlag(FLAGS_all));
    if (!workers.ok()) return Fail(workers.status());
    if (JsonOutput()) {
      v1::ListWorkersResponse resp;
      for (const auto& w : *workers) *resp.add_workers() = w;
      return PrintJson(resp);
    }
    std::fputs(RenderWorkersTable(*workers, absl::Now()).c_str(), stdout);
    return 0;
  });
}

int SubmitWith(CoordinatorClient& client, bool json) {
  const std::string kind = absl::GetFlag(FLAGS_kind);
  if (kind != "train" && kind != "tensor") return Usage(absl::StrCat("--kind: '", kind, "' is not one of train, tensor"));
  // A flag this submit would not read is refused, not ignored (a flag
  // submit never reads is refused before this, Command::flags).
  const std::set<std::string> given = GivenFlags();
  if (given.count("watch_timeout") > 0 && !absl::GetFlag(FLAGS_watch)) {
    return Usage("submit: --watch-timeout bounds the watch of --watch; without --watch nothing is watched");
  }
  if (kind == "tensor") {
    // The layout `tensor` takes (a pipeline is a TRAIN job's), and a name.
    std::string ignored = FlagsOf(given, "client/job_flags.cc", {"tp", "dp", "mode", "depth", "name"});
    if (given.count("job_file") > 0) ignored = absl::StrCat(ignored, ignored.empty() ? "" : ", ", "--job-file");
    if (absl::GetFlag(FLAGS_watch)) ignored = absl::StrCat(ignored, ignored.empty() ? "" : ", ", "--watch");
    if (!ignored.empty()) {
      return Usage(absl::StrCat("submit --kind tensor: ", ignored, " do not apply: a TENSOR job hosts ColoTensors ",
                                "(coloctl tensor ...) on its layout (--tp, --dp, --mode, --depth) under --name"));
    }
    auto job = SubmitTensorJob(client, absl::GetFlag(FLAGS_name), absl::GetFlag(FLAGS_request_id));
    if (!job.ok()) {
      if (absl::IsInvalidArgument(job.status())) return Usage(absl::StrCat("submit: ", job.status().message()));
      return Fail(job.status());
    }
    if (json) return PrintJson(*job);
    std::printf("%s\n", job->job_id().c_str());
    return 0;
  }
  if (!absl::GetFlag(FLAGS_job_file).empty()) {
    if (const std::string ignored = FlagsOf(given, "client/job_flags.cc", {}); !ignored.empty()) {
      return Usage(absl::StrCat("submit --job-file: ", ignored,
                                " do not apply: the job file is the whole spec (edit it, or leave --job-file out)"));
    }
  }
  absl::StatusOr<v1::JobSpec> spec = absl::GetFlag(FLAGS_job_file).empty()
                                         ? TrainJobSpecFromFlags()
                                         : ReadJobFile(absl::GetFlag(FLAGS_job_file));
  if (!spec.ok()) {
    if (absl::IsInvalidArgument(spec.status())) return Usage(absl::StrCat("submit: ", spec.status().message()));
    return Fail(spec.status());
  }
  // What the coordinator would refuse is a usage error here, before a call
  // is made, as for the flags (TrainJobSpecFromFlags validates its own).
  if (absl::Status valid = ValidateJobSpec(*spec); !valid.ok()) {
    return Usage(absl::StrCat("submit --job-file ", absl::GetFlag(FLAGS_job_file), ": ", valid.message()));
  }
  if (absl::GetFlag(FLAGS_job_file).empty()) {
    if (absl::Status s = UploadModelIfAsked(client, *spec, json); !s.ok()) return Fail(s);
  }
  auto job = client.SubmitJob(*spec, absl::GetFlag(FLAGS_request_id));
  if (!job.ok()) return Fail(job.status());
  if (!absl::GetFlag(FLAGS_watch)) {
    if (json) return PrintJson(*job);
    std::printf("%s\n", job->job_id().c_str());
    return 0;
  }
  if (!json) std::printf("submitted %s (%s)\n", job->job_id().c_str(), LayoutName(job->spec().shard()).c_str());
  auto ended = WatchToEnd(client, job->job_id(), json, nullptr);
  if (!ended.ok()) return Fail(ended.status());
  return ExitForJob(*ended);
}

int RunSubmit(const std::vector<std::string>&) {
  return WithCoordinator([](CoordinatorClient& client) { return SubmitWith(client, JsonOutput()); });
}

absl::StatusOr<std::vector<v1::JobState>> StatesFromFlag() {
  std::vector<v1::JobState> states;
  for (absl::string_view name : absl::StrSplit(absl::GetFlag(FLAGS_state), ',', absl::SkipEmpty())) {
    v1::JobState s;
    if (!v1::JobState_Parse(absl::StrCat("JOB_STATE_", absl::AsciiStrToUpper(name)), &s) ||
        s == v1::JOB_STATE_UNSPECIFIED) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--state: '", name, "' is not one of pending, scheduled, running, restarting, succeeded, failed, cancelled"));
    }
    states.push_back(s);
  }
  return states;
}

int RunJobs(const std::vector<std::string>&) {
  return WithCoordinator([](CoordinatorClient& client) {
    auto states = StatesFromFlag();
    if (!states.ok()) return Usage(std::string(states.status().message()));
    auto jobs = client.ListJobs(*states);
    if (!jobs.ok()) return Fail(jobs.status());
    if (JsonOutput()) {
      v1::ListJobsResponse resp;
      for (const auto& j : *jobs) *resp.add_jobs() = j;
      return PrintJson(resp);
    }
    std::fputs(RenderJobsTable(*jobs, absl::Now()).c_str(), stdout);
    return 0;
  });
}

int RunStatus(const std::vector<std::string>& operands) {
  return WithCoordinator([&](CoordinatorClient& client) {
    auto job = client.GetJob(operands[0]);
    if (!job.ok()) return Fail(job.status());
    if (JsonOutput()) return PrintJson(*job);
    std::fputs(RenderJob(*job, absl::Now()).c_str(), stdout);
    return 0;
  });
}

int RunCheckpoints(const std::vector<std::string>& operands) {
  return WithCoordinator([&](CoordinatorClient& client) {
    auto job = client.GetJob(operands[0]);
    if (!job.ok()) return Fail(job.status());
    if (JsonOutput()) {
      absl::StatusOr<std::string> out = RenderCheckpointsJson(*job, /*pretty=*/true);
      if (!out.ok()) return Fail(out.status());
      std::fputs(out->c_str(), stdout);
      return 0;
    }
    if (job->checkpoints_size() == 0) {
      std::printf("%s has reported no checkpoint%s\n", job->job_id().c_str(),
                  job->spec().train().checkpoint_dir().empty() ? " (it has no --save directory)" : " yet");
      return 0;
    }
    std::fputs(RenderCheckpoints(*job).c_str(), stdout);
    return 0;
  });
}

int RunWatch(const std::vector<std::string>& operands) {
  return WithCoordinator([&](CoordinatorClient& client) {
    auto ended = WatchToEnd(client, operands[0], JsonOutput(), nullptr);
    if (!ended.ok()) return Fail(ended.status());
    return ExitForJob(*ended);
  });
}

int RunCancel(const std::vector<std::string>& operands) {
  return WithCoordinator([&](CoordinatorClient& client) {
    auto job = client.CancelJob(operands[0], absl::GetFlag(FLAGS_reason));
    if (!job.ok()) return Fail(job.status());
    if (JsonOutput()) return PrintJson(*job);
    std::printf("%s %s: %s\n", job->job_id().c_str(), JobStateLabel(job->state()).c_str(), job->reason().c_str());
    return 0;
  });
}

int RunDelete(const std::vector<std::string>& operands) {
  return WithCoordinator([&](CoordinatorClient& client) {
    if (absl::Status s = client.DeleteJob(operands[0]); !s.ok()) return Fail(s);
    if (JsonOutput()) {
      std::printf("%s\n", JsonText({{"job_id", operands[0]}, {"deleted", true}}).c_str());
      return 0;
    }
    std::printf("%s deleted\n", operands[0].c_str());
    return 0;
  });
}

int RunMesh(const std::vector<std::string>& operands) {
  return WithCoordinator([&](CoordinatorClient& client) {
    auto got = client.GetMesh(operands[0]);
    if (!got.ok()) return Fail(got.status());
    if (got->state() != v1::JOB_STATE_SCHEDULED && got->state() != v1::JOB_STATE_RUNNING) {
      std::fprintf(stderr,
                   "coloctl: %s (%s): the mesh of its last attempt (generation %lld), whose workers may run "
                   "other jobs now\n",
                   operands[0].c_str(), JobStateLabel(got->state()).c_str(), static_cast<long long>(got->generation()));
    }
    if (JsonOutput()) return PrintJson(got->mesh());
    std::printf("mesh of %s: ", operands[0].c_str());
    std::fputs(RenderMesh(got->mesh()).c_str(), stdout);
    return 0;
  });
}

constexpr Command kCommands[] = {
    {"workers", "", "all",
     "  workers     List the workers registered with the coordinator: id, address, host,\n"
     "              device, state, heartbeat age and colod version. --all includes lost\n"
     "              workers; --output json prints the ListWorkersResponse as proto3 JSON.\n",
     RunWorkers},
    {"submit", "", COLOD_TRAIN_JOB_FLAGS "kind request_id watch job_file",
     "  submit      Submit a TRAIN job: --model DIR --data FILE and the train flags above;\n"
     "              the model's files are streamed to the coordinator and the workers\n"
     "              download them (--upload=false: the workers read DIR themselves). --data\n"
     "              and other paths must be readable by the workers; relative ones are made\n"
     "              absolute. Or --job-file FILE: a colod.v1.JobSpec as JSON, or YAML for\n"
     "              .yaml/.yml, sent as it is. Prints the job id; --watch follows it.\n"
     "              A job whose rank fails or whose worker is lost restarts by itself (up to\n"
     "              --max-restarts, default 3; 0 never) from its newest checkpoint (--save\n"
     "              DIR --save-every K), waiting up to --restart-wait (5m) for workers.\n",
     RunSubmit},
    {"jobs", "", "state",
     "  jobs        List jobs: id, name, kind, state, layout, step, loss, updated, reason.\n"
     "              --state running,... only those.\n",
     RunJobs},
    {"status", "JOB", "", "  status JOB  One job in detail (--output json: the Job).\n", RunStatus},
    {"checkpoints", "JOB", "",
     "  checkpoints JOB\n"
     "              The training checkpoints a job keeps (after --keep-last/--keep-best), oldest\n"
     "              first: step, held-out loss, size, path; the best and the latest (where a\n"
     "              restart resumes) marked. --output json: {\"checkpoints\": [...]}.\n",
     RunCheckpoints},
    {"watch", "JOB", "watch_timeout",
     "  watch JOB   Follow a job to its end: state changes and a progress bar with step,\n"
     "              loss and tokens/s, then the loss curve; --output json prints every event\n"
     "              as one JSON line. Exits 0 when the job succeeded, 1 otherwise (it\n"
     "              failed, was cancelled, or did not end within --watch-timeout), 69 when\n"
     "              the coordinator stays unreachable.\n",
     RunWatch},
    {"cancel", "JOB", "reason",
     "  cancel JOB  Cancel a job [--reason TEXT]; its ranks are aborted and the workers freed.\n", RunCancel},
    {"delete", "JOB", "",
     "  delete JOB  Forget a job that ended: its record, events and request id (the coordinator's\n"
     "              --job-retention does this by itself after a while). Cancel a running job first.\n"
     "              --output json: {\"job_id\": JOB, \"deleted\": true}.\n",
     RunDelete},
    {"mesh", "JOB", "",
     "  mesh JOB    The job's rank grid (a row per dp replica, a column per tp rank, each\n"
     "              cell the rank's worker) and every process group per axis.\n",
     RunMesh},
};

}  // namespace

CommandGroup ClusterCommands() {
  return {"Cluster commands (talk to --coordinator, or $COLOD_COORDINATOR, or 127.0.0.1:7070;\n"
          "every call has the --timeout deadline, but a watch's --watch-timeout and a submit's\n"
          "upload's --upload-timeout):",
          kCommands};
}

}  // namespace colod::cli
