// CPU registration of the fused head (several losses in one pass).
#include <torch/library.h>

#include "common/loss_kernels.h"
#include "common/row_pass_cpu.h"
#include "fused_head/fused_head_distill.h"

namespace rl_losses {
namespace {

// The GSPO term runs the statistics pass and the steps between the passes of GSPO's CPU back-end (gspo_cpu.cpp,
// compiled there); its gradient is the head's own pass, and GSPO's metrics are not the head's. The distillation
// term runs on distillation's CPU passes (distillation_cpu.cpp).
const FusedHeadBackend& fused_head_backend_cpu() {
  static constexpr FusedHeadBackend backend =
      FusedHeadBackendImpl<CpuRunner, gspo_backend_cpu, distill_backend_cpu>::backend();
  return backend;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  register_loss<FusedHeadLoss<fused_head_backend_cpu>>(m);
}

}  // namespace rl_losses
