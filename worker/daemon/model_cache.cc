#include "worker/daemon/model_cache.h"

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <system_error>
#include <vector>

#include "absl/random/random.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/auth.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/model_layout.h"
#include "common/status_macros.h"

namespace colod {
namespace {

namespace fs = std::filesystem;

// The text of a RESOURCE_EXHAUSTED refusal for want of room that carries no
// mark of ours (RetryAfter), beside gRPC's own (IsBusyRefusal): a
// coordinator's from before the mark (2026-12), at its
// --max-concurrent-downloads (mixed versions during an upgrade, workers
// first).
bool IsUnmarkedDownloadsBusyText(absl::string_view message) {
  return absl::StrContains(message, "--max-concurrent-downloads");
}

// An error of writing into the worker's own --work-dir: a full disk there
// (RESOURCE_EXHAUSTED, FileError's) is the worker's fault, not the job's.
absl::Status OwnDisk(absl::Status s) { return absl::IsResourceExhausted(s) ? MarkWorkerFault(std::move(s)) : s; }

}  // namespace

ModelCache::ModelCache(Options options) : options_(std::move(options)) {}

absl::Status ModelCache::Materialize(const v1::ModelSpec& model, const std::string& dir, AbortSignal& abort,
                                     const PathPolicy& paths) {
  ASSIGN_OR_RETURN(const std::string weights_path, Weights(model, abort));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return OwnDisk(FileError("cannot create", dir, ec.value()));
  RETURN_IF_ERROR(OwnDisk(WriteFileAtomically(dir + "/config.json", model.config_json())));
  const fs::path weights = fs::absolute(weights_path, ec);
  const bool exists = !ec && fs::exists(weights, ec);  // (a path that is not there clears ec)
  // A path this worker may not look into (EACCES, a loop of links) is not a
  // missing one; nor is one its file system fails to look up for now (EIO,
  // ESTALE: a stale mount), which is this worker's fault: the job restarts
  // elsewhere, and this worker sits out.
  if (ec) {
    absl::Status s = FileError("spec.model.weights_path: cannot look up", weights_path, ec.value());
    return absl::IsUnavailable(s) ? MarkWorkerFault(std::move(s)) : s;
  }
  if (!exists) {
    return absl::NotFoundError(
        absl::StrCat("spec.model.weights_path: '", weights_path, "' does not exist on this worker"));
  }
  std::vector<fs::path> files;
  if (fs::is_directory(weights, ec)) {
    absl::StatusOr<std::vector<std::string>> names = ListDirectory(weights.string());
    if (!names.ok()) {
      return absl::FailedPreconditionError(absl::StrCat("spec.model.weights_path: ", names.status().message()));
    }
    bool tensors = false;
    for (const std::string& name : *names) {
      tensors = tensors || IsWeightsFile(name);
      // The tokenizer comes along: text data is encoded with it.
      if (IsWeightsFile(name) || IsTokenizerFile(name)) files.push_back(weights / name);
    }
    if (!tensors) {
      return absl::NotFoundError(absl::StrCat("spec.model.weights_path: '", weights_path,
                                              "' holds no .safetensors file"));
    }
  }
  if (model.upload_id().empty()) {  // a download is this worker's own
    for (const fs::path& f : files) RETURN_IF_ERROR(paths.Check("spec.model.weights_path", f.string()));
  }
  if (files.empty()) {
    fs::create_symlink(weights, fs::path(dir) / "model.safetensors", ec);
  } else {
    for (const fs::path& f : files) {
      fs::create_symlink(f, fs::path(dir) / f.filename(), ec);
      if (ec) break;
    }
  }
  if (ec) return OwnDisk(FileError("cannot link the weights into", dir, ec.value()));
  return absl::OkStatus();
}

absl::StatusOr<std::string> ModelCache::Weights(const v1::ModelSpec& model, AbortSignal& abort) {
  if (model.upload_id().empty()) return model.weights_path();
  // Held across the download: only PruneIfIdle contends, and it does not wait.
  absl::MutexLock lock(&files_mu_);
  // (Never one of the cache's own names: a download or a removal in progress.)
  if (!IsPlainFileName(model.upload_id()) || absl::EndsWith(model.upload_id(), ".tmp") ||
      absl::EndsWith(model.upload_id(), kRemoving)) {
    return absl::InvalidArgumentError(absl::StrCat("spec.model.upload_id: '", model.upload_id(), "' is not an id"));
  }
  const std::string dir = absl::StrCat(options_.work_dir, "/uploads/", model.upload_id());
  std::error_code ec;
  if (fs::is_directory(dir, ec)) {
    fs::last_write_time(dir, fs::file_time_type::clock::now(), ec);  // used now: Prune keeps it
    PruneLocked(model.upload_id());  // a worker whose jobs all hit its cache still lets go of what none uses
    return dir;
  }
  RETURN_IF_ERROR(abort.Check());
  PruneLocked(model.upload_id());
  const std::string tmp = dir + ".tmp";
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) return OwnDisk(FileError("cannot create", tmp, ec.value()));
  struct RemoveTmp {
    const std::string& tmp;
    bool keep = false;
    ~RemoveTmp() {
      std::error_code ec;
      if (!keep) fs::remove_all(tmp, ec);
    }
  } remove_tmp{tmp};
  const absl::Time deadline = absl::Now() + options_.download_timeout;
  absl::Duration backoff = std::max(options_.busy_backoff, absl::Milliseconds(1));  // never a spin
  absl::BitGen bits;
  absl::Status busy;  // the coordinator's last refusal for want of room
  const auto stayed_busy = [&] {
    return absl::DeadlineExceededError(
        absl::StrCat("downloading upload '", model.upload_id(), "': the coordinator stayed busy for ",
                     absl::FormatDuration(options_.download_timeout), " (", busy.message(), ")"));
  };
  for (int refusals = 0;; ++refusals) {
    bool received = false, busy_refusal = false;
    std::optional<absl::Duration> retry_after;
    const absl::Status s = DownloadInto(model.upload_id(), tmp, deadline, abort, received, retry_after, busy_refusal);
    // The deadline passing during a last ask that got nothing: it was the wait.
    if (!busy.ok() && !received && absl::IsDeadlineExceeded(s)) return stayed_busy();
    // A coordinator at its bound of downloads (its refusal says when to ask
    // again) or of server threads refuses before it sends anything: wait
    // and ask again.
    if (s.ok() || received || !busy_refusal) {
      RETURN_IF_ERROR(s);
      break;
    }
    busy = s;
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return stayed_busy();
    if (refusals == 0) {
      COLOD_LOG(INFO) << "the coordinator is busy (" << s.message() << "); asking again for upload "
                      << model.upload_id() << " until the download deadline";
    }
    // Up to half again at random, so that workers refused together spread
    // out; never sooner than the coordinator asked.
    const absl::Duration wait = std::min(
        left, std::max(backoff, retry_after.value_or(absl::ZeroDuration())) * (1 + absl::Uniform(bits, 0.0, 0.5)));
    absl::Notification woken;
    {
      const std::unique_ptr<AbortSignal::Registration> wake = abort.OnAbort([&woken] { woken.Notify(); });
      woken.WaitForNotificationWithTimeout(wait);
    }
    RETURN_IF_ERROR(abort.Check());
    if (wait == left) return stayed_busy();  // no time left to ask again
    backoff = std::min(backoff * 2, options_.max_busy_backoff);
  }
  // Durable before it is in place: a later job trusts any directory there,
  // and a power loss must not leave it holding cut files.
  RETURN_IF_ERROR(OwnDisk(SyncFilesAndDirectory(tmp)));
  fs::rename(tmp, dir, ec);
  if (ec) return OwnDisk(FileError(absl::StrCat("cannot rename it to '", dir, "'"), tmp, ec.value()));
  remove_tmp.keep = true;
  if (const absl::Status synced = SyncDirectory(fs::path(dir).parent_path().string()); !synced.ok()) {
    COLOD_LOG(WARNING) << "upload " << model.upload_id() << " is in place, but not yet durable: " << synced.message();
  }
  return dir;
}

absl::Status ModelCache::DownloadInto(const std::string& upload_id, const std::string& tmp, absl::Time deadline,
                                      AbortSignal& abort, bool& received, std::optional<absl::Duration>& retry_after,
                                      bool& busy_refusal) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  AddAuthToken(ctx, options_.auth_token);
  AddWorkerKey(ctx, options_.worker_key);
  v1::DownloadModelRequest req;
  req.set_upload_id(upload_id);
  std::unique_ptr<grpc::ClientReaderInterface<v1::ModelChunk>> reader = options_.coordinator->DownloadModel(&ctx, req);
  // From here on an abort cancels the call: Read returns false at once.
  const std::unique_ptr<AbortSignal::Registration> cancel = abort.OnAbort([&ctx] { ctx.TryCancel(); });
  v1::ModelChunk chunk;
  std::ofstream out;
  std::string file;
  int64_t written = 0;         // of `file`
  std::set<std::string> done;  // the files sent before it
  absl::Status failed;
  while (reader->Read(&chunk)) {
    received = true;
    if (!IsPlainFileName(chunk.file())) {
      failed = absl::InternalError(absl::StrCat("the coordinator sent a bad file name '", chunk.file(), "'"));
      ctx.TryCancel();
      break;
    }
    // Each file whole, its chunks in order: a file sent again (it would be
    // written over) or a chunk out of place is refused, never cached.
    const bool next_file = chunk.file() != file;
    if ((next_file && (done.count(chunk.file()) > 0 || chunk.offset() != 0)) ||
        (!next_file && chunk.offset() != written)) {
      failed = absl::InternalError(absl::StrCat("the coordinator sent ", chunk.file(), " out of order (a chunk at ",
                                                chunk.offset(), ", where ", next_file ? 0 : written,
                                                " was due): the download is refused"));
      ctx.TryCancel();
      break;
    }
    if (next_file) {
      out.close();
      if (!file.empty()) done.insert(file);
      file = chunk.file();
      written = 0;
      errno = 0;
      out.open(tmp + "/" + file, std::ios::binary | std::ios::trunc);
      if (!out.is_open()) {  // (no inode left: ENOSPC; the write below would make no call to report it)
        failed = OwnDisk(FileError("cannot create", tmp + "/" + file, errno != 0 ? errno : EIO));
        ctx.TryCancel();
        break;
      }
    }
    errno = 0;
    out.write(chunk.data().data(), static_cast<std::streamsize>(chunk.data().size()));
    if (out) out.flush();  // a full disk shows here, not at a close whose error is lost
    if (!out) {
      failed = OwnDisk(FileError("cannot write", tmp + "/" + file, errno != 0 ? errno : EIO));
      ctx.TryCancel();
      break;
    }
    written += static_cast<int64_t>(chunk.data().size());
  }
  out.close();
  const grpc::Status s = reader->Finish();  // after a cancel, returns at once
  if (!s.ok()) {
    retry_after = RetryAfter(ctx);
    busy_refusal = IsBusyRefusal(s, ctx) || (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED &&
                                             IsUnmarkedDownloadsBusyText(s.error_message()));
  }
  RETURN_IF_ERROR(abort.Check());
  RETURN_IF_ERROR(failed);
  if (!s.ok()) {
    return absl::Status(FromGrpcStatus(s).code(),
                        absl::StrCat("downloading upload '", upload_id, "': ", s.error_message()));
  }
  return absl::OkStatus();
}

void ModelCache::Used(const v1::ModelSpec& model) {
  if (model.upload_id().empty() || !IsPlainFileName(model.upload_id())) return;
  std::error_code ec;
  fs::last_write_time(absl::StrCat(options_.work_dir, "/uploads/", model.upload_id()), fs::file_time_type::clock::now(),
                      ec);  // gone (pruned by hand): nothing to stamp
}

void ModelCache::Prune(const std::string& keep) {
  absl::MutexLock lock(&files_mu_);
  PruneLocked(keep);
}

bool ModelCache::PruneIfIdle(const std::string& keep) {
  if (!files_mu_.TryLock()) return false;  // a rank's download or lookup: it prunes itself
  PruneLocked(keep);
  files_mu_.Unlock();
  return true;
}

void ModelCache::PruneLocked(const std::string& keep) {
  const fs::path uploads = fs::path(options_.work_dir) / "uploads";
  std::error_code ec;
  // A TTL past a century (inf included) keeps every upload: the clock's
  // arithmetic would overflow, and wrap to a cutoff in the future.
  const bool forever = options_.cache_ttl >= absl::Hours(24 * 365 * 100);
  const fs::file_time_type cutoff =
      forever ? fs::file_time_type::min()
              : fs::file_time_type::clock::now() -
                    std::chrono::duration_cast<fs::file_time_type::duration>(absl::ToChronoSeconds(options_.cache_ttl));
  std::vector<fs::path> stale;
  // Nothing to prune where the listing fails (none made yet, most often).
  for (const std::string& name : ListDirectory(uploads.string()).value_or(std::vector<std::string>{})) {
    if (name == keep) continue;
    // One rank (and so one download) runs at a time, and it holds
    // files_mu_: any .tmp is a leftover, as is a removal a crash cut short.
    std::error_code time_ec;
    const fs::file_time_type used = fs::last_write_time(uploads / name, time_ec);
    if (absl::EndsWith(name, ".tmp") || absl::EndsWith(name, kRemoving) || (!time_ec && used < cutoff)) {
      stale.push_back(uploads / name);
    }
  }
  for (fs::path p : stale) {
    // Out of the cache's names first: a removal cut short (a crash, an
    // error midway) never leaves a part of an upload under its id.
    if (!absl::EndsWith(p.filename().string(), ".tmp") && !absl::EndsWith(p.filename().string(), kRemoving)) {
      const fs::path away = p.string() + kRemoving;
      fs::rename(p, away, ec);
      if (ec) {
        COLOD_LOG(WARNING) << "cannot remove the cached upload " << p.string() << ": " << ec.message();
        continue;
      }
      p = away;
    }
    fs::remove_all(p, ec);
    if (ec) {
      COLOD_LOG(WARNING) << "cannot remove the cached upload " << p.string() << ": " << ec.message();
    } else {
      COLOD_LOG(INFO) << "removed the cached upload " << p.filename().string() << " (unused for "
                      << absl::FormatDuration(options_.cache_ttl) << ")";
    }
  }
}

}  // namespace colod
