// CPU registration of the GSPO ops (from logits and from hidden states, and the per-document sums).
#include <torch/library.h>

#include "common/loss_kernels.h"
#include "common/row_pass_cpu.h"
#include "gspo/gspo.h"

namespace rl_losses {

const GspoBackend& gspo_backend_cpu() {
  static constexpr GspoBackend backend = GspoBackendImpl<CpuRunner>::backend();
  return backend;
}

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  using Gspo = GspoLoss<gspo_backend_cpu>;
  register_loss<Gspo>(m);
  register_linear_loss<Gspo, linear_backend_cpu>(m);
  m.impl("gspo_document_sums", boxed<&Gspo::document_sums>());
}

}  // namespace rl_losses
