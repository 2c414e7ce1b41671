// CUDA registration of the cross-entropy forward ops.
#include <torch/library.h>

#include "common/row_pass_cuda.cuh"
#include "cross_entropy/cross_entropy.h"

namespace rl_losses {
namespace {

void rows_cuda(const RowPassArgs& args, const CrossEntropyRows& rows) {
  cuda::row_pass_cuda(args, "cross_entropy", [&](auto* tag) {
    return make_cross_entropy_epilogue<std::remove_pointer_t<decltype(tag)>>(rows);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CUDA, m) {
  m.impl("_cross_entropy_forward", &CrossEntropyOps<rows_cuda>::forward);
  m.impl("_cross_entropy_forward_inplace", &CrossEntropyOps<rows_cuda>::forward_inplace);
}

}  // namespace rl_losses
