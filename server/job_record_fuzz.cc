// The coordinator's job record reader (JobManager::ReadRecord) on arbitrary
// bytes, as a damaged data dir could hold them. It reads a snapshot field
// by field, keeping its events serialized; the reference is protobuf's own
// parser. The first byte chooses the file:
//   even: the bytes are the snapshot job-000001.pb. What ReadRecord takes,
//         JobRecord::ParseFromArray must take too (naming the job), as the
//         same record. (ReadRecord is the stricter: protobuf's parser ends
//         a message at a 0 tag and passes over what follows, where
//         ReadRecord sets the file aside as damaged.)
//   odd:  the bytes are the log job-000001.log beside a good snapshot.
//         ReadRecord must return, with the snapshot's events first and the
//         taken entries' events numbered on from them.
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <string>

#include "colod/v1/job.pb.h"
#include "google/protobuf/util/message_differencer.h"
#include "server/job_manager.h"

namespace {

const std::string& Dir() {
  static const std::string* dir = [] {
    const char* tmp = std::getenv("TEST_TMPDIR");
    std::string pattern = std::string(tmp != nullptr ? tmp : "/tmp") + "/job-record-fuzz-XXXXXX";
    if (::mkdtemp(pattern.data()) == nullptr) std::abort();
    return new std::string(pattern);
  }();
  return *dir;
}

void Write(const std::string& path, const void* data, size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string snapshot = Dir() + "/job-000001.pb", log = Dir() + "/job-000001.log";
  const uint8_t* bytes = data + 1;
  const size_t n = size - 1;
  if (data[0] % 2 == 0) {
    ::unlink(log.c_str());
    Write(snapshot, bytes, n);
    const absl::StatusOr<colod::v1::JobRecord> got = colod::JobManager::ReadRecord(Dir(), "job-000001");
    colod::v1::JobRecord want;
    const bool parses = want.ParseFromArray(bytes, static_cast<int>(n)) && want.job().job_id() == "job-000001";
    if (got.ok() && (!parses || !google::protobuf::util::MessageDifferencer::Equals(*got, want))) std::abort();
    return 0;
  }
  colod::v1::JobRecord good;
  good.mutable_job()->set_job_id("job-000001");
  good.set_record_seq(1);
  for (int64_t seq = 1; seq <= 2; ++seq) {
    colod::v1::JobEvent* ev = good.add_events();
    ev->set_job_id("job-000001");
    ev->set_sequence(seq);
  }
  const std::string whole = good.SerializeAsString();
  Write(snapshot, whole.data(), whole.size());
  Write(log, bytes, n);
  const absl::StatusOr<colod::v1::JobRecord> got = colod::JobManager::ReadRecord(Dir(), "job-000001");
  if (!got.ok() || got->job().job_id() != "job-000001" || got->events_size() < 2) std::abort();
  for (int i = 0; i < got->events_size(); ++i) {
    if (i < 2 && got->events(i).sequence() != i + 1) std::abort();
  }
  return 0;
}
