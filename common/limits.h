// Bounds that hold across colod, so that every component refuses the same
// inputs: a job the coordinator accepts is one its workers, their
// rendezvous and their checkpoints accept too.
#ifndef COLOD_COMMON_LIMITS_H_
#define COLOD_COMMON_LIMITS_H_

#include <cstddef>

namespace colod {

// Ranks of one job (tp * dp), of one barrier, of one checkpoint.
inline constexpr int kMaxWorldSize = 65536;

// Labels of a job (JobSpec.labels) or a worker (WorkerInfo.labels): at
// most this many, each key 1 to kMaxLabelKeyBytes bytes and each value at
// most kMaxLabelValueBytes.
inline constexpr int kMaxLabels = 64;
inline constexpr size_t kMaxLabelKeyBytes = 128;
inline constexpr size_t kMaxLabelValueBytes = 1024;

// A job spec's paths (PATH_MAX: no longer one opens) and its model's
// config.json (Hugging Face's are a few KiB, tens with a label map): every
// job's spec is listed with it, and a ListJobs reply must fit in 4 MiB.
inline constexpr size_t kMaxPathBytes = 4096;
inline constexpr size_t kMaxConfigJsonBytes = size_t{1} << 20;

// The kept checkpoints a step reports (the newest; StepProgress.checkpoints),
// at most this many and this many bytes of their paths: each job keeps its
// newest step's list, which every full read of the job carries. The
// worker trims its report to them; the coordinator refuses one past them.
inline constexpr size_t kMaxReportedCheckpoints = 1000;
inline constexpr size_t kMaxReportedCheckpointPathBytes = size_t{512} << 10;

// Each text a worker registers with the coordinator (WorkerInfo: address,
// metrics address, host, device name, version, peak source), in bytes.
inline constexpr size_t kMaxWorkerText = 512;

}  // namespace colod

#endif  // COLOD_COMMON_LIMITS_H_
