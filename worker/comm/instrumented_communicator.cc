#include "worker/comm/instrumented_communicator.h"

#include "absl/time/clock.h"
#include "common/int_math.h"

namespace colod {
namespace {

// Tells the observer when the wrapped collective is first seen complete
// (by Wait or IsCompleted), with the time since it was submitted.
class ObservedWork final : public Work, public std::enable_shared_from_this<ObservedWork> {
 public:
  ObservedWork(InstrumentedCommunicator* owner, std::shared_ptr<Work> inner, absl::Time start,
               std::function<void(absl::Duration, bool ok)> done)
      : owner_(owner), inner_(std::move(inner)), start_(start), done_(std::move(done)) {}

  absl::Status Wait(absl::Duration timeout) override {
    absl::Status s = inner_->Wait(timeout);
    if (s.ok()) Report(true);
    ReportFailure(s);
    return s;
  }
  // The host does not see the completion of an op the device waits for: a
  // later sweep of the owner reports it once it is complete.
  absl::Status WaitOnDevice(absl::Duration timeout) override {
    absl::Status s = inner_->WaitOnDevice(timeout);
    if (s.ok() && !IsCompleted()) owner_->Defer(shared_from_this());
    ReportFailure(s);
    return s;
  }
  bool IsCompleted() override {
    const bool completed = inner_->IsCompleted();
    if (completed) Report(inner_->Wait(absl::ZeroDuration()).ok());
    return completed;
  }

 private:
  // After a wait that returned `s`: reports the op's failure, not a wait
  // that only ran out of time while the op goes on.
  void ReportFailure(const absl::Status& s) {
    if (!s.ok() && inner_->IsCompleted()) Report(false);
  }
  void Report(bool ok) {
    absl::MutexLock lock(&mu_);
    if (reported_) return;
    reported_ = true;
    done_(absl::Now() - start_, ok);
  }

  InstrumentedCommunicator* const owner_;  // outlives its works
  const std::shared_ptr<Work> inner_;
  const absl::Time start_;
  const std::function<void(absl::Duration, bool)> done_;
  absl::Mutex mu_;
  bool reported_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace

std::shared_ptr<Work> InstrumentedCommunicator::Observe(const char* op, int64_t count, int64_t copies, DType dtype,
                                                        const std::function<std::shared_ptr<Work>()>& submit) {
  const std::optional<int64_t> elements = count >= 0 ? CheckedMul(count, copies) : std::nullopt;
  const std::optional<int64_t> counted =
      elements.has_value() ? CheckedMul(*elements, static_cast<int64_t>(SizeOf(dtype))) : std::nullopt;
  if (!counted.has_value()) return submit();  // refused by the backend (CheckCollectiveCount): nothing moves
  const int64_t bytes = *counted;
  {
    absl::MutexLock lock(&mu_);
    OpStats& s = stats_[op];
    ++s.calls;
    s.bytes += bytes;
  }
  if (!observer_ && !recorder_) return submit();
  // Recorded before the backend takes it: a submission can wait on the host
  // (NCCL connects at first use), and the hang detector must see it then.
  const int64_t seq = recorder_ ? recorder_->Enqueue(group_, op, bytes) : 0;
  const absl::Time start = absl::Now();
  std::shared_ptr<Work> work = submit();
  Sweep();
  return std::make_shared<ObservedWork>(
      this, std::move(work), start,
      [observer = observer_, recorder = recorder_, group = group_, seq, op, bytes](absl::Duration d, bool ok) {
        if (recorder) recorder->End(group, seq, ok);
        if (observer && ok) observer(op, bytes, d);
      });
}

InstrumentedCommunicator::~InstrumentedCommunicator() {
  Sweep();
  if (recorder_) recorder_->CloseGroup(group_);
}

void InstrumentedCommunicator::Defer(std::shared_ptr<Work> work) {
  absl::MutexLock lock(&mu_);
  deferred_.push_back(std::move(work));
}

void InstrumentedCommunicator::Sweep() {
  std::vector<std::shared_ptr<Work>> pending;
  {
    absl::MutexLock lock(&mu_);
    pending.swap(deferred_);
  }
  if (pending.empty()) return;
  std::vector<std::shared_ptr<Work>> still;
  for (std::shared_ptr<Work>& w : pending) {
    if (!w->IsCompleted()) still.push_back(std::move(w));  // IsCompleted reports the others
  }
  absl::MutexLock lock(&mu_);
  deferred_.insert(deferred_.end(), std::make_move_iterator(still.begin()), std::make_move_iterator(still.end()));
}

InstrumentedCommunicator::OpStats InstrumentedCommunicator::Stats(const std::string& op) const {
  absl::MutexLock lock(&mu_);
  auto it = stats_.find(op);
  return it == stats_.end() ? OpStats() : it->second;
}

std::map<std::string, InstrumentedCommunicator::OpStats> InstrumentedCommunicator::AllStats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

std::shared_ptr<Work> InstrumentedCommunicator::AllReduce(void* data, int64_t count, DType dtype, ReduceOp op) {
  return Observe("all_reduce", count, 1, dtype, [&] { return inner_->AllReduce(data, count, dtype, op); });
}

std::shared_ptr<Work> InstrumentedCommunicator::AllGather(const void* in, void* out, int64_t count, DType dtype) {
  return Observe("all_gather", count, 1, dtype, [&] { return inner_->AllGather(in, out, count, dtype); });
}

std::shared_ptr<Work> InstrumentedCommunicator::ReduceScatter(const void* in, void* out, int64_t count, DType dtype,
                                                              ReduceOp op) {
  return Observe("reduce_scatter", count, size(), dtype,
                 [&] { return inner_->ReduceScatter(in, out, count, dtype, op); });
}

std::shared_ptr<Work> InstrumentedCommunicator::Broadcast(void* data, int64_t count, DType dtype, int root) {
  return Observe("broadcast", count, 1, dtype, [&] { return inner_->Broadcast(data, count, dtype, root); });
}

std::shared_ptr<Work> InstrumentedCommunicator::AllToAll(const void* in, void* out, int64_t count, DType dtype) {
  return Observe("all_to_all", count, size(), dtype, [&] { return inner_->AllToAll(in, out, count, dtype); });
}

std::shared_ptr<Work> InstrumentedCommunicator::Send(const void* data, int64_t count, DType dtype, int dst,
                                                     uint32_t tag) {
  return Observe("send", count, 1, dtype, [&] { return inner_->Send(data, count, dtype, dst, tag); });
}

std::shared_ptr<Work> InstrumentedCommunicator::Recv(void* data, int64_t count, DType dtype, int src, uint32_t tag) {
  return Observe("recv", count, 1, dtype, [&] { return inner_->Recv(data, count, dtype, src, tag); });
}

std::shared_ptr<Work> InstrumentedCommunicator::Barrier() {
  return Observe("barrier", 0, 1, DType::kF32, [&] { return inner_->Barrier(); });
}

}  // namespace colod
