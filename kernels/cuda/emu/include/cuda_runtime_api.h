// colod's CUDA emulation: the runtime API header (see cuda_runtime.h).
#include "cuda_runtime.h"
