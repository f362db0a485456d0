// The Prometheus rules and the Grafana dashboard in deploy/ against what the
// real daemons export. A coordinator and two CPU workers run as processes on
// loopback; while a TRAIN job trains, every /metrics page is scraped, and
// every PromQL expression of deploy/prometheus/rules/*.yml and
// deploy/grafana/colod.json must name only series the scrapes hold (a
// histogram through its _bucket, _sum or _count samples) or recording rules
// defined in the rules, each with the labels the expression uses (in
// matchers, by/without, on/ignoring, group_left/right). The workers' job
// series are checked too: labelled {job_id, rank}, tokens shared so that
// they add up to the job's, gone when the rank ends (running, last step) and
// after the linger (the rest); the coordinator counts finished jobs. Every
// page passes `promtool check metrics` (Debian's prometheus package).
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/subprocess.h"
#include "tests/testing/prometheus_text.h"
#include "tests/testing/promql_refs.h"
#include "tests/testing/temp_dir.h"
#include "worker/shardformer/testing.h"
#include "worker/train/job_options.h"

namespace colod {
namespace {

using ::colod::testing::Daemon;
using ::colod::testing::ReadFile;
using ::colod::testing::Runfile;
using ::colod::testing::RunCommand;
using ::colod::testing::TempPath;
using Families = std::map<std::string, testing::MetricFamily>;

constexpr char kGpl[] = "/usr/share/common-licenses/GPL-3";
// Labels Prometheus puts on every series of a target (job, instance) and
// that the scrape configs in deploy/prometheus add (component).
const std::set<std::string> kTargetLabels = {"instance", "job", "component"};

struct Rule {
  std::string file;
  std::string kind;  // "record" or "alert"
  std::string name;
  std::string expr;
};

size_t Indent(const std::string& line) { return line.find_first_not_of(' '); }

// The rules of a Prometheus rule file, read as the files in deploy/ write
// them: "- record: NAME" or "- alert: NAME", then "expr: EXPR" on one line
// or as a block scalar ("expr: |" and more indented lines).
std::vector<Rule> ReadRules(const std::string& path) {
  std::vector<Rule> rules;
  std::vector<std::string> lines;
  std::istringstream in(ReadFile(path));
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  for (size_t i = 0; i < lines.size(); ++i) {
    absl::string_view l = absl::StripAsciiWhitespace(lines[i]);
    if (absl::ConsumePrefix(&l, "- record:") || absl::ConsumePrefix(&l, "- alert:")) {
      const bool record = absl::StrContains(lines[i], "- record:");
      rules.push_back({path, record ? "record" : "alert", std::string(absl::StripAsciiWhitespace(l)), ""});
    } else if (absl::ConsumePrefix(&l, "expr:") && !rules.empty()) {
      std::string value(absl::StripAsciiWhitespace(l));
      if (value == "|" || value == "|-" || value == ">" || value == ">-") {
        value.clear();
        const size_t indent = Indent(lines[i]);
        while (i + 1 < lines.size() &&
               (absl::StripAsciiWhitespace(lines[i + 1]).empty() || Indent(lines[i + 1]) > indent)) {
          absl::StrAppend(&value, lines[++i], "\n");
        }
      } else if (value.size() >= 2 && (value[0] == '"' || value[0] == '\'') && value.back() == value[0]) {
        value = value.substr(1, value.size() - 2);
      }
      rules.back().expr = value;
    }
  }
  return rules;
}

// Every "expr" of the dashboard's panels (rows hold panels too).
void CollectExprs(const nlohmann::json& j, std::vector<std::string>* out) {
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) {
      if (it.key() == "expr" && it.value().is_string()) {
        out->push_back(it.value().get<std::string>());
      } else {
        CollectExprs(it.value(), out);
      }
    }
  } else if (j.is_array()) {
    for (const auto& e : j) CollectExprs(e, out);
  }
}

// Grafana's variables, replaced as Grafana would.
std::string Substitute(std::string expr) {
  return absl::StrReplaceAll(expr, {{"$__rate_interval", "1m"},
                                    {"$__interval", "1m"},
                                    {"$__range", "1h"},
                                    {"${job_id}", ".*"},
                                    {"$job_id", ".*"}});
}

Families Scrape(const std::string& address) {
  auto body = testing::HttpGet(address, "/metrics");
  EXPECT_TRUE(body.ok()) << address << ": " << body.status();
  if (!body.ok()) return {};
  auto families = testing::ParsePrometheusText(*body);
  EXPECT_TRUE(families.ok()) << families.status() << "\n" << *body;
  return families.ok() ? *families : Families{};
}

// Samples named `name` (NAME or NAME_bucket/_sum/_count) on a page.
std::vector<testing::Sample> Samples(const Families& families, const std::string& name) {
  std::vector<testing::Sample> out;
  for (const auto& [family, f] : families) {
    for (const testing::Sample& s : f.samples) {
      if (s.name == name) out.push_back(s);
    }
  }
  return out;
}

// Samples on a page that carry a job_id label.
int JobSeries(const Families& families) {
  int n = 0;
  for (const auto& [family, f] : families) {
    for (const testing::Sample& s : f.samples) n += s.labels.count("job_id");
  }
  return n;
}

class DashboardMetricsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    shardformer::testing::TinyOptions tiny;
    tiny.vocab = 257;  // byte-level text
    tiny.positions = 32;
    auto model = shardformer::testing::WriteTinyGpt2(TempPath("gpt2"), tiny);
    ASSERT_TRUE(model.ok()) << model.status();
    coordinator_ = testing::StartTestCoordinator();
    ASSERT_FALSE(coordinator_.grpc.empty()) << ReadFile(coordinator_.log);
    auto client = CoordinatorClient::Create(coordinator_.grpc);
    ASSERT_TRUE(client.ok());
    client_ = std::move(*client);
    workers_ = testing::StartTestWorkers(coordinator_.grpc, 2, {"--metrics-linger", "20s"});
    for (const Daemon& w : workers_) ASSERT_FALSE(w.grpc.empty()) << ReadFile(w.log);
    const absl::Status registered = testing::WaitForWorkers(*client_, 2);
    ASSERT_TRUE(registered.ok()) << registered << "\n" << Logs();
  }

  // A tp=2 TRAIN job of `steps` steps of 4 x 32 tokens, evaluated after
  // each on a batch of the held-out tenth of its text; in fp16 (its loss
  // scaled: the series of fp16 ranks) or fp32.
  v1::JobSpec Spec(int64_t steps, bool fp16 = false) const {
    train::TrainOptions o;
    o.model_dir = TempPath("gpt2");
    o.data_path = kGpl;
    o.steps = steps;
    o.batch_size = 4;
    o.seq_len = 32;
    o.lr = 3e-3;
    o.seed = 3;
    o.shard.layout.set_tensor_parallel_size(2);
    o.shard.layout.set_data_parallel_size(1);
    o.shard.layout.set_tensor_parallel_mode(v1::TENSOR_PARALLEL_MODE_1D);
    o.eval_split = 0.1;
    o.eval_every = 1;
    o.eval_steps = 1;
    if (fp16) o.shard.param_dtype = DType::kF16;
    v1::JobSpec spec = train::SpecFromTrainOptions(o);
    spec.mutable_model()->set_config_json(ReadFile(o.model_dir + "/config.json"));
    spec.mutable_model()->set_weights_path(o.model_dir);
    return spec;
  }

  std::string Logs() { return testing::DaemonLogs(coordinator_, workers_); }

  // colod_jobs_finished_total{state}, once it reaches `want` (the sweeper
  // publishes it within its period) or after 10 s.
  double JobsFinished(const std::string& state, double want) {
    double got = -1;
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    do {
      for (const testing::Sample& s : Samples(Scrape(coordinator_.metrics), "colod_jobs_finished_total")) {
        if (s.labels.at("state") == state) got = s.value;
      }
      if (got == want) break;
      absl::SleepFor(absl::Milliseconds(50));
    } while (absl::Now() < deadline);
    return got;
  }

  Daemon coordinator_;
  std::vector<Daemon> workers_;
  std::unique_ptr<CoordinatorClient> client_;
};

TEST_F(DashboardMetricsTest, RulesAndDashboardNameOnlyWhatTheDaemonsExport) {
  const std::string promtool = "/usr/bin/promtool";
  ASSERT_TRUE(std::filesystem::exists(promtool))
      << "promtool is missing: install Debian's prometheus package (apt-get install prometheus)";

  // A short job to its end: each worker's rank counted its share of the
  // tokens (2 tp ranks share a replica's 4 x 32 tokens a step), so the
  // shares add up to the job's; the ended ranks' series stay for the
  // linger, without the ones that say a rank runs.
  auto short_job = client_->SubmitJob(Spec(3));
  ASSERT_TRUE(short_job.ok()) << short_job.status();
  ASSERT_TRUE(client_->WatchJob(short_job->job_id(), 1, absl::Seconds(240), [](const v1::JobEvent&) { return true; })
                  .ok());
  auto done = client_->GetJob(short_job->job_id());
  ASSERT_TRUE(done.ok());
  ASSERT_EQ(done->state(), v1::JOB_STATE_SUCCEEDED) << done->reason() << Logs();
  double tokens = 0;
  std::set<std::string> ranks;
  for (const Daemon& w : workers_) {
    const Families page = Scrape(w.metrics);
    const std::vector<testing::Sample> t = Samples(page, "colod_tokens_total");
    ASSERT_EQ(t.size(), 1u) << w.metrics;
    EXPECT_EQ(t[0].labels.at("job_id"), short_job->job_id());
    ranks.insert(t[0].labels.at("rank"));
    EXPECT_EQ(t[0].value, 3 * 4 * 32 / 2);
    tokens += t[0].value;
    const std::vector<testing::Sample> loss = Samples(page, "colod_loss");
    ASSERT_EQ(loss.size(), 1u);
    EXPECT_NEAR(loss[0].value, done->loss(), 1e-5);
    const std::vector<testing::Sample> eval = Samples(page, "colod_eval_loss");
    ASSERT_EQ(eval.size(), 1u);
    EXPECT_EQ(eval[0].labels, loss[0].labels);
    EXPECT_NEAR(eval[0].value, done->last_eval().loss(), 1e-5);
    EXPECT_EQ(Samples(page, "colod_step_duration_seconds_count").at(0).value, 3);
    EXPECT_TRUE(Samples(page, "colod_rank_running").empty());
    EXPECT_TRUE(Samples(page, "colod_rank_last_step_timestamp_seconds").empty());
    EXPECT_TRUE(Samples(page, "colod_loss_scale").empty());  // an fp32 rank scales nothing
    EXPECT_TRUE(Samples(page, "colod_skipped_updates_total").empty());
  }
  EXPECT_EQ(ranks, (std::set<std::string>{"0", "1"}));
  EXPECT_EQ(tokens, 3 * 4 * 32);
  EXPECT_EQ(JobsFinished("succeeded", 1), 1);

  // A long job, scraped while it trains: in fp16, so that its workers
  // export the loss scale's series too.
  auto job = client_->SubmitJob(Spec(100000, /*fp16=*/true));
  ASSERT_TRUE(job.ok()) << job.status();
  const absl::Time deadline = absl::Now() + absl::Seconds(120);
  while (absl::Now() < deadline && client_->GetJob(job->job_id())->step() < 2) {
    absl::SleepFor(absl::Milliseconds(50));
  }
  ASSERT_GE(client_->GetJob(job->job_id())->step(), 2) << Logs();
  std::vector<std::pair<std::string, std::string>> pages;  // address, body
  for (const std::string& address : {coordinator_.metrics, workers_[0].metrics, workers_[1].metrics}) {
    auto body = testing::HttpGet(address, "/metrics");
    ASSERT_TRUE(body.ok()) << body.status();
    pages.emplace_back(address, *body);
  }
  // Sample name -> the labels its series carry, over every page.
  std::map<std::string, std::set<std::string>> exported;
  for (const auto& [address, body] : pages) {
    auto families = testing::ParsePrometheusText(body);
    ASSERT_TRUE(families.ok()) << families.status();
    for (const auto& [family, f] : *families) {
      for (const testing::Sample& s : f.samples) {
        std::set<std::string>& labels = exported[s.name];
        labels.insert(kTargetLabels.begin(), kTargetLabels.end());
        for (const auto& [k, v] : s.labels) labels.insert(k);
      }
    }
  }
  const double now = absl::ToDoubleSeconds(absl::Now() - absl::UnixEpoch());
  for (const Daemon& w : workers_) {
    const Families page = Scrape(w.metrics);
    const std::vector<testing::Sample> running = Samples(page, "colod_rank_running");
    ASSERT_EQ(running.size(), 1u) << w.metrics;
    EXPECT_EQ(running[0].labels.at("job_id"), job->job_id());
    EXPECT_EQ(running[0].labels.at("kind"), "train");
    EXPECT_EQ(running[0].value, 1);
    const std::vector<testing::Sample> last = Samples(page, "colod_rank_last_step_timestamp_seconds");
    ASSERT_EQ(last.size(), 1u);
    EXPECT_GT(last[0].value, now - 120);
    EXPECT_LE(last[0].value, now + 1);
    // An fp16 rank's loss scale (65536 at the start, doubled only after
    // 2000 steps without overflow, halved by one) and its skipped updates.
    const std::vector<testing::Sample> scale = Samples(page, "colod_loss_scale");
    ASSERT_EQ(scale.size(), 1u) << w.metrics;
    EXPECT_GE(scale[0].value, 1);
    EXPECT_LE(scale[0].value, 65536);
    const std::vector<testing::Sample> skipped = Samples(page, "colod_skipped_updates_total");
    ASSERT_EQ(skipped.size(), 1u) << w.metrics;
    EXPECT_EQ(skipped[0].value, std::log2(65536 / scale[0].value));  // each skip halved it
  }

  // Every page passes promtool's lint (DESIGN.md section 4).
  for (const auto& [address, body] : pages) {
    const std::string file = TempPath(absl::StrCat("page-", address.substr(address.rfind(':') + 1), ".txt"));
    std::ofstream(file) << body;
    auto lint = RunCommand({"/bin/sh", "-c", absl::StrCat(promtool, " check metrics < ", file)}, TempPath(""));
    EXPECT_EQ(lint.code, 0) << address << ":\n" << lint.out << lint.err;
  }

  // The rules: recording rules first (their labels are those of what they
  // combine), then alerts; then the dashboard's queries and its variables.
  std::map<std::string, std::set<std::string>> recorded;
  testing::LabelLookup labels_of = [&](const std::string& name) -> std::optional<std::set<std::string>> {
    if (auto it = exported.find(name); it != exported.end()) return it->second;
    if (auto it = recorded.find(name); it != recorded.end()) return it->second;
    if (name == "up") return kTargetLabels;  // Prometheus' own, per target
    return std::nullopt;
  };
  std::vector<Rule> rules;
  std::vector<std::string> files;
  for (const auto& f : std::filesystem::directory_iterator(Runfile("deploy/prometheus/rules"))) {
    if (f.path().extension() == ".yml") files.push_back(f.path().string());
  }
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) {
    for (Rule& r : ReadRules(f)) {
      r.file = "deploy/prometheus/rules/" + std::filesystem::path(f).filename().string();
      rules.push_back(std::move(r));
    }
  }
  std::stable_partition(rules.begin(), rules.end(), [](const Rule& r) { return r.kind == "record"; });
  int records = 0, alerts = 0;
  std::set<std::string> used;
  for (const Rule& r : rules) {
    ASSERT_FALSE(r.expr.empty()) << r.file << ": " << r.name << " has no expr";
    const testing::PromqlRefs refs = testing::ReadPromql(r.expr, labels_of);
    EXPECT_TRUE(refs.problems.empty()) << r.file << ": " << r.kind << " " << r.name << ": "
                                       << absl::StrJoin(refs.problems, "; ") << "\n  " << r.expr;
    EXPECT_FALSE(refs.names.empty()) << r.name;
    used.insert(refs.names.begin(), refs.names.end());
    if (r.kind == "record") {
      EXPECT_TRUE(absl::StartsWith(r.name, "colod:")) << r.name;
      recorded[r.name] = refs.output_labels;
      ++records;
    } else {
      ++alerts;
    }
  }
  EXPECT_GE(records, 1);
  EXPECT_GE(alerts, 1);

  const nlohmann::json dashboard =
      nlohmann::json::parse(ReadFile(Runfile("deploy/grafana/colod.json")), nullptr, /*allow_exceptions=*/false);
  ASSERT_FALSE(dashboard.is_discarded()) << "deploy/grafana/colod.json is not JSON";
  std::vector<std::string> exprs;
  CollectExprs(dashboard["panels"], &exprs);
  ASSERT_FALSE(exprs.empty());
  for (const std::string& e : exprs) {
    const std::string expr = Substitute(e);
    EXPECT_FALSE(absl::StrContains(expr, "$")) << "a Grafana variable this test does not know: " << e;
    const testing::PromqlRefs refs = testing::ReadPromql(expr, labels_of);
    EXPECT_TRUE(refs.problems.empty()) << "dashboard: " << absl::StrJoin(refs.problems, "; ") << "\n  " << e;
    EXPECT_FALSE(refs.names.empty()) << e;
    used.insert(refs.names.begin(), refs.names.end());
  }
  // Variables: label_values(SELECTOR, LABEL).
  const std::regex label_values(R"(^\s*label_values\((.+),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$)");
  int variables = 0;
  for (const auto& v : dashboard["templating"]["list"]) {
    if (v.value("type", "") != "query") continue;
    const std::string q = v["query"].is_object() ? v["query"].value("query", "") : v["query"].get<std::string>();
    std::smatch m;
    ASSERT_TRUE(std::regex_match(q, m, label_values)) << "variable query: " << q;
    const testing::PromqlRefs refs = testing::ReadPromql(m[1].str(), labels_of);
    EXPECT_TRUE(refs.problems.empty()) << q << ": " << absl::StrJoin(refs.problems, "; ");
    EXPECT_TRUE(refs.output_labels.count(m[2].str())) << q << ": no such label";
    used.insert(refs.names.begin(), refs.names.end());
    ++variables;
  }
  EXPECT_GE(variables, 1);
  std::cout << records << " recording rules, " << alerts << " alerts, " << exprs.size() << " dashboard queries, "
            << variables << " variables; names used: " << absl::StrJoin(used, " ") << "\n";

  // Cancelled: the ranks' running and last-step series go at once, the
  // rest after the linger (20 s); the coordinator counts the cancellation.
  ASSERT_TRUE(client_->CancelJob(job->job_id(), "enough").ok());
  EXPECT_EQ(JobsFinished("cancelled", 1), 1);
  const absl::Time idle = absl::Now() + absl::Seconds(60);
  bool stopped = false;
  while (!stopped && absl::Now() < idle) {
    stopped = true;
    for (const Daemon& w : workers_) {
      const Families page = Scrape(w.metrics);
      stopped = stopped && Samples(page, "colod_rank_running").empty() &&
                Samples(page, "colod_rank_last_step_timestamp_seconds").empty();
    }
    if (!stopped) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(stopped) << Logs();
  bool expired = false;
  const absl::Time linger = absl::Now() + absl::Seconds(60);
  while (!expired && absl::Now() < linger) {
    expired = true;
    for (const Daemon& w : workers_) expired = expired && JobSeries(Scrape(w.metrics)) == 0;
    if (!expired) absl::SleepFor(absl::Milliseconds(250));
  }
  EXPECT_TRUE(expired) << "job series still exported 60 s after the ranks ended";
}

}  // namespace
}  // namespace colod
