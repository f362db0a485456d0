#include "kernels/cuda/stream.h"

#include <map>
#include <mutex>

#include "kernels/cuda/status.h"

namespace colod::kernels::cuda {
namespace {

struct Streams {
  std::mutex mu;
  std::map<int, cudaStream_t> by_device;  // never destroyed (see stream.h)
};

Streams& AllStreams() {
  static Streams* s = new Streams();  // outlives every static that frees memory
  return *s;
}

// The last device this thread asked for, so a launch takes no lock.
thread_local int cached_device = -1;
thread_local cudaStream_t cached_stream = nullptr;

}  // namespace

absl::StatusOr<cudaStream_t> ComputeStream(int device) {
  COLOD_RETURN_IF_CUDA(cudaSetDevice(device));
  if (device == cached_device) return cached_stream;
  Streams& all = AllStreams();
  std::lock_guard<std::mutex> lock(all.mu);  // one non-blocking CUDA call, once per device
  auto it = all.by_device.find(device);
  if (it == all.by_device.end()) {
    cudaStream_t s = nullptr;
    COLOD_RETURN_IF_CUDA(cudaStreamCreateWithFlags(&s, cudaStreamDefault));
    it = all.by_device.emplace(device, s).first;
  }
  cached_device = device;
  cached_stream = it->second;
  return it->second;
}

absl::Status Synchronize(int device) {
  absl::StatusOr<cudaStream_t> s = ComputeStream(device);
  if (!s.ok()) return s.status();
  return CudaStatus(cudaStreamSynchronize(*s), "cudaStreamSynchronize");
}

}  // namespace colod::kernels::cuda
