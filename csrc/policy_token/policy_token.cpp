// policy_token_loss: schema, checks and the CPU kernel (the CUDA one is policy_token_cuda.cu).
#include "policy_token/policy_token.h"

#include <ATen/Parallel.h>
#include <ATen/Dispatch.h>
#include <c10/core/DeviceGuard.h>
#include <torch/library.h>

#include <string>

#include "common/checks.h"

namespace rl_losses {

std::vector<at::Tensor> policy_token_loss(const at::Tensor& log_probs, const std::optional<at::Tensor>& old_log_probs,
                                          const at::Tensor& advantages, double epsilon_low, double epsilon_high,
                                          std::optional<double> delta, const std::optional<at::Tensor>& ref_log_probs,
                                          double beta, c10::string_view loss_type, double sapo_temperature_pos,
                                          double sapo_temperature_neg,
                                          const std::optional<at::Tensor>& rollout_log_probs,
                                          std::optional<c10::string_view> rollout_correction, double rollout_cap,
                                          std::optional<c10::ArrayRef<double>> rollout_mask_bounds,
                                          c10::string_view kl_estimator, bool kl_importance_weighted,
                                          const std::optional<at::Tensor>& loss_mask, PolicyTokenKernel kernel) {
  const char* op = "policy_token_loss";
  const c10::OptionalDeviceGuard guard(log_probs.device());  // the kernel launches on log_probs' device
  TORCH_CHECK(at::isFloatingType(log_probs.scalar_type()), op, ": log_probs must be a floating-point tensor, got ",
              log_probs.scalar_type());
  check_epsilons(op, epsilon_low, epsilon_high);
  check_delta(op, delta, epsilon_high);
  check_beta(op, beta, ref_log_probs.has_value());
  // Loss types whose token loss depends on the rest of its sequence are the fused ops' alone: named here, so
  // that a loss type added to the shared options is not taken elementwise unless it is elementwise.
  TORCH_CHECK(loss_type == "ppo_clip" || loss_type == "cispo" || loss_type == "sapo", op,
              ": loss_type must be 'ppo_clip', 'cispo' or 'sapo' (sequence-level loss types are the fused ops'), "
              "got '", std::string(loss_type), "'");
  // The sequence-level modes need every token of a sequence: the fused ops have them, an elementwise op not.
  TORCH_CHECK(!rollout_correction || std::string(*rollout_correction).rfind("sequence_", 0) != 0, op,
              ": rollout_correction must be None, 'token_truncate' or 'token_mask' (the sequence-level modes are the "
              "fused ops'), got '", std::string(*rollout_correction), "'");
  const PolicyArgs args = policy_args(loss_type, sapo_temperature_pos, sapo_temperature_neg, rollout_correction,
                                      rollout_cap, rollout_mask_bounds, kl_estimator, kl_importance_weighted,
                                      /*entropy_coefficient=*/0.0, /*vespo (refused above): TRL's defaults*/ 2.0, 3.0,
                                      3.0, 2.0);
  PolicyTokenInputs in;
  in.opt = make_policy_options(op, args, epsilon_low, epsilon_high, delta, beta, rollout_log_probs.has_value());
  const auto acc = log_probs.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // check_per_token compares shapes and devices with its reference tensor: here the log-probs.
  in.log_probs = log_probs.reshape({-1}).to(acc).contiguous();
  if (old_log_probs) in.old_log_probs = check_per_token(op, "old_log_probs", *old_log_probs, log_probs, acc);
  in.advantages = check_per_token(op, "advantages", broadcast_per_sequence(op, "advantages", advantages, log_probs),
                                  log_probs, acc);
  if (ref_log_probs) in.ref_log_probs = check_per_token(op, "ref_log_probs", *ref_log_probs, log_probs, acc);
  if (rollout_log_probs) {
    in.rollout_log_probs = check_per_token(op, "rollout_log_probs", *rollout_log_probs, log_probs, acc);
  }
  if (loss_mask) in.loss_mask = check_loss_mask(op, *loss_mask, log_probs, "log_probs", log_probs.sizes(), "shape");
  const auto opts = log_probs.options().dtype(acc);
  for (int k = 0; k < kPolicyTokenOutputs; ++k) in.out.push_back(at::empty(log_probs.sizes(), opts));
  if (log_probs.numel() > 0) kernel(in);
  return in.out;
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

// A fragment of its own: the op is not a row pass and shares no schema macro with the fused ones.
TORCH_LIBRARY_FRAGMENT(rl_losses, m) {
  // Per-token policy loss ℓ_t and ∂ℓ_t/∂lp_t from per-token log-probs (the fused ops' per-token math, without the
  // logits): (loss, grad_log_probs, ratio, clipped_low, clipped_high, kl, rollout_weight), each shaped like
  // log_probs, float32 (float64 for float64 log-probs); all 0 where loss_mask is 0 (no input read there).
  // Aggregation is the caller's. Every tensor argument is positional: torch.library.register_autograd
  // (python/rl_losses/policy_token.py) needs it so.
  m.def(
      "policy_token_loss(Tensor log_probs, Tensor? old_log_probs, Tensor advantages, Tensor? ref_log_probs=None, "
      "Tensor? rollout_log_probs=None, Tensor? loss_mask=None, *, float epsilon_low=0.2, float epsilon_high=0.2, "
      "float? delta=None, float beta=0.0, str loss_type=\"ppo_clip\", float sapo_temperature_pos=1.0, "
      "float sapo_temperature_neg=1.05, str? rollout_correction=None, float rollout_cap=3.0, "
      "float[]? rollout_mask_bounds=None, str kl_estimator=\"k3\", bool kl_importance_weighted=False) -> "
      "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rl_losses, CPU, m) { m.impl("policy_token_loss", &policy_token_op<&policy_token_cpu>); }

}  // namespace rl_losses
