// policy_token_loss's autograd kernel: differentiable w.r.t. log_probs through its loss, whose derivative the op
// returns per token (grad_log_probs): the backward is grad_loss · grad_log_probs. In C++ rather than Python
// (torch.library.register_autograd), whose Python frames every call would pay on the host (docs/host_time.md).
#include <ATen/TensorOperators.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <utility>
#include <vector>

#include "common/autograd.h"

namespace rl_losses {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The op's schema positions, looked up on its first call.
struct PolicyTokenOp {
  c10::OperatorHandle op;
  size_t n_args, slope;  // arguments; the output index of grad_log_probs
};

const PolicyTokenOp& policy_token_op_info() {
  static const PolicyTokenOp info = [] {
    const auto op = find_op("rl_losses::policy_token_loss");
    const auto& returns = op.schema().returns();
    size_t slope = 0;
    while (slope < returns.size() && returns[slope].name() != "grad_log_probs") ++slope;
    TORCH_INTERNAL_ASSERT(slope < returns.size(), "policy_token_loss returns no grad_log_probs");
    return PolicyTokenOp{op, op.schema().arguments().size(), slope};
  }();
  return info;
}

// The op below autograd, on `stack` (its arguments in, its results out).
void call_below_autograd(const PolicyTokenOp& info, torch::jit::Stack* stack) {
  at::AutoDispatchBelowADInplaceOrView guard;
  info.op.callBoxed(stack);
}

class PolicyTokenFunction : public torch::autograd::Function<PolicyTokenFunction> {
 public:
  // `args`: the op's arguments, log_probs first (repeated for autograd).
  static variable_list forward(AutogradContext* ctx, const at::Tensor& log_probs, std::vector<c10::IValue> args) {
    const PolicyTokenOp& info = policy_token_op_info();
    variable_list out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = call_boxed(info.op, std::move(args));
    }
    ctx->save_for_backward({out[info.slope]});
    ctx->saved_data["dtype"] = log_probs.scalar_type();
    ctx->set_materialize_grads(false);  // only the loss's gradient is read
    ctx->mark_non_differentiable(variable_list(out.begin() + 1, out.end()));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor& grad_loss = grad_outputs[0];
    if (!grad_loss.defined()) return {at::Tensor(), at::Tensor()};
    const at::Tensor slope = ctx->get_saved_variables()[0];
    return {(grad_loss * slope).to(ctx->saved_data["dtype"].toScalarType()), at::Tensor()};
  }
};

void autograd_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const PolicyTokenOp& info = policy_token_op_info();
  const at::Tensor log_probs = (stack->end() - info.n_args)->toTensor();
  // Without a gradient to compute, nothing to record: the op runs on the caller's stack.
  if (!input_needs_grad(log_probs) && !log_probs._fw_grad(/*level=*/0).defined()) {
    call_below_autograd(info, stack);
    return;
  }
  std::vector<c10::IValue> args(std::make_move_iterator(stack->end() - info.n_args),
                                std::make_move_iterator(stack->end()));
  torch::jit::drop(*stack, info.n_args);
  for (auto& t : PolicyTokenFunction::apply(log_probs, std::move(args))) stack->emplace_back(std::move(t));
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, Autograd, m) {
  m.impl("policy_token_loss", torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
}

}  // namespace rl_losses
