// The flight recorder on its own, and fed by an InstrumentedCommunicator over
// real Gloo ranks (threads on loopback) where one rank stops taking part.
#include "worker/comm/flight_recorder.h"

#include <limits>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "common/rendezvous_store.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "worker/comm/gloo/gloo_communicator.h"
#include "worker/comm/instrumented_communicator.h"
#include "worker/comm/store.h"

namespace colod {
namespace {

TEST(FlightRecorder, SequencesPerGroupPendingAndEnded) {
  FlightRecorder r(/*capacity=*/3);
  EXPECT_EQ(r.Enqueue("tp/0_1", "all_reduce", 64), 1);
  EXPECT_EQ(r.Enqueue("dp/0_2", "all_reduce", 128), 1);
  EXPECT_EQ(r.Enqueue("tp/0_1", "all_gather", 32), 2);
  r.End("tp/0_1", 1, true);
  r.End("tp/0_1", 1, false);  // once only
  r.End("tp/0_1", 9, true);   // unknown: nothing
  const absl::Time later = absl::Now() + absl::Seconds(5);
  std::vector<v1::CollectiveProgress> p = r.Progress(later);
  ASSERT_EQ(p.size(), 2u);  // by group name
  EXPECT_EQ(p[0].group(), "dp/0_2");
  EXPECT_EQ(p[0].entered(), 1);
  EXPECT_EQ(p[0].pending_sequence(), 1);
  EXPECT_EQ(p[1].group(), "tp/0_1");
  EXPECT_EQ(p[1].entered(), 2);
  EXPECT_EQ(p[1].pending_sequence(), 2);
  EXPECT_EQ(p[1].pending_op(), "all_gather");
  EXPECT_GE(p[1].pending_for().seconds(), 4);
  std::vector<FlightRecorder::Entry> e = r.Entries();
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0].state, FlightRecorder::State::kCompleted);
  EXPECT_GE(e[0].ended, e[0].enqueued);
  EXPECT_EQ(e[2].state, FlightRecorder::State::kPending);
  EXPECT_GE(e[2].started, e[0].ended);  // its turn came when #1 ended
  // The ring keeps the newest `capacity`; pending ones stay in the progress.
  r.Enqueue("tp/0_1", "barrier", 0);
  e = r.Entries();
  ASSERT_EQ(e.size(), 3u);
  EXPECT_EQ(e[0].group, "dp/0_2");
  EXPECT_EQ(e[2].op, "barrier");
  r.End("dp/0_2", 1, false);
  const nlohmann::json dump = nlohmann::json::parse(r.ToJson());
  ASSERT_EQ(dump.size(), 3u);
  EXPECT_EQ(dump[0]["state"], "failed");
  EXPECT_EQ(dump[0]["bytes"], 128);
  EXPECT_EQ(dump[2]["state"], "pending");
  EXPECT_FALSE(dump[2].contains("ended"));
}

// Two ranks all-reduce once; then rank 1 stops taking part. Rank 0's record
// shows #2 pending and growing older while rank 1 entered only #1; the abort
// ends #2 as failed.
TEST(FlightRecorder, RecordsWhatAGlooRankIsStuckIn) {
  auto shared = std::make_shared<RendezvousStore>();
  std::vector<std::shared_ptr<FlightRecorder>> rec = {std::make_shared<FlightRecorder>(),
                                                      std::make_shared<FlightRecorder>()};
  std::vector<std::unique_ptr<Communicator>> comms(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      InMemoryStore store(shared, "test");
      GlooCommunicator::Options o;
      o.timeout = absl::Seconds(60);
      auto c = GlooCommunicator::Create(store, r, 2, o);
      ASSERT_TRUE(c.ok()) << c.status();
      comms[r] = std::make_unique<InstrumentedCommunicator>(*std::move(c), nullptr, rec[r], "tp/0_1");
      std::vector<float> x(8, 1.0f);
      ASSERT_TRUE(comms[r]->AllReduce(x.data(), 8, DType::kF32, ReduceOp::kSum)->Wait(absl::Seconds(30)).ok());
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_TRUE(comms[0] && comms[1]);
  // A count the backend refuses (negative, or past int64 as bytes: count x
  // ranks x 4) is neither counted nor recorded, nor multiplied past int64.
  auto* observed = static_cast<InstrumentedCommunicator*>(comms[0].get());
  const int64_t huge = std::numeric_limits<int64_t>::max() / 2;
  EXPECT_EQ(comms[0]->ReduceScatter(nullptr, nullptr, huge, DType::kF32, ReduceOp::kSum)->Wait(absl::Seconds(5)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(comms[0]->AllReduce(nullptr, -4, DType::kF32, ReduceOp::kSum)->Wait(absl::Seconds(5)).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(observed->Stats("reduce_scatter").calls, 0);
  EXPECT_EQ(observed->Stats("all_reduce").calls, 1);
  EXPECT_EQ(observed->Stats("all_reduce").bytes, 32);
  EXPECT_EQ(rec[0]->Entries().size(), 1u);
  std::vector<float> x(8, 1.0f);
  std::shared_ptr<Work> stuck = comms[0]->AllReduce(x.data(), 8, DType::kF32, ReduceOp::kSum);
  absl::SleepFor(absl::Milliseconds(300));
  EXPECT_FALSE(stuck->IsCompleted());  // (a Wait that ran out would abort the communicator)
  const std::vector<v1::CollectiveProgress> p0 = rec[0]->Progress(absl::Now());
  const std::vector<v1::CollectiveProgress> p1 = rec[1]->Progress(absl::Now());
  ASSERT_EQ(p0.size(), 1u);
  ASSERT_EQ(p1.size(), 1u);
  EXPECT_EQ(p0[0].entered(), 2);
  EXPECT_EQ(p0[0].pending_sequence(), 2);
  EXPECT_EQ(p0[0].pending_op(), "all_reduce");
  EXPECT_GE(p0[0].pending_for().nanos() + p0[0].pending_for().seconds() * 1000000000, 250000000);
  EXPECT_EQ(p1[0].entered(), 1);
  EXPECT_EQ(p1[0].pending_sequence(), 0);
  comms[0]->Abort(absl::CancelledError("test over"));
  // Waited on "the device" (Gloo: the host): a failure is recorded all the same.
  EXPECT_EQ(stuck->WaitOnDevice(absl::Seconds(10)).code(), absl::StatusCode::kAborted);
  const std::vector<FlightRecorder::Entry> e = rec[0]->Entries();
  ASSERT_EQ(e.size(), 2u);
  EXPECT_EQ(e[0].state, FlightRecorder::State::kCompleted);
  EXPECT_EQ(e[1].state, FlightRecorder::State::kFailed);
  EXPECT_EQ(rec[0]->Progress(absl::Now())[0].pending_sequence(), 0);
  // One submitted and never waited for: abandoned with its communicator.
  std::shared_ptr<Work> never = comms[0]->AllReduce(x.data(), 8, DType::kF32, ReduceOp::kSum);
  comms[1]->Abort(absl::CancelledError("test over"));
  comms.clear();
  never.reset();
  ASSERT_EQ(rec[0]->Entries().size(), 3u);
  EXPECT_EQ(rec[0]->Entries()[2].state, FlightRecorder::State::kAbandoned);
}

}  // namespace
}  // namespace colod
