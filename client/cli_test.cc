#include "client/cli.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "client/job_flags.h"
#include "common/atomic_file.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace colod::cli {
namespace {

std::string FreshDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/", name, ".", ::getpid());
  std::filesystem::create_directories(dir);
  return dir;
}

// --out and --logits: a file is written whole or not at all; a link to one
// replaces the file it names and stays a link; a FIFO or a device is
// written in place (a pipe's reader gets the bytes), never replaced by a
// file; a FIFO nothing reads, a directory or a link to nothing is refused
// at once.
TEST(WriteOutputFile, WritesFilesLinksAndPipesAsTheyAre) {
  const std::string dir = FreshDir("out");
  ASSERT_TRUE(WriteOutputFile(dir + "/new.npy", "first").ok());
  EXPECT_EQ(ReadFileToString(dir + "/new.npy").value_or("?"), "first");
  ASSERT_TRUE(WriteOutputFile(dir + "/new.npy", "second").ok());
  EXPECT_EQ(ReadFileToString(dir + "/new.npy").value_or("?"), "second");

  std::filesystem::create_symlink(dir + "/new.npy", dir + "/link.npy");
  ASSERT_TRUE(WriteOutputFile(dir + "/link.npy", "through the link").ok());
  EXPECT_TRUE(std::filesystem::is_symlink(dir + "/link.npy"));
  EXPECT_EQ(ReadFileToString(dir + "/new.npy").value_or("?"), "through the link");

  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const absl::Time start = absl::Now();
  const absl::Status unread = WriteOutputFile(fifo, "nobody reads");
  EXPECT_EQ(unread.code(), absl::StatusCode::kFailedPrecondition) << unread;
  EXPECT_NE(unread.message().find("a FIFO nothing reads from"), absl::string_view::npos) << unread;
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  const int reader = ::open(fifo.c_str(), O_RDONLY | O_NONBLOCK);
  ASSERT_GE(reader, 0);
  ASSERT_TRUE(WriteOutputFile(fifo, "into the pipe").ok());
  char got[32] = {};
  EXPECT_EQ(::read(reader, got, sizeof(got)), 13);
  EXPECT_EQ(std::string(got), "into the pipe");
  ::close(reader);
  struct stat st;
  ASSERT_EQ(::lstat(fifo.c_str(), &st), 0);
  EXPECT_TRUE(S_ISFIFO(st.st_mode)) << "the FIFO stays a FIFO";
  ASSERT_TRUE(WriteOutputFile("/dev/null", "discarded").ok());

  // coloctl ... --out /dev/stdout >> log: the bytes go after what the log
  // holds, through the descriptor; the log is not replaced.
  const std::string log = dir + "/stdout.log";
  ASSERT_TRUE(WriteFileAtomically(log, "HEADER\n").ok());
  std::fflush(stdout);
  const int saved = ::dup(STDOUT_FILENO);
  const int appended = ::open(log.c_str(), O_WRONLY | O_APPEND);
  ASSERT_GE(appended, 0);
  ASSERT_EQ(::dup2(appended, STDOUT_FILENO), STDOUT_FILENO);
  const absl::Status to_stdout = WriteOutputFile("/dev/stdout", "npy bytes");
  ::dup2(saved, STDOUT_FILENO);
  ::close(saved);
  ::close(appended);
  EXPECT_TRUE(to_stdout.ok()) << to_stdout;
  EXPECT_EQ(ReadFileToString(log).value_or("?"), "HEADER\nnpy bytes");

  std::filesystem::create_symlink(dir + "/nothing", dir + "/dangling");
  EXPECT_EQ(WriteOutputFile(dir + "/dangling", "x").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(WriteOutputFile(dir, "x").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_FALSE(std::filesystem::exists(dir + "/nothing"));
}

// A token that a header cannot carry is refused when the client is made,
// not by gRPC aborting the process at the first call.
// A job is named after its model directory however the directory is
// written: with a trailing slash (a shell's completion) or as ".".
TEST(SetModelFromDir, NamesTheJobAfterTheDirectoryHoweverItIsWritten) {
  const std::string dir = FreshDir("gpt2-tiny");
  {
    std::FILE* f = std::fopen((dir + "/config.json").c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("{}", f);
    std::fclose(f);
  }
  const std::string name = std::filesystem::path(dir).filename().string();
  for (const std::string& written : {dir, dir + "/", dir + "/.", dir + "//"}) {
    v1::JobSpec spec;
    ASSERT_TRUE(SetModelFromDir(written, spec).ok()) << written;
    EXPECT_EQ(spec.name(), name) << written;
  }
}

// --coordinator HOST:PORT names a host, whatever it is called: "unix:7070"
// is the host "unix", never the local socket ./7070 gRPC would make of it.
TEST(CoordinatorClient, AHostNamedLikeAGrpcSchemeIsAHost) {
  const std::string dir = FreshDir("unix-scheme");
  char cwd[4096];
  ASSERT_NE(::getcwd(cwd, sizeof(cwd)), nullptr);
  ASSERT_EQ(::chdir(dir.c_str()), 0);
  grpc::ServerBuilder b;
  b.AddListeningPort("unix:7070", grpc::InsecureServerCredentials());  // ./7070, serving nothing of colod's
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  ASSERT_EQ(::chdir(cwd), 0);
  ASSERT_NE(server, nullptr);
  CoordinatorClient::Options options;
  options.timeout = absl::Seconds(3);
  auto client = CoordinatorClient::Create("unix:7070", options);
  ASSERT_TRUE(client.ok()) << client.status();
  ASSERT_EQ(::chdir(dir.c_str()), 0);
  const absl::Status s = (*client)->ListWorkers(false).status();
  ASSERT_EQ(::chdir(cwd), 0);
  // Reaching the socket would be UNIMPLEMENTED (no CoordinatorService there).
  EXPECT_NE(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_FALSE(s.ok());
  server->Shutdown();
}

TEST(CoordinatorClient, RefusesATokenAHeaderCannotCarry) {
  CoordinatorClient::Options o;
  o.auth_token = "line\nbreak";
  const auto c = CoordinatorClient::Create("127.0.0.1:1", o);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << c.status();
  EXPECT_NE(c.status().message().find("byte 0x0a at offset 4"), absl::string_view::npos) << c.status();
}

}  // namespace
}  // namespace colod::cli
