// CPU registration of the GRPO forward ops (from logits and from hidden states).
#include <torch/library.h>

#include "common/row_pass_cpu.h"
#include "grpo/grpo.h"
#include "linear/linear.h"

namespace rl_losses {
namespace {

const GrpoBackend& grpo_backend_cpu() {
  static constexpr GrpoBackend backend = GrpoBackendImpl<CpuRunner>::backend();
  return backend;
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  m.impl("_grpo_forward", &GrpoOps<grpo_backend_cpu>::forward);
  m.impl("_grpo_forward_inplace", &GrpoOps<grpo_backend_cpu>::forward_inplace);
  m.impl("_linear_grpo_forward", &LinearGrpoOp<grpo_backend_cpu, linear_backend_cpu>::forward);
}

}  // namespace rl_losses
