// Tests only: trains a SentencePiece model with Debian's
// libsentencepiece_train, so that tokenizer tests read a model the library
// itself wrote. Usage: sentencepiece_train_for_test --input=... (the
// trainer's own flags, passed through). Links no Abseil and no protobuf
// (see sentencepiece_helper.cc).
#include <sentencepiece_trainer.h>

#include <cstdio>
#include <string>

int main(int argc, char** argv) {
  std::string args;
  for (int i = 1; i < argc; ++i) args += std::string(i > 1 ? " " : "") + argv[i];
  const auto status = sentencepiece::SentencePieceTrainer::Train(args);
  if (!status.ok()) {
    std::fprintf(stderr, "%s\n", status.ToString().c_str());
    return 1;
  }
  return 0;
}
