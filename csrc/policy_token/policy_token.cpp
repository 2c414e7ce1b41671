// policy_token_loss: checks and the CPU kernel (the CUDA one is policy_token_cuda.cu, registered in
// cuda_registration.cpp).
#include "policy_token/policy_token.h"

#include <ATen/Dispatch.h>
#include <ATen/ops/ones.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/boxed_kernel.h"
#include "common/checks.h"

namespace rl_losses {

PolicyTokenResults policy_token_loss(const PolicyTokenArgs& a, PolicyTokenKernel kernel) {
  const char* op = "policy_token_loss";
  const at::Tensor& log_probs = a.log_probs;
  TORCH_CHECK(at::isFloatingType(log_probs.scalar_type()), op, ": log_probs must be a floating-point tensor, got ",
              log_probs.scalar_type());
  check_clip(op, a.clip, a.beta, a.ref_log_probs.has_value());
  // The sequence-level modes need every token of a sequence: the fused ops have them, an elementwise op not.
  TORCH_CHECK(!sequence_level_rollout(a.policy), op, ": rollout_correction must be None, 'token_truncate' or "
              "'token_mask' (the sequence-level modes are the fused ops'), got '", a.policy.rollout_correction.value_or(""),
              "'");
  PolicyTokenInputs in;
  in.opt = make_policy_options(op, a.policy, nullptr, &a.clip, a.beta, a.rollout_log_probs.has_value());
  // VESPO and GMPO read whole sequences; clip_cov and kl_cov the whole batch's statistics, which the op has (its
  // log-probs are every token's).
  TORCH_CHECK(!sequence_loss_type(in.opt.loss_type), op, ": loss_type '", a.policy.loss_type, "' weighs a token by the ",
              "rest of its sequence, which only the fused ops (grpo, gspo) read");
  const auto acc = acc_dtype(log_probs.scalar_type());
  // check_per_token compares shapes and devices with its reference tensor: here the log-probs.
  in.log_probs = flat_contiguous(log_probs, acc);
  if (a.old_log_probs) in.old_log_probs = check_per_token(op, "old_log_probs", *a.old_log_probs, log_probs, acc);
  in.advantages = check_per_token(op, "advantages", broadcast_per_sequence(a.advantages, log_probs), log_probs, acc);
  if (a.ref_log_probs) in.ref_log_probs = check_per_token(op, "ref_log_probs", *a.ref_log_probs, log_probs, acc);
  if (a.rollout_log_probs) {
    in.rollout_log_probs = check_per_token(op, "rollout_log_probs", *a.rollout_log_probs, log_probs, acc);
  }
  if (a.loss_mask) in.loss_mask = check_loss_mask(op, *a.loss_mask, log_probs, "log_probs", log_probs.sizes(), "shape");
  if (cov_loss_type(in.opt.loss_type)) {
    const at::Tensor every = at::ones({log_probs.numel()}, log_probs.options().dtype(at::kBool));
    const at::Tensor mask = in.loss_mask.defined() ? in.loss_mask : every;
    in.cov_selected = cov_selection(a.policy, in.opt, in.log_probs,
                                    in.old_log_probs.defined() ? in.old_log_probs : in.log_probs, in.advantages, mask)
                          .selected;
  }
  const auto opts = log_probs.options().dtype(acc);
  for (int k = 0; k < kPolicyTokenOutputs; ++k) in.out.push_back(new_empty(log_probs.sizes(), opts));
  if (log_probs.numel() > 0) kernel(in);
  PolicyTokenResults r;
  r.loss = in.out[kPtLoss];
  r.grad_log_probs = in.out[kPtGrad];
  r.ratio = in.out[kPtRatio];
  r.clipped_low = in.out[kPtLow];
  r.clipped_high = in.out[kPtHigh];
  r.kl = in.out[kPtKl];
  r.rollout_weight = in.out[kPtRolloutWeight];
  return r;
}

namespace {

void policy_token_cpu(const PolicyTokenInputs& in) {
  AT_DISPATCH_FLOATING_TYPES(in.log_probs.scalar_type(), "policy_token_loss", [&] {
    const PolicyOptions<scalar_t> o = policy_options_as<scalar_t>(in.opt);
    const PolicyTokenPtrs<scalar_t> p = policy_token_ptrs<scalar_t>(in);
    at::parallel_for(0, in.log_probs.numel(), 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) policy_token_at(o, p, i);
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) {
  m.impl("policy_token_loss", boxed<&policy_token_op<&policy_token_cpu>>());
}

}  // namespace rl_losses
