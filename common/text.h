// Text from input (a file's bytes quoted in an error, a peer's message) made
// fit to travel in a proto3 `string` field, which must be valid UTF-8: a
// message that is not does not parse, and gRPC refuses the whole call.
#ifndef COLOD_COMMON_TEXT_H_
#define COLOD_COMMON_TEXT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"

namespace colod {

// A status or failure message a rank or worker reports to the coordinator,
// and what the coordinator keeps of one, in bytes.
inline constexpr size_t kMaxReportedMessageBytes = 16 << 10;
// In rank 0's TRAINING status message, before the newer checkpoints a
// resume passed over as damaged (each "step-N: why", "; " between): coloctl
// shows them where the worker's log is out of the user's sight.
inline constexpr char kPassedOverDamaged[] = "passed over damaged checkpoints: ";
// What a FORWARD job's result keeps of the tensors its model did not load
// (ForwardResult.unread_tensors): the first this many names, each cut to
// this many bytes; the coordinator holds a result to it too.
inline constexpr size_t kMaxUnreadTensorsReported = 100;
inline constexpr size_t kMaxUnreadTensorNameBytes = 256;
// Before UnreadTensorsNote's count, in rank 0's TRAINING status message.
inline constexpr char kUnreadTensors[] = "tensors of the model's files not loaded: ";

// kUnreadTensors, `count` and why it matters, and the first of `names`
// (at most 8, "and K more"; each C-escaped and cut at
// kMaxUnreadTensorNameBytes): a model loaded whose files hold tensors that
// are not its own (ShardedModel::unread_tensors). Without `count`: all of
// `names`.
std::string UnreadTensorsNote(int64_t count, const std::vector<std::string>& names);
inline std::string UnreadTensorsNote(const std::vector<std::string>& names) {
  return UnreadTensorsNote(static_cast<int64_t>(names.size()), names);
}

// Rank 0's TRAINING status message: "resumed from `checkpoint` (step
// `step`)" where it resumed, kPassedOverDamaged and `skipped` ("; "
// between), and UnreadTensorsNote(`unread`) last, each where there is one.
// At most kMaxReportedMessageBytes (what the coordinator keeps): a long
// list of damaged checkpoints is cut ("...") so that the note still fits.
std::string TrainingStartMessage(absl::string_view checkpoint, int64_t step, const std::vector<std::string>& skipped,
                                 const std::vector<std::string>& unread);

// `text` with each byte that does not belong to a well-formed UTF-8
// sequence (a stray continuation byte, a truncated or overlong sequence, a
// surrogate, a code point past U+10FFFF) replaced by U+FFFD.
std::string ValidUtf8(absl::string_view text);
// Whether `text` is well-formed UTF-8 (ValidUtf8 would leave it as it is).
bool IsValidUtf8(absl::string_view text);

// `text` from input (a name in a file's header, a request's field) as an
// error quotes it: its first `max` bytes C-escaped (a control byte or a
// stray byte cannot reach a terminal or break a proto `string`), "..."
// after them where it was longer.
std::string EscapedPrefix(absl::string_view text, size_t max);

// ValidUtf8(text), cut to at most `max` bytes (max >= 3) at a character's
// start, "..." ending what was cut.
std::string Utf8Prefix(absl::string_view text, size_t max);

}  // namespace colod

#endif  // COLOD_COMMON_TEXT_H_
