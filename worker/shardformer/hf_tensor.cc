#include "worker/shardformer/hf_tensor.h"

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/int_math.h"
#include "common/status_macros.h"

namespace colod::shardformer {
namespace {

// Row-major strides of dims [0, end) of `shape` counted in units of dim `end`.
std::vector<int64_t> Strides(const Shape& shape, int64_t end) {
  std::vector<int64_t> s(end + 1, 1);
  for (int64_t d = end - 1; d >= 0; --d) s[d] = s[d + 1] * shape[d + 1];
  return s;
}

}  // namespace

absl::StatusOr<HfReader> FileReader(const ModelFiles& files, const HfTensor& hf) {
  if (!files.Has(hf.name)) {
    return absl::InvalidArgumentError(absl::StrCat("the checkpoint has no tensor ", hf.name));
  }
  ASSIGN_OR_RETURN(TensorInfo info, files.Info(hf.name));
  if (info.shape != hf.shape) {
    return absl::InvalidArgumentError(absl::StrCat("tensor ", hf.name, " has shape ", ShapeToString(info.shape),
                                                   " but config.json implies ", ShapeToString(hf.shape)));
  }
  const ModelFiles* f = &files;
  const std::string name = hf.name;
  return HfReader([f, name](const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths) {
    return f->ReadSlice(name, starts, lengths);
  });
}

HfReader MemoryReader(const Tensor& t) {
  return [t](const std::vector<int64_t>& starts, const std::vector<int64_t>& lengths) -> absl::StatusOr<Tensor> {
    Tensor v = t;
    for (size_t d = 0; d < starts.size(); ++d) {
      ASSIGN_OR_RETURN(v, v.Narrow(static_cast<int64_t>(d), starts[d], lengths[d]));
    }
    return v.TryContiguous();
  };
}

absl::StatusOr<Tensor> ReadLayerBlock(const HfTensor& hf, const Shape& layer_shape, const std::vector<int64_t>& starts,
                                      const std::vector<int64_t>& lengths, const HfReader& read) {
  const int64_t nd = static_cast<int64_t>(layer_shape.size());
  if (hf.shape.size() > 2) {
    // A tensor of more dims (a Conv2d weight, ViT's cls_token) is held as stored.
    if (layer_shape != hf.shape || hf.transpose || hf.narrow_dim >= 0 || hf.valid_rows >= 0 ||
        starts.size() != hf.shape.size() || lengths.size() != hf.shape.size()) {
      return absl::InvalidArgumentError(absl::StrCat("cannot map a ", ShapeToString(layer_shape),
                                                     " layer tensor onto ", hf.name, " ", ShapeToString(hf.shape)));
    }
    ASSIGN_OR_RETURN(Tensor t, read(starts, lengths));
    return t.dtype() == DType::kF32 ? t : t.ToDType(DType::kF32);
  }
  const bool matrix = hf.shape.size() == 2;
  if ((!matrix && hf.shape.size() != 1) || nd < (matrix ? 2 : 1) ||
      static_cast<int64_t>(starts.size()) != nd || static_cast<int64_t>(lengths.size()) != nd) {
    return absl::InvalidArgumentError(absl::StrCat("cannot map a ", ShapeToString(layer_shape), " layer tensor onto ",
                                                   hf.name, " ", ShapeToString(hf.shape)));
  }
  if (hf.transpose && !matrix) return absl::InvalidArgumentError(absl::StrCat(hf.name, ": only matrices transpose"));
  auto hf_read = [&](std::vector<int64_t> s, std::vector<int64_t> l) -> absl::StatusOr<Tensor> {
    if (hf.narrow_dim >= 0) s[hf.narrow_dim] += hf.narrow_start;
    ASSIGN_OR_RETURN(Tensor t, read(s, l));
    return t.dtype() == DType::kF32 ? t : t.ToDType(DType::kF32);
  };
  ASSIGN_OR_RETURN(Tensor out, Tensor::Zeros(Shape(lengths.begin(), lengths.end()), DType::kF32));
  // Runs: along the last two dims (a [rows, cols] block of the flattened
  // matrix) or the last dim (a range of the flat vector), one per index of
  // the dims before them.
  const int64_t run_dim = matrix ? nd - 2 : nd - 1;
  const std::vector<int64_t> stride = Strides(layer_shape, run_dim);
  std::vector<int64_t> idx(run_dim, 0);
  while (true) {
    int64_t f0 = starts[run_dim];
    Tensor dest = out;
    for (int64_t d = 0; d < run_dim; ++d) {
      f0 += (starts[d] + idx[d]) * stride[d];
      ASSIGN_OR_RETURN(dest, dest.Narrow(d, idx[d], 1));
    }
    const int64_t len = lengths[run_dim];
    Tensor piece;
    bool padding = false;  // the whole run is padding rows: stays zero
    if (!matrix) {
      const int64_t valid = hf.valid_rows < 0 ? f0 + len : std::min(f0 + len, hf.valid_rows);
      padding = valid <= f0;
      if (!padding) {
        ASSIGN_OR_RETURN(piece, hf_read({f0}, {valid - f0}));
        ASSIGN_OR_RETURN(dest, dest.Narrow(run_dim, 0, valid - f0));
      }
    } else if (hf.transpose) {
      ASSIGN_OR_RETURN(Tensor t, hf_read({starts[nd - 1], f0}, {lengths[nd - 1], len}));
      ASSIGN_OR_RETURN(t, t.Transpose(0, 1));
      ASSIGN_OR_RETURN(piece, t.TryContiguous());
    } else {
      const int64_t valid = hf.valid_rows < 0 ? f0 + len : std::min(f0 + len, hf.valid_rows);
      padding = valid <= f0;
      if (!padding) {
        ASSIGN_OR_RETURN(piece, hf_read({f0, starts[nd - 1]}, {valid - f0, lengths[nd - 1]}));
        ASSIGN_OR_RETURN(dest, dest.Narrow(run_dim, 0, valid - f0));
      }
    }
    if (!padding) {
      ASSIGN_OR_RETURN(piece, piece.Reshape(dest.shape()));
      RETURN_IF_ERROR(dest.CopyFrom(piece));
    }
    int64_t d = run_dim - 1;
    while (d >= 0 && ++idx[d] == lengths[d]) idx[d--] = 0;
    if (d < 0) break;
  }
  return out;
}

absl::StatusOr<ColoParameter> LoadParameter(const HfTensor& hf, const Shape& layer_shape, const DistSpec& spec,
                                            ProcessGroup* pg, const HfReader& read, const std::string& name,
                                            ComputeSpec compute, DType dtype, Device device) {
  auto block = LocalBlock(spec, layer_shape, pg);
  if (!block.ok()) return absl::InvalidArgumentError(absl::StrCat(hf.name, ": ", block.status().message()));
  ASSIGN_OR_RETURN(Tensor local, ReadLayerBlock(hf, layer_shape, block->starts, block->lengths, read));
  if (dtype != DType::kF32) {
    ASSIGN_OR_RETURN(local, local.ToDType(dtype));
  }
  if (device != Device::Cpu()) {
    ASSIGN_OR_RETURN(local, local.To(device));
  }
  ASSIGN_OR_RETURN(ColoTensor t, ColoTensor::FromLocal(Variable(local, /*requires_grad=*/true), spec, pg));
  t.set_compute_spec(compute);
  return ColoParameter(std::move(t), name);
}

absl::StatusOr<Tensor> LayerToHf(const HfTensor& hf, const Tensor& layer_global) {
  ASSIGN_OR_RETURN(Tensor t, layer_global.TryContiguous());
  if (hf.shape.size() > 2) return t;  // held as stored (ReadLayerBlock)
  if (hf.shape.size() == 1) {
    ASSIGN_OR_RETURN(t, t.Reshape({t.numel()}));
    if (hf.valid_rows >= 0) {
      ASSIGN_OR_RETURN(t, t.Narrow(0, 0, hf.valid_rows));
    }
    return t.TryContiguous();
  }
  if (t.shape().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(hf.name, ": a scalar cannot be the [rows, columns] tensor ",
                                                   ShapeToString(hf.shape)));
  }
  // Rows from the leading dims, not numel / last: a dim may be 0.
  const int64_t last = t.shape().back();
  const int64_t rows = *CheckedProduct(absl::MakeConstSpan(t.shape()).first(t.shape().size() - 1));
  ASSIGN_OR_RETURN(t, t.Reshape({rows, last}));
  if (hf.valid_rows >= 0) {
    ASSIGN_OR_RETURN(t, t.Narrow(0, 0, hf.valid_rows));
  }
  if (hf.transpose) {
    ASSIGN_OR_RETURN(t, t.Transpose(0, 1));
  }
  return t.TryContiguous();
}

absl::Status PlaceInHf(const HfTensor& hf, const Tensor& slice, Tensor& full) {
  Tensor dest = full;
  if (hf.narrow_dim >= static_cast<int64_t>(slice.shape().size())) {
    return absl::InvalidArgumentError(absl::StrCat(hf.name, ": a ", ShapeToString(slice.shape()),
                                                   " slice has no dim ", hf.narrow_dim, " to narrow"));
  }
  if (hf.narrow_dim >= 0) {
    ASSIGN_OR_RETURN(dest, full.Narrow(hf.narrow_dim, hf.narrow_start, slice.shape()[hf.narrow_dim]));
  }
  if (dest.shape() != slice.shape()) {
    return absl::InvalidArgumentError(absl::StrCat(hf.name, ": a ", ShapeToString(slice.shape()),
                                                   " slice does not fit ", ShapeToString(dest.shape())));
  }
  return dest.CopyFrom(slice);
}

}  // namespace colod::shardformer
