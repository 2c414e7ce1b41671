// CUDA registration of the GSPO ops.
#include <torch/library.h>

#include "common/row_pass_cuda.cuh"
#include "gspo/gspo.h"

namespace rl_losses {
namespace {
constexpr GspoBackend kCuda = GspoBackendImpl<CudaRunner>::backend();
}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CUDA, m) {
  m.impl("_gspo_forward", &GspoOps<kCuda>::forward);
  m.impl("_gspo_forward_inplace", &GspoOps<kCuda>::forward_inplace);
}

}  // namespace rl_losses
