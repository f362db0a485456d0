// Tokenizers on arbitrary bytes. The first byte picks what the rest is:
//   0  text for a fixed byte-level BPE (bytes, a few merges, an added
//      token): every id lies in the vocabulary and decoding gives the
//      bytes back, whatever they are (invalid UTF-8 included)
//   1  a tokenizer.json: LoadTokenizer refuses it, or the tokenizer it
//      makes round-trips a text (and its own file) as above
//   2  vocab.json, a NUL, merges.txt: the same
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "worker/train/byte_level_bpe.h"
#include "worker/train/tokenizer.h"

namespace {

using colod::train::ByteLevelBpe;
using colod::train::Tokenizer;

void CheckRoundTrip(const Tokenizer& tok, const std::string& text) {
  auto ids = tok.Encode(text);
  if (!ids.ok()) std::abort();  // byte-level BPE encodes any bytes
  for (int64_t id : *ids) {
    if (id < 0 || id >= tok.vocab_size()) std::abort();
  }
  auto back = tok.Decode(*ids);
  if (!back.ok() || *back != text) std::abort();
}

const ByteLevelBpe& FixedBpe() {
  static const ByteLevelBpe* bpe = [] {
    absl::flat_hash_map<std::string, int64_t> vocab;
    for (int b = 0; b < 256; ++b) vocab[ByteLevelBpe::ByteSymbol(static_cast<uint8_t>(b))] = b;
    const std::string G = ByteLevelBpe::ByteSymbol(' ');
    std::vector<std::pair<std::string, std::string>> merges = {
        {G, "t"}, {"h", "e"}, {G + "t", "he"}, {"i", "n"}, {G, "in"}, {"e", "r"}, {G, G}, {G + G, G + G}};
    int64_t id = 256;
    for (const auto& [a, b] : merges) vocab[a + b] = id++;
    ByteLevelBpe::Options o;
    o.added = {{id, "<|endoftext|>"}};
    o.eos = id;
    auto made = ByteLevelBpe::Create(vocab, merges, o);
    if (!made.ok()) std::abort();
    return made->release();
  }();
  return *bpe;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  const int mode = data[0] % 3;
  if (mode == 0) {
    CheckRoundTrip(FixedBpe(), rest);
    return 0;
  }
  static const std::string dir = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string d = std::string(tmp != nullptr ? tmp : "/tmp") + "/tokenizer-fuzz-" + std::to_string(::getpid());
    std::filesystem::create_directories(d);
    return d;
  }();
  for (const char* f : {"tokenizer.json", "vocab.json", "merges.txt"}) std::filesystem::remove(dir + "/" + f);
  if (mode == 1) {
    std::ofstream(dir + "/tokenizer.json", std::ios::binary) << rest;
  } else {
    const size_t nul = rest.find('\0');
    std::ofstream(dir + "/vocab.json", std::ios::binary) << rest.substr(0, nul);
    std::ofstream(dir + "/merges.txt", std::ios::binary) << (nul == std::string::npos ? "" : rest.substr(nul + 1));
  }
  auto tok = colod::train::LoadTokenizer(dir);
  if (!tok.ok()) return 0;
  CheckRoundTrip(**tok, "Hello, world! The thin winter\xff\xfe \xe2\x96\x81 123");
  CheckRoundTrip(**tok, rest.substr(0, 4096));
  auto doc = (*tok)->EncodeDocument("the end");
  if (!doc.ok()) std::abort();
  return 0;
}
