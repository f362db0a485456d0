#include "common/find_binary.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace colod {

absl::StatusOr<std::string> FindBinary(const std::string& name, const std::vector<std::string>& relative_dirs,
                                       std::string self) {
  if (self.empty()) {
    std::error_code ec;
    self = std::filesystem::read_symlink("/proc/self/exe", ec).string();
  }
  const std::filesystem::path dir = std::filesystem::path(self).parent_path();
  std::vector<std::filesystem::path> tried;
  if (!self.empty()) {
    tried.push_back(dir / name);
    for (const std::string& rel : relative_dirs) tried.push_back(dir / rel / name);
  }
  const char* path = std::getenv("PATH");
  for (absl::string_view p : absl::StrSplit(path != nullptr ? path : "", ':', absl::SkipEmpty())) {
    tried.push_back(std::filesystem::path(std::string(p)) / name);
  }
  for (const auto& t : tried) {
    std::error_code ec;
    if (std::filesystem::is_regular_file(t, ec) && ::access(t.c_str(), X_OK) == 0) {
      const std::filesystem::path canonical = std::filesystem::weakly_canonical(t, ec);
      return ec ? t.string() : canonical.string();
    }
  }
  return absl::NotFoundError(absl::StrCat("cannot find ", name, " next to ", self.empty() ? "this program" : self,
                                          relative_dirs.empty() ? "" : ", in ", absl::StrJoin(relative_dirs, ", "),
                                          " or on $PATH"));
}

}  // namespace colod
