// CUDA back-end of token_log_probs: its two row passes (registered in csrc/cuda_registration.cpp).
#include "common/row_pass_cuda.cuh"
#include "token_log_probs/token_log_probs.h"

namespace rl_losses {

const TokenLogProbsBackend& token_log_probs_backend_cuda() {
  static constexpr TokenLogProbsBackend backend = TokenLogProbsBackendImpl<CudaRunner>::backend();
  return backend;
}

}  // namespace rl_losses
