#include "common/flags.h"

#include "gtest/gtest.h"

namespace colod {
namespace {

TEST(ParseByteSize, UnitsAndErrors) {
  EXPECT_EQ(*ParseByteSize("0"), 0);
  EXPECT_EQ(*ParseByteSize("4096"), 4096);
  EXPECT_EQ(*ParseByteSize("512MiB"), int64_t{512} << 20);
  EXPECT_EQ(*ParseByteSize(" 8 GiB "), int64_t{8} << 30);
  EXPECT_EQ(*ParseByteSize("1.5GiB"), int64_t{3} << 29);
  EXPECT_EQ(*ParseByteSize("2TB"), int64_t{2000000000000});
  EXPECT_EQ(*ParseByteSize("64KiB"), 65536);
  for (const char* bad : {"", "GiB", "-1GiB", "8gib", "8 GiBs", "1.5", "1e9", "8EiB", "abc", "1..2MiB"}) {
    EXPECT_EQ(ParseByteSize(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ParseByteSize("99999999TiB").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace colod
