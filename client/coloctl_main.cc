// coloctl: the colod command line. The commands live in their groups'
// tables (cmd_*.cc); this file builds --help from them and dispatches.
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/cli.h"
#include "client/commands.h"
#include "common/flags.h"

namespace colod::cli {
namespace {

constexpr char kIntro[] =
    "coloctl: drive a colod cluster.\n"
    "\n"
    "Usage:\n"
    "  coloctl [flags] COMMAND\n";

constexpr char kEpilogue[] =
    "Exit status: 0 on success, 1 when the command fails (the status code, e.g. the\n"
    "coordinator's gRPC code, and the message are printed), 2 for a usage error.\n"
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

// In --help's order.
std::vector<CommandGroup> Groups() { return {LocalCommands(), ModelCommands(), ClusterCommands(), TensorCommands()}; }

std::string HelpText(const std::vector<CommandGroup>& groups) {
  std::string out = kIntro;
  for (const CommandGroup& group : groups) {
    absl::StrAppend(&out, "\n", group.heading, "\n");
    for (const Command& command : group.commands) out += command.usage;
  }
  absl::StrAppend(&out, "\n", kEpilogue);
  return out;
}

const Command* FindCommand(const std::vector<CommandGroup>& groups, const std::string& name) {
  for (const CommandGroup& group : groups) {
    for (const Command& command : group.commands) {
      if (name == command.name) return &command;
    }
  }
  return nullptr;
}

// Checks the operands the command declares, then runs it.
int Dispatch(const Command& command, const std::vector<std::string>& args) {
  const std::vector<std::string> operands(args.begin() + 1, args.end());
  if (command.operands != nullptr) {
    const std::vector<std::string> wanted = absl::StrSplit(command.operands, ' ', absl::SkipEmpty());
    if (operands.size() < wanted.size()) {
      return Usage(absl::StrCat(command.name, ": missing ", wanted[operands.size()]));
    }
    if (operands.size() > wanted.size()) {
      return Usage(absl::StrCat("unexpected argument '", operands[wanted.size()], "'"));
    }
  }
  return command.run(operands);
}

int Main(int argc, char** argv) {
  const std::vector<CommandGroup> groups = Groups();
  const std::vector<std::string> args = ParseFlags(argc, argv, HelpText(groups));
  if (args.empty()) return Usage("missing COMMAND");
  const std::string output = absl::GetFlag(FLAGS_output);
  if (output != "table" && output != "json") {
    return Usage(absl::StrCat("--output: '", output, "' is not one of table, json"));
  }
  const Command* command = FindCommand(groups, args[0]);
  if (command == nullptr) return Usage(absl::StrCat("unknown command '", args[0], "'"));
  return Dispatch(*command, args);
}

}  // namespace
}  // namespace colod::cli

int main(int argc, char** argv) { return colod::cli::Main(argc, argv); }
