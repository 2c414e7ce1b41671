// CUDA registrations of every op (compiled only into CUDA builds).
//
// They live in this host-compiler (.cpp) file, not in the .cu files: a bad-input error thrown by the shared
// validation must unwind only through frames of one compiler. With it unwinding through nvcc-compiled host
// frames, the process crashed on the GPU machine's toolchain instead of raising. The .cu files export plain
// launchers (common/cuda_backends.h) and never see user input unchecked.
#ifdef RL_LOSSES_WITH_CUDA

#include <torch/library.h>

#include "common/cuda_backends.h"
#include "common/row_stats.h"
#include "cross_entropy/cross_entropy.h"
#include "grpo/grpo.h"
#include "gspo/gspo.h"
#include "linear/linear.h"

namespace rl_losses {
namespace {

void scale_grad_cuda(const at::Tensor& grad, const at::Tensor& grad_output) {
  if (grad.numel() == 0) return;
  if (grad_output.numel() != 1 || grad_output.dim() != 0) {
    grad.mul_(grad_output.unsqueeze(-1));  // reduction="none": one upstream value per row
    return;
  }
  TORCH_CHECK(grad_output.device() == grad.device(), "_scale_grad_: grad_output is on ", grad_output.device(),
              " but the gradient is on ", grad.device());
  scale_grad_cuda_scalar(grad, grad_output);
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CUDA, m) {
  m.impl("row_stats", &row_stats_op<row_stats_cuda>);
  m.impl("_scale_grad_", &scale_grad_cuda);
  m.impl("_cross_entropy_forward", &CrossEntropyOps<cross_entropy_rows_cuda>::forward);
  m.impl("_cross_entropy_forward_inplace", &CrossEntropyOps<cross_entropy_rows_cuda>::forward_inplace);
  m.impl("_grpo_forward", &GrpoOps<grpo_backend_cuda>::forward);
  m.impl("_grpo_forward_inplace", &GrpoOps<grpo_backend_cuda>::forward_inplace);
  m.impl("_gspo_forward", &GspoOps<gspo_backend_cuda>::forward);
  m.impl("_gspo_forward_inplace", &GspoOps<gspo_backend_cuda>::forward_inplace);
  m.impl("gspo_document_sums", &GspoOps<gspo_backend_cuda>::document_sums);
  m.impl("_linear_cross_entropy_forward",
         &LinearCrossEntropyOp<cross_entropy_rows_cuda, accumulate_weight_grad_cuda>::forward);
  m.impl("_linear_grpo_forward", &LinearGrpoOp<grpo_backend_cuda, accumulate_weight_grad_cuda>::forward);
  m.impl("_linear_gspo_forward", &LinearGspoOp<gspo_backend_cuda, accumulate_weight_grad_cuda>::forward);
}

}  // namespace rl_losses

#endif  // RL_LOSSES_WITH_CUDA
