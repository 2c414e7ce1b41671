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

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/row_pass.h"
#include "common/row_source.h"
#include "linear/linear_source.h"
#include "op_args.h"

namespace rl_losses {

// Forward: statistics → lp, H (when asked) and the statistics (when computed here, not given).
template <typename acc_t>
struct TokenLogProbsEpilogue {
  static constexpr bool kMayUseEntropy = true, kMayUseSmoothing = false, kMayUseEntropyGrad = false;
  static constexpr bool kMayReadStats = true, kMayWriteGrad = false;
  static constexpr bool kSkipsUnlabelled = false;  // the entropy of an unlabelled row is still an output
  static constexpr bool kMaySample = true;
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
  static constexpr bool kSkipsUnlabelled = false, kMaySample = true;
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

// token_log_probs' options and the results of its forward ops (op_args.h).
RL_LOSSES_ARG_GROUP(TokenLogProbsOwnArgs, RL_LOSSES_TOKEN_LOG_PROBS_KEYWORDS)
struct TokenLogProbsArgs : TokenLogProbsOwnArgs {
  SamplerArgs sampler;
  void read(schema::Args& args) {
    TokenLogProbsOwnArgs::read(args);
    sampler.read(args);
  }
};
RL_LOSSES_ARG_GROUP(ScaleArg, RL_LOSSES_SCALE)  // the backward ops' one option
RL_LOSSES_RESULT_GROUP(TokenLogProbsResults, RL_LOSSES_TOKEN_LOG_PROBS_RESULTS)
#define RL_LOSSES_TOKEN_LOG_PROBS_FORWARD(X) RL_LOSSES_TOKEN_LOG_PROBS_RESULTS(X) RL_LOSSES_STATS_RESULT(X)
RL_LOSSES_RESULT_GROUP(TokenLogProbsForward, RL_LOSSES_TOKEN_LOG_PROBS_FORWARD)
RL_LOSSES_ARG_GROUP(TokenLogProbsUpstream, RL_LOSSES_TOKEN_LOG_PROBS_UPSTREAM)

// log_probs and entropy shaped like the target (entropy empty unless compute_entropy), stats (N, 5) for the
// backward (empty when row_stats were given: those are the backward's).
TokenLogProbsForward token_log_probs_forward(RowSource& src, const at::Tensor& target, const TokenLogProbsArgs& a,
                                             const OptTensor& row_stats, const TokenLogProbsBackend& backend);

// Runs the gradient pass over the source (the gradient is the source's: src.grads()).
void token_log_probs_backward(RowSource& src, const at::Tensor& target, const TokenLogProbsUpstream& upstream,
                              double logits_scale_factor, const SamplerArgs& sampler,
                              const TokenLogProbsBackend& backend);

// The registered kernels of one back-end (boxed, arguments by name: common/schema.h), from logits and from the
// fused lm_head's hidden states (logits = hidden @ weight.T (+ bias) a chunk at a time; the backward, which
// needs the upstream gradients, computes each chunk's logits again).
template <const TokenLogProbsBackend& (*kBackend)()>
struct TokenLogProbsKernels {
  static void forward(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    schema::Args args(op, stack);
    const auto in = args.read<LogitsInput>();
    const auto shard = args.read<VocabShard>();
    LogitsSource src("token_log_probs", in.logits, in.target, shard.vocab_start, shard.vocab_size, false, false);
    token_log_probs_forward(src, in.target, args.read<TokenLogProbsArgs>(), args.read<RowStatsArg>().row_stats,
                            kBackend())
        .write(args);
    args.push_results();
  }
  static void backward(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    schema::Args args(op, stack);
    const auto in = args.read<LogitsInput>();
    const auto shard = args.read<VocabShard>();
    LogitsSource src("token_log_probs", in.logits, in.target, shard.vocab_start, shard.vocab_size, true, false);
    token_log_probs_backward(src, in.target, args.read<TokenLogProbsUpstream>(),
                             args.read<ScaleArg>().logits_scale_factor, args.read<SamplerArgs>(), kBackend());
    GradResult{src.grads()[0]}.write(args);
    args.push_results();
  }
  // Rows without a label may be left out (skip_unlabelled) only where nothing of theirs is asked for: their log-prob
  // is 0, but their entropy, when computed (forward) or differentiated (backward), needs their logits (False then).
  // The forward computes no gradient: weight_main_grad is only checked there (the backward adds into it).
  template <const LinearBackend& (*kLinear)()>
  static void linear_forward(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    schema::Args args(op, stack);
    const auto in = args.read<LinearInput>();
    const auto a = args.read<TokenLogProbsArgs>();
    auto linear = args.read<LinearOptions>();
    if (a.compute_entropy) linear.skip_unlabelled = false;
    LinearSource src("linear_token_log_probs", in.hidden, in.weight, linear.bias, in.target, linear,
                     {false, false, false}, kLinear());
    token_log_probs_forward(src, in.target, a, std::nullopt, kBackend()).write(args);
    args.push_results();
  }
  template <const LinearBackend& (*kLinear)()>
  static void linear_backward(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    schema::Args args(op, stack);
    const auto in = args.read<LinearInput>();
    const auto upstream = args.read<TokenLogProbsUpstream>();
    auto linear = args.read<LinearOptions>();
    if (upstream.grad_entropy) linear.skip_unlabelled = false;
    LinearSource src("linear_token_log_probs", in.hidden, in.weight, linear.bias, in.target, linear,
                     args.read<OutputMaskArg>().output_mask, kLinear());
    if (src.wants_grad()) {
      token_log_probs_backward(src, in.target, upstream, args.read<ScaleArg>().logits_scale_factor,
                               args.read<SamplerArgs>(), kBackend());
    }
    const auto g = src.grads();
    LinearGradResults{g[0], g[1], g[2]}.write(args);
    args.push_results();
  }
};

}  // namespace rl_losses
