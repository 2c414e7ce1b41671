// CUDA registrations of every op (compiled only into CUDA builds).
//
// They live in this host-compiler (.cpp) file, not in the .cu files: a bad-input error thrown by the shared
// validation must unwind only through frames of one compiler. With it unwinding through nvcc-compiled host
// frames, the process crashed on the GPU machine's toolchain instead of raising. The .cu files export plain
// launchers (common/cuda_backends.h) and never see user input unchecked.
#ifdef RL_LOSSES_WITH_CUDA

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <type_traits>
#include <utility>

#include "common/cuda_backends.h"
#include "common/row_stats.h"
#include "cross_entropy/cross_entropy.h"
#include "distillation/distillation.h"
#include "dpo/dpo.h"
#include "combined/fused_head.h"
#include "grpo/grpo.h"
#include "gspo/gspo.h"
#include "linear/linear.h"
#include "token_log_probs/linear_token_log_probs.h"

namespace rl_losses {
namespace {

// Op F run with its first tensor's GPU as the current device: the library's own launches (its kernels, their
// stream, memsets, the device's properties) go to the current device, which need not be the tensors' one. The
// one place that sets it for every CUDA op. A first tensor on the CPU (another argument on a GPU brought the
// call here) sets nothing, so that the op's own device check reports the mismatch.
template <auto F>
struct OnTensorsDevice;
template <typename R, typename First, typename... Rest, R (*F)(First, Rest...)>
struct OnTensorsDevice<F> {
  static_assert(std::is_same_v<std::decay_t<First>, at::Tensor>, "the op's first argument is a tensor");
  static R call(First first, Rest... rest) {
    c10::cuda::OptionalCUDAGuard guard;
    if (first.is_cuda()) guard.set_device(first.device());
    return F(std::forward<First>(first), std::forward<Rest>(rest)...);
  }
};

void scale_grad_cuda(const at::Tensor& grad, const at::Tensor& grad_output,
                     const std::optional<at::Tensor>& row_unscale) {
  if (grad.numel() == 0) return;
  const at::Tensor grad2d = grad.view({-1, grad.size(-1)});
  check_scale_grad(grad2d, grad_output, row_unscale);
  const bool prescaled = row_unscale.has_value() && row_unscale->numel() > 0;
  TORCH_CHECK(grad_output.device() == grad.device(), "_scale_grad_: grad_output is on ", grad_output.device(),
              " but the gradient is on ", grad.device());
  scale_grad_cuda_rows(grad, grad_output, prescaled ? row_unscale->const_data_ptr<float>() : nullptr);
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CUDA, m) {
  using CrossEntropy = CrossEntropyOps<cross_entropy_rows_cuda>;
  using Grpo = GrpoOps<grpo_backend_cuda>;
  using Gspo = GspoOps<gspo_backend_cuda>;
  using LinearCrossEntropy = LinearCrossEntropyOp<cross_entropy_rows_cuda, linear_backend_cuda>;
  using LinearGrpo = LinearGrpoOp<grpo_backend_cuda, linear_backend_cuda>;
  using LinearGspo = LinearGspoOp<gspo_backend_cuda, linear_backend_cuda>;
  m.impl("row_stats", &OnTensorsDevice<&row_stats_op<row_stats_cuda>>::call);
  m.impl("_scale_grad_", &OnTensorsDevice<&scale_grad_cuda>::call);
  m.impl("_cross_entropy_forward", &OnTensorsDevice<&CrossEntropy::forward>::call);
  m.impl("_cross_entropy_forward_inplace", &OnTensorsDevice<&CrossEntropy::forward_inplace>::call);
  m.impl("_grpo_forward", &OnTensorsDevice<&Grpo::forward>::call);
  m.impl("_grpo_forward_inplace", &OnTensorsDevice<&Grpo::forward_inplace>::call);
  m.impl("_gspo_forward", &OnTensorsDevice<&Gspo::forward>::call);
  m.impl("_gspo_forward_inplace", &OnTensorsDevice<&Gspo::forward_inplace>::call);
  m.impl("gspo_document_sums", &OnTensorsDevice<&Gspo::document_sums>::call);
  m.impl("_linear_cross_entropy_forward", &OnTensorsDevice<&LinearCrossEntropy::forward>::call);
  m.impl("_linear_grpo_forward", &OnTensorsDevice<&LinearGrpo::forward>::call);
  m.impl("_linear_gspo_forward", &OnTensorsDevice<&LinearGspo::forward>::call);
  using Distill = DistillOps<distill_backend_cuda>;
  m.impl("_distillation_forward", &OnTensorsDevice<&Distill::forward>::call);
  m.impl("_distillation_forward_inplace", &OnTensorsDevice<&Distill::forward_inplace>::call);
  m.impl("distillation_stats", &OnTensorsDevice<&Distill::stats>::call);
  m.impl("distillation_jsd_sums", &OnTensorsDevice<&Distill::jsd_sums>::call);
  using Dpo = DpoOps<dpo_backend_cuda>;
  m.impl("_dpo_forward", &OnTensorsDevice<&Dpo::forward>::call);
  m.impl("_dpo_forward_inplace", &OnTensorsDevice<&Dpo::forward_inplace>::call);
  using FusedHead = FusedHeadOps<fused_head_backend_cuda>;
  m.impl("_fused_head_loss_forward", &OnTensorsDevice<&FusedHead::forward>::call);
  m.impl("_fused_head_loss_forward_inplace", &OnTensorsDevice<&FusedHead::forward_inplace>::call);
  using TokenLogProbs = TokenLogProbsOps<token_log_probs_backend_cuda>;
  using LinearTokenLogProbs = LinearTokenLogProbsOps<token_log_probs_backend_cuda, linear_backend_cuda>;
  m.impl("_token_log_probs_forward", &OnTensorsDevice<&TokenLogProbs::forward>::call);
  m.impl("_token_log_probs_backward", &OnTensorsDevice<&TokenLogProbs::backward>::call);
  m.impl("_linear_token_log_probs_forward", &OnTensorsDevice<&LinearTokenLogProbs::forward>::call);
  m.impl("_linear_token_log_probs_backward", &OnTensorsDevice<&LinearTokenLogProbs::backward>::call);
}

}  // namespace rl_losses

#endif  // RL_LOSSES_WITH_CUDA
