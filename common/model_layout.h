// The files of a Hugging Face-style model directory that colod reads, so
// that what coloctl uploads, what a worker links into a job's model
// directory and what the trainer looks for agree.
//
// Thread-safety: pure functions.
#ifndef COLOD_COMMON_MODEL_LAYOUT_H_
#define COLOD_COMMON_MODEL_LAYOUT_H_

#include <sys/stat.h>

#include <optional>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace colod {

// The tokenizer's files, in the order a tokenizer is looked for
// (worker/train/tokenizer.h): SentencePiece (LLaMA, T5), then byte-level
// BPE (tokenizer.json, or vocab.json + merges.txt), and the settings.
inline constexpr absl::string_view kTokenizerFiles[] = {"tokenizer.model", "spiece.model",  "tokenizer.json",
                                                        "vocab.json",      "merges.txt",    "tokenizer_config.json"};

inline bool IsTokenizerFile(absl::string_view name) {
  for (absl::string_view f : kTokenizerFiles) {
    if (name == f) return true;
  }
  return false;
}

// The files that make a directory a model. Nothing writes a model over
// one (init-model, consolidate, a run's final_dir): new weights beside an
// old index would load as neither.
inline constexpr absl::string_view kModelFiles[] = {"config.json", "model.safetensors",
                                                    "model.safetensors.index.json"};

// The first of kModelFiles in `dir` (a link, even to nothing, counts), or
// nullopt.
inline std::optional<std::string> ModelFileIn(const std::string& dir) {
  for (absl::string_view name : kModelFiles) {
    struct stat st;
    if (::lstat(absl::StrCat(dir, "/", name).c_str(), &st) == 0) return std::string(name);
  }
  return std::nullopt;
}

// Weights: *.safetensors and the index of a sharded checkpoint.
inline bool IsWeightsFile(absl::string_view name) {
  return absl::EndsWith(name, ".safetensors") || name == "model.safetensors.index.json";
}

}  // namespace colod

#endif  // COLOD_COMMON_MODEL_LAYOUT_H_
