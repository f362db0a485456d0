#include "worker/shardformer/checkpoint.h"

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/int_math.h"
#include "common/json.h"
#include "common/status_macros.h"
#include "common/text.h"
#include "nlohmann/json.hpp"
#include "spec/job_validation.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/shardformer/safetensors.h"
#include "worker/tensor/dtype.h"

namespace colod::shardformer {
namespace {

using Json = nlohmann::json;

std::string RankFile(int rank, int world) { return absl::StrFormat("rank-%05d-of-%05d.safetensors", rank, world); }

// Whether `rank` writes a parameter of `spec`: the rank at coordinate 0 of
// every mesh axis the parameter is not split over. Pipeline stages hold
// different parameters, so the pp axis counts as split (IndexOf asks only
// the ranks of the parameter's own stage).
absl::StatusOr<bool> Owns(const DistSpec& spec, const DeviceMesh& mesh, int rank) {
  std::set<int> split;
  if (auto pp = mesh.AxisIndices("pp"); pp.ok()) split.insert(pp->begin(), pp->end());
  for (const auto& [axis, p] : spec.placements()) {
    if (p.kind == Placement::Kind::kPartial) {
      return absl::FailedPreconditionError(absl::StrCat("a parameter is a partial sum over ", axis));
    }
    if (p.kind != Placement::Kind::kShard) continue;
    ASSIGN_OR_RETURN(std::vector<int> indices, mesh.AxisIndices(axis));
    split.insert(indices.begin(), indices.end());
  }
  const std::vector<int> coords = mesh.Coordinates(rank);
  for (size_t i = 0; i < coords.size(); ++i) {
    if (!split.count(static_cast<int>(i)) && coords[i] != 0) return false;
  }
  return true;
}

Json PlacementsJson(const DistSpec& spec) {
  Json out = Json::array();
  for (const auto& [axis, p] : spec.placements()) {
    Json j = {{"axis", axis}};
    switch (p.kind) {
      case Placement::Kind::kReplicate: j["kind"] = "replicate"; break;
      case Placement::Kind::kShard:
        j["kind"] = "shard";
        j["dims"] = p.dims;
        j["num_partitions"] = p.num_partitions;
        break;
      case Placement::Kind::kPartial: j["kind"] = "partial"; break;
    }
    out.push_back(j);
  }
  return out;
}

// Whether `rank` is on the pipeline stage of `me` (every rank, without stages).
bool SameStage(const DeviceMesh& mesh, int rank, int me) {
  auto pp = mesh.AxisIndices("pp");
  if (!pp.ok()) return true;
  return mesh.Coordinates(rank)[(*pp)[0]] == mesh.Coordinates(me)[(*pp)[0]];
}

// The index of this rank's stage's parameters (every parameter, without
// stages); a stage's mirror of another's table is left to its owner.
// `saved`: the dtype every part was written in where not the parameters'
// (RankParts::dtype).
absl::StatusOr<Json> IndexOf(ShardedModel& model, std::optional<DType> saved) {
  const DeviceMesh& mesh = model.process_group()->mesh();
  const int world = mesh.world_size(), me = model.process_group()->rank();
  Json axes = Json::array();
  for (const MeshAxis& a : mesh.axes()) axes.push_back({{"name", a.name}, {"size", a.size}});
  const v1::ShardConfig& layout = model.shard_config().layout;
  Json index = {
      {"format", kCheckpointFormat},
      {"model_type", model.config().model_type},
      {"world_size", world},
      {"mesh", axes},
      {"shard_config",
       {{"tensor_parallel_size", layout.tensor_parallel_size()},
        {"data_parallel_size", layout.data_parallel_size()},
        {"tensor_parallel_mode", v1::TensorParallelMode_Name(layout.tensor_parallel_mode())},
        {"depth", layout.depth()},
        {"sequence_parallel", layout.sequence_parallel()},
        {"pipeline_parallel_size", std::max(1, layout.pipeline_parallel_size())}}},
  };
  Json tensors = Json::object();
  for (const NamedParam& p : model.Parameters()) {
    if (p.mirror) continue;
    const ColoParameter& param = p.bound.param;
    const HfTensor& hf = p.bound.hf;
    Json blocks = Json::array();
    for (int r = 0; r < world; ++r) {
      if (!SameStage(mesh, r, me)) continue;
      ASSIGN_OR_RETURN(bool owns, Owns(param.spec(), mesh, r));
      if (!owns) continue;
      ASSIGN_OR_RETURN(Block b, LocalBlock(param.spec(), param.global_shape(), mesh, r));
      blocks.push_back({{"file", RankFile(r, world)}, {"starts", b.starts}, {"lengths", b.lengths}});
    }
    tensors[p.name] = {
        {"global_shape", param.global_shape()},
        {"dtype", SafetensorsDTypeName(saved.value_or(param.local().dtype()))},
        {"dist_spec", param.spec().ToString()},
        {"placements", PlacementsJson(param.spec())},
        {"hf",
         {{"name", hf.name},
          {"shape", hf.shape},
          {"transpose", hf.transpose},
          {"narrow_dim", hf.narrow_dim},
          {"narrow_start", hf.narrow_start},
          {"valid_rows", hf.valid_rows}}},
        {"blocks", blocks},
    };
  }
  index["tensors"] = tensors;
  return index;
}

absl::Status Damaged(const std::string& dir, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("checkpoint ", dir, ": ", what));
}

}  // namespace

absl::Status SaveShardedCheckpoint(ShardedModel& model, const std::string& dir) {
  return SaveShardedCheckpoint(std::vector<ShardedModel*>{&model}, dir);
}

absl::Status SaveShardedCheckpoint(const std::vector<ShardedModel*>& chunks, const std::string& dir) {
  return SaveShardedCheckpoint(chunks, dir, nullptr);
}

absl::Status SaveShardedCheckpoint(const std::vector<ShardedModel*>& chunks, const std::string& dir,
                                   const PartValues* values) {
  if (chunks.empty()) return absl::InvalidArgumentError("a checkpoint of no model chunk");
  // Every rank learns whether every rank took its part (weights that are
  // not finite fail on the ranks that own them) before any writes.
  absl::StatusOr<RankParts> parts = TakeRankParts(chunks, values);
  RETURN_IF_ERROR(AgreeOverMesh(
      *chunks.front()->process_group(), parts.status(), chunks.front()->shard_config().device,
      absl::StrCat("the checkpoint in ", dir, " was not saved: another rank could not take its part of the weights")));
  return SaveShardedCheckpoint(chunks, *std::move(parts), dir);
}

absl::StatusOr<RankParts> TakeRankParts(const std::vector<ShardedModel*>& chunks, const PartValues* values) {
  if (chunks.empty()) return absl::InvalidArgumentError("a checkpoint of no model chunk");
  ProcessGroup* pg = chunks.front()->process_group();
  const DeviceMesh& mesh = pg->mesh();
  const int rank = pg->rank();
  NoGradScope no_grad;
  RankParts mine;
  if (values != nullptr) mine.dtype = values->dtype;
  // This rank's part of `p`, its value `value`, copied to the host.
  const auto take = [&](const NamedParam& p, const Tensor& value) -> absl::Status {
    if (values != nullptr && (value.dtype() != values->dtype || value.shape() != p.bound.param.local().shape())) {
      return absl::InternalError(absl::StrCat("the value written of ", p.name, " is ", DTypeName(value.dtype()),
                                              ShapeToString(value.shape()), ", not ", DTypeName(values->dtype),
                                              ShapeToString(p.bound.param.local().shape())));
    }
    ASSIGN_OR_RETURN(Tensor host, value.To(Device::Cpu()));
    Tensor part = host.Contiguous();  // on the host: fails only without host memory
    if (const int64_t at = FirstNonFinite(part.dtype(), part.raw_data(), part.numel()); at >= 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the weights are not finite (parameter ", p.name, ", element ", at,
          " of this rank's part): training diverged, and nothing of this checkpoint is saved. Resume from an "
          "earlier checkpoint with a lower learning rate (lr), a longer warm-up (warmup_steps) or gradient "
          "clipping (clip_norm)"));
    }
    mine.tensors.emplace_back(p.name, std::move(part));
    return absl::OkStatus();
  };
  // With `values`, a part this rank cannot take fails the whole only once
  // every parameter's value was made: `of` may be collective, and the
  // rank's peers are making the next ones. (`of` itself fails alike on the
  // ranks it is collective over.)
  absl::Status first = absl::OkStatus();
  std::set<std::string> names;
  for (ShardedModel* chunk : chunks) {
    for (const NamedParam& p : chunk->Parameters()) {
      if (p.mirror) continue;  // the table's owner writes it (a rank may hold it and a mirror of it)
      if (!names.insert(p.name).second) return absl::InternalError(absl::StrCat("two parameters are named ", p.name));
      ASSIGN_OR_RETURN(bool owns, Owns(p.bound.param.spec(), mesh, rank));
      if (values == nullptr) {
        if (owns) RETURN_IF_ERROR(take(p, p.bound.param.local()));
        continue;
      }
      ASSIGN_OR_RETURN(const Tensor value, values->of(p, owns));
      if (owns && first.ok()) first = take(p, value);
    }
  }
  RETURN_IF_ERROR(first);
  return mine;
}

absl::Status SaveShardedCheckpoint(const std::vector<ShardedModel*>& chunks, RankParts parts, const std::string& dir) {
  if (chunks.empty()) return absl::InvalidArgumentError("a checkpoint of no model chunk");
  ShardedModel& model = *chunks.front();
  ProcessGroup* pg = model.process_group();
  const DeviceMesh& mesh = pg->mesh();
  const int rank = pg->rank(), world = mesh.world_size();
  // Each step's writes end in an agreement (AgreeOverMesh), not a plain
  // barrier: a rank that could not write fails with its own error, the
  // others with one that follows from it, and none returns (its caller
  // removing the directory, say) while another still writes there.
  const Device& device = model.shard_config().device;
  const std::string peer_failed =
      absl::StrCat("the checkpoint in ", dir, " was not saved: another rank could not write its part");
  absl::Status wrote = absl::OkStatus();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) wrote = absl::FailedPreconditionError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  NoGradScope no_grad;
  if (wrote.ok()) wrote = WriteSafetensors(absl::StrCat(dir, "/", RankFile(rank, world)), parts.tensors);
  RETURN_IF_ERROR(AgreeOverMesh(*pg, wrote, device, peer_failed));
  // Pipeline stages: each stage's first rank writes its stages' parts of
  // the index (one a virtual stage), which rank 0 joins.
  const int stages = std::max(1, model.shard_config().stage.count);
  const std::vector<int> coords = mesh.Coordinates(rank);
  auto pp_axis = mesh.AxisIndices("pp");
  bool stage_leader = true;
  for (size_t i = 0; i < coords.size(); ++i) {
    const bool is_pp = pp_axis.ok() && static_cast<int>(i) == (*pp_axis)[0];
    stage_leader = stage_leader && (is_pp || coords[i] == 0);
  }
  auto part = [&](int stage) { return absl::StrFormat("%s/index-stage-%05d.json", dir, stage); };
  if (stages > 1 && stage_leader) {
    for (ShardedModel* chunk : chunks) {
      absl::StatusOr<Json> fragment = IndexOf(*chunk, parts.dtype);
      wrote = fragment.ok() ? WriteFileAtomically(part(chunk->shard_config().stage.index), fragment->dump())
                            : fragment.status();
      if (!wrote.ok()) break;
    }
  }
  if (stages > 1) RETURN_IF_ERROR(AgreeOverMesh(*pg, wrote, device, peer_failed));
  // Rank 0 joins the index; the others wait for it in the last agreement.
  const auto join_index = [&]() -> absl::Status {
    ASSIGN_OR_RETURN(Json index, IndexOf(model, parts.dtype));
    for (int s = 1; s < stages; ++s) {
      ASSIGN_OR_RETURN(std::string text, ReadFileToString(part(s)));
      const Json fragment = ParseJson(text);
      if (fragment.is_discarded() || !fragment.contains("tensors") || !fragment["tensors"].is_object()) {
        return absl::InternalError(absl::StrCat(part(s), " is not a stage's index"));
      }
      for (const auto& [name, t] : fragment["tensors"].items()) index["tensors"][name] = t;
    }
    RETURN_IF_ERROR(WriteFileAtomically(dir + "/config.json", model.config().json));
    RETURN_IF_ERROR(WriteFileAtomically(absl::StrCat(dir, "/", kCheckpointIndex), index.dump(1)));
    for (int s = 0; s < stages && stages > 1; ++s) {
      std::error_code ec;
      std::filesystem::remove(part(s), ec);
    }
    return absl::OkStatus();
  };
  // The index exists when any rank returns OK.
  return AgreeOverMesh(*pg, rank == 0 ? join_index() : absl::OkStatus(), device,
                       absl::StrCat("the checkpoint in ", dir, " was not saved: rank 0 could not write its index"));
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> OpenCheckpointFile(const std::string& path) {
  ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsFile> f, SafetensorsFile::Open(path));
  if (!f->unreadable().empty()) {
    const auto& [name, dtype] = *f->unreadable().begin();
    return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", EscapedPrefix(name, kMaxUnreadTensorNameBytes),
                                                   "' is ", dtype, ", a dtype colod's checkpoints never hold"));
  }
  return f;
}

absl::StatusOr<std::optional<DType>> ParseModelDType(const std::string& name) {
  RETURN_IF_ERROR(CheckModelDType(name));  // one of spec's kModelDTypes
  if (name == "f32") return DType::kF32;
  if (name == "bf16") return DType::kBF16;
  if (name == "f16") return DType::kF16;
  return std::nullopt;  // "" or "auto"
}

bool IsModelDType(DType dtype) { return dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16; }

namespace {

// Hugging Face's name of a model dtype (config.json's torch_dtype).
const char* TorchDTypeName(DType dtype) {
  return dtype == DType::kBF16 ? "bfloat16" : dtype == DType::kF16 ? "float16" : "float32";
}

}  // namespace

absl::StatusOr<SafetensorsFile*> CheckpointFiles::Get(const std::string& name) {
  std::unique_ptr<SafetensorsFile>& f = files_[name];
  if (f == nullptr) {
    ASSIGN_OR_RETURN(f, OpenCheckpointFile(absl::StrCat(dir_, "/", name)));
  }
  return f.get();
}

absl::Status ConsolidateCheckpoint(const std::string& dir, const std::string& out_dir, std::optional<DType> dtype) {
  return ConsolidateCheckpoint(dir, out_dir, dtype, nullptr);
}

absl::Status ConsolidateCheckpoint(const std::string& dir, const std::string& out_dir, std::optional<DType> dtype,
                                   const BlockSource& source) {
  if (dtype.has_value() && !IsModelDType(*dtype)) {
    return absl::InvalidArgumentError("a model is written in f32, bf16 or f16");
  }
  // Both destinations before anything is read or written: never new weights
  // beside an old config.
  for (const char* name : {"/model.safetensors", "/config.json"}) RETURN_IF_ERROR(CheckReplaceable(out_dir + name));
  ASSIGN_OR_RETURN(const CheckpointIndex index, ReadCheckpointIndex(dir));
  ASSIGN_OR_RETURN(std::string config, ReadFileToString(dir + "/config.json"));
  CheckpointFiles files(dir);
  auto file = [&](const std::string& name) -> absl::StatusOr<SafetensorsFile*> {
    absl::StatusOr<SafetensorsFile*> f = files.Get(name);
    if (!f.ok()) return Damaged(dir, std::string(f.status().message()));
    return f;
  };
  // Every block as stored before any allocation: each block of a tensor in
  // a file of its own (a file holds one tensor of a name), so the index's
  // shapes, which its blocks tile (ParseCheckpointIndex), are backed by the
  // rank files' bytes, and the checkpoint tensors they fill can be no larger
  // than they are.
  int64_t parameter_elements = 0, hf_elements = 0;
  std::map<std::string, Shape> hf_shapes;
  std::map<std::string, std::set<DType>> hf_dtypes;  // of the blocks that fill each
  // The parameters that fill each checkpoint tensor, in the index's order.
  std::map<std::string, std::vector<const std::pair<const std::string, CheckpointTensor>*>> fill;
  for (const auto& entry : index.tensors) {
    const auto& [name, t] = entry;
    fill[t.hf.name].push_back(&entry);
    parameter_elements = CheckedAdd(parameter_elements, *CheckedProduct(t.global_shape)).value_or(INT64_MAX);
    auto [known, inserted] = hf_shapes.emplace(t.hf.name, t.hf.shape);
    if (inserted) {
      hf_elements = CheckedAdd(hf_elements, *CheckedProduct(t.hf.shape)).value_or(INT64_MAX);
    } else if (known->second != t.hf.shape) {
      return Damaged(dir, absl::StrCat(name, " and another parameter give ", t.hf.name, " two shapes"));
    }
    std::set<std::string> block_files;
    for (const CheckpointBlock& b : t.blocks) {
      if (!block_files.insert(b.file).second) {
        return Damaged(dir, absl::StrCat("two blocks of ", name, " name ", b.file, ", which holds one ", name));
      }
      ASSIGN_OR_RETURN(SafetensorsFile * f, file(b.file));
      if (!f->Has(name)) return Damaged(dir, absl::StrCat(b.file, " lacks ", name));
      ASSIGN_OR_RETURN(TensorInfo info, f->Info(name));
      if (info.shape != Shape(b.lengths.begin(), b.lengths.end())) {
        return Damaged(dir, absl::StrCat(b.file, " holds ", name, " as ", ShapeToString(info.shape),
                                         ", the index says ", ShapeToString(b.lengths)));
      }
      hf_dtypes[t.hf.name].insert(info.dtype);
    }
  }
  if (hf_elements > parameter_elements) {
    return Damaged(dir, absl::StrCat("its checkpoint tensors have ", hf_elements, " elements, more than the ",
                                     parameter_elements, " of the parameters that fill them"));
  }
  // Each checkpoint tensor is written in the dtype its parameters were
  // saved in where they agree (a bf16 run's model is bf16, half an F32's
  // bytes, and the same values), else F32. It is made when its turn comes
  // and dropped once written: the consolidation holds one tensor of the
  // model (and one parameter of it), not the whole model.
  std::vector<TensorLayout> layout;
  std::set<DType> written;
  for (const auto& [hf_name, shape] : hf_shapes) {
    const std::set<DType>& dtypes = hf_dtypes[hf_name];
    const DType one = dtypes.size() == 1 ? *dtypes.begin() : DType::kF32;
    layout.push_back({hf_name, dtype.value_or(one == DType::kBF16 || one == DType::kF16 ? one : DType::kF32), shape});
    written.insert(layout.back().dtype);
  }
  // The dtype to load it in: its tensors', or F32 for a model of several
  // (which loses none of them; a config's bf16 would round the F32 ones).
  // (Its keys in their order: ParseJson bounds the nesting first.) Newer
  // transformers write "dtype" and prefer it where both are: both say it.
  if (ParseJson(config).is_object()) {
    const char* load_as = TorchDTypeName(written.size() == 1 ? *written.begin() : DType::kF32);
    nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(config);
    ordered["torch_dtype"] = load_as;
    if (ordered.contains("dtype")) ordered["dtype"] = load_as;
    config = ordered.dump(2) + "\n";
  }
  const auto make = [&](size_t i) -> absl::StatusOr<Tensor> {
    const TensorLayout& l = layout[i];
    ASSIGN_OR_RETURN(Tensor out, Tensor::Zeros(l.shape, DType::kF32));
    int64_t filled = 0;  // elements written
    // Where in it each parameter went: (dim, start, length), dim -1 for the
    // whole. The elements filled adding up to the tensor's is not enough:
    // two pieces over one range leave another zero.
    std::vector<std::array<int64_t, 3>> ranges;
    for (const auto* entry : fill[l.name]) {
      const auto& [name, t] = *entry;
      ASSIGN_OR_RETURN(Tensor whole, Tensor::Zeros(t.global_shape, DType::kF32));
      for (const CheckpointBlock& b : t.blocks) {
        std::optional<Tensor> given;
        if (source) {
          ASSIGN_OR_RETURN(given, source(name, b));
          if (given.has_value() && given->shape() != Shape(b.lengths.begin(), b.lengths.end())) {
            return absl::InternalError(absl::StrCat("the block of ", name, " in ", b.file, " given is ",
                                                    ShapeToString(given->shape()), ", not ", ShapeToString(b.lengths)));
          }
        }
        Tensor piece;
        if (given.has_value()) {
          piece = *std::move(given);
        } else {
          ASSIGN_OR_RETURN(SafetensorsFile * f, file(b.file));
          ASSIGN_OR_RETURN(piece, f->Read(name));
        }
        Tensor dest = whole;
        for (size_t d = 0; d < t.global_shape.size(); ++d) {
          ASSIGN_OR_RETURN(dest, dest.Narrow(static_cast<int64_t>(d), b.starts[d], b.lengths[d]));
        }
        ASSIGN_OR_RETURN(piece, piece.ToDType(DType::kF32));
        RETURN_IF_ERROR(dest.CopyFrom(piece));
      }
      auto slice = LayerToHf(t.hf, whole);
      if (!slice.ok()) return Damaged(dir, absl::StrCat(name, ": ", slice.status().message()));
      const absl::Status placed = PlaceInHf(t.hf, *slice, out);
      if (!placed.ok()) return Damaged(dir, absl::StrCat(name, ": ", placed.message()));
      const std::array<int64_t, 3> range = {t.hf.narrow_dim, t.hf.narrow_dim >= 0 ? t.hf.narrow_start : 0,
                                            t.hf.narrow_dim >= 0 ? slice->shape()[t.hf.narrow_dim] : 0};
      for (const std::array<int64_t, 3>& other : ranges) {
        if (range[0] < 0 || other[0] != range[0] ||
            (other[1] < range[1] + range[2] && range[1] < other[1] + other[2])) {
          return Damaged(dir, absl::StrCat(name, ": its piece of ", l.name, " overlaps another's"));
        }
      }
      ranges.push_back(range);
      filled += slice->numel();
    }
    if (filled != out.numel()) {
      return Damaged(dir,
                     absl::StrCat("the parameters cover ", filled, " of the ", out.numel(), " elements of ", l.name));
    }
    if (l.dtype == DType::kF32) return out;
    ASSIGN_OR_RETURN(Tensor narrow, out.ToDType(l.dtype));
    // f16 holds up to 65504: a larger weight would become inf, which no
    // model colod writes holds (docs/TRAINING.md).
    if (const int64_t bad = FirstNonFinite(narrow.dtype(), narrow.raw_data(), narrow.numel()); bad >= 0) {
      return absl::FailedPreconditionError(absl::StrCat(l.name, " does not fit ", SafetensorsDTypeName(l.dtype),
                                                        ": element ", bad, " is ", out.ToFloats()[bad],
                                                        " (f16 holds up to 65504); write the model in f32 or bf16"));
    }
    return narrow;
  };
  // The directories of out_dir's path made here, one at a time: a failure
  // removes them again (deepest first, each only where still empty), and
  // never one that was there.
  std::vector<std::filesystem::path> made;
  std::error_code ec;
  std::filesystem::path at;
  for (const std::filesystem::path& part : std::filesystem::path(out_dir).lexically_normal()) {
    if (part.empty()) continue;
    at /= part;
    if (std::filesystem::create_directory(at, ec)) made.insert(made.begin(), at);
    if (ec) {
      const std::string why = ec.message();
      for (const std::filesystem::path& d : made) std::filesystem::remove(d, ec);
      return absl::FailedPreconditionError(absl::StrCat("cannot create ", at.string(), ": ", why));
    }
  }
  // config.json goes in place just before the model does (the model's
  // before_rename): a config that cannot be written leaves the model there
  // as it was (a restart's earlier one), and a model never arrives without
  // its config.
  const absl::Status s =
      WriteSafetensorsStreamed(out_dir + "/model.safetensors", layout, make, {{"format", "pt"}},
                               [&] { return WriteFileAtomically(out_dir + "/config.json", config); });
  if (!s.ok()) {
    for (const std::filesystem::path& d : made) std::filesystem::remove(d, ec);
  }
  return s;
}

}  // namespace colod::shardformer
