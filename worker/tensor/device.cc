#include "worker/tensor/device.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"

namespace colod {

std::string Device::ToString() const { return is_cuda() ? absl::StrCat("cuda:", index) : "cpu"; }

absl::StatusOr<Device> ParseDevice(absl::string_view text) {
  if (text == "cpu") return Device::Cpu();
  if (text == "cuda") return Device::Cuda(0);
  int index = 0;
  absl::string_view rest = text;
  if (absl::ConsumePrefix(&rest, "cuda:") && absl::SimpleAtoi(rest, &index) && index >= 0) return Device::Cuda(index);
  return absl::InvalidArgumentError(absl::StrCat("device '", text, "' is not cpu, cuda or cuda:N"));
}

}  // namespace colod
