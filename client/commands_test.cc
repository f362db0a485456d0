// coloctl's command tables: what --help and the dispatch in coloctl_main.cc
// rely on.
#include <set>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "client/commands.h"
#include "client/in_process_commands.h"
#include "gtest/gtest.h"

namespace colod::cli {
namespace {

std::vector<CommandGroup> AllGroups() {
  return {LocalCommands(), ModelCommands(), ClusterCommands(), TensorCommands()};
}

TEST(Commands, EveryCommandHasAUniqueNameAUsageEntryAndARun) {
  std::set<std::string> names;
  for (const CommandGroup& group : AllGroups()) {
    ASSERT_NE(group.heading, nullptr);
    EXPECT_TRUE(absl::EndsWith(group.heading, ":")) << group.heading;
    EXPECT_FALSE(group.commands.empty()) << group.heading;
    for (const Command& c : group.commands) {
      ASSERT_NE(c.name, nullptr);
      ASSERT_NE(c.usage, nullptr) << c.name;
      EXPECT_NE(c.run, nullptr) << c.name;
      EXPECT_TRUE(names.insert(c.name).second) << "two commands named " << c.name;
      // --help is the usages one after the other: each starts a line with
      // its name in the command column and ends its last line.
      EXPECT_TRUE(absl::StartsWith(c.usage, absl::StrCat("  ", c.name, " "))) << c.usage;
      EXPECT_TRUE(absl::EndsWith(c.usage, "\n")) << c.name;
      // The operands the dispatch checks are the ones the usage shows.
      if (c.operands != nullptr && c.operands[0] != '\0') {
        EXPECT_TRUE(absl::StartsWith(c.usage, absl::StrCat("  ", c.name, " ", c.operands))) << c.usage;
      }
    }
  }
  for (const char* expected : {"workers", "submit", "jobs", "status", "checkpoints", "watch", "cancel", "delete", "mesh", "tensor", "forward",
                               "train", "init-model", "tokenize", "consolidate", "local", "health", "version"}) {
    EXPECT_EQ(names.count(expected), 1u) << expected;
  }
}

// --help's descriptions fit 88 columns, rewrapped without losing or
// reordering a word; a first line whose name and operands pass the
// description column and the tensor command's table stay as written.
TEST(Commands, UsagesWrapToTheHelpWidthKeepingEveryWord) {
  const auto words = [](absl::string_view text) {
    return std::vector<std::string>(absl::StrSplit(text, absl::ByAnyChar(" \n"), absl::SkipEmpty()));
  };
  for (const CommandGroup& group : AllGroups()) {
    for (const Command& c : group.commands) {
      const std::string wrapped = WrapUsage(c);
      EXPECT_EQ(words(wrapped), words(c.usage)) << c.name;
      EXPECT_TRUE(absl::StartsWith(wrapped, absl::StrCat("  ", c.name, " "))) << wrapped;
      EXPECT_TRUE(absl::EndsWith(wrapped, "\n")) << c.name;
      for (absl::string_view line : absl::StrSplit(wrapped, '\n')) {
        // The table's rows are indented past the column, as written.
        if (line.size() > 88) {
          EXPECT_TRUE(absl::StrContains(c.usage, line)) << c.name << ": a rewrapped line of " << line.size()
                                                        << " columns: " << line;
        }
      }
    }
  }
  // A description of three ragged lines: one paragraph at the column.
  const Command ragged{"cmd", "JOB",
                       "  cmd JOB     one two\n"
                       "              three four five six seven eight nine ten eleven twelve thirteen fourteen "
                       "fifteen sixteen\n"
                       "              end.\n"
                       "                table row   stays\n",
                       nullptr};
  EXPECT_EQ(WrapUsage(ragged),
            "  cmd JOB     one two three four five six seven eight nine ten eleven twelve thirteen\n"
            "              fourteen fifteen sixteen end.\n"
            "                table row   stays\n");
  // A name and operands past the column: that line as written, the text below rewrapped.
  const Command wide{"checkpoints", "JOB", "  checkpoints JOB\n              a\n              b.\n", nullptr};
  EXPECT_EQ(WrapUsage(wide), "  checkpoints JOB\n              a b.\n");
}

// coloctl hands exactly the commands coloctl-run runs over to it: each of
// coloctl-run's is one of coloctl's model commands, under the same name.
TEST(Commands, EveryInProcessCommandIsAColoctlModelCommand) {
  std::set<std::string> model;
  for (const Command& c : ModelCommands().commands) model.insert(c.name);
  std::set<std::string> in_process;
  for (const Command& c : InProcessCommands().commands) {
    EXPECT_EQ(model.count(c.name), 1u) << c.name;
    EXPECT_TRUE(absl::StartsWith(c.usage, absl::StrCat("  ", c.name, " "))) << c.usage;
    EXPECT_NE(c.run, nullptr) << c.name;
    in_process.insert(c.name);
  }
  EXPECT_EQ(in_process, (std::set<std::string>{"forward", "train", "init-model", "tokenize", "consolidate"}));
}

}  // namespace
}  // namespace colod::cli
