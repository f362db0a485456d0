#include "worker/daemon/progress_reporter.h"

#include "absl/time/clock.h"
#include "common/auth.h"
#include "common/grpc_status.h"
#include "common/logging.h"
#include "common/proto_time.h"
#include "worker/train/job_options.h"

namespace colod {

ProgressReporter::ProgressReporter(Options options, const v1::AssignJobRequest& assignment)
    : options_(std::move(options)),
      job_id_(assignment.job_id()),
      generation_(assignment.generation()),
      rank_(assignment.rank()) {}

bool ProgressReporter::Phase(v1::RankPhase phase, const std::string& message) const {
  v1::ReportProgressRequest r;
  r.mutable_status()->set_phase(phase);
  r.mutable_status()->set_message(message);
  return Send(std::move(r));
}

bool ProgressReporter::Step(const train::StepStats& st) const {
  v1::ReportProgressRequest r;
  *r.mutable_step() = train::StepProgressOf(st);
  return Send(std::move(r));
}

void ProgressReporter::End(const absl::Status& status, const std::optional<v1::ForwardResult>& forward) const {
  v1::ReportProgressRequest r;
  r.mutable_result()->set_code(static_cast<int>(status.code()));
  r.mutable_result()->set_message(std::string(status.message()));
  if (status.ok() && forward.has_value()) *r.mutable_result()->mutable_forward() = *forward;
  Send(std::move(r));
}

bool ProgressReporter::Send(v1::ReportProgressRequest req) const {
  req.set_job_id(job_id_);
  req.set_generation(generation_);
  req.set_rank(rank_);
  req.set_worker_id(options_.worker_id ? options_.worker_id() : "");
  const bool final = req.has_result();
  for (int attempt = 0; attempt < (final ? 5 : 2); ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + options_.rpc_timeout));
    AddAuthToken(ctx, options_.auth_token);
    v1::ReportProgressResponse resp;
    const grpc::Status s = options_.coordinator->ReportProgress(&ctx, req, &resp);
    if (s.ok()) return resp.stop();
    // The job is gone or moved on: nothing to tell, and nothing to run for.
    if (s.error_code() == grpc::StatusCode::ABORTED || s.error_code() == grpc::StatusCode::NOT_FOUND ||
        s.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
      return true;
    }
    COLOD_LOG(WARNING) << "job " << job_id_ << ": progress report failed: " << FromGrpcStatus(s);
    absl::SleepFor(absl::Milliseconds(200) * (attempt + 1));
  }
  return false;
}

}  // namespace colod
