#include "common/text.h"

#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/escaping.h"
#include "gtest/gtest.h"

namespace colod {
namespace {

// Whether `s` is well-formed UTF-8, by the standard library's own decoder
// (mbrtowc in a UTF-8 locale would depend on the host's locales; this
// checks the structure the way RFC 3629 states it, independently written:
// decode each sequence to its code point and check the code point's range).
bool WellFormed(const std::string& s) {
  for (size_t i = 0; i < s.size();) {
    const unsigned char b = static_cast<unsigned char>(s[i]);
    int n = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xE ? 3 : (b >> 3) == 0x1E ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    uint32_t cp = n == 1 ? b : n == 2 ? (b & 0x1F) : n == 3 ? (b & 0x0F) : (b & 0x07);
    for (int k = 1; k < n; ++k) {
      const unsigned char c = static_cast<unsigned char>(s[i + k]);
      if ((c & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (c & 0x3F);
    }
    const uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    i += n;
  }
  return true;
}

TEST(Text, ValidTextIsKeptAsItIs) {
  const std::string text = "plain, caf\xC3\xA9, \xE2\x82\xAC, \xF0\x9F\x98\x80, \xF4\x8F\xBF\xBF";
  ASSERT_TRUE(WellFormed(text));
  EXPECT_EQ(ValidUtf8(text), text);
  EXPECT_EQ(Utf8Prefix(text, 1000), text);
  EXPECT_TRUE(IsValidUtf8(text));
  EXPECT_TRUE(IsValidUtf8("\xEF\xBF\xBD"));  // U+FFFD itself
  EXPECT_FALSE(IsValidUtf8("job-\xFF"));
  EXPECT_FALSE(IsValidUtf8("\xC3"));
}

TEST(Text, EachBadByteBecomesOneReplacementCharacter) {
  const std::string fffd = "\xEF\xBF\xBD";
  EXPECT_EQ(ValidUtf8("a\xFF" "b"), "a" + fffd + "b");                    // never in UTF-8
  EXPECT_EQ(ValidUtf8("\x80"), fffd);                                      // a stray continuation
  EXPECT_EQ(ValidUtf8("\xC3"), fffd);                                      // cut short at the end
  EXPECT_EQ(ValidUtf8("\xC3" "a"), fffd + "a");                            // cut short before ASCII
  EXPECT_EQ(ValidUtf8("\xC0\xAF"), fffd + fffd);                           // overlong '/'
  EXPECT_EQ(ValidUtf8("\xE0\x80\xAF"), fffd + fffd + fffd);                // overlong, 3 bytes
  EXPECT_EQ(ValidUtf8("\xED\xA0\x80"), fffd + fffd + fffd);                // a surrogate
  EXPECT_EQ(ValidUtf8("\xF4\x90\x80\x80"), fffd + fffd + fffd + fffd);     // past U+10FFFF
  // Every byte value, alone and in every pair: the result is well-formed.
  for (int a = 0; a < 256; ++a) {
    for (int b = 0; b < 256; b += 7) {
      const std::string in{static_cast<char>(a), static_cast<char>(b), '\xA9'};
      EXPECT_TRUE(WellFormed(ValidUtf8(in))) << a << " " << b;
    }
  }
}

TEST(Text, APrefixIsCutAtACharactersStartAndMarked) {
  const std::string euros = "\xE2\x82\xAC\xE2\x82\xAC\xE2\x82\xAC";  // three 3-byte characters
  EXPECT_EQ(Utf8Prefix(euros, 9), euros);
  EXPECT_EQ(Utf8Prefix(euros, 8), "\xE2\x82\xAC...");    // room for one character and the mark
  EXPECT_EQ(Utf8Prefix(euros, 5), "...");                // none fits before the mark
  const std::string big(100000, 'x');
  const std::string cut = Utf8Prefix(big + "\xFF", kMaxReportedMessageBytes);
  EXPECT_EQ(cut.size(), kMaxReportedMessageBytes);
  EXPECT_EQ(cut.substr(cut.size() - 3), "...");
  for (size_t max = 3; max < 40; ++max) {
    const std::string p = Utf8Prefix("a\xC3\xA9\xF0\x9F\x98\x80\xFF\xE2\x82\xAC tail text", max);
    EXPECT_LE(p.size(), max);
    EXPECT_TRUE(WellFormed(p)) << max;
  }
}

// Input quoted in an error: every byte that is not printable ASCII
// escaped (a terminal's escape sequence, a stray byte, a NUL), the quote
// cut at `max` input bytes and marked.
TEST(Text, AnEscapedPrefixIsPrintableAsciiCutAndMarked) {
  EXPECT_EQ(EscapedPrefix("bf16", 64), "bf16");
  const std::string raw("a\x1b[2Jb\0c\xff'\"\n", 12);
  const std::string escaped = EscapedPrefix(raw, 64);
  for (char c : escaped) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << static_cast<int>(c);
  std::string back;
  ASSERT_TRUE(absl::CUnescape(escaped, &back));
  EXPECT_EQ(back, raw);  // nothing lost
  EXPECT_EQ(EscapedPrefix("abcdef", 3), "abc...");
  EXPECT_EQ(EscapedPrefix("abc", 3), "abc");
  const std::string hostile = std::string(1 << 20, '\x1b');
  const std::string quoted = EscapedPrefix(hostile, 128);
  EXPECT_EQ(quoted.size(), 128 * 4 + 3);
  for (char c : quoted) EXPECT_TRUE(c >= 0x20 && c < 0x7f) << static_cast<int>(c);
}

// Rank 0's TRAINING message: each part where there is one, the unread note
// last; a list of damaged checkpoints too long for what the coordinator
// keeps is cut so that the note survives whole.
TEST(Text, TrainingStartMessageKeepsTheUnreadNoteWithinTheReportedBound) {
  EXPECT_EQ(TrainingStartMessage("", 0, {}, {}), "");
  EXPECT_EQ(TrainingStartMessage("/ck/step-000005", 5, {}, {}), "resumed from /ck/step-000005 (step 5)");
  EXPECT_EQ(
      TrainingStartMessage("/ck/step-000005", 5, {"step-000007: no train_state.json"}, {}),
      std::string("resumed from /ck/step-000005 (step 5); ") + kPassedOverDamaged + "step-000007: no train_state.json");
  const std::string note = UnreadTensorsNote({"score.weight"});
  EXPECT_EQ(TrainingStartMessage("", 0, {}, {"score.weight"}), note);

  std::vector<std::string> skipped;
  for (int i = 0; i < 1000; ++i) skipped.push_back("step-" + std::to_string(i) + ": " + std::string(100, 'x'));
  const std::vector<std::string> unread(20, std::string(300, '\x01'));  // escaped 4 bytes each, cut at 256
  const std::string long_note = UnreadTensorsNote(unread);
  ASSERT_GT(long_note.size(), 8000u);
  const std::string m = TrainingStartMessage("/ck/step-000005", 5, skipped, unread);
  EXPECT_LE(m.size(), kMaxReportedMessageBytes);
  EXPECT_GT(m.size(), kMaxReportedMessageBytes - 8);  // the damaged list filled the rest
  EXPECT_EQ(m.rfind("resumed from /ck/step-000005 (step 5); ", 0), 0u) << m.substr(0, 80);
  EXPECT_NE(m.find(std::string(kPassedOverDamaged) + "step-0: "), std::string::npos);
  ASSERT_GE(m.size(), long_note.size());
  EXPECT_EQ(m.substr(m.size() - long_note.size()), long_note);
  EXPECT_EQ(m.substr(m.size() - long_note.size() - 5, 5), "...; ");
  EXPECT_TRUE(IsValidUtf8(m));
  // Bytes that are not UTF-8 (each becomes a 3-byte U+FFFD) in the path and
  // the reasons: measured as sent, the note still whole.
  for (std::string& s : skipped) s += "\xff\xfe";
  const std::string bad = TrainingStartMessage("/ck/\xff\xff/step-000005", 5, skipped, unread);
  EXPECT_LE(bad.size(), kMaxReportedMessageBytes);
  EXPECT_TRUE(IsValidUtf8(bad));
  ASSERT_GE(bad.size(), long_note.size());
  EXPECT_EQ(bad.substr(bad.size() - long_note.size()), long_note);
}

}  // namespace
}  // namespace colod
