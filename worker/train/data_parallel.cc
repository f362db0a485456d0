#include "worker/train/data_parallel.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/tensor/ops.h"

namespace colod::train {

using shardformer::NamedParam;

absl::StatusOr<std::unique_ptr<GradSync>> GradSync::Create(std::vector<NamedParam> params, ProcessGroup* pg,
                                                           int64_t bucket_bytes, int zero_stage,
                                                           const std::vector<int>& chunk_starts) {
  if (zero_stage < 0 || zero_stage > 2) {
    return absl::InvalidArgumentError(absl::StrCat("zero stage ", zero_stage, " is not one of 0, 1, 2"));
  }
  std::unique_ptr<GradSync> s(new GradSync(std::move(params), pg));
  s->zero_ = zero_stage;
  ASSIGN_OR_RETURN(int dp, pg->AxisSize("dp"));
  if (dp == 1) return s;
  ASSIGN_OR_RETURN(s->dp_, pg->Comm("dp"));
  s->dp_size_ = dp;
  s->dp_rank_ = s->dp_->rank();
  const int n = static_cast<int>(s->params_.size());
  // Tied tables are summed across pipeline stages after the sync: whole.
  auto partitioned = [&](int i) { return zero_stage > 0 && !s->params_[i].tied && !s->params_[i].mirror; };
  s->bucket_of_.assign(n, -1);
  s->offset_of_.assign(n, 0);
  int64_t bytes = 0;
  for (int i = n - 1; i >= 0; --i) {
    const Tensor& local = s->params_[i].bound.param.local();
    const int64_t size = local.nbytes();
    // The last parameter of a chunk that another follows (filled in
    // reverse): a new bucket.
    const bool chunk_ends = std::find(chunk_starts.begin(), chunk_starts.end(), i + 1) != chunk_starts.end();
    if (s->buckets_.empty() || chunk_ends || (bytes > 0 && bytes + size > bucket_bytes) ||
        s->params_[s->buckets_.back().params.back()].bound.param.local().dtype() != local.dtype() ||
        s->buckets_.back().partitioned != partitioned(i)) {
      s->buckets_.emplace_back();
      s->buckets_.back().partitioned = partitioned(i);
      bytes = 0;
    }
    if (partitioned(i) && !local.is_contiguous()) {
      // Its slices are updated and gathered through flat views.
      return absl::InvalidArgumentError(absl::StrCat(s->params_[i].name, " is not contiguous: ZeRO partitions "
                                                     "contiguous parameters"));
    }
    Bucket& b = s->buckets_.back();
    b.params.push_back(i);
    s->bucket_of_[i] = static_cast<int>(s->buckets_.size()) - 1;
    s->offset_of_[i] = b.elements;
    b.elements += local.numel();
    bytes += size;
  }
  for (Bucket& b : s->buckets_) {
    const Tensor& first = s->params_[b.params[0]].bound.param.local();
    b.dtype = first.dtype();
    b.device = first.device();
    b.chunk = b.partitioned ? (b.elements + dp - 1) / dp : b.elements;
    if (s->Releases(b)) {
      // Stage 2: the parameters' gradients are their own until the bucket
      // is complete; only this rank's chunk of the sum stays.
      ASSIGN_OR_RETURN(b.reduced, Tensor::Zeros({b.chunk}, b.dtype, b.device));
      continue;
    }
    // Each bucket's flat buffer holds its parameters' gradients (views set
    // as their gradient storage): backward writes into the bucket, the
    // all-reduce (reduce-scatter) runs on it in place, and nothing is
    // copied in or out.
    if (b.partitioned) {
      ASSIGN_OR_RETURN(b.flat, Tensor::Zeros({b.chunk * dp}, b.dtype, b.device));  // the padding stays zero
      ASSIGN_OR_RETURN(b.reduced, b.flat.Narrow(0, s->dp_rank_ * b.chunk, b.chunk));
    } else {
      ASSIGN_OR_RETURN(b.flat, Tensor::Empty({b.elements}, b.dtype, b.device));
    }
    for (int i : b.params) {
      const Tensor& local = s->params_[i].bound.param.local();
      ASSIGN_OR_RETURN(Tensor view, s->Slot(b, s->offset_of_[i], local));
      Variable v = s->params_[i].bound.param.variable();
      RETURN_IF_ERROR(v.SetGradStorage(view));
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
  for (Abandoned& a : abandoned_) (void)a.work->Wait(pg_->timeout());
}

absl::Status GradSync::Start(int index) {
  Bucket& b = buckets_[index];
  if (Releases(b)) {
    if (b.work != nullptr) RETURN_IF_ERROR(Retire(b));  // an earlier micro-batch's, still in flight
    ASSIGN_OR_RETURN(b.flat, Tensor::Zeros({b.chunk * dp_size_}, b.dtype, b.device));
  }
  for (int i : b.params) {
    Variable v = params_[i].bound.param.variable();
    std::optional<Tensor> g = v.grad();
    if (!g.has_value()) return absl::FailedPreconditionError(absl::StrCat(params_[i].name, " has no gradient"));
    // A gradient outside its bucket (stage 2, or its storage was replaced)
    // is copied in.
    if (!g->SharesStorageWith(b.flat)) {
      ASSIGN_OR_RETURN(Tensor slot, Slot(b, offset_of_[i], *g));
      RETURN_IF_ERROR(slot.CopyFrom(*g));
    }
    if (Releases(b)) v.ZeroGrad();  // stage 2: the gradient lives on in the bucket only
  }
  if (!b.partitioned) {
    b.work = dp_->AllReduce(b.flat.raw_data(), b.flat.numel(), b.dtype, ReduceOp::kSum);
    return absl::OkStatus();
  }
  Tensor out = b.reduced;  // stage 1: in place, the rank's chunk of flat
  if (Releases(b)) {
    b.pending_add = b.filled;  // a later micro-batch: summed apart, then added
    if (b.pending_add) {
      ASSIGN_OR_RETURN(b.partial, Tensor::Empty({b.chunk}, b.dtype, b.device));
      out = b.partial;
    }
    b.filled = true;
    b.ready = 0;  // the next micro-batch's Backward fills it again
  }
  b.work = dp_->ReduceScatter(b.flat.raw_data(), out.raw_data(), b.chunk, b.dtype, ReduceOp::kSum);
  if (Releases(b)) {
    in_flight_.push_back(index);
    while (in_flight_.size() > 2) RETURN_IF_ERROR(Retire(buckets_[in_flight_.front()]));
  }
  return absl::OkStatus();
}

absl::Status GradSync::Retire(Bucket& b) {
  const int index = static_cast<int>(&b - buckets_.data());
  in_flight_.erase(std::remove(in_flight_.begin(), in_flight_.end(), index), in_flight_.end());
  if (b.work == nullptr) return absl::OkStatus();
  // The device waits, not the host: what follows is stream ordered, and the
  // buffer is freed (reused) in stream order after the reduction.
  const absl::Status waited = b.work->WaitOnDevice(pg_->timeout());
  if (!waited.ok()) {
    // The reduction may still read flat and write partial: they stay alive.
    abandoned_.push_back(Abandoned{std::move(b.work), std::move(b.flat), std::move(b.partial)});
    b.work = nullptr;
    b.flat = b.partial = Tensor();
    b.pending_add = false;
    return waited;
  }
  b.work = nullptr;
  b.flat = Tensor();
  if (!b.pending_add) return absl::OkStatus();
  b.pending_add = false;
  ASSIGN_OR_RETURN(Tensor sum, Add(b.reduced, b.partial));
  b.partial = Tensor();
  return b.reduced.CopyFrom(sum);
}

void GradSync::OnReady(int bucket) {
  Bucket& b = buckets_[bucket];
  if (!error_.ok() || (!enabled_ && !Releases(b))) return;
  ++grads_ready_;
  if (++b.ready < static_cast<int>(b.params.size()) || (!Releases(b) && b.work != nullptr)) return;
  error_ = Start(bucket);
  if (error_.ok()) {
    ++started_during_backward_;
    b.started_at = grads_ready_;
  }
}

absl::Status GradSync::Finish() {
  if (dp_ == nullptr) return absl::OkStatus();
  absl::Status status = error_;
  error_ = absl::OkStatus();
  for (size_t i = 0; i < buckets_.size(); ++i) {
    Bucket& b = buckets_[i];
    // Stage 2: a bucket part of whose gradients the last Backward left, or
    // that no Backward of the step completed.
    const bool start = Releases(b) ? b.ready > 0 || !b.filled : b.work == nullptr;
    if (status.ok() && start) status = Start(static_cast<int>(i));
  }
  for (Bucket& b : buckets_) {
    if (Releases(b)) {
      const absl::Status retired = Retire(b);
      if (status.ok()) status = retired;
    } else if (b.work != nullptr) {
      // The device waits, not the host: the copies below are stream ordered.
      const absl::Status waited = b.work->WaitOnDevice(pg_->timeout());
      if (status.ok()) status = waited;
    }
  }
  if (status.ok()) {
    for (Bucket& b : buckets_) {
      if (b.partitioned) continue;  // the sums stay in the chunks
      for (int i : b.params) {
        Tensor g = *params_[i].bound.param.variable().grad();
        if (!g.SharesStorageWith(b.flat)) {  // copied in by Start: copied back
          ASSIGN_OR_RETURN(Tensor slot, Slot(b, offset_of_[i], g));
          RETURN_IF_ERROR(g.CopyFrom(slot));
        }
      }
    }
  }
  // A bucket overlapped backward if a gradient was still computed after its
  // reduction was enqueued.
  last_bucket_bytes_ = last_overlapped_bytes_ = 0;
  for (Bucket& b : buckets_) {
    const int64_t bytes = b.chunk * (b.partitioned ? dp_size_ : 1) * static_cast<int64_t>(SizeOf(b.dtype));
    last_bucket_bytes_ += bytes;
    if (b.started_at > 0 && b.started_at < grads_ready_) last_overlapped_bytes_ += bytes;
    b.ready = 0;
    b.started_at = 0;
    b.work = nullptr;
    b.filled = b.pending_add = false;
    b.partial = Tensor();
    if (Releases(b)) b.flat = Tensor();
  }
  in_flight_.clear();
  started_during_backward_ = 0;
  grads_ready_ = 0;
  return status;
}

std::pair<int64_t, int64_t> GradSync::Owned(const Bucket& b, int i) const {
  const int64_t mine = dp_rank_ * b.chunk, at = offset_of_[i];
  return {std::max(at, mine), std::min(at + params_[i].bound.param.local().numel(), mine + b.chunk)};
}

Partition GradSync::partition() const {
  if (dp_ == nullptr || zero_ == 0) return Partition::Whole(params_);
  Partition p;
  p.over_dp = true;
  for (int i = 0; i < static_cast<int>(params_.size()); ++i) {
    const Bucket& b = buckets_[bucket_of_[i]];
    const int64_t n = params_[i].bound.param.local().numel();
    if (!b.partitioned) {
      p.slices.push_back(ParamSlice{i, 0, n, std::nullopt});
      continue;
    }
    const auto [lo, hi] = Owned(b, i);
    if (lo >= hi) continue;
    absl::StatusOr<Tensor> grad = b.reduced.Narrow(0, lo - dp_rank_ * b.chunk, hi - lo);
    p.slices.push_back(ParamSlice{i, lo - offset_of_[i], hi - lo, *grad});  // in range by construction
  }
  return p;
}

absl::Status GradSync::GatherParams() {
  if (dp_ == nullptr || zero_ == 0) return absl::OkStatus();
  for (Bucket& b : buckets_) {
    if (!b.partitioned) continue;
    const int64_t mine = dp_rank_ * b.chunk;
    // This rank's chunk of the updated weights (the padding zero), then all
    // of them.
    ASSIGN_OR_RETURN(Tensor send, Tensor::Zeros({b.chunk}, b.dtype, b.device));
    for (int i : b.params) {
      const Tensor& local = params_[i].bound.param.local();
      const auto [lo, hi] = Owned(b, i);
      if (lo >= hi) continue;
      ASSIGN_OR_RETURN(Tensor flat, local.Reshape({local.numel()}));
      ASSIGN_OR_RETURN(Tensor from, flat.Narrow(0, lo - offset_of_[i], hi - lo));
      ASSIGN_OR_RETURN(Tensor to, send.Narrow(0, lo - mine, hi - lo));
      RETURN_IF_ERROR(to.CopyFrom(from));
    }
    ASSIGN_OR_RETURN(Tensor all, Tensor::Empty({b.chunk * dp_size_}, b.dtype, b.device));
    RETURN_IF_ERROR(dp_->AllGather(send.raw_data(), all.raw_data(), b.chunk, b.dtype)->WaitOnDevice(pg_->timeout()));
    for (int i : b.params) {
      Tensor local = params_[i].bound.param.local();
      ASSIGN_OR_RETURN(Tensor gathered, all.Narrow(0, offset_of_[i], local.numel()));
      ASSIGN_OR_RETURN(Tensor shaped, gathered.Reshape(local.shape()));
      RETURN_IF_ERROR(local.CopyFrom(shaped));
    }
  }
  return absl::OkStatus();
}

int64_t GradSync::chunk_bytes() const {
  int64_t n = 0;
  for (const Bucket& b : buckets_) n += Releases(b) ? b.reduced.nbytes() : 0;
  return n;
}

}  // namespace colod::train
