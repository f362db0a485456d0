// The DistSpec text syntax (coloctl tensor create/reshard --spec) on
// arbitrary text over a tp 4 x dp 2 mesh: an error, or a spec whose
// rendering (DistSpecText) parses back to a spec that renders the same
// ("tp=R" and "R" are the same spec, spelled differently).
#include <cstdint>
#include <cstdlib>
#include <string>

#include "client/format.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const colod::v1::MeshSpec mesh = [] {
    colod::v1::MeshSpec m;
    colod::v1::MeshAxis* dp = m.add_axes();
    dp->set_name("dp");
    dp->set_size(2);
    colod::v1::MeshAxis* tp = m.add_axes();
    tp->set_name("tp");
    tp->set_size(4);
    m.set_world_size(8);
    return m;
  }();
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<colod::v1::DistSpec> spec = colod::ParseDistSpecText(text, mesh);
  if (!spec.ok()) return 0;
  const std::string rendered = colod::DistSpecText(*spec);
  absl::StatusOr<colod::v1::DistSpec> again = colod::ParseDistSpecText(rendered, mesh);
  if (!again.ok() || colod::DistSpecText(*again) != rendered) std::abort();
  return 0;
}
