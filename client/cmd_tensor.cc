// `coloctl tensor ...`: the ColoTensors of a TENSOR job, through the
// coordinator's TensorService.
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "client/cli.h"
#include "client/commands.h"
#include "client/format.h"
#include "client/job_flags.h"
#include "common/atomic_file.h"
#include "common/grpc_server.h"
#include "common/int_math.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(std::string, spec, "R",
          "tensor create/reshard: placements AXIS=R|S(DIM)|S(D1,D2|N1,N2)|P joined by ';', e.g. 'tp=S(-1)'.");
ABSL_FLAG(std::string, shape, "", "tensor create: the global shape, e.g. 2,3,2 (values N(0,1) from --seed).");
ABSL_FLAG(int32_t, rank, -1, "tensor get: only this rank's shard (default: the gathered global value).");

namespace colod::cli {
namespace {

// Nested brackets of a small tensor's values ("[[0.1, 0.2], ...]").
std::string FormatValues(const v1::TensorValue& value) {
  auto floats = TensorValueFloats(value);
  if (!floats.ok()) return std::string(floats.status().message());
  const std::vector<float>& v = *floats;
  const std::vector<int64_t> shape(value.shape().begin(), value.shape().end());
  if (v.size() > 4096) return absl::StrCat("(", v.size(), " values; use --out FILE.npy)");
  if (v.empty()) return "[]";  // a size-0 dimension: nothing to nest (and no stride to divide by)
  std::function<std::string(size_t, size_t, size_t)> rec = [&](size_t d, size_t offset,
                                                                 size_t stride) -> std::string {
    if (d == shape.size()) return absl::StrFormat("%.4f", v[offset]);
    const size_t inner = stride / static_cast<size_t>(shape[d]);
    std::vector<std::string> parts;
    for (int64_t i = 0; i < shape[d]; ++i) parts.push_back(rec(d + 1, offset + i * inner, inner));
    return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
  };
  return rec(0, 0, v.size());
}

absl::StatusOr<std::vector<int64_t>> ParseShape(const std::string& text) {
  std::vector<int64_t> shape;
  for (absl::string_view d : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int64_t v;
    if (!absl::SimpleAtoi(d, &v) || v < 1) {
      return absl::InvalidArgumentError(absl::StrCat("--shape: '", text, "' is not sizes like 2,3,2"));
    }
    shape.push_back(v);
  }
  if (shape.empty()) return absl::InvalidArgumentError("--shape is required, e.g. --shape 2,3,2");
  if (!CheckedBytes(shape, sizeof(float)).has_value()) {
    return absl::InvalidArgumentError(absl::StrCat("--shape: ", text, " floats take more than 2^63 bytes"));
  }
  return shape;
}

// Waits until `job_id` runs (TENSOR jobs run until cancelled).
absl::Status WaitRunning(CoordinatorClient& client, const std::string& job_id, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    auto job = client.GetJob(job_id);
    if (!job.ok()) return job.status();
    if (job->state() == v1::JOB_STATE_RUNNING) return absl::OkStatus();
    if (job->state() == v1::JOB_STATE_SUCCEEDED || job->state() == v1::JOB_STATE_FAILED ||
        job->state() == v1::JOB_STATE_CANCELLED) {
      return absl::FailedPreconditionError(
          absl::StrCat("job ", job_id, " ", JobStateLabel(job->state()), ": ", job->reason()));
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat("job ", job_id, " is still ", JobStateLabel(job->state()), ": ", job->reason()));
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
}

// The ColoTensor document's example over gRPC: a TENSOR job on tp x dp
// workers; a random [2, 3, 2] tensor sharded on its last dim over tp, made
// replicated, then resharded on dim 0; every rank's shape at each stage.
int TensorDemo(CoordinatorClient& c, bool json) {
  // A TENSOR job runs (and holds its workers) until cancelled: Ctrl-C,
  // SIGTERM or SIGHUP cancels it before coloctl exits 128 + the signal. The
  // signals are blocked from before the client exists (RunTensor), and taken
  // by a thread of their own once the job does.
  auto job = SubmitTensorJob(c, "colotensor-example");
  if (!job.ok()) return Fail(job.status());
  const std::string id = job->job_id();
  absl::Notification done;
  std::thread canceller([&] {
    while (!done.HasBeenNotified()) {
      const int sig = WaitForShutdownSignalFor(absl::Milliseconds(200));
      if (sig == 0) continue;
      std::fprintf(stderr, "coloctl: %s: cancelling %s\n", ::strsignal(sig), id.c_str());
      const absl::Status s = c.CancelJob(id, absl::StrCat("tensor demo interrupted (", ::strsignal(sig), ")")).status();
      if (!s.ok()) std::fprintf(stderr, "coloctl: could not cancel %s: %s\n", id.c_str(), s.ToString().c_str());
      std::fflush(stdout);
      std::fflush(stderr);
      std::_Exit(128 + sig);  // the demo's own calls may still be waiting on the job
    }
  });
  absl::Cleanup join = [&] {
    done.Notify();
    canceller.join();
  };
  auto run = [&]() -> absl::Status {
    RETURN_IF_ERROR(WaitRunning(c, id, absl::GetFlag(FLAGS_timeout) * 6));
    auto got = c.GetMesh(id);
    if (!got.ok()) return got.status();
    const v1::MeshSpec* mesh = &got->mesh();
    nlohmann::json stages = nlohmann::json::array();
    auto show = [&](const std::string& what, const v1::TensorLayout& layout) -> absl::Status {
      nlohmann::json ranks = nlohmann::json::array();
      if (!json) std::printf("%s\n", what.c_str());
      for (const v1::ShardLayout& s : layout.shards()) {
        auto shard = c.GetShard(id, layout.name(), s.rank());
        if (!shard.ok()) return shard.status();
        std::vector<int64_t> shape(shard->value().shape().begin(), shard->value().shape().end());
        ranks.push_back({{"rank", s.rank()}, {"shape", shape}});
        if (!json) {
          std::printf("  rank %d: shape [%s] %s\n", s.rank(), absl::StrJoin(shape, ", ").c_str(),
                      FormatValues(shard->value()).c_str());
        }
      }
      stages.push_back({{"stage", what}, {"spec", DistSpecText(layout.dist_spec())}, {"ranks", ranks}});
      return absl::OkStatus();
    };
    v1::CreateTensorRequest create;
    create.set_job_id(id);
    create.set_name("t1");
    create.mutable_random()->set_seed(absl::GetFlag(FLAGS_seed));
    for (int64_t d : {2, 3, 2}) create.mutable_random()->add_shape(d);
    create.mutable_random()->set_dtype(v1::DTYPE_F32);
    create.mutable_random()->set_distribution(v1::RandomInit::DISTRIBUTION_NORMAL);
    create.set_compute_pattern(v1::COMPUTE_PATTERN_TP1D);
    auto spec = ParseDistSpecText("tp=S(-1)", *mesh);
    if (!spec.ok()) return spec.status();
    *create.mutable_dist_spec() = *spec;
    auto layout = c.CreateTensor(create);
    if (!layout.ok()) return layout.status();
    RETURN_IF_ERROR(show("t1 = ColoTensor(randn(2, 3, 2), ShardSpec(dims=[-1], num_partitions=[tp]))", *layout));
    layout = c.SetDistSpec(id, "t1", v1::DistSpec());
    if (!layout.ok()) return layout.status();
    RETURN_IF_ERROR(show("t1 = t1.to_replicate()", *layout));
    spec = ParseDistSpecText("tp=S(0)", *mesh);
    if (!spec.ok()) return spec.status();
    layout = c.SetDistSpec(id, "t1", *spec);
    if (!layout.ok()) return layout.status();
    RETURN_IF_ERROR(show("t1.set_dist_spec(ShardSpec([0], [tp]))", *layout));
    if (json) std::printf("%s\n", JsonText({{"job_id", id}, {"stages", stages}}).c_str());
    return absl::OkStatus();
  };
  const absl::Status s = run();
  std::move(join).Invoke();  // no signal's cancel from here on: this one follows
  auto cancelled = c.CancelJob(id, "tensor demo finished");  // a TENSOR job runs until cancelled
  if (!s.ok()) return Fail(s);
  if (!cancelled.ok()) return Fail(cancelled.status());
  return 0;
}

// `operands`: SUBCOMMAND [JOB [NAME]].
int TensorWith(CoordinatorClient& c, const std::vector<std::string>& operands, bool json) {
  if (operands.empty()) return Usage("tensor: missing SUBCOMMAND (demo, create, reshard, list, get, delete)");
  const std::string& sub = operands[0];
  auto need = [&](size_t n, const char* what) {
    return operands.size() == n ? 0 : Usage(absl::StrCat("tensor ", sub, ": expected ", what));
  };
  // Each subcommand's own flags of the command's (`tensor create J x --tp 4`
  // would otherwise run without a word about --tp).
  static const std::map<std::string, std::set<std::string>> kOwn = {{"demo", {"tp", "dp", "mode", "depth", "seed"}},
                                                                    {"create", {"shape", "spec", "seed"}},
                                                                    {"reshard", {"spec"}},
                                                                    {"get", {"rank", "out"}},
                                                                    {"list", {}},
                                                                    {"delete", {}}};
  const auto own = kOwn.find(sub);
  if (own == kOwn.end()) return Usage(absl::StrCat("tensor: unknown subcommand '", sub, "'"));
  std::vector<std::string> foreign;
  const std::set<std::string> given = GivenFlags();
  for (const char* flag : {"tp", "dp", "mode", "depth", "shape", "rank", "out", "spec", "seed"}) {
    if (given.count(flag) && !own->second.count(flag)) foreign.push_back(absl::StrCat("--", flag));
  }
  if (!foreign.empty()) {
    return Usage(absl::StrCat("tensor ", sub, ": ", absl::StrJoin(foreign, ", "), " do",
                              foreign.size() == 1 ? "es" : "",
                              " not apply to it (coloctl tensor --help says which flags each subcommand takes)"));
  }
  if (sub == "get" && absl::GetFlag(FLAGS_rank) < -1) {
    return Usage(absl::StrCat("tensor get: --rank ", absl::GetFlag(FLAGS_rank),
                              " is not a rank (leave it out for "
                              "the gathered value)"));
  }
  if (sub == "demo") {
    if (int u = need(1, "no arguments")) return u;
    return TensorDemo(c, json);
  }
  if (int u = need(sub == "list" ? 2 : 3, sub == "list" ? "JOB" : "JOB NAME")) return u;
  std::vector<int64_t> shape;  // create's, checked before any call
  if (sub == "create") {
    absl::StatusOr<std::vector<int64_t>> parsed = ParseShape(absl::GetFlag(FLAGS_shape));
    if (!parsed.ok()) return Usage(std::string(parsed.status().message()));
    shape = *std::move(parsed);
  }
  // A TENSOR job just submitted waits for its workers (`J=$(coloctl submit
  // --kind tensor)` then `coloctl tensor create $J ...`): up to --timeout
  // for it to run.
  if (const absl::Status running = WaitRunning(c, operands[1], absl::GetFlag(FLAGS_timeout)); !running.ok()) {
    return Fail(running);
  }
  if (sub == "list") {
    auto list = c.ListTensors(operands[1]);
    if (!list.ok()) return Fail(list.status());
    if (json) {
      v1::ListTensorsResponse resp;
      for (const auto& l : *list) *resp.add_tensors() = l;
      return PrintJson(resp);
    }
    for (const auto& l : *list) std::fputs(RenderTensorLayout(l).c_str(), stdout);
    return 0;
  }
  if (sub == "delete") {
    const absl::Status s = c.DeleteTensor(operands[1], operands[2]);
    if (!s.ok()) return Fail(s);
    // As `coloctl delete` answers (a script's JSON parser gets an object).
    if (json) {
      std::printf("%s\n", JsonText({{"job_id", operands[1]}, {"name", operands[2]}, {"deleted", true}}).c_str());
    } else {
      std::printf("tensor %s deleted\n", operands[2].c_str());
    }
    return 0;
  }
  if (sub == "get") {
    absl::StatusOr<v1::TensorValue> value;
    if (absl::GetFlag(FLAGS_rank) >= 0) {
      auto shard = c.GetShard(operands[1], operands[2], absl::GetFlag(FLAGS_rank));
      if (!shard.ok()) return Fail(shard.status());
      value = shard->value();
    } else {
      value = c.GetGlobal(operands[1], operands[2]);
    }
    if (!value.ok()) return Fail(value.status());
    if (!absl::GetFlag(FLAGS_out).empty()) {
      auto npy = TensorValueNpy(*value);
      if (!npy.ok()) return Fail(npy.status());
      const absl::Status s = WriteOutputFile(absl::GetFlag(FLAGS_out), *npy);
      return s.ok() ? 0 : Fail(s);
    }
    if (json) return PrintJson(*value);
    std::printf("[%s] %s\n", absl::StrJoin(value->shape(), ", ").c_str(), FormatValues(*value).c_str());
    return 0;
  }
  auto mesh = c.GetMesh(operands[1]);
  if (!mesh.ok()) return Fail(mesh.status());
  auto spec = ParseDistSpecText(absl::GetFlag(FLAGS_spec), mesh->mesh());
  if (!spec.ok()) return Usage(absl::StrCat("--spec: ", spec.status().message()));
  absl::StatusOr<v1::TensorLayout> layout;
  if (sub == "reshard") {
    layout = c.SetDistSpec(operands[1], operands[2], *spec);
  } else {
    v1::CreateTensorRequest req;
    req.set_job_id(operands[1]);
    req.set_name(operands[2]);
    req.mutable_random()->set_seed(absl::GetFlag(FLAGS_seed));
    for (int64_t d : shape) req.mutable_random()->add_shape(d);
    req.mutable_random()->set_dtype(v1::DTYPE_F32);
    *req.mutable_dist_spec() = *spec;
    layout = c.CreateTensor(req);
  }
  if (!layout.ok()) return Fail(layout.status());
  if (json) return PrintJson(*layout);
  std::fputs(RenderTensorLayout(*layout).c_str(), stdout);
  return 0;
}

int RunTensor(const std::vector<std::string>& operands) {
  // The demo's signals are blocked before the client's threads start, so
  // that none of them takes one (and ends the process without the cancel).
  if (!operands.empty() && operands[0] == "demo") BlockShutdownSignals();
  return WithCoordinator([&](CoordinatorClient& c) { return TensorWith(c, operands, JsonOutput()); });
}

constexpr Command kCommands[] = {
    {"tensor", nullptr, "tp dp mode depth shape rank out spec seed",
     "  tensor ...  ColoTensors of a TENSOR job (coloctl submit --kind tensor --tp T --dp D):\n"
     "                tensor demo                the ColoTensor document's example: a [2,3,2]\n"
     "                                           tensor sharded on its last dim over tp, made\n"
     "                                           replicated, resharded on dim 0; each rank's shape\n"
     "                                           (its own TENSOR job, cancelled at the end or on\n"
     "                                           Ctrl-C)\n"
     "                tensor create JOB NAME --shape 2,3,2 [--seed S] [--spec 'tp=S(-1)']\n"
     "                tensor reshard JOB NAME --spec 'tp=S(0)'   (R: replicated)\n"
     "                tensor get JOB NAME [--rank R] [--out FILE.npy]   (a FIFO or /dev/stdout\n"
     "                                           is written in place; a link, its file replaced)\n"
     "                tensor list JOB | tensor delete JOB NAME\n"
     "              Each waits up to --timeout for a job just submitted to run.\n",
     RunTensor},
};

}  // namespace

CommandGroup TensorCommands() {
  return {"Tensor commands (on the coordinator, as the cluster commands):", kCommands};
}

}  // namespace colod::cli
