// All-reduce, reduce-scatter and all-gather bandwidth of the Gloo
// communicator on loopback, next to this machine's memcpy bandwidth measured
// in the same run; where the build has CUDA and the machine two or more
// GPUs, the NCCL communicator's all-reduce, all-gather, reduce-scatter and
// ring send/recv on device buffers, bf16, 1 KiB to --nccl_max_bytes (1 GiB),
// one process per GPU as colod's worker daemons run (this binary started
// again as each rank, the unique id through a FileStore), on 2, 4, ... GPUs,
// next to cuda:0's device-to-device copy bandwidth.
//
//   bazel run -c opt //bench:collectives [-- --json] [-- --iters N]
//       [-- --backend gloo|nccl|all] [-- --nccl_max_bytes B]
//
// As nccl-tests define them: size is the whole buffer (all-reduce's, the
// reduce-scatter's input, the all-gather's output, what each rank sends),
// algbw = size / time, and busbw = algbw * 2(n-1)/n for all-reduce, algbw *
// (n-1)/n for reduce-scatter and all-gather, algbw for send/recv: the
// bandwidth each rank's link would need for the ring algorithm, comparable
// across rank counts and collectives.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/flags.h"
#include "common/status_macros.h"
#include "bench/self_ranks.h"
#include "kernels/device.h"
#include "common/rendezvous_store.h"
#include "worker/comm/store.h"
#include "worker/comm/gloo/gloo_communicator.h"
#ifdef COLOD_WITH_CUDA
#include <cuda_runtime.h>

#include "worker/comm/nccl/nccl_communicator.h"
#endif

ABSL_FLAG(bool, json, false, "Print one JSON object per row instead of a table.");
ABSL_FLAG(int, iters, 5, "Timed all-reduces per row (after one warm-up).");
ABSL_FLAG(std::string, backend, "all",
          "gloo, nccl or all: which communicators to measure (nccl rows need a CUDA build and 2+ GPUs).");
ABSL_FLAG(int64_t, nccl_max_bytes, int64_t{1} << 30, "The NCCL rows' largest size: from 1 KiB up, x8 apart, and this.");
ABSL_FLAG(int, nccl_rank, -1, "Internal: run as NCCL rank N of --nccl_ranks (bench:collectives starts these).");
ABSL_FLAG(int, nccl_ranks, 0, "Internal: the NCCL ranks' count.");
ABSL_FLAG(std::string, nccl_store, "", "Internal: the ranks' FileStore directory (the unique id).");


namespace colod {
namespace {

// Best-of-5 memcpy of a 64 MiB buffer (the loopback path copies at least this much).
double MemcpyGBps() {
  const size_t bytes = 64 << 20;
  std::vector<char> a(bytes, 1), b(bytes, 2);
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    const absl::Time t0 = absl::Now();
    std::memcpy(b.data(), a.data(), bytes);
    const double s = absl::ToDoubleSeconds(absl::Now() - t0);
    best = std::max(best, bytes / s / 1e9);
    a[i] = b[bytes - 1 - i];  // keep the copies observable
  }
  return best;
}

enum class Op { kAllReduce, kReduceScatter, kAllGather, kSendRecv };

const char* OpName(Op op) {
  switch (op) {
    case Op::kAllReduce: return "allreduce";
    case Op::kReduceScatter: return "reducescatter";
    case Op::kAllGather: return "allgather";
    case Op::kSendRecv: return "sendrecv";
  }
  return "";
}

struct Row {
  Op op = Op::kAllReduce;
  int ranks;
  size_t bytes;
  double seconds;  // median of iters
};

// The all-reduce algorithm: the communicator's own choice, or one forced
// through GlooCommunicator::Options (the exchange is for two ranks).
enum class Algorithm { kDefault, kRing, kBcube, kExchange };

Row Measure(Op op, int n, size_t bytes, int iters, Algorithm algorithm = Algorithm::kDefault) {
  auto shared = std::make_shared<RendezvousStore>();
  std::vector<std::unique_ptr<GlooCommunicator>> comms(n);
  std::vector<double> times;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      InMemoryStore store(shared, "bench");
      GlooCommunicator::Options o;
      if (algorithm != Algorithm::kDefault) {
        o.halving_doubling_max_bytes = algorithm == Algorithm::kRing ? 0 : SIZE_MAX;
        o.two_rank_exchange_max_bytes = algorithm == Algorithm::kExchange ? SIZE_MAX : 0;
      }
      auto c = GlooCommunicator::Create(store, r, n, o);
      if (!c.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", r, c.status().ToString().c_str());
        std::exit(1);
      }
      comms[r] = std::move(*c);
      const int64_t count = static_cast<int64_t>(bytes / sizeof(float));  // the whole buffer
      const int64_t chunk = count / n;                                     // a rank's share
      std::vector<float> data(count, 1.0f + r), part(chunk, 1.0f + r);
      auto run = [&] {
        std::shared_ptr<Work> w;
        switch (op) {
          case Op::kAllReduce:
            w = comms[r]->AllReduce(data.data(), count, DType::kF32, ReduceOp::kSum);
            break;
          case Op::kReduceScatter:
            w = comms[r]->ReduceScatter(data.data(), part.data(), chunk, DType::kF32, ReduceOp::kSum);
            break;
          case Op::kAllGather:
            w = comms[r]->AllGather(part.data(), data.data(), chunk, DType::kF32);
            break;
          case Op::kSendRecv:
            std::exit(2);  // NCCL rows only
        }
        absl::Status s = w->Wait(absl::Minutes(5));
        if (!s.ok()) {
          std::fprintf(stderr, "rank %d: %s\n", r, s.ToString().c_str());
          std::exit(1);
        }
      };
      run();  // warm-up: connections, buffers
      for (int i = 0; i < iters; ++i) {
        (void)comms[r]->Barrier()->Wait(absl::Minutes(1));
        const absl::Time t0 = absl::Now();
        run();
        if (r == 0) times.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
      }
      (void)comms[r]->Barrier()->Wait(absl::Minutes(1));
    });
  }
  for (auto& t : threads) t.join();
  std::sort(times.begin(), times.end());
  return Row{op, n, bytes, times[times.size() / 2]};
}

#ifdef COLOD_WITH_CUDA
void Check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Best-of-5 device-to-device copy of 256 MiB on cuda:0, counted as
// nccl-tests count bandwidth (bytes moved once, read plus write not doubled).
double DeviceCopyGBps() {
  const size_t bytes = 256 << 20;
  void *a = nullptr, *b = nullptr;
  Check(cudaSetDevice(0), "cudaSetDevice");
  Check(cudaMalloc(&a, bytes), "cudaMalloc");
  Check(cudaMalloc(&b, bytes), "cudaMalloc");
  Check(cudaMemset(a, 1, bytes), "cudaMemset");
  double best = 0;
  for (int i = 0; i < 5; ++i) {
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const absl::Time t0 = absl::Now();
    Check(cudaMemcpy(b, a, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy");
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    best = std::max(best, bytes / absl::ToDoubleSeconds(absl::Now() - t0) / 1e9);
  }
  Check(cudaFree(a), "cudaFree");
  Check(cudaFree(b), "cudaFree");
  return best;
}

// The NCCL rows' sizes: 1 KiB, x8 apart, and `max`.
std::vector<size_t> NcclSizes(size_t max) {
  std::vector<size_t> sizes;
  for (size_t b = 1024; b < max; b *= 8) sizes.push_back(b);
  sizes.push_back(max);
  return sizes;
}

// Rank `rank` of `n`, a process of its own on GPU `rank`: every op at every
// size, timed on rank 0 from a barrier (a one-element all-reduce, completed)
// to the device's completion, the median of `iters`; rank 0 prints each as
// "row OP N BYTES SECONDS". Exits non-zero on any failure.
int RunNcclRank(int rank, int n, const std::string& dir, int iters, size_t max_bytes) {
  auto fail = [rank](const absl::Status& s) {
    std::fprintf(stderr, "nccl rank %d: %s\n", rank, s.ToString().c_str());
    return 1;
  };
  auto store = FileStore::Open(dir);
  if (!store.ok()) return fail(store.status());
  NcclCommunicator::Options o;
  o.device = rank;
  o.prefix = "bench";
  auto c = NcclCommunicator::Create(**store, rank, n, o);
  if (!c.ok()) return fail(c.status());
  Check(cudaSetDevice(rank), "cudaSetDevice");
  void *in = nullptr, *out = nullptr, *flag = nullptr;
  Check(cudaMalloc(&in, max_bytes), "cudaMalloc");
  Check(cudaMalloc(&out, max_bytes), "cudaMalloc");
  Check(cudaMalloc(&flag, sizeof(float)), "cudaMalloc");
  Check(cudaMemset(in, 0, max_bytes), "cudaMemset");
  Check(cudaMemset(out, 0, max_bytes), "cudaMemset");
  Check(cudaMemset(flag, 0, sizeof(float)), "cudaMemset");
  const DType t = DType::kBF16;
  for (Op op : {Op::kAllReduce, Op::kAllGather, Op::kReduceScatter, Op::kSendRecv}) {
    for (size_t bytes : NcclSizes(max_bytes)) {
      const int64_t count = static_cast<int64_t>(bytes / SizeOf(t)), part = count / n;
      if (part < 1) continue;
      auto run = [&]() -> absl::Status {
        std::shared_ptr<Work> w;
        switch (op) {
          case Op::kAllReduce: w = (*c)->AllReduce(out, count, t, ReduceOp::kSum); break;
          case Op::kAllGather: w = (*c)->AllGather(in, out, part, t); break;
          case Op::kReduceScatter: w = (*c)->ReduceScatter(in, out, part, t, ReduceOp::kSum); break;
          case Op::kSendRecv: w = (*c)->SendRecv(in, (rank + 1) % n, out, (rank + n - 1) % n, count, t); break;
        }
        RETURN_IF_ERROR(w->Wait(absl::Minutes(5)));
        return kernels::CudaSynchronize(rank);
      };
      if (absl::Status s = run(); !s.ok()) return fail(s);  // warm-up
      std::vector<double> times;
      for (int i = 0; i < iters; ++i) {
        absl::Status s = (*c)->AllReduce(flag, 1, DType::kF32, ReduceOp::kSum)->Wait(absl::Minutes(1));
        if (s.ok()) s = kernels::CudaSynchronize(rank);
        if (!s.ok()) return fail(s);
        const absl::Time t0 = absl::Now();
        if (s = run(); !s.ok()) return fail(s);
        times.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
      }
      std::sort(times.begin(), times.end());
      if (rank == 0) {
        std::printf("row %d %d %zu %.9f\n", static_cast<int>(op), n, bytes, times[times.size() / 2]);
        std::fflush(stdout);
      }
    }
  }
  // Each rank says it is done, and rank 0 ends only after every one has:
  // under the CUDA emulation rank 0's process holds the clique, and a rank
  // still waiting for its last collective's answer when that process ends
  // sees a lost peer (CI saw it once on 2 busy cores). On GPUs this only
  // makes the ranks end together.
  if (absl::Status s = (*store)->Set(absl::StrCat("done/", rank), "1"); !s.ok()) return fail(s);
  if (rank == 0) {
    std::vector<std::string> done;
    for (int r = 0; r < n; ++r) done.push_back(absl::StrCat("done/", r));
    if (absl::StatusOr<std::vector<std::string>> w = (*store)->Wait(done, absl::Minutes(2)); !w.ok()) {
      return fail(w.status());
    }
  }
  Check(cudaFree(in), "cudaFree");
  Check(cudaFree(out), "cudaFree");
  Check(cudaFree(flag), "cudaFree");
  return 0;
}

// Starts this binary as `n` rank processes and reads rank 0's rows; false
// (after printing why) if a rank failed.
bool MeasureNcclProcesses(int n, int iters, size_t max_bytes, const std::function<void(const Row&)>& on_row) {
  const absl::Status s = bench::RunSelfAsRanks(
      n,
      [&](int r, const std::string& store) -> std::vector<std::string> {
        return {absl::StrCat("--nccl_rank=", r), absl::StrCat("--nccl_ranks=", n), "--nccl_store=" + store,
                absl::StrCat("--iters=", iters), absl::StrCat("--nccl_max_bytes=", max_bytes)};
      },
      [&](const std::string& line) {
        int op = 0, ranks = 0;
        size_t bytes = 0;
        double seconds = 0;
        if (std::sscanf(line.c_str(), "row %d %d %zu %lf", &op, &ranks, &bytes, &seconds) == 4) {
          on_row(Row{static_cast<Op>(op), ranks, bytes, seconds});
        }
      });
  if (!s.ok()) std::fprintf(stderr, "bench:collectives: NCCL on %d GPUs: %s\n", n, s.ToString().c_str());
  return s.ok();
}
#endif

void PrintRow(bool json, const char* backend, const char* dtype, const Row& row, const char* limit_name,
              double limit_gbps) {
  const double algbw = row.bytes / row.seconds / 1e9;
  const double factor = row.op == Op::kAllReduce ? 2.0 : 1.0;
  const double busbw = row.op == Op::kSendRecv ? algbw : algbw * factor * (row.ranks - 1) / row.ranks;
  if (json) {
    std::printf(
        "{\"bench\":\"%s\",\"backend\":\"%s\",\"dtype\":\"%s\",\"ranks\":%d,\"bytes\":%zu,"
        "\"seconds\":%.6f,\"algbw_gbps\":%.4f,\"busbw_gbps\":%.4f,\"%s_gbps\":%.4f}\n",
        OpName(row.op), backend, dtype, row.ranks, row.bytes, row.seconds, algbw, busbw, limit_name, limit_gbps);
  } else {
    const std::string size = row.bytes >= (size_t{1} << 30) ? absl::StrCat(row.bytes >> 30, " GiB")
                             : row.bytes >= (size_t{1} << 20) ? absl::StrCat(row.bytes >> 20, " MiB")
                                                              : absl::StrCat(row.bytes >> 10, " KiB");
    std::printf("%-13s  %-5s  %-4s  %5d  %10s  %11.3f  %12.3f  %12.3f  %13.1f%%\n", OpName(row.op), backend, dtype,
                row.ranks, size.c_str(), row.seconds * 1e3, algbw, busbw, 100 * busbw / limit_gbps);
  }
  std::fflush(stdout);
}

}  // namespace
}  // namespace colod

int main(int argc, char** argv) {
  colod::ParseFlags(argc, argv,
                    "collectives: Gloo all-reduce, reduce-scatter and all-gather bandwidth on loopback vs "
                    "memcpy.\n\nUsage:\n"
                    "  bazel run -c opt //bench:collectives [-- --json] [-- --iters N] [-- --backend gloo|nccl|all]\n"
                    "      [-- --nccl_max_bytes B]\n");
  const bool json = absl::GetFlag(FLAGS_json);
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  const int64_t max_bytes = absl::GetFlag(FLAGS_nccl_max_bytes);
  if (max_bytes < 1024) {
    std::fprintf(stderr, "--nccl_max_bytes must be at least 1024, not %lld\n", static_cast<long long>(max_bytes));
    return 2;
  }
#ifdef COLOD_WITH_CUDA
  if (absl::GetFlag(FLAGS_nccl_rank) >= 0) {
    return colod::RunNcclRank(absl::GetFlag(FLAGS_nccl_rank), absl::GetFlag(FLAGS_nccl_ranks),
                              absl::GetFlag(FLAGS_nccl_store), iters, static_cast<size_t>(max_bytes));
  }
#endif
  const std::string backend = absl::GetFlag(FLAGS_backend);
  if (backend != "gloo" && backend != "nccl" && backend != "all") {
    std::fprintf(stderr, "--backend must be gloo, nccl or all, not '%s'\n", backend.c_str());
    return 2;
  }
  const char* header = "%-13s  %-5s  %-4s  %5s  %10s  %11s  %12s  %12s  %14s\n";
  if (backend != "nccl") {
    const double memcpy_gbps = colod::MemcpyGBps();
    if (!json) {
      std::printf("Gloo collectives, ranks as threads on loopback; host memcpy %.2f GB/s (same run)\n\n",
                  memcpy_gbps);
      std::printf(header, "op", "comm", "type", "ranks", "size", "time (ms)", "algbw (GB/s)", "busbw (GB/s)",
                  "busbw/memcpy");
    }
    for (colod::Op op : {colod::Op::kAllReduce, colod::Op::kReduceScatter, colod::Op::kAllGather}) {
      for (int n : {2, 4}) {
        for (size_t mib : {1, 16, 64}) {
          colod::PrintRow(json, "gloo", "f32", colod::Measure(op, n, mib << 20, iters), "memcpy", memcpy_gbps);
        }
      }
    }
    // The all-reduce algorithms side by side: the crossovers that
    // GlooCommunicator::Options::halving_doubling_max_bytes and
    // two_rank_exchange_max_bytes are set from.
    const colod::GlooCommunicator::Options defaults;
    if (!json) {
      std::printf("\nGloo all-reduce, f32: Gloo's ring (segments pipelined) and bcube (halving-doubling), and "
                  "colod's two-rank exchange; the communicator takes the exchange up to %zu MiB between two ranks, "
                  "else bcube up to %zu MiB\n\n%5s  %10s  %14s  %15s  %15s  %12s\n",
                  defaults.two_rank_exchange_max_bytes >> 20, defaults.halving_doubling_max_bytes >> 20, "ranks",
                  "size", "ring (ms)", "bcube (ms)", "exchange (ms)", "ring/bcube");
    }
    for (int n : {2, 4}) {
      for (size_t kib : {4, 64, 256, 1024, 4096, 16384, 65536}) {
        const colod::Row ring = colod::Measure(colod::Op::kAllReduce, n, kib << 10, iters, colod::Algorithm::kRing);
        const colod::Row bcube = colod::Measure(colod::Op::kAllReduce, n, kib << 10, iters, colod::Algorithm::kBcube);
        const double exchange =
            n == 2 ? colod::Measure(colod::Op::kAllReduce, n, kib << 10, iters, colod::Algorithm::kExchange).seconds
                   : 0;
        if (json) {
          std::printf("{\"bench\":\"allreduce_algorithms\",\"backend\":\"gloo\",\"dtype\":\"f32\",\"ranks\":%d,"
                      "\"bytes\":%zu,\"ring_seconds\":%.6f,\"bcube_seconds\":%.6f",
                      n, kib << 10, ring.seconds, bcube.seconds);
          if (n == 2) std::printf(",\"exchange_seconds\":%.6f", exchange);
          std::printf("}\n");
        } else {
          const std::string ex = n == 2 ? absl::StrFormat("%.3f", exchange * 1e3) : "-";
          std::printf("%5d  %6zu KiB  %14.3f  %15.3f  %15s  %11.2fx\n", n, kib, ring.seconds * 1e3,
                      bcube.seconds * 1e3, ex.c_str(), ring.seconds / bcube.seconds);
        }
        std::fflush(stdout);
      }
    }
  }
  if (backend == "gloo") return 0;
  const int gpus = colod::kernels::CudaDeviceCount();
#ifdef COLOD_WITH_CUDA
  if (gpus >= 2) {
    const double copy_gbps = colod::DeviceCopyGBps();
    if (!json) {
      std::printf("\nNCCL, bf16, one process per GPU (rank r on cuda:r), device buffers; cuda:0 device-to-device "
                  "copy %.1f GB/s (same run)\n\n",
                  copy_gbps);
      std::printf(header, "op", "comm", "type", "ranks", "size", "time (ms)", "algbw (GB/s)", "busbw (GB/s)",
                  "busbw/d2d copy");
    }
    bool ok = true;
    for (int n = 2; n <= gpus && ok; n *= 2) {
      ok = colod::MeasureNcclProcesses(n, iters, static_cast<size_t>(max_bytes), [&](const colod::Row& row) {
        colod::PrintRow(json, "nccl", "bf16", row, "d2d_copy", copy_gbps);
      });
    }
    return ok ? 0 : 1;
  }
#endif
  if (!json) {
    std::printf("\nNCCL rows skipped: %s\n", colod::kernels::BuiltWithCuda()
                                                  ? (std::to_string(gpus) + " CUDA device(s); they need 2").c_str()
                                                  : "built without CUDA");
  }
  return 0;
}
