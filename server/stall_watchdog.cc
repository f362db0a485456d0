#include "server/stall_watchdog.h"

#include <system_error>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/logging.h"

namespace colod {

StallWatchdog::StallWatchdog(absl::Duration stall, absl::Duration period) : stall_(stall), period_(period) {
  if (stall_ <= absl::ZeroDuration()) return;
  try {
    thread_ = std::thread([this] { Loop(); });
  } catch (const std::system_error& e) {
    COLOD_LOG(WARNING) << "no thread for the stalled-stream watchdog (" << e.what()
                       << "): stalled transfers last until their clients' deadlines";
  }
}

StallWatchdog::~StallWatchdog() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
}

std::unique_ptr<StallWatchdog::Watch> StallWatchdog::Start(grpc::ServerContext* ctx, std::string what) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  entries_.emplace(id, Entry{ctx, std::move(what), absl::Now()});
  return std::unique_ptr<Watch>(new Watch(this, id));
}

StallWatchdog::Watch::~Watch() {
  absl::MutexLock lock(&dog_->mu_);
  dog_->entries_.erase(id_);
}

void StallWatchdog::Watch::Progress() {
  absl::MutexLock lock(&dog_->mu_);
  auto it = dog_->entries_.find(id_);
  if (it != dog_->entries_.end()) it->second.last = absl::Now();
}

bool StallWatchdog::Watch::stalled() const {
  absl::MutexLock lock(&dog_->mu_);
  auto it = dog_->entries_.find(id_);
  return it != dog_->entries_.end() && it->second.stalled;
}

int64_t StallWatchdog::cancelled() const {
  absl::MutexLock lock(&mu_);
  return cancelled_;
}

int64_t StallWatchdog::watched() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(entries_.size());
}

void StallWatchdog::Loop() {
  for (;;) {
    std::vector<std::string> said;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_), period_)) return;
      const absl::Time now = absl::Now();
      for (auto& [id, e] : entries_) {
        if (e.stalled || now - e.last < stall_) continue;
        e.stalled = true;
        ++cancelled_;
        // Under the lock: the Watch (and so the context) cannot go
        // meanwhile, and TryCancel only marks the call.
        e.ctx->TryCancel();
        said.push_back(absl::StrCat(e.what, ": no progress for ", absl::FormatDuration(now - e.last),
                                    ", cancelled (--stream-stall-timeout)"));
      }
    }
    for (const std::string& s : said) COLOD_LOG(WARNING) << s;  // logged outside the lock
  }
}

}  // namespace colod
