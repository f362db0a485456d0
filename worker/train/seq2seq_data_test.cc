// Seq2SeqDataset and ShiftRight: the decoder input Hugging Face's T5 builds
// from `labels` (worked examples), the batches cut from the pairs, and what
// is refused (naming the file and the pair).
#include "worker/train/seq2seq_data.h"

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "common/host_memory.h"
#include "gtest/gtest.h"
#include "tests/testing/sparse_npy.h"
#include "tests/testing/temp_dir.h"
#include "worker/tensor/npy.h"

namespace colod::train {
namespace {

using ::colod::testing::TempPath;

std::string Npy(const std::string& name, const Tensor& t) {
  const std::string path = TempPath(name);
  EXPECT_TRUE(WriteNpy(path, t).ok());
  return path;
}

Tensor Ids(const Shape& shape, const std::vector<int64_t>& v) { return *Tensor::FromInt64s(shape, v); }

TEST(ShiftRight, TheStartTokenThenTheTargetsWithPadForLeftOut) {
  // start 0 and pad 1 differ here, so each is seen where it belongs.
  auto got = ShiftRight(Ids({2, 3}, {5, 6, -100, 7, -100, -100}), 0, 1);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->shape(), (Shape{2, 3}));
  EXPECT_EQ(got->ToInt64s(), (std::vector<int64_t>{0, 5, 6, 0, 7, 1}));
  auto one = ShiftRight(Ids({1, 1}, {9}), 4, 0);  // the last target is never read
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->ToInt64s(), (std::vector<int64_t>{4}));
  EXPECT_EQ(ShiftRight(Ids({3}, {1, 2, 3}), 0, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ShiftRight(*Tensor::FromFloats({1, 2}, {1, 2}), 0, 0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Seq2SeqDataset, BatchesAreThePairsAtTheIndices) {
  // 3 pairs of 4 input ids (int32 on disk) and 3 targets.
  const std::string inputs =
      Npy("s2s_in.npy", *Ids({3, 4}, {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12}).ToDType(DType::kI32));
  const std::string targets = Npy("s2s_out.npy", Ids({3, 3}, {20, 21, -100, 22, -100, -100, 23, 24, 25}));
  auto d = Seq2SeqDataset::Open(inputs, targets, 32, /*decoder_start=*/2, /*pad=*/0);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ((*d)->size(), 3);
  EXPECT_EQ((*d)->input_len(), 4);
  EXPECT_EQ((*d)->target_len(), 3);
  Tensor ids, dec, labels;
  ASSERT_TRUE((*d)->Batch({2, 0, 2}, &ids, &dec, &labels).ok());
  EXPECT_EQ(ids.shape(), (Shape{3, 4}));
  EXPECT_EQ(ids.dtype(), DType::kI64);
  EXPECT_EQ(ids.ToInt64s(), (std::vector<int64_t>{9, 10, 11, 12, 1, 2, 3, 4, 9, 10, 11, 12}));
  EXPECT_EQ(labels.ToInt64s(), (std::vector<int64_t>{23, 24, 25, 20, 21, -100, 23, 24, 25}));
  EXPECT_EQ(dec.ToInt64s(), (std::vector<int64_t>{2, 23, 24, 2, 20, 21, 2, 23, 24}));
  EXPECT_EQ((*d)->Batch({3}, &ids, &dec, &labels).code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ((*d)->Batch({-1}, &ids, &dec, &labels).code(), absl::StatusCode::kOutOfRange);
}

TEST(Seq2SeqDataset, RefusesWhatTheModelCannotReadNamingTheFileAndPair) {
  const std::string inputs = Npy("r_in.npy", Ids({2, 2}, {1, 2, 3, 4}));
  const std::string targets = Npy("r_out.npy", Ids({2, 2}, {5, 6, 7, -100}));
  struct Case {
    std::string inputs, targets, message;
  };
  for (const Case& c : std::vector<Case>{
           {Npy("r_flat.npy", Ids({4}, {1, 2, 3, 4})), targets, "r_flat.npy: the inputs must be integer token ids"},
           {Npy("r_float.npy", *Tensor::FromFloats({2, 2}, {1, 2, 3, 4})), targets,
            "r_float.npy: the inputs must be integer token ids [N, length], got f32 [2, 2]"},
           {inputs, Npy("r_three.npy", Ids({3, 2}, {5, 6, 7, 8, 9, 10})),
            "r_three.npy: the targets must be integer token ids [2 (one per input), length], got i64 [3, 2]"},
           {Npy("r_big.npy", Ids({2, 2}, {1, 2, 3, 40})), targets,
            "r_big.npy: id 40 of input 1 is outside the model's vocabulary of 32"},
           {inputs, Npy("r_neg.npy", Ids({2, 2}, {5, 6, -5, 1})),
            "r_neg.npy: id -5 of target 1 is outside the model's vocabulary of 32 (and is not -100)"},
           {inputs, Npy("r_none.npy", Ids({2, 2}, {5, 6, -100, -100})),
            "r_none.npy: target 1 is all -100"},
       }) {
    auto d = Seq2SeqDataset::Open(c.inputs, c.targets, 32, 0, 0);
    ASSERT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << c.message;
    EXPECT_NE(d.status().message().find(c.message), std::string::npos) << d.status();
  }
  EXPECT_EQ(Seq2SeqDataset::Open(TempPath("absent.npy"), targets, 32, 0, 0).status().code(),
            absl::StatusCode::kNotFound);
}

// Pairs whose int64 values would not fit in the memory available are
// refused from their headers, before either file is read: here int32
// inputs whose file ReadNpy alone could hold (8 bytes an id, with its
// tensor) but whose ids as int64 with the tensor they come from could not
// (20 bytes an id).
TEST(Seq2SeqDataset, PairsThatWouldNotFitInMemoryAreRefusedBeforeTheyAreRead) {
  const int64_t rows = AvailableHostMemoryBytes() / 12 / 64 + 1;
  const std::string inputs = TempPath("huge_inputs.npy"), targets = TempPath("huge_targets.npy");
  testing::WriteSparseNpy(inputs, "<i4", {rows, 64}, 4);
  testing::WriteSparseNpy(targets, "<i4", {rows, 1}, 4);
  const absl::Time start = absl::Now();
  const absl::Status s = Seq2SeqDataset::Open(inputs, targets, 100, 0, 0).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), inputs + " and " + targets + " would take about")) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << "read before it was refused?";
  ::unlink(inputs.c_str());
  ::unlink(targets.c_str());
}

}  // namespace
}  // namespace colod::train
