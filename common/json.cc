#include "common/json.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace colod {

nlohmann::json ParseJson(absl::string_view text, int max_depth) {
  // The deepest nesting, strings skipped: a linear scan before the parse.
  int depth = 0;
  bool in_string = false, escaped = false;
  for (const char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) return nlohmann::json(nlohmann::json::value_t::discarded);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
}

std::string DescribeJson(const nlohmann::json& value) {
  constexpr size_t kMax = 80;
  if (value.is_string()) {
    const std::string& s = value.get_ref<const std::string&>();
    const nlohmann::json cut = s.substr(0, kMax);
    // A cut may split a UTF-8 sequence: replaced, not thrown on.
    return absl::StrCat(JsonText(cut), s.size() > kMax ? "..." : "");
  }
  if (value.is_array()) return absl::StrCat("an array of ", value.size());
  if (value.is_object()) return absl::StrCat("an object of ", value.size(), " keys");
  if (value.is_discarded()) return "not JSON";
  return JsonText(value);  // a number, a boolean, null
}

std::string JsonText(const nlohmann::json& value, int indent) {
  return value.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace colod
