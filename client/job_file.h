// Job files: a colod.v1.JobSpec written as JSON (proto3 JSON names) or YAML
// (the same structure), for `coloctl submit --job-file`.
#ifndef COLOD_CLIENT_JOB_FILE_H_
#define COLOD_CLIENT_JOB_FILE_H_

#include <string>

#include "absl/status/statusor.h"
#include "colod/v1/job.pb.h"

namespace colod {

// Parses `text` as a JobSpec: YAML when `yaml`, else JSON. Field names as in
// proto3 JSON (tensorParallelSize or tensor_parallel_size), enums by name
// (JOB_KIND_TRAIN). INVALID_ARGUMENT naming `what` and the problem (syntax,
// an unknown field, a value of the wrong type).
absl::StatusOr<v1::JobSpec> ParseJobSpec(const std::string& text, bool yaml, const std::string& what = "job file");

// Reads PATH: YAML for .yaml/.yml, JSON otherwise. NOT_FOUND if unreadable.
absl::StatusOr<v1::JobSpec> ReadJobFile(const std::string& path);

}  // namespace colod

#endif  // COLOD_CLIENT_JOB_FILE_H_
