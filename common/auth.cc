#include "common/auth.h"

#include <sys/stat.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "absl/algorithm/container.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/atomic_file.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"

namespace colod {

namespace {

// A token file's tokens, and whether it is a regular file (not a pipe).
struct TokenFile {
  std::vector<std::string> tokens;
  bool regular = false;
};

// ReadAuthTokens, with one stat of the file: with `regular_only`, a file that
// is not a regular one is refused unread (a FIFO whose writer holds it open
// would block the read).
absl::StatusOr<TokenFile> ReadTokenFile(const std::string& path, absl::string_view flag, bool regular_only) {
  constexpr size_t kMaxBytes = 64 << 10;
  constexpr size_t kMaxTokens = 64;
  auto too_large = [&] {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' is over 64 KiB: a token file holds a token a line"));
  };
  TokenFile out;
  if (struct stat info; ::stat(path.c_str(), &info) == 0) {
    out.regular = S_ISREG(info.st_mode);
    if (!out.regular && regular_only) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' is no longer a regular file"));
    }
    if (out.regular && static_cast<uint64_t>(info.st_size) > kMaxBytes) {
      return too_large();  // not read: a huge file would be read whole, every refresh
    }
  }
  auto text = ReadFileToString(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat(flag, ": ", text.status().message()));
  if (text->size() > kMaxBytes) return too_large();
  std::vector<std::string> tokens;
  int line = 0;
  for (absl::string_view l : absl::StrSplit(*text, '\n')) {
    ++line;
    const absl::string_view token = absl::StripAsciiWhitespace(l);
    if (token.empty()) continue;
    if (absl::Status s = CheckAuthToken(token); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' line ", line, ": ", s.message()));
    }
    if (tokens.size() == kMaxTokens) {
      return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' holds over 64 tokens"));
    }
    tokens.emplace_back(token);
  }
  if (tokens.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' holds no token"));
  out.tokens = std::move(tokens);
  return out;
}

// Whether `got` equals `want`, in constant time in `want`'s length: no
// early exit on the first mismatch.
bool ConstantTimeEqual(absl::string_view got, absl::string_view want) {
  unsigned char diff = got.size() == want.size() ? 0 : 1;
  for (size_t i = 0; i < want.size(); ++i) {
    diff |= static_cast<unsigned char>(want[i] ^ (i < got.size() ? got[i] : 0));
  }
  return diff == 0;
}

// Whether a token of `a` is one of `b`'s.
bool AnyShared(const std::vector<std::string>& a, const std::vector<std::string>& b) {
  return std::any_of(a.begin(), a.end(),
                     [&](const std::string& t) { return std::find(b.begin(), b.end(), t) != b.end(); });
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ReadAuthTokens(const std::string& path, absl::string_view flag) {
  ASSIGN_OR_RETURN(TokenFile file, ReadTokenFile(path, flag, /*regular_only=*/false));
  return std::move(file.tokens);
}

absl::Status CheckAuthToken(absl::string_view token) {
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char c = static_cast<unsigned char>(token[i]);
    if (c >= 0x20 && c <= 0x7e) continue;
    return absl::InvalidArgumentError(absl::StrFormat(
        "the token holds byte 0x%02x at offset %d, which is not printable ASCII: a bearer token is one line of "
        "printable characters (no line break, tab, control or non-ASCII byte)",
        c, i));
  }
  return absl::OkStatus();
}

absl::Status CheckTokenRefresh(absl::Duration refresh) {
  if (refresh == absl::ZeroDuration() || refresh >= absl::Milliseconds(10)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      "--auth-token-refresh-interval: must be 0 (the files are read once) or at least 10ms");
}

struct AuthToken::State {
  explicit State(std::string flag) : flag(std::move(flag)) {}
  ~State() {
    {
      absl::MutexLock lock(&mu);
      stop = true;
    }
    if (reader.joinable()) reader.join();
  }
  std::vector<std::string> Tokens() const {
    absl::MutexLock lock(&mu);
    return tokens;
  }
  // Reads the file again every `refresh` until `stop`.
  void ReadAgain(const std::string& path, absl::Duration refresh);
  // The tokens of a read of the file, checked against the other role's
  // (KeepApartFrom): INVALID_ARGUMENT naming both flags for a shared one.
  absl::StatusOr<std::vector<std::string>> Read(const std::string& path) const;

  const std::string flag;  // names the file in messages
  mutable absl::Mutex mu;
  std::vector<std::string> tokens ABSL_GUARDED_BY(mu);  // never empty
  bool stop ABSL_GUARDED_BY(mu) = false;
  int64_t reads ABSL_GUARDED_BY(mu) = 0;
  // Weak: the two roles' states keep each other apart, and must not keep
  // each other (and their threads) alive.
  std::weak_ptr<const State> apart ABSL_GUARDED_BY(mu);
  std::thread reader;
};

absl::StatusOr<std::vector<std::string>> AuthToken::State::Read(const std::string& path) const {
  // A FIFO whose writer holds it open would block the read, and ~State's join.
  ASSIGN_OR_RETURN(TokenFile read, ReadTokenFile(path, flag, /*regular_only=*/true));
  std::shared_ptr<const State> other;
  {
    absl::MutexLock lock(&mu);
    other = apart.lock();
  }
  if (other != nullptr && AnyShared(read.tokens, other->Tokens())) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' holds a token of ", other->flag,
                                                   ": one role's token may not admit the other's calls"));
  }
  return std::move(read.tokens);
}

void AuthToken::State::ReadAgain(const std::string& path, absl::Duration refresh) {
  // A content that differs from the tokens is taken once two reads in a row
  // agree, the second soon after the first: a read in the middle of a write
  // that is not made at once (an editor's, a shell's >) would take a cut
  // token and drop the lines after it.
  const absl::Duration settle = std::min(refresh, absl::Milliseconds(200));
  std::optional<std::vector<std::string>> pending;
  std::string said;  // the last failure logged, so that each is logged once
  while (true) {
    {
      absl::MutexLock lock(&mu);
      if (mu.AwaitWithTimeout(absl::Condition(&stop), pending.has_value() ? settle : refresh)) return;
    }
    absl::StatusOr<std::vector<std::string>> read = Read(path);  // no lock held
    std::string changed;                                         // logged once the lock is released
    {
      absl::MutexLock lock(&mu);
      ++reads;
      if (!read.ok() || *read == tokens) {
        pending.reset();
      } else if (!pending.has_value() || *pending != *read) {
        pending = *read;  // taken if the next read agrees
      } else {
        pending.reset();
        const bool sent_changed = read->front() != tokens.front();
        tokens = *read;
        changed = absl::StrCat(flag, ": read again, ", tokens.size(), tokens.size() == 1 ? " token" : " tokens",
                               sent_changed ? "; the token sent changed" : "; the token sent is the same");
      }
    }
    if (!changed.empty()) COLOD_LOG(INFO) << changed;
    if (read.ok()) {
      said.clear();
    } else if (read.status().message() != said) {
      said = std::string(read.status().message());
      COLOD_LOG(WARNING) << said << ": the tokens read before stay";
    }
  }
}

AuthToken::AuthToken(std::string token) {
  if (token.empty()) return;
  state_ = std::make_shared<State>("a token");
  absl::MutexLock lock(&state_->mu);
  state_->tokens.push_back(std::move(token));
}

absl::StatusOr<AuthToken> AuthToken::FromFile(const std::string& path, absl::string_view flag, absl::Duration refresh) {
  RETURN_IF_ERROR(CheckTokenRefresh(refresh));
  ASSIGN_OR_RETURN(TokenFile file, ReadTokenFile(path, flag, /*regular_only=*/false));
  AuthToken out;
  out.state_ = std::make_shared<State>(std::string(flag));
  {
    absl::MutexLock lock(&out.state_->mu);
    out.state_->tokens = std::move(file.tokens);
  }
  if (refresh > absl::ZeroDuration() && file.regular) {
    // The thread holds the state, not a handle: it ends with the last handle
    // (~State). A pipe (a shell's <(...)) is read once.
    out.state_->reader = std::thread([s = out.state_.get(), path, refresh] { s->ReadAgain(path, refresh); });
  }
  return out;
}

void AuthToken::KeepApartFrom(const AuthToken& other) {
  if (state_ == nullptr || other.state_ == nullptr) return;
  absl::MutexLock lock(&state_->mu);
  state_->apart = other.state_;
}

int64_t AuthToken::reads() const {
  if (state_ == nullptr) return 0;
  absl::MutexLock lock(&state_->mu);
  return state_->reads;
}

std::string AuthToken::Sent() const {
  if (state_ == nullptr) return "";
  absl::MutexLock lock(&state_->mu);
  return state_->tokens.front();
}

std::vector<std::string> AuthToken::All() const {
  if (state_ == nullptr) return {};
  return state_->Tokens();
}

bool AuthToken::CarriedBy(absl::string_view authorization) const {
  if (state_ == nullptr) return false;
  constexpr absl::string_view kBearer = "Bearer ";
  const bool bearer = absl::StartsWith(authorization, kBearer);
  const absl::string_view got = bearer ? authorization.substr(kBearer.size()) : authorization;
  absl::MutexLock lock(&state_->mu);
  bool any = false;
  for (const std::string& token : state_->tokens) any |= ConstantTimeEqual(got, token);  // each, no early exit
  return bearer && any;
}

bool AuthToken::SharesATokenWith(const AuthToken& other) const {
  return AnyShared(All(), other.All());  // each copied under its own lock: no two locks at once
}

absl::Status TokenAuth::Check(const grpc::ServerContext& ctx, CallerRole role) const {
  RETURN_IF_ERROR(CheckBearer(ctx, role));
  if (role == CallerRole::kWorker && key_ != nullptr) return key_->Check(ctx);
  return absl::OkStatus();
}

absl::Status TokenAuth::CheckToken(const grpc::ServerContext& ctx, CallerRole role) const {
  RETURN_IF_ERROR(CheckBearer(ctx, role));
  if (role == CallerRole::kWorker && key_ != nullptr) return key_->CheckNotOther(ctx);
  return absl::OkStatus();
}

absl::Status TokenAuth::CheckBearer(const grpc::ServerContext& ctx, CallerRole role) const {
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) return CheckBearer(std::nullopt, role);
  return CheckBearer(absl::string_view(it->second.data(), it->second.size()), role);
}

absl::Status TokenAuth::CheckBearer(std::optional<absl::string_view> authorization, CallerRole role) const {
  const bool worker_call = role == CallerRole::kWorker && !worker_token_.empty();
  const AuthToken& want = worker_call ? worker_token_ : token_;
  if (want.empty()) return absl::OkStatus();
  if (!authorization.has_value()) {
    return absl::UnauthenticatedError(
        "missing bearer token (authorization metadata): this daemon was started with a token, give the caller "
        "its --auth-token-file");
  }
  const absl::string_view got = *authorization;
  const bool mine = want.CarriedBy(got);
  // Both roles' are compared, so the time says nothing of which one was close.
  const bool other = !worker_token_.empty() && (worker_call ? token_ : worker_token_).CarriedBy(got);
  if (mine && !other) return absl::OkStatus();
  if (mine) {
    return absl::PermissionDeniedError(
        "the call's token is both the clients' and the workers' (a line of both the coordinator's "
        "--auth-token-file and its --worker-token-file): it admits no call until one of the files drops it");
  }
  if (other) {
    return absl::PermissionDeniedError(
        worker_call ? "this call is a worker's: the client token does not admit it (workers carry the "
                      "coordinator's --worker-token-file)"
                    : "this call is a client's: the worker token does not admit it (clients carry the "
                      "coordinator's --auth-token-file)");
  }
  return absl::UnauthenticatedError(
      "invalid bearer token: the caller's --auth-token-file holds a token this daemon does not take");
}

void AddAuthToken(grpc::ClientContext& ctx, const AuthToken& token) {
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token.Sent());
}

std::string NewWorkerKey() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&out, absl::Hex(rd(), absl::kZeroPad8));
  return out;
}

absl::Status CheckWorkerKey(absl::string_view key) {
  if (key.empty()) return absl::OkStatus();
  if (key.size() < 16 || key.size() > 256) {
    return absl::InvalidArgumentError(absl::StrCat("worker_key: ", key.size(), " bytes, not 16 to 256"));
  }
  if (absl::Status s = CheckAuthToken(key); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("worker_key: ", s.message()));
  }
  return absl::OkStatus();
}

bool CarriesWorkerKey(const grpc::ServerContext& ctx, absl::string_view key) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(kWorkerKeyMetadata);
  if (it == md.end()) return false;
  return ConstantTimeEqual(absl::string_view(it->second.data(), it->second.size()), key);
}

void AddWorkerKey(grpc::ClientContext& ctx, const std::string& key) {
  if (!key.empty()) ctx.AddMetadata(kWorkerKeyMetadata, key);
}

void AddJobGeneration(grpc::ClientContext& ctx, int64_t generation, const std::string& job_uid) {
  ctx.AddMetadata(kJobGenerationMetadata, absl::StrCat(generation));
  if (!job_uid.empty()) ctx.AddMetadata(kJobUidMetadata, job_uid);
}

absl::StatusOr<std::optional<CallGeneration>> JobGenerationOf(const grpc::ServerContext& ctx) {
  const auto& md = ctx.client_metadata();
  auto it = md.find(kJobGenerationMetadata);
  if (it == md.end()) return std::optional<CallGeneration>();
  const absl::string_view text(it->second.data(), it->second.size());
  CallGeneration call;
  if (!absl::SimpleAtoi(text, &call.generation) || call.generation < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(kJobGenerationMetadata, ": not a generation: '", absl::CHexEscape(text.substr(0, 32)), "'"));
  }
  if (auto uid = md.find(kJobUidMetadata); uid != md.end()) {
    call.job_uid = std::string(uid->second.data(), uid->second.size());
    if (call.job_uid.empty() || call.job_uid.size() > 64 ||
        !absl::c_all_of(call.job_uid, [](char c) { return absl::ascii_isgraph(static_cast<unsigned char>(c)); })) {
      return absl::InvalidArgumentError(
          absl::StrCat(kJobUidMetadata, ": not a job uid: '", absl::CHexEscape(call.job_uid.substr(0, 32)), "'"));
    }
  }
  return std::optional<CallGeneration>(std::move(call));
}

absl::Status WorkerKey::CheckNotOther(const grpc::ServerContext& ctx) const {
  const auto& md = ctx.client_metadata();
  auto it = md.find(kWorkerKeyMetadata);
  if (it == md.end() || ConstantTimeEqual(absl::string_view(it->second.data(), it->second.size()), key_)) {
    return absl::OkStatus();
  }
  return absl::PermissionDeniedError(
      "the call carries another worker process's key (colod-worker-key): it is meant for a worker that listened at "
      "this address before (this daemon holds another key and registers as a worker of its own)");
}

bool TokenAuth::CarriesOwnKey(const grpc::ServerContext& ctx) const {
  return key_ != nullptr && CarriesWorkerKey(ctx, key_->key());
}

absl::Status WorkerKey::Check(const grpc::ServerContext& ctx) const {
  RETURN_IF_ERROR(CheckNotOther(ctx));
  if (!taken_.load() || CarriesWorkerKey(ctx, key_)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      "this worker takes calls only from its coordinator: the call does not carry the worker's key (colod-worker-key)");
}

namespace {

// A PEM file's text: NOT_FOUND when it cannot be read, INVALID_ARGUMENT
// when it holds no PEM block (an empty --tls-ca would otherwise make gRPC
// trust the system's CAs instead, without a word).
absl::StatusOr<std::string> ReadPem(const std::string& path, const char* flag) {
  auto text = ReadFileToString(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat(flag, ": ", text.status().message()));
  if (text->find("-----BEGIN ") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", path, "' holds no PEM block (-----BEGIN ...-----)", text->empty() ? ": it is empty" : ""));
  }
  return text;
}

absl::Status CheckPair(const TlsFiles& tls) {
  if (tls.cert.empty() != tls.key.empty()) {
    return absl::InvalidArgumentError("--tls-cert and --tls-key go together");
  }
  if (tls.refresh < absl::ZeroDuration()) return absl::InvalidArgumentError("--tls-refresh-interval: must be >= 0");
  return absl::OkStatus();
}

// The files, read again every tls.refresh (at least a second), where they
// are to be.
std::shared_ptr<grpc::experimental::CertificateProviderInterface> Watcher(const TlsFiles& tls) {
  const int64_t seconds = std::clamp<int64_t>(absl::ToInt64Seconds(tls.refresh), 1, int64_t{1} << 30);
  return std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(tls.key, tls.cert, tls.ca,
                                                                             static_cast<unsigned int>(seconds));
}

}  // namespace

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> MakeServerCredentials(const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureServerCredentials();
  RETURN_IF_ERROR(CheckPair(tls));
  if (tls.cert.empty()) return absl::InvalidArgumentError("a TLS server needs --tls-cert and --tls-key");
  const grpc_ssl_client_certificate_request_type request =
      tls.ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                     : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY;
  grpc::SslServerCredentialsOptions o(request);
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.private_key, ReadPem(tls.key, "--tls-key"));
  ASSIGN_OR_RETURN(pair.cert_chain, ReadPem(tls.cert, "--tls-cert"));
  o.pem_key_cert_pairs.push_back(pair);
  if (!tls.ca.empty()) {
    ASSIGN_OR_RETURN(o.pem_root_certs, ReadPem(tls.ca, "--tls-ca"));
  }
  if (tls.ca.empty() || tls.refresh <= absl::ZeroDuration()) return grpc::SslServerCredentials(o);
  grpc::experimental::TlsServerCredentialsOptions watched(Watcher(tls));
  watched.watch_identity_key_cert_pairs();
  watched.watch_root_certs();
  watched.set_cert_request_type(request);
  std::shared_ptr<grpc::ServerCredentials> out = grpc::experimental::TlsServerCredentials(watched);
  if (out == nullptr) return absl::InternalError("gRPC made no TLS server credentials of the files");
  return out;
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> MakeChannelCredentials(const TlsFiles& tls) {
  if (!tls.enabled()) return grpc::InsecureChannelCredentials();
  RETURN_IF_ERROR(CheckPair(tls));
  grpc::SslCredentialsOptions o;
  if (!tls.ca.empty()) {
    ASSIGN_OR_RETURN(o.pem_root_certs, ReadPem(tls.ca, "--tls-ca"));
  }
  if (!tls.cert.empty()) {
    ASSIGN_OR_RETURN(o.pem_private_key, ReadPem(tls.key, "--tls-key"));
    ASSIGN_OR_RETURN(o.pem_cert_chain, ReadPem(tls.cert, "--tls-cert"));
  }
  if (tls.ca.empty() || tls.refresh <= absl::ZeroDuration()) return grpc::SslCredentials(o);
  grpc::experimental::TlsChannelCredentialsOptions watched;
  watched.set_certificate_provider(Watcher(tls));
  watched.watch_root_certs();
  if (!tls.cert.empty()) watched.watch_identity_key_cert_pairs();
  watched.set_verify_server_certs(true);
  // The server's certificate must name the address dialled, as with
  // SslCredentials.
  watched.set_certificate_verifier(std::make_shared<grpc::experimental::HostNameCertificateVerifier>());
  std::shared_ptr<grpc::ChannelCredentials> out = grpc::experimental::TlsCredentials(watched);
  if (out == nullptr) return absl::InternalError("gRPC made no TLS channel credentials of the files");
  return out;
}

}  // namespace colod
