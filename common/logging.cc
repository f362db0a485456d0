#include "common/logging.h"

#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace colod {
namespace {

int SeverityFromEnv() {
  const char* env = std::getenv("COLOD_LOG_LEVEL");
  if (env == nullptr) return static_cast<int>(LogSeverity::kInfo);
  if (std::strcmp(env, "WARNING") == 0) return static_cast<int>(LogSeverity::kWarning);
  if (std::strcmp(env, "ERROR") == 0) return static_cast<int>(LogSeverity::kError);
  return static_cast<int>(LogSeverity::kInfo);
}

std::atomic<int>& MinSeverity() {
  static std::atomic<int> min_severity{SeverityFromEnv()};
  return min_severity;
}

const char* SeverityLetter(LogSeverity s) {
  switch (s) {
    case LogSeverity::kInfo: return "I";
    case LogSeverity::kWarning: return "W";
    case LogSeverity::kError: return "E";
    case LogSeverity::kFatal: return "F";
  }
  return "?";
}

}  // namespace

void SetMinLogSeverity(LogSeverity severity) { MinSeverity().store(static_cast<int>(severity)); }

LogMessage::LogMessage(LogSeverity severity, const char* file, int line) : severity_(severity) {
  const char* base = std::strrchr(file, '/');
  stream_ << SeverityLetter(severity)
          << absl::FormatTime(" %Y-%m-%dT%H:%M:%E3S ", absl::Now(), absl::UTCTimeZone())
          << (base ? base + 1 : file) << ":" << line << "] ";
}

LogMessage::~LogMessage() {
  if (static_cast<int>(severity_) >= MinSeverity().load() || severity_ == LogSeverity::kFatal) {
    std::string line = stream_.str();
    line.push_back('\n');
    // One write(2) per line keeps concurrent lines whole.
    ssize_t unused = ::write(STDERR_FILENO, line.data(), line.size());
    (void)unused;
  }
  if (severity_ == LogSeverity::kFatal) std::abort();
}

}  // namespace colod
