// cuDNN's fused attention (flash attention through its backend graph API),
// an alternative to colod's own tensor-core kernels (layer_ops.cu) that
// FlashAttention and FlashAttentionBackward take where the environment asks
// for it (COLOD_ATTENTION=cudnn) and the call is one it serves. colod's
// kernels stay the path the CUDA emulation tests; this one runs on hardware
// only, and the deviceless plan below is what CI checks of it (docs/GPU.md,
// "cuDNN's attention").
//
// libcudnn.so.9 is loaded at the first use (dlopen; COLOD_CUDNN_LIBRARY
// names another file), so no binary needs cuDNN to start: where it is
// missing, too old, or cannot build a plan for a shape, the call says why
// and the caller runs its own kernels.
//
// The graphs are cuDNN's composite SDPA pattern (the one its frontend
// builds): S = Q K^T scale, a causal mask by generated indices, the softmax
// with its row statistics (lse, natural log, as the own kernels write
// them), O = P V; the backward recomputes P from the statistics. Plans are
// built once per device and shape (heuristics mode A, the first engine
// config that finalizes; an NVRTC compile of a second or so) and cached.
//
// Thread-safe: the plan cache and each device's cuDNN handle are guarded by
// mutexes; a handle's stream is set and its plan enqueued under its lock
// (cudnnBackendExecute enqueues, it does not wait).
#ifndef COLOD_KERNELS_CUDA_CUDNN_ATTENTION_H_
#define COLOD_KERNELS_CUDA_CUDNN_ATTENTION_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/types.h"

struct CUstream_st;

namespace colod::kernels::cuda {

// One attention call's shape: operands as FlashAttention's (q, k, v laid
// out as `layout`; out, dout and lse contiguous), `deterministic` the
// backward without atomics (cuDNN's dP-workspace path).
struct CudnnAttentionShape {
  ElemType type = ElemType::kBF16;
  int64_t b = 0, s = 0, hq = 0, hkv = 0, d = 0;
  bool causal = false;
  bool deterministic = false;
  AttentionLayout layout;
};

// Whether COLOD_ATTENTION=cudnn is set (read at each call).
bool CudnnAttentionRequested();

// OK when the cuDNN graphs express the call: bf16 or f16 operands, a head
// dim that is a multiple of 8 up to 128, hq a multiple of hkv, every stride
// a whole number of 16 bytes, no ALiBi or additive bias. INVALID_ARGUMENT
// naming what is not, otherwise. Needs no library.
absl::Status CudnnAttentionServes(const CudnnAttentionShape& shape, const AttentionBias& extra);

// Enqueue the forward (out and lse) or the backward (dq, dk, dv) on
// `stream` of `device`. UNAVAILABLE where cuDNN cannot be loaded, has no
// plan for the shape, or its scratch cannot be allocated (the message says
// why, and so does stderr once); the caller then runs its own kernels.
// Scratch memory (the plan's workspace, the backward's dQ accumulator and
// row sums) comes from the stream's pool and is given back in stream order.
absl::Status CudnnAttentionForward(int device, CUstream_st* stream, const CudnnAttentionShape& shape, const void* q,
                                   const void* k, const void* v, void* out, float* lse, float scale);
absl::Status CudnnAttentionBackward(int device, CUstream_st* stream, const CudnnAttentionShape& shape, const void* q,
                                    const void* k, const void* v, const void* out, const void* dout, const float* lse,
                                    void* dq, void* dk, void* dv, float scale);

// Calls cuDNN has served in this process (forward and backward together),
// for tests and benchmarks that must know which kernels ran.
int64_t CudnnAttentionCalls();

// What cuDNN made of a graph without a GPU (cuDNN's deviceless
// compilation): the graph's engines, the heuristics' configs for the device,
// and the first config's plan.
struct CudnnDevicelessPlan {
  int64_t engines = 0;  // engines cuDNN knows for the graph
  int64_t configs = 0;  // engine configs the heuristics offer for the device
  // The first config's plan finalized (a driver was present), or cuDNN
  // compiled its kernel and stopped only at loading it into a driver, which
  // a machine without a GPU has no real one of.
  bool compiled = false;
  std::string engine;  // the config cuDNN describes it as (JSON)
};

// Builds the forward (backward = false) or backward graph of `shape` for
// the device described by `device_json` (cuDNN's JSON of device
// properties: CudnnDeviceJson), runs the heuristics and finalizes the first
// config's plan. FAILED_PRECONDITION without a usable cuDNN (at least 9.8),
// INTERNAL naming the call cuDNN refused otherwise.
absl::StatusOr<CudnnDevicelessPlan> CudnnAttentionDeviceless(const std::string& device_json,
                                                             const CudnnAttentionShape& shape, bool backward);

// cuDNN's JSON of device properties for an NVIDIA H100 SXM (sm_90, 132
// SMs), the device CudnnAttentionDeviceless plans for in CI.
std::string CudnnH100DeviceJson();

}  // namespace colod::kernels::cuda

#endif  // COLOD_KERNELS_CUDA_CUDNN_ATTENTION_H_
