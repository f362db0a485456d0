#include "kernels/cuda/emu/nccl_ranks.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace colod_nccl_emu_test {
namespace {

// The checks of one rank, collected as text.
class Checker {
 public:
  explicit Checker(int rank) : rank_(rank) {}
  void Expect(bool ok, const std::string& what) {
    if (!ok && errors_.size() < 2000) errors_ += "rank " + std::to_string(rank_) + ": " + what + "\n";
  }
  const std::string& errors() const { return errors_; }

 private:
  int rank_;
  std::string errors_;
};

template <typename T>
T* Upload(const std::vector<T>& h) {
  void* d = nullptr;
  if (cudaMalloc(&d, h.size() * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  return static_cast<T*>(d);
}

template <typename T>
std::vector<T> Download(const T* d, size_t n) {
  std::vector<T> h(n);
  cudaStreamSynchronize(cudaStreamPerThread);
  cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return h;
}

}  // namespace

std::string IdToHex(const ncclUniqueId& id) {
  std::string hex;
  char b[3];
  for (size_t i = 0; i < sizeof id.internal; ++i) {
    snprintf(b, sizeof b, "%02x", static_cast<unsigned char>(id.internal[i]));
    hex += b;
  }
  return hex;
}

bool IdFromHex(const std::string& hex, ncclUniqueId* id) {
  if (hex.size() != 2 * sizeof id->internal) return false;
  for (size_t i = 0; i < sizeof id->internal; ++i) {
    unsigned v = 0;
    if (sscanf(hex.c_str() + 2 * i, "%2x", &v) != 1) return false;
    id->internal[i] = static_cast<char>(v);
  }
  return true;
}

bool Connect(ncclComm_t comm) {
  float* x = nullptr;
  if (cudaMalloc(reinterpret_cast<void**>(&x), sizeof(float)) != cudaSuccess) return false;
  const bool ok = ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, comm, cudaStreamPerThread) == ncclSuccess &&
                  cudaStreamSynchronize(cudaStreamPerThread) == cudaSuccess;
  cudaFree(x);
  return ok;
}

std::string RunCollectives(const ncclUniqueId& id, int rank, int nranks, int device) {
  Checker c(rank);
  const int n = nranks, r = rank;
  const size_t count = 5;
  auto value = [](int j, size_t i) { return static_cast<float>(100 * j + i); };
  if (cudaSetDevice(device) != cudaSuccess) return "no device " + std::to_string(device);
  ncclComm_t comm = nullptr;
  // Non-blocking, as colod's communicators are: ready once every rank joined.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  if (ncclCommInitRankConfig(&comm, n, id, r, &config) != ncclSuccess) return "ncclCommInitRankConfig failed";
  // Polls the communicator's state until it leaves ncclInProgress (30 s at most).
  auto settle = [&](ncclComm_t of) {
    ncclResult_t state = ncclInProgress;
    for (int i = 0; i < 3000 && state == ncclInProgress; ++i) {
      ncclCommGetAsyncError(of, &state);
      if (state == ncclInProgress) usleep(10000);
    }
    return state;
  };
  if (settle(comm) != ncclSuccess) return "rank " + std::to_string(r) + ": the communicator never got ready";
  // A call on it: ncclSuccess, or ncclInProgress where it first connects
  // (`connects`: the first collective, the first send to or receive from a
  // peer), enqueued once the state is ncclSuccess again.
  auto enqueued = [&](ncclResult_t result, bool connects, ncclComm_t of = nullptr) {
    return result == (connects && n > 1 ? ncclInProgress : ncclSuccess) && settle(of ? of : comm) == ncclSuccess;
  };
  ncclResult_t state = ncclSuccess;
  int got_rank = -1, got_size = -1;
  ncclCommUserRank(comm, &got_rank);
  ncclCommCount(comm, &got_size);
  c.Expect(got_rank == r && got_size == n, "rank and size");
  std::vector<float> mine(count * n);
  for (size_t i = 0; i < mine.size(); ++i) mine[i] = value(r, i);
  float* in = Upload(mine);
  float* out = Upload(std::vector<float>(count * n, -1.0f));
  const cudaStream_t s = cudaStreamPerThread;
  // AllReduce, in place.
  float* ar = Upload(std::vector<float>(mine.begin(), mine.begin() + count));
  c.Expect(enqueued(ncclAllReduce(ar, ar, count, ncclFloat32, ncclSum, comm, s), true), "AllReduce enqueued");
  std::vector<float> got = Download(ar, count);
  for (size_t i = 0; i < count; ++i) {
    float want = 0;
    for (int j = 0; j < n; ++j) want += value(j, i);
    c.Expect(got[i] == want, "AllReduce[" + std::to_string(i) + "] " + std::to_string(got[i]));
  }
  // AllGather.
  c.Expect(enqueued(ncclAllGather(in, out, count, ncclFloat32, comm, s), false), "AllGather enqueued");
  got = Download(out, count * n);
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < count; ++i) c.Expect(got[j * count + i] == value(j, i), "AllGather");
  }
  // ReduceScatter (max): chunk r of every rank's input.
  c.Expect(enqueued(ncclReduceScatter(in, out, count, ncclFloat32, ncclMax, comm, s), false), "ReduceScatter enqueued");
  got = Download(out, count);
  for (size_t i = 0; i < count; ++i) c.Expect(got[i] == value(n - 1, r * count + i), "ReduceScatter");
  // Broadcast from the last rank.
  c.Expect(enqueued(ncclBroadcast(in, out, count, ncclFloat32, n - 1, comm, s), false), "Broadcast enqueued");
  got = Download(out, count);
  for (size_t i = 0; i < count; ++i) c.Expect(got[i] == value(n - 1, i), "Broadcast");
  // Reduce (sum) to rank 0; the others' outputs untouched.
  float* red = Upload(std::vector<float>(count, -7.0f));
  c.Expect(enqueued(ncclReduce(in, red, count, ncclFloat32, ncclSum, 0, comm, s), false), "Reduce enqueued");
  got = Download(red, count);
  for (size_t i = 0; i < count; ++i) {
    float want = 0;
    for (int j = 0; j < n; ++j) want += value(j, i);
    c.Expect(got[i] == (r == 0 ? want : -7.0f), "Reduce");
  }
  // AlltoAll: chunk j of the output is chunk r of rank j's input.
  c.Expect(enqueued(ncclAlltoAll(in, out, count, ncclFloat32, comm, s), false), "AlltoAll enqueued");
  got = Download(out, count * n);
  for (int j = 0; j < n; ++j) {
    for (size_t i = 0; i < count; ++i) c.Expect(got[j * count + i] == value(j, r * count + i), "AlltoAll");
  }
  // A ring exchange in one group: to r + 1, from r - 1.
  float* ring = Upload(std::vector<float>(count, 0.0f));
  ncclGroupStart();
  ncclSend(in, count, ncclFloat32, (r + 1) % n, comm, s);
  ncclRecv(ring, count, ncclFloat32, (r + n - 1) % n, comm, s);
  c.Expect(enqueued(ncclGroupEnd(), true), "the ring's group");
  got = Download(ring, count);
  for (size_t i = 0; i < count; ++i) c.Expect(got[i] == value((r + n - 1) % n, i), "ring Recv");
  // bf16, widened and summed in rank order, rounded once.
  std::vector<__nv_bfloat16> h16(count);
  for (size_t i = 0; i < count; ++i) h16[i] = __float2bfloat16_rn(static_cast<float>(r + 1) * 0.5f);
  __nv_bfloat16* d16 = Upload(h16);
  c.Expect(enqueued(ncclAllReduce(d16, d16, count, ncclBfloat16, ncclSum, comm, s), false), "bf16 enqueued");
  std::vector<__nv_bfloat16> g16 = Download(d16, count);
  for (size_t i = 0; i < count; ++i) {
    c.Expect(__bfloat162float(g16[i]) == 0.5f * n * (n + 1) / 2, "bf16 AllReduce");
  }
  // A split: colors r % 2, keys reversing the order. A null config is the
  // parent's: non-blocking, the child written once every rank split.
  ncclComm_t sub = nullptr;
  c.Expect(enqueued(ncclCommSplit(comm, r % 2, -r, &sub, nullptr), false) && sub != nullptr, "split");
  if (sub != nullptr) {
    int sub_rank = -1, sub_size = -1;
    ncclCommUserRank(sub, &sub_rank);
    ncclCommCount(sub, &sub_size);
    const int same = (n - r % 2 + 1) / 2;  // ranks of r's color
    int above = 0;                        // of them, those with a larger rank (a smaller key)
    for (int j = r + 2; j < n; j += 2) ++above;
    c.Expect(sub_size == same && sub_rank == above,
             "split rank " + std::to_string(sub_rank) + " of " + std::to_string(sub_size));
    float* x = Upload(std::vector<float>{static_cast<float>(r)});
    c.Expect(enqueued(ncclAllReduce(x, x, 1, ncclFloat32, ncclSum, sub, s), /*connects=*/sub_size > 1, sub),
             "split AllReduce enqueued");
    float want = 0;
    for (int j = r % 2; j < n; j += 2) want += static_cast<float>(j);
    c.Expect(Download(x, 1)[0] == want, "split AllReduce");
    cudaFree(x);
    ncclCommDestroy(sub);
  }
  ncclComm_t none = reinterpret_cast<ncclComm_t>(0x1);
  c.Expect(enqueued(ncclCommSplit(comm, r == 0 ? 0 : NCCL_SPLIT_NOCOLOR, 0, &none, nullptr), false), "second split");
  c.Expect((none == nullptr) == (r != 0), "NCCL_SPLIT_NOCOLOR gives no communicator");
  if (none != nullptr && r == 0) ncclCommDestroy(none);
  ncclCommGetAsyncError(comm, &state);
  c.Expect(state == ncclSuccess, "no async error");
  ncclCommDestroy(comm);
  for (void* p : {static_cast<void*>(in), static_cast<void*>(out), static_cast<void*>(ar), static_cast<void*>(red),
                  static_cast<void*>(ring), static_cast<void*>(d16)}) {
    cudaFree(p);
  }
  return c.errors();
}

}  // namespace colod_nccl_emu_test
