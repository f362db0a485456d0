#include "worker/comm/instrumented_communicator.h"

namespace colod {

void InstrumentedCommunicator::Count(const char* op, int64_t elements, DType dtype) {
  absl::MutexLock lock(&mu_);
  OpStats& s = stats_[op];
  ++s.calls;
  s.bytes += elements * static_cast<int64_t>(SizeOf(dtype));
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
  Count("all_reduce", count, dtype);
  return inner_->AllReduce(data, count, dtype, op);
}

std::shared_ptr<Work> InstrumentedCommunicator::AllGather(const void* in, void* out, int64_t count, DType dtype) {
  Count("all_gather", count, dtype);
  return inner_->AllGather(in, out, count, dtype);
}

std::shared_ptr<Work> InstrumentedCommunicator::ReduceScatter(const void* in, void* out, int64_t count, DType dtype,
                                                              ReduceOp op) {
  Count("reduce_scatter", count * size(), dtype);
  return inner_->ReduceScatter(in, out, count, dtype, op);
}

std::shared_ptr<Work> InstrumentedCommunicator::Broadcast(void* data, int64_t count, DType dtype, int root) {
  Count("broadcast", count, dtype);
  return inner_->Broadcast(data, count, dtype, root);
}

std::shared_ptr<Work> InstrumentedCommunicator::AllToAll(const void* in, void* out, int64_t count, DType dtype) {
  Count("all_to_all", count * size(), dtype);
  return inner_->AllToAll(in, out, count, dtype);
}

std::shared_ptr<Work> InstrumentedCommunicator::Send(const void* data, int64_t count, DType dtype, int dst,
                                                     uint32_t tag) {
  Count("send", count, dtype);
  return inner_->Send(data, count, dtype, dst, tag);
}

std::shared_ptr<Work> InstrumentedCommunicator::Recv(void* data, int64_t count, DType dtype, int src, uint32_t tag) {
  Count("recv", count, dtype);
  return inner_->Recv(data, count, dtype, src, tag);
}

std::shared_ptr<Work> InstrumentedCommunicator::Barrier() {
  Count("barrier", 0, DType::kF32);
  return inner_->Barrier();
}

}  // namespace colod
