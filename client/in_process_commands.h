// coloctl-run's only command group (cmd_run.cc): forward and train on this
// machine's GPUs, init-model, tokenize, consolidate. It links the trainer,
// the models and the kernels, which coloctl does not; coloctl's model
// commands (commands.h) hand these command lines over to it.
#ifndef COLOD_CLIENT_IN_PROCESS_COMMANDS_H_
#define COLOD_CLIENT_IN_PROCESS_COMMANDS_H_

#include "client/cli.h"

namespace colod::cli {

CommandGroup InProcessCommands();

}  // namespace colod::cli

#endif  // COLOD_CLIENT_IN_PROCESS_COMMANDS_H_
