// A job's event history, kept serialized. A long run's history holds an
// event a step: parsed, each took about 400 bytes of the coordinator's
// memory (the message, its step and timestamps, each allocated on its
// own); serialized, about 100. A record is then the events' bytes as they
// are, with no message built again.
#ifndef COLOD_SERVER_EVENT_LOG_H_
#define COLOD_SERVER_EVENT_LOG_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "colod/v1/job.pb.h"

namespace colod {

// Not thread-safe: the JobManager holds it under its lock.
class EventLog {
 public:
  size_t size() const { return index_.size(); }
  bool empty() const { return index_.empty(); }
  void Append(const v1::JobEvent& event);
  // Appends an event already serialized (read back from a record: the
  // caller checked that it parses).
  void AppendSerialized(absl::string_view bytes);
  // The event at `i` (< size()), parsed.
  v1::JobEvent Get(size_t i) const;
  // Its bytes, valid until the next Append.
  absl::string_view Bytes(size_t i) const;
  // Appends the events [from, size()) to `out` as the repeated message
  // field `field` of a serialized message: what the message's
  // serialization would hold for them, so `out` parses as it with them.
  void AppendAsField(int field, size_t from, std::string* out) const;
  // Memory held, in bytes (what it allocated, not counting the allocator's
  // own overhead).
  size_t bytes_held() const;

 private:
  // Events are packed into chunks of up to kChunkBytes (one larger event
  // has a chunk of its own), so a long history grows by chunks, never by
  // copying what it holds.
  static constexpr size_t kChunkBytes = size_t{1} << 20;
  // Room for the next event's `n` bytes, indexed.
  char* Reserve(size_t n);
  struct Where {
    uint32_t chunk;
    uint32_t begin;
  };
  std::vector<std::string> chunks_;
  std::vector<Where> index_;
};

}  // namespace colod

#endif  // COLOD_SERVER_EVENT_LOG_H_
