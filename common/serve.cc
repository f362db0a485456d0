#include "common/serve.h"

#include <cxxabi.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <system_error>
#include <thread>
#include <typeinfo>

#include "absl/strings/escaping.h"
#include "common/exit_codes.h"
#include "common/grpc_server.h"
#include "common/logging.h"
#include "common/ready_file.h"
#include "common/text.h"

namespace colod {
namespace {

constexpr size_t kMaxTerminateMessage = 1024;

// The daemon's name for the terminate handler's line: a copy that is never
// freed, so that the handler may read it while static destructors run.
std::atomic<const char*> daemon_name{"colod"};

[[noreturn]] void OnTerminate() {
  // One line for the process: a call on the same thread (the line below ran
  // out of memory and threw) exits at once, and one on another thread waits
  // for the first call's exit.
  static std::atomic<bool> entered{false};
  thread_local bool here = false;
  if (here) std::_Exit(kExitUncaughtException);
  here = true;
  if (entered.exchange(true)) {
    for (;;) ::pause();
  }
  std::string what = "std::terminate was called with no exception in flight";
  if (std::exception_ptr e = std::current_exception()) {
    std::string type = "an unknown type";
    if (const std::type_info* t = abi::__cxa_current_exception_type(); t != nullptr) {
      int status = 0;
      std::unique_ptr<char, void (*)(void*)> name(abi::__cxa_demangle(t->name(), nullptr, nullptr, &status), std::free);
      type = status == 0 && name != nullptr ? name.get() : t->name();
    }
    std::string message;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      message = x.what();
    } catch (...) {
      message = "(not a std::exception: no message)";
    }
    what = "an exception of type " + type + " escaped every handler: \"" +
           absl::CHexEscape(Utf8Prefix(message, kMaxTerminateMessage)) + "\"";
  }
  char thread_name[32] = "";
  pthread_getname_np(pthread_self(), thread_name, sizeof(thread_name));
  COLOD_LOG(ERROR) << daemon_name.load() << " ends on thread " << ::syscall(SYS_gettid) << " ('"
                   << absl::CHexEscape(thread_name) << "'): " << what << "; exiting " << kExitUncaughtException
                   << " without a clean shutdown, for its supervisor to start a new process";
  std::_Exit(kExitUncaughtException);
}

}  // namespace

void ExitOnUncaughtExceptions(absl::string_view name) {
  // Leaked on purpose: the handler may run while static destructors do.
  daemon_name.store((new std::string(name))->c_str());
  std::set_terminate(OnTerminate);
}

void ExitOnNextShutdownSignal(absl::string_view name) {
  try {
    std::thread([name = std::string(name)] {
      const int sig = WaitForShutdownSignal();
      COLOD_LOG(WARNING) << "received signal " << sig << " during the shutdown: " << name
                         << " exits now, without finishing it";
      std::_Exit(128 + sig);
    }).detach();
  } catch (const std::system_error& e) {
    COLOD_LOG(WARNING) << "a signal during the shutdown will not end " << name << " at once: " << e.what();
  }
}

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
