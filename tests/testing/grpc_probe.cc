#include "tests/testing/grpc_probe.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "client/grpc_wire.h"
#include "common/grpc_status.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"

namespace colod::testing {

using grpc_wire::FromByteBuffer;
using grpc_wire::LengthDelimitedField;
using grpc_wire::NextIs;
using grpc_wire::ToByteBuffer;

absl::StatusOr<std::vector<std::string>> ListServicesByReflection(const std::string& address,
                                                                  absl::Duration timeout) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareCall(
      &ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", &cq);
  int start = 0, write = 0, done = 0, read = 0, finish = 0;
  call->StartCall(&start);
  if (!NextIs(cq, &start)) return absl::UnavailableError("reflection: cannot start the call");
  // ServerReflectionRequest{list_services: ""} is field 7.
  call->Write(ToByteBuffer(LengthDelimitedField(7, "")), &write);
  if (!NextIs(cq, &write)) return absl::UnavailableError("reflection: write failed");
  call->WritesDone(&done);
  if (!NextIs(cq, &done)) return absl::UnavailableError("reflection: writes-done failed");
  grpc::ByteBuffer response;
  call->Read(&response, &read);
  const bool got = NextIs(cq, &read);
  grpc::Status status;
  call->Finish(&status, &finish);
  NextIs(cq, &finish);
  grpc_wire::ShutdownAndDrain(cq);
  if (!status.ok()) return FromGrpcStatus(status);
  if (!got) return absl::DataLossError("reflection: no response");

  // ServerReflectionResponse.list_services_response (6) -> ListServiceResponse.service (1)
  // -> ServiceResponse.name (1).
  google::protobuf::UnknownFieldSet top;
  if (!top.ParseFromString(FromByteBuffer(response))) return absl::DataLossError("bad reflection response");
  std::vector<std::string> names;
  for (int i = 0; i < top.field_count(); ++i) {
    const auto& f = top.field(i);
    if (f.number() == 7) return absl::InternalError("reflection answered with an error_response");
    if (f.number() != 6 || f.type() != google::protobuf::UnknownField::TYPE_LENGTH_DELIMITED) continue;
    google::protobuf::UnknownFieldSet list;
    if (!list.ParseFromString(f.length_delimited())) return absl::DataLossError("bad ListServiceResponse");
    for (int j = 0; j < list.field_count(); ++j) {
      if (list.field(j).number() != 1) continue;
      google::protobuf::UnknownFieldSet svc;
      if (!svc.ParseFromString(list.field(j).length_delimited())) return absl::DataLossError("bad ServiceResponse");
      for (int k = 0; k < svc.field_count(); ++k) {
        if (svc.field(k).number() == 1) names.push_back(svc.field(k).length_delimited());
      }
    }
  }
  return names;
}

}  // namespace colod::testing
