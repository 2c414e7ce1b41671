// Per-token log-probabilities of the labels and entropies (docs/token_log_probs.md), differentiable through
// both outputs with arbitrary upstream gradients: what an RL trainer computes before its own loss (TRL's
// selective_log_softmax, verl's log-prob/entropy kernel).
//
//   forward:  one statistics pass; per row lp = x_y − lse (0 without a label), H = lse − Σp·x, and the row
//             statistics themselves, which the backward reads instead of recomputing them;
//   backward: one gradient-only pass with those statistics and per-row coefficients (math.h:
//             token_log_prob_grad) a = −g_lp − g_H·H, b = g_lp, h = −g_H.
// Unlike the losses, the gradient cannot be computed in the forward: it depends on a whole vector of upstream
// gradients, known only in the backward. The row-pass epilogues and the device-independent code shared by the
// CPU and CUDA registrations are here.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/row_pass.h"
#include "common/row_source.h"

namespace rl_losses {

// Forward: statistics → lp, H (when asked) and the statistics (when computed here, not given).
template <typename acc_t>
struct TokenLogProbsEpilogue {
  static constexpr bool kMayUseEntropy = true, kMayUseSmoothing = false, kMayUseEntropyGrad = false;
  static constexpr bool kMayReadStats = true, kMayWriteGrad = false;
  static constexpr bool kSkipsUnlabelled = false;  // the entropy of an unlabelled row is still an output
  acc_t* log_probs;  // (N,)
  acc_t* entropy;    // (N,) or null
  acc_t* stats_out;  // (N, 5) or null

  C10_HOST_DEVICE GradCoef<acc_t> operator()(int64_t row, int64_t label, const RowStats<acc_t>& st) const {
    log_probs[row] = label >= 0 ? st.log_prob(st.label) : acc_t(0);
    if (entropy != nullptr) entropy[row] = st.entropy();
    if (stats_out != nullptr) store_stats(stats_out, row, st);
    return {acc_t(0), acc_t(0), acc_t(0), acc_t(0)};
  }
};

// Backward: the gradient of Σ g_lp·lp + g_H·H from the forward's statistics.
template <typename acc_t>
struct TokenLogProbsGradEpilogue {
  static constexpr bool kMayUseEntropy = false, kMayUseSmoothing = false;
  static constexpr bool kMayReadStats = true, kMayWriteGrad = true, kMayUseEntropyGrad = true;
  static constexpr bool kSkipsUnlabelled = false;
  const acc_t* grad_log_probs;  // (N,) or null (no gradient reached the log-probs)
  const acc_t* grad_entropy;    // (N,) or null

  C10_HOST_DEVICE GradCoef<acc_t> operator()(int64_t row, int64_t label, const RowStats<acc_t>& st) const {
    const acc_t g_lp = grad_log_probs != nullptr ? grad_log_probs[row] : acc_t(0);
    const acc_t g_h = grad_entropy != nullptr ? grad_entropy[row] : acc_t(0);
    return token_log_prob_grad(g_lp, g_h, g_h != acc_t(0) ? st.entropy() : acc_t(0), label >= 0);
  }
};

struct TokenLogProbsRows {
  at::Tensor log_probs;  // (N,)
  at::Tensor entropy;    // (N,) or undefined
  at::Tensor stats_out;  // (N, 5) or undefined
};

struct TokenLogProbsGrads {
  at::Tensor grad_log_probs;  // (N,) acc dtype, or undefined
  at::Tensor grad_entropy;    // (N,) acc dtype, or undefined
};

// The back-end: the two row passes on one device.
struct TokenLogProbsBackend {
  void (*forward)(const RowPassArgs&, const TokenLogProbsRows&);
  void (*backward)(const RowPassArgs&, const TokenLogProbsGrads&);
};

template <typename Runner>
struct TokenLogProbsBackendImpl {
  static void forward(const RowPassArgs& args, const TokenLogProbsRows& r) {
    Runner::row_pass(args, "token_log_probs", [&](auto* tag) {
      using acc_t = std::remove_pointer_t<decltype(tag)>;
      return TokenLogProbsEpilogue<acc_t>{r.log_probs.data_ptr<acc_t>(),
                                          r.entropy.defined() ? r.entropy.data_ptr<acc_t>() : nullptr,
                                          r.stats_out.defined() ? r.stats_out.data_ptr<acc_t>() : nullptr};
    });
  }
  static void backward(const RowPassArgs& args, const TokenLogProbsGrads& g) {
    Runner::row_pass(args, "token_log_probs", [&](auto* tag) {
      using acc_t = std::remove_pointer_t<decltype(tag)>;
      auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<acc_t>() : nullptr; };
      return TokenLogProbsGradEpilogue<acc_t>{ptr(g.grad_log_probs), ptr(g.grad_entropy)};
    });
  }
  static constexpr TokenLogProbsBackend backend() { return {&forward, &backward}; }
};

// (log_probs, entropy, stats): log_probs and entropy shaped like the target (entropy empty unless
// compute_entropy), stats (N, 5) for the backward (empty when row_stats were given: those are the backward's).
std::vector<at::Tensor> token_log_probs_forward(RowSource& src, const at::Tensor& target, double logits_scale_factor,
                                                bool compute_entropy, const std::optional<at::Tensor>& row_stats,
                                                const TokenLogProbsBackend& backend);

// Runs the gradient pass over the source (the gradient is the source's: src.grads()).
void token_log_probs_backward(RowSource& src, const at::Tensor& target, const at::Tensor& row_stats,
                              const std::optional<at::Tensor>& grad_log_probs,
                              const std::optional<at::Tensor>& grad_entropy, double logits_scale_factor,
                              const TokenLogProbsBackend& backend);

using TokenLogProbsT3 = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The registered ops of one back-end, from logits (the fused-linear ones: linear_token_log_probs.h).
template <const TokenLogProbsBackend& (*kBackend)()>
struct TokenLogProbsOps {
  using Opt = std::optional<at::Tensor>;
  static TokenLogProbsT3 forward(const at::Tensor& logits, const at::Tensor& target, double s, bool entropy,
                                 const Opt& stats, int64_t vs, int64_t vn) {
    LogitsSource src("token_log_probs", logits, target, vs, vn, false, false);
    auto o = token_log_probs_forward(src, target, s, entropy, stats, kBackend());
    return {o[0], o[1], o[2]};
  }
  static at::Tensor backward(const at::Tensor& logits, const at::Tensor& target, const at::Tensor& stats,
                             const Opt& grad_lp, const Opt& grad_h, double s, int64_t vs, int64_t vn) {
    LogitsSource src("token_log_probs", logits, target, vs, vn, true, false);
    token_log_probs_backward(src, target, stats, grad_lp, grad_h, s, kBackend());
    return src.grads()[0];
  }
};

}  // namespace rl_losses
