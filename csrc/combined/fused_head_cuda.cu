// CUDA back-end of the fused head (registered in csrc/cuda_registration.cpp): the CE/GRPO row kernels with the
// combined epilogue.
#include "combined/fused_head.h"
#include "common/row_pass_cuda.cuh"

namespace rl_losses {

const FusedHeadBackend& fused_head_backend_cuda() {
  static constexpr FusedHeadBackend backend = FusedHeadBackendImpl<CudaRunner>::backend();
  return backend;
}

}  // namespace rl_losses
