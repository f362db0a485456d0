// Ends the server streams that make no progress: a client that stops
// reading a download (its Write blocks on flow control) or sending an
// upload (its Read blocks) would otherwise hold its slot and a server thread
// until its own deadline, which it may not have set.
#ifndef COLOD_SERVER_STALL_WATCHDOG_H_
#define COLOD_SERVER_STALL_WATCHDOG_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace colod {

// Thread-safe. Its own thread looks every `period` and cancels
// (ServerContext::TryCancel, which never blocks) each watched stream whose
// last progress is older than `stall`; the handler's blocked Read or Write
// then returns false. A zero `stall` watches nothing.
class StallWatchdog {
 public:
  StallWatchdog(absl::Duration stall, absl::Duration period = absl::Seconds(1));
  ~StallWatchdog();  // stops the thread; every Watch must be gone
  StallWatchdog(const StallWatchdog&) = delete;
  StallWatchdog& operator=(const StallWatchdog&) = delete;

  // One stream under watch, from now; unwatched when destroyed (before the
  // handler returns: the context must outlive it).
  class Watch {
   public:
    ~Watch();
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;
    // The stream moved (a chunk read or written).
    void Progress();
    // Whether the watchdog cancelled the stream for its stall.
    bool stalled() const;

   private:
    friend class StallWatchdog;
    Watch(StallWatchdog* dog, uint64_t id) : dog_(dog), id_(id) {}
    StallWatchdog* const dog_;
    const uint64_t id_;
  };
  // `what` names the stream in the log line of its cancel.
  std::unique_ptr<Watch> Start(grpc::ServerContext* ctx, std::string what);

  // Streams cancelled for a stall so far.
  int64_t cancelled() const;
  // Streams under watch now.
  int64_t watched() const;

 private:
  struct Entry {
    grpc::ServerContext* ctx;
    std::string what;
    absl::Time last;
    bool stalled = false;
  };
  void Loop();

  const absl::Duration stall_, period_;
  mutable absl::Mutex mu_;
  std::map<uint64_t, Entry> entries_ ABSL_GUARDED_BY(mu_);
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t cancelled_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace colod

#endif  // COLOD_SERVER_STALL_WATCHDOG_H_
