// CPU registration of the fused head (several losses in one pass).
#include <torch/library.h>

#include "common/loss_kernels.h"
#include "common/row_pass_cpu.h"
#include "fused_head/fused_head.h"

namespace rl_losses {
namespace {

// The GSPO term runs GSPO's statistics pass and its steps between the passes; its gradient is the head's own pass
// (and its metrics are not the head's), so those two are left out.
const GspoBackend& head_gspo_backend_cpu() {
  using Impl = GspoBackendImpl<CpuRunner>;
  static constexpr GspoBackend backend = {&Impl::stats, nullptr, &Impl::token_terms, &Impl::documents, &Impl::tokens,
                                          nullptr};
  return backend;
}

const FusedHeadBackend& fused_head_backend_cpu() {
  static constexpr FusedHeadBackend backend = FusedHeadBackendImpl<CpuRunner, head_gspo_backend_cpu>::backend();
  return backend;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  register_loss<FusedHeadLoss<fused_head_backend_cpu>>(m);
}

}  // namespace rl_losses
