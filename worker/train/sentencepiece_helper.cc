// colod-sentencepiece: Debian's libsentencepiece in a process of its own.
//
// The library carries its own copy of protobuf, whose exported symbols
// collide with the libprotobuf every other colod program links through gRPC
// (such a process crashes while loading), and its header declares its own
// absl::string_view. So the library lives here, in a program that links
// nothing else, and the worker and coloctl talk to it over a socket
// (worker/train/sentencepiece_tokenizer.h).
//
// Usage: colod-sentencepiece MODEL_FILE, with the socket on stdin/stdout.
// The protocol (little-endian, one request answered at a time):
//   hello     u8 status; 0: i32 piece count, i32 bos id, i32 eos id,
//             i32 unk id (-1: none); 1: u32 length, the error message
//   request   u8 op, u64 n, payload: op 'E' encode n bytes of text;
//             op 'D' decode n ids (i32 each)
//   answer    u8 status; 0: u64 n, then n ids (i32; encode) or n bytes
//             (decode); 1: u32 length, the error message
// The program ends, with status 0, when its input closes.
//
// No Abseil header may be included here (see above).
#include <sentencepiece_processor.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

// Requests larger than these are refused (the parent never sends them).
constexpr uint64_t kMaxText = uint64_t{1} << 30;
constexpr uint64_t kMaxIds = uint64_t{1} << 28;

bool ReadAll(void* buf, size_t n) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    const ssize_t r = ::read(0, p, n);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

bool WriteAll(const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    const ssize_t w = ::write(1, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(v));
}

bool SendError(const std::string& message) {
  std::string out;
  Put<uint8_t>(&out, 1);
  Put<uint32_t>(&out, static_cast<uint32_t>(message.size()));
  out += message;
  return WriteAll(out.data(), out.size());
}

int Serve(const sentencepiece::SentencePieceProcessor& sp) {
  std::string text;
  std::vector<int> ids;
  for (;;) {
    uint8_t op;
    uint64_t n;
    if (!ReadAll(&op, 1)) return 0;  // the parent closed the socket: done
    if (!ReadAll(&n, sizeof(n))) return 1;
    std::string out;
    if (op == 'E') {
      if (n > kMaxText) {
        SendError("text over 1 GiB");
        return 1;
      }
      text.resize(n);
      if (!ReadAll(text.data(), n)) return 1;
      ids.clear();
      const auto status = sp.Encode(text, &ids);
      if (!status.ok()) {
        if (!SendError(status.ToString())) return 1;
        continue;
      }
      Put<uint8_t>(&out, 0);
      Put<uint64_t>(&out, ids.size());
      out.append(reinterpret_cast<const char*>(ids.data()), ids.size() * sizeof(int));
    } else if (op == 'D') {
      if (n > kMaxIds) {
        SendError("over 2^28 ids");
        return 1;
      }
      ids.resize(n);
      if (!ReadAll(ids.data(), n * sizeof(int))) return 1;
      for (int id : ids) {
        if (id < 0 || id >= sp.GetPieceSize()) {
          ids.clear();
          break;
        }
      }
      if (ids.size() != n) {
        if (!SendError("an id outside the vocabulary")) return 1;
        continue;
      }
      text.clear();
      const auto status = sp.Decode(ids, &text);
      if (!status.ok()) {
        if (!SendError(status.ToString())) return 1;
        continue;
      }
      Put<uint8_t>(&out, 0);
      Put<uint64_t>(&out, text.size());
      out += text;
    } else {
      SendError("unknown request");
      return 1;
    }
    if (!WriteAll(out.data(), out.size())) return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    std::fprintf(stderr,
                 "usage: colod-sentencepiece MODEL_FILE\n"
                 "Serves a SentencePiece model (tokenizer.model) to a colod worker or coloctl over\n"
                 "stdin/stdout; they start it themselves. It is a program of its own because\n"
                 "libsentencepiece cannot share a process with gRPC's protobuf.\n");
    return argc == 2 ? 0 : 2;
  }
  sentencepiece::SentencePieceProcessor sp;
  const auto status = sp.Load(argv[1]);
  if (!status.ok()) {
    SendError(status.ToString());
    return 1;
  }
  std::string hello;
  Put<uint8_t>(&hello, 0);
  Put<int32_t>(&hello, sp.GetPieceSize());
  Put<int32_t>(&hello, sp.bos_id());
  Put<int32_t>(&hello, sp.eos_id());
  Put<int32_t>(&hello, sp.unk_id());
  if (!WriteAll(hello.data(), hello.size())) return 1;
  return Serve(sp);
}
