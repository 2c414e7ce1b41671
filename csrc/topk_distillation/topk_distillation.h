// Distillation from a sparse teacher (docs/distillation_dpo.md): a divergence (`kind`: forward KL, reverse KL, JSD)
// over the teacher's top-K ids, its remaining mass treated by `tail` (topk_distillation_math.h). Per pass over a
// chunk of rows, three steps (four for JSD):
//   1. gather: s·z at the K ids (kept: the gradient may overwrite the logits; under tensor parallelism given,
//      student_at_ids) and their K-wide sums (TopkPartial);
//   1b. JSD only, after the row statistics (computed first as a pass of their own): its lse-dependent K-wide sums
//      (TopkJsdPartial);
//   2. the row pass with TopkEpilogue: lse, the loss, and the gradient a·q_j written once over the whole row;
//   3. scatter: the gradient's values at the K ids written whole over step 2's (topk_grad_at).
// Steps 1, 1b and 3 are O(N·K) element-wise steps of the runner (CpuRunner / CudaRunner), written once here; the
// V-wide reads and write are the row pass's alone (and JSD's statistics pass), so the fused lm_head (LinearSource)
// runs this loss unchanged.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "common/row_pass.h"
#include "common/row_source.h"
#include "distillation/distillation.h"  // the kinds, their parsing, distill_options_as
#include "op_args.h"
#include "topk_distillation/topk_distillation_math.h"

namespace rl_losses {

template <typename acc_t>
struct TopkEpilogue {
  static constexpr bool kMayUseEntropy = false, kMayUseSmoothing = false, kMayUseEntropyGrad = false;
  // Stats read: the split statistics pass on CUDA, lean mode's vocabulary sweep.
  static constexpr bool kMayReadStats = true, kMayWriteGrad = true;
  static constexpr bool kSkipsUnlabelled = true;  // an unlabelled row: no loss, zero gradient, statistics unused
  DistillOptions<acc_t> opt;
  TopkTail tail;
  const acc_t* prep;  // (N, kTopkPrepFields)
  acc_t* grad_rows;   // (N, kTopkGradFields)
  // D: counted on the device (the labelled tokens), or a host value when that is null.
  const acc_t* divisor;
  acc_t divisor_value;
  acc_t* row_loss;      // (N,) ℓ_t / D
  acc_t* divergence;    // (N,) ℓ_t
  acc_t* student_mass;  // (N,) Q
  acc_t* teacher_mass;  // (N,) P

  C10_HOST_DEVICE GradCoef<acc_t> operator()(int64_t row, int64_t label, const RowStats<acc_t>& st) const {
    acc_t* g = grad_rows + row * kTopkGradFields;
    if (label < 0) {
      row_loss[row] = divergence[row] = student_mass[row] = teacher_mass[row] = acc_t(0);
      g[kTopkW] = acc_t(0);
      return {acc_t(0), acc_t(0), acc_t(0), acc_t(0)};
    }
    const acc_t* pr = prep + row * kTopkPrepFields;
    const TopkRowResult<acc_t> r = topk_row(opt, tail, pr, st.lse(), g);
    const acc_t w = acc_t(1) / divisor_of(divisor, divisor_value);
    g[kTopkW] = w;
    row_loss[row] = w * r.loss;
    divergence[row] = r.loss;
    student_mass[row] = r.q_mass;
    teacher_mass[row] = pr[kTopkP];
    return {w * r.a, acc_t(0), acc_t(0), acc_t(0)};
  }
  // The scatter's values bounded (row_pass.h, GradRowPrescaled): topk_row's bound times w.
  C10_HOST_DEVICE float extra_grad_bound(int64_t row) const {
    const acc_t* g = grad_rows + row * kTopkGradFields;
    if (g[kTopkW] == acc_t(0)) return 0.f;  // an unlabelled row: its bound was never written
    return static_cast<float>(g[kTopkW] * g[kTopkBound]);
  }
};

// What the steps read and fill; tensors of the accumulation dtype unless said.
struct TopkRows {
  DistillOptions<double> opt;  // kind and β (scale and temperature unused)
  TopkTail tail;
  at::Tensor ids;        // (N, K) int64
  at::Tensor log_probs;  // (N, K) log p
  at::Tensor x;          // (N, K) s·z at the ids (step 1), or given (x_given: a vocabulary shard's hook)
  bool x_given = false;
  at::Tensor prep;       // (N, kTopkPrepFields) (step 1)
  at::Tensor grad_rows;  // (N, kTopkGradFields) (step 2)
  at::Tensor divisor;    // 0-dim D, or undefined: divisor_value
  double divisor_value = 1.0;
  at::Tensor row_loss, divergence, student_mass, teacher_mass;  // (N,)
};

// A back-end's steps over one pass's rows; `gather`: the first pass over these rows (it computes their statistics,
// or they were given), so step 1 runs.
using TopkBackend = void (*)(const RowPassArgs&, const TopkRows&, bool gather);

// Whether the epilogue needs the K-wide sums of step 1b, which need the row statistics first.
inline bool topk_needs_jsd_step(const DistillOptions<double>& o) { return o.kind == DistillKind::kJsd; }

#define RL_LOSSES_TOPK_DISTILLATION_ARGS(X) RL_LOSSES_TOPK_INPUT(X) RL_LOSSES_TOPK_DISTILLATION_KEYWORDS(X)
RL_LOSSES_ARG_GROUP(TopkDistillationArgs, RL_LOSSES_TOPK_DISTILLATION_ARGS)
RL_LOSSES_ARG_GROUP(TopkHooks, RL_LOSSES_TOPK_HOOKS)
RL_LOSSES_RESULT_GROUP(TopkDistillationResults, RL_LOSSES_TOPK_RESULTS)

TopkDistillationResults topk_distillation_forward(RowSource& src, const at::Tensor& target,
                                                  const TopkDistillationArgs& a, const TopkHooks& hooks,
                                                  TopkBackend backend);

template <TopkBackend kBackend>
struct TopkDistillationLoss {
  static constexpr const char* kName = "topk_distillation";
  static constexpr const char* kLinearName = "linear_topk_distillation";
  static TopkDistillationResults run(RowSource& src, const at::Tensor& target, schema::Args& args, bool logits_op) {
    return topk_distillation_forward(src, target, args.read<TopkDistillationArgs>(),
                                     logits_op ? args.read<TopkHooks>() : TopkHooks{}, kBackend);
  }
};

// What steps 1 and 3 read of a pass: its rows, and the K entries of every row (epilogue rows), x written by step 1.
template <typename scalar_t, typename acc_t>
struct TopkEntries {
  RowPassView<scalar_t, int64_t, acc_t> v;
  int64_t k;
  const int64_t* ids;
  const acc_t* lp;
  acc_t* x;
};

// Step 1 for chunk row r (epilogue row e): x (unless x_given) and the K-wide sums; an unlabelled row is not read.
// `part` takes the entries first, first + stride, ... (a CUDA warp's lanes: cuda gathers with a warp per row),
// `store` the combined sums; operator() is the whole row in one thread (the CPU).
template <typename scalar_t, typename acc_t>
struct TopkGather {
  TopkEntries<scalar_t, acc_t> t;
  acc_t* prep;
  bool x_given;
  C10_HOST_DEVICE TopkPartial<acc_t> part(int64_t r, int64_t first, int64_t stride) const {
    TopkPartial<acc_t> s = TopkPartial<acc_t>::empty();
    if (t.v.target[r] < 0) return s;
    const int64_t row = t.v.epilogue_row(r) * t.k;
    const scalar_t* z = t.v.logits + r * t.v.row_stride;
    for (int64_t i = row + first; i < row + t.k; i += stride) {
      // (Given, x of an id out of range would be a silent 0: no shard holds it.)
      CUDA_KERNEL_ASSERT(t.ids[i] >= 0 && t.ids[i] < (x_given ? t.v.vocab_total : t.v.vocab) &&
                         "rl_losses: a teacher id is out of the vocabulary");
      if (!x_given) t.x[i] = static_cast<acc_t>(z[t.ids[i]]) * t.v.scale;
      s.add(t.x[i], t.lp[i]);
    }
    return s;
  }
  C10_HOST_DEVICE void store(int64_t r, const TopkPartial<acc_t>& s) const {
    if (t.v.target[r] >= 0) s.store(prep + t.v.epilogue_row(r) * kTopkPrepFields);
  }
  C10_HOST_DEVICE void operator()(int64_t r) const { store(r, part(r, 0, 1)); }
};

// Step 1b for chunk row r (JSD): its K-wide sums given the row's statistics `stats` (the pass's rows, (n, 5)) and
// step 1's; parts and stores as TopkGather's.
template <typename scalar_t, typename acc_t>
struct TopkJsdStep {
  TopkEntries<scalar_t, acc_t> t;
  DistillOptions<acc_t> opt;
  TopkTail tail;
  const acc_t* stats;
  acc_t* prep;
  C10_HOST_DEVICE TopkJsdPartial<acc_t> part(int64_t r, int64_t first, int64_t stride) const {
    TopkJsdPartial<acc_t> s = TopkJsdPartial<acc_t>::empty();
    if (t.v.target[r] < 0) return s;
    const acc_t* pr = prep + t.v.epilogue_row(r) * kTopkPrepFields;
    const acc_t norm = topk_student_norm(tail, pr, load_stats(stats, r).lse());
    const acc_t teacher_norm = topk_teacher_norm(tail, pr);
    const int64_t row = t.v.epilogue_row(r) * t.k;
    for (int64_t i = row + first; i < row + t.k; i += stride) s.add(opt, t.x[i] - norm, t.lp[i] - teacher_norm);
    return s;
  }
  C10_HOST_DEVICE void store(int64_t r, const TopkJsdPartial<acc_t>& s) const {
    if (t.v.target[r] >= 0) s.store(prep + t.v.epilogue_row(r) * kTopkPrepFields);
  }
  C10_HOST_DEVICE void operator()(int64_t r) const { store(r, part(r, 0, 1)); }
};

// Step 3 for element (r, i) of the chunk: the value at id k_i, where this pass's columns hold it, times the fp16
// row's pre-scaling 2^k (row_unscale holds 2^-k, an exact power of two).
template <typename scalar_t, typename acc_t>
struct TopkScatter {
  TopkEntries<scalar_t, acc_t> t;
  DistillOptions<acc_t> opt;
  const acc_t* grad_rows;
  const float* row_unscale;  // (N,) or null
  C10_HOST_DEVICE void operator()(int64_t u) const {
    const RowPassView<scalar_t, int64_t, acc_t>& v = t.v;
    const int64_t r = u / t.k, e = v.epilogue_row(r), i = e * t.k + u % t.k;
    const acc_t* g = grad_rows + e * kTopkGradFields;
    if (v.target[r] < 0 || g[kTopkW] == acc_t(0)) return;
    const int64_t col = t.ids[i] - v.vocab_start;
    if (col < 0 || col >= v.vocab) return;
    acc_t value = v.scale * topk_grad_at(opt, g, t.x[i], t.lp[i]);
    if (row_unscale != nullptr) value /= static_cast<acc_t>(row_unscale[e]);
    v.grad[r * v.grad_row_stride + col] = static_cast<scalar_t>(value);
  }
};

// The steps on one back-end (Runner: CpuRunner or CudaRunner); gather_rows(step, n) runs step 1 (TopkGather) or
// 1b (TopkJsdStep) over the pass's n rows. Step 1b needs the pass's statistics in stats_in (stats_pass_first).
template <class Runner, typename GatherRows>
void topk_distillation_rows(const RowPassArgs& p, const TopkRows& rows, bool gather, const GatherRows& gather_rows) {
  const int64_t n = p.logits.size(0), k = rows.ids.size(1);
  RL_LOSSES_DISPATCH_LOGITS(p.logits.scalar_type(), "topk_distillation", [&] {
    using acc_t = typename acc_type<scalar_t>::type;
    const TopkEntries<scalar_t, acc_t> t{make_view<scalar_t, int64_t, acc_t>(p), k,
                                         rows.ids.const_data_ptr<int64_t>(), rows.log_probs.const_data_ptr<acc_t>(),
                                         rows.x.data_ptr<acc_t>()};
    const DistillOptions<acc_t> opt = distill_options_as<acc_t>(rows.opt);
    if (gather) gather_rows(TopkGather<scalar_t, acc_t>{t, rows.prep.data_ptr<acc_t>(), rows.x_given}, n);
    if (gather && topk_needs_jsd_step(rows.opt)) {
      gather_rows(TopkJsdStep<scalar_t, acc_t>{t, opt, rows.tail, p.stats_in.const_data_ptr<acc_t>(),
                                               rows.prep.data_ptr<acc_t>()},
                  n);
    }
    Runner::row_pass(p, "topk_distillation", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      return TopkEpilogue<T>{.opt = distill_options_as<T>(rows.opt),
                             .tail = rows.tail,
                             .prep = rows.prep.const_data_ptr<T>(),
                             .grad_rows = rows.grad_rows.data_ptr<T>(),
                             .divisor = rows.divisor.defined() ? rows.divisor.const_data_ptr<T>() : nullptr,
                             .divisor_value = T(rows.divisor_value),
                             .row_loss = rows.row_loss.data_ptr<T>(),
                             .divergence = rows.divergence.data_ptr<T>(),
                             .student_mass = rows.student_mass.data_ptr<T>(),
                             .teacher_mass = rows.teacher_mass.data_ptr<T>()};
    });
    if (!p.write_grad()) return;
    const float* unscale = std::is_same_v<scalar_t, c10::Half> && p.grad_row_unscale.defined()
                               ? p.grad_row_unscale.const_data_ptr<float>()
                               : nullptr;
    Runner::for_each(n * k, TopkScatter<scalar_t, acc_t>{t, opt, rows.grad_rows.const_data_ptr<acc_t>(), unscale});
  });
}

}  // namespace rl_losses
