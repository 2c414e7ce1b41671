// CUDA back-end of DPO (registered in csrc/cuda_registration.cpp): the row passes and steps of the CUDA runner.
#include "common/row_pass_cuda.cuh"
#include "dpo/dpo.h"

namespace rl_losses {

const DpoBackend& dpo_backend_cuda() {
  static constexpr DpoBackend backend = DpoBackendImpl<CudaRunner>::backend();
  return backend;
}

}  // namespace rl_losses
