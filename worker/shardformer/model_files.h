// A Hugging Face-style model directory's weights: `model.safetensors`, or
// `model.safetensors.index.json` whose weight_map names the shard file of
// every tensor. Each rank reads only its block of a tensor (ReadShard).
//
// Thread-safety: immutable after Open but for the names looked up
// (Unread's record, under a mutex of its own); reads may run concurrently.
#ifndef COLOD_WORKER_SHARDFORMER_MODEL_FILES_H_
#define COLOD_WORKER_SHARDFORMER_MODEL_FILES_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "worker/colo/colo_tensor.h"
#include "worker/shardformer/safetensors.h"

namespace colod::shardformer {

class ModelFiles {
 public:
  // NOT_FOUND when the directory has neither file; INVALID_ARGUMENT for a
  // malformed index (not JSON, no weight_map, a shard file that does not
  // exist or lacks a tensor the index names) or safetensors file.
  static absl::StatusOr<std::unique_ptr<ModelFiles>> Open(const std::string& dir);

  std::vector<std::string> Names() const;
  // The stored tensors no Info, Read, ReadSlice or ReadShard looked at yet,
  // sorted: after a whole model was loaded, what of the files is not the
  // model's (a config.json of fewer layers than its weights, a head the
  // model does not have).
  std::vector<std::string> Unread() const ABSL_LOCKS_EXCLUDED(mu_);
  bool Has(const std::string& name) const { return where_.count(Stored(name)) > 0; }
  // Names asked for with this prefix are looked up without it (a bare
  // model's checkpoint read as the LM model's).
  void set_strip_prefix(std::string prefix) { strip_prefix_ = std::move(prefix); }
  // NOT_FOUND naming the tensor and the directory.
  absl::StatusOr<TensorInfo> Info(const std::string& name) const;
  absl::StatusOr<Tensor> Read(const std::string& name) const;
  absl::StatusOr<Tensor> ReadSlice(const std::string& name, const std::vector<int64_t>& starts,
                                   const std::vector<int64_t>& lengths) const;
  // This rank's shard of `name` under `spec` (Replicate and Shard
  // placements), reading only its bytes, as a ColoTensor of dtype `dtype`.
  absl::StatusOr<ColoTensor> ReadShard(const std::string& name, const DistSpec& spec, ProcessGroup* pg,
                                       DType dtype = DType::kF32, bool requires_grad = true) const;

 private:
  explicit ModelFiles(std::string dir) : dir_(std::move(dir)) {}
  absl::StatusOr<const SafetensorsFile*> FileOf(const std::string& name) const;
  std::string Stored(const std::string& name) const;

  const std::string dir_;
  std::map<std::string, std::unique_ptr<SafetensorsFile>> files_;  // by file name
  std::map<std::string, std::string> where_;                       // tensor -> file name
  std::string strip_prefix_;
  mutable absl::Mutex mu_;
  mutable std::set<std::string> looked_up_ ABSL_GUARDED_BY(mu_);  // stored names
};

}  // namespace colod::shardformer

#endif  // COLOD_WORKER_SHARDFORMER_MODEL_FILES_H_
