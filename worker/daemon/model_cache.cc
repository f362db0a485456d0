#include "worker/daemon/model_cache.h"

#include <filesystem>
#include <fstream>
#include <system_error>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/atomic_file.h"
#include "common/auth.h"
#include "common/grpc_status.h"
#include "common/status_macros.h"

namespace colod {
namespace {

namespace fs = std::filesystem;

}  // namespace

ModelCache::ModelCache(Options options) : options_(std::move(options)) {}

absl::Status ModelCache::Materialize(const v1::ModelSpec& model, const std::string& dir, AbortSignal& abort) {
  ASSIGN_OR_RETURN(const std::string weights_path, Weights(model, abort));
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create '", dir, "': ", ec.message()));
  RETURN_IF_ERROR(WriteFileAtomically(dir + "/config.json", model.config_json()));
  const fs::path weights = fs::absolute(weights_path, ec);
  if (ec || !fs::exists(weights, ec)) {
    return absl::NotFoundError(
        absl::StrCat("spec.model.weights_path: '", weights_path, "' does not exist on this worker"));
  }
  std::vector<fs::path> files;
  if (fs::is_directory(weights, ec)) {
    for (const fs::directory_entry& e : fs::directory_iterator(weights, ec)) {
      const std::string name = e.path().filename().string();
      if (absl::EndsWith(name, ".safetensors") || name == "model.safetensors.index.json") files.push_back(e.path());
    }
    if (files.empty()) {
      return absl::NotFoundError(absl::StrCat("spec.model.weights_path: '", weights_path,
                                              "' holds no .safetensors file"));
    }
  }
  if (files.empty()) {
    fs::create_symlink(weights, fs::path(dir) / "model.safetensors", ec);
  } else {
    for (const fs::path& f : files) {
      fs::create_symlink(f, fs::path(dir) / f.filename(), ec);
      if (ec) break;
    }
  }
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot link the weights into '", dir, "': ", ec.message()));
  return absl::OkStatus();
}

absl::StatusOr<std::string> ModelCache::Weights(const v1::ModelSpec& model, AbortSignal& abort) {
  if (model.upload_id().empty()) return model.weights_path();
  if (!IsPlainFileName(model.upload_id())) {
    return absl::InvalidArgumentError(absl::StrCat("spec.model.upload_id: '", model.upload_id(), "' is not an id"));
  }
  const std::string dir = absl::StrCat(options_.work_dir, "/uploads/", model.upload_id());
  std::error_code ec;
  if (fs::is_directory(dir, ec)) return dir;
  RETURN_IF_ERROR(abort.Check());
  const std::string tmp = dir + ".tmp";
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("cannot create '", tmp, "': ", ec.message()));
  struct RemoveTmp {
    const std::string& tmp;
    bool keep = false;
    ~RemoveTmp() {
      std::error_code ec;
      if (!keep) fs::remove_all(tmp, ec);
    }
  } remove_tmp{tmp};
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.download_timeout));
  AddAuthToken(ctx, options_.auth_token);
  v1::DownloadModelRequest req;
  req.set_upload_id(model.upload_id());
  std::unique_ptr<grpc::ClientReaderInterface<v1::ModelChunk>> reader = options_.coordinator->DownloadModel(&ctx, req);
  // From here on an abort cancels the call: Read returns false at once.
  const std::unique_ptr<AbortSignal::Registration> cancel = abort.OnAbort([&ctx] { ctx.TryCancel(); });
  v1::ModelChunk chunk;
  std::ofstream out;
  std::string file;
  absl::Status failed;
  while (reader->Read(&chunk)) {
    if (!IsPlainFileName(chunk.file())) {
      failed = absl::InternalError(absl::StrCat("the coordinator sent a bad file name '", chunk.file(), "'"));
      ctx.TryCancel();
      break;
    }
    if (chunk.file() != file) {
      out.close();
      file = chunk.file();
      out.open(tmp + "/" + file, std::ios::binary | std::ios::trunc);
    }
    out.write(chunk.data().data(), static_cast<std::streamsize>(chunk.data().size()));
    if (!out) {
      failed = absl::InternalError(absl::StrCat("cannot write ", tmp, "/", file));
      ctx.TryCancel();
      break;
    }
  }
  out.close();
  const grpc::Status s = reader->Finish();  // after a cancel, returns at once
  RETURN_IF_ERROR(abort.Check());
  RETURN_IF_ERROR(failed);
  if (!s.ok()) {
    return absl::Status(FromGrpcStatus(s).code(),
                        absl::StrCat("downloading upload '", model.upload_id(), "': ", s.error_message()));
  }
  fs::rename(tmp, dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot rename '", tmp, "': ", ec.message()));
  remove_tmp.keep = true;
  return dir;
}

}  // namespace colod
