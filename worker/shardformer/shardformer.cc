#include "worker/shardformer/shardformer.h"

#include <algorithm>
#include <fstream>
#include <limits>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/atomic_file.h"
#include "common/json.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/colo/tensor_collectives.h"
#include "worker/nn/functional.h"
#include "worker/nn/vocab_cross_entropy.h"
#include "worker/shardformer/models.h"

namespace colod::shardformer {

absl::Status TieLmHeads(Module& model) {
  for (auto& [path, m] : model.Modules()) {
    if (!m->decl().has_value() || m->decl()->tied_to.empty()) continue;
    ASSIGN_OR_RETURN(Module * source, model.Get(m->decl()->tied_to));
    if (source->layer() == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " is tied to ", m->decl()->tied_to, ", which has no weights loaded"));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<Layer> head, source->layer()->TiedHead());
    m->set_layer(std::move(head));
  }
  return absl::OkStatus();
}

absl::Status CausalLmPolicy::Preprocess(const ModelConfig& config, ShardConfig& shard) {
  RETURN_IF_ERROR(CheckShardable(config, shard.layout));
  if (shard.sequence_parallel() && (shard.is_2d() || shard.is_3d())) {
    return absl::InvalidArgumentError("sequence_parallel applies to tensor_parallel_mode 1d only");
  }
  return absl::OkStatus();
}

absl::Status CausalLmPolicy::Postprocess(Module& model, const ModelConfig&, const ShardConfig&) {
  return TieLmHeads(model);
}

ModelRegistry& ModelRegistry::Global() {
  static ModelRegistry* registry = [] {
    auto* r = new ModelRegistry();
    r->Register("gpt2", Gpt2Family());
    r->Register("llama", LlamaFamily());
    r->Register("bert", BertFamily());
    r->Register("opt", OptFamily());
    r->Register("bloom", BloomFamily());
    r->Register("vit", VitFamily());
    r->Register("t5", T5Family());
    return r;
  }();
  return *registry;
}

void ModelRegistry::Register(const std::string& model_type, ModelFamily family) {
  absl::MutexLock lock(&mu_);
  families_[model_type] = std::move(family);
}

absl::StatusOr<ModelFamily> ModelRegistry::Get(const std::string& model_type) const {
  absl::MutexLock lock(&mu_);
  auto it = families_.find(model_type);
  if (it == families_.end()) {
    std::vector<std::string> known;
    for (const auto& [name, f] : families_) known.push_back(name);
    return absl::InvalidArgumentError(absl::StrCat("model_type '", model_type, "' has no registered policy; known: ",
                                                   absl::StrJoin(known, ", ")));
  }
  return it->second;
}

absl::Status ModelSharder::Apply(Module& module, const std::string& path,
                                 const ModulePolicyDescription& description) {
  const std::string where = path.empty() ? module.cls() : path;
  for (const auto& [name, value] : description.attribute_replacement) {
    const size_t dot = name.rfind('.');
    Module* target = dot == std::string::npos ? &module : module.Find(name.substr(0, dot));
    if (target == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("the policy sets ", name, " but ", where, " has no such module"));
    }
    target->SetAttr(dot == std::string::npos ? name : name.substr(dot + 1), value);
  }
  for (const SubModuleReplacementDescription& d : description.sub_module_replacement) {
    Module* leaf = module.Find(d.suffix);
    if (leaf == nullptr) {
      // A pipeline stage holds part of the model (ModelFamily::split_stage).
      if (d.ignore_if_not_exist || shard_.pp() > 1) continue;
      return absl::InvalidArgumentError(
          absl::StrCat("the policy replaces ", d.suffix, " but ", where, " has no such sub-module"));
    }
    if (!leaf->decl().has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the policy replaces ", where, ".", d.suffix, ", which is a ", leaf->cls(), ", not a layer"));
    }
    ASSIGN_OR_RETURN(LayerFactory factory, LayerRegistry::Global().Get(d.target_module));
    LayerContext context{files_, pg_, &shard_, d.kwargs};
    ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer, factory(*leaf->decl(), context));
    leaf->set_layer(std::move(layer));
  }
  for (const auto& replace : description.param_replacement) {
    RETURN_IF_ERROR(replace(module));
  }
  if (description.method_replacement) module.set_forward(description.method_replacement);
  return absl::OkStatus();
}

absl::Status ModelSharder::Shard() {
  RETURN_IF_ERROR(policy_.Preprocess(config_, shard_));
  if (shard_.tp() > 1) {
    ASSIGN_OR_RETURN(auto module_policy, policy_.ModulePolicy(config_, shard_));
    for (auto& [path, m] : model_.Modules()) {
      auto it = module_policy.find(m->cls());
      if (it != module_policy.end()) RETURN_IF_ERROR(Apply(*m, path, it->second));
    }
  }
  ASSIGN_OR_RETURN(LayerFactory native, LayerRegistry::Global().Get("native"));
  LayerContext context{files_, pg_, &shard_, {}};
  for (auto& [path, m] : model_.Modules()) {
    if (!m->decl().has_value() || m->layer() != nullptr || !m->decl()->tied_to.empty()) continue;
    ASSIGN_OR_RETURN(std::unique_ptr<Layer> layer, native(*m->decl(), context));
    m->set_layer(std::move(layer));
  }
  RETURN_IF_ERROR(policy_.Postprocess(model_, config_, shard_));
  for (auto& [path, m] : model_.Modules()) {
    if (m->decl().has_value() && m->layer() == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          path, " has no layer after the policy's postprocess", m->decl()->tied_to.empty() ? "" : " (is it tied?)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ColoTensor> ShardedModel::Forward(const Tensor& ids) {
  if (config_.takes_images()) {
    const Shape want = {ids.dim() > 0 ? ids.shape()[0] : 0, config_.num_channels, config_.image_size,
                        config_.image_size};
    if (ids.dim() != 4 || ids.shape() != want || !IsFloat(ids.dtype())) {
      return absl::InvalidArgumentError(absl::StrCat("pixel values must be floats [batch, ", config_.num_channels, ", ",
                                                     config_.image_size, ", ", config_.image_size, "], got ",
                                                     DTypeName(ids.dtype()), " ", ShapeToString(ids.shape())));
    }
    ASSIGN_OR_RETURN(Tensor pixels, ids.ContiguousAs(DType::kF32));
    ASSIGN_OR_RETURN(pixels, pixels.To(shard_.device));
    ASSIGN_OR_RETURN(ColoTensor input, ColoTensor::FromLocal(pixels, DistSpec(), pg_));
    return root_->Forward(input);
  }
  if (ids.dim() != 2 || !IsInteger(ids.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("token ids must be integers [batch, seq], got ", ShapeToString(ids.shape())));
  }
  if (ids.shape()[1] > config_.max_positions) {
    return absl::InvalidArgumentError(absl::StrCat("sequences of ", ids.shape()[1], " tokens exceed the model's ",
                                                   config_.max_positions, " positions"));
  }
  ASSIGN_OR_RETURN(Tensor i64, ids.ContiguousAs(DType::kI64));
  // The ids stay on the host: the embeddings check and group them there and
  // copy them up themselves (ops::Embedding), so a forward and backward read
  // nothing back from the device for them.
  ASSIGN_OR_RETURN(i64, i64.To(Device::Cpu()));
  ASSIGN_OR_RETURN(ColoTensor input, ColoTensor::FromLocal(i64, DistSpec(), pg_));
  return root_->Forward(input);
}

absl::StatusOr<ColoTensor> ShardedModel::Forward(const Tensor& ids, const Tensor& decoder_ids) {
  if (!config_.is_encoder_decoder()) {
    return absl::InvalidArgumentError(absl::StrCat("a ", config_.model_type, " has no decoder input"));
  }
  std::vector<ColoTensor> inputs;
  for (const auto& [t, what] : {std::make_pair(&ids, "token ids"), std::make_pair(&decoder_ids, "decoder ids")}) {
    if (t->dim() != 2 || !IsInteger(t->dtype()) || t->shape()[1] < 1 ||
        t->shape()[0] != ids.shape()[0]) {
      return absl::InvalidArgumentError(absl::StrCat(what, " must be integers [batch, seq] of one batch, got ",
                                                     DTypeName(t->dtype()), " ", ShapeToString(t->shape())));
    }
    if (t->shape()[1] > config_.max_positions) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": sequences of ", t->shape()[1], " tokens exceed ",
                                                     config_.max_positions));
    }
    ASSIGN_OR_RETURN(Tensor i64, t->ContiguousAs(DType::kI64));
    ASSIGN_OR_RETURN(i64, i64.To(Device::Cpu()));  // as Forward(ids): the embeddings copy them up
    ASSIGN_OR_RETURN(ColoTensor input, ColoTensor::FromLocal(i64, DistSpec(), pg_));
    inputs.push_back(std::move(input));
  }
  return root_->Forward(inputs[0], inputs[1]);
}

absl::StatusOr<LmLoss> ShardedModel::ClassificationLoss(const ColoTensor& logits, const Tensor& labels,
                                                        int64_t denominator) {
  if (labels.dim() != 1) {
    return absl::InvalidArgumentError(absl::StrCat("labels must be [batch], got ", ShapeToString(labels.shape())));
  }
  ASSIGN_OR_RETURN(Tensor column, labels.Reshape({labels.shape()[0], 1}));  // a copy if strided
  return TokenLoss(logits, column, denominator);
}

absl::StatusOr<LmLoss> ShardedModel::NextTokenLoss(const ColoTensor& logits, const Tensor& ids) {
  if (ids.dim() != 2 || logits.global_shape().size() != 3 || logits.global_shape()[0] != ids.shape()[0] ||
      logits.global_shape()[1] != ids.shape()[1]) {
    return absl::InvalidArgumentError(absl::StrCat("logits ", ShapeToString(logits.global_shape()),
                                                   " do not match ids ", ShapeToString(ids.shape())));
  }
  ASSIGN_OR_RETURN(Tensor labels, NextTokenLabels(ids));
  return TokenLoss(logits, labels);
}

absl::StatusOr<Tensor> ShardedModel::NextTokenLabels(const Tensor& ids) {
  if (ids.dim() != 2 || !IsInteger(ids.dtype())) {
    return absl::InvalidArgumentError(
        absl::StrCat("token ids must be integers [batch, seq], got ", ShapeToString(ids.shape())));
  }
  const int64_t batch = ids.shape()[0], seq = ids.shape()[1];
  ASSIGN_OR_RETURN(const std::vector<int64_t> all, ids.ReadInt64s());
  std::vector<int64_t> next(all.size(), -100);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t s = 0; s + 1 < seq; ++s) next[b * seq + s] = all[b * seq + s + 1];
  }
  return Tensor::FromInt64s({batch, seq}, next);
}

absl::StatusOr<LmLoss> ShardedModel::ForwardTokenLoss(const std::function<absl::StatusOr<ColoTensor>()>& forward,
                                                      const Tensor& labels, int64_t denominator) {
  Module* head = root_->Find("lm_head");
  std::optional<ColoTensor> weight;
  if (fused_head_rows_ != 0 && head != nullptr && head->decl().has_value() && head->layer() != nullptr) {
    absl::StatusOr<ColoTensor> w = head->layer()->HeadWeight();
    if (w.ok()) weight = *std::move(w);
  }
  if (!weight.has_value()) {
    ASSIGN_OR_RETURN(ColoTensor logits, forward());
    return TokenLoss(logits, labels, denominator);
  }
  // The model up to its head: the head's leaf hands its input back.
  std::optional<ColoTensor> seen;
  head->set_pass_through(&seen);
  absl::StatusOr<ColoTensor> out = forward();
  head->set_pass_through(nullptr);
  if (!out.ok()) return out.status();
  if (!seen.has_value() || out->local().raw_data() != seen->local().raw_data() ||
      out->local().shape() != seen->local().shape()) {
    return absl::InternalError(absl::StrCat("the ", config_.model_type,
                                            " model's output is not its lm_head's: the fused loss cannot take it"));
  }
  const ColoTensor& hidden = *out;
  const Shape& hs = hidden.global_shape();
  bool replicated = true;
  for (const auto& [axis, p] : hidden.spec().placements()) replicated = replicated && p.kind == Placement::Kind::kReplicate;
  if (!replicated || hs.size() != 3) {  // the head runs as it would have
    ASSIGN_OR_RETURN(ColoTensor logits, head->layer()->Forward(hidden));
    return TokenLoss(logits, labels, denominator);
  }
  if (labels.dim() != 2 || hs[0] != labels.shape()[0] || hs[1] != labels.shape()[1]) {
    return absl::InvalidArgumentError(absl::StrCat("hidden states ", ShapeToString(hs), " do not match labels ",
                                                   ShapeToString(labels.shape())));
  }
  const int64_t rows = hs[0] * hs[1];
  ASSIGN_OR_RETURN(Tensor mine, labels.ContiguousAs(DType::kI64));
  ASSIGN_OR_RETURN(mine, mine.Reshape({rows}));
  int64_t count = 0;
  ASSIGN_OR_RETURN(const std::vector<int64_t> mine_labels, mine.ReadInt64s());
  for (int64_t l : mine_labels) count += l != -100;
  ASSIGN_OR_RETURN(Variable flat, nn::Reshape(hidden.variable(), {rows, hs[2]}));
  int64_t chunk_rows = fused_head_rows_;
  if (chunk_rows == kFusedHeadByBytes) {  // the rows whose logits fit the budget
    // The logits are computed in the head's dtype, or through an f32
    // temporary where the hidden states' differs (ops::MatMul): counted so.
    const DType w_dtype = weight->local().dtype();
    const DType z_dtype = flat.value().dtype() == w_dtype ? w_dtype : DType::kF32;
    const int64_t row_bytes = weight->local().shape()[0] * static_cast<int64_t>(SizeOf(z_dtype));
    chunk_rows = std::max<int64_t>(1, kFusedHeadChunkBytes / std::max<int64_t>(row_bytes, 1));
  }
  if (shard_.pp() == 1) {
    // One micro-batch in flight: the gradients are taken in forward and
    // held, in f32, until its backward; no chunk's logits are recomputed.
    ASSIGN_OR_RETURN(Variable sum,
                     nn::VocabParallelLinearCrossEntropySum(flat, *weight, mine, config_.vocab_size, chunk_rows));
    ASSIGN_OR_RETURN(LmLoss out_loss, MeanOfSum(sum, count, {}, denominator));
    out_loss.fused_head = true;
    return out_loss;
  }
  ASSIGN_OR_RETURN(Variable per_row,
                   nn::VocabParallelLinearCrossEntropy(flat, *weight, mine, config_.vocab_size, chunk_rows));
  ASSIGN_OR_RETURN(LmLoss out_loss, MeanOfRows(per_row, count, {}, denominator));
  out_loss.fused_head = true;
  return out_loss;
}

absl::StatusOr<LmLoss> ShardedModel::TokenLoss(const ColoTensor& logits, const Tensor& labels,
                                               int64_t denominator) {
  if (labels.dim() != 2 || logits.global_shape().size() != 3 || logits.global_shape()[0] != labels.shape()[0] ||
      logits.global_shape()[1] != labels.shape()[1]) {
    return absl::InvalidArgumentError(absl::StrCat("logits ", ShapeToString(logits.global_shape()),
                                                   " do not match labels ", ShapeToString(labels.shape())));
  }
  const int64_t batch = labels.shape()[0], seq = labels.shape()[1], vocab = config_.vocab_size;
  // The logits' rows this rank holds (placements on the batch and sequence
  // dims), and whether the vocabulary is split.
  DistSpec rows;
  std::vector<std::string> row_axes;
  bool vocab_split = false;
  for (const auto& [axis, p] : logits.spec().placements()) {
    if (p.kind == Placement::Kind::kPartial) {
      return absl::InvalidArgumentError("the logits must not be partial sums");
    }
    if (p.kind != Placement::Kind::kShard) continue;
    const bool on_vocab = std::find(p.dims.begin(), p.dims.end(), 2) != p.dims.end();
    if (on_vocab && p.dims.size() > 1) return absl::InvalidArgumentError("the logits' vocab dim is split with others");
    if (on_vocab) {
      if (axis != "tp") return absl::InvalidArgumentError(absl::StrCat("vocab split over ", axis, ", not tp"));
      vocab_split = true;
    } else {
      rows.Set(axis, p);
      row_axes.push_back(axis);
    }
  }
  ASSIGN_OR_RETURN(Block block, LocalBlock(rows, {batch, seq}, pg_));
  ASSIGN_OR_RETURN(Tensor mine, labels.dtype() == DType::kI64 ? labels : labels.ToDType(DType::kI64));
  for (int d = 0; d < 2; ++d) {
    ASSIGN_OR_RETURN(mine, mine.Narrow(d, block.starts[d], block.lengths[d]));
  }
  ASSIGN_OR_RETURN(mine, mine.Reshape({block.lengths[0] * block.lengths[1]}));  // a copy if strided
  // Counted (and, by the vocab-parallel loss, checked) where the labels are,
  // on the host for the trainer's batches: no device round trip.
  int64_t count = 0;
  ASSIGN_OR_RETURN(const std::vector<int64_t> mine_labels, mine.ReadInt64s());
  for (int64_t l : mine_labels) count += l != -100;
  Variable per_row;
  if (vocab_split) {
    ASSIGN_OR_RETURN(per_row, nn::VocabParallelCrossEntropy(logits, mine, vocab));
  } else {  // the labels stay on the host: checked there and copied up by the loss
    const int64_t width = logits.local().shape().back();
    ASSIGN_OR_RETURN(Variable flat, nn::Reshape(logits.variable(), {mine.numel(), width}));
    if (width > vocab) {
      ASSIGN_OR_RETURN(flat, nn::Narrow(flat, 1, 0, vocab));
    }
    ASSIGN_OR_RETURN(per_row, nn::CrossEntropy(flat, mine));
  }
  return MeanOfRows(per_row, count, std::move(row_axes), denominator);
}

absl::StatusOr<LmLoss> ShardedModel::MeanOfRows(const Variable& per_row, int64_t count,
                                                std::vector<std::string> row_axes, int64_t denominator) {
  ASSIGN_OR_RETURN(Variable sum, Sum(per_row));
  return MeanOfSum(sum, count, std::move(row_axes), denominator);
}

absl::StatusOr<LmLoss> ShardedModel::MeanOfSum(const Variable& sum, int64_t count, std::vector<std::string> row_axes,
                                               int64_t denominator) {
  const Device dev = sum.value().device();
  // [loss sum, labelled tokens], summed over the ranks that hold other rows,
  // on the device, and read once. Deferred, the caller divides by its own
  // denominator: the sum alone (a fresh f32 copy), no count uploaded.
  const bool deferred = loss_read_deferred_ && denominator > 0;
  ASSIGN_OR_RETURN(Tensor sum1, sum.value().Reshape({1}));
  ASSIGN_OR_RETURN(Tensor both, sum1.ToDType(DType::kF32));
  if (!deferred) {
    ASSIGN_OR_RETURN(Tensor n, Tensor::FromFloats({1}, {static_cast<float>(count)}));
    ASSIGN_OR_RETURN(n, n.To(dev));
    ASSIGN_OR_RETURN(both, Tensor::Cat({both, n}, 0));
  }
  if (pg_->mesh().AxisIndices("dp").ok() && *pg_->AxisSize("dp") > 1) row_axes.push_back("dp");
  std::vector<Communicator*> comms;
  for (const std::string& axis : row_axes) {
    ASSIGN_OR_RETURN(Communicator * comm, pg_->Comm(axis));
    RETURN_IF_ERROR(
        comm->AllReduce(both.raw_data(), both.numel(), DType::kF32, ReduceOp::kSum)->WaitOnDevice(pg_->timeout()));
    comms.push_back(comm);
  }
  if (deferred) {  // the caller reads the sum with the rest of its step
    LmLoss out;
    out.value = std::numeric_limits<double>::quiet_NaN();
    out.tokens = -1;
    out.sum_on_device = both;
    out.denominator = denominator;
    ASSIGN_OR_RETURN(out.loss, Scale(sum, static_cast<float>(1.0 / static_cast<double>(denominator))));
    return out;
  }
  ASSIGN_OR_RETURN(const std::vector<float> totals, both.ReadFloats());
  for (Communicator* comm : comms) RETURN_IF_ERROR(comm->AsyncError());  // the sums above may have failed
  LmLoss out;
  out.tokens = static_cast<int64_t>(totals[1]);
  if (out.tokens == 0 && denominator <= 0) return absl::InvalidArgumentError("no position has a label (all are -100)");
  const double divisor = denominator > 0 ? static_cast<double>(denominator) : totals[1];
  out.value = totals[0] / divisor;
  ASSIGN_OR_RETURN(out.loss, Scale(sum, static_cast<float>(1.0 / divisor)));
  return out;
}

absl::StatusOr<Tensor> ShardedModel::GatherLogits(const ColoTensor& logits) {
  NoGradScope no_grad;
  ASSIGN_OR_RETURN(ColoTensor full, logits.ToReplicate());
  Tensor t = full.local();
  if (t.shape().back() > config_.vocab_size) {
    ASSIGN_OR_RETURN(t, t.Narrow(t.dim() - 1, 0, config_.vocab_size));
  }
  ASSIGN_OR_RETURN(t, t.To(Device::Cpu()));
  return t.ContiguousAs(DType::kF32);
}

const TiedTable* ShardedModel::FindTied(const std::string& path) const {
  for (const TiedTable& t : tied_) {
    if (t.path == path) return &t;
  }
  return nullptr;
}

std::vector<NamedParam> ShardedModel::Parameters() {
  std::vector<NamedParam> out;
  for (auto& [path, m] : root_->Modules()) {
    if (m->layer() == nullptr) continue;
    const TiedTable* tied = FindTied(path);
    const bool mirror = tied != nullptr && !tied->stages.empty() && tied->stages.front() != shard_.stage.index;
    for (BoundParam& b : m->layer()->Params()) {
      out.push_back(NamedParam{path.empty() ? b.name : b.name.empty() ? path : absl::StrCat(path, ".", b.name), b,
                               tied != nullptr, mirror, tied != nullptr ? tied->stages : std::vector<int>{}});
    }
  }
  return out;
}

absl::StatusOr<DistSpec> ShardedModel::StageInputSpec(int64_t ndim) {
  for (auto& [path, m] : root_->Modules()) {
    if (m->layer() == nullptr) continue;
    // The stage's first layer of the stream: a table it shares (an
    // embedding, a position bias) takes no stream.
    if (!shard_.stage.first() && FindTied(path) != nullptr) continue;
    return m->layer()->InputSpec(ndim);
  }
  return absl::FailedPreconditionError("the stage has no layer");
}

Shape ShardedModel::StageInputShape(int64_t rows, int64_t seq, int64_t decoder_seq) const {
  const int64_t hidden = config_.hidden_size;
  if (config_.takes_images()) return {rows, config_.max_positions, hidden};
  // An encoder-decoder's decoder stage after the first (t5.cc's stages).
  if (config_.is_encoder_decoder() && shard_.stage.begin > config_.num_layers) {
    return {rows, decoder_seq + seq, hidden};
  }
  return {rows, seq, hidden};
}

absl::StatusOr<std::map<std::string, Tensor>> ShardedModel::GatherHf(bool gradients) {
  NoGradScope no_grad;
  std::map<std::string, Tensor> out;
  for (const NamedParam& p : Parameters()) {
    const ColoParameter& param = p.bound.param;
    Tensor local = param.local();
    if (gradients) {
      std::optional<Tensor> g = param.variable().grad();
      if (!g.has_value()) return absl::FailedPreconditionError(absl::StrCat(p.name, " has no gradient"));
      local = *g;
    }
    ASSIGN_OR_RETURN(ColoTensor t, ColoTensor::FromLocal(local, param.spec(), pg_));
    ASSIGN_OR_RETURN(ColoTensor full, t.ToReplicate());
    ASSIGN_OR_RETURN(Tensor host, full.local().To(Device::Cpu()));
    ASSIGN_OR_RETURN(Tensor slice, LayerToHf(p.bound.hf, host));
    auto it = out.find(p.bound.hf.name);
    if (it == out.end()) {
      ASSIGN_OR_RETURN(Tensor zeros, Tensor::Zeros(p.bound.hf.shape, slice.dtype()));
      it = out.emplace(p.bound.hf.name, zeros).first;
    }
    RETURN_IF_ERROR(PlaceInHf(p.bound.hf, slice, it->second));
  }
  return out;
}

absl::StatusOr<std::unique_ptr<ShardedModel>> ShardFormer::Optimize(std::unique_ptr<Module> model,
                                                                    const ModelConfig& config,
                                                                    const ModelFiles& files, Policy& policy) {
  ModelSharder sharder(*model, policy, config, shard_, &files, pg_);
  RETURN_IF_ERROR(sharder.Shard());
  return std::make_unique<ShardedModel>(std::move(model), config, sharder.shard_config(), pg_);
}

absl::StatusOr<ModelConfig> LoadConfig(const std::string& dir) {
  const std::string path = dir + "/config.json";
  ASSIGN_OR_RETURN(const std::string text, ReadConfigJson(dir));
  const nlohmann::json j = ParseJson(text);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  if (!j.contains("model_type") || !j["model_type"].is_string()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": model_type is missing"));
  }
  auto family = ModelRegistry::Global().Get(j["model_type"].get<std::string>());
  if (!family.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", family.status().message()));
  if (family->parse) return family->parse(text, path);
  return ParseModelConfig(text, path);
}

namespace {

// Tensors a Hugging Face checkpoint may hold that no model reads: buffers
// (the causal mask of GPT-2's files, the rotary frequencies of older LLaMA
// ones, position ids), the copies of a tied embedding, and what Hugging
// Face's own classes of these models ignore too (its
// _keys_to_ignore_on_load_unexpected): a pooler (bert-base-uncased's files
// are BertForPreTraining's, with its next-sentence head), and the relative
// attention bias T5 v1.0's files carry on the decoder's cross-attention.
bool ReadByNoModel(absl::string_view name, const ModelConfig& config) {
  for (absl::string_view buffer : {".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", "position_ids"}) {
    if (absl::EndsWith(name, buffer)) return true;
  }
  if (absl::StartsWith(name, "pooler.") || absl::StrContains(name, ".pooler.") ||
      absl::StartsWith(name, "cls.seq_relationship.")) {
    return true;
  }
  if (config.is_encoder_decoder() && absl::StrContains(name, "EncDecAttention.relative_attention_bias")) return true;
  if (name == "lm_head.weight") return config.tie_word_embeddings;
  // BERT's MLM decoder: its weight is the word embedding's, its bias
  // cls.predictions.bias (older files store both).
  if (name == "cls.predictions.decoder.weight" || name == "cls.predictions.decoder.bias") {
    return config.tie_word_embeddings;
  }
  // (T5's stacks share its `shared` table whether or not the head ties it.)
  return config.is_encoder_decoder() &&
         (name == "encoder.embed_tokens.weight" || name == "decoder.embed_tokens.weight");
}

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<ShardedModel>>> ShardFormer::LoadChunks(const std::string& dir) {
  const int v = shard_.pp() > 1 ? shard_.virtual_stages() : 1;
  std::vector<std::unique_ptr<ShardedModel>> chunks;
  for (int c = 0; c < v; ++c) {
    ShardConfig mine = shard_;
    mine.chunk = c;
    ASSIGN_OR_RETURN(std::unique_ptr<ShardedModel> chunk, ShardFormer(std::move(mine), pg_).Load(dir));
    chunks.push_back(std::move(chunk));
  }
  return chunks;
}

absl::StatusOr<std::unique_ptr<ShardedModel>> ShardFormer::Load(const std::string& dir) {
  ASSIGN_OR_RETURN(ModelConfig config, LoadConfig(dir));
  ASSIGN_OR_RETURN(ModelFamily family, ModelRegistry::Global().Get(config.model_type));
  ASSIGN_OR_RETURN(std::unique_ptr<ModelFiles> files, ModelFiles::Open(dir));
  ASSIGN_OR_RETURN(std::unique_ptr<Module> model, family.build(config));
  std::vector<TiedTable> tied;
  if (shard_.pp() > 1) {
    const int v = shard_.virtual_stages();
    if (shard_.chunk < 0 || shard_.chunk >= v) {
      return absl::InvalidArgumentError(absl::StrCat("chunk ", shard_.chunk, " of ", v, " virtual stages"));
    }
    ASSIGN_OR_RETURN(std::vector<int64_t> layers, PipelineStageLayers(config, shard_.layout));  // pp * V
    if (!family.split_stage) {
      return absl::InvalidArgumentError(absl::StrCat("the ", config.model_type,
                                                     " policy has no pipeline stages: its family declares no "
                                                     "split_stage (ModelFamily, docs/SHARDFORMER.md)"));
    }
    ASSIGN_OR_RETURN(int rank, pg_->LocalRank("pp"));
    const int index = shard_.chunk * shard_.pp() + rank;
    PipelineStage& stage = shard_.stage;
    stage.index = index;
    stage.count = shard_.pp() * v;
    stage.begin = 0;
    for (int s = 0; s < index; ++s) stage.begin += layers[s];
    stage.end = stage.begin + layers[index];
    stage.layers = layers;
    ASSIGN_OR_RETURN(tied, family.split_stage(*model, stage));
  } else {
    shard_.stage = PipelineStage{0, 1, 0, config.num_layers};
  }
  if (shard_.recompute != Recompute::kNone) {
    // The blocks RunSequential runs: every family's but an encoder-decoder's
    // (T5's stacks run their blocks with the encoder's output beside).
    if (config.is_encoder_decoder()) {
      return absl::InvalidArgumentError(absl::StrCat("activation recomputation (", RecomputeName(shard_.recompute),
                                                     ") is not available for ", config.model_type,
                                                     ": its stacks' blocks take two inputs"));
    }
    for (const auto& [path, m] : model->Modules()) {
      if (m->cls() == "ModuleList") m->set_recompute(shard_.recompute);
    }
  }
  std::unique_ptr<Policy> policy = family.policy();
  // Checkpoints of the bare model (GPT2Model) lack the LM model's prefix
  // ("transformer."); Hugging Face loads both, and so does colod.
  if (!family.base_model_prefix.empty()) {
    bool prefixed = false;
    for (const std::string& name : files->Names()) prefixed = prefixed || absl::StartsWith(name, family.base_model_prefix + ".");
    if (!prefixed) files->set_strip_prefix(family.base_model_prefix + ".");
  }
  ASSIGN_OR_RETURN(std::unique_ptr<ShardedModel> sharded, Optimize(std::move(model), config, *files, *policy));
  sharded->set_tied_tables(std::move(tied));
  if (shard_.pp() == 1) {
    std::vector<std::string> unread;
    for (std::string& name : files->Unread()) {
      if (!ReadByNoModel(name, config)) unread.push_back(std::move(name));
    }
    if (!unread.empty() && pg_->rank() == 0) {
      constexpr size_t kNamed = 8;
      std::vector<std::string> named(unread.begin(), unread.begin() + std::min(unread.size(), kNamed));
      COLOD_LOG(WARNING) << dir << ": " << unread.size() << " of its tensors are not this " << config.model_type
                         << " model's and were not loaded: " << absl::StrJoin(named, ", ")
                         << (unread.size() > kNamed ? absl::StrCat(" and ", unread.size() - kNamed, " more") : "")
                         << " (does config.json describe these weights? fewer layers than they have?)";
    }
    sharded->set_unread_tensors(std::move(unread));
  }
  return sharded;
}

}  // namespace colod::shardformer
