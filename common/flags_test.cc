#include "common/flags.h"

#include <cstdlib>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"

ABSL_FLAG(std::vector<std::string>, test_roots, {}, "test: a repeatable list flag");
ABSL_FLAG(int, test_count, 0, "test: a plain flag");
ABSL_FLAG(std::string, test_reason, "", "test: a string flag");
ABSL_FLAG(bool, test_switch, false, "test: a bool flag");
ABSL_FLAG(std::string, test_note, "", "test: another string flag");

namespace colod {
namespace {

TEST(WrapText, LinesFitTheWidthAtTheIndentKeepingEveryWord) {
  EXPECT_EQ(WrapText("aa bb  cc dd", 2, 8), "  aa bb\n  cc dd\n");
  // A word wider than the room stays whole, on its own line.
  EXPECT_EQ(WrapText("a verylongword b", 2, 8), "  a\n  verylongword\n  b\n");
  // A newline ends a line; an empty line stays empty.
  EXPECT_EQ(WrapText("a\n\nb c", 1, 80), " a\n\n b c\n");
  EXPECT_EQ(WrapText("", 6, 80), "\n");
  // Exactly the width fits.
  EXPECT_EQ(WrapText("abc def", 0, 7), "abc def\n");
  EXPECT_EQ(WrapText("abc defg", 0, 7), "abc\ndefg\n");
}

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

// What Abseil would read: a value-taking flag of this binary given alone
// takes the next argument whatever it starts with ("--" too); a bool takes
// none; --noNAME sets the bool NAME; an unknown flag is listed without a
// flag (and takes no next argument); "-" is no flag; "--=x" ends the flags
// as "--" does.
TEST(ScanFlags, FindsEachFlagItsValueAndWhereItStands) {
  const std::vector<std::string> args = {"prog", "--test-count", "--test-switch", "-test_reason=a=b", "--notest-switch",
                                         "pos", "--unknown", "x", "-", "--=x", "--test-count=9"};
  const std::vector<FlagArg> flags = ScanFlags(args);
  ASSERT_EQ(flags.size(), 4u);
  EXPECT_EQ(flags[0].index, 1u);
  EXPECT_EQ(flags[0].name, "test_count");
  ASSERT_NE(flags[0].flag, nullptr);
  EXPECT_EQ(flags[0].flag->Name(), "test_count");
  EXPECT_EQ(flags[0].value, "--test-switch");
  EXPECT_TRUE(flags[0].value_next);
  EXPECT_EQ(flags[1].index, 3u);
  EXPECT_EQ(flags[1].name, "test_reason");
  EXPECT_EQ(flags[1].value, "a=b");
  EXPECT_FALSE(flags[1].value_next);
  EXPECT_EQ(flags[2].index, 4u);
  EXPECT_EQ(flags[2].name, "notest_switch");
  ASSERT_NE(flags[2].flag, nullptr);
  EXPECT_EQ(flags[2].flag->Name(), "test_switch");
  EXPECT_TRUE(flags[2].negated);
  EXPECT_FALSE(flags[2].value.has_value());
  EXPECT_EQ(flags[3].index, 6u);
  EXPECT_EQ(flags[3].flag, nullptr);
  EXPECT_FALSE(flags[3].value.has_value());

  const std::vector<FlagArg> tail = ScanFlags({"prog", "--test-reason", "--", "--test-switch", "--test-count"});
  ASSERT_EQ(tail.size(), 3u);
  EXPECT_EQ(tail[0].value, "--");
  EXPECT_EQ(tail[1].index, 3u);
  // A value-taking flag at the end has none.
  EXPECT_EQ(tail[2].index, 4u);
  EXPECT_FALSE(tail[2].value.has_value());
  EXPECT_FALSE(tail[2].value_next);
  // Abseil drops two dashes at most: "---x" names "-x"; "-=x" ends the flags.
  const std::vector<FlagArg> dashes = ScanFlags({"prog", "---test-count", "-=x", "--test-switch"});
  ASSERT_EQ(dashes.size(), 1u);
  EXPECT_EQ(dashes[0].spelled, "---test-count");
  EXPECT_EQ(dashes[0].flag, nullptr);
}

// What Abseil would refuse is found first, named, and changes no flag.
TEST(CheckFlags, NamesAnUnknownFlagAMissingValueAndAValueThatDoesNotParse) {
  const int count = absl::GetFlag(FLAGS_test_count);
  EXPECT_TRUE(CheckFlags({"prog", "--test-count", "7", "--test_switch", "--notest-switch", "pos", "--", "--x"}).ok());
  EXPECT_EQ(absl::GetFlag(FLAGS_test_count), count);  // checked, not set
  const absl::Status unknown = CheckFlags({"prog", "--test-count=1", "--bogus-flag=1"});
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unknown.message(), "--bogus-flag: no such flag");
  EXPECT_TRUE(CheckFlags({"prog", "--undefok=bogus-flag,other", "--bogus-flag=1", "--nobogus_flag"}).ok());
  EXPECT_EQ(CheckFlags({"prog", "--test-count"}).message(), "--test-count: missing its value");
  const absl::Status bad = CheckFlags({"prog", "--test-count=seven"});
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(bad.message(), "--test-count: ")) << bad;
  EXPECT_EQ(absl::GetFlag(FLAGS_test_count), count);
  EXPECT_EQ(CheckFlags({"prog", "--test-switch=maybe"}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckFlags({"prog", "--notest-switch=1"}).message(), "--notest-switch: takes no value");
  EXPECT_EQ(CheckFlags({"prog", "--notest-count"}).code(), absl::StatusCode::kInvalidArgument);  // no bool
  EXPECT_EQ(CheckFlags({"prog", "---test-count=1"}).message(), "---test-count: no such flag");
  EXPECT_TRUE(CheckFlags({"prog", "--=x", "--bogus"}).ok());  // past the end of flags
  // Only the last --undefok counts, as with Abseil.
  EXPECT_TRUE(CheckFlags({"prog", "--undefok=a", "--undefok", "bogus", "--bogus"}).ok());
  EXPECT_FALSE(CheckFlags({"prog", "--undefok=bogus", "--undefok=a", "--bogus"}).ok());
  // Abseil's own flags are left to it.
  EXPECT_TRUE(CheckFlags({"prog", "--helpshort", "--help=coord", "--flagfile=/dev/null", "--only_check_args"}).ok());
}

// --fromenv and --tryfromenv stand for the flags their variables hold, in
// their place (a --flagfile there is read too), checked as the command
// line's; an unset variable of --fromenv is named, and so is a name that
// would read the environment again.
TEST(ExpandFlagSources, FromenvGivesItsVariablesFlagsInItsPlace) {
  ASSERT_EQ(setenv("FLAGS_test_count", "7", 1), 0);
  ASSERT_EQ(setenv("FLAGS_test_reason", "from the environment", 1), 0);
  ASSERT_EQ(unsetenv("FLAGS_test_switch"), 0);
  const auto expanded = ExpandFlagSources(
      {"prog", "--x=1", "--fromenv=test-count,test_reason", "--tryfromenv", "test_switch,test-count", "pos"});
  ASSERT_TRUE(expanded.ok()) << expanded.status();
  EXPECT_EQ(*expanded, (std::vector<std::string>{"prog", "--x=1", "--test_count=7",
                                                 "--test_reason=from the environment", "--test_count=7", "pos"}));
  EXPECT_EQ(ExpandFlagSources({"prog", "--fromenv=test_switch"}).status().message(),
            "--fromenv: FLAGS_test_switch is not set (--tryfromenv passes over an unset one)");
  EXPECT_EQ(ExpandFlagSources({"prog", "--fromenv"}).status().message(), "--fromenv: missing its value");
  EXPECT_EQ(ExpandFlagSources({"prog", "--tryfromenv=from-env,fromenv"}).status().message(),
            "--tryfromenv: cannot read --fromenv from the environment");
  ASSERT_EQ(setenv("FLAGS_test_count", "seven", 1), 0);
  const auto bad = ExpandFlagSources({"prog", "--fromenv=test_count"});
  ASSERT_TRUE(bad.ok()) << bad.status();
  EXPECT_TRUE(absl::StartsWith(CheckFlags(*bad).message(), "--test_count: ")) << CheckFlags(*bad);
  ASSERT_EQ(setenv("FLAGS_flagfile", "/nonexistent.flags", 1), 0);
  EXPECT_EQ(ExpandFlagSources({"prog", "--fromenv=flagfile"}).status().message(),
            "--flagfile: cannot open '/nonexistent.flags': No such file or directory");
  for (const char* name : {"FLAGS_test_count", "FLAGS_test_reason", "FLAGS_flagfile"}) unsetenv(name);
}

// Repeatable flags collect every value; a value after its flag stays as
// written, dashes and all (once rewritten as a flag's name: -oom_retry-1);
// a bool flag takes no value, so what follows it is the next argument; an
// --undefok's names are spelt as the flags are, dashes and all. (ParseFlags
// runs once a process.)
TEST(ParseFlags, RepeatableFlagsCollectEveryValueAndValuesStayAsWritten) {
  // (--help as a flag's value, or after the end of flags, is what it
  // stands for: before, `--reason -h` printed the help and exited 0.)
  std::vector<std::string> args = {"prog",
                                   "--test-roots=/a",
                                   "--test-count",
                                   "-3",
                                   "--test-roots",
                                   "/b,/c",
                                   "--test-reason",
                                   "-oom-retry-1",
                                   "--test-switch",
                                   "pos",
                                   "--undefok=not-here,x",
                                   "--not-here=1",
                                   "--test-note",
                                   "-h",
                                   "--",
                                   "--test-roots=/not-a-flag",
                                   "--help"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  const std::vector<std::string> positional =
      ParseFlags(static_cast<int>(argv.size()), argv.data(), "usage", {"test_roots"});
  EXPECT_EQ(absl::GetFlag(FLAGS_test_roots), (std::vector<std::string>{"/a", "/b", "/c"}));
  EXPECT_EQ(absl::GetFlag(FLAGS_test_count), -3);
  EXPECT_EQ(absl::GetFlag(FLAGS_test_reason), "-oom-retry-1");
  EXPECT_TRUE(absl::GetFlag(FLAGS_test_switch));
  EXPECT_EQ(absl::GetFlag(FLAGS_test_note), "-h");
  EXPECT_EQ(positional, (std::vector<std::string>{"pos", "--test-roots=/not-a-flag", "--help"}));
}

}  // namespace
}  // namespace colod
