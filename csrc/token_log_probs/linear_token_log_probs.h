// The fused lm_head form of token_log_probs (token_log_probs.h): logits = hidden @ weight.T (+ bias), a chunk
// of rows at a time (linear/linear_source.h). The forward computes each chunk's logits once for the
// statistics; the backward, which needs the upstream gradients, computes them again chunk by chunk and turns
// each chunk's gradient into grad_hidden, grad_weight and grad_bias (in lean mode: two sweeps, as the losses'
// gradient pass). No more than one chunk (or block) of logits exists.
#pragma once

#include <array>
#include <optional>
#include <tuple>

#include "linear/linear_source.h"
#include "token_log_probs/token_log_probs.h"

namespace rl_losses {

// Rows without a label are left out (skip_unlabelled) only where nothing of theirs is asked for: their log-prob
// is 0, but their entropy, when computed (forward) or differentiated (backward), needs their logits.
template <const TokenLogProbsBackend& (*kBackend)(), const LinearBackend& (*kLinear)()>
struct LinearTokenLogProbsOps {
  using Opt = std::optional<at::Tensor>;
  static TokenLogProbsT3 forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                                 const Opt& bias, double s, bool entropy, std::optional<int64_t> chunk,
                                 c10::string_view strategy, const Opt& main_grad, bool skip) {
    // No gradient here: main_grad is only checked (the backward adds into it).
    LinearSource src("linear_token_log_probs", hidden, weight, bias, target,
                     {chunk, strategy, main_grad, skip && !entropy}, {false, false, false}, kLinear());
    auto o = token_log_probs_forward(src, target, s, entropy, std::nullopt, kBackend());
    return {o[0], o[1], o[2]};
  }
  static TokenLogProbsT3 backward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                                  const Opt& bias, const at::Tensor& stats, const Opt& grad_lp, const Opt& grad_h,
                                  double s, std::optional<int64_t> chunk, c10::string_view strategy,
                                  const Opt& main_grad, bool skip, std::array<bool, 3> mask) {
    LinearSource src("linear_token_log_probs", hidden, weight, bias, target,
                     {chunk, strategy, main_grad, skip && !grad_h}, mask, kLinear());
    if (src.wants_grad()) token_log_probs_backward(src, target, stats, grad_lp, grad_h, s, kBackend());
    auto g = src.grads();
    return {g[0], g[1], g[2]};
  }
};

}  // namespace rl_losses
