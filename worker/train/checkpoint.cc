#include "worker/train/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/shardformer/checkpoint.h"
#include "worker/shardformer/safetensors.h"

namespace colod::train {

std::string StepDir(const std::string& dir, int64_t step) { return absl::StrFormat("%s/step-%06d", dir, step); }
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
  }
  return j;
}

// An integer field of `j` (read from `where`); INVALID_ARGUMENT for a
// missing one or another type (a damaged file, never an exception).
absl::StatusOr<int64_t> IntField(const Json& j, const char* name, const std::string& where) {
  if (!j.contains(name) || !j[name].is_number_integer()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", name, " is not an integer"));
  }
  return j[name].get<int64_t>();
}

absl::StatusOr<Json> ReadJson(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path));
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON object"));
  return j;
}

// Every file of a step directory opens and validates.
absl::Status Validate(const std::string& step_dir) {
  ASSIGN_OR_RETURN(Json state, ReadJson(step_dir + "/" + kState));
  RETURN_IF_ERROR(shardformer::ReadCheckpointIndex(step_dir).status());
  const std::string where = absl::StrCat(step_dir, "/", kState);
  RETURN_IF_ERROR(IntField(state, "step", where).status());
  ASSIGN_OR_RETURN(const int64_t world, IntField(state, "world_size", where));
  if (world < 1 || world > kMaxWorldSize) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": world_size ", world));
  }
  for (int r = 0; r < world; ++r) {
    for (const std::string& name :
         {absl::StrFormat("rank-%05d-of-%05d.safetensors", r, world), OptimFile(r, world)}) {
      auto f = shardformer::SafetensorsFile::Open(step_dir + "/" + name);
      if (!f.ok()) return f.status();
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status SaveTrainingCheckpoint(shardformer::ShardedModel& model, Optimizer& optimizer, const std::string& dir,
                                    int64_t step, uint64_t seed) {
  ProcessGroup* pg = model.process_group();
  const int rank = pg->rank(), world = pg->mesh().world_size();
  const std::string final_dir = StepDir(dir, step), tmp = final_dir + ".tmp";
  std::error_code ec;
  if (rank == 0) {
    fs::remove_all(tmp, ec);  // a crashed attempt's leftovers
    fs::create_directories(tmp, ec);
    if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create ", tmp, ": ", ec.message()));
  }
  RETURN_IF_ERROR(pg->Barrier());
  RETURN_IF_ERROR(shardformer::SaveShardedCheckpoint(model, tmp));
  std::vector<std::pair<std::string, Tensor>> state;
  for (auto& [name, t] : optimizer.State()) {
    ASSIGN_OR_RETURN(Tensor host, t.To(Device::Cpu()));
    state.emplace_back(name, host.Contiguous());
  }
  RETURN_IF_ERROR(shardformer::WriteSafetensors(absl::StrCat(tmp, "/", OptimFile(rank, world)), state));
  RETURN_IF_ERROR(pg->Barrier());
  if (rank == 0) {
    const Json j = {{"step", step},
                    {"optimizer_steps", optimizer.steps()},
                    {"seed", seed},
                    {"world_size", world},
                    {"model_type", model.config().model_type},
                    {"layout", LayoutJson(model.shard_config().layout)}};
    RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(tmp, "/", kState), j.dump(1)));
    fs::remove_all(final_dir, ec);
    fs::rename(tmp, final_dir, ec);
    if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot rename ", tmp, ": ", ec.message()));
  }
  return pg->Barrier();
}

absl::StatusOr<std::string> LatestCheckpoint(const std::string& dir, std::vector<std::string>* skipped) {
  std::vector<std::string> steps;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && absl::StartsWith(name, "step-") && !absl::EndsWith(name, ".tmp")) {
      steps.push_back(name);
    }
  }
  if (ec) return absl::NotFoundError(absl::StrCat("cannot list ", dir, ": ", ec.message()));
  std::sort(steps.rbegin(), steps.rend());  // zero-padded: newest first
  for (const std::string& s : steps) {
    const absl::Status valid = Validate(dir + "/" + s);
    if (valid.ok()) return dir + "/" + s;
    if (skipped != nullptr) skipped->push_back(absl::StrCat(s, ": ", valid.message()));
  }
  return absl::NotFoundError(absl::StrCat("no complete checkpoint in ", dir));
}

absl::StatusOr<Resumed> ReadTrainState(const std::string& checkpoint) {
  ASSIGN_OR_RETURN(Json state, ReadJson(checkpoint + "/" + kState));
  const std::string where = absl::StrCat(checkpoint, "/", kState);
  Resumed r;
  ASSIGN_OR_RETURN(r.step, IntField(state, "step", where));
  if (!state.contains("seed") || !state["seed"].is_number_unsigned()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": seed is not an unsigned integer"));
  }
  r.seed = state["seed"].get<uint64_t>();
  return r;
}

absl::StatusOr<Resumed> RestoreTrainingCheckpoint(const std::string& checkpoint, shardformer::ShardedModel& model,
                                                  Optimizer& optimizer) {
  ProcessGroup* pg = model.process_group();
  ASSIGN_OR_RETURN(Json state, ReadJson(checkpoint + "/" + kState));
  if (state["layout"] != LayoutJson(model.shard_config().layout)) {
    return absl::FailedPreconditionError(absl::StrCat(
        checkpoint, " was written at layout ", state["layout"].dump(), "; resume at that layout, or consolidate it ",
        "(coloctl consolidate) and train from the consolidated model"));
  }
  ASSIGN_OR_RETURN(const shardformer::CheckpointIndex index, shardformer::ReadCheckpointIndex(checkpoint));
  std::map<std::string, std::unique_ptr<shardformer::SafetensorsFile>> files;
  auto file = [&](const std::string& name) -> absl::StatusOr<shardformer::SafetensorsFile*> {
    auto& f = files[name];
    if (f == nullptr) {
      ASSIGN_OR_RETURN(f, shardformer::SafetensorsFile::Open(checkpoint + "/" + name));
    }
    return f.get();
  };
  NoGradScope no_grad;
  for (const shardformer::NamedParam& p : model.Parameters()) {
    const ColoParameter& param = p.bound.param;
    auto entry = index.tensors.find(p.name);
    if (entry == index.tensors.end()) {
      return absl::InvalidArgumentError(absl::StrCat(checkpoint, " has no parameter ", p.name));
    }
    ASSIGN_OR_RETURN(Block mine, LocalBlock(param.spec(), param.global_shape(), pg));
    std::string where;
    for (const shardformer::CheckpointBlock& b : entry->second.blocks) {
      if (b.starts == mine.starts && b.lengths == mine.lengths) where = b.file;
    }
    if (where.empty()) return absl::InvalidArgumentError(absl::StrCat(checkpoint, " lacks this rank's ", p.name));
    ASSIGN_OR_RETURN(shardformer::SafetensorsFile * f, file(where));
    ASSIGN_OR_RETURN(Tensor value, f->Read(p.name));
    Tensor local = param.local();
    RETURN_IF_ERROR(local.CopyFrom(value));
  }
  ASSIGN_OR_RETURN(shardformer::SafetensorsFile * optim, file(OptimFile(pg->rank(), pg->mesh().world_size())));
  for (auto& [name, t] : optimizer.State()) {
    ASSIGN_OR_RETURN(Tensor value, optim->Read(name));
    RETURN_IF_ERROR(t.CopyFrom(value));
  }
  const std::string where = absl::StrCat(checkpoint, "/", kState);
  ASSIGN_OR_RETURN(const int64_t optimizer_steps, IntField(state, "optimizer_steps", where));
  optimizer.set_steps(optimizer_steps);
  return ReadTrainState(checkpoint);
}

}  // namespace colod::train
