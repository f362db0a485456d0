// coloctl: the colod command line.
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/coordinator_client.h"
#include "client/format.h"
#include "colod/v1/coordinator.pb.h"
#include "common/flags.h"
#include "common/version.h"

ABSL_FLAG(std::string, coordinator, "",
          "Coordinator HOST:PORT. Default: $COLOD_COORDINATOR, else 127.0.0.1:7070.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "Deadline of each call, e.g. 10s.");
ABSL_FLAG(std::string, output, "table", "Output format: table or json.");
ABSL_FLAG(bool, all, false, "workers: also list workers whose lease expired (lost).");

namespace {

constexpr char kUsage[] =
    "coloctl: drive a colod cluster.\n"
    "\n"
    "Usage:\n"
    "  coloctl [flags] COMMAND\n"
    "\n"
    "Commands:\n"
    "  workers     List the workers registered with the coordinator: id, address, host,\n"
    "              device, state and heartbeat age. --all includes lost workers;\n"
    "              --output json prints the ListWorkersResponse as proto3 JSON.\n"
    "  version     Print the colod version.\n"
    "\n"
    "Exit status: 0 on success, 1 when the coordinator returns an error (the gRPC code and\n"
    "message are printed), 2 for a usage error.\n"
    "\n"
    "Examples:\n"
    "  coloctl --coordinator 127.0.0.1:7070 workers\n"
    "  COLOD_COORDINATOR=10.0.0.5:7070 coloctl workers --output json\n";

int Fail(const absl::Status& s) {
  std::fprintf(stderr, "coloctl: error: %s: %s\n", absl::StatusCodeToString(s.code()).c_str(),
               std::string(s.message()).c_str());
  return 1;
}

int Usage(const std::string& why) {
  std::fprintf(stderr, "coloctl: %s\nRun 'coloctl --help' for usage.\n", why.c_str());
  return 2;
}

std::string CoordinatorAddress() {
  std::string addr = absl::GetFlag(FLAGS_coordinator);
  if (addr.empty()) {
    const char* env = std::getenv("COLOD_COORDINATOR");
    addr = (env != nullptr && env[0] != '\0') ? env : "127.0.0.1:7070";
  }
  return addr;
}

int Workers(colod::CoordinatorClient& client, bool json) {
  auto workers = client.ListWorkers(absl::GetFlag(FLAGS_all));
  if (!workers.ok()) return Fail(workers.status());
  if (json) {
    colod::v1::ListWorkersResponse resp;
    for (const auto& w : *workers) *resp.add_workers() = w;
    auto out = colod::RenderJson(resp, /*pretty=*/true);
    if (!out.ok()) return Fail(out.status());
    std::fputs(out->c_str(), stdout);
  } else {
    std::fputs(colod::RenderWorkersTable(*workers, absl::Now()).c_str(), stdout);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args = colod::ParseFlags(argc, argv, kUsage);
  if (args.empty()) return Usage("missing COMMAND");
  const std::string output = absl::GetFlag(FLAGS_output);
  if (output != "table" && output != "json") {
    return Usage(absl::StrCat("--output: '", output, "' is not one of table, json"));
  }
  const std::string& cmd = args[0];
  if (cmd == "version") {
    std::printf("colod %s\n", colod::kVersion);
    return 0;
  }
  if (cmd != "workers") return Usage(absl::StrCat("unknown command '", cmd, "'"));
  if (args.size() > 1) return Usage(absl::StrCat("unexpected argument '", args[1], "'"));
  colod::CoordinatorClient::Options opts;
  opts.timeout = absl::GetFlag(FLAGS_timeout);
  auto client = colod::CoordinatorClient::Create(CoordinatorAddress(), opts);
  if (!client.ok()) return Usage(std::string(client.status().message()));
  return Workers(**client, output == "json");
}
