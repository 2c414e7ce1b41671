// CPU registration of the GRPO forward ops (from logits and from hidden states).
#include <torch/library.h>

#include "common/loss_kernels.h"
#include "common/row_pass_cpu.h"
#include "grpo/grpo.h"

namespace rl_losses {
namespace {

const GrpoBackend& grpo_backend_cpu() {
  static constexpr GrpoBackend backend = GrpoBackendImpl<CpuRunner>::backend();
  return backend;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  register_loss<GrpoLoss<grpo_backend_cpu>>(m);
  register_linear_loss<GrpoLoss<grpo_backend_cpu>, linear_backend_cpu>(m);
}

}  // namespace rl_losses
