// CUDA back-end of the fused head (registered in csrc/cuda_registration.cpp): the CE/GRPO row kernels with the
// combined epilogue; the GSPO term uses GSPO's own back-end (gspo_cuda.cu) for its statistics and steps, the
// distillation term distillation's passes (distillation_cuda.cu; fused_head_distill.h).
#include "fused_head/fused_head_distill.h"
#include "common/cuda_backends.h"
#include "common/row_pass_cuda.cuh"

namespace rl_losses {

const FusedHeadBackend& fused_head_backend_cuda() {
  static constexpr FusedHeadBackend backend =
      FusedHeadBackendImpl<CudaRunner, gspo_backend_cuda, distill_backend_cuda>::backend();
  return backend;
}

}  // namespace rl_losses
