#include "client/grpc_wire.h"

#include <vector>

#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"

namespace colod::grpc_wire {

std::string LengthDelimitedField(int number, const std::string& payload) {
  std::string out;
  google::protobuf::io::StringOutputStream raw(&out);
  {
    // The coded stream flushes into `out` when it goes out of scope.
    google::protobuf::io::CodedOutputStream coded(&raw);
    coded.WriteTag(static_cast<uint32_t>(number << 3 | 2));
    coded.WriteVarint32(static_cast<uint32_t>(payload.size()));
    coded.WriteString(payload);
  }
  return out;
}

grpc::ByteBuffer ToByteBuffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

std::string FromByteBuffer(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  (void)buffer.Dump(&slices);
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

bool NextIs(grpc::CompletionQueue& cq, void* expect) {
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok)) return false;
  return ok && tag == expect;
}

void ShutdownAndDrain(grpc::CompletionQueue& cq) {
  cq.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok)) {
  }
}

}  // namespace colod::grpc_wire
