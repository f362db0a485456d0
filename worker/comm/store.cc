#include "worker/comm/store.h"

#include <openssl/evp.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/logging.h"
#include "common/rendezvous_store.h"
#include "common/status_macros.h"

namespace colod {
namespace {

absl::Status ValidateKey(absl::string_view key) {
  if (key.empty()) return absl::InvalidArgumentError("key: must not be empty");
  if (key.size() > RendezvousStore::kMaxKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("key: longer than ", RendezvousStore::kMaxKeyBytes, " bytes"));
  }
  return absl::OkStatus();
}

}  // namespace

InMemoryStore::InMemoryStore() : InMemoryStore(std::make_shared<RendezvousStore>(), "default") {}

InMemoryStore::InMemoryStore(std::shared_ptr<RendezvousStore> shared, std::string scope)
    : store_(std::move(shared)), scope_(std::move(scope)) {}

InMemoryStore::~InMemoryStore() = default;

absl::Status InMemoryStore::Set(absl::string_view key, std::string value) {
  return store_->Set(scope_, key, std::move(value));
}

absl::StatusOr<std::string> InMemoryStore::Get(absl::string_view key) {
  return store_->Get(scope_, key);
}

absl::StatusOr<std::vector<std::string>> InMemoryStore::Wait(const std::vector<std::string>& keys,
                                                             absl::Duration timeout) {
  return store_->Wait(scope_, keys, timeout);
}

absl::StatusOr<std::unique_ptr<FileStore>> FileStore::Open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir)) {
    return absl::FailedPreconditionError(
        absl::StrCat("file store: cannot create directory '", dir, "': ", ec.message()));
  }
  return std::unique_ptr<FileStore>(new FileStore(dir));
}

std::string FileStore::PathOf(absl::string_view key) const {
  // Hex keeps any key (slashes, dots, bytes) a flat, valid file name. A
  // long key's hex (Gloo's name the group's ranks) would pass NAME_MAX (255,
  // with WriteFileAtomically's ".tmp.PID.N"): its SHA-256 names it then,
  // a name no hex key has.
  constexpr size_t kMaxHexName = 160;
  std::string hex = absl::BytesToHexString(key);
  if (hex.size() <= kMaxHexName) return absl::StrCat(dir_, "/", hex);
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_Digest(key.data(), key.size(), digest, &length, EVP_sha256(), nullptr) != 1 || length != 32) {
    // (Only without memory.) One name for every long key would be worse.
    COLOD_LOG(FATAL) << "file store: SHA-256 of a key failed";
  }
  return absl::StrCat(dir_, "/sha256-",
                      absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), length)));
}

absl::Status FileStore::Set(absl::string_view key, std::string value) {
  RETURN_IF_ERROR(ValidateKey(key));
  const std::string path = PathOf(key);
  const absl::Status s = WriteFileAtomically(path, value);
  if (!s.ok()) return absl::UnavailableError(absl::StrCat("file store: ", s.message()));
  return absl::OkStatus();
}

absl::StatusOr<std::string> FileStore::Get(absl::string_view key) {
  RETURN_IF_ERROR(ValidateKey(key));
  absl::StatusOr<std::string> value = ReadFileToString(PathOf(key));
  // Missing: not set yet. Another error (EACCES, EIO, ESTALE on a shared
  // directory) is said as it is, not as a key that never came.
  if (absl::IsNotFound(value.status())) {
    return absl::NotFoundError(absl::StrCat("key '", key, "' is not set in ", dir_));
  }
  if (!value.ok()) return absl::UnavailableError(absl::StrCat("file store: ", value.status().message()));
  return value;
}

absl::StatusOr<std::vector<std::string>> FileStore::Wait(const std::vector<std::string>& keys,
                                                         absl::Duration timeout) {
  if (keys.empty()) return absl::InvalidArgumentError("keys: at least one key is required");
  for (const std::string& k : keys) RETURN_IF_ERROR(ValidateKey(k));
  if (timeout <= absl::ZeroDuration()) return absl::InvalidArgumentError("timeout: must be > 0");
  const absl::Time deadline = absl::Now() + timeout;
  absl::Duration backoff = absl::Milliseconds(1);
  for (;;) {
    std::vector<std::string> values;
    std::vector<std::string> missing;
    for (const std::string& k : keys) {
      auto v = Get(k);
      if (v.ok()) {
        values.push_back(*std::move(v));
      } else if (absl::IsNotFound(v.status())) {
        missing.push_back(k);
      } else {
        return v.status();  // at once, not as missing keys after the timeout
      }
    }
    if (missing.empty()) return values;
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat("after ", absl::FormatDuration(timeout),
                                                      " still missing in ", dir_, ": ",
                                                      absl::StrJoin(missing, ", ")));
    }
    absl::SleepFor(std::min(backoff, deadline - now));
    backoff = std::min(backoff * 2, absl::Milliseconds(50));
  }
}

}  // namespace colod
