// Models uploaded through the coordinator (UploadModel), kept in its data
// directory as DIR/uploads/upload-NNNNNN/<files>. An upload is written into
// a .tmp directory and renamed when complete, so a broken stream leaves
// nothing that a job could name.
#ifndef COLOD_SERVER_UPLOAD_STORE_H_
#define COLOD_SERVER_UPLOAD_STORE_H_

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "colod/v1/coordinator.pb.h"

namespace colod {

// Thread-safe; uploads proceed concurrently.
class UploadStore {
 public:
  // Creates DIR (and removes the .tmp leftovers of interrupted uploads).
  static absl::StatusOr<std::unique_ptr<UploadStore>> Open(const std::string& dir);

  // One upload in progress; Add chunks in order, then Finish.
  class Writer {
   public:
    ~Writer();  // an unfinished upload is removed
    // INVALID_ARGUMENT for a bad file name or a chunk out of order.
    absl::Status Add(const v1::ModelChunk& chunk);
    // Publishes the upload. INVALID_ARGUMENT if no file came.
    absl::StatusOr<v1::UploadModelResponse> Finish();

   private:
    friend class UploadStore;
    Writer(std::string id, std::string tmp, std::string final_dir)
        : id_(std::move(id)), tmp_(std::move(tmp)), final_(std::move(final_dir)) {}
    const std::string id_, tmp_, final_;
    std::string file_;  // the file being written
    int64_t offset_ = 0;
    std::ofstream out_;
    std::vector<std::string> files_;
    int64_t bytes_ = 0;
    bool finished_ = false;
  };
  std::unique_ptr<Writer> Begin();

  bool Exists(const std::string& upload_id) const;
  // The upload's directory; NOT_FOUND for an unknown or malformed id.
  absl::StatusOr<std::string> Path(const std::string& upload_id) const;

 private:
  explicit UploadStore(std::string dir, int64_t next) : dir_(std::move(dir)), next_(next) {}
  const std::string dir_;
  mutable absl::Mutex mu_;
  int64_t next_ ABSL_GUARDED_BY(mu_);
};

}  // namespace colod

#endif  // COLOD_SERVER_UPLOAD_STORE_H_
