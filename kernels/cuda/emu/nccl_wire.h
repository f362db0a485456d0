// The socket transport of colod's NCCL emulation (nccl.cc) between
// processes: a communicator's clique lives in the process whose
// ncclGetUniqueId made its id; a rank in another process reaches it over a
// TCP connection on loopback to that process's listener, as a real NCCL rank
// reaches its bootstrap root through the id's address. Frames are a fixed
// header (kind, request number, eight integer arguments, payload length)
// and the payload. Not for use outside kernels/cuda/emu.
//
// Thread-safety: Conn::Write and TryWrite may be called from any thread (one
// frame at a time); Conn::Read from one reader thread; Shutdown from any
// thread.
#ifndef COLOD_KERNELS_CUDA_EMU_NCCL_WIRE_H_
#define COLOD_KERNELS_CUDA_EMU_NCCL_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace colod_nccl_emu {

// What a frame asks or answers.
enum class Kind : uint32_t {
  kHelloInit = 1,   // a: nranks, rank, device; payload: the unique id
  kHelloChild,      // a: the token of a split's child rank
  kReady,           // a: the communicator's state (ncclResult_t)
  kCollective,      // a: seq, count, type, red op, root, op code; payload: the input
  kSend,            // a: peer, seq; payload: the data
  kRecv,            // a: peer, seq, bytes
  kSplit,           // a: seq, color, key, device
  kDone,            // the answer to a request; payload: its output
  kSplitDone,       // a: child token (-1: none), child rank, child size
  kAsyncError,      // a: the error a peer's loss gives (ncclRemoteError)
  kBye,             // the rank destroyed its communicator
  kAbort,           // the rank aborted its communicator
  kConnect,         // a: first collective (0/1), sends, receives; payload: their peers (int32)
};

struct Frame {
  Kind kind = Kind::kDone;
  uint64_t req = 0;
  int64_t a[8] = {};
  std::vector<char> payload;
};

class Conn {
 public:
  explicit Conn(int fd) : fd_(fd) {}
  ~Conn();
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  // Writes one frame; false once the connection is broken.
  bool Write(Kind kind, uint64_t req, std::initializer_list<int64_t> args, const void* payload = nullptr,
             size_t bytes = 0);
  // Writes a small frame without waiting: skipped while another frame is
  // being written, and the connection ended if the socket cannot take it
  // whole (the peer then reads an end instead). For what must not block:
  // an abort, telling a rank of a lost peer.
  void TryWrite(Kind kind, std::initializer_list<int64_t> args);
  // Reads one frame; false at end of stream or on a malformed one.
  bool Read(Frame* f);
  // Ends the connection both ways: a blocked Read returns false.
  void Shutdown();

 private:
  const int fd_;
  std::mutex write_mu_;
};

// "127.0.0.1:PORT" of this process's listener, started on the first call;
// every connection it accepts is handed to `on_accept` (the first call's)
// on a thread of its own.
std::string ListenerAddress(const std::function<void(std::shared_ptr<Conn>)>& on_accept);

// A connection to "HOST:PORT"; nullptr if it cannot be made.
std::shared_ptr<Conn> Connect(const std::string& address);

}  // namespace colod_nccl_emu

#endif  // COLOD_KERNELS_CUDA_EMU_NCCL_WIRE_H_
