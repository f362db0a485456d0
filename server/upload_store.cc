#include "server/upload_store.h"

#include <openssl/evp.h>

#include <cerrno>
#include <filesystem>
#include <limits>
#include <system_error>

#include "absl/random/random.h"
#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "common/atomic_file.h"
#include "common/logging.h"
#include "common/status_macros.h"

namespace colod {

namespace fs = std::filesystem;

namespace {

// The counter of an upload id, "upload-NNNNNN-" and 16 lowercase hex
// digits (or "upload-NNNNNN", as ids were made before), or 0 where `name`
// is not one.
int64_t UploadCounter(absl::string_view name) {
  if (!absl::ConsumePrefix(&name, "upload-")) return 0;
  const size_t dash = name.find('-');
  if (dash != absl::string_view::npos) {
    const absl::string_view random = name.substr(dash + 1);
    if (random.size() != 16) return 0;
    for (char c : random) {
      if (!absl::ascii_isdigit(c) && !(c >= 'a' && c <= 'f')) return 0;
    }
    name = name.substr(0, dash);
  }
  int64_t n = 0;
  for (char c : name) {
    if (!absl::ascii_isdigit(c)) return 0;
  }
  return absl::SimpleAtoi(name, &n) && n > 0 ? n : 0;
}

bool IsUploadId(absl::string_view name) { return UploadCounter(name) > 0; }

// The bytes of `dir`'s regular files, and kFileBytes each (as an upload
// counts them); what cannot be listed or sized counts 0.
int64_t DirectoryBytes(const std::string& dir) {
  int64_t bytes = 0;
  for (const std::string& name : ListDirectory(dir).value_or(std::vector<std::string>{})) {
    std::error_code ec;
    const std::string path = dir + "/" + name;
    if (!fs::is_regular_file(path, ec)) continue;
    const uintmax_t size = fs::file_size(path, ec);
    if (!ec) bytes += UploadStore::Writer::kFileBytes + static_cast<int64_t>(size);
  }
  return bytes;
}

}  // namespace

// SHA-256 through OpenSSL's EVP interface.
struct UploadStore::Writer::Hash {
  Hash() : ctx(EVP_MD_CTX_new()) { EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr); }
  ~Hash() { EVP_MD_CTX_free(ctx); }
  void Update(absl::string_view bytes) { EVP_DigestUpdate(ctx, bytes.data(), bytes.size()); }
  std::string HexDigest() {
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    EVP_DigestFinal_ex(ctx, digest, &n);
    return absl::BytesToHexString(absl::string_view(reinterpret_cast<const char*>(digest), n));
  }
  EVP_MD_CTX* const ctx;
};

absl::StatusOr<std::unique_ptr<UploadStore>> UploadStore::Open(const std::string& dir, Limits limits, Clock* clock) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create '", dir, "': ", ec.message()));
  int64_t next = 1;
  std::vector<std::string> ids;
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(dir);
  if (!names.ok()) return absl::FailedPreconditionError(names.status().message());
  for (const std::string& name : *names) {
    const std::string path = dir + "/" + name;
    if (IsAtomicWriteLeftover(name) && IsRegularFile(path)) {
      fs::remove(path, ec);  // a .sha256 whose write was cut short
      continue;
    }
    if (absl::EndsWith(name, ".tmp")) {
      fs::remove_all(path, ec);  // an interrupted upload
      if (ec) COLOD_LOG(WARNING) << "cannot remove the interrupted upload " << path << ": " << ec.message();
      continue;
    }
    const int64_t n = UploadCounter(name);
    if (n > 0 && n < std::numeric_limits<int64_t>::max()) next = std::max(next, n + 1);
    if (n > 0 && fs::is_directory(path, ec)) ids.push_back(name);
    // A hash whose upload is gone (a removal cut short before 2026-12-07
    // removed the directory first).
    if (absl::EndsWith(name, ".sha256") && IsRegularFile(path) &&
        !fs::is_directory(dir + "/" + name.substr(0, name.size() - 7), ec)) {
      fs::remove(path, ec);
    }
  }
  std::unique_ptr<UploadStore> store(new UploadStore(dir, next, limits, clock));
  absl::MutexLock lock(&store->mu_);
  for (const std::string& id : ids) {
    Stored s;
    s.bytes = DirectoryBytes(absl::StrCat(dir, "/", id));
    s.last_used = clock->Now();  // a full grace period from this start
    if (absl::StatusOr<std::string> sha = ReadFileToString(absl::StrCat(dir, "/", id, ".sha256")); sha.ok()) {
      s.sha256 = std::string(absl::StripAsciiWhitespace(*sha));
      if (!s.sha256.empty()) store->by_sha_[s.sha256] = id;
    }
    store->stored_bytes_ += s.bytes;
    store->stored_[id] = s;
  }
  return store;
}

UploadStore::~UploadStore() = default;

absl::StatusOr<std::unique_ptr<UploadStore::Writer>> UploadStore::Begin() {
  if (admit_) RETURN_IF_ERROR(admit_(0));
  absl::MutexLock lock(&mu_);
  if (writers_ >= limits_.max_concurrent_uploads) {
    return absl::ResourceExhaustedError(absl::StrCat(writers_, " uploads are in progress, the coordinator's ",
                                                     "--max-concurrent-uploads: retry when one has ended"));
  }
  if (static_cast<int>(stored_.size()) + writers_ >= limits_.max_uploads) {
    return absl::ResourceExhaustedError(absl::StrCat(
        stored_.size(), " uploads are stored and ", writers_, " in progress, the coordinator's --max-uploads ",
        limits_.max_uploads, ": uploads no job names go an hour after they were made"));
  }
  ++writers_;
  const std::string id = absl::StrFormat("upload-%06d-%016x", next_++, absl::Uniform<uint64_t>(bits_));
  return std::unique_ptr<Writer>(new Writer(this, id, dir_ + "/" + id + ".tmp", dir_ + "/" + id));
}

absl::Status UploadStore::Reserve(int64_t n) {
  absl::MutexLock lock(&mu_);
  if (stored_bytes_ + reserved_bytes_ + n > limits_.quota_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat("the coordinator's --upload-quota of ", limits_.quota_bytes,
                                                     " bytes is spent (", stored_bytes_, " stored, ",
                                                     reserved_bytes_, " in uploads in progress)"));
  }
  reserved_bytes_ += n;
  return absl::OkStatus();
}

void UploadStore::Release(int64_t n, bool writer_done) {
  absl::MutexLock lock(&mu_);
  reserved_bytes_ -= n;
  if (writer_done) --writers_;
}

int64_t UploadStore::bytes() const {
  absl::MutexLock lock(&mu_);
  return stored_bytes_ + reserved_bytes_;
}

UploadStore::Writer::Writer(UploadStore* store, std::string id, std::string tmp, std::string final_dir)
    : store_(store), id_(std::move(id)), tmp_(std::move(tmp)), final_(std::move(final_dir)),
      hash_(std::make_unique<Hash>()) {}

UploadStore::Writer::~Writer() {
  if (finished_) return;
  out_.close();
  std::error_code ec;
  fs::remove_all(tmp_, ec);
  store_->Release(reserved_, /*writer_done=*/true);
}

namespace {

std::string SizeBytes(int64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((static_cast<uint64_t>(n) >> (8 * i)) & 0xff);
  return out;
}

}  // namespace

absl::Status UploadStore::Writer::Add(const v1::ModelChunk& chunk) {
  if (store_->admit_) RETURN_IF_ERROR(store_->admit_(static_cast<int64_t>(chunk.data().size())));
  if (!IsPlainFileName(chunk.file())) {
    return absl::InvalidArgumentError(absl::StrCat("chunk.file: '", chunk.file(), "' is not a file name"));
  }
  if (chunk.file() != file_) {
    if (seen_.count(chunk.file())) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk.file: '", chunk.file(), "' came again after another file"));
    }
    if (files_.size() >= static_cast<size_t>(kMaxFiles)) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk.file: '", chunk.file(), "' would be file ", files_.size() + 1,
                       " of the upload; an upload holds at most ", kMaxFiles));
    }
    if (chunk.offset() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk.offset: the first chunk of '", chunk.file(), "' starts at ", chunk.offset(), ", not 0"));
    }
    if (absl::Status s = store_->Reserve(kFileBytes); !s.ok()) return s;
    reserved_ += kFileBytes;
    out_.close();
    if (!file_.empty()) hash_->Update(SizeBytes(offset_));  // the previous file's end
    std::error_code ec;
    fs::create_directories(tmp_, ec);
    if (ec) return FileError("cannot create", tmp_, ec.value());  // (ENOSPC: RESOURCE_EXHAUSTED)
    errno = 0;
    out_.open(tmp_ + "/" + chunk.file(), std::ios::binary | std::ios::trunc);
    if (!out_) return FileError("cannot create", tmp_ + "/" + chunk.file(), errno != 0 ? errno : EIO);
    file_ = chunk.file();
    offset_ = 0;
    files_.push_back(file_);
    seen_.insert(file_);
    hash_->Update(file_);
    hash_->Update(absl::string_view("\0", 1));
  }
  if (chunk.offset() != offset_) {
    return absl::InvalidArgumentError(absl::StrCat("chunk.offset: ", chunk.offset(), " in '", file_, "', expected ",
                                                   offset_, " (chunks must come in order)"));
  }
  const int64_t n = static_cast<int64_t>(chunk.data().size());
  if (absl::Status s = store_->Reserve(n); !s.ok()) return s;
  reserved_ += n;  // released by Finish or the destructor
  bytes_ += n;
  errno = 0;
  out_.write(chunk.data().data(), static_cast<std::streamsize>(n));
  if (out_) out_.flush();  // a full disk shows here, with its errno
  if (!out_) return FileError("cannot write", tmp_ + "/" + file_, errno != 0 ? errno : EIO);
  hash_->Update(chunk.data());
  offset_ += n;
  return absl::OkStatus();
}

absl::StatusOr<v1::UploadModelResponse> UploadStore::Writer::Finish() {
  if (files_.empty()) return absl::InvalidArgumentError("the upload has no files");
  errno = 0;
  out_.close();
  if (!out_) return FileError("cannot write", tmp_ + "/" + file_, errno != 0 ? errno : EIO);
  hash_->Update(SizeBytes(offset_));
  const std::string sha = hash_->HexDigest();
  v1::UploadModelResponse resp;
  for (const std::string& f : files_) resp.add_files(f);
  resp.set_bytes(bytes_);
  resp.set_sha256(sha);
  std::error_code ec;
  {
    absl::MutexLock lock(&store_->mu_);
    auto same = store_->by_sha_.find(sha);
    if (same != store_->by_sha_.end() && store_->stored_.count(same->second)) {
      // Stored already: keep that one, drop this copy.
      Stored& s = store_->stored_[same->second];
      s.last_used = store_->clock_->Now();
      resp.set_upload_id(same->second);
      resp.set_deduplicated(true);
      store_->reserved_bytes_ -= reserved_;
      --store_->writers_;
      finished_ = true;
    }
  }
  if (resp.deduplicated()) {
    fs::remove_all(tmp_, ec);
    return resp;
  }
  // Durable before it is published: a crash after the rename (and the job
  // record naming it) must not leave an upload of empty or cut files that
  // its recorded hash then deduplicates onto.
  if (absl::Status s = SyncFilesAndDirectory(tmp_); !s.ok()) return s;
  fs::rename(tmp_, final_, ec);
  if (ec) return FileError("cannot publish the upload as", final_, ec.value());
  // The rename durable before the upload id is handed out (a job record
  // naming it survives a power loss; the upload must too): not left to the
  // hash's write below, which may fail on a full disk.
  if (absl::Status s = SyncDirectory(fs::path(final_).parent_path().string()); !s.ok()) {
    fs::remove_all(final_, ec);  // not published: the writer's end gives its room back
    return s;
  }
  if (absl::Status s = WriteFileAtomically(final_ + ".sha256", sha + "\n"); !s.ok()) {
    COLOD_LOG(WARNING) << "upload " << id_ << ": its hash is not recorded (it will not deduplicate): " << s;
  }
  absl::MutexLock lock(&store_->mu_);
  Stored& s = store_->stored_[id_];
  s.bytes = reserved_;  // the files' bookkeeping too
  s.sha256 = sha;
  s.last_used = store_->clock_->Now();
  store_->by_sha_[sha] = id_;
  store_->reserved_bytes_ -= reserved_;
  store_->stored_bytes_ += reserved_;
  --store_->writers_;
  finished_ = true;
  resp.set_upload_id(id_);
  return resp;
}

absl::StatusOr<std::unique_ptr<UploadStore::Reading>> UploadStore::BeginReading(const std::string& upload_id) {
  absl::MutexLock lock(&mu_);
  auto it = IsUploadId(upload_id) ? stored_.find(upload_id) : stored_.end();
  if (it == stored_.end()) return absl::NotFoundError(absl::StrCat("no upload '", upload_id, "'"));
  if (readers_ >= limits_.max_concurrent_downloads) {
    return absl::ResourceExhaustedError(absl::StrCat(readers_, " downloads are in progress, the coordinator's ",
                                                     "--max-concurrent-downloads: retry when one has ended"));
  }
  ++readers_;
  ++it->second.readers;
  it->second.last_used = clock_->Now();
  return std::unique_ptr<Reading>(new Reading(this, upload_id, dir_ + "/" + upload_id));
}

UploadStore::Reading::~Reading() {
  absl::MutexLock lock(&store_->mu_);
  --store_->readers_;
  auto it = store_->stored_.find(id_);
  if (it != store_->stored_.end()) {
    --it->second.readers;
    it->second.last_used = store_->clock_->Now();  // the grace starts again when the download ends
  }
}

bool UploadStore::Exists(const std::string& upload_id) {
  absl::MutexLock lock(&mu_);
  auto it = IsUploadId(upload_id) ? stored_.find(upload_id) : stored_.end();
  if (it == stored_.end()) return false;
  it->second.last_used = clock_->Now();
  return true;
}

bool UploadStore::Differ(const std::string& a, const std::string& b) const {
  absl::MutexLock lock(&mu_);
  auto x = stored_.find(a), y = stored_.find(b);
  return x != stored_.end() && y != stored_.end() && !x->second.sha256.empty() && !y->second.sha256.empty() &&
         x->second.sha256 != y->second.sha256;
}

absl::StatusOr<std::string> UploadStore::Path(const std::string& upload_id) const {
  std::error_code ec;
  const std::string path = dir_ + "/" + upload_id;
  if (!IsUploadId(upload_id) || !fs::is_directory(path, ec)) {
    return absl::NotFoundError(absl::StrCat("no upload '", upload_id, "'"));
  }
  return path;
}

std::vector<std::string> UploadStore::CollectGarbage(const std::set<std::string>& in_use, absl::Duration grace) {
  std::vector<std::string> removed;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    for (auto it = stored_.begin(); it != stored_.end();) {
      if (in_use.count(it->first) || it->second.readers > 0) {
        it->second.last_used = now;
        ++it;
        continue;
      }
      if (now - it->second.last_used <= grace) {
        ++it;
        continue;
      }
      removed.push_back(it->first);
      // (The hash may name a copy finished beside it, which stays.)
      if (auto same = by_sha_.find(it->second.sha256); same != by_sha_.end() && same->second == it->first) {
        by_sha_.erase(same);
      }
      stored_bytes_ -= it->second.bytes;
      it = stored_.erase(it);
    }
  }
  // Outside the lock: removing files blocks. The hash goes first and the
  // directory is renamed out of the uploads' names before its files go: a
  // crash midway leaves a .tmp, which the next Open removes, never a
  // half-removed upload that Open would load as whole (and deduplicate a
  // new upload of the same model onto).
  for (const std::string& id : removed) {
    std::error_code ec;
    fs::remove(dir_ + "/" + id + ".sha256", ec);
    const std::string doomed = absl::StrCat(dir_, "/", id, ".removed.tmp");
    fs::rename(dir_ + "/" + id, doomed, ec);
    fs::remove_all(ec ? dir_ + "/" + id : doomed, ec);
    if (ec) COLOD_LOG(WARNING) << "cannot remove the expired upload " << id << ": " << ec.message();
  }
  return removed;
}

}  // namespace colod
