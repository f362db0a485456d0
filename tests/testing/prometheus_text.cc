#include "tests/testing/prometheus_text.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <limits>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/net.h"
#include "common/status_macros.h"

namespace colod::testing {
namespace {

bool IsNameStart(char c) { return absl::ascii_isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':'; }
bool IsNameChar(char c) { return IsNameStart(c) || absl::ascii_isdigit(static_cast<unsigned char>(c)); }

bool ValidName(absl::string_view s, bool allow_colon) {
  if (s.empty() || !IsNameStart(s[0]) || (!allow_colon && s[0] == ':')) return false;
  for (char c : s) {
    if (!IsNameChar(c) || (!allow_colon && c == ':')) return false;
  }
  return true;
}

bool ParseValue(absl::string_view s, double* out) {
  std::string lower = absl::AsciiStrToLower(s);
  if (lower == "nan") { *out = std::numeric_limits<double>::quiet_NaN(); return true; }
  if (lower == "+inf" || lower == "inf") { *out = std::numeric_limits<double>::infinity(); return true; }
  if (lower == "-inf") { *out = -std::numeric_limits<double>::infinity(); return true; }
  return absl::SimpleAtod(s, out);
}

}  // namespace

absl::StatusOr<std::string> HttpGet(const std::string& host_port, const std::string& path) {
  ASSIGN_OR_RETURN(HostPort hp, ParseHostPort(host_port, "address", false));
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(hp.host.c_str(), std::to_string(hp.port).c_str(), &hints, &res) != 0 || !res) {
    return absl::UnavailableError(absl::StrCat("cannot resolve ", host_port));
  }
  int fd = ::socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  timeval tv{5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (fd < 0 || ::connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
    freeaddrinfo(res);
    if (fd >= 0) ::close(fd);
    return absl::UnavailableError(absl::StrCat("cannot connect to ", host_port, ": ", std::strerror(errno)));
  }
  freeaddrinfo(res);
  const std::string req = absl::StrCat("GET ", path, " HTTP/1.0\r\nHost: ", host_port, "\r\n\r\n");
  if (::send(fd, req.data(), req.size(), 0) != static_cast<ssize_t>(req.size())) {
    ::close(fd);
    return absl::UnavailableError("send failed");
  }
  std::string resp;
  char buf[8192];
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    resp.append(buf, n);
  }
  ::close(fd);
  size_t header_end = resp.find("\r\n\r\n");
  if (header_end == std::string::npos) return absl::DataLossError("no HTTP header end");
  absl::string_view status_line = absl::string_view(resp).substr(0, resp.find("\r\n"));
  if (!absl::StrContains(status_line, " 200")) {
    return absl::FailedPreconditionError(absl::StrCat("HTTP ", status_line));
  }
  return resp.substr(header_end + 4);
}

absl::StatusOr<std::map<std::string, MetricFamily>> ParsePrometheusText(const std::string& text) {
  std::map<std::string, MetricFamily> families;
  std::string current;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat("line ", line_no, " '", line, "': ", why));
    };
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::vector<absl::string_view> parts = absl::StrSplit(line, absl::MaxSplits(' ', 3));
      if (parts.size() < 3 || (parts[1] != "HELP" && parts[1] != "TYPE")) continue;  // plain comment
      if (!ValidName(parts[2], true)) return bad("bad metric name");
      MetricFamily& f = families[std::string(parts[2])];
      f.name = std::string(parts[2]);
      if (parts[1] == "TYPE") {
        if (!f.type.empty()) return bad("TYPE declared twice");
        if (parts.size() != 4) return bad("TYPE without a type");
        static const char* kTypes[] = {"counter", "gauge", "histogram", "summary", "untyped"};
        bool known = false;
        for (const char* t : kTypes) known |= parts[3] == t;
        if (!known) return bad("unknown type");
        f.type = std::string(parts[3]);
        if (!f.samples.empty()) return bad("TYPE after samples");
      } else {
        f.help = parts.size() == 4 ? std::string(parts[3]) : "";
      }
      current = f.name;
      continue;
    }
    Sample s;
    size_t i = 0;
    while (i < line.size() && IsNameChar(line[i])) ++i;
    s.name = std::string(line.substr(0, i));
    if (!ValidName(s.name, true)) return bad("bad sample name");
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        size_t start = i;
        while (i < line.size() && IsNameChar(line[i])) ++i;
        std::string label(line.substr(start, i - start));
        if (!ValidName(label, false)) return bad("bad label name");
        if (i + 1 >= line.size() || line[i] != '=' || line[i + 1] != '"') return bad("expected =\"");
        i += 2;
        std::string value;
        while (i < line.size() && line[i] != '"') {
          if (line[i] == '\\') {
            if (i + 1 >= line.size()) return bad("dangling escape");
            char e = line[i + 1];
            if (e == 'n') value.push_back('\n');
            else if (e == '\\' || e == '"') value.push_back(e);
            else return bad("bad escape");
            i += 2;
          } else {
            value.push_back(line[i++]);
          }
        }
        if (i >= line.size()) return bad("unterminated label value");
        ++i;  // closing quote
        if (s.labels.count(label)) return bad("label repeated");
        s.labels[label] = value;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size()) return bad("unterminated label set");
      ++i;  // '}'
    }
    if (i >= line.size() || line[i] != ' ') return bad("expected a space before the value");
    std::vector<absl::string_view> rest = absl::StrSplit(line.substr(i + 1), ' ', absl::SkipEmpty());
    if (rest.empty() || rest.size() > 2) return bad("expected `value [timestamp]`");
    if (!ParseValue(rest[0], &s.value)) return bad("value is not a number");
    std::string family = s.name;
    if (!families.count(family)) {
      for (const char* suffix : {"_bucket", "_sum", "_count"}) {
        if (absl::EndsWith(s.name, suffix)) {
          std::string base = s.name.substr(0, s.name.size() - std::strlen(suffix));
          if (families.count(base)) family = base;
        }
      }
    }
    if (family != current) return bad("sample outside its family's block");
    families[family].samples.push_back(std::move(s));
  }
  return families;
}

}  // namespace colod::testing
