// clip_cov's and kl_cov's token selection (common/policy.h: cov_selection) on each token's log-prob (grpo: from its
// loss pass, or from a statistics pass before it where a pass cannot be redone, grpo.cpp); the steps are
// common/policy_cov.h's, on the tensors' device. Every count stays on the device (k is computed there, the subset
// the first k of an order), so the call neither waits for the device nor depends on a size the host reads: a CUDA
// graph can capture it.
#include <ATen/ops/empty.h>
#include <ATen/ops/rand.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>

#include "common/cuda_backends.h"
#include "common/policy_cov.h"

namespace rl_losses {

int64_t cov_subset_bound(const PolicyArgs& a, const PolicyOptions<double>& o, int64_t n_tokens) {
  if (n_tokens == 0) return 0;
  // k = max(⌊ratio·n⌋, 1) with n = n_tokens: a product by ratio > 0 and its floor, each rounded monotonically in
  // float64, so that k <= this bound for every masked-in count n <= n_tokens.
  const double ratio = o.loss_type == kKlCov ? a.kl_cov_ratio : a.clip_cov_ratio;
  const double k = std::max(std::floor(static_cast<double>(n_tokens) * ratio), 1.0);
  return k >= static_cast<double>(n_tokens) ? n_tokens : static_cast<int64_t>(k);
}

CovSelection cov_selection(const PolicyArgs& a, const PolicyOptions<double>& o, const at::Tensor& log_probs,
                           const at::Tensor& old_log_probs, const at::Tensor& advantages, const at::Tensor& mask) {
  const int64_t n = mask.numel();
  CovSelectArgs s;
  s.kl = o.loss_type == kKlCov;
  s.ratio = s.kl ? a.kl_cov_ratio : a.clip_cov_ratio;
  s.eps_low = o.clip.epsilon_low;
  s.eps_high = o.clip.epsilon_high;
  s.lb = a.clip_cov_lb;
  s.ub = a.clip_cov_ub;
  s.log_probs = log_probs.contiguous();
  s.old_log_probs = old_log_probs.to(log_probs.scalar_type()).contiguous();
  s.advantages = advantages.to(log_probs.scalar_type()).contiguous();
  s.mask = mask.to(at::kBool).contiguous();
  // clip_cov's uniformly random k-subset of its candidates (all of them if fewer), as verl's first k of
  // torch.randperm(#candidates): the k candidates of smallest key, the keys U(0, 1) in float64 drawn for every token
  // from the device's default generator (a CUDA graph replays it with fresh draws).
  if (!s.kl) s.draws = at::rand({n}, mask.options().dtype(at::kDouble));
  s.means = at::empty({3}, log_probs.options());
  s.selected = at::zeros({n}, mask.options().dtype(at::kBool));
  s.first = at::empty({cov_subset_bound(a, o, n)}, mask.options().dtype(at::kLong));
#ifdef RL_LOSSES_WITH_CUDA
  if (mask.is_cuda()) {
    cov_select_cuda(s);
    return {s.selected, s.first};
  }
#endif
  cov_select_cpu(s);
  return {s.selected, s.first};
}

}  // namespace rl_losses
