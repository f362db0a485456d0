// 3D tensor parallelism (the reference document's algorithm) on the
// tp_output x tp_input x tp_weight sub-axes of a q x q x q mesh (local rank
// weight + q*input + q*q*output; worker/colo/mesh.h).
//
// Layout chosen here. Each layer has three roles, R, K and C, taken by the
// three axes:
//   R = tp_output always; K and C are tp_input and tp_weight, swapped from
//   one layer to the next (Linear3D::Options::swap), as ColossalAI swaps its
//   input and output groups between consecutive layers.
//   input X [rows, in] or [batch, seq, in]: dim 0 split q*q ways, R outer
//                            and K inner (whole sequences stay on a rank);
//                            in split over C       ([16,256] -> [4,128])
//   weight A [in, out]       in split over C; out split q*q ways, K outer
//                            and R inner. Held as the view [in, q, out/q]
//                            with {C: S(0), K: S(1), R: S(2)}; its local
//                            block is [in/q, out/q^2] ([256,1024] -> [128,256])
//   output Y [.., rows, out] rows split R outer, C inner; out split over K,
//                            i.e. the next layer's input with K and C swapped
//                            ([4,512], then [4,128] after a swapped layer)
//   bias [out]               held as [q, out/q] split over K, replicated
//                            over R and C
// Forward: all-gather X over K (rows) -> X_RC, all-gather A over R (columns)
// -> A_CK, Y_RK partial = X_RC A_CK, reduce-scatter over C (rows). Backward:
// all-gather dY over C, dX = dY A^T reduce-scattered over K, dA = X^T dY
// reduce-scattered over R. Shards of one dim nest in mesh order
// (worker/colo/redistribute.h), which is why R, the outer row split of every
// activation, must be tp_output, the outermost 3D axis.
//
// Thread-safety: a layer is used by one rank thread at a time.
#ifndef COLOD_WORKER_NN_LINEAR3D_H_
#define COLOD_WORKER_NN_LINEAR3D_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"
#include "worker/nn/functional.h"

namespace colod::nn {

// The 3D activation spec of a tensor of rank `ndim`: dim 0 split
// (tp_output, k_axis), the last dim over c_axis.
DistSpec Activation3D(int64_t ndim, int q, const std::string& k_axis, const std::string& c_axis);

class Linear3D {
 public:
  struct Options {
    bool swap = false;  // K = tp_weight and C = tp_input (every second layer)
  };
  // `weight` is the full [in, out]; `bias` [out].
  static absl::StatusOr<Linear3D> FromGlobal(const Tensor& weight, const std::optional<Tensor>& bias,
                                             ProcessGroup* pg, Options options);
  // x in this layer's input spec; y in its output spec.
  // With an epilogue (GELU before a down projection), it is applied to the
  // local output with the bias, one kernel each way (nn::BiasEpilogue).
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x, Epilogue epilogue = Epilogue::kNone) const;
  DistSpec InputSpec(int64_t ndim) const { return Activation3D(ndim, q_, k_, c_); }
  DistSpec OutputSpec(int64_t ndim) const { return Activation3D(ndim, q_, c_, k_); }
  const ColoParameter& weight() const { return weight_; }  // global view [in, q, out/q]
  const std::optional<ColoParameter>& bias() const { return bias_; }

 private:
  Linear3D(ColoParameter w, std::optional<ColoParameter> b, ProcessGroup* pg, int q, std::string k, std::string c)
      : weight_(std::move(w)), bias_(std::move(b)), pg_(pg), q_(q), k_(std::move(k)), c_(std::move(c)) {}
  ColoParameter weight_;
  std::optional<ColoParameter> bias_;
  ProcessGroup* pg_;
  int q_;
  std::string k_, c_;
};

// LayerNorm over activations in the spec Activation3D(.., k_axis, c_axis):
// statistics all-reduced over c_axis (the hidden split), gamma and beta
// [hidden] split over c_axis and replicated over tp_output and k_axis.
class LayerNorm3D {
 public:
  static absl::StatusOr<LayerNorm3D> FromGlobal(const Tensor& gamma, const Tensor& beta, float eps, ProcessGroup* pg,
                                                const std::string& k_axis, const std::string& c_axis);
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) const;
  const ColoParameter& gamma() const { return gamma_; }
  const ColoParameter& beta() const { return beta_; }

 private:
  LayerNorm3D(ColoParameter g, ColoParameter b, float eps, ProcessGroup* pg, int q, std::string k, std::string c)
      : gamma_(std::move(g)), beta_(std::move(b)), eps_(eps), pg_(pg), q_(q), k_(std::move(k)), c_(std::move(c)) {}
  ColoParameter gamma_, beta_;
  float eps_;
  ProcessGroup* pg_;
  int q_;
  std::string k_, c_;
};

}  // namespace colod::nn

#endif  // COLOD_WORKER_NN_LINEAR3D_H_
