#include "kernels/cuda/tensor_ops.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/cuda/elements.h"
#include "kernels/cuda/launch.h"
#include "kernels/philox.h"

namespace colod::kernels::cuda {
namespace {

#define RETURN_IF_CUDA(call) COLOD_RETURN_IF_CUDA(call)

// Element i's offsets in two layouts of one (coalesced) shape: one div/mod
// per dim, in 32-bit arithmetic where every extent fits (Index = uint32_t),
// as 64-bit division is several times slower.
template <typename Index>
__device__ __forceinline__ void StridedOffsets(int64_t i, const Layout& sl, const Layout& dl, int64_t* so,
                                               int64_t* dof) {
  Index rem = static_cast<Index>(i);
  *so = 0;
  *dof = 0;
  for (int d = sl.ndim - 1; d >= 0; --d) {
    const Index extent = static_cast<Index>(sl.shape[d]);
    const Index idx = rem % extent;
    rem /= extent;
    *so += static_cast<int64_t>(idx) * sl.strides[d];
    *dof += static_cast<int64_t>(idx) * dl.strides[d];
  }
}

// The general converting copy (a same-type copy is StridedWordCopyKernel).
template <typename Index>
__global__ void StridedCopyKernel(const char* src, Layout sl, ElemType st, char* dst, Layout dl, ElemType dt,
                                  int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t so, dof;
    StridedOffsets<Index>(i, sl, dl, &so, &dof);
    if (IsInt(st) && IsInt(dt)) {
      StoreI(dst, dof, dt, LoadI(src, so, st));
    } else {
      StoreF(dst, dof, dt, LoadF(src, so, st));
    }
  }
}

// A same-type copy in words of kWord bytes (WidenLayouts): element i of the
// word-unit layouts, one 16-byte access for a word of 16.
template <int kWord>
struct alignas(kWord) Word {
  unsigned char b[kWord];
};

template <typename Index, int kWord>
__global__ void StridedWordCopyKernel(const Word<kWord>* src, Layout sl, Word<kWord>* dst, Layout dl, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    int64_t so, dof;
    StridedOffsets<Index>(i, sl, dl, &so, &dof);
    dst[dof] = src[so];
  }
}

// Rewrites element layouts of `es`-byte elements as layouts of `word`-byte
// words where that is exact: the innermost dimension contiguous on both
// sides, its bytes and every other stride's bytes multiples of the word,
// both pointers aligned to it; a word of the element's own size always.
// QKV's split into heads moves rows of 64 bf16 (128 bytes) 16 bytes at a
// time; the general kernel copied them a byte at a time.
bool WidenLayouts(Layout* sl, Layout* dl, int es, int word, const void* src, const void* dst) {
  const int last = sl->ndim - 1;
  const int64_t k = word / es;
  if (last < 0 || word % es != 0 || reinterpret_cast<uintptr_t>(src) % word != 0 ||
      reinterpret_cast<uintptr_t>(dst) % word != 0) {
    return false;
  }
  if (k == 1) return true;  // the element itself: any strides
  if (sl->strides[last] != 1 || dl->strides[last] != 1 || sl->shape[last] % k != 0) return false;
  for (int d = 0; d < last; ++d) {
    if (sl->strides[d] % k != 0 || dl->strides[d] % k != 0) return false;
  }
  sl->shape[last] /= k;
  dl->shape[last] /= k;
  for (int d = 0; d < last; ++d) {
    sl->strides[d] /= k;
    dl->strides[d] /= k;
  }
  return true;
}

template <int kWord>
void LaunchWordCopy(const void* src, const Layout& sl, void* dst, const Layout& dl, int64_t n, bool narrow,
                    cudaStream_t stream) {
  using W = Word<kWord>;
  if (narrow) {
    Launch(StridedWordCopyKernel<uint32_t, kWord>, Blocks(n), kThreads, stream, static_cast<const W*>(src), sl,
           static_cast<W*>(dst), dl, n);
  } else {
    Launch(StridedWordCopyKernel<int64_t, kWord>, Blocks(n), kThreads, stream, static_cast<const W*>(src), sl,
           static_cast<W*>(dst), dl, n);
  }
}

// Contiguous float-to-float conversion with the types known at compile time,
// kVec elements a thread per step through one aligned load and store (16
// bytes of f32; the host picks kVec = 1 for unaligned views).
template <ElemType S, ElemType D, int kVec>
__global__ void ConvertKernel(const void* src, void* dst, int64_t n) {
  const int64_t vecs = n / kVec;
  using SRaw = typename std::conditional<S == ElemType::kF32, float, uint16_t>::type;
  using DRaw = typename std::conditional<D == ElemType::kF32, float, uint16_t>::type;
  struct alignas(sizeof(SRaw) * kVec) SVec { SRaw v[kVec]; };
  struct alignas(sizeof(DRaw) * kVec) DVec { DRaw v[kVec]; };
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const SVec in = static_cast<const SVec*>(src)[i];
    DVec out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float f = LoadF(in.v, j, S);
      StoreF(out.v, j, D, f);
    }
    static_cast<DVec*>(dst)[i] = out;
  }
  // The tail (n not a multiple of kVec): the first threads.
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (t < n - vecs * kVec) StoreF(dst, vecs * kVec + t, D, LoadF(src, vecs * kVec + t, S));
}

template <ElemType S, ElemType D>
void LaunchConvert(const void* src, void* dst, int64_t n, cudaStream_t stream) {
  constexpr int kVec = 4;
  const bool aligned = reinterpret_cast<uintptr_t>(src) % (kVec * ElemSize(S)) == 0 &&
                       reinterpret_cast<uintptr_t>(dst) % (kVec * ElemSize(D)) == 0;
  if (aligned) {
    Launch(ConvertKernel<S, D, kVec>, Blocks(n / kVec), kThreads, stream, src, dst, n);
  } else {
    Launch(ConvertKernel<S, D, 1>, Blocks(n), kThreads, stream, src, dst, n);
  }
}

// dst <- src converted, both contiguous float buffers of different types.
// False where the pair has no specialized kernel.
bool ConvertContiguous(const void* src, ElemType st, void* dst, ElemType dt, int64_t n, cudaStream_t stream) {
  using E = ElemType;
  if (st == E::kF32 && dt == E::kBF16) LaunchConvert<E::kF32, E::kBF16>(src, dst, n, stream);
  else if (st == E::kBF16 && dt == E::kF32) LaunchConvert<E::kBF16, E::kF32>(src, dst, n, stream);
  else if (st == E::kF32 && dt == E::kF16) LaunchConvert<E::kF32, E::kF16>(src, dst, n, stream);
  else if (st == E::kF16 && dt == E::kF32) LaunchConvert<E::kF16, E::kF32>(src, dst, n, stream);
  else return false;
  return true;
}

__global__ void FillRandomKernel(char* p, ElemType t, int64_t n, uint64_t seed, bool normal) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float v = normal ? PhiloxNormal(seed, static_cast<uint64_t>(i)) : PhiloxUniform(seed, static_cast<uint64_t>(i));
    StoreF(p, i, t, v);
  }
}

template <typename T>
__device__ __forceinline__ T Apply(BinaryOp op, T x, T y) {
  switch (op) {
    case BinaryOp::kAdd: return x + y;
    case BinaryOp::kSub: return x - y;
    case BinaryOp::kMul: return x * y;
  }
  return x;
}

__global__ void BinaryKernel(BinaryOp op, ElemType t, const char* a, const char* b, char* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    if (t == ElemType::kI32) {
      reinterpret_cast<int32_t*>(out)[i] =
          Apply(op, reinterpret_cast<const int32_t*>(a)[i], reinterpret_cast<const int32_t*>(b)[i]);
    } else if (t == ElemType::kI64) {
      reinterpret_cast<int64_t*>(out)[i] =
          Apply(op, reinterpret_cast<const int64_t*>(a)[i], reinterpret_cast<const int64_t*>(b)[i]);
    } else {
      StoreF(out, i, t, Apply(op, LoadF(a, i, t), LoadF(b, i, t)));
    }
  }
}

// Binary's arithmetic for PackedRows (x = a, d = b).
struct BinaryPackOp {
  BinaryOp op;
  __device__ float operator()(float x, float y, float) const { return Apply(op, x, y); }
};

__global__ void ScaleKernel(ElemType t, const char* a, float s, char* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    StoreF(out, i, t, LoadF(a, i, t) * s);
  }
}

// out (out_t) = a (t) * s[0]: the factor read on the device.
__global__ void ScaleByKernel(ElemType t, const char* a, const float* s, ElemType out_t, char* out, int64_t n) {
  const float f = *s;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    StoreF(out, i, out_t, LoadF(a, i, t) * f);
  }
}

// Pass 1: block b sums the elements b*kThreads + t + k*gridDim*kThreads in a
// fixed order and tree; pass 2 sums the partials in block order.
// With `square`, of the elements' squares.
__global__ void SumPartialsKernel(ElemType t, const char* a, int64_t n, bool square, double* partials) {
  __shared__ double acc[kThreads];
  double s = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double v = IsInt(t) ? static_cast<double>(LoadI(a, i, t)) : static_cast<double>(LoadF(a, i, t));
    s += square ? v * v : v;
  }
  const double total = BlockSum(s, acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

__global__ void SumFinalKernel(const double* partials, int count, double* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double s = 0;
    for (int i = 0; i < count; ++i) s += partials[i];
    *out = s;
  }
}

// partials[partial_offset + b] <- block b's sum in double (of squares with
// `square`), over its chunk in a fixed order and tree.
__global__ void MultiSumPartialsKernel(TensorList<BufferRef> list, bool square, double* partials,
                                       int64_t partial_offset) {
  __shared__ double acc[kThreads];
  int64_t begin = 0, end = 0;
  const BufferRef& x = BlockTensor(list, &begin, &end);
  double s = 0;
  for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    const double v = LoadF(x.data, i, x.type);
    s += square ? v * v : v;
  }
  const double total = BlockSum(s, acc);
  if (threadIdx.x == 0) partials[partial_offset + blockIdx.x] = total;
}

// acc[0] += the partials summed in order, in f32. One block: its threads
// sum strided slices, then a tree (a fixed order either way).
__global__ void MultiSumFinalKernel(const double* partials, int64_t count, float* acc) {
  __shared__ double s[kThreads];
  double v = 0;
  for (int64_t i = threadIdx.x; i < count; i += blockDim.x) v += partials[i];
  const double total = BlockSum(v, s);
  if (threadIdx.x == 0) acc[0] += static_cast<float>(total);
}

// The device's default memory pool, set to keep what it has reserved (CUDA's
// default release threshold, 0, gives freed memory back at every
// synchronization): after the first training step, tensors reuse the pool's
// memory and no step asks the device for more.
absl::StatusOr<cudaMemPool_t> KeptPool(int device) {
  static std::mutex mu;
  static std::set<int>* configured = new std::set<int>;
  cudaMemPool_t pool = nullptr;
  RETURN_IF_CUDA(cudaDeviceGetDefaultMemPool(&pool, device));
  std::lock_guard<std::mutex> lock(mu);  // two non-blocking calls, once per device
  if (configured->insert(device).second) {
    uint64_t keep_all = UINT64_MAX;
    const cudaError_t e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
    if (e != cudaSuccess) configured->erase(device);
    RETURN_IF_CUDA(e);
  }
  return pool;
}

// The pinned staging ring of one device (Upload): kSlots buffers of 1 MiB
// (16 MiB of page-locked memory per device, allocated as used and kept
// until exit), each with the event of the last copy out of it. A slot is
// taken under the mutex and filled outside it once that copy has run (a
// query; a slot still in flight is passed over); the host never waits for
// the device here.
constexpr int kStagingSlots = 16;
constexpr size_t kMaxStagedUpload = 1 << 20;

struct StagingSlot {
  void* host = nullptr;  // kMaxStagedUpload bytes (MakePinnedSlot)
  cudaEvent_t done = nullptr;
  bool in_use = false;  // taken by an Upload in progress
};

struct DeviceStaging {
  std::mutex mu;
  StagingSlot slots[kStagingSlots];  // guarded by mu (in_use; the rest by in_use's owner)
  int next = 0;
};

// The process's one T of `device`, made at first use and kept until exit
// (the staging ring, the started reads).
template <typename T>
T& OfDevice(int device) {
  static std::mutex mu;
  static auto* by_device = new std::map<int, std::unique_ptr<T>>;
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<T>& t = (*by_device)[device];
  if (t == nullptr) t = std::make_unique<T>();
  return *t;
}

DeviceStaging& Staging(int device) { return OfDevice<DeviceStaging>(device); }

// Makes a slot's event (`event_flags`) and its page-locked buffer of
// `bytes` where it has none yet (the staging ring's, the started reads'),
// both kept until exit: cudaFreeHost waits for the device, which may be
// inside a collective waiting for this very thread. What failed stays null.
cudaError_t MakePinnedSlot(cudaEvent_t* done, unsigned event_flags, void** host, size_t bytes) {
  if (*done == nullptr) {
    const cudaError_t e = cudaEventCreateWithFlags(done, event_flags);
    if (e != cudaSuccess) {
      *done = nullptr;
      return e;
    }
  }
  if (*host == nullptr) {
    const cudaError_t e = cudaMallocHost(host, bytes);
    if (e != cudaSuccess) {
      *host = nullptr;
      return e;
    }
  }
  return cudaSuccess;
}

// Fills `slot` with src and copies it to dst on `stream`; *staged is false
// (and nothing done) where the slot's previous copy has not run yet.
absl::Status StagedCopy(StagingSlot& slot, void* dst, const void* src, size_t nbytes, cudaStream_t stream,
                        bool* staged) {
  *staged = false;
  if (slot.done != nullptr) {
    const cudaError_t q = cudaEventQuery(slot.done);
    if (q == cudaErrorNotReady) return absl::OkStatus();  // its copy is still to run: Upload tries the next
    RETURN_IF_CUDA(q);
  }
  RETURN_IF_CUDA(MakePinnedSlot(&slot.done, cudaEventDisableTiming, &slot.host, kMaxStagedUpload));
  std::memcpy(slot.host, src, nbytes);
  RETURN_IF_CUDA(cudaMemcpyAsync(dst, slot.host, nbytes, cudaMemcpyHostToDevice, stream));
  const cudaError_t recorded = cudaEventRecord(slot.done, stream);
  if (recorded != cudaSuccess) {
    // The event still marks the slot's previous copy: let this one run
    // before anything refills the slot.
    (void)cudaStreamSynchronize(stream);
    RETURN_IF_CUDA(recorded);
  }
  *staged = true;
  return absl::OkStatus();
}

}  // namespace

absl::Status Upload(int device, void* dst, const void* src, size_t nbytes) {
  if (nbytes == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  DeviceStaging& staging = Staging(device);
  bool staged = false;
  // Each slot at most once, from the next one round: a slot whose last copy
  // has not run yet (the host runs a step ahead, so the uploads of two
  // steps may be in flight) is passed over for the next.
  for (int tried = 0; nbytes <= kMaxStagedUpload && !staged && tried < kStagingSlots; ++tried) {
    StagingSlot* slot = nullptr;
    {
      std::lock_guard<std::mutex> lock(staging.mu);
      for (int i = 0; i < kStagingSlots && slot == nullptr; ++i) {
        const int k = (staging.next + i) % kStagingSlots;
        if (!staging.slots[k].in_use) {
          slot = &staging.slots[k];
          slot->in_use = true;
          staging.next = (k + 1) % kStagingSlots;
        }
      }
    }
    if (slot == nullptr) break;  // every slot is being filled by another thread
    const absl::Status s = StagedCopy(*slot, dst, src, nbytes, stream, &staged);
    std::lock_guard<std::mutex> lock(staging.mu);
    slot->in_use = false;
    if (!s.ok()) return s;
  }
  if (!staged) {  // large, every slot busy, or the device far behind: CUDA stages it
    RETURN_IF_CUDA(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyHostToDevice, stream));
  }
  return absl::OkStatus();
}

namespace {

// The started reads of one device (StartRead): page-locked slots of
// kMaxStartedRead bytes, each with the event of its copy, at most
// kMaxReadSlots a device. A slot is taken under the mutex and used outside
// it by its ticket's holder. A device has one compute stream in the process
// (stream.h), so the copies into a slot run in the order they were
// enqueued: a slot dropped with its copy still to run is free at once, as
// the next copy into it runs after that one. A ticket is the slot's index
// + 1 in its low 8 bits and the slot's use count above them, so a stale
// ticket names no slot.
constexpr size_t kMaxReadSlots = 64;

struct ReadSlot {
  void* host = nullptr;  // kMaxStartedRead bytes (MakePinnedSlot)
  cudaEvent_t done = nullptr;
  bool in_use = false;  // a ticket holds it
  uint64_t uses = 0;    // times taken
  size_t nbytes = 0;    // the holder's read
};

struct DeviceReads {
  std::mutex mu;
  std::vector<std::unique_ptr<ReadSlot>> slots;  // guarded by mu (the vector, in_use and uses)
};

DeviceReads& Reads(int device) { return OfDevice<DeviceReads>(device); }

// The slot `ticket` holds on `device`, or null for a ticket no read holds.
ReadSlot* SlotOf(int device, uint64_t ticket) {
  DeviceReads& reads = Reads(device);
  std::lock_guard<std::mutex> lock(reads.mu);
  const uint64_t index = ticket & 0xff;
  if (index == 0 || index > reads.slots.size()) return nullptr;
  ReadSlot* slot = reads.slots[index - 1].get();
  return slot->in_use && (ticket >> 8) == slot->uses ? slot : nullptr;
}

void ReleaseSlot(int device, ReadSlot* slot) {
  DeviceReads& reads = Reads(device);
  std::lock_guard<std::mutex> lock(reads.mu);
  slot->in_use = false;
}

}  // namespace

absl::StatusOr<uint64_t> StartRead(int device, const void* src, size_t nbytes) {
  if (nbytes > kMaxStartedRead) {
    return absl::InvalidArgumentError(absl::StrCat("StartRead: ", nbytes, " bytes (at most ", kMaxStartedRead, ")"));
  }
  COLOD_CUDA_BEGIN(stream, device);
  DeviceReads& reads = Reads(device);
  ReadSlot* slot = nullptr;
  uint64_t ticket = 0;
  {
    std::lock_guard<std::mutex> lock(reads.mu);
    size_t index = 0;
    while (index < reads.slots.size() && reads.slots[index]->in_use) ++index;
    if (index == reads.slots.size()) {
      if (reads.slots.size() >= kMaxReadSlots) {
        return absl::ResourceExhaustedError(
            absl::StrCat("StartRead: ", kMaxReadSlots, " reads of CUDA device ", device, " are pending"));
      }
      reads.slots.push_back(std::make_unique<ReadSlot>());
    }
    slot = reads.slots[index].get();
    slot->in_use = true;
    ++slot->uses;
    slot->nbytes = nbytes;
    ticket = (slot->uses << 8) | (index + 1);
  }
  // The ticket's holder owns the slot from here.
  auto fail = [&](cudaError_t e, const char* what) {
    ReleaseSlot(device, slot);
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("StartRead on CUDA device ", device, ": ", what, ": ",
                                            cudaGetErrorString(e)));
  };
  const cudaError_t made =
      MakePinnedSlot(&slot->done, cudaEventDisableTiming | cudaEventBlockingSync, &slot->host, kMaxStartedRead);
  if (made != cudaSuccess) return fail(made, "its event or page-locked buffer");
  if (nbytes > 0) {
    const cudaError_t e = cudaMemcpyAsync(slot->host, src, nbytes, cudaMemcpyDeviceToHost, stream);
    if (e != cudaSuccess) return fail(e, "cudaMemcpyAsync");
  }
  const cudaError_t e = cudaEventRecord(slot->done, stream);
  if (e != cudaSuccess) return fail(e, "cudaEventRecord");
  return ticket;
}

absl::Status FinishRead(int device, uint64_t ticket, void* dst, size_t nbytes) {
  ReadSlot* slot = SlotOf(device, ticket);
  if (slot == nullptr) return absl::InvalidArgumentError(absl::StrCat("FinishRead: no read ", ticket));
  if (nbytes != slot->nbytes) {
    const size_t started = slot->nbytes;
    ReleaseSlot(device, slot);
    return absl::InvalidArgumentError(
        absl::StrCat("FinishRead: read ", ticket, " holds ", started, " bytes, not ", nbytes));
  }
  // The copy's event, not the stream: work enqueued after the read runs on.
  const cudaError_t e = cudaEventSynchronize(slot->done);
  if (e != cudaSuccess) {
    ReleaseSlot(device, slot);
    cudaGetLastError();
    return absl::InternalError(absl::StrCat("FinishRead on CUDA device ", device, ": cudaEventSynchronize: ",
                                            cudaGetErrorString(e)));
  }
  if (nbytes > 0) std::memcpy(dst, slot->host, nbytes);
  ReleaseSlot(device, slot);
  return absl::OkStatus();
}

void DropRead(int device, uint64_t ticket) {
  if (ReadSlot* slot = SlotOf(device, ticket)) ReleaseSlot(device, slot);
}

// Stream ordered on the device's compute stream: the memory is usable by
// work enqueued there from now on. Another stream (a communicator's) must
// wait on an event of the compute stream before it touches the memory, as
// NcclCommunicator does before every collective.
absl::StatusOr<void*> Malloc(int device, size_t nbytes) {
  COLOD_CUDA_BEGIN(stream, device);
  const absl::StatusOr<cudaMemPool_t> pool = KeptPool(device);
  if (!pool.ok()) return pool.status();
  void* p = nullptr;
  cudaError_t e = cudaMallocAsync(&p, nbytes == 0 ? 1 : nbytes, stream);
  if (e == cudaErrorMemoryAllocation) {
    // The pool may hold freed blocks of other sizes: give them back and retry once.
    cudaGetLastError();
    RETURN_IF_CUDA(cudaStreamSynchronize(stream));
    RETURN_IF_CUDA(cudaMemPoolTrimTo(*pool, 0));
    e = cudaMallocAsync(&p, nbytes == 0 ? 1 : nbytes, stream);
  }
  RETURN_IF_CUDA(e);
  return p;
}

void Free(int device, void* p) {
  if (p == nullptr) return;
  absl::StatusOr<cudaStream_t> stream = ComputeStream(device);
  if (stream.ok()) cudaFreeAsync(p, *stream);  // in stream order: after every use enqueued so far
}

absl::Status Memset0(int device, void* p, size_t nbytes) {
  if (nbytes == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  RETURN_IF_CUDA(cudaMemsetAsync(p, 0, nbytes, stream));
  return Finish("cudaMemsetAsync");
}

absl::Status Memcpy(int device, void* dst, const void* src, size_t nbytes) {
  if (nbytes == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  // Into pageable host memory (the callers' buffers; only Upload's staging
  // is pinned) CUDA returns once the copy has completed, after the work
  // enqueued before it: the caller may read `dst` at once. From pageable
  // memory CUDA stages the source before it returns, so the caller may reuse
  // `src` at once (Upload avoids that path for the per-step uploads).
  RETURN_IF_CUDA(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream));
  return Finish("cudaMemcpyAsync");
}

absl::Status StridedCopy(int device, const void* src, const Layout& src_layout, ElemType src_type, void* dst,
                         const Layout& dst_layout, ElemType dst_type) {
  if (src_layout.ndim != dst_layout.ndim || src_layout.ndim > kMaxDims) {
    return absl::InvalidArgumentError("StridedCopy: layouts differ in rank or exceed kMaxDims");
  }
  int64_t n = 1;
  for (int d = 0; d < src_layout.ndim; ++d) {
    if (src_layout.shape[d] != dst_layout.shape[d]) return absl::InvalidArgumentError("StridedCopy: shapes differ");
    n *= src_layout.shape[d];
  }
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  Layout sl = src_layout, dl = dst_layout;
  CoalesceLayouts(&sl, &dl);
  if (sl.ndim == 1 && sl.strides[0] == 1 && dl.strides[0] == 1) {  // contiguous on both sides
    if (src_type == dst_type) {
      RETURN_IF_CUDA(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * ElemSize(src_type), cudaMemcpyDeviceToDevice,
                                     stream));
      return absl::OkStatus();
    }
    if (ConvertContiguous(src, src_type, dst, dst_type, n, stream)) return Finish("ConvertKernel");
  }
  bool narrow = n <= INT32_MAX;
  for (int d = 0; d < sl.ndim; ++d) narrow = narrow && sl.shape[d] <= INT32_MAX;
  if (src_type == dst_type) {  // in the widest words the layouts allow, at least the element
    const int es = ElemSize(src_type);
    for (int word : {16, 8, 4, 2}) {
      if (word < es || !WidenLayouts(&sl, &dl, es, word, src, dst)) continue;
      const int64_t words = n / (word / es);
      if (word == 16) LaunchWordCopy<16>(src, sl, dst, dl, words, narrow, stream);
      if (word == 8) LaunchWordCopy<8>(src, sl, dst, dl, words, narrow, stream);
      if (word == 4) LaunchWordCopy<4>(src, sl, dst, dl, words, narrow, stream);
      if (word == 2) LaunchWordCopy<2>(src, sl, dst, dl, words, narrow, stream);
      return Finish("StridedWordCopyKernel");
    }
  }
  if (narrow) {
    Launch(StridedCopyKernel<uint32_t>, Blocks(n), kThreads, stream, static_cast<const char*>(src), sl, src_type,
           static_cast<char*>(dst), dl, dst_type, n);
  } else {
    Launch(StridedCopyKernel<int64_t>, Blocks(n), kThreads, stream, static_cast<const char*>(src), sl, src_type,
           static_cast<char*>(dst), dl, dst_type, n);
  }
  return Finish("StridedCopyKernel");
}

absl::Status FillRandom(int device, void* p, ElemType type, int64_t n, uint64_t seed, bool normal) {
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  Launch(FillRandomKernel, Blocks(n), kThreads, stream, static_cast<char*>(p), type, n, seed, normal);
  return Finish("FillRandomKernel");
}

absl::Status Binary(int device, BinaryOp op, ElemType type, const void* a, const void* b, void* out, int64_t n) {
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  // Float operands in packs of 16 bytes where aligned: one row of n.
  bool packed = false;
  if (type == ElemType::kF32) packed = PackedRows<float>(stream, BinaryPackOp{op}, a, b, nullptr, out, n, n);
  if (type == ElemType::kBF16) packed = PackedRows<Bf16>(stream, BinaryPackOp{op}, a, b, nullptr, out, n, n);
  if (type == ElemType::kF16) packed = PackedRows<F16>(stream, BinaryPackOp{op}, a, b, nullptr, out, n, n);
  if (packed) return Finish("PackedRowsKernel");
  Launch(BinaryKernel, Blocks(n), kThreads, stream,
      op, type, static_cast<const char*>(a), static_cast<const char*>(b), static_cast<char*>(out), n);
  return Finish("BinaryKernel");
}

absl::Status Scale(int device, ElemType type, const void* a, float s, void* out, int64_t n) {
  if (IsInt(type)) return absl::InvalidArgumentError("Scale: float types only");
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  Launch(ScaleKernel, Blocks(n), kThreads, stream, type, static_cast<const char*>(a), s,
                                                               static_cast<char*>(out), n);
  return Finish("ScaleKernel");
}

absl::Status ScaleBy(int device, ElemType type, const void* a, const float* s, ElemType out_type, void* out,
                     int64_t n) {
  if (IsInt(type) || IsInt(out_type)) return absl::InvalidArgumentError("ScaleBy: float types only");
  if (n == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  Launch(ScaleByKernel, Blocks(n), kThreads, stream, type, static_cast<const char*>(a), s, out_type,
         static_cast<char*>(out), n);
  return Finish("ScaleByKernel");
}

absl::StatusOr<double> Sum(int device, ElemType type, const void* a, int64_t n) {
  if (n == 0) return 0.0;
  COLOD_CUDA_BEGIN(stream, device);
  const unsigned blocks = Blocks(n);
  double* buf = nullptr;
  RETURN_IF_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&buf), (blocks + 1) * sizeof(double), stream));
  Launch(SumPartialsKernel, blocks, kThreads, stream, type, static_cast<const char*>(a), n, false, buf);
  Launch(SumFinalKernel, 1, 1, stream, buf, static_cast<int>(blocks), buf + blocks);
  double result = 0;
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) {
    e = cudaMemcpyAsync(&result, buf + blocks, sizeof(double), cudaMemcpyDeviceToHost, stream);
  }
  // Into pageable memory: complete when cudaMemcpyAsync returns.
  cudaFreeAsync(buf, stream);
  RETURN_IF_CUDA(e);
  return result;
}

absl::Status AccumulateSum(int device, const std::vector<BufferRef>& parts, bool square, float* acc) {
  int64_t total_blocks = 0;
  for (const BufferRef& p : parts) {
    if (IsInt(p.type)) return absl::InvalidArgumentError("AccumulateSum: float types only");
    if (p.n > 0) total_blocks += (p.n + kMultiChunk - 1) / kMultiChunk;
  }
  if (total_blocks == 0) return absl::OkStatus();
  COLOD_CUDA_BEGIN(stream, device);
  double* partials = nullptr;
  RETURN_IF_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&partials), total_blocks * sizeof(double), stream));
  int64_t offset = 0;
  absl::Status s = ForEachLaunch(parts, [&](const TensorList<BufferRef>& list, int64_t blocks) {
    Launch(MultiSumPartialsKernel, static_cast<unsigned>(blocks), kThreads, stream, list, square, partials, offset);
    offset += blocks;
    return Finish("MultiSumPartialsKernel");
  });
  if (s.ok()) {
    Launch(MultiSumFinalKernel, 1, kThreads, stream, static_cast<const double*>(partials), total_blocks, acc);
    s.Update(Finish("MultiSumFinalKernel"));
  }
  cudaFreeAsync(partials, stream);  // after the kernels, in stream order
  return s;
}

}  // namespace colod::kernels::cuda
