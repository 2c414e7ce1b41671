// CUDA back-end of GRPO: the row pass and the metrics reduction (registered in csrc/cuda_registration.cpp).
#include "common/row_pass_cuda.cuh"
#include "grpo/grpo.h"

namespace rl_losses {

const GrpoBackend& grpo_backend_cuda() {
  static constexpr GrpoBackend backend = GrpoBackendImpl<CudaRunner>::backend();
  return backend;
}

}  // namespace rl_losses
