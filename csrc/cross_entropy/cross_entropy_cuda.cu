// CUDA back-end of cross-entropy: the row function (registered in csrc/cuda_registration.cpp).
#include "common/row_pass_cuda.cuh"
#include "cross_entropy/cross_entropy.h"

namespace rl_losses {

void cross_entropy_rows_cuda(const RowPassArgs& args, const CrossEntropyRows& rows) {
  cuda::row_pass_cuda(args, "cross_entropy", [&](auto* tag) {
    return make_cross_entropy_epilogue<std::remove_pointer_t<decltype(tag)>>(rows);
  });
}

}  // namespace rl_losses
