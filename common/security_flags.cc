#include "common/security_flags.h"

#include <cstdlib>

#include "absl/flags/flag.h"
#include "common/status_macros.h"

ABSL_FLAG(std::string, tls_cert, "",
          "PEM certificate (chain): a daemon serves TLS with it (with --tls-key); a client presents it to a "
          "server that requires mutual TLS.");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls-cert.");
ABSL_FLAG(std::string, tls_ca, "",
          "PEM CA that signs the cluster's certificates: a daemon requires peers to present one (mutual TLS); "
          "a client verifies the server against it (and turns TLS on).");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding the bearer token of colod's calls (health and reflection stay open), or several, a "
          "line each: the first is sent, each is taken (rotation: the daemons' --auth-token-refresh-interval); "
          "empty: no authentication. coloctl: the clients' token, the coordinator's --auth-token-file (or "
          "$COLOD_AUTH_TOKEN_FILE). A worker: the workers' token, the coordinator's --worker-token-file where it "
          "has one, else its --auth-token-file. The coordinator: the clients' token, and the workers' too "
          "unless --worker-token-file is given.");

namespace colod {

absl::StatusOr<Security> SecurityFromFlags(bool token_from_env, absl::Duration token_refresh) {
  RETURN_IF_ERROR(CheckTokenRefresh(token_refresh));
  Security s;
  s.tls = {absl::GetFlag(FLAGS_tls_cert), absl::GetFlag(FLAGS_tls_key), absl::GetFlag(FLAGS_tls_ca)};
  std::string token_file = absl::GetFlag(FLAGS_auth_token_file);
  const char* env = std::getenv("COLOD_AUTH_TOKEN_FILE");
  if (token_file.empty() && token_from_env && env != nullptr) token_file = env;
  if (!token_file.empty()) {
    ASSIGN_OR_RETURN(s.auth_token, AuthToken::FromFile(token_file, "--auth-token-file", token_refresh));
  }
  return s;
}

}  // namespace colod
