// coloctl's command groups, a file each; coloctl_main.cc lists them in this
// order in --help and dispatches to their commands.
#ifndef COLOD_CLIENT_COMMANDS_H_
#define COLOD_CLIENT_COMMANDS_H_

#include "client/cli.h"

namespace colod::cli {

// cmd_cluster.cc: workers, submit, jobs, status, checkpoints, watch, cancel, delete, mesh.
CommandGroup ClusterCommands();
// cmd_tensor.cc: tensor demo/create/reshard/get/list/delete.
CommandGroup TensorCommands();
// cmd_model.cc: forward, train, plan, init-model, tokenize, consolidate (the
// last three, and forward and train --device cuda, handed to coloctl-run).
CommandGroup ModelCommands();
// cmd_local.cc: local, health, version.
CommandGroup LocalCommands();

}  // namespace colod::cli

#endif  // COLOD_CLIENT_COMMANDS_H_
