#include "common/auth.h"

#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

std::string Write(const std::string& name, const std::string& text) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/auth_", name, ".", ::getpid());
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// A token file as an editor leaves it (a line break at the end) reads as the
// token; one that would not fit in a header value is refused naming the
// byte: gRPC aborted the whole process when it was sent.
TEST(ReadAuthToken, TrimsTheEndsAndRefusesWhatCannotTravelInAHeader) {
  EXPECT_EQ(ReadAuthToken(Write("good", "  s3cret-token_+/=\n")).value_or("?"), "s3cret-token_+/=");
  EXPECT_EQ(ReadAuthToken(Write("words", "correct horse battery\n")).value_or("?"), "correct horse battery");
  const struct {
    const char* name;
    std::string text;
    const char* says;
  } cases[] = {{"two_lines", "abc\ndef\n", "byte 0x0a at offset 3"},
               {"tab", "abc\tdef", "byte 0x09 at offset 3"},
               {"utf8", "t\xc3\xb6ken", "byte 0xc3 at offset 1"},
               {"nul", std::string("ab\0c", 4), "byte 0x00 at offset 2"}};
  for (const auto& c : cases) {
    const std::string path = Write(c.name, c.text);
    const absl::StatusOr<std::string> token = ReadAuthToken(path);
    EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(token.status().message().find(c.says), absl::string_view::npos) << token.status();
    EXPECT_NE(token.status().message().find("--auth-token-file: '" + path + "'"), absl::string_view::npos)
        << token.status();
  }
  const absl::Status empty = ReadAuthToken(Write("empty", " \n")).status();
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument) << empty;
  EXPECT_EQ(ReadAuthToken("/nonexistent/token").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(CheckAuthToken("").ok()) << "no token: no authentication";
}

// An empty or garbage --tls-ca is refused: gRPC takes an empty root list as
// "trust the system's CAs", and a garbage one failed later as an empty
// address list.
TEST(MakeChannelCredentials, RefusesAFileWithNoPemBlock) {
  for (const std::string& text : {std::string(), std::string("not a certificate\n")}) {
    TlsFiles tls;
    tls.ca = Write("ca", text);
    const auto creds = MakeChannelCredentials(tls);
    EXPECT_EQ(creds.status().code(), absl::StatusCode::kInvalidArgument) << creds.status();
    EXPECT_NE(creds.status().message().find("--tls-ca: '" + tls.ca + "' holds no PEM block"), absl::string_view::npos)
        << creds.status();
  }
  // A server's files likewise.
  TlsFiles server;
  server.cert = Write("cert", "");
  server.key = Write("key", "-----BEGIN PRIVATE KEY-----\n");
  const auto served = MakeServerCredentials(server);
  EXPECT_EQ(served.status().code(), absl::StatusCode::kInvalidArgument) << served.status();
  EXPECT_NE(served.status().message().find("--tls-cert: '" + server.cert + "' holds no PEM block"),
            absl::string_view::npos)
      << served.status();
}

}  // namespace
}  // namespace colod
