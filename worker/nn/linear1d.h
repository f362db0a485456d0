// 1D (Megatron) tensor-parallel linear layers over the "tp" axis of a
// ProcessGroup, holding ColoParameters and mapping ColoTensors to
// ColoTensors (DESIGN.md section 3):
//
//   Linear1DCol  weight [out/p, in] = tp: S(0), bias [out/p] = tp: S(0).
//                Input replicated over tp; forward is local, backward
//                all-reduces the input gradient. Output tp: S(-1), or
//                replicated with gather_output (an all-gather, sliced back in
//                backward). With `fused` = n (a fused QKV projection, n = 3),
//                the weight is held as [n, out/n, in] sharded on dim 1, so
//                each rank holds its part of q, of k and of v; the output is
//                [..., n, out/n] sharded on the last dim, and gathered it is
//                [..., out] in q|k|v order.
//   Linear1DRow  weight [out, in/p] = tp: S(1), bias [out] replicated and
//                added after the reduce. Input tp: S(-1) (parallel_input) or
//                replicated and sliced here; the partial output is
//                all-reduced in forward, identity in backward.
//
// A Col -> Row MLP thus runs one all-reduce forward and one backward.
//
// Sequence parallelism (sequence_parallel, Megatron's): outside the
// column/row pair, activations are split along the sequence dim (ndim-2)
// over tp. Col then all-gathers its input along it forward, keeping only
// the shard, gathers it again in the backward for the weight's gradient
// (behind the input gradient's GEMM) and reduce-scatters the input gradient
// (nn::GatheredLinear); Row reduce-scatters its (never kept)
// partial output along it forward (out tp: S(ndim-2)) and all-gathers the
// gradient backward; Row's bias gradient is all-reduced over tp.
// Placements on other axes (a batch sharded over dp) pass through.
//
// Thread-safety: a layer is used by one rank thread at a time.
#ifndef COLOD_WORKER_NN_LINEAR1D_H_
#define COLOD_WORKER_NN_LINEAR1D_H_

#include <optional>

#include "absl/status/statusor.h"
#include "worker/colo/colo_tensor.h"
#include "worker/nn/functional.h"

namespace colod::nn {

// The specs a layer holds its weight and bias under (for reading shards
// straight from a checkpoint; nn::*::FromParameters checks them).
struct ParamSpecs {
  DistSpec weight;
  DistSpec bias;
};

class Linear1DCol {
 public:
  struct Options {
    bool gather_output = false;
    int fused = 1;  // projections fused along the output dim (3 for q|k|v)
    bool sequence_parallel = false;
  };
  // This rank's shards of the full `weight` [out, in] and `bias` [out];
  // INVALID_ARGUMENT naming the dim when out is not divisible by tp.
  static absl::StatusOr<Linear1DCol> FromGlobal(const Tensor& weight, const std::optional<Tensor>& bias,
                                                ProcessGroup* pg, Options options);
  // Weight [out, in] (fused: [n, out/n, in]) tp: S(0) (fused: S(1)); bias alike.
  static absl::StatusOr<ParamSpecs> Specs(ProcessGroup* pg, const Options& options);
  // From this rank's shards (read from a checkpoint, or a tied embedding's
  // table); INVALID_ARGUMENT when a spec is not Specs()'s.
  static absl::StatusOr<Linear1DCol> FromParameters(ColoParameter weight, std::optional<ColoParameter> bias,
                                                    ProcessGroup* pg, Options options);
  // With an epilogue (GELU before a down projection), it is applied to the
  // local output with the bias, one kernel each way (nn::BiasEpilogue).
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x, Epilogue epilogue = Epilogue::kNone) const;

  const ColoParameter& weight() const { return weight_; }
  const std::optional<ColoParameter>& bias() const { return bias_; }

 private:
  Linear1DCol(ColoParameter w, std::optional<ColoParameter> b, ProcessGroup* pg, Options o)
      : weight_(std::move(w)), bias_(std::move(b)), pg_(pg), options_(o) {}
  ColoParameter weight_;
  std::optional<ColoParameter> bias_;
  ProcessGroup* pg_;
  Options options_;
};

class Linear1DRow {
 public:
  struct Options {
    bool parallel_input = true;
    bool sequence_parallel = false;
  };
  static absl::StatusOr<Linear1DRow> FromGlobal(const Tensor& weight, const std::optional<Tensor>& bias,
                                                ProcessGroup* pg, Options options);
  // Weight [out, in] tp: S(1); bias replicated.
  static absl::StatusOr<ParamSpecs> Specs(ProcessGroup* pg, const Options& options);
  static absl::StatusOr<Linear1DRow> FromParameters(ColoParameter weight, std::optional<ColoParameter> bias,
                                                    ProcessGroup* pg, Options options);
  absl::StatusOr<ColoTensor> Forward(const ColoTensor& x) const;

  const ColoParameter& weight() const { return weight_; }
  const std::optional<ColoParameter>& bias() const { return bias_; }

 private:
  Linear1DRow(ColoParameter w, std::optional<ColoParameter> b, ProcessGroup* pg, Options o)
      : weight_(std::move(w)), bias_(std::move(b)), pg_(pg), options_(o) {}
  ColoParameter weight_;
  std::optional<ColoParameter> bias_;
  ProcessGroup* pg_;
  Options options_;
};

// A GPT-2 Conv1D weight [in, out] (y = x W + b) in torch Linear's layout
// [out, in].
absl::StatusOr<Tensor> Conv1DToLinear(const Tensor& conv1d_weight);

// `spec` with its tp placement replaced by `p`.
DistSpec WithTp(const DistSpec& spec, Placement p);

}  // namespace colod::nn

#endif  // COLOD_WORKER_NN_LINEAR1D_H_
