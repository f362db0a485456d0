#include "worker/train/optimizer.h"

#include <algorithm>
#include <cmath>
#include <set>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/clip.h"
#include "worker/colo/tensor_collectives.h"
#include "worker/tensor/ops.h"

namespace colod::train {

using shardformer::NamedParam;

absl::StatusOr<OptimizerOptions::Kind> ParseOptimizer(const std::string& name) {
  if (name == "adamw") return OptimizerOptions::Kind::kAdamW;
  if (name == "sgd") return OptimizerOptions::Kind::kSgd;
  return absl::InvalidArgumentError(absl::StrCat("optimizer '", name, "' is not one of adamw, sgd"));
}

Partition Partition::Whole(const std::vector<NamedParam>& params) {
  Partition p;
  for (size_t i = 0; i < params.size(); ++i) {
    p.slices.push_back(ParamSlice{static_cast<int>(i), 0, params[i].bound.param.local().numel(), std::nullopt});
  }
  return p;
}

absl::StatusOr<Optimizer> Optimizer::Create(std::vector<NamedParam> params, OptimizerOptions options) {
  Partition whole = Partition::Whole(params);
  return Create(std::move(params), options, std::move(whole));
}

absl::StatusOr<Optimizer> Optimizer::Create(std::vector<NamedParam> params, OptimizerOptions options,
                                            Partition partition) {
  Optimizer o(std::move(params), options, std::move(partition));
  for (const NamedParam& p : o.params_) {
    const Tensor& t = p.bound.param.local();
    if (t.dtype() != DType::kF32 && t.dtype() != DType::kBF16 && t.dtype() != DType::kF16) {
      return absl::InvalidArgumentError(absl::StrCat(p.name, " is ", DTypeName(t.dtype()), ", not a float"));
    }
  }
  for (size_t i = 0; i < o.partition_.slices.size(); ++i) {
    const ParamSlice& s = o.partition_.slices[i];
    if (s.param < 0 || s.param >= static_cast<int>(o.params_.size())) {
      return absl::InvalidArgumentError(absl::StrCat("slice ", i, " names parameter ", s.param));
    }
    const Tensor& t = o.params_[s.param].bound.param.local();
    if (!o.Whole(i) && !t.is_contiguous()) {  // its slice is updated through a flat view
      return absl::InvalidArgumentError(absl::StrCat(o.params_[s.param].name, " is not contiguous"));
    }
    if (s.offset < 0 || s.length < 1 || s.offset > t.numel() - s.length) {
      return absl::InvalidArgumentError(absl::StrCat("slice [", s.offset, ", +", s.length, ") of ",
                                                     o.params_[s.param].name, " is outside its ", t.numel(),
                                                     " elements"));
    }
    ASSIGN_OR_RETURN(Tensor held, o.SliceOf(i, t));
    Tensor master;
    if (t.dtype() != DType::kF32) {
      ASSIGN_OR_RETURN(master, held.ToDType(DType::kF32));
      ASSIGN_OR_RETURN(master, master.TryClone());
    }
    o.master_.push_back(master);
    ASSIGN_OR_RETURN(Tensor m, Tensor::Zeros(held.shape(), DType::kF32, t.device()));
    o.m_.push_back(m);
    if (options.kind == OptimizerOptions::Kind::kAdamW) {
      ASSIGN_OR_RETURN(Tensor v, Tensor::Zeros(held.shape(), DType::kF32, t.device()));
      o.v_.push_back(v);
    }
  }
  return o;
}

bool Optimizer::Whole(size_t i) const {
  const ParamSlice& s = partition_.slices[i];
  return s.offset == 0 && s.length == params_[s.param].bound.param.local().numel();
}

absl::StatusOr<Tensor> Optimizer::SliceOf(size_t i, const Tensor& t) const {
  const ParamSlice& s = partition_.slices[i];
  const Tensor& local = params_[s.param].bound.param.local();
  if (Whole(i)) return t.numel() == local.numel() && t.shape() != local.shape() ? t.Reshape(local.shape()) : t;
  if (t.numel() == s.length) return t.Reshape({s.length});
  ASSIGN_OR_RETURN(Tensor flat, t.Reshape({t.numel()}));
  return flat.Narrow(0, s.offset, s.length);
}

absl::StatusOr<Tensor> Optimizer::F32Weights(size_t param, ProcessGroup* pg) const {
  if (param >= params_.size()) return absl::InvalidArgumentError(absl::StrCat("no parameter ", param));
  const Tensor& local = params_[param].bound.param.local();
  // Summed over dp unless some slice of it is kept whole on every dp rank
  // (the same on every dp rank: such a parameter is a slice of each, and a
  // partitioned one never is).
  bool summed = partition_.over_dp;
  for (const ParamSlice& s : partition_.slices) summed = summed && (s.param != static_cast<int>(param) || s.grad);
  // This rank's slices in place, zeros elsewhere (nothing collective).
  const auto mine = [&]() -> absl::StatusOr<Tensor> {
    ASSIGN_OR_RETURN(Tensor out, Tensor::Zeros(local.shape(), DType::kF32, local.device()));
    ASSIGN_OR_RETURN(Tensor flat, out.Reshape({out.numel()}));
    for (size_t i = 0; i < partition_.slices.size(); ++i) {
      const ParamSlice& s = partition_.slices[i];
      if (s.param != static_cast<int>(param)) continue;
      Tensor weights = master_[i];  // f32 (Mixed), else the f32 parameter's own
      if (!Mixed(i)) {
        ASSIGN_OR_RETURN(weights, SliceOf(i, local));
      }
      ASSIGN_OR_RETURN(const Tensor dense, weights.TryContiguous());
      ASSIGN_OR_RETURN(Tensor run, dense.Reshape({s.length}));
      ASSIGN_OR_RETURN(Tensor to, flat.Narrow(0, s.offset, s.length));
      RETURN_IF_ERROR(to.CopyFrom(run));
    }
    return out;
  };
  absl::StatusOr<Tensor> out = mine();
  const absl::StatusOr<int> dp = pg->AxisSize("dp");
  if (!partition_.over_dp || !dp.ok() || *dp < 2) return out;
  // Under ZeRO the dp group agrees first, for every parameter: a rank that
  // could not take its part (no device memory for the copy) must not leave
  // its peers in this parameter's sum while it goes on to the next
  // collective. (A device's later failure is the communicator's sticky
  // error, which the save's agreement reads: ProcessGroup::AsyncError.)
  RETURN_IF_ERROR(
      AgreeOverGroup(*pg, "dp", out.status(), local.device(),
                     absl::StrCat("a dp peer could not take its part of the f32 weights of ", params_[param].name)));
  if (summed) {
    ASSIGN_OR_RETURN(Communicator * comm, pg->Comm("dp"));
    RETURN_IF_ERROR(
        comm->AllReduce(out->raw_data(), out->numel(), DType::kF32, ReduceOp::kSum)->WaitOnDevice(pg->timeout()));
  }
  return out;
}

absl::StatusOr<Tensor> Optimizer::SliceGrad(size_t i) const {
  const ParamSlice& s = partition_.slices[i];
  if (s.grad.has_value()) return SliceOf(i, *s.grad);
  std::optional<Tensor> grad = params_[s.param].bound.param.variable().grad();
  if (!grad.has_value()) {
    return absl::FailedPreconditionError(absl::StrCat(params_[s.param].name, " has no gradient"));
  }
  return SliceOf(i, grad->Contiguous());
}

absl::Status Optimizer::Step(double lr, double grad_scale) { return Step(lr, grad_scale, std::nullopt); }

absl::Status Optimizer::Step(double lr, const Tensor& grad_scale_at) {
  if (options_.kind != OptimizerOptions::Kind::kAdamW) {  // SGD scales on the host: read it
    ASSIGN_OR_RETURN(const std::vector<float> scale, grad_scale_at.ReadFloats());
    if (scale.size() != 1) return absl::InvalidArgumentError("the gradients' scale must be one number");
    return Step(lr, scale[0], std::nullopt);
  }
  return Step(lr, 1.0, grad_scale_at);
}

absl::Status Optimizer::Step(double lr, double grad_scale, const std::optional<Tensor>& grad_scale_at) {
  ++steps_;
  std::vector<ops::AdamWParam> adam;
  for (size_t i = 0; i < partition_.slices.size(); ++i) {
    ASSIGN_OR_RETURN(Tensor held, SliceOf(i, params_[partition_.slices[i].param].bound.param.local()));
    const bool mixed = Mixed(i);
    Tensor param = mixed ? master_[i] : held;  // the f32 weights the update runs on
    ASSIGN_OR_RETURN(Tensor grad, SliceGrad(i));
    if (options_.kind == OptimizerOptions::Kind::kAdamW) {
      // One fused step over every slice below: the gradient is read in its
      // own dtype and the held bf16/f16 copy written by the kernel.
      ops::AdamWParam a;
      a.master = param;
      if (mixed) a.held = held;
      a.grad = grad;
      a.m = m_[i];
      a.v = v_[i];
      adam.push_back(std::move(a));
      continue;
    }
    if (mixed) {
      ASSIGN_OR_RETURN(grad, grad.ToDType(DType::kF32));
    }
    if (grad_scale != 1.0) {
      ASSIGN_OR_RETURN(grad, Scale(grad, static_cast<float>(grad_scale)));
    }
    RETURN_IF_ERROR(SgdStep(param, grad, m_[i], lr));
    if (mixed) {
      ASSIGN_OR_RETURN(Tensor rounded, param.ToDType(held.dtype()));
      RETURN_IF_ERROR(held.CopyFrom(rounded));
    }
  }
  if (adam.empty()) return absl::OkStatus();
  ops::AdamWOptions o;
  o.lr = static_cast<float>(lr);
  o.beta1 = static_cast<float>(options_.beta1);
  o.beta2 = static_cast<float>(options_.beta2);
  o.eps = static_cast<float>(options_.eps);
  o.weight_decay = static_cast<float>(options_.weight_decay);
  o.grad_scale = static_cast<float>(grad_scale);
  o.grad_scale_at = grad_scale_at;
  return ops::AdamW(adam, steps_, o);
}

// torch.optim.SGD: g' = g + wd * p; buf = momentum * buf + g' (buf = g' at
// the first step); p -= lr * buf.
absl::Status Optimizer::SgdStep(Tensor& param, const Tensor& grad, Tensor& buffer, double lr) {
  Tensor g = grad;
  if (options_.weight_decay != 0) {
    ASSIGN_OR_RETURN(Tensor decay, Scale(param, static_cast<float>(options_.weight_decay)));
    ASSIGN_OR_RETURN(g, Add(g, decay));
  }
  Tensor buf = g;
  if (steps_ > 1) {
    ASSIGN_OR_RETURN(Tensor kept, Scale(buffer, static_cast<float>(options_.momentum)));
    ASSIGN_OR_RETURN(buf, Add(kept, g));
  }
  RETURN_IF_ERROR(buffer.CopyFrom(buf));
  ASSIGN_OR_RETURN(Tensor delta, Scale(buf, static_cast<float>(lr)));
  ASSIGN_OR_RETURN(Tensor updated, Sub(param, delta));
  return param.CopyFrom(updated);
}

void Optimizer::ZeroGrad() {
  for (NamedParam& p : params_) {
    Variable v = p.bound.param.variable();
    v.ZeroGrad();
  }
}

std::vector<Optimizer::StateTensor> Optimizer::State() {
  std::vector<StateTensor> out;
  const bool adam = options_.kind == OptimizerOptions::Kind::kAdamW;
  for (size_t i = 0; i < partition_.slices.size(); ++i) {
    const ParamSlice& s = partition_.slices[i];
    const NamedParam* p = &params_[s.param];
    auto add = [&](const char* state, const Tensor& t) {
      std::string name = absl::StrCat(p->name, ".", state);
      if (!Whole(i)) absl::StrAppend(&name, "@", s.offset);
      out.push_back(StateTensor{std::move(name), p, state, s.offset, t});
    };
    add(adam ? "exp_avg" : "momentum_buffer", m_[i]);
    if (adam) add("exp_avg_sq", v_[i]);
    if (Mixed(i)) add("master", master_[i]);
  }
  return out;
}

int64_t Optimizer::state_bytes() const {
  int64_t n = 0;
  for (const Tensor& t : m_) n += t.nbytes();
  for (const Tensor& t : v_) n += t.nbytes();
  for (size_t i = 0; i < master_.size(); ++i) n += Mixed(i) ? master_[i].nbytes() : 0;
  return n;
}

namespace {

// The sum of squares of `grads`, each of parameter `params[k]`, that this
// rank counts (see the file comment), summed over tp and pp, and over dp
// when `over_dp` (ZeRO: the dp ranks hold disjoint slices; a parameter kept
// whole on every dp rank, `whole[k]`, is then counted on dp rank 0).
// Enqueued where the gradients are (the parameters' device, whether or not
// this rank counts any) and all-reduced there: `squares` holds one sum, or
// with an order a sum a slot (NormOrder), which the norm adds in slot order
// in double. `comms` ran the all-reduces (their errors are seen once the
// host has waited for them).
struct Squares {
  Tensor squares;
  std::vector<Communicator*> comms;
};
absl::StatusOr<Squares> SquaresOf(const std::vector<const NamedParam*>& params, const std::vector<Tensor>& grads,
                                  const std::vector<bool>& whole, bool over_dp, const Device& device,
                                  ProcessGroup* pg, const NormOrder* order) {
  const DeviceMesh& mesh = pg->mesh();
  const std::vector<int> coords = mesh.Coordinates(pg->rank());
  ASSIGN_OR_RETURN(std::vector<int> dp_axes, mesh.AxisIndices("dp"));
  const bool slotted = order != nullptr && !order->empty();
  ASSIGN_OR_RETURN(Tensor total, Tensor::Zeros({slotted ? order->size() : 1}, DType::kF32, device));
  std::vector<Tensor> counted;  // the gradients this rank counts
  // Pipeline stages hold different parameters: each counts its own.
  std::vector<int> pp_axes;
  if (auto pp = mesh.AxisIndices("pp"); pp.ok()) pp_axes = *pp;
  for (size_t k = 0; k < params.size(); ++k) {
    const NamedParam& p = *params[k];
    if (p.mirror) continue;  // a shared table's owner (its first holder) counts it
    const ColoParameter& param = p.bound.param;
    std::set<int> split(pp_axes.begin(), pp_axes.end());
    // dp replicas are equal: each counts (the sum is not over dp), or, over
    // dp, each its own slice, or rank 0 a whole parameter.
    if (!over_dp || !whole[k]) split.insert(dp_axes.begin(), dp_axes.end());
    for (const auto& [axis, placement] : param.spec().placements()) {
      if (placement.kind != Placement::Kind::kShard) continue;
      ASSIGN_OR_RETURN(std::vector<int> indices, mesh.AxisIndices(axis));
      split.insert(indices.begin(), indices.end());
    }
    bool counts = true;
    for (size_t i = 0; i < coords.size(); ++i) counts = counts && (split.count(static_cast<int>(i)) || coords[i] == 0);
    if (!counts) continue;
    if (slotted) {
      const int64_t slot = order->Slot(p.name);
      if (slot < 0) return absl::InternalError(absl::StrCat(p.name, " has no slot in the gradient norm's order"));
      ASSIGN_OR_RETURN(Tensor at, total.Narrow(0, slot, 1));
      RETURN_IF_ERROR(AddSumOfSquares({grads[k]}, at));
    } else {
      counted.push_back(grads[k]);
    }
  }
  if (!slotted) RETURN_IF_ERROR(AddSumOfSquares(counted, total));  // one reduction over them all
  std::vector<Communicator*> comms;
  for (const char* axis : {"tp", "pp", "dp"}) {
    if (std::string(axis) == "dp" && !over_dp) continue;
    absl::StatusOr<int> size = pg->AxisSize(axis);
    if (!size.ok() || *size < 2) continue;
    ASSIGN_OR_RETURN(Communicator * comm, pg->Comm(axis));
    RETURN_IF_ERROR(
        comm->AllReduce(total.raw_data(), total.numel(), DType::kF32, ReduceOp::kSum)->WaitOnDevice(pg->timeout()));
    comms.push_back(comm);
  }
  return Squares{std::move(total), std::move(comms)};
}

// The norm of SquaresOf's sums, read on the host.
absl::StatusOr<double> NormOf(const std::vector<const NamedParam*>& params, const std::vector<Tensor>& grads,
                              const std::vector<bool>& whole, bool over_dp, const Device& device, ProcessGroup* pg,
                              const NormOrder* order = nullptr) {
  ASSIGN_OR_RETURN(Squares sq, SquaresOf(params, grads, whole, over_dp, device, pg, order));
  ASSIGN_OR_RETURN(const std::vector<float> squares, sq.squares.ReadFloats());
  for (Communicator* comm : sq.comms) RETURN_IF_ERROR(comm->AsyncError());  // the all-reduces above may have failed
  double sum = 0;
  for (float s : squares) sum += s;  // in slot order (GradNormClip's sum)
  return std::sqrt(sum);
}

// The gradients `optimizer` reads that the norm counts, as NormOf takes them.
struct OptimizerGrads {
  std::vector<const NamedParam*> of;
  std::vector<Tensor> grads;
  std::vector<bool> whole;
  Device device = Device::Cpu();
};
absl::StatusOr<OptimizerGrads> GradsOf(const Optimizer& optimizer) {
  OptimizerGrads g;
  const Partition& partition = optimizer.partition();
  for (size_t i = 0; i < partition.slices.size(); ++i) {
    const ParamSlice& s = partition.slices[i];
    const NamedParam& p = optimizer.params()[s.param];
    if (p.mirror) continue;
    ASSIGN_OR_RETURN(Tensor grad, optimizer.SliceGrad(i));
    g.of.push_back(&p);
    g.grads.push_back(grad);
    g.whole.push_back(!s.grad.has_value());  // kept whole on every dp rank, reading its own gradient
  }
  // A rank may own no slice at all (a small bucket over a large dp): the
  // device is its parameters'.
  const std::vector<NamedParam>& params = optimizer.params();
  if (!params.empty()) g.device = params[0].bound.param.local().device();
  return g;
}

}  // namespace

absl::StatusOr<double> GlobalGradNorm(const std::vector<NamedParam>& params, ProcessGroup* pg) {
  std::vector<const NamedParam*> of;
  std::vector<Tensor> grads;
  for (const NamedParam& p : params) {
    if (p.mirror) continue;
    std::optional<Tensor> g = p.bound.param.variable().grad();
    if (!g.has_value()) return absl::FailedPreconditionError(absl::StrCat(p.name, " has no gradient"));
    of.push_back(&p);
    grads.push_back(*g);
  }
  const Device device = params.empty() ? Device::Cpu() : params[0].bound.param.local().device();
  return NormOf(of, grads, std::vector<bool>(of.size(), true), /*over_dp=*/false, device, pg);
}

absl::StatusOr<double> GlobalGradNorm(const Optimizer& optimizer, ProcessGroup* pg, const NormOrder* order) {
  ASSIGN_OR_RETURN(const OptimizerGrads g, GradsOf(optimizer));
  return NormOf(g.of, g.grads, g.whole, optimizer.partition().over_dp, g.device, pg, order);
}

absl::StatusOr<DeviceClip> ClipOnDevice(const Optimizer& optimizer, double max_norm, ProcessGroup* pg,
                                        const NormOrder* order, double loss_scale) {
  ASSIGN_OR_RETURN(const OptimizerGrads g, GradsOf(optimizer));
  ASSIGN_OR_RETURN(Squares sq, SquaresOf(g.of, g.grads, g.whole, optimizer.partition().over_dp, g.device, pg, order));
  DeviceClip clip;
  ASSIGN_OR_RETURN(clip.norm_and_scale, ops::GradNormClip(sq.squares, max_norm, loss_scale));
  ASSIGN_OR_RETURN(clip.scale, clip.norm_and_scale.Narrow(0, 1, 1));
  return clip;
}

namespace {

// FNV-1a, 64 bits: a name's hash, the same in every process.
int64_t NameHash(const std::string& name) {
  uint64_t h = 14695981039346656037ull;
  for (unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return static_cast<int64_t>(h);
}

}  // namespace

absl::StatusOr<NormOrder> NormOrder::Create(const std::vector<NamedParam>& params, ProcessGroup* pg,
                                            const Device& device) {
  NormOrder order;
  absl::StatusOr<int> stages = pg->AxisSize("pp");
  if (!stages.ok() || *stages < 2) return order;
  std::map<std::string, int64_t> hashes_of;  // this rank's parameters (a mirror is its owner's)
  for (const NamedParam& p : params) {
    if (!p.mirror) hashes_of.emplace(p.name, NameHash(p.name));
  }
  std::vector<int64_t> mine;
  for (const auto& [name, h] : hashes_of) mine.push_back(h);
  ASSIGN_OR_RETURN(Communicator * comm, pg->Comm("pp"));
  const absl::Duration timeout = pg->timeout();
  const int n = *stages;
  // Every stage's count, then its hashes (padded to the largest count).
  ASSIGN_OR_RETURN(Tensor count, Tensor::FromInt64s({1}, {static_cast<int64_t>(mine.size())}));
  ASSIGN_OR_RETURN(count, count.To(device));
  ASSIGN_OR_RETURN(Tensor counts, Tensor::Empty({n}, DType::kI64, device));
  RETURN_IF_ERROR(comm->AllGather(count.raw_data(), counts.raw_data(), 1, DType::kI64)->WaitOnDevice(timeout));
  ASSIGN_OR_RETURN(const std::vector<int64_t> each, counts.ReadInt64s());
  int64_t most = 0;
  for (int64_t c : each) most = std::max(most, c);
  std::vector<int64_t> padded = mine;
  padded.resize(static_cast<size_t>(most), 0);
  ASSIGN_OR_RETURN(Tensor hashes, Tensor::FromInt64s({most}, padded));
  ASSIGN_OR_RETURN(hashes, hashes.To(device));
  ASSIGN_OR_RETURN(Tensor all, Tensor::Empty({n * most}, DType::kI64, device));
  if (most > 0) {
    RETURN_IF_ERROR(comm->AllGather(hashes.raw_data(), all.raw_data(), most, DType::kI64)->WaitOnDevice(timeout));
  }
  ASSIGN_OR_RETURN(const std::vector<int64_t> gathered, all.ReadInt64s());
  std::vector<int64_t> sorted;
  for (int s = 0; s < n; ++s) {
    for (int64_t i = 0; i < each[s]; ++i) sorted.push_back(gathered[static_cast<size_t>(s * most + i)]);
  }
  std::sort(sorted.begin(), sorted.end());
  if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
    return absl::InternalError("two parameters' names hash alike (or two stages hold one parameter): the gradient "
                               "norm cannot order them");
  }
  for (const auto& [name, h] : hashes_of) {
    order.slots_[name] = std::lower_bound(sorted.begin(), sorted.end(), h) - sorted.begin();
  }
  order.size_ = static_cast<int64_t>(sorted.size());
  return order;
}

int64_t NormOrder::Slot(const std::string& name) const {
  auto it = slots_.find(name);
  return it == slots_.end() ? -1 : it->second;
}

double ClipFactor(double norm, double max_norm) { return kernels::ClipFactor(norm, max_norm); }

absl::StatusOr<LossScaler> LossScaler::Create(double scale, int64_t window, int64_t good_steps) {
  if (absl::Status valid = CheckLossScale(scale); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("loss scale: ", valid.message()));
  }
  if (absl::Status valid = CheckLossScaleWindow(window); !valid.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("loss scale window: ", valid.message()));
  }
  if (good_steps < 0 || good_steps >= window) {
    return absl::InvalidArgumentError(
        absl::StrCat("loss scale: ", good_steps, " good steps is not in [0, the window, ", window, ")"));
  }
  return LossScaler(scale, window, good_steps);
}

absl::StatusOr<bool> LossScaler::Update(double norm) {
  if (!std::isfinite(norm)) {
    if (scale_ <= 1) {
      return absl::FailedPreconditionError(absl::StrCat("the gradients are not finite (norm ", norm,
                                                        ") at a loss scale of 1: no scale keeps them in fp16's range"));
    }
    scale_ /= 2;
    good_steps_ = 0;
    return false;
  }
  if (++good_steps_ >= window_) {
    scale_ = std::min(scale_ * 2, kMax);
    good_steps_ = 0;
  }
  return true;
}

absl::StatusOr<double> ClipGradNorm(const std::vector<NamedParam>& params, double max_norm, ProcessGroup* pg) {
  ASSIGN_OR_RETURN(double norm, GlobalGradNorm(params, pg));
  const double factor = ClipFactor(norm, max_norm);
  if (factor == 1.0) return norm;
  for (const NamedParam& p : params) {
    Tensor g = *p.bound.param.variable().grad();
    ASSIGN_OR_RETURN(Tensor scaled, Scale(g, static_cast<float>(factor)));
    RETURN_IF_ERROR(g.CopyFrom(scaled));
  }
  return norm;
}

double LearningRate(int64_t step, double lr, int64_t warmup, int64_t total, double min_lr) {
  if (step < warmup) return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (step >= total || total <= warmup) return total <= warmup ? lr : min_lr;
  const double progress = static_cast<double>(step - warmup) / static_cast<double>(total - warmup);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(M_PI * progress));
}

}  // namespace colod::train
