#include "server/job_manager.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <iterator>
#include <limits>
#include <optional>
#include <random>
#include <system_error>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/atomic_file.h"
#include "common/little_endian.h"
#include "common/logging.h"
#include "common/proto_time.h"
#include "common/status_macros.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "spec/job_validation.h"
#include "spec/model_config.h"
#include "spec/plan.h"

namespace colod {

namespace {
// Job numbers stay below this (2^62): a next id read from the data dir at or
// past it is not taken, and none is handed out past it.
constexpr int64_t kMaxJobNumber = int64_t{1} << 62;
}  // namespace
namespace {

// The directories a TRAIN spec writes, which one job at a time may (as a
// checkpoint_dir or a final_dir alike): each with its dir lexically normal
// and without a trailing separator, and, for an absolute dir whose links
// the coordinator can resolve (a shared file system, an embedded cluster),
// again with the dir resolved, so that a link to another job's directory is
// that directory. Jobs are compared by the dirs. Reads the file system:
// never called under mu_.
std::vector<JobManager::OutputDir> OutputDirKeys(const v1::JobSpec& spec) {
  std::vector<JobManager::OutputDir> keys;
  if (spec.kind() != v1::JOB_KIND_TRAIN || spec.train().eval_only()) return keys;  // an evaluation writes nothing
  // A checkpoint_dir without checkpoint_every is never written.
  const bool saves = spec.train().checkpoint_every() > 0;
  const auto trimmed = [](std::string key) {
    while (key.size() > 1 && key.back() == '/') key.pop_back();
    return key;
  };
  for (const auto& [field, dir] :
       {std::pair<const char*, std::string>{"checkpoint_dir", saves ? spec.train().checkpoint_dir() : ""},
        std::pair<const char*, std::string>{"final_dir", spec.train().final_dir()}}) {
    if (dir.empty()) continue;
    const std::string key = trimmed(std::filesystem::path(dir).lexically_normal().string());
    keys.push_back({field, key});
    if (!std::filesystem::path(dir).is_absolute()) continue;
    std::error_code ec;
    const std::filesystem::path resolved = std::filesystem::weakly_canonical(dir, ec);
    if (ec || resolved.empty()) continue;
    const std::string real = trimmed(resolved.string());
    if (real != key) keys.push_back({field, real});
  }
  return keys;
}

// Job.uid: 64 random bits, hex.
std::string NewJobUid() {
  std::random_device rd;
  return absl::StrCat(absl::Hex(rd(), absl::kZeroPad8), absl::Hex(rd(), absl::kZeroPad8));
}

// The run summary's model FLOPs per token (spec/plan.h); 0 where not
// known (a config that does not parse, an encoder-decoder).
double TrainFlopsPerTokenOf(const v1::JobSpec& spec) {
  absl::StatusOr<ModelConfig> config = ParseModelConfig(spec.model().config_json());
  if (!config.ok()) return 0;
  absl::StatusOr<double> flops = TrainFlopsPerToken(*config, spec.train().seq_len());
  return flops.ok() ? *flops : 0;
}

// In the state directory: the next job id, written when a job is deleted.
constexpr char kNextIdFile[] = "next-id";

std::string SnapshotPath(absl::string_view dir, absl::string_view job_id) {
  return absl::StrCat(dir, "/", job_id, ".pb");
}
std::string LogPath(absl::string_view dir, absl::string_view job_id) { return absl::StrCat(dir, "/", job_id, ".log"); }

// Appends `entry` to the log at `path` as one entry (its 4-byte
// little-endian length, then it) and syncs it. On a failure the file is cut
// back to where it was, so that no part of an entry stays; `*torn` says
// whether something of it may have stayed.
absl::Status AppendLogEntry(const std::string& path, absl::string_view entry, bool* torn) {
  *torn = false;
  if (entry.size() > UINT32_MAX) return absl::InvalidArgumentError("a job record entry over 4 GiB");
  std::string buf(4, '\0');
  for (int i = 0; i < 4; ++i) buf[i] = static_cast<char>((entry.size() >> (8 * i)) & 0xff);
  buf.append(entry.data(), entry.size());
  const int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return FileError("cannot open", path, errno);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return FileError("cannot stat", path, err);
  }
  absl::Status s = WriteAll(fd, buf, path);
  if (s.ok() && ::fdatasync(fd) != 0) s = FileError("cannot sync", path, errno);
  if (!s.ok()) {
    if (::ftruncate(fd, st.st_size) != 0 || ::fdatasync(fd) != 0) *torn = true;
    ::close(fd);
    return s;
  }
  // From here on the entry is in the file: a failure leaves it there
  // (`*torn`: the next write replaces the log, so that it is not appended
  // again after itself).
  if (::close(fd) != 0) {
    *torn = true;
    return FileError("cannot close", path, errno);
  }
  if (st.st_size == 0) {  // a new file: its name must be durable too
    if (absl::Status s = SyncDirectory(std::filesystem::path(path).parent_path().string()); !s.ok()) {
      *torn = true;
      return s;
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool IsTrainedStep(const v1::StepProgress& step) { return !step.has_eval() || step.has_step_duration(); }

namespace {

// Splits a serialized JobRecord into the record without its events (`head`)
// and its events' bytes (views into `bytes`), without building the events:
// a long history parsed whole took about four times its size in memory.
// False for bytes that are not a JobRecord.
bool SplitRecord(absl::string_view bytes, v1::JobRecord* head, std::vector<absl::string_view>* events) {
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max())) return false;
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  in.SetTotalBytesLimit(std::numeric_limits<int>::max());
  std::string rest;  // every other field, as it is
  while (static_cast<size_t>(in.CurrentPosition()) < bytes.size()) {
    const size_t start = static_cast<size_t>(in.CurrentPosition());
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return false;  // bytes that are no tag (a varint cut short, or 0)
    const uint32_t field = tag >> 3, type = tag & 7;
    if (field == static_cast<uint32_t>(v1::JobRecord::kEventsFieldNumber) && type == 2) {  // length-delimited
      uint32_t n = 0;
      if (!in.ReadVarint32(&n)) return false;
      const size_t at = static_cast<size_t>(in.CurrentPosition());
      if (n > bytes.size() - at || !in.Skip(static_cast<int>(n))) return false;
      events->push_back(bytes.substr(at, n));
      continue;
    }
    // Anything else (the job, the request id, unknown fields) as the
    // message parser would take it.
    if (!google::protobuf::internal::WireFormatLite::SkipField(&in, tag)) return false;
    rest.append(bytes.data() + start, static_cast<size_t>(in.CurrentPosition()) - start);
  }
  return head->ParseFromString(rest);
}

// Parses every event of `views`; false if one is not a JobEvent.
bool ParseEvents(const std::vector<absl::string_view>& views, std::vector<v1::JobEvent>* out) {
  out->resize(views.size());
  for (size_t i = 0; i < views.size(); ++i) {
    if (!(*out)[i].ParseFromArray(views[i].data(), static_cast<int>(views[i].size()))) return false;
  }
  return true;
}

}  // namespace

absl::StatusOr<JobManager::StoredRecord> JobManager::ReadStoredRecord(const std::string& state_dir,
                                                                      const std::string& job_id,
                                                                      std::string* log_tail) {
  if (log_tail != nullptr) log_tail->clear();
  const std::string pb = SnapshotPath(state_dir, job_id);
  if (!IsRegularFile(pb)) return absl::NotFoundError(absl::StrCat("no record file ", pb));
  StoredRecord record;
  {
    ASSIGN_OR_RETURN(const std::string bytes, ReadFileToString(pb));
    std::vector<absl::string_view> views;
    if (!SplitRecord(bytes, &record.head, &views) || record.head.job().job_id() != job_id) {
      return absl::InvalidArgumentError(absl::StrCat(pb, " is not a record of job ", job_id));
    }
    // One event at a time: a long history is never held parsed whole.
    v1::JobEvent ev;
    for (absl::string_view view : views) {
      if (!ev.ParseFromArray(view.data(), static_cast<int>(view.size()))) {
        return absl::InvalidArgumentError(absl::StrCat(pb, " is not a record of job ", job_id));
      }
      if (ev.has_step() && IsTrainedStep(ev.step())) record.trained_steps.insert(ev.step().step());
      record.events.AppendSerialized(view);
    }
  }
  const std::string log = LogPath(state_dir, job_id);
  if (!IsRegularFile(log)) return record;
  ASSIGN_OR_RETURN(const std::string entries, ReadFileToString(log));
  // Entries in order; a torn one (a crash mid-append) or one that does not
  // follow (damaged) ends what is taken. One no newer than the snapshot is
  // passed over.
  size_t at = 0;
  while (entries.size() - at >= 4) {
    const uint64_t n = LoadLittleEndian(reinterpret_cast<const unsigned char*>(entries.data() + at), 4);
    if (n > entries.size() - at - 4 || n > static_cast<uint64_t>(std::numeric_limits<int>::max())) break;
    v1::JobRecord entry;
    std::vector<absl::string_view> views;
    std::vector<v1::JobEvent> events;
    if (!SplitRecord(absl::string_view(entries).substr(at + 4, n), &entry, &views) || !ParseEvents(views, &events) ||
        entry.job().job_id() != job_id || !entry.request_id().empty()) {
      break;
    }
    if (entry.record_seq() > record.head.record_seq()) {
      if (!events.empty() && events[0].sequence() != static_cast<int64_t>(record.events.size()) + 1) break;
      *record.head.mutable_job() = std::move(*entry.mutable_job());
      for (size_t i = 0; i < views.size(); ++i) {
        if (events[i].has_step() && IsTrainedStep(events[i].step())) {
          record.trained_steps.insert(events[i].step().step());
        }
        record.events.AppendSerialized(views[i]);
      }
      record.head.set_record_seq(entry.record_seq());
    }
    at += 4 + n;
  }
  if (log_tail != nullptr) *log_tail = entries.substr(at);
  return record;
}

absl::StatusOr<v1::JobRecord> JobManager::ReadRecord(const std::string& state_dir, const std::string& job_id,
                                                     std::string* log_tail) {
  ASSIGN_OR_RETURN(StoredRecord stored, ReadStoredRecord(state_dir, job_id, log_tail));
  v1::JobRecord record = std::move(stored.head);
  for (size_t i = 0; i < stored.events.size(); ++i) *record.add_events() = stored.events.Get(i);
  return record;
}

std::string JobStateName(v1::JobState state) {
  std::string name = v1::JobState_Name(state);
  const std::string prefix = "JOB_STATE_";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  return absl::AsciiStrToLower(name);
}

std::string RankPhaseName(v1::RankPhase phase) {
  std::string name = v1::RankPhase_Name(phase);
  const std::string prefix = "RANK_PHASE_";
  if (name.rfind(prefix, 0) == 0) name = name.substr(prefix.size());
  return absl::AsciiStrToLower(name);
}

bool JobManager::IsFinal(v1::JobState state) {
  return state == v1::JOB_STATE_SUCCEEDED || state == v1::JOB_STATE_FAILED ||
         state == v1::JOB_STATE_CANCELLED;
}

bool JobManager::IsJobId(absl::string_view id) {
  return absl::StartsWith(id, "job-") && id.size() >= 10 && std::all_of(id.begin() + 4, id.end(), absl::ascii_isdigit);
}

JobManager::JobManager(Clock* clock) : clock_(clock) {}

absl::StatusOr<std::unique_ptr<JobManager>> JobManager::Open(const std::string& state_dir, Clock* clock) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(state_dir, ec);
  if (ec) {
    return absl::FailedPreconditionError(absl::StrCat("cannot create '", state_dir, "': ", ec.message()));
  }
  auto m = std::make_unique<JobManager>(clock);
  absl::StatusOr<std::vector<std::string>> names = ListDirectory(state_dir);
  if (!names.ok()) return absl::FailedPreconditionError(names.status().message());
  // Every file is read and parsed before the lock is taken (none is held
  // across a read), one at a time.
  struct File {
    std::string name, path;
    std::optional<StoredRecord> record;   // nullopt: damaged, set aside
    OnDisk on_disk;                       // of the record read
    bool had_log = false;                 // its log is folded into a new snapshot
    std::vector<OutputDir> output_dirs;   // OutputDirKeys of a job not ended (reads the file system)
  };
  std::vector<File> files;
  const std::set<std::string> present(names->begin(), names->end());
  for (const std::string& name : *names) {
    if (IsAtomicWriteLeftover(name) && IsRegularFile(state_dir + "/" + name)) {
      // A snapshot written when the last coordinator died: its record is
      // the one before (the rename never happened).
      fs::remove(state_dir + "/" + name, ec);
      continue;
    }
    if (absl::StartsWith(name, "job-") && absl::EndsWith(name, ".log") &&
        !present.count(absl::StrCat(name.substr(0, name.size() - 4), ".pb"))) {
      // A log without its snapshot: left by a delete cut short. Nothing reads it.
      fs::remove(state_dir + "/" + name, ec);
      continue;
    }
    if (!absl::StartsWith(name, "job-") || !absl::EndsWith(name, ".pb")) continue;
    File f{name, state_dir + "/" + name, std::nullopt};
    // One bad file must not keep the coordinator (and every other job) down:
    // a record that does not parse, or a directory or a device of its name,
    // is kept for a human to look at, out of the way. A read error fails.
    const std::string id = name.substr(0, name.size() - 3);
    std::string tail;
    absl::StatusOr<StoredRecord> record = ReadStoredRecord(state_dir, id, &tail);
    if (record.ok()) {
      f.on_disk.seq = record->head.record_seq();
      f.on_disk.events = record->events.size();
      f.had_log = present.count(id + ".log") > 0;
      if (!tail.empty()) {
        COLOD_LOG(WARNING) << "job record log " << LogPath(state_dir, id) << " ends in " << tail.size()
                           << " bytes that are not a whole entry (a write cut short); the record is taken up to there";
      }
      if (!IsFinal(record->head.job().state())) f.output_dirs = OutputDirKeys(record->head.job().spec());
      f.record = *std::move(record);
    } else if (!absl::IsNotFound(record.status()) && !absl::IsInvalidArgument(record.status())) {
      return record.status();
    }
    files.push_back(std::move(f));
  }
  // The next id, written when a job is deleted: a deleted job's id is never
  // handed out again, even when its record was the newest. One that exists
  // but cannot be read fails.
  const std::string next_id_path = state_dir + "/" + kNextIdFile;
  const absl::StatusOr<std::string> next_id = ReadFileToString(next_id_path);
  if (!next_id.ok() && !absl::IsNotFound(next_id.status())) return next_id.status();
  std::vector<std::string> damaged;  // set aside once the lock is released
  std::vector<std::optional<RecordWrite>> writes;  // written once the lock is released
  std::set<std::string> rewrite;                   // jobs whose record is written again (a log folded in)
  {
    absl::MutexLock lock(&m->mu_);
    if (next_id.ok()) {
      int64_t n = 0;
      if (absl::SimpleAtoi(absl::StripAsciiWhitespace(*next_id), &n) && n > 0 && n <= kMaxJobNumber) {
        m->next_id_ = std::max(m->next_id_, n);
      }
    }
    for (File& f : files) {
      // job-NNNNNN.pb: its number is taken even if the record is damaged.
      const std::string& name = f.name;
      int64_t n = 0;
      // (A number past any a coordinator hands out, 2^62, from a planted
      // file is not taken: the next ones would overflow.)
      if (absl::SimpleAtoi(absl::string_view(name).substr(4, name.size() - 4 - 3), &n) && n >= 0 &&
          n < kMaxJobNumber) {
        m->next_id_ = std::max(m->next_id_, n + 1);
      }
      if (!f.record.has_value()) {
        damaged.push_back(f.path);
        continue;
      }
      StoredRecord& record = *f.record;
      Entry e;
      e.job = std::move(*record.head.mutable_job());
      e.record_seq = record.head.record_seq();
      if (f.had_log) rewrite.insert(e.job.job_id());
      // A record written before jobs stored their memory floor gets it now,
      // once (the scheduler places jobs by it).
      if (!e.job.has_memory_floor() && e.job.spec().kind() != v1::JOB_KIND_TENSOR) {
        const v1::MemoryFloor floor = JobMemoryFloor(e.job.spec());
        if (floor.total_bytes() > 0) *e.job.mutable_memory_floor() = floor;
      }
      e.events = std::move(record.events);
      e.published = e.events.size();  // read back: on disk
      e.trained_steps = std::move(record.trained_steps);
      e.request_id = record.head.request_id();
      f.record.reset();  // what was not moved into the entry
      if (!e.request_id.empty()) m->job_by_request_id_[e.request_id] = e.job.job_id();
      e.output_dirs = std::move(f.output_dirs);
      m->jobs_.emplace(e.job.job_id(), std::move(e));
    }
    m->state_dir_ = state_dir;
    for (auto& [id, e] : m->jobs_) {
      const v1::JobState state = e.job.state();
      if (state != v1::JOB_STATE_SCHEDULED && state != v1::JOB_STATE_RUNNING && state != v1::JOB_STATE_RESTARTING) {
        continue;
      }
      std::string reason = "the coordinator restarted while the job ran";
      if (RestartLimitsOf(e.job.spec()).max_restarts > 0) {
        absl::StrAppend(&reason, "; placing it again");
        if (ResumesFromCheckpoint(e.job)) {
          absl::StrAppend(&reason, " from its newest checkpoint in ", e.job.spec().train().checkpoint_dir());
        }
        m->AppendStateChangeLocked(e, v1::JOB_STATE_RESTARTING, reason);
      } else {
        if (!e.job.last_checkpoint().empty()) {
          absl::StrAppend(&reason, "; resume from ", e.job.last_checkpoint());
        }
        m->AppendStateChangeLocked(e, v1::JOB_STATE_FAILED, reason);
      }
      rewrite.insert(id);
    }
    // Whole records: a log is folded into its snapshot (and so no entry is
    // ever appended after a torn one).
    for (const std::string& id : rewrite) writes.push_back(m->TakeWholeRecordLocked(m->jobs_.at(id)));
  }
  {
    absl::MutexLock io(&m->io_mu_);
    for (const File& f : files) {
      if (!f.record.has_value()) continue;
      OnDisk& d = m->on_disk_[f.name.substr(0, f.name.size() - 3)];
      d = f.on_disk;
      d.snapshot_bytes = static_cast<int64_t>(fs::file_size(f.path, ec));
      if (ec) d.snapshot_bytes = 0;
    }
  }
  for (const std::string& path : damaged) {
    fs::rename(path, path + ".damaged", ec);
    COLOD_LOG(ERROR) << "job record '" << path << "' is damaged; set aside as " << path << ".damaged"
                     << (ec ? absl::StrCat(" failed: ", ec.message()) : "");
    const std::string log = path.substr(0, path.size() - 3) + ".log";
    if (fs::exists(log, ec)) fs::rename(log, log + ".damaged", ec);
  }
  for (const auto& w : writes) (void)m->WriteRecord(w);
  return m;
}

void JobManager::Flush() {
  std::vector<std::optional<RecordWrite>> writes;
  {
    absl::MutexLock lock(&mu_);
    for (auto& [id, e] : jobs_) {
      if (e.unwritten) writes.push_back(TakeRecordLocked(e));
    }
  }
  for (const auto& w : writes) (void)WriteRecord(w);  // logged
}

void JobManager::FlushStale() {
  std::vector<std::optional<RecordWrite>> writes;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    for (auto& [id, e] : jobs_) {
      const absl::Duration wait = DoubledWait(kStepWriteInterval, e.write_failures, kMaxWriteRetryInterval);
      if (e.unwritten && now - e.persisted >= wait) writes.push_back(TakeRecordLocked(e));
    }
  }
  for (const auto& w : writes) (void)WriteRecord(w);  // logged
}

std::optional<JobManager::RecordWrite> JobManager::TakeRecordLocked(Entry& e) {
  e.persisted = clock_->Now();
  e.unwritten = false;
  if (state_dir_.empty()) return std::nullopt;
  RecordWrite w;
  w.job_id = e.job.job_id();
  w.seq = ++e.record_seq;
  return w;
}

std::string JobManager::SerializeRecord(const Entry& e, int64_t seq, std::optional<size_t> log_from_event) {
  v1::JobRecord record;
  *record.mutable_job() = e.job;
  if (!log_from_event.has_value()) record.set_request_id(e.request_id);  // a snapshot's; a log entry has none
  record.set_record_seq(seq);
  std::string bytes = record.SerializeAsString();
  // The events as they are kept: the record's `events` field (2).
  e.events.AppendAsField(v1::JobRecord::kEventsFieldNumber, log_from_event.value_or(0), &bytes);
  return bytes;
}

std::optional<JobManager::RecordWrite> JobManager::TakeWholeRecordLocked(Entry& e) {
  std::optional<RecordWrite> w = TakeRecordLocked(e);
  if (!w.has_value()) return w;
  w->whole = SerializeRecord(e, w->seq, std::nullopt);
  w->events = e.events.size();
  return w;
}

namespace {

// This thread's innermost DeferredWrites scope (of any manager), or null.
thread_local JobManager::DeferredWrites* current_deferral = nullptr;

}  // namespace

JobManager::DeferredWrites::DeferredWrites(JobManager& manager) : manager_(manager), outer_(current_deferral) {
  current_deferral = this;
}

JobManager::DeferredWrites::~DeferredWrites() {
  current_deferral = outer_;
  for (DeferredWrites* d = outer_; d != nullptr; d = d->outer_) {
    if (&d->manager_ == &manager_) {  // an enclosing scope of the same manager writes them
      for (RecordWrite& w : writes_) d->writes_.push_back(std::move(w));
      return;
    }
  }
  // Each job's newest record: the older ones would be skipped anyway.
  absl::flat_hash_set<std::string> newest;
  std::vector<const RecordWrite*> order;
  for (auto it = writes_.rbegin(); it != writes_.rend(); ++it) {
    if (newest.insert(it->job_id).second) order.push_back(&*it);
  }
  for (auto it = order.rbegin(); it != order.rend(); ++it) (void)manager_.WriteRecord(**it);
}

void JobManager::WriteOrDefer(std::optional<RecordWrite> w) {
  if (!w.has_value()) return;
  for (DeferredWrites* d = current_deferral; d != nullptr; d = d->outer_) {
    if (&d->manager_ == this) {
      d->writes_.push_back(std::move(*w));
      return;
    }
  }
  (void)WriteRecord(w);  // logged; the change stands
}

void JobManager::SetBeforeWriteForTest(std::function<void(const std::string& job_id)> hook) {
  before_write_ = std::move(hook);
}

int64_t JobManager::RecordBytesWritten() {
  absl::MutexLock io(&io_mu_);
  return record_bytes_written_;
}

void JobManager::SetRoomHooks(RoomHooks hooks) { room_ = std::move(hooks); }

void JobManager::SetUploadsDiffer(std::function<bool(const std::string& a, const std::string& b)> differ) {
  uploads_differ_ = std::move(differ);
}

absl::Status JobManager::WriteRecord(const std::optional<RecordWrite>& w) {
  if (!w.has_value()) return absl::OkStatus();
  if (before_write_) before_write_(w->job_id);
  size_t events = 0;  // the events this write takes: watchers may see them once it ended
  absl::Status s = WriteRecordEvents(*w, &events);
  if (absl::IsResourceExhausted(s) && w->only_if_known && room_.make_room && room_.make_room()) {
    s = WriteRecordEvents(*w, &events);
    if (s.ok()) COLOD_LOG(INFO) << "job " << w->job_id << " recorded in the room made for it";
  }
  AfterWrite(w->job_id, w->seq, events, s.ok());
  return s;
}

absl::Status JobManager::WriteRecordEvents(const RecordWrite& w, size_t* taken_events) {
  absl::MutexLock io(&io_mu_);
  auto known = on_disk_.find(w.job_id);
  if (known != on_disk_.end() && known->second.seq >= w.seq) return absl::OkStatus();  // a newer one is there
  const OnDisk* d = known == on_disk_.end() ? nullptr : &known->second;
  bool whole = !w.whole.empty();
  std::string taken;  // what this write takes, unless it is w.whole
  int64_t seq = w.seq;
  size_t events = w.events;
  if (whole ? w.only_if_known : true) {
    absl::MutexLock lock(&mu_);  // brief: io_mu_ is held, so no delete removes files meanwhile
    auto it = jobs_.find(w.job_id);
    if (it == jobs_.end()) return absl::OkStatus();  // deleted since: its files stay removed
    if (!whole) {
      // Every change so far, numbered as the newest (later takes of it are
      // then skipped): the job and the events the disk lacks, or all of it
      // once the log outgrew the snapshot.
      const Entry& e = it->second;
      whole = d == nullptr || d->torn || d->events > e.events.size() ||
              (d->log_bytes > kMinLogBytes && d->log_bytes > d->snapshot_bytes);
      seq = e.record_seq;
      events = e.events.size();
      taken = SerializeRecord(e, seq, whole ? std::nullopt : std::optional<size_t>(d->events));
    }
  }
  *taken_events = events;
  const absl::string_view bytes = w.whole.empty() ? absl::string_view(taken) : absl::string_view(w.whole);
  if (whole) {
    absl::Status s = WriteFileAtomically(SnapshotPath(state_dir_, w.job_id), bytes);
    if (!s.ok()) {
      COLOD_LOG(ERROR) << "cannot record job " << w.job_id << ": " << s;
      return s;
    }
    record_bytes_written_ += static_cast<int64_t>(bytes.size());
    OnDisk& now = on_disk_[w.job_id];
    now.seq = seq;
    now.events = events;
    now.snapshot_bytes = static_cast<int64_t>(bytes.size());
    // The log's entries are all in the snapshot now (and numbered below
    // it, should its removal fail: they are passed over when read).
    std::error_code ec;
    std::filesystem::remove(LogPath(state_dir_, w.job_id), ec);
    if (ec) {
      COLOD_LOG(ERROR) << "cannot remove the log of job " << w.job_id << " (its next write is a snapshot again): "
                       << ec.message();
      now.torn = true;
    } else {
      now.log_bytes = 0;
      now.torn = false;
    }
    return absl::OkStatus();
  }
  bool torn = false;
  absl::Status s = AppendLogEntry(LogPath(state_dir_, w.job_id), bytes, &torn);
  OnDisk& now = on_disk_[w.job_id];
  if (!s.ok()) {
    now.torn = torn;
    COLOD_LOG(ERROR) << "cannot record job " << w.job_id << ": " << s;
    return s;
  }
  record_bytes_written_ += 4 + static_cast<int64_t>(bytes.size());
  now.seq = seq;
  now.events = events;
  now.log_bytes += 4 + static_cast<int64_t>(bytes.size());
  return absl::OkStatus();
}

bool JobManager::StepSet::insert(int64_t step) {
  auto next = runs_.upper_bound(step);  // the first run that starts after `step`
  if (next != runs_.begin()) {
    auto prev = std::prev(next);
    if (step <= prev->second) return false;  // inside it
    if (prev->second == step - 1) {          // extends it (step > prev->second: no overflow), may join the next
      prev->second = step;
      if (next != runs_.end() && next->first - 1 == step) {  // (next->first > step: no overflow)
        prev->second = next->second;
        runs_.erase(next);
      }
      return true;
    }
  }
  if (next != runs_.end() && next->first - 1 == step) {  // extends the next one down
    const int64_t last = next->second;
    runs_.erase(next);
    runs_.emplace(step, last);
    return true;
  }
  runs_.emplace(step, step);
  return true;
}

void JobManager::AppendEventLocked(Entry& e, const v1::JobEvent& ev) {
  e.events.Append(ev);
  if (state_dir_.empty()) e.published = e.events.size();  // nothing to write: nothing a crash takes back
}

void JobManager::AfterWrite(const std::string& job_id, int64_t seq, size_t events, bool written) {
  absl::MutexLock lock(&mu_);
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  Entry& e = it->second;
  e.published = std::max(e.published, std::min(events, e.events.size()));
  if (written) {
    e.write_failures = 0;
    return;
  }
  // Not on disk: FlushStale tries again, unless a later write was taken
  // since (it holds this one's changes, and marks the job itself if it
  // fails too).
  if (seq < e.record_seq) return;
  e.unwritten = true;
  e.write_failures = std::min(e.write_failures + 1, 1 << 20);
}

v1::JobEvent JobManager::NewEventLocked(const Entry& e) {
  v1::JobEvent ev;
  ev.set_job_id(e.job.job_id());
  ev.set_sequence(static_cast<int64_t>(e.events.size()) + 1);
  *ev.mutable_time() = ToProtoTimestamp(clock_->Now());
  return ev;
}

absl::Status JobManager::CheckNotEndedLocked(const Entry& e) {
  if (!IsFinal(e.job.state())) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat("job '", e.job.job_id(), "' already ended (", JobStateName(e.job.state()), ")"));
}

absl::StatusOr<JobManager::Entry*> JobManager::FindLocked(absl::string_view job_id) {
  auto it = jobs_.find(std::string(job_id));
  if (it == jobs_.end()) return absl::NotFoundError(absl::StrCat("no job '", job_id, "'"));
  return &it->second;
}

void JobManager::AppendStateChangeLocked(Entry& e, v1::JobState state, absl::string_view reason) {
  if (IsFinal(state) && !IsFinal(e.job.state())) ++finished_[JobStateName(state)];
  e.job.set_state(state);
  e.job.set_reason(std::string(reason));
  *e.job.mutable_update_time() = ToProtoTimestamp(clock_->Now());
  v1::JobEvent ev = NewEventLocked(e);
  ev.mutable_state_change()->set_state(state);
  ev.mutable_state_change()->set_reason(std::string(reason));
  AppendEventLocked(e, ev);
  if (state == v1::JOB_STATE_RUNNING && e.first_running_known && !e.first_running.has_value()) {
    e.first_running = FromProtoTimestamp(ev.time());
  }
  if (e.job.has_summary()) UpdateWallTimeLocked(e);
}

void JobManager::UpdateWallTimeLocked(Entry& e) {
  // From the first RUNNING (the history's first; a record kept only
  // without it starts at the job's creation) to now. Looked up once: a
  // step's update must not walk a long history.
  if (!e.first_running_known) {
    e.first_running_known = true;
    for (size_t i = 0; i < e.events.size(); ++i) {
      const v1::JobEvent ev = e.events.Get(i);
      if (ev.has_state_change() && ev.state_change().state() == v1::JOB_STATE_RUNNING) {
        e.first_running = FromProtoTimestamp(ev.time());
        break;
      }
    }
  }
  const absl::Time start = e.first_running.value_or(FromProtoTimestamp(e.job.create_time()));
  *e.job.mutable_summary()->mutable_wall_time() = ToProtoDuration(std::max(absl::ZeroDuration(), clock_->Now() - start));
}

absl::Status JobManager::ChangeJob(absl::string_view job_id, absl::FunctionRef<absl::StatusOr<bool>(Entry&)> change,
                                   v1::Job* out, bool must_record) {
  std::optional<RecordWrite> w;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Entry * e, FindLocked(job_id));
    const size_t events = e->events.size();
    ASSIGN_OR_RETURN(const bool record, change(*e));
    if (record) {
      w = TakeRecordLocked(*e);
    } else if (e->events.size() != events) {
      e->unwritten = true;  // a step of the last second: the next write, or Flush, takes it
    }
    if (out != nullptr) *out = e->job;
  }
  if (must_record) return WriteRecord(w);
  WriteOrDefer(std::move(w));
  return absl::OkStatus();
}

absl::StatusOr<v1::Job> JobManager::Schedule(absl::string_view job_id, const v1::MeshSpec& mesh,
                                             double peak_flops) {
  v1::Job job;
  v1::JobState before = v1::JOB_STATE_UNSPECIFIED;  // set once the change is made
  v1::Job placement_before;                           // what the change sets, as it was
  std::optional<double> peak_before;
  const absl::Status recorded = ChangeJob(
      job_id,
      [&](Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<bool> {
        if (e.job.state() != v1::JOB_STATE_PENDING && e.job.state() != v1::JOB_STATE_RESTARTING) {
          return absl::FailedPreconditionError(
              absl::StrCat("job '", job_id, "' is ", JobStateName(e.job.state()), ", not pending or restarting"));
        }
        before = e.job.state();
        *placement_before.mutable_mesh() = e.job.mesh();
        *placement_before.mutable_rank0_workers() = e.job.rank0_workers();
        placement_before.set_rank0_first_generation(e.job.rank0_first_generation());
        placement_before.set_stalled(e.job.stalled());
        *placement_before.mutable_stalled_time() = e.job.stalled_time();
        peak_before = e.attempt_peak_flops;
        *e.job.mutable_mesh() = mesh;
        e.attempt_peak_flops = peak_flops > 0 && std::isfinite(peak_flops) ? peak_flops : 0;
        e.job.set_generation(e.job.generation() + 1);
        if (mesh.ranks_size() > 0) {
          auto& holders = *e.job.mutable_rank0_workers();
          if (e.job.rank0_first_generation() == 0) e.job.set_rank0_first_generation(e.job.generation());
          holders[e.job.generation()] = mesh.ranks(0).worker_id();
          while (holders.size() > kMaxRank0Workers) {  // the oldest go (a map's order is not kept: find it)
            holders.erase(std::min_element(holders.begin(), holders.end(),
                                           [](const auto& a, const auto& b) { return a.first < b.first; }));
          }
        }
        e.job.clear_stalled();  // a new attempt
        e.job.clear_stalled_time();
        AppendStateChangeLocked(e, v1::JOB_STATE_SCHEDULED,
                                absl::StrCat("ranks assigned to ", mesh.world_size(), " workers; connecting"));
        return true;
      },
      &job, /*must_record=*/true);
  if (recorded.ok()) return job;
  if (before == v1::JOB_STATE_UNSPECIFIED) return recorded;  // not changed
  // Not on disk: the generation is not handed out (spent: the next attempt
  // takes the one after it), the placement is undone, and the job waits in
  // its state for a record that can be written.
  const std::string why = absl::StrCat("its new generation cannot be recorded (", recorded.message(),
                                       "): it is placed once its record can be written");
  (void)ChangeJob(job_id, [&](Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<bool> {
    if (e.job.state() != v1::JOB_STATE_SCHEDULED || e.job.generation() != job.generation()) return false;
    *e.job.mutable_mesh() = placement_before.mesh();
    *e.job.mutable_rank0_workers() = placement_before.rank0_workers();
    e.job.set_rank0_first_generation(placement_before.rank0_first_generation());
    e.job.set_stalled(placement_before.stalled());
    *e.job.mutable_stalled_time() = placement_before.stalled_time();
    e.attempt_peak_flops = peak_before;
    AppendStateChangeLocked(e, before, why);
    return true;
  });
  return absl::UnavailableError(why);
}

absl::StatusOr<v1::Job> JobManager::SetState(absl::string_view job_id, v1::JobState state,
                                             absl::string_view reason) {
  v1::Job job;
  RETURN_IF_ERROR(ChangeJob(
      job_id,
      [&](Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<bool> {
        RETURN_IF_ERROR(CheckNotEndedLocked(e));
        AppendStateChangeLocked(e, state, reason);
        return true;
      },
      &job));
  return job;
}

absl::StatusOr<v1::Job> JobManager::Restart(absl::string_view job_id, absl::string_view failure,
                                            absl::string_view reason) {
  v1::Job job;
  RETURN_IF_ERROR(ChangeJob(
      job_id,
      [&](Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<bool> {
        RETURN_IF_ERROR(CheckNotEndedLocked(e));
        e.job.set_restarts(e.job.restarts() + 1);
        e.job.add_attempt_failures(std::string(failure));
        AppendStateChangeLocked(e, v1::JOB_STATE_RESTARTING, reason);
        return true;
      },
      &job));
  return job;
}

absl::Status JobManager::AddStep(absl::string_view job_id, const v1::StepProgress& step) {
  return ChangeJob(job_id, [&](Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return AddStepLocked(e, step); });
}

absl::Status JobManager::AddLateStep(absl::string_view job_id, int64_t generation, absl::string_view worker_id,
                                     const v1::StepProgress& step) {
  return ChangeJob(job_id, [&](Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<bool> {
    // A generation before the first recorded (a record written before
    // rank0_workers existed) is trusted, as every report was then.
    const auto& holders = e.job.rank0_workers();
    if (e.job.rank0_first_generation() > 0 && generation >= e.job.rank0_first_generation()) {
      const auto it = holders.find(generation);
      if (it == holders.end() || it->second != worker_id) {
        return absl::PermissionDeniedError(absl::StrCat("worker '", worker_id, "' did not hold rank 0 of job '",
                                                        job_id, "' generation ", generation));
      }
    }
    return AddStepLocked(e, step);
  });
}

absl::StatusOr<bool> JobManager::AddStepLocked(Entry& e, const v1::StepProgress& step) {
  RETURN_IF_ERROR(CheckNotEndedLocked(e));
  const bool trained = IsTrainedStep(step);
  // A trained step is one of the job's (watchers draw it against the steps,
  // and each is remembered); an evaluation-only report names the step of
  // the checkpoint it evaluated, any.
  const int64_t steps = e.job.spec().train().steps();
  if (step.step() < 0 || (trained && steps > 0 && step.step() > steps)) {
    return absl::InvalidArgumentError(absl::StrCat("step ", step.step(), " is outside job '", e.job.job_id(),
                                                   "''s steps 0 to ", steps));
  }
  // What a report says about now (the kept checkpoints, the last ones)
  // is taken from the newest step only: a late report of an earlier
  // step must not roll it back.
  const bool newest = step.step() >= e.job.step();
  if (newest && step.checkpoints_size() > 0) *e.job.mutable_checkpoints() = step.checkpoints();
  if (trained && !e.trained_steps.insert(step.step())) {
    return newest && step.checkpoints_size() > 0;  // recorded once; what a re-run's save kept is news
  }
  if (!trained && e.job.has_last_eval() && e.job.last_eval().step() == step.eval().step() &&
      e.job.last_eval().loss() == step.eval().loss()) {
    return false;  // an eval_only report sent again
  }
  if (trained) {
    v1::RunSummary& sum = *e.job.mutable_summary();
    sum.set_steps(sum.steps() + 1);
    if (step.update_skipped()) sum.set_skipped_updates(sum.skipped_updates() + 1);
    const int64_t tokens = std::max<int64_t>(0, step.tokens());
    sum.set_tokens(sum.tokens() > std::numeric_limits<int64_t>::max() - tokens ? std::numeric_limits<int64_t>::max()
                                                                               : sum.tokens() + tokens);
    const absl::Duration train = FromProtoDuration(sum.train_time()) + FromProtoDuration(step.step_duration());
    *sum.mutable_train_time() = ToProtoDuration(train);
    const double seconds = absl::ToDoubleSeconds(train);
    sum.set_mean_tokens_per_second(seconds > 0 ? static_cast<double>(sum.tokens()) / seconds : 0);
    if (newest) sum.set_last_tokens_per_second(step.tokens_per_second());
    if (!e.flops_per_token.has_value()) e.flops_per_token = TrainFlopsPerTokenOf(e.job.spec());
    sum.set_model_flops_per_token(*e.flops_per_token);
    if (e.attempt_peak_flops.has_value()) sum.set_peak_flops_per_second(*e.attempt_peak_flops);
    const double mfu = sum.peak_flops_per_second() > 0 ? sum.mean_tokens_per_second() *
                                                             sum.model_flops_per_token() /
                                                             sum.peak_flops_per_second()
                                                       : 0;
    sum.set_mfu(std::isfinite(mfu) ? mfu : 0);
    UpdateWallTimeLocked(e);
  }
  if (trained && step.step() >= e.job.step()) {
    e.job.set_step(step.step());
    e.job.set_loss(step.loss());
  }
  if (newest && !step.checkpoint().empty()) e.job.set_last_checkpoint(step.checkpoint());
  if (step.has_eval()) {
    if (newest) *e.job.mutable_last_eval() = step.eval();
    // The lowest loss, the earliest of equals; a loss that is not finite
    // (a diverged run's) never becomes the best.
    if (std::isfinite(step.eval().loss()) &&
        (!e.job.has_best_eval() || step.eval().loss() < e.job.best_eval().loss())) {
      *e.job.mutable_best_eval() = step.eval();
    }
  }
  const absl::Time now = clock_->Now();
  *e.job.mutable_update_time() = ToProtoTimestamp(now);
  v1::JobEvent ev = NewEventLocked(e);
  *ev.mutable_step() = step;
  ev.mutable_step()->clear_checkpoints();  // the job keeps the newest list; the history need not repeat it
  AppendEventLocked(e, ev);
  // A record holds the whole history, so writing it on every step of a
  // long job would cost O(steps^2): steps are written at most once a second
  // (and whenever one names a checkpoint); every state change writes at once.
  return !step.checkpoint().empty() || now - e.persisted >= absl::Seconds(1);
}

absl::Status JobManager::SetForwardResult(absl::string_view job_id, const v1::ForwardResult& result) {
  return ChangeJob(job_id, [&](Entry& e) -> absl::StatusOr<bool> {
    *e.job.mutable_forward_result() = result;
    // As a worker of this version sends it (an older or hostile one may
    // not): a job's record stays small.
    BoundUnreadTensors(*e.job.mutable_forward_result());
    return true;
  });
}

absl::Status JobManager::AddHang(absl::string_view job_id, const v1::HangReport& hang) {
  return ChangeJob(job_id, [&](Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<bool> {
    RETURN_IF_ERROR(CheckNotEndedLocked(e));
    ++hangs_;
    e.job.set_stalled(hang.message());
    v1::JobEvent ev = NewEventLocked(e);
    *e.job.mutable_stalled_time() = ev.time();
    *ev.mutable_hang() = hang;
    AppendEventLocked(e, ev);
    return true;
  });
}

int64_t JobManager::HangCount() {
  absl::MutexLock lock(&mu_);
  return hangs_;
}

absl::Status JobManager::AddRankStatus(absl::string_view job_id, const v1::RankStatus& status) {
  return ChangeJob(job_id, [&](Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<bool> {
    RETURN_IF_ERROR(CheckNotEndedLocked(e));
    v1::JobEvent ev = NewEventLocked(e);
    *ev.mutable_rank_status() = status;
    AppendEventLocked(e, ev);
    return true;
  });
}

absl::Status JobManager::SetPeakFlops(absl::string_view job_id, int64_t generation, double peak_flops) {
  return ChangeJob(job_id, [&](Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<bool> {
    RETURN_IF_ERROR(CheckNotEndedLocked(e));
    if (e.job.generation() == generation)
      e.attempt_peak_flops = peak_flops > 0 && std::isfinite(peak_flops) ? peak_flops : 0;
    return false;  // nothing of the record changed
  });
}

absl::Status JobManager::NoteResumed(absl::string_view job_id, int64_t step, const std::string& checkpoint) {
  return ChangeJob(job_id, [&](Entry& e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) -> absl::StatusOr<bool> {
    RETURN_IF_ERROR(CheckNotEndedLocked(e));
    if (step <= e.job.step()) return false;
    e.job.set_step(step);
    if (!checkpoint.empty()) e.job.set_last_checkpoint(checkpoint);
    *e.job.mutable_update_time() = ToProtoTimestamp(clock_->Now());
    return true;
  });
}

namespace {

// Whether two specs are one submission: the same, but for the upload that
// carried the model (a retry may upload it again).
// Deterministic bytes of `spec` (a NaN equals itself: a retry of a spec
// with one is the same submission).
std::string SpecBytes(const v1::JobSpec& spec) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream out(&bytes);
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.SetSerializationDeterministic(true);
    spec.SerializeToCodedStream(&coded);
  }  // (the streams' ends trim `bytes`)
  return bytes;
}

// The same spec, but maybe for the upload id, where `differ` (if any) does
// not know the two uploads' files to differ.
bool SameSubmission(v1::JobSpec a, v1::JobSpec b,
                    const std::function<bool(const std::string&, const std::string&)>& differ) {
  const std::string ua = a.model().upload_id(), ub = b.model().upload_id();
  if (ua != ub && differ && differ(ua, ub)) return false;
  a.mutable_model()->clear_upload_id();
  b.mutable_model()->clear_upload_id();
  return SpecBytes(a) == SpecBytes(b);
}

}  // namespace

absl::StatusOr<v1::Job> JobManager::Submit(const v1::JobSpec& spec, absl::string_view request_id,
                                           std::optional<v1::MemoryFloor> floor) {
  RETURN_IF_ERROR(ValidateJobSpec(spec));
  if (!floor.has_value()) floor = JobMemoryFloor(spec);
  const std::string request(request_id);
  const std::vector<OutputDir> dirs = OutputDirKeys(spec);
  const std::string uid = NewJobUid();  // before the lock: it may read the kernel's entropy
  Entry e;
  std::optional<RecordWrite> w;
  {
    absl::MutexLock lock(&mu_);
    if (!request.empty()) {
      // A submit of the same request id still writing its record finishes
      // first: then this one returns its job, or tries again if it failed.
      auto not_submitting = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return !submitting_.contains(request); };
      mu_.Await(absl::Condition(&not_submitting));
      auto it = job_by_request_id_.find(request);
      if (it != job_by_request_id_.end()) {
        const v1::Job& job = jobs_.at(it->second).job;
        // The same request again (a retry, whose model may have been
        // uploaded again): its job. Another spec under a request id already
        // used is a mistake the caller would not see (yesterday's job in
        // place of today's).
        if (!SameSubmission(job.spec(), spec, uploads_differ_)) {
          return absl::AlreadyExistsError(absl::StrCat("request id '", request, "' was used by ", job.job_id(),
                                                       " for another spec: give this one a new "
                                                       "request id"));
        }
        return job;
      }
      submitting_.insert(request);
    }
    // One job at a time writes a directory (OutputDirKeys).
    absl::Status taken;
    for (const OutputDir& mine : dirs) {
      if (submitting_dirs_.contains(mine.dir)) {
        // Its record is being written, and may yet fail: not known to be taken.
        taken = absl::UnavailableError(
            absl::StrCat("spec.train: ", mine.dir, " is named by a job being submitted; try again"));
        break;
      }
    }
    for (auto it = jobs_.begin(); taken.ok() && !dirs.empty() && it != jobs_.end(); ++it) {
      if (IsFinal(it->second.job.state())) continue;
      for (const OutputDir& theirs : it->second.output_dirs) {
        const auto mine =
            std::find_if(dirs.begin(), dirs.end(), [&](const OutputDir& d) { return d.dir == theirs.dir; });
        if (mine == dirs.end()) continue;
        const std::string& field = mine->field;
        taken = absl::FailedPreconditionError(absl::StrCat(
            "spec.train.", field, ": ", field == "final_dir" ? spec.train().final_dir() : spec.train().checkpoint_dir(),
            " is the ", theirs.field, " of ", it->first, " (", JobStateName(it->second.job.state()),
            "): one job at a time writes a directory (use another, or submit once that job ended)"));
        break;
      }
    }
    if (!taken.ok()) {
      if (!request.empty()) submitting_.erase(request);
      return taken;
    }
    if (room_.admit) {
      if (absl::Status room = room_.admit(); !room.ok()) {
        if (!request.empty()) submitting_.erase(request);
        return room;
      }
    }
    int64_t active = 0;
    for (const auto& [id, other] : jobs_) active += IsFinal(other.job.state()) ? 0 : 1;
    if (active >= max_active_jobs_) {
      if (!request.empty()) submitting_.erase(request);
      return absl::ResourceExhaustedError(
          absl::StrCat(active, " jobs have not ended, all the coordinator takes at once (--max-active-jobs ",
                       max_active_jobs_, "): submit again once some ended, or cancel some"));
    }
    if (next_id_ >= kMaxJobNumber) {
      if (!request.empty()) submitting_.erase(request);
      return absl::ResourceExhaustedError(absl::StrCat("job numbers are exhausted (", next_id_,
                                                       "): the data dir's next-id was tampered with"));
    }
    for (const OutputDir& dir : dirs) submitting_dirs_.insert(dir.dir);
    e.job.set_job_id(absl::StrFormat("job-%06d", next_id_++));
    e.job.set_uid(uid);
    *e.job.mutable_spec() = spec;
    if (floor->total_bytes() > 0) *e.job.mutable_memory_floor() = *floor;
    *e.job.mutable_create_time() = ToProtoTimestamp(clock_->Now());
    e.request_id = request;
    AppendStateChangeLocked(e, v1::JOB_STATE_PENDING, "waiting for workers");
    w = TakeWholeRecordLocked(e);
    if (w.has_value()) w->only_if_known = false;  // added only once it is written
  }
  // The record is written before the job is added, so no other call sees a
  // job that a restart would not know.
  const absl::Status s = WriteRecord(w);
  absl::MutexLock lock(&mu_);
  if (!request.empty()) submitting_.erase(request);
  for (const OutputDir& dir : dirs) submitting_dirs_.erase(dir.dir);
  if (!s.ok()) {
    // Not accepted: nothing of it stays (its id is not reused either).
    return absl::Status(s.code(), absl::StrCat("the job cannot be recorded: ", s.message()));
  }
  const std::string id = e.job.job_id();
  if (!request.empty()) job_by_request_id_[request] = id;
  e.published = e.events.size();  // written
  e.output_dirs = dirs;
  return jobs_.emplace(id, std::move(e)).first->second.job;
}

void JobManager::SetMaxActiveJobs(int64_t n) {
  absl::MutexLock lock(&mu_);
  max_active_jobs_ = n;
}

absl::StatusOr<v1::Job> JobManager::Get(absl::string_view job_id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Entry * e, FindLocked(job_id));
  return e->job;
}

std::vector<v1::Job> JobManager::List(const std::vector<v1::JobState>& states) {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Job> out;
  for (const auto& [id, e] : jobs_) {
    if (!states.empty() && std::find(states.begin(), states.end(), e.job.state()) == states.end()) {
      continue;
    }
    out.push_back(e.job);
  }
  return out;
}

JobManager::Page JobManager::ListPage(const std::vector<v1::JobState>& states, absl::string_view after, int limit,
                                      const std::function<void(v1::Job&)>& view, size_t max_bytes) {
  absl::MutexLock lock(&mu_);
  Page page;
  size_t bytes = 0;
  auto it = after.empty() ? jobs_.begin() : jobs_.upper_bound(std::string(after));
  for (; it != jobs_.end(); ++it) {
    const v1::Job& job = it->second.job;
    if (!states.empty() && std::find(states.begin(), states.end(), job.state()) == states.end()) continue;
    if (static_cast<int>(page.jobs.size()) == limit || (!page.jobs.empty() && bytes >= max_bytes)) {
      page.more = true;
      break;
    }
    page.jobs.push_back(job);
    if (view) view(page.jobs.back());
    bytes += page.jobs.back().ByteSizeLong();
  }
  return page;
}

absl::Status JobManager::Delete(absl::string_view job_id) {
  int64_t next_id = 0;
  {
    absl::MutexLock lock(&mu_);
    ASSIGN_OR_RETURN(Entry * e, FindLocked(job_id));
    if (!IsFinal(e->job.state())) {
      return absl::FailedPreconditionError(absl::StrCat("job '", job_id, "' has not ended (",
                                                        JobStateName(e->job.state()), "): cancel it first"));
    }
    DeleteLocked(std::string(job_id));
    next_id = next_id_;
  }
  RemoveRecords({std::string(job_id)}, next_id);
  return absl::OkStatus();
}

std::vector<std::string> JobManager::Expire(absl::Duration retention, int64_t max_ended) {
  std::vector<std::string> expired;
  if (retention <= absl::ZeroDuration() && max_ended <= 0) return expired;
  int64_t next_id = 0;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time cutoff = retention > absl::ZeroDuration() ? clock_->Now() - retention : absl::InfinitePast();
    std::vector<std::pair<absl::Time, std::string>> kept;  // ended, within the retention
    for (const auto& [id, e] : jobs_) {
      if (!IsFinal(e.job.state())) continue;
      const absl::Time updated = FromProtoTimestamp(e.job.update_time());
      if (updated < cutoff) {
        expired.push_back(id);
      } else {
        kept.emplace_back(updated, id);
      }
    }
    if (max_ended > 0 && static_cast<int64_t>(kept.size()) > max_ended) {
      const size_t over = kept.size() - static_cast<size_t>(max_ended);
      // The oldest first; of equal times the lower id (jobs_'s order).
      std::stable_sort(kept.begin(), kept.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      for (size_t i = 0; i < over; ++i) expired.push_back(kept[i].second);
    }
    for (const std::string& id : expired) DeleteLocked(id);
    next_id = next_id_;
  }
  if (!expired.empty()) RemoveRecords(expired, next_id);
  return expired;
}

void JobManager::DeleteLocked(const std::string& job_id) {
  auto it = jobs_.find(job_id);
  if (it == jobs_.end()) return;
  if (!it->second.request_id.empty()) job_by_request_id_.erase(it->second.request_id);
  jobs_.erase(it);  // a watcher waiting on it wakes (WaitForEvents looks it up) and finds it gone
}

void JobManager::RemoveRecords(const std::vector<std::string>& job_ids, int64_t next_id) {
  if (state_dir_.empty()) return;
  absl::MutexLock io(&io_mu_);
  // Deletes write in any order; the file only moves forward.
  if (next_id > next_id_written_) {
    if (absl::Status s = WriteFileAtomically(state_dir_ + "/" + kNextIdFile, absl::StrCat(next_id, "\n")); !s.ok()) {
      COLOD_LOG(ERROR) << "cannot record the next job id: " << s;
    } else {
      next_id_written_ = next_id;
    }
  }
  for (const std::string& job_id : job_ids) {
    on_disk_.erase(job_id);
    std::error_code ec;
    std::filesystem::remove(SnapshotPath(state_dir_, job_id), ec);
    if (ec) COLOD_LOG(ERROR) << "cannot remove the record of job " << job_id << ": " << ec.message();
    std::filesystem::remove(LogPath(state_dir_, job_id), ec);  // (a log left alone is removed by Open)
    if (ec) COLOD_LOG(ERROR) << "cannot remove the record log of job " << job_id << ": " << ec.message();
  }
}

absl::StatusOr<v1::Job> JobManager::Cancel(absl::string_view job_id, absl::string_view reason) {
  return SetState(job_id, v1::JOB_STATE_CANCELLED, reason.empty() ? "cancelled by client" : reason);
}

absl::StatusOr<JobManager::Events> JobManager::WaitForEvents(absl::string_view job_id, int64_t from_sequence,
                                                             absl::Duration timeout, size_t max_events) {
  const int64_t from = std::max<int64_t>(from_sequence, 1);
  std::vector<std::string> taken;  // copied under the lock, parsed after it
  Events out;
  {
    absl::MutexLock lock(&mu_);
    RETURN_IF_ERROR(FindLocked(job_id).status());
    // Looked up on every evaluation: an ended job may be deleted meanwhile,
    // and the condition must never touch a gone entry.
    const std::string id(job_id);
    auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      auto it = jobs_.find(id);
      if (it == jobs_.end()) return true;
      const Entry& e = it->second;
      return static_cast<int64_t>(e.published) >= from ||
             (IsFinal(e.job.state()) && e.published == e.events.size());
    };
    mu_.AwaitWithTimeout(absl::Condition(&ready), timeout);
    ASSIGN_OR_RETURN(const Entry* found, FindLocked(job_id));  // NOT_FOUND once deleted
    const Entry& e = *found;
    const int64_t last = static_cast<int64_t>(e.published);
    int64_t seq = from;
    for (; seq <= last && taken.size() < max_events; ++seq) taken.emplace_back(e.events.Bytes(seq - 1));
    out.finished = IsFinal(e.job.state()) && e.published == e.events.size() && seq > last;
  }
  out.events.resize(taken.size());
  for (size_t i = 0; i < taken.size(); ++i) {
    // Bytes the job manager serialized itself: they parse.
    (void)out.events[i].ParseFromString(taken[i]);
  }
  return out;
}

std::set<std::string> JobManager::UploadIdsInUse() {
  absl::MutexLock lock(&mu_);
  std::set<std::string> ids;
  for (const auto& [id, e] : jobs_) {
    if (!e.job.spec().model().upload_id().empty()) ids.insert(e.job.spec().model().upload_id());
  }
  return ids;
}

std::map<std::string, int64_t> JobManager::FinishedCounts() {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int64_t> counts = finished_;
  for (v1::JobState s : {v1::JOB_STATE_SUCCEEDED, v1::JOB_STATE_FAILED, v1::JOB_STATE_CANCELLED}) {
    counts.emplace(JobStateName(s), 0);
  }
  return counts;
}

std::map<std::string, int> JobManager::CountByState() {
  absl::MutexLock lock(&mu_);
  std::map<std::string, int> counts;
  for (int s = v1::JobState_MIN; s <= v1::JobState_MAX; ++s) {
    if (v1::JobState_IsValid(s) && s != v1::JOB_STATE_UNSPECIFIED) {
      counts[JobStateName(static_cast<v1::JobState>(s))] = 0;
    }
  }
  for (const auto& [id, e] : jobs_) ++counts[JobStateName(e.job.state())];
  return counts;
}

}  // namespace colod
