// CUDA registrations of every op (compiled only into CUDA builds).
//
// They live in this host-compiler (.cpp) file, not in the .cu files: a bad-input error thrown by the shared
// validation must unwind only through frames of one compiler. With it unwinding through nvcc-compiled host
// frames, the process crashed on the GPU machine's toolchain instead of raising. The .cu files export plain
// launchers (common/cuda_backends.h) and never see user input unchecked.
#ifdef RL_LOSSES_WITH_CUDA

#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "common/cuda_backends.h"
#include "common/loss_kernels.h"
#include "common/row_stats.h"
#include "cross_entropy/cross_entropy.h"
#include "distillation/distillation.h"
#include "dpo/dpo.h"
#include "fused_head/fused_head.h"
#include "grpo/grpo.h"
#include "gspo/gspo.h"
#include "kept_set/kept_set.h"
#include "policy_token/policy_token.h"
#include "token_log_probs/token_log_probs.h"
#include "topk_distillation/topk_distillation.h"

namespace rl_losses {
namespace {

// Kernel F run with its first argument's GPU as the current device: the library's own launches (its kernels, their
// stream, memsets, the device's properties) go to the current device, which need not be the tensors' one. The one
// place that sets it for every CUDA op. A first tensor on the CPU (another argument on a GPU brought the call here)
// sets nothing, so that the op's own device check reports the mismatch. Below autograd, as every back-end's
// kernels (common/boxed_kernel.h).
template <BoxedKernel F>
struct OnTensorsDevice {
  static void call(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const c10::IValue& first = *(stack->end() - op.schema().arguments().size());
    c10::cuda::OptionalCUDAGuard guard;
    if (first.isTensor() && first.toTensor().is_cuda()) guard.set_device(first.toTensor().device());
    BelowAutograd<F>::call(op, ks, stack);
  }
};

template <BoxedKernel F>
torch::CppFunction on_device() {
  return boxed<F, OnTensorsDevice>();
}

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

void scale_grad_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  schema::Args args(op, stack);
  const c10::IValue& row_unscale = args.arg("row_unscale");
  scale_grad_cuda(args.arg("grad").toTensor(), args.arg("grad_output").toTensor(),
                  row_unscale.isNone() ? std::nullopt : std::optional<at::Tensor>(row_unscale.toTensor()));
  args.push_results();
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CUDA, m) {
  m.impl("row_stats", on_device<&row_stats_kernel<row_stats_cuda, row_stats_blocks_cuda>>());
  m.impl("_scale_grad_", on_device<&scale_grad_kernel>());
  register_loss<CrossEntropyLoss<cross_entropy_rows_cuda>, OnTensorsDevice>(m);
  register_linear_loss<CrossEntropyLoss<cross_entropy_rows_cuda>, linear_backend_cuda, OnTensorsDevice>(m);
  register_loss<GrpoLoss<grpo_backend_cuda>, OnTensorsDevice>(m);
  register_linear_loss<GrpoLoss<grpo_backend_cuda>, linear_backend_cuda, OnTensorsDevice>(m);
  register_loss<GspoLoss<gspo_backend_cuda>, OnTensorsDevice>(m);
  register_linear_loss<GspoLoss<gspo_backend_cuda>, linear_backend_cuda, OnTensorsDevice>(m);
  m.impl("gspo_document_sums", on_device<&GspoLoss<gspo_backend_cuda>::document_sums>());
  m.impl("policy_token_loss", on_device<&policy_token_op<&policy_token_cuda>>());
  m.impl("_scatter_rows", on_device<&scatter_rows_op<&scatter_rows_cuda>>());
  using Distill = DistillKernels<distill_backend_cuda>;
  m.impl("_distillation_forward", on_device<&Distill::forward<false>>());
  m.impl("_distillation_forward_inplace", on_device<&Distill::forward<true>>());
  m.impl("distillation_stats", on_device<&Distill::stats>());
  m.impl("distillation_jsd_sums", on_device<&Distill::jsd_sums>());
  register_loss<DpoLoss<dpo_backend_cuda>, OnTensorsDevice>(m);
  register_loss<FusedHeadLoss<fused_head_backend_cuda>, OnTensorsDevice>(m);
  register_loss<TopkDistillationLoss<topk_distillation_rows_cuda>, OnTensorsDevice>(m);
  register_linear_loss<TopkDistillationLoss<topk_distillation_rows_cuda>, linear_backend_cuda, OnTensorsDevice>(m);
  using TokenLogProbs = TokenLogProbsKernels<token_log_probs_backend_cuda>;
  m.impl("_token_log_probs_forward", on_device<&TokenLogProbs::forward>());
  m.impl("_token_log_probs_backward", on_device<&TokenLogProbs::backward>());
  m.impl("_linear_token_log_probs_forward", on_device<&TokenLogProbs::linear_forward<linear_backend_cuda>>());
  m.impl("_linear_token_log_probs_backward", on_device<&TokenLogProbs::linear_backward<linear_backend_cuda>>());
}

}  // namespace rl_losses

#endif  // RL_LOSSES_WITH_CUDA
