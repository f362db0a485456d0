// Pipeline-parallel schedules (issue 20): the order in which stage s of a
// pipeline of `stages` runs the forward (F) and backward (B) passes of a
// step's micro-batches, and a simulation of the whole pipeline that checks a
// set of schedules for deadlock and measures its bubble.
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
  bool operator==(const PipeTask& o) const { return kind == o.kind && micro_batch == o.micro_batch; }
};

// "F0 F1 B0 F2 B1 B2".
std::string ScheduleToString(const std::vector<PipeTask>& tasks);

// 1F1B (PipeDream-Flush, Megatron-LM's non-interleaved schedule): stage s
// runs min(stages - s - 1, micro_batches) warm-up forwards, then one forward
// and one backward in turn, then the backwards left; at most stages - s
// micro-batches' activations are alive on it at once. INVALID_ARGUMENT
// unless 0 <= stage < stages and micro_batches >= 1.
absl::StatusOr<std::vector<PipeTask>> OneFOneBSchedule(int stages, int stage, int micro_batches);

struct PipeSimulation {
  bool deadlock = false;
  // Where each stuck stage waits ("stage 1 waits at B0 for stage 2"), when
  // it deadlocked.
  std::string stuck;
  double makespan = 0;  // the step's time
  // 1 - (the busiest stage's compute) / makespan: the time a stage idles.
  double bubble_fraction = 0;
  int max_in_flight = 0;  // the most micro-batches alive (F done, B not) on one stage
};

// Runs `schedules` (one per stage) to the end or to a deadlock, with a
// forward on stage s taking forward_cost[s] and a backward twice that;
// communication takes no time. INVALID_ARGUMENT for a schedule that does not
// run each of the same micro-batches' F and B once, F first.
absl::StatusOr<PipeSimulation> SimulatePipeline(const std::vector<std::vector<PipeTask>>& schedules,
                                                const std::vector<double>& forward_cost);

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_PIPELINE_SCHEDULE_H_
