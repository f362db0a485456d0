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
// A token file holds one token or several, a line each: a process sends
// the first and takes every one, so that a token is changed with no call
// refused (AuthToken).
//
// Thread-safety: TokenAuth is immutable; AuthToken and WorkerKey are
// thread-safe.
#ifndef COLOD_COMMON_AUTH_H_
#define COLOD_COMMON_AUTH_H_

#include <atomic>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace colod {

// The tokens in `path`: a token a line, each line's surrounding whitespace
// trimmed and blank lines skipped, in the file's order. NOT_FOUND for a
// missing file; INVALID_ARGUMENT for a file of no token, one over 64 KiB
// or over 64 tokens, or a line that CheckAuthToken refuses (naming the
// line, never its text); each error names `flag` and the file.
absl::StatusOr<std::vector<std::string>> ReadAuthTokens(const std::string& path,
                                                        absl::string_view flag = "--auth-token-file");
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

// The generation of its job (and the job's uid, Job.uid) a coordinator's
// call to a worker is meant for (the tensor calls): a worker that runs
// another refuses it, so that a call sent as the job was placed again
// cannot reach its new ranks.
inline constexpr char kJobGenerationMetadata[] = "colod-job-generation";
inline constexpr char kJobUidMetadata[] = "colod-job-uid";
struct CallGeneration {
  int64_t generation = 0;
  std::string job_uid;  // "" none
};
void AddJobGeneration(grpc::ClientContext& ctx, int64_t generation, const std::string& job_uid);
// The generation a call carries; nullopt where it carries none (a client's
// call, an older coordinator's); INVALID_ARGUMENT where it is not a number
// or the uid is not 1 to 64 printable ASCII bytes.
absl::StatusOr<std::optional<CallGeneration>> JobGenerationOf(const grpc::ServerContext& ctx);

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

// The bearer tokens of one role: none (no authentication), one, or
// several from a token file (ReadAuthTokens). The first is the one sent
// (Sent), and every one is taken (CarriedBy). A token is rotated with no
// call refused in three steps, each once every daemon has read its file
// again (--auth-token-refresh-interval, a minute): the new token added as
// a second line, then moved first, then the old one dropped.
//
// AuthToken is a handle: its copies share the tokens, which FromFile's
// thread replaces as the file changes; that thread ends with the last copy.
// Thread-safe.
class AuthToken {
 public:
  // No token: every call is taken, and none carries a token.
  AuthToken() = default;
  // The one token `token`, for good; none where it is empty. Implicit: a
  // string is a token (clients' options, tests).
  AuthToken(std::string token);                                    // NOLINT(google-explicit-constructor)
  AuthToken(const char* token) : AuthToken(std::string(token)) {}  // NOLINT(google-explicit-constructor)
  // The tokens of `path` (ReadAuthTokens, its errors naming `flag`), read
  // again every `refresh` by a thread of its own, where `path` is a regular
  // file (a pipe is read once). A new content is taken once two reads in a
  // row agree (the second within 200 ms): a read in the middle of a write
  // would take a cut token. A read that fails (a file removed, emptied,
  // garbled, or sharing a token with KeepApartFrom's) keeps the tokens read
  // last, and says why in the log once. Zero reads the file once, here;
  // INVALID_ARGUMENT for another `refresh` under 10 ms
  // (CheckTokenRefresh).
  static absl::StatusOr<AuthToken> FromFile(const std::string& path, absl::string_view flag,
                                            absl::Duration refresh = absl::ZeroDuration());

  // Whether there is no token.
  bool empty() const { return state_ == nullptr; }
  // The token sent ("" where there is none).
  std::string Sent() const;
  // Every token taken, the sent one first.
  std::vector<std::string> All() const;
  // Whether `authorization` is "Bearer " and one of the tokens, compared
  // with each in constant time in the token's length.
  bool CarriedBy(absl::string_view authorization) const;
  // Whether a token is both this one's and `other`'s.
  bool SharesATokenWith(const AuthToken& other) const;
  // From now on, a read of this one's file that holds a token of `other`
  // is refused as a bad read: the coordinator keeps its clients' and its
  // workers' tokens apart (Start refuses them shared). Held weakly.
  void KeepApartFrom(const AuthToken& other);
  // The times the file was read again so far (tests).
  int64_t reads() const;

 private:
  struct State;
  std::shared_ptr<State> state_;
};

// OK for a refresh of 0 or at least 10 ms; INVALID_ARGUMENT naming
// --auth-token-refresh-interval otherwise.
absl::Status CheckTokenRefresh(absl::Duration refresh);

// The help of the daemons' --auth-token-refresh-interval.
inline constexpr char kAuthTokenRefreshIntervalHelp[] =
    "How often the token files (--auth-token-file, the coordinator's --worker-token-file) are read again, so "
    "that a token is rotated with no restart and no call refused: a file holds a token a line, the first is "
    "sent and each is taken; add the new token as a second line everywhere, move it first once every daemon "
    "has read it, then drop the old one. Replace a file at once (a rename, as the kubelet does). A read that "
    "fails (a file removed or emptied, a line that is not a good token) keeps the tokens read last (logged). 0 "
    "reads them once, at start; another value must be at least 10ms.";

// Who may make a call: see the file comment.
enum class CallerRole { kClient, kWorker };

class TokenAuth {
 public:
  // `token` admits clients' calls, and workers' too where `worker_token` is
  // empty (one token, every role). `worker_token` admits workers' calls,
  // and only those. An empty token accepts every call of its role.
  // `key`, a worker's own (null elsewhere): its workers' calls must also
  // carry it (WorkerKey::Check).
  explicit TokenAuth(AuthToken token = {}, AuthToken worker_token = {}, std::shared_ptr<const WorkerKey> key = nullptr)
      : token_(std::move(token)), worker_token_(std::move(worker_token)), key_(std::move(key)) {}
  // OK when the call carries a token of `role` (compared in constant
  // time), and a worker's key where there is one. PERMISSION_DENIED when it
  // carries the other role's token (authenticated, but not for this call),
  // a token of both roles (a line of both files: it admits neither until
  // one drops it) or not the key; UNAUTHENTICATED otherwise.
  absl::Status Check(const grpc::ServerContext& ctx, CallerRole role) const;
  // The token, and no other worker's key (WorkerKey::CheckNotOther), but
  // not this worker's: for a worker's reads (GetStatus, which probes and
  // tests call, and the coordinator's proof of a registration's key).
  absl::Status CheckToken(const grpc::ServerContext& ctx, CallerRole role) const;
  // Whether the call carries this worker's own key (compared in constant
  // time); false where there is none: GetStatusResponse.worker_key_held.
  bool CarriesOwnKey(const grpc::ServerContext& ctx) const;
  // The bearer token of `role` alone, from the call's `authorization`
  // metadata (nullopt: the call has none), as Check gives it.
  absl::Status CheckBearer(std::optional<absl::string_view> authorization, CallerRole role) const;

 private:
  absl::Status CheckBearer(const grpc::ServerContext& ctx, CallerRole role) const;

  AuthToken token_;
  AuthToken worker_token_;  // empty: token_ plays both roles
  std::shared_ptr<const WorkerKey> key_;
};

// Adds the token sent (if any) to an outgoing call.
void AddAuthToken(grpc::ClientContext& ctx, const AuthToken& token);

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
