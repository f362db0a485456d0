#include "client/health.h"

#include "absl/strings/str_cat.h"
#include "client/grpc_wire.h"
#include "common/grpc_status.h"
#include "common/net.h"
#include "common/status_macros.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"

namespace colod {

absl::string_view ServingStatusName(ServingStatus status) {
  switch (status) {
    case ServingStatus::kServing:
      return "SERVING";
    case ServingStatus::kNotServing:
      return "NOT_SERVING";
    case ServingStatus::kServiceUnknown:
      return "SERVICE_UNKNOWN";
    case ServingStatus::kUnknown:
      break;
  }
  return "UNKNOWN";
}

absl::StatusOr<ServingStatus> CheckHealth(const std::string& address, const std::string& service,
                                          const HealthCheckOptions& options) {
  RETURN_IF_ERROR(ParseHostPort(address, "address", /*allow_zero_port=*/false).status());
  if (options.timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout: must be > 0");
  auto channel = grpc::CreateChannel(
      DialTarget(address), options.credentials != nullptr ? options.credentials : grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options.timeout));
  grpc::CompletionQueue cq;
  // HealthCheckRequest{service} is field 1; proto3 leaves an empty one out.
  const grpc::ByteBuffer request =
      grpc_wire::ToByteBuffer(service.empty() ? "" : grpc_wire::LengthDelimitedField(1, service));
  auto call = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  int finish = 0;
  call->Finish(&response, &status, &finish);
  const bool finished = grpc_wire::NextIs(cq, &finish);
  grpc_wire::ShutdownAndDrain(cq);
  if (!finished) return absl::InternalError("health check: the completion queue failed");
  if (!status.ok()) {
    absl::Status st = FromGrpcStatus(status);
    // "connection refused" or a deadline alone would not say where.
    if (st.code() == absl::StatusCode::kUnavailable || st.code() == absl::StatusCode::kDeadlineExceeded) {
      return MarkUnreachable(absl::Status(st.code(), absl::StrCat("health check of ", address, ": ", st.message())));
    }
    return st;
  }
  // HealthCheckResponse{status} is field 1, a varint; absent means UNKNOWN.
  google::protobuf::UnknownFieldSet fields;
  if (!fields.ParseFromString(grpc_wire::FromByteBuffer(response))) {
    return absl::DataLossError("health check: bad HealthCheckResponse");
  }
  int value = 0;
  for (int i = 0; i < fields.field_count(); ++i) {
    if (fields.field(i).number() == 1 && fields.field(i).type() == google::protobuf::UnknownField::TYPE_VARINT) {
      value = static_cast<int>(fields.field(i).varint());
    }
  }
  return static_cast<ServingStatus>(value);
}

}  // namespace colod
