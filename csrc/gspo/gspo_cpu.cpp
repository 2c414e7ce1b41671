// CPU registration of the GSPO ops (from logits and from hidden states).
#include <torch/library.h>

#include "common/row_pass_cpu.h"
#include "gspo/gspo.h"
#include "linear/linear.h"

namespace rl_losses {
namespace {

const GspoBackend& gspo_backend_cpu() {
  static constexpr GspoBackend backend = GspoBackendImpl<CpuRunner>::backend();
  return backend;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  m.impl("_gspo_forward", &GspoOps<gspo_backend_cpu>::forward);
  m.impl("_gspo_forward_inplace", &GspoOps<gspo_backend_cpu>::forward_inplace);
  m.impl("_linear_gspo_forward", &LinearGspoOp<gspo_backend_cpu, linear_backend_cpu>::forward);
  m.impl("gspo_document_sums", &GspoOps<gspo_backend_cpu>::document_sums);
}

}  // namespace rl_losses
