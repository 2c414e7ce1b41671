// The policy family's per-token loss on per-token log-probs (docs/integrations/verl.md): for trainers that
// compute the log-probs themselves (verl's policy-loss registry) and only need the loss of each token and its
// derivative w.r.t. the log-prob. Elementwise (clip_cov and kl_cov after their subset of the whole call,
// cov_selection): the same policy_token() (common/math.h) the fused GRPO epilogue evaluates per row, so the two
// cannot disagree.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "common/math.h"
#include "common/policy.h"
#include "op_args.h"

namespace rl_losses {

// The op's per-token results (PolicyTokenResults names them).
enum PolicyTokenOutput : int {
  kPtLoss = 0,      // ℓ_t: the surrogate (times the rollout weight) + β·KL_t
  kPtGrad,          // ∂ℓ_t/∂lp_t
  kPtRatio,         // r_t = exp(lp_t − old_t)
  kPtLow,           // 1 where the ratio is clipped below (ppo_clip) or outside dppo's region with A <= 0, else 0
  kPtHigh,          // 1 where clipped above (ppo_clip), capped (cispo), outside dppo's region with A > 0 or in
                    // clip_cov's subset, else 0
  kPtKl,            // KL_t (importance weighted when asked), 0 without ref_log_probs
  kPtRolloutWeight, // ω_t, 1 without a rollout correction
  kPolicyTokenOutputs
};

template <typename T>
struct PolicyTokenPtrs {
  const T* log_probs;
  const T* old_log_probs;      // null: on-policy (old = sg(lp))
  const T* advantages;
  const T* ref_log_probs;      // null without a reference
  const T* rollout_log_probs;  // null without a rollout correction
  const bool* loss_mask;       // null: every position counts
  const bool* cov_selected;    // clip_cov / kl_cov: the token is in the subset (cov_selection), else null
  T* out[kPolicyTokenOutputs];
};

template <typename T>
C10_HOST_DEVICE inline void policy_token_at(const PolicyOptions<T>& o, const PolicyTokenPtrs<T>& p, int64_t i) {
  if (p.loss_mask != nullptr && !p.loss_mask[i]) {  // a masked position: no input read (padding may hold NaN)
    for (int k = 0; k < kPolicyTokenOutputs; ++k) p.out[k][i] = T(0);
    return;
  }
  const T lp = p.log_probs[i];
  const T old = p.old_log_probs != nullptr ? p.old_log_probs[i] : lp;
  const T adv = p.advantages[i];
  const T rw = rollout_weight(o, p.rollout_log_probs != nullptr ? old - p.rollout_log_probs[i] : T(0));
  const bool has_ref = p.ref_log_probs != nullptr;
  const PolicyTokenTerms<T> t = policy_token(o, lp, old, adv, has_ref, has_ref ? p.ref_log_probs[i] : T(0), rw, T(1),
                                             p.cov_selected != nullptr && p.cov_selected[i]);
  p.out[kPtLoss][i] = t.t.loss;
  p.out[kPtGrad][i] = -t.t.coef;  // coef is −∂ℓ/∂lp (the logits' gradient is coef·(p − onehot))
  p.out[kPtRatio][i] = t.t.ratio;
  p.out[kPtLow][i] = t.clipped_low ? T(1) : T(0);
  p.out[kPtHigh][i] = t.clipped_high ? T(1) : T(0);
  p.out[kPtKl][i] = t.kl;
  p.out[kPtRolloutWeight][i] = rw;
}

// The validated inputs, flattened and in the working dtype (float32, float64 for float64 log-probs).
struct PolicyTokenInputs {
  PolicyOptions<double> opt;
  at::Tensor log_probs, old_log_probs, advantages, ref_log_probs, rollout_log_probs;  // undefined: not given
  at::Tensor loss_mask;                                                                // bool, or undefined
  at::Tensor cov_selected;                                             // bool, clip_cov / kl_cov only
  std::vector<at::Tensor> out;                                                         // kPolicyTokenOutputs
};

template <typename T>
PolicyTokenPtrs<T> policy_token_ptrs(const PolicyTokenInputs& in) {
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<T>() : nullptr; };
  auto flags = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<bool>() : nullptr; };
  PolicyTokenPtrs<T> p{ptr(in.log_probs), ptr(in.old_log_probs), ptr(in.advantages), ptr(in.ref_log_probs),
                       ptr(in.rollout_log_probs), flags(in.loss_mask), flags(in.cov_selected), {}};
  for (int k = 0; k < kPolicyTokenOutputs; ++k) p.out[k] = in.out[k].data_ptr<T>();
  return p;
}

using PolicyTokenKernel = void (*)(const PolicyTokenInputs&);

// policy_token_loss' arguments (op_args.h).
#define RL_LOSSES_POLICY_TOKEN_ARGS(X) \
  RL_LOSSES_POLICY_TOKEN_INPUT(X) RL_LOSSES_POLICY_TENSORS(X) RL_LOSSES_POLICY_TOKEN_MASK(X) RL_LOSSES_KL_WEIGHT(X)
RL_LOSSES_ARG_GROUP(PolicyTokenOwnArgs, RL_LOSSES_POLICY_TOKEN_ARGS)
struct PolicyTokenArgs : PolicyTokenOwnArgs {
  ClipArgs clip;
  PolicyArgs policy;
  void read(schema::Args& args) {
    PolicyTokenOwnArgs::read(args);
    clip.read(args);
    policy.read(args);
  }
};
RL_LOSSES_RESULT_GROUP(PolicyTokenResults, RL_LOSSES_POLICY_TOKEN_RESULTS)

PolicyTokenResults policy_token_loss(const PolicyTokenArgs& a, PolicyTokenKernel kernel);

// The op's kernel over one device's elementwise kernel (the CPU and CUDA registrations).
template <PolicyTokenKernel kKernel>
void policy_token_op(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  schema::Args args(op, stack);
  policy_token_loss(args.read<PolicyTokenArgs>(), kKernel).write(args);
  args.push_results();
}

}  // namespace rl_losses
