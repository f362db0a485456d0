// The coordinator's request validation on arbitrary JobSpecs (the bytes as
// a serialized proto, as SubmitJob receives them): ValidateJobSpec, the
// restart policy and the memory floor must return, never crash, and agree
// with each other.
#include <cstdint>
#include <cstdlib>

#include "colod/v1/job.pb.h"
#include "spec/job_validation.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  colod::v1::JobSpec spec;
  if (!spec.ParseFromArray(data, static_cast<int>(size))) return 0;
  const absl::Status valid = colod::ValidateJobSpec(spec);
  const colod::RestartLimits limits = colod::RestartLimitsOf(spec);
  if (limits.max_restarts < 0) std::abort();
  const int64_t floor = colod::RankMemoryFloorBytes(spec);
  if (floor < 0) std::abort();
  if (valid.ok()) {
    std::vector<colod::v1::Worker> workers(1);
    workers[0].mutable_info()->set_memory_bytes(int64_t{1} << 40);
    (void)colod::CheckMemoryFits(colod::JobMemoryFloor(spec), workers);
  }
  return 0;
}
