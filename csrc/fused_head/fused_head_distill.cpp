#include "fused_head/fused_head_distill.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>

#include "common/checks.h"

namespace rl_losses {

FusedHeadDistillRows fused_head_distill_state(const char* op, const FlatLogits& f, const at::Tensor& target,
                                              const FusedHeadArgs& a) {
  TORCH_CHECK(a.teacher_logits.has_value(), op, ": distillation_weight = ", a.distillation_weight,
              " > 0 needs teacher_logits");
  // The logits' own shape (the batch dims of the target, then V), for the teacher's and the mask's checks.
  const at::Tensor logits = target.dim() == 0 ? f.logits2d.select(0, 0) : f.logits2d.unflatten(0, target.sizes());
  FusedHeadDistillRows d;
  d.state = distill_term_state(op, {logits, *a.teacher_logits, a.kind, a.distillation_beta, a.temperature,
                                    a.logits_scale_factor, a.distillation_mask, a.distillation_divisor,
                                    "distillation_beta", "distillation_mask"});
  d.weight = a.distillation_weight;
  d.state.head_coef = at::empty({f.n_rows, kDistHeadFields}, d.state.stats.options());
  d.state.head_labels = f.target1d;
  return d;
}

void fused_head_distill_rows(RowSource& src, FusedHeadRows& rows, FusedHeadDistillRows& d, double scale,
                             bool smoothing, const FusedHeadBackend& backend) {
  const FlatLogits& f = src.flat();
  const DistillBackend& distill = backend.distill();
  DistillState& s = d.state;
  const at::ScalarType acc = s.stats.scalar_type();
  src.run(make_row_pass_args(f, scale), src.wants_grad(), [&](RowPassArgs& pa) {
    s.logits = pa.logits;
    // Read before the passes: with inplace_backward the gradient pass writes over the logits.
    d.label_logit = pa.logits.gather(1, f.target1d.clamp_min(0).unsqueeze(1)).squeeze(1).to(acc).mul(scale);
    if (smoothing) d.sum_x = at::sum(pa.logits, {1}, false, acc).mul(scale);
    if (pa.grad.defined()) {
      // The passes write each row's gradient unscaled (no fp16 row pre-scaling): a factor of 1 for every row.
      if (pa.grad_row_unscale.defined()) pa.grad_row_unscale.fill_(1.0);
      s.grad = pa.grad;
      // One pass where the back-end has it (CUDA's cluster kernel): both rows read once, every term on chip.
      if (backend.distill_fused != nullptr && backend.distill_fused(rows, d)) return;
    }
    // Every row's statistics: a row the distillation mask leaves out still has the other terms' (its teacher's
    // fields are read by no one).
    DistillState every_row = s;
    every_row.mask = at::Tensor();
    distill.stats(every_row);
    if (s.opt.kind == DistillKind::kJsd) distill.jsd_sums(s);
    backend.distill_step(rows, d);
    if (s.grad.defined()) distill.grad(s);
  });
}

}  // namespace rl_losses
