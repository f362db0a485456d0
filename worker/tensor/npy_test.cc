// .npy files as NumPy writes them (bytes spelled out from the format
// description), and the writer's output read back.
#include "worker/tensor/npy.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

// A version-1.0 file with `dict` (padded as NumPy pads) and `data`.
std::string Npy(std::string dict, const std::string& data) {
  const size_t total = 10 + dict.size() + 1;
  dict.append((64 - total % 64) % 64, ' ');
  dict.push_back('\n');
  std::string out("\x93NUMPY\x01\x00", 8);
  out.push_back(static_cast<char>(dict.size() & 0xff));
  out.push_back(static_cast<char>(dict.size() >> 8));
  return out + dict + data;
}

template <typename T>
std::string Bytes(std::initializer_list<T> v) {
  std::string s(v.size() * sizeof(T), '\0');
  std::memcpy(s.data(), v.begin(), s.size());
  return s;
}

TEST(Npy, ReadsWhatNumPyWrites) {
  auto ids = ParseNpy(Npy("{'descr': '<i8', 'fortran_order': False, 'shape': (2, 3), }",
                          Bytes<int64_t>({1, 2, 3, 40000, 5, 6})));
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(ids->shape(), (Shape{2, 3}));
  EXPECT_EQ(ids->ToInt64s(), (std::vector<int64_t>{1, 2, 3, 40000, 5, 6}));
  auto vec = ParseNpy(Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (3,), }", Bytes<float>({1.5f, -2, 0})));
  ASSERT_TRUE(vec.ok()) << vec.status();
  EXPECT_EQ(vec->ToFloats(), (std::vector<float>{1.5f, -2, 0}));
  // uint16 token files (nanoGPT's .bin as an array) read as i64.
  auto tokens = ParseNpy(Npy("{'descr': '<u2', 'fortran_order': False, 'shape': (3,), }", Bytes<uint16_t>({65535, 0, 7})));
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_EQ(tokens->dtype(), DType::kI64);
  EXPECT_EQ(tokens->ToInt64s(), (std::vector<int64_t>{65535, 0, 7}));
  auto scalar = ParseNpy(Npy("{'descr': '<f4', 'fortran_order': False, 'shape': (), }", Bytes<float>({3})));
  ASSERT_TRUE(scalar.ok());
  EXPECT_EQ(scalar->shape(), Shape{});
}

TEST(Npy, WriterOutputReadsBackAndIsAlignedLikeNumPys) {
  const Tensor t = *Tensor::RandomNormal({2, 3, 5}, 9);
  auto bytes = SerializeNpy(t);
  ASSERT_TRUE(bytes.ok());
  const size_t header_len = static_cast<unsigned char>((*bytes)[8]) | static_cast<unsigned char>((*bytes)[9]) << 8;
  EXPECT_EQ((10 + header_len) % 64, 0u);
  EXPECT_EQ(ParseNpy(*bytes)->ToBytes(), t.ToBytes());
  const Tensor ids = *Tensor::FromInt64s({4}, {1, 2, 3, 4});
  EXPECT_EQ(ParseNpy(*SerializeNpy(ids))->ToInt64s(), ids.ToInt64s());
  EXPECT_EQ(SerializeNpy(*t.ToDType(DType::kBF16)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Npy, RejectsWhatItCannotRead) {
  EXPECT_EQ(ParseNpy("not numpy").status().code(), absl::StatusCode::kInvalidArgument);
  auto fortran = ParseNpy(Npy("{'descr': '<f4', 'fortran_order': True, 'shape': (1,), }", Bytes<float>({1})));
  EXPECT_NE(fortran.status().message().find("fortran_order"), absl::string_view::npos) << fortran.status();
  auto f8 = ParseNpy(Npy("{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }", Bytes<double>({1})));
  EXPECT_NE(f8.status().message().find("'<f8'"), absl::string_view::npos) << f8.status();
  auto short_data = ParseNpy(Npy("{'descr': '<i8', 'fortran_order': False, 'shape': (2, 2), }", Bytes<int64_t>({1})));
  EXPECT_NE(short_data.status().message().find("needs 32 bytes"), absl::string_view::npos) << short_data.status();
  EXPECT_EQ(ReadNpy("/nonexistent/ids.npy").status().code(), absl::StatusCode::kNotFound);
  // A version-2 header past 64 KiB (numpy's only reason for version 2) is
  // named as such, from bytes and from a file, not as a truncated file.
  std::string v2("\x93NUMPY\x02\x00", 8);
  const uint32_t len = 70000;
  for (int i = 0; i < 4; ++i) v2.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  v2 += "{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (1,), }";
  v2.resize(12 + len + 4, ' ');
  auto big = ParseNpy(v2);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument) << big.status();
  EXPECT_NE(big.status().message().find("header is 70000 bytes"), absl::string_view::npos) << big.status();
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/v2.npy");
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  ASSERT_EQ(::write(fd, v2.data(), v2.size()), static_cast<ssize_t>(v2.size()));
  ::close(fd);
  auto info = ReadNpyInfo(path);
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument) << info.status();
  EXPECT_NE(info.status().message().find("header is 70000 bytes"), absl::string_view::npos) << info.status();
  ::unlink(path.c_str());
  // A FIFO whose writer stays and writes nothing would hold a read that no
  // abort ends; a directory: refused at once, named.
  const std::string fifo = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/input-fifo.npy");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const int writer = ::open(fifo.c_str(), O_RDWR | O_NONBLOCK);  // a writer that stays
  ASSERT_GE(writer, 0) << std::strerror(errno);
  const absl::Time start = absl::Now();
  auto from_fifo = ReadNpy(fifo);
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));
  EXPECT_EQ(from_fifo.status().code(), absl::StatusCode::kInvalidArgument) << from_fifo.status();
  EXPECT_NE(from_fifo.status().message().find("not a regular file"), absl::string_view::npos) << from_fifo.status();
  ::close(writer);
  ::unlink(fifo.c_str());
  auto from_dir = ReadNpy(tmp != nullptr ? tmp : "/tmp");
  EXPECT_EQ(from_dir.status().code(), absl::StatusCode::kInvalidArgument) << from_dir.status();
}

// The crafted header: (2^62, 16) elements wrap to 0 in plain int64
// arithmetic, so an empty data section passed the size check and the
// tensor's storage was freed with a bad pointer. Every dtype, and a zero
// dim beside the huge ones, is INVALID_ARGUMENT naming the shape.
TEST(Npy, ShapesWhoseSizesOverflowAreRefused) {
  for (const char* descr : {"<i8", "<f4", "<u2", "<u4"}) {
    for (const char* shape : {"(4611686018427387904, 16)", "(4611686018427387904, 16, 0)",
                              "(9223372036854775807, 2)", "(3037000500, 3037000500)"}) {
      auto t = ParseNpy(Npy(absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': ", shape, ", }"),
                            ""));
      EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << descr << " " << shape;
      EXPECT_NE(t.status().message().find("too large"), absl::string_view::npos) << t.status();
    }
  }
  // An empty array is fine.
  auto empty = ParseNpy(Npy("{'descr': '<i8', 'fortran_order': False, 'shape': (0, 16), }", ""));
  ASSERT_TRUE(empty.ok()) << empty.status();
  EXPECT_EQ(empty->numel(), 0);
}

// An array that would not fit in the memory available is refused from its
// header, before it is read: a sparse file whose size costs no disk. A
// small one of the same kinds reads.
TEST(Npy, AnArrayLargerThanTheMemoryIsRefusedBeforeItIsRead) {
  const int64_t physical = static_cast<int64_t>(::sysconf(_SC_PHYS_PAGES)) * ::sysconf(_SC_PAGE_SIZE);
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = absl::StrCat(tmp != nullptr ? tmp : "/tmp", "/huge.npy");
  for (const char* descr : {"<f4", "<u2"}) {
    const int64_t elements = physical / 4;  // as <f4, the file and its tensor; <u2 widened, 9 bytes an element more
    const std::string npy =
        Npy(absl::StrCat("{'descr': '", descr, "', 'fortran_order': False, 'shape': (", elements, ",), }"), "");
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ASSERT_GE(fd, 0) << std::strerror(errno);
    ASSERT_EQ(::write(fd, npy.data(), npy.size()), static_cast<ssize_t>(npy.size()));
    const int64_t width = descr[2] == 'f' ? 4 : 2;
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(npy.size() + elements * width)), 0) << std::strerror(errno);
    ::close(fd);
    const absl::Time start = absl::Now();
    const absl::StatusOr<Tensor> t = ReadNpy(path);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kResourceExhausted) << descr << ": " << t.status();
    EXPECT_NE(t.status().message().find("GiB is available"), absl::string_view::npos) << t.status();
    EXPECT_LT(absl::Now() - start, absl::Seconds(2)) << descr << ": read before it was refused?";
  }
  ::unlink(path.c_str());
  ASSERT_TRUE(WriteNpy(path, *Tensor::FromInt64s({3}, {1, 2, 3})).ok());
  const absl::StatusOr<Tensor> small = ReadNpy(path);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->ToInt64s(), (std::vector<int64_t>{1, 2, 3}));
}

}  // namespace
}  // namespace colod
