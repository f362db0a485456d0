// Rank assignment: which worker runs each global rank of a job's mesh, and
// the placement policy of one scheduling pass (PlaceJob).
//
// Deterministic and stable: the result depends only on the set of workers
// (not on the order they are listed in), so the same cluster gives the same
// placement every time. Tensor-parallel groups are consecutive ranks (tp is
// the innermost axis, spec/mesh.h); each is packed onto one host where
// one has enough free workers — the host with the fewest free workers that
// still fits (best fit, ties by host name), keeping larger hosts whole for
// later groups — and within a host ranks follow device ordinal. A group no
// single host can hold takes the free workers in (host, ordinal) order.
//
// Thread-safety: a pure function.
#ifndef COLOD_SERVER_PLACEMENT_H_
#define COLOD_SERVER_PLACEMENT_H_

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "colod/v1/job.pb.h"
#include "colod/v1/mesh.pb.h"
#include "colod/v1/worker.pb.h"
#include "spec/mesh.h"

namespace colod {

// `mesh`'s MeshSpec (axes, groups) with `ranks` filled from `workers` (the
// idle ones to choose from). RESOURCE_EXHAUSTED naming both numbers when
// there are fewer workers than ranks.
absl::StatusOr<v1::MeshSpec> AssignRanks(const DeviceMesh& mesh, const std::vector<v1::WorkerInfo>& workers);

// Where a job goes in a scheduling pass, or why it waits.
struct PlacementDecision {
  // Set: the workers of its ranks (AssignRanks).
  std::optional<v1::MeshSpec> placed;
  // Otherwise why it waits ("waiting for workers: needs 4 workers of one
  // device kind; 3 registered (3 cpu, 0 cuda), 3 idle"), and whether it fits
  // the registered workers of one device kind: a job that fits waits for
  // busy ones and holds the queue (first come, first served); one that does
  // not cannot start until workers join, so jobs behind it go first
  // (backfill).
  std::string waiting;
  bool fits_cluster = false;
};

// The placement policy for one job: of the `live` workers, those with at
// least `memory_need` bytes (0: unknown; a worker that does not say decides
// itself) are registered candidates; of those, the ones not BUSY and not in
// `unavailable` (holding a rank, sitting out a refusal, taken earlier in the
// pass) are idle. The job takes idle CUDA workers if there are enough of
// them, else idle CPU ones (AssignRanks), else waits. Only workers that
// say they have what the job `needs` (features an older worker lacks) are
// candidates. Errors other than too few workers (a mesh AssignRanks cannot
// lay out) are returned.
struct WorkerNeeds {
  bool masked_lm = false;          // WorkerInfo.trains_masked_lm (RunsAMaskedLanguageModel)
  bool fp16_loss_scaling = false;  // WorkerInfo.scales_fp16_loss (TrainsInFp16)
};
absl::StatusOr<PlacementDecision> PlaceJob(const DeviceMesh& mesh, int64_t memory_need,
                                           const std::vector<v1::Worker>& live,
                                           const std::set<std::string>& unavailable, const WorkerNeeds& needs = {});

// Whether a job's ranks run a masked language model (BERT): one that trains
// it (TrainConfig.mask_token_id), or a forward pass of one (no next-token
// loss; its labels are positions'). An older worker would train it on next
// tokens, report a next-token loss, or refuse the labels: PlaceJob's
// WorkerNeeds::masked_lm.
bool RunsAMaskedLanguageModel(const v1::JobSpec& spec);
// Whether a job trains in fp16 mixed precision (an evaluation computes no
// gradient), or names a loss scale (with auto precision: a resume of an
// fp16 checkpoint): an older worker would refuse it, or, older still, train
// it without loss scaling. WorkerNeeds::fp16_loss_scaling. (A job at auto
// that names no scale and resumes an fp16 checkpoint is not told apart.)
bool TrainsInFp16(const v1::JobSpec& spec);

}  // namespace colod

#endif  // COLOD_SERVER_PLACEMENT_H_
