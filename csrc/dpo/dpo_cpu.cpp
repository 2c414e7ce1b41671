// CPU registration of the DPO forward ops.
#include <torch/library.h>

#include "common/row_pass_cpu.h"
#include "dpo/dpo.h"

namespace rl_losses {
namespace {

const DpoBackend& dpo_backend_cpu() {
  static constexpr DpoBackend backend = DpoBackendImpl<CpuRunner>::backend();
  return backend;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  m.impl("_dpo_forward", &DpoOps<dpo_backend_cpu>::forward);
  m.impl("_dpo_forward_inplace", &DpoOps<dpo_backend_cpu>::forward_inplace);
}

}  // namespace rl_losses
