// 2D (SUMMA) tensor parallelism, ColossalAI's legacy layout, on the tp_col x
// tp_row sub-axes of a 2D mesh (q x q ranks; spec/mesh.h). Processor
// (i, j) has tp_col coordinate i and tp_row coordinate j, so its tp local
// rank is i*q + j. Activations X [.., rows, hidden] and weights A [in, out]
// (y = x A, ColossalAI's Linear2D layout) are split into q x q blocks, block
// (i, j) on processor (i, j):
//
//   activations  {tp_col: S(0), tp_row: S(hidden)}      ([16,256] -> [8,128] at q=2;
//                                                        [B,S,H] -> [B/q,S,H/q])
//   weight       {tp_col: S(0),    tp_row: S(1)}        ([256,1024] -> [128,512])
//   bias, gamma  {tp_row: S(0)}, replicated over tp_col
//
// Linear2D forward is SUMMA: for t = 0..q-1, X_it is broadcast along the
// row group, A_tj along the column group, and Y_ij += X_it A_tj. Backward
// runs the same q broadcasts for dX_it = sum_j dY_ij A_tj^T and dA_tj =
// sum_i X_it^T dY_ij, with the q partial products of each reduced to their
// owners by one reduce-scatter (along the row group for dX, the column group
// for dA). Norm2D all-reduces its row statistics along the row group.
// Parameters replicated over tp_col get their gradients all-reduced over it.
//
// 2.5D (Tesseract; mesh tp_dep x tp_col x tp_row = d x q x q, local rank
// row + q*col + q*q*dep): the same layers on a mesh with a tp_dep axis. The
// rows of an activation are split d ways over tp_dep and, inside each depth
// layer's slab, q ways over tp_col ({tp_dep: S(rows), tp_col: S(rows),
// tp_row: S(hidden)}: [16,256] -> [4,128] at d = q = 2); weights are
// replicated over depth, each depth layer runs SUMMA on its slab, and the
// weight gradients are all-reduced over tp_dep (the depth reduction).
//
// Thread-safety: a layer is used by one rank thread at a time.
#ifndef COLOD_WORKER_NN_LINEAR2D_H_
#define COLOD_WORKER_NN_LINEAR2D_H_

#include <optional>

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"
#include "worker/nn/linear1d.h"
#include "worker/nn/norm.h"

namespace colod::nn {

// The activation spec for a tensor of rank `ndim` ([rows, hidden] or
// [batch, seq, hidden]): dim 0 split over tp_dep (when depth > 1) and tp_col,
// so that every rank holds whole sequences (attention stays local), and the
// last dim over tp_row.
DistSpec Activation2D(int64_t ndim, int q, int depth = 1);

class Linear2D {
 public:
  // `weight` is the full [in, out]; `bias` [out]. INVALID_ARGUMENT naming
  // the dim when in or out is not divisible by q.
  static absl::StatusOr<Linear2D> FromGlobal(const Tensor& weight, const std::optional<Tensor>& bias,
                                             ProcessGroup* pg);
  // Weight [in, out] {tp_col: S(0), tp_row: S(1)}; bias [out] {tp_row: S(0)}.
  static absl::StatusOr<ParamSpecs> Specs(ProcessGroup* pg);
  // From this rank's blocks; INVALID_ARGUMENT for other shapes or specs.
  static absl::StatusOr<Linear2D> FromParameters(ColoParameter weight, std::optional<ColoParameter> bias,
                                                 ProcessGroup* pg);
  // x in the 2D activation spec; returns y in the same spec.
  // With an epilogue (GELU before a down projection), it is applied to the
  // local output with the bias, one kernel each way (nn::BiasEpilogue).
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x, Epilogue epilogue = Epilogue::kNone) const;
  const ColoParameter& weight() const { return weight_; }
  const std::optional<ColoParameter>& bias() const { return bias_; }

 private:
  Linear2D(ColoParameter w, std::optional<ColoParameter> b, ProcessGroup* pg, int q)
      : weight_(std::move(w)), bias_(std::move(b)), pg_(pg), q_(q) {}
  ColoParameter weight_;
  std::optional<ColoParameter> bias_;
  ProcessGroup* pg_;
  int q_;
};

// LayerNorm or RMSNorm (Options::kind, like Norm1D) on 2D / 2.5D
// activations: gamma (and beta, LayerNorm's) [hidden] {tp_row: S(0)},
// replicated over tp_col (and depth); the row statistics (the means, or the
// sums of squares) are all-reduced along the row group.
class Norm2D {
 public:
  using Kind = NormKind;
  struct Options {
    Kind kind = Kind::kLayerNorm;
    float eps = 1e-5f;
  };
  // `beta` is required for LayerNorm and must be absent for RMSNorm.
  static absl::StatusOr<Norm2D> FromGlobal(const Tensor& gamma, const std::optional<Tensor>& beta, ProcessGroup* pg,
                                           Options options);
  // gamma and beta [hidden] {tp_row: S(0)}.
  static absl::StatusOr<DistSpec> Spec(ProcessGroup* pg);
  // From parameters in Spec(); INVALID_ARGUMENT otherwise.
  static absl::StatusOr<Norm2D> FromParameters(ColoParameter gamma, std::optional<ColoParameter> beta,
                                               ProcessGroup* pg, Options options);
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) const;
  const ColoParameter& gamma() const { return gamma_; }
  const std::optional<ColoParameter>& beta() const { return beta_; }

 private:
  Norm2D(ColoParameter g, std::optional<ColoParameter> b, ProcessGroup* pg, Options o)
      : gamma_(std::move(g)), beta_(std::move(b)), pg_(pg), options_(o) {}
  ColoParameter gamma_;
  std::optional<ColoParameter> beta_;
  ProcessGroup* pg_;
  Options options_;
};

// The SUMMA product on this rank's blocks: x_local [.., r, k/q] and
// a_local [k/q, n/q] -> y_local [.., r, n/q], on the tape. `row` is the
// tp_row communicator (ranks (i, *)), `col` the tp_col one (ranks (*, j)).
absl::StatusOr<Variable> Summa(const Variable& x, const Variable& a, Communicator* row, Communicator* col,
                               absl::Duration timeout);

// This rank's 2D (or 2.5D) groups.
struct Groups2D {
  Communicator* row;  // ranks (i, *), local rank j
  Communicator* col;  // ranks (*, j), local rank i
  Communicator* dep;  // the depth group of 2.5D; nullptr on a 2D mesh
  int q;
  int depth;
};
// FAILED_PRECONDITION on a mesh without tp_col and tp_row axes.
absl::StatusOr<Groups2D> GetGroups2D(ProcessGroup* pg);
// `x` in the activation spec (redistributed if it is not).
absl::StatusOr<ColoTensor> ToActivation2D(const ColoTensor& x, const Groups2D& g);
// `p` for a parameter replicated over the column (and depth) groups: its
// gradient is all-reduced over them, since each of those ranks adds a term.
absl::StatusOr<Variable> SumGradOverReplicas(const Variable& p, const Groups2D& g, absl::Duration timeout);

// The 2.5D layers are the 2D ones on a mesh with a tp_dep axis.
using Linear2p5D = Linear2D;
using Norm2p5D = Norm2D;

}  // namespace colod::nn

#endif  // COLOD_WORKER_NN_LINEAR2D_H_
