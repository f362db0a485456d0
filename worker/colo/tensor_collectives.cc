#include "worker/colo/tensor_collectives.h"

#include <limits>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace colod {

absl::StatusOr<std::vector<Tensor>> AllGatherPieces(const Tensor& t, Communicator& comm, absl::Duration timeout) {
  const int n = comm.size();
  ASSIGN_OR_RETURN(const Tensor in, t.TryContiguous());
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

absl::Status CheckBackend(const Tensor& t, const Communicator& comm) {
  const bool wants_cuda = comm.backend() == "nccl";
  if (t.device().is_cuda() == wants_cuda) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat("a ", t.device().ToString(), " tensor cannot move over a ",
                                                    comm.backend(), " communicator; use ",
                                                    wants_cuda ? "a gloo" : "an nccl", " process group"));
}

absl::Status AllReduceInPlace(Tensor& t, ReduceOp op, Communicator& comm, absl::Duration timeout) {
  if (!t.is_contiguous()) return absl::InvalidArgumentError("all-reduce in place: the tensor must be contiguous");
  if (comm.size() == 1 || t.numel() == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CheckBackend(t, comm));
  return comm.AllReduce(t.raw_data(), t.numel(), t.dtype(), op)->WaitOnDevice(timeout);
}

absl::StatusOr<Tensor> BroadcastFrom(const Tensor& t, int root, Communicator& comm, absl::Duration timeout) {
  // The root sends a copy of its data; elsewhere `t` only gives the shape.
  ASSIGN_OR_RETURN(Tensor buf,
                   comm.rank() == root ? t.TryClone() : Tensor::Empty(t.shape(), t.dtype(), t.device()));
  RETURN_IF_ERROR(comm.Broadcast(buf.raw_data(), buf.numel(), buf.dtype(), root)->WaitOnDevice(timeout));
  return buf;
}

absl::StatusOr<Tensor> AnyOverMesh(ProcessGroup& pg, bool mine, const Device& device) {
  Tensor flag;
  if (mine) {
    ASSIGN_OR_RETURN(const Tensor host, Tensor::FromFloats({1}, {1.0f}));
    ASSIGN_OR_RETURN(flag, host.To(device));
  } else {
    ASSIGN_OR_RETURN(flag, Tensor::Zeros({1}, DType::kF32, device));
  }
  // Along each axis in turn: the max of maxes over groups that cover the
  // mesh is the mesh's (axes that overlap, as a 2D mesh's, count twice,
  // which a max does not mind).
  for (const MeshAxis& axis : pg.mesh().axes()) {
    if (axis.size < 2) continue;
    ASSIGN_OR_RETURN(Communicator * comm, pg.Comm(axis.name));
    RETURN_IF_ERROR(comm->AllReduce(flag.raw_data(), 1, DType::kF32, ReduceOp::kMax)->WaitOnDevice(pg.timeout()));
  }
  return flag;
}

namespace {

// AgreeOverMesh's verdict from the agreed flag `any` (AnyOverMesh's or a
// group's).
absl::Status Agreed(ProcessGroup& pg, const absl::Status& mine, const absl::StatusOr<Tensor>& any,
                    absl::string_view peer_failed) {
  const absl::StatusOr<std::vector<float>> agreed =
      any.ok() ? any->ReadFloats() : absl::StatusOr<std::vector<float>>(any.status());
  if (!mine.ok()) return mine;
  RETURN_IF_ERROR(agreed.status());
  // A 1 comes only from a peer that failed (a peer's abort may follow it).
  if (agreed->empty() || (*agreed)[0] != 0) return MarkPeerCaused(absl::AbortedError(peer_failed));
  // A communicator that failed or was aborted (NCCL: the stream ran past
  // the collective) leaves this rank's own 0 in place, not the mesh's.
  return pg.AsyncError();
}

}  // namespace

absl::Status AgreeOverMesh(ProcessGroup& pg, const absl::Status& mine, const Device& device,
                           absl::string_view peer_failed) {
  return Agreed(pg, mine, AnyOverMesh(pg, !mine.ok(), device), peer_failed);
}

absl::Status AgreeOverGroup(ProcessGroup& pg, const std::string& group, const absl::Status& mine, const Device& device,
                            absl::string_view peer_failed) {
  const auto any = [&]() -> absl::StatusOr<Tensor> {
    ASSIGN_OR_RETURN(Tensor flag, Tensor::Zeros({1}, DType::kF32, device));
    if (!mine.ok()) {
      ASSIGN_OR_RETURN(const Tensor one, Tensor::FromFloats({1}, {1.0f}));
      RETURN_IF_ERROR(flag.CopyFrom(one));
    }
    ASSIGN_OR_RETURN(Communicator * comm, pg.Comm(group));
    if (comm->size() > 1) {
      RETURN_IF_ERROR(comm->AllReduce(flag.raw_data(), 1, DType::kF32, ReduceOp::kMax)->WaitOnDevice(pg.timeout()));
    }
    return flag;
  };
  return Agreed(pg, mine, any(), peer_failed);
}

absl::Status SameOverMesh(ProcessGroup& pg, int64_t mine, const Device& device, absl::string_view what) {
  if (mine == std::numeric_limits<int64_t>::min()) {  // (its negation overflows)
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", mine, " cannot be compared"));
  }
  // The max of {mine, -mine}: the mesh's largest and (negated) smallest.
  ASSIGN_OR_RETURN(Tensor both, Tensor::FromInt64s({2}, {mine, -mine}));
  ASSIGN_OR_RETURN(both, both.To(device));
  for (const MeshAxis& axis : pg.mesh().axes()) {
    if (axis.size < 2) continue;
    ASSIGN_OR_RETURN(Communicator * comm, pg.Comm(axis.name));
    RETURN_IF_ERROR(comm->AllReduce(both.raw_data(), 2, DType::kI64, ReduceOp::kMax)->WaitOnDevice(pg.timeout()));
  }
  ASSIGN_OR_RETURN(const std::vector<int64_t> got, both.ReadInt64s());
  if (got.size() != 2) return absl::InternalError(absl::StrCat(what, ": the agreement read ", got.size(), " values"));
  const int64_t largest = got[0], smallest = -got[1];
  // Values that differ came from a peer (a peer's abort may follow them);
  // the same ones may be this rank's own, left in place by a communicator
  // that failed or was aborted (NCCL: the stream ran past the collective).
  if (largest != mine || smallest != mine) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": this rank's ", mine, ", another's ", largest != mine ? largest : smallest));
  }
  return pg.AsyncError();
}

}  // namespace colod
