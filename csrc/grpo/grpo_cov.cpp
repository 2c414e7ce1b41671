// grpo's clip_cov / kl_cov with one read of the logits (docs/policy_losses.md, "Passes over the logits"): the loss
// pass runs first with no token selected, its log-probs give the subset (cov_selection), and the rows that may hold
// a selected token run the same pass again, a sub-batch of at most cov_subset_bound rows (3 at N = 16384 with
// verl's ratio 2e-4), whose results replace the first pass's on the selected tokens only.
#include "grpo/grpo.h"

namespace rl_losses {

namespace {

at::Tensor gather(const at::Tensor& t, const at::Tensor& index) { return t.defined() ? t.index_select(0, index) : t; }

// dst[index[i]] = src[i] where keep[i] (dim 0); the other rows of dst keep their bits.
void put_where(const at::Tensor& dst, const at::Tensor& index, const at::Tensor& keep, const at::Tensor& src) {
  const at::Tensor k = src.dim() > 1 ? keep.unsqueeze(1) : keep;
  dst.index_copy_(0, index, at::where(k, src, dst.index_select(0, index)));
}

}  // namespace

void grpo_cov_fix_up(const RowPassArgs& a, GrpoRows& rows, const PolicyArgs& policy, const at::Tensor& mask,
                     const GrpoBackend& backend) {
  // Every selected token is among the `bound` of lowest rank: the sub-batch is sized on the host, so nothing here
  // waits for the device (a CUDA graph captures the call).
  const int64_t bound = cov_subset_bound(policy, rows.opt, a.logits.size(0));
  const CovSelection sel =
      cov_selection(policy, rows.opt, rows.log_probs, rows.old_log_probs.defined() ? rows.old_log_probs : rows.log_probs,
                    rows.advantages, mask, bound);
  const at::Tensor& index = sel.first;
  GrpoRows sub = rows;
  for (at::Tensor* t : {&sub.advantages, &sub.old_log_probs, &sub.ref_log_probs, &sub.rollout_log_probs,
                        &sub.sequence_log_rho, &sub.loss_weights, &sub.vespo_phi, &sub.sequence_share}) {
    *t = gather(*t, index);
  }
  sub.cov_selected = sel.selected.index_select(0, index);
  sub.out = new_empty({bound, kGrpoFields}, rows.out.options());
  sub.log_probs = new_empty({bound}, rows.log_probs.options());

  RowPassArgs s = a;  // the first pass's rows, as that pass saw them (statistics, floors), gathered
  for (at::Tensor* t : {&s.logits, &s.target, &s.stats_in, &s.sampler_params, &s.logit_floor}) *t = gather(*t, index);
  if (a.write_grad()) s.grad = at::empty({bound, a.grad.size(1)}, a.grad.options());
  if (a.grad_row_unscale.defined()) s.grad_row_unscale = new_empty({bound}, a.grad_row_unscale.options());
  TORCH_INTERNAL_ASSERT(a.row_offset == 0 && !a.row_index.defined() && !a.stats_out.defined(),
                        "rl_losses: the clip_cov / kl_cov fix-up needs a pass over the whole batch");
  split_stats_pass_on_cuda(s);
  backend.rows(s, sub);

  const at::Tensor& keep = sub.cov_selected;
  put_where(rows.out, index, keep, sub.out);
  put_where(rows.log_probs, index, keep, sub.log_probs);
  if (a.write_grad()) put_where(a.grad, index, keep, s.grad);
  if (a.grad_row_unscale.defined()) put_where(a.grad_row_unscale, index, keep, s.grad_row_unscale);
  rows.cov_selected = sel.selected;
}

}  // namespace rl_losses
