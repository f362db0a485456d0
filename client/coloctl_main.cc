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
#include "nlohmann/json.hpp"
#include "worker/shardformer/checkpoint.h"
#include "worker/shardformer/run_forward.h"
#include "worker/tensor/npy.h"

ABSL_FLAG(std::string, coordinator, "",
          "Coordinator HOST:PORT. Default: $COLOD_COORDINATOR, else 127.0.0.1:7070.");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10), "Deadline of each call, e.g. 10s.");
ABSL_FLAG(std::string, output, "table", "Output format: table or json.");
ABSL_FLAG(bool, all, false, "workers: also list workers whose lease expired (lost).");
ABSL_FLAG(std::string, model, "", "forward: the model directory (config.json + model.safetensors or an index).");
ABSL_FLAG(std::string, input, "", "forward: int64 (or int32/uint16/uint32) token ids [batch, seq] as .npy.");
ABSL_FLAG(std::string, logits, "", "forward: where to write the f32 logits [batch, seq, vocab] as .npy.");
ABSL_FLAG(int32_t, tp, 1, "forward: tensor-parallel size.");
ABSL_FLAG(int32_t, dp, 1, "forward: data-parallel size (splits the batch).");
ABSL_FLAG(std::string, mode, "1d", "forward: tensor-parallel mode: 1d, 2d, 2.5d or 3d.");
ABSL_FLAG(int32_t, depth, 0, "forward: depth of 2.5d (tp = depth * q * q).");
ABSL_FLAG(std::string, checkpoint, "", "consolidate: the sharded checkpoint directory.");
ABSL_FLAG(std::string, out, "", "consolidate: the Hugging Face directory to write.");
ABSL_FLAG(bool, sequence_parallel, false, "forward: split activations along the sequence over tp (1d).");

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
    "  forward     Run one forward pass of a Hugging Face-style model directory on tp * dp\n"
    "              local ranks (threads talking Gloo over loopback) and print the mean\n"
    "              next-token cross-entropy; does not need a coordinator.\n"
    "              --model DIR --input IDS.npy [--logits OUT.npy] [--tp T] [--dp D]\n"
    "              [--mode 1d|2d|2.5d|3d] [--depth D] [--sequence-parallel]. The ids are\n"
    "              integers [batch, seq]; the logits are written as f32 [batch, seq, vocab]\n"
    "              without vocabulary padding. --output json prints one JSON object with\n"
    "              loss, tokens, logits and shape.\n"
    "  consolidate Assemble a sharded checkpoint (one file per rank + colod_checkpoint.json)\n"
    "              into a Hugging Face directory (config.json + model.safetensors) that\n"
    "              loads at any layout: --checkpoint DIR --out DIR.\n"
    "\n"
    "Exit status: 0 on success, 1 when the command fails (the status code, e.g. the\n"
    "coordinator's gRPC code, and the message are printed), 2 for a usage error.\n"
    "\n"
    "Examples:\n"
    "  coloctl --coordinator 127.0.0.1:7070 workers\n"
    "  COLOD_COORDINATOR=10.0.0.5:7070 coloctl workers --output json\n"
    "  coloctl forward --model ./gpt2 --input ids.npy --logits logits.npy --tp 2 --dp 1 --mode 1d\n";

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

absl::StatusOr<colod::v1::TensorParallelMode> ParseMode(const std::string& mode) {
  if (mode == "1d") return colod::v1::TENSOR_PARALLEL_MODE_1D;
  if (mode == "2d") return colod::v1::TENSOR_PARALLEL_MODE_2D;
  if (mode == "2.5d") return colod::v1::TENSOR_PARALLEL_MODE_2P5D;
  if (mode == "3d") return colod::v1::TENSOR_PARALLEL_MODE_3D;
  return absl::InvalidArgumentError(absl::StrCat("--mode: '", mode, "' is not one of 1d, 2d, 2.5d, 3d"));
}

int Forward(bool json) {
  const std::string model = absl::GetFlag(FLAGS_model), input = absl::GetFlag(FLAGS_input),
                    logits_path = absl::GetFlag(FLAGS_logits);
  if (model.empty()) return Usage("forward: --model is required");
  if (input.empty()) return Usage("forward: --input is required");
  auto mode = ParseMode(absl::GetFlag(FLAGS_mode));
  if (!mode.ok()) return Usage(std::string(mode.status().message()));
  colod::shardformer::ForwardRequest request;
  request.model_dir = model;
  request.shard.layout.set_tensor_parallel_size(absl::GetFlag(FLAGS_tp));
  request.shard.layout.set_data_parallel_size(absl::GetFlag(FLAGS_dp));
  request.shard.layout.set_tensor_parallel_mode(*mode);
  request.shard.layout.set_depth(absl::GetFlag(FLAGS_depth));
  request.shard.layout.set_sequence_parallel(absl::GetFlag(FLAGS_sequence_parallel));
  auto ids = colod::ReadNpy(input);
  if (!ids.ok()) return Fail(ids.status());
  request.ids = *ids;
  auto result = colod::shardformer::RunForward(request);
  if (!result.ok()) return Fail(result.status());
  if (!logits_path.empty()) {
    const absl::Status written = colod::WriteNpy(logits_path, result->logits);
    if (!written.ok()) return Fail(written);
  }
  const colod::Shape& s = result->logits.shape();
  if (json) {
    nlohmann::json out = {{"loss", result->loss}, {"tokens", result->tokens}, {"shape", {s[0], s[1], s[2]}}};
    out["logits"] = logits_path.empty() ? nlohmann::json() : nlohmann::json(logits_path);
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::printf("loss %.6f (mean next-token cross-entropy over %lld tokens)\n", result->loss,
                static_cast<long long>(result->tokens));
    if (!logits_path.empty()) {
      std::printf("logits f32 [%lld, %lld, %lld] written to %s\n", static_cast<long long>(s[0]),
                  static_cast<long long>(s[1]), static_cast<long long>(s[2]), logits_path.c_str());
    }
  }
  return 0;
}

int Consolidate() {
  const std::string checkpoint = absl::GetFlag(FLAGS_checkpoint), out = absl::GetFlag(FLAGS_out);
  if (checkpoint.empty()) return Usage("consolidate: --checkpoint is required");
  if (out.empty()) return Usage("consolidate: --out is required");
  const absl::Status s = colod::shardformer::ConsolidateCheckpoint(checkpoint, out);
  if (!s.ok()) return Fail(s);
  std::printf("wrote %s/model.safetensors and %s/config.json\n", out.c_str(), out.c_str());
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
  if (cmd == "consolidate") {
    if (args.size() > 1) return Usage(absl::StrCat("unexpected argument '", args[1], "'"));
    return Consolidate();
  }
  if (cmd == "forward") {
    if (args.size() > 1) return Usage(absl::StrCat("unexpected argument '", args[1], "'"));
    return Forward(output == "json");
  }
  if (cmd != "workers") return Usage(absl::StrCat("unknown command '", cmd, "'"));
  if (args.size() > 1) return Usage(absl::StrCat("unexpected argument '", args[1], "'"));
  colod::CoordinatorClient::Options opts;
  opts.timeout = absl::GetFlag(FLAGS_timeout);
  auto client = colod::CoordinatorClient::Create(CoordinatorAddress(), opts);
  if (!client.ok()) return Usage(std::string(client.status().message()));
  return Workers(**client, output == "json");
}
