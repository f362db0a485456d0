// Where a tensor's bytes live: host memory or one CUDA device.
#ifndef COLOD_WORKER_TENSOR_DEVICE_H_
#define COLOD_WORKER_TENSOR_DEVICE_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace colod {

// A value type; thread-safe.
struct Device {
  enum class Kind { kCpu, kCuda };
  Kind kind = Kind::kCpu;
  int index = 0;  // the CUDA ordinal; 0 for the CPU

  static Device Cpu() { return Device(); }
  static Device Cuda(int index = 0) { return Device{Kind::kCuda, index}; }
  bool is_cuda() const { return kind == Kind::kCuda; }
  bool operator==(const Device& o) const { return kind == o.kind && index == o.index; }
  bool operator!=(const Device& o) const { return !(*this == o); }
  std::string ToString() const;  // "cpu", "cuda:0"
};

// "cpu", "cuda" (ordinal 0) or "cuda:N"; INVALID_ARGUMENT otherwise.
absl::StatusOr<Device> ParseDevice(absl::string_view text);

}  // namespace colod

#endif  // COLOD_WORKER_TENSOR_DEVICE_H_
