// coloctl-run: the coloctl commands that compute in this process (forward
// and train on this machine's GPUs, init-model, tokenize, consolidate).
// coloctl runs it for them, on the same command line (cli.h: RunInProcess);
// it is a binary of its own so that coloctl, which orchestration hosts
// install to talk gRPC, links none of the trainer, the models or the kernels.
#include "client/cli.h"
#include "client/in_process_commands.h"

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
  return colod::cli::CommandLineMain(argc, argv, colod::cli::kIntro, colod::cli::kEpilogue,
                                     {colod::cli::InProcessCommands()});
}
