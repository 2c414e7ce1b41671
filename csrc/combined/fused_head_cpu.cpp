// CPU registration of the fused head (several losses in one pass).
#include <torch/library.h>

#include "combined/fused_head.h"
#include "common/row_pass_cpu.h"

namespace rl_losses {
namespace {

const FusedHeadBackend& fused_head_backend_cpu() {
  static constexpr FusedHeadBackend backend = FusedHeadBackendImpl<CpuRunner>::backend();
  return backend;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  m.impl("_fused_head_loss_forward", &FusedHeadOps<fused_head_backend_cpu>::forward);
  m.impl("_fused_head_loss_forward_inplace", &FusedHeadOps<fused_head_backend_cpu>::forward_inplace);
}

}  // namespace rl_losses
