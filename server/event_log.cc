#include "server/event_log.h"

#include <algorithm>
#include <cstring>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace colod {

char* EventLog::Reserve(size_t n) {
  if (chunks_.empty() || (!chunks_.back().empty() && chunks_.back().size() + n > kChunkBytes)) {
    chunks_.emplace_back();
  }
  std::string& chunk = chunks_.back();
  const size_t begin = chunk.size();
  if (chunk.capacity() < begin + n) {
    // Doubling up to a chunk's size, then a new chunk: a small job's
    // history holds little, a long one's is never copied whole.
    chunk.reserve(std::max(begin + n, std::min(kChunkBytes, std::max<size_t>(256, 2 * chunk.capacity()))));
  }
  chunk.resize(begin + n);
  index_.push_back({static_cast<uint32_t>(chunks_.size() - 1), static_cast<uint32_t>(begin)});
  return chunk.data() + begin;
}

void EventLog::Append(const v1::JobEvent& event) {
  const size_t n = event.ByteSizeLong();
  event.SerializeWithCachedSizesToArray(reinterpret_cast<uint8_t*>(Reserve(n)));
}

void EventLog::AppendSerialized(absl::string_view bytes) {
  char* at = Reserve(bytes.size());
  if (!bytes.empty()) std::memcpy(at, bytes.data(), bytes.size());
}

absl::string_view EventLog::Bytes(size_t i) const {
  const Where w = index_[i];
  const std::string& chunk = chunks_[w.chunk];
  const size_t end = i + 1 < index_.size() && index_[i + 1].chunk == w.chunk ? index_[i + 1].begin : chunk.size();
  return absl::string_view(chunk).substr(w.begin, end - w.begin);
}

v1::JobEvent EventLog::Get(size_t i) const {
  v1::JobEvent event;
  const absl::string_view bytes = Bytes(i);
  // Bytes it serialized itself: they parse.
  (void)event.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()));
  return event;
}

void EventLog::AppendAsField(int field, size_t from, std::string* out) const {
  google::protobuf::io::StringOutputStream stream(out);
  google::protobuf::io::CodedOutputStream coded(&stream);
  const uint32_t tag = (static_cast<uint32_t>(field) << 3) | 2;  // length-delimited
  for (size_t i = from; i < index_.size(); ++i) {
    const absl::string_view bytes = Bytes(i);
    coded.WriteTag(tag);
    coded.WriteVarint32(static_cast<uint32_t>(bytes.size()));
    coded.WriteRaw(bytes.data(), static_cast<int>(bytes.size()));
  }
}

size_t EventLog::bytes_held() const {
  size_t held = index_.capacity() * sizeof(Where) + chunks_.capacity() * sizeof(std::string);
  for (const std::string& c : chunks_) held += c.capacity();
  return held;
}

}  // namespace colod
