#include "common/flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "common/status_macros.h"
#include "common/version.h"

namespace colod {
namespace {

bool IsOwnFlag(absl::string_view filename) {
  return !absl::StartsWith(filename, "absl/") && !absl::StrContains(filename, "/absl/");
}

}  // namespace

void PrintHelp(absl::string_view usage, const std::function<bool(const absl::CommandLineFlag&)>& only) {
  std::string out(usage);
  if (!out.empty() && out.back() != '\n') out.push_back('\n');
  std::vector<absl::CommandLineFlag*> flags;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (IsOwnFlag(flag->Filename()) && (only == nullptr || only(*flag))) flags.push_back(flag);
  }
  std::sort(flags.begin(), flags.end(),
            [](auto* a, auto* b) { return a->Name() < b->Name(); });
  absl::StrAppend(&out, "\nFlags:\n");
  for (absl::CommandLineFlag* f : flags) {
    absl::StrAppend(&out, "  --", DashedName(f->Name()));
    std::string def = f->DefaultValue();
    if (!def.empty()) absl::StrAppend(&out, " (default: ", def, ")");
    absl::StrAppend(&out, "\n", WrapText(f->Help(), 6, kHelpWidth));
  }
  absl::StrAppend(&out, "  --help, -h\n      Show this help and exit.\n");
  absl::StrAppend(&out, "  --version\n      Print the colod version and exit.\n");
  std::fputs(out.c_str(), stdout);
}

std::string WrapText(absl::string_view text, int indent, int width) {
  const std::string pad(static_cast<size_t>(std::max(indent, 0)), ' ');
  std::string out;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    std::string current;
    for (absl::string_view word : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
      if (!current.empty() && current.size() + 1 + word.size() > static_cast<size_t>(width)) {
        absl::StrAppend(&out, current, "\n");
        current.clear();
      }
      absl::StrAppend(&current, current.empty() ? pad : " ", word);
    }
    absl::StrAppend(&out, current, "\n");
  }
  return out;
}

std::vector<FlagArg> ScanFlags(const std::vector<std::string>& args) {
  std::vector<FlagArg> out;
  for (size_t i = 1; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.size() < 2 || a[0] != '-') continue;  // positional, "-" too
    const size_t start = a[1] == '-' ? 2 : 1;   // Abseil drops at most two dashes
    const size_t end = std::min(a.find('='), a.size());
    if (start >= end) break;  // "--", "--=x", "-=x": the end of flags
    FlagArg f;
    f.index = i;
    f.spelled = a.substr(0, end);
    f.name = a.substr(start, end - start);
    std::replace(f.name.begin(), f.name.end(), '-', '_');
    f.flag = absl::FindCommandLineFlag(f.name);
    if (f.flag == nullptr && absl::StartsWith(f.name, "no")) {  // as Abseil's LocateFlag
      f.flag = absl::FindCommandLineFlag(f.name.substr(2));
      f.negated = f.flag != nullptr;
    }
    if (end < a.size()) {
      f.value = a.substr(end + 1);
    } else if (f.flag != nullptr && !f.negated && !f.flag->IsOfType<bool>() && i + 1 < args.size()) {
      f.value = args[i + 1];
      f.value_next = true;
    }
    out.push_back(std::move(f));
    if (out.back().value_next) ++i;
  }
  return out;
}

namespace {

// Flags Abseil's parser handles itself (usage flags are not in its
// registry in every release): CheckFlags leaves them to it.
bool IsAbseilsOwn(absl::string_view name) {
  static const auto* const kOwn = new std::set<std::string, std::less<>>{
      "help",    "helpfull",        "helpshort", "helppackage", "helpon",     "helpmatch",
      "version", "only_check_args", "flagfile",  "fromenv",     "tryfromenv", "undefok"};
  return kOwn->count(name) > 0;
}

// The names an --undefok value lists, spelt as Abseil's names ('_').
std::set<std::string> UndefokNames(absl::string_view value) {
  std::set<std::string> out;
  for (absl::string_view name : absl::StrSplit(value, ',', absl::SkipEmpty())) {
    std::string n(name);
    std::replace(n.begin(), n.end(), '-', '_');
    out.insert(std::move(n));
  }
  return out;
}

// The lines of the flagfile at `path` as Abseil reads them: leading blanks
// dropped, empty lines and '#' comments skipped, each other line one
// argument that must start with '-' and may not be "--".
absl::StatusOr<std::vector<std::string>> ReadFlagfile(const std::string& path) {
  constexpr size_t kMaxBytes = 1 << 20;
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat("--flagfile: cannot open '", path, "': ", std::strerror(errno)));
  // Read to a bound (a device such as /dev/zero has no end, nor a line end).
  std::string text(kMaxBytes + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  if (in.bad()) return absl::InvalidArgumentError(absl::StrCat("--flagfile: cannot read '", path, "'"));
  text.resize(static_cast<size_t>(in.gcount()));
  if (text.size() > kMaxBytes) return absl::InvalidArgumentError(absl::StrCat("--flagfile ", path, ": over 1 MiB"));
  std::vector<std::string> out;
  int number = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++number;
    const absl::string_view stripped = absl::StripLeadingAsciiWhitespace(line);
    if (stripped.empty() || stripped[0] == '#') continue;
    // A flag with a name: not "-", nor the end of flags ("--", "--=x", "-=x").
    const size_t start = stripped.size() > 1 && stripped[1] == '-' ? 2 : 1;
    if (stripped[0] != '-' || start >= std::min(stripped.find('='), stripped.size())) {
      return absl::InvalidArgumentError(absl::StrCat("--flagfile ", path, ": line ", number, " is not a flag ",
                                                     "(a flagfile holds a --flag=value a line, and # comments)"));
    }
    out.emplace_back(stripped);
  }
  return out;
}

// The flags that --fromenv=NAMES or --tryfromenv=NAMES (`f`) stand for,
// after `program`: --NAME=VALUE for each name (spelt either way) whose
// variable FLAGS_NAME (spelt with '_') is set, as Abseil reads them.
// INVALID_ARGUMENT for a name of --fromenv whose variable is not set, and
// for the names fromenv and tryfromenv.
absl::StatusOr<std::vector<std::string>> FlagsFromEnv(const FlagArg& f, const std::string& program) {
  std::vector<std::string> out = {program};
  for (absl::string_view name : absl::StrSplit(*f.value, ',', absl::SkipEmpty())) {
    std::string n(name);
    std::replace(n.begin(), n.end(), '-', '_');
    if (n == "fromenv" || n == "tryfromenv") {
      return absl::InvalidArgumentError(absl::StrCat(f.spelled, ": cannot read --", name, " from the environment"));
    }
    const std::string variable = "FLAGS_" + n;
    const char* value = std::getenv(variable.c_str());
    if (value == nullptr) {
      if (f.name == "fromenv") {
        return absl::InvalidArgumentError(
            absl::StrCat(f.spelled, ": ", variable, " is not set (--tryfromenv passes over an unset one)"));
      }
      continue;
    }
    out.push_back(absl::StrCat("--", n, "=", value));
  }
  return out;
}

// ExpandFlagSources, `depth` more sources deep at most, reading
// `files_left` more files at most.
absl::StatusOr<std::vector<std::string>> ExpandFlagSourcesWithin(const std::vector<std::string>& args, int depth,
                                                                 int& files_left) {
  std::vector<std::string> out(args.begin(), args.begin() + (args.empty() ? 0 : 1));
  size_t next = 1;
  for (const FlagArg& f : ScanFlags(args)) {
    const bool env = f.name == "fromenv" || f.name == "tryfromenv";
    if (f.name != "flagfile" && !env) continue;
    out.insert(out.end(), args.begin() + static_cast<std::ptrdiff_t>(next),
               args.begin() + static_cast<std::ptrdiff_t>(f.index));
    next = f.index + (f.value_next ? 2 : 1);
    if (!f.value.has_value()) return absl::InvalidArgumentError(absl::StrCat(f.spelled, ": missing its value"));
    if (depth == 0) return absl::InvalidArgumentError(absl::StrCat("--", f.name, ": nested more than 4 deep"));
    if (env) {  // in its place, as Abseil reads them (a --flagfile among them too)
      ASSIGN_OR_RETURN(std::vector<std::string> flags, FlagsFromEnv(f, args.empty() ? std::string() : args[0]));
      ASSIGN_OR_RETURN(std::vector<std::string> expanded, ExpandFlagSourcesWithin(flags, depth - 1, files_left));
      out.insert(out.end(), expanded.begin() + 1, expanded.end());
      continue;
    }
    for (absl::string_view path : absl::StrSplit(*f.value, ',', absl::SkipEmpty())) {
      if (--files_left < 0) return absl::InvalidArgumentError("--flagfile: more than 64 files");
      ASSIGN_OR_RETURN(std::vector<std::string> lines, ReadFlagfile(std::string(path)));
      lines.insert(lines.begin(), args.empty() ? std::string() : args[0]);
      // A file's last flag takes no value from what follows the file (as
      // Abseil reads each file apart): `--work-dir` alone on the last line
      // would take the command line's next flag as its value.
      const std::vector<FlagArg> flags = ScanFlags(lines);
      if (!flags.empty()) {
        const FlagArg& last = flags.back();
        if (last.flag != nullptr && !last.negated && !last.flag->IsOfType<bool>() && !last.value.has_value()) {
          return absl::InvalidArgumentError(
              absl::StrCat("--flagfile ", path, ": ", last.spelled, ": missing its value"));
        }
      }
      ASSIGN_OR_RETURN(std::vector<std::string> expanded, ExpandFlagSourcesWithin(lines, depth - 1, files_left));
      out.insert(out.end(), expanded.begin() + 1, expanded.end());
    }
  }
  out.insert(out.end(), args.begin() + static_cast<std::ptrdiff_t>(std::min(next, args.size())), args.end());
  return out;
}

}  // namespace

std::string DashedName(absl::string_view name) {
  std::string out(name);
  std::replace(out.begin(), out.end(), '_', '-');
  return out;
}

absl::StatusOr<std::vector<std::string>> ExpandFlagSources(const std::vector<std::string>& args) {
  int files_left = 64;
  return ExpandFlagSourcesWithin(args, 4, files_left);
}

absl::Status CheckFlags(const std::vector<std::string>& args) {
  const std::vector<FlagArg> flags = ScanFlags(args);
  std::set<std::string> undefok;  // Abseil's --undefok is its last occurrence
  for (const FlagArg& f : flags) {
    if (f.name == "undefok" && f.value.has_value()) undefok = UndefokNames(*f.value);
  }
  for (const FlagArg& f : flags) {
    if (IsAbseilsOwn(f.name)) continue;
    if (f.flag == nullptr) {
      if (undefok.count(f.name) > 0 || (absl::StartsWith(f.name, "no") && undefok.count(f.name.substr(2)) > 0)) {
        continue;
      }
      return absl::InvalidArgumentError(absl::StrCat(f.spelled, ": no such flag"));
    }
    if (f.negated) {
      if (!f.flag->IsOfType<bool>()) {
        return absl::InvalidArgumentError(
            absl::StrCat(f.spelled, ": --", DashedName(f.flag->Name()), " takes a value, it has no --no form"));
      }
      if (f.value.has_value()) return absl::InvalidArgumentError(absl::StrCat(f.spelled, ": takes no value"));
      continue;
    }
    if (!f.value.has_value()) {
      if (f.flag->IsOfType<bool>()) continue;
      return absl::InvalidArgumentError(absl::StrCat(f.spelled, ": missing its value"));
    }
    // Parsed into the flag, then set back: no value changes here.
    absl::CommandLineFlag* flag = absl::FindCommandLineFlag(f.flag->Name());
    const std::string before = flag->CurrentValue();
    std::string error;
    const bool parsed = flag->ParseFrom(*f.value, &error);
    std::string ignored;
    (void)flag->ParseFrom(before, &ignored);
    if (!parsed) return absl::InvalidArgumentError(absl::StrCat(f.spelled, ": ", error));
  }
  return absl::OkStatus();
}

std::vector<std::string> ParseFlags(int argc, char** argv, absl::string_view usage,
                                    const std::set<std::string>& repeatable) {
  absl::FlagsUsageConfig config;
  config.contains_help_flags = IsOwnFlag;
  config.contains_helpshort_flags = IsOwnFlag;
  config.version_string = [] { return absl::StrCat("colod ", kVersion, "\n"); };
  absl::SetFlagsUsageConfig(config);
  absl::SetProgramUsageMessage(usage);
  // A --flagfile's or --fromenv's flags in its place (Abseil would exit 1
  // on a file it cannot open, an unset variable and on what they hold; the
  // names there are spelt as here).
  absl::StatusOr<std::vector<std::string>> expanded = ExpandFlagSources(std::vector<std::string>(argv, argv + argc));
  if (!expanded.ok()) {
    const std::string program = argc == 0 ? "colod" : std::filesystem::path(argv[0]).filename().string();
    std::fprintf(stderr, "%s: %s\nRun '%s --help' for usage.\n", program.c_str(),
                 std::string(expanded.status().message()).c_str(), program.c_str());
    std::exit(2);
  }
  const std::vector<std::string> given = *std::move(expanded);
  // (Not a flag's value: `--reason -h` is a reason.)
  for (const FlagArg& f : ScanFlags(given)) {
    const std::string& a = given[f.index];
    if (a == "--help" || a == "-h" || a == "-help" || a == "--helpfull") {
      PrintHelp(usage);
      std::exit(0);
    }
    if (a == "--version" || a == "-version") {
      std::printf("colod %s\n", kVersion);
      std::exit(0);
    }
  }
  // Rewrite --data-dir[=x] to --data_dir[=x] for Abseil (and the names an
  // --undefok lists); positional arguments and everything after the end of
  // flags stay as they are. The values of each repeatable flag are joined
  // with commas into one occurrence, where its last one stood.
  std::vector<std::string> rewritten = given;
  std::vector<bool> dropped(given.size(), false);
  struct Repeated {
    std::vector<std::string> values;
    size_t last = 0;  // where its last occurrence stands
  };
  std::map<std::string, Repeated> repeated;
  for (const FlagArg& f : ScanFlags(given)) {
    std::string& a = rewritten[f.index];
    const size_t start = a[1] == '-' ? 2 : 1;
    std::replace(a.begin() + static_cast<std::ptrdiff_t>(start),
                 a.begin() + static_cast<std::ptrdiff_t>(start + f.name.size()), '-', '_');
    if (f.name == "undefok" && f.value.has_value()) {
      std::string& v = rewritten[f.value_next ? f.index + 1 : f.index];
      std::replace(v.end() - static_cast<std::ptrdiff_t>(f.value->size()), v.end(), '-', '_');
    }
    if (repeatable.count(f.name) == 0 || !f.value.has_value()) continue;
    Repeated& r = repeated[f.name];
    r.values.push_back(*f.value);
    r.last = f.index;
    dropped[f.index] = true;
    if (f.value_next) dropped[f.index + 1] = true;
  }
  for (const auto& [name, r] : repeated) {
    rewritten[r.last] = absl::StrCat("--", name, "=", absl::StrJoin(r.values, ","));
    dropped[r.last] = false;
  }
  std::vector<std::string> storage;
  for (size_t i = 0; i < rewritten.size(); ++i) {
    if (!dropped[i]) storage.push_back(std::move(rewritten[i]));
  }
  // A flag Abseil would refuse (exiting 1) is a usage error, as the
  // binaries' others are.
  if (const absl::Status checked = CheckFlags(given); !checked.ok()) {  // named as the user spelt them
    const std::string program = given.empty() ? "colod" : std::filesystem::path(given[0]).filename().string();
    std::fprintf(stderr, "%s: %s\nRun '%s --help' for usage.\n", program.c_str(),
                 std::string(checked.message()).c_str(), program.c_str());
    std::exit(2);
  }
  std::vector<char*> normalized;
  for (std::string& a : storage) normalized.push_back(a.data());
  std::vector<char*> positional =
      absl::ParseCommandLine(static_cast<int>(normalized.size()), normalized.data());
  std::vector<std::string> out;
  for (size_t i = 1; i < positional.size(); ++i) out.emplace_back(positional[i]);
  // `storage` dies here; `out` holds copies.
  return out;
}

absl::StatusOr<int64_t> ParseByteSize(absl::string_view text) {
  const absl::string_view t = absl::StripAsciiWhitespace(text);
  size_t digits = 0;
  while (digits < t.size() && (absl::ascii_isdigit(t[digits]) || t[digits] == '.')) ++digits;
  const absl::string_view number = t.substr(0, digits), unit = absl::StripAsciiWhitespace(t.substr(digits));
  auto bad = [&] {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", text, "' is not a byte size: a number of bytes, or one with KiB, MiB, GiB, TiB (or KB, MB, GB, TB)"));
  };
  if (number.empty()) return bad();
  static constexpr struct {
    const char* name;
    double factor;
  } kUnits[] = {{"", 1},          {"B", 1},          {"KiB", 1024.0},   {"MiB", 1048576.0},
                {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}, {"KB", 1e3}, {"MB", 1e6},
                {"GB", 1e9},      {"TB", 1e12}};
  for (const auto& u : kUnits) {
    if (unit != u.name) continue;
    double value = 0;
    if (!absl::SimpleAtod(number, &value) || !(value >= 0)) return bad();
    const double bytes = value * u.factor;
    if (!(bytes < 9.2e18)) return absl::InvalidArgumentError(absl::StrCat("'", text, "' is too large"));
    if (u.factor == 1 && number.find('.') != absl::string_view::npos) return bad();  // a fraction of a byte
    return static_cast<int64_t>(bytes);
  }
  return bad();
}

}  // namespace colod
