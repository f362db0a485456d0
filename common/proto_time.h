// Conversions between absl time types and google.protobuf Timestamp/Duration,
// the one place the API's time fields are translated.
#ifndef COLOD_COMMON_PROTO_TIME_H_
#define COLOD_COMMON_PROTO_TIME_H_

#include "absl/time/time.h"
#include "google/protobuf/duration.pb.h"
#include "google/protobuf/timestamp.pb.h"
#include "google/protobuf/util/time_util.h"

namespace colod {

inline google::protobuf::Timestamp ToProtoTimestamp(absl::Time t) {
  return google::protobuf::util::TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(t));
}

inline absl::Time FromProtoTimestamp(const google::protobuf::Timestamp& ts) {
  return absl::FromUnixSeconds(ts.seconds()) + absl::Nanoseconds(ts.nanos());
}

inline google::protobuf::Duration ToProtoDuration(absl::Duration d) {
  return google::protobuf::util::TimeUtil::NanosecondsToDuration(absl::ToInt64Nanoseconds(d));
}

inline absl::Duration FromProtoDuration(const google::protobuf::Duration& d) {
  return absl::Seconds(d.seconds()) + absl::Nanoseconds(d.nanos());
}

}  // namespace colod

#endif  // COLOD_COMMON_PROTO_TIME_H_
