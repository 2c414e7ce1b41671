// CUDA back-end of GRPO: the row function (registered in csrc/cuda_registration.cpp).
#include "common/row_pass_cuda.cuh"
#include "grpo/grpo.h"

namespace rl_losses {

void grpo_rows_cuda(const RowPassArgs& args, const GrpoRows& rows) {
  cuda::row_pass_cuda(args, "grpo",
                      [&](auto* tag) { return make_grpo_epilogue<std::remove_pointer_t<decltype(tag)>>(rows); });
}

}  // namespace rl_losses
