// Tests' tokenizer models: a SentencePiece model built by hand in the
// protocol-buffer wire format (its encodings can be worked out on paper),
// and models trained by libsentencepiece's own trainer.
#ifndef COLOD_WORKER_TRAIN_TOKENIZER_TESTING_H_
#define COLOD_WORKER_TRAIN_TOKENIZER_TESTING_H_

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"
#include "worker/train/byte_level_bpe.h"

namespace colod::train::testing {

// A fresh, empty directory under the test's temporary directory.
inline std::string EmptyDir(const std::string& name) {
  const std::string dir = colod::testing::TempPath(name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

inline void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

// GPT-2's byte-level BPE layout in miniature: the 256 byte symbols (id =
// byte), the merges "Ġ t", "h e", "Ġt he" (ids 256-258), <|endoftext|>
// (259).
inline nlohmann::json SmallGpt2Vocab() {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[ByteLevelBpe::ByteSymbol(static_cast<uint8_t>(b))] = b;
  const std::string G = ByteLevelBpe::ByteSymbol(' ');
  vocab[G + "t"] = 256;
  vocab["he"] = 257;
  vocab[G + "the"] = 258;
  vocab["<|endoftext|>"] = 259;
  return vocab;
}
inline constexpr char kSmallGpt2Merges[] = "#version: 0.2\n\xC4\xA0 t\nh e\n\xC4\xA0t he\n";

// DIR/vocab.json and DIR/merges.txt of that tokenizer (260 ids).
inline void WriteSmallGpt2Tokenizer(const std::string& dir) {
  WriteFile(dir + "/vocab.json", SmallGpt2Vocab().dump());
  WriteFile(dir + "/merges.txt", kSmallGpt2Merges);
}

// Wire format, enough for sentencepiece_model.proto's ModelProto: pieces
// (1: piece 1, score 2, type 3), trainer_spec (2: model_type 3,
// vocab_size 4), normalizer_spec (3: name 1, add_dummy_prefix 3,
// remove_extra_whitespaces 4, escape_whitespaces 5).
inline std::string Varint(uint64_t v) {
  std::string out;
  do {
    out.push_back(static_cast<char>((v & 0x7F) | (v > 0x7F ? 0x80 : 0)));
    v >>= 7;
  } while (v != 0);
  return out;
}
inline std::string LengthField(int number, const std::string& bytes) {
  return Varint(uint64_t(number) << 3 | 2) + Varint(bytes.size()) + bytes;
}
inline std::string IntField(int number, uint64_t v) { return Varint(uint64_t(number) << 3) + Varint(v); }
inline std::string FloatField(int number, float f) {
  std::string out = Varint(uint64_t(number) << 3 | 5);
  char b[4];
  std::memcpy(b, &f, 4);
  return out.append(b, 4);
}
// type: 1 normal, 2 unknown, 3 control.
inline std::string Piece(const std::string& piece, float score, int type) {
  return LengthField(1, LengthField(1, piece) + FloatField(2, score) + IntField(3, type));
}

// SentencePiece's space.
inline const std::string kMetaSpace = "\xE2\x96\x81";

// A BPE model of 11 pieces: <unk> <s> </s> ▁ a b c, then ▁a (score -1),
// ab (-2), ▁ab (-3), bc (-4); no normalization, a dummy ▁ in front, spaces
// as ▁. BPE merges the adjacent pair whose union scores highest, leftmost
// first.
inline std::string HandBuiltBpeModel() {
  const std::string& U = kMetaSpace;
  std::string model = Piece("<unk>", 0, 2) + Piece("<s>", 0, 3) + Piece("</s>", 0, 3) + Piece(U, 0, 1) +
                      Piece("a", 0, 1) + Piece("b", 0, 1) + Piece("c", 0, 1) + Piece(U + "a", -1, 1) +
                      Piece("ab", -2, 1) + Piece(U + "ab", -3, 1) + Piece("bc", -4, 1);
  model += LengthField(2, IntField(3, 2) + IntField(4, 11));
  model += LengthField(3, LengthField(1, "identity") + IntField(3, 1) + IntField(4, 0) + IntField(5, 1));
  return model;
}

// Trains a model with libsentencepiece_train ($SENTENCEPIECE_TRAIN, the
// test's data dependency //worker/train:sentencepiece_train_for_test) on
// `corpus`, writing PREFIX.model; `flags` are the trainer's own. Returns
// what went wrong, or "" on success.
inline std::string TrainSentencePiece(const std::string& prefix, const std::string& corpus,
                                      const std::string& flags) {
  const char* trainer = std::getenv("SENTENCEPIECE_TRAIN");
  if (trainer == nullptr) return "SENTENCEPIECE_TRAIN is not set";
  const std::string input = prefix + ".corpus.txt";
  std::ofstream(input, std::ios::binary) << corpus;
  const std::string cmd = std::string(trainer) + " --input=" + input + " --model_prefix=" + prefix +
                          " --minloglevel=2 " + flags + " > " + prefix + ".train.log 2>&1";
  if (std::system(cmd.c_str()) != 0) return "trainer failed: " + cmd;
  return "";
}

}  // namespace colod::train::testing

#endif  // COLOD_WORKER_TRAIN_TOKENIZER_TESTING_H_
