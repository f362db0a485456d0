// What the scheduler does to the ranks of its placements once something
// went wrong, or to find out whether it did: aborts, probing and hang
// reports. Scheduler decides (it owns the placements and their states);
// RankSupervisor carries the decisions to the workers and reads what they
// report.
//
//  - Aborts: StopRanks queues one AbortJob per rank of a placement that has
//    not ended; StopStaleRanks queues one for a worker whose heartbeat says
//    it runs a job generation the scheduler does not (it ended, or the
//    coordinator restarted), once per worker and generation. SendAborts
//    sends what is queued, every call at once.
//  - Probing: after a rank failure, ProbePeers asks the placement's other
//    live ranks for their status and returns the verdict: the reason, with
//    the peers that do not answer named first, and whether a restart may
//    mend it.
//  - Hangs: NewHangs finds the collectives that ranks wait in past the
//    threshold (FindHangs over the workers' last heartbeats) and returns each
//    once per placement (ForgetPlacement drops a placement's record).
//
// Thread-safety: thread-safe. Its mutex guards the queued aborts, the
// stale-rank record and the reported hangs; it is a leaf lock (never held
// across a call to a worker, nor while taking another lock), so the
// scheduler may call StopRanks, StopStaleRanks, NewHangs and ForgetPlacement
// under its own lock. SendAborts and ProbePeers block on the workers (up to
// their timeouts): call them holding no lock.
#ifndef COLOD_SERVER_RANK_SUPERVISOR_H_
#define COLOD_SERVER_RANK_SUPERVISOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/job.pb.h"
#include "colod/v1/mesh.pb.h"
#include "colod/v1/worker.pb.h"
#include "server/worker_client.h"

namespace colod {

// "rank 2 (worker w2 at host:port)": how job reasons and events name a rank.
std::string RankName(const v1::MeshSpec& mesh, int rank);
// The key a call to rank `rank`'s worker carries, from a placement's keys
// by rank (Scheduler's Placed::keys); "" past them.
std::string RankKey(const std::vector<std::string>& keys, int rank);

class RankSupervisor {
 public:
  struct Options {
    // Deadline of each AbortJob call.
    absl::Duration abort_timeout = absl::Seconds(3);
    // Deadline of each status probe.
    absl::Duration probe_timeout = absl::Seconds(2);
    // Waiting in a collective this long is a hang (> 0).
    absl::Duration hang_threshold = absl::Seconds(30);
    // A stale rank's abort that did not reach its worker is sent again this
    // long after, twice as long after each failure in a row up to
    // kMaxStaleAbortRetry (StopStaleRanks): SendAborts waits for each.
    absl::Duration stale_abort_retry = absl::Seconds(10);
  };

  // The ranks of a placement to probe after `failure` (the first failure a
  // rank reported, with its code): every rank that has not ended, but the
  // failed one.
  struct Probe {
    std::string job_id;
    int64_t generation = 0;
    std::vector<std::string> names;  // RankName of each
    std::vector<WorkerClient::Call<v1::GetStatusRequest>> calls;  // GetStatus of each
    std::string failure;
    absl::StatusCode failure_code = absl::StatusCode::kUnknown;
  };
  struct Verdict {
    std::string reason;
    // Whether a restart may mend it: a peer that does not answer is the
    // cluster's failure, whatever the first rank to notice it reported;
    // else the failure's code decides (IsRetryableRankError).
    bool retryable = false;
  };

  // `client` carries the calls; never null.
  RankSupervisor(std::shared_ptr<WorkerClient> client, Options options);

  // Queues an abort of the placement to each rank of `mesh` not in `ended`
  // and not `except_rank` (-1: none). `keys`: each rank's worker's key, by
  // rank (Scheduler's Placed::keys), carried by its call (WorkerClient::
  // Call::key): a daemon restarted at a rank's address refuses it. Each
  // abort carries `job_uid` (Job.uid): a worker that gets it before the
  // rank's assignment refuses the assignment (AbortJobRequest.job_uid).
  void StopRanks(const std::string& job_id, const std::string& job_uid, int64_t generation, const v1::MeshSpec& mesh,
                 const std::vector<std::string>& keys, const std::set<int>& ended, int except_rank,
                 const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);
  // Queues an abort to each BUSY worker of `workers` whose job generation
  // `runs(job_id, generation)` denies, unless it was told already about that
  // generation (the record keeps only the workers still stale, so a worker
  // that took the job up again is told again) and the telling did not fail:
  // an abort that did not reach the worker (unavailable, a deadline, no
  // answer) is sent again stale_abort_retry after (one the worker refused,
  // another key or generation, is not), since nothing else would stop that rank (a
  // serving TENSOR rank, one stuck in a collective) and its worker would stay
  // BUSY for good; each carries `key_to_call(worker_id)`
  // (WorkerRegistry::KeyToCall).
  void StopStaleRanks(const std::vector<v1::Worker>& workers,
                      const std::function<bool(const std::string& job_id, int64_t generation)>& runs,
                      const WorkerKeyToCall& key_to_call)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Sends every queued abort (all at once) and logs failures other than
  // NOT_FOUND (the rank already ended; a stale rank's failed abort is sent
  // again, StopStaleRanks). Blocks up to abort_timeout.
  void SendAborts() ABSL_LOCKS_EXCLUDED(mu_);

  // `keys` as StopRanks's.
  static Probe PeersToProbe(const std::string& job_id, int64_t generation, const v1::MeshSpec& mesh,
                            const std::vector<std::string>& keys, const std::set<int>& ended, int failed_rank,
                            std::string failure, absl::StatusCode failure_code);
  // Probes `probe`'s ranks (all at once; a dead worker refuses or does not
  // answer, a stopped one does not answer in time) and judges (JudgeProbe).
  // Blocks up to probe_timeout.
  Verdict ProbePeers(const Probe& probe) ABSL_LOCKS_EXCLUDED(mu_);
  // The same for several jobs' probes, every rank of all of them at once:
  // one probe_timeout in all, not one a job (a SIGSTOPped worker in each of
  // several failed jobs held the scheduler's tick for each in turn). The
  // verdicts in `probes`' order.
  std::vector<Verdict> ProbePeers(const std::vector<Probe>& probes) ABSL_LOCKS_EXCLUDED(mu_);
  // The verdict from the probe's answers, in its ranks' order. Pure.
  static Verdict JudgeProbe(const Probe& probe, const std::vector<absl::Status>& answers);

  // The hangs of one running placement not returned before (per collective
  // and set of silent ranks: a rank falling silent after the first report
  // is named in a second), from `workers`' last heartbeats at `now`.
  std::vector<v1::HangReport> NewHangs(const std::string& job_id, int64_t generation, const v1::MeshSpec& mesh,
                                       const std::map<std::string, const v1::Worker*>& workers, absl::Time now)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Drops the hangs recorded for `job_id` (its placement was released).
  void ForgetPlacement(const std::string& job_id) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const std::shared_ptr<WorkerClient> client_;
  const Options options_;

  absl::Mutex mu_;
  // A queued abort; `stale_worker`: the worker id of a stale rank's
  // (StopStaleRanks), "" for a placement's (StopRanks).
  struct Queued {
    WorkerClient::Call<v1::AbortJobRequest> call;
    std::string stale_worker;
  };
  std::vector<Queued> aborts_ ABSL_GUARDED_BY(mu_);
  // Workers told to stop a stale rank: worker id -> "job/generation" and
  // when to tell it again (InfiniteFuture: sent, not failed).
  struct Told {
    std::string key;
    absl::Time again = absl::InfiniteFuture();
    int failures = 0;  // in a row
  };
  static constexpr absl::Duration kMaxStaleAbortRetry = absl::Minutes(5);
  std::map<std::string, Told> stale_told_ ABSL_GUARDED_BY(mu_);
  // Per job: "generation/group#sequence silent RANKS" of each hang returned.
  std::map<std::string, std::set<std::string>> hangs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace colod

#endif  // COLOD_SERVER_RANK_SUPERVISOR_H_
