#include "worker/train/sentencepiece_tokenizer.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/find_binary.h"
#include "common/status_macros.h"

extern char** environ;

namespace colod::train {
namespace {

constexpr uint32_t kMaxMessage = 64 << 10;

int RemainingMs(absl::Time deadline) {
  const absl::Duration left = deadline - absl::Now();
  if (left <= absl::ZeroDuration()) return 0;
  return static_cast<int>(std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
}

// Waits until `fd` is ready for `events`: OK, DEADLINE_EXCEEDED, or
// UNAVAILABLE when the other end is gone.
absl::Status Wait(int fd, short events, absl::Time deadline) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, RemainingMs(deadline));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return absl::UnavailableError(absl::StrCat("poll: ", std::strerror(errno)));
    if (r == 0) return absl::DeadlineExceededError("no answer in time");
    if (p.revents & events) return absl::OkStatus();
    return absl::UnavailableError("its socket closed");
  }
}

absl::Status SendAll(int fd, const char* p, size_t n, absl::Time deadline) {
  while (n > 0) {
    RETURN_IF_ERROR(Wait(fd, POLLOUT, deadline));
    const ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (w <= 0) return absl::UnavailableError(absl::StrCat("send: ", std::strerror(errno)));
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, void* buf, size_t n, absl::Time deadline) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    RETURN_IF_ERROR(Wait(fd, POLLIN, deadline));
    const ssize_t r = ::recv(fd, p, n, MSG_DONTWAIT);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (r == 0) return absl::UnavailableError("it closed its socket");
    if (r < 0) return absl::UnavailableError(absl::StrCat("recv: ", std::strerror(errno)));
    p += r;
    n -= static_cast<size_t>(r);
  }
  return absl::OkStatus();
}

// The error message that follows a status byte of 1.
absl::StatusOr<std::string> RecvMessage(int fd, absl::Time deadline) {
  uint32_t len = 0;
  RETURN_IF_ERROR(RecvAll(fd, &len, sizeof(len), deadline));
  if (len > kMaxMessage) return absl::UnavailableError(absl::StrCat("it announced a message of ", len, " bytes"));
  std::string message(len, '\0');
  RETURN_IF_ERROR(RecvAll(fd, message.data(), len, deadline));
  return message;
}

absl::Time DeadlineFor(absl::Duration timeout, size_t bytes) {
  return absl::Now() + timeout + absl::Seconds(static_cast<double>(bytes) / (1 << 20));
}

}  // namespace

absl::StatusOr<std::unique_ptr<SentencePieceTokenizer>> SentencePieceTokenizer::Load(const std::string& model_path,
                                                                                      Options options) {
  std::string helper = options.helper;
  if (helper.empty()) {
    if (const char* env = std::getenv("COLOD_SENTENCEPIECE_HELPER"); env != nullptr && *env != '\0') {
      helper = env;
    } else {
      absl::StatusOr<std::string> found =
          FindBinary("colod-sentencepiece", {"../worker/train", "../train", "../../worker/train"});
      if (!found.ok()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "reading the SentencePiece model ", model_path, " needs the helper program colod-sentencepiece, which is ",
            "installed next to colod-worker and coloctl (or named by $COLOD_SENTENCEPIECE_HELPER): ",
            found.status().message()));
      }
      helper = *found;
    }
  }
  std::unique_ptr<SentencePieceTokenizer> t(
      new SentencePieceTokenizer(model_path, std::move(helper), std::move(options)));
  int32_t hello[4];
  {
    absl::MutexLock lock(&t->mu_);
    RETURN_IF_ERROR(t->StartLocked(hello));
  }
  t->pieces_ = hello[0];
  if (hello[1] >= 0) t->bos_ = hello[1];
  if (hello[2] >= 0) t->eos_ = hello[2];
  t->add_bos_ = t->bos_.has_value() && t->options_.add_bos.value_or(true);
  return t;
}

SentencePieceTokenizer::~SentencePieceTokenizer() {
  absl::MutexLock lock(&mu_);
  StopLocked();
}

pid_t SentencePieceTokenizer::helper_pid() const {
  absl::MutexLock lock(&mu_);
  return pid_;
}

absl::Status SentencePieceTokenizer::StartLocked(int32_t hello[4]) const {
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("socketpair: ", std::strerror(errno)));
  }
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_adddup2(&files, sv[1], 0);
  posix_spawn_file_actions_adddup2(&files, sv[1], 1);
  posix_spawn_file_actions_addclosefrom_np(&files, 3);  // nothing else of this process leaks into it
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);
  sigaddset(&defaults, SIGTERM);
  sigaddset(&defaults, SIGINT);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
  std::string arg0 = helper_, arg1 = model_path_;
  char* argv[] = {arg0.data(), arg1.data(), nullptr};
  pid_t pid = 0;
  const int err = ::posix_spawn(&pid, helper_.c_str(), &files, &attr, argv, environ);
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attr);
  ::close(sv[1]);
  if (err != 0) {
    ::close(sv[0]);
    return absl::FailedPreconditionError(
        absl::StrCat("cannot start the SentencePiece helper ", helper_, ": ", std::strerror(err)));
  }
  fd_ = sv[0];
  pid_ = pid;
  const absl::Time deadline = DeadlineFor(options_.timeout, 0);
  uint8_t status = 0;
  absl::Status s = RecvAll(fd_, &status, 1, deadline);
  if (s.ok() && status == 1) {
    const absl::StatusOr<std::string> message = RecvMessage(fd_, deadline);
    StopLocked();
    return absl::InvalidArgumentError(absl::StrCat(model_path_, " is not a SentencePiece model libsentencepiece can read: ",
                                                   message.ok() ? *message : "(no reason given)"));
  }
  if (s.ok() && status != 0) s = absl::UnavailableError(absl::StrCat("it sent status ", status));
  if (s.ok()) s = RecvAll(fd_, hello, 4 * sizeof(int32_t), deadline);
  if (s.ok() && (hello[0] <= 0 || hello[1] >= hello[0] || hello[2] >= hello[0])) {
    s = absl::InvalidArgumentError(absl::StrCat(model_path_, " has ", hello[0], " pieces and bos/eos ids ", hello[1],
                                                "/", hello[2]));
  }
  if (!s.ok()) {
    const std::string why = StopLocked();
    if (absl::IsInvalidArgument(s)) return s;
    return absl::Status(s.code(), absl::StrCat("the SentencePiece helper ", helper_, " (pid ", pid, ") loading ",
                                               model_path_, ": ", s.message(), "; ", why));
  }
  return absl::OkStatus();
}

std::string SentencePieceTokenizer::StopLocked() const {
  if (pid_ <= 0) return "";
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  // Whatever state it is in (answering, stopped, dead), it is no use now.
  ::kill(pid_, SIGKILL);
  int wstatus = 0;
  pid_t r;
  do {
    r = ::waitpid(pid_, &wstatus, 0);
  } while (r < 0 && errno == EINTR);
  pid_ = 0;
  if (r < 0) return "it was reaped elsewhere";
  if (WIFEXITED(wstatus)) return absl::StrCat("it exited with status ", WEXITSTATUS(wstatus));
  if (WIFSIGNALED(wstatus) && WTERMSIG(wstatus) != SIGKILL) {
    return absl::StrCat("it died of signal ", WTERMSIG(wstatus), " (", strsignal(WTERMSIG(wstatus)), ")");
  }
  return "it was killed";
}

absl::StatusOr<std::string> SentencePieceTokenizer::Exchange(char op, absl::string_view payload,
                                                              uint64_t count) const {
  absl::MutexLock lock(&mu_);
  if (pid_ == 0) {
    int32_t hello[4];
    RETURN_IF_ERROR(StartLocked(hello));
    if (hello[0] != pieces_) {
      StopLocked();
      return absl::FailedPreconditionError(
          absl::StrCat(model_path_, " changed while in use: it has ", hello[0], " pieces, not ", pieces_));
    }
  }
  const pid_t pid = pid_;
  const absl::Time deadline = DeadlineFor(options_.timeout, payload.size());
  std::string header(1, op);
  header.append(reinterpret_cast<const char*>(&count), sizeof(count));
  absl::Status s = SendAll(fd_, header.data(), header.size(), deadline);
  if (s.ok()) s = SendAll(fd_, payload.data(), payload.size(), deadline);
  uint8_t status = 0;
  if (s.ok()) s = RecvAll(fd_, &status, 1, deadline);
  if (s.ok() && status == 1) {
    absl::StatusOr<std::string> message = RecvMessage(fd_, deadline);
    if (message.ok()) return absl::InvalidArgumentError(absl::StrCat("SentencePiece (", model_path_, "): ", *message));
    s = message.status();
  }
  uint64_t n = 0;
  if (s.ok() && status != 0) s = absl::UnavailableError(absl::StrCat("it sent status ", status));
  if (s.ok()) s = RecvAll(fd_, &n, sizeof(n), deadline);
  // Encoding never yields more ids than bytes plus a few; decoding a piece
  // never yields more than a few hundred bytes.
  // (NFKC normalization can lengthen a text some 18 times).
  const uint64_t limit = op == 'E' ? (payload.size() * 32 + 64) * sizeof(int32_t) : (count + 1) * 4096;
  const uint64_t width = op == 'E' ? sizeof(int32_t) : 1;
  if (s.ok() && (n > limit / width)) s = absl::UnavailableError(absl::StrCat("it announced ", n, " items"));
  std::string out;
  if (s.ok()) {
    out.resize(n * width);
    s = RecvAll(fd_, out.data(), out.size(), deadline);
  }
  if (!s.ok()) {
    const std::string why = StopLocked();
    return absl::Status(absl::IsDeadlineExceeded(s) ? absl::StatusCode::kDeadlineExceeded
                                                    : absl::StatusCode::kUnavailable,
                        absl::StrCat("the SentencePiece helper (pid ", pid, ") for ", model_path_, " failed: ",
                                     s.message(), "; ", why, " (the next call starts another)"));
  }
  return out;
}

absl::StatusOr<std::vector<int64_t>> SentencePieceTokenizer::Encode(absl::string_view text) const {
  if (text.size() > kMaxText) {
    return absl::InvalidArgumentError(
        absl::StrCat("a text of ", text.size(), " bytes is over SentencePiece's ", kMaxText, "; split it"));
  }
  ASSIGN_OR_RETURN(std::string raw, Exchange('E', text, text.size()));
  std::vector<int64_t> ids(raw.size() / sizeof(int32_t));
  for (size_t i = 0; i < ids.size(); ++i) {
    int32_t id;
    std::memcpy(&id, raw.data() + i * sizeof(id), sizeof(id));
    if (id < 0 || id >= pieces_) return absl::InternalError(absl::StrCat("SentencePiece returned id ", id));
    ids[i] = id;
  }
  return ids;
}

absl::StatusOr<std::string> SentencePieceTokenizer::Decode(absl::Span<const int64_t> ids) const {
  if (ids.size() > (size_t{1} << 28)) return absl::InvalidArgumentError("over 2^28 ids to decode at once");
  std::string payload(ids.size() * sizeof(int32_t), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= pieces_) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", ids[i], " is not in the vocabulary of ", pieces_));
    }
    const int32_t id = static_cast<int32_t>(ids[i]);
    std::memcpy(payload.data() + i * sizeof(id), &id, sizeof(id));
  }
  return Exchange('D', payload, ids.size());
}

}  // namespace colod::train
