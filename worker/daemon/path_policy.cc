#include "worker/daemon/path_policy.h"

#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "worker/train/data.h"

namespace colod {
namespace {

namespace fs = std::filesystem;

// Whether `path` is `root` or below it, component-wise ("/data2" is not
// under "/data").
bool Under(const std::string& path, const std::string& root) {
  if (root == "/") return true;
  return path == root || (absl::StartsWith(path, root) && path[root.size()] == '/');
}

}  // namespace

absl::StatusOr<PathPolicy> PathPolicy::Create(const std::vector<std::string>& roots) {
  PathPolicy p;
  for (const std::string& r : roots) {
    if (r.empty() || r[0] != '/') {
      return absl::InvalidArgumentError(absl::StrCat("--allow-path: '", r, "' is not an absolute path"));
    }
    std::error_code ec;
    const fs::path canonical = fs::canonical(r, ec);
    if (ec || !fs::is_directory(canonical, ec)) {
      return absl::InvalidArgumentError(absl::StrCat("--allow-path: '", r, "' is not an existing directory"));
    }
    std::string s = canonical.string();
    while (s.size() > 1 && s.back() == '/') s.pop_back();
    p.roots_.push_back(s);
  }
  return p;
}

absl::Status PathPolicy::Reserve(const std::string& dir) {
  std::error_code ec;
  const fs::path canonical = fs::canonical(dir, ec);
  if (ec) return absl::InvalidArgumentError(absl::StrCat("'", dir, "' cannot be resolved: ", ec.message()));
  std::string reserved = canonical.string();
  while (reserved.size() > 1 && reserved.back() == '/') reserved.pop_back();
  // A root in the work dir allows nothing: dropped, said so; where every
  // root is one, the worker would run no job that names a path.
  std::vector<std::string> kept;
  for (const std::string& root : roots_) {
    if (!Under(root, reserved)) {
      kept.push_back(root);
      continue;
    }
    COLOD_LOG(WARNING) << "--allow-path " << root << " is in --work-dir " << reserved
                       << ", where no job may name a path: it allows nothing (give a directory beside the work dir)";
  }
  if (kept.empty() && !roots_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("every --allow-path is in --work-dir ", reserved,
                                                   ", where no job may name a path: they would allow nothing (give "
                                                   "directories beside the work dir)"));
  }
  roots_ = std::move(kept);
  reserved_ = reserved;
  return absl::OkStatus();
}

absl::Status PathPolicy::Check(absl::string_view field, const std::string& path) const {
  if (path.find('\0') != std::string::npos) {
    // The check would see one path and open() another (the bytes before it).
    return absl::PermissionDeniedError(absl::StrCat(field, ": the path holds a NUL byte"));
  }
  if ((unrestricted() && reserved_.empty()) || path.empty()) return absl::OkStatus();
  std::error_code ec;
  // The parts that exist are resolved through their links; the rest (an
  // output not written yet) lexically, so ".." cannot climb out.
  const fs::path resolved = fs::weakly_canonical(fs::absolute(path, ec), ec);
  if (ec) {  // (fails closed: what cannot be resolved is not known to lie outside)
    return absl::PermissionDeniedError(absl::StrCat(field, ": '", path, "' cannot be resolved: ", ec.message()));
  }
  const std::string s = resolved.lexically_normal().string();
  // None in the worker's own directory, however it is reached (a link in a
  // weights directory to a cached upload, too).
  if (!reserved_.empty() && Under(s, reserved_)) {
    return absl::PermissionDeniedError(absl::StrCat(field, ": '", path, "' is in this worker's own directory (",
                                                    reserved_,
                                                    ", --work-dir: its download cache and scratch), "
                                                    "which no job may name"));
  }
  if (unrestricted()) return absl::OkStatus();
  for (const std::string& root : roots_) {
    if (Under(s, root)) return absl::OkStatus();
  }
  return absl::PermissionDeniedError(absl::StrCat(field, ": '", path,
                                                  "' is outside the paths this worker allows (--allow-path ",
                                                  absl::StrJoin(roots_, ", "), ")"));
}

absl::Status PathPolicy::CheckJob(const v1::JobSpec& spec) const {
  struct Named {
    const char* field;
    const std::string& path;
  };
  const Named paths[] = {
      {"spec.model.weights_path", spec.model().weights_path()},
      {"spec.train.data_path", spec.train().data_path()},
      {"spec.train.labels_path", spec.train().labels_path()},
      {"spec.train.eval_labels_path", spec.train().eval_labels_path()},
      {"spec.train.checkpoint_dir", spec.train().checkpoint_dir()},
      {"spec.train.resume_from", spec.train().resume_from()},
      {"spec.train.final_dir", spec.train().final_dir()},
      {"spec.forward.input_path", spec.forward().input_path()},
      {"spec.forward.logits_path", spec.forward().logits_path()},
      {"spec.forward.labels_path", spec.forward().labels_path()},
      {"spec.forward.decoder_input_path", spec.forward().decoder_input_path()},
  };
  for (const Named& n : paths) {
    if (absl::Status s = Check(n.field, n.path); !s.ok()) return s;
  }
  // Training data may name a Megatron dataset by its prefix, .bin or .idx:
  // every file the corpus may open is checked (each may be a link).
  for (const Named& data : {Named{"spec.train.data_path", spec.train().data_path()},
                            Named{"spec.train.eval_data_path", spec.train().eval_data_path()}}) {
    if (data.path.empty()) continue;
    for (const std::string& file : train::DataFiles(data.path)) {
      if (absl::Status s = Check(data.field, file); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace colod
