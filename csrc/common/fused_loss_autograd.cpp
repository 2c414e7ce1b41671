// Autograd (and no-autograd) kernels of the public loss ops (kLosses and kLinearLosses below).
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
// autograd code at all: list it below.
//
// The fused-linear ops (linear_cross_entropy, linear_grpo, linear_gspo) have the same shape with three
// differentiable inputs, hidden (argument 0), weight (1) and the optional `bias`: `_linear_<op>_forward(<the
// public arguments>, output_mask)` returns (outputs..., grad_hidden, grad_weight, grad_bias), computing the
// gradients that output_mask asks for. Given `weight_main_grad`, the forward adds the weight's gradient into
// that buffer, for an upstream gradient of 1, and autograd gets none for the weight (its .grad is untouched):
// the backward then refuses any other upstream gradient (a device-side assert on CUDA, no synchronisation),
// since what was added cannot be scaled afterwards.
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "common/autograd.h"

namespace rl_losses {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Calls an op with a boxed argument list; returns its (all tensor) outputs.
std::vector<at::Tensor> call_boxed(const c10::OperatorHandle& op, std::vector<c10::IValue> args) {
  op.callBoxed(args);
  std::vector<at::Tensor> out;
  out.reserve(args.size());
  for (auto& v : args) out.push_back(v.toTensor());
  return out;
}

// What a forward op returns: the public op's outputs, the gradient (not in place) and the per-row factors of
// a pre-scaled fp16 gradient (undefined where the forward has no grad_row_unscale output).
struct ForwardOutputs {
  std::vector<at::Tensor> out;
  at::Tensor grad, row_unscale;
};

// Calls the forward op with `args` (the public op's arguments, logits first, inplace_backward removed).
ForwardOutputs call_forward(const std::string& name, std::vector<c10::IValue> args, bool need_grad, bool inplace) {
  if (!inplace) args.emplace_back(need_grad);
  const auto op = find_op(("rl_losses::_" + name + (inplace ? "_forward_inplace" : "_forward")).c_str());
  ForwardOutputs f;
  f.out = call_boxed(op, std::move(args));
  if (op.schema().returns().back().name() == "grad_row_unscale") {
    f.row_unscale = f.out.back();
    f.out.pop_back();
  }
  if (!inplace) {
    f.grad = f.out.back();
    f.out.pop_back();
  }
  return f;
}

class FusedLossFunction : public torch::autograd::Function<FusedLossFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const std::string& name,
                               std::vector<c10::IValue> rest, bool need_grad, bool inplace) {
    at::AutoDispatchBelowADInplaceOrView guard;
    rest.insert(rest.begin(), logits);
    ForwardOutputs f = call_forward(name, std::move(rest), need_grad, need_grad && inplace);
    std::vector<at::Tensor>& out = f.out;
    if (need_grad && inplace) {
      mark_overwritten(logits);
      f.grad = logits;
    }
    if (need_grad) save_fused_grads(ctx, {f.grad}, f.row_unscale);
    ctx->saved_data["name"] = name;
    ctx->mark_non_differentiable(variable_list(out.begin() + 1, out.end()));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const std::string name = ctx->saved_data["name"].toStringRef();
    return {take_fused_grads(ctx, grad_outputs[0], name.c_str())[0], at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// Splits the boxed stack of a public op into (logits, other arguments, inplace_backward).
struct PublicArgs {
  std::string name;
  at::Tensor logits;
  std::vector<c10::IValue> rest;
  bool inplace;
};

PublicArgs pop_public_args(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  std::vector<c10::IValue> args(stack->end() - n, stack->end());
  torch::jit::drop(*stack, n);
  const auto idx = schema.argumentIndexWithName("inplace_backward");
  TORCH_INTERNAL_ASSERT(idx.has_value(), schema.name(), " has no inplace_backward argument");
  PublicArgs p;
  p.name = schema.name().substr(schema.name().find("::") + 2);
  p.inplace = args[*idx].toBool();
  args.erase(args.begin() + *idx);
  p.logits = args[0].toTensor();
  p.rest.assign(args.begin() + 1, args.end());
  return p;
}

void autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  PublicArgs p = pop_public_args(op, stack);
  const bool need_grad = input_needs_grad(p.logits);
  if (need_grad && p.inplace) check_inplace_target(p.logits, p.name.c_str());
  for (auto& t : FusedLossFunction::apply(p.logits, p.name, std::move(p.rest), need_grad, p.inplace))
    stack->emplace_back(std::move(t));
}

// Without autograd (inference mode, or called below the Autograd key): the forward alone, no gradient.
void no_grad_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  PublicArgs p = pop_public_args(op, stack);
  p.rest.insert(p.rest.begin(), p.logits);
  for (auto& t : call_forward(p.name, std::move(p.rest), false, false).out) stack->emplace_back(std::move(t));
}

// ---- fused-linear ops ---------------------------------------------------------------------------------
std::vector<at::Tensor> call_linear_forward(const std::string& name, std::vector<c10::IValue> args,
                                            std::array<bool, 3> mask) {
  args.emplace_back(c10::List<bool>({mask[0], mask[1], mask[2]}));
  return call_boxed(find_op(("rl_losses::_" + name + "_forward").c_str()), std::move(args));
}

class LinearLossFunction : public torch::autograd::Function<LinearLossFunction> {
 public:
  // hidden, weight, bias are the differentiable inputs (an optional bias: autograd tracks it when given);
  // `args` is the whole public argument list, passed on to the forward op.
  // into_main_grad: the weight's gradient goes into the weight_main_grad argument.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const std::optional<at::Tensor>& bias, const std::string& name,
                               std::vector<c10::IValue> args, std::array<bool, 3> mask, bool into_main_grad) {
    at::AutoDispatchBelowADInplaceOrView guard;
    std::vector<at::Tensor> out = call_linear_forward(name, std::move(args), mask);
    std::vector<at::Tensor> grads(out.end() - 3, out.end());
    out.resize(out.size() - 3);
    for (int i = 0; i < 3; ++i) {
      if (!mask[i] || (i == 1 && into_main_grad)) grads[i] = at::Tensor();
    }
    save_fused_grads(ctx, grads);
    ctx->saved_data["name"] = name;
    ctx->saved_data["into_main_grad"] = into_main_grad;
    ctx->mark_non_differentiable(variable_list(out.begin() + 1, out.end()));
    return out;
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
    return {grads[0], grads[1], grads[2], at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct LinearArgs {
  std::string name;
  std::vector<c10::IValue> args;
  at::Tensor hidden, weight;
  std::optional<at::Tensor> bias, main_grad;
};

LinearArgs pop_linear_args(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  LinearArgs p;
  p.args.assign(stack->end() - n, stack->end());
  torch::jit::drop(*stack, n);
  p.name = schema.name().substr(schema.name().find("::") + 2);
  p.hidden = p.args[0].toTensor();
  p.weight = p.args[1].toTensor();
  const auto idx = schema.argumentIndexWithName("bias");
  TORCH_INTERNAL_ASSERT(idx.has_value(), schema.name(), " has no bias argument");
  if (!p.args[*idx].isNone()) p.bias = p.args[*idx].toTensor();
  const auto main_grad = schema.argumentIndexWithName("weight_main_grad");
  TORCH_INTERNAL_ASSERT(main_grad.has_value(), schema.name(), " has no weight_main_grad argument");
  if (!p.args[*main_grad].isNone()) p.main_grad = p.args[*main_grad].toTensor();
  return p;
}

void linear_autograd_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  LinearArgs p = pop_linear_args(op, stack);
  const std::array<bool, 3> mask{input_needs_grad(p.hidden), input_needs_grad(p.weight),
                                 p.bias && input_needs_grad(*p.bias)};
  const bool into_main_grad = mask[1] && p.main_grad.has_value();
  for (auto& t : LinearLossFunction::apply(p.hidden, p.weight, p.bias, p.name, std::move(p.args), mask,
                                           into_main_grad))
    stack->emplace_back(std::move(t));
}

void linear_no_grad_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  LinearArgs p = pop_linear_args(op, stack);
  std::vector<at::Tensor> out = call_linear_forward(p.name, std::move(p.args), {false, false, false});
  out.resize(out.size() - 3);  // the empty gradient placeholders
  for (auto& t : out) stack->emplace_back(std::move(t));
}

}  // namespace

// The losses of registration.cpp's def_loss and def_linear.
constexpr const char* kLosses[] = {"cross_entropy", "grpo", "gspo", "distillation", "dpo", "fused_head",
                                   "topk_distillation"};
constexpr const char* kLinearLosses[] = {"linear_cross_entropy", "linear_grpo", "linear_gspo",
                                         "linear_topk_distillation"};

TORCH_LIBRARY_IMPL(rl_losses, Autograd, m) {
  for (const char* name : kLosses) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&autograd_kernel>());
  for (const char* name : kLinearLosses) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&linear_autograd_kernel>());
  }
}

TORCH_LIBRARY_IMPL(rl_losses, CompositeExplicitAutograd, m) {
  for (const char* name : kLosses) m.impl(name, torch::CppFunction::makeFromBoxedFunction<&no_grad_kernel>());
  for (const char* name : kLinearLosses) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&linear_no_grad_kernel>());
  }
}

}  // namespace rl_losses
