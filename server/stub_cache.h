// Stubs of one gRPC service by worker address, as the coordinator's
// scheduler and tensor proxy call the workers.
#ifndef COLOD_SERVER_STUB_CACHE_H_
#define COLOD_SERVER_STUB_CACHE_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "common/grpc_server.h"
#include "common/net.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"

namespace colod {

// A stub for each address, on a keepalive channel (TLS or plaintext, which
// connects lazily) made when the address is first asked for. A stub not
// asked for during `idle` is dropped, closing its channel, by a later
// lookup: a coordinator up for months, with workers coming and going (a
// Kubernetes pod has a new address after each restart), keeps only the
// channels of the workers it talks to. A caller holds the returned stub for
// as long as its calls on it run.
//
// Thread-safe. Dropped channels are closed after the lock is released; a
// new one is made under it, which connects nothing (it is lazy).
template <typename Service>
class StubCache {
 public:
  using Stub = typename Service::Stub;
  static constexpr absl::Duration kDefaultIdle = absl::Minutes(10);

  // `credentials` null: plaintext. `clock` must outlive the cache.
  explicit StubCache(std::shared_ptr<grpc::ChannelCredentials> credentials, absl::Duration idle = kDefaultIdle,
                     const Clock* clock = Clock::Real())
      : credentials_(credentials ? std::move(credentials) : grpc::InsecureChannelCredentials()),
        idle_(idle),
        clock_(clock) {}

  std::shared_ptr<Stub> Get(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_) {
    return GetWithChannel(address).stub;
  }

  // The stub of `address` and its channel (to ask whether it is connected).
  struct StubAndChannel {
    std::shared_ptr<Stub> stub;
    std::shared_ptr<grpc::Channel> channel;
  };
  StubAndChannel GetWithChannel(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_) {
    const absl::Time now = clock_->Now();
    std::vector<StubAndChannel> dropped;  // closed after the lock is released
    absl::MutexLock lock(&mu_);
    // A sweep at most every idle / 4: lookups stay O(log n) however many
    // addresses there are.
    if (now - last_sweep_ >= idle_ / 4) {
      last_sweep_ = now;
      for (auto it = entries_.begin(); it != entries_.end();) {
        if (now - it->second.last_used < idle_) {
          ++it;
          continue;
        }
        dropped.push_back(std::move(it->second.handle));
        it = entries_.erase(it);
      }
    }
    Entry& e = entries_[address];
    if (e.handle.stub == nullptr) {
      e.handle.channel = CreateKeepaliveChannel(DialTarget(address), credentials_);
      e.handle.stub = Service::NewStub(e.handle.channel);
    }
    e.last_used = now;
    return e.handle;
  }

  // Drops the stub of `address`, if any: the next Get makes a new channel.
  // For a daemon registered there anew (restarted on its port): the old
  // channel may still be backing off from the refusals of the daemon that
  // died (gRPC waits a second or more before it connects again), and calls
  // on it would fail at once for that long. Calls in flight on the old stub
  // go on (their holders keep it).
  void Forget(const std::string& address) ABSL_LOCKS_EXCLUDED(mu_) {
    StubAndChannel dropped;  // closed after the lock is released
    {
      absl::MutexLock lock(&mu_);
      const auto it = entries_.find(address);
      if (it == entries_.end()) return;
      dropped = std::move(it->second.handle);
      entries_.erase(it);
    }
    // Calls that hold the old channel (waiting for it to connect) connect
    // at once, not after its backoff.
    grpc::experimental::ChannelResetConnectionBackoff(dropped.channel.get());
  }

  // How many addresses have a stub.
  size_t size() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    return entries_.size();
  }

 private:
  struct Entry {
    StubAndChannel handle;
    absl::Time last_used;
  };
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  const absl::Duration idle_;
  const Clock* const clock_;
  mutable absl::Mutex mu_;
  std::map<std::string, Entry> entries_ ABSL_GUARDED_BY(mu_);
  absl::Time last_sweep_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
};

}  // namespace colod

#endif  // COLOD_SERVER_STUB_CACHE_H_
