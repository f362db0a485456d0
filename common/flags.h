// Command-line parsing shared by the colod binaries (Abseil flags).
#ifndef COLOD_COMMON_FLAGS_H_
#define COLOD_COMMON_FLAGS_H_

#include <cstddef>
#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "absl/flags/commandlineflag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace colod {

// Parses argv with Abseil flags. --help / -h prints `usage` followed by the
// binary's own flags (not Abseil's internal ones) and exits 0; --version
// prints the colod version and exits 0; a --flagfile and a --fromenv's
// variables are read here (ExpandFlagSources), and a flagfile that cannot
// be read, a variable of --fromenv that is not set, or an unknown or
// malformed flag, there or on the command line (CheckFlags), prints why and
// exits 2, a usage error. Returns the positional arguments, argv[0] excluded.
// Flags named in `repeatable` (Abseil's names, with '_'; list-valued) may be
// given several times: their values are joined with commas.
std::vector<std::string> ParseFlags(int argc, char** argv, absl::string_view usage,
                                    const std::set<std::string>& repeatable = {});

// What --help prints: `usage`, then the binary's own flags (not Abseil's),
// with their defaults and help; only those `only` accepts, where given.
void PrintHelp(absl::string_view usage, const std::function<bool(const absl::CommandLineFlag&)>& only = nullptr);

// A flag on a command line, as Abseil reads it.
struct FlagArg {
  size_t index = 0;     // its place in the command line
  std::string spelled;  // as written, up to any '=' ("--data-dir", "-nowatch")
  // Its name as Abseil spells it: one or two leading dashes dropped, the
  // name's '-' made '_' ("data_dir"; "nowatch" for --nowatch).
  std::string name;
  // The flag of this binary that it names, or null. --noNAME, where no
  // flag is called that, names NAME (negated).
  const absl::CommandLineFlag* flag = nullptr;
  bool negated = false;
  // "--flag=VALUE" or "--flag VALUE"; none for a bool given alone, a
  // negation, or a flag whose value is missing.
  std::optional<std::string> value;
  bool value_next = false;  // the value is the next argument, args[index + 1]
};

// The flags of `args` (args[0], the program, excluded) up to the end of
// flags, "--" (and "--=x" or "-=x", which Abseil takes for it): the
// arguments that start with '-' and go on ("-" is positional). A flag of
// this binary that takes a value and is given without "=VALUE" takes the
// next argument as its value, whatever that starts with, as Abseil does:
// that argument is then no flag.
std::vector<FlagArg> ScanFlags(const std::vector<std::string>& args);

// A flag's Abseil name as colod's command lines spell it: '_' made '-'
// ("data_dir": "data-dir"); Abseil's spelling works too.
std::string DashedName(absl::string_view name);

// `args` (args[0], the program, kept) with each --flagfile=FILE[,FILE...]
// before the end of flags replaced by the flags its files hold, as Abseil
// reads a flagfile (leading blanks dropped, empty lines and '#' comments
// skipped, a flag a line; a file's last flag takes no value from what
// follows it), theirs too: so the flags there are checked, spelt and
// joined as the command line's are; and each --fromenv=NAME[,NAME...] or
// --tryfromenv by --NAME=VALUE for each variable FLAGS_NAME (the name with
// '_') that is set, in its place, as Abseil reads them. INVALID_ARGUMENT
// naming the file for one that cannot be read or is over 1 MiB, a line
// that is not a flag, files (or environments) nested more than 4 deep or
// more than 64 files; naming the variable for one of --fromenv that is not
// set.
absl::StatusOr<std::vector<std::string>> ExpandFlagSources(const std::vector<std::string>& args);

// Whether Abseil would parse the flags of `args` (args[0], the program,
// excluded; names as Abseil spells them, with '_'): INVALID_ARGUMENT naming
// the first flag that is unknown to this binary (and not named by the last
// --undefok), that misses its value, negates a flag that is no bool or
// gives a negation a value, or whose value does not parse (Abseil's
// reason). Abseil's own flags (the --help family, --flagfile, --fromenv,
// --tryfromenv, --undefok) are left to it (ParseFlags reads the flagfiles
// and variables before it: ExpandFlagSources). No flag's value changes.
absl::Status CheckFlags(const std::vector<std::string>& args);

// `text` wrapped into lines of at most `width` columns, each starting with
// `indent` spaces and ending in '\n'. Lines break at spaces (a run of spaces
// is one); a word wider than the room stays whole, on a line of its own; a
// '\n' in `text` ends a line (an empty line stays, without the indent).
// --help's flag entries and coloctl's command descriptions go through it.
std::string WrapText(absl::string_view text, int indent, int width);
// The columns --help is wrapped to.
inline constexpr int kHelpWidth = 88;

// A byte size as flags spell it: a whole number of bytes, or one with a
// unit (KiB, MiB, GiB, TiB; KB, MB, GB, TB in powers of 1000), e.g. "8GiB",
// "512MiB", "1.5GB". INVALID_ARGUMENT for anything else, a negative size or
// one past int64.
absl::StatusOr<int64_t> ParseByteSize(absl::string_view text);

}  // namespace colod

#endif  // COLOD_COMMON_FLAGS_H_
