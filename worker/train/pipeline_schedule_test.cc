// The 1F1B schedule: Megatron-LM's order on each stage, no deadlock for any
// pipeline depth and micro-batch count with uneven stage costs, at most
// stages - s micro-batches alive on stage s, and the bubble of the closed
// form (p - 1) / (m + p - 1) when the stages are even; the simulation finds
// the deadlock of a schedule without warm-up and refuses malformed ones.
// The interleaved schedule (V chunks per rank): Megatron-LM's order, every
// (micro-batch, chunk) once and no deadlock for any depth, chunk count and
// multiple of the depth, and with even stages the bubble of its closed form,
// (p - 1) / (V m) of the compute: 1F1B's with V m micro-batches.
#include "worker/train/pipeline_schedule.h"

#include "gtest/gtest.h"

namespace colod::train {
namespace {

std::vector<std::vector<PipeTask>> OneFOneB(int stages, int micro) {
  std::vector<std::vector<PipeTask>> all;
  for (int s = 0; s < stages; ++s) all.push_back(*OneFOneBSchedule(stages, s, micro));
  return all;
}

TEST(OneFOneB, EachStagesOrderIsMegatrons) {
  EXPECT_EQ(ScheduleToString(*OneFOneBSchedule(4, 0, 6)), "F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5");
  EXPECT_EQ(ScheduleToString(*OneFOneBSchedule(4, 2, 6)), "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 B5");
  EXPECT_EQ(ScheduleToString(*OneFOneBSchedule(4, 3, 6)), "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5");
  // Fewer micro-batches than stages: all forwards, then all backwards.
  EXPECT_EQ(ScheduleToString(*OneFOneBSchedule(4, 0, 2)), "F0 F1 B0 B1");
  EXPECT_EQ(ScheduleToString(*OneFOneBSchedule(1, 0, 3)), "F0 B0 F1 B1 F2 B2");
  EXPECT_FALSE(OneFOneBSchedule(4, 4, 2).ok());
  EXPECT_FALSE(OneFOneBSchedule(0, 0, 2).ok());
  EXPECT_FALSE(OneFOneBSchedule(2, 0, 0).ok());
}

TEST(OneFOneB, NoDeadlockAtAnyDepthWithUnevenStages) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 12; ++m) {
      // Stages of 1 to 3 layers, unevenly (e.g. 6 layers over 4 stages: 2 1 2 1).
      std::vector<double> cost;
      for (int s = 0; s < p; ++s) cost.push_back(1 + (s * 7) % 3);
      auto sim = SimulatePipeline(OneFOneB(p, m), cost);
      ASSERT_TRUE(sim.ok()) << sim.status();
      EXPECT_FALSE(sim->deadlock) << "p=" << p << " m=" << m << ": " << sim->stuck;
      EXPECT_LE(sim->max_in_flight, std::min(p, m)) << "p=" << p << " m=" << m;
      double total = 0;
      for (double c : cost) total += 3 * c * m;
      EXPECT_GE(sim->makespan * p, total) << "no stage computes more than the makespan";
    }
  }
}

TEST(OneFOneB, TheBubbleOfEvenStagesIsTheClosedForm) {
  for (int p = 1; p <= 8; ++p) {
    for (int m = 1; m <= 16; ++m) {
      auto sim = SimulatePipeline(OneFOneB(p, m), std::vector<double>(p, 1.0));
      ASSERT_TRUE(sim.ok()) << sim.status();
      ASSERT_FALSE(sim->deadlock);
      EXPECT_NEAR(sim->bubble_fraction, static_cast<double>(p - 1) / (m + p - 1), 1e-12) << "p=" << p << " m=" << m;
      EXPECT_NEAR(sim->makespan, 3.0 * (m + p - 1), 1e-9) << "p=" << p << " m=" << m;
    }
  }
}

std::vector<std::vector<PipeTask>> Interleaved(int stages, int micro, int chunks) {
  std::vector<std::vector<PipeTask>> all;
  for (int s = 0; s < stages; ++s) all.push_back(*InterleavedSchedule(stages, s, micro, chunks));
  return all;
}

TEST(Interleaved, EachRanksOrderIsMegatrons) {
  // p = 2, V = 2, m = 4. Rank 0 warms up with 2 (p - 0 - 1) + (V - 1) p = 4
  // forwards: micro-batches 0 and 1 through chunk 0, then through chunk 1.
  // The backwards run the same groups from chunk 1 down.
  EXPECT_EQ(ScheduleToString(*InterleavedSchedule(2, 0, 4, 2)),
            "F0c0 F1c0 F0c1 F1c1 F2c0 B0c1 F3c0 B1c1 F2c1 B0c0 F3c1 B1c0 B2c1 B3c1 B2c0 B3c0");
  EXPECT_EQ(ScheduleToString(*InterleavedSchedule(2, 1, 4, 2)),
            "F0c0 F1c0 F0c1 B0c1 F1c1 B1c1 F2c0 B0c0 F3c0 B1c0 F2c1 B2c1 F3c1 B3c1 B2c0 B3c0");
  // As many micro-batches as stages: every forward first.
  EXPECT_EQ(ScheduleToString(*InterleavedSchedule(2, 1, 2, 2)), "F0c0 F1c0 F0c1 F1c1 B0c1 B1c1 B0c0 B1c0");
  EXPECT_FALSE(InterleavedSchedule(4, 0, 6, 2).ok());  // 6 micro-batches are not groups of 4
  EXPECT_FALSE(InterleavedSchedule(4, 4, 8, 2).ok());
  EXPECT_FALSE(InterleavedSchedule(4, 0, 8, 0).ok());
  EXPECT_FALSE(InterleavedSchedule(4, 0, 0, 2).ok());
}

TEST(Interleaved, NoDeadlockAtAnyDepthChunkCountAndMultipleWithUnevenStages) {
  for (int p = 1; p <= 8; ++p) {
    for (int v = 1; v <= 4; ++v) {
      for (int m = p; m <= 4 * p; m += p) {
        std::vector<double> cost;
        for (int s = 0; s < p; ++s) cost.push_back(1 + (s * 7) % 3);
        auto sim = SimulatePipeline(Interleaved(p, m, v), cost);
        ASSERT_TRUE(sim.ok()) << sim.status();
        EXPECT_FALSE(sim->deadlock) << "p=" << p << " V=" << v << " m=" << m << ": " << sim->stuck;
        // Rank 0's warm-up and its first steady forward at most.
        const int warmup = m == p ? v * m : std::min(2 * (p - 1) + (v - 1) * p + 1, v * m);
        EXPECT_LE(sim->max_in_flight, warmup) << "p=" << p << " V=" << v << " m=" << m;
      }
    }
  }
}

TEST(Interleaved, TheBubbleOfEvenStagesIsAVthOfOneFOneBs) {
  for (int p = 2; p <= 8; ++p) {
    for (int v = 1; v <= 4; ++v) {
      for (int m = p; m <= 4 * p; m += p) {
        // A chunk is a V-th of a stage: its forward takes 1 / V.
        auto sim = SimulatePipeline(Interleaved(p, m, v), std::vector<double>(p, 1.0 / v));
        ASSERT_TRUE(sim.ok()) << sim.status();
        ASSERT_FALSE(sim->deadlock) << sim->stuck;
        const double compute = 3.0 * m, idle = sim->makespan - compute;
        EXPECT_NEAR(idle / compute, static_cast<double>(p - 1) / (v * m), 1e-9) << "p=" << p << " V=" << v << " m=" << m;
        EXPECT_NEAR(sim->bubble_fraction, static_cast<double>(p - 1) / (v * m + p - 1), 1e-9)
            << "p=" << p << " V=" << v << " m=" << m;
      }
    }
  }
}

TEST(SimulatePipeline, FindsTheDeadlockOfASchedulewithoutWarmUp) {
  // Stage 0 runs its first backward before stage 1 has the forward it needs
  // to get there: each waits for the other.
  std::vector<std::vector<PipeTask>> bad = {
      {{PipeTask::Kind::kForward, 0}, {PipeTask::Kind::kBackward, 0}, {PipeTask::Kind::kForward, 1},
       {PipeTask::Kind::kBackward, 1}},
      {{PipeTask::Kind::kForward, 0}, {PipeTask::Kind::kForward, 1}, {PipeTask::Kind::kBackward, 0},
       {PipeTask::Kind::kBackward, 1}},
  };
  auto sim = SimulatePipeline(bad, {1, 1});
  ASSERT_TRUE(sim.ok()) << sim.status();
  EXPECT_TRUE(sim->deadlock);
  EXPECT_EQ(sim->stuck, "stage 0 waits at B0 for stage 1; stage 1 waits at F1 for stage 0");
}

TEST(SimulatePipeline, RefusesMalformedSchedules) {
  using K = PipeTask::Kind;
  EXPECT_FALSE(SimulatePipeline({}, {}).ok());
  EXPECT_FALSE(SimulatePipeline({{{K::kForward, 0}, {K::kBackward, 0}}}, {1, 1}).ok());  // costs
  EXPECT_FALSE(SimulatePipeline({{{K::kBackward, 0}, {K::kForward, 0}}}, {1}).ok());    // B before F
  EXPECT_FALSE(SimulatePipeline({{{K::kForward, 0}, {K::kForward, 0}}}, {1}).ok());     // F twice
  EXPECT_FALSE(SimulatePipeline({{{K::kForward, 0}, {K::kBackward, 3}}}, {1}).ok());    // no micro-batch 3
  EXPECT_FALSE(SimulatePipeline({{{K::kForward, 0}, {K::kBackward, 0}}, {{K::kForward, 0}}}, {1, 1}).ok());
  // Interleaved: chunk 1's backward without its forward; a negative chunk.
  EXPECT_FALSE(SimulatePipeline({{{K::kForward, 0, 0}, {K::kBackward, 0, 1}, {K::kForward, 0, 1}, {K::kBackward, 0, 0}}},
                                {1})
                   .ok());
  EXPECT_FALSE(SimulatePipeline({{{K::kForward, 0, -1}, {K::kBackward, 0, -1}}}, {1}).ok());
}

}  // namespace
}  // namespace colod::train
