#include "client/job_file.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "google/protobuf/util/json_util.h"
#include "nlohmann/json.hpp"
#include "yaml-cpp/yaml.h"

namespace colod {
namespace {

// Bounds on a job file's YAML as it is walked: aliases are references, so
// a few lines that nest them (a "billion laughs") or alias a node inside
// itself would walk forever or without end of memory.
constexpr int kMaxYamlDepth = 64;
constexpr int64_t kMaxYamlNodes = 100000;

// YAML to JSON: mappings, sequences, and scalars as strings except true and
// false (proto3 JSON takes numbers as strings for every numeric field).
absl::StatusOr<nlohmann::json> ToJson(const YAML::Node& node, int depth, int64_t& nodes_left) {
  if (depth > kMaxYamlDepth) return absl::InvalidArgumentError(absl::StrCat("nested over ", kMaxYamlDepth, " deep"));
  if (--nodes_left < 0) {
    return absl::InvalidArgumentError(absl::StrCat("over ", kMaxYamlNodes, " values (aliases count each time)"));
  }
  switch (node.Type()) {
    case YAML::NodeType::Map: {
      nlohmann::json out = nlohmann::json::object();
      for (const auto& kv : node) {
        absl::StatusOr<nlohmann::json> value = ToJson(kv.second, depth + 1, nodes_left);
        if (!value.ok()) return value.status();
        out[kv.first.as<std::string>()] = *std::move(value);
      }
      return out;
    }
    case YAML::NodeType::Sequence: {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& item : node) {
        absl::StatusOr<nlohmann::json> value = ToJson(item, depth + 1, nodes_left);
        if (!value.ok()) return value.status();
        out.push_back(*std::move(value));
      }
      return out;
    }
    case YAML::NodeType::Scalar: {
      const std::string v = node.as<std::string>();
      if (node.Tag() != "!" && (v == "true" || v == "false")) return v == "true";
      return v;
    }
    default:
      return nullptr;
  }
}

}  // namespace

absl::StatusOr<v1::JobSpec> ParseJobSpec(const std::string& text, bool yaml, const std::string& what) {
  std::string json = text;
  if (yaml) {
    try {
      int64_t nodes_left = kMaxYamlNodes;
      absl::StatusOr<nlohmann::json> j = ToJson(YAML::Load(text), 0, nodes_left);
      if (!j.ok()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", j.status().message()));
      json = j->dump();
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": not YAML: ", e.what()));
    } catch (const nlohmann::json::exception& e) {  // a string that is not UTF-8 (found by job_file_fuzz)
      return absl::InvalidArgumentError(absl::StrCat(what, ": not UTF-8 text: ", e.what()));
    }
  }
  v1::JobSpec spec;
  google::protobuf::util::JsonParseOptions opts;
  opts.ignore_unknown_fields = false;
  const auto s = google::protobuf::util::JsonStringToMessage(json, &spec, opts);
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a colod.v1.JobSpec: ", std::string(s.message())));
  }
  return spec;
}

absl::StatusOr<v1::JobSpec> ReadJobFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  const bool yaml = absl::EndsWith(path, ".yaml") || absl::EndsWith(path, ".yml");
  return ParseJobSpec(*text, yaml, path);
}

}  // namespace colod
