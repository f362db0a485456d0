// 3D tensor parallelism (the reference document's algorithm) on the
// tp_output x tp_input x tp_weight sub-axes of a q x q x q mesh (local rank
// weight + q*input + q*q*output; spec/mesh.h).
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
//                            and R inner. Held in nn.Linear's layout A^T
//                            [out, in] as the view [q, out/q, in] with
//                            {K: S(0), R: S(1), C: S(2)} (as a fused 1D
//                            projection is held: a checkpoint's matrix, its
//                            leading dims flattened); its local block is
//                            [1, out/q^2, in/q], the document's
//                            [in/q, out/q^2] block transposed
//                            ([256,1024] -> [128,256])
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
// activation, must be tp_output, the outermost 3D axis, and why the weight
// needs its own dim for K.
//
// A model's residual stream is in the spec of a Linear3D's input (K =
// tp_input, C = tp_weight): the norms and the embedding default to it, the
// first linear of a pair takes it and the second (swap) gives it back.
//
// Thread-safety: a layer is used by one rank thread at a time.
#ifndef COLOD_WORKER_NN_LINEAR3D_H_
#define COLOD_WORKER_NN_LINEAR3D_H_

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"
#include "worker/nn/functional.h"
#include "worker/nn/linear1d.h"
#include "worker/nn/norm.h"

namespace colod::nn {

// The residual stream's axes (a Linear3D's input without swap).
inline constexpr char kStreamK[] = "tp_input";
inline constexpr char kStreamC[] = "tp_weight";

// The 3D activation spec of a tensor of rank `ndim`: dim 0 split
// (tp_output, k_axis), the last dim over c_axis.
DistSpec Activation3D(int64_t ndim, int q, const std::string& k_axis, const std::string& c_axis);
// This rank's q; FAILED_PRECONDITION without the three 3D axes.
absl::StatusOr<int> Get3DSize(ProcessGroup* pg);
// Activation3D on the residual stream's axes.
absl::StatusOr<DistSpec> StreamSpec3D(int64_t ndim, ProcessGroup* pg);
// `x` in the 3D spec `want` (as is when its 3D axes already are).
absl::StatusOr<ColoTensor> ToSpec3D(const ColoTensor& x, const DistSpec& want);

class Linear3D {
 public:
  struct Options {
    bool swap = false;  // K = tp_weight and C = tp_input (every second layer)
  };
  // `weight` is the full [in, out]; `bias` [out].
  static absl::StatusOr<Linear3D> FromGlobal(const Tensor& weight, const std::optional<Tensor>& bias,
                                             ProcessGroup* pg, Options options);
  // The weight's spec, on the view [q, out/q, in], and the bias's, on [q, out/q].
  static absl::StatusOr<ParamSpecs> Specs(ProcessGroup* pg, Options options);
  // From parameters of those shapes in Specs(); INVALID_ARGUMENT otherwise.
  static absl::StatusOr<Linear3D> FromParameters(ColoParameter weight, std::optional<ColoParameter> bias,
                                                 ProcessGroup* pg, Options options);
  // x in this layer's input spec; y in its output spec.
  // With an epilogue (GELU before a down projection), it is applied to the
  // local output with the bias, one kernel each way (nn::BiasEpilogue).
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x, Epilogue epilogue = Epilogue::kNone) const;
  DistSpec InputSpec(int64_t ndim) const { return Activation3D(ndim, q_, k_, c_); }
  DistSpec OutputSpec(int64_t ndim) const { return Activation3D(ndim, q_, c_, k_); }
  const ColoParameter& weight() const { return weight_; }  // global view [q, out/q, in] of A^T
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

// LayerNorm or RMSNorm over activations in the spec Activation3D(..,
// k_axis, c_axis): statistics all-reduced over c_axis (the hidden split),
// gamma and beta [hidden] split over c_axis and replicated over tp_output
// and k_axis (their gradients summed over both).
class Norm3D {
 public:
  using Kind = NormKind;
  struct Options {
    Kind kind = Kind::kLayerNorm;
    float eps = 1e-5f;
    std::string k_axis = kStreamK, c_axis = kStreamC;
  };
  // `beta` is required for LayerNorm and must be absent for RMSNorm.
  static absl::StatusOr<Norm3D> FromGlobal(const Tensor& gamma, const std::optional<Tensor>& beta, ProcessGroup* pg,
                                           Options options);
  // gamma and beta [hidden] {c_axis: S(0)}.
  static absl::StatusOr<DistSpec> Spec(ProcessGroup* pg, const Options& options);
  static absl::StatusOr<Norm3D> FromParameters(ColoParameter gamma, std::optional<ColoParameter> beta,
                                               ProcessGroup* pg, Options options);
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) const;
  const ColoParameter& gamma() const { return gamma_; }
  const std::optional<ColoParameter>& beta() const { return beta_; }

 private:
  Norm3D(ColoParameter g, std::optional<ColoParameter> b, ProcessGroup* pg, int q, Options o)
      : gamma_(std::move(g)), beta_(std::move(b)), pg_(pg), q_(q), options_(std::move(o)) {}
  ColoParameter gamma_;
  std::optional<ColoParameter> beta_;
  ProcessGroup* pg_;
  int q_;
  Options options_;
};

}  // namespace colod::nn

#endif  // COLOD_WORKER_NN_LINEAR3D_H_
