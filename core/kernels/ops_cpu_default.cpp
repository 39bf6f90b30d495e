// core/kernels/ops CPU kernels for any x86-64 or other host: ATen's portable Vectorized<float>.
#define TITAN_OPS_TABLE cpu_kernels_default
#define TITAN_OPS_ISA "default"
#include "core/kernels/ops_cpu_kernels.h"
