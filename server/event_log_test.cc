// EventLog against the messages it was given: each event reads back equal,
// across chunk boundaries and for an event larger than a chunk; the field
// it writes parses as the record that holds the same events; a long
// history costs about its serialized size.
#include "server/event_log.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "google/protobuf/util/message_differencer.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

v1::JobEvent Event(int64_t seq, size_t reason_bytes) {
  v1::JobEvent ev;
  ev.set_job_id("job-000001");
  ev.set_sequence(seq);
  ev.mutable_time()->set_seconds(1700000000 + seq);
  if (seq % 2 == 0) {
    ev.mutable_step()->set_step(seq);
    ev.mutable_step()->set_loss(1.0 / static_cast<double>(seq));
  } else {
    ev.mutable_state_change()->set_state(v1::JOB_STATE_RUNNING);
    ev.mutable_state_change()->set_reason(std::string(reason_bytes, static_cast<char>('a' + seq % 26)));
  }
  return ev;
}

TEST(EventLog, EveryEventReadsBackAsItWasGiven) {
  EventLog log;
  EXPECT_TRUE(log.empty());
  std::vector<v1::JobEvent> given;
  // Small events filling several chunks, one larger than a chunk between
  // them, and an empty one.
  for (int64_t i = 1; i <= 40000; ++i) {
    const size_t reason = i == 20001 ? (size_t{3} << 20) : (i == 7 ? 0 : static_cast<size_t>(i % 300));
    given.push_back(Event(i, reason));
    log.Append(given.back());
  }
  given.push_back(v1::JobEvent());
  log.Append(given.back());
  ASSERT_EQ(log.size(), given.size());
  for (size_t i = 0; i < given.size(); ++i) {
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(log.Get(i), given[i])) << "event " << i;
    EXPECT_EQ(log.Bytes(i), given[i].SerializeAsString()) << "event " << i;
  }
}

TEST(EventLog, ItsFieldParsesAsTheRecordOfTheSameEvents) {
  EventLog log;
  v1::JobRecord want;
  want.mutable_job()->set_job_id("job-000001");
  want.set_record_seq(9);
  for (int64_t i = 1; i <= 500; ++i) log.Append(Event(i, static_cast<size_t>(i)));
  for (size_t from : {size_t{0}, size_t{123}, size_t{500}}) {
    v1::JobRecord head = want;
    std::string bytes = head.SerializeAsString();
    log.AppendAsField(v1::JobRecord::kEventsFieldNumber, from, &bytes);
    v1::JobRecord got;
    ASSERT_TRUE(got.ParseFromString(bytes)) << "from " << from;
    v1::JobRecord expected = want;
    for (size_t i = from; i < log.size(); ++i) *expected.add_events() = log.Get(i);
    EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(got, expected)) << "from " << from;
    EXPECT_EQ(got.events_size(), static_cast<int>(500 - from));
  }
}

// A long run's history: its memory is its serialized size, give or take a
// small part (an index entry an event, the last chunk's slack).
TEST(EventLog, ALongHistoryCostsAboutItsSerializedSize) {
  EventLog log;
  size_t serialized = 0;
  for (int64_t i = 1; i <= 200000; ++i) {
    const v1::JobEvent ev = Event(i, 40);
    serialized += ev.ByteSizeLong();
    log.Append(ev);
  }
  EXPECT_LE(log.bytes_held(), serialized + 16 * log.size() + (size_t{2} << 20))
      << log.bytes_held() << " bytes held for " << serialized << " serialized";
}

}  // namespace
}  // namespace colod
