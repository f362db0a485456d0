// RankSupervisor against a fake worker client: which ranks are aborted and
// when, the verdict of a probe, and hangs reported once per placement.
#include "server/rank_supervisor.h"

#include "absl/strings/match.h"
#include "common/proto_time.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

// Records aborts; aborts answer by address (NOT_FOUND unless listed in
// abort_answers), probes too (OK unless listed in answers).
class FakeWorkers final : public WorkerClient {
 public:
  std::vector<absl::Status> Assign(const std::vector<Call<v1::AssignJobRequest>>& calls, absl::Duration) override {
    return std::vector<absl::Status>(calls.size(), absl::UnimplementedError("not here"));
  }
  std::vector<absl::Status> Abort(const std::vector<Call<v1::AbortJobRequest>>& calls, absl::Duration) override {
    absl::MutexLock lock(&mu);
    std::vector<absl::Status> out;
    for (const auto& c : calls) {
      aborted.push_back(c);
      auto it = abort_answers.find(c.address);
      out.push_back(it == abort_answers.end() ? absl::NotFoundError("ended already") : it->second);
    }
    return out;
  }
  std::vector<absl::Status> Probe(const std::vector<Call<v1::GetStatusRequest>>& calls, absl::Duration) override {
    absl::MutexLock lock(&mu);
    ++probe_calls;
    std::vector<absl::Status> out;
    for (const auto& c : calls) {
      probed.push_back(c);
      auto it = answers.find(c.address);
      out.push_back(it == answers.end() ? absl::OkStatus() : it->second);
    }
    return out;
  }

  absl::Mutex mu;
  std::vector<Call<v1::AbortJobRequest>> aborted;
  std::vector<Call<v1::GetStatusRequest>> probed;
  int probe_calls = 0;  // Probe's calls (each of many RPCs at once)
  std::map<std::string, absl::Status> answers;
  std::map<std::string, absl::Status> abort_answers;
};

// `n` ranks on workers w0..w(n-1) at host:700r.
v1::MeshSpec Mesh(int n) {
  v1::MeshSpec m;
  m.set_world_size(n);
  for (int r = 0; r < n; ++r) {
    v1::RankAssignment* a = m.add_ranks();
    a->set_rank(r);
    a->set_worker_id("w" + std::to_string(r));
    a->set_worker_address("host:700" + std::to_string(r));
  }
  return m;
}

// Each rank's worker's key, by rank ("key-r").
std::vector<std::string> Keys(int n) {
  std::vector<std::string> out;
  for (int r = 0; r < n; ++r) out.push_back("key-" + std::to_string(r));
  return out;
}

// Each call's address, and the key it carries after a space.
template <typename Request>
std::vector<std::string> Addresses(const std::vector<WorkerClient::Call<Request>>& calls) {
  std::vector<std::string> out;
  for (const auto& c : calls) out.push_back(c.key.empty() ? c.address : c.address + " " + c.key);
  return out;
}

class RankSupervisorTest : public ::testing::Test {
 protected:
  std::shared_ptr<FakeWorkers> fake_ = std::make_shared<FakeWorkers>();
  RankSupervisor supervisor_{fake_, RankSupervisor::Options{absl::Seconds(1), absl::Seconds(1), absl::Seconds(5)}};
};

TEST_F(RankSupervisorTest, StopsTheRanksThatHaveNotEndedOnceEach) {
  const struct {
    std::set<int> ended;
    int except;
    std::vector<std::string> aborted;
  } cases[] = {
      {{}, -1, {"host:7000 key-0", "host:7001 key-1", "host:7002 key-2", "host:7003 key-3"}},
      {{1}, -1, {"host:7000 key-0", "host:7002 key-2", "host:7003 key-3"}},
      {{1}, 3, {"host:7000 key-0", "host:7002 key-2"}},
      {{0, 1, 2, 3}, -1, {}},
  };
  for (const auto& c : cases) {
    fake_->aborted.clear();
    // Each call carries its rank's worker's key (a daemon restarted at the
    // address refuses it).
    supervisor_.StopRanks("j", "0a1b", 4, Mesh(4), Keys(4), c.ended, c.except, "why");
    supervisor_.SendAborts();  // NOT_FOUND answers are fine
    EXPECT_EQ(Addresses(fake_->aborted), c.aborted);
    for (const auto& a : fake_->aborted) {
      EXPECT_EQ(a.request.job_id(), "j");
      EXPECT_EQ(a.request.generation(), 4);
      EXPECT_EQ(a.request.job_uid(), "0a1b");
      EXPECT_EQ(a.request.reason(), "why");
    }
    supervisor_.SendAborts();  // sent once
    EXPECT_EQ(fake_->aborted.size(), c.aborted.size());
  }
}

v1::Worker Busy(const std::string& id, const std::string& job, int64_t generation) {
  v1::Worker w;
  w.mutable_info()->set_worker_id(id);
  w.mutable_info()->set_address(id + ":7070");
  w.mutable_status()->set_state(job.empty() ? v1::WORKER_STATE_IDLE : v1::WORKER_STATE_BUSY);
  w.mutable_status()->set_job_id(job);
  w.mutable_status()->set_generation(generation);
  return w;
}

TEST_F(RankSupervisorTest, TellsAWorkerRunningAStaleRankToStopOncePerGeneration) {
  // The scheduler runs job "a" generation 2 only.
  auto runs = [](const std::string& job, int64_t generation) { return job == "a" && generation == 2; };
  const struct {
    std::vector<v1::Worker> workers;
    std::vector<std::string> told;
  } passes[] = {
      {{Busy("w0", "a", 2), Busy("w1", "a", 1), Busy("w2", "b", 1), Busy("w3", "", 0)},
       {"w1:7070 key-of-w1", "w2:7070 key-of-w2"}},
      {{Busy("w0", "a", 2), Busy("w1", "a", 1), Busy("w2", "b", 1), Busy("w3", "", 0)}, {}},  // told already
      {{Busy("w1", "a", 1), Busy("w2", "b", 3)}, {"w2:7070 key-of-w2"}},                      // a new generation
      {{Busy("w1", "", 0), Busy("w2", "b", 3)}, {}},                                          // w1 stopped
      {{Busy("w1", "a", 1)}, {"w1:7070 key-of-w1"}},  // and is stale again: told again
  };
  const auto key_to_call = [](const std::string& id) { return "key-of-" + id; };
  for (size_t i = 0; i < std::size(passes); ++i) {
    fake_->aborted.clear();
    supervisor_.StopStaleRanks(passes[i].workers, runs, key_to_call);
    supervisor_.SendAborts();
    EXPECT_EQ(Addresses(fake_->aborted), passes[i].told) << "pass " << i;
  }
  ASSERT_FALSE(fake_->aborted.empty());
  EXPECT_EQ(fake_->aborted[0].request.job_id(), "a");
  EXPECT_EQ(fake_->aborted[0].request.generation(), 1);
  EXPECT_TRUE(absl::StrContains(fake_->aborted[0].request.reason(), "does not run this job"));
}

// A stale rank's abort that did not reach its worker is sent again after
// stale_abort_retry (nothing else stops a serving TENSOR rank, and its
// worker would stay BUSY for good); one answered (NOT_FOUND: it ended), or
// refused (PERMISSION_DENIED: another key), is not; a placement's aborts
// are sent once whatever their answer.
TEST_F(RankSupervisorTest, AStaleRanksAbortThatFailedIsSentAgainLater) {
  auto runs = [](const std::string&, int64_t) { return false; };
  const auto key_to_call = [](const std::string& id) { return "key-of-" + id; };
  const std::vector<v1::Worker> stale = {Busy("w1", "a", 1), Busy("w2", "a", 1)};
  fake_->abort_answers["w1:7070"] = absl::UnavailableError("connection refused");
  fake_->abort_answers["w2:7070"] = absl::PermissionDeniedError("the call's key is not this worker's");
  // Within the retry interval (10 s by default): told once.
  supervisor_.StopStaleRanks(stale, runs, key_to_call);
  supervisor_.SendAborts();
  EXPECT_EQ(Addresses(fake_->aborted), (std::vector<std::string>{"w1:7070 key-of-w1", "w2:7070 key-of-w2"}));
  fake_->aborted.clear();
  supervisor_.StopStaleRanks(stale, runs, key_to_call);
  supervisor_.SendAborts();
  EXPECT_TRUE(fake_->aborted.empty());
  // Past it: the failed one again, until it is answered.
  RankSupervisor::Options now;
  now.stale_abort_retry = absl::ZeroDuration();
  RankSupervisor again(fake_, now);
  fake_->aborted.clear();
  for (int pass = 0; pass < 3; ++pass) {
    again.StopStaleRanks(stale, runs, key_to_call);
    again.SendAborts();
  }
  EXPECT_EQ(Addresses(fake_->aborted), (std::vector<std::string>{"w1:7070 key-of-w1", "w2:7070 key-of-w2",
                                                                 "w1:7070 key-of-w1", "w1:7070 key-of-w1"}));
  fake_->abort_answers["w1:7070"] = absl::NotFoundError("ended already");
  again.StopStaleRanks(stale, runs, key_to_call);
  again.SendAborts();
  fake_->aborted.clear();
  again.StopStaleRanks(stale, runs, key_to_call);
  again.SendAborts();
  EXPECT_TRUE(fake_->aborted.empty()) << "answered";
  // Each failure in a row waits twice as long before the next (every try
  // waits out the abort's deadline on the scheduler's thread): at 200 ms,
  // sent again after 250 ms, then not at 250 ms more (400 ms), then again.
  RankSupervisor::Options slow;
  slow.stale_abort_retry = absl::Milliseconds(200);
  RankSupervisor doubling(fake_, slow);
  fake_->abort_answers["w1:7070"] = absl::UnavailableError("connection refused");
  const std::vector<v1::Worker> w1 = {Busy("w1", "a", 1)};
  std::vector<size_t> sent;
  for (int pass = 0; pass < 4; ++pass) {
    if (pass > 0) absl::SleepFor(absl::Milliseconds(250));
    fake_->aborted.clear();
    doubling.StopStaleRanks(w1, runs, key_to_call);
    doubling.SendAborts();
    sent.push_back(fake_->aborted.size());
  }
  EXPECT_EQ(sent, (std::vector<size_t>{1, 1, 0, 1}));
  // A placement's abort that failed: once.
  fake_->aborted.clear();
  fake_->abort_answers["host:7000"] = absl::UnavailableError("connection refused");
  again.StopRanks("j", "0a1b", 4, Mesh(1), Keys(1), {}, -1, "why");
  again.SendAborts();
  again.SendAborts();
  EXPECT_EQ(fake_->aborted.size(), 1u);
}

TEST_F(RankSupervisorTest, ProbesThePeersThatHaveNotEndedButTheFailedRank) {
  const RankSupervisor::Probe probe = RankSupervisor::PeersToProbe(
      "j", 3, Mesh(4), Keys(4), /*ended=*/{2}, /*failed_rank=*/1, "rank 1: ABORTED: peer closed",
      absl::StatusCode::kAborted);
  EXPECT_EQ(Addresses(probe.calls), (std::vector<std::string>{"host:7000 key-0", "host:7003 key-3"}));
  EXPECT_EQ(probe.names, (std::vector<std::string>{"rank 0 (worker w0 at host:7000)", "rank 3 (worker w3 at host:7003)"}));
  fake_->answers["host:7003"] = absl::DeadlineExceededError("no answer");
  const RankSupervisor::Verdict v = supervisor_.ProbePeers(probe);
  EXPECT_EQ(Addresses(fake_->probed), Addresses(probe.calls));
  EXPECT_EQ(v.reason,
            "rank 3 (worker w3 at host:7003) does not answer (DEADLINE_EXCEEDED: no answer); first failure reported: "
            "rank 1: ABORTED: peer closed");
  EXPECT_TRUE(v.retryable);
}

// Several failed jobs' peers are probed in one go (one probe timeout in all,
// not one a job), and each job is judged by its own peers' answers.
TEST_F(RankSupervisorTest, SeveralJobsPeersAreProbedAtOnceEachJudgedByItsOwn) {
  RankSupervisor::Probe a = RankSupervisor::PeersToProbe("a", 1, Mesh(3), Keys(3), {}, 0, "rank 0 of a failed",
                                                         absl::StatusCode::kInvalidArgument);
  RankSupervisor::Probe none = RankSupervisor::PeersToProbe("n", 1, Mesh(1), Keys(1), {}, 0, "rank 0 of n failed",
                                                            absl::StatusCode::kInvalidArgument);
  RankSupervisor::Probe b = RankSupervisor::PeersToProbe("b", 1, Mesh(3), Keys(3), {}, 0, "rank 0 of b failed",
                                                         absl::StatusCode::kInvalidArgument);
  // b's ranks are on other hosts than a's.
  for (auto& c : b.calls) c.address = "other-" + c.address;
  for (auto& n : b.names) n = "b's " + n;
  fake_->answers["other-host:7002"] = absl::DeadlineExceededError("no answer");
  const std::vector<RankSupervisor::Verdict> v = supervisor_.ProbePeers({a, none, b});
  EXPECT_EQ(fake_->probe_calls, 1);
  EXPECT_EQ(fake_->probed.size(), 4u);
  ASSERT_EQ(v.size(), 3u);
  EXPECT_EQ(v[0].reason, "rank 0 of a failed");  // its peers answered: its own error, not retried
  EXPECT_FALSE(v[0].retryable);
  EXPECT_EQ(v[1].reason, "rank 0 of n failed");  // no peer to probe
  EXPECT_FALSE(v[1].retryable);
  EXPECT_TRUE(absl::StartsWith(v[2].reason, "b's rank 2 (worker w2 at host:7002) does not answer")) << v[2].reason;
  EXPECT_TRUE(v[2].retryable);
}

TEST(JudgeProbe, AnUnansweredPeerIsTheClustersFailureElseTheCodeDecides) {
  const struct {
    absl::StatusCode failure_code;
    std::vector<absl::Status> answers;
    bool retryable;
    bool names_peer;
  } cases[] = {
      {absl::StatusCode::kAborted, {absl::OkStatus(), absl::OkStatus()}, true, false},
      {absl::StatusCode::kInvalidArgument, {absl::OkStatus(), absl::OkStatus()}, false, false},
      {absl::StatusCode::kResourceExhausted, {absl::OkStatus(), absl::UnavailableError("refused")}, true, true},
      {absl::StatusCode::kInvalidArgument, {}, false, false},  // no live peer
  };
  for (const auto& c : cases) {
    RankSupervisor::Probe p;
    p.names = {"rank 0", "rank 2"};
    p.failure = "rank 1 failed";
    p.failure_code = c.failure_code;
    const RankSupervisor::Verdict v = RankSupervisor::JudgeProbe(p, c.answers);
    EXPECT_EQ(v.retryable, c.retryable) << absl::StatusCodeToString(c.failure_code);
    if (c.names_peer) {
      EXPECT_EQ(v.reason, "rank 2 does not answer (UNAVAILABLE: refused); first failure reported: rank 1 failed");
    } else {
      EXPECT_EQ(v.reason, "rank 1 failed");
    }
  }
}

// Rank 0 waits 6 s in tp/0_1 #8 (4 s at its heartbeat 2 s ago); rank 1
// entered #7 only and reported `rank1_silent` ago.
std::vector<v1::Worker> Heartbeats(const std::string& job, int64_t generation, absl::Time now,
                                   absl::Duration rank1_silent) {
  std::vector<v1::Worker> out;
  for (int r = 0; r < 2; ++r) {
    v1::Worker w = Busy("w" + std::to_string(r), job, generation);
    *w.mutable_last_heartbeat_time() = ToProtoTimestamp(now - (r == 0 ? absl::Seconds(2) : rank1_silent));
    v1::CollectiveProgress* p = w.mutable_status()->add_collectives();
    p->set_group("tp/0_1");
    p->set_entered(r == 0 ? 8 : 7);
    if (r == 0) {
      p->set_pending_sequence(8);
      p->set_pending_op("all_reduce");
      *p->mutable_pending_for() = ToProtoDuration(absl::Seconds(4));
    }
    out.push_back(std::move(w));
  }
  return out;
}

std::map<std::string, const v1::Worker*> ById(const std::vector<v1::Worker>& workers) {
  std::map<std::string, const v1::Worker*> out;
  for (const v1::Worker& w : workers) out[w.info().worker_id()] = &w;
  return out;
}

TEST_F(RankSupervisorTest, ReportsAHangOncePerPlacementAndAgainWhenARankFallsSilent) {
  const absl::Time now = absl::FromUnixSeconds(1'800'000'000);
  const std::vector<v1::Worker> beats = Heartbeats("j", 1, now, absl::Seconds(1));
  std::vector<v1::HangReport> hangs = supervisor_.NewHangs("j", 1, Mesh(2), ById(beats), now);
  ASSERT_EQ(hangs.size(), 1u);
  EXPECT_EQ(hangs[0].message(),
            "collective #8 (all_reduce) of group tp/0_1 pending for 6s on ranks 0; not entered by rank 1 (worker w1 at "
            "host:7001) (entered #7)");
  EXPECT_TRUE(supervisor_.NewHangs("j", 1, Mesh(2), ById(beats), now).empty());  // once
  // Rank 1 falls silent past the threshold: the same collective, naming it.
  const std::vector<v1::Worker> silent = Heartbeats("j", 1, now, absl::Seconds(9));
  hangs = supervisor_.NewHangs("j", 1, Mesh(2), ById(silent), now);
  ASSERT_EQ(hangs.size(), 1u);
  ASSERT_EQ(hangs[0].silent_ranks_size(), 1);
  EXPECT_TRUE(supervisor_.NewHangs("j", 1, Mesh(2), ById(silent), now).empty());
  // The next generation's hang is its own; heartbeats of another generation
  // are not read as this one's.
  EXPECT_EQ(supervisor_.NewHangs("j", 2, Mesh(2), ById(Heartbeats("j", 2, now, absl::Seconds(1))), now).size(), 1u);
  EXPECT_TRUE(supervisor_.NewHangs("j", 3, Mesh(2), ById(beats), now).empty());
  // A released placement's record is dropped.
  supervisor_.ForgetPlacement("j");
  EXPECT_EQ(supervisor_.NewHangs("j", 1, Mesh(2), ById(beats), now).size(), 1u);
}

}  // namespace
}  // namespace colod
