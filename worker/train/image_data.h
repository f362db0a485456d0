// Training data for an image classifier (ViT): images and their labels as
// two .npy files, the images float [N, channels, height, width] (f32 or
// f16: numpy's <f4, <f2; every pixel finite) and the labels integer [N] (int64, int32, uint16, uint32; -100
// leaves an image out of the loss). Both are read into memory when opened
// (the images as f32). Batches take the images BatchSampler::ForExamples
// draws.
//
// Thread-safety: immutable after Open (concurrent Batch calls are fine).
#ifndef COLOD_WORKER_TRAIN_IMAGE_DATA_H_
#define COLOD_WORKER_TRAIN_IMAGE_DATA_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/tensor/tensor.h"

namespace colod::train {

class ImageDataset {
 public:
  // What the model reads: images of `channels` x `image_size` x
  // `image_size` and labels below `num_labels`. NOT_FOUND for a missing
  // file; INVALID_ARGUMENT naming the file for an array of another shape or
  // dtype, a label count that is not the image count, or a label outside
  // [0, num_labels) other than -100 (naming the image).
  static absl::StatusOr<std::unique_ptr<ImageDataset>> Open(const std::string& images_path,
                                                            const std::string& labels_path, int64_t channels,
                                                            int64_t image_size, int64_t num_labels);

  int64_t size() const { return size_; }
  // How many of the images at `indices` have a label (not -100).
  int64_t Labelled(const std::vector<int64_t>& indices) const;
  // The images at `indices` as f32 [n, C, H, W] and their labels as int64 [n].
  absl::Status Batch(const std::vector<int64_t>& indices, Tensor* images, Tensor* labels) const;

 private:
  ImageDataset() = default;
  int64_t size_ = 0;
  Tensor images_;  // f32 [N, C, H, W]
  std::vector<int64_t> labels_;
};

}  // namespace colod::train

#endif  // COLOD_WORKER_TRAIN_IMAGE_DATA_H_
