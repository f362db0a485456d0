// Data-parallel gradient synchronization: gradients summed over the dp
// replicas in buckets, each bucket's all-reduce started on the dp
// communicator as soon as the last of its gradients is complete during
// backward (Variable::SetGradReadyHook), so communication overlaps the rest
// of the backward pass. Parameters fill buckets in reverse order of
// registration, the order backward completes them. Each bucket is one flat
// buffer that is its parameters' gradient storage (Variable::SetGradStorage,
// DDP's gradient_as_bucket_view): backward writes the gradients into it and
// the all-reduce sums it in place, with no copies in or out.
//
// The loss each replica back-propagates is its share of the global mean
// (ShardedModel::TokenLoss), so a plain sum gives the full gradient. With
// gradient accumulation, every micro-batch but the last runs with the sync
// disabled and only accumulates.
//
// Thread-safety: one rank thread (the hooks run on it, inside Backward).
#ifndef COLOD_WORKER_TRAIN_DATA_PARALLEL_H_
#define COLOD_WORKER_TRAIN_DATA_PARALLEL_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "worker/colo/process_group.h"
#include "worker/shardformer/module.h"

namespace colod::train {

class GradSync {
 public:
  // Installs the hooks. dp = 1 makes every call a no-op.
  static absl::StatusOr<std::unique_ptr<GradSync>> Create(std::vector<shardformer::NamedParam> params,
                                                          ProcessGroup* pg, int64_t bucket_bytes);
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Whether the next Backward reduces (true, the default) or only accumulates.
  void set_enabled(bool enabled) { enabled_ = enabled; }
  // After the Backward that reduced: starts any bucket not started yet,
  // waits for all and writes the sums back into the gradients.
  absl::Status Finish();

  int buckets() const { return static_cast<int>(buckets_.size()); }
  // Buckets whose all-reduce started inside the last Backward (overlapped).
  int started_during_backward() const { return started_during_backward_; }
  // Of the last reducing step (read after its Finish): the bytes of every
  // bucket, and of those whose all-reduce was enqueued on the dp
  // communicator's stream before backward's last kernel (some gradient was
  // still computed after it started): the communication that can overlap
  // backward; the rest (at least the bucket of the first layers) waits for
  // its end.
  int64_t last_bucket_bytes() const { return last_bucket_bytes_; }
  int64_t last_overlapped_bytes() const { return last_overlapped_bytes_; }

 private:
  struct Bucket {
    std::vector<int> params;  // indices into params_
    int ready = 0;
    Tensor flat;  // the params' gradients, back to back (their storage)
    std::shared_ptr<Work> work;
    int64_t started_at = 0;  // grads_ready_ when it started inside Backward (0: not)
  };
  // The part of b.flat at `offset` elements shaped as `grad`.
  absl::StatusOr<Tensor> Slot(const Bucket& b, int64_t offset, const Tensor& grad) const;
  GradSync(std::vector<shardformer::NamedParam> params, ProcessGroup* pg) : params_(std::move(params)), pg_(pg) {}
  void OnReady(int bucket);
  absl::Status Start(Bucket& b);

  std::vector<shardformer::NamedParam> params_;
  ProcessGroup* pg_;
  Communicator* dp_ = nullptr;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;  // param -> bucket
  bool enabled_ = true;
  bool in_finish_ = false;
  int started_during_backward_ = 0;
  int64_t grads_ready_ = 0;  // gradients completed in this Backward so far
  int64_t last_bucket_bytes_ = 0, last_overlapped_bytes_ = 0;
  absl::Status error_;
};

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_DATA_PARALLEL_H_
