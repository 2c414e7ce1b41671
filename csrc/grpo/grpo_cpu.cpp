// CPU registration of the GRPO forward ops (from logits and from hidden states).
#include <torch/library.h>

#include "common/row_pass_cpu.h"
#include "grpo/grpo.h"
#include "linear/linear.h"

namespace rl_losses {
namespace {

void rows_cpu(const RowPassArgs& args, const GrpoRows& rows) {
  row_pass_cpu(args, "grpo", [&](auto* tag) { return make_grpo_epilogue<std::remove_pointer_t<decltype(tag)>>(rows); });
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  m.impl("_grpo_forward", &GrpoOps<rows_cpu>::forward);
  m.impl("_grpo_forward_inplace", &GrpoOps<rows_cpu>::forward_inplace);
  m.impl("_linear_grpo_forward", &LinearGrpoOp<rows_cpu, accumulate_weight_grad_cpu>::forward);
}

}  // namespace rl_losses
