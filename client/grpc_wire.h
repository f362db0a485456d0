// Calling gRPC methods without generated code, as any generic gRPC client
// (grpcurl, a Kubernetes probe) does: Debian ships neither the health nor the
// reflection .proto, and the C++ classes of their messages live inside
// libgrpc++ and libgrpc++_reflection, so the few fields needed are encoded and
// decoded by hand. Used by the health check (client/health.h) and the tests'
// reflection probe.
#ifndef COLOD_CLIENT_GRPC_WIRE_H_
#define COLOD_CLIENT_GRPC_WIRE_H_

#include <string>

#include "grpcpp/completion_queue.h"
#include "grpcpp/support/byte_buffer.h"

namespace colod::grpc_wire {

// A length-delimited field `number` holding `payload`, in protobuf wire format.
std::string LengthDelimitedField(int number, const std::string& payload);

grpc::ByteBuffer ToByteBuffer(const std::string& bytes);
std::string FromByteBuffer(const grpc::ByteBuffer& buffer);

// Waits for the next completion on `cq`; false if the queue is shut down, the
// operation failed, or the completion is not `expect`'s.
bool NextIs(grpc::CompletionQueue& cq, void* expect);

// Shuts `cq` down and takes what is left in it: a CompletionQueue must be
// empty when it is destroyed.
void ShutdownAndDrain(grpc::CompletionQueue& cq);

}  // namespace colod::grpc_wire

#endif  // COLOD_CLIENT_GRPC_WIRE_H_
