#include "worker/colo/dist_spec.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"

namespace colod {

Placement Placement::Shard(std::vector<int64_t> dims, std::vector<int64_t> num_partitions) {
  Placement p;
  p.kind = Kind::kShard;
  p.dims = std::move(dims);
  p.num_partitions = std::move(num_partitions);
  return p;
}

Placement Placement::Partial(ReduceOp op) {
  Placement p;
  p.kind = Kind::kPartial;
  p.op = op;
  return p;
}

bool Placement::operator==(const Placement& o) const {
  if (kind != o.kind) return false;
  if (kind == Kind::kShard) return dims == o.dims && num_partitions == o.num_partitions;
  if (kind == Kind::kPartial) return op == o.op;
  return true;
}

std::string Placement::ToString() const {
  switch (kind) {
    case Kind::kReplicate: return "R";
    case Kind::kShard: return absl::StrCat("S(", absl::StrJoin(dims, ","), "|", absl::StrJoin(num_partitions, ","), ")");
    case Kind::kPartial: {
      static const char* kOps[] = {"sum", "avg", "max", "min"};
      return absl::StrCat("P(", kOps[static_cast<int>(op)], ")");
    }
  }
  return "?";
}

DistSpec& DistSpec::Set(const std::string& axis, Placement p) {
  for (auto& [a, q] : placements_) {
    if (a == axis) {
      q = std::move(p);
      return *this;
    }
  }
  placements_.emplace_back(axis, std::move(p));
  return *this;
}

Placement DistSpec::Get(const std::string& axis) const {
  for (const auto& [a, p] : placements_) {
    if (a == axis) return p;
  }
  return Placement::Replicate();
}

bool DistSpec::Has(const std::string& axis) const {
  for (const auto& [a, p] : placements_) {
    if (a == axis) return true;
  }
  return false;
}

std::string DistSpec::ToString() const {
  std::vector<std::string> parts;
  for (const auto& [a, p] : placements_) parts.push_back(absl::StrCat(a, ":", p.ToString()));
  return absl::StrCat("{", absl::StrJoin(parts, ", "), "}");
}

std::vector<int64_t> BlockCoordinates(int64_t index, const std::vector<int64_t>& num_partitions) {
  std::vector<int64_t> c(num_partitions.size());
  for (int64_t i = static_cast<int64_t>(num_partitions.size()) - 1; i >= 0; --i) {
    c[i] = index % num_partitions[i];
    index /= num_partitions[i];
  }
  return c;
}

absl::StatusOr<Tensor> ShardBlock(const Tensor& t, const Placement& shard, int64_t index) {
  if (shard.kind != Placement::Kind::kShard || shard.dims.size() != shard.num_partitions.size() ||
      shard.dims.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("not a valid shard placement: ", shard.ToString()));
  }
  std::vector<int64_t> coords = BlockCoordinates(index, shard.num_partitions);
  Tensor view = t;
  for (size_t i = 0; i < shard.dims.size(); ++i) {
    ASSIGN_OR_RETURN(view, view.Chunk(shard.dims[i], shard.num_partitions[i], coords[i]));
  }
  return view;
}

}  // namespace colod
