// grpo's clip_cov / kl_cov with one read of the logits (docs/policy_losses.md, "Passes over the logits"): the loss
// pass runs first with no token selected, its log-probs give the subset (cov_selection), and the rows that may hold
// a selected token run the same pass again, a sub-batch of at most cov_subset_bound rows (3 at N = 16384 with
// verl's ratio 2e-4), whose results replace the first pass's on the selected tokens only. The fused lm_head, whose
// chunks' gradients are consumed chunk by chunk, redoes those rows itself (grpo_cov_revisit: a RowRevisit).
#include "grpo/grpo.h"

#include <utility>

namespace rl_losses {

void grpo_cov_fix_up(const RowPassArgs& a, GrpoRows& rows, const PolicyArgs& policy, const at::Tensor& mask,
                     const GrpoBackend& backend) {
  TORCH_INTERNAL_ASSERT(a.row_offset == 0 && !a.row_index.defined() && !a.stats_out.defined(),
                        "rl_losses: the clip_cov / kl_cov fix-up needs a pass over the whole batch");
  // Every selected token is among sel.first, the `bound` of lowest rank: the sub-batch is sized on the host, so
  // nothing here waits for the device (a CUDA graph captures the call).
  const at::Tensor& old = rows.old_log_probs.defined() ? rows.old_log_probs : rows.log_probs;  // on-policy: ℓ
  const CovSelection sel = cov_selection(policy, rows.opt, rows.log_probs, old, rows.advantages, mask);
  const int64_t bound = sel.first.numel();
  const at::TensorOptions acc = rows.out.options();
  GrpoRows sub = rows;  // the options, the divisor; the per-row tensors the sub-batch's own
  for (at::Tensor* t : grpo_row_inputs(sub)) {
    if (t->defined()) *t = new_empty({bound}, acc);  // undefined stays so: it switches a term off
  }
  sub.cov_selected = new_empty({bound}, acc.dtype(at::kBool));
  sub.out = new_empty({bound, kGrpoFields}, acc);
  sub.log_probs = new_empty({bound}, acc);

  RowPassArgs s = a;  // the first pass's rows as it saw them (statistics, floors), gathered
  s.logits = new_empty({bound, a.logits.size(1)}, a.logits.options());
  s.target = new_empty({bound}, a.target.options());
  for (at::Tensor* t : {&s.stats_in, &s.sampler_params, &s.logit_floor}) {
    if (t->defined()) *t = t->index_select(0, sel.first);  // tensor parallelism, the split pass, the sampler
  }
  if (a.write_grad()) s.grad = new_empty({bound, a.grad.size(1)}, a.grad.options());
  if (a.grad_row_unscale.defined()) s.grad_row_unscale = new_empty({bound}, a.grad_row_unscale.options());

  const GrpoCovRows c{sel.first, sel.selected, a, rows, s, sub};
  backend.cov_gather(c);
  split_stats_pass_on_cuda(s);
  backend.rows(s, sub);
  backend.cov_write_back(c);
  rows.cov_selected = sel.selected;
}

RowRevisit grpo_cov_revisit(GrpoRows& rows, const PolicyArgs& policy, const at::Tensor& mask,
                            const GrpoBackend& backend) {
  RowRevisit r;
  r.select = [&rows, &policy, mask] {
    const at::Tensor& old = rows.old_log_probs.defined() ? rows.old_log_probs : rows.log_probs;  // on-policy: ℓ
    const CovSelection sel = cov_selection(policy, rows.opt, rows.log_probs, old, rows.advantages, mask);
    rows.cov_selected = sel.selected;
    return std::make_pair(sel.first, sel.selected.index_select(0, sel.first));
  };
  r.pass = [&rows, &backend](RowPassArgs& a, bool changed) {
    GrpoRows sub = rows;  // the per-row arrays the batch's: the sub-batch indexes them by row_index
    if (!changed) sub.cov_selected = at::Tensor();
    split_stats_pass_on_cuda(a);
    backend.rows(a, sub);
  };
  return r;
}

}  // namespace rl_losses
