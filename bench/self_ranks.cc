#include "bench/self_ranks.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include "absl/strings/str_cat.h"

extern char** environ;

namespace colod::bench {

absl::Status RunSelfAsRanks(int ranks, const std::function<std::vector<std::string>(int, const std::string&)>& args,
                            const std::function<void(const std::string&)>& on_line,
                            const std::function<void(const std::string&)>& on_done) {
  char exe[4096];
  const ssize_t len = readlink("/proc/self/exe", exe, sizeof exe - 1);
  if (len <= 0) return absl::InternalError("cannot find this binary (/proc/self/exe)");
  const std::string self(exe, static_cast<size_t>(len));
  char templ[] = "/tmp/colod-bench-ranks-XXXXXX";
  if (mkdtemp(templ) == nullptr) return absl::InternalError("mkdtemp failed");
  const std::string store = templ;
  int fds[2];
  if (pipe(fds) != 0) {
    std::filesystem::remove_all(store);
    return absl::InternalError("pipe failed");
  }
  std::vector<pid_t> pids;
  for (int r = 0; r < ranks; ++r) {
    std::vector<std::string> a = args(r, store);
    a.insert(a.begin(), self);
    std::vector<char*> argv;
    for (std::string& s : a) argv.push_back(s.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t files;
    posix_spawn_file_actions_init(&files);
    if (r == 0) posix_spawn_file_actions_adddup2(&files, fds[1], 1);
    posix_spawn_file_actions_addclose(&files, fds[0]);
    pid_t pid = -1;
    if (posix_spawn(&pid, self.c_str(), &files, nullptr, argv.data(), environ) == 0) pids.push_back(pid);
    posix_spawn_file_actions_destroy(&files);
  }
  close(fds[1]);
  FILE* out = fdopen(fds[0], "r");
  char line[1024];
  while (out != nullptr && std::fgets(line, sizeof line, out) != nullptr) on_line(line);
  if (out != nullptr) std::fclose(out);
  int failed = ranks - static_cast<int>(pids.size());
  for (pid_t pid : pids) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  if (failed == 0 && on_done) on_done(store);
  std::error_code ec;
  std::filesystem::remove_all(store, ec);
  if (failed > 0) return absl::InternalError(absl::StrCat(failed, " of ", ranks, " rank processes failed"));
  return absl::OkStatus();
}

}  // namespace colod::bench
