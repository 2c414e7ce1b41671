// Autograd (and no-autograd) kernels of the public loss ops (kLosses and kLinearLosses).
//
// The three share one shape, so they share one kernel, written once over the op's schema:
//   * the only differentiable input is `logits` (argument 0) and the only differentiable output is the
//     loss (output 0); every other output is a detached metric;
//   * `rl_losses::<op>` = `rl_losses::_<op>_forward(<the same arguments without inplace_backward>,
//     compute_grad)` returning (outputs..., grad), or `_<op>_forward_inplace(...)` writing the gradient into
//     the logits when inplace_backward;
//   * the gradient is computed in the forward (for an upstream gradient of 1) when grad mode is on and the
//     logits require it, saved, and scaled in the backward by the `_scale_grad_` op (common/autograd.h);
//   * a forward whose last output is `grad_row_unscale` (the ops over the row pass) stores fp16 gradient rows
//     pre-scaled, and that output goes to `_scale_grad_` with the gradient.
// Being boxed, the kernel finds inplace_backward and bias by name, and hands the public op's arguments on to
// the forward op, whose schema registration.cpp builds from the same list; so a new loss with this shape needs no
// autograd code at all: list it in kLosses.
// Where no gradient is needed (no_grad, inference, inputs that do not require one), the forward op runs on the
// caller's stack below autograd, as the no-autograd kernel does: an autograd Function with nothing to record
// cost the host a node, its context and a pass over every output, which the policy ops' 13 outputs felt
// (docs/host_time.md).
//
// The fused-linear ops (linear_cross_entropy, linear_grpo, linear_gspo) have the same shape with three
// differentiable inputs, hidden (argument 0), weight (1) and the optional `bias`: `_linear_<op>_forward(<the
// public arguments>, output_mask)` returns (outputs..., grad_hidden, grad_weight, grad_bias), computing the
// gradients that output_mask asks for. Given `weight_main_grad`, the forward adds the weight's gradient into
// that buffer, for an upstream gradient of 1, and autograd gets none for the weight (its .grad is untouched):
// the backward then refuses any other upstream gradient (a device-side assert on CUDA, no synchronisation),
// since what was added cannot be scaled afterwards.
#include <ATen/ops/_assert_async.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <iterator>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/autograd.h"

namespace rl_losses {

// The losses of registration.cpp's def_loss and def_linear.
constexpr const char* kLosses[] = {"cross_entropy", "grpo", "gspo", "distillation", "dpo", "fused_head",
                                   "topk_distillation"};
constexpr const char* kLinearLosses[] = {"linear_cross_entropy", "linear_grpo", "linear_gspo",
                                         "linear_topk_distillation"};

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the kernels of one public loss op read of its schema and its forward ops, looked up on its first call
// rather than by a name built on every call.
struct LossOps {
  std::string name;      // the public op's, without the namespace
  size_t n_args;         // the public op's
  size_t inplace_index;  // of inplace_backward
  c10::OperatorHandle forward, forward_inplace;
  // Whether each ends its outputs with grad_row_unscale (after grad, which the in-place one does not return).
  bool row_unscale, inplace_row_unscale;
  // The public op's `Tensor?` results, which the in-place forward (an op that writes an argument, whose results are
  // plain tensors) returns empty where it leaves them out (common/schema.cpp).
  std::vector<bool> optional_results;
};

bool returns_row_unscale(const c10::OperatorHandle& op) {
  return op.schema().returns().back().name() == "grad_row_unscale";
}

LossOps find_loss_ops(const char* name) {
  const auto op = find_op((std::string("rl_losses::") + name).c_str());
  const auto& schema = op.schema();
  const auto idx = schema.argumentIndexWithName("inplace_backward");
  TORCH_INTERNAL_ASSERT(idx.has_value(), schema.name(), " has no inplace_backward argument");
  const auto forward = find_op(("rl_losses::_" + std::string(name) + "_forward").c_str());
  const auto inplace = find_op(("rl_losses::_" + std::string(name) + "_forward_inplace").c_str());
  std::vector<bool> optional;
  for (const auto& r : schema.returns()) optional.push_back(r.type()->kind() == c10::TypeKind::OptionalType);
  return {name, schema.arguments().size(), *idx, forward, inplace, returns_row_unscale(forward),
          returns_row_unscale(inplace), std::move(optional)};
}

// The public op's arguments moved off the stack as the forward ops take them: logits first, inplace_backward
// taken out (returned in `inplace`), room left for compute_grad.
std::vector<c10::IValue> pop_forward_args(const LossOps& ops, torch::jit::Stack* stack, bool* inplace) {
  std::vector<c10::IValue> args;
  args.reserve(ops.n_args);
  const auto first = stack->end() - ops.n_args;
  for (size_t i = 0; i < ops.n_args; ++i) {
    if (i == ops.inplace_index) {
      *inplace = first[i].toBool();
    } else {
      args.push_back(std::move(first[i]));
    }
  }
  torch::jit::drop(*stack, ops.n_args);
  return args;
}

// What a forward op returns: the public op's outputs, the gradient (not in place) and the per-row factors of
// a pre-scaled fp16 gradient (undefined where the forward has no grad_row_unscale output).
struct ForwardOutputs {
  std::vector<at::Tensor> out;
  at::Tensor grad, row_unscale;
};

// Calls the forward op with `args` (pop_forward_args').
ForwardOutputs call_forward(const LossOps& ops, std::vector<c10::IValue> args, bool need_grad, bool inplace) {
  if (!inplace) args.emplace_back(need_grad);
  ForwardOutputs f;
  f.out = call_boxed(inplace ? ops.forward_inplace : ops.forward, std::move(args));
  if (inplace ? ops.inplace_row_unscale : ops.row_unscale) {
    f.row_unscale = f.out.back();
    f.out.pop_back();
  }
  if (!inplace) {
    f.grad = f.out.back();
    f.out.pop_back();
  } else {
    for (size_t i = 0; i < f.out.size(); ++i) {
      if (ops.optional_results[i] && f.out[i].dim() == 1 && f.out[i].numel() == 0) f.out[i] = at::Tensor();
    }
  }
  return f;
}

class FusedLossFunction : public torch::autograd::Function<FusedLossFunction> {
 public:
  // `args`: the forward op's arguments, `logits` among them (first), repeated for autograd.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const LossOps& ops,
                               std::vector<c10::IValue> args, bool need_grad, bool inplace,
                               std::vector<bool>* present) {
    at::AutoDispatchBelowADInplaceOrView guard;
    ForwardOutputs f = call_forward(ops, std::move(args), need_grad, need_grad && inplace);
    std::vector<at::Tensor>& out = f.out;
    if (need_grad && inplace) {
      mark_overwritten(logits);
      f.grad = logits;
    }
    if (need_grad) save_fused_grads(ctx, {f.grad}, f.row_unscale);
    ctx->saved_data["name"] = ops.name;
    return non_differentiable_after_loss(ctx, std::move(out), present);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const std::string name = ctx->saved_data["name"].toStringRef();
    return {take_fused_grads(ctx, grad_outputs[0], name.c_str())[0], at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

// Whether `t` carries a forward-mode tangent (level 0, as autograd's custom functions ask).
bool has_fw_grad(const at::Tensor& t) { return t._fw_grad(/*level=*/0).defined(); }

// The forward alone, no gradient, on the caller's stack: the forward op's outputs but its gradient ones.
void run_without_grad(const LossOps& ops, torch::jit::Stack* stack) {
  // Below autograd as under FusedLossFunction: the forward ops have no autograd kernel of their own.
  at::AutoDispatchBelowADInplaceOrView guard;
  const auto first = stack->end() - ops.n_args;
  stack->erase(first + ops.inplace_index);
  stack->emplace_back(false);  // compute_grad
  ops.forward.callBoxed(stack);
  torch::jit::drop(*stack, ops.row_unscale ? 2 : 1);  // grad (an empty placeholder) and grad_row_unscale
}

template <size_t I>
const LossOps& loss_ops() {
  static const LossOps ops = find_loss_ops(kLosses[I]);
  return ops;
}

template <size_t I>
void autograd_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const LossOps& ops = loss_ops<I>();
  const at::Tensor& logits = (stack->end() - ops.n_args)->toTensor();
  // Without a gradient to compute (no_grad, or logits that do not require one), autograd has nothing to record
  // and the forward runs as it would below the Autograd key. (A forward-mode tangent still goes through
  // FusedLossFunction, which refuses it.)
  if (!input_needs_grad(logits) && !has_fw_grad(logits)) {
    run_without_grad(ops, stack);
    return;
  }
  bool inplace = false;
  std::vector<c10::IValue> args = pop_forward_args(ops, stack, &inplace);
  const at::Tensor logits_arg = args[0].toTensor();
  const bool need_grad = input_needs_grad(logits_arg);
  if (need_grad && inplace) check_inplace_target(logits_arg, ops.name.c_str());
  std::vector<bool> present;
  push_outputs(stack, FusedLossFunction::apply(logits_arg, ops, std::move(args), need_grad, inplace, &present),
               present);
}

// Without autograd (inference mode, or called below the Autograd key): the forward alone, no gradient.
template <size_t I>
void no_grad_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
  run_without_grad(loss_ops<I>(), stack);
}

// ---- fused-linear ops ---------------------------------------------------------------------------------
// A fused-linear op's schema positions and forward op, looked up on its first call (as LossOps).
struct LinearOps {
  std::string name;
  size_t n_args, bias_index, main_grad_index;
  c10::OperatorHandle forward;
};

LinearOps find_linear_ops(const char* name) {
  const auto op = find_op((std::string("rl_losses::") + name).c_str());
  const auto& schema = op.schema();
  const auto bias = schema.argumentIndexWithName("bias");
  TORCH_INTERNAL_ASSERT(bias.has_value(), schema.name(), " has no bias argument");
  const auto main_grad = schema.argumentIndexWithName("weight_main_grad");
  TORCH_INTERNAL_ASSERT(main_grad.has_value(), schema.name(), " has no weight_main_grad argument");
  return {name, schema.arguments().size(), *bias, *main_grad,
          find_op(("rl_losses::_" + std::string(name) + "_forward").c_str())};
}

template <size_t I>
const LinearOps& linear_ops() {
  static const LinearOps ops = find_linear_ops(kLinearLosses[I]);
  return ops;
}

std::vector<at::Tensor> call_linear_forward(const LinearOps& ops, std::vector<c10::IValue> args,
                                            std::array<bool, 3> mask) {
  args.emplace_back(c10::List<bool>({mask[0], mask[1], mask[2]}));
  return call_boxed(ops.forward, std::move(args));
}

class LinearLossFunction : public torch::autograd::Function<LinearLossFunction> {
 public:
  // hidden, weight, bias are the differentiable inputs (an optional bias: autograd tracks it when given);
  // `args` is the whole public argument list, passed on to the forward op.
  // into_main_grad: the weight's gradient goes into the weight_main_grad argument.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const LinearOps& ops,
                               std::vector<c10::IValue> args, std::array<bool, 3> mask, bool into_main_grad,
                               std::vector<bool>* present) {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::vector<at::Tensor> out = call_linear_forward(ops, std::move(args), mask);
    std::vector<at::Tensor> grads(out.end() - 3, out.end());
    out.resize(out.size() - 3);
    for (int i = 0; i < 3; ++i) {
      if (!mask[i] || (i == 1 && into_main_grad)) grads[i] = at::Tensor();
    }
    save_fused_grads(ctx, grads);
    ctx->saved_data["name"] = ops.name;
    ctx->saved_data["into_main_grad"] = into_main_grad;
    return non_differentiable_after_loss(ctx, std::move(out), present);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const std::string name = ctx->saved_data["name"].toStringRef();
    std::vector<at::Tensor> grads = take_fused_grads(ctx, grad_outputs[0], name.c_str());
    if (ctx->saved_data["into_main_grad"].toBool() && grad_outputs[0].defined()) {
      at::_assert_async(grad_outputs[0].eq(1),
                        name + ": with weight_main_grad, the weight's gradient is added to the buffer in the forward, "
                               "for an upstream gradient of 1, and the backward got another one; scale the loss "
                               "through divisor instead of scaling the returned loss");
    }
    return {grads[0], grads[1], grads[2], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The forward alone, no gradient, on the caller's stack (as run_without_grad).
void run_linear_without_grad(const LinearOps& ops, torch::jit::Stack* stack) {
  at::AutoDispatchBelowADInplaceOrView guard;
  stack->emplace_back(c10::List<bool>({false, false, false}));  // output_mask
  ops.forward.callBoxed(stack);
  torch::jit::drop(*stack, 3);  // the empty gradient placeholders
}

template <size_t I>
void linear_autograd_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const LinearOps& ops = linear_ops<I>();
  const auto first = stack->end() - ops.n_args;
  const at::Tensor& hidden = first[0].toTensor();
  const at::Tensor& weight = first[1].toTensor();
  std::optional<at::Tensor> bias, main_grad;
  if (!first[ops.bias_index].isNone()) bias = first[ops.bias_index].toTensor();
  if (!first[ops.main_grad_index].isNone()) main_grad = first[ops.main_grad_index].toTensor();
  const std::array<bool, 3> mask{input_needs_grad(hidden), input_needs_grad(weight), bias && input_needs_grad(*bias)};
  // Nothing to differentiate: as autograd_kernel.
  if (!mask[0] && !mask[1] && !mask[2] && !has_fw_grad(hidden) && !has_fw_grad(weight) &&
      !(bias && has_fw_grad(*bias))) {
    run_linear_without_grad(ops, stack);
    return;
  }
  const bool into_main_grad = mask[1] && main_grad.has_value();
  const at::Tensor h = hidden, w = weight;
  std::vector<c10::IValue> args(std::make_move_iterator(first), std::make_move_iterator(stack->end()));
  torch::jit::drop(*stack, ops.n_args);
  std::vector<bool> present;
  push_outputs(stack, LinearLossFunction::apply(h, w, bias, ops, std::move(args), mask, into_main_grad, &present),
               present);
}

template <size_t I>
void linear_no_grad_kernel(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
  run_linear_without_grad(linear_ops<I>(), stack);
}

// One kernel per loss, each with its own LossOps (LinearOps).
template <size_t... I, size_t... J>
void impl_losses(torch::Library& m, std::index_sequence<I...>, std::index_sequence<J...>, bool autograd) {
  (m.impl(kLosses[I], autograd ? torch::CppFunction::makeFromBoxedFunction<&autograd_kernel<I>>()
                               : torch::CppFunction::makeFromBoxedFunction<&no_grad_kernel<I>>()),
   ...);
  (m.impl(kLinearLosses[J], autograd ? torch::CppFunction::makeFromBoxedFunction<&linear_autograd_kernel<J>>()
                                     : torch::CppFunction::makeFromBoxedFunction<&linear_no_grad_kernel<J>>()),
   ...);
}

void impl_losses(torch::Library& m, bool autograd) {
  impl_losses(m, std::make_index_sequence<std::size(kLosses)>(), std::make_index_sequence<std::size(kLinearLosses)>(),
              autograd);
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, Autograd, m) { impl_losses(m, true); }

TORCH_LIBRARY_IMPL(rl_losses, CompositeExplicitAutograd, m) { impl_losses(m, false); }

}  // namespace rl_losses
