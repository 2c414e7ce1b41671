// CPU registration of token_log_probs' forward and backward ops (from logits and from hidden states).
#include <torch/library.h>

#include "common/boxed_kernel.h"
#include "common/row_pass_cpu.h"
#include "token_log_probs/token_log_probs.h"

namespace rl_losses {
namespace {

const TokenLogProbsBackend& token_log_probs_backend_cpu() {
  static constexpr TokenLogProbsBackend backend = TokenLogProbsBackendImpl<CpuRunner>::backend();
  return backend;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  using K = TokenLogProbsKernels<token_log_probs_backend_cpu>;
  m.impl("_token_log_probs_forward", boxed<&K::forward>());
  m.impl("_token_log_probs_backward", boxed<&K::backward>());
  m.impl("_linear_token_log_probs_forward", boxed<&K::linear_forward<linear_backend_cpu>>());
  m.impl("_linear_token_log_probs_backward", boxed<&K::linear_backward<linear_backend_cpu>>());
}

}  // namespace rl_losses
