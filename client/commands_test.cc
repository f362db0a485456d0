// coloctl's command tables: what --help and the dispatch in coloctl_main.cc
// rely on.
#include "client/commands.h"

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/algorithm/container.h"
#include "absl/flags/commandlineflag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
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
  const Command ragged{"cmd", "JOB", "",
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
  const Command wide{"checkpoints", "JOB", "", "  checkpoints JOB\n              a\n              b.\n", nullptr};
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

std::set<std::string> Listed(const Command& c) { return absl::StrSplit(c.flags, ' ', absl::SkipEmpty()); }

// Whether a flag's help says it is `command`'s: the head of one of its
// parts ("train, submit: ...; init-model: ...") names the command, alone
// or qualified ("train with --device cuda"); submit, which takes "the
// train flags", takes those named for train unqualified.
bool HelpNames(const absl::CommandLineFlag& flag, const Command& command) {
  const std::string own = command.name;
  const bool takes_train_flags = absl::StrContains(command.usage, "the train flags");
  const auto is_word = [](char c) { return absl::ascii_isalnum(c) || c == '-' || c == '_'; };
  for (absl::string_view part : absl::StrSplit(flag.Help(), ';')) {
    const size_t colon = part.find(':');
    if (colon == absl::string_view::npos) continue;
    const absl::string_view head = part.substr(0, colon);
    // A list of commands, not a sentence that names one before a colon.
    if (!absl::c_all_of(head, [&](char c) { return is_word(c) || c == ',' || c == ' '; })) continue;
    for (absl::string_view listed : absl::StrSplit(head, ',')) {
      for (absl::string_view item : absl::StrSplit(listed, " and ")) {
        item = absl::StripAsciiWhitespace(item);
        if (item == own || absl::StartsWith(item, own + " ")) return true;
        if (takes_train_flags && item == "train") return true;
      }
    }
  }
  return false;
}

// Whether the command's usage names --flag (the flag's name with dashes)
// as its own: not after another of `commands` ("`train --data PREFIX`
// reads the result" in tokenize's).
bool UsageNames(const absl::CommandLineFlag& flag, const Command& command, const std::set<std::string>& commands) {
  std::string dashed = absl::StrCat("--", flag.Name());
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  const absl::string_view usage = command.usage;
  for (size_t at = usage.find(dashed); at != absl::string_view::npos; at = usage.find(dashed, at + 1)) {
    const size_t end = at + dashed.size();
    if (end != usage.size() && (absl::ascii_isalnum(usage[end]) || usage[end] == '-')) continue;  // --flag-more
    size_t word_end = at;
    while (word_end > 0 && usage[word_end - 1] == ' ') --word_end;
    size_t word_start = word_end;
    while (word_start > 0 && (absl::ascii_isalnum(usage[word_start - 1]) || usage[word_start - 1] == '-')) {
      --word_start;
    }
    const std::string before(usage.substr(word_start, word_end - word_start));
    if (before != command.name && commands.count(before) > 0) continue;
    return true;
  }
  return false;
}

// What a command accepts (Command::flags; anything else of coloctl's is a
// usage error) is what its documentation says it takes: every flag it
// lists is one, named for it by the flag's help or by its usage, and
// every flag whose help names it is listed. The flags no command lists,
// which every command accepts, are the global ones. coloctl-run's commands
// take what coloctl's of the same name take, which hand them over.
TEST(Commands, EachCommandTakesTheFlagsItsHelpNamesAndNoOther) {
  std::set<std::string> listed_by_any, commands;
  const std::vector<CommandGroup> groups = AllGroups();
  for (const CommandGroup& group : groups) {
    for (const Command& c : group.commands) commands.insert(c.name);
  }
  for (const CommandGroup& group : groups) {
    for (const Command& c : group.commands) {
      ASSERT_NE(c.flags, nullptr) << c.name;
      for (const std::string& name : Listed(c)) {
        listed_by_any.insert(name);
        const absl::CommandLineFlag* flag = absl::FindCommandLineFlag(name);
        ASSERT_NE(flag, nullptr) << c.name << " lists --" << name << ", which is no flag";
        EXPECT_TRUE(HelpNames(*flag, c) || UsageNames(*flag, c, commands))
            << c.name << " takes --" << name << " but neither its usage nor the flag's help says so: " << flag->Help();
      }
      for (const auto& [name, flag] : absl::GetAllFlags()) {
        if (!absl::StartsWith(flag->Filename(), "client/")) continue;
        EXPECT_TRUE(!HelpNames(*flag, c) || Listed(c).count(std::string(name)) > 0)
            << "--" << name << "'s help names " << c.name << ", which does not take it: " << flag->Help();
      }
    }
  }
  std::set<std::string> global;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    const std::string file = flag->Filename();
    if ((absl::StartsWith(file, "client/") || absl::StartsWith(file, "common/")) &&
        !listed_by_any.count(std::string(name))) {
      global.insert(std::string(name));
    }
  }
  EXPECT_EQ(global, (std::set<std::string>{"auth_token_file", "coordinator", "output", "timeout", "tls_ca", "tls_cert",
                                           "tls_key"}));
  for (const Command& in_process : InProcessCommands().commands) {
    for (const Command& c : ModelCommands().commands) {
      if (std::string(c.name) == in_process.name) {
        EXPECT_EQ(Listed(in_process), Listed(c)) << c.name;
      }
    }
  }
}

}  // namespace
}  // namespace colod::cli
