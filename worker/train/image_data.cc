#include "worker/train/image_data.h"

#include "absl/strings/str_cat.h"
#include "common/int_math.h"
#include "common/status_macros.h"
#include "worker/tensor/dtype.h"
#include "worker/tensor/npy.h"
#include "worker/train/data.h"

namespace colod::train {

absl::StatusOr<std::unique_ptr<ImageDataset>> ImageDataset::Open(const std::string& images_path,
                                                                 const std::string& labels_path, int64_t channels,
                                                                 int64_t image_size, int64_t num_labels) {
  // At the peak: the images as read, then as f32 where they are not
  // (f16), with the labels' tensor and their int64 values; or ReadNpy's
  // buffers of either file.
  ASSIGN_OR_RETURN(const NpyFootprint pixels, NpyFootprintOf(images_path));
  ASSIGN_OR_RETURN(const NpyFootprint targets, NpyFootprintOf(labels_path));
  const bool f32 = !pixels.info.integer && pixels.info.tensor_element_bytes == 4;
  const std::optional<int64_t> as_f32 = f32 ? std::optional<int64_t>(0) : CheckedMul(pixels.elements, 4);
  RETURN_IF_ERROR(ArraysFitInMemory({images_path, labels_path},
                                    MaxBytes(MaxBytes(pixels.read, SumBytes(pixels.tensor, targets.read)),
                                             SumBytes(SumBytes(pixels.tensor, as_f32), targets.TensorAndInt64s()))));
  ASSIGN_OR_RETURN(Tensor images, ReadNpy(images_path));
  if (images.dim() != 4 || !IsFloat(images.dtype()) || images.shape()[1] != channels ||
      images.shape()[2] != image_size || images.shape()[3] != image_size || images.shape()[0] < 1) {
    return absl::InvalidArgumentError(absl::StrCat(images_path, ": the images must be floats [N, ", channels, ", ",
                                                   image_size, ", ", image_size, "], got ", DTypeName(images.dtype()),
                                                   " ", ShapeToString(images.shape())));
  }
  ASSIGN_OR_RETURN(Tensor labels, ReadNpy(labels_path));
  if (labels.dim() != 1 || labels.shape()[0] != images.shape()[0] ||
      !IsInteger(labels.dtype())) {
    return absl::InvalidArgumentError(absl::StrCat(labels_path, ": the labels must be integers [",
                                                   images.shape()[0], "] (one per image), got ",
                                                   DTypeName(labels.dtype()), " ", ShapeToString(labels.shape())));
  }
  std::unique_ptr<ImageDataset> d(new ImageDataset());
  d->size_ = images.shape()[0];
  ASSIGN_OR_RETURN(d->images_, images.ContiguousAs(DType::kF32));
  // A NaN or inf pixel is the data's fault: found in training it would read
  // as a run that diverged (lower the learning rate), and fail unrestarted.
  if (const int64_t at = FirstNonFinite(DType::kF32, d->images_.raw_data(), d->images_.numel()); at >= 0) {
    const int64_t per_image = d->images_.numel() / d->size_;
    return absl::InvalidArgumentError(absl::StrCat(images_path, ": image ", at / per_image, " holds ",
                                                   d->images_.data<float>()[at], " at element ", at % per_image,
                                                   "; pixels must be finite"));
  }
  ASSIGN_OR_RETURN(d->labels_, labels.ReadInt64s());
  for (size_t i = 0; i < d->labels_.size(); ++i) {
    const int64_t l = d->labels_[i];
    if (l != -100 && (l < 0 || l >= num_labels)) {
      return absl::InvalidArgumentError(absl::StrCat(labels_path, ": label ", l, " of image ", i,
                                                     " is outside the model's ", num_labels, " labels"));
    }
  }
  return d;
}

int64_t ImageDataset::Labelled(const std::vector<int64_t>& indices) const {
  int64_t n = 0;
  for (int64_t i : indices) n += i >= 0 && i < size_ && labels_[i] != -100;
  return n;
}

absl::Status ImageDataset::Batch(const std::vector<int64_t>& indices, Tensor* images, Tensor* labels) const {
  const Shape& s = images_.shape();
  ASSIGN_OR_RETURN(*images, Tensor::Empty({static_cast<int64_t>(indices.size()), s[1], s[2], s[3]}, DType::kF32));
  std::vector<int64_t> want(indices.size());
  for (size_t r = 0; r < indices.size(); ++r) {
    const int64_t i = indices[r];
    if (i < 0 || i >= size_) return absl::OutOfRangeError(absl::StrCat("image ", i, " of ", size_));
    ASSIGN_OR_RETURN(Tensor row, images->Narrow(0, static_cast<int64_t>(r), 1));
    ASSIGN_OR_RETURN(Tensor src, images_.Narrow(0, i, 1));
    RETURN_IF_ERROR(row.CopyFrom(src));
    want[r] = labels_[i];
  }
  ASSIGN_OR_RETURN(*labels, Tensor::FromInt64s({static_cast<int64_t>(indices.size())}, want));
  return absl::OkStatus();
}

}  // namespace colod::train
