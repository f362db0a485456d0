// Bounds the coordinator's checks of registrations at their addresses
// (ProveWorkerKey). Each check holds a server thread until its deadline
// where the address never answers (a firewall that drops packets, a host
// that is down), so without bounds a few workers with a wrong
// --advertise-host, or one holder of the workers' token registering at
// addresses that never answer, would hold every server thread, or every
// check, and refuse every keyed registration.
#ifndef COLOD_SERVER_KEY_PROOF_GATE_H_
#define COLOD_SERVER_KEY_PROOF_GATE_H_

#include <cstddef>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"

namespace colod {

// The host a gRPC peer calls from, its port dropped: "ipv4:10.0.0.7:51234"
// -> "ipv4:10.0.0.7"; an IPv6 peer by its /64 ("ipv6:[2001:db8::7]:5000"
// or its percent-encoded form -> "ipv6:[2001:db8::]/64": one host may hold
// a whole /64); anything else ("unix:/path") as it is.
std::string PeerHost(absl::string_view peer);

// Admits checks: at most `max` at once, `max_per_peer` of them for callers
// on one host (PeerHost), one of an address per caller host (so a caller
// checking the address over and over holds up nobody else's check of
// it); and an address where a check ran to its deadline unanswered is
// answered so, without a call, for `unreachable_for` (a worker that cannot
// be reached tries again every few seconds; a refused connection holds no
// thread, and is not remembered). Thread-safe.
class KeyProofGate {
 public:
  struct Options {
    int max = 16;
    int max_per_peer = 4;
    // Each check's deadline (the caller's, where sooner).
    absl::Duration deadline = absl::Seconds(3);
    absl::Duration unreachable_for = absl::Seconds(15);
    // Unreachable addresses remembered at most (the oldest go first).
    size_t max_remembered = 4096;
    Clock *clock = Clock::Real();  // must outlive the gate
  };
  explicit KeyProofGate(Options options);
  const Options &options() const { return options_; }

  // OK where a check of `address` for a caller on `peer_host` may start:
  // Leave must follow. UNAVAILABLE, saying why and that the worker tries
  // again, where `max` checks run, `max_per_peer` from this host, one of
  // this address from this host, or where a check found `address`
  // unreachable within `unreachable_for`.
  absl::Status Enter(absl::string_view peer_host, absl::string_view address) ABSL_LOCKS_EXCLUDED(mu_);
  // The check Enter admitted ended; `unreachable`: it ran to its deadline
  // and nothing answered at the address.
  void Leave(absl::string_view peer_host, absl::string_view address, bool unreachable) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const Options options_;
  absl::Mutex mu_;
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<std::string, int> by_peer_ ABSL_GUARDED_BY(mu_);
  // "PEER_HOST ADDRESS" -> checks running.
  absl::flat_hash_map<std::string, int> by_address_ ABSL_GUARDED_BY(mu_);
  // Address -> when a check last found it unreachable.
  absl::flat_hash_map<std::string, absl::Time> unreachable_ ABSL_GUARDED_BY(mu_);
};

}  // namespace colod

#endif  // COLOD_SERVER_KEY_PROOF_GATE_H_
