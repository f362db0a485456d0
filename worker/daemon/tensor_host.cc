#include "worker/daemon/tensor_host.h"

#include <algorithm>
#include <limits>
#include <optional>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "common/int_math.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "worker/colo/redistribute.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/colo/tensor_proto.h"
#include "worker/tensor/autograd.h"

namespace colod {

absl::StatusOr<TensorHost::Entry*> TensorHost::FindLocked(const std::string& name) {
  if (closed_) return absl::UnavailableError("the job's rank has stopped");
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return absl::NotFoundError(absl::StrCat("no tensor '", name, "'"));
  return &it->second;
}

absl::StatusOr<v1::TensorLayout> TensorHost::LayoutLocked(const std::string& name, const Entry& e) {
  ASSIGN_OR_RETURN(v1::TensorLayout layout,
                   DescribeLayout(name, e.tensor.local().dtype(), e.tensor.global_shape(), e.tensor.spec(), mesh_));
  layout.set_compute_pattern(ComputePatternToProto(e.tensor.compute_spec().pattern));
  return layout;
}

TensorHost::Reservation::~Reservation() {
  if (bytes_ == 0) return;
  absl::MutexLock lock(&host_->mu_);
  host_->held_bytes_ -= bytes_;
}

void TensorHost::Reservation::KeepLocked(int64_t kept) {
  host_->held_bytes_ -= bytes_ - kept;
  bytes_ = 0;
}

absl::StatusOr<v1::TensorLayout> TensorHost::Create(const v1::CreateTensorRequest& req) {
  if (req.name().empty()) return absl::InvalidArgumentError("name: required");
  if (req.name().size() > kMaxNameBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("name: ", req.name().size(), " bytes, more than the ", kMaxNameBytes, " a tensor name may have"));
  }
  ASSIGN_OR_RETURN(DistSpec spec, DistSpecFromProto(req.dist_spec()));
  ASSIGN_OR_RETURN(ComputePattern pattern, ComputePatternFromProto(req.compute_pattern()));
  // The bytes it will take, reserved before anything is allocated.
  int64_t bytes = 0;
  DType random_dtype = DType::kF32;
  Shape random_shape;
  if (req.init_case() == v1::CreateTensorRequest::kValue) {
    bytes = static_cast<int64_t>(req.value().data().size());  // already here; the tensor is its size
  } else if (req.init_case() == v1::CreateTensorRequest::kRandom) {
    const v1::RandomInit& r = req.random();
    if (!v1::RandomInit::Distribution_IsValid(r.distribution())) {
      return absl::InvalidArgumentError(
          absl::StrCat("random.distribution: unknown value ", static_cast<int>(r.distribution())));
    }
    const v1::DType wire = r.dtype() == v1::DTYPE_UNSPECIFIED ? v1::DTYPE_F32 : r.dtype();
    ASSIGN_OR_RETURN(random_dtype, DTypeFromProto(wire, "random.dtype"));
    random_shape.assign(r.shape().begin(), r.shape().end());
    for (int64_t d : random_shape) {
      if (d < 1) return absl::InvalidArgumentError(absl::StrCat("random.shape: sizes must be >= 1, got ", d));
    }
    const std::optional<int64_t> checked = CheckedBytes(random_shape, static_cast<int64_t>(SizeOf(random_dtype)));
    if (!checked.has_value()) return absl::InvalidArgumentError("random.shape: its bytes overflow int64");
    bytes = *checked;
  }
  // The spec against the shape before anything is drawn or reserved: a
  // malformed request costs nothing (a tensor of gigabytes drawn only to
  // be refused would cost minutes on every rank).
  const Shape shape = req.init_case() == v1::CreateTensorRequest::kValue
                          ? Shape(req.value().shape().begin(), req.value().shape().end())
                          : random_shape;
  if (req.init_case() != v1::CreateTensorRequest::INIT_NOT_SET) {
    absl::StatusOr<DistSpec> normalized = NormalizeSpec(spec, mesh_, static_cast<int64_t>(shape.size()));
    absl::Status fits = normalized.ok() ? CheckDivisible(*normalized, shape) : normalized.status();
    if (!fits.ok()) return absl::InvalidArgumentError(absl::StrCat("dist_spec: ", fits.message()));
  }
  if (req.init_case() == v1::CreateTensorRequest::kRandom && !IsFloat(random_dtype)) {
    return absl::InvalidArgumentError(
        absl::StrCat("random.dtype: ", DTypeName(random_dtype), " is not a float dtype a random init draws"));
  }
  // While it is made, the whole value (read or drawn) and the rank's copy
  // of its part (up to the whole, replicated) are held together: twice its
  // size, plus its bookkeeping (a size near 2^63 fits no budget: kept there).
  const int64_t data_bytes = bytes;
  bytes = bytes > std::numeric_limits<int64_t>::max() - Cost(0, req.name()) ? std::numeric_limits<int64_t>::max()
                                                                             : Cost(bytes, req.name());
  const int64_t making = bytes > std::numeric_limits<int64_t>::max() - data_bytes ? std::numeric_limits<int64_t>::max()
                                                                                  : bytes + data_bytes;
  {
    absl::MutexLock lock(&mu_);
    if (closed_) return absl::UnavailableError("the job's rank has stopped");
    // (A create of a name taken is that, whatever the budget: a retry while
    // the first still runs is told again below, once it stored it.)
    if (tensors_.count(req.name())) return absl::AlreadyExistsError(absl::StrCat("tensor '", req.name(), "' exists"));
    if (making > budget_bytes_ - held_bytes_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("tensor '", req.name(), "' would take ", bytes, " bytes, and ", making,
                       " while it is made (the whole value beside this rank's part); this rank's tensors hold ",
                       held_bytes_, " of the ", budget_bytes_, " it may use (the worker's memory): delete some first"));
    }
    held_bytes_ += making;
  }
  // Given back unless the tensor is stored; the value's copy once it is made.
  Reservation reservation(this, making);
  Tensor global;
  switch (req.init_case()) {
    case v1::CreateTensorRequest::kValue: {
      ASSIGN_OR_RETURN(global, TensorFromProto(req.value()));
      break;
    }
    case v1::CreateTensorRequest::kRandom: {
      const v1::RandomInit& r = req.random();
      if (r.distribution() == v1::RandomInit::DISTRIBUTION_UNIFORM) {
        ASSIGN_OR_RETURN(global, Tensor::RandomUniform(random_shape, r.seed(), random_dtype));
      } else {
        ASSIGN_OR_RETURN(global, Tensor::RandomNormal(random_shape, r.seed(), random_dtype));
      }
      break;
    }
    default:
      return absl::InvalidArgumentError("init: one of value or random is required");
  }
  // The copy to the device and the shard are made without a lock (the
  // other calls, collectives included, go on meanwhile), counted in
  // creating_: Close waits for them, so the process group outlives them.
  const auto taken = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::Status {
    if (closed_) return absl::UnavailableError("the job's rank has stopped");
    if (tensors_.count(req.name())) return absl::AlreadyExistsError(absl::StrCat("tensor '", req.name(), "' exists"));
    return absl::OkStatus();
  };
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(taken());
    ++creating_;
  }
  auto creating = absl::MakeCleanup([this] {
    absl::MutexLock lock(&mu_);
    --creating_;
  });
  ASSIGN_OR_RETURN(global, global.To(device_));
  NoGradScope no_grad;
  absl::StatusOr<ColoTensor> t = ColoTensor::FromGlobal(global, spec, pg_);
  if (!t.ok()) {
    // A spec that does not fit the tensor is the caller's; anything else
    // (the device out of memory) keeps its code.
    if (!absl::IsInvalidArgument(t.status())) return t.status();
    return absl::InvalidArgumentError(absl::StrCat("dist_spec: ", t.status().message()));
  }
  t->set_compute_spec({pattern});
  global = Tensor();  // the whole value goes before the map's lock is taken
  std::move(creating).Invoke();
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(taken());  // a Create of the same name may have come first
  Entry& e = tensors_.emplace(req.name(), Entry{*std::move(t), next_id_++, bytes, req.creation_id()}).first->second;
  reservation.KeepLocked(bytes);  // held by the entry now; the rest given back
  return LayoutLocked(req.name(), e);
}

namespace {

// FNV-1a, 64 bits: the same on every rank and process (absl::Hash is
// seeded per process).
uint64_t Fingerprint(absl::string_view text) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// RESOURCE_EXHAUSTED where a value of `shape` and `dtype` is over
// kMaxValueBytes, the message `what` N bytes, then `remedy`.
absl::Status AnswerFits(const Shape& shape, DType dtype, absl::string_view what, absl::string_view remedy) {
  const std::optional<int64_t> bytes = CheckedBytes(shape, static_cast<int64_t>(SizeOf(dtype)));
  if (bytes.has_value() && *bytes <= TensorHost::kMaxValueBytes) return absl::OkStatus();
  return absl::ResourceExhaustedError(absl::StrCat(what, bytes.value_or(-1), " bytes, over the ",
                                                   TensorHost::kMaxValueBytes,
                                                   " an answer carries (gRPC's 4 MiB messages): ", remedy));
}

}  // namespace

absl::Status TensorHost::AgreeOnEveryRank(const std::string& call, const std::string& name,
                                          const absl::StatusOr<Entry>& found, bool room) {
  std::string what = absl::StrCat(call, "|", name, "|");
  if (found.ok()) {
    const ColoTensor& t = found->tensor;
    absl::StrAppend(&what, DTypeName(t.local().dtype()), "|", ShapeToString(t.global_shape()), "|",
                    t.spec().ToString());
    // Only where set: a worker from before the field (or a coordinator that
    // sets none) fingerprints without it, and ranks of both still agree.
    if (found->creation_id != 0) absl::StrAppend(&what, "|", found->creation_id);
  } else {
    absl::StrAppend(&what, "absent");
  }
  const uint64_t mine = Fingerprint(what);
  // Four 16-bit pieces (exact in f32), then the verdict so far, the max
  // of the ranks': 0 alike, kNoRoom a rank lacks room, 1 they differ. Five
  // floats, as before the room was agreed: a worker from before it gathers
  // as many (pieces of two sizes would abort a Gloo worker), and reads any
  // verdict but 0 as a refusal.
  constexpr float kNoRoom = 0.5f;
  std::vector<float> values = {static_cast<float>(mine & 0xffff), static_cast<float>((mine >> 16) & 0xffff),
                               static_cast<float>((mine >> 32) & 0xffff), static_cast<float>(mine >> 48),
                               room ? 0.0f : kNoRoom};
  // One pass over the axes tells every rank: after axis k, a rank's flag is
  // whether the ranks of its slice over axes 1..k differ (its group along
  // k holds one rank of each slice over 1..k-1: a flag there, or two
  // fingerprints that differ, where each of those slices agrees within).
  for (const MeshAxis& axis : mesh_.axes()) {
    if (axis.size < 2) continue;
    ASSIGN_OR_RETURN(Communicator * comm, pg_->Comm(axis.name));
    ASSIGN_OR_RETURN(Tensor here, Tensor::FromFloats({static_cast<int64_t>(values.size())}, values));
    ASSIGN_OR_RETURN(here, here.To(device_));
    ASSIGN_OR_RETURN(std::vector<Tensor> pieces, AllGatherPieces(here, *comm, pg_->timeout()));
    for (const Tensor& piece : pieces) {
      ASSIGN_OR_RETURN(Tensor host, piece.To(Device::Cpu()));
      const std::vector<float> theirs = host.ToFloats();
      if (theirs.size() != values.size()) return absl::InternalError("a fingerprint of another size");
      if (!std::equal(values.begin(), values.begin() + 4, theirs.begin())) values[4] = 1;
      values[4] = std::max(values[4], theirs[4]);
    }
  }
  if (values[4] == kNoRoom && found.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("a rank of the job lacks the room ", call, " of tensor '", name,
                     "' needs for its temporaries (at each step of it, the part it starts from and twice the "
                     "part after it; this rank ",
                     room ? "has it" : "lacks it", "): delete some tensors first; it did not run"));
  }
  if (values[4] == 0) return found.ok() ? absl::OkStatus() : found.status();
  return absl::FailedPreconditionError(absl::StrCat(
      "the job's ranks do not all hold tensor '", name, "' alike (this rank: ",
      found.ok() ? absl::StrCat(ShapeToString(found->tensor.global_shape()), " ", found->tensor.spec().ToString())
                 : "none",
      "), or were not all asked the same: its calls reached some ranks and not others (an earlier call cut "
      "short, or a worker called directly), a create was refused on some, or a delete reached only some and "
      "the tensor was made again; ",
      call, " did not run. Delete the tensor and create it again"));
}

absl::Status TensorHost::OpenForCollectives() {
  absl::MutexLock lock(&mu_);
  return closed_ ? absl::UnavailableError("the job's rank has stopped") : absl::OkStatus();
}

absl::StatusOr<TensorHost::Entry> TensorHost::Snapshot(const std::string& name) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Entry * e, FindLocked(name));
  return *e;
}

int64_t TensorHost::ConversionBytes(const ColoTensor& t, const DistSpec& target) {
  // A plan that cannot be made is refused by the conversion on every rank
  // alike, before any data moves: it reserves nothing.
  absl::StatusOr<std::vector<RedistributeStep>> plan = t.Plan(target);
  if (!plan.ok()) return 0;
  const Shape& global = t.global_shape();
  const int64_t element = static_cast<int64_t>(SizeOf(t.local().dtype()));
  DistSpec at = t.spec();
  // The part a step starts from (the tensor's own, first: counted already)
  // and, beside it, its result and the pieces it gathers for it, each up to
  // the part after the step. (A plan may gather to the whole and then cut:
  // its middle steps hold the most.)
  int64_t before = 0, most = 0;
  for (const RedistributeStep& step : *plan) {
    at.Set(step.axis, step.to);
    const std::optional<int64_t> after = CheckedBytes(LocalShape(at, global), element);
    const std::optional<int64_t> twice = after.has_value() ? CheckedMul(*after, 2) : std::nullopt;
    const std::optional<int64_t> held = twice.has_value() ? CheckedAdd(before, *twice) : std::nullopt;
    if (!held.has_value()) return std::numeric_limits<int64_t>::max();
    most = std::max(most, *held);
    before = *after;
  }
  return most;
}

absl::StatusOr<v1::TensorLayout> TensorHost::SetDistSpec(const v1::SetDistSpecRequest& req) {
  ASSIGN_OR_RETURN(DistSpec spec, DistSpecFromProto(req.dist_spec()));
  absl::MutexLock order(&collective_mu_);
  RETURN_IF_ERROR(OpenForCollectives());
  const absl::StatusOr<Entry> found = Snapshot(req.name());
  // The conversion's temporaries, reserved before the collective: a rank
  // without that room says so in the agreement, and every rank refuses,
  // rather than one failing (or being killed) alone inside the collective.
  const int64_t temporaries = found.ok() ? ConversionBytes(found->tensor, spec) : 0;
  bool room = false;
  {
    absl::MutexLock lock(&mu_);
    room = !found.ok() || temporaries <= budget_bytes_ - held_bytes_;
    if (room && found.ok()) held_bytes_ += temporaries;
  }
  const Reservation reserved(this, room && found.ok() ? temporaries : 0);
  RETURN_IF_ERROR(AgreeOnEveryRank(absl::StrCat("SetDistSpec to ", spec.ToString()), req.name(), found, room));
  const Entry& current = *found;
  NoGradScope no_grad;
  ASSIGN_OR_RETURN(ColoTensor next, current.tensor.Redistribute(spec));  // the collective, without the map's lock
  // On NCCL the collective was only enqueued: a communicator the watchdog
  // aborts meanwhile leaves the stream to run past it, and `next` holds what
  // its memory held. It is kept only once the device ran it, without an error.
  if (next.local().device().is_cuda()) RETURN_IF_ERROR(kernels::CudaSynchronize(next.local().device().index));
  RETURN_IF_ERROR(pg_->AsyncError());
  absl::MutexLock lock(&mu_);
  auto it = tensors_.find(req.name());
  if (it == tensors_.end() || it->second.id != current.id) {  // deleted (and maybe made again) meanwhile
    return absl::NotFoundError(absl::StrCat("tensor '", req.name(), "' was deleted while it was redistributed"));
  }
  it->second.tensor = std::move(next);
  return LayoutLocked(req.name(), it->second);
}

absl::StatusOr<v1::GetShardResponse> TensorHost::GetShard(const v1::GetShardRequest& req) {
  v1::GetShardResponse resp;
  Tensor local;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Entry * e, FindLocked(req.name()));  // UNAVAILABLE once closed: the group may be gone
    if (req.rank() != rank_) {
      return absl::InvalidArgumentError(absl::StrCat("rank: this worker holds rank ", rank_, ", not ", req.rank()));
    }
    ASSIGN_OR_RETURN(v1::TensorLayout layout, LayoutLocked(req.name(), *e));
    *resp.mutable_layout() = layout.shards(rank_);
    local = e->tensor.local();
    RETURN_IF_ERROR(AnswerFits(local.shape(), local.dtype(),
                               absl::StrCat("rank ", rank_, "'s shard of tensor '", req.name(), "' is "),
                               "reshard it over more ranks"));
  }
  // The copy to the host waits for the device (on CUDA behind a collective
  // in progress), without the map's lock.
  ASSIGN_OR_RETURN(*resp.mutable_value(), TensorToProto(local));
  return resp;
}

absl::StatusOr<v1::TensorValue> TensorHost::GetGlobal(const std::string& name, bool answer) {
  absl::MutexLock order(&collective_mu_);
  RETURN_IF_ERROR(OpenForCollectives());
  const absl::StatusOr<Entry> found = Snapshot(name);
  // (Its temporaries are bounded by kMaxValueBytes, checked below.)
  RETURN_IF_ERROR(AgreeOnEveryRank("GetGlobal", name, found, /*room=*/true));
  // Alike on every rank (agreed above): every rank refuses it.
  RETURN_IF_ERROR(AnswerFits(found->tensor.global_shape(), found->tensor.local().dtype(),
                             absl::StrCat("tensor '", name, "' whole is "),
                             "read it a shard at a time (GetShard), or reshard it so that the shards fit"));
  NoGradScope no_grad;
  ASSIGN_OR_RETURN(ColoTensor whole, found->tensor.ToReplicate());
  if (!answer) return v1::TensorValue();
  ASSIGN_OR_RETURN(v1::TensorValue value, TensorToProto(whole.local()));  // waits for the device
  // A gather that NCCL's watchdog aborted (a peer late past the timeout)
  // left the stream to run past it: what was read is not the tensor.
  RETURN_IF_ERROR(pg_->AsyncError());
  return value;
}

absl::StatusOr<v1::TensorLayout> TensorHost::Describe(const std::string& name) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Entry * e, FindLocked(name));
  return LayoutLocked(name, *e);
}

std::vector<v1::TensorLayout> TensorHost::List(const std::string& after, std::string* next) {
  absl::MutexLock lock(&mu_);
  std::vector<v1::TensorLayout> out;
  size_t bytes = 0;
  if (next != nullptr) next->clear();
  for (auto it = after.empty() ? tensors_.begin() : tensors_.upper_bound(after); it != tensors_.end(); ++it) {
    absl::StatusOr<v1::TensorLayout> layout = LayoutLocked(it->first, it->second);
    if (!layout.ok()) continue;
    const size_t size = layout->ByteSizeLong() + 6;  // and its field's tag and length
    if (!out.empty() && bytes + size > kMaxListBytes) {
      if (next != nullptr) *next = out.back().name();
      break;
    }
    bytes += size;
    out.push_back(*std::move(layout));
  }
  return out;
}

void TensorHost::Close() {
  absl::MutexLock order(&collective_mu_);  // the collective in progress ends first
  absl::MutexLock lock(&mu_);
  closed_ = true;
  // And the Creates making their shards (a copy, no collective).
  mu_.Await(absl::Condition(
      +[](int* creating) { return *creating == 0; }, &creating_));
  for (const auto& [name, e] : tensors_) held_bytes_ -= e.bytes;
  tensors_.clear();
}

absl::Status TensorHost::Delete(const std::string& name) {
  absl::MutexLock lock(&mu_);
  if (closed_) return absl::UnavailableError("the job's rank has stopped");
  auto it = tensors_.find(name);
  if (it == tensors_.end()) return absl::NotFoundError(absl::StrCat("no tensor '", name, "'"));
  held_bytes_ -= it->second.bytes;
  tensors_.erase(it);
  return absl::OkStatus();
}

}  // namespace colod
