#include "client/format.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/proto_time.h"
#include "google/protobuf/util/json_util.h"

namespace colod {
namespace {

std::string EnumSuffix(const std::string& name, const std::string& prefix) {
  std::string out = name.rfind(prefix, 0) == 0 ? name.substr(prefix.size()) : name;
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

std::string Age(const google::protobuf::Timestamp& ts, absl::Time now) {
  if (ts.seconds() == 0 && ts.nanos() == 0) return "-";
  absl::Duration d = now - FromProtoTimestamp(ts);
  if (d < absl::ZeroDuration()) d = absl::ZeroDuration();
  return absl::StrFormat("%.1fs ago", absl::ToDoubleSeconds(d));
}

}  // namespace

std::string RenderTable(const std::vector<std::string>& header,
                        const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> width(header.size());
  for (size_t c = 0; c < header.size(); ++c) width[c] = header[c].size();
  for (const auto& r : rows) {
    for (size_t c = 0; c < r.size() && c < width.size(); ++c) width[c] = std::max(width[c], r[c].size());
  }
  std::string out;
  auto line = [&](const std::vector<std::string>& cells) {
    std::string l;
    for (size_t c = 0; c < width.size(); ++c) {
      const std::string cell = c < cells.size() ? cells[c] : "";
      absl::StrAppend(&l, cell);
      if (c + 1 < width.size()) l.append(width[c] - cell.size() + 2, ' ');
    }
    while (!l.empty() && l.back() == ' ') l.pop_back();
    absl::StrAppend(&out, l, "\n");
  };
  line(header);
  for (const auto& r : rows) line(r);
  return out;
}

std::string RenderWorkersTable(const std::vector<v1::Worker>& workers, absl::Time now) {
  std::vector<std::vector<std::string>> rows;
  for (const v1::Worker& w : workers) {
    const v1::WorkerInfo& i = w.info();
    std::string device = EnumSuffix(v1::DeviceKind_Name(i.device_kind()), "DEVICE_KIND_");
    if (i.device_kind() == v1::DEVICE_KIND_CUDA) {
      absl::StrAppend(&device, ":", i.device_ordinal(), " (", i.device_name(), ")");
    }
    rows.push_back({i.worker_id(), i.address(), i.host(), device,
                    EnumSuffix(v1::WorkerState_Name(w.state()), "WORKER_STATE_"),
                    Age(w.last_heartbeat_time(), now)});
  }
  return RenderTable({"ID", "ADDRESS", "HOST", "DEVICE", "STATE", "LAST HEARTBEAT"}, rows);
}

absl::StatusOr<std::string> RenderJson(const google::protobuf::Message& message, bool pretty) {
  google::protobuf::util::JsonPrintOptions opts;
  opts.add_whitespace = pretty;
  opts.always_print_primitive_fields = true;
  opts.always_print_enums_as_ints = false;
  std::string out;
  auto status = google::protobuf::util::MessageToJsonString(message, &out, opts);
  if (!status.ok()) return absl::InternalError(std::string(status.message()));
  if (out.empty() || out.back() != '\n') out.push_back('\n');
  return out;
}

}  // namespace colod
