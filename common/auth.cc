#include "common/auth.h"

#include <fstream>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace colod {

absl::StatusOr<std::string> ReadAuthToken(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("--auth-token-file: cannot read '", path, "'"));
  std::stringstream s;
  s << in.rdbuf();
  std::string token(absl::StripAsciiWhitespace(s.str()));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat("--auth-token-file: '", path, "' is empty"));
  return token;
}

absl::Status TokenAuth::Check(const grpc::ServerContext& ctx) const {
  if (token_.empty()) return absl::OkStatus();
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return absl::UnauthenticatedError("missing bearer token (authorization metadata)");
  const std::string got(it->second.data(), it->second.size());
  const std::string want = "Bearer " + token_;
  // Constant time in the token's length: no early exit on the first mismatch.
  unsigned char diff = got.size() == want.size() ? 0 : 1;
  for (size_t i = 0; i < want.size(); ++i) diff |= static_cast<unsigned char>(want[i] ^ (i < got.size() ? got[i] : 0));
  if (diff != 0) return absl::UnauthenticatedError("invalid bearer token");
  return absl::OkStatus();
}

void AddAuthToken(grpc::ClientContext& ctx, const std::string& token) {
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
}

}  // namespace colod
