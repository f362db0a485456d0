// Rendering of API objects for coloctl: aligned tables and JSON.
#ifndef COLOD_CLIENT_FORMAT_H_
#define COLOD_CLIENT_FORMAT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "colod/v1/worker.pb.h"
#include "google/protobuf/message.h"

namespace colod {

// A table with a header row; columns padded to their widest cell.
std::string RenderTable(const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows);

// ID, ADDRESS, HOST, DEVICE, STATE, LAST HEARTBEAT (age relative to `now`).
std::string RenderWorkersTable(const std::vector<v1::Worker>& workers, absl::Time now);

// Proto3 JSON of `message` (field names in lowerCamelCase, enums by name),
// followed by a newline.
absl::StatusOr<std::string> RenderJson(const google::protobuf::Message& message, bool pretty);

}  // namespace colod

#endif  // COLOD_CLIENT_FORMAT_H_
