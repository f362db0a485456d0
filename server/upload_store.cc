#include "server/upload_store.h"

#include <filesystem>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"

namespace colod {

namespace fs = std::filesystem;

absl::StatusOr<std::unique_ptr<UploadStore>> UploadStore::Open(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create '", dir, "': ", ec.message()));
  int64_t next = 1;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (absl::EndsWith(name, ".tmp")) {
      fs::remove_all(e.path(), ec);  // an interrupted upload
      continue;
    }
    int64_t n = 0;
    if (absl::StartsWith(name, "upload-") && absl::SimpleAtoi(name.substr(7), &n)) next = std::max(next, n + 1);
  }
  return std::unique_ptr<UploadStore>(new UploadStore(dir, next));
}

std::unique_ptr<UploadStore::Writer> UploadStore::Begin() {
  absl::MutexLock lock(&mu_);
  const std::string id = absl::StrFormat("upload-%06d", next_++);
  return std::unique_ptr<Writer>(new Writer(id, dir_ + "/" + id + ".tmp", dir_ + "/" + id));
}

UploadStore::Writer::~Writer() {
  if (finished_) return;
  out_.close();
  std::error_code ec;
  fs::remove_all(tmp_, ec);
}

absl::Status UploadStore::Writer::Add(const v1::ModelChunk& chunk) {
  if (!IsPlainFileName(chunk.file())) {
    return absl::InvalidArgumentError(absl::StrCat("chunk.file: '", chunk.file(), "' is not a file name"));
  }
  if (chunk.file() != file_) {
    for (const std::string& f : files_) {
      if (f == chunk.file()) {
        return absl::InvalidArgumentError(absl::StrCat("chunk.file: '", f, "' came again after another file"));
      }
    }
    if (chunk.offset() != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("chunk.offset: the first chunk of '", chunk.file(), "' starts at ", chunk.offset(), ", not 0"));
    }
    out_.close();
    std::error_code ec;
    fs::create_directories(tmp_, ec);
    out_.open(tmp_ + "/" + chunk.file(), std::ios::binary | std::ios::trunc);
    if (!out_) return absl::InternalError(absl::StrCat("cannot write '", tmp_, "/", chunk.file(), "'"));
    file_ = chunk.file();
    offset_ = 0;
    files_.push_back(file_);
  }
  if (chunk.offset() != offset_) {
    return absl::InvalidArgumentError(absl::StrCat("chunk.offset: ", chunk.offset(), " in '", file_, "', expected ",
                                                   offset_, " (chunks must come in order)"));
  }
  out_.write(chunk.data().data(), static_cast<std::streamsize>(chunk.data().size()));
  if (!out_) return absl::InternalError(absl::StrCat("writing '", file_, "' failed"));
  offset_ += static_cast<int64_t>(chunk.data().size());
  bytes_ += static_cast<int64_t>(chunk.data().size());
  return absl::OkStatus();
}

absl::StatusOr<v1::UploadModelResponse> UploadStore::Writer::Finish() {
  if (files_.empty()) return absl::InvalidArgumentError("the upload has no files");
  out_.close();
  if (!out_) return absl::InternalError(absl::StrCat("writing '", file_, "' failed"));
  std::error_code ec;
  fs::rename(tmp_, final_, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot publish the upload: ", ec.message()));
  finished_ = true;
  v1::UploadModelResponse resp;
  resp.set_upload_id(id_);
  for (const std::string& f : files_) resp.add_files(f);
  resp.set_bytes(bytes_);
  return resp;
}

bool UploadStore::Exists(const std::string& upload_id) const { return Path(upload_id).ok(); }

absl::StatusOr<std::string> UploadStore::Path(const std::string& upload_id) const {
  int64_t n = 0;
  std::error_code ec;
  const std::string path = dir_ + "/" + upload_id;
  if (!absl::StartsWith(upload_id, "upload-") || !absl::SimpleAtoi(upload_id.substr(7), &n) ||
      !fs::is_directory(path, ec)) {
    return absl::NotFoundError(absl::StrCat("no upload '", upload_id, "'"));
  }
  return path;
}

}  // namespace colod
