#include "tests/testing/promql_refs.h"

#include <cctype>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace colod::testing {
namespace {

struct Token {
  enum Kind { kIdent, kNumber, kString, kPunct, kEnd };
  Kind kind = kEnd;
  std::string text;  // a string's contents without quotes; "[]" for a whole range or subquery
};

bool IdentStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_' || c == ':'; }
bool IdentChar(char c) { return IdentStart(c) || std::isdigit(static_cast<unsigned char>(c)); }

// Splits `s` into tokens; false (with `error`) for an unterminated string or bracket.
bool Tokenize(absl::string_view s, std::vector<Token>* out, std::string* error) {
  size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++i;
    } else if (c == '#') {  // a comment, to the end of the line
      while (i < s.size() && s[i] != '\n') ++i;
    } else if (IdentStart(c)) {
      size_t j = i;
      while (j < s.size() && IdentChar(s[j])) ++j;
      out->push_back({Token::kIdent, std::string(s.substr(i, j - i))});
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c)) ||
               (c == '.' && i + 1 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1])))) {
      size_t j = i;  // numbers, hex, exponents and durations (5m, 1h30m)
      while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '.')) {
        const bool exponent = (s[j] == 'e' || s[j] == 'E') && j + 1 < s.size() && (s[j + 1] == '+' || s[j + 1] == '-');
        j += exponent ? 2 : 1;
      }
      out->push_back({Token::kNumber, std::string(s.substr(i, j - i))});
      i = j;
    } else if (c == '"' || c == '\'' || c == '`') {
      size_t j = i + 1;
      std::string text;
      while (j < s.size() && s[j] != c) {
        if (s[j] == '\\' && c != '`' && j + 1 < s.size()) ++j;
        text += s[j++];
      }
      if (j >= s.size()) {
        *error = "an unterminated string";
        return false;
      }
      out->push_back({Token::kString, text});
      i = j + 1;
    } else if (c == '[') {  // a range or a subquery: nothing this reader needs
      const size_t end = s.find(']', i);
      if (end == absl::string_view::npos) {
        *error = "an unclosed '['";
        return false;
      }
      out->push_back({Token::kPunct, "[]"});
      i = end + 1;
    } else {
      static const char* const kTwo[] = {"==", "!=", "<=", ">=", "=~", "!~"};
      std::string op(1, c);
      for (const char* two : kTwo) {
        if (s.substr(i, 2) == two) op = two;
      }
      out->push_back({Token::kPunct, op});
      i += op.size();
    }
  }
  out->push_back({Token::kEnd, ""});
  return true;
}

bool IsAggregator(const std::string& lc) {
  static const char* const kAggregators[] = {"sum",   "avg",    "min",      "max",         "count",
                                             "group", "stddev", "stdvar",   "topk",        "bottomk",
                                             "quantile", "count_values", "limitk", "limit_ratio"};
  for (const char* a : kAggregators) {
    if (lc == a) return true;
  }
  return false;
}

// The series a (sub)expression combines: a metric's, or the label set an
// aggregation leaves.
struct Source {
  std::string name;              // a metric or recording rule; empty for `labels`
  std::set<std::string> labels;  // when `name` is empty
};
using Sources = std::vector<Source>;

class Reader {
 public:
  Reader(std::vector<Token> tokens, const LabelLookup& labels_of, PromqlRefs* out)
      : tokens_(std::move(tokens)), labels_of_(labels_of), out_(out) {}

  void Read() {
    const Sources sources = Sequence();
    if (Peek().kind != Token::kEnd) Problem(absl::StrCat("unexpected '", Peek().text, "'"));
    for (const Source& s : sources) {
      const std::set<std::string> labels = LabelsOf(s);
      out_->output_labels.insert(labels.begin(), labels.end());
    }
  }

 private:
  const Token& Peek(size_t ahead = 0) const { return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)]; }
  Token Next() {
    Token t = Peek();
    if (pos_ < tokens_.size() - 1) ++pos_;
    return t;
  }
  bool PeekPunct(const char* p, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::kPunct && Peek(ahead).text == p;
  }
  bool Consume(const char* p) {
    if (!PeekPunct(p)) return false;
    Next();
    return true;
  }
  bool Expect(const char* p) {
    if (Consume(p)) return true;
    Problem(absl::StrCat("expected '", p, "', found '", Peek().text, "'"));
    failed_ = true;
    return false;
  }
  std::string PeekLower(size_t ahead = 0) const {
    return Peek(ahead).kind == Token::kIdent ? absl::AsciiStrToLower(Peek(ahead).text) : "";
  }
  void Problem(const std::string& p) { out_->problems.push_back(p); }

  std::set<std::string> LabelsOf(const Source& s) {
    if (s.name.empty()) return s.labels;
    std::optional<std::set<std::string>> labels = labels_of_(s.name);
    if (!labels) {
      if (unknown_.insert(s.name).second) Problem(absl::StrCat(s.name, " is not exported"));
      return {};
    }
    return *labels;
  }

  static std::string Describe(const Source& s) {
    return s.name.empty() ? absl::StrCat("an aggregation by (", absl::StrJoin(s.labels, ", "), ")") : s.name;
  }

  // Every label of `labels` on each source (all) or on one of them at least.
  void Require(const Sources& sources, const std::set<std::string>& labels, bool all, const std::string& where) {
    for (const std::string& label : labels) {
      bool somewhere = false;
      std::vector<std::string> lacking;
      for (const Source& s : sources) {
        const std::set<std::string> has = LabelsOf(s);
        if (has.count(label)) {
          somewhere = true;
        } else if (!s.name.empty() && unknown_.count(s.name)) {
          somewhere = true;  // reported already
        } else {
          lacking.push_back(Describe(s));
        }
      }
      if (all) {
        for (const std::string& l : lacking) Problem(absl::StrCat(l, " has no label '", label, "' (", where, ")"));
      } else if (!somewhere) {
        Problem(absl::StrCat("no operand has the label '", label, "' (", where, ")"));
      }
    }
  }

  // ( a, b, ... )
  std::set<std::string> LabelList() {
    std::set<std::string> labels;
    if (!Expect("(")) return labels;
    while (!failed_ && !Consume(")")) {
      const Token t = Next();
      if (t.kind == Token::kIdent || t.kind == Token::kString) {
        labels.insert(t.text);
      } else if (!(t.kind == Token::kPunct && t.text == ",")) {
        Problem(absl::StrCat("unexpected '", t.text, "' in a label list"));
        failed_ = true;
      }
    }
    return labels;
  }

  // { l="v", ... } after a metric name: the label names; `name` gets
  // __name__="..." when there is one.
  std::set<std::string> Matchers(std::string* name) {
    std::set<std::string> labels;
    Expect("{");
    while (!failed_ && !Consume("}")) {
      const Token label = Next();
      const Token op = Next();
      const Token value = Next();
      if ((label.kind != Token::kIdent && label.kind != Token::kString) || op.kind != Token::kPunct ||
          value.kind != Token::kString) {
        Problem("cannot read a label matcher");
        failed_ = true;
        break;
      }
      if (label.text == "__name__") {
        if (op.text == "=") *name = value.text;
      } else {
        labels.insert(label.text);
      }
      Consume(",");
    }
    return labels;
  }

  Sources Selector(std::string name) {
    std::set<std::string> matched;
    if (PeekPunct("{")) matched = Matchers(&name);
    if (name.empty()) {
      Problem("a selector without a metric name");
      return {};
    }
    out_->names.insert(name);
    Sources s = {Source{name, {}}};
    Require(s, matched, true, "matcher");
    return s;
  }

  // The comma-separated arguments of a call, through the closing ')'.
  Sources Arguments() {
    Sources args;
    if (!Expect("(")) return args;
    if (Consume(")")) return args;
    do {
      Sources a = Sequence();
      args.insert(args.end(), a.begin(), a.end());
    } while (!failed_ && Consume(","));
    Expect(")");
    return args;
  }

  Sources Aggregation(const std::string& op) {
    std::string modifier;
    std::set<std::string> labels;
    if (PeekLower() == "by" || PeekLower() == "without") {
      modifier = PeekLower();
      Next();
      labels = LabelList();
    }
    Sources args = Arguments();
    if (modifier.empty() && (PeekLower() == "by" || PeekLower() == "without")) {
      modifier = PeekLower();
      Next();
      labels = LabelList();
    }
    const bool keeps_series = op == "topk" || op == "bottomk" || op == "limitk" || op == "limit_ratio";
    if (modifier == "by") {
      Require(args, labels, true, absl::StrCat(op, " by (", absl::StrJoin(labels, ", "), ")"));
      if (keeps_series) return args;
      return {Source{"", labels}};
    }
    if (modifier == "without") {
      Sources out;
      for (const Source& s : args) {
        std::set<std::string> left = LabelsOf(s);
        for (const std::string& l : labels) left.erase(l);
        out.push_back(Source{"", left});
      }
      return out;
    }
    if (keeps_series) return args;
    return {Source{"", {}}};
  }

  Sources Function(const std::string& name) {
    Sources args = Arguments();
    if (name != "histogram_quantile") return args;
    Sources out;
    for (const Source& s : args) {
      std::set<std::string> left = LabelsOf(s);
      left.erase("le");
      out.push_back(Source{"", left});
    }
    return out;
  }

  // Operands and operators up to a ')', ',' or the end.
  Sources Sequence() {
    Sources out;
    struct Matching {
      std::string keyword;
      std::set<std::string> labels;
    };
    std::vector<Matching> matchings;
    while (!failed_ && Peek().kind != Token::kEnd && !PeekPunct(")") && !PeekPunct(",") && !PeekPunct("}")) {
      if (PeekPunct("(")) {
        Next();
        Sources inner = Sequence();
        Expect(")");
        out.insert(out.end(), inner.begin(), inner.end());
        continue;
      }
      if (PeekPunct("{")) {
        Sources s = Selector("");
        out.insert(out.end(), s.begin(), s.end());
        continue;
      }
      const Token t = Next();
      if (t.kind != Token::kIdent) continue;  // numbers, strings, operators, ranges
      const std::string lc = absl::AsciiStrToLower(t.text);
      Sources s;
      if (IsAggregator(lc) && (PeekPunct("(") || PeekLower() == "by" || PeekLower() == "without")) {
        s = Aggregation(lc);
      } else if (lc == "on" || lc == "ignoring") {
        matchings.push_back({lc, LabelList()});
      } else if (lc == "group_left" || lc == "group_right") {
        // As in Prometheus, a '(' right after it opens its label list.
        matchings.push_back({lc, PeekPunct("(") ? LabelList() : std::set<std::string>{}});
      } else if (lc == "offset") {
        Consume("-");
        Next();  // the duration
      } else if (lc == "bool" || lc == "and" || lc == "or" || lc == "unless" || lc == "atan2" || lc == "inf" ||
                 lc == "nan") {
        // operators and numbers
      } else if (PeekPunct("(")) {
        s = Function(lc);
      } else if (lc == "by" || lc == "without") {
        Problem(absl::StrCat("'", t.text, "' outside an aggregation"));
        failed_ = true;
      } else {
        s = Selector(t.text);
      }
      out.insert(out.end(), s.begin(), s.end());
    }
    for (const Matching& m : matchings) {
      const bool all = m.keyword == "on" || m.keyword == "ignoring";
      Require(out, m.labels, all, absl::StrCat(m.keyword, " (", absl::StrJoin(m.labels, ", "), ")"));
    }
    return out;
  }

  const std::vector<Token> tokens_;
  const LabelLookup& labels_of_;
  PromqlRefs* const out_;
  size_t pos_ = 0;
  bool failed_ = false;
  std::set<std::string> unknown_;
};

}  // namespace

PromqlRefs ReadPromql(absl::string_view expr, const LabelLookup& labels_of) {
  PromqlRefs refs;
  std::vector<Token> tokens;
  std::string error;
  if (!Tokenize(expr, &tokens, &error)) {
    refs.problems.push_back(absl::StrCat("cannot read: ", error));
    return refs;
  }
  Reader(std::move(tokens), labels_of, &refs).Read();
  return refs;
}

}  // namespace colod::testing
