// The CUDA runtime of colod's emulation (include/cuda_runtime.h): devices,
// memory, streams and events. Streams are host threads that run their work
// in order; the legacy default stream orders itself with every blocking
// stream of its device through per-stream submitted/completed counters, as
// CUDA's does.
//
// Thread-safety: every entry point may be called from any thread. The
// registry's mutex guards the device, stream, event and allocation tables
// and is never held while waiting for a stream.
#include "kernels/cuda/emu/runtime_internal.h"

#include <cuda_emu.h>

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

namespace colod_cuda_emu {
namespace {

thread_local cudaError_t last_error = cudaSuccess;
thread_local int current_device = 0;

cudaError_t Fail(cudaError_t e) {
  if (e != cudaSuccess) last_error = e;
  return e;
}

int64_t EnvInt(const char* name, int64_t fallback) {
  const char* v = getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long long n = strtoll(v, &end, 10);
  if (end == v || *end != '\0' || n < 0) {
    fprintf(stderr, "colod CUDA emulation: %s=%s is not a non-negative integer; using %lld\n", name, v,
            static_cast<long long>(fallback));
    return fallback;
  }
  return n;
}

}  // namespace

// A stream: a host thread running tasks in order. `submitted` counts tasks
// enqueued, `completed` tasks finished; a waiter for task k waits until
// completed >= k.
class Stream {
 public:
  Stream(int device, bool blocking, bool legacy) : device_(device), blocking_(blocking), legacy_(legacy) {}
  ~Stream() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

  int device() const { return device_; }
  bool blocking() const { return blocking_; }
  bool legacy() const { return legacy_; }

  // Enqueues `fn`; returns its task number.
  uint64_t Enqueue(std::function<void()> fn) {
    std::lock_guard<std::mutex> l(mu_);
    if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
    queue_.push_back(std::move(fn));
    ++submitted_;
    cv_.notify_all();
    return submitted_;
  }

  uint64_t Submitted() {
    std::lock_guard<std::mutex> l(mu_);
    return submitted_;
  }

  // Waits until the first `task` tasks completed.
  void WaitFor(uint64_t task) {
    std::unique_lock<std::mutex> l(mu_);
    cv_.wait(l, [&] { return completed_ >= task; });
  }

  bool Done(uint64_t task) {
    std::lock_guard<std::mutex> l(mu_);
    return completed_ >= task;
  }

  void Synchronize() { WaitFor(Submitted()); }

 private:
  void Run() {
    current_device = device_;
    std::unique_lock<std::mutex> l(mu_);
    for (;;) {
      cv_.wait(l, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, drained
      std::function<void()> fn = std::move(queue_.front());
      queue_.pop_front();
      l.unlock();
      fn();
      fn = nullptr;  // its captures (other streams) are released outside the lock
      l.lock();
      ++completed_;
      cv_.notify_all();
    }
  }

  const int device_;
  const bool blocking_;
  const bool legacy_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  uint64_t submitted_ = 0;
  uint64_t completed_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

namespace {

struct Allocation {
  size_t size;
  int device;
  size_t block = 0;  // a pool block's bytes; 0 for cudaMalloc's own
};

// Each device's default memory pool (cudaMallocAsync): freed blocks are kept
// for reuse by an allocation of the same rounded size, and returned to the
// device while more than the release threshold is kept free. CUDA's pool
// sub-allocates and trims at synchronization points; exact-size reuse and
// trimming at the free are the emulation's simplification (the same sizes
// recur from step to step, which is what a pool is for).
// A block freed with cudaFreeAsync is reusable at once by allocations on the
// stream that freed it (they come after the free in stream order, as CUDA
// allows) and by any stream once that stream has reached the free.
struct FreeBlock {
  void* p;
  const void* stream;  // the freeing stream (an identity, never dereferenced)
  uint64_t seq;        // which free of p this is
  bool ready;          // the stream has reached the free
};
struct Pool {
  uint64_t release_threshold = 0;  // CUDA's default: give back what is freed
  size_t reserved = 0, reserved_high = 0, used = 0, used_high = 0;
  std::multimap<size_t, FreeBlock> free;  // by block bytes
};

// Calls made on the host, for tests of what a step does (cuda_emu.h): for
// the process, and for the calling host thread.
std::atomic<uint64_t> device_allocations{0}, host_synchronizations{0}, stream_queries{0}, kernel_launches{0},
    pageable_uploads{0}, warp_mmas{0}, async_copies{0};
thread_local Counters this_thread_counters;

void CountPageableUpload() {
  pageable_uploads.fetch_add(1, std::memory_order_relaxed);
  ++this_thread_counters.pageable_uploads;
}

// Page-locked host memory (cudaMallocHost): copies from it are not staged
// and read it when the stream reaches them; copies into it do not block.
class PinnedRanges {
 public:
  static PinnedRanges& Get() {
    static PinnedRanges* r = new PinnedRanges();
    return *r;
  }
  void Add(const void* p, size_t n) {
    std::lock_guard<std::mutex> l(mu_);
    ranges_[reinterpret_cast<uintptr_t>(p)] = n;
  }
  bool Remove(const void* p) {
    std::lock_guard<std::mutex> l(mu_);
    return ranges_.erase(reinterpret_cast<uintptr_t>(p)) == 1;
  }
  // Whether [p, p + n) lies in one pinned allocation.
  bool Contains(const void* p, size_t n) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> l(mu_);
    auto it = ranges_.upper_bound(a);
    if (it == ranges_.begin()) return false;
    --it;
    return a >= it->first && a + n <= it->first + it->second;
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, size_t> ranges_;
};

void CountDeviceAllocation() {
  device_allocations.fetch_add(1, std::memory_order_relaxed);
  ++this_thread_counters.device_allocations;
}

void CountStreamQuery() {
  stream_queries.fetch_add(1, std::memory_order_relaxed);
  ++this_thread_counters.stream_queries;
}

// The process-wide tables.
class Registry {
 public:
  static Registry& Get() {
    static Registry* r = new Registry();  // never destroyed: streams may outlive static destruction
    return *r;
  }

  int devices() const { return devices_; }
  size_t capacity() const { return capacity_; }

  std::shared_ptr<Stream> NewStream(int device, bool blocking, bool legacy) {
    auto s = std::make_shared<Stream>(device, blocking, legacy);
    std::lock_guard<std::mutex> l(mu_);
    streams_[s.get()] = s;
    return s;
  }

  void DropStream(Stream* s) {
    std::shared_ptr<Stream> keep;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = streams_.find(s);
      if (it == streams_.end()) return;
      keep = std::move(it->second);
      streams_.erase(it);
    }
    // `keep` joins the stream's thread here, outside the lock.
  }

  std::shared_ptr<Stream> Find(Stream* s) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = streams_.find(s);
    return it == streams_.end() ? nullptr : it->second;
  }

  std::shared_ptr<Stream> Legacy(int device) {
    std::lock_guard<std::mutex> l(mu_);
    std::shared_ptr<Stream>& s = legacy_[device];
    if (s == nullptr) {
      s = std::make_shared<Stream>(device, true, true);
      streams_[s.get()] = s;
    }
    return s;
  }

  // Every stream of `device` with (blocking only: when `blocking_only`).
  std::vector<std::shared_ptr<Stream>> StreamsOf(int device, bool blocking_only) {
    std::vector<std::shared_ptr<Stream>> out;
    std::lock_guard<std::mutex> l(mu_);
    for (auto& [p, s] : streams_) {
      if (s->device() == device && (!blocking_only || s->blocking())) out.push_back(s);
    }
    return out;
  }

  // cudaMalloc: new device memory.
  cudaError_t Allocate(int device, size_t size, void** out) {
    const size_t bytes = size == 0 ? 1 : size;
    void* p = nullptr;
    const cudaError_t e = NewMemory(device, bytes, &p);
    if (e != cudaSuccess) return e;
    std::lock_guard<std::mutex> l(mu_);
    allocations_[p] = Allocation{bytes, device};
    *out = p;
    return cudaSuccess;
  }

  // cudaMallocAsync: a free block of the device's pool, or new memory the
  // pool then keeps.
  cudaError_t AllocateFromPool(int device, size_t size, const void* stream, void** out) {
    const size_t bytes = size == 0 ? 1 : size;
    if (bytes > capacity_) return cudaErrorMemoryAllocation;
    const size_t block = (bytes + 511) / 512 * 512;
    {
      std::lock_guard<std::mutex> l(mu_);
      Pool& pool = pools_[device];
      for (auto [it, end] = pool.free.equal_range(block); it != end; ++it) {
        if (!it->second.ready && it->second.stream != stream) continue;
        void* p = it->second.p;
        pool.free.erase(it);
        Use(pool, block);
        allocations_[p] = Allocation{bytes, device, block};
        *out = p;
        return cudaSuccess;
      }
    }
    void* p = nullptr;
    const cudaError_t e = NewMemory(device, block, &p);
    if (e != cudaSuccess) return e;
    std::lock_guard<std::mutex> l(mu_);
    Pool& pool = pools_[device];
    pool.reserved += block;
    pool.reserved_high = std::max(pool.reserved_high, pool.reserved);
    Use(pool, block);
    allocations_[p] = Allocation{bytes, device, block};
    *out = p;
    return cudaSuccess;
  }

  // cudaFree and the stream-ordered cudaFreeAsync: a pool block goes back to
  // its pool (and the pool trims to its threshold), other memory to the host.
  cudaError_t Release(void* p) {
    std::vector<void*> give_back;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = allocations_.find(p);
      if (it == allocations_.end()) return cudaErrorInvalidValue;
      const Allocation a = it->second;
      allocations_.erase(it);
      if (a.block == 0) {
        used_[a.device] -= a.size;
        give_back.push_back(p);
      } else {
        Pool& pool = pools_[a.device];
        pool.used -= a.block;
        pool.free.emplace(a.block, FreeBlock{p, nullptr, ++free_seq_, true});
        Trim(a.device, pool, give_back);
      }
    }
    for (void* q : give_back) free(q);
    return cudaSuccess;
  }

  // cudaMemPoolGetAttribute / cudaMemPoolSetAttribute on a device's pool.
  cudaError_t GetPoolAttribute(int device, cudaMemPoolAttr attr, uint64_t* value) {
    std::lock_guard<std::mutex> l(mu_);
    const Pool& pool = pools_[device];
    switch (attr) {
      case cudaMemPoolAttrReleaseThreshold: *value = pool.release_threshold; return cudaSuccess;
      case cudaMemPoolAttrReservedMemCurrent: *value = pool.reserved; return cudaSuccess;
      case cudaMemPoolAttrReservedMemHigh: *value = pool.reserved_high; return cudaSuccess;
      case cudaMemPoolAttrUsedMemCurrent: *value = pool.used; return cudaSuccess;
      case cudaMemPoolAttrUsedMemHigh: *value = pool.used_high; return cudaSuccess;
    }
    return cudaErrorInvalidValue;
  }

  // cudaFreeAsync of a pool block on `stream`: reusable now in that stream's
  // order, by other streams after Reached(). Returns the block's bytes and
  // the free's sequence number; nothing for memory that is not a live pool
  // block (the caller frees that in stream order).
  std::optional<std::pair<size_t, uint64_t>> FreeToPool(void* p, const void* stream) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = allocations_.find(p);
    if (it == allocations_.end() || it->second.block == 0) return std::nullopt;
    const Allocation a = it->second;
    allocations_.erase(it);
    Pool& pool = pools_[a.device];
    pool.used -= a.block;
    const uint64_t seq = ++free_seq_;
    pool.free.emplace(a.block, FreeBlock{p, stream, seq, false});
    return std::make_pair(a.block, seq);
  }

  // The freeing stream reached free `seq` of pool block p (a no-op when the
  // stream already reused the block).
  void Reached(int device, void* p, size_t block, uint64_t seq) {
    std::vector<void*> give_back;
    {
      std::lock_guard<std::mutex> l(mu_);
      Pool& pool = pools_[device];
      for (auto [it, end] = pool.free.equal_range(block); it != end; ++it) {
        if (it->second.p == p && it->second.seq == seq) it->second.ready = true;
      }
      Trim(device, pool, give_back);
    }
    for (void* q : give_back) free(q);
  }

  // cudaMemPoolTrimTo.
  void TrimPool(int device, size_t keep) {
    std::vector<void*> give_back;
    {
      std::lock_guard<std::mutex> l(mu_);
      Trim(device, pools_[device], give_back, keep);
    }
    for (void* q : give_back) free(q);
  }

  cudaError_t SetPoolAttribute(int device, cudaMemPoolAttr attr, uint64_t value) {
    std::vector<void*> give_back;
    {
      std::lock_guard<std::mutex> l(mu_);
      Pool& pool = pools_[device];
      switch (attr) {
        case cudaMemPoolAttrReleaseThreshold:
          pool.release_threshold = value;
          Trim(device, pool, give_back);
          break;
        case cudaMemPoolAttrReservedMemHigh: pool.reserved_high = pool.reserved; break;  // CUDA: reset (value 0)
        case cudaMemPoolAttrUsedMemHigh: pool.used_high = pool.used; break;
        default: return cudaErrorInvalidValue;  // the current values cannot be set
      }
    }
    for (void* q : give_back) free(q);
    return cudaSuccess;
  }

  bool Owns(const void* p) {
    std::lock_guard<std::mutex> l(mu_);
    return allocations_.count(const_cast<void*>(p)) > 0;
  }

  // The device allocation holding [p, p + size), if one does.
  std::optional<DeviceRange> RangeOf(const void* p, size_t size) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = allocations_.upper_bound(const_cast<void*>(p));
    if (it == allocations_.begin()) return std::nullopt;
    --it;
    const char* base = static_cast<const char*>(it->first);
    const char* q = static_cast<const char*>(p);
    if (q < base || static_cast<size_t>(q - base) > it->second.size ||
        size > it->second.size - static_cast<size_t>(q - base)) {
      return std::nullopt;
    }
    return DeviceRange{it->second.device, it->first, it->second.size};
  }

  size_t Used(int device) {
    std::lock_guard<std::mutex> l(mu_);
    return used_[device];
  }

 private:
  // Frees the pool's blocks (largest first) while it keeps more free than its
  // threshold, or (keep set) more reserved than `keep`; the caller frees
  // `give_back` outside the lock.
  void Trim(int device, Pool& pool, std::vector<void*>& give_back, std::optional<size_t> keep = std::nullopt) {
    // Largest first; blocks whose stream has not reached their free may
    // still be in use and stay.
    for (auto it = pool.free.end(); it != pool.free.begin();) {
      --it;
      if (keep.has_value() ? pool.reserved <= *keep : pool.reserved - pool.used <= pool.release_threshold) break;
      if (!it->second.ready) continue;
      pool.reserved -= it->first;
      used_[device] -= it->first;
      give_back.push_back(it->second.p);
      it = pool.free.erase(it);
    }
  }

  static void Use(Pool& pool, size_t block) {
    pool.used += block;
    pool.used_high = std::max(pool.used_high, pool.used);
  }

  // `bytes` of new device memory, charged against the capacity.
  cudaError_t NewMemory(int device, size_t bytes, void** out) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (used_[device] + bytes > capacity_ || bytes > capacity_) return cudaErrorMemoryAllocation;
      used_[device] += bytes;
    }
    void* p = aligned_alloc(256, (bytes + 255) / 256 * 256);  // cudaMalloc aligns to 256 bytes
    if (p == nullptr) {
      std::lock_guard<std::mutex> l(mu_);
      used_[device] -= bytes;
      return cudaErrorMemoryAllocation;
    }
    CountDeviceAllocation();
    *out = p;
    return cudaSuccess;
  }

  Registry()
      : devices_(static_cast<int>(std::min<int64_t>(EnvInt("COLOD_CUDA_EMU_DEVICES", 4), 64))),
        capacity_(static_cast<size_t>(EnvInt("COLOD_CUDA_EMU_MEMORY", int64_t{8} << 30))) {}

  const int devices_;
  const size_t capacity_;
  std::mutex mu_;
  std::map<Stream*, std::shared_ptr<Stream>> streams_;
  std::map<int, std::shared_ptr<Stream>> legacy_;
  std::map<void*, Allocation> allocations_;
  std::map<int, size_t> used_;  // device memory the process holds, pools' reserves included
  std::map<int, Pool> pools_;
  uint64_t free_seq_ = 0;
};

// The calling thread's per-thread default streams, one per device; drained
// and dropped when the thread exits. The pointer is trivially destructible,
// so CUDA calls made after the thread's thread_local destructors ran (static
// destructors at exit) find it null and use the legacy stream.
struct PerThreadStreams {
  std::map<int, std::shared_ptr<Stream>> by_device;
};
thread_local PerThreadStreams* per_thread = nullptr;
thread_local bool per_thread_gone = false;
struct PerThreadReaper {
  ~PerThreadReaper() {
    PerThreadStreams* p = per_thread;
    per_thread = nullptr;
    per_thread_gone = true;
    if (p == nullptr) return;
    for (auto& [d, s] : p->by_device) {
      s->Synchronize();
      Registry::Get().DropStream(s.get());
    }
    delete p;
  }
};
thread_local PerThreadReaper per_thread_reaper;

}  // namespace

std::shared_ptr<Stream> Resolve(cudaStream_t handle) {
  Registry& r = Registry::Get();
  if (handle == nullptr || handle == cudaStreamLegacy) return r.Legacy(current_device);
  if (handle == cudaStreamPerThread) {
    if (per_thread_gone) return r.Legacy(current_device);  // the thread is exiting
    if (per_thread == nullptr) {
      (void)&per_thread_reaper;  // constructs the reaper: it runs at thread exit
      per_thread = new PerThreadStreams();
    }
    std::shared_ptr<Stream>& s = per_thread->by_device[current_device];
    if (s == nullptr) s = r.NewStream(current_device, /*blocking=*/true, /*legacy=*/false);
    return s;
  }
  return r.Find(reinterpret_cast<Stream*>(handle));
}

void Enqueue(const std::shared_ptr<Stream>& s, std::function<void()> fn) {
  Registry& r = Registry::Get();
  if (s->legacy()) {
    // The legacy stream waits for the work already submitted to every
    // blocking stream of its device.
    std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> before;
    for (auto& other : r.StreamsOf(s->device(), /*blocking_only=*/true)) {
      if (other != s) before.emplace_back(other, other->Submitted());
    }
    s->Enqueue([before = std::move(before), fn = std::move(fn)] {
      for (auto& [other, task] : before) other->WaitFor(task);
      fn();
    });
  } else if (s->blocking()) {
    // A blocking stream's work waits for the legacy stream's earlier work.
    std::shared_ptr<Stream> legacy = r.Legacy(s->device());
    const uint64_t task = legacy->Submitted();
    s->Enqueue([legacy, task, fn = std::move(fn)] {
      legacy->WaitFor(task);
      fn();
    });
  } else {
    s->Enqueue(std::move(fn));
  }
}

void SetLastError(cudaError_t e) { Fail(e); }

int DeviceOf(const Stream& s) { return s.device(); }

int CurrentDevice() { return current_device; }

std::optional<DeviceRange> FindDeviceRange(const void* p, size_t size) { return Registry::Get().RangeOf(p, size); }

void Fatal(const std::string& what) {
  fprintf(stderr, "colod CUDA emulation: %s\n", what.c_str());
  fflush(stderr);
  abort();
}

void CountHostSynchronization() {
  host_synchronizations.fetch_add(1, std::memory_order_relaxed);
  ++this_thread_counters.host_synchronizations;
}

void CountKernelLaunch() {
  kernel_launches.fetch_add(1, std::memory_order_relaxed);
  ++this_thread_counters.kernel_launches;
}

void CountWarpMma() { warp_mmas.fetch_add(1, std::memory_order_relaxed); }
void CountAsyncCopy() { async_copies.fetch_add(1, std::memory_order_relaxed); }

Counters GetThreadCounters() { return this_thread_counters; }

namespace {
std::atomic<size_t> fail_async_allocation{0};  // 0: disarmed

// Whether this allocation of `size` bytes is the one the hook fails (it
// disarms then, so exactly one does).
bool TakeAsyncAllocationFailure(size_t size) {
  size_t armed = fail_async_allocation.load();
  while (armed != 0 && size >= armed) {
    if (fail_async_allocation.compare_exchange_weak(armed, 0)) return true;
  }
  return false;
}
}  // namespace

void FailNextAsyncAllocation(size_t min_bytes) { fail_async_allocation.store(min_bytes); }
bool AsyncAllocationFailureArmed() { return fail_async_allocation.load() != 0; }

namespace {
constexpr int kFaultDevices = 64;
// Launches left before the armed fault (the launch that takes it to 0
// faults); 0: none armed.
std::atomic<uint64_t> launches_to_fault[kFaultDevices];
std::atomic<bool> faulted[kFaultDevices];
bool FaultableDevice(int device) { return device >= 0 && device < kFaultDevices; }
}  // namespace

void FaultDeviceAtLaunch(int device, uint64_t launch) {
  if (!FaultableDevice(device)) Fatal("FaultDeviceAtLaunch: no such device");
  if (launch == 0) {
    faulted[device].store(true);
  } else {
    launches_to_fault[device].store(launch);
  }
}

void ClearDeviceFaults() {
  last_error = cudaSuccess;  // the calling thread's, which the failed calls set
  for (int d = 0; d < kFaultDevices; ++d) {
    launches_to_fault[d].store(0);
    faulted[d].store(false);
  }
}

bool DeviceFaulted(int device) { return FaultableDevice(device) && faulted[device].load(); }

cudaError_t StickyError(int device) { return DeviceFaulted(device) ? cudaErrorIllegalAddress : cudaSuccess; }

namespace {
// A fault a test arms in a process it starts (a worker daemon):
// COLOD_CUDA_EMU_FAULT_AT_LAUNCH=DEVICE:N, counted from the process's first
// launch on DEVICE; with COLOD_CUDA_EMU_FAULT_ONCE=PATH only in the first
// process to launch on DEVICE and create PATH (a restarted daemon's new
// context is sound).
struct EnvFault {
  int device = -1;
  unsigned long long launch = 0;
  std::string once;
};
const EnvFault& FaultFromEnv() {
  static const EnvFault fault = [] {
    EnvFault f;
    const char* v = getenv("COLOD_CUDA_EMU_FAULT_AT_LAUNCH");
    if (v == nullptr) return f;
    int used = 0;
    if (sscanf(v, "%d:%llu%n", &f.device, &f.launch, &used) != 2 || v[used] != '\0' || strchr(v, '-') != nullptr ||
        !FaultableDevice(f.device)) {
      Fatal(std::string("COLOD_CUDA_EMU_FAULT_AT_LAUNCH: '") + v + "' is not DEVICE:N");
    }
    if (const char* once = getenv("COLOD_CUDA_EMU_FAULT_ONCE")) f.once = once;
    return f;
  }();
  return fault;
}
std::atomic<bool> env_fault_decided{false};
}  // namespace

void NoteLaunch(int device) {
  const EnvFault& env = FaultFromEnv();
  if (device == env.device && !env_fault_decided.exchange(true)) {
    bool arm = true;
    if (!env.once.empty()) {
      const int fd = open(env.once.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
      arm = fd >= 0;  // else another process faulted already
      if (fd >= 0) close(fd);
    }
    if (arm) FaultDeviceAtLaunch(device, env.launch);  // this launch is the first counted
  }
  if (!FaultableDevice(device)) return;
  uint64_t left = launches_to_fault[device].load();
  while (left != 0) {
    if (launches_to_fault[device].compare_exchange_weak(left, left - 1)) {
      if (left == 1) faulted[device].store(true);
      return;
    }
  }
}

Counters GetCounters() {
  Counters c;
  c.device_allocations = device_allocations.load();
  c.host_synchronizations = host_synchronizations.load();
  c.stream_queries = stream_queries.load();
  c.kernel_launches = kernel_launches.load();
  c.pageable_uploads = pageable_uploads.load();
  c.warp_mmas = warp_mmas.load();
  c.async_copies = async_copies.load();
  return c;
}

// Waits for all work of `device` (cudaDeviceSynchronize, cudaFree).
void SynchronizeDevice(int device) {
  for (auto& s : Registry::Get().StreamsOf(device, /*blocking_only=*/false)) s->Synchronize();
}

namespace {

bool ValidDevice(int d) { return d >= 0 && d < Registry::Get().devices(); }

// Where a pointer lives, for cudaMemcpyDefault and direction checks.
bool IsDevice(const void* p) { return Registry::Get().RangeOf(p, 1).has_value(); }

// Checks a copy of `count` bytes against the allocations and `kind`, and
// says which sides are device memory.
cudaError_t CheckCopy(void* dst, const void* src, size_t count, cudaMemcpyKind kind, bool& dst_dev, bool& src_dev) {
  dst_dev = src_dev = false;
  if (count == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
  dst_dev = Registry::Get().RangeOf(dst, count).has_value();
  src_dev = Registry::Get().RangeOf(src, count).has_value();
  // A device pointer whose range runs past its allocation is neither: check
  // that a pointer that starts in device memory stays there.
  if ((!dst_dev && IsDevice(dst)) || (!src_dev && IsDevice(src))) return cudaErrorInvalidValue;
  switch (kind) {
    case cudaMemcpyHostToHost: return (!dst_dev && !src_dev) ? cudaSuccess : cudaErrorInvalidMemcpyDirection;
    case cudaMemcpyHostToDevice: return (dst_dev && !src_dev) ? cudaSuccess : cudaErrorInvalidMemcpyDirection;
    case cudaMemcpyDeviceToHost: return (!dst_dev && src_dev) ? cudaSuccess : cudaErrorInvalidMemcpyDirection;
    case cudaMemcpyDeviceToDevice: return (dst_dev && src_dev) ? cudaSuccess : cudaErrorInvalidMemcpyDirection;
    case cudaMemcpyDefault: return cudaSuccess;
  }
  return cudaErrorInvalidMemcpyDirection;
}

}  // namespace
}  // namespace colod_cuda_emu

using colod_cuda_emu::Fail;
using colod_cuda_emu::Registry;
using colod_cuda_emu::Resolve;
using colod_cuda_emu::Stream;

struct CUevent_st {
  int device = 0;  // current at creation, as CUDA ties an event to it
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;   // generation of the last cudaEventRecord
  uint64_t completed = 0;  // generation its stream reached
};

namespace colod_cuda_emu {
namespace {
// Events by handle. Pending records and waits hold their own reference, so a
// destroyed event lives until they ran, as CUDA allows.
std::mutex events_mu;
std::map<CUevent_st*, std::shared_ptr<CUevent_st>>& Events() {
  static auto* events = new std::map<CUevent_st*, std::shared_ptr<CUevent_st>>();
  return *events;
}
std::shared_ptr<CUevent_st> FindEvent(CUevent_st* e) {
  std::lock_guard<std::mutex> l(events_mu);
  auto it = Events().find(e);
  return it == Events().end() ? nullptr : it->second;
}
}  // namespace
}  // namespace colod_cuda_emu

const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorUnknown: return "cudaErrorUnknown";
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInsufficientDriver: return "CUDA driver version is insufficient for CUDA runtime version";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorUnknown: return "unknown error";
  }
  return "unknown error";
}

cudaError_t cudaGetLastError() {
  // A broken context's error is sticky: reading it does not clear it.
  if (cudaError_t sticky = colod_cuda_emu::StickyError(colod_cuda_emu::current_device)) return sticky;
  const cudaError_t e = colod_cuda_emu::last_error;
  colod_cuda_emu::last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError() {
  if (cudaError_t sticky = colod_cuda_emu::StickyError(colod_cuda_emu::current_device)) return sticky;
  return colod_cuda_emu::last_error;
}

cudaError_t cudaDriverGetVersion(int* version) {
  if (version == nullptr) return Fail(cudaErrorInvalidValue);
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) { return cudaDriverGetVersion(version); }

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return Fail(cudaErrorInvalidValue);
  *count = Registry::Get().devices();
  return *count == 0 ? Fail(cudaErrorNoDevice) : cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (!colod_cuda_emu::ValidDevice(device)) return Fail(cudaErrorInvalidDevice);
  colod_cuda_emu::current_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return Fail(cudaErrorInvalidValue);
  *device = colod_cuda_emu::current_device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return Fail(cudaErrorInvalidValue);
  if (!colod_cuda_emu::ValidDevice(device)) return Fail(cudaErrorInvalidDevice);
  *prop = cudaDeviceProp{};
  snprintf(prop->name, sizeof prop->name, "colod CUDA emulation");
  prop->totalGlobalMem = Registry::Get().capacity();
  prop->sharedMemPerBlock = 48 << 10;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff;
  prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  prop->pciBusID = device;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  colod_cuda_emu::CountHostSynchronization();
  colod_cuda_emu::SynchronizeDevice(colod_cuda_emu::current_device);
  return Fail(colod_cuda_emu::StickyError(colod_cuda_emu::current_device));
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  if (free_bytes == nullptr || total_bytes == nullptr) return Fail(cudaErrorInvalidValue);
  if (cudaError_t e = colod_cuda_emu::StickyError(colod_cuda_emu::current_device)) return Fail(e);
  Registry& r = Registry::Get();
  *total_bytes = r.capacity();
  *free_bytes = r.capacity() - r.Used(colod_cuda_emu::current_device);
  return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  if (cudaError_t e = colod_cuda_emu::StickyError(colod_cuda_emu::current_device)) return Fail(e);
  return Fail(Registry::Get().Allocate(colod_cuda_emu::current_device, size, ptr));
}

cudaError_t cudaMallocHost(void** ptr, size_t size) {
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  void* p = aligned_alloc(256, (size + 255) / 256 * 256 + 256);
  if (p == nullptr) return Fail(cudaErrorMemoryAllocation);
  colod_cuda_emu::PinnedRanges::Get().Add(p, size == 0 ? 1 : size);
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  if (!colod_cuda_emu::PinnedRanges::Get().Remove(ptr)) return Fail(cudaErrorInvalidValue);
  // Like cudaFree, it waits for the (current) device first.
  colod_cuda_emu::CountHostSynchronization();
  colod_cuda_emu::SynchronizeDevice(colod_cuda_emu::current_device);
  free(ptr);
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  // cudaFree synchronizes the device before it frees.
  auto range = Registry::Get().RangeOf(ptr, 1);
  if (!range.has_value() || range->base != ptr) return Fail(cudaErrorInvalidValue);
  if (cudaError_t e = colod_cuda_emu::StickyError(range->device)) return Fail(e);
  colod_cuda_emu::CountHostSynchronization();
  colod_cuda_emu::SynchronizeDevice(range->device);
  return Fail(Registry::Get().Release(ptr));
}

cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t* pool, int device) {
  if (pool == nullptr || device < 0 || device >= Registry::Get().devices()) return Fail(cudaErrorInvalidValue);
  // Filled once (thread-safe static initialization); a handle names its device.
  static CUmemPoolHandle_st* const pools = [] {
    auto* p = new CUmemPoolHandle_st[64];
    for (int d = 0; d < 64; ++d) p[d].device = d;
    return p;
  }();
  *pool = &pools[device];
  return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  if (pool == nullptr || value == nullptr) return Fail(cudaErrorInvalidValue);
  return Fail(Registry::Get().SetPoolAttribute(pool->device, attr, *static_cast<uint64_t*>(value)));
}

cudaError_t cudaMemPoolGetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void* value) {
  if (pool == nullptr || value == nullptr) return Fail(cudaErrorInvalidValue);
  return Fail(Registry::Get().GetPoolAttribute(pool->device, attr, static_cast<uint64_t*>(value)));
}

cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t min_bytes_to_keep) {
  if (pool == nullptr) return Fail(cudaErrorInvalidValue);
  Registry::Get().TrimPool(pool->device, min_bytes_to_keep);
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t stream) {
  if (ptr == nullptr) return Fail(cudaErrorInvalidValue);
  auto s = Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (cudaError_t e = colod_cuda_emu::StickyError(s->device())) return Fail(e);
  if (colod_cuda_emu::TakeAsyncAllocationFailure(size)) return Fail(cudaErrorMemoryAllocation);
  // Usable in stream order from here: allocating now is at least as early.
  return Fail(Registry::Get().AllocateFromPool(s->device(), size, s.get(), ptr));
}

cudaError_t cudaFreeAsync(void* ptr, cudaStream_t stream) {
  if (ptr == nullptr) return cudaSuccess;
  auto s = Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (cudaError_t e = colod_cuda_emu::StickyError(s->device())) return Fail(e);
  if (!Registry::Get().Owns(ptr)) return Fail(cudaErrorInvalidValue);
  // A pool block: reusable in this stream's order now, by others once the
  // stream has reached the free.
  if (auto freed = Registry::Get().FreeToPool(ptr, s.get())) {
    const int device = s->device();
    colod_cuda_emu::Enqueue(s, [device, ptr, freed] {
      Registry::Get().Reached(device, ptr, freed->first, freed->second);
    });
    return cudaSuccess;
  }
  // Other memory is freed when the stream reaches it: work enqueued before
  // may still use it.
  colod_cuda_emu::Enqueue(s, [ptr] {
    if (Registry::Get().Release(ptr) != cudaSuccess) colod_cuda_emu::Fatal("cudaFreeAsync: double free");
  });
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
  bool dst_dev, src_dev;
  const cudaError_t check = colod_cuda_emu::CheckCopy(dst, src, count, kind, dst_dev, src_dev);
  if (check != cudaSuccess) return Fail(check);
  if (count == 0) return cudaSuccess;
  auto s = Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (cudaError_t e = colod_cuda_emu::StickyError(s->device())) return Fail(e);
  const bool src_pinned = !src_dev && colod_cuda_emu::PinnedRanges::Get().Contains(src, count);
  const bool dst_pinned = !dst_dev && colod_cuda_emu::PinnedRanges::Get().Contains(dst, count);
  if (!src_dev && dst_dev && !src_pinned) {
    // From pageable host memory CUDA stages the source before it returns:
    // the caller may reuse its buffer at once (a real driver may wait for
    // the stream to do so: counted, so tests can see a step make none).
    colod_cuda_emu::CountPageableUpload();
    auto staged = std::make_shared<std::vector<char>>(static_cast<const char*>(src),
                                                      static_cast<const char*>(src) + count);
    colod_cuda_emu::Enqueue(s, [dst, staged] { memcpy(dst, staged->data(), staged->size()); });
    return cudaSuccess;
  }
  // From pinned memory the copy reads the source when the stream reaches it:
  // the caller must not reuse it before then (an event says when).
  colod_cuda_emu::Enqueue(s, [dst, src, count] { memmove(dst, src, count); });
  if (src_dev && !dst_dev && !dst_pinned) {
    // To pageable host memory the copy is synchronous: it has completed on return.
    colod_cuda_emu::CountHostSynchronization();
    s->Synchronize();
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, cudaMemcpyKind kind) {
  const cudaError_t e = cudaMemcpyAsync(dst, src, count, kind, cudaStreamLegacy);
  if (e != cudaSuccess) return e;
  colod_cuda_emu::CountHostSynchronization();
  Resolve(cudaStreamLegacy)->Synchronize();
  return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  if (!Registry::Get().RangeOf(ptr, count).has_value()) return Fail(cudaErrorInvalidValue);
  auto s = Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (cudaError_t e = colod_cuda_emu::StickyError(s->device())) return Fail(e);
  colod_cuda_emu::Enqueue(s, [ptr, value, count] { memset(ptr, value, count); });
  return cudaSuccess;
}

cudaError_t cudaMemset(void* ptr, int value, size_t count) {
  const cudaError_t e = cudaMemsetAsync(ptr, value, count, cudaStreamLegacy);
  if (e != cudaSuccess) return e;
  colod_cuda_emu::CountHostSynchronization();
  Resolve(cudaStreamLegacy)->Synchronize();
  return cudaSuccess;
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (stream == nullptr || (flags & ~1u) != 0) return Fail(cudaErrorInvalidValue);
  if (cudaError_t e = colod_cuda_emu::StickyError(colod_cuda_emu::current_device)) return Fail(e);
  auto s = Registry::Get().NewStream(colod_cuda_emu::current_device, (flags & cudaStreamNonBlocking) == 0, false);
  *stream = reinterpret_cast<cudaStream_t>(s.get());
  return cudaSuccess;
}

cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread) {
    return Fail(cudaErrorInvalidResourceHandle);
  }
  auto s = Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  // CUDA returns at once and lets queued work finish; the stream's thread
  // runs it before it stops.
  Registry::Get().DropStream(s.get());
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  auto s = Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  colod_cuda_emu::CountHostSynchronization();
  s->Synchronize();
  return Fail(colod_cuda_emu::StickyError(s->device()));
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  auto s = Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  colod_cuda_emu::CountStreamQuery();
  if (cudaError_t e = colod_cuda_emu::StickyError(s->device())) return Fail(e);
  return s->Done(s->Submitted()) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int flags) {
  if (event == nullptr || (flags & ~7u) != 0) return Fail(cudaErrorInvalidValue);
  auto e = std::make_shared<CUevent_st>();
  e->device = colod_cuda_emu::current_device;
  std::lock_guard<std::mutex> l(colod_cuda_emu::events_mu);
  colod_cuda_emu::Events()[e.get()] = e;
  *event = e.get();
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::shared_ptr<CUevent_st> e;
  {
    std::lock_guard<std::mutex> l(colod_cuda_emu::events_mu);
    auto it = colod_cuda_emu::Events().find(event);
    if (it == colod_cuda_emu::Events().end()) return Fail(cudaErrorInvalidResourceHandle);
    e = std::move(it->second);
    colod_cuda_emu::Events().erase(it);
  }
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  std::shared_ptr<CUevent_st> e = colod_cuda_emu::FindEvent(event);
  if (e == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  auto s = Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (cudaError_t sticky = colod_cuda_emu::StickyError(s->device())) return Fail(sticky);
  // CUDA records an event only on a stream of the device it was created on.
  if (s->device() != e->device) return Fail(cudaErrorInvalidResourceHandle);
  uint64_t gen;
  {
    std::lock_guard<std::mutex> l(e->mu);
    gen = ++e->recorded;
  }
  colod_cuda_emu::Enqueue(s, [e, gen] {
    std::lock_guard<std::mutex> l(e->mu);
    e->completed = std::max(e->completed, gen);
    e->cv.notify_all();
  });
  return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  std::shared_ptr<CUevent_st> e = colod_cuda_emu::FindEvent(event);
  if (e == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  colod_cuda_emu::CountStreamQuery();
  if (cudaError_t sticky = colod_cuda_emu::StickyError(e->device)) return Fail(sticky);
  std::lock_guard<std::mutex> l(e->mu);
  return e->completed >= e->recorded ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  std::shared_ptr<CUevent_st> e = colod_cuda_emu::FindEvent(event);
  if (e == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  colod_cuda_emu::CountHostSynchronization();
  std::unique_lock<std::mutex> l(e->mu);
  const uint64_t want = e->recorded;
  e->cv.wait(l, [&] { return e->completed >= want; });
  l.unlock();
  return Fail(colod_cuda_emu::StickyError(e->device));
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
  if (flags != 0) return Fail(cudaErrorInvalidValue);
  std::shared_ptr<CUevent_st> e = colod_cuda_emu::FindEvent(event);
  if (e == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  auto s = Resolve(stream);
  if (s == nullptr) return Fail(cudaErrorInvalidResourceHandle);
  if (cudaError_t sticky = colod_cuda_emu::StickyError(s->device())) return Fail(sticky);
  uint64_t want;
  {
    std::lock_guard<std::mutex> l(e->mu);
    want = e->recorded;
  }
  if (want == 0) return cudaSuccess;  // never recorded: nothing to wait for
  colod_cuda_emu::Enqueue(s, [e, want] {
    std::unique_lock<std::mutex> l(e->mu);
    e->cv.wait(l, [&] { return e->completed >= want; });
  });
  return cudaSuccess;
}
