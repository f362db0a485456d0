// The rendezvous Store that communicators use to find each other (Gloo
// addresses, NCCL unique ids). Three implementations share one contract:
//   InMemoryStore     ranks as threads of one process (tests)
//   FileStore         ranks as processes sharing a directory
//   CoordinatorStore  ranks in worker daemons: the coordinator's KV over gRPC
#ifndef COLOD_WORKER_COMM_STORE_H_
#define COLOD_WORKER_COMM_STORE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace colod {

class RendezvousStore;

// Implementations are thread-safe. Keys are non-empty strings of at most 1024
// bytes; values are opaque bytes.
class Store {
 public:
  virtual ~Store() = default;
  // Sets (or overwrites) `key`.
  virtual absl::Status Set(absl::string_view key, std::string value) = 0;
  // NOT_FOUND if the key is not set.
  virtual absl::StatusOr<std::string> Get(absl::string_view key) = 0;
  // The values of `keys` (in order) once every one is set; DEADLINE_EXCEEDED
  // naming the missing keys after `timeout`. Never waits forever.
  virtual absl::StatusOr<std::vector<std::string>> Wait(const std::vector<std::string>& keys,
                                                        absl::Duration timeout) = 0;
};

// Keys of one process, in memory: an adapter over the coordinator's
// RendezvousStore, scoped. Several InMemoryStores may share one
// RendezvousStore (one per rank thread, or per scope).
class InMemoryStore final : public Store {
 public:
  // A store with its own RendezvousStore.
  InMemoryStore();
  // A view of `shared` (which must outlive this) restricted to `scope`.
  InMemoryStore(std::shared_ptr<RendezvousStore> shared, std::string scope);
  ~InMemoryStore() override;

  absl::Status Set(absl::string_view key, std::string value) override;
  absl::StatusOr<std::string> Get(absl::string_view key) override;
  absl::StatusOr<std::vector<std::string>> Wait(const std::vector<std::string>& keys,
                                                absl::Duration timeout) override;

 private:
  std::shared_ptr<RendezvousStore> store_;
  const std::string scope_;
};

// Keys as files in a directory shared by the ranks (a local or network file
// system). Each Set writes a temporary file and renames it, so a reader never
// sees a partial value; Wait polls with a short backoff.
class FileStore final : public Store {
 public:
  // Creates `dir` if needed. FAILED_PRECONDITION if it cannot.
  static absl::StatusOr<std::unique_ptr<FileStore>> Open(const std::string& dir);

  absl::Status Set(absl::string_view key, std::string value) override;
  absl::StatusOr<std::string> Get(absl::string_view key) override;
  absl::StatusOr<std::vector<std::string>> Wait(const std::vector<std::string>& keys,
                                                absl::Duration timeout) override;

 private:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {}
  std::string PathOf(absl::string_view key) const;
  const std::string dir_;
};

}  // namespace colod

#endif  // COLOD_WORKER_COMM_STORE_H_
