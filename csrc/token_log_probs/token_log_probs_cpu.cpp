// CPU registration of token_log_probs' forward and backward ops (from logits and from hidden states).
#include <torch/library.h>

#include "common/row_pass_cpu.h"
#include "token_log_probs/linear_token_log_probs.h"

namespace rl_losses {
namespace {

const TokenLogProbsBackend& token_log_probs_backend_cpu() {
  static constexpr TokenLogProbsBackend backend = TokenLogProbsBackendImpl<CpuRunner>::backend();
  return backend;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  using Ops = TokenLogProbsOps<token_log_probs_backend_cpu>;
  using Linear = LinearTokenLogProbsOps<token_log_probs_backend_cpu, linear_backend_cpu>;
  m.impl("_token_log_probs_forward", &Ops::forward);
  m.impl("_token_log_probs_backward", &Ops::backward);
  m.impl("_linear_token_log_probs_forward", &Linear::forward);
  m.impl("_linear_token_log_probs_backward", &Linear::backward);
}

}  // namespace rl_losses
