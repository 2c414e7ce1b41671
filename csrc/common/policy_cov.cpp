// clip_cov's and kl_cov's token selection (common/policy.h: cov_selection): O(N) steps on (N,) vectors in ATen
// ops, the same on every device, between the statistics pass that gives each token's log-prob and the loss pass
// that reads the flags.
#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/policy.h"

namespace rl_losses {

at::Tensor cov_selection(const PolicyArgs& a, const PolicyOptions<double>& o, const at::Tensor& log_probs,
                         const at::Tensor& old_log_probs, const at::Tensor& advantages, const at::Tensor& mask) {
  at::Tensor selected = at::zeros(mask.sizes(), mask.options());
  const int64_t n = mask.sum().item<int64_t>();
  if (n == 0) return selected;
  // Where m = 0 nothing is read: the padding may hold NaN.
  const at::Tensor zero = at::zeros({}, log_probs.options());
  const at::Tensor lp = at::where(mask, log_probs, zero);
  const at::Tensor adv = at::where(mask, advantages, zero);
  const at::Tensor cov = (adv - adv.sum() / double(n)) * (lp - lp.sum() / double(n));
  if (o.loss_type == kKlCov) {
    const int64_t k = std::max<int64_t>(static_cast<int64_t>(a.kl_cov_ratio * double(n)), 1);
    const at::Tensor ranked = at::where(mask, cov, -std::numeric_limits<double>::infinity());
    return selected.index_fill_(0, std::get<1>(ranked.topk(k)), true);
  }
  // clip_cov's candidates: the tokens the PPO clip leaves alone (verl's ~clip_by_origin, in its own form) inside
  // the covariance band.
  const at::Tensor ratio = (lp - at::where(mask, old_log_probs, zero)).exp();
  const at::Tensor unclipped = -adv * ratio;
  const at::Tensor clipped = -adv * ratio.clamp(1.0 - o.clip.epsilon_low, 1.0 + o.clip.epsilon_high);
  const at::Tensor candidate = mask & clipped.gt(unclipped).logical_not() & cov.gt(a.clip_cov_lb) &
                               cov.lt(a.clip_cov_ub);
  at::Tensor index = candidate.nonzero().squeeze(-1);
  const int64_t count = index.size(0);
  if (count == 0) return selected;
  const int64_t k = std::max<int64_t>(static_cast<int64_t>(a.clip_cov_ratio * double(n)), 1);
  const at::Tensor perm = at::randperm(count, at::TensorOptions().dtype(at::kLong));  // verl's torch.randperm(count)
  index = index.index_select(0, perm.slice(0, 0, std::min(k, count)).to(index.device()));
  return selected.index_fill_(0, index, true);
}

}  // namespace rl_losses
