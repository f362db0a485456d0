#include "common/serve.h"

#include "common/grpc_server.h"
#include "common/logging.h"
#include "common/ready_file.h"

namespace colod {

int ServeUntilSignal(absl::string_view name, const std::string& ready_file, const std::string& grpc,
                     const std::string& metrics, const std::function<void()>& shutdown) {
  if (!ready_file.empty()) {
    absl::Status s = WriteReadyFile(ready_file, {{"grpc", grpc}, {"metrics", metrics}});
    if (!s.ok()) {
      COLOD_LOG(ERROR) << s.message();
      shutdown();
      return 1;
    }
  }
  const int sig = WaitForShutdownSignal();
  COLOD_LOG(INFO) << "received signal " << sig;
  shutdown();
  COLOD_LOG(INFO) << name << " stopped";
  return 0;
}

}  // namespace colod
