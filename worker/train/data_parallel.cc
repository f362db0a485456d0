#include "worker/train/data_parallel.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace colod::train {

using shardformer::NamedParam;

absl::StatusOr<std::unique_ptr<GradSync>> GradSync::Create(std::vector<NamedParam> params, ProcessGroup* pg,
                                                           int64_t bucket_bytes) {
  std::unique_ptr<GradSync> s(new GradSync(std::move(params), pg));
  ASSIGN_OR_RETURN(int dp, pg->AxisSize("dp"));
  if (dp == 1) return s;
  ASSIGN_OR_RETURN(s->dp_, pg->Comm("dp"));
  const int n = static_cast<int>(s->params_.size());
  s->bucket_of_.assign(n, -1);
  int64_t bytes = 0;
  for (int i = n - 1; i >= 0; --i) {
    const Tensor& local = s->params_[i].bound.param.local();
    const int64_t size = local.nbytes();
    if (s->buckets_.empty() || (bytes > 0 && bytes + size > bucket_bytes) ||
        s->params_[s->buckets_.back().params.back()].bound.param.local().dtype() != local.dtype()) {
      s->buckets_.emplace_back();
      bytes = 0;
    }
    s->buckets_.back().params.push_back(i);
    s->bucket_of_[i] = static_cast<int>(s->buckets_.size()) - 1;
    bytes += size;
  }
  // Each bucket's flat buffer holds its parameters' gradients (views set
  // as their gradient storage): backward writes into the bucket, the
  // all-reduce runs on it in place, and nothing is copied in or out.
  for (Bucket& b : s->buckets_) {
    const Tensor& first = s->params_[b.params[0]].bound.param.local();
    int64_t elements = 0;
    for (int i : b.params) elements += s->params_[i].bound.param.local().numel();
    ASSIGN_OR_RETURN(b.flat, Tensor::Empty({elements}, first.dtype(), first.device()));
    int64_t offset = 0;
    for (int i : b.params) {
      const Tensor& local = s->params_[i].bound.param.local();
      ASSIGN_OR_RETURN(Tensor piece, b.flat.Narrow(0, offset, local.numel()));
      ASSIGN_OR_RETURN(Tensor view, piece.Reshape(local.shape()));
      Variable v = s->params_[i].bound.param.variable();
      RETURN_IF_ERROR(v.SetGradStorage(view));
      offset += local.numel();
    }
  }
  GradSync* self = s.get();
  for (int i = 0; i < n; ++i) {
    Variable v = s->params_[i].bound.param.variable();
    const int b = s->bucket_of_[i];
    v.SetGradReadyHook([self, b] { self->OnReady(b); });
  }
  return s;
}

absl::StatusOr<Tensor> GradSync::Slot(const Bucket& b, int64_t offset, const Tensor& grad) const {
  ASSIGN_OR_RETURN(Tensor piece, b.flat.Narrow(0, offset, grad.numel()));
  return piece.Reshape(grad.shape());
}

GradSync::~GradSync() {
  for (NamedParam& p : params_) {
    Variable v = p.bound.param.variable();
    v.SetGradReadyHook(nullptr);
    // Gradients already taken stay valid (a view keeps its bucket alive).
    if (dp_ != nullptr) (void)v.SetGradStorage(std::nullopt);
  }
  for (Bucket& b : buckets_) {
    if (b.work != nullptr) (void)b.work->Wait(pg_->timeout());
  }
}

absl::Status GradSync::Start(Bucket& b) {
  int64_t offset = 0;
  for (int i : b.params) {
    const ColoParameter& p = params_[i].bound.param;
    std::optional<Tensor> g = p.variable().grad();
    if (!g.has_value()) return absl::FailedPreconditionError(absl::StrCat(params_[i].name, " has no gradient"));
    // A gradient outside its bucket (its storage was replaced) is copied in.
    if (!g->SharesStorageWith(b.flat)) {
      ASSIGN_OR_RETURN(Tensor slot, Slot(b, offset, *g));
      RETURN_IF_ERROR(slot.CopyFrom(*g));
    }
    offset += g->numel();
  }
  b.work = dp_->AllReduce(b.flat.raw_data(), b.flat.numel(), b.flat.dtype(), ReduceOp::kSum);
  return absl::OkStatus();
}

void GradSync::OnReady(int bucket) {
  if (!enabled_ || !error_.ok()) return;
  ++grads_ready_;
  Bucket& b = buckets_[bucket];
  if (++b.ready < static_cast<int>(b.params.size()) || b.work != nullptr) return;
  error_ = Start(b);
  if (error_.ok()) {
    ++started_during_backward_;
    b.started_at = grads_ready_;
  }
}

absl::Status GradSync::Finish() {
  if (dp_ == nullptr) return absl::OkStatus();
  absl::Status status = error_;
  error_ = absl::OkStatus();
  for (Bucket& b : buckets_) {
    if (status.ok() && b.work == nullptr) status = Start(b);
  }
  for (Bucket& b : buckets_) {
    if (b.work != nullptr) {
      // The device waits, not the host: the copies below are stream ordered.
      const absl::Status waited = b.work->WaitOnDevice(pg_->timeout());
      if (status.ok()) status = waited;
    }
  }
  if (status.ok()) {
    for (Bucket& b : buckets_) {
      int64_t offset = 0;
      for (int i : b.params) {
        Tensor g = *params_[i].bound.param.variable().grad();
        if (!g.SharesStorageWith(b.flat)) {  // copied in by Start: copied back
          ASSIGN_OR_RETURN(Tensor slot, Slot(b, offset, g));
          RETURN_IF_ERROR(g.CopyFrom(slot));
        }
        offset += g.numel();
      }
    }
  }
  // A bucket overlapped backward if a gradient was still computed after its
  // all-reduce was enqueued.
  last_bucket_bytes_ = last_overlapped_bytes_ = 0;
  for (Bucket& b : buckets_) {
    last_bucket_bytes_ += b.flat.nbytes();
    if (b.started_at > 0 && b.started_at < grads_ready_) last_overlapped_bytes_ += b.flat.nbytes();
    b.ready = 0;
    b.started_at = 0;
    b.work = nullptr;
  }
  started_during_backward_ = 0;
  grads_ready_ = 0;
  return status;
}

}  // namespace colod::train
