#include "common/ready_file.h"

#include "absl/strings/str_cat.h"
#include "common/atomic_file.h"

namespace colod {

absl::Status WriteReadyFile(const std::string& path,
                            const std::vector<std::pair<std::string, std::string>>& entries) {
  std::string body;
  for (const auto& [k, v] : entries) absl::StrAppend(&body, k, "=", v, "\n");
  const absl::Status s = WriteFileAtomically(path, body);
  if (!s.ok()) return absl::FailedPreconditionError(absl::StrCat("--ready-file: ", s.message()));
  return absl::OkStatus();
}

}  // namespace colod
