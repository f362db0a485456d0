// Jobs: submission, lifecycle, and the per-job event log that WatchJob streams.
#ifndef COLOD_SERVER_JOB_MANAGER_H_
#define COLOD_SERVER_JOB_MANAGER_H_

#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "colod/v1/job.pb.h"
#include "common/clock.h"
#include "server/event_log.h"

namespace colod {

// A trained step's report, not an eval_only run's (an evaluation without a
// step_duration).
bool IsTrainedStep(const v1::StepProgress& step);

// Holds every job and its event history. Jobs are validated on submit and
// then wait in PENDING until the scheduler (server/scheduler.h) assigns ranks.
//
// With a state directory every change of a job is written there before the
// call returns — step events at most once a second unless they name a
// checkpoint — so a restarted coordinator knows its jobs, their events and
// last checkpoints. A job's record is a snapshot (JOB.pb, replaced
// atomically) and a log of what changed since (JOB.log), folded into a new
// snapshot once it outgrows it (ReadRecord). Watchers see an event once it
// is written (WaitForEvents).
// Jobs that were SCHEDULED, RUNNING or RESTARTING when the coordinator
// stopped are RESTARTING on restart (their ranks' communicators died with
// it), to be placed again from their newest checkpoint, unless their restart
// policy allows none (then FAILED, the reason naming the checkpoint to resume
// from). A coordinator restart is not the job's failure: it does not count
// against max_restarts. PENDING jobs stay queued.
//
// Thread-safe. WaitForEvents blocks its caller, never the others. Records
// are written after the jobs' lock is released (a slow or full disk delays
// the call that changed a job, not the others' reads and changes), one
// writer at a time; a job's file always ends as its newest record.
class JobManager {
 public:
  explicit JobManager(Clock* clock = Clock::Real());
  // Loads the jobs recorded in `state_dir` (created if missing) and records
  // every later change there; submits' request ids are remembered across
  // restarts. A record that does not parse is set aside as FILE.damaged
  // (logged; its job id is not reused). FAILED_PRECONDITION naming the path
  // for a directory it cannot use or a record it cannot read.
  static absl::StatusOr<std::unique_ptr<JobManager>> Open(const std::string& state_dir,
                                                          Clock* clock = Clock::Real());

  // Jobs not ended (PENDING to RUNNING, RESTARTING) at once; Submit past it
  // is RESOURCE_EXHAUSTED. Jobs a restart loads count, and are kept.
  static constexpr int64_t kDefaultMaxActiveJobs = 10000;
  void SetMaxActiveJobs(int64_t n) ABSL_LOCKS_EXCLUDED(mu_);

  // A full data dir. Where a job's record cannot be written for want of
  // room (RESOURCE_EXHAUSTED), `make_room` is asked to free some (the
  // coordinator removes its DiskReserve), and where it did, the write is
  // tried again at once: what watchers are sent is then on disk. A submit's
  // first record never asks (a new job must not take the room kept for the
  // running ones' histories). While `admit` returns an error, Submit
  // refuses new jobs with it. Set before any write; either may be empty.
  struct RoomHooks {
    std::function<bool()> make_room;
    std::function<absl::Status()> admit;
  };
  void SetRoomHooks(RoomHooks hooks);

  // Whether two uploads hold different files (the coordinator's UploadStore:
  // their hashes differ; false where either is unknown, collected or
  // without a hash). A submit that repeats a request id with a spec that
  // differs only in its upload id is the same submission (a retry that
  // uploaded the model again) unless this says the files differ: then it
  // is ALREADY_EXISTS like any other spec. Called under the manager's lock:
  // it must not block. Set before any submit; may be empty.
  void SetUploadsDiffer(std::function<bool(const std::string& a, const std::string& b)> differ);

  // Validates (ValidateJobSpec) and adds a PENDING job with its memory floor
  // (`floor`, else JobMemoryFloor(spec): computed once, here, and stored with
  // the job). With a non-empty request_id, a repeated submit returns the
  // first job instead of a new one.
  // A TRAIN job whose checkpoint_dir or final_dir is that of a job not yet
  // ended is FAILED_PRECONDITION naming that job: two jobs saving into one
  // checkpoint directory remove each other's saves in progress, and two
  // writing one final directory mix their rank files (a next run may
  // resume from or overwrite it once the job ended).
  // RESOURCE_EXHAUSTED where SetMaxActiveJobs jobs have not ended: each
  // waiting job is copied and placed on every scheduler tick.
  // A job whose record cannot be written is not added: the error
  // (RESOURCE_EXHAUSTED for a full disk, atomic_file.h's FileError) is
  // returned and nothing of it remains, so an accepted job survives a
  // coordinator restart.
  absl::StatusOr<v1::Job> Submit(const v1::JobSpec& spec, absl::string_view request_id,
                                 std::optional<v1::MemoryFloor> floor = std::nullopt);
  // NOT_FOUND for an unknown id.
  absl::StatusOr<v1::Job> Get(absl::string_view job_id);
  // Jobs in submission order; only `states` if non-empty.
  std::vector<v1::Job> List(const std::vector<v1::JobState>& states);
  // A page of List: up to `limit` jobs whose ids come after `after` (all
  // when empty), each passed through `view` as it is copied out, the page
  // ending after the job that brings it to `max_bytes` (its jobs' encoded
  // sizes, as viewed); `more` says whether jobs follow.
  struct Page {
    std::vector<v1::Job> jobs;
    bool more = false;
  };
  Page ListPage(const std::vector<v1::JobState>& states, absl::string_view after, int limit,
                const std::function<void(v1::Job&)>& view = nullptr,
                size_t max_bytes = std::numeric_limits<size_t>::max());
  // Moves a job that has not ended to CANCELLED. FAILED_PRECONDITION if it
  // already ended, NOT_FOUND if unknown.
  absl::StatusOr<v1::Job> Cancel(absl::string_view job_id, absl::string_view reason);
  // Forgets an ended job: its record, events and request id go, and its id
  // is never handed out again. FAILED_PRECONDITION while it has not ended
  // (cancel it first), NOT_FOUND if unknown. Watchers get NOT_FOUND.
  absl::Status Delete(absl::string_view job_id);
  // Deletes the jobs that ended more than `retention` ago (by their last
  // update), and past `max_ended` ended jobs the oldest ended (by their last
  // update, then id) until that many are left; returns their ids. A
  // retention of zero or less keeps them however old, a max_ended of zero
  // or less however many.
  std::vector<std::string> Expire(absl::Duration retention, int64_t max_ended = 0);
  // The default of the coordinator's --max-ended-jobs.
  static constexpr int64_t kDefaultMaxEndedJobs = 10000;

  struct Events {
    std::vector<v1::JobEvent> events;
    // True when the job is in a final state and `events` reaches its last event.
    bool finished = false;
  };
  // PENDING or RESTARTING -> SCHEDULED with the mesh (ranks assigned) and a
  // new generation. FAILED_PRECONDITION unless the job is PENDING or
  // RESTARTING. `peak_flops`: the attempt's devices' dense peak
  // (spec/plan.h's PeakFlopsOf; 0 unknown), which the run summary's MFU
  // divides by from the attempt's next step on.
  // The new generation is on disk before it is handed out, so a coordinator
  // that restarts never places a job again under a generation a rank of it
  // may still run (the same rendezvous scope, the same checkpoint directory
  // names): where the record cannot be written (a full disk) the placement
  // is undone and the job goes back to its state with the reason (two
  // events: SCHEDULED and back), the generation spent, and the call fails
  // UNAVAILABLE. Not under a caller's lock: it writes the record before it
  // returns.
  absl::StatusOr<v1::Job> Schedule(absl::string_view job_id, const v1::MeshSpec& mesh, double peak_flops = 0);
  // The peak the summary's MFU divides by from now on, for attempt
  // `generation` (another's is ignored): rank 0 said which precision it
  // trains at (a run at auto that resumed a checkpoint of another). Kept
  // in memory, as Schedule's; the summary records it with the next step.
  absl::Status SetPeakFlops(absl::string_view job_id, int64_t generation, double peak_flops);
  // Moves a job that has not ended to `state` (RUNNING or a final state; or
  // PENDING again, with a new reason, while it waits).
  // FAILED_PRECONDITION if it already ended.
  absl::StatusOr<v1::Job> SetState(absl::string_view job_id, v1::JobState state, absl::string_view reason);
  // -> RESTARTING with `reason`: counts a restart and records `failure`
  // (why the attempt ended) in attempt_failures. FAILED_PRECONDITION if the
  // job already ended.
  absl::StatusOr<v1::Job> Restart(absl::string_view job_id, absl::string_view failure, absl::string_view reason);
  // Appends rank 0's step (and records step, loss and checkpoint on the
  // job). Each trained step is recorded once: a step already in the history
  // (re-run after a resume, or reported late by an earlier attempt) adds no
  // event and changes neither step nor loss, though its checkpoint list is
  // taken. A step reported late arrives after later ones; the job's step is
  // the highest recorded. FAILED_PRECONDITION once the job ended: its
  // history is closed.
  absl::Status AddStep(absl::string_view job_id, const v1::StepProgress& step);
  // AddStep for a step that generation `generation` (an earlier one) ran
  // and could not report then, from `worker_id`: PERMISSION_DENIED unless
  // that worker held rank 0 of that generation (Job.rank0_workers, the
  // newest kMaxRank0Workers generations; a generation before the record's
  // rank0_first_generation, placed before those fields existed, is trusted).
  static constexpr size_t kMaxRank0Workers = 64;
  absl::Status AddLateStep(absl::string_view job_id, int64_t generation, absl::string_view worker_id,
                           const v1::StepProgress& step);
  // Records a FORWARD job's outcome (before it is marked SUCCEEDED).
  absl::Status SetForwardResult(absl::string_view job_id, const v1::ForwardResult& result);
  // Appends a hang report (event) and sets the job's `stalled` to its
  // message; FAILED_PRECONDITION once the job ended.
  absl::Status AddHang(absl::string_view job_id, const v1::HangReport& hang);
  // Hang reports since this process started.
  int64_t HangCount();
  // Appends a rank's phase change; FAILED_PRECONDITION once the job ended.
  absl::Status AddRankStatus(absl::string_view job_id, const v1::RankStatus& status);
  // Rank 0 of a TRAIN job resumed from `checkpoint`, written after `step`:
  // where the record is behind it (its steps were not written: a full data
  // dir, then a crash), the job's step and last checkpoint become those
  // (its loss stays the last one recorded). Nothing otherwise.
  // FAILED_PRECONDITION once the job ended.
  absl::Status NoteResumed(absl::string_view job_id, int64_t step, const std::string& checkpoint);

  // Events with sequence >= from_sequence, at most `max_events` of them.
  // With a state directory, only events already written there (a step
  // waits up to kStepWriteInterval, until FlushStale): a watcher never sees
  // an event that a crash of the coordinator could take back, whose
  // sequence number would then be handed out again. (A write that fails
  // publishes its events all the same: a full disk must not stall every
  // watch.)
  // (a watcher's batch: they are copied under the jobs' lock, and a long
  // run's history holds an event a step). Waits up to `timeout` for at
  // least one if there are none yet. NOT_FOUND for an unknown id.
  static constexpr size_t kAllEvents = ~size_t{0};
  absl::StatusOr<Events> WaitForEvents(absl::string_view job_id, int64_t from_sequence, absl::Duration timeout,
                                       size_t max_events = kAllEvents);

  // The upload ids the jobs' specs name (every job still known, ended ones
  // included: a restart may need its model).
  std::set<std::string> UploadIdsInUse();
  // Number of jobs per state name ("pending", "running", ...).
  std::map<std::string, int> CountByState();
  // Jobs that ended in this process, per final state name ("succeeded",
  // "failed", "cancelled"; each present), counting those that Open failed
  // because the coordinator restarted while they ran.
  std::map<std::string, int64_t> FinishedCounts();

  static bool IsFinal(v1::JobState state);
  // Whether `id` has the shape of the ids Submit hands out: "job-" and six
  // digits or more (the order of jobs_ below assumes it).
  static bool IsJobId(absl::string_view id);

  // While one lives on a thread, the record writes of the changes that
  // thread makes through `manager` wait, and are written (each job's newest
  // record, once) when the outermost one ends. A caller that changes jobs
  // under a lock of its own (the Scheduler) declares one before it takes
  // that lock, so the disk is written after the lock is released: a slow or
  // full disk delays that call, not every caller of the lock. The changes are
  // visible at once, as always, and on disk before the scope ends (instead of
  // before each change returns). Submit never waits: it needs its record's
  // outcome. Belongs to the thread that made it.
  class DeferredWrites;

  // Called with the job id before each record write, on the writing thread
  // (tests: what locks that thread holds then).
  void SetBeforeWriteForTest(std::function<void(const std::string& job_id)> hook);
  // Writes every change not written yet (the steps of the last second:
  // AddStep writes at most once a second), before the coordinator stops.
  void Flush() ABSL_LOCKS_EXCLUDED(mu_, io_mu_);
  // Writes the changes that have waited kStepWriteInterval or longer: the
  // last steps of a job that reports no more for now, which watchers see
  // only once written. The coordinator calls it several times a second. A
  // change whose write failed (a CancelJob's, a job's end, on a full disk)
  // is tried again here, after kStepWriteInterval doubled for each failure
  // in a row up to kMaxWriteRetryInterval: a coordinator that restarts
  // after the disk had room again finds it.
  void FlushStale() ABSL_LOCKS_EXCLUDED(mu_, io_mu_);
  // How long a step may wait to be written (AddStep).
  static constexpr absl::Duration kStepWriteInterval = absl::Seconds(1);
  static constexpr absl::Duration kMaxWriteRetryInterval = absl::Seconds(64);
  // Bytes written to job records (snapshots and log entries) since Open.
  int64_t RecordBytesWritten();
  // A job's log (WriteRecord) is folded into a new snapshot once it holds
  // more than this and more than the snapshot.
  static constexpr int64_t kMinLogBytes = 1 << 20;

  // The record of job `job_id` in `state_dir` as Open reads it (its
  // snapshot and log), without writing anything. NOT_FOUND without a
  // snapshot; INVALID_ARGUMENT for one that does not parse. `log_tail`, if
  // given, gets what of the log was not taken (a torn or damaged entry and
  // what follows it), empty if none.
  static absl::StatusOr<v1::JobRecord> ReadRecord(const std::string& state_dir, const std::string& job_id,
                                                  std::string* log_tail = nullptr);

  // A directory a TRAIN job writes: its `field` (checkpoint_dir or
  // final_dir) and `dir`, normalized; one job at a time may write a dir.
  struct OutputDir {
    std::string field;
    std::string dir;
  };

 private:
  // A set of steps kept as runs of consecutive ones: a run's steps cost
  // one node, not one each.
  class StepSet {
   public:
    // False if `step` was in the set already.
    bool insert(int64_t step);

   private:
    std::map<int64_t, int64_t> runs_;  // first -> last, disjoint and not adjacent
  };
  // A record as read back: the JobRecord without its events, which are
  // kept serialized as they were read.
  struct StoredRecord {
    v1::JobRecord head;
    EventLog events;
    StepSet trained_steps;  // the steps the events record
  };
  static absl::StatusOr<StoredRecord> ReadStoredRecord(const std::string& state_dir, const std::string& job_id,
                                                       std::string* log_tail);
  struct Entry {
    v1::Job job;
    std::string request_id;  // of the submit that created it; may be empty
    EventLog events;
    absl::Time persisted = absl::InfinitePast();  // when its record was last taken for writing
    int64_t record_seq = 0;                       // the newest record's number (JobRecord.record_seq)
    bool unwritten = false;                       // changed since its record was last taken (Flush)
    // Record writes that failed in a row (a full or broken disk): the
    // change waits for FlushStale, which tries again less often each time.
    int write_failures = 0;
    size_t published = 0;                         // events watchers may see: written (WaitForEvents)
    StepSet trained_steps;                        // the steps its events record
    // When it first ran (its history's first RUNNING), once looked up.
    std::optional<absl::Time> first_running;
    bool first_running_known = false;
    // The latest attempt's devices' peak (Schedule), once scheduled since
    // this coordinator started; before that the summary's stored one holds.
    std::optional<double> attempt_peak_flops;
    // The model's FLOPs a token (0: not known), computed at its first step.
    std::optional<double> flops_per_token;
    // The directories it writes (OutputDirKeys, made outside mu_ when it
    // was submitted or read back): one job at a time may.
    std::vector<OutputDir> output_dirs;
  };
  // That a job's record must be written, once mu_ is released (file
  // writes and fsyncs never hold mu_). Most carry no bytes: WriteRecord
  // takes what changed since the last write when it writes (the log entry
  // of a long job's step is the step, not its history).
  struct RecordWrite {
    std::string job_id;
    int64_t seq = 0;  // the entry's record_seq when it was taken
    // A whole record (a JobRecord) to write as the snapshot, holding
    // `events` events: a submit's first record (the job is not known yet)
    // and Open's. Empty: the change is taken at write time.
    std::string whole;
    size_t events = 0;
    // Skip it if the job is gone by then (deleted); false for a submit's
    // first record, written before the job is added.
    bool only_if_known = true;
  };
  // What of a job is on disk (WriteRecord's, under io_mu_).
  struct OnDisk {
    int64_t seq = 0;             // the newest record_seq written
    size_t events = 0;           // events written (snapshot and log)
    int64_t snapshot_bytes = 0;  // of JOB.pb
    int64_t log_bytes = 0;       // of JOB.log
    // An append failed and may have left part or all of its entry: the
    // next write is a snapshot (nothing is appended after a torn entry, nor
    // an entry's events again).
    bool torn = false;
  };

  void AppendStateChangeLocked(Entry& e, v1::JobState state, absl::string_view reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A new event of `e` (its job id, the next sequence, now), to fill and
  // then append (AppendEventLocked).
  v1::JobEvent NewEventLocked(const Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AppendEventLocked(Entry& e, const v1::JobEvent& ev) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // After the write numbered `seq` of `job_id`'s record, which took its
  // first `events` events: lets watchers see them (written, or where it
  // failed, never hidden from them for good), and where it failed and no
  // later write was taken since, marks the job unwritten (FlushStale).
  void AfterWrite(const std::string& job_id, int64_t seq, size_t events, bool written) ABSL_LOCKS_EXCLUDED(mu_);
  // The summary's wall time: the first RUNNING event to now.
  void UpdateWallTimeLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // AddStep's change of the entry (whether to write the record now).
  absl::StatusOr<bool> AddStepLocked(Entry& e, const v1::StepProgress& step) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::StatusOr<Entry*> FindLocked(absl::string_view job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static absl::Status CheckNotEndedLocked(const Entry& e);
  // Applies `change` to the job under mu_ (NOT_FOUND for an unknown id; the
  // change's own error leaves nothing written); when it returns true, takes
  // the job's record and writes it once mu_ is released. `out`, if given,
  // gets the job as changed. With `must_record` the record is written now,
  // outside any DeferredWrites, and a failed write is returned (the change
  // stands in memory all the same); otherwise a failure is logged only.
  absl::Status ChangeJob(absl::string_view job_id, absl::FunctionRef<absl::StatusOr<bool>(Entry&)> change,
                         v1::Job* out = nullptr, bool must_record = false) ABSL_LOCKS_EXCLUDED(mu_, io_mu_);
  // That the job's record must be written (nullopt without a state
  // directory); cheap, under mu_. The caller writes it with WriteRecord once
  // mu_ is released.
  std::optional<RecordWrite> TakeRecordLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A JobRecord of `e` numbered `seq`: a snapshot (the job, every event and
  // the request id), or with `log_from_event` a log entry (the job and the
  // events from that one on).
  static std::string SerializeRecord(const Entry& e, int64_t seq, std::optional<size_t> log_from_event);
  // The same with the whole record serialized (RecordWrite::whole).
  std::optional<RecordWrite> TakeWholeRecordLocked(Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes a taken record to the state directory, never under mu_. Writes
  // are serialized (io_mu_): a record older than one of the same job already
  // written, or of a job deleted meanwhile, is skipped. Otherwise what
  // changed since the last write is appended to JOB.log (taken under mu_,
  // briefly: the job and the new events), or, once the log outgrew
  // the snapshot, the whole record replaces JOB.pb and the log is removed;
  // so a job's writes cost in all a few times its record, however long its
  // history. A failure is logged and returned: a change to a known job goes
  // on with its record stale; a new job is not accepted (Submit). Then the
  // events the write took are published to watchers, written or not.
  absl::Status WriteRecord(const std::optional<RecordWrite>& w) ABSL_LOCKS_EXCLUDED(mu_, io_mu_);
  // WriteRecord's write; `taken_events` gets how many events it took (0
  // for a write skipped).
  absl::Status WriteRecordEvents(const RecordWrite& w, size_t* taken_events) ABSL_LOCKS_EXCLUDED(mu_, io_mu_);
  // Forgets the job in memory; its files go in RemoveRecords (after mu_).
  void DeleteLocked(const std::string& job_id) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Removes deleted jobs' records and records the next id (so a deleted
  // job's id is never handed out again), never under mu_.
  void RemoveRecords(const std::vector<std::string>& job_ids, int64_t next_id) ABSL_LOCKS_EXCLUDED(mu_, io_mu_);

  // Writes `w` now, or hands it to this thread's DeferredWrites for this
  // manager; never under mu_.
  void WriteOrDefer(std::optional<RecordWrite> w) ABSL_LOCKS_EXCLUDED(mu_, io_mu_);

  Clock* const clock_;
  std::string state_dir_;  // empty: in memory only
  std::function<void(const std::string&)> before_write_;  // set before any write
  RoomHooks room_;  // set before any write
  std::function<bool(const std::string&, const std::string&)> uploads_differ_;  // set before any submit
  absl::Mutex mu_;
  // Job ids in the order they were handed out: job-NNNNNN has at least six
  // digits (IsJobId), and job-1000000 comes after job-999999 (shorter first), not
  // between job-100000 and job-100001 as strings would put it. List,
  // ListPage's pages and the scheduler's queue go in this order.
  struct JobIdOrder {
    bool operator()(const std::string& a, const std::string& b) const {
      return a.size() != b.size() ? a.size() < b.size() : a < b;
    }
  };
  std::map<std::string, Entry, JobIdOrder> jobs_ ABSL_GUARDED_BY(mu_);
  int64_t max_active_jobs_ ABSL_GUARDED_BY(mu_) = kDefaultMaxActiveJobs;
  absl::flat_hash_map<std::string, std::string> job_by_request_id_ ABSL_GUARDED_BY(mu_);
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  std::map<std::string, int64_t> finished_ ABSL_GUARDED_BY(mu_);
  int64_t hangs_ ABSL_GUARDED_BY(mu_) = 0;
  // Request ids whose submit is writing its first record: a repeated submit
  // waits for it instead of adding a second job.
  absl::flat_hash_set<std::string> submitting_ ABSL_GUARDED_BY(mu_);
  // The output directories (OutputDirKeys) of submits writing their
  // record: a concurrent submit of the same directory is refused as one of
  // a job already added would be.
  absl::flat_hash_set<std::string> submitting_dirs_ ABSL_GUARDED_BY(mu_);

  // The state directory's writer lock, taken before mu_ where both are held
  // (WriteRecord checks under mu_ that a job still exists).
  absl::Mutex io_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  // Per known job, what of it is on disk.
  absl::flat_hash_map<std::string, OnDisk> on_disk_ ABSL_GUARDED_BY(io_mu_);
  // Bytes written to records (snapshots and log entries) since Open.
  int64_t record_bytes_written_ ABSL_GUARDED_BY(io_mu_) = 0;
  int64_t next_id_written_ ABSL_GUARDED_BY(io_mu_) = 0;
};

class JobManager::DeferredWrites {
 public:
  explicit DeferredWrites(JobManager& manager);
  ~DeferredWrites();  // the outermost writes what its scope changed
  DeferredWrites(const DeferredWrites&) = delete;
  DeferredWrites& operator=(const DeferredWrites&) = delete;

 private:
  friend class JobManager;
  JobManager& manager_;
  DeferredWrites* const outer_;  // this thread's enclosing scope, of any manager
  std::vector<RecordWrite> writes_;
};

// "pending", "scheduled", ... for metrics labels and tables.
std::string JobStateName(v1::JobState state);
// "training", "serving", ... for reasons and tables.
std::string RankPhaseName(v1::RankPhase phase);

}  // namespace colod

#endif  // COLOD_SERVER_JOB_MANAGER_H_
