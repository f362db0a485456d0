// Layer layouts against checkpoint tensors: a block read straight from the
// checkpoint equals the same block of the whole layer tensor, and the whole
// layer tensor converts back to the checkpoint tensor.
#include "worker/shardformer/hf_tensor.h"

#include "gtest/gtest.h"

namespace colod::shardformer {
namespace {

Tensor Narrowed(const Tensor& t, const std::vector<int64_t>& s, const std::vector<int64_t>& l) {
  Tensor v = t;
  for (size_t d = 0; d < s.size(); ++d) v = *v.Narrow(static_cast<int64_t>(d), s[d], l[d]);
  return v.Contiguous();
}

struct Layout {
  const char* what;
  HfTensor hf;
  Shape layer;
  std::vector<int64_t> starts, lengths;  // a block of the layer tensor
};

TEST(HfTensor, BlocksMatchTheWholeLayerTensorAndConvertBack) {
  const Tensor conv = *Tensor::RandomNormal({6, 12}, 1);  // a Conv1D [in, 3 * out]
  const Tensor table = *Tensor::RandomNormal({5, 4}, 2);  // an embedding [V, H]
  const Tensor bias = *Tensor::RandomNormal({12}, 3);
  const std::vector<std::pair<Layout, Tensor>> cases = {
      {{"fused q|k|v [3, 4, 6] from Conv1D", {"w", {6, 12}, true}, {3, 4, 6}, {0, 2, 0}, {3, 2, 6}}, conv},
      {{"transposed [12, 6]", {"w", {6, 12}, true}, {12, 6}, {4, 3}, {4, 3}}, conv},
      {{"padded table [8, 4]", {"t", {5, 4}, false, -1, 0, 5}, {8, 4}, {4, 0}, {4, 4}}, table},
      {{"fused bias [3, 4]", {"b", {12}}, {3, 4}, {0, 1}, {3, 2}}, bias},
      {{"padded vocabulary bias [16]", {"b", {12}, false, -1, 0, 12}, {16}, {8}, {8}}, bias},
      {{"k of a Conv1D, as [6, 4]", {"w", {6, 12}, false, 1, 4}, {6, 4}, {2, 0}, {2, 4}}, conv},
  };
  for (const auto& [c, source] : cases) {
    const HfReader read = MemoryReader(source);
    std::vector<int64_t> zeros(c.layer.size(), 0);
    auto whole = ReadLayerBlock(c.hf, c.layer, zeros, std::vector<int64_t>(c.layer.begin(), c.layer.end()), read);
    ASSERT_TRUE(whole.ok()) << c.what << ": " << whole.status();
    auto block = ReadLayerBlock(c.hf, c.layer, c.starts, c.lengths, read);
    ASSERT_TRUE(block.ok()) << c.what << ": " << block.status();
    EXPECT_EQ(block->ToFloats(), Narrowed(*whole, c.starts, c.lengths).ToFloats()) << c.what;
    auto back = LayerToHf(c.hf, *whole);
    ASSERT_TRUE(back.ok()) << c.what;
    Tensor full = *Tensor::Zeros(source.shape(), DType::kF32);
    ASSERT_TRUE(PlaceInHf(c.hf, *back, full).ok()) << c.what;
    if (c.hf.narrow_dim < 0) {
      EXPECT_EQ(full.ToFloats(), source.ToFloats()) << c.what;
    } else {
      EXPECT_EQ(full.Narrow(1, 4, 4)->ToFloats(), source.Narrow(1, 4, 4)->ToFloats()) << c.what;
    }
  }
  // The padded rows of the table are zeros, the others its rows.
  auto padded = ReadLayerBlock({"t", {5, 4}, false, -1, 0, 5}, {8, 4}, {0, 0}, {8, 4}, MemoryReader(table));
  ASSERT_TRUE(padded.ok());
  EXPECT_EQ(padded->Narrow(0, 0, 5)->ToFloats(), table.ToFloats());
  EXPECT_EQ(padded->Narrow(0, 5, 3)->ToFloats(), std::vector<float>(12, 0.0f));
  // Fused: element [k, j, i] is the Conv1D's [i, k * 4 + j].
  auto fused = ReadLayerBlock({"w", {6, 12}, true}, {3, 4, 6}, {0, 0, 0}, {3, 4, 6}, MemoryReader(conv));
  const std::vector<float> f = fused->ToFloats(), w = conv.ToFloats();
  EXPECT_EQ(f[(2 * 4 + 1) * 6 + 5], w[5 * 12 + 2 * 4 + 1]);
}

// A checkpoint index is input (coloctl consolidate): shapes it pairs that
// no layer makes are errors, never a division by zero or a read past a
// shape. An empty tensor converts as any other.
TEST(HfTensor, ShapesNoLayerMakesAreErrorsNotCrashes) {
  auto empty = LayerToHf({"w", {0, 4}, true}, *Tensor::Zeros({4, 0}, DType::kF32));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->shape(), (Shape{0, 4}));
  auto scalar = LayerToHf({"w", {2, 2}}, *Tensor::Zeros({}, DType::kF32));
  EXPECT_EQ(scalar.status().code(), absl::StatusCode::kInvalidArgument) << scalar.status();
  EXPECT_NE(scalar.status().message().find("a scalar cannot be the [rows, columns] tensor [2, 2]"), std::string::npos);
  // A narrow along a dim the slice does not have ([2, 2, 2] is held as stored).
  Tensor full = *Tensor::Zeros({2, 2, 2}, DType::kF32);
  const HfTensor three = {"w", {2, 2, 2}, false, 2, 0};
  auto held = LayerToHf(three, *Tensor::Zeros({8}, DType::kF32));
  ASSERT_TRUE(held.ok());
  const absl::Status placed = PlaceInHf(three, *held, full);
  EXPECT_EQ(placed.code(), absl::StatusCode::kInvalidArgument) << placed;
  EXPECT_NE(placed.message().find("a [8] slice has no dim 2 to narrow"), std::string::npos) << placed;
}

}  // namespace
}  // namespace colod::shardformer
