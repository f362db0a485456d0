// The files of a Hugging Face-style model directory that colod reads, so
// that what coloctl uploads, what a worker links into a job's model
// directory and what the trainer looks for agree.
//
// Thread-safety: pure functions.
#ifndef COLOD_COMMON_MODEL_LAYOUT_H_
#define COLOD_COMMON_MODEL_LAYOUT_H_

#include "absl/strings/match.h"
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

// Weights: *.safetensors and the index of a sharded checkpoint.
inline bool IsWeightsFile(absl::string_view name) {
  return absl::EndsWith(name, ".safetensors") || name == "model.safetensors.index.json";
}

}  // namespace colod

#endif  // COLOD_COMMON_MODEL_LAYOUT_H_
