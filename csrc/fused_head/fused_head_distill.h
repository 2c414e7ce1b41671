// The fused head's distillation term (docs/distillation_dpo.md): distillation_weight · the distillation op's loss
// against `teacher_logits`, beside the label CE, the z-loss and the GRPO term. The head then runs on
// distillation's passes, which read the student's row and the teacher's together, with one row step of every term
// (FusedHeadDistillStep: the distillation row step, distill_row, and the other terms by FusedHeadEpilogue itself,
// from the student's statistics): the gradient pass adds the other terms' a·Q_j + c + b·[j = label]
// (distill_head_grad) to distillation's, one gradient written once.
//   CUDA: distillation's cluster kernel with this step as its head (distillation_cluster.cuh), where it applies
//     and the teacher has the student's dtype: each row of both tensors read once, as distillation alone reads
//     them (the kernel then reads every row: the step applies the distillation mask);
//   otherwise (and on the CPU): the statistics pass, JSD's sums, the step over all rows, the gradient pass.
// The label's logit is gathered before the passes (one value a row) and, with label smoothing, Σx summed (one more
// read of the logits: the distillation statistics have no Σx).
//
// Not with the GSPO term (its per-document steps need a statistics pass of their own between) nor under tensor
// parallelism (the head's statistics and distillation's would need their all-reduce together): refused.
#pragma once

#include "common/row_source.h"
#include "distillation/distillation.h"
#include "fused_head/fused_head.h"

namespace rl_losses {

template <typename acc_t>
struct FusedHeadDistillStep {
  static constexpr bool kOn = true;  // a head of distillation's cluster kernel (distillation_cluster.cuh)
  FusedHeadEpilogue<acc_t> head;
  DistillOptions<acc_t> opt;
  acc_t weight;              // distillation_weight (> 0)
  const acc_t* stats;        // (N, 7) DistillStats
  const acc_t* jsd_sums;     // (N, 2), or null unless the kind is JSD
  const acc_t* mask;         // (N,) 0/1 distillation_mask, or null: every row
  const acc_t* divisor;      // 0-dim D of the distillation term, or null: divisor_value
  acc_t divisor_value;
  const acc_t* label_logit;  // (N,) s·z at the label (any finite value where unlabelled)
  const acc_t* sum_x;        // (N,) Σ s·z, or null: no label smoothing
  acc_t* table;              // (N, kDistGradFields): the gradient pass's, its weight times distillation_weight
  acc_t* coef;               // (N, kDistHeadFields): the other terms' (a, b, c)

  C10_HOST_DEVICE void operator()(int64_t i) const {
    const bool jsd = opt.kind == DistillKind::kJsd;
    row(i, DistillStats<acc_t>::load(stats + i * DistillStats<acc_t>::kFields), jsd ? jsd_sums[2 * i] : acc_t(0),
        jsd ? jsd_sums[2 * i + 1] : acc_t(0), head.out + i * kHeadTerms, head.log_probs + i,
        table + i * kDistGradFields, coef + i * kDistHeadFields);
  }

  // Row i from its statistics (and JSD's sums): every term's share into o[kHeadTerms] and *lp, the distillation
  // gradient table into t and the other terms' coefficients into h.
  C10_HOST_DEVICE void row(int64_t i, const DistillStats<acc_t>& ds, acc_t jsd_loss, acc_t jsd_s, acc_t* o,
                           acc_t* lp, acc_t* t, acc_t* h) const {
    others(i, ds, o, lp, h);  // sets every share, the distillation term's to 0: first
    o[kHeadDistill] = distill(i, ds, jsd_loss, jsd_s, t);
  }
  // The terms but distillation: their shares into o (o[kHeadDistill] = 0) and *lp, their coefficients into h.
  C10_HOST_DEVICE void others(int64_t i, const DistillStats<acc_t>& ds, acc_t* o, acc_t* lp, acc_t* h) const {
    const GradCoef<acc_t> g = head.terms(i, row_stats(i, ds), o, lp);
    h[kHeadCoefA] = g.a;
    h[kHeadCoefB] = g.b;
    h[kHeadCoefC] = g.c;
  }
  C10_HOST_DEVICE RowStats<acc_t> row_stats(int64_t i, const DistillStats<acc_t>& ds) const {
    return {ds.ms, ds.ss, acc_t(0), sum_x != nullptr ? sum_x[i] : acc_t(0), label_logit[i]};
  }
  // The distillation term: its gradient table into t; returns its share.
  C10_HOST_DEVICE acc_t distill(int64_t i, const DistillStats<acc_t>& ds, acc_t jsd_loss, acc_t jsd_s,
                                acc_t* t) const {
    const acc_t m = mask != nullptr ? mask[i] : acc_t(1);
    if (m == acc_t(0)) {  // the teacher's statistics are not read; the other terms still read Q (lse)
      t[kDistLseS] = ds.lse_student();
      t[kDistLseT] = t[kDistWeight] = t[kDistConst] = acc_t(0);
      return acc_t(0);
    }
    const DistillRowResult<acc_t> r = distill_row(opt, ds, jsd_loss, jsd_s, m / divisor_of(divisor, divisor_value));
    for (int k = 0; k < kDistGradFields; ++k) t[k] = r.table[k];
    t[kDistWeight] *= weight;
    return r.table[kDistWeight] * r.divergence;  // the term's share, unweighted (as the op's row_loss)
  }

  // The cluster kernel's calls, each in its own warp (cluster_others: one per part of the other terms) so that the
  // row, which every CTA's warps wait for, takes the longest of the chains rather than their sum. Outputs are
  // written where `write` (one CTA of the cluster); into locals first: no global store between the row's loads
  // (which may then be issued together). The kernel adds the parts' coefficients in order, as terms() does.
  static constexpr int kParts = kHeadParts;
  C10_HOST_DEVICE void cluster_others(int64_t i, const DistillStats<acc_t>& ds, bool write, acc_t* h, int part) const {
    acc_t o[kHeadTerms], lp;
    const GradCoef<acc_t> g = part == kHeadLabelPart ? head.template part<kHeadLabelPart>(i, row_stats(i, ds), o, &lp)
                                                     : head.template part<kHeadPolicyPart>(i, row_stats(i, ds), o, &lp);
    h[kHeadCoefA] = g.a;
    h[kHeadCoefB] = g.b;
    h[kHeadCoefC] = g.c;
    if (!write) return;
    if (part == kHeadLabelPart) {
      head.out[i * kHeadTerms + kHeadLabel] = o[kHeadLabel];
      head.out[i * kHeadTerms + kHeadZLoss] = o[kHeadZLoss];
      head.log_probs[i] = lp;
    } else {
      head.out[i * kHeadTerms + kHeadGrpo] = o[kHeadGrpo];
      head.out[i * kHeadTerms + kHeadGspo] = o[kHeadGspo];
    }
  }
  C10_HOST_DEVICE void cluster_distill(int64_t i, const DistillStats<acc_t>& ds, acc_t jsd_loss, acc_t jsd_s,
                                       bool write, acc_t* t) const {
    const acc_t d = distill(i, ds, jsd_loss, jsd_s, t);
    if (write) head.out[i * kHeadTerms + kHeadDistill] = d;
  }
  C10_HOST_DEVICE int64_t label(int64_t i) const { return head.labels[i]; }

#if defined(__CUDACC__)
  // The cluster kernel's hint at a row's start: its per-row inputs towards L1, so that cluster_others, which every
  // CTA's row waits for, finds them there. Pointers that are null (a term off) are skipped.
  __device__ void prefetch(int64_t i) const {
    const void* rows[] = {head.labels + i, label_logit + i, sum_x != nullptr ? sum_x + i : nullptr,
                          mask != nullptr ? mask + i : nullptr,
                          head.z_mask != nullptr ? head.z_mask + i : nullptr,
                          head.advantages != nullptr ? head.advantages + i : nullptr,
                          head.old_log_probs != nullptr ? head.old_log_probs + i : nullptr,
                          head.ref_log_probs != nullptr ? head.ref_log_probs + i : nullptr,
                          head.rollout_log_probs != nullptr ? head.rollout_log_probs + i : nullptr,
                          head.loss_weights != nullptr ? head.loss_weights + i : nullptr};
    for (const void* p : rows) {
      if (p != nullptr) asm volatile("prefetch.global.L1 [%0];" ::"l"(p));
    }
  }
#endif
};

// The host side: the distillation term's state (its passes' buffers) and the step's other inputs.
struct FusedHeadDistillRows {
  DistillState state;
  double weight = 0;
  at::Tensor label_logit, sum_x;  // (N,) each; sum_x undefined without label smoothing
};

template <typename acc_t>
FusedHeadDistillStep<acc_t> make_fused_head_distill_step(const FusedHeadRows& r, const FusedHeadDistillRows& d) {
  auto ptr = [](const at::Tensor& t) { return t.defined() ? t.const_data_ptr<acc_t>() : nullptr; };
  const DistillState& s = d.state;
  FusedHeadDistillStep<acc_t> f;
  f.head = make_fused_head_epilogue<acc_t>(r);
  f.opt = distill_options_as<acc_t>(s.opt);
  f.weight = acc_t(d.weight);
  f.stats = ptr(s.stats);
  f.jsd_sums = ptr(s.jsd_sums);
  f.mask = ptr(s.mask);
  f.divisor = ptr(s.divisor);
  f.divisor_value = acc_t(s.divisor_value);
  f.label_logit = ptr(d.label_logit);
  f.sum_x = ptr(d.sum_x);
  f.table = s.grad_rows.data_ptr<acc_t>();
  f.coef = s.head_coef.data_ptr<acc_t>();
  return f;
}

template <typename Runner, const GspoBackend& (*kGspo)(), const DistillBackend& (*kDistill)(),
          bool (*kDistillFused)(const FusedHeadRows&, const FusedHeadDistillRows&) = nullptr>
struct FusedHeadBackendImpl {
  static void rows(const RowPassArgs& args, const FusedHeadRows& r) {
    Runner::row_pass(args, "fused_head", [&](auto* tag) {
      return make_fused_head_epilogue<std::remove_pointer_t<decltype(tag)>>(r);
    });
  }
  static void totals(const FusedHeadRows& r) {
    AT_DISPATCH_FLOATING_TYPES(r.out.scalar_type(), "fused_head", [&] {
      FusedHeadTotals<scalar_t> t;
      t.out = r.out.const_data_ptr<scalar_t>();
      for (int k = 0; k < kHeadTerms; ++k) t.weight[k] = scalar_t(r.weight[k]);
      for (int k = 0; k <= kHeadTerms; ++k) {
        t.dst[k] = r.scalars[k].defined() ? r.scalars[k].data_ptr<scalar_t>() : nullptr;
      }
      Runner::sum_then(r.out.size(0), t);
    });
  }
  static void distill_step(const FusedHeadRows& r, const FusedHeadDistillRows& d) {
    AT_DISPATCH_FLOATING_TYPES(r.out.scalar_type(), "fused_head", [&] {
      Runner::for_each(r.out.size(0), make_fused_head_distill_step<scalar_t>(r, d));
    });
  }
  static constexpr FusedHeadBackend backend() {
    return {&rows, &totals, kGspo, kDistill, &distill_step, kDistillFused};
  }
};

// The term's checks (after those of fused_head_forward) and its buffers.
FusedHeadDistillRows fused_head_distill_state(const char* op, const FlatLogits& f, const at::Tensor& target,
                                              const FusedHeadArgs& a);
// The head's passes with the distillation term, given `rows` as the row pass would take them: fills rows.out and
// rows.log_probs, and the gradient where the source asks for it. `smoothing`: the label term smooths (Σx).
void fused_head_distill_rows(RowSource& src, FusedHeadRows& rows, FusedHeadDistillRows& d, double scale,
                             bool smoothing, const FusedHeadBackend& backend);

}  // namespace rl_losses
