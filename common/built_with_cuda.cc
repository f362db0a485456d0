#include "common/built_with_cuda.h"

namespace colod {

bool BuiltWithCuda() {
#ifdef COLOD_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace colod
