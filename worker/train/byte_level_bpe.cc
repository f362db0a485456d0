#include "worker/train/byte_level_bpe.h"

#include <queue>

#include "absl/strings/str_cat.h"
#include "unicode/uchar.h"

namespace colod::train {
namespace {

constexpr int64_t kMaxId = (int64_t{1} << 31) - 1;

// bytes_to_unicode: the code point that stands for each byte.
const std::array<UChar32, 256>& ByteCodePoints() {
  static const std::array<UChar32, 256> table = [] {
    std::array<UChar32, 256> t{};
    auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
    int next = 256;
    for (int b = 0; b < 256; ++b) t[b] = printable(b) ? b : next++;
    return t;
  }();
  return table;
}

// The byte a code point stands for, or -1.
int ByteOf(UChar32 c) {
  static const std::vector<int> inverse = [] {
    std::vector<int> v(512, -1);
    for (int b = 0; b < 256; ++b) v[ByteCodePoints()[b]] = b;
    return v;
  }();
  return c >= 0 && c < static_cast<UChar32>(inverse.size()) ? inverse[c] : -1;
}

// UTF-8 of a code point below U+0800 (the byte alphabet's).
std::string Utf8(UChar32 c) {
  if (c < 0x80) return std::string(1, static_cast<char>(c));
  return {static_cast<char>(0xC0 | (c >> 6)), static_cast<char>(0x80 | (c & 0x3F))};
}

enum class Class { kLetter, kNumber, kSpace, kOther };

Class Classify(UChar32 c) {
  if (c < 0) return Class::kOther;
  if (u_isUWhiteSpace(c)) return Class::kSpace;
  switch (u_charType(c)) {
    case U_UPPERCASE_LETTER:
    case U_LOWERCASE_LETTER:
    case U_TITLECASE_LETTER:
    case U_MODIFIER_LETTER:
    case U_OTHER_LETTER: return Class::kLetter;
    case U_DECIMAL_DIGIT_NUMBER:
    case U_LETTER_NUMBER:
    case U_OTHER_NUMBER: return Class::kNumber;
    default: return Class::kOther;
  }
}

// The code point at byte `i` of `s` (strict UTF-8: no overlong forms,
// surrogates or values past U+10FFFF) and its length; a byte that does not
// start a valid sequence is c = -1 of length 1.
struct Decoded {
  UChar32 c;
  size_t length;
};
Decoded DecodeAt(absl::string_view s, size_t i) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char b0 = byte(i);
  if (b0 < 0x80) return {b0, 1};
  size_t length;
  UChar32 c;
  unsigned char lo = 0x80, hi = 0xBF;  // the second byte's range
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    length = 2, c = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    length = 3, c = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    length = 4, c = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return {-1, 1};
  }
  if (s.size() - i < length) return {-1, 1};
  for (size_t k = 1; k < length; ++k) {
    const unsigned char b = byte(i + k);
    if (k == 1 ? (b < lo || b > hi) : (b < 0x80 || b > 0xBF)) return {-1, 1};
    c = (c << 6) | (b & 0x3F);
  }
  return {c, length};
}

// The bytes a vocabulary symbol stands for; nullopt when it holds a code
// point outside the byte alphabet (or is not UTF-8).
std::optional<std::string> SymbolBytes(const std::string& symbol) {
  std::string out;
  for (size_t i = 0; i < symbol.size();) {
    const Decoded d = DecodeAt(symbol, i);
    const int b = ByteOf(d.c);
    if (b < 0) return std::nullopt;
    out.push_back(static_cast<char>(b));
    i += d.length;
  }
  return out;
}

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

}  // namespace

std::string ByteLevelBpe::ByteSymbol(uint8_t byte) { return Utf8(ByteCodePoints()[byte]); }

void ByteLevelBpe::PreTokenize(absl::string_view text, absl::FunctionRef<void(absl::string_view)> word) {
  const size_t n = text.size();
  // The class of the code point at byte i and where the next one starts.
  auto at = [&](size_t i) {
    const Decoded d = DecodeAt(text, i);
    return std::make_pair(Classify(d.c), i + d.length);
  };
  auto run = [&](size_t i, Class cls) {
    while (i < n) {
      const auto [c, next] = at(i);
      if (c != cls) break;
      i = next;
    }
    return i;
  };
  auto ascii = [&](size_t i, char ch) { return i < n && text[i] == ch; };
  size_t i = 0;
  while (i < n) {
    size_t end = i;
    // 's|'t|'re|'ve|'m|'ll|'d
    if (ascii(i, '\'')) {
      if (ascii(i + 1, 's') || ascii(i + 1, 't') || ascii(i + 1, 'm') || ascii(i + 1, 'd')) {
        end = i + 2;
      } else if ((ascii(i + 1, 'r') && ascii(i + 2, 'e')) || (ascii(i + 1, 'v') && ascii(i + 2, 'e')) ||
                 (ascii(i + 1, 'l') && ascii(i + 2, 'l'))) {
        end = i + 3;
      }
    }
    if (end == i) {
      // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional space, then a run of one class.
      size_t head = i;
      if (ascii(i, ' ') && i + 1 < n && at(i + 1).first != Class::kSpace) head = i + 1;
      const Class cls = at(head).first;
      if (cls != Class::kSpace) {
        end = run(head, cls);
      } else {
        // `\s+(?!\S)|\s+`: white space, less its last character when more
        // than one precede a non-space (that one joins the next word).
        size_t last = i;  // where the run's last character starts
        end = i;
        while (end < n) {
          const auto [c, next] = at(end);
          if (c != Class::kSpace) break;
          last = end;
          end = next;
        }
        if (end < n && last > i) end = last;
      }
    }
    word(text.substr(i, end - i));
    i = end;
  }
}

std::vector<absl::string_view> ByteLevelBpe::PreTokenize(absl::string_view text) {
  std::vector<absl::string_view> words;
  PreTokenize(text, [&](absl::string_view w) { words.push_back(w); });
  return words;
}

absl::StatusOr<std::unique_ptr<ByteLevelBpe>> ByteLevelBpe::Create(
    const absl::flat_hash_map<std::string, int64_t>& vocab,
    const std::vector<std::pair<std::string, std::string>>& merges, Options options) {
  int64_t size = 0;
  for (const auto& [symbol, id] : vocab) {
    if (id < 0 || id > kMaxId) {
      return absl::InvalidArgumentError(absl::StrCat("vocabulary id ", id, " of '", symbol, "' is outside [0, 2^31)"));
    }
    size = std::max(size, id + 1);
  }
  for (const auto& [id, content] : options.added) {
    if (id < 0 || id > kMaxId) {
      return absl::InvalidArgumentError(absl::StrCat("added token id ", id, " of '", content, "' is outside [0, 2^31)"));
    }
    size = std::max(size, id + 1);
  }
  // A sparse vocabulary would make the tables below as large as its largest id.
  const int64_t entries = static_cast<int64_t>(vocab.size() + options.added.size());
  if (size > 2 * entries + 1024) {
    return absl::InvalidArgumentError(absl::StrCat("vocabulary ids run to ", size - 1, " for only ", entries,
                                                   " tokens; ids must be dense"));
  }
  std::unique_ptr<ByteLevelBpe> bpe(new ByteLevelBpe(std::move(options)));
  bpe->symbols_.assign(size, "");
  bpe->is_id_.assign(size, false);
  for (const auto& [symbol, id] : vocab) {
    if (bpe->is_id_[id]) return absl::InvalidArgumentError(absl::StrCat("vocabulary id ", id, " is used twice"));
    bpe->is_id_[id] = true;
    std::optional<std::string> bytes = SymbolBytes(symbol);
    bpe->symbols_[id] = bytes.has_value() ? *bytes : symbol;
    bpe->vocab_.emplace(symbol, static_cast<int32_t>(id));
  }
  for (const auto& [id, content] : bpe->options_.added) {
    // Decoding gives each id one text: an id both a symbol and an added token would not round-trip.
    if (bpe->is_id_[id]) {
      return absl::InvalidArgumentError(absl::StrCat("added token '", content, "' has id ", id, ", which is taken by '",
                                                     bpe->symbols_[id], "'"));
    }
    bpe->is_id_[id] = true;
    bpe->symbols_[id] = content;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = bpe->vocab_.find(ByteSymbol(static_cast<uint8_t>(b)));
    if (it == bpe->vocab_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("the vocabulary lacks the symbol of byte ", b, " ('",
                                                     ByteSymbol(static_cast<uint8_t>(b)), "'): not byte-level"));
    }
    bpe->byte_ids_[b] = it->second;
  }
  if (merges.size() > static_cast<size_t>(kMaxId)) return absl::InvalidArgumentError("too many merges");
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    auto l = bpe->vocab_.find(left), r = bpe->vocab_.find(right), m = bpe->vocab_.find(left + right);
    if (l == bpe->vocab_.end() || r == bpe->vocab_.end() || m == bpe->vocab_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("merge ", rank + 1, " '", left, " ", right, "': '",
                                                     l == bpe->vocab_.end() ? left
                                                     : r == bpe->vocab_.end() ? right
                                                                              : left + right,
                                                     "' is not in the vocabulary"));
    }
    // A pair listed twice ranks as its last listing, as in GPT-2's dict of the merges.
    bpe->merges_.insert_or_assign(PairKey(l->second, r->second), Merge{static_cast<int32_t>(rank), m->second});
  }
  for (std::optional<int64_t> special : {bpe->options_.bos, bpe->options_.eos}) {
    if (special.has_value() && (*special < 0 || *special >= size || !bpe->is_id_[*special])) {
      return absl::InvalidArgumentError(absl::StrCat("special token id ", *special, " is not in the vocabulary"));
    }
  }
  return bpe;
}

void ByteLevelBpe::EncodeWord(absl::string_view word, std::vector<int32_t>& sym, std::vector<int64_t>& out) const {
  if (options_.ignore_merges) {
    std::string symbols;
    for (unsigned char b : word) symbols += ByteSymbol(b);
    if (auto it = vocab_.find(symbols); it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  const int n = static_cast<int>(word.size());
  sym.resize(n);
  for (int i = 0; i < n; ++i) sym[i] = byte_ids_[static_cast<unsigned char>(word[i])];
  std::vector<int> next(n), prev(n);
  std::vector<bool> alive(n, true);
  for (int i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  struct Candidate {
    int32_t rank;
    int pos;
    int32_t left, right, result;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto consider = [&](int pos) {
    if (pos < 0 || next[pos] < 0) return;
    auto it = merges_.find(PairKey(sym[pos], sym[next[pos]]));
    if (it != merges_.end()) heap.push(Candidate{it->second.rank, pos, sym[pos], sym[next[pos]], it->second.result});
  };
  for (int i = 0; i + 1 < n; ++i) consider(i);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    const int j = next[c.pos];
    // Stale: the pair at this position has changed since it was queued.
    if (!alive[c.pos] || j < 0 || sym[c.pos] != c.left || sym[j] != c.right) continue;
    sym[c.pos] = c.result;
    alive[j] = false;
    next[c.pos] = next[j];
    if (next[j] >= 0) prev[next[j]] = c.pos;
    consider(prev[c.pos]);
    consider(c.pos);
  }
  for (int i = 0; i >= 0 && i < n; i = next[i]) out.push_back(sym[i]);
}

absl::StatusOr<std::vector<int64_t>> ByteLevelBpe::Encode(absl::string_view text) const {
  std::string prefixed;
  if (options_.add_prefix_space && !text.empty() && text[0] != ' ') {
    prefixed = absl::StrCat(" ", text);
    text = prefixed;
  }
  std::vector<int64_t> out;
  out.reserve(text.size() / 3);
  std::vector<int32_t> scratch;
  // Natural text repeats its words: each distinct one is merged once per call.
  absl::flat_hash_map<absl::string_view, std::pair<size_t, size_t>> seen;  // word -> its ids in `out`
  PreTokenize(text, [&](absl::string_view word) {
    if (auto it = seen.find(word); it != seen.end()) {
      const auto [from, count] = it->second;
      for (size_t k = 0; k < count; ++k) out.push_back(out[from + k]);
      return;
    }
    const size_t from = out.size();
    for (size_t at = 0; at < word.size(); at += kMaxWordBytes) EncodeWord(word.substr(at, kMaxWordBytes), scratch, out);
    if (word.size() <= 64 && seen.size() < (size_t{1} << 20)) seen.emplace(word, std::make_pair(from, out.size() - from));
  });
  return out;
}

absl::StatusOr<std::string> ByteLevelBpe::Decode(absl::Span<const int64_t> ids) const {
  std::string out;
  for (int64_t id : ids) {
    if (id < 0 || id >= vocab_size() || !is_id_[id]) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", id, " is not in the vocabulary of ", vocab_size()));
    }
    out += symbols_[id];
  }
  return out;
}

}  // namespace colod::train
