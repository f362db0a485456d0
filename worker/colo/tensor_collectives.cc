#include "worker/colo/tensor_collectives.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace colod {

absl::StatusOr<std::vector<Tensor>> AllGatherPieces(const Tensor& t, Communicator& comm, absl::Duration timeout) {
  const int n = comm.size();
  const Tensor in = t.Contiguous();
  ASSIGN_OR_RETURN(Tensor flat, Tensor::Empty({n * in.numel()}, in.dtype(), in.device()));
  RETURN_IF_ERROR(comm.AllGather(in.raw_data(), flat.raw_data(), in.numel(), in.dtype())->WaitOnDevice(timeout));
  std::vector<Tensor> pieces;
  for (int j = 0; j < n; ++j) {
    ASSIGN_OR_RETURN(Tensor piece, flat.Narrow(0, j * in.numel(), in.numel()));
    ASSIGN_OR_RETURN(piece, piece.Reshape(in.shape()));
    pieces.push_back(std::move(piece));
  }
  return pieces;
}

absl::StatusOr<Tensor> AllGatherDim(const Tensor& t, int64_t dim, Communicator& comm, absl::Duration timeout) {
  ASSIGN_OR_RETURN(std::vector<Tensor> pieces, AllGatherPieces(t, comm, timeout));
  return Tensor::Cat(pieces, dim);
}

absl::StatusOr<Tensor> ReduceScatterBlocks(const std::vector<Tensor>& blocks, Communicator& comm,
                                           absl::Duration timeout, ReduceOp op) {
  if (static_cast<int>(blocks.size()) != comm.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("reduce-scatter: ", blocks.size(), " blocks for a group of ", comm.size()));
  }
  std::vector<Tensor> flat;
  for (const Tensor& b : blocks) {
    ASSIGN_OR_RETURN(Tensor f, b.Reshape({b.numel()}));
    flat.push_back(std::move(f));
  }
  ASSIGN_OR_RETURN(Tensor staged, Tensor::Cat(flat, 0));
  ASSIGN_OR_RETURN(Tensor out, Tensor::Empty(blocks[0].shape(), blocks[0].dtype(), blocks[0].device()));
  RETURN_IF_ERROR(comm.ReduceScatter(staged.raw_data(), out.raw_data(), out.numel(), out.dtype(), op)->WaitOnDevice(timeout));
  return out;
}

absl::StatusOr<Tensor> ReduceScatterDim(const Tensor& t, int64_t dim, Communicator& comm, absl::Duration timeout,
                                        ReduceOp op) {
  std::vector<Tensor> blocks;
  for (int j = 0; j < comm.size(); ++j) {
    ASSIGN_OR_RETURN(Tensor b, t.Chunk(dim, comm.size(), j));
    blocks.push_back(std::move(b));
  }
  return ReduceScatterBlocks(blocks, comm, timeout, op);
}

absl::Status AllReduceValues(std::vector<float>& values, ReduceOp op, Communicator& comm, Device device,
                             absl::Duration timeout) {
  const int64_t n = static_cast<int64_t>(values.size());
  if (comm.backend() != "nccl") {
    return comm.AllReduce(values.data(), n, DType::kF32, op)->Wait(timeout);
  }
  if (!device.is_cuda()) {
    return absl::FailedPreconditionError("an NCCL communicator needs the values staged on a CUDA device");
  }
  ASSIGN_OR_RETURN(Tensor host, Tensor::FromFloats({n}, values));
  ASSIGN_OR_RETURN(Tensor buf, host.To(device));
  RETURN_IF_ERROR(comm.AllReduce(buf.raw_data(), n, DType::kF32, op)->WaitOnDevice(timeout));
  std::vector<float> got = buf.ToFloats();  // waits for the device
  // Read after the device passed the collective: if it failed (the watchdog
  // aborted it) the values are not the reduction, and the error says why.
  RETURN_IF_ERROR(comm.AsyncError());
  values = std::move(got);
  return absl::OkStatus();
}

absl::StatusOr<Tensor> BroadcastFrom(const Tensor& t, int root, Communicator& comm, absl::Duration timeout) {
  // The root sends a copy of its data; elsewhere `t` only gives the shape.
  ASSIGN_OR_RETURN(Tensor buf,
                   comm.rank() == root ? t.Clone() : Tensor::Empty(t.shape(), t.dtype(), t.device()));
  RETURN_IF_ERROR(comm.Broadcast(buf.raw_data(), buf.numel(), buf.dtype(), root)->WaitOnDevice(timeout));
  return buf;
}

}  // namespace colod
