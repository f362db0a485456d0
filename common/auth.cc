#include "common/auth.h"

#include <algorithm>
#include <fstream>
#include <random>
#include <sstream>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_certificate_verifier.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "common/status_macros.h"

namespace colod {

absl::StatusOr<std::string> ReadAuthToken(const std::string& path, absl::string_view flag) {
  auto text = ReadFileToString(path);
  if (!text.ok()) return absl::NotFoundError(absl::StrCat(flag, ": ", text.status().message()));
  std::string token(absl::StripAsciiWhitespace(*text));
  if (token.empty()) return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "' is empty"));
  if (absl::Status s = CheckAuthToken(token); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": '", path, "': ", s.message()));
  }
  return token;
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

namespace {

// Whether `got` equals `want`, in constant time in `want`'s length: no
// early exit on the first mismatch.
bool ConstantTimeEqual(absl::string_view got, absl::string_view want) {
  unsigned char diff = got.size() == want.size() ? 0 : 1;
  for (size_t i = 0; i < want.size(); ++i) {
    diff |= static_cast<unsigned char>(want[i] ^ (i < got.size() ? got[i] : 0));
  }
  return diff == 0;
}

// Whether `header` is "Bearer " + `token`.
bool CarriesToken(absl::string_view header, const std::string& token) {
  return ConstantTimeEqual(header, "Bearer " + token);
}

}  // namespace

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
  const bool worker_call = role == CallerRole::kWorker && !worker_token_.empty();
  const std::string& want = worker_call ? worker_token_ : token_;
  if (want.empty()) return absl::OkStatus();
  const auto& md = ctx.client_metadata();
  auto it = md.find("authorization");
  if (it == md.end()) {
    return absl::UnauthenticatedError(
        "missing bearer token (authorization metadata): this daemon was started with a token, give the caller "
        "its --auth-token-file");
  }
  const absl::string_view got(it->second.data(), it->second.size());
  if (CarriesToken(got, want)) return absl::OkStatus();
  if (!worker_token_.empty()) {
    // Both are compared, so the time says nothing of which one was close.
    const bool other = CarriesToken(got, worker_call ? token_ : worker_token_);
    if (other && !(worker_call ? token_ : worker_token_).empty()) {
      return absl::PermissionDeniedError(
          worker_call ? "this call is a worker's: the client token does not admit it (workers carry the "
                        "coordinator's --worker-token-file)"
                      : "this call is a client's: the worker token does not admit it (clients carry the "
                        "coordinator's --auth-token-file)");
    }
  }
  return absl::UnauthenticatedError(
      "invalid bearer token: the caller's --auth-token-file holds a token this daemon does not take");
}

void AddAuthToken(grpc::ClientContext& ctx, const std::string& token) {
  if (!token.empty()) ctx.AddMetadata("authorization", "Bearer " + token);
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
