#include "worker/train/tokenizer.h"

#include <sys/stat.h>

#include <algorithm>
#include <tuple>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/atomic_file.h"
#include "common/json.h"
#include "common/model_layout.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/train/byte_level_bpe.h"
#include "worker/train/sentencepiece_tokenizer.h"

namespace colod::train {
namespace {

using Json = nlohmann::json;

// A tokenizer file, refused before it is read when it is not a regular file
// or larger than kMaxTokenizerFileBytes.
absl::Status CheckTokenizerFile(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return absl::NotFoundError(absl::StrCat(path, " does not exist"));
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(path, " is not a regular file"));
  if (st.st_size > kMaxTokenizerFileBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is ", st.st_size, " bytes, over the ", kMaxTokenizerFileBytes, " a tokenizer file may be"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadTokenizerFile(const std::string& path) {
  RETURN_IF_ERROR(CheckTokenizerFile(path));
  return ReadFileToString(path, kMaxTokenizerFileBytes);  // (a pipe in its place since is not read without end)
}

absl::StatusOr<Json> ReadJson(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadTokenizerFile(path));
  Json j = ParseJson(text);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a JSON object"));
  }
  return j;
}

// What tokenizer_config.json says (every field optional).
struct TokenizerConfig {
  std::optional<bool> add_bos;
  std::optional<std::string> bos, eos;
};

// A special token's content: "</s>" or {"content": "</s>", ...}.
std::optional<std::string> TokenContent(const Json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  return std::nullopt;
}

absl::StatusOr<TokenizerConfig> ReadTokenizerConfig(const std::string& dir) {
  TokenizerConfig config;
  const std::string path = dir + "/tokenizer_config.json";
  if (!IsRegularFile(path)) return config;
  ASSIGN_OR_RETURN(Json j, ReadJson(path));
  if (auto it = j.find("add_bos_token"); it != j.end()) {
    if (!it->is_boolean()) return absl::InvalidArgumentError(absl::StrCat(path, ": add_bos_token must be true or false"));
    config.add_bos = it->get<bool>();
  }
  config.bos = TokenContent(j, "bos_token");
  config.eos = TokenContent(j, "eos_token");
  return config;
}

using Vocab = absl::flat_hash_map<std::string, int64_t>;
using Merges = std::vector<std::pair<std::string, std::string>>;

absl::StatusOr<Vocab> ParseVocab(const Json& j, const std::string& what) {
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(what, " must be an object of token: id"));
  Vocab vocab;
  vocab.reserve(j.size());
  for (const auto& [token, id] : j.items()) {
    if (!id.is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": the id of '", token, "' is not an integer"));
    }
    vocab.emplace(token, id.get<int64_t>());
  }
  return vocab;
}

absl::StatusOr<std::pair<std::string, std::string>> SplitMerge(absl::string_view line, const std::string& where) {
  std::vector<std::string> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 2 || parts[0].empty() || parts[1].empty()) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": a merge is two symbols and one space, got '", line, "'"));
  }
  return std::make_pair(std::move(parts[0]), std::move(parts[1]));
}

// The options both BPE file layouts share: bos/eos by their content.
absl::Status SetSpecials(const Vocab& vocab, const TokenizerConfig& config, ByteLevelBpe::Options& o) {
  auto id_of = [&](const std::string& content) -> std::optional<int64_t> {
    for (const auto& [id, c] : o.added) {
      if (c == content) return id;
    }
    auto it = vocab.find(content);
    if (it != vocab.end()) return it->second;
    return std::nullopt;
  };
  for (auto [name, content, out] : {std::make_tuple("bos_token", config.bos, &o.bos),
                                    std::make_tuple("eos_token", config.eos, &o.eos)}) {
    if (!content.has_value()) continue;
    *out = id_of(*content);
    if (!out->has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer_config.json: ", name, " '", *content, "' is not in the vocabulary"));
    }
  }
  // GPT-2 (and BLOOM) end documents with <|endoftext|>, OPT with </s>.
  for (const char* fallback : {"<|endoftext|>", "</s>"}) {
    if (!o.eos.has_value()) o.eos = id_of(fallback);
  }
  if (!o.bos.has_value() && config.add_bos.value_or(false)) o.bos = o.eos;  // GPT2Tokenizer's bos is its eos
  o.add_bos = config.add_bos.value_or(false);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadVocabAndMerges(const std::string& dir, const TokenizerConfig& config) {
  const std::string vocab_path = dir + "/vocab.json", merges_path = dir + "/merges.txt";
  ASSIGN_OR_RETURN(Json vj, ReadJson(vocab_path));
  ASSIGN_OR_RETURN(Vocab vocab, ParseVocab(vj, vocab_path));
  ASSIGN_OR_RETURN(std::string text, ReadTokenizerFile(merges_path));
  Merges merges;
  int64_t line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty() || (line_no == 1 && absl::StartsWith(line, "#version"))) continue;
    ASSIGN_OR_RETURN(auto merge, SplitMerge(line, absl::StrCat(merges_path, ":", line_no)));
    merges.push_back(std::move(merge));
  }
  ByteLevelBpe::Options o;
  RETURN_IF_ERROR(SetSpecials(vocab, config, o));
  auto bpe = ByteLevelBpe::Create(vocab, merges, o);
  if (!bpe.ok()) return absl::InvalidArgumentError(absl::StrCat(dir, ": ", bpe.status().message()));
  return std::unique_ptr<Tokenizer>(std::move(*bpe));
}

// Refuses a tokenizer.json field that would change the encoding in a way
// colod does not implement.
absl::Status Unsupported(const std::string& path, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ": ", what,
                                                 "; colod implements byte-level BPE (a BPE model with a ByteLevel "
                                                 "pre-tokenizer) and SentencePiece (tokenizer.model)"));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizerJson(const std::string& dir, const TokenizerConfig& config) {
  const std::string path = dir + "/tokenizer.json";
  ASSIGN_OR_RETURN(Json j, ReadJson(path));
  auto field = [&](const Json& o, const char* key) -> const Json* {
    auto it = o.find(key);
    return it == o.end() || it->is_null() ? nullptr : &*it;
  };
  const Json* model = field(j, "model");
  if (model == nullptr || !model->is_object()) return Unsupported(path, "no model");
  // Input is read by its type, never by json::value() or get() on a value
  // of another type (they throw), and described without dumping it.
  const Json* type = field(*model, "type");
  if (type == nullptr || !type->is_string() || *type != "BPE") {
    return Unsupported(path, absl::StrCat("model.type is ", type == nullptr ? "missing" : DescribeJson(*type)));
  }
  if (const Json* n = field(j, "normalizer")) {
    const Json* kind = n->is_object() ? field(*n, "type") : nullptr;
    return Unsupported(path, absl::StrCat("a normalizer (", DescribeJson(kind != nullptr ? *kind : *n), ")"));
  }
  const Json* pre = field(j, "pre_tokenizer");
  const Json* pre_type = pre != nullptr && pre->is_object() ? field(*pre, "type") : nullptr;
  if (pre_type == nullptr || !pre_type->is_string() || *pre_type != "ByteLevel") {
    return Unsupported(path, absl::StrCat("pre_tokenizer ", pre == nullptr        ? "none"
                                                            : pre_type != nullptr ? DescribeJson(*pre_type)
                                                                                  : DescribeJson(*pre)));
  }
  const auto flag = [&](const char* key, bool fallback) -> absl::StatusOr<bool> {
    const Json* v = field(*pre, key);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": pre_tokenizer.", key, " must be true or false, not ", DescribeJson(*v)));
    }
    return v->get<bool>();
  };
  ASSIGN_OR_RETURN(const bool use_regex, flag("use_regex", true));
  if (!use_regex) return Unsupported(path, "a ByteLevel pre-tokenizer without its regex");
  for (const char* key : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
    const Json* v = field(*model, key);
    if (v != nullptr && !(v->is_string() && v->get<std::string>().empty())) {
      return Unsupported(path, absl::StrCat("model.", key, " ", DescribeJson(*v)));
    }
  }
  if (const Json* v = field(*model, "byte_fallback"); v != nullptr && *v == true) {
    return Unsupported(path, "model.byte_fallback");
  }
  const Json* vocab_json = field(*model, "vocab");
  if (vocab_json == nullptr) return absl::InvalidArgumentError(absl::StrCat(path, ": model.vocab is missing"));
  ASSIGN_OR_RETURN(Vocab vocab, ParseVocab(*vocab_json, path + " model.vocab"));
  Merges merges;
  if (const Json* m = field(*model, "merges")) {
    if (!m->is_array()) return absl::InvalidArgumentError(absl::StrCat(path, ": model.merges must be an array"));
    merges.reserve(m->size());
    for (size_t k = 0; k < m->size(); ++k) {
      const Json& e = (*m)[k];
      const std::string where = absl::StrCat(path, " model.merges[", k, "]");
      if (e.is_string()) {
        ASSIGN_OR_RETURN(auto merge, SplitMerge(e.get<std::string>(), where));
        merges.push_back(std::move(merge));
      } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
        merges.emplace_back(e[0].get<std::string>(), e[1].get<std::string>());
      } else {
        return absl::InvalidArgumentError(absl::StrCat(where, " must be \"a b\" or [\"a\", \"b\"]"));
      }
    }
  }
  ByteLevelBpe::Options o;
  ASSIGN_OR_RETURN(o.add_prefix_space, flag("add_prefix_space", false));
  if (const Json* v = field(*model, "ignore_merges"); v != nullptr && v->is_boolean()) o.ignore_merges = v->get<bool>();
  if (const Json* added = field(j, "added_tokens")) {
    if (!added->is_array()) return absl::InvalidArgumentError(absl::StrCat(path, ": added_tokens must be an array"));
    for (const Json& t : *added) {
      if (!t.is_object() || !t.contains("id") || !t["id"].is_number_integer() || !t.contains("content") ||
          !t["content"].is_string()) {
        return absl::InvalidArgumentError(absl::StrCat(path, ": each added token needs an integer id and a content"));
      }
      o.added.emplace_back(t["id"].get<int64_t>(), t["content"].get<std::string>());
    }
  }
  // Added tokens that are also in the vocabulary are the vocabulary's.
  o.added.erase(std::remove_if(o.added.begin(), o.added.end(),
                               [&](const auto& a) {
                                 auto it = vocab.find(a.second);
                                 return it != vocab.end() && it->second == a.first;
                               }),
                o.added.end());
  RETURN_IF_ERROR(SetSpecials(vocab, config, o));
  auto bpe = ByteLevelBpe::Create(vocab, merges, o);
  if (!bpe.ok()) return absl::InvalidArgumentError(absl::StrCat(path, ": ", bpe.status().message()));
  return std::unique_ptr<Tokenizer>(std::move(*bpe));
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> Tokenizer::EncodeDocument(absl::string_view text) const {
  std::vector<int64_t> ids;
  if (add_bos()) ids.push_back(*bos_id());
  ASSIGN_OR_RETURN(std::vector<int64_t> body, Encode(text));
  ids.insert(ids.end(), body.begin(), body.end());
  if (eos_id().has_value()) ids.push_back(*eos_id());
  return ids;
}

bool HasTokenizer(const std::string& model_dir) {
  for (absl::string_view name : kTokenizerFiles) {
    // merges.txt and tokenizer_config.json alone are no tokenizer.
    if (name != "merges.txt" && name != "tokenizer_config.json" && IsRegularFile(absl::StrCat(model_dir, "/", name))) {
      return true;
    }
  }
  return false;
}

absl::StatusOr<std::unique_ptr<Tokenizer>> LoadTokenizer(const std::string& model_dir) {
  ASSIGN_OR_RETURN(TokenizerConfig config, ReadTokenizerConfig(model_dir));
  // LLaMA's directories hold a tokenizer.json too (a Metaspace BPE built
  // from the model); the SentencePiece model is the original.
  for (const char* name : {"/tokenizer.model", "/spiece.model"}) {
    const std::string path = model_dir + name;
    if (!IsRegularFile(path)) continue;
    RETURN_IF_ERROR(CheckTokenizerFile(path));
    SentencePieceTokenizer::Options options;
    options.add_bos = config.add_bos;
    ASSIGN_OR_RETURN(std::unique_ptr<SentencePieceTokenizer> t, SentencePieceTokenizer::Load(path, options));
    return std::unique_ptr<Tokenizer>(std::move(t));
  }
  if (IsRegularFile(model_dir + "/tokenizer.json")) return LoadTokenizerJson(model_dir, config);
  if (IsRegularFile(model_dir + "/vocab.json")) {
    if (!IsRegularFile(model_dir + "/merges.txt")) {
      return absl::InvalidArgumentError(absl::StrCat(model_dir, " has vocab.json without merges.txt"));
    }
    return LoadVocabAndMerges(model_dir, config);
  }
  return absl::NotFoundError(absl::StrCat(model_dir, " has no tokenizer (tokenizer.model, spiece.model, tokenizer.json, "
                                          "or vocab.json with merges.txt)"));
}

}  // namespace colod::train
