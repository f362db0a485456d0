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

absl::Status MakePipelineChannels(ProcessGroup& pg, int stages) {
  for (const bool forward : {true, false}) {
    for (int parity = 0; parity < std::min(2, stages - 1); ++parity) {
      RETURN_IF_ERROR(pg.Comm(Channel(forward, forward ? parity : parity + 1)).status());
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<PipelineStepResult> RunPipelineStep(shardformer::ShardedModel& model, ProcessGroup& pg, GradSync& sync,
                                                   const Tensor& inputs, const Tensor& labels, int64_t micro_batches,
                                                   int64_t step_labels, bool reduce, bool train) {
  const shardformer::PipelineStage& stage = model.shard_config().stage;
  const int me = stage.index;
  const int m = static_cast<int>(micro_batches);
  std::vector<PipeTask> schedule;
  if (train) {
    ASSIGN_OR_RETURN(schedule, OneFOneBSchedule(stage.count, me, m));
  } else {  // forwards only: nothing waits for a backward
    for (int i = 0; i < m; ++i) schedule.push_back(PipeTask{PipeTask::Kind::kForward, i});
  }
  // The stream between stages: [rows, seq, hidden]; an image classifier's
  // sequence is its patches and the CLS token (max_positions).
  const bool images = model.config().takes_images();
  const int64_t rows = inputs.shape()[0] / micro_batches, seq = images ? model.config().max_positions : inputs.shape()[1];
  const absl::Duration timeout = pg.timeout();
  RETURN_IF_ERROR(MakePipelineChannels(pg, stage.count));
  Communicator *send_fwd = nullptr, *recv_fwd = nullptr, *send_back = nullptr, *recv_back = nullptr;
  if (!stage.last()) {
    ASSIGN_OR_RETURN(send_fwd, pg.Comm(Channel(true, me)));
    ASSIGN_OR_RETURN(recv_back, pg.Comm(Channel(false, me + 1)));
  }
  if (!stage.first()) {
    ASSIGN_OR_RETURN(recv_fwd, pg.Comm(Channel(true, me - 1)));
    ASSIGN_OR_RETURN(send_back, pg.Comm(Channel(false, me)));
  }
  // What this stage receives: the residual stream [rows, seq, hidden] in its
  // first layer's spec, this rank's block of it.
  DistSpec in_spec;
  Shape in_local;
  const DType dtype = model.shard_config().param_dtype;
  const Device device = model.shard_config().device;
  if (!stage.first()) {
    ASSIGN_OR_RETURN(in_spec, model.StageInputSpec(3));
    ASSIGN_OR_RETURN(Block block, LocalBlock(in_spec, {rows, seq, model.config().hidden_size}, &pg));
    in_local = Shape(block.lengths.begin(), block.lengths.end());
  }
  struct InFlight {
    Variable input;     // a received activation (a leaf), or none on the first stage
    std::optional<ColoTensor> output;  // what was sent on
    Variable loss;      // the last stage's
  };
  std::map<int, InFlight> alive;
  std::vector<Pending> sends;
  double loss = 0;
  int64_t correct = 0;  // an evaluation's classifier's, on the last stage
  absl::Duration waited;
  auto run = [&]() -> absl::Status {
    for (const PipeTask& task : schedule) {
      const int i = task.micro_batch;
      if (task.kind == PipeTask::Kind::kForward) {
        InFlight f;
        std::optional<ColoTensor> in;  // a later stage's input activation
        if (!stage.first()) {
          ASSIGN_OR_RETURN(Tensor buf, Tensor::Empty(in_local, dtype, device));
          const absl::Time waiting = absl::Now();
          RETURN_IF_ERROR(recv_fwd->Recv(buf.raw_data(), buf.numel(), dtype, me - 1, static_cast<uint32_t>(i))
                              ->WaitOnDevice(timeout));
          waited += absl::Now() - waiting;
          f.input = Variable(buf, /*requires_grad=*/true);
          ASSIGN_OR_RETURN(in, ColoTensor::FromLocal(f.input, in_spec, &pg));
        }
        auto forward = [&]() -> absl::StatusOr<ColoTensor> {
          if (!stage.first()) return model.root().Forward(*in);
          ASSIGN_OR_RETURN(Tensor ids, inputs.Narrow(0, i * rows, rows));
          return model.Forward(ids.Contiguous());
        };
        if (stage.last()) {  // the LM head fused with the loss where the model allows
          ASSIGN_OR_RETURN(Tensor want, labels.Narrow(0, i * rows, rows));
          ASSIGN_OR_RETURN(shardformer::LmLoss l, ForwardLoss(model, forward, want.Contiguous(), step_labels,
                                                              images && !train ? &correct : nullptr));
          loss += l.value;
          f.loss = l.loss;
        } else {
          ASSIGN_OR_RETURN(ColoTensor out, forward());
          Tensor o = out.local().Contiguous();
          sends.push_back({send_fwd->Send(o.raw_data(), o.numel(), o.dtype(), me + 1, static_cast<uint32_t>(i)), o});
          f.output = out;
        }
        if (train) alive[i] = std::move(f);
        continue;
      }
      auto it = alive.find(i);
      if (it == alive.end()) return absl::InternalError(absl::StrCat("pipeline: B", i, " before F", i));
      InFlight& f = it->second;
      sync.set_enabled(reduce && i == m - 1);  // every stage's last task is the last micro-batch's backward
      if (stage.last()) {
        RETURN_IF_ERROR(Backward(f.loss));
      } else {
        const Tensor& o = f.output->local();
        ASSIGN_OR_RETURN(Tensor grad, Tensor::Empty(o.shape(), o.dtype(), o.device()));
        const absl::Time waiting = absl::Now();
        RETURN_IF_ERROR(recv_back->Recv(grad.raw_data(), grad.numel(), grad.dtype(), me + 1, static_cast<uint32_t>(i))
                            ->WaitOnDevice(timeout));
        waited += absl::Now() - waiting;
        RETURN_IF_ERROR(Backward(f.output->variable(), grad));
      }
      if (!stage.first()) {
        std::optional<Tensor> g = f.input.grad();
        if (!g.has_value()) return absl::InternalError(absl::StrCat("pipeline: no gradient for F", i, "'s input"));
        Tensor gc = g->Contiguous();
        sends.push_back(
            {send_back->Send(gc.raw_data(), gc.numel(), gc.dtype(), me - 1, static_cast<uint32_t>(i)), gc});
      }
      alive.erase(it);
    }
    return absl::OkStatus();
  };
  absl::Status ran = run();
  // Every send is waited for, on every path: they read buffers freed below.
  absl::Status sent = WaitAll(sends, timeout);
  RETURN_IF_ERROR(ran);
  RETURN_IF_ERROR(sent);
  // The loss, which the last stage has, on every stage.
  ASSIGN_OR_RETURN(const double total, SumOver(pg, "pp", stage.last() ? loss : 0.0, device));
  PipelineStepResult result{total, absl::ToDoubleSeconds(waited)};
  if (images && !train) {  // a count below 2^24: exact in f32
    ASSIGN_OR_RETURN(const double all, SumOver(pg, "pp", static_cast<double>(correct), device));
    result.correct = static_cast<int64_t>(all);
  }
  return result;
}

int64_t CorrectRows(const Tensor& logits, const Tensor& labels) {
  const std::vector<float> z = logits.ToFloats();
  const std::vector<int64_t> want = labels.ToInt64s();
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
    *correct += CorrectRows(full, labels);
  }
  return l;
}

absl::StatusOr<double> SumOver(ProcessGroup& pg, const std::string& axis, double value, const Device& device) {
  ASSIGN_OR_RETURN(Communicator * comm, pg.Comm(axis));
  ASSIGN_OR_RETURN(Tensor host, Tensor::FromFloats({1}, {static_cast<float>(value)}));
  ASSIGN_OR_RETURN(Tensor total, host.To(device));
  RETURN_IF_ERROR(comm->AllReduce(total.raw_data(), 1, DType::kF32, ReduceOp::kSum)->WaitOnDevice(pg.timeout()));
  return static_cast<double>(total.ToFloats()[0]);
}

absl::Status SumTiedGradients(const std::vector<shardformer::NamedParam>& params,
                              const shardformer::ShardedModel& model, ProcessGroup& pg) {
  const shardformer::PipelineStage& stage = model.shard_config().stage;
  if (stage.count < 2 || !(stage.first() || stage.last())) return absl::OkStatus();
  const int first = 0, last = stage.count - 1;
  ASSIGN_OR_RETURN(Communicator * to_last, pg.Comm(Channel(true, 0)));    // first -> last
  ASSIGN_OR_RETURN(Communicator * to_first, pg.Comm(Channel(false, 1)));  // last -> first
  for (const shardformer::NamedParam& p : params) {
    if (!p.tied) continue;  // in the same order on both stages: the module order
    std::optional<Tensor> g = p.bound.param.variable().grad();
    if (!g.has_value()) return absl::FailedPreconditionError(absl::StrCat(p.name, " has no gradient"));
    Tensor mine = g->Contiguous();
    ASSIGN_OR_RETURN(Tensor theirs, Tensor::Empty(mine.shape(), mine.dtype(), mine.device()));
    std::shared_ptr<Work> sent, got;
    if (stage.first()) {
      sent = to_last->Send(mine.raw_data(), mine.numel(), mine.dtype(), last, 0);
      got = to_first->Recv(theirs.raw_data(), theirs.numel(), theirs.dtype(), last, 0);
    } else {
      got = to_last->Recv(theirs.raw_data(), theirs.numel(), theirs.dtype(), first, 0);
      sent = to_first->Send(mine.raw_data(), mine.numel(), mine.dtype(), first, 0);
    }
    const absl::Status a = sent->WaitOnDevice(pg.timeout()), b = got->WaitOnDevice(pg.timeout());
    RETURN_IF_ERROR(a);
    RETURN_IF_ERROR(b);
    // first + last on both (addition commutes exactly).
    ASSIGN_OR_RETURN(Tensor sum, stage.first() ? Add(mine, theirs) : Add(theirs, mine));
    RETURN_IF_ERROR(g->CopyFrom(sum));
  }
  return absl::OkStatus();
}

}  // namespace colod::train
