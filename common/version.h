#ifndef COLOD_COMMON_VERSION_H_
#define COLOD_COMMON_VERSION_H_

namespace colod {

// Semantic version of every colod binary; reported by --version, in
// WorkerInfo.version and in the colod_build_info metric.
inline constexpr char kVersion[] = "0.1.0";

}  // namespace colod

#endif  // COLOD_COMMON_VERSION_H_
