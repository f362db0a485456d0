// safetensors files built byte by byte from the format's description, files
// from the writer, and every header rule the reader enforces.
#include "worker/shardformer/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/testing/heap.h"
#include "tests/testing/raw_safetensors.h"
#include "tests/testing/temp_dir.h"

namespace colod::shardformer {
namespace {

using ::colod::testing::TempPath;

std::string Raw(const std::string& header, const std::string& data) {
  return ::colod::testing::RawSafetensors(header, data);
}

std::string Floats(std::initializer_list<float> v) {
  std::string s(v.size() * 4, '\0');
  std::memcpy(s.data(), v.begin(), s.size());
  return s;
}

std::string WriteFile(const std::string& name, const std::string& bytes) {
  const std::string path = TempPath(name);
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

TEST(Safetensors, ReadsAFileBuiltFromTheSpecification) {
  const std::string path = WriteFile(
      "spec.safetensors",
      Raw(R"({"__metadata__":{"format":"pt"},"b":{"dtype":"I64","shape":[2],"data_offsets":[16,32]},)"
          R"("w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})",
          Floats({1, 2, 3, 4}) + std::string("\x07\0\0\0\0\0\0\0\xfe\xff\xff\xff\xff\xff\xff\xff", 16)));
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  auto w = (*f)->Read("w");
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->shape(), (Shape{2, 2}));
  EXPECT_EQ(w->ToFloats(), (std::vector<float>{1, 2, 3, 4}));
  EXPECT_EQ((*f)->Read("b")->ToInt64s(), (std::vector<int64_t>{7, -2}));
  EXPECT_EQ((*f)->Read("missing").status().code(), absl::StatusCode::kNotFound);
}

// Dtypes the format defines and colod does not read (a model's bool mask
// buffer, an old u8 one, an f64 table) are validated like the others and
// kept aside: the file opens, its other tensors read, and only those names
// are refused, naming their dtype.
TEST(Safetensors, TensorsOfDTypesColodDoesNotReadAreListedNotRefusedWhole) {
  const std::string path =
      WriteFile("unread.safetensors", Raw(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                          R"("mask":{"dtype":"BOOL","shape":[2,3],"data_offsets":[8,14]},)"
                                          R"("old":{"dtype":"U8","shape":[2],"data_offsets":[14,16]},)"
                                          R"("table":{"dtype":"F64","shape":[1],"data_offsets":[16,24]},)"
                                          R"("packed":{"dtype":"F4","shape":[4,4],"data_offsets":[24,32]}})",
                                          Floats({1, 2}) + std::string("\1\0\1\1\1\0\7\7", 8) + std::string(16, '\0')));
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->Read("w")->ToFloats(), (std::vector<float>{1, 2}));
  EXPECT_EQ((*f)->tensors().size(), 1u);
  EXPECT_EQ((*f)->unreadable(),
            (std::map<std::string, std::string>{{"mask", "BOOL"}, {"old", "U8"}, {"table", "F64"}, {"packed", "F4"}}));
  for (const char* name : {"mask", "old", "table", "packed"}) {
    EXPECT_TRUE((*f)->Has(name)) << name;
    const absl::Status s = (*f)->Read(name).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << name << ": " << s;
    EXPECT_NE(s.message().find(
                  absl::StrCat("tensor ", name, " is ", (*f)->unreadable().at(name), ", a dtype colod does not read")),
              absl::string_view::npos)
        << s;
    EXPECT_EQ((*f)->ReadSlice(name, {0}, {1}).status().code(), absl::StatusCode::kInvalidArgument) << name;
  }
  EXPECT_FALSE((*f)->Has("missing"));
  EXPECT_EQ((*f)->Info("missing").status().code(), absl::StatusCode::kNotFound);
}

// A streamed write makes each tensor when its turn comes and drops it once
// written: it holds one tensor of the file, never all (a model's
// consolidation on rank 0). A tensor made unlike its layout, or an error of
// the maker, leaves no file.
TEST(Safetensors, AStreamedWriteHoldsOneTensorAtATime) {
  constexpr int64_t kRows = 1024, kCols = 1024, kBytes = kRows * kCols * 4;  // 4 MiB each
  std::vector<TensorLayout> layout;
  for (int i = 0; i < 8; ++i) layout.push_back({"t" + std::to_string(i), DType::kF32, {kRows, kCols}});
  const std::string path = TempPath("streamed.safetensors");
  const int64_t base = ::colod::testing::HeapInUse();
  int64_t most = 0;  // heap above `base` when a tensor is about to be made
  const auto make = [&](size_t i) -> absl::StatusOr<Tensor> {
    most = std::max(most, ::colod::testing::HeapInUse() - base);
    absl::StatusOr<Tensor> t = Tensor::Zeros({kRows, kCols}, DType::kF32);
    if (t.ok()) std::fill(t->data<float>(), t->data<float>() + kRows * kCols, static_cast<float>(i) + 0.5f);
    return t;
  };
  ASSERT_TRUE(WriteSafetensorsStreamed(path, layout, make, {{"format", "pt"}}).ok());
  EXPECT_LT(most, kBytes / 2) << "the tensors written before were still held";
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->metadata().at("format"), "pt");
  for (int i = 0; i < 8; ++i) {
    auto t = (*f)->ReadSlice("t" + std::to_string(i), {kRows - 1, kCols - 2}, {1, 2});
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->ToFloats(), std::vector<float>(2, static_cast<float>(i) + 0.5f)) << i;
  }

  const std::string bad = TempPath("streamed_bad.safetensors");
  const absl::Status shape = WriteSafetensorsStreamed(bad, {{"a", DType::kF32, {2, 3}}}, [](size_t) {
    return Tensor::Zeros({3, 2}, DType::kF32);
  });
  EXPECT_EQ(shape.code(), absl::StatusCode::kInvalidArgument) << shape;
  EXPECT_NE(shape.message().find("tensor a was made F32[3, 2], its header says F32[2, 3]"), absl::string_view::npos)
      << shape;
  const absl::Status made = WriteSafetensorsStreamed(bad, {{"a", DType::kF32, {2}}, {"b", DType::kF32, {2}}},
                                                     [](size_t i) -> absl::StatusOr<Tensor> {
                                                       if (i == 1) return absl::DataLossError("b is gone");
                                                       return Tensor::Zeros({2}, DType::kF32);
                                                     });
  EXPECT_EQ(made, absl::DataLossError("b is gone"));
  EXPECT_FALSE(std::filesystem::exists(bad));
  for (const auto& entry : std::filesystem::directory_iterator(std::filesystem::path(bad).parent_path())) {
    EXPECT_EQ(entry.path().filename().string().find("streamed_bad.safetensors.tmp"), std::string::npos) << entry.path();
  }
  EXPECT_EQ(WriteSafetensorsStreamed(bad, {{"a", DType::kF32, {2}}, {"a", DType::kF32, {2}}},
                                     [](size_t) { return Tensor::Zeros({2}, DType::kF32); })
                .code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(Safetensors, WriterRoundTripsEveryDTypeAndSlicesReadOnlyTheirBlock) {
  const Tensor a = *Tensor::RandomNormal({6, 10, 3}, 1);
  const Tensor h = *Tensor::RandomNormal({5, 4}, 2, DType::kBF16);
  const Tensor g = *Tensor::RandomNormal({7}, 3, DType::kF16);
  const Tensor i = *Tensor::FromInt64s({3}, {1, -5, 1LL << 40});
  const Tensor scalar = *Tensor::FromFloats({}, {2.5f});
  const std::string path = TempPath("round.safetensors");
  ASSERT_TRUE(
      WriteSafetensors(path, {{"a", a}, {"h", h}, {"g", g}, {"i", i}, {"scalar", scalar}}, {{"k", "v"}}).ok());
  std::ifstream in(path, std::ios::binary);
  uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  EXPECT_EQ(n % 8, 0u) << "the header is padded to 8 bytes";
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ((*f)->Read("a")->ToBytes(), a.ToBytes());
  EXPECT_EQ((*f)->Read("h")->ToBytes(), h.ToBytes());
  EXPECT_EQ((*f)->Read("h")->dtype(), DType::kBF16);
  EXPECT_EQ((*f)->Read("g")->ToBytes(), g.ToBytes());
  EXPECT_EQ((*f)->Read("i")->ToInt64s(), i.ToInt64s());
  EXPECT_EQ((*f)->Read("scalar")->shape(), Shape{});
  EXPECT_EQ((*f)->Read("scalar")->ToFloats(), std::vector<float>{2.5f});
  EXPECT_EQ((*f)->metadata().at("k"), "v");
  // A block in the middle of every dim, and a row block (one contiguous run).
  auto block = (*f)->ReadSlice("a", {2, 3, 1}, {3, 4, 2});
  ASSERT_TRUE(block.ok()) << block.status();
  EXPECT_EQ(block->ToFloats(), a.Narrow(0, 2, 3)->Narrow(1, 3, 4)->Narrow(2, 1, 2)->ToFloats());
  EXPECT_EQ((*f)->ReadSlice("a", {4, 0, 0}, {2, 10, 3})->ToFloats(), a.Narrow(0, 4, 2)->ToFloats());
  // Whole on the last dim, part of the middle one: a run of 5 x 3 elements
  // for each of 4 indices of the first.
  EXPECT_EQ((*f)->ReadSlice("a", {1, 2, 0}, {4, 5, 3})->ToFloats(),
            a.Narrow(0, 1, 4)->Narrow(1, 2, 5)->ToFloats());
  EXPECT_EQ((*f)->ReadSlice("a", {6, 0, 0}, {0, 10, 3})->shape(), (Shape{0, 10, 3}));  // empty, at the end
  EXPECT_EQ((*f)->ReadSlice("g", {2}, {5})->ToBytes(), g.Narrow(0, 2, 5)->Contiguous().ToBytes());
  EXPECT_EQ((*f)->ReadSlice("a", {0, 0, 0}, {7, 1, 1}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteSafetensors(path, {{"a", a}, {"a", a}}).code(), absl::StatusCode::kInvalidArgument);
}

// Slices whose runs are long enough to be read one by one (2 MiB and more),
// and short runs read together a buffer at a time, across several buffers:
// each equals the slice of the whole tensor.
TEST(Safetensors, SlicesOfLargeTensorsEqualTheSliceOfTheWhole) {
  const Tensor wide = *Tensor::RandomNormal({3, 700000}, 4);  // 2.8 MB rows
  const Tensor tall = *Tensor::RandomNormal({4096, 1024}, 5);  // 16 MiB, rows of 4 KiB
  const Tensor spread = *Tensor::RandomNormal({64, 8192}, 6);  // rows of 32 KiB
  const std::string path = TempPath("large.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"wide", wide}, {"tall", tall}, {"spread", spread}}).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  const struct {
    const char* name;
    const Tensor& whole;
    std::vector<int64_t> starts, lengths;
  } cases[] = {
      {"wide", wide, {0, 100}, {3, 600000}},   // three runs of 2.4 MB
      {"wide", wide, {1, 0}, {2, 700000}},     // one run
      {"tall", tall, {0, 512}, {4096, 512}},   // 4096 runs of 2 KiB over 16 MiB
      {"tall", tall, {7, 1000}, {4001, 3}},    // runs of 12 bytes
      {"tall", tall, {4095, 1023}, {1, 1}},    // the last element
      {"spread", spread, {3, 5}, {60, 4}},     // runs 32 KiB apart: read one by one
      {"spread", spread, {0, 8000}, {64, 192}},
  };
  for (const auto& c : cases) {
    auto got = (*f)->ReadSlice(c.name, c.starts, c.lengths);
    ASSERT_TRUE(got.ok()) << got.status();
    const Tensor want = *c.whole.Narrow(0, c.starts[0], c.lengths[0])->Narrow(1, c.starts[1], c.lengths[1]);
    EXPECT_EQ(got->ToFloats(), want.ToFloats()) << c.name << " from " << c.starts[0] << "," << c.starts[1];
  }
}

// A file cut short while it is open (a user's weights rewritten in place) is
// DATA_LOSS naming it when a rank reads past the new end. Mapped, the read
// was a SIGBUS that killed the worker daemon and every job on it.
TEST(Safetensors, AFileCutShortWhileOpenIsDataLossNotACrash) {
  const Tensor a = *Tensor::RandomNormal({64, 64}, 6);
  const Tensor b = *Tensor::RandomNormal({64, 64}, 7);
  const std::string path = TempPath("shrinking.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"a", a}, {"b", b}}).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ(::truncate(path.c_str(), 4096), 0);
  auto got = (*f)->Read("b");
  EXPECT_EQ(got.status().code(), absl::StatusCode::kDataLoss) << got.status();
  EXPECT_NE(got.status().message().find(path), absl::string_view::npos) << got.status();
  EXPECT_NE(got.status().message().find("changed while in use"), absl::string_view::npos) << got.status();
  EXPECT_EQ((*f)->ReadSlice("a", {60, 0}, {4, 64}).status().code(), absl::StatusCode::kDataLoss);
}

TEST(Safetensors, MalformedFilesAreInvalidArgumentNamingTheRule) {
  const std::string w16 = Floats({1, 2, 3, 4});
  struct Case {
    const char* name;
    std::string bytes;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"short", std::string("\x10\0\0", 3), "fewer than the 8-byte header length"},
      {"long_header", Raw("{}", "").replace(0, 1, "\x7f"), "does not fit the file"},
      {"not_json", Raw("{\"w\":", w16), "not a JSON object"},
      {"array", Raw("[1,2]", ""), "not a JSON object"},
      {"no_offsets", Raw(R"({"w":{"dtype":"F32","shape":[2,2]}})", w16), "needs dtype, shape and two data_offsets"},
      {"dtype", Raw(R"({"w":{"dtype":"F7","shape":[2],"data_offsets":[0,16]}})", w16), "dtype F7"},
      {"unread_size", Raw(R"({"w":{"dtype":"F64","shape":[3],"data_offsets":[0,16]}})", w16), "needs 24 bytes"},
      {"packed_size", Raw(R"({"w":{"dtype":"F4","shape":[2,16],"data_offsets":[0,8]}})", w16), "needs 16 bytes"},
      {"partial_byte", Raw(R"({"w":{"dtype":"F6_E2M3","shape":[3],"data_offsets":[0,16]}})", w16),
       "F6_E2M3[3] is 18 bits, not whole bytes"},
      {"size", Raw(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})", w16), "needs 24 bytes"},
      {"bounds", Raw(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[8,24]}})", w16), "outside the 16-byte"},
      {"overlap",
       Raw(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[3],"data_offsets":[4,16]}})",
           w16),
       "overlap"},
      {"hole", Raw(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", w16), "belong to no tensor"},
      {"negative", Raw(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", w16), "not a size"},
      {"metadata", Raw(R"({"__metadata__":{"a":1}})", ""), "is not a string"},
      // Sizes whose products or values leave int64: (2^62, 16) F32 wraps to
      // 0 bytes in plain arithmetic and would match empty offsets.
      {"wrapping_shape", Raw(R"({"w":{"dtype":"F32","shape":[4611686018427387904,16],"data_offsets":[0,0]}})", ""),
       "the shape is too large"},
      {"wrapping_unread", Raw(R"({"w":{"dtype":"U64","shape":[2305843009213693952,8],"data_offsets":[0,0]}})", ""),
       "the shape is too large"},
      {"unread_overlap",
       Raw(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"b":{"dtype":"BOOL","shape":[8],"data_offsets":[8,16]}})",
           w16),
       "overlap"},
      {"huge_dim", Raw(R"({"w":{"dtype":"I32","shape":[18446744073709551615],"data_offsets":[0,0]}})", ""),
       "not a size"},
      {"huge_offset", Raw(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551608,0]}})", w16),
       "not a size"},
  };
  for (const Case& c : cases) {
    auto f = SafetensorsFile::Open(WriteFile(std::string(c.name) + ".safetensors", c.bytes));
    EXPECT_EQ(f.status().code(), absl::StatusCode::kInvalidArgument) << c.name << ": " << f.status();
    EXPECT_NE(f.status().message().find(c.message), absl::string_view::npos) << c.name << ": " << f.status();
  }
  EXPECT_EQ(SafetensorsFile::Open(TempPath("absent.safetensors")).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace colod::shardformer
