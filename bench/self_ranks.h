// Rank processes for the benchmarks' rows that run one process per device,
// as colod's worker daemons do (bench:collectives' NCCL rows, bench:train's
// "procs" rows): the benchmark starts its own binary again as each rank.
//
// Thread-safety: call from one thread.
#ifndef COLOD_BENCH_SELF_RANKS_H_
#define COLOD_BENCH_SELF_RANKS_H_

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace colod::bench {

// Starts this binary (/proc/self/exe) `ranks` times, rank r with the
// arguments `args(r, store)` after argv[0], where `store` is a fresh
// temporary directory the ranks may rendezvous in (a FileStore; removed at
// the end). Rank 0's stdout goes to `on_line`, a line at a time; the others'
// stdout and every rank's stderr stay this process's. Waits for every rank,
// then, if all exited 0, calls `on_done(store)` (results the ranks left
// there) before the directory goes. INTERNAL, naming how many, if a rank
// could not start or did not exit 0.
absl::Status RunSelfAsRanks(int ranks, const std::function<std::vector<std::string>(int, const std::string&)>& args,
                            const std::function<void(const std::string&)>& on_line,
                            const std::function<void(const std::string&)>& on_done = nullptr);

}  // namespace colod::bench

#endif  // COLOD_BENCH_SELF_RANKS_H_
