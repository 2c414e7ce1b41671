// clip_cov's and kl_cov's token selection (common/policy.h: cov_selection): O(N log N) steps on (N,) vectors in ATen
// ops, the same on every device, on each token's log-prob (grpo: from its loss pass, or from a statistics pass
// before it where a pass cannot be redone, grpo.cpp). Every count stays on the device (k is a 0-dim tensor, the
// subset a rank below it), so the call neither waits for the device nor depends on a size the host reads: a CUDA
// graph can capture it.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common/policy.h"

namespace rl_losses {

namespace {

// Each token's place in the order of `keys` (0: first), ties in index order: one stable sort and a scatter. The
// first `n_first` tokens of that order go to *first.
at::Tensor rank_of(const at::Tensor& keys, bool descending, int64_t n_first, at::Tensor* first) {
  const at::Tensor order = std::get<1>(keys.sort(/*stable=*/true, /*dim=*/0, descending));
  if (first != nullptr) *first = order.narrow(0, 0, n_first);
  return at::empty_like(order).scatter_(0, order, at::arange(keys.numel(), order.options()));
}

// k = max(⌊ratio·n⌋, 1) (verl's int(ratio·n) of the masked-in count n), in float64 as the host's product was.
at::Tensor subset_size(double ratio, const at::Tensor& n) {
  return (n.to(at::kDouble) * ratio).floor().clamp_min(1);
}

}  // namespace

int64_t cov_subset_bound(const PolicyArgs& a, const PolicyOptions<double>& o, int64_t n_tokens) {
  if (n_tokens == 0) return 0;
  // subset_size's k with n = n_tokens: a product by ratio > 0 and its floor, each rounded monotonically in
  // float64, so that k <= this bound for every masked-in count n <= n_tokens.
  const double ratio = o.loss_type == kKlCov ? a.kl_cov_ratio : a.clip_cov_ratio;
  const double k = std::max(std::floor(static_cast<double>(n_tokens) * ratio), 1.0);
  return k >= static_cast<double>(n_tokens) ? n_tokens : static_cast<int64_t>(k);
}

CovSelection cov_selection(const PolicyArgs& a, const PolicyOptions<double>& o, const at::Tensor& log_probs,
                           const at::Tensor& old_log_probs, const at::Tensor& advantages, const at::Tensor& mask,
                           int64_t n_first) {
  CovSelection r;
  at::Tensor* first = n_first > 0 ? &r.first : nullptr;
  const at::Tensor n = mask.sum();  // int64, 0-dim on the device
  // Where m = 0 nothing is read: the padding may hold NaN. (Without a token, the means are 0/1 and nothing is
  // selected: every rank test below is and-ed with the mask.)
  const at::Tensor zero = at::zeros({}, log_probs.options());
  const at::Tensor lp = at::where(mask, log_probs, zero);
  const at::Tensor adv = at::where(mask, advantages, zero);
  const at::Tensor count = n.clamp_min(1).to(log_probs.scalar_type());
  const at::Tensor cov = (adv - adv.sum() / count) * (lp - lp.sum() / count);
  if (o.loss_type == kKlCov) {
    // The k tokens of largest cov (verl's torch.topk; among equal values the first in index order).
    const at::Tensor ranked = at::where(mask, cov, -std::numeric_limits<double>::infinity());
    r.selected = mask & rank_of(ranked, /*descending=*/true, n_first, first).lt(subset_size(a.kl_cov_ratio, n));
    return r;
  }
  // clip_cov's candidates: the tokens the PPO clip leaves alone (verl's ~clip_by_origin, in its own form) inside
  // the covariance band.
  const at::Tensor ratio = (lp - at::where(mask, old_log_probs, zero)).exp();
  const at::Tensor unclipped = -adv * ratio;
  const at::Tensor clipped = -adv * ratio.clamp(1.0 - o.clip.epsilon_low, 1.0 + o.clip.epsilon_high);
  const at::Tensor candidate = mask & clipped.gt(unclipped).logical_not() & cov.gt(a.clip_cov_lb) &
                               cov.lt(a.clip_cov_ub);
  // A uniformly random k-subset of the candidates (all of them if fewer), as verl's first k of
  // torch.randperm(#candidates): the k candidates of smallest key, the keys U(0, 1) in float64 drawn for every
  // token from the device's default generator (a CUDA graph replays it with fresh draws), the other tokens' keys
  // set past every candidate's.
  const at::Tensor keys = at::rand({mask.numel()}, mask.options().dtype(at::kDouble));
  const at::Tensor placed = at::where(candidate, keys, 2.0);
  r.selected = candidate & rank_of(placed, /*descending=*/false, n_first, first).lt(subset_size(a.clip_cov_ratio, n));
  return r;
}

}  // namespace rl_losses
