// The security flags every colod binary shares: --tls-cert, --tls-key,
// --tls-ca and --auth-token-file, defined once here (link
// //common:security_flags) and read with SecurityFromFlags.
#ifndef COLOD_COMMON_SECURITY_FLAGS_H_
#define COLOD_COMMON_SECURITY_FLAGS_H_

#include <string>

#include "absl/status/statusor.h"
#include "common/auth.h"

namespace colod {

struct Security {
  TlsFiles tls;
  AuthToken auth_token;  // empty: no authentication
};

// The flags' values, with the tokens read from their file, and read again
// every `token_refresh` (AuthToken::FromFile; zero: once). With
// `token_from_env`, an unset --auth-token-file falls back to
// $COLOD_AUTH_TOKEN_FILE (coloctl). NOT_FOUND / INVALID_ARGUMENT naming the
// flag for an unreadable token file or one of no good token, and for a
// `token_refresh` CheckTokenRefresh refuses (with or without a file).
absl::StatusOr<Security> SecurityFromFlags(bool token_from_env = false,
                                           absl::Duration token_refresh = absl::ZeroDuration());

}  // namespace colod

#endif  // COLOD_COMMON_SECURITY_FLAGS_H_
