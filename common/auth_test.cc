#include "common/auth.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

std::string Write(const std::string& name, const std::string& text) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/auth_", name, ".", ::getpid());
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

using Tokens = std::vector<std::string>;

// A token file as an editor leaves it (a line break at the end) reads as the
// token, and one of several lines as their tokens in order (blank lines and
// the lines' ends dropped, a Windows editor's CR too); a token that would
// not fit in a header value is refused naming its line and the byte (never
// the text): gRPC aborted the whole process when it was sent.
TEST(ReadAuthTokens, ATokenALineTrimmedAndRefusesWhatCannotTravelInAHeader) {
  EXPECT_EQ(ReadAuthTokens(Write("good", "  s3cret-token_+/=\n")).value_or(Tokens{}), Tokens{"s3cret-token_+/="});
  EXPECT_EQ(ReadAuthTokens(Write("words", "correct horse battery\n")).value_or(Tokens{}),
            Tokens{"correct horse battery"});
  EXPECT_EQ(ReadAuthTokens(Write("lines", "new-token\r\n\n  old-token \n")).value_or(Tokens{}),
            (Tokens{"new-token", "old-token"}));
  std::string many;
  for (int i = 0; i < 65; ++i) absl::StrAppend(&many, "token-", i, "\n");
  const struct {
    const char* name;
    std::string text;
    const char* says;
  } cases[] = {{"tab", "abc\tdef", "line 1: the token holds byte 0x09 at offset 3"},
               {"utf8", "first\nt\xc3\xb6ken", "line 2: the token holds byte 0xc3 at offset 1"},
               {"nul", std::string("ab\0c", 4), "byte 0x00 at offset 2"},
               {"many", many, "holds over 64 tokens"},
               {"huge", std::string(65 << 10, 'x'), "is over 64 KiB"}};
  for (const auto& c : cases) {
    const std::string path = Write(c.name, c.text);
    const absl::StatusOr<Tokens> token = ReadAuthTokens(path);
    EXPECT_EQ(token.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(token.status().message().find(c.says), absl::string_view::npos) << token.status();
    EXPECT_NE(token.status().message().find("--auth-token-file: '" + path + "'"), absl::string_view::npos)
        << token.status();
  }
  const absl::Status empty = ReadAuthTokens(Write("empty", " \n\n")).status();
  EXPECT_EQ(empty.code(), absl::StatusCode::kInvalidArgument) << empty;
  EXPECT_NE(empty.message().find("holds no token"), absl::string_view::npos) << empty;
  EXPECT_EQ(ReadAuthTokens("/nonexistent/token").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(CheckAuthToken("").ok()) << "no token: no authentication";
}

// The first token is sent and every one is taken, exactly and only after
// "Bearer "; no token sends nothing and takes nothing.
TEST(AuthToken, SendsTheFirstAndTakesEach) {
  const auto two = AuthToken::FromFile(Write("two", "new-token\nold-token\n"), "--auth-token-file");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->Sent(), "new-token");
  EXPECT_EQ(two->All(), (Tokens{"new-token", "old-token"}));
  EXPECT_TRUE(two->CarriedBy("Bearer new-token"));
  EXPECT_TRUE(two->CarriedBy("Bearer old-token"));
  for (const char* header :
       {"new-token", "Bearer new-toke", "Bearer new-token ", "bearer new-token", "Bearer ", "", "Bearer other-token"}) {
    EXPECT_FALSE(two->CarriedBy(header)) << header;
  }
  const AuthToken none, empty(""), one("old-token");
  EXPECT_TRUE(none.empty());
  EXPECT_TRUE(empty.empty());
  EXPECT_EQ(none.Sent(), "");
  EXPECT_FALSE(none.CarriedBy("Bearer "));
  EXPECT_TRUE(one.SharesATokenWith(*two));
  EXPECT_TRUE(two->SharesATokenWith(one));
  EXPECT_FALSE(AuthToken("third").SharesATokenWith(*two));
  EXPECT_FALSE(none.SharesATokenWith(*two));
}

// Waits up to 10 s for `token` to send `want`.
bool SendsWithin(const AuthToken& token, const std::string& want) {
  for (int i = 0; i < 1000 && token.Sent() != want; ++i) absl::SleepFor(absl::Milliseconds(10));
  return token.Sent() == want;
}

// Replaces `path` at once with `text`, as the kubelet swaps a Secret's files.
void Replace(const std::string& path, const std::string& text) {
  std::ofstream(path + ".new", std::ios::binary) << text;
  ASSERT_EQ(std::rename((path + ".new").c_str(), path.c_str()), 0);
}

// With a refresh, a change of the file is taken, by every copy; a file
// removed, emptied or garbled keeps the tokens read last; the reading
// thread ends with the last copy.
TEST(AuthToken, AFileReadAgainIsTakenAndABadReadKeepsTheLastTokens) {
  const std::string path = Write("rotated", "old-token\n");
  for (const absl::Duration refresh : {absl::Seconds(-1), absl::Milliseconds(9)}) {
    EXPECT_EQ(AuthToken::FromFile(path, "--auth-token-file", refresh).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  std::optional<AuthToken> token;
  {
    auto read = AuthToken::FromFile(path, "--auth-token-file", absl::Milliseconds(20));
    ASSERT_TRUE(read.ok()) << read.status();
    token = *read;  // a copy; the first handle goes
  }
  EXPECT_EQ(token->Sent(), "old-token");
  Replace(path, "old-token\nnew-token\n");
  for (int i = 0; i < 1000 && !token->CarriedBy("Bearer new-token"); ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_TRUE(token->CarriedBy("Bearer new-token"));
  EXPECT_EQ(token->Sent(), "old-token");
  Replace(path, "new-token\nold-token\n");
  EXPECT_TRUE(SendsWithin(*token, "new-token"));
  // Each bad content is read at least twice (a read begun before the
  // change may have read the file before it).
  auto read_twice = [&] {
    const int64_t before = token->reads();
    for (int i = 0; i < 1000 && token->reads() < before + 3; ++i) absl::SleepFor(absl::Milliseconds(10));
    return token->reads() >= before + 3;
  };
  for (const std::string& bad : {std::string(" \n"), std::string("t\xc3\xb6ken\n")}) {
    Replace(path, bad);
    ASSERT_TRUE(read_twice());
    EXPECT_EQ(token->All(), (Tokens{"new-token", "old-token"})) << bad;
  }
  ASSERT_EQ(std::remove(path.c_str()), 0);
  ASSERT_TRUE(read_twice());
  EXPECT_EQ(token->Sent(), "new-token");
  // A directory in its place is not read (nor a FIFO, which could block).
  ASSERT_EQ(::mkdir(path.c_str(), 0700), 0);
  ASSERT_TRUE(read_twice());
  EXPECT_EQ(token->Sent(), "new-token");
  ASSERT_EQ(::rmdir(path.c_str()), 0);
  Replace(path, "newest-token\n");
  EXPECT_TRUE(SendsWithin(*token, "newest-token"));
  EXPECT_FALSE(token->CarriedBy("Bearer old-token"));
  token.reset();  // joins the reader; a hang here would time the test out
  // A file over 64 KiB is refused from its size, unread.
  Replace(path, std::string(1 << 20, 'x'));
  const auto huge = AuthToken::FromFile(path, "--auth-token-file");
  EXPECT_NE(huge.status().message().find("is over 64 KiB"), absl::string_view::npos) << huge.status();
  Replace(path, "newest-token\n");
  // Without a refresh, the file is read once.
  auto once = AuthToken::FromFile(path, "--auth-token-file");
  ASSERT_TRUE(once.ok());
  Replace(path, "later-token\n");
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(once->Sent(), "newest-token");
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

// Two roles' tokens kept apart: a read of one's file that holds a token
// of the other's is refused, and the tokens before stay; a pipe is read
// once, whatever the refresh.
TEST(AuthToken, ARefreshKeepsTwoRolesApart) {
  const std::string clients_path = Write("apart-clients", "client-token\n");
  const std::string workers_path = Write("apart-workers", "worker-token\n");
  auto clients = AuthToken::FromFile(clients_path, "--auth-token-file", absl::Milliseconds(20));
  auto workers = AuthToken::FromFile(workers_path, "--worker-token-file", absl::Milliseconds(20));
  ASSERT_TRUE(clients.ok() && workers.ok());
  clients->KeepApartFrom(*workers);
  workers->KeepApartFrom(*clients);
  Replace(workers_path, "worker-token\nclient-token\n");
  const int64_t before = workers->reads();
  for (int i = 0; i < 1000 && workers->reads() < before + 3; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(workers->All(), Tokens{"worker-token"});
  Replace(workers_path, "worker-token\nworker-next\n");
  for (int i = 0; i < 1000 && !workers->CarriedBy("Bearer worker-next"); ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(workers->All(), (Tokens{"worker-token", "worker-next"}));
  // The other way round too.
  Replace(clients_path, "worker-next\n");
  const int64_t clients_before = clients->reads();
  for (int i = 0; i < 1000 && clients->reads() < clients_before + 3; ++i) absl::SleepFor(absl::Milliseconds(10));
  EXPECT_EQ(clients->Sent(), "client-token");
  // A pipe: no reader at all.
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  ASSERT_EQ(::write(fds[1], "piped-token\n", 12), 12);
  ::close(fds[1]);
  auto piped = AuthToken::FromFile(absl::StrCat("/proc/self/fd/", fds[0]), "--auth-token-file", absl::Milliseconds(20));
  ::close(fds[0]);
  ASSERT_TRUE(piped.ok()) << piped.status();
  EXPECT_EQ(piped->Sent(), "piped-token");
  absl::SleepFor(absl::Milliseconds(100));
  EXPECT_EQ(piped->reads(), 0);
}

// Each role's token admits that role's calls only; the other role's is
// refused PERMISSION_DENIED (authenticated, not for this call), an unknown
// one or none UNAUTHENTICATED; a token of both files (each role's own state
// reads its file, and two reads at the same instant could each take it)
// admits no call of either role. One token alone plays both roles.
TEST(TokenAuth, EachRoleItsOwnTokenAndATokenOfBothAdmitsNeither) {
  using C = absl::StatusCode;
  const TokenAuth two(AuthToken("client-token"), AuthToken("worker-token"));
  const auto code = [](const TokenAuth& auth, std::optional<absl::string_view> authorization, CallerRole role) {
    return auth.CheckBearer(authorization, role).code();
  };
  EXPECT_EQ(code(two, "Bearer client-token", CallerRole::kClient), C::kOk);
  EXPECT_EQ(code(two, "Bearer worker-token", CallerRole::kWorker), C::kOk);
  EXPECT_EQ(code(two, "Bearer worker-token", CallerRole::kClient), C::kPermissionDenied);
  EXPECT_EQ(code(two, "Bearer client-token", CallerRole::kWorker), C::kPermissionDenied);
  EXPECT_EQ(code(two, "Bearer other-token", CallerRole::kClient), C::kUnauthenticated);
  EXPECT_EQ(code(two, "client-token", CallerRole::kClient), C::kUnauthenticated) << "no Bearer";
  EXPECT_EQ(code(two, std::nullopt, CallerRole::kWorker), C::kUnauthenticated);

  const std::string clients_path = Write("both-clients", "client-token\nshared-token\n");
  const std::string workers_path = Write("both-workers", "worker-token\nshared-token\n");
  auto clients = AuthToken::FromFile(clients_path, "--auth-token-file", absl::ZeroDuration());
  auto workers = AuthToken::FromFile(workers_path, "--worker-token-file", absl::ZeroDuration());
  ASSERT_TRUE(clients.ok() && workers.ok());
  ASSERT_TRUE(clients->SharesATokenWith(*workers));
  const TokenAuth both(*clients, *workers);
  for (CallerRole role : {CallerRole::kClient, CallerRole::kWorker}) {
    const absl::Status s = both.CheckBearer("Bearer shared-token", role);
    EXPECT_EQ(s.code(), C::kPermissionDenied) << s;
    EXPECT_NE(s.message().find("both the clients' and the workers'"), absl::string_view::npos) << s;
  }
  EXPECT_EQ(code(both, "Bearer client-token", CallerRole::kClient), C::kOk) << "the others still admit";
  EXPECT_EQ(code(both, "Bearer worker-token", CallerRole::kWorker), C::kOk);

  const TokenAuth one(AuthToken("only-token"));
  EXPECT_EQ(code(one, "Bearer only-token", CallerRole::kClient), C::kOk);
  EXPECT_EQ(code(one, "Bearer only-token", CallerRole::kWorker), C::kOk);
  EXPECT_EQ(code(TokenAuth(), std::nullopt, CallerRole::kWorker), C::kOk) << "no token: no authentication";
}

}  // namespace
}  // namespace colod
