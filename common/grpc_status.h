// The one place where absl::Status and grpc::Status are converted.
#ifndef COLOD_COMMON_GRPC_STATUS_H_
#define COLOD_COMMON_GRPC_STATUS_H_

#include <cstddef>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "grpcpp/server_context.h"
#include "grpcpp/support/status.h"

namespace colod {

// A status message travels in the call's trailers as grpc-message,
// percent-encoded; trailers past the peer's limit (8 KiB by default in
// gRPC 1.51) are dropped, and the caller sees RESOURCE_EXHAUSTED instead of
// the real error. Encoded, a message keeps at most this many bytes.
inline constexpr size_t kMaxEncodedStatusMessage = 4096;
// `message` as the wire can carry it: whole when its encoding fits
// kMaxEncodedStatusMessage, else valid UTF-8 cut to fit, ending "...".
std::string StatusMessageForTheWire(absl::string_view message);

// Maps the canonical code one to one and keeps the message
// (StatusMessageForTheWire).
grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

// A refusal for want of room now (RESOURCE_EXHAUSTED: a bound of concurrent
// calls reached) that asking again later mends says so in its trailing
// metadata, `colod-retry-after-ms: N`, the wait the server suggests: a
// client tells it from a final refusal (a quota spent) by this, never by
// the message's text.
inline constexpr char kRetryAfterMetadata[] = "colod-retry-after-ms";
// Marks the call's refusal as one to ask again after `wait`, clamped to
// 1 ms to a day.
void SetRetryAfter(grpc::ServerContext& ctx, absl::Duration wait);
// The wait a finished call's refusal suggests (SetRetryAfter), or nullopt
// where the server marked none (or sent one that does not parse). Only
// after the call has finished (Finish, or a unary call's return).
std::optional<absl::Duration> RetryAfter(const grpc::ClientContext& ctx);
// Whether a finished call's refusal is one for want of room now, to ask
// again later: RESOURCE_EXHAUSTED marked so (RetryAfter), or gRPC's own when
// the server found no thread for the call (its resource quota: a sync
// server's fixed text "Server Threadpool Exhausted", which carries no mark).
bool IsBusyRefusal(const grpc::Status& status, const grpc::ClientContext& ctx);

// A client's call that failed UNAVAILABLE or DEADLINE_EXCEEDED without an
// answer from its server: the server could not be reached (refused, no
// route, a TLS handshake that failed) or did not answer in time.
// MarkUnreachable adds a payload that says so, kept while the status is
// passed on unchanged, so that what reports it (coloctl's exit status) need
// not read the code or the message; any other status is returned as it is.
absl::Status MarkUnreachable(absl::Status status);
bool IsUnreachable(const absl::Status& status);

// A rank's failure whose cause is the worker's own (its --work-dir full, its
// device lost), not the job's: another worker may well run the rank.
// MarkWorkerFault adds a payload that says so (kept while the status is
// passed on unchanged); the worker reports it (RankResult.worker_fault), and
// the coordinator restarts the job without that worker for a while.
absl::Status MarkWorkerFault(absl::Status status);
bool IsWorkerFault(const absl::Status& status);

// A training rank that stopped because a worker of its job shuts down
// (RankHooks::drain), after the step every rank agreed on and with that
// step's checkpoint saved: not a failure of the job's or the worker's.
// MarkDrained adds a payload that says so; the worker reports it
// (RankResult.drained), and the coordinator places the job again, resuming
// from that checkpoint, without counting it against the job.
absl::Status MarkDrained(absl::Status status);
bool IsDrained(const absl::Status& status);

// A rank's failure that follows from a peer's: a save another rank could
// not write its part of, a collective a failed peer's abort ended. The
// peer's own error, reported too, says why. MarkPeerCaused adds a payload
// that says so; the worker reports it (RankResult.peer_caused), and
// whoever picks one error of several ranks' (RunLocalRanks, the
// coordinator) takes any other first, whichever came first.
absl::Status MarkPeerCaused(absl::Status status);
bool IsPeerCaused(const absl::Status& status);

// `status` with its message replaced by `message`: its code and its
// payloads (the marks above) are kept. For the one who words an error again
// (names the stage or the file it came from) without unmarking it.
absl::Status WithMessage(const absl::Status& status, absl::string_view message);

// colod's servers mark every answer of theirs in its trailing metadata
// (MarkAnswered), so that a client tells an UNAVAILABLE or a
// DEADLINE_EXCEEDED its server answered (the coordinator passing on a
// worker's, a store wait that timed out) from a server it never reached.
inline constexpr char kAnsweredMetadata[] = "colod-answered";
void MarkAnswered(grpc::ServerContext& ctx);
// `status` of a finished call `ctx`, MarkUnreachable'd unless its server
// marked the answer.
absl::Status MarkUnreachableUnlessAnswered(absl::Status status, const grpc::ClientContext& ctx);

}  // namespace colod

#endif  // COLOD_COMMON_GRPC_STATUS_H_
