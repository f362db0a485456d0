// The execution model of colod's CUDA emulation: a launch becomes one task
// on its stream; the task runs the grid's blocks one after another, and a
// block's threads as fibers on the stream's host thread, so
// __syncthreads is a real barrier and __shared__ (static thread_local) is a
// block's own.
//
// A block starts with its thread 0 on a fiber. If that thread returns
// without reaching a barrier, the kernel has none on this path (CUDA
// requires a barrier to be reached by every thread of the block or by none),
// and the remaining threads run as plain calls, without fibers: the cost of
// barrier-free kernels. Otherwise every thread gets a fiber, and the block
// runs in rounds from one __syncthreads to the next: warp by warp (the first
// warp first, after each odd-numbered barrier the last), each warp's lanes
// run through their warp-level operations to the barrier or their end
// before the next warp starts; a round in which some threads ended while
// others wait at a barrier is the divergent barrier the hardware would hang
// on, reported and aborted.
//
// Warp-level operations (__shfl_sync, __ballot_sync, __syncwarp, mma.sync,
// ldmatrix: WarpExchange) are barriers of the warp's 32 lanes: a lane puts
// its contribution in its warp's slot and yields; once every lane of the
// warp waits there, the scheduler resumes them, and each reads all 32 slots.
// The slots are double-buffered by the warp's parity, so a lane that runs on
// to the warp's next operation writes the other half while its laggards
// still read this one. Warps are as far apart as a GPU may let them be, not
// in lock step (the rounds above), so a warp that overwrites shared memory
// another still reads without a barrier shows (with cp.async's NaN bytes,
// warp.cc). A lane that returned or waits at __syncthreads while
// others of its warp wait at a warp-level operation hangs a GPU: reported
// and aborted. A block whose thread 0 returns without a barrier or a
// warp-level operation runs its other threads as plain calls, so one of them
// reaching a warp-level operation is reported too (a kernel where warp 0
// skips the warp-level operations the others perform would need thread 0 to
// reach one; none of colod's does).
//
// Under ThreadSanitizer (--config=cuda-emu-tsan) every thread of a block
// gets a fiber (no plain calls), and each fiber is a thread of its own to
// TSan, ordered by nothing but what orders a block's threads on a GPU (the
// Scheduler's comment), so a missing __syncthreads is a data race it reports.
//
// Thread-safety: LaunchGrid may be called from any thread. Fibers and their
// stacks belong to the host thread that runs them (thread_local).
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cuda/emu/runtime_internal.h"

#ifdef COLOD_CUDA_EMU_TSAN
#include <sanitizer/tsan_interface.h>
#endif

// Switching fibers. On x86-64 a hand-written switch saves the callee-saved
// registers, MXCSR and the x87 control word on the old stack and restores
// them from the new one: a few nanoseconds, where swapcontext makes a
// sigprocmask system call each time (block reductions switch thousands of
// times per block). Elsewhere ucontext does it.
#if defined(__x86_64__)
extern "C" void colod_emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl colod_emu_switch
.type colod_emu_switch,@function
colod_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size colod_emu_switch,.-colod_emu_switch
.section .note.GNU-stack,"",@progbits
.text
)");
#define COLOD_EMU_ASM_SWITCH 1
#endif

namespace colod_cuda_emu {

namespace {

// A warp some of whose lanes wait at a warp-level operation while the others
// returned or wait at __syncthreads: the hardware hangs.
std::string WarpDivergence(int warp, int at_warp, int returned, int at_barrier, uint3 b) {
  return "a warp-level operation (__shfl_sync, __ballot_sync, __syncwarp, mma.sync, ldmatrix) reached by " +
         std::to_string(at_warp) + " lanes of warp " + std::to_string(warp) + " while " + std::to_string(returned) +
         " had returned and " + std::to_string(at_barrier) +
         " wait at __syncthreads: a divergent warp, which hangs a GPU (block " + std::to_string(b.x) + "," +
         std::to_string(b.y) + "," + std::to_string(b.z) + ")";
}

void CheckWarpArguments(size_t bytes, unsigned mask, int lanes) {
  if (bytes == 0 || bytes > kWarpSlotBytes) Fatal("WarpExchange of " + std::to_string(bytes) + " bytes");
  const unsigned all = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
  if ((mask & all) != all) {
    Fatal("a warp-level operation with mask " + std::to_string(mask) +
          ", which leaves out lanes the warp has: the emulation runs them by whole warps only");
  }
}

// What WarpExchange returns: the first `lanes` slots of `bytes` each, then
// zeros for the lanes a partial warp does not have.
void CopyLanes(const unsigned char (*slot)[kWarpSlotBytes], int lanes, size_t bytes, void* all) {
  unsigned char* out = static_cast<unsigned char*>(all);
  for (int l = 0; l < 32; ++l) {
    if (l < lanes) {
      memcpy(out + l * bytes, slot[l], bytes);
    } else {
      memset(out + l * bytes, 0, bytes);
    }
  }
}

}  // namespace

thread_local const ThreadContext* current_thread = nullptr;

namespace {

constexpr size_t kStackBytes = 256 << 10;

// Under ThreadSanitizer (--config=cuda-emu-tsan) every fiber is a thread of
// its own to TSan (its fiber API), ordered only by a __syncthreads among the
// block's threads, a warp-level operation among its warp's lanes, and the
// end of a block before the next one. A fiber's switch back to the
// scheduler orders nothing (__tsan_switch_to_fiber_no_sync), and the
// scheduler's switch to a fiber passes on only the scheduler's own history,
// which holds no fiber's of the running block: it takes the fibers'
// histories at the block's end only (block_end). So two threads' accesses
// with no barrier between them are a race TSan reports, whatever order the
// scheduler ran them in. Two orderings are stronger than a GPU's, so what
// only they order is not reported: every warp-level operation orders its
// lanes' memory (on a GPU __syncwarp does, a shuffle orders only the values
// it moves), and a grid's blocks, which run one after another here, are
// ordered (on a GPU they are not: two blocks writing one place without
// atomics is a race TSan does not see here). The scheduler's bookkeeping
// that fibers write and it reads, or the reverse (the fiber states,
// running, the warps' parity and byte count, current_thread), is accessed
// with relaxed atomics (Relaxed, SetRelaxed): never reported, and ordering
// nothing. Without TSan those compile to plain loads and stores, and
// TsanRelease and TsanAcquire do nothing.
#ifdef COLOD_CUDA_EMU_TSAN
constexpr bool kTsan = true;
void TsanRelease(void* sync) { __tsan_release(sync); }
void TsanAcquire(void* sync) { __tsan_acquire(sync); }
#else
constexpr bool kTsan = false;
void TsanRelease(void*) {}
void TsanAcquire(void*) {}
#endif

template <typename T>
T Relaxed(const T& v) {
  return __atomic_load_n(&v, __ATOMIC_RELAXED);
}

template <typename T>
void SetRelaxed(T& v, T x) {
  __atomic_store_n(&v, x, __ATOMIC_RELAXED);
}

void SetCurrentThread(const ThreadContext* t) { SetRelaxed(current_thread, t); }

struct Fiber {
#ifdef COLOD_EMU_ASM_SWITCH
  void* sp = nullptr;  // saved stack pointer while suspended
#else
  ucontext_t context;
#endif
  void* stack = nullptr;  // kStackBytes plus a guard page below
  void* tsan = nullptr;   // its TSan fiber (under TSan)
  // The states the scheduler reads: Relaxed and SetRelaxed only.
  bool done = false;
  bool at_barrier = false;  // waits at __syncthreads
  bool at_warp = false;     // waits at a warp-level operation
  unsigned barriers = 0;    // the __syncthreads it passed in this block (its own)
  bool started = false;     // has its Entry frame: after a block it waits in Entry's loop
};

// A warp's exchange slots, double-buffered by parity (WarpExchange).
struct WarpSlots {
  unsigned char slot[2][32][kWarpSlotBytes];
  int parity = 0;    // Relaxed and SetRelaxed only
  size_t bytes = 0;  // what the lanes waiting now put; Relaxed and SetRelaxed only
};

// The host thread's block scheduler.
struct Scheduler {
#ifdef COLOD_EMU_ASM_SWITCH
  void* main_sp = nullptr;
#else
  ucontext_t main;
#endif
  std::vector<Fiber> fibers;
  std::vector<ThreadContext> contexts;
  std::vector<WarpSlots> warps;
  const std::function<void()>* body = nullptr;
  unsigned char* dynamic_shared = nullptr;  // the grid's dynamic shared memory
  int running = -1;     // the fiber running now, or -1; Relaxed and SetRelaxed only
  bool direct = false;  // threads run as plain calls: a barrier is divergence
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  // Under TSan: the host thread's own TSan context, and what orders a
  // block's threads (__syncthreads by its parity, as the warps' slots; the
  // block's end for the scheduler).
  void* tsan_main = nullptr;
  char barrier_sync[2] = {};
  char block_end = 0;

  Scheduler() {
    fibers.reserve(1024);  // a block's most threads: a suspended fiber's Fiber never moves
#ifdef COLOD_CUDA_EMU_TSAN
    tsan_main = __tsan_get_current_fiber();
#endif
  }

  ~Scheduler() {
    for (Fiber& f : fibers) {
      if (f.stack != nullptr) munmap(f.stack, kStackBytes + page);
#ifdef COLOD_CUDA_EMU_TSAN
      if (f.tsan != nullptr) __tsan_destroy_fiber(f.tsan);
#endif
    }
  }

  void EnsureFibers(size_t n) {
    while (fibers.size() < n) {
      Fiber f;
      f.stack = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
      if (f.stack == MAP_FAILED) Fatal("cannot map a fiber stack");
      mprotect(f.stack, page, PROT_NONE);  // overflow faults instead of corrupting
#ifdef COLOD_CUDA_EMU_TSAN
      f.tsan = __tsan_create_fiber(0);
#endif
      fibers.push_back(f);
    }
  }

  static void Entry();

  // Prepares fiber i to run the kernel body from its start: a new fiber gets
  // a frame that enters Entry; one that ran a block before waits at the end
  // of Entry's loop, which runs the body again when resumed. (A fiber never
  // leaves Entry: ThreadSanitizer's shadow call stack of each fiber stays
  // balanced, where a frame rebuilt for every block left Entry's entries on
  // it, about 2 a block.)
  void Start(int i) {
    Fiber& f = fibers[i];
    SetRelaxed(f.done, false);
    SetRelaxed(f.at_barrier, false);
    SetRelaxed(f.at_warp, false);
    f.barriers = 0;
    if (f.started) return;
    f.started = true;
#ifdef COLOD_EMU_ASM_SWITCH
    // The frame colod_emu_switch pops: MXCSR and x87 control word, r15, r14,
    // r13, r12, rbx, rbp, then the return address (Entry), above which a
    // fake return slot leaves rsp % 16 == 8 at Entry, as after a call.
    uintptr_t top = (reinterpret_cast<uintptr_t>(f.stack) + page + kStackBytes) & ~uintptr_t{15};
    void** frame = reinterpret_cast<void**>(top);
    *--frame = nullptr;                                        // fake return address of Entry
    *--frame = reinterpret_cast<void*>(&Scheduler::Entry);     // ret target
    for (int r = 0; r < 6; ++r) *--frame = nullptr;            // rbp rbx r12 r13 r14 r15
    uint32_t control[2];
    asm volatile("stmxcsr %0" : "=m"(control[0]));
    asm volatile("fnstcw %0" : "=m"(control[1]));
    *--frame = nullptr;
    memcpy(frame, control, 4);
    memcpy(reinterpret_cast<char*>(frame) + 4, &control[1], 2);
    f.sp = frame;
#else
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = static_cast<char*>(f.stack) + page;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;  // Entry never returns
    makecontext(&f.context, &Scheduler::Entry, 0);
#endif
  }

  // Runs fiber i until it reaches a barrier or ends.
  void Resume(int i) {
    SetRelaxed(running, i);
    SetCurrentThread(&contexts[i]);
#ifdef COLOD_CUDA_EMU_TSAN
    __tsan_switch_to_fiber(fibers[i].tsan, 0);  // passes on the scheduler's history only
#endif
#ifdef COLOD_EMU_ASM_SWITCH
    colod_emu_switch(&main_sp, fibers[i].sp);
#else
    swapcontext(&main, &fibers[i].context);
#endif
    SetRelaxed(running, -1);
  }

  // From fiber i back to the scheduler.
  void Yield(int i) {
#ifdef COLOD_CUDA_EMU_TSAN
    __tsan_switch_to_fiber(tsan_main, __tsan_switch_to_fiber_no_sync);
#endif
#ifdef COLOD_EMU_ASM_SWITCH
    colod_emu_switch(&fibers[i].sp, main_sp);
#else
    swapcontext(&fibers[i].context, &main);
#endif
  }

  // Releases warp w from its warp-level operations until none of its lanes
  // waits at one (they wait at __syncthreads or returned); a warp some of
  // whose lanes wait at one while the others do not is divergent.
  void RunWarp(int w, int n, uint3 block_idx) {
    const int first = 32 * w, end = first + 32 < n ? first + 32 : n;
    for (;;) {
      int at_warp = 0, done = 0, at_barrier = 0;
      for (int i = first; i < end; ++i) {
        at_warp += Relaxed(fibers[i].at_warp);
        done += Relaxed(fibers[i].done);
        at_barrier += Relaxed(fibers[i].at_barrier);
      }
      if (at_warp == 0) return;
      if (at_warp != end - first) Fatal(WarpDivergence(w, at_warp, done, at_barrier, block_idx));
      SetRelaxed(warps[w].parity, Relaxed(warps[w].parity) ^ 1);
      SetRelaxed(warps[w].bytes, size_t{0});
      for (int i = first; i < end; ++i) {
        SetRelaxed(fibers[i].at_warp, false);
        Resume(i);
      }
    }
  }

  void RunBlock(dim3 grid, dim3 block, uint3 block_idx) {
    const int n = static_cast<int>(block.x * block.y * block.z);
    contexts.resize(n);
    for (int i = 0; i < n; ++i) {
      const unsigned t = static_cast<unsigned>(i);
      contexts[i] = ThreadContext{uint3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)}, block_idx,
                                  block, grid, dynamic_shared};
    }
    const int nwarps = (n + 31) / 32;
    if (static_cast<int>(warps.size()) < nwarps) warps.resize(nwarps);
    for (int w = 0; w < nwarps; ++w) SetRelaxed(warps[w].bytes, size_t{0});
    EnsureFibers(1);
    Start(0);
    Resume(0);
    // Under TSan every thread gets a fiber, so that each is a thread of its own to it.
    if (Relaxed(fibers[0].done) && !kTsan) {
      // No barrier on thread 0's path: none on any thread's.
      direct = true;
      for (int i = 1; i < n; ++i) {
        current_thread = &contexts[i];
        (*body)();
      }
      direct = false;
      current_thread = nullptr;
      return;
    }
    EnsureFibers(n);
    // Warps run as far apart as a GPU may let them be: each warp is run on
    // through its warp-level operations to its next __syncthreads (or its
    // end) before the next warp moves, from the start and after each
    // barrier, so a warp that overwrites shared memory another still reads
    // without a barrier between them shows.
    for (int w = 0; w < nwarps; ++w) {
      for (int i = 32 * w; i < 32 * w + 32 && i < n; ++i) {
        if (i == 0) continue;  // started above
        Start(i);
        Resume(i);
      }
      RunWarp(w, n, block_idx);
    }
    for (int round = 1;; ++round) {
      int done = 0, waiting = 0;
      for (int i = 0; i < n; ++i) (Relaxed(fibers[i].done) ? done : waiting) += 1;
      if (waiting == 0) break;
      if (done > 0) {
        Fatal("__syncthreads reached by " + std::to_string(waiting) + " of the block's " + std::to_string(n) +
              " threads while " + std::to_string(done) +
              " had returned: a divergent barrier, which hangs or corrupts a GPU (block " +
              std::to_string(block_idx.x) + "," + std::to_string(block_idx.y) + "," + std::to_string(block_idx.z) +
              ")");
      }
      // Odd rounds the last warp first: a buffer only higher warps write
      // and lower ones read shows too.
      for (int k = 0; k < nwarps; ++k) {
        const int w = round % 2 == 1 ? nwarps - 1 - k : k;
        for (int i = 32 * w; i < 32 * w + 32 && i < n; ++i) {
          SetRelaxed(fibers[i].at_barrier, false);
          Resume(i);
        }
        RunWarp(w, n, block_idx);
      }
    }
    TsanAcquire(&block_end);  // what every thread of the block did
    SetCurrentThread(nullptr);
  }
};

thread_local Scheduler scheduler;

// A fiber's life: the body as one CUDA thread of a block, then, resumed by
// a later block's Start, as that block's thread (i is read again: the
// fiber plays the same index, but `running` is the scheduler's).
void Scheduler::Entry() {
  Scheduler& s = scheduler;
  for (;;) {
    (*s.body)();
    const int i = Relaxed(s.running);
    SetRelaxed(s.fibers[i].done, true);
    TsanRelease(&s.block_end);  // after its last write here: the scheduler may free the fibers after the block
    s.Yield(i);
  }
}

}  // namespace

void SyncThreads() {
  Scheduler& s = scheduler;
  if (CurrentThread() == nullptr) Fatal("__syncthreads called outside a kernel");
  if (s.direct) {
    Fatal("__syncthreads reached by a thread although thread 0 of its block returned without one: a divergent "
          "barrier, which hangs or corrupts a GPU");
  }
  const int i = Relaxed(s.running);
  // By the barrier's parity: a thread resumed before another arrives at the
  // next barrier, so the next one's releases must not reach this one's
  // acquires.
  char* sync = &s.barrier_sync[s.fibers[i].barriers++ % 2];
  TsanRelease(sync);
  SetRelaxed(s.fibers[i].at_barrier, true);
  s.Yield(i);  // the scheduler sets current_thread again when it resumes this fiber
  TsanAcquire(sync);
}

void WarpExchange(const void* mine, size_t bytes, unsigned mask, void* all) {
  Scheduler& s = scheduler;
  if (CurrentThread() == nullptr) Fatal("a warp-level operation called outside a kernel");
  const ThreadContext& t = *CurrentThread();
  const int n = static_cast<int>(t.block_dim.x * t.block_dim.y * t.block_dim.z);
  if (s.direct) {
    Fatal("a warp-level operation (__shfl_sync, __ballot_sync, __syncwarp, mma.sync, ldmatrix) reached by a "
          "thread although thread 0 of its block returned without one: a divergent warp if they share one; "
          "otherwise thread 0 must reach one for the emulation to run the block's threads as fibers");
  }
  const int i = Relaxed(s.running);
  const int w = i / 32, lane = i % 32;
  CheckWarpArguments(bytes, mask, n - 32 * w < 32 ? n - 32 * w : 32);
  WarpSlots& slots = s.warps[w];
  const size_t waiting = Relaxed(slots.bytes);
  if (waiting != 0 && waiting != bytes) {
    Fatal("lanes of warp " + std::to_string(w) + " wait at different warp-level operations (" +
          std::to_string(waiting) + " and " + std::to_string(bytes) + " bytes)");
  }
  SetRelaxed(slots.bytes, bytes);
  const int parity = Relaxed(slots.parity);
  memcpy(slots.slot[parity][lane], mine, bytes);
  TsanRelease(&slots.slot[parity]);
  SetRelaxed(s.fibers[i].at_warp, true);
  s.Yield(i);  // the scheduler sets current_thread again when it resumes this fiber
  TsanAcquire(&slots.slot[parity]);
  CopyLanes(slots.slot[parity], n - 32 * w < 32 ? n - 32 * w : 32, bytes, all);
}

namespace {

// Dynamic shared memory a block: what any launch may ask for, and the
// opt-in limit of sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin).
constexpr size_t kDefaultDynamicShared = 48 << 10;
constexpr size_t kOptInDynamicShared = 227 << 10;

struct alignas(16) Pack16 {
  unsigned char bytes[16];
};

// Each kernel's cudaFuncAttributeMaxDynamicSharedMemorySize where set.
std::mutex func_attributes_mu;
std::map<const void*, int>& FuncMaxDynamicShared() {
  static auto* m = new std::map<const void*, int>;  // guarded by func_attributes_mu; never destroyed
  return *m;
}

// The dynamic shared memory a launch of `kernel` may ask for.
size_t MaxDynamicShared(const void* kernel) {
  std::lock_guard<std::mutex> lock(func_attributes_mu);
  auto it = FuncMaxDynamicShared().find(kernel);
  return it == FuncMaxDynamicShared().end() ? kDefaultDynamicShared : static_cast<size_t>(it->second);
}

}  // namespace

cudaError_t LaunchGrid(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream, const void* kernel,
                       std::function<void()> thread) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || threads == 0 || threads > 1024 || block.z > 64 ||
      grid.y > 65535 || grid.z > 65535 || grid.x > 0x7fffffffu ||
      (shared_bytes > kDefaultDynamicShared && shared_bytes > MaxDynamicShared(kernel))) {
    SetLastError(cudaErrorInvalidConfiguration);
    return cudaErrorInvalidConfiguration;
  }
  std::shared_ptr<Stream> s = Resolve(stream);
  if (s == nullptr) {
    SetLastError(cudaErrorInvalidResourceHandle);
    return cudaErrorInvalidResourceHandle;
  }
  if (cudaError_t e = StickyError(DeviceOf(*s))) {
    SetLastError(e);
    return e;
  }
  CountKernelLaunch();
  NoteLaunch(DeviceOf(*s));  // the launch that faults returns success: the fault is asynchronous
  Enqueue(s, [grid, block, shared_bytes, thread = std::move(thread)] {
    // 16-byte aligned, as `extern __shared__ __align__(16)` is; garbage
    // (NaNs) at first, as on a GPU.
    std::vector<Pack16> dynamic((shared_bytes + 15) / 16);
    if (!dynamic.empty()) memset(dynamic.data(), 0xff, dynamic.size() * sizeof(Pack16));
    unsigned char* shared = dynamic.empty() ? nullptr : reinterpret_cast<unsigned char*>(dynamic.data());
    Scheduler& sched = scheduler;
    sched.body = &thread;
    sched.dynamic_shared = shared;
    for (unsigned z = 0; z < grid.z; ++z) {
      for (unsigned y = 0; y < grid.y; ++y) {
        for (unsigned x = 0; x < grid.x; ++x) sched.RunBlock(grid, block, uint3{x, y, z});
      }
    }
    sched.body = nullptr;
    sched.dynamic_shared = nullptr;
  });
  return cudaSuccess;
}

}  // namespace colod_cuda_emu

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
  using colod_cuda_emu::kOptInDynamicShared;
  if (func == nullptr || attr != cudaFuncAttributeMaxDynamicSharedMemorySize || value < 0 ||
      static_cast<size_t>(value) > kOptInDynamicShared) {
    colod_cuda_emu::SetLastError(cudaErrorInvalidValue);
    return cudaErrorInvalidValue;
  }
  std::lock_guard<std::mutex> lock(colod_cuda_emu::func_attributes_mu);
  colod_cuda_emu::FuncMaxDynamicShared()[func] = value;
  return cudaSuccess;
}
