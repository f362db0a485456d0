// ImageDataset: what it accepts, what it refuses (naming the file and the
// image), and the batches it cuts; BatchSampler::ForExamples's indices.
#include "worker/train/image_data.h"

#include <cmath>
#include <limits>
#include <set>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "common/host_memory.h"
#include "gtest/gtest.h"
#include "tests/testing/sparse_npy.h"
#include "tests/testing/temp_dir.h"
#include "worker/tensor/npy.h"
#include "worker/train/data.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;

std::string Npy(const std::string& name, const Tensor& t) {
  const std::string path = TempPath(name);
  EXPECT_TRUE(WriteNpy(path, t).ok());
  return path;
}

TEST(ImageDataset, BatchesAreTheImagesAndLabelsAtTheIndices) {
  std::vector<float> v(5 * 2 * 4 * 4);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i);
  const std::string images = Npy("images.npy", *Tensor::FromFloats({5, 2, 4, 4}, v));
  const std::string labels = Npy("labels.npy", *Tensor::FromInt64s({5}, {3, -100, 0, 2, 1}));
  auto d = ImageDataset::Open(images, labels, 2, 4, 4);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->size(), 5);
  Tensor x, y;
  ASSERT_TRUE((*d)->Batch({4, 1, 4}, &x, &y).ok());
  ASSERT_EQ(x.shape(), (Shape{3, 2, 4, 4}));
  EXPECT_EQ(y.ToInt64s(), (std::vector<int64_t>{1, -100, 1}));
  const std::vector<float> got = x.ToFloats();
  for (int64_t r = 0; r < 3; ++r) {
    const int64_t image = std::vector<int64_t>{4, 1, 4}[r];
    for (int64_t j = 0; j < 32; ++j) ASSERT_EQ(got[r * 32 + j], static_cast<float>(image * 32 + j));
  }
  EXPECT_EQ((*d)->Batch({5}, &x, &y).code(), absl::StatusCode::kOutOfRange);
}

TEST(ImageDataset, RefusesWhatTheModelCannotRead) {
  const std::string images = Npy("images2.npy", *Tensor::Zeros({3, 2, 4, 4}, DType::kF32));
  // Pixels that are not finite (an f16 file's overflow, a broken
  // normalization): the data's fault, said as such.
  std::vector<float> pixels(3 * 32, 0.5f);
  pixels[2 * 32 + 5] = std::nanf("");
  const Tensor nan = *Tensor::FromFloats({3, 2, 4, 4}, pixels);
  pixels[2 * 32 + 5] = 0.5f;
  pixels[0] = std::numeric_limits<float>::infinity();
  const Tensor inf = *(*Tensor::FromFloats({3, 2, 4, 4}, pixels)).ToDType(DType::kF16);
  struct Bad {
    std::string images, labels;
    std::string says;
  };
  for (const Bad& b : std::vector<Bad>{
           {Npy("small.npy", *Tensor::Zeros({3, 2, 4, 2}, DType::kF32)),
            Npy("l3.npy", *Tensor::Zeros({3}, DType::kI64)), "the images must be floats [N, 2, 4, 4]"},
           {Npy("ints.npy", *Tensor::Zeros({3, 2, 4, 4}, DType::kI64)),
            Npy("l3b.npy", *Tensor::Zeros({3}, DType::kI64)), "the images must be floats"},
           {images, Npy("l2.npy", *Tensor::Zeros({2}, DType::kI64)), "integers [3] (one per image)"},
           {images, Npy("lf.npy", *Tensor::Zeros({3}, DType::kF32)), "integers [3]"},
           {images, Npy("lbig.npy", *Tensor::FromInt64s({3}, {0, 4, 1})),
            "label 4 of image 1 is outside the model's 4"},
           {images, Npy("lneg.npy", *Tensor::FromInt64s({3}, {0, -1, 1})), "label -1 of image 1"},
           {Npy("nan.npy", nan), Npy("l3c.npy", *Tensor::Zeros({3}, DType::kI64)), "image 2 holds nan at element 5"},
           {Npy("inf.npy", inf), Npy("l3d.npy", *Tensor::Zeros({3}, DType::kI64)), "image 0 holds inf at element 0"},
       }) {
    auto d = ImageDataset::Open(b.images, b.labels, 2, 4, 4);
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << b.says;
    EXPECT_NE(d.status().message().find(b.says), std::string::npos) << d.status();
  }
  EXPECT_EQ(ImageDataset::Open(TempPath("none.npy"), TempPath("none.npy"), 2, 4, 4).status().code(),
            absl::StatusCode::kNotFound);
}

// Images that would not fit in the memory available as f32 are refused
// from their headers, before they are read: here f16 images whose file
// ReadNpy alone could hold (4 bytes a pixel, with its tensor) but not
// their f32 copy beside the f16 tensor (6).
TEST(ImageDataset, ImagesThatWouldNotFitInMemoryAreRefusedBeforeTheyAreRead) {
  const int64_t images = static_cast<int64_t>(AvailableHostMemoryBytes() / 4.5 / (3 * 32 * 32)) + 1;
  const std::string pixels = TempPath("huge_images.npy"), labels = TempPath("huge_labels.npy");
  testing::WriteSparseNpy(pixels, "<f2", {images, 3, 32, 32}, 2);
  testing::WriteSparseNpy(labels, "<i8", {images}, 8);
  const absl::Time start = absl::Now();
  const absl::Status s = ImageDataset::Open(pixels, labels, 3, 32, 10).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), pixels + " and " + labels + " would take about")) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "read before it was refused?";
  ::unlink(pixels.c_str());
  ::unlink(labels.c_str());
}

TEST(BatchSampler, ExamplesAreDrawnFromEveryIndexAndSplitOverDp) {
  auto s = BatchSampler::ForExamples(7, 4, 2, 3);
  ASSERT_TRUE(s.ok()) << s.status();
  std::set<int64_t> seen;
  for (int64_t step = 0; step < 50; ++step) {
    const std::vector<int64_t> starts = s->Starts(step);
    ASSERT_EQ(starts.size(), 4u);
    for (int64_t i : starts) {
      ASSERT_GE(i, 0);
      ASSERT_LT(i, 7);
      seen.insert(i);
    }
  }
  EXPECT_EQ(seen.size(), 7u);  // the last image too
  EXPECT_EQ(BatchSampler::ForExamples(7, 3, 2, 3).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BatchSampler::ForExamples(0, 4, 2, 3).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace colod::train
