#include "kernels/cuda/emu/nccl_wire.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

namespace colod_nccl_emu {
namespace {

constexpr uint32_t kMagic = 0x45434e43;  // "CNCE"
// A frame's payload is at most this: a corrupt length fails the read
// instead of allocating it.
constexpr uint64_t kMaxPayload = uint64_t{1} << 36;

struct Header {
  uint32_t magic;
  uint32_t kind;
  uint64_t req;
  int64_t a[8];
  uint64_t bytes;
};

bool WriteAll(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

bool ReadAll(int fd, void* data, size_t n) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    const ssize_t r = recv(fd, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
  }
  return true;
}

}  // namespace

Conn::~Conn() { close(fd_); }

bool Conn::Write(Kind kind, uint64_t req, std::initializer_list<int64_t> args, const void* payload, size_t bytes) {
  Header h{};
  h.magic = kMagic;
  h.kind = static_cast<uint32_t>(kind);
  h.req = req;
  int i = 0;
  for (int64_t v : args) {
    if (i < 8) h.a[i++] = v;
  }
  h.bytes = bytes;
  // A frame is written whole before the next: the lock covers the socket
  // writes, whose reader (the peer's reader thread) never waits on us.
  std::lock_guard<std::mutex> l(write_mu_);
  return WriteAll(fd_, &h, sizeof h) && (bytes == 0 || WriteAll(fd_, payload, bytes));
}

void Conn::TryWrite(Kind kind, std::initializer_list<int64_t> args) {
  Header h{};
  h.magic = kMagic;
  h.kind = static_cast<uint32_t>(kind);
  int i = 0;
  for (int64_t v : args) {
    if (i < 8) h.a[i++] = v;
  }
  std::unique_lock<std::mutex> l(write_mu_, std::try_to_lock);
  if (!l.owns_lock()) return;
  ssize_t w;
  do {
    w = send(fd_, &h, sizeof h, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (w < 0 && errno == EINTR);
  if (w != static_cast<ssize_t>(sizeof h)) shutdown(fd_, SHUT_RDWR);  // a torn frame must not be read
}

bool Conn::Read(Frame* f) {
  Header h;
  if (!ReadAll(fd_, &h, sizeof h) || h.magic != kMagic || h.bytes > kMaxPayload) return false;
  f->kind = static_cast<Kind>(h.kind);
  f->req = h.req;
  memcpy(f->a, h.a, sizeof h.a);
  f->payload.resize(h.bytes);
  return h.bytes == 0 || ReadAll(fd_, f->payload.data(), h.bytes);
}

void Conn::Shutdown() { shutdown(fd_, SHUT_RDWR); }

std::string ListenerAddress(const std::function<void(std::shared_ptr<Conn>)>& on_accept) {
  static const std::string* address = [&on_accept]() -> std::string* {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = 0;
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || listen(fd, 128) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
      if (fd >= 0) close(fd);
      return new std::string();  // no listener: ids serve this process only
    }
    std::thread([fd, on_accept] {
      for (;;) {
        const int c = accept4(fd, nullptr, nullptr, SOCK_CLOEXEC);
        if (c < 0) {
          if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE) continue;
          return;
        }
        const int one = 1;
        setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        auto conn = std::make_shared<Conn>(c);
        std::thread([on_accept, conn] { on_accept(conn); }).detach();
      }
    }).detach();
    return new std::string("127.0.0.1:" + std::to_string(ntohs(a.sin_port)));
  }();
  return *address;
}

std::shared_ptr<Conn> Connect(const std::string& address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return nullptr;
  sockaddr_in a{};
  a.sin_family = AF_INET;
  const int port = atoi(address.c_str() + colon + 1);
  if (port <= 0 || port > 65535 || inet_pton(AF_INET, address.substr(0, colon).c_str(), &a.sin_addr) != 1) {
    return nullptr;
  }
  a.sin_port = htons(static_cast<uint16_t>(port));
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return nullptr;
  int r;
  do {
    r = connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  } while (r != 0 && errno == EINTR);
  if (r != 0) {
    close(fd);
    return nullptr;
  }
  const int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return std::make_shared<Conn>(fd);
}

}  // namespace colod_nccl_emu
