// CPU registration of the DPO forward ops.
#include <torch/library.h>

#include "common/loss_kernels.h"
#include "common/row_pass_cpu.h"
#include "dpo/dpo.h"

namespace rl_losses {
namespace {

const DpoBackend& dpo_backend_cpu() {
  static constexpr DpoBackend backend = DpoBackendImpl<CpuRunner>::backend();
  return backend;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) { register_loss<DpoLoss<dpo_backend_cpu>>(m); }

}  // namespace rl_losses
