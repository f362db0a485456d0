// Minimal leveled logging to stderr (Debian's Abseil 20220623 predates absl/log).
//
//   COLOD_LOG(INFO) << "listening on " << addr;
//
// Thread-safe: each message is formatted into its own buffer and written with
// one locked write, so lines from different threads never interleave.
#ifndef COLOD_COMMON_LOGGING_H_
#define COLOD_COMMON_LOGGING_H_

#include <sstream>

namespace colod {

enum class LogSeverity { kInfo, kWarning, kError, kFatal };

// Messages below this severity are dropped. Default kInfo; settable from
// $COLOD_LOG_LEVEL (INFO, WARNING, ERROR) at first use.
void SetMinLogSeverity(LogSeverity severity);

class LogMessage {
 public:
  LogMessage(LogSeverity severity, const char* file, int line);
  ~LogMessage();  // writes the line; kFatal aborts
  std::ostream& stream() { return stream_; }

 private:
  LogSeverity severity_;
  std::ostringstream stream_;
};

}  // namespace colod

#define COLOD_LOG_SEVERITY_INFO ::colod::LogSeverity::kInfo
#define COLOD_LOG_SEVERITY_WARNING ::colod::LogSeverity::kWarning
#define COLOD_LOG_SEVERITY_ERROR ::colod::LogSeverity::kError
#define COLOD_LOG_SEVERITY_FATAL ::colod::LogSeverity::kFatal
#define COLOD_LOG(severity) \
  ::colod::LogMessage(COLOD_LOG_SEVERITY_##severity, __FILE__, __LINE__).stream()

#endif  // COLOD_COMMON_LOGGING_H_
