#include "worker/train/pipeline.h"

#include <algorithm>
#include <map>
#include <optional>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "worker/train/pipeline_schedule.h"

namespace colod::train {
namespace {

// The channel that carries stage `from`'s sends in one direction.
std::string Channel(bool forward, int from) { return absl::StrCat("pp#", forward ? "f" : "b", from % 2); }
// Virtual stages: the channel from the last rank to the first (forward),
// or from the first to the last (backward).
std::string WrapChannel(bool forward) { return forward ? "pp#fw" : "pp#bw"; }

struct Pending {
  std::shared_ptr<Work> work;
  Tensor keep;  // the buffer the send reads from
};

absl::Status WaitAll(std::vector<Pending>& sends, absl::Duration timeout) {
  absl::Status first;
  for (Pending& p : sends) {
    absl::Status s = p.work->WaitOnDevice(timeout);
    if (first.ok() && !s.ok()) first = s;
  }
  sends.clear();
  return first;
}

}  // namespace

absl::Status MakePipelineChannels(ProcessGroup& pg, int stages, int virtual_stages) {
  for (const bool forward : {true, false}) {
    for (int parity = 0; parity < std::min(2, stages - 1); ++parity) {
      RETURN_IF_ERROR(pg.Comm(Channel(forward, forward ? parity : parity + 1)).status());
    }
  }
  if (virtual_stages > 1 && stages > 1) {
    for (const bool forward : {true, false}) RETURN_IF_ERROR(pg.Comm(WrapChannel(forward)).status());
  }
  return absl::OkStatus();
}

absl::StatusOr<PipelineStepResult> RunPipelineStep(shardformer::ShardedModel& model, ProcessGroup& pg, GradSync& sync,
                                                   const Tensor& inputs, const Tensor& labels, int64_t micro_batches,
                                                   int64_t step_labels, bool reduce, bool train,
                                                   const Tensor* decoder_inputs, double loss_scale) {
  return RunPipelineStep(std::vector<shardformer::ShardedModel*>{&model}, pg, sync, inputs, labels, micro_batches,
                         step_labels, reduce, train, decoder_inputs, loss_scale);
}

absl::StatusOr<PipelineStepResult> RunPipelineStep(const std::vector<shardformer::ShardedModel*>& chunks,
                                                   ProcessGroup& pg, GradSync& sync, const Tensor& inputs,
                                                   const Tensor& labels, int64_t micro_batches, int64_t step_labels,
                                                   bool reduce, bool train, const Tensor* decoder_inputs,
                                                   double loss_scale) {
  if (chunks.empty()) return absl::InvalidArgumentError("pipeline: no model chunk");
  const ModelConfig& config = chunks.front()->config();
  const bool pairs = config.is_encoder_decoder();
  if (pairs != (decoder_inputs != nullptr)) {
    return absl::InvalidArgumentError(pairs ? "pipeline: an encoder-decoder's stages need the decoder's inputs"
                                            : "pipeline: decoder inputs for a model without a decoder");
  }
  // Checked on every rank (the first stage's forward checks the ids again):
  // a rank that refused them alone would leave the others waiting.
  if (micro_batches < 1 || micro_batches > (int64_t{1} << 20) || inputs.dim() < 1 ||
      inputs.shape()[0] % micro_batches != 0 || labels.dim() < 1 ||
      labels.shape()[0] != inputs.shape()[0]) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline: inputs ", ShapeToString(inputs.shape()), " and labels ",
                                                   ShapeToString(labels.shape()), " in ", micro_batches,
                                                   " micro-batches"));
  }
  if (config.takes_images()
          ? (inputs.dim() != 4 || !IsFloat(inputs.dtype()) || inputs.shape()[1] != config.num_channels ||
             inputs.shape()[2] != config.image_size || inputs.shape()[3] != config.image_size)
          : (inputs.dim() != 2 || !IsInteger(inputs.dtype()) || inputs.shape()[1] < 1 ||
             inputs.shape()[1] > config.max_positions)) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline: inputs must be ",
                                                   config.takes_images() ? "float pixels [rows, channels, side, side]"
                                                                         : absl::StrCat("integer ids [rows, 1 to ",
                                                                                        config.max_positions, "]"),
                                                   ", got ", DTypeName(inputs.dtype()), " ",
                                                   ShapeToString(inputs.shape())));
  }
  if (pairs && (decoder_inputs->dim() != 2 || inputs.dim() != 2 || !IsInteger(decoder_inputs->dtype()) ||
                decoder_inputs->shape()[0] != inputs.shape()[0] || decoder_inputs->shape()[1] < 1 ||
                decoder_inputs->shape()[1] > config.max_positions)) {
    return absl::InvalidArgumentError(absl::StrCat("pipeline: decoder inputs must be integers [rows, 1 to ",
                                                   config.max_positions, "] for inputs ",
                                                   ShapeToString(inputs.shape()), ", got ",
                                                   DTypeName(decoder_inputs->dtype()), " ",
                                                   ShapeToString(decoder_inputs->shape())));
  }
  const int v = static_cast<int>(chunks.size());
  ASSIGN_OR_RETURN(const int me, pg.LocalRank("pp"));
  ASSIGN_OR_RETURN(const int p, pg.AxisSize("pp"));
  const int virtual_stages = p * v;
  for (int c = 0; c < v; ++c) {
    const shardformer::PipelineStage& st = chunks[c]->shard_config().stage;
    if (st.count != virtual_stages || st.index != c * p + me) {
      return absl::InvalidArgumentError(absl::StrCat("pipeline: chunk ", c, " of rank ", me, " is stage ", st.index,
                                                     " of ", st.count, ", not ", c * p + me, " of ",
                                                     virtual_stages));
    }
  }
  const int m = static_cast<int>(micro_batches);
  ASSIGN_OR_RETURN(std::vector<PipeTask> schedule, InterleavedSchedule(p, me, m, v));
  if (!train) {  // forwards only, in the same order: nothing waits for a backward
    std::vector<PipeTask> forwards;
    for (const PipeTask& t : schedule) {
      if (t.kind == PipeTask::Kind::kForward) forwards.push_back(t);
    }
    schedule = std::move(forwards);
  }
  // A message's tag: its sender's virtual stage and the micro-batch.
  auto tag = [m](int sender, int i) { return static_cast<uint32_t>(int64_t{sender} * m + i); };
  // The stream between stages: [rows, seq, hidden]; an image classifier's
  // sequence is its patches and the CLS token (max_positions).
  shardformer::ShardedModel& head = *chunks.back();
  const bool images = head.config().takes_images();
  const int64_t rows = inputs.shape()[0] / micro_batches, seq = images ? head.config().max_positions : inputs.shape()[1];
  const int64_t decoder_seq = pairs ? decoder_inputs->shape()[1] : 0;
  const absl::Duration timeout = pg.timeout();
  RETURN_IF_ERROR(MakePipelineChannels(pg, p, v));
  // Each direction's communicators: to and from the neighbouring ranks; the
  // wrap-around between the last rank and the first (virtual stages only)
  // on channels of their own.
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  Communicator *send_fwd = nullptr, *recv_fwd = nullptr, *send_back = nullptr, *recv_back = nullptr;
  // Only those MakePipelineChannels made: making one is collective.
  const bool wraps = v > 1 && p > 1;
  if (me < p - 1 || wraps) {
    ASSIGN_OR_RETURN(send_fwd, pg.Comm(me == p - 1 ? WrapChannel(true) : Channel(true, me)));
    ASSIGN_OR_RETURN(recv_back, pg.Comm(me == p - 1 ? WrapChannel(false) : Channel(false, me + 1)));
  }
  if (me > 0 || wraps) {
    ASSIGN_OR_RETURN(recv_fwd, pg.Comm(me == 0 ? WrapChannel(true) : Channel(true, me - 1)));
    ASSIGN_OR_RETURN(send_back, pg.Comm(me == 0 ? WrapChannel(false) : Channel(false, me)));
  }
  // What each chunk but the first virtual stage receives: the residual
  // stream [rows, seq, hidden] (ShardedModel::StageInputShape: an
  // encoder-decoder's decoder stages take the encoder's output too) in its
  // first layer's spec, this rank's block.
  std::vector<DistSpec> in_spec(v);
  std::vector<Shape> in_local(v);
  for (int c = 0; c < v; ++c) {
    if (chunks[c]->shard_config().stage.first()) continue;
    ASSIGN_OR_RETURN(in_spec[c], chunks[c]->StageInputSpec(3));
    ASSIGN_OR_RETURN(Block block, LocalBlock(in_spec[c], chunks[c]->StageInputShape(rows, seq, decoder_seq), &pg));
    in_local[c] = Shape(block.lengths.begin(), block.lengths.end());
  }
  struct InFlight {
    Variable input;     // a received activation (a leaf), or none on the first stage
    std::optional<ColoTensor> output;  // what was sent on
    Variable loss;      // the last stage's
  };
  std::map<std::pair<int, int>, InFlight> alive;  // (chunk, micro-batch)
  std::vector<Pending> sends;
  double loss = 0;
  int64_t correct = 0;  // an evaluation's classifier's, on the last stage
  absl::Duration waited;
  // On Gloo, receives are posted ahead of the tasks that read them: each
  // channel's next one as soon as its previous one was read (a gradient's
  // once its forward ran, which fixes its shape), so that the transfer
  // overlaps this rank's compute. A Gloo send waits until its receiver
  // posted; posted only when needed, every receive cost the round trip and
  // the sender's wake-up on top of the bubble. Each channel's receives stay
  // in the order its sender sends them, one posted at a time, on the
  // channel's own thread, where they hold up nothing else. On NCCL they are
  // posted when needed: NCCL connects a pair of ranks at its first
  // operation, which holds the host until the peer's matching one, and a
  // first receive posted ahead of the schedule's need could wait for a peer
  // that waits for this rank (the wrap channel's at V > 1, a gradient's at
  // p > 2); the device, not the host, waits for a receive there.
  struct Inbox {
    Communicator* comm = nullptr;
    bool forward = true;
    bool ahead = false;  // posted ahead (Gloo), or when needed (NCCL)
    std::vector<size_t> tasks;  // the schedule's tasks that read from it, in order
    size_t posted = 0;          // how many of them were posted
    std::optional<Pending> next;  // posted and not yet read: tasks[posted - 1]'s
  };
  Inbox from_prev{recv_fwd, true, recv_fwd != nullptr && recv_fwd->backend() == "gloo"},
      from_next{recv_back, false, recv_back != nullptr && recv_back->backend() == "gloo"};
  for (size_t t = 0; t < schedule.size(); ++t) {
    const shardformer::PipelineStage& st = chunks[schedule[t].chunk]->shard_config().stage;
    if (schedule[t].kind == PipeTask::Kind::kForward) {
      if (!st.first()) from_prev.tasks.push_back(t);
    } else if (!st.last()) {
      from_next.tasks.push_back(t);
    }
  }
  // Posts the channel's next receive, if none is posted and it may be now:
  // ahead, or `needed` by the task at hand.
  auto post = [&](Inbox& in, bool needed = false) -> absl::Status {
    if (in.next.has_value() || in.posted == in.tasks.size() || !(in.ahead || needed)) return absl::OkStatus();
    const PipeTask& task = schedule[in.tasks[in.posted]];
    const int c = task.chunk, i = task.micro_batch;
    const shardformer::ShardConfig& shard = chunks[c]->shard_config();
    Tensor buf;
    if (in.forward) {
      ASSIGN_OR_RETURN(buf, Tensor::Empty(in_local[c], shard.param_dtype, shard.device));
    } else {
      auto it = alive.find({c, i});
      if (it == alive.end() || !it->second.output.has_value()) return absl::OkStatus();  // its forward is to come
      const Tensor& o = it->second.output->local();
      ASSIGN_OR_RETURN(buf, Tensor::Empty(o.shape(), o.dtype(), o.device()));
    }
    const int from = in.forward ? shard.stage.index - 1 : shard.stage.index + 1;
    in.next = Pending{in.comm->Recv(buf.raw_data(), buf.numel(), buf.dtype(), in.forward ? prev : next, tag(from, i)),
                      buf};
    ++in.posted;
    return absl::OkStatus();
  };
  // Task t's message, waited for on the device; the channel's next posted.
  // A receive whose wait failed stays posted: the step's end aborts its
  // channel and waits it out.
  // Posting it here is waiting too (NCCL's first operation on a channel
  // holds the host until the peer's).
  auto take = [&](Inbox& in, size_t t) -> absl::StatusOr<Tensor> {
    const absl::Time waiting = absl::Now();
    RETURN_IF_ERROR(post(in, /*needed=*/true));
    if (!in.next.has_value() || in.tasks[in.posted - 1] != t) {
      return absl::InternalError(absl::StrCat("pipeline: task ", t, "'s receive was not posted"));
    }
    RETURN_IF_ERROR(in.next->work->WaitOnDevice(timeout));
    waited += absl::Now() - waiting;
    Tensor got = std::move(in.next->keep);
    in.next.reset();
    RETURN_IF_ERROR(post(in));
    return got;
  };
  auto run = [&]() -> absl::Status {
    RETURN_IF_ERROR(post(from_prev));
    for (size_t t = 0; t < schedule.size(); ++t) {
      const PipeTask& task = schedule[t];
      const int i = task.micro_batch, c = task.chunk;
      shardformer::ShardedModel& model = *chunks[c];
      const shardformer::PipelineStage& stage = model.shard_config().stage;
      if (task.kind == PipeTask::Kind::kForward) {
        InFlight f;
        std::optional<ColoTensor> in;  // a later stage's input activation
        if (!stage.first()) {
          ASSIGN_OR_RETURN(Tensor buf, take(from_prev, t));
          f.input = Variable(buf, /*requires_grad=*/true);
          ASSIGN_OR_RETURN(in, ColoTensor::FromLocal(f.input, in_spec[c], &pg));
        }
        auto forward = [&]() -> absl::StatusOr<ColoTensor> {
          std::optional<Tensor> decoder_ids;  // an encoder-decoder's, which every stage takes
          if (pairs) {
            ASSIGN_OR_RETURN(Tensor d, decoder_inputs->Narrow(0, i * rows, rows));
            ASSIGN_OR_RETURN(decoder_ids, d.ContiguousAs(DType::kI64));
          }
          if (!stage.first()) {
            if (!pairs) return model.root().Forward(*in);
            ASSIGN_OR_RETURN(Tensor host, decoder_ids->To(Device::Cpu()));
            ASSIGN_OR_RETURN(ColoTensor context, ColoTensor::FromLocal(host, DistSpec(), &pg));
            return model.root().Forward(*in, context);
          }
          ASSIGN_OR_RETURN(Tensor ids, inputs.Narrow(0, i * rows, rows));
          ASSIGN_OR_RETURN(ids, ids.TryContiguous());
          if (pairs) return model.Forward(ids, *decoder_ids);
          return model.Forward(ids);
        };
        if (stage.last()) {  // the LM head fused with the loss where the model allows
          ASSIGN_OR_RETURN(Tensor want, labels.Narrow(0, i * rows, rows));
          ASSIGN_OR_RETURN(want, want.TryContiguous());
          ASSIGN_OR_RETURN(shardformer::LmLoss l, ForwardLoss(model, forward, want, step_labels,
                                                              images && !train ? &correct : nullptr));
          loss += l.value;
          f.loss = l.loss;
        } else {
          ASSIGN_OR_RETURN(ColoTensor out, forward());
          ASSIGN_OR_RETURN(Tensor o, out.local().TryContiguous());
          sends.push_back({send_fwd->Send(o.raw_data(), o.numel(), o.dtype(), next, tag(stage.index, i)), o});
          f.output = out;
        }
        if (train) {
          alive[{c, i}] = std::move(f);
          RETURN_IF_ERROR(post(from_next));  // this forward's gradient, if it is the next to come
        }
        continue;
      }
      auto it = alive.find({c, i});
      if (it == alive.end()) {
        return absl::InternalError(absl::StrCat("pipeline: B", i, " before F", i, " on chunk ", c));
      }
      InFlight& f = it->second;
      // Each chunk's last task is its last micro-batch's backward.
      sync.set_enabled(reduce && i == m - 1);
      if (stage.last()) {
        RETURN_IF_ERROR(Backward(f.loss, static_cast<float>(loss_scale)));
      } else {
        ASSIGN_OR_RETURN(Tensor grad, take(from_next, t));
        RETURN_IF_ERROR(Backward(f.output->variable(), grad));
      }
      if (!stage.first()) {
        std::optional<Tensor> g = f.input.grad();
        if (!g.has_value()) return absl::InternalError(absl::StrCat("pipeline: no gradient for F", i, "'s input"));
        Tensor gc = g->Contiguous();
        sends.push_back({send_back->Send(gc.raw_data(), gc.numel(), gc.dtype(), prev, tag(stage.index, i)), gc});
      }
      alive.erase(it);
    }
    return absl::OkStatus();
  };
  const absl::Time began = absl::Now();
  absl::Status ran = run();
  // This stage's busy time: its tasks, less their waits for a neighbour.
  const double busy = absl::ToDoubleSeconds(absl::Now() - began - waited);
  // Every send and posted receive is waited for, on every path: they use
  // buffers freed below. After a failure a receive still posted (one
  // posted ahead, on Gloo, or one whose wait failed) may never be answered
  // (its sender may wait for this rank): its channel is aborted first,
  // which ends the wait at once (the channel's sender then fails too; no
  // other communicator of the group is touched).
  for (Inbox* in : {&from_prev, &from_next}) {
    if (!in->next.has_value()) continue;
    if (!ran.ok()) in->comm->Abort(ran);
    sends.push_back(std::move(*in->next));
  }
  absl::Status sent = WaitAll(sends, timeout);
  RETURN_IF_ERROR(ran);
  RETURN_IF_ERROR(sent);
  // In one all-reduce over pp: the loss, which the last stage has, the
  // stages' busy times, and an evaluation's correct rows (a count below
  // 2^24: exact in f32). The all-reduce ends the step's span on every
  // stage at once, so a stage's idle time is the span less its busy time:
  // its waits for a neighbour, and the last stages' time after their last
  // task, until the first stage's last backward.
  const Device device = head.shard_config().device;
  const bool last = head.shard_config().stage.last();
  std::vector<double> sums = {last ? loss : 0.0, busy};
  if (images && !train) sums.push_back(static_cast<double>(correct));
  ASSIGN_OR_RETURN(sums, SumOver(pg, "pp", std::move(sums), device));
  const double span = absl::ToDoubleSeconds(absl::Now() - began);
  PipelineStepResult result;
  result.loss = sums[0];
  result.wait_seconds = std::max(0.0, span - busy);
  result.mean_wait_seconds = std::max(0.0, span - sums[1] / p);
  result.span_seconds = span;
  if (images && !train) result.correct = static_cast<int64_t>(sums[2]);
  return result;
}

absl::StatusOr<int64_t> CorrectRows(const Tensor& logits, const Tensor& labels) {
  ASSIGN_OR_RETURN(const std::vector<float> z, logits.ReadFloats());
  ASSIGN_OR_RETURN(const std::vector<int64_t> want, labels.ReadInt64s());
  const int64_t rows = static_cast<int64_t>(want.size()), classes = rows > 0 ? logits.numel() / rows : 0;
  int64_t correct = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (want[r] < 0) continue;  // -100: unlabelled
    const float* row = z.data() + r * classes;
    correct += std::max_element(row, row + classes) - row == want[r];
  }
  return correct;
}

absl::StatusOr<shardformer::LmLoss> ForwardLoss(shardformer::ShardedModel& model,
                                                const std::function<absl::StatusOr<ColoTensor>()>& forward,
                                                const Tensor& labels, int64_t denominator, int64_t* correct) {
  if (!model.config().takes_images()) return model.ForwardTokenLoss(forward, labels, denominator);
  ASSIGN_OR_RETURN(ColoTensor logits, forward());
  ASSIGN_OR_RETURN(shardformer::LmLoss l, model.ClassificationLoss(logits, labels, denominator));
  if (correct != nullptr) {
    ASSIGN_OR_RETURN(Tensor full, model.GatherLogits(logits));
    ASSIGN_OR_RETURN(const int64_t right, CorrectRows(full, labels));
    *correct += right;
  }
  return l;
}

absl::StatusOr<std::vector<double>> SumOver(ProcessGroup& pg, const std::string& axis, std::vector<double> values,
                                            const Device& device) {
  if (values.empty()) return values;
  ASSIGN_OR_RETURN(Communicator * comm, pg.Comm(axis));
  const std::vector<float> f(values.begin(), values.end());
  const int64_t n = static_cast<int64_t>(f.size());
  ASSIGN_OR_RETURN(Tensor host, Tensor::FromFloats({n}, f));
  ASSIGN_OR_RETURN(Tensor total, host.To(device));
  RETURN_IF_ERROR(comm->AllReduce(total.raw_data(), n, DType::kF32, ReduceOp::kSum)->WaitOnDevice(pg.timeout()));
  ASSIGN_OR_RETURN(const std::vector<float> sums, total.ReadFloats());
  return std::vector<double>(sums.begin(), sums.end());
}

absl::StatusOr<double> SumOver(ProcessGroup& pg, const std::string& axis, double value, const Device& device) {
  ASSIGN_OR_RETURN(const std::vector<double> sums, SumOver(pg, axis, std::vector<double>{value}, device));
  return sums[0];
}

absl::Status SumTiedGradients(const std::vector<shardformer::ShardedModel*>& chunks,
                              const std::vector<std::vector<shardformer::NamedParam>>& chunk_params,
                              ProcessGroup& pg) {
  if (chunks.size() != chunk_params.size()) {
    return absl::InvalidArgumentError("SumTiedGradients: one parameter list a chunk");
  }
  // This rank's holders of each table, by name (the same on every holder):
  // the holders' stages (ascending) and, for each held here, its gradient.
  struct Table {
    std::vector<int> stages;
    std::map<int, Tensor> mine;  // stage -> the gradient (sharing the parameter's)
  };
  std::map<std::string, Table> tables;
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int stage = chunks[c]->shard_config().stage.index;
    for (const shardformer::NamedParam& p : chunk_params[c]) {
      if (!p.tied || p.tie_stages.size() < 2) continue;
      std::optional<Tensor> g = p.bound.param.variable().grad();
      if (!g.has_value()) return absl::FailedPreconditionError(absl::StrCat(p.name, " has no gradient"));
      Table& t = tables[p.name];
      if (!t.stages.empty() && t.stages != p.tie_stages) {
        return absl::InternalError(absl::StrCat(p.name, ": its chunks disagree on the stages that hold it"));
      }
      t.stages = p.tie_stages;
      t.mine[stage] = *g;
    }
  }
  if (tables.empty()) return absl::OkStatus();
  ASSIGN_OR_RETURN(const int ranks, pg.AxisSize("pp"));
  // Virtual stage s is on pipeline rank s mod pp (chunk s / pp).
  auto rank_of = [ranks](int stage) { return stage % ranks; };
  ASSIGN_OR_RETURN(Communicator * gather, pg.Comm(Channel(true, 0)));    // holders -> owner
  ASSIGN_OR_RETURN(Communicator * scatter, pg.Comm(Channel(false, 1)));  // owner -> holders
  const absl::Duration timeout = pg.timeout();
  // The tables in name order on every rank, each exchanged whole before the
  // next: no rank waits on one that is still in an earlier table. Each
  // message's tag is the holder's stage.
  for (auto& [name, t] : tables) {
    const int owner = t.stages.front();
    std::vector<Pending> sends;
    if (t.mine.count(owner) > 0) {
      // The sum in stage order, whichever ranks hold the copies: the same
      // bits for any placement of the stages.
      ASSIGN_OR_RETURN(Tensor sum, t.mine[owner].TryContiguous());
      for (size_t k = 1; k < t.stages.size(); ++k) {
        const int s = t.stages[k];
        Tensor theirs;
        if (auto it = t.mine.find(s); it != t.mine.end()) {
          theirs = it->second;
        } else {
          ASSIGN_OR_RETURN(theirs, Tensor::Empty(sum.shape(), sum.dtype(), sum.device()));
          RETURN_IF_ERROR(
              gather->Recv(theirs.raw_data(), theirs.numel(), theirs.dtype(), rank_of(s), static_cast<uint32_t>(s))
                  ->WaitOnDevice(timeout));
        }
        ASSIGN_OR_RETURN(sum, Add(sum, theirs));
      }
      for (int s : t.stages) {
        if (auto it = t.mine.find(s); it != t.mine.end()) {
          RETURN_IF_ERROR(it->second.CopyFrom(sum));
        } else {
          sends.push_back({scatter->Send(sum.raw_data(), sum.numel(), sum.dtype(), rank_of(s), static_cast<uint32_t>(s)),
                           sum});
        }
      }
      RETURN_IF_ERROR(WaitAll(sends, timeout));
      continue;
    }
    for (auto& [s, g] : t.mine) {  // in stage order, as the owner receives them
      ASSIGN_OR_RETURN(Tensor mine, g.TryContiguous());
      sends.push_back(
          {gather->Send(mine.raw_data(), mine.numel(), mine.dtype(), rank_of(owner), static_cast<uint32_t>(s)), mine});
    }
    RETURN_IF_ERROR(WaitAll(sends, timeout));
    for (auto& [s, g] : t.mine) {
      ASSIGN_OR_RETURN(Tensor sum, Tensor::Empty(g.shape(), g.dtype(), g.device()));
      RETURN_IF_ERROR(scatter->Recv(sum.raw_data(), sum.numel(), sum.dtype(), rank_of(owner), static_cast<uint32_t>(s))
                          ->WaitOnDevice(timeout));
      RETURN_IF_ERROR(g.CopyFrom(sum));
    }
  }
  return absl::OkStatus();
}

}  // namespace colod::train
