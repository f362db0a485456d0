// The raw-pointer kernels of one kind of device as one table: kernels/cpu's
// or kernels/cuda's twins, which have the same signatures. Tensor storage and
// every Tensor-level op (tensor.cc, ops.cc) go through it, so they hold no
// per-device code: a device kind is one table.
//
// The CPU table is always there; the CUDA table exists where the build has
// CUDA (the toolkit or the emulation; cuda_kernels.cc or no_cuda_kernels.cc
// is linked in, bazel/cuda_rules.bzl's if_cuda).
//
// Thread-safe: the tables are immutable and the kernels are thread-safe.
#ifndef COLOD_WORKER_TENSOR_DEVICE_KERNELS_H_
#define COLOD_WORKER_TENSOR_DEVICE_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/types.h"
#include "worker/tensor/device.h"

namespace colod {

struct DeviceKernels {
  using ElemType = kernels::ElemType;
  using Layout = kernels::Layout;

  // Memory and copies (kernels/*/tensor_ops.h).
  absl::StatusOr<void*> (*Malloc)(int device, size_t nbytes);
  void (*Free)(int device, void* p);
  absl::Status (*Memset0)(int device, void* p, size_t nbytes);
  absl::Status (*Memcpy)(int device, void* dst, const void* src, size_t nbytes);
  absl::Status (*Upload)(int device, void* dst, const void* src, size_t nbytes);
  absl::StatusOr<uint64_t> (*StartRead)(int device, const void* src, size_t nbytes);
  absl::Status (*FinishRead)(int device, uint64_t ticket, void* dst, size_t nbytes);
  void (*DropRead)(int device, uint64_t ticket);
  absl::Status (*StridedCopy)(int device, const void* src, const Layout& src_layout, ElemType src_type, void* dst,
                              const Layout& dst_layout, ElemType dst_type);
  absl::Status (*FillRandom)(int device, void* p, ElemType type, int64_t n, uint64_t seed, bool normal);
  absl::Status (*Binary)(int device, kernels::BinaryOp op, ElemType type, const void* a, const void* b, void* out,
                         int64_t n);
  absl::Status (*Scale)(int device, ElemType type, const void* a, float s, void* out, int64_t n);
  absl::Status (*ScaleBy)(int device, ElemType type, const void* a, const float* s, ElemType out_type, void* out,
                          int64_t n);
  absl::StatusOr<double> (*Sum)(int device, ElemType type, const void* a, int64_t n);
  absl::Status (*AccumulateSum)(int device, const std::vector<kernels::BufferRef>& parts, bool square, float* acc);

  // Layer kernels (kernels/*/layer_ops.h).
  absl::Status (*Gemm)(int device, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                       const void* a, const void* b, void* c);
  absl::Status (*SetAllowTf32)(int device, bool allow);
  absl::Status (*BiasAdd)(int device, ElemType type, const void* x, const void* bias, void* out, int64_t rows,
                          int64_t n);
  absl::Status (*BiasGrad)(int device, ElemType type, const void* dy, void* db, int64_t rows, int64_t n);
  absl::Status (*Gelu)(int device, ElemType type, const void* x, const void* bias, void* y, int64_t rows, int64_t n,
                       bool tanh_approx);
  absl::Status (*GeluBackward)(int device, ElemType type, const void* dy, const void* x, const void* bias, void* dx,
                               void* db, int64_t rows, int64_t n, bool tanh_approx);
  absl::Status (*Activation)(int device, ElemType type, kernels::ActivationKind kind, const void* x, void* y,
                             int64_t n);
  absl::Status (*ActivationBackward)(int device, ElemType type, kernels::ActivationKind kind, const void* dy,
                                     const void* x, void* dx, int64_t n);
  absl::Status (*LayerNorm)(int device, ElemType type, const void* x, const void* residual, const void* g,
                            const void* b, float eps, void* y, void* sum, float* mean, float* rstd, int64_t rows,
                            int64_t n);
  absl::Status (*LayerNormBackward)(int device, ElemType type, const void* dy, const void* x, const void* g,
                                    const float* mean, const float* rstd, const void* acc, void* dx, void* dg,
                                    void* db, int64_t rows, int64_t n);
  absl::Status (*RmsNorm)(int device, ElemType type, const void* x, const void* residual, const void* g, float eps,
                          void* y, void* sum, float* rstd, int64_t rows, int64_t n);
  absl::Status (*RmsNormBackward)(int device, ElemType type, const void* dy, const void* x, const void* g,
                                  const float* rstd, const void* acc, void* dx, void* dg, int64_t rows, int64_t n);
  absl::Status (*NormRowSums)(int device, ElemType type, const void* x, const float* center, bool square,
                              int64_t rows, int64_t n, float* sums);
  absl::Status (*NormApply)(int device, ElemType type, const void* x, const void* g, const void* b, const float* mean,
                            const float* sq_sums, int64_t h, float eps, int64_t rows, int64_t n, void* y,
                            float* rstd);
  absl::Status (*NormBackwardSums)(int device, ElemType type, const void* dy, const void* x, const void* g,
                                   const float* mean, const float* rstd, int64_t rows, int64_t n, float* sums);
  absl::Status (*NormBackwardApply)(int device, ElemType type, const void* dy, const void* x, const void* g,
                                    const float* mean, const float* rstd, const float* sums, int64_t h, int64_t rows,
                                    int64_t n, void* dx);
  absl::Status (*NormParamGrad)(int device, ElemType type, const void* dy, const void* x, const float* mean,
                                const float* rstd, int64_t rows, int64_t n, float* dg, float* db);
  absl::Status (*Softmax)(int device, const float* x, float* y, int64_t rows, int64_t k, int64_t causal_q);
  absl::Status (*SoftmaxBackward)(int device, const float* dy, const float* y, float* dx, int64_t rows, int64_t k);
  absl::Status (*Dropout)(int device, const float* x, float* y, int64_t n, float p, uint64_t seed, uint64_t offset);
  absl::Status (*Embedding)(int device, ElemType type, const void* table, const int64_t* ids, void* out, int64_t count,
                            int64_t rows, int64_t h, int64_t row_offset);
  absl::Status (*EmbeddingBackward)(int device, ElemType type, const void* dy, const std::vector<int64_t>& seg_rows,
                                    const std::vector<int64_t>& seg_starts, const std::vector<int64_t>& tokens,
                                    void* dtable, int64_t rows, int64_t h);
  absl::Status (*CrossEntropy)(int device, const float* logits, const int64_t* labels, float* loss, int64_t n,
                               int64_t v, float smoothing, int64_t ignore_index);
  absl::Status (*CrossEntropyBackward)(int device, const float* dloss, const float* logits, const int64_t* labels,
                                       float* dlogits, int64_t n, int64_t v, float smoothing, int64_t ignore_index);
  absl::Status (*VocabShardStats)(int device, ElemType type, const void* z, const int64_t* labels, int64_t rows,
                                  int64_t width, int64_t real, int64_t start, int64_t ignore_index, float* mine);
  absl::Status (*VocabShardCombine)(int device, const float* gathered, int64_t shards, int64_t rows, float* mx,
                                    float* stats);
  absl::Status (*VocabShardLoss)(int device, const float* mx, const float* stats, const int64_t* labels, int64_t rows,
                                 int64_t vocab, float smoothing, int64_t ignore_index, float* lse, float* loss);
  absl::Status (*VocabShardBackward)(int device, ElemType type, const void* z, const int64_t* labels, const float* lse,
                                     const float* dloss, int64_t rows, int64_t width, int64_t real, int64_t start,
                                     int64_t vocab, float smoothing, int64_t ignore_index, ElemType dz_type,
                                     void* dz);
  absl::Status (*Rope)(int device, const float* x, float* y, int64_t b, int64_t s, int64_t heads, int64_t d,
                       float theta, int64_t position_offset, float sign);
  absl::Status (*FlashAttention)(int device, ElemType type, const void* q, const void* k, const void* v, void* out,
                                 float* lse, int64_t b, int64_t s, int64_t hq, int64_t hkv, int64_t d, float scale,
                                 bool causal, kernels::AttentionBias extra, kernels::AttentionLayout layout);
  absl::Status (*FlashAttentionBackward)(int device, ElemType type, const void* q, const void* k, const void* v,
                                         const void* out, const void* dout, const float* lse, float* delta, void* dq,
                                         void* dk, void* dv, int64_t b, int64_t s, int64_t hq, int64_t hkv,
                                         int64_t d, float scale, bool causal, kernels::AttentionBias extra,
                                         kernels::AttentionLayout layout);
  absl::Status (*AdamW)(int device, const std::vector<kernels::AdamWTensor>& tensors, const kernels::AdamWHyper& h);
  absl::Status (*GradNormClip)(int device, const float* squares, int64_t n, double max_norm, double loss_scale,
                               float* out);
  absl::Status (*GemmF32Out)(int device, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                             const void* a, const void* b, float* c, bool accumulate);
  absl::Status (*GemmBias)(int device, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                           const void* a, const void* b, const void* bias, void* c);
  absl::Status (*GemmBiasGrad)(int device, ElemType type, int64_t m, int64_t n, int64_t k, const void* dy,
                               const void* x, void* dw, void* db);
  absl::Status (*GemmBiasGelu)(int device, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n,
                               int64_t k, const void* a, const void* b, const void* bias, void* c, void* pre);
  absl::Status (*GemmDGelu)(int device, ElemType type, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k,
                            const void* a, const void* b, const void* pre, void* c);
  bool (*GemmEpilogues)(int device);
};

// The table of a kernels/ namespace; a twin whose signature drifts is a
// compile error here.
#define COLOD_DEVICE_KERNELS(ns)                                                                      \
  ::colod::DeviceKernels {                                                                            \
    &ns::Malloc, &ns::Free, &ns::Memset0, &ns::Memcpy, &ns::Upload, &ns::StartRead, &ns::FinishRead,   \
        &ns::DropRead, &ns::StridedCopy, &ns::FillRandom, &ns::Binary,                                \
        &ns::Scale, &ns::ScaleBy, &ns::Sum, &ns::AccumulateSum, &ns::Gemm, &ns::SetAllowTf32, &ns::BiasAdd, &ns::BiasGrad, \
        &ns::Gelu, &ns::GeluBackward, &ns::Activation, &ns::ActivationBackward, &ns::LayerNorm, &ns::LayerNormBackward, \
        &ns::RmsNorm, &ns::RmsNormBackward, &ns::NormRowSums, &ns::NormApply, &ns::NormBackwardSums,   \
        &ns::NormBackwardApply, &ns::NormParamGrad, &ns::Softmax, &ns::SoftmaxBackward, &ns::Dropout,   \
        &ns::Embedding, &ns::EmbeddingBackward, &ns::CrossEntropy, &ns::CrossEntropyBackward,           \
        &ns::VocabShardStats, &ns::VocabShardCombine, &ns::VocabShardLoss,                            \
        &ns::VocabShardBackward,                                                                      \
        &ns::Rope, &ns::FlashAttention, &ns::FlashAttentionBackward, &ns::AdamW, &ns::GradNormClip,    \
        &ns::GemmF32Out, &ns::GemmBias, &ns::GemmBiasGrad, &ns::GemmBiasGelu, &ns::GemmDGelu,          \
        &ns::GemmEpilogues                                                                            \
  }

const DeviceKernels& CpuKernels();
// nullptr where the binary was built without CUDA.
const DeviceKernels* CudaKernels();

// The table for `device`'s kind: FAILED_PRECONDITION naming the device where
// the binary was built without CUDA.
absl::StatusOr<const DeviceKernels*> KernelsFor(Device device);

}  // namespace colod

#endif  // COLOD_WORKER_TENSOR_DEVICE_KERNELS_H_
