#include "worker/shardformer/model_files.h"

#include <sys/stat.h>

#include <cerrno>

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"
#include "common/status_macros.h"
#include "worker/colo/redistribute.h"
#include "worker/shardformer/checkpoint_index.h"

namespace colod::shardformer {

absl::StatusOr<std::unique_ptr<ModelFiles>> ModelFiles::Open(const std::string& dir) {
  std::unique_ptr<ModelFiles> m(new ModelFiles(dir));
  const std::string single = dir + "/model.safetensors", index = absl::StrCat(dir, "/", kWeightMapIndex);
  // The index where there is one (not a FIFO or a device, which could
  // block the rank where no abort reaches it); else the single file. An
  // index there but unreadable is that error, not "neither".
  struct stat st;
  const bool has_index = ::stat(index.c_str(), &st) == 0;
  if (!has_index && errno != ENOENT && errno != ENOTDIR) return FileError("cannot read", index, errno);
  if (has_index && !S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(index, " is not a regular file"));
  }
  if (!has_index) {
    auto f = SafetensorsFile::Open(single);
    if (absl::IsNotFound(f.status())) {
      return absl::NotFoundError(absl::StrCat(dir, " has neither model.safetensors nor model.safetensors.index.json"));
    }
    if (!f.ok()) return f.status();
    for (const auto& [name, info] : (*f)->tensors()) m->where_[name] = "model.safetensors";
    for (const auto& [name, dtype] : (*f)->unreadable()) m->where_[name] = "model.safetensors";
    m->files_["model.safetensors"] = *std::move(f);
    return m;
  }
  ASSIGN_OR_RETURN(const std::string text, ReadFileToString(index));
  ASSIGN_OR_RETURN(const auto weight_map, ParseWeightMap(text, index));
  for (const auto& [tensor, file] : weight_map) {
    if (!m->files_.count(file)) {
      auto f = SafetensorsFile::Open(dir + "/" + file);
      if (!f.ok()) return absl::InvalidArgumentError(absl::StrCat(index, ": ", f.status().message()));
      m->files_[file] = *std::move(f);
    }
    if (!m->files_[file]->Has(tensor)) {
      return absl::InvalidArgumentError(absl::StrCat(index, ": ", file, " has no tensor ", tensor));
    }
    m->where_[tensor] = file;
  }
  return m;
}

std::vector<std::string> ModelFiles::Names() const {
  std::vector<std::string> out;
  for (const auto& [name, file] : where_) out.push_back(name);
  return out;
}

std::string ModelFiles::Stored(const std::string& name) const {
  if (!strip_prefix_.empty() && name.compare(0, strip_prefix_.size(), strip_prefix_) == 0) {
    return name.substr(strip_prefix_.size());
  }
  return name;
}

absl::StatusOr<const SafetensorsFile*> ModelFiles::FileOf(const std::string& name) const {
  auto it = where_.find(Stored(name));
  if (it == where_.end()) return absl::NotFoundError(absl::StrCat(dir_, " has no tensor ", name));
  {
    absl::MutexLock lock(&mu_);
    looked_up_.insert(it->first);
  }
  return files_.at(it->second).get();
}

std::vector<std::string> ModelFiles::Unread() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> out;
  for (const auto& [name, file] : where_) {
    if (!looked_up_.count(name)) out.push_back(name);
  }
  return out;
}

absl::StatusOr<TensorInfo> ModelFiles::Info(const std::string& name) const {
  ASSIGN_OR_RETURN(const SafetensorsFile* f, FileOf(name));
  return f->Info(Stored(name));
}

absl::StatusOr<Tensor> ModelFiles::Read(const std::string& name) const {
  ASSIGN_OR_RETURN(const SafetensorsFile* f, FileOf(name));
  return f->Read(Stored(name));
}

absl::StatusOr<Tensor> ModelFiles::ReadSlice(const std::string& name, const std::vector<int64_t>& starts,
                                             const std::vector<int64_t>& lengths) const {
  ASSIGN_OR_RETURN(const SafetensorsFile* f, FileOf(name));
  return f->ReadSlice(Stored(name), starts, lengths);
}

absl::StatusOr<ColoTensor> ModelFiles::ReadShard(const std::string& name, const DistSpec& spec, ProcessGroup* pg,
                                                 DType dtype, bool requires_grad) const {
  ASSIGN_OR_RETURN(TensorInfo info, Info(name));
  auto block = LocalBlock(spec, info.shape, pg);
  if (!block.ok()) return absl::InvalidArgumentError(absl::StrCat(name, ": ", block.status().message()));
  ASSIGN_OR_RETURN(Tensor local, ReadSlice(name, block->starts, block->lengths));
  if (local.dtype() != dtype) {
    ASSIGN_OR_RETURN(local, local.ToDType(dtype));
  }
  return ColoTensor::FromLocal(Variable(local, requires_grad), spec, pg);
}

}  // namespace colod::shardformer
