// Pipeline-parallel schedules (issue 20): the order in which stage s of a
// pipeline of `stages` runs the forward (F) and backward (B) passes of a
// step's micro-batches, and a simulation of the whole pipeline that checks a
// set of schedules for deadlock and measures its bubble.
//
// Interleaved (issue 49, Megatron-LM's virtual stages): each of the p ranks
// holds V model chunks, chunk c of rank s being virtual stage c * p + s of
// the p * V the model is cut into; a micro-batch's forward runs the virtual
// stages in order, going round the ranks V times.
//
// The communication model the simulation checks, which the pipeline engine
// keeps: stage s's forward of micro-batch i needs the activation stage s-1's
// forward of i sends; its backward needs the gradient stage s+1's backward of
// i sends (the last stage's, its own forward's loss). Each direction between
// two neighbours is its own FIFO channel (its own communicator and thread),
// so a stage's send never waits for its compute, and a receive blocks only
// the stage that posts it. A schedule is deadlock-free when the simulation
// finishes every stage's tasks.
//
// Thread-safety: functions of their arguments.
#ifndef COLOD_WORKER_TRAIN_PIPELINE_SCHEDULE_H_
#define COLOD_WORKER_TRAIN_PIPELINE_SCHEDULE_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace colod::train {

struct PipeTask {
  enum class Kind { kForward, kBackward };
  Kind kind;
  int micro_batch;
  int chunk = 0;  // the rank's model chunk (interleaved: 0..V-1)
  bool operator==(const PipeTask& o) const {
    return kind == o.kind && micro_batch == o.micro_batch && chunk == o.chunk;
  }
};

// "F0 F1 B0 F2 B1 B2"; where any task is of a chunk other than 0, every
// task names its chunk: "F0c0 F1c0 F0c1 ...".
std::string ScheduleToString(const std::vector<PipeTask>& tasks);

// 1F1B (PipeDream-Flush, Megatron-LM's non-interleaved schedule): stage s
// runs min(stages - s - 1, micro_batches) warm-up forwards, then one forward
// and one backward in turn, then the backwards left; at most stages - s
// micro-batches' activations are alive on it at once. INVALID_ARGUMENT
// unless 0 <= stage < stages and micro_batches >= 1.
absl::StatusOr<std::vector<PipeTask>> OneFOneBSchedule(int stages, int stage, int micro_batches);

// Interleaved 1F1B (Megatron-LM's schedule with virtual stages) for rank
// `stage` of `stages`, each holding `chunks` model chunks. The forwards run
// in groups of `stages` micro-batches through chunk 0, then the same group
// through chunk 1, and so on; the backwards in the same groups from the last
// chunk down. Rank s runs min(2 (stages - s - 1) + (chunks - 1) stages,
// chunks * micro_batches) warm-up forwards (all of them when micro_batches ==
// stages), then one forward and one backward in turn, then the backwards
// left. With even stages the bubble is (p - 1) / (V m) of the compute, a
// V-th of 1F1B's. chunks == 1 is OneFOneBSchedule. INVALID_ARGUMENT unless
// 0 <= stage < stages, chunks >= 1 and micro_batches >= 1, and (chunks > 1)
// micro_batches is a multiple of stages.
absl::StatusOr<std::vector<PipeTask>> InterleavedSchedule(int stages, int stage, int micro_batches, int chunks);

struct PipeSimulation {
  bool deadlock = false;
  // Where each stuck stage waits ("stage 1 waits at B0 for stage 2"), when
  // it deadlocked.
  std::string stuck;
  double makespan = 0;  // the step's time
  // 1 - (the busiest stage's compute) / makespan: the time a stage idles.
  double bubble_fraction = 0;
  // The most micro-batches alive (F done, B not) on one stage; interleaved,
  // (micro-batch, chunk) pairs, each a V-th of a stage's activations.
  int max_in_flight = 0;
};

// Runs `schedules` (one per stage) to the end or to a deadlock, with a
// forward on stage s taking forward_cost[s] (each of its chunks, where the
// schedules are interleaved) and a backward twice that; communication takes
// no time. INVALID_ARGUMENT for a schedule that does not run each of the
// same micro-batches' F and B once on each of the same chunks, F first.
absl::StatusOr<PipeSimulation> SimulatePipeline(const std::vector<std::vector<PipeTask>>& schedules,
                                                const std::vector<double>& forward_cost);

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_PIPELINE_SCHEDULE_H_
