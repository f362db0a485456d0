#include "worker/shardformer/checkpoint_index.h"

#include <algorithm>
#include <optional>
#include <utility>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/int_math.h"
#include "common/json.h"
#include "common/limits.h"
#include "common/status_macros.h"
#include "common/text.h"
#include "kernels/types.h"
#include "nlohmann/json.hpp"

namespace colod::shardformer {
namespace {

using Json = nlohmann::json;

// Every field is read through these: a field of the wrong type is an error,
// never an exception.
class Reader {
 public:
  explicit Reader(absl::string_view where) : where_(where) {}

  absl::Status Error(absl::string_view what) const { return absl::InvalidArgumentError(absl::StrCat(where_, ": ", what)); }

  absl::StatusOr<const Json*> Field(const Json& j, const char* name, absl::string_view of) const {
    if (!j.is_object() || !j.contains(name)) return Error(absl::StrCat(of, " has no ", name));
    return &j[name];
  }
  absl::StatusOr<std::string> String(const Json& j, const char* name, absl::string_view of) const {
    ASSIGN_OR_RETURN(const Json* f, Field(j, name, of));
    if (!f->is_string()) return Error(absl::StrCat(of, ".", name, " is not a string"));
    return f->get<std::string>();
  }
  absl::StatusOr<int64_t> Int(const Json& j, const char* name, absl::string_view of) const {
    ASSIGN_OR_RETURN(const Json* f, Field(j, name, of));
    if (!f->is_number_integer()) return Error(absl::StrCat(of, ".", name, " is not an integer"));
    if (f->is_number_unsigned() && f->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return Error(absl::StrCat(of, ".", name, " is out of range"));
    }
    return f->get<int64_t>();
  }
  absl::StatusOr<bool> Bool(const Json& j, const char* name, absl::string_view of) const {
    ASSIGN_OR_RETURN(const Json* f, Field(j, name, of));
    if (!f->is_boolean()) return Error(absl::StrCat(of, ".", name, " is not a boolean"));
    return f->get<bool>();
  }
  // A list of at most kernels::kMaxDims non-negative integers.
  absl::StatusOr<std::vector<int64_t>> Dims(const Json& j, const char* name, absl::string_view of) const {
    ASSIGN_OR_RETURN(const Json* f, Field(j, name, of));
    if (!f->is_array() || f->size() > static_cast<size_t>(kernels::kMaxDims)) {
      return Error(absl::StrCat(of, ".", name, " is not a list of at most ", kernels::kMaxDims, " integers"));
    }
    std::vector<int64_t> out;
    for (const Json& d : *f) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0 ||
          (d.is_number_unsigned() && d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))) {
        return Error(absl::StrCat(of, ".", name, " holds something other than a non-negative integer"));
      }
      out.push_back(d.get<int64_t>());
    }
    return out;
  }
  // Dims whose bytes, in the widest dtype, fit int64 (as tensors' must).
  absl::StatusOr<Shape> ShapeOf(const Json& j, const char* name, absl::string_view of) const {
    ASSIGN_OR_RETURN(Shape s, Dims(j, name, of));
    if (!CheckedBytes(s, 8).has_value()) {
      return Error(absl::StrCat(of, ".", name, " ", ShapeToString(s), " is too large"));
    }
    return s;
  }

 private:
  const std::string where_;
};

// A tensor name as colod writes them (its parameters' and Hugging Face's):
// printable ASCII, 1 to kMaxIndexNameBytes bytes. Any other is a damaged
// index's, refused before an error could quote it.
constexpr size_t kMaxIndexNameBytes = 1024;
bool PlainTensorName(absl::string_view name) {
  return !name.empty() && name.size() <= kMaxIndexNameBytes &&
         absl::c_all_of(name, [](char c) { return c >= 0x20 && c < 0x7f; });
}
std::string NotPlain(absl::string_view name) {
  return absl::StrCat("'", EscapedPrefix(name, 256), "' is not a tensor name colod writes (printable ASCII, 1 to ",
                      kMaxIndexNameBytes, " bytes)");
}

absl::StatusOr<HfTensor> ParseHf(const Reader& r, const Json& h, const std::string& of) {
  HfTensor hf;
  ASSIGN_OR_RETURN(hf.name, r.String(h, "name", of));
  if (!PlainTensorName(hf.name)) return r.Error(absl::StrCat(of, ".name: ", NotPlain(hf.name)));
  ASSIGN_OR_RETURN(hf.shape, r.ShapeOf(h, "shape", of));
  ASSIGN_OR_RETURN(hf.transpose, r.Bool(h, "transpose", of));
  ASSIGN_OR_RETURN(hf.narrow_dim, r.Int(h, "narrow_dim", of));
  ASSIGN_OR_RETURN(hf.narrow_start, r.Int(h, "narrow_start", of));
  ASSIGN_OR_RETURN(hf.valid_rows, r.Int(h, "valid_rows", of));
  if (hf.narrow_dim < -1 || hf.narrow_dim >= static_cast<int64_t>(hf.shape.size()) || hf.narrow_start < 0 ||
      (hf.narrow_dim >= 0 && hf.narrow_start > hf.shape[hf.narrow_dim]) || hf.valid_rows < -1) {
    return r.Error(absl::StrCat(of, " (narrow_dim ", hf.narrow_dim, ", narrow_start ", hf.narrow_start,
                                ", valid_rows ", hf.valid_rows, ") does not fit the shape ",
                                ShapeToString(hf.shape)));
  }
  return hf;
}

// The blocks tile the tensor, as the blocks of a distributed spec do:
// along each dim their intervals partition [0, size), and no two blocks are
// the same cell of the grid those partitions make. With ParseTensor's
// element count, every element then lies in exactly one block. Overlapping
// blocks whose sizes add up to the tensor's (two halves of the same rows, a
// gap elsewhere) would leave a part of the tensor unwritten, zeros a
// consolidation would pass on as weights.
absl::Status CheckTiling(const Reader& r, const CheckpointTensor& t, const std::string& of) {
  const size_t n = t.blocks.size(), dims = t.global_shape.size();
  std::vector<std::vector<size_t>> cells(n, std::vector<size_t>(dims));
  for (size_t d = 0; d < dims; ++d) {
    std::vector<std::pair<int64_t, int64_t>> intervals;  // (start, length)
    intervals.reserve(n);
    for (const CheckpointBlock& b : t.blocks) intervals.emplace_back(b.starts[d], b.lengths[d]);
    std::sort(intervals.begin(), intervals.end());
    intervals.erase(std::unique(intervals.begin(), intervals.end()), intervals.end());
    int64_t at = 0;
    for (const auto& [start, length] : intervals) {
      if (start != at) {
        return r.Error(absl::StrCat("the blocks of ", of, " do not tile its shape ", ShapeToString(t.global_shape),
                                    ": along dim ", d, " one starts at ", start, " where ",
                                    start < at ? "another runs to " : "the ones before end at ", at));
      }
      at = start + length;  // inside the shape (ParseTensor)
    }
    if (at != t.global_shape[d]) {
      return r.Error(absl::StrCat("the blocks of ", of, " do not tile its shape ", ShapeToString(t.global_shape),
                                  ": along dim ", d, " they end at ", at));
    }
    for (size_t i = 0; i < n; ++i) {
      const std::pair<int64_t, int64_t> mine(t.blocks[i].starts[d], t.blocks[i].lengths[d]);
      cells[i][d] = static_cast<size_t>(std::lower_bound(intervals.begin(), intervals.end(), mine) - intervals.begin());
    }
  }
  std::sort(cells.begin(), cells.end());
  if (std::adjacent_find(cells.begin(), cells.end()) != cells.end()) {
    return r.Error(absl::StrCat("two blocks of ", of, " hold the same part of it"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CheckpointTensor> ParseTensor(const Reader& r, const Json& t, const std::string& name) {
  const std::string of = absl::StrCat("tensor ", name);
  CheckpointTensor out;
  ASSIGN_OR_RETURN(out.global_shape, r.ShapeOf(t, "global_shape", of));
  ASSIGN_OR_RETURN(out.dtype, r.String(t, "dtype", of));
  if (t.contains("dist_spec")) {
    ASSIGN_OR_RETURN(out.dist_spec, r.String(t, "dist_spec", of));
  }
  ASSIGN_OR_RETURN(const Json* h, r.Field(t, "hf", of));
  ASSIGN_OR_RETURN(out.hf, ParseHf(r, *h, absl::StrCat(of, ".hf")));
  ASSIGN_OR_RETURN(const Json* blocks, r.Field(t, "blocks", of));
  if (!blocks->is_array() || blocks->empty() || blocks->size() > static_cast<size_t>(kMaxWorldSize)) {
    return r.Error(absl::StrCat(of, ".blocks is not a list of 1 to ", kMaxWorldSize, " blocks"));
  }
  const int64_t elements = *CheckedProduct(out.global_shape);  // ShapeOf checked it
  int64_t covered = 0;
  for (const Json& b : *blocks) {
    CheckpointBlock block;
    ASSIGN_OR_RETURN(block.file, r.String(b, "file", of));
    if (!IsPlainFileName(block.file)) {
      return r.Error(absl::StrCat(of, " names the file '", EscapedPrefix(block.file, 256),
                                  "'; block files must sit beside the index"));
    }
    ASSIGN_OR_RETURN(block.starts, r.Dims(b, "starts", of));
    ASSIGN_OR_RETURN(block.lengths, r.Dims(b, "lengths", of));
    if (block.starts.size() != out.global_shape.size() || block.lengths.size() != out.global_shape.size()) {
      return r.Error(absl::StrCat("a block of ", of, " does not have its ", out.global_shape.size(), " dims"));
    }
    for (size_t d = 0; d < out.global_shape.size(); ++d) {
      const std::optional<int64_t> end = CheckedAdd(block.starts[d], block.lengths[d]);
      if (!end.has_value() || *end > out.global_shape[d]) {
        return r.Error(absl::StrCat("a block of ", of, " lies outside its shape ", ShapeToString(out.global_shape)));
      }
    }
    // Inside the global shape, so its product cannot overflow.
    const std::optional<int64_t> sum = CheckedAdd(covered, *CheckedProduct(block.lengths));
    if (!sum.has_value() || *sum > elements) {
      return r.Error(absl::StrCat("the blocks of ", of, " hold more than its ", elements, " elements"));
    }
    covered = *sum;
    out.blocks.push_back(std::move(block));
  }
  if (covered != elements) {
    return r.Error(absl::StrCat("the blocks of ", of, " hold ", covered, " of its ", elements, " elements"));
  }
  RETURN_IF_ERROR(CheckTiling(r, out, of));
  return out;
}

}  // namespace

absl::StatusOr<CheckpointIndex> ParseCheckpointIndex(absl::string_view text, absl::string_view where) {
  const Reader r(where);
  const Json j = ParseJson(text);
  if (j.is_discarded() || !j.is_object()) return r.Error("not a JSON object");
  const absl::StatusOr<std::string> format = r.String(j, "format", "the index");
  if (!format.ok() || *format != kCheckpointFormat) return r.Error(absl::StrCat("not a ", kCheckpointFormat, " index"));
  CheckpointIndex index;
  ASSIGN_OR_RETURN(const int64_t world, r.Int(j, "world_size", "the index"));
  if (world < 1 || world > kMaxWorldSize) {
    return r.Error(absl::StrCat("world_size ", world, " is outside [1, ", kMaxWorldSize, "]"));
  }
  index.world_size = static_cast<int>(world);
  if (j.contains("mesh")) {
    ASSIGN_OR_RETURN(const Json* mesh, r.Field(j, "mesh", "the index"));
    if (!mesh->is_array() || mesh->size() > static_cast<size_t>(kernels::kMaxDims)) {
      return r.Error(absl::StrCat("mesh is not a list of at most ", kernels::kMaxDims, " axes"));
    }
    int64_t ranks = 1;
    for (const Json& a : *mesh) {
      ASSIGN_OR_RETURN(std::string name, r.String(a, "name", "a mesh axis"));
      if (!PlainTensorName(name) || name.size() > 64) {
        return r.Error(absl::StrCat("mesh axis '", EscapedPrefix(name, 64), "' is not a name"));
      }
      ASSIGN_OR_RETURN(const int64_t size, r.Int(a, "size", "a mesh axis"));
      if (size < 1 || size > world) {
        return r.Error(absl::StrCat("mesh axis '", name, "' has size ", size, ", outside [1, ", world, "]"));
      }
      ranks *= size;  // <= kMaxWorldSize before each step: no overflow
      if (ranks > world) break;
      index.mesh.emplace_back(std::move(name), static_cast<int>(size));
    }
    if (ranks != world) {
      return r.Error(absl::StrCat("the mesh's axes make ", ranks > world ? "more than " : "", ranks,
                                  " ranks, not world_size ", world));
    }
  }
  if (j.contains("model_type")) {
    ASSIGN_OR_RETURN(index.model_type, r.String(j, "model_type", "the index"));
  }
  ASSIGN_OR_RETURN(const Json* tensors, r.Field(j, "tensors", "the index"));
  if (!tensors->is_object()) return r.Error("tensors is not an object");
  for (auto it = tensors->begin(); it != tensors->end(); ++it) {
    if (!PlainTensorName(it.key())) return r.Error(absl::StrCat("tensor ", NotPlain(it.key())));
    ASSIGN_OR_RETURN(CheckpointTensor t, ParseTensor(r, it.value(), it.key()));
    index.tensors.emplace(it.key(), std::move(t));
  }
  return index;
}

absl::StatusOr<CheckpointIndex> ReadCheckpointIndex(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kCheckpointIndex);
  // (A block a tensor a rank: some 200 bytes each, tens of MiB for the
  // largest models and meshes. One past this is read no further.)
  constexpr int64_t kMaxIndexBytes = int64_t{1} << 30;
  ASSIGN_OR_RETURN(std::string text, ReadFileToString(path, kMaxIndexBytes));
  return ParseCheckpointIndex(text, path);
}

absl::StatusOr<std::map<std::string, std::string>> ParseWeightMap(absl::string_view text, absl::string_view where) {
  const Reader r(where);
  const Json j = ParseJson(text);
  if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    return r.Error("not a JSON object with a weight_map object");
  }
  std::map<std::string, std::string> out;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string()) {
      return r.Error(absl::StrCat("the file of ", EscapedPrefix(it.key(), 256), " is not a string"));
    }
    const std::string file = it.value().get<std::string>();
    if (!IsPlainFileName(file)) {
      return r.Error(absl::StrCat(EscapedPrefix(it.key(), 256), " names the file '", EscapedPrefix(file, 256),
                                  "'; shard files must sit beside the index"));
    }
    out.emplace(it.key(), file);
  }
  return out;
}

}  // namespace colod::shardformer
