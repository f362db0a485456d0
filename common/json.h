#ifndef COLOD_COMMON_JSON_H_
#define COLOD_COMMON_JSON_H_

#include <string>

#include "absl/strings/string_view.h"
#include "nlohmann/json.hpp"

namespace colod {

// Arrays and objects nested deeper than this in JSON from input are refused:
// nlohmann's parser and destructor are iterative, but copies, comparisons
// and dump() recurse, and a file of a million '[' would overflow a thread's
// stack there. Every file colod reads nests a few levels.
inline constexpr int kMaxJsonDepth = 100;

// `text` parsed, as nlohmann::json::parse(text, nullptr, false) does: a
// discarded value (is_discarded()) where it is not JSON, or where it nests
// deeper than `max_depth`. Never throws. Thread-safe.
nlohmann::json ParseJson(absl::string_view text, int max_depth = kMaxJsonDepth);

// A value from input, described for an error message in at most about 100
// characters: a number, a boolean or null as JSON, a string quoted and cut,
// an array or an object by its size. Never dumps a nested value (whose text
// may be huge), never throws. Thread-safe.
std::string DescribeJson(const nlohmann::json& value);

// `value` as JSON text (indented by `indent` spaces a level, or one line
// for -1), bytes that are not UTF-8 replaced by U+FFFD rather than thrown on
// (a file name or a flag from a command line may hold any). Thread-safe.
std::string JsonText(const nlohmann::json& value, int indent = -1);

}  // namespace colod

#endif  // COLOD_COMMON_JSON_H_
