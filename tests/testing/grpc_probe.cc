#include "tests/testing/grpc_probe.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/grpc_status.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/unknown_field_set.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/support/byte_buffer.h"

namespace colod::testing {
namespace {

// A length-delimited field `number` holding `payload`, in protobuf wire format.
std::string LengthDelimited(int number, const std::string& payload) {
  std::string out;
  google::protobuf::io::StringOutputStream raw(&out);
  {
    google::protobuf::io::CodedOutputStream coded(&raw);
    coded.WriteTag(static_cast<uint32_t>(number << 3 | 2));
    coded.WriteVarint32(static_cast<uint32_t>(payload.size()));
    coded.WriteString(payload);
  }
  return out;
}

grpc::ByteBuffer ToBuffer(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

std::string FromBuffer(const grpc::ByteBuffer& b) {
  std::vector<grpc::Slice> slices;
  (void)b.Dump(&slices);
  std::string out;
  for (const auto& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// Waits for the next completion with tag `expect`; false if the op failed.
bool Next(grpc::CompletionQueue& cq, void* expect) {
  void* tag = nullptr;
  bool ok = false;
  if (!cq.Next(&tag, &ok)) return false;
  return ok && tag == expect;
}

}  // namespace

absl::StatusOr<ServingStatus> HealthCheck(const std::string& address, const std::string& service,
                                          absl::Duration timeout) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  grpc::CompletionQueue cq;
  grpc::ByteBuffer request = ToBuffer(service.empty() ? "" : LengthDelimited(1, service));
  auto call = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check", request, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  int tag = 0;
  call->Finish(&response, &status, &tag);
  if (!Next(cq, &tag)) return absl::InternalError("health check: completion queue failed");
  cq.Shutdown();
  if (!status.ok()) return FromGrpcStatus(status);
  google::protobuf::UnknownFieldSet fields;
  const std::string bytes = FromBuffer(response);
  if (!fields.ParseFromString(bytes)) return absl::DataLossError("bad HealthCheckResponse");
  int value = 0;
  for (int i = 0; i < fields.field_count(); ++i) {
    if (fields.field(i).number() == 1 &&
        fields.field(i).type() == google::protobuf::UnknownField::TYPE_VARINT) {
      value = static_cast<int>(fields.field(i).varint());
    }
  }
  return static_cast<ServingStatus>(value);
}

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
  if (!Next(cq, &start)) return absl::UnavailableError("reflection: cannot start the call");
  // ServerReflectionRequest{list_services: ""} is field 7.
  call->Write(ToBuffer(LengthDelimited(7, "")), &write);
  if (!Next(cq, &write)) return absl::UnavailableError("reflection: write failed");
  call->WritesDone(&done);
  if (!Next(cq, &done)) return absl::UnavailableError("reflection: writes-done failed");
  grpc::ByteBuffer response;
  call->Read(&response, &read);
  const bool got = Next(cq, &read);
  grpc::Status status;
  call->Finish(&status, &finish);
  Next(cq, &finish);
  cq.Shutdown();
  void* tag;
  bool ok;
  while (cq.Next(&tag, &ok)) {
  }
  if (!status.ok()) return FromGrpcStatus(status);
  if (!got) return absl::DataLossError("reflection: no response");

  // ServerReflectionResponse.list_services_response (6) -> ListServiceResponse.service (1)
  // -> ServiceResponse.name (1).
  google::protobuf::UnknownFieldSet top;
  if (!top.ParseFromString(FromBuffer(response))) return absl::DataLossError("bad reflection response");
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
