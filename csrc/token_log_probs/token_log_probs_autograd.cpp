// Autograd (and no-autograd) kernels of token_log_probs and linear_token_log_probs.
//
// Unlike the losses (common/fused_loss_autograd.cpp), whose gradient is computed in the forward for an
// upstream gradient of 1 and scaled afterwards, these outputs are vectors whose upstream gradients are known
// only in the backward. So the forward saves the row statistics (N × 5 floats, next to the logits the caller
// holds anyway) and the backward is a registered op, `_token_log_probs_backward` /
// `_linear_token_log_probs_backward`, one gradient pass (the linear form recomputes each chunk's logits).
// Both outputs are differentiable (the entropy only when computed); either may receive no gradient. Given
// `weight_main_grad`, the linear form's backward adds the weight's gradient into it (with the real upstream
// gradients) and autograd gets none for the weight.
#include <torch/autograd.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <tuple>

#include "common/autograd.h"

namespace rl_losses {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using Opt = std::optional<at::Tensor>;
using T2 = std::tuple<at::Tensor, at::Tensor>;
using T3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

Opt defined_or_none(const at::Tensor& t) { return t.defined() ? Opt(t) : std::nullopt; }

// A second differentiation of the backward pass would need the gradient of a row pass w.r.t. its
// coefficients; refuse it rather than return a silently wrong (zero) second derivative.
void check_no_double_backward(const char* op) {
  TORCH_CHECK(!at::GradMode::is_enabled(), op,
              ": double backward (create_graph=True) is not supported; differentiate token_log_probs once, or "
              "use rl_losses.reference.token_log_probs for higher derivatives");
}

const auto& forward_op() {
  static const auto op = find_op("rl_losses::_token_log_probs_forward")
                             .typed<T3(const at::Tensor&, const at::Tensor&, double, bool, const Opt&, int64_t,
                                       int64_t)>();
  return op;
}

class TokenLogProbsFunction : public torch::autograd::Function<TokenLogProbsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& target, double s,
                               bool entropy, const Opt& row_stats, int64_t vocab_start, int64_t vocab_size) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [lp, h, stats] = forward_op().call(logits, target, s, entropy, row_stats, vocab_start, vocab_size);
    ctx->save_for_backward({logits, target, row_stats ? *row_stats : stats});
    ctx->saved_data["s"] = s;
    ctx->saved_data["entropy"] = entropy;
    ctx->saved_data["vocab_start"] = vocab_start;
    ctx->saved_data["vocab_size"] = vocab_size;
    ctx->set_materialize_grads(false);
    if (!entropy) ctx->mark_non_differentiable({h});
    return {lp, h};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list out(7);
    const bool entropy = ctx->saved_data["entropy"].toBool();
    const at::Tensor g_lp = grad_outputs[0], g_h = entropy ? grad_outputs[1] : at::Tensor();
    if (!g_lp.defined() && !g_h.defined()) return out;
    check_no_double_backward("token_log_probs");
    static const auto op = find_op("rl_losses::_token_log_probs_backward")
                               .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&,
                                                 const Opt&, double, int64_t, int64_t)>();
    const auto saved = ctx->get_saved_variables();
    out[0] = op.call(saved[0], saved[1], saved[2], defined_or_none(g_lp), defined_or_none(g_h),
                     ctx->saved_data["s"].toDouble(), ctx->saved_data["vocab_start"].toInt(),
                     ctx->saved_data["vocab_size"].toInt());
    return out;
  }
};

T2 token_log_probs_autograd(const at::Tensor& logits, const at::Tensor& target, double s, bool entropy,
                            const Opt& row_stats, int64_t vocab_start, int64_t vocab_size) {
  auto out = TokenLogProbsFunction::apply(logits, target, s, entropy, row_stats, vocab_start, vocab_size);
  return {out[0], out[1]};
}

T2 token_log_probs_no_grad(const at::Tensor& logits, const at::Tensor& target, double s, bool entropy,
                           const Opt& row_stats, int64_t vocab_start, int64_t vocab_size) {
  auto [lp, h, stats] = forward_op().call(logits, target, s, entropy, row_stats, vocab_start, vocab_size);
  return {lp, h};
}

// ---- fused lm_head ------------------------------------------------------------------------------------
const auto& linear_forward_op() {
  static const auto op = find_op("rl_losses::_linear_token_log_probs_forward")
                             .typed<T3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&, double,
                                       bool, std::optional<int64_t>, c10::string_view, const Opt&, bool)>();
  return op;
}

class LinearTokenLogProbsFunction : public torch::autograd::Function<LinearTokenLogProbsFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& weight,
                               const Opt& bias, const at::Tensor& target, double s, bool entropy,
                               std::optional<int64_t> chunk_size, c10::string_view strategy, const Opt& main_grad,
                               bool skip) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [lp, h, stats] =
        linear_forward_op().call(hidden, weight, target, bias, s, entropy, chunk_size, strategy, main_grad, skip);
    ctx->save_for_backward({hidden, weight, bias.value_or(at::Tensor()), target, stats});
    ctx->saved_data["s"] = s;
    ctx->saved_data["entropy"] = entropy;
    ctx->saved_data["chunk_size"] = chunk_size ? c10::IValue(*chunk_size) : c10::IValue();
    ctx->saved_data["has_bias"] = bias.has_value();
    ctx->saved_data["strategy"] = std::string(strategy);
    ctx->saved_data["skip_unlabelled"] = skip;
    // Not saved for backward: other calls' backwards add into the same buffer before this one's runs, and a
    // saved tensor would refuse its moved version.
    ctx->saved_data["weight_main_grad"] = main_grad ? c10::IValue(*main_grad) : c10::IValue();
    ctx->set_materialize_grads(false);
    if (!entropy) ctx->mark_non_differentiable({h});
    return {lp, h};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    variable_list out(10);
    const bool entropy = ctx->saved_data["entropy"].toBool();
    const at::Tensor g_lp = grad_outputs[0], g_h = entropy ? grad_outputs[1] : at::Tensor();
    if (!g_lp.defined() && !g_h.defined()) return out;
    check_no_double_backward("linear_token_log_probs");
    static const auto op =
        find_op("rl_losses::_linear_token_log_probs_backward")
            .typed<T3(const at::Tensor&, const at::Tensor&, const at::Tensor&, const Opt&, const at::Tensor&,
                      const Opt&, const Opt&, double, std::optional<int64_t>, c10::string_view, const Opt&, bool,
                      std::array<bool, 3>)>();
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const auto chunk = ctx->saved_data["chunk_size"];
    const auto main_grad = ctx->saved_data["weight_main_grad"];
    const std::array<bool, 3> mask{ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                                   has_bias && ctx->needs_input_grad(2)};
    auto [gh, gw, gb] = op.call(saved[0], saved[1], saved[3], has_bias ? Opt(saved[2]) : std::nullopt, saved[4],
                                defined_or_none(g_lp), defined_or_none(g_h), ctx->saved_data["s"].toDouble(),
                                chunk.isNone() ? std::nullopt : std::optional<int64_t>(chunk.toInt()),
                                ctx->saved_data["strategy"].toStringRef(),
                                main_grad.isNone() ? std::nullopt : Opt(main_grad.toTensor()),
                                ctx->saved_data["skip_unlabelled"].toBool(), mask);
    if (mask[0]) out[0] = gh;
    if (mask[1] && main_grad.isNone()) out[1] = gw;
    if (mask[2]) out[2] = gb;
    return out;
  }
};

T2 linear_token_log_probs_autograd(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                                   const Opt& bias, double s, bool entropy, std::optional<int64_t> chunk_size,
                                   c10::string_view strategy, const Opt& main_grad, bool skip) {
  auto out = LinearTokenLogProbsFunction::apply(hidden, weight, bias, target, s, entropy, chunk_size, strategy,
                                                main_grad, skip);
  return {out[0], out[1]};
}

T2 linear_token_log_probs_no_grad(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                                  const Opt& bias, double s, bool entropy, std::optional<int64_t> chunk_size,
                                  c10::string_view strategy, const Opt& main_grad, bool skip) {
  auto [lp, h, stats] =
      linear_forward_op().call(hidden, weight, target, bias, s, entropy, chunk_size, strategy, main_grad, skip);
  return {lp, h};
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, Autograd, m) {
  m.impl("token_log_probs", &token_log_probs_autograd);
  m.impl("linear_token_log_probs", &linear_token_log_probs_autograd);
}

TORCH_LIBRARY_IMPL(rl_losses, CompositeExplicitAutograd, m) {
  m.impl("token_log_probs", &token_log_probs_no_grad);
  m.impl("linear_token_log_probs", &linear_token_log_probs_no_grad);
}

}  // namespace rl_losses
