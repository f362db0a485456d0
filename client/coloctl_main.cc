// coloctl: the colod command line. The commands live in their groups'
// tables (cmd_*.cc); CommandLineMain (cli.h) builds --help from them and
// dispatches. coloctl talks gRPC; what computes in-process is coloctl-run's
// (coloctl_run_main.cc).
#include "client/cli.h"
#include "client/commands.h"

namespace colod::cli {
namespace {

constexpr char kIntro[] =
    "coloctl: drive a colod cluster.\n"
    "\n"
    "Usage:\n"
    "  coloctl [flags] COMMAND\n"
    "  coloctl help COMMAND    (or COMMAND --help): one command and its flags\n";

constexpr char kEpilogue[] =
    "Exit status: 0 on success, 1 when the command fails (the status code, e.g. the\n"
    "coordinator's gRPC code, and the message are printed), 2 for a usage error (a\n"
    "flag that is unknown, lacks its value or whose value does not parse, or is\n"
    "another command's (only the global flags go with every command); a spec or\n"
    "a model directory that would be refused: it is checked before a cluster starts\n"
    "or a call is made), 69 when the coordinator (health: the daemon) was not\n"
    "reached (refused, unresolvable, a TLS handshake that failed) or did not answer\n"
    "within --timeout: UNAVAILABLE or DEADLINE_EXCEEDED with no answer from it (one\n"
    "it answers, a worker's passed on, is 1); 128 + N when signal N (Ctrl-C: 130)\n"
    "stopped it (but local, which runs until a signal stops it: 0).\n"
    "\n"
    "Examples:\n"
    "  coloctl --coordinator 127.0.0.1:7070 workers\n"
    "  coloctl init-model --out ./gpt2-tiny\n"
    "  coloctl submit --model ./gpt2-tiny --data /usr/share/common-licenses/GPL-3 --tp 2 --dp 2 --steps 40 --watch\n"
    "  coloctl jobs --state running --output json\n"
    "  coloctl mesh job-000001\n"
    "  COLOD_COORDINATOR=10.0.0.5:7070 coloctl workers --output json\n"
    "  coloctl health 127.0.0.1:7070 --service colod.v1.CoordinatorService --timeout 3s\n"
    "  coloctl forward --model ./gpt2 --input ids.npy --logits logits.npy --tp 2 --dp 1 --mode 1d\n"
    "  coloctl train --model ./gpt2 --data train.bin --steps 100 --batch-size 16 --seq-len 256 \\\n"
    "      --lr 3e-4 --optimizer adamw --tp 2 --dp 2 --mode 1d --output json\n";

int Main(int argc, char** argv) {
  // In --help's order.
  return CommandLineMain(argc, argv, kIntro, kEpilogue,
                         {LocalCommands(), ModelCommands(), ClusterCommands(), TensorCommands()});
}

}  // namespace
}  // namespace colod::cli

int main(int argc, char** argv) { return colod::cli::Main(argc, argv); }
