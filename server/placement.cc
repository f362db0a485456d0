#include "server/placement.h"

#include <algorithm>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "spec/model_config.h"

namespace colod {

absl::StatusOr<v1::MeshSpec> AssignRanks(const DeviceMesh& mesh, const std::vector<v1::WorkerInfo>& workers) {
  const int world = mesh.world_size();
  if (static_cast<int>(workers.size()) < world) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the mesh has ", world, " ranks but only ", workers.size(), " idle workers"));
  }
  ASSIGN_OR_RETURN(int tp, mesh.AxisSize("tp"));
  // Free workers per host, each host's in device-ordinal order.
  std::map<std::string, std::vector<const v1::WorkerInfo*>> free;
  for (const v1::WorkerInfo& w : workers) free[w.host()].push_back(&w);
  auto by_ordinal = [](const v1::WorkerInfo* a, const v1::WorkerInfo* b) {
    return std::make_tuple(a->device_ordinal(), a->worker_id(), a->address()) <
           std::make_tuple(b->device_ordinal(), b->worker_id(), b->address());
  };
  for (auto& [host, list] : free) std::sort(list.begin(), list.end(), by_ordinal);

  v1::MeshSpec spec = mesh.ToProto();
  std::vector<const v1::WorkerInfo*> placed;
  for (int group = 0; group < world / tp; ++group) {
    // Best fit: the host with the fewest free workers that holds the group.
    std::string best;
    size_t best_free = 0;
    for (const auto& [host, list] : free) {
      if (list.size() >= static_cast<size_t>(tp) && (best.empty() || list.size() < best_free)) {
        best = host;
        best_free = list.size();
      }
    }
    for (int k = 0; k < tp; ++k) {
      std::string host = best;
      if (host.empty()) {  // no host holds the whole group: (host, ordinal) order
        for (const auto& [h, list] : free) {
          if (!list.empty()) {
            host = h;
            break;
          }
        }
      }
      auto& list = free[host];
      placed.push_back(list.front());
      list.erase(list.begin());
      if (list.empty()) free.erase(host);
    }
  }
  spec.clear_ranks();
  for (int r = 0; r < world; ++r) {
    v1::RankAssignment* a = spec.add_ranks();
    a->set_rank(r);
    a->set_worker_id(placed[r]->worker_id());
    a->set_worker_address(placed[r]->address());
    a->set_host(placed[r]->host());
    a->set_device_ordinal(placed[r]->device_ordinal());
  }
  return spec;
}

absl::StatusOr<PlacementDecision> PlaceJob(const DeviceMesh& mesh, int64_t memory_need,
                                           const std::vector<v1::Worker>& live,
                                           const std::set<std::string>& unavailable, const WorkerNeeds& needs) {
  std::vector<v1::WorkerInfo> cpu, cuda;  // idle candidates
  int registered_cpu = 0, registered_cuda = 0, too_small = 0, too_old = 0;
  for (const v1::Worker& w : live) {
    // An older worker would train a masked language model on next tokens,
    // and refuse fp16 training or run it unscaled.
    if ((needs.masked_lm && !w.info().trains_masked_lm()) ||
        (needs.fp16_loss_scaling && !w.info().scales_fp16_loss())) {
      ++too_old;
      continue;
    }
    if (memory_need > 0 && w.info().memory_bytes() > 0 && w.info().memory_bytes() < memory_need) {
      ++too_small;
      continue;
    }
    const bool is_cuda = w.info().device_kind() == v1::DEVICE_KIND_CUDA;
    ++(is_cuda ? registered_cuda : registered_cpu);
    // A worker still winding down a rank says BUSY until its next heartbeat.
    if (unavailable.count(w.info().worker_id()) || w.status().state() == v1::WORKER_STATE_BUSY) continue;
    (is_cuda ? cuda : cpu).push_back(w.info());
  }
  const int world = mesh.world_size();
  const std::vector<v1::WorkerInfo>& pool = static_cast<int>(cuda.size()) >= world ? cuda : cpu;
  absl::StatusOr<v1::MeshSpec> placed = AssignRanks(mesh, pool);
  PlacementDecision d;
  if (placed.ok()) {
    d.placed = *std::move(placed);
    return d;
  }
  if (!absl::IsResourceExhausted(placed.status())) return placed.status();
  d.fits_cluster = world <= std::max(registered_cpu, registered_cuda);
  const std::string memory =
      too_small > 0 ? absl::StrCat(" with ", GiB(memory_need), " of memory") : std::string();
  d.waiting = absl::StrCat(
      "waiting for workers: needs ", world, " workers of one device kind", memory, "; ",
      registered_cpu + registered_cuda, " registered", memory.empty() ? "" : " that have it", " (", registered_cpu,
      " cpu, ", registered_cuda, " cuda), ", cpu.size() + cuda.size(), " idle",
      too_small > 0 ? absl::StrCat("; ", too_small, " more with less memory") : "",
      too_old > 0 ? absl::StrCat("; ", too_old, " more of an older colod, which ",
                                 needs.masked_lm ? "trains no masked language model" : "",
                                 needs.masked_lm && needs.fp16_loss_scaling ? " or " : "",
                                 needs.fp16_loss_scaling ? "scales no fp16 run's loss" : "", " (upgrade them)")
                  : "",
      d.fits_cluster ? "" : "; jobs behind it that fit run first");
  return d;
}

bool RunsAMaskedLanguageModel(const v1::JobSpec& spec) {
  if (spec.kind() == v1::JOB_KIND_TRAIN) return spec.train().has_mask_token_id();
  if (spec.kind() != v1::JOB_KIND_FORWARD) return false;
  const absl::StatusOr<ModelConfig> config = ParseModelConfig(spec.model().config_json());
  return config.ok() && config->masked_lm();
}

bool TrainsInFp16(const v1::JobSpec& spec) {
  if (spec.kind() != v1::JOB_KIND_TRAIN || spec.train().eval_only()) return false;
  // (A loss scale is refused at another precision: with auto, the job means
  // to train fp16, or resume an fp16 checkpoint.)
  return spec.train().precision() == v1::PRECISION_FP16_MIXED || spec.train().has_loss_scale() ||
         spec.train().loss_scale_window() != 0;
}

}  // namespace colod
