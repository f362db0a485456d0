// The ColoTensors of the rank of a TENSOR job that runs on this worker: what
// the worker's TensorService serves. The coordinator's TensorService calls
// every rank of the job with the same request, in the same order, so that
// collective ones (create from a seed needs none; SetDistSpec and GetGlobal
// do) line up across the ranks.
#ifndef COLOD_WORKER_DAEMON_TENSOR_HOST_H_
#define COLOD_WORKER_DAEMON_TENSOR_HOST_H_

#include <map>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "colod/v1/tensor.pb.h"
#include "worker/colo/colo_tensor.h"
#include "worker/colo/process_group.h"

namespace colod {

// Thread-safe. The collective calls (SetDistSpec, GetGlobal) run one at a
// time under an ordering lock that only they and Close take (the
// coordinator sends every rank its calls in one order). They work on a
// handle to the tensor (a ColoTensor shares its storage, which nothing
// writes in place) and store the result under the map's lock, which is
// held only briefly and never across a collective or a copy to the host:
// Create, GetShard, Describe, List and Delete do not wait for a collective
// (NCCL's first use of a group can hold one for its whole timeout). A
// tensor deleted, or deleted and made again, while it was redistributed
// keeps the newer state: the SetDistSpec is NOT_FOUND.
class TensorHost {
 public:
  // `pg` is the rank's process group and must outlive the host; tensors
  // live on `device`. The tensors held together may take `budget_bytes`
  // (each counted at its global size, which every rank materializes once,
  // plus Cost's bookkeeping), with what the calls in progress hold besides:
  // a Create the whole value beside the part, a SetDistSpec what its steps
  // hold (ConversionBytes).
  TensorHost(ProcessGroup* pg, Device device, int64_t budget_bytes)
      : pg_(pg), rank_(pg->rank()), mesh_(pg->mesh()), device_(device), budget_bytes_(budget_bytes) {}

  // A tensor name's bytes at most.
  static constexpr size_t kMaxNameBytes = 256;
  // The most bytes of values GetGlobal and GetShard answer with: gRPC's
  // 4 MiB message limit on the coordinator's hop to the workers, less room
  // for the rest of the answer. A larger value is refused before it is
  // gathered or copied (RESOURCE_EXHAUSTED), not after every rank gathered
  // it whole and the message failed.
  static constexpr int64_t kMaxValueBytes = (int64_t{4} << 20) - (int64_t{64} << 10);
  // What a tensor of `data_bytes` named `name` counts against the budget:
  // its data, its name and kPerTensorBytes of bookkeeping (the map's node,
  // the ColoTensor and its specs), so that empty or tiny tensors are not
  // free.
  static constexpr int64_t kPerTensorBytes = 1024;
  static int64_t Cost(int64_t data_bytes, const std::string& name) {
    return data_bytes + kPerTensorBytes + static_cast<int64_t>(name.size());
  }

  // ALREADY_EXISTS for a taken name; INVALID_ARGUMENT naming the field for a
  // missing name or one over kMaxNameBytes, a missing init, a bad dtype, a value whose bytes do not match its
  // shape, or a spec that does not fit the mesh or the shape;
  // RESOURCE_EXHAUSTED, before anything is allocated, for one that would
  // pass the budget.
  absl::StatusOr<v1::TensorLayout> Create(const v1::CreateTensorRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  // Collective. NOT_FOUND for an unknown name. Before the collective every
  // rank checks that all the mesh's ranks hold the tensor alike and were
  // asked the same (AgreeOnEveryRank): FAILED_PRECONDITION on every rank
  // where they do not; and that each has the budget for the conversion's
  // temporaries (ConversionBytes, held while it runs): RESOURCE_EXHAUSTED
  // on every rank where one lacks it.
  absl::StatusOr<v1::TensorLayout> SetDistSpec(const v1::SetDistSpecRequest& request)
      ABSL_LOCKS_EXCLUDED(collective_mu_, mu_);
  // This rank's shard. INVALID_ARGUMENT unless request.rank is this rank.
  absl::StatusOr<v1::GetShardResponse> GetShard(const v1::GetShardRequest& request);
  // The whole value (gathered and reduced). Collective, checked as
  // SetDistSpec's. With `answer` false the rank takes part in the gather
  // and answers with an empty value (GetGlobalRequest.value_on_rank_zero_only).
  absl::StatusOr<v1::TensorValue> GetGlobal(const std::string& name, bool answer = true)
      ABSL_LOCKS_EXCLUDED(collective_mu_, mu_);
  // The rank of the job's mesh this host is (a copy: usable once the group
  // is gone).
  int rank() const { return rank_; }
  absl::StatusOr<v1::TensorLayout> Describe(const std::string& name);
  // The layouts of the tensors named after `after` (all: ""), in name
  // order, as many as kMaxListBytes of them holds (one at least);
  // `*next` gets the last one's name where more follow, else "". Near the
  // 4 MiB a message may hold: a client that does not follow pages sees
  // every listing that could be sent before pages came.
  static constexpr size_t kMaxListBytes = (size_t{7} << 20) / 2;
  std::vector<v1::TensorLayout> List(const std::string& after = "", std::string* next = nullptr);
  absl::Status Delete(const std::string& name);
  // Waits for the collective call in progress (an aborted group ends it),
  // drops every tensor, and makes later calls UNAVAILABLE: the process
  // group is about to go away.
  void Close() ABSL_LOCKS_EXCLUDED(collective_mu_, mu_);

 private:
  // Bytes of the budget held (held_bytes_) for an operation, given back
  // when it goes out of scope, unless kept.
  class Reservation {
   public:
    Reservation(TensorHost* host, int64_t bytes) : host_(host), bytes_(bytes) {}
    Reservation(const Reservation&) = delete;
    Reservation& operator=(const Reservation&) = delete;
    ~Reservation() ABSL_LOCKS_EXCLUDED(host_->mu_);
    // Keeps `kept` of the bytes held (a tensor stored), gives the rest back.
    void KeepLocked(int64_t kept) ABSL_EXCLUSIVE_LOCKS_REQUIRED(host_->mu_);

   private:
    TensorHost* const host_;
    int64_t bytes_;
  };
  struct Entry {
    ColoTensor tensor;  // its ComputeSpec carries the request's compute_pattern
    uint64_t id = 0;    // which Create made it
    int64_t bytes = 0;  // its global size, counted against the budget
    uint64_t creation_id = 0;  // CreateTensorRequest.creation_id: which of the job's creates
  };
  absl::StatusOr<Entry*> FindLocked(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The most a conversion of `t` to `target` holds at once besides `t`'s
  // own part: over the steps of its plan, the part a step starts from and
  // twice the part after it (its result and the pieces gathered for it);
  // 0 for a conversion that cannot be planned (refused alike everywhere).
  static int64_t ConversionBytes(const ColoTensor& t, const DistSpec& target);
  // UNAVAILABLE once closed. Called under collective_mu_, which Close takes
  // to close: OK means the process group stays until that lock is let go
  // (a collective on a closed host would run on a group that is gone).
  absl::Status OpenForCollectives() ABSL_EXCLUSIVE_LOCKS_REQUIRED(collective_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // A copy of the named tensor's entry (a handle), taken under the map's lock.
  absl::StatusOr<Entry> Snapshot(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::TensorLayout> LayoutLocked(const std::string& name, const Entry& e)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Before a collective of the tensor call `call` on `name` (its entry, or
  // `found`'s error where this rank has none): whether every rank of the
  // mesh holds the same tensor (shape, dtype, spec, and the create that made
  // it: CreateTensorRequest.creation_id) and runs the same call,
  // by a fingerprint of them and a flag of any difference seen, gathered
  // along each axis in turn, so every rank returns the same answer.
  // Otherwise the ranks' pieces would not match (a Gloo size mismatch
  // aborts the process) or a rank would wait alone for its timeout: where
  // the coordinator's calls reached some ranks and not others, a Create one
  // rank refused (its budget), or a client called a worker directly. OK, or
  // FAILED_PRECONDITION on every rank naming this rank's tensor; `found`'s
  // error where every rank lacks the tensor.
  // `room`: whether this rank has the budget the call's temporaries need;
  // where a rank lacks it (and they agree otherwise), RESOURCE_EXHAUSTED on
  // every rank.
  absl::Status AgreeOnEveryRank(const std::string& call, const std::string& name, const absl::StatusOr<Entry>& found,
                                bool room) ABSL_EXCLUSIVE_LOCKS_REQUIRED(collective_mu_);

  // Used only where the group is known to be alive: under collective_mu_
  // after OpenForCollectives, or within a Create that Close waits for.
  ProcessGroup* const pg_;
  const int rank_;
  const DeviceMesh mesh_;  // the group's, copied: checks before any use of the group
  const Device device_;
  // Held across a collective call; taken before mu_.
  absl::Mutex collective_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  absl::Mutex mu_;
  std::map<std::string, Entry> tensors_ ABSL_GUARDED_BY(mu_);
  bool closed_ ABSL_GUARDED_BY(mu_) = false;
  int creating_ ABSL_GUARDED_BY(mu_) = 0;  // Creates making a shard without the lock
  const int64_t budget_bytes_;
  int64_t held_bytes_ ABSL_GUARDED_BY(mu_) = 0;  // of the tensors, and of Creates in progress
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace colod

#endif  // COLOD_WORKER_DAEMON_TENSOR_HOST_H_
