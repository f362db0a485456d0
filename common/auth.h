// Bearer-token authentication of colod's gRPC services. Every colod service
// call carries "authorization: Bearer <token>" when the daemons were started
// with --auth-token-file; health checks and reflection stay open (they are
// separate services), so probes work without the token.
//
// Calls have one of two roles. A client's (submitting, watching and
// cancelling jobs, tensors, uploads) carries the client token; a worker's
// (registering, heartbeats, progress reports, the rendezvous store, model
// downloads), and the coordinator's calls to the workers, carry the worker
// token where the coordinator has one (--worker-token-file), so that
// holding the client token is not enough to pose as a worker or to drive one.
//
// Thread-safety: TokenAuth is immutable.
#ifndef COLOD_COMMON_AUTH_H_
#define COLOD_COMMON_AUTH_H_

#include <atomic>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace colod {

// The token in `path` (surrounding whitespace trimmed). NOT_FOUND for a
// missing file, INVALID_ARGUMENT for an empty one or one CheckAuthToken
// refuses; each error names `flag`.
absl::StatusOr<std::string> ReadAuthToken(const std::string& path, absl::string_view flag = "--auth-token-file");
// OK when `token` can travel in the authorization header: printable ASCII
// only (0x20 to 0x7e; RFC 6750's tokens are a part of it). INVALID_ARGUMENT
// naming the first other byte and where it is: a line break, a tab or a
// byte of UTF-8 (which gRPC would abort the process on, sending it).
absl::Status CheckAuthToken(absl::string_view token);

// A worker's key (RegisterWorkerRequest.worker_key): a secret of one worker
// process that ties calls to it, beside the workers' token, which all
// workers share. Travels as the metadata kWorkerKeyMetadata.
inline constexpr char kWorkerKeyMetadata[] = "colod-worker-key";
// 32 random hex digits.
std::string NewWorkerKey();
// OK for an empty key or one of 16 to 256 printable ASCII bytes;
// INVALID_ARGUMENT otherwise.
absl::Status CheckWorkerKey(absl::string_view key);
// Whether the call carries `key` (compared in constant time).
bool CarriesWorkerKey(const grpc::ServerContext& ctx, absl::string_view key);
// Adds `key` (if any) to an outgoing call.
void AddWorkerKey(grpc::ClientContext& ctx, const std::string& key);

// A worker process's key (NewWorkerKey), and whether the coordinator it
// registered with took it (RegisterWorkerResponse.worker_key_taken): then
// every call to the worker must carry it. Thread-safe.
class WorkerKey {
 public:
  WorkerKey() : key_(NewWorkerKey()) {}
  const std::string& key() const { return key_; }
  void SetTaken(bool taken) { taken_.store(taken); }
  // OK where the call carries this key, or none while the coordinator has
  // not taken it (it sends none); PERMISSION_DENIED otherwise (CheckNotOther).
  absl::Status Check(const grpc::ServerContext& ctx) const;
  // PERMISSION_DENIED for a call carrying another key, before registration
  // too: the coordinator's calls for a worker process that listened at this
  // address before (a daemon restarted on its port) carry that process's
  // key, and this one must not run its ranks; and the coordinator proves a
  // registration's key by calling the address with it (ProveWorkerKey). OK
  // for a call carrying this key or none.
  absl::Status CheckNotOther(const grpc::ServerContext& ctx) const;

 private:
  const std::string key_;
  std::atomic<bool> taken_{false};
};

// Who may make a call: see the file comment.
enum class CallerRole { kClient, kWorker };

class TokenAuth {
 public:
  // `token` admits clients' calls, and workers' too where `worker_token` is
  // empty (one token, every role). `worker_token` admits workers' calls,
  // and only those. An empty token accepts every call of its role.
  // `key`, a worker's own (null elsewhere): its workers' calls must also
  // carry it (WorkerKey::Check).
  explicit TokenAuth(std::string token = "", std::string worker_token = "",
                     std::shared_ptr<const WorkerKey> key = nullptr)
      : token_(std::move(token)), worker_token_(std::move(worker_token)), key_(std::move(key)) {}
  // OK when the call carries the token of `role` (compared in constant
  // time), and a worker's key where there is one. PERMISSION_DENIED when it
  // carries the other role's token (authenticated, but not for this call)
  // or not the key; UNAUTHENTICATED otherwise.
  absl::Status Check(const grpc::ServerContext& ctx, CallerRole role) const;
  // The token, and no other worker's key (WorkerKey::CheckNotOther), but
  // not this worker's: for a worker's reads (GetStatus, which probes and
  // tests call, and the coordinator's proof of a registration's key).
  absl::Status CheckToken(const grpc::ServerContext& ctx, CallerRole role) const;
  // Whether the call carries this worker's own key (compared in constant
  // time); false where there is none: GetStatusResponse.worker_key_held.
  bool CarriesOwnKey(const grpc::ServerContext& ctx) const;

 private:
  // The bearer token of `role` alone.
  absl::Status CheckBearer(const grpc::ServerContext& ctx, CallerRole role) const;

  std::string token_;
  std::string worker_token_;  // empty: token_ plays both roles
  std::shared_ptr<const WorkerKey> key_;
};

// Adds the token (if any) to an outgoing call.
void AddAuthToken(grpc::ClientContext& ctx, const std::string& token);

// TLS files (PEM) of a daemon or client: --tls-cert, --tls-key, --tls-ca.
// All empty: plaintext. cert + key: the server side of TLS. With ca too, a
// server requires and verifies client certificates signed by it (mutual
// TLS), and a client verifies the server against it and presents its own
// cert + key when given.
struct TlsFiles {
  std::string cert, key, ca;
  // How often the files are read again (a renewed certificate, a rotated
  // CA), with --tls-ca given: a server then presents the new certificate and
  // trusts the new CA from the next handshake on, and a channel does as a
  // client; connections already up stay. Zero reads them once, here (so
  // does a client without a CA, which trusts the system's). The files must
  // be replaced at once (the kubelet swaps a directory behind a symbolic
  // link): an unreadable or empty file keeps the last good ones, but a key
  // that does not match its certificate, or a file that does not parse,
  // fails every new handshake until it is fixed (gRPC's
  // FileWatcherCertificateProvider).
  absl::Duration refresh = absl::ZeroDuration();
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};
// The help of the daemons' --tls-refresh-interval (TlsFiles::refresh).
inline constexpr char kTlsRefreshIntervalHelp[] =
    "With --tls-ca: how often the TLS files are read again, so that a renewed certificate or a rotated "
    "CA (a Kubernetes Secret updated in place) is served and trusted from the next connection on, with no "
    "restart. Replace the files at once (as the kubelet does): an unreadable or empty file keeps the last "
    "good ones, but a key that does not match its certificate fails new connections until fixed. 0 reads "
    "them once, at start.";
// INVALID_ARGUMENT naming the flag for a cert without a key (or the other
// way round) or a file that holds no PEM block; NOT_FOUND for a file that
// cannot be read. (The files are checked here; a later read is as `refresh`
// says.)
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsFiles& tls);
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsFiles& tls);

}  // namespace colod

#endif  // COLOD_COMMON_AUTH_H_
