// CUDA back-end of GSPO (registered in csrc/cuda_registration.cpp).
#include "common/row_pass_cuda.cuh"
#include "gspo/gspo.h"

namespace rl_losses {

const GspoBackend& gspo_backend_cuda() {
  static constexpr GspoBackend backend = GspoBackendImpl<CudaRunner>::backend();
  return backend;
}

}  // namespace rl_losses
