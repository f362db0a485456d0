// Bounds that hold across colod, so that every component refuses the same
// inputs: a job the coordinator accepts is one its workers, their
// rendezvous and their checkpoints accept too.
#ifndef COLOD_COMMON_LIMITS_H_
#define COLOD_COMMON_LIMITS_H_

namespace colod {

// Ranks of one job (tp * dp), of one barrier, of one checkpoint.
inline constexpr int kMaxWorldSize = 65536;

}  // namespace colod

#endif  // COLOD_COMMON_LIMITS_H_
