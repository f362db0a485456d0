#include "worker/train/pipeline_schedule.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace colod::train {

std::string ScheduleToString(const std::vector<PipeTask>& tasks) {
  std::vector<std::string> parts;
  for (const PipeTask& t : tasks) {
    parts.push_back(absl::StrCat(t.kind == PipeTask::Kind::kForward ? "F" : "B", t.micro_batch));
  }
  return absl::StrJoin(parts, " ");
}

absl::StatusOr<std::vector<PipeTask>> OneFOneBSchedule(int stages, int stage, int micro_batches) {
  if (stages < 1 || stage < 0 || stage >= stages || micro_batches < 1) {
    return absl::InvalidArgumentError(absl::StrCat("no 1F1B schedule for stage ", stage, " of ", stages, " with ",
                                                   micro_batches, " micro-batches"));
  }
  const int warmup = std::min(stages - stage - 1, micro_batches);
  std::vector<PipeTask> out;
  int f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back({PipeTask::Kind::kForward, f});
  for (; f < micro_batches; ++f, ++b) {
    out.push_back({PipeTask::Kind::kForward, f});
    out.push_back({PipeTask::Kind::kBackward, b});
  }
  for (; b < micro_batches; ++b) out.push_back({PipeTask::Kind::kBackward, b});
  return out;
}

absl::StatusOr<PipeSimulation> SimulatePipeline(const std::vector<std::vector<PipeTask>>& schedules,
                                                const std::vector<double>& forward_cost) {
  const int p = static_cast<int>(schedules.size());
  if (p == 0 || forward_cost.size() != schedules.size()) {
    return absl::InvalidArgumentError("one schedule and one forward cost per stage");
  }
  // Every stage runs F and B of micro-batches 0..m-1 once each, F before B.
  const int m = static_cast<int>(schedules[0].size() / 2);
  for (int s = 0; s < p; ++s) {
    std::vector<int> seen_f(m, 0), seen_b(m, 0);
    if (static_cast<int>(schedules[s].size()) != 2 * m) {
      return absl::InvalidArgumentError(absl::StrCat("stage ", s, " runs ", schedules[s].size(), " tasks, not ", 2 * m));
    }
    for (const PipeTask& t : schedules[s]) {
      if (t.micro_batch < 0 || t.micro_batch >= m) {
        return absl::InvalidArgumentError(absl::StrCat("stage ", s, ": micro-batch ", t.micro_batch, " of ", m));
      }
      if (t.kind == PipeTask::Kind::kForward) {
        ++seen_f[t.micro_batch];
      } else {
        if (seen_f[t.micro_batch] == 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("stage ", s, ": B", t.micro_batch, " before F", t.micro_batch));
        }
        ++seen_b[t.micro_batch];
      }
    }
    for (int i = 0; i < m; ++i) {
      if (seen_f[i] != 1 || seen_b[i] != 1) {
        return absl::InvalidArgumentError(absl::StrCat("stage ", s, " runs F", i, " ", seen_f[i], " and B", i, " ",
                                                       seen_b[i], " times"));
      }
    }
  }
  constexpr double kNotYet = std::numeric_limits<double>::infinity();
  // When each stage finished each micro-batch's F and B (kNotYet until then).
  std::vector<std::vector<double>> done_f(p, std::vector<double>(m, kNotYet)), done_b = done_f;
  std::vector<size_t> next(p, 0);
  std::vector<double> clock(p, 0), busy(p, 0);
  std::vector<int> alive(p, 0);
  PipeSimulation sim;
  // Each round runs every task whose input has been produced, in time order
  // per stage; a round that runs none with tasks left is a deadlock.
  for (;;) {
    bool progressed = false, left = false;
    for (int s = 0; s < p; ++s) {
      while (next[s] < schedules[s].size()) {
        const PipeTask& t = schedules[s][next[s]];
        const bool forward = t.kind == PipeTask::Kind::kForward;
        double ready;
        if (forward) {
          ready = s == 0 ? 0 : done_f[s - 1][t.micro_batch];
        } else {
          ready = s == p - 1 ? done_f[s][t.micro_batch] : done_b[s + 1][t.micro_batch];
        }
        if (ready == kNotYet) break;
        const double cost = forward ? forward_cost[s] : 2 * forward_cost[s];
        clock[s] = std::max(clock[s], ready) + cost;
        busy[s] += cost;
        (forward ? done_f : done_b)[s][t.micro_batch] = clock[s];
        alive[s] += forward ? 1 : -1;
        sim.max_in_flight = std::max(sim.max_in_flight, alive[s]);
        ++next[s];
        progressed = true;
      }
      left = left || next[s] < schedules[s].size();
    }
    if (!left) break;
    if (!progressed) {
      sim.deadlock = true;
      std::vector<std::string> stuck;
      for (int s = 0; s < p; ++s) {
        if (next[s] == schedules[s].size()) continue;
        const PipeTask& t = schedules[s][next[s]];
        const bool forward = t.kind == PipeTask::Kind::kForward;
        stuck.push_back(absl::StrCat("stage ", s, " waits at ", forward ? "F" : "B", t.micro_batch, " for stage ",
                                     forward ? s - 1 : (s == p - 1 ? s : s + 1)));
      }
      sim.stuck = absl::StrJoin(stuck, "; ");
      return sim;
    }
  }
  sim.makespan = *std::max_element(clock.begin(), clock.end());
  const double most = *std::max_element(busy.begin(), busy.end());
  sim.bubble_fraction = sim.makespan > 0 ? 1 - most / sim.makespan : 0;
  return sim;
}

}  // namespace colod::train
