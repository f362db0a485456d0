#include "worker/train/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "common/atomic_file.h"
#include "common/grpc_status.h"
#include "common/json.h"
#include "common/limits.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "common/text.h"
#include "nlohmann/json.hpp"
#include "worker/colo/tensor_collectives.h"
#include "worker/shardformer/checkpoint.h"
#include "worker/shardformer/safetensors.h"

namespace colod::train {

std::string StepDir(const std::string& dir, int64_t step) { return absl::StrFormat("%s/step-%06d", dir, step); }

std::string CheckpointWriter::Tag() const {
  return absl::StrCat(job.empty() ? "" : job + ".", "gen-", generation);
}

namespace {

bool ValidJobName(const std::string& job) {
  return job.size() <= 128 && std::all_of(job.begin(), job.end(), [](char c) {
           return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_';
         });
}

}  // namespace

absl::Status CheckpointWriter::Check() const {
  if (generation < 0) return absl::InvalidArgumentError(absl::StrCat("checkpoint generation ", generation, " < 0"));
  if (!ValidJobName(job)) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint job '", EscapedPrefix(job, 128),
                     "': at most 128 letters, digits, '-' and '_' (it names a directory)"));
  }
  if (lineage.size() > kMaxCheckpointLineage) {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint lineage of ", lineage.size(), " writers: at most ", kMaxCheckpointLineage));
  }
  for (const std::string& w : lineage) {
    if (!ValidJobName(w)) {
      return absl::InvalidArgumentError(absl::StrCat("checkpoint lineage names job '", EscapedPrefix(w, 128),
                                                     "': at most 128 letters, digits, '-' and '_'"));
    }
  }
  return absl::OkStatus();
}

std::vector<std::string> ContinuedLineage(const std::vector<std::string>& lineage, const std::string& resumed,
                                          const std::string& job) {
  std::vector<std::string> out;
  const auto add = [&](const std::string& w) {  // (a name no writer can have: none)
    if (w != job && ValidJobName(w) && std::find(out.begin(), out.end(), w) == out.end()) out.push_back(w);
  };
  for (const std::string& w : lineage) add(w);
  add(resumed);
  if (out.size() > kMaxCheckpointLineage) out.erase(out.begin(), out.end() - kMaxCheckpointLineage);
  return out;
}

std::vector<std::string> LineageWithCheckpointsIn(const std::vector<std::string>& lineage, const std::string& dir) {
  const absl::StatusOr<std::vector<CheckpointInfo>> listed = ListCheckpoints(dir);
  if (!listed.ok()) return lineage;
  std::set<std::string> present;
  for (const CheckpointInfo& c : *listed) present.insert(c.job);
  std::vector<std::string> out;
  for (const std::string& w : lineage) {
    if (present.count(w) > 0) out.push_back(w);
  }
  return out;
}

std::string StepTmpDir(const std::string& dir, int64_t step, const CheckpointWriter& writer) {
  return absl::StrCat(StepDir(dir, step), ".", writer.Tag(), ".tmp");
}

namespace {

using Json = nlohmann::json;
namespace fs = std::filesystem;

constexpr char kState[] = "train_state.json";

std::string OptimFile(int rank, int world) {
  return absl::StrFormat("optim-rank-%05d-of-%05d.safetensors", rank, world);
}

Json LayoutJson(const v1::ShardConfig& l) {
  Json j = {{"tensor_parallel_size", l.tensor_parallel_size()},
            {"data_parallel_size", l.data_parallel_size()},
            {"tensor_parallel_mode", v1::TensorParallelMode_Name(l.tensor_parallel_mode())},
            {"depth", l.depth()},
            {"sequence_parallel", l.sequence_parallel()}};
  // Only with stages, so that checkpoints written before they existed resume.
  if (l.pipeline_parallel_size() > 1) {
    j["pipeline_parallel_size"] = l.pipeline_parallel_size();
    j["pipeline_stage_layers"] = std::vector<int32_t>(l.pipeline_stage_layers().begin(), l.pipeline_stage_layers().end());
    if (l.virtual_stages() > 1) j["virtual_stages"] = l.virtual_stages();
  }
  return j;
}

// An integer field of `j` (read from `where`); INVALID_ARGUMENT for a
// missing one, another type or one past int64 (a damaged file, never an
// exception or a value wrapped negative).
absl::StatusOr<int64_t> IntField(const Json& j, const char* name, const std::string& where) {
  if (!j.contains(name) || !j[name].is_number_integer() ||
      (j[name].is_number_unsigned() && j[name].get<uint64_t>() > uint64_t{std::numeric_limits<int64_t>::max()})) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", name, " is not an integer"));
  }
  return j[name].get<int64_t>();
}

// IntField, >= 0.
absl::StatusOr<int64_t> CountField(const Json& j, const char* name, const std::string& where) {
  ASSIGN_OR_RETURN(const int64_t v, IntField(j, name, where));
  if (v < 0) return absl::InvalidArgumentError(absl::StrCat(where, ": ", name, " ", v, " is negative"));
  return v;
}

// The step a DIR entry named step-N (StepDir's name: "step-", then digits,
// nothing else) is the checkpoint of; nullopt for any other name (a copy
// named step-000040-best, a temporary directory, a user's file).
std::optional<int64_t> StepOfName(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "step-") || name.empty() || name.size() > 18) return std::nullopt;
  int64_t step = 0;
  for (const char c : name) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return std::nullopt;
    step = step * 10 + (c - '0');
  }
  return step;
}

// The checkpoint's step: its state file's, which must be its name's (a
// copy renamed to another step is no checkpoint of that step).
absl::StatusOr<int64_t> CheckedStep(const std::string& step_dir, const Json& state) {
  const std::string where = absl::StrCat(step_dir, "/", kState);
  ASSIGN_OR_RETURN(const int64_t step, CountField(state, "step", where));
  const std::optional<int64_t> named = StepOfName(fs::path(step_dir).filename().string());
  if (named.has_value() && *named != step) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": step ", step, " is not the directory's ", *named));
  }
  return step;
}

// The seed a checkpoint's sampler was on.
absl::StatusOr<uint64_t> SeedField(const Json& state, const std::string& where) {
  if (!state.contains("seed") || !state["seed"].is_number_unsigned()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": seed is not an unsigned integer"));
  }
  return state["seed"].get<uint64_t>();
}

// The data_parallel_size of the layout a checkpoint was written at.
absl::StatusOr<int32_t> SavedDataParallelSize(const Json& state, const std::string& where) {
  if (!state.contains("layout") || !state["layout"].is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": layout is not an object"));
  }
  const absl::StatusOr<int64_t> dp = IntField(state["layout"], "data_parallel_size", where + ": layout");
  if (!dp.ok() || *dp < 1 || *dp > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": layout.data_parallel_size is not a valid size"));
  }
  return static_cast<int32_t>(*dp);
}

// The most bytes a train_state.json holds (a few KiB: its lineage, at most
// kMaxCheckpointLineage ids, is the most of it): one past it is read no
// further (a file truncated to a terabyte, or a link to one, was read whole,
// or threw allocating it, at every listing of the directory).
constexpr int64_t kMaxTrainStateBytes = int64_t{16} << 20;

absl::StatusOr<Json> ReadJson(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, kMaxTrainStateBytes));
  Json j = ParseJson(text);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON object"));
  return j;
}

// The job a checkpoint's train_state.json names as its writer (none: "").
std::string WriterJob(const Json& state) {
  return state.contains("job") && state["job"].is_string() ? state["job"].get<std::string>() : "";
}

// A masked language model's [MASK] id a checkpoint records (none: not one,
// or written before 2026-12-07); INVALID_ARGUMENT where it is not an id.
absl::StatusOr<std::optional<int64_t>> MaskTokenIdField(const Json& state, const std::string& where) {
  if (!state.contains("mask_token_id")) return std::optional<int64_t>();
  if (!state["mask_token_id"].is_number_integer() || state["mask_token_id"].get<int64_t>() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": mask_token_id: not a token id"));
  }
  return std::optional<int64_t>(state["mask_token_id"].get<int64_t>());
}

// The parameters' dtype a checkpoint records (none: written before
// 2026-12-06); INVALID_ARGUMENT where it is not a float dtype's name.
absl::StatusOr<std::optional<DType>> ParamDTypeField(const Json& state, const std::string& where) {
  if (!state.contains("param_dtype")) return std::optional<DType>();
  absl::StatusOr<DType> dtype = state["param_dtype"].is_string() ? ParseDType(state["param_dtype"].get<std::string>())
                                                                 : absl::InvalidArgumentError("not a string");
  if (dtype.ok() && !IsFloat(*dtype))
    dtype = absl::InvalidArgumentError(absl::StrCat(DTypeName(*dtype), " is not a float dtype"));
  if (!dtype.ok()) return absl::InvalidArgumentError(absl::StrCat(where, ": param_dtype: ", dtype.status().message()));
  return std::optional<DType>(*dtype);
}

// fp16's loss scale a checkpoint records, with its good steps (none: another
// precision, or written before 2026-12-08); INVALID_ARGUMENT where they are
// not a scale LossScaler takes (its window aside).
absl::StatusOr<std::optional<std::pair<double, int64_t>>> LossScaleField(const Json& state, const std::string& where) {
  if (!state.contains("loss_scale")) return std::optional<std::pair<double, int64_t>>();
  const Json& l = state["loss_scale"];
  if (!l.is_object() || !l.contains("scale") || !l["scale"].is_number() || !l.contains("good_steps") ||
      !l["good_steps"].is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": loss_scale: not {\"scale\": S, \"good_steps\": N}"));
  }
  const double scale = l["scale"].get<double>();
  const int64_t good = l["good_steps"].get<int64_t>();
  if (absl::Status valid = CheckLossScale(scale); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": loss_scale: ", valid.message()));
  }
  if (good < 0) return absl::InvalidArgumentError(absl::StrCat(where, ": loss_scale: ", good, " good steps"));
  return std::optional<std::pair<double, int64_t>>(std::make_pair(scale, good));
}

// Every file of a step directory whose train_state.json reads as `state`
// opens and validates.
absl::Status ValidateFiles(const std::string& step_dir, const Json& state) {
  RETURN_IF_ERROR(shardformer::ReadCheckpointIndex(step_dir).status());
  const std::string where = absl::StrCat(step_dir, "/", kState);
  ASSIGN_OR_RETURN(const int64_t step, CheckedStep(step_dir, state));
  ASSIGN_OR_RETURN(const int64_t world, IntField(state, "world_size", where));
  if (world < 1 || world > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": world_size ", world));
  }
  // Every field a resume reads, so that a damaged one is skipped for an
  // older checkpoint rather than failing the job when it is restored.
  // (A step updates once at most: more is a damaged count, which the next
  // update would carry past int64's range.)
  ASSIGN_OR_RETURN(const int64_t updates, CountField(state, "optimizer_steps", where));
  if (updates > step) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": optimizer_steps ", updates, " is past the checkpoint's step ", step));
  }
  RETURN_IF_ERROR(SeedField(state, where).status());
  RETURN_IF_ERROR(SavedDataParallelSize(state, where).status());
  RETURN_IF_ERROR(MaskTokenIdField(state, where).status());
  RETURN_IF_ERROR(LossScaleField(state, where).status());
  RETURN_IF_ERROR(ParamDTypeField(state, where).status());
  for (int r = 0; r < world; ++r) {
    for (const std::string& name :
         {absl::StrFormat("rank-%05d-of-%05d.safetensors", r, world), OptimFile(r, world)}) {
      auto f = shardformer::OpenCheckpointFile(step_dir + "/" + name);
      if (!f.ok()) return f.status();
    }
  }
  return absl::OkStatus();
}

// Every file of a step directory opens and validates.
absl::Status Validate(const std::string& step_dir) {
  ASSIGN_OR_RETURN(const Json state, ReadJson(step_dir + "/" + kState));
  return ValidateFiles(step_dir, state);
}

bool IsDirectory(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

// The writer whose save a DIR entry is the temporary directory of:
// step-NNNNNN.[JOB.]gen-G.tmp; step-N.tmp (colod before 2026-12) gives
// generation -1. nullopt for any other name.
std::optional<CheckpointWriter> TmpWriter(const std::string& name) {
  constexpr size_t kStep = sizeof("step-000000") - 1;  // StepDir's six digits at least
  if (!absl::StartsWith(name, "step-") || !absl::EndsWith(name, ".tmp") || name.size() < kStep + 4) {
    return std::nullopt;
  }
  const std::string stem = name.substr(0, name.size() - 4);
  if (!StepOfName(stem.substr(0, stem.find('.'))).has_value()) return std::nullopt;  // not step-N...: a user's
  const size_t gen = stem.rfind(".gen-");
  if (gen == std::string::npos) return CheckpointWriter{.generation = -1};
  CheckpointWriter w;
  if (!absl::SimpleAtoi(stem.substr(gen + 5), &w.generation) || w.generation < 0) return std::nullopt;
  const size_t step_end = stem.find('.');  // after step-NNNNNN
  if (step_end < gen) w.job = stem.substr(step_end + 1, gen - step_end - 1);
  return w;
}

// How long another writer's temporary directory is left alone after its
// last change (a file renamed into it): a save in progress, not a crashed
// one, of a job whose ranks still run after the coordinator ended it (one
// it gave up on), which the coordinator lets another job's directory be.
constexpr auto kOtherWritersTmpGrace = std::chrono::hours(1);

// Removes the temporary directories under `dir` that are not `writer`'s
// job's later generations' (this rank would then be the stale one): crashed
// or abandoned saves of this job's earlier generations, its own, and other
// jobs' and runs' unchanged for kOtherWritersTmpGrace (one job writes a
// directory at a time).
void RemoveStaleTmpDirs(const std::string& dir, const CheckpointWriter& writer) {
  for (const std::string& name : ListDirectory(dir).value_or(std::vector<std::string>{})) {
    const std::optional<CheckpointWriter> w = TmpWriter(name);
    if (!w.has_value() || (w->job == writer.job && w->generation > writer.generation)) continue;
    if (w->job != writer.job) {
      std::error_code age;
      const fs::file_time_type changed = fs::last_write_time(absl::StrCat(dir, "/", name), age);
      if (age || fs::file_time_type::clock::now() - changed < kOtherWritersTmpGrace) continue;
    }
    std::error_code rm;
    fs::remove_all(absl::StrCat(dir, "/", name), rm);
    if (rm) COLOD_LOG(WARNING) << "cannot remove " << dir << "/" << name << ": " << rm.message();
  }
}

// A fault-injection seam of the internal:: testing hooks: a function tests
// set and the saving thread copies (empty but in tests), run without the
// lock. Thread-safe; never destroyed (a static of each hook).
template <typename Fn>
class TestingSeam {
 public:
  Fn Get() {
    std::lock_guard<std::mutex> lock(mu_);
    return fn_;
  }
  void Set(Fn fn) {
    std::lock_guard<std::mutex> lock(mu_);
    fn_ = std::move(fn);
  }

 private:
  std::mutex mu_;
  Fn fn_;  // guarded by mu_
};

TestingSeam<std::function<int(int)>>& ExchangeSeam() {
  static auto* seam = new TestingSeam<std::function<int(int)>>();
  return *seam;
}
// Run by rank 0 once its checkpoint is whole, before it puts it in place.
TestingSeam<std::function<void(ProcessGroup&)>>& BeforeInstallSeam() {
  static auto* seam = new TestingSeam<std::function<void(ProcessGroup&)>>();
  return *seam;
}

// Run by every rank before it writes its part of a checkpoint into `tmp`.
TestingSeam<std::function<void(ProcessGroup&, const std::string& tmp)>>& BeforeWriteSeam() {
  static auto* seam = new TestingSeam<std::function<void(ProcessGroup&, const std::string&)>>();
  return *seam;
}

// renameat2(a, b, RENAME_EXCHANGE), the n-th of an install, after the
// testing hook (internal::SetCheckpointExchangeHookForTesting), which may
// fail it with an errno of its own.
int Exchange(int n, const std::string& a, const std::string& b) {
  if (const std::function<int(int)> hook = ExchangeSeam().Get()) {
    if (const int injected = hook(n); injected != 0) {
      errno = injected;
      return -1;
    }
  }
  return ::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE);
}

// Moves `tmp` (complete) to `final_dir`. A directory there is replaced:
// exchanged with tmp in one atomic rename (renameat2's RENAME_EXCHANGE) and
// then removed, so that some whole checkpoint of the step is in place at
// every moment; where the file system cannot exchange, moved aside first,
// removed after, and moved back if the rename fails. ABORTED, leaving it
// and removing tmp, where the checkpoint in place is one this rank must not
// replace: a later generation's of the same job (this rank is a stale one
// the coordinator gave up on), or, once `pg` says this rank was aborted
// (ProcessGroup::Aborted), another job's (the coordinator may have given up on this rank,
// and the directory's next job saved there). Read before the exchange and
// again after it: one put in place meanwhile, or an abort meanwhile,
// exchanges it back (where that fails, ABORTED leaving both). Where nothing
// is in place the checkpoint goes in, aborted or not: it replaces nothing,
// and a restart of its own job resumes from it.
absl::Status InstallCheckpoint(const std::string& dir, const std::string& tmp, const std::string& final_dir,
                               const CheckpointWriter& writer, const ProcessGroup& pg) {
  std::error_code ec;
  if (!fs::exists(final_dir, ec)) {
    fs::rename(tmp, final_dir, ec);
    if (ec) {
      return absl::FailedPreconditionError(absl::StrCat("cannot rename ", tmp, " to ", final_dir, ": ", ec.message()));
    }
    return absl::OkStatus();
  }
  struct Keep {
    CheckpointWriter owner;  // who wrote the checkpoint that stays
    std::string why;
  };
  // Why the checkpoint at `checkpoint` must stay, if it must.
  const auto keep = [&](const std::string& checkpoint) -> std::optional<Keep> {
    absl::StatusOr<Json> there = ReadJson(absl::StrCat(checkpoint, "/", kState));
    if (!there.ok()) return std::nullopt;
    const Json& t = *there;
    CheckpointWriter owner;
    owner.job = WriterJob(t);
    if (t.contains("generation") && t["generation"].is_number_integer()) {
      owner.generation = t["generation"].get<int64_t>();
    }
    if (owner.job == writer.job) {
      if (owner.generation <= writer.generation) return std::nullopt;
      return Keep{owner, absl::StrCat("was written by generation ", owner.generation, " of ",
                                      writer.job.empty() ? "the run" : writer.job, ", later than this one's ",
                                      writer.generation)};
    }
    const absl::Status stop = pg.Aborted();
    if (stop.ok()) return std::nullopt;
    return Keep{owner, absl::StrCat("was written by ", owner.job.empty() ? "a run outside a coordinator" : owner.job,
                                    ", and this rank was aborted (", stop.message(), ")")};
  };
  const auto refuse = [&](const Keep& k) {
    fs::remove_all(tmp, ec);
    return absl::AbortedError(absl::StrCat(final_dir, " ", k.why, ": left in place"));
  };
  if (const std::optional<Keep> k = keep(final_dir)) return refuse(*k);
  if (Exchange(1, tmp, final_dir) == 0) {
    // What went out: one that must stay, put in place (or made so by an
    // abort) since it was read above, goes back.
    if (const std::optional<Keep> k = keep(tmp)) {
      if (Exchange(2, tmp, final_dir) == 0) return refuse(*k);
      // Neither is removed: a whole checkpoint of the step stays in place
      // (this one), and the other goes where no cleanup or listing looks
      // (tmp's name is this writer's: its next save would remove it), for
      // a human.
      const std::string back_error = std::strerror(errno);
      const std::string conflict =
          absl::StrCat(dir, "/.conflict-", fs::path(final_dir).filename().string(), ".", k->owner.Tag());
      fs::rename(tmp, conflict, ec);
      return absl::AbortedError(absl::StrCat(
          "the checkpoint of ", final_dir, " that ", k->why, " went out when generation ", writer.generation,
          "'s replaced it, and cannot be put back (", back_error, "): it is in ", ec ? tmp : conflict));
    }
    fs::remove_all(tmp, ec);  // the old checkpoint; a leftover goes with the next save's stale directories
    return absl::OkStatus();
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot exchange ", tmp, " and ", final_dir, ": ", std::strerror(errno)));
  }
  const std::string aside =
      absl::StrCat(dir, "/.trash-", fs::path(final_dir).filename().string(), ".", writer.Tag());
  fs::remove_all(aside, ec);
  fs::rename(final_dir, aside, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot move ", final_dir, " aside: ", ec.message()));
  fs::rename(tmp, final_dir, ec);
  if (ec) {
    const absl::Status failed =
        absl::FailedPreconditionError(absl::StrCat("cannot rename ", tmp, " to ", final_dir, ": ", ec.message()));
    std::error_code back;
    fs::rename(aside, final_dir, back);
    if (back) COLOD_LOG(WARNING) << "cannot move " << aside << " back to " << final_dir << ": " << back.message();
    return failed;
  }
  fs::remove_all(aside, ec);  // a leftover is removed by the next prune
  return absl::OkStatus();
}

}  // namespace

namespace internal {
void SetCheckpointExchangeHookForTesting(std::function<int(int exchange)> hook) { ExchangeSeam().Set(std::move(hook)); }
void SetCheckpointBeforeInstallHookForTesting(std::function<void(ProcessGroup&)> hook) {
  BeforeInstallSeam().Set(std::move(hook));
}
void SetCheckpointBeforeWriteHookForTesting(std::function<void(ProcessGroup&, const std::string& tmp)> hook) {
  BeforeWriteSeam().Set(std::move(hook));
}
}  // namespace internal

absl::Status SaveTrainingCheckpoint(shardformer::ShardedModel& model, Optimizer& optimizer, const std::string& dir,
                                    int64_t step, uint64_t seed, std::optional<double> eval_loss,
                                    const CheckpointWriter& writer) {
  return SaveTrainingCheckpoint(std::vector<shardformer::ShardedModel*>{&model}, optimizer, dir, step, seed, eval_loss,
                                writer);
}

absl::Status SaveTrainingCheckpoint(const std::vector<shardformer::ShardedModel*>& chunks, Optimizer& optimizer,
                                    const std::string& dir, int64_t step, uint64_t seed,
                                    std::optional<double> eval_loss, const CheckpointWriter& writer,
                                    const std::string& report, std::optional<int64_t> mask_token_id,
                                    const LossScaler* loss_scale) {
  if (chunks.empty()) return absl::InvalidArgumentError("a checkpoint of no model chunk");
  RETURN_IF_ERROR(writer.Check());
  shardformer::ShardedModel& model = *chunks.front();
  ProcessGroup* pg = model.process_group();
  const int rank = pg->rank(), world = pg->mesh().world_size();
  const std::string final_dir = StepDir(dir, step), tmp = StepTmpDir(dir, step, writer);
  // An aborted rank (given up on, perhaps: another job may own the
  // directory now) starts no save and removes nothing.
  RETURN_IF_ERROR(pg->Aborted());
  // Weights that are not finite (on a rank that owns parameters) fail the
  // save here, before any rank writes: every rank learns of it in the
  // first agreement, as of rank 0's failure to create the directory.
  absl::StatusOr<shardformer::RankParts> parts = shardformer::TakeRankParts(chunks);
  std::error_code ec;
  absl::Status made = parts.status();
  if (rank == 0 && made.ok()) {
    // Crashed or abandoned attempts, this one's included, before this
    // checkpoint takes room of its own.
    RemoveStaleTmpDirs(dir, writer);
    fs::create_directories(tmp, ec);
    if (ec) made = absl::FailedPreconditionError(absl::StrCat("cannot create ", tmp, ": ", ec.message()));
  }
  // A save that fails before its checkpoint is put in place (a full disk,
  // a peer lost) removes its temporary directory: it is this writer's
  // alone, and left, it would hold its room for an hour
  // (kOtherWritersTmpGrace) against another job's saves. Rank 0 alone
  // removes it: past the ranks' agreement (below) it alone writes there
  // and puts it in place, and another rank whose agreement fails (a peer
  // lost after rank 0 passed it) must not remove what rank 0 may be
  // renaming. From the install on it may hold another job's checkpoint,
  // for a human (InstallCheckpoint).
  bool remove_tmp = rank == 0;
  absl::Cleanup failed = [&] {
    if (!remove_tmp) return;
    std::error_code rm;
    fs::remove_all(tmp, rm);
  };
  const Device& device = model.shard_config().device;
  RETURN_IF_ERROR(AgreeOverMesh(*pg, made, device,
                                absl::StrCat("the checkpoint of step ", step,
                                             " was not saved: another rank could not take its part of the weights, "
                                             "or rank 0 could not create ",
                                             tmp)));
  // Each rank writes its parts, and every rank learns whether all could
  // (AgreeOverMesh, in SaveShardedCheckpoint and here): a rank that could
  // not fails with its own error, the others with one that follows from it
  // (the job's reason is the cause), and no rank returns, nor rank 0
  // removes the directory, while another still writes there (its write
  // would fail too, "No such file or directory", perhaps first).
  if (const std::function<void(ProcessGroup&, const std::string&)> hook = BeforeWriteSeam().Get()) hook(*pg, tmp);
  RETURN_IF_ERROR(shardformer::SaveShardedCheckpoint(chunks, *std::move(parts), tmp));
  const auto write_state = [&]() -> absl::Status {
    std::vector<std::pair<std::string, Tensor>> state;
    std::set<std::string> written;
    for (const Optimizer::StateTensor& t : optimizer.State()) {
      // A rank holding a table and a mirror of it (chunks of one interleaved
      // pipeline rank) keeps the same state for both: written once.
      if (!written.insert(t.name).second) continue;
      ASSIGN_OR_RETURN(Tensor host, t.value.To(Device::Cpu()));
      state.emplace_back(t.name, host.Contiguous());  // on the host: fails only without host memory
    }
    return shardformer::WriteSafetensors(absl::StrCat(tmp, "/", OptimFile(rank, world)), state);
  };
  RETURN_IF_ERROR(AgreeOverMesh(
      *pg, write_state(), device,
      absl::StrCat("the checkpoint of step ", step, " was not saved: another rank could not write its part to ", tmp)));
  // Rank 0 writes the state and puts the checkpoint in place; the others
  // wait for it in the last agreement.
  const auto install = [&]() -> absl::Status {
    Json j = {{"step", step},
              {"optimizer_steps", optimizer.steps()},
              {"seed", seed},
              {"world_size", world},
              {"model_type", model.config().model_type},
              {"layout", LayoutJson(model.shard_config().layout)},
              {"param_dtype", std::string(DTypeName(model.shard_config().param_dtype))}};
    if (eval_loss.has_value() && std::isfinite(*eval_loss)) j["eval_loss"] = *eval_loss;
    if (mask_token_id.has_value()) j["mask_token_id"] = *mask_token_id;
    if (loss_scale != nullptr) {
      j["loss_scale"] = {{"scale", loss_scale->scale()}, {"good_steps", loss_scale->good_steps()}};
    }
    if (!writer.job.empty()) j["job"] = writer.job;
    if (!writer.lineage.empty()) j["lineage"] = writer.lineage;
    if (writer.generation > 0) j["generation"] = writer.generation;
    if (!report.empty()) {
      if (Json r = ParseJson(report); r.is_object()) j["report"] = std::move(r);
    }
    RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(tmp, "/", kState), JsonText(j, 1)));
    // Every rank's files are there and read (ranks of another colod version
    // would write elsewhere): retention trusts train_state.json alone.
    if (const absl::Status whole = Validate(tmp); !whole.ok()) {
      return absl::FailedPreconditionError(
          absl::StrCat("checkpoint ", tmp, " is incomplete after every rank wrote its part (do all workers run the "
                       "same colod version?): ",
                       whole.message()));
    }
    // A rank aborted since the agreement (the coordinator may have given up
    // on it, and the directory's next job saved there) replaces no other
    // job's checkpoint of the step: InstallCheckpoint asks. The agreements
    // fence the rest of the save; this covers the state write and the
    // checks, which read every file, and the install itself.
    if (const std::function<void(ProcessGroup&)> hook = BeforeInstallSeam().Get()) hook(*pg);
    remove_tmp = false;
    RETURN_IF_ERROR(InstallCheckpoint(dir, tmp, final_dir, writer, *pg));
    // The checkpoint's name on disk before it is reported or an older one
    // is pruned: a power loss must not keep the removals and lose it.
    return SyncDirectory(dir);
  };
  RETURN_IF_ERROR(AgreeOverMesh(*pg, rank == 0 ? install() : absl::OkStatus(), device,
                                absl::StrCat("the checkpoint of step ", step, " failed as rank 0 put it in place")));
  // What a stale rank of an earlier generation made again meanwhile.
  if (rank == 0 && pg->Aborted().ok()) RemoveStaleTmpDirs(dir, writer);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<CheckpointInfo>> ListCheckpoints(const std::string& dir, std::vector<std::string>* skipped) {
  std::vector<CheckpointInfo> out;
  ASSIGN_OR_RETURN(const std::vector<std::string> names, ListDirectory(dir));
  for (const std::string& name : names) {
    const std::string path = dir + "/" + name;
    if (!StepOfName(name).has_value() || !IsDirectory(path)) continue;
    absl::StatusOr<Json> state = ReadJson(path + "/" + kState);
    absl::StatusOr<int64_t> step = state.ok() ? CheckedStep(path, *state) : absl::StatusOr<int64_t>(state.status());
    if (!step.ok()) {
      if (skipped != nullptr) skipped->push_back(absl::StrCat(name, ": ", step.status().message()));
      continue;
    }
    CheckpointInfo c;
    c.path = path;
    c.step = *step;
    c.job = WriterJob(*state);
    if (state->contains("eval_loss") && (*state)["eval_loss"].is_number()) {
      c.eval_loss = (*state)["eval_loss"].get<double>();
    }
    // Never throws: an entry that cannot be read or sized is not counted.
    std::error_code walk;
    for (fs::recursive_directory_iterator it(path, fs::directory_options::skip_permission_denied, walk), end;
         !walk && it != end; it.increment(walk)) {
      std::error_code type, size;
      if (!it->is_regular_file(type) || type) continue;
      const uintmax_t bytes = it->file_size(size);
      if (!size) c.bytes += static_cast<int64_t>(bytes);
    }
    out.push_back(std::move(c));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointInfo& a, const CheckpointInfo& b) { return a.step < b.step; });
  return out;
}

namespace {

constexpr absl::string_view kTrash = ".trash-";

// The writer of DIR/NAME where NAME is a checkpoint a save moved aside
// (.trash-step-N.[JOB.]gen-G); nullopt for any other name, a prune's
// removal (.trash-step-N) included.
std::optional<CheckpointWriter> MovedAsideBy(const std::string& name) {
  if (!absl::StartsWith(name, ".trash-step-")) return std::nullopt;
  std::optional<CheckpointWriter> w = TmpWriter(absl::StrCat(name.substr(kTrash.size()), ".tmp"));
  if (!w.has_value() || w->generation < 0) return std::nullopt;
  return w;
}

// Whether `w`'s leftovers are `writer`'s to touch: a later generation of
// its job may be saving now.
bool LaterGenerationOf(const CheckpointWriter& writer, const CheckpointWriter& w) {
  return w.job == writer.job && w.generation > writer.generation;
}

}  // namespace

namespace {

// `check` of a checkpoint directory and of each entry in it (each may be a
// link); OK without a check. Its error (PERMISSION_DENIED) where it refuses
// one; FAILED_PRECONDITION where the directory cannot be listed (a 0111
// directory's files open by name though they cannot be listed: none of it
// may be read, since none of it was checked).
absl::Status CheckCheckpointPaths(const std::string& step_dir, const PathCheck& check) {
  if (!check) return absl::OkStatus();
  RETURN_IF_ERROR(check(step_dir));
  const absl::StatusOr<std::vector<std::string>> names = ListDirectory(step_dir);
  if (!names.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot be listed, so its files cannot be checked against this worker's --allow-path (",
                     names.status().message(), ")"));
  }
  for (const std::string& name : *names) RETURN_IF_ERROR(check(absl::StrCat(step_dir, "/", name)));
  return absl::OkStatus();
}

}  // namespace

void RestoreMovedAsideCheckpoints(const std::string& dir, const CheckpointWriter& writer, const PathCheck& check) {
  for (const std::string& name : ListDirectory(dir).value_or(std::vector<std::string>{})) {
    const std::optional<CheckpointWriter> w = MovedAsideBy(name);
    if (!w.has_value() || LaterGenerationOf(writer, *w)) continue;
    const std::string step_name = name.substr(kTrash.size(), name.find('.', kTrash.size()) - kTrash.size());
    const std::string from = absl::StrCat(dir, "/", name), to = absl::StrCat(dir, "/", step_name);
    // The replacement went in (or the name cannot be looked up).
    std::error_code lookup;
    if (fs::symlink_status(to, lookup).type() != fs::file_type::not_found) continue;
    // Nothing of one outside the allowed paths is read (a link out).
    if (const absl::Status allowed = CheckCheckpointPaths(from, check); !allowed.ok()) {
      COLOD_LOG(WARNING) << "not putting back " << from << ": " << allowed.message();
      continue;
    }
    // Only a whole checkpoint of its step: not a replaced one's leftover,
    // half removed.
    const absl::StatusOr<Json> state = ReadJson(absl::StrCat(from, "/", kState));
    if (!state.ok() || !ValidateFiles(from, *state).ok()) continue;
    const absl::StatusOr<int64_t> step = CheckedStep(from, *state);
    if (!step.ok() || *step != StepOfName(step_name)) continue;
    // rename(2) onto a name that appeared meanwhile (another rank restoring
    // it) fails, or finds the directory gone: either way step N is there.
    std::error_code mv;
    fs::rename(from, to, mv);
    if (mv) {
      if (mv != std::errc::no_such_file_or_directory && mv != std::errc::directory_not_empty &&
          mv != std::errc::file_exists) {
        COLOD_LOG(WARNING) << "cannot put back the checkpoint " << from << " (moved aside by a save that never "
                           << "replaced it) as " << to << ": " << mv.message();
      }
      continue;
    }
    COLOD_LOG(WARNING) << "put back " << to << ": a save by " << w->Tag() << " moved it aside to replace it and "
                       << "never did (its process ended between the two renames)";
  }
}

absl::StatusOr<std::vector<CheckpointInfo>> PruneCheckpoints(const std::string& dir, const Retention& keep,
                                                             const std::string& must_keep,
                                                             const CheckpointWriter& writer, const PathCheck& check) {
  // A moved-aside checkpoint whose step has no other is the only copy of
  // it: put back, not removed below.
  RestoreMovedAsideCheckpoints(dir, writer, check);
  for (const std::string& name : ListDirectory(dir).value_or(std::vector<std::string>{})) {
    if (absl::StartsWith(name, ".trash-step-")) {  // removals a crash interrupted, and replaced checkpoints
      const std::optional<CheckpointWriter> w = MovedAsideBy(name);
      if (w.has_value() && LaterGenerationOf(writer, *w)) continue;
      std::error_code rm;
      fs::remove_all(absl::StrCat(dir, "/", name), rm);
    }
  }
  ASSIGN_OR_RETURN(std::vector<CheckpointInfo> listed, ListCheckpoints(dir));
  std::vector<CheckpointInfo> all;  // the writer's own: the others' are not this run's to remove
  for (CheckpointInfo& c : listed) {
    if (c.job == writer.job || std::find(writer.lineage.begin(), writer.lineage.end(), c.job) != writer.lineage.end()) {
      all.push_back(std::move(c));
    }
  }
  if (keep.keep_last <= 0 && !keep.keep_best) return all;
  const int64_t n = static_cast<int64_t>(all.size());
  std::vector<bool> kept(all.size(), keep.keep_last <= 0);
  for (int64_t i = std::max<int64_t>(0, n - std::max<int64_t>(1, keep.keep_last)); i < n; ++i) kept[i] = true;
  if (keep.keep_best) {
    std::optional<size_t> best;
    for (size_t i = 0; i < all.size(); ++i) {
      const std::optional<double>& l = all[i].eval_loss;
      if (l.has_value() && !std::isnan(*l) && (!best.has_value() || *l < *all[*best].eval_loss)) best = i;
    }
    if (best.has_value()) kept[*best] = true;
  }
  for (size_t i = 0; i < all.size(); ++i) kept[i] = kept[i] || all[i].path == must_keep;
  std::vector<CheckpointInfo> out;
  for (size_t i = 0; i < all.size(); ++i) {
    if (kept[i]) {
      out.push_back(all[i]);
      continue;
    }
    const std::string trash = absl::StrCat(dir, "/.trash-", fs::path(all[i].path).filename().string());
    std::error_code mv;
    fs::rename(all[i].path, trash, mv);
    if (mv) {  // still a checkpoint, whole: kept, and tried again after the next save
      COLOD_LOG(WARNING) << "cannot remove checkpoint " << all[i].path << ": " << mv.message();
      out.push_back(all[i]);
      continue;
    }
    std::error_code rm;
    fs::remove_all(trash, rm);  // a leftover is removed by the next prune
  }
  return out;
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& dir, std::vector<std::string>* skipped,
                                             const std::optional<std::vector<std::string>>& writers,
                                             const PathCheck& check) {
  // A checkpoint itself (DIR/step-N, e.g. the best one to go on from): it,
  // if complete and one of `writers`'.
  if (IsRegularFile(absl::StrCat(dir, "/", kState))) {
    if (const absl::Status allowed = CheckCheckpointPaths(dir, check); !allowed.ok()) {
      return absl::Status(allowed.code(), absl::StrCat(dir, ": ", allowed.message()));
    }
    ASSIGN_OR_RETURN(const Json state, ReadJson(absl::StrCat(dir, "/", kState)));
    if (writers.has_value() && std::find(writers->begin(), writers->end(), WriterJob(state)) == writers->end()) {
      return absl::NotFoundError(absl::StrCat(dir, " is another writer's checkpoint (", WriterJob(state), ")"));
    }
    if (const absl::Status valid = ValidateFiles(dir, state); !valid.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint ", dir, " is damaged: ", valid.message()));
    }
    return dir;
  }
  std::vector<std::pair<int64_t, std::string>> numbered;
  ASSIGN_OR_RETURN(const std::vector<std::string> names, ListDirectory(dir));
  for (const std::string& name : names) {
    const std::optional<int64_t> step = StepOfName(name);
    if (step.has_value() && IsDirectory(dir + "/" + name)) numbered.emplace_back(*step, name);
  }
  // Newest first, by number: step-1000000 is newer than step-999999, which
  // sorts after it as text.
  std::sort(numbered.rbegin(), numbered.rend());
  int64_t others = 0;  // another writer's, complete or not
  for (const auto& [number, s] : numbered) {
    const std::string step_dir = dir + "/" + s;
    // A link out ends the search; one that cannot be listed (its files
    // unchecked) is passed over.
    if (const absl::Status allowed = CheckCheckpointPaths(step_dir, check); !allowed.ok()) {
      if (absl::IsPermissionDenied(allowed)) return allowed;
      if (skipped != nullptr) skipped->push_back(absl::StrCat(s, ": ", allowed.message()));
      continue;
    }
    const absl::StatusOr<Json> state = ReadJson(step_dir + "/" + kState);
    if (state.ok() && writers.has_value() &&
        std::find(writers->begin(), writers->end(), WriterJob(*state)) == writers->end()) {
      ++others;
      continue;
    }
    const absl::Status valid = state.ok() ? ValidateFiles(step_dir, *state) : state.status();
    if (valid.ok()) return step_dir;
    if (skipped != nullptr) skipped->push_back(absl::StrCat(s, ": ", valid.message()));
  }
  if (writers.has_value()) {
    std::vector<std::string> named;
    for (const std::string& w : *writers) named.push_back(w.empty() ? "a run outside a coordinator" : w);
    return absl::NotFoundError(absl::StrCat(
        "no complete checkpoint of ", named.empty() ? "no writer" : absl::StrJoin(named, " or "), " in ", dir,
        others > 0 ? absl::StrCat(" (", others, " checkpoints of other writers passed over)") : ""));
  }
  return absl::NotFoundError(absl::StrCat("no complete checkpoint in ", dir));
}

namespace {

// The parameters' dtype a checkpoint's index says: BF16 or F16 where any
// tensor is (only mixed precision writes them), F32 where every one is;
// none where the index does not read or names another.
std::optional<DType> IndexedParamDType(const std::string& checkpoint) {
  const absl::StatusOr<shardformer::CheckpointIndex> index = shardformer::ReadCheckpointIndex(checkpoint);
  if (!index.ok() || index->tensors.empty()) return std::nullopt;
  std::set<std::string> dtypes;
  for (const auto& [name, t] : index->tensors) dtypes.insert(t.dtype);
  if (dtypes.count("BF16")) return DType::kBF16;
  if (dtypes.count("F16")) return DType::kF16;
  if (dtypes == std::set<std::string>{"F32"}) return DType::kF32;
  return std::nullopt;
}

}  // namespace

absl::StatusOr<Resumed> ReadTrainState(const std::string& checkpoint) {
  ASSIGN_OR_RETURN(Json state, ReadJson(checkpoint + "/" + kState));
  const std::string where = absl::StrCat(checkpoint, "/", kState);
  Resumed r;
  ASSIGN_OR_RETURN(r.step, CheckedStep(checkpoint, state));
  ASSIGN_OR_RETURN(r.seed, SeedField(state, where));
  r.job = WriterJob(state);
  // (A lineage that does not read, or names what no writer can be, counts
  // for none: the file is not the run's to trust past its own job.)
  if (state.contains("lineage") && state["lineage"].is_array()) {
    CheckpointWriter w;
    for (const Json& name : state["lineage"]) {
      if (!name.is_string()) break;
      w.lineage.push_back(name.get<std::string>());
      if (w.lineage.size() > kMaxCheckpointLineage) break;
    }
    if (w.Check().ok() && w.lineage.size() == state["lineage"].size()) r.lineage = std::move(w.lineage);
  }
  if (state.contains("report") && state["report"].is_object()) r.report = JsonText(state["report"]);
  ASSIGN_OR_RETURN(r.param_dtype, ParamDTypeField(state, where));
  // A checkpoint of before 2026-12-06 records none, though bf16 and f16
  // runs saved theirs from 2026-11-23: the index's dtypes say which (a
  // 16-bit tensor is a mixed-precision run's; f32 alone an f32 run's).
  if (!r.param_dtype.has_value()) r.param_dtype = IndexedParamDType(checkpoint);
  ASSIGN_OR_RETURN(r.mask_token_id, MaskTokenIdField(state, where));
  ASSIGN_OR_RETURN(const auto scale, LossScaleField(state, where));  // (scale, good steps)
  if (scale.has_value()) {
    r.loss_scale = scale->first;
    r.loss_scale_good_steps = scale->second;
  }
  return r;
}

namespace {

// The optimizer files of the ranks that held this rank's tensor-parallel
// and pipeline shards when the checkpoint was written at `saved` (this
// run's layout with another data_parallel_size): the ranks whose mesh
// coordinates other than dp are this rank's.
// The optimizer files of the ranks of `saved` (the mesh a checkpoint was
// written at) whose coordinates but on the `dp_axes` are `coords`: those
// holding the pieces of one shard's state, whole or ZeRO's partitions.
std::vector<std::string> OptimFilesOfShard(const DeviceMesh& saved, const std::vector<int>& dp_axes,
                                           const std::vector<int>& coords) {
  std::vector<std::string> files;
  for (int r = 0; r < saved.world_size(); ++r) {
    const std::vector<int> theirs = saved.Coordinates(r);
    bool same = theirs.size() == coords.size();
    for (size_t a = 0; same && a < coords.size(); ++a) {
      same = std::find(dp_axes.begin(), dp_axes.end(), static_cast<int>(a)) != dp_axes.end() || theirs[a] == coords[a];
    }
    if (same) files.push_back(OptimFile(r, saved.world_size()));
  }
  return files;
}

absl::StatusOr<std::vector<std::string>> PeerOptimFiles(const v1::ShardConfig& saved, ProcessGroup* pg) {
  ASSIGN_OR_RETURN(const DeviceMesh old, DeviceMesh::FromShardConfig(saved));
  ASSIGN_OR_RETURN(const std::vector<int> dp_axes, pg->mesh().AxisIndices("dp"));
  return OptimFilesOfShard(old, dp_axes, pg->mesh().Coordinates(pg->rank()));
}

// The offset within its parameter of the saved state tensor `name` if it
// is a piece of `prefix` ("<param>.<state>": offset 0, or
// "<param>.<state>@<offset>").
std::optional<int64_t> PieceOffset(const std::string& name, const std::string& prefix) {
  if (name == prefix) return 0;
  if (!absl::StartsWith(name, prefix + "@")) return std::nullopt;
  int64_t offset = 0;
  if (!absl::SimpleAtoi(name.substr(prefix.size() + 1), &offset) || offset < 0) return std::nullopt;
  return offset;
}

// A checkpoint's files, each opened once (OpenCheckpointFile) as asked for.
using shardformer::CheckpointFiles;

// Puts the elements [begin, begin + target.numel()) of state `prefix`
// ("<param>.<state>") of one rank's local tensor into `target` (flat) from
// the pieces the optimizer files `peers` hold (whole, or ZeRO's partitions
// at any dp size; a whole state every dp replica wrote is read once).
// INVALID_ARGUMENT naming `whose` state and the first element none covers.
absl::Status AssembleState(CheckpointFiles& files, const std::vector<std::string>& peers, const std::string& prefix,
                           int64_t begin, Tensor& target, absl::string_view whose) {
  const int64_t end = begin + target.numel();
  std::vector<std::pair<int64_t, int64_t>> covered;
  // How far from `lo` the pieces read so far cover without a gap.
  auto reached_from = [&covered](int64_t lo) {
    std::vector<std::pair<int64_t, int64_t>> c = covered;
    std::sort(c.begin(), c.end());
    int64_t reached = lo;
    for (const auto& [a, b] : c) {
      if (a <= reached && b > reached) reached = b;
    }
    return reached;
  };
  for (const std::string& peer : peers) {
    ASSIGN_OR_RETURN(shardformer::SafetensorsFile * f, files.Get(peer));
    for (const auto& [name, info] : f->tensors()) {
      const std::optional<int64_t> at = PieceOffset(name, prefix);
      if (!at.has_value()) continue;
      int64_t length = 1;
      for (int64_t d : info.shape) length *= d;  // bounded by the file's size (validated on open)
      if (*at > std::numeric_limits<int64_t>::max() - length) {
        return absl::InvalidArgumentError(absl::StrCat(peer, ": ", name, " overflows its parameter"));
      }
      const int64_t lo = std::max(begin, *at), hi = std::min(end, *at + length);
      if (lo >= hi || reached_from(lo) >= hi) continue;
      ASSIGN_OR_RETURN(Tensor piece, f->Read(name));
      ASSIGN_OR_RETURN(Tensor flat, piece.Reshape({piece.numel()}));
      ASSIGN_OR_RETURN(Tensor part, flat.Narrow(0, lo - *at, hi - lo));
      ASSIGN_OR_RETURN(Tensor into, target.Narrow(0, lo - begin, hi - lo));
      RETURN_IF_ERROR(into.CopyFrom(part));
      covered.emplace_back(lo, hi);
    }
  }
  const int64_t reached = reached_from(begin);
  if (reached < end) {
    return absl::InvalidArgumentError(absl::StrCat(files.dir(), " lacks ", whose, " ", prefix, " from element ",
                                                   reached, " (of [", begin, ", ", end, "))"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<Resumed> RestoreTrainingCheckpoint(const std::string& checkpoint, shardformer::ShardedModel& model,
                                                  Optimizer& optimizer) {
  return RestoreTrainingCheckpoint(checkpoint, std::vector<shardformer::ShardedModel*>{&model}, optimizer);
}

absl::StatusOr<Resumed> RestoreTrainingCheckpoint(const std::string& checkpoint,
                                                  const std::vector<shardformer::ShardedModel*>& chunks,
                                                  Optimizer& optimizer, bool parameters_only) {
  if (chunks.empty()) return absl::InvalidArgumentError("a restore into no model chunk");
  shardformer::ShardedModel& model = *chunks.front();
  ProcessGroup* pg = model.process_group();
  ASSIGN_OR_RETURN(Json state, ReadJson(checkpoint + "/" + kState));
  const std::string where = absl::StrCat(checkpoint, "/", kState);
  // Any data_parallel_size resumes (ZeRO's partitions are resharded below);
  // the rest of the layout must be the one written.
  const v1::ShardConfig& layout = model.shard_config().layout;
  ASSIGN_OR_RETURN(const int32_t saved_dp, SavedDataParallelSize(state, where));
  Json saved = state["layout"];
  Json now = LayoutJson(layout);
  v1::ShardConfig saved_layout = layout;
  saved_layout.set_data_parallel_size(saved_dp);
  saved.erase("data_parallel_size");
  now.erase("data_parallel_size");
  if (saved != now) {
    return absl::FailedPreconditionError(absl::StrCat(
        checkpoint, " was written at layout ", state["layout"].dump(), "; resume at that layout (at any ",
        "data_parallel_size), or consolidate it (coloctl consolidate) and train from the consolidated model"));
  }
  ASSIGN_OR_RETURN(const shardformer::CheckpointIndex index, shardformer::ReadCheckpointIndex(checkpoint));
  CheckpointFiles files(checkpoint);
  NoGradScope no_grad;
  std::vector<shardformer::NamedParam> params;
  for (shardformer::ShardedModel* chunk : chunks) {
    for (shardformer::NamedParam& p : chunk->Parameters()) params.push_back(std::move(p));
  }
  for (const shardformer::NamedParam& p : params) {
    const ColoParameter& param = p.bound.param;
    auto entry = index.tensors.find(p.name);
    if (entry == index.tensors.end()) {
      return absl::InvalidArgumentError(absl::StrCat(checkpoint, " has no parameter ", p.name));
    }
    ASSIGN_OR_RETURN(Block mine, LocalBlock(param.spec(), param.global_shape(), pg));
    std::string from;
    for (const shardformer::CheckpointBlock& b : entry->second.blocks) {
      if (b.starts == mine.starts && b.lengths == mine.lengths) from = b.file;
    }
    if (from.empty()) return absl::InvalidArgumentError(absl::StrCat(checkpoint, " lacks this rank's ", p.name));
    ASSIGN_OR_RETURN(shardformer::SafetensorsFile * f, files.Get(from));
    ASSIGN_OR_RETURN(Tensor value, f->Read(p.name));
    Tensor local = param.local();
    RETURN_IF_ERROR(local.CopyFrom(value));
  }
  if (parameters_only) return ReadTrainState(checkpoint);
  // Each state tensor of this rank's slices is put together from the pieces
  // the ranks holding the same shards wrote (whole, or ZeRO's partitions at
  // any dp size).
  ASSIGN_OR_RETURN(const std::vector<std::string> peers, PeerOptimFiles(saved_layout, pg));
  for (const Optimizer::StateTensor& t : optimizer.State()) {
    ASSIGN_OR_RETURN(Tensor target, t.value.Reshape({t.value.numel()}));
    RETURN_IF_ERROR(
        AssembleState(files, peers, absl::StrCat(t.param->name, ".", t.state), t.offset, target, "this rank's"));
  }
  ASSIGN_OR_RETURN(const int64_t optimizer_steps, CountField(state, "optimizer_steps", where));
  optimizer.set_steps(optimizer_steps);
  return ReadTrainState(checkpoint);
}

absl::Status ConsolidateTrainingCheckpoint(const std::string& dir, const std::string& out_dir,
                                           std::optional<DType> dtype) {
  // The parameters as saved where no other dtype is asked for, or where the
  // directory is no training checkpoint.
  if (!dtype.has_value() || !shardformer::IsModelDType(*dtype) || !IsRegularFile(absl::StrCat(dir, "/", kState))) {
    return shardformer::ConsolidateCheckpoint(dir, out_dir, dtype);
  }
  const absl::StatusOr<Resumed> state = ReadTrainState(dir);
  // A state that does not read (a checkpoint a resume passes over, salvaged)
  // leaves the index to say whether the run was f32; if not, never a silent
  // widening of what may be a bf16 run's rounding.
  if (!state.ok()) {
    const absl::StatusOr<shardformer::CheckpointIndex> index = shardformer::ReadCheckpointIndex(dir);
    bool f32 = index.ok() && !index->tensors.empty();
    if (index.ok()) {
      for (const auto& [name, t] : index->tensors) f32 = f32 && t.dtype == "F32";
    }
    if (f32) return shardformer::ConsolidateCheckpoint(dir, out_dir, dtype);
    return absl::FailedPreconditionError(
        absl::StrCat(state.status().message(),
                     ": the run's precision, and so whether its optimizer files hold the f32 master "
                     "weights a ",
                     DTypeName(*dtype),
                     " model is made of, is not known; --dtype auto "
                     "writes its parameters as saved"));
  }
  // (Inferred from the index where the state records none: ReadTrainState.)
  const DType saved = state->param_dtype.value_or(DType::kF32);
  if (*dtype == saved || saved == DType::kF32) return shardformer::ConsolidateCheckpoint(dir, out_dir, dtype);
  // Every file opens and validates before anything is written.
  if (const absl::Status valid = Validate(dir); !valid.ok()) {
    if (!absl::StrContains(valid.message(), "optim-rank-")) return valid;
    return absl::Status(valid.code(),
                        absl::StrCat(valid.message(), ": the ", DTypeName(*dtype), " model of a ", DTypeName(saved),
                                     " run is made of the f32 master weights its optimizer files hold; without "
                                     "them, --dtype auto writes its parameters as saved"));
  }
  // The mesh it was written at (the index's), to find each block's rank's
  // dp peers: the ranks whose other coordinates are its own, which hold
  // the pieces of its master weights under ZeRO.
  ASSIGN_OR_RETURN(const shardformer::CheckpointIndex index, shardformer::ReadCheckpointIndex(dir));
  std::vector<MeshAxis> axes;
  for (const auto& [name, size] : index.mesh) axes.push_back(MeshAxis{name, size});
  absl::StatusOr<DeviceMesh> mesh = DeviceMesh::Create(axes);
  if (!mesh.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, "/", shardformer::kCheckpointIndex, ": its mesh: ", mesh.status().message()));
  }
  const int world = mesh->world_size();
  const std::vector<int> dp_axes = mesh->AxisIndices("dp").value_or(std::vector<int>{});
  std::map<std::string, int> rank_of;
  for (int r = 0; r < world; ++r) rank_of[absl::StrFormat("rank-%05d-of-%05d.safetensors", r, world)] = r;
  CheckpointFiles files(dir);
  const shardformer::BlockSource masters =
      [&](const std::string& param, const shardformer::CheckpointBlock& b) -> absl::StatusOr<std::optional<Tensor>> {
    auto at = rank_of.find(b.file);
    if (at == rank_of.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat(dir, ": ", b.file, " is not a rank file of its ", world, " ranks"));
    }
    const std::vector<std::string> peers = OptimFilesOfShard(*mesh, dp_axes, mesh->Coordinates(at->second));
    int64_t elements = 1;
    for (int64_t l : b.lengths) elements *= l;  // (the index's blocks were checked against their files)
    ASSIGN_OR_RETURN(Tensor master, Tensor::Zeros({elements}, DType::kF32));
    RETURN_IF_ERROR(AssembleState(files, peers, param + ".master", 0, master, absl::StrCat(b.file, "'s")));
    return master.Reshape(Shape(b.lengths.begin(), b.lengths.end()));
  };
  return shardformer::ConsolidateCheckpoint(dir, out_dir, dtype, masters);
}

}  // namespace colod::train
