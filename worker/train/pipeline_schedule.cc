#include "worker/train/pipeline_schedule.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace colod::train {

std::string ScheduleToString(const std::vector<PipeTask>& tasks) {
  const bool chunks = std::any_of(tasks.begin(), tasks.end(), [](const PipeTask& t) { return t.chunk != 0; });
  std::vector<std::string> parts;
  for (const PipeTask& t : tasks) {
    parts.push_back(absl::StrCat(t.kind == PipeTask::Kind::kForward ? "F" : "B", t.micro_batch,
                                 chunks ? absl::StrCat("c", t.chunk) : ""));
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

absl::StatusOr<std::vector<PipeTask>> InterleavedSchedule(int stages, int stage, int micro_batches, int chunks) {
  if (stages < 1 || stage < 0 || stage >= stages || micro_batches < 1 || chunks < 1) {
    return absl::InvalidArgumentError(absl::StrCat("no interleaved schedule for stage ", stage, " of ", stages,
                                                   " with ", chunks, " chunks and ", micro_batches,
                                                   " micro-batches"));
  }
  if (chunks == 1) return OneFOneBSchedule(stages, stage, micro_batches);
  if (micro_batches % stages != 0) {
    return absl::InvalidArgumentError(absl::StrCat("the interleaved schedule runs the micro-batches in groups of the ",
                                                   stages, " stages: ", micro_batches, " micro-batches are not a "
                                                   "multiple of ", stages));
  }
  // The k-th forward (backward) of the rank: its group of `stages`
  // micro-batches goes through the chunks in order (backward: reversed).
  const int group = stages * chunks;
  auto task = [&](int k, PipeTask::Kind kind) {
    const int in_group = k % group;
    int chunk = in_group / stages;
    if (kind == PipeTask::Kind::kBackward) chunk = chunks - 1 - chunk;
    return PipeTask{kind, (k / group) * stages + in_group % stages, chunk};
  };
  const int total = micro_batches * chunks;
  const int warmup = micro_batches == stages ? total : std::min(2 * (stages - stage - 1) + (chunks - 1) * stages, total);
  std::vector<PipeTask> out;
  int f = 0, b = 0;
  for (; f < warmup; ++f) out.push_back(task(f, PipeTask::Kind::kForward));
  for (; f < total; ++f, ++b) {
    out.push_back(task(f, PipeTask::Kind::kForward));
    out.push_back(task(b, PipeTask::Kind::kBackward));
  }
  for (; b < total; ++b) out.push_back(task(b, PipeTask::Kind::kBackward));
  return out;
}

absl::StatusOr<PipeSimulation> SimulatePipeline(const std::vector<std::vector<PipeTask>>& schedules,
                                                const std::vector<double>& forward_cost) {
  const int p = static_cast<int>(schedules.size());
  if (p == 0 || forward_cost.size() != schedules.size()) {
    return absl::InvalidArgumentError("one schedule and one forward cost per stage");
  }
  // The chunks per rank (V), and the micro-batches (m): every stage runs F
  // and B of each micro-batch 0..m-1 on each chunk 0..V-1 once, F first.
  int v = 1;
  for (const std::vector<PipeTask>& tasks : schedules) {
    for (const PipeTask& t : tasks) {
      if (t.chunk < 0 || t.chunk >= 1 << 16) return absl::InvalidArgumentError(absl::StrCat("chunk ", t.chunk));
      v = std::max(v, t.chunk + 1);
    }
  }
  const int m = static_cast<int>(schedules[0].size() / (2 * v));
  for (int s = 0; s < p; ++s) {
    std::vector<int> seen_f(static_cast<size_t>(m) * v, 0), seen_b = seen_f;
    if (static_cast<int64_t>(schedules[s].size()) != int64_t{2} * m * v) {
      return absl::InvalidArgumentError(
          absl::StrCat("stage ", s, " runs ", schedules[s].size(), " tasks, not ", int64_t{2} * m * v));
    }
    for (const PipeTask& t : schedules[s]) {
      if (t.micro_batch < 0 || t.micro_batch >= m) {
        return absl::InvalidArgumentError(absl::StrCat("stage ", s, ": micro-batch ", t.micro_batch, " of ", m));
      }
      const size_t at = static_cast<size_t>(t.chunk) * m + t.micro_batch;
      if (t.kind == PipeTask::Kind::kForward) {
        ++seen_f[at];
      } else {
        if (seen_f[at] == 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("stage ", s, ": B", t.micro_batch, " before F", t.micro_batch, " on chunk ", t.chunk));
        }
        ++seen_b[at];
      }
    }
    for (size_t at = 0; at < seen_f.size(); ++at) {
      if (seen_f[at] != 1 || seen_b[at] != 1) {
        return absl::InvalidArgumentError(absl::StrCat("stage ", s, " runs F", at % m, " ", seen_f[at], " and B",
                                                       at % m, " ", seen_b[at], " times on chunk ", at / m));
      }
    }
  }
  constexpr double kNotYet = std::numeric_limits<double>::infinity();
  // When each virtual stage (chunk c of rank s: c * p + s) finished each
  // micro-batch's F and B (kNotYet until then).
  const int virtual_stages = p * v;
  std::vector<std::vector<double>> done_f(virtual_stages, std::vector<double>(m, kNotYet)), done_b = done_f;
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
        const int vs = t.chunk * p + s;
        double ready;
        if (forward) {
          ready = vs == 0 ? 0 : done_f[vs - 1][t.micro_batch];
        } else {
          ready = vs == virtual_stages - 1 ? done_f[vs][t.micro_batch] : done_b[vs + 1][t.micro_batch];
        }
        if (ready == kNotYet) break;
        const double cost = forward ? forward_cost[s] : 2 * forward_cost[s];
        clock[s] = std::max(clock[s], ready) + cost;
        busy[s] += cost;
        (forward ? done_f : done_b)[vs][t.micro_batch] = clock[s];
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
        const int vs = t.chunk * p + s;
        const int from = forward ? vs - 1 : (vs == virtual_stages - 1 ? vs : vs + 1);
        stuck.push_back(absl::StrCat("stage ", s, " waits at ", forward ? "F" : "B", t.micro_batch,
                                     v > 1 ? absl::StrCat("c", t.chunk) : "", " for stage ", from % p));
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
