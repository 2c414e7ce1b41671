// The registered forward ops of the fused lm_head (linear_source.h): each loss's shared forward run over a
// LinearSource. A back-end's registration binds its row functions and its LinearBackend (GEMMs).
#pragma once

#include <array>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "cross_entropy/cross_entropy.h"
#include "grpo/grpo.h"
#include "gspo/gspo.h"
#include "linear/linear_source.h"

namespace rl_losses {

namespace linear_detail {

template <size_t... I>
auto as_tuple(const std::vector<at::Tensor>& v, std::index_sequence<I...>) {
  return std::make_tuple(v[I]...);
}

// The op's outputs followed by grad_hidden, grad_weight, grad_bias, as the schema's tuple of N tensors.
template <size_t N>
auto with_grads(std::vector<at::Tensor> out, LinearSource& src) {
  for (auto& g : src.grads()) out.push_back(std::move(g));
  TORCH_INTERNAL_ASSERT(out.size() == N);
  return as_tuple(out, std::make_index_sequence<N>{});
}

using Opt = std::optional<at::Tensor>;

// The schema's chunk_size, strategy, weight_main_grad, skip_unlabelled (registration.cpp: RL_LOSSES_LINEAR_ARGS).
inline LinearOptions options(std::optional<int64_t> chunk, c10::string_view strategy, const Opt& main_grad, bool skip) {
  return {chunk, strategy, main_grad, skip};
}

}  // namespace linear_detail

template <CrossEntropyBackend kBackend, const LinearBackend& (*kLinear)()>
struct LinearCrossEntropyOp {
  using Opt = linear_detail::Opt;
  static auto forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target, const Opt& bias,
                      double s, double eps, double z, double lw, c10::string_view reduction,
                      std::optional<double> d, std::optional<int64_t> chunk, c10::string_view strategy,
                      const Opt& main_grad, bool skip, std::array<bool, 3> mask) {
    constexpr const char* op = "linear_cross_entropy";
    LinearSource src(op, hidden, weight, bias, target, linear_detail::options(chunk, strategy, main_grad, skip), mask,
                     kLinear());
    // The weight gradient is summed over tokens in the forward, so one upstream value per token cannot be
    // applied afterwards.
    TORCH_CHECK(reduction != "none" || !src.wants_grad(), op,
                ": reduction='none' cannot be differentiated (the weight gradient is summed over tokens in the "
                "forward); use 'sum' or 'mean', or call it without gradients");
    auto [loss, lse] = cross_entropy_forward(src, target, s, eps, z, lw, std::string(reduction), d, std::nullopt,
                                             kBackend);
    return linear_detail::with_grads<5>({loss, lse}, src);
  }
};

template <const GrpoBackend& (*kBackend)(), const LinearBackend& (*kLinear)()>
struct LinearGrpoOp {
  using Opt = linear_detail::Opt;
  using SV = c10::string_view;
  static auto forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                      const at::Tensor& adv, const Opt& old, const Opt& bias, const Opt& ref, const Opt& w,
                      const Opt& counts, double el, double eh, std::optional<double> delta, double beta,
                      std::optional<double> d, double s, bool entropy, std::optional<int64_t> chunk, SV strategy,
                      const Opt& main_grad, bool skip, SV loss_type, double tau_pos, double tau_neg,
                      const Opt& rollout, std::optional<SV> correction,
                      double cap, std::optional<c10::ArrayRef<double>> bounds, SV kl, bool kl_iw, double ent_coef,
                      double kp, double lamp, double kn, double lamn, const Opt& doc, std::optional<int64_t> n_docs,
                      std::array<bool, 3> mask) {
    LinearSource src("linear_grpo", hidden, weight, bias, target,
                     linear_detail::options(chunk, strategy, main_grad, skip), mask, kLinear());
    auto out = grpo_forward(src, target, adv, old, ref, w, counts, el, eh, delta, beta, d, s, entropy, std::nullopt,
                            rollout, doc, n_docs,
                            policy_args(loss_type, tau_pos, tau_neg, correction, cap, bounds, kl, kl_iw, ent_coef, kp,
                                        lamp, kn, lamn),
                            kBackend());
    return linear_detail::with_grads<kPolicyOutputs + 3>(std::move(out), src);
  }
};

template <const GspoBackend& (*kBackend)(), const LinearBackend& (*kLinear)()>
struct LinearGspoOp {
  using Opt = linear_detail::Opt;
  using SV = c10::string_view;
  static auto forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target,
                      const at::Tensor& adv, const Opt& old, const at::Tensor& doc, const Opt& bias,
                      std::optional<int64_t> n_docs, const Opt& counts, double el, double eh,
                      std::optional<double> delta, SV weighting, bool token_adv, std::optional<double> d, double s,
                      bool entropy, std::optional<int64_t> chunk, SV strategy, const Opt& main_grad, bool skip,
                      const Opt& ref, double beta, SV loss_type, double tau_pos, double tau_neg, const Opt& rollout,
                      std::optional<SV> correction, double cap, std::optional<c10::ArrayRef<double>> bounds, SV kl,
                      bool kl_iw, double ent_coef, double kp, double lamp, double kn, double lamn,
                      std::array<bool, 3> mask) {
    LinearSource src("linear_gspo", hidden, weight, bias, target,
                     linear_detail::options(chunk, strategy, main_grad, skip), mask, kLinear());
    const GspoPolicyInputs p{ref, beta, rollout,
                             policy_args(loss_type, tau_pos, tau_neg, correction, cap, bounds, kl, kl_iw, ent_coef, kp,
                                         lamp, kn, lamn), delta};
    auto out = gspo_forward(src, target, adv, old, doc, n_docs, counts, el, eh, std::string(weighting), token_adv, d,
                            s, entropy, std::nullopt, std::nullopt, p, kBackend());
    return linear_detail::with_grads<kPolicyOutputs + 4>(std::move(out), src);
  }
};

}  // namespace rl_losses
