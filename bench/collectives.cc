// All-reduce bandwidth of the Gloo communicator on loopback, next to this
// machine's memcpy bandwidth measured in the same run.
//
//   bazel run -c opt //bench:collectives [-- --json] [-- --iters N]
//
// busbw = algbw * 2(n-1)/n, as nccl-tests define it: the bandwidth each rank's
// link would need for a ring all-reduce, comparable across rank counts.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/flags.h"
#include "server/rendezvous_store.h"
#include "worker/comm/gloo/gloo_communicator.h"

ABSL_FLAG(bool, json, false, "Print one JSON object per row instead of a table.");
ABSL_FLAG(int, iters, 5, "Timed all-reduces per row (after one warm-up).");

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

struct Row {
  int ranks;
  size_t bytes;
  double seconds;  // median of iters
};

Row Measure(int n, size_t bytes, int iters) {
  auto shared = std::make_shared<RendezvousStore>();
  std::vector<std::unique_ptr<GlooCommunicator>> comms(n);
  std::vector<double> times;
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      InMemoryStore store(shared, "bench");
      auto c = GlooCommunicator::Create(store, r, n, GlooCommunicator::Options());
      if (!c.ok()) {
        std::fprintf(stderr, "rank %d: %s\n", r, c.status().ToString().c_str());
        std::exit(1);
      }
      comms[r] = std::move(*c);
      const int64_t count = static_cast<int64_t>(bytes / sizeof(float));
      std::vector<float> data(count, 1.0f + r);
      auto run = [&] {
        absl::Status s = comms[r]->AllReduce(data.data(), count, DType::kF32, ReduceOp::kSum)
                             ->Wait(absl::Minutes(5));
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
  return Row{n, bytes, times[times.size() / 2]};
}

}  // namespace
}  // namespace colod

int main(int argc, char** argv) {
  colod::ParseFlags(argc, argv,
                    "collectives: Gloo all-reduce bandwidth on loopback vs memcpy.\n\nUsage:\n"
                    "  bazel run -c opt //bench:collectives [-- --json] [-- --iters N]\n");
  const bool json = absl::GetFlag(FLAGS_json);
  const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
  const double memcpy_gbps = colod::MemcpyGBps();
  if (!json) {
    std::printf("Gloo all-reduce, f32, ranks as threads on loopback; memcpy %.2f GB/s (same run)\n\n",
                memcpy_gbps);
    std::printf("%5s  %9s  %11s  %12s  %12s  %14s\n", "ranks", "size", "time (ms)", "algbw (GB/s)",
                "busbw (GB/s)", "busbw/memcpy");
  }
  for (int n : {2, 4}) {
    for (size_t mib : {1, 16, 64}) {
      colod::Row row = colod::Measure(n, mib << 20, iters);
      const double algbw = row.bytes / row.seconds / 1e9;
      const double busbw = algbw * 2.0 * (n - 1) / n;
      if (json) {
        std::printf(
            "{\"bench\":\"allreduce\",\"backend\":\"gloo\",\"dtype\":\"f32\",\"ranks\":%d,\"bytes\":%zu,"
            "\"seconds\":%.6f,\"algbw_gbps\":%.4f,\"busbw_gbps\":%.4f,\"memcpy_gbps\":%.4f}\n",
            n, row.bytes, row.seconds, algbw, busbw, memcpy_gbps);
      } else {
        std::printf("%5d  %6zu MiB  %11.2f  %12.3f  %12.3f  %13.1f%%\n", n, mib, row.seconds * 1e3,
                    algbw, busbw, 100 * busbw / memcpy_gbps);
      }
      std::fflush(stdout);
    }
  }
  return 0;
}
