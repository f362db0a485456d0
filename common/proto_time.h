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

// Whether `d` is a Duration as google/protobuf/duration.proto defines one:
// seconds within +-10,000 years, nanos within +-999,999,999 and of the
// seconds' sign.
inline bool IsValidProtoDuration(const google::protobuf::Duration& d) {
  constexpr int64_t kMaxSeconds = 315576000000;
  if (d.seconds() < -kMaxSeconds || d.seconds() > kMaxSeconds) return false;
  if (d.nanos() < -999999999 || d.nanos() > 999999999) return false;
  return !((d.seconds() > 0 && d.nanos() < 0) || (d.seconds() < 0 && d.nanos() > 0));
}

}  // namespace colod

#endif  // COLOD_COMMON_PROTO_TIME_H_
