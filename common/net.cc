#include "common/net.h"

#include <unistd.h>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"

namespace colod {

std::string HostPort::ToString() const {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

absl::StatusOr<HostPort> ParseHostPort(absl::string_view text, absl::string_view what,
                                       bool allow_zero_port) {
  auto bad = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": '", text, "' is not HOST:PORT (", why, ")"));
  };
  if (text.empty()) return bad("empty");
  HostPort out;
  absl::string_view port_text;
  if (text.front() == '[') {
    size_t close = text.find(']');
    if (close == absl::string_view::npos) return bad("unclosed '['");
    out.host = std::string(text.substr(1, close - 1));
    if (close + 1 >= text.size() || text[close + 1] != ':') return bad("missing ':PORT'");
    port_text = text.substr(close + 2);
  } else {
    size_t colon = text.rfind(':');
    if (colon == absl::string_view::npos) return bad("missing ':PORT'");
    out.host = std::string(text.substr(0, colon));
    if (out.host.find(':') != std::string::npos) return bad("IPv6 literals need brackets");
    port_text = text.substr(colon + 1);
  }
  if (out.host.empty()) return bad("empty host");
  for (char c : out.host) {
    if (absl::ascii_isspace(static_cast<unsigned char>(c))) return bad("space in host");
  }
  if (port_text.empty()) return bad("empty port");
  for (char c : port_text) {
    if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return bad("port is not a number");
  }
  if (port_text.size() > 5 || !absl::SimpleAtoi(port_text, &out.port) || out.port > 65535 ||
      out.port < (allow_zero_port ? 0 : 1)) {
    return bad(allow_zero_port ? "port must be 0..65535" : "port must be 1..65535");
  }
  return out;
}

std::string DialTarget(absl::string_view host_port) { return absl::StrCat("dns:///", host_port); }

std::string LocalHostName() {
  char buf[256] = {0};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

bool IsLoopbackHost(absl::string_view host) {
  return host == "localhost" || host == "::1" || absl::StartsWith(host, "127.");
}

void WarnIfOpenWithoutAuth(absl::string_view daemon, absl::string_view listen, bool has_token) {
  if (has_token) return;
  absl::StatusOr<HostPort> hp = ParseHostPort(listen, "--listen", true);
  if (hp.ok() && IsLoopbackHost(hp->host)) return;
  COLOD_LOG(WARNING) << daemon << " listens on " << listen
                     << " without --auth-token-file: anyone who reaches that address may call it (see "
                        "docs/SECURITY.md)";
}

}  // namespace colod
