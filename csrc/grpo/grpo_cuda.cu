// CUDA registration of the GRPO forward ops.
#include <torch/library.h>

#include "common/row_pass_cuda.cuh"
#include "grpo/grpo.h"

namespace rl_losses {
namespace {

void rows_cuda(const RowPassArgs& args, const GrpoRows& rows) {
  cuda::row_pass_cuda(args, "grpo",
                      [&](auto* tag) { return make_grpo_epilogue<std::remove_pointer_t<decltype(tag)>>(rows); });
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CUDA, m) {
  m.impl("_grpo_forward", &GrpoOps<rows_cuda>::forward);
  m.impl("_grpo_forward_inplace", &GrpoOps<rows_cuda>::forward_inplace);
}

}  // namespace rl_losses
