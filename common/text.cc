#include "common/text.h"

#include <algorithm>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace colod {
namespace {

// The length of the well-formed UTF-8 sequence at `s[i]` (RFC 3629's
// table), or 0 where none starts there.
size_t SequenceLength(absl::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return 1;
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    n = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    n = 3;
    if (b0 == 0xE0) lo = 0xA0;  // no overlong form
    if (b0 == 0xED) hi = 0x9F;  // no surrogate
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    n = 4;
    if (b0 == 0xF0) lo = 0x90;  // no overlong form
    if (b0 == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  if (byte(i + 1) < lo || byte(i + 1) > hi) return 0;
  for (size_t k = 2; k < n; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) return 0;
  }
  return n;
}

constexpr absl::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

}  // namespace

std::string EscapedPrefix(absl::string_view text, size_t max) {
  return text.size() > max ? absl::StrCat(absl::CHexEscape(text.substr(0, max)), "...") : absl::CHexEscape(text);
}

std::string UnreadTensorsNote(int64_t count, const std::vector<std::string>& names) {
  constexpr size_t kNamed = 8;
  std::vector<std::string> named(names.begin(), names.begin() + std::min(names.size(), kNamed));
  const int64_t more = count - static_cast<int64_t>(named.size());
  // (Names from a file's header, escaped: they may reach a terminal.)
  for (std::string& n : named) n = EscapedPrefix(n, kMaxUnreadTensorNameBytes);
  return absl::StrCat(kUnreadTensors, count,
                      " (not this model's: another model's head, or a config.json of fewer layers than the "
                      "weights?): ",
                      absl::StrJoin(named, ", "), more > 0 ? absl::StrCat(" and ", more, " more") : "");
}

std::string TrainingStartMessage(absl::string_view checkpoint, int64_t step, const std::vector<std::string>& skipped,
                                 const std::vector<std::string>& unread) {
  // (Made valid UTF-8 before they are measured: a path's stray byte
  // becomes three, which the last cut would take from the note.)
  std::vector<std::string> parts;
  if (!checkpoint.empty()) parts.push_back(ValidUtf8(absl::StrCat("resumed from ", checkpoint, " (step ", step, ")")));
  const std::string note = unread.empty() ? "" : UnreadTensorsNote(unread);
  if (!skipped.empty()) {
    std::string damaged = ValidUtf8(absl::StrCat(kPassedOverDamaged, absl::StrJoin(skipped, "; ")));
    size_t other = note.size() + 4;  // and two "; "
    for (const std::string& p : parts) other += p.size();
    const size_t room = other + 64 < kMaxReportedMessageBytes ? kMaxReportedMessageBytes - other : 64;
    if (damaged.size() > room) damaged = Utf8Prefix(damaged, room);
    parts.push_back(std::move(damaged));
  }
  if (!note.empty()) parts.push_back(note);  // last: coloctl prints it to the message's end
  return Utf8Prefix(absl::StrJoin(parts, "; "), kMaxReportedMessageBytes);
}

std::string ValidUtf8(absl::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();) {
    const size_t n = SequenceLength(text, i);
    if (n == 0) {
      out.append(kReplacement.data(), kReplacement.size());
      ++i;
    } else {
      out.append(text.data() + i, n);
      i += n;
    }
  }
  return out;
}

bool IsValidUtf8(absl::string_view text) { return ValidUtf8(text) == text; }

std::string Utf8Prefix(absl::string_view text, size_t max) {
  std::string out = ValidUtf8(text);
  if (out.size() <= max) return out;
  size_t cut = max < 3 ? 0 : max - 3;
  while (cut > 0 && (static_cast<unsigned char>(out[cut]) & 0xC0) == 0x80) --cut;
  out.resize(cut);
  out += "...";
  return out;
}

}  // namespace colod
