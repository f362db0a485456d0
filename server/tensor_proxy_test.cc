#include "server/tensor_proxy.h"

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "colod/v1/tensor.grpc.pb.h"
#include "common/auth.h"
#include "common/grpc_status.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "prometheus/registry.h"
#include "server/job_manager.h"

namespace colod {
namespace {

// One rank's worker: CreateTensor records the name and, for "slow",
// "aborted" and "refused", holds the call until `release`; the last two
// then fail.
class SlowWorker final : public v1::TensorService::Service {
 public:
  grpc::Status CreateTensor(grpc::ServerContext* ctx, const v1::CreateTensorRequest* req,
                            v1::CreateTensorResponse*) override {
    {
      absl::MutexLock lock(&mu);
      names.push_back(req->name());
      creation_ids.push_back(req->creation_id());
      const absl::StatusOr<std::optional<CallGeneration>> call = JobGenerationOf(*ctx);
      generations.push_back(call.ok() && call->has_value() ? (*call)->generation : -1);
      uids.push_back(call.ok() && call->has_value() ? (*call)->job_uid : "-");
    }
    // Made on rank 0, refused on rank 1 (its budget).
    if (req->name() == "half-made" && rank == 1) return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, "full");
    // Rank 0 held one of that name before (an earlier delete reached only
    // rank 1): its tensor must be left alone.
    if (req->name() == "held-before" && rank == 0) return grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "exists");
    // Rank 0 fails for its peer's failure (a collective's), rank 1 for its own.
    if (req->name() == "peer-failed") {
      return rank == 0 ? grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "waited for the peer")
                       : grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "its own fault");
    }
    if (req->name() == "slow") release.WaitForNotification();
    if (req->name() == "aborted" || req->name() == "refused") {
      release.WaitForNotification();
      // What a rank answers once its job was aborted under the call, and
      // an error of its own.
      return req->name() == "aborted" ? grpc::Status(grpc::StatusCode::ABORTED, "the rank was aborted")
                                      : grpc::Status(grpc::StatusCode::ALREADY_EXISTS, "tensor 'refused' exists");
    }
    return grpc::Status::OK;
  }
  // Answers with the value "rank R" of the rank its address was given,
  // where the call asks every rank for it.
  grpc::Status GetGlobal(grpc::ServerContext*, const v1::GetGlobalRequest* req, v1::GetGlobalResponse* resp) override {
    absl::MutexLock lock(&mu);
    rank_zero_only.push_back(req->value_on_rank_zero_only());
    if (!req->value_on_rank_zero_only() || rank == 0) resp->mutable_value()->set_data(absl::StrCat("rank ", rank));
    return grpc::Status::OK;
  }
  // Deletes "half-gone" only on rank 0 (an earlier delete reached rank 1).
  grpc::Status DeleteTensor(grpc::ServerContext*, const v1::DeleteTensorRequest* req,
                            v1::DeleteTensorResponse*) override {
    absl::MutexLock lock(&mu);
    deleted.push_back(req->name());
    if (req->name() == "half-gone" && rank == 1) return grpc::Status(grpc::StatusCode::NOT_FOUND, "no tensor");
    return grpc::Status::OK;
  }
  std::vector<std::string> Names() {
    absl::MutexLock lock(&mu);
    return names;
  }

  absl::Mutex mu;
  std::vector<std::string> names ABSL_GUARDED_BY(mu);
  std::vector<bool> rank_zero_only ABSL_GUARDED_BY(mu);
  std::vector<uint64_t> creation_ids ABSL_GUARDED_BY(mu);
  std::vector<int64_t> generations ABSL_GUARDED_BY(mu);  // what each create carried; -1 none
  std::vector<std::string> uids ABSL_GUARDED_BY(mu);
  std::vector<std::string> deleted ABSL_GUARDED_BY(mu);
  int rank = 0;
  absl::Notification release;
};

// A gRPC server on a loopback port for `service`.
std::unique_ptr<grpc::Server> Serve(grpc::Service* service, std::string* address) {
  int port = 0;
  grpc::ServerBuilder b;
  b.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  b.RegisterService(service);
  std::unique_ptr<grpc::Server> server = b.BuildAndStart();
  *address = "127.0.0.1:" + std::to_string(port);
  return server;
}

// A RUNNING TENSOR job in `jobs` with a tp rank on each of `addresses`.
void RunTensorJob(JobManager& jobs, const std::vector<std::string>& addresses, absl::StatusOr<v1::Job>* job) {
  v1::JobSpec spec;
  spec.set_kind(v1::JOB_KIND_TENSOR);
  spec.mutable_shard()->set_tensor_parallel_size(static_cast<int>(addresses.size()));
  spec.mutable_shard()->set_data_parallel_size(1);
  *job = jobs.Submit(spec, "");
  ASSERT_TRUE(job->ok()) << job->status();
  v1::MeshSpec mesh;
  for (size_t r = 0; r < addresses.size(); ++r) {
    v1::RankAssignment& a = *mesh.add_ranks();
    a.set_rank(static_cast<int>(r));
    a.set_worker_id(absl::StrCat("worker-", r));
    a.set_worker_address(addresses[r]);
  }
  ASSERT_TRUE(jobs.Schedule((*job)->job_id(), mesh).ok());
  ASSERT_TRUE(jobs.SetState((*job)->job_id(), v1::JOB_STATE_RUNNING, "serving").ok());
}

// The proxy's CreateTensor calls of `method` that ended with `code` so far.
double Ended(prometheus::Registry& registry, const std::string& code) {
  for (const prometheus::MetricFamily& f : registry.Collect()) {
    if (f.name != "colod_rpc_duration_seconds") continue;
    for (const prometheus::ClientMetric& m : f.metric) {
      bool method = false, with_code = false;
      for (const prometheus::ClientMetric::Label& l : m.label) {
        method |= l.name == "method" && l.value == "CreateTensor";
        with_code |= l.name == "code" && l.value == code;
      }
      if (method && with_code) return static_cast<double>(m.histogram.sample_count);
    }
  }
  return 0;
}

// Calls on one job are served one at a time, in the order they came. A
// caller that goes away while it waits for its turn (cancelled, or its
// deadline passed) is answered at once, frees its server thread, and is
// never sent to the ranks; the calls behind it do not wait for it.
TEST(TensorProxy, ACallerThatGoesAwayWhileQueuedGivesUpItsTurn) {
  SlowWorker worker;
  std::string worker_address;
  std::unique_ptr<grpc::Server> worker_server = Serve(&worker, &worker_address);

  JobManager jobs;
  absl::StatusOr<v1::Job> job;
  ASSERT_NO_FATAL_FAILURE(RunTensorJob(jobs, {worker_address}, &job));

  prometheus::Registry registry;
  TensorProxy proxy(&jobs, &registry, TensorProxy::Options());
  std::string proxy_address;
  std::unique_ptr<grpc::Server> proxy_server = Serve(&proxy, &proxy_address);
  auto stub = v1::TensorService::NewStub(grpc::CreateChannel(proxy_address, grpc::InsecureChannelCredentials()));
  const auto create = [&](const std::string& name, grpc::ClientContext* ctx) {
    v1::CreateTensorRequest req;
    req.set_job_id(job->job_id());
    req.set_name(name);
    v1::CreateTensorResponse resp;
    return stub->CreateTensor(ctx, req, &resp);
  };

  grpc::Status slow;
  std::thread first([&] {
    grpc::ClientContext ctx;
    slow = create("slow", &ctx);
  });
  for (int i = 0; i < 1000 && worker.Names().empty(); ++i) absl::SleepFor(absl::Milliseconds(5));
  ASSERT_EQ(worker.Names(), std::vector<std::string>{"slow"});

  // Queued behind it: one is cancelled, one runs out of time.
  grpc::ClientContext cancelled_ctx;
  grpc::Status cancelled;
  std::thread second([&] { cancelled = create("cancelled", &cancelled_ctx); });
  absl::SleepFor(absl::Milliseconds(200));
  cancelled_ctx.TryCancel();
  second.join();
  EXPECT_EQ(cancelled.error_code(), grpc::StatusCode::CANCELLED);
  grpc::ClientContext late_ctx;
  late_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  EXPECT_EQ(create("late", &late_ctx).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // The proxy answered both (its handlers ended) while "slow" still runs.
  for (int i = 0; i < 200 && Ended(registry, "CANCELLED") + Ended(registry, "DEADLINE_EXCEEDED") < 2; ++i) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  EXPECT_EQ(Ended(registry, "CANCELLED"), 1);
  EXPECT_EQ(Ended(registry, "DEADLINE_EXCEEDED"), 1);
  EXPECT_EQ(Ended(registry, "OK"), 0);

  // A call behind the two that gave up runs as soon as "slow" ends.
  grpc::Status next;
  std::thread third([&] {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    next = create("next", &ctx);
  });
  absl::SleepFor(absl::Milliseconds(100));
  worker.release.Notify();
  first.join();
  third.join();
  EXPECT_TRUE(slow.ok()) << slow.error_message();
  EXPECT_TRUE(next.ok()) << next.error_message();
  EXPECT_EQ(worker.Names(), (std::vector<std::string>{"slow", "next"}));
  // Nothing is kept for the job once its calls ended, and a later call
  // starts a queue afresh.
  EXPECT_EQ(proxy.QueuedJobs(), 0u);
  grpc::ClientContext after_ctx;
  after_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  const grpc::Status after = create("after", &after_ctx);
  EXPECT_TRUE(after.ok()) << after.error_message();
  EXPECT_EQ(worker.Names(), (std::vector<std::string>{"slow", "next", "after"}));
  EXPECT_EQ(proxy.QueuedJobs(), 0u);

  proxy_server->Shutdown();
  worker_server->Shutdown();
}

// A RUNNING TENSOR job of two ranks on SlowWorkers (ranks 0 and 1) and a
// proxy in front of them, served on loopback until it is destroyed.
struct TwoRanks {
  void Start() {
    workers[1].rank = 1;
    for (int r = 0; r < 2; ++r) servers[r] = Serve(&workers[r], &addresses[r]);
    ASSERT_NO_FATAL_FAILURE(RunTensorJob(jobs, {addresses[0], addresses[1]}, &job));
    proxy = std::make_unique<TensorProxy>(&jobs, &registry, options);
    proxy_server = Serve(proxy.get(), &proxy_address);
    stub = v1::TensorService::NewStub(grpc::CreateChannel(proxy_address, grpc::InsecureChannelCredentials()));
  }
  // CreateTensor of `name` on the job, through the proxy.
  absl::Status Create(const std::string& name) {
    grpc::ClientContext ctx;
    v1::CreateTensorRequest req;
    req.set_job_id(job->job_id());
    req.set_name(name);
    v1::CreateTensorResponse resp;
    return FromGrpcStatus(stub->CreateTensor(&ctx, req, &resp));
  }
  ~TwoRanks() {
    if (proxy_server != nullptr) proxy_server->Shutdown();
    for (auto& s : servers) {
      if (s != nullptr) s->Shutdown();
    }
  }
  TensorProxy::Options options;
  SlowWorker workers[2];
  std::string addresses[2];
  std::unique_ptr<grpc::Server> servers[2];
  JobManager jobs;
  absl::StatusOr<v1::Job> job;
  prometheus::Registry registry;
  std::unique_ptr<TensorProxy> proxy;
  std::string proxy_address;
  std::unique_ptr<grpc::Server> proxy_server;
  std::unique_ptr<v1::TensorService::Stub> stub;
};

// Once a call's turn comes it goes to every rank within the coordinator's
// own deadline, however soon the client's passes: before, a client with a
// deadline of a millisecond reached some ranks and not others, whose
// tensors then differed (a later gather aborted a worker).
TEST(TensorProxy, ACallWhoseTurnCameReachesEveryRankWhateverTheClientsDeadline) {
  TwoRanks two;
  ASSERT_NO_FATAL_FAILURE(two.Start());
  SlowWorker* const workers = two.workers;
  TensorProxy& proxy = *two.proxy;
  auto& stub = two.stub;
  const absl::StatusOr<v1::Job>& job = two.job;
  for (int i = 0; i < 40; ++i) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::microseconds(200 + 100 * i));
    v1::CreateTensorRequest req;
    req.set_job_id(job->job_id());
    req.set_name(absl::StrCat("t", i));
    v1::CreateTensorResponse resp;
    (void)stub->CreateTensor(&ctx, req, &resp);
  }
  // Every call the proxy served has ended (its answer may have come too
  // late for the client): both ranks saw the same calls.
  for (int i = 0; i < 500 && proxy.QueuedJobs() > 0; ++i) absl::SleepFor(absl::Milliseconds(10));
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(workers[0].Names(), workers[1].Names());
  EXPECT_FALSE(workers[0].Names().empty());
}

// A GetGlobal goes to every rank (the gather is collective) asking only
// rank 0 for the value: the coordinator holds one copy of up to 4 MiB, not
// one a rank, and passes rank 0's on.
TEST(TensorProxy, AGatherAsksOnlyRankZeroForTheValue) {
  TwoRanks two;
  ASSERT_NO_FATAL_FAILURE(two.Start());
  auto& stub = two.stub;
  const absl::StatusOr<v1::Job>& job = two.job;
  grpc::ClientContext ctx;
  v1::GetGlobalRequest req;
  req.set_job_id(job->job_id());
  req.set_name("x");
  v1::GetGlobalResponse resp;
  ASSERT_TRUE(stub->GetGlobal(&ctx, req, &resp).ok());
  EXPECT_EQ(resp.value().data(), "rank 0");
  for (SlowWorker& w : two.workers) {
    absl::MutexLock lock(&w.mu);
    EXPECT_EQ(w.rank_zero_only, std::vector<bool>{true}) << "rank " << w.rank;
  }
}

// The ranks keep holding the same tensors whatever part of a call fails: a
// create one rank refused is deleted again where it was made; a delete
// that found nothing on some ranks (an earlier one reached them) is done;
// each create carries a creation id of its own, the same on every rank (the
// ranks compare it before a collective). Where ranks fail, the error is
// the one whose failure is its own, not a peer's that waited for it.
TEST(TensorProxy, APartlyFailedCallLeavesTheRanksAlikeAndNamesTheCause) {
  TwoRanks two;
  ASSERT_NO_FATAL_FAILURE(two.Start());
  const auto create = [&](const std::string& name) { return two.Create(name); };
  const auto remove = [&](const std::string& name) {
    grpc::ClientContext ctx;
    v1::DeleteTensorRequest req;
    req.set_job_id(two.job->job_id());
    req.set_name(name);
    v1::DeleteTensorResponse resp;
    return FromGrpcStatus(two.stub->DeleteTensor(&ctx, req, &resp));
  };
  absl::Status s = create("half-made");
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 1 ")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "the 1 ranks that made it deleted it again")) << s;
  {
    absl::MutexLock lock0(&two.workers[0].mu);
    absl::MutexLock lock1(&two.workers[1].mu);
    EXPECT_EQ(two.workers[0].deleted, std::vector<std::string>{"half-made"});
    EXPECT_TRUE(two.workers[1].deleted.empty());
  }
  s = create("held-before");
  EXPECT_EQ(s.code(), absl::StatusCode::kAlreadyExists) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 0 ")) << s;
  {
    absl::MutexLock lock0(&two.workers[0].mu);
    absl::MutexLock lock1(&two.workers[1].mu);
    EXPECT_EQ(two.workers[0].deleted, std::vector<std::string>{"half-made"}) << "rank 0's own tensor was deleted";
    EXPECT_EQ(two.workers[1].deleted, std::vector<std::string>{"held-before"});
  }
  EXPECT_TRUE(remove("half-gone").ok());
  s = create("peer-failed");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 1 ") && absl::StrContains(s.message(), "its own fault")) << s;
  ASSERT_TRUE(create("fine").ok());
  absl::MutexLock lock0(&two.workers[0].mu);
  absl::MutexLock lock1(&two.workers[1].mu);
  const std::vector<uint64_t>& ids = two.workers[0].creation_ids;
  EXPECT_EQ(ids, two.workers[1].creation_ids);
  ASSERT_EQ(ids.size(), 4u);
  EXPECT_NE(ids[0], 0u);
  EXPECT_EQ(std::set<uint64_t>(ids.begin(), ids.end()).size(), 4u);
}

// A call goes to the ranks once every rank's worker is connected. One that
// is not for a moment (its server restarting) is waited for, so that its
// peers do not wait in a collective for a call that failed at once; one that
// stays away gets the call sent to no rank, UNAVAILABLE naming it, and the
// calls after that are answered at once rather than each waiting again.
// Each call carries the job's generation and uid, which a worker running
// another refuses.
TEST(TensorProxy, ACallIsSentOnlyOnceEveryRanksWorkerIsConnected) {
  TwoRanks two;
  two.options.connect_timeout = absl::Seconds(4);
  ASSERT_NO_FATAL_FAILURE(two.Start());
  const auto create = [&](const std::string& name) { return two.Create(name); };
  const auto restart_rank_one = [&] {
    grpc::ServerBuilder b;
    b.AddListeningPort(two.addresses[1], grpc::InsecureServerCredentials());
    b.RegisterService(&two.workers[1]);
    two.servers[1] = b.BuildAndStart();
  };
  ASSERT_TRUE(create("connected").ok());
  // Rank 1's server goes away and comes back on its port 600 ms later.
  two.servers[1]->Shutdown();
  two.servers[1].reset();
  absl::SleepFor(absl::Milliseconds(300));  // (the proxy's connection sees it close)
  std::thread back([&] {
    absl::SleepFor(absl::Milliseconds(300));
    restart_rank_one();
  });
  absl::Status s = create("blip");
  back.join();
  ASSERT_NE(two.servers[1], nullptr) << "the port was not free again";
  EXPECT_TRUE(s.ok()) << s;
  // It stays away: nothing is sent, rank 0 included.
  two.servers[1]->Shutdown();
  two.servers[1].reset();
  absl::SleepFor(absl::Milliseconds(300));
  absl::Time start = absl::Now();
  s = create("nowhere");
  const absl::Duration first = absl::Now() - start;
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "rank 1 (worker worker-1 at " + two.addresses[1] + ") is not connected"))
      << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "; the call was sent to no rank")) << s;
  EXPECT_GE(first, absl::Seconds(3.9));
  EXPECT_LT(first, absl::Seconds(15));
  // The next call does not wait for it again.
  start = absl::Now();
  s = create("nowhere again");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  // It registers anew on its port: the next call connects to it at once.
  restart_rank_one();
  ASSERT_NE(two.servers[1], nullptr) << "the port was not free again";
  two.proxy->ForgetConnection(two.addresses[1]);
  start = absl::Now();
  s = create("registered again");
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
  absl::MutexLock lock0(&two.workers[0].mu);
  absl::MutexLock lock1(&two.workers[1].mu);
  const std::vector<std::string> sent = {"connected", "blip", "registered again"};
  EXPECT_EQ(two.workers[0].names, sent);
  EXPECT_EQ(two.workers[1].names, sent);
  const absl::StatusOr<v1::Job> placed = two.jobs.Get(two.job->job_id());
  ASSERT_TRUE(placed.ok()) << placed.status();
  EXPECT_GT(placed->generation(), 0);
  EXPECT_EQ(two.workers[0].generations, std::vector<int64_t>(3, placed->generation()));
  EXPECT_EQ(two.workers[1].generations, two.workers[0].generations);
  EXPECT_FALSE(placed->uid().empty());
  EXPECT_EQ(two.workers[0].uids, std::vector<std::string>(3, placed->uid()));
}

// What calls found of a worker stands only while calls keep looking: one
// that comes after connect_timeout without any gives the worker its whole
// wait again (a record from long ago would fail a drop of the moment at
// once), while calls one after another are answered at once.
TEST(TensorProxy, AWorkerNotLookedAtForAWhileIsWaitedForAgain) {
  TwoRanks two;
  two.options.connect_timeout = absl::Seconds(1);
  ASSERT_NO_FATAL_FAILURE(two.Start());
  two.servers[1]->Shutdown();
  two.servers[1].reset();
  const auto create_took = [&](const std::string& name) {
    const absl::Time start = absl::Now();
    const absl::Status s = two.Create(name);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << name << ": " << s;
    return absl::Now() - start;
  };
  EXPECT_GE(create_took("first"), absl::Milliseconds(900));
  EXPECT_LT(create_took("right after"), absl::Milliseconds(500));
  absl::SleepFor(absl::Milliseconds(1500));
  EXPECT_GE(create_took("a while after"), absl::Milliseconds(900));
  absl::MutexLock lock(&two.workers[0].mu);
  EXPECT_TRUE(two.workers[0].names.empty()) << "a call reached rank 0";
}

// A call whose job is cancelled, or placed again, while it runs on the
// ranks answers what a call after that gets, FAILED_PRECONDITION naming the
// job's state (the ranks' ABORTED is what the cancel did to them, and
// API.md keeps that code for other things); a rank's own error is passed on
// as it is, naming the rank, whatever became of the job.
TEST(TensorProxy, ACallWhoseJobStopsUnderItAnswersTheJobsState) {
  JobManager jobs;
  prometheus::Registry registry;
  TensorProxy proxy(&jobs, &registry, TensorProxy::Options());
  std::string proxy_address;
  std::unique_ptr<grpc::Server> proxy_server = Serve(&proxy, &proxy_address);
  auto stub = v1::TensorService::NewStub(grpc::CreateChannel(proxy_address, grpc::InsecureChannelCredentials()));
  // Runs CreateTensor `name` on a new job's one rank and, while the rank
  // holds it, `meanwhile` on the job; the call's status.
  const auto call_while = [&](const std::string& name, const std::function<void(const std::string&)>& meanwhile,
                              std::string* rank_address) {
    SlowWorker worker;
    std::unique_ptr<grpc::Server> server = Serve(&worker, rank_address);
    absl::StatusOr<v1::Job> job;
    RunTensorJob(jobs, {*rank_address}, &job);
    grpc::Status status(grpc::StatusCode::UNKNOWN, "not run");
    if (!job.ok()) return status;
    std::thread call([&] {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      v1::CreateTensorRequest req;
      req.set_job_id(job->job_id());
      req.set_name(name);
      v1::CreateTensorResponse resp;
      status = stub->CreateTensor(&ctx, req, &resp);
    });
    for (int i = 0; i < 1000 && worker.Names().empty(); ++i) absl::SleepFor(absl::Milliseconds(5));
    const bool reached = worker.Names() == std::vector<std::string>{name};
    if (reached) meanwhile(job->job_id());
    worker.release.Notify();
    call.join();
    server->Shutdown();
    EXPECT_TRUE(reached);
    return status;
  };
  std::string rank;
  const grpc::Status refused = call_while("refused", [](const std::string&) {}, &rank);
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_NE(refused.error_message().find("rank 0 (worker worker-0 at " + rank + "): tensor 'refused'"),
            std::string::npos)
      << refused.error_message();

  const auto cancel = [&](const std::string& id) { EXPECT_TRUE(jobs.Cancel(id, "done with it").ok()); };
  const grpc::Status cancelled = call_while("aborted", cancel, &rank);
  EXPECT_EQ(cancelled.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << cancelled.error_message();
  EXPECT_NE(cancelled.error_message().find("is cancelled, no longer running: its ranks stopped while the call ran "
                                           "(rank 0 (worker worker-0 at " + rank + "): the rank was aborted)"),
            std::string::npos)
      << cancelled.error_message();
  // The rank's own error stays its own, though the job ended meanwhile.
  const grpc::Status own = call_while("refused", cancel, &rank);
  EXPECT_EQ(own.error_code(), grpc::StatusCode::ALREADY_EXISTS) << own.error_message();

  // Placed again (a restart) and running anew: its new ranks hold nothing.
  const auto place_again = [&](const std::string& id) {
    EXPECT_TRUE(jobs.Restart(id, "a worker was lost", "restarting").ok());
    v1::MeshSpec mesh;
    v1::RankAssignment& a = *mesh.add_ranks();
    a.set_rank(0);
    a.set_worker_id("worker-9");
    a.set_worker_address("127.0.0.1:9");
    EXPECT_TRUE(jobs.Schedule(id, mesh).ok());
    EXPECT_TRUE(jobs.SetState(id, v1::JOB_STATE_RUNNING, "serving").ok());
  };
  const grpc::Status moved = call_while("aborted", place_again, &rank);
  EXPECT_EQ(moved.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << moved.error_message();
  EXPECT_NE(moved.error_message().find("was placed again while the call ran: its new ranks hold none of its "
                                       "tensors (rank 0 (worker worker-0 at " + rank + "): the rank was aborted)"),
            std::string::npos)
      << moved.error_message();

  // A call queued behind that one while the job is placed again, or
  // cancelled, is answered so when its turn comes, and sent to no worker.
  for (const bool restart : {true, false}) {
    std::string queued_at;
    grpc::Status queued(grpc::StatusCode::UNKNOWN, "not run");
    std::thread second;
    const auto replace_then_queue = [&](const std::string& id) {
      second = std::thread([&, id] {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
        v1::CreateTensorRequest req;
        req.set_job_id(id);
        req.set_name("queued");
        v1::CreateTensorResponse resp;
        queued = stub->CreateTensor(&ctx, req, &resp);
      });
      for (int i = 0; i < 2000 && proxy.CallsWaiting(id) == 0; ++i) absl::SleepFor(absl::Milliseconds(5));
      EXPECT_EQ(proxy.CallsWaiting(id), 1) << "the second call is not waiting for its turn";
      if (restart) {
        place_again(id);
      } else {
        EXPECT_TRUE(jobs.Cancel(id, "done with it").ok());
      }
    };
    (void)call_while("slow", replace_then_queue, &queued_at);
    if (second.joinable()) second.join();
    EXPECT_EQ(queued.error_code(), grpc::StatusCode::FAILED_PRECONDITION) << queued.error_message();
    EXPECT_NE(
        queued.error_message().find(restart ? "was placed again while the call waited for its turn" : "is cancelled"),
        std::string::npos)
        << queued.error_message();
  }
  proxy_server->Shutdown();
}

}  // namespace
}  // namespace colod
