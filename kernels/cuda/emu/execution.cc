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
// The thread mode (COLOD_CUDA_EMU_THREADS, set by --config=cuda-emu-tsan) runs
// a block's threads as real host threads instead, so ThreadSanitizer checks
// the kernels' shared-memory protocol: a missing __syncthreads is a data race
// it reports. A pool of worker threads, worker t playing CUDA thread t, runs
// one grid at a time process-wide (__shared__ is then plain static storage,
// which one block at a time may use); a block ends when all its threads have
// returned, and __syncthreads is a generation-counted barrier. A thread that
// returns while others wait at a barrier, or reaches one after another
// returned, is the divergent barrier, reported and aborted as above. A
// warp-level operation is a generation-counted barrier of the warp's lanes
// with the same double-buffered slots; each thread's state (running, at the
// block barrier, at a warp-level operation, returned) lets whichever lane
// comes second report a warp divided between them.
//
// Thread-safety: LaunchGrid may be called from any thread. Fibers and their
// stacks belong to the host thread that runs them (thread_local); the thread
// mode's pool state is guarded by its mutex.
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/emu/runtime_internal.h"

#ifndef COLOD_CUDA_EMU_THREADS

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
#endif  // !COLOD_CUDA_EMU_THREADS

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

#ifndef COLOD_CUDA_EMU_THREADS

thread_local const ThreadContext* current_thread = nullptr;

namespace {

constexpr size_t kStackBytes = 256 << 10;

struct Fiber {
#ifdef COLOD_EMU_ASM_SWITCH
  void* sp = nullptr;  // saved stack pointer while suspended
#else
  ucontext_t context;
#endif
  void* stack = nullptr;  // kStackBytes plus a guard page below
  bool done = false;
  bool at_barrier = false;  // waits at __syncthreads
  bool at_warp = false;     // waits at a warp-level operation
};

// A warp's exchange slots, double-buffered by parity (WarpExchange).
struct WarpSlots {
  unsigned char slot[2][32][kWarpSlotBytes];
  int parity = 0;
  size_t bytes = 0;  // what the lanes waiting now put
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
  int running = -1;    // the fiber running now, or -1
  bool direct = false;  // threads run as plain calls: a barrier is divergence
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));

  ~Scheduler() {
    for (Fiber& f : fibers) {
      if (f.stack != nullptr) munmap(f.stack, kStackBytes + page);
    }
  }

  void EnsureFibers(size_t n) {
    while (fibers.size() < n) {
      Fiber f;
      f.stack = mmap(nullptr, kStackBytes + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
      if (f.stack == MAP_FAILED) Fatal("cannot map a fiber stack");
      mprotect(f.stack, page, PROT_NONE);  // overflow faults instead of corrupting
      fibers.push_back(f);
    }
  }

  static void Entry();

  // Prepares fiber i to run the kernel body from its start.
  void Start(int i) {
    Fiber& f = fibers[i];
    f.done = false;
    f.at_barrier = false;
    f.at_warp = false;
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
    f.context.uc_link = &main;
    makecontext(&f.context, &Scheduler::Entry, 0);
#endif
  }

  // Runs fiber i until it reaches a barrier or ends.
  void Resume(int i) {
    running = i;
    current_thread = &contexts[i];
#ifdef COLOD_EMU_ASM_SWITCH
    colod_emu_switch(&main_sp, fibers[i].sp);
#else
    swapcontext(&main, &fibers[i].context);
#endif
    running = -1;
  }

  // From fiber i back to the scheduler.
  void Yield(int i) {
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
        at_warp += fibers[i].at_warp;
        done += fibers[i].done;
        at_barrier += fibers[i].at_barrier;
      }
      if (at_warp == 0) return;
      if (at_warp != end - first) Fatal(WarpDivergence(w, at_warp, done, at_barrier, block_idx));
      warps[w].parity ^= 1;
      warps[w].bytes = 0;
      for (int i = first; i < end; ++i) {
        fibers[i].at_warp = false;
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
    for (int w = 0; w < nwarps; ++w) warps[w].bytes = 0;
    EnsureFibers(1);
    Start(0);
    Resume(0);
    if (fibers[0].done) {
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
      for (int i = 0; i < n; ++i) (fibers[i].done ? done : waiting) += 1;
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
          fibers[i].at_barrier = false;
          Resume(i);
        }
        RunWarp(w, n, block_idx);
      }
    }
    current_thread = nullptr;
  }
};

thread_local Scheduler scheduler;

void Scheduler::Entry() {
  Scheduler& s = scheduler;
  (*s.body)();
  const int i = s.running;
  s.fibers[i].done = true;
#ifdef COLOD_EMU_ASM_SWITCH
  s.Yield(i);  // never resumed
  Fatal("a finished fiber was resumed");
#endif
  // ucontext: uc_link returns to `main`.
}

}  // namespace

void SyncThreads() {
  Scheduler& s = scheduler;
  if (current_thread == nullptr) Fatal("__syncthreads called outside a kernel");
  if (s.direct) {
    Fatal("__syncthreads reached by a thread although thread 0 of its block returned without one: a divergent "
          "barrier, which hangs or corrupts a GPU");
  }
  const int i = s.running;
  s.fibers[i].at_barrier = true;
  s.Yield(i);
  current_thread = &s.contexts[i];
}

void WarpExchange(const void* mine, size_t bytes, unsigned mask, void* all) {
  Scheduler& s = scheduler;
  if (current_thread == nullptr) Fatal("a warp-level operation called outside a kernel");
  const ThreadContext& t = *current_thread;
  const int n = static_cast<int>(t.block_dim.x * t.block_dim.y * t.block_dim.z);
  if (s.direct) {
    Fatal("a warp-level operation (__shfl_sync, __ballot_sync, __syncwarp, mma.sync, ldmatrix) reached by a "
          "thread although thread 0 of its block returned without one: a divergent warp if they share one; "
          "otherwise thread 0 must reach one for the emulation to run the block's threads as fibers");
  }
  const int i = s.running;
  const int w = i / 32, lane = i % 32;
  CheckWarpArguments(bytes, mask, n - 32 * w < 32 ? n - 32 * w : 32);
  WarpSlots& slots = s.warps[w];
  if (slots.bytes != 0 && slots.bytes != bytes) {
    Fatal("lanes of warp " + std::to_string(w) + " wait at different warp-level operations (" +
          std::to_string(slots.bytes) + " and " + std::to_string(bytes) + " bytes)");
  }
  slots.bytes = bytes;
  const int parity = slots.parity;
  memcpy(slots.slot[parity][lane], mine, bytes);
  s.fibers[i].at_warp = true;
  s.Yield(i);
  current_thread = &s.contexts[i];
  CopyLanes(slots.slot[parity], n - 32 * w < 32 ? n - 32 * w : 32, bytes, all);
}

#endif  // !COLOD_CUDA_EMU_THREADS

#ifdef COLOD_CUDA_EMU_THREADS
thread_local const ThreadContext* current_thread = nullptr;

namespace {

std::string Divergence(int waiting, int returned, int n, uint3 b) {
  return "__syncthreads reached by " + std::to_string(waiting) + " of the block's " + std::to_string(n) +
         " threads while " + std::to_string(returned) +
         " had returned: a divergent barrier, which hangs or corrupts a GPU (block " + std::to_string(b.x) + "," +
         std::to_string(b.y) + "," + std::to_string(b.z) + ")";
}

// The pool of host threads that play a block's CUDA threads, one grid at a
// time. Thread-safe; lives for the process (its workers never exit).
class BlockThreads {
 public:
  static BlockThreads& Get() {
    static BlockThreads* pool = new BlockThreads;  // never destroyed: workers outlive main
    return *pool;
  }

  // Runs `body` as every thread of every block of the grid; returns when all
  // have returned.
  void Run(dim3 grid, dim3 block, unsigned char* dynamic_shared, const std::function<void()>& body) {
    std::lock_guard<std::mutex> one_grid(grid_mu_);
    const int n = static_cast<int>(block.x * block.y * block.z);
    std::unique_lock<std::mutex> lock(mu_);
    while (static_cast<int>(workers_.size()) < n) {
      const int t = static_cast<int>(workers_.size());
      workers_.emplace_back([this, t] { Work(t); });
    }
    body_ = &body;
    dynamic_shared_ = dynamic_shared;
    grid_ = grid;
    block_ = block;
    n_ = n;
    state_.assign(n, kRunning);
    warps_.resize((n + 31) / 32);
    for (Warp& w : warps_) w.arrived = 0;
    blocks_ = uint64_t{grid.x} * grid.y * grid.z;
    block_index_ = 0;
    arrived_ = returned_ = 0;
    ++grid_generation_;
    cv_.notify_all();
    cv_.wait(lock, [&] { return done_generation_ == grid_generation_; });
    body_ = nullptr;
  }

  // __syncthreads from a CUDA thread of the running block.
  void Barrier() {
    const int t = Linear(*current_thread);
    std::unique_lock<std::mutex> lock(mu_);
    if (returned_ > 0) Fatal(Divergence(arrived_ + 1, returned_, n_, current_thread->block_idx));
    CheckWarpUndivided(t, kAtBarrier, current_thread->block_idx);
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++phase_;
      for (State& st : state_) st = kRunning;
      cv_.notify_all();
      return;
    }
    state_[t] = kAtBarrier;
    const uint64_t phase = phase_;
    cv_.wait(lock, [&] { return phase_ != phase; });
  }

  // A warp-level operation from a CUDA thread of the running block.
  void Exchange(const void* mine, size_t bytes, unsigned mask, void* all) {
    const int t = Linear(*current_thread);
    const int w = t / 32, lane = t % 32;
    std::unique_lock<std::mutex> lock(mu_);
    const int lanes = n_ - 32 * w < 32 ? n_ - 32 * w : 32;
    CheckWarpArguments(bytes, mask, lanes);
    CheckWarpUndivided(t, kAtWarp, current_thread->block_idx);
    Warp& warp = warps_[w];
    if (warp.arrived > 0 && warp.bytes != bytes) {
      Fatal("lanes of warp " + std::to_string(w) + " wait at different warp-level operations (" +
            std::to_string(warp.bytes) + " and " + std::to_string(bytes) + " bytes)");
    }
    warp.bytes = bytes;
    const int parity = warp.parity;
    memcpy(warp.slot[parity][lane], mine, bytes);
    if (++warp.arrived == lanes) {
      warp.arrived = 0;
      warp.parity ^= 1;
      ++warp.phase;
      for (int i = 32 * w; i < 32 * w + lanes; ++i) state_[i] = kRunning;
      cv_.notify_all();
    } else {
      state_[t] = kAtWarp;
      const uint64_t phase = warp.phase;
      cv_.wait(lock, [&] { return warp.phase != phase; });
    }
    CopyLanes(warp.slot[parity], lanes, bytes, all);
  }

 private:
  void Work(int t) {
    ThreadContext context{};
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return grid_generation_ != seen && t < n_ && done_generation_ != grid_generation_; });
      seen = grid_generation_;
      const dim3 grid = grid_, block = block_;
      // A thread still waking from the last block end of this grid when the
      // next grid starts must not take that grid's blocks here: it rejoins
      // through the wait above, with the new grid's shape.
      for (uint64_t b = block_index_; grid_generation_ == seen && b < blocks_; b = block_index_) {
        const unsigned x = static_cast<unsigned>(b % grid.x), y = static_cast<unsigned>((b / grid.x) % grid.y),
                       z = static_cast<unsigned>(b / (uint64_t{grid.x} * grid.y));
        const unsigned u = static_cast<unsigned>(t);
        context = ThreadContext{uint3{u % block.x, (u / block.x) % block.y, u / (block.x * block.y)},
                                uint3{x, y, z}, block, grid, dynamic_shared_};
        const std::function<void()>* body = body_;
        lock.unlock();
        current_thread = &context;
        (*body)();
        current_thread = nullptr;
        lock.lock();
        // This thread has returned from block b.
        if (arrived_ > 0) Fatal(Divergence(arrived_, returned_ + 1, n_, context.block_idx));
        CheckWarpUndivided(t, kReturned, context.block_idx);
        state_[t] = kReturned;
        if (++returned_ == n_) {
          returned_ = 0;
          for (State& st : state_) st = kRunning;
          ++block_index_;
          ++phase_;
          if (block_index_ == blocks_) done_generation_ = grid_generation_;
          cv_.notify_all();
        } else {
          const uint64_t phase = phase_;
          cv_.wait(lock, [&] { return phase_ != phase; });
        }
      }
    }
  }

  enum State { kRunning, kAtBarrier, kAtWarp, kReturned };

  // A warp's exchange slots, double-buffered by parity, and its barrier.
  struct Warp {
    unsigned char slot[2][32][kWarpSlotBytes];
    int parity = 0;
    int arrived = 0;
    size_t bytes = 0;
    uint64_t phase = 0;
  };

  static int Linear(const ThreadContext& c) {
    return static_cast<int>(c.thread_idx.x + c.block_dim.x * (c.thread_idx.y + c.block_dim.y * c.thread_idx.z));
  }

  // Thread t enters `next` (the block barrier, a warp-level operation, or its
  // return): reports a lane of its warp already in a different one of them
  // where one of the two is a warp-level operation (a hang on a GPU).
  void CheckWarpUndivided(int t, State next, uint3 block) {
    const int first = t / 32 * 32, end = first + 32 < n_ ? first + 32 : n_;
    int at_warp = next == kAtWarp, returned = next == kReturned, at_barrier = next == kAtBarrier;
    bool divided = false;
    for (int i = first; i < end; ++i) {
      if (i == t || state_[i] == kRunning) continue;
      at_warp += state_[i] == kAtWarp;
      returned += state_[i] == kReturned;
      at_barrier += state_[i] == kAtBarrier;
      divided = divided || (state_[i] != next && (state_[i] == kAtWarp || next == kAtWarp));
    }
    if (divided) Fatal(WarpDivergence(t / 32, at_warp, returned, at_barrier, block));
  }

  std::mutex grid_mu_;  // one grid at a time: __shared__ is process-wide static storage
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;           // guarded by mu_
  const std::function<void()>* body_ = nullptr;  // guarded by mu_, set while a grid runs
  unsigned char* dynamic_shared_ = nullptr;      // guarded by mu_, the running grid's
  dim3 grid_, block_;                          // guarded by mu_
  int n_ = 0;                                  // threads per block; guarded by mu_
  uint64_t blocks_ = 0, block_index_ = 0;      // guarded by mu_
  int arrived_ = 0;                            // at the barrier now; guarded by mu_
  int returned_ = 0;                           // returned from the block; guarded by mu_
  uint64_t phase_ = 0;                         // barrier and block-end generations; guarded by mu_
  uint64_t grid_generation_ = 0, done_generation_ = 0;  // guarded by mu_
  std::vector<State> state_;                   // each thread of the block; guarded by mu_
  std::vector<Warp> warps_;                    // guarded by mu_
};

}  // namespace

void SyncThreads() {
  if (current_thread == nullptr) Fatal("__syncthreads called outside a kernel");
  BlockThreads::Get().Barrier();
}

void WarpExchange(const void* mine, size_t bytes, unsigned mask, void* all) {
  if (current_thread == nullptr) Fatal("a warp-level operation called outside a kernel");
  BlockThreads::Get().Exchange(mine, bytes, mask, all);
}
#endif  // COLOD_CUDA_EMU_THREADS

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
#ifdef COLOD_CUDA_EMU_THREADS
    BlockThreads::Get().Run(grid, block, shared, thread);
#else
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
#endif
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
