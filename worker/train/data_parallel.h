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
// disabled and only accumulates (but under ZeRO stage 2, below).
//
// ZeRO (DeepSpeed's stages 1 and 2, over the dp group): each bucket is
// padded to a multiple of dp elements and split into dp equal chunks; dp
// rank r owns chunk r. A bucket is reduce-scattered instead of all-reduced,
// so each rank receives only its chunk's sum, and its optimizer updates only
// the parameter elements in its chunks (Partition(), with their state:
// optimizer.h); GatherParams then all-gathers the updated weights bucket by
// bucket. Stage 1 keeps the full gradient buckets (the chunk is reduced in
// place in them); stage 2 keeps only the chunks: each parameter's gradient
// is allocated by backward, copied into a bucket buffer when its bucket is
// complete and released, the bucket reduce-scattered into the rank's chunk
// and its buffer released once the reduction is done (at most two in
// flight), so a replica holds 1/dp of the gradients plus the buckets being
// reduced. Stage 2 reduces every micro-batch and adds the chunks up (the
// sum order differs from stage 0's by rounding only). Parameters the
// pipeline's first and last stages share (tied tables) stay whole and
// all-reduced, as their gradients are summed across stages afterwards.
//
// Thread-safety: one rank thread (the hooks run on it, inside Backward).
#ifndef COLOD_WORKER_TRAIN_DATA_PARALLEL_H_
#define COLOD_WORKER_TRAIN_DATA_PARALLEL_H_

#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "worker/colo/process_group.h"
#include "worker/shardformer/module.h"
#include "worker/train/optimizer.h"

namespace colod::train {

class GradSync {
 public:
  // Installs the hooks. dp = 1 makes every call a no-op. `zero_stage`: 0
  // (all-reduce), 1 or 2 (see the file comment); INVALID_ARGUMENT otherwise.
  // `chunk_starts`: the indices of `params` where another model chunk's
  // parameters begin (interleaved 1F1B: a rank's chunks run their
  // backwards at different times); no bucket spans two chunks.
  static absl::StatusOr<std::unique_ptr<GradSync>> Create(std::vector<shardformer::NamedParam> params,
                                                          ProcessGroup* pg, int64_t bucket_bytes, int zero_stage = 0,
                                                          const std::vector<int>& chunk_starts = {});
  ~GradSync();
  GradSync(const GradSync&) = delete;
  GradSync& operator=(const GradSync&) = delete;

  // Whether the next Backward reduces (true, the default) or only
  // accumulates. Stage 2 reduces every Backward (its gradients do not stay).
  void set_enabled(bool enabled) { enabled_ = enabled; }
  // After the Backward that reduced: starts any bucket not started yet,
  // waits for all and writes the sums back into the gradients (ZeRO: into
  // this rank's chunks).
  absl::Status Finish();

  // What this rank's optimizer updates: without ZeRO (or dp = 1) every
  // parameter whole; with it, the parts of the partitioned buckets' params
  // in this rank's chunks (reading the reduced chunks), and the tied ones
  // whole. The tensors stay valid as long as this GradSync.
  Partition partition() const;
  // ZeRO, after the optimizer step: every partitioned bucket's updated
  // weights all-gathered from the ranks that own them into every replica's
  // parameters. A no-op without ZeRO.
  absl::Status GatherParams();
  int zero_stage() const { return zero_; }
  // The bytes of gradient this sync keeps beside the parameters' own (ZeRO
  // stage 2's reduced chunks); the buckets of stages 0 and 1 are the
  // parameters' gradient storage, counted with them.
  int64_t chunk_bytes() const;

  int buckets() const { return static_cast<int>(buckets_.size()); }
  // Buckets whose all-reduce started inside the last Backward (overlapped;
  // under stage 2, inside the step's Backward passes).
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
    // The params' gradients, back to back (their storage; stage 2: a buffer
    // they are copied into, alive while the bucket is being reduced); with
    // ZeRO padded with zeros to dp x chunk elements.
    Tensor flat;
    std::shared_ptr<Work> work;
    int64_t started_at = 0;  // grads_ready_ when it started inside Backward (0: not)
    DType dtype = DType::kF32;
    Device device = Device::Cpu();
    // ZeRO: this bucket is reduce-scattered (its params are not tied).
    bool partitioned = false;
    int64_t elements = 0, chunk = 0;  // its gradients' elements; ceil(elements / dp)
    Tensor reduced;  // this rank's chunk of the sum (stage 1: a view of flat)
    // Stage 2: `reduced` holds this step's sum so far; a later micro-batch
    // reduces into `partial`, added once its reduction is done.
    bool filled = false, pending_add = false;
    Tensor partial;
  };
  bool Releases(const Bucket& b) const { return b.partitioned && zero_ == 2; }
  // The elements [lo, hi) of partitioned bucket b's flat buffer that are
  // both parameter i's and in this rank's chunk; lo >= hi where none.
  std::pair<int64_t, int64_t> Owned(const Bucket& b, int i) const;
  // Stage 2: waits for b's reduction (on the device), adds a later
  // micro-batch's part and releases its buffer.
  absl::Status Retire(Bucket& b);
  // The part of b.flat at `offset` elements shaped as `grad`.
  absl::StatusOr<Tensor> Slot(const Bucket& b, int64_t offset, const Tensor& grad) const;
  GradSync(std::vector<shardformer::NamedParam> params, ProcessGroup* pg) : params_(std::move(params)), pg_(pg) {}
  void OnReady(int bucket);
  absl::Status Start(int bucket);

  std::vector<shardformer::NamedParam> params_;
  ProcessGroup* pg_;
  Communicator* dp_ = nullptr;
  std::vector<Bucket> buckets_;
  std::vector<int> bucket_of_;  // param -> bucket
  std::vector<int64_t> offset_of_;  // param -> its first element in its bucket
  int zero_ = 0;
  int dp_size_ = 1, dp_rank_ = 0;
  std::vector<int> in_flight_;  // stage 2: buckets started and not yet retired, oldest first
  // Stage 2: reductions whose wait failed, with the buffers they may still
  // read or write: kept until the destructor has waited for them again.
  struct Abandoned {
    std::shared_ptr<Work> work;
    Tensor flat, partial;
  };
  std::vector<Abandoned> abandoned_;
  bool enabled_ = true;
  bool in_finish_ = false;
  int started_during_backward_ = 0;
  int64_t grads_ready_ = 0;  // gradients completed in this Backward so far
  int64_t last_bucket_bytes_ = 0, last_overlapped_bytes_ = 0;
  absl::Status error_;
};

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_DATA_PARALLEL_H_
