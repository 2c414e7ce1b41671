// Autograd (and no-autograd) kernels of token_log_probs and linear_token_log_probs.
//
// Unlike the losses (common/fused_loss_autograd.cpp), whose gradient is computed in the forward for an
// upstream gradient of 1 and scaled afterwards, these outputs are vectors whose upstream gradients are known
// only in the backward. So the forward saves the row statistics (N × 5 floats, next to the logits the caller
// holds anyway) and the backward is a registered op, `_token_log_probs_backward` /
// `_linear_token_log_probs_backward`, one gradient pass (the linear form recomputes each chunk's logits).
// Both outputs are differentiable (the entropy only when computed); either may receive no gradient.
// The kernels are boxed: the public op's arguments go on to its `_forward` op as they are (the same list,
// registration.cpp), and the backward op's are set by name. Given `weight_main_grad`, the linear form's backward
// adds the weight's gradient into it (with the real upstream gradients) and autograd gets none for the weight.
#include <torch/autograd.h>
#include <torch/library.h>

#include <vector>

#include "common/autograd.h"
#include "token_log_probs/token_log_probs.h"

namespace rl_losses {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

c10::IValue defined_or_none(const at::Tensor& t) { return t.defined() ? c10::IValue(t) : c10::IValue(); }
c10::IValue value_or_none(const OptTensor& t) { return t ? c10::IValue(*t) : c10::IValue(); }

// The sampler's options go to the backward, which computes the same floors again.
void save_sampler(AutogradContext* ctx, const SamplerArgs& s) {
  ctx->saved_data["top_k"] = value_or_none(s.top_k);
  ctx->saved_data["top_p"] = value_or_none(s.top_p);
  ctx->saved_data["min_p"] = value_or_none(s.min_p);
}

// A second differentiation of the backward pass would need the gradient of a row pass w.r.t. its
// coefficients; refuse it rather than return a silently wrong (zero) second derivative.
void check_no_double_backward(const char* op) {
  TORCH_CHECK(!at::GradMode::is_enabled(), op,
              ": double backward (create_graph=True) is not supported; differentiate token_log_probs once, or "
              "use rl_losses.reference.token_log_probs for higher derivatives");
}

// The public op's arguments passed on to `_<op>_forward`: (log_probs, entropy, stats).
schema::Call forward_call(const std::string& name, std::vector<c10::IValue> args) {
  return std::move(schema::Call(find_op(("rl_losses::_" + name + "_forward").c_str()), std::move(args)).run());
}

class TokenLogProbsFunction : public torch::autograd::Function<TokenLogProbsFunction> {
 public:
  // `args`: the public op's arguments; `logits` among them, repeated for autograd.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, std::vector<c10::IValue> args,
                               const LogitsInput& in, const TokenLogProbsArgs& a, const VocabShard& shard,
                               const OptTensor& row_stats) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const schema::Call fwd = forward_call("token_log_probs", std::move(args));
    ctx->save_for_backward({logits, in.target, row_stats ? *row_stats : fwd.result("stats")});
    ctx->saved_data["logits_scale_factor"] = a.logits_scale_factor;
    ctx->saved_data["compute_entropy"] = a.compute_entropy;
    ctx->saved_data["vocab_start"] = shard.vocab_start;
    ctx->saved_data["vocab_size"] = shard.vocab_size;
    save_sampler(ctx, a.sampler);
    ctx->set_materialize_grads(false);
    const at::Tensor lp = fwd.result("log_probs"), h = fwd.result("entropy");
    if (!a.compute_entropy) ctx->mark_non_differentiable({h});
    return {lp, h};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list out(6);
    const bool entropy = ctx->saved_data["compute_entropy"].toBool();
    const at::Tensor g_lp = grad_outputs[0], g_h = entropy ? grad_outputs[1] : at::Tensor();
    if (!g_lp.defined() && !g_h.defined()) return out;
    check_no_double_backward("token_log_probs");
    static const auto op = find_op("rl_losses::_token_log_probs_backward");
    const auto saved = ctx->get_saved_variables();
    schema::Call call(op);
    call.set("logits", saved[0]).set("target", saved[1]).set("stats", saved[2]);
    call.set("grad_log_probs", defined_or_none(g_lp)).set("grad_entropy", defined_or_none(g_h));
    for (const char* name : {"logits_scale_factor", "vocab_start", "vocab_size"}) call.set(name, ctx->saved_data[name]);
    for (const char* name : SamplerArgs::kNames) call.set(name, ctx->saved_data[name]);
    out[0] = call.run().result("grad");
    return out;
  }
};

class LinearTokenLogProbsFunction : public torch::autograd::Function<LinearTokenLogProbsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const OptTensor& bias, std::vector<c10::IValue> args, const LinearInput& in,
                               const LinearOptions& linear, const TokenLogProbsArgs& a) {
    at::AutoDispatchBelowADInplaceOrView guard;
    const schema::Call fwd = forward_call("linear_token_log_probs", std::move(args));
    ctx->save_for_backward({hidden, weight, bias.value_or(at::Tensor()), in.target, fwd.result("stats")});
    ctx->saved_data["logits_scale_factor"] = a.logits_scale_factor;
    ctx->saved_data["compute_entropy"] = a.compute_entropy;
    ctx->saved_data["chunk_size"] = linear.chunk_size ? c10::IValue(*linear.chunk_size) : c10::IValue();
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["strategy"] = linear.strategy;
    ctx->saved_data["skip_unlabelled"] = linear.skip_unlabelled ? c10::IValue(*linear.skip_unlabelled) : c10::IValue();
    ctx->saved_data["head_dtype"] = linear.head_dtype;
    save_sampler(ctx, a.sampler);
    // Not saved for backward: other calls' backwards add into the same buffer before this one's runs, and a
    // saved tensor would refuse its moved version.
    ctx->saved_data["weight_main_grad"] = linear.weight_main_grad ? c10::IValue(*linear.weight_main_grad) : c10::IValue();
    ctx->set_materialize_grads(false);
    const at::Tensor lp = fwd.result("log_probs"), h = fwd.result("entropy");
    if (!a.compute_entropy) ctx->mark_non_differentiable({h});
    return {lp, h};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list out(7);
    const bool entropy = ctx->saved_data["compute_entropy"].toBool();
    const at::Tensor g_lp = grad_outputs[0], g_h = entropy ? grad_outputs[1] : at::Tensor();
    if (!g_lp.defined() && !g_h.defined()) return out;
    check_no_double_backward("linear_token_log_probs");
    static const auto op = find_op("rl_losses::_linear_token_log_probs_backward");
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const c10::List<bool> mask({ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                has_bias && ctx->needs_input_grad(2)});
    schema::Call call(op);
    call.set("hidden", saved[0]).set("weight", saved[1]).set("bias", has_bias ? c10::IValue(saved[2]) : c10::IValue());
    call.set("target", saved[3]).set("stats", saved[4]).set("output_mask", mask);
    call.set("grad_log_probs", defined_or_none(g_lp)).set("grad_entropy", defined_or_none(g_h));
    for (const char* name : {"logits_scale_factor", "chunk_size", "strategy", "weight_main_grad", "skip_unlabelled",
                           "head_dtype"}) {
      call.set(name, ctx->saved_data[name]);
    }
    for (const char* name : SamplerArgs::kNames) call.set(name, ctx->saved_data[name]);
    call.run();
    const bool into_main_grad = !ctx->saved_data["weight_main_grad"].isNone();
    const char* names[3] = {"grad_hidden", "grad_weight", "grad_bias"};
    for (int i = 0; i < 3; ++i) {
      if (mask.get(i) && !(i == 1 && into_main_grad)) out[i] = call.result(names[i]);
    }
    return out;
  }
};

void token_log_probs_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  schema::Args args(op, stack);
  const auto in = args.read<LogitsInput>();
  const auto a = args.read<TokenLogProbsArgs>();
  const auto shard = args.read<VocabShard>();
  const auto row_stats = args.read<RowStatsArg>().row_stats;
  const auto out = TokenLogProbsFunction::apply(in.logits, args.arguments(), in, a, shard, row_stats);
  TokenLogProbsResults{out[0], out[1]}.write(args);
  args.push_results();
}

void linear_token_log_probs_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  schema::Args args(op, stack);
  const auto in = args.read<LinearInput>();
  const auto linear = args.read<LinearOptions>();
  const auto a = args.read<TokenLogProbsArgs>();
  const auto out = LinearTokenLogProbsFunction::apply(in.hidden, in.weight, linear.bias, args.arguments(), in, linear,
                                                      a);
  TokenLogProbsResults{out[0], out[1]}.write(args);
  args.push_results();
}

// Without autograd: the forward op alone.
void no_grad_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  schema::Args args(op, stack);
  const schema::Call fwd = forward_call(args.op_name(), args.arguments());
  TokenLogProbsResults{fwd.result("log_probs"), fwd.result("entropy")}.write(args);
  args.push_results();
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, Autograd, m) {
  m.impl("token_log_probs", torch::CppFunction::makeFromBoxedFunction<&token_log_probs_autograd>());
  m.impl("linear_token_log_probs", torch::CppFunction::makeFromBoxedFunction<&linear_token_log_probs_autograd>());
}

TORCH_LIBRARY_IMPL(rl_losses, CompositeExplicitAutograd, m) {
  m.impl("token_log_probs", torch::CppFunction::makeFromBoxedFunction<&no_grad_kernel>());
  m.impl("linear_token_log_probs", torch::CppFunction::makeFromBoxedFunction<&no_grad_kernel>());
}

}  // namespace rl_losses
