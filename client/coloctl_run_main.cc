// coloctl-run: the coloctl commands that compute in this process (forward
// and train on this machine's GPUs, init-model, tokenize, consolidate).
// coloctl runs it for them, on the same command line (cli.h: RunInProcess);
// it is a binary of its own so that coloctl, which orchestration hosts
// install to talk gRPC, links none of the trainer, the models or the kernels.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "client/cli.h"
#include "client/in_process_commands.h"
#include "common/atomic_file.h"
#include "common/grpc_server.h"

namespace colod::cli {
namespace {

constexpr char kIntro[] =
    "coloctl-run: the coloctl commands that compute in this process. coloctl runs it for\n"
    "them; `coloctl --help` describes them and their flags.\n"
    "\n"
    "Usage:\n"
    "  coloctl-run [flags] COMMAND\n";

constexpr char kEpilogue[] =
    "Exit status: 0 on success, 1 when the command fails, 2 for a usage error.\n";

}  // namespace
}  // namespace colod::cli

int main(int argc, char** argv) {
  // Ctrl-C, SIGTERM or SIGHUP ends the command as it would (the process
  // dies of the signal: a shell loop around it stops), but first removes
  // the files it was writing and had not renamed (a tokenizer's dataset of
  // gigabytes, a consolidated model): before, they stayed beside their
  // destination.
  colod::BlockShutdownSignals();
  std::thread([] {
    const int sig = colod::WaitForShutdownSignal();
    const int removed = colod::RemoveTemporaryFiles();  // (and no more are made)
    const std::string note = removed > 0 ? absl::StrCat("; removed ", removed, " unfinished file(s)") : "";
    std::fprintf(stderr, "coloctl: %s: stopped%s\n", ::strsignal(sig), note.c_str());
    ::signal(sig, SIG_DFL);
    sigset_t only;
    sigemptyset(&only);
    sigaddset(&only, sig);
    ::pthread_sigmask(SIG_UNBLOCK, &only, nullptr);
    ::raise(sig);
    std::_Exit(128 + sig);  // (not reached)
  }).detach();
  return colod::cli::CommandLineMain(argc, argv, colod::cli::kIntro, colod::cli::kEpilogue,
                                     {colod::cli::InProcessCommands()});
}
