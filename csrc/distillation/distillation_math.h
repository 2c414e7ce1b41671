// The per-row math of distillation (docs/distillation_dpo.md), written once for the CPU loops and the CUDA
// kernels. Per row t, the student's scaled logits x = s·z and the teacher's y = z_teacher / T give
//   Q = softmax(x) (student), P = softmax(y) (teacher),
// and the divergences
//   forward_kl     Σ_j P_j (log P_j − log Q_j)
//   reverse_kl     Σ_j Q_j (log Q_j − log P_j)
//   cross_entropy  −Σ_j P_j log Q_j                     (forward_kl + the teacher's entropy)
//   jsd (β)        β·KL(P || M) + (1−β)·KL(Q || M),  M = β·P + (1−β)·Q   (Liger-Kernel's generalised JSD)
// The gradient w.r.t. x of each has the form Q_j·u_j − P_j·v + Q_j·c with a per-row constant c, so one
// statistics pass (two softmaxes at once), for JSD a second sums pass, and one gradient pass suffice.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>

#include "common/math.h"

namespace rl_losses {

enum class DistillKind : int { kForwardKl = 0, kReverseKl = 1, kCrossEntropy = 2, kJsd = 3 };

// DistillStats' weighted sums, as bits: the ones a kind's row step reads (distill_row) are all that the fused CUDA
// pass accumulates; the statistics op of tensor parallelism, which serves every kind, takes them all.
enum DistillSums : int { kSumWt = 1, kSumWs = 2, kSumHx = 4, kAllSums = 7 };
constexpr int distill_sums_of(DistillKind k) {
  return k == DistillKind::kForwardKl ? kSumWt : k == DistillKind::kReverseKl ? kSumWs
                                             : k == DistillKind::kCrossEntropy ? kSumHx
                                                                               : 0;  // JSD: the two lse only
}

// Online statistics of one row (or one vocabulary shard of it) of student x and teacher y. Sums weighted by
// e^{y−mt} rescale with the teacher's max, those weighted by e^{x−ms} with the student's; partial states
// combine associatively (the CUDA block reduction and the tensor-parallel all-reduce rely on it).
template <typename T>
struct DistillStats {
  T ms;  // max_j x_j
  T ss;  // Σ e^{x−ms}
  T mt;  // max_j y_j
  T st;  // Σ e^{y−mt}
  T wt;  // Σ e^{y−mt}·(y − x)      (forward KL: Σ P (y − x) = wt / st)
  T ws;  // Σ e^{x−ms}·(x − y)      (reverse KL: Σ Q (x − y) = ws / ss)
  T hx;  // Σ e^{y−mt}·x            (cross-entropy: Σ P x = hx / st)

  static constexpr int kFields = 7;

  C10_HOST_DEVICE static DistillStats empty() { return {neg_inf<T>(), T(0), neg_inf<T>(), T(0), T(0), T(0), T(0)}; }

  // Rescales the sums to new maxima (each >= the old one).
  C10_HOST_DEVICE void rescale(T new_ms, T new_mt) {
    if (new_ms > ms) {
      const T f = ms == neg_inf<T>() ? T(0) : exp_nonpos(ms - new_ms);
      ss *= f;
      ws *= f;
      ms = new_ms;
    }
    if (new_mt > mt) {
      const T f = mt == neg_inf<T>() ? T(0) : exp_nonpos(mt - new_mt);
      st *= f;
      wt *= f;
      hx *= f;
      mt = new_mt;
    }
  }

  // Adds one pair (x, y) at the current maxima (which bound x and y). A side whose values are all −inf so far
  // adds nothing (x − max would be NaN), and a zero weight never multiplies an infinite difference (a −inf
  // logit of the other side): 0·inf would make a NaN.
  // kSums: the weighted sums to accumulate (DistillSums bits; the others stay 0). kFiniteMax: the caller has
  // tested both maxima for −inf (once for a group of pairs, not per element).
  template <int kSums = kAllSums, bool kFiniteMax = false>
  C10_HOST_DEVICE void add_at_max(T x, T y) {
    const T eq = !kFiniteMax && ms == neg_inf<T>() ? T(0) : exp_nonpos(x - ms);
    const T ep = !kFiniteMax && mt == neg_inf<T>() ? T(0) : exp_nonpos(y - mt);
    ss += eq;
    st += ep;
    if constexpr ((kSums & (kSumWt | kSumHx)) != 0) {
      if (ep > T(0)) {
        if constexpr ((kSums & kSumWt) != 0) wt += ep * (y - x);
        if constexpr ((kSums & kSumHx) != 0) hx += ep * x;
      }
    }
    if constexpr ((kSums & kSumWs) != 0) {
      if (eq > T(0)) ws += eq * (x - y);
    }
  }

  // kSums: the weighted sums to combine (the others are 0 in both states, as add_at_max<kSums> leaves them, and
  // stay 0 without their products: the CUDA reductions' butterflies run this per step on every row's path).
  template <int kSums = kAllSums>
  C10_HOST_DEVICE static DistillStats combine(const DistillStats& a, const DistillStats& b) {
    const T ms = a.ms > b.ms ? a.ms : b.ms, mt = a.mt > b.mt ? a.mt : b.mt;
    const T fas = a.ms == ms ? T(1) : exp_nonpos(a.ms - ms), fbs = b.ms == ms ? T(1) : exp_nonpos(b.ms - ms);
    const T fat = a.mt == mt ? T(1) : exp_nonpos(a.mt - mt), fbt = b.mt == mt ? T(1) : exp_nonpos(b.mt - mt);
    return {ms,
            sum_of_products(a.ss, fas, b.ss, fbs),
            mt,
            sum_of_products(a.st, fat, b.st, fbt),
            (kSums & kSumWt) != 0 ? sum_of_products(a.wt, fat, b.wt, fbt) : T(0),
            (kSums & kSumWs) != 0 ? sum_of_products(a.ws, fas, b.ws, fbs) : T(0),
            (kSums & kSumHx) != 0 ? sum_of_products(a.hx, fat, b.hx, fbt) : T(0)};
  }

  C10_HOST_DEVICE T lse_student() const { return ms + ::log(ss); }
  C10_HOST_DEVICE T lse_teacher() const { return mt + ::log(st); }

  C10_HOST_DEVICE static DistillStats load(const T* p) { return {p[0], p[1], p[2], p[3], p[4], p[5], p[6]}; }
  C10_HOST_DEVICE void store(T* p) const {
    p[0] = ms;
    p[1] = ss;
    p[2] = mt;
    p[3] = st;
    p[4] = wt;
    p[5] = ws;
    p[6] = hx;
  }
};

// The options of one call, in the accumulation type.
template <typename T>
struct DistillOptions {
  DistillKind kind;
  T scale;            // s: x = s·z
  T inv_temperature;  // 1/T: y = z_teacher / T
  T beta;             // JSD's β, in (0, 1) (the kinds at 0 and 1 are the KLs)
  T log_beta, log_one_minus_beta;
};

// JSD's per-element pieces from log Q and log P: the element's loss term and Q·(log Q − log M), whose row sum S is
// the gradient's row constant. log M is the logarithm of M = β·P + (1−β)·Q itself where M is a normal number (three
// special-function operations an element: P, Q, log M; the per-element math is what the CUDA passes spend their
// time on), and by log-add-exp below that, where P and Q are both tiny (log-probabilities under about −87) and M
// would have lost its bits.
template <typename T>
struct JsdTerms {
  T loss;         // β·P(log P − log M) + (1−β)·Q(log Q − log M)
  T q_term;       // Q(log Q − log M)
  T q_log_ratio;  // log Q − log M
  T q;            // Q
};

template <typename T>
C10_HOST_DEVICE inline T jsd_log_m_small(const DistillOptions<T>& o, T log_q, T log_p) {
  const T a = o.log_beta + log_p, b = o.log_one_minus_beta + log_q;
  const T hi = a > b ? a : b, lo = a > b ? b : a;
  // hi == −inf: P = Q = 0 here, the element adds nothing (and −inf − −inf would be a NaN).
  return hi == neg_inf<T>() ? neg_inf<T>() : hi + log1p_unit(exp_nonpos(lo - hi));
}

template <typename T>
C10_HOST_DEVICE inline JsdTerms<T> jsd_terms(const DistillOptions<T>& o, T log_q, T log_p) {
  const T p = exp_nonpos(log_p), q = exp_nonpos(log_q);  // log-probabilities: <= 0
  const T m = o.beta * p + (T(1) - o.beta) * q;
  const T log_m = m >= std::numeric_limits<T>::min() ? log_normal(m) : jsd_log_m_small(o, log_q, log_p);
  const T lq = q > T(0) ? log_q - log_m : T(0), lp = p > T(0) ? log_p - log_m : T(0);
  return {o.beta * p * lp + (T(1) - o.beta) * q * lq, q * lq, lq, q};
}

// Columns of the per-row gradient table the row step writes for the gradient pass.
enum DistillGradField : int { kDistLseS = 0, kDistLseT, kDistWeight, kDistConst, kDistGradFields };

// One unmasked row's result from its statistics (and JSD's sums: Σ loss terms, S): the divergence ℓ_t and the
// gradient table (lse of both sides, the weight w = w_t/D, the row constant c: reverse KL ws/ss, JSD S).
template <typename T>
struct DistillRowResult {
  T divergence;
  T table[kDistGradFields];
};

template <typename T>
C10_HOST_DEVICE inline DistillRowResult<T> distill_row(const DistillOptions<T>& opt, const DistillStats<T>& st,
                                                       T jsd_loss, T jsd_s, T w) {
  const T lse_s = st.lse_student(), lse_t = st.lse_teacher();
  T loss, c = T(0);
  switch (opt.kind) {
    case DistillKind::kForwardKl:
      loss = st.wt / st.st + (lse_s - lse_t);
      break;
    case DistillKind::kReverseKl:
      c = st.ws / st.ss;
      loss = c - (lse_s - lse_t);
      break;
    case DistillKind::kCrossEntropy:
      loss = lse_s - st.hx / st.st;
      break;
    default:  // kJsd
      loss = jsd_loss;
      c = jsd_s;
      break;
  }
  DistillRowResult<T> r;
  r.divergence = loss;
  r.table[kDistLseS] = lse_s;
  r.table[kDistLseT] = lse_t;
  r.table[kDistWeight] = w;
  r.table[kDistConst] = c;
  return r;
}

// Per row, after the statistics (and JSD's sums): the row's share of the loss, w_t·ℓ_t / D, and what the
// gradient pass needs (distill_row's table; zeros for a masked row). The CUDA cluster kernel evaluates
// distill_row itself, from the statistics it holds on chip.
template <typename T>
struct DistillRowStep {
  DistillOptions<T> opt;
  const T* stats;     // (N, 7)
  const T* jsd_sums;  // (N, 2): Σ loss terms, S; or null unless kind is JSD
  const T* mask;      // (N,) 0/1, or null: every row counts
  const T* divisor;   // 0-dim D, or null: divisor_value
  T divisor_value;
  T* row_loss;        // (N,) w_t·ℓ_t / D
  T* divergence;      // (N,) ℓ_t (0 for a masked row)
  T* grad_rows;       // (N, kDistGradFields)

  C10_HOST_DEVICE void operator()(int64_t i) const {
    const T m = mask != nullptr ? mask[i] : T(1);
    T* g = grad_rows + i * kDistGradFields;
    if (m == T(0)) {
      row_loss[i] = T(0);
      divergence[i] = T(0);
      for (int k = 0; k < kDistGradFields; ++k) g[k] = T(0);
      return;
    }
    const bool jsd = opt.kind == DistillKind::kJsd;
    const DistillRowResult<T> r = distill_row(opt, DistillStats<T>::load(stats + i * DistillStats<T>::kFields),
                                              jsd ? jsd_sums[2 * i] : T(0), jsd ? jsd_sums[2 * i + 1] : T(0),
                                              m / divisor_of(divisor, divisor_value));
    row_loss[i] = r.table[kDistWeight] * r.divergence;
    divergence[i] = r.divergence;
    for (int k = 0; k < kDistGradFields; ++k) g[k] = r.table[k];
  }
};

// dℓ/dx_j for one element, given the row's gradient table entry (before the factor s·w), and the student's Q_j it
// computes on the way (the fused head's other terms reuse it: an exponential per element is these loops' cost):
//   forward_kl, cross_entropy: Q − P;   reverse_kl: Q·((x − y) − c);   jsd: (1−β)·Q·((log Q − log M) − S).
template <typename T>
struct DistillGradQ {
  T grad;
  T q;
};

template <DistillKind kKind, typename T>
C10_HOST_DEVICE inline DistillGradQ<T> distill_grad_q(const DistillOptions<T>& o, T x, T y, T lse_s, T lse_t, T c) {
  if constexpr (kKind == DistillKind::kJsd) {
    const JsdTerms<T> j = jsd_terms(o, x - lse_s, y - lse_t);
    return {(T(1) - o.beta) * j.q * (j.q_log_ratio - c), j.q};
  } else {
    const T q = exp_nonpos(x - lse_s);
    if constexpr (kKind == DistillKind::kReverseKl) {
      return {q > T(0) ? q * ((x - y) - c) : T(0), q};
    } else {
      return {q - exp_nonpos(y - lse_t), q};
    }
  }
}

template <DistillKind kKind, typename T>
C10_HOST_DEVICE inline T distill_grad(const DistillOptions<T>& o, T x, T y, T lse_s, T lse_t, T c) {
  return distill_grad_q<kKind>(o, x, y, lse_s, lse_t, c).grad;
}

// Other terms of the same student row (the fused head's label CE, z-loss and GRPO: fused_head/), given as the row
// pass's gradient coefficients (common/math.h): they add a·Q_j + c + b·[j = label] to dL/dx_j.
enum DistillHeadField : int { kHeadCoefA = 0, kHeadCoefB, kHeadCoefC, kDistHeadFields };
template <typename T>
struct DistillHeadCoef {
  T a, b, c;
  C10_HOST_DEVICE static DistillHeadCoef load(const T* p) { return {p[kHeadCoefA], p[kHeadCoefB], p[kHeadCoefC]}; }
  C10_HOST_DEVICE bool zero() const { return a == T(0) && b == T(0) && c == T(0); }
  C10_HOST_DEVICE DistillHeadCoef plus(const DistillHeadCoef& o) const { return {a + o.a, b + o.b, c + o.c}; }
  // The coefficients times the gradient's factor s, so that an element's sum takes no further product.
  C10_HOST_DEVICE DistillHeadCoef scaled(T s) const { return {s * a, s * b, s * c}; }
};

// s·dL/dx_j of a row with the distillation table (weight w = table[kDistWeight]; kDistill: w != 0, else the
// teacher's y is not read) and the other terms' coefficients h, given sw = s·w and sh = h.scaled(s): two
// multiply-adds past distillation's own term per element, Q_j computed once for both (the per-element work is what
// bounds the CUDA kernels). `is_label`: add s·b (the CUDA cluster kernel adds it itself, once per row).
template <DistillKind kKind, bool kDistill, typename T>
C10_HOST_DEVICE inline T distill_head_grad(const DistillOptions<T>& o, T x, T y, T lse_s, T lse_t, T c, T sw,
                                           const DistillHeadCoef<T>& sh, bool is_label) {
  T g;
  if constexpr (kDistill && (kKind == DistillKind::kForwardKl || kKind == DistillKind::kCrossEntropy)) {
    // sw·(Q − P) + a·Q + c as (sw + a)·Q + (c − sw·P): two multiply-adds where the other form takes a subtraction
    // more (sw + a is the same for the whole row: hoisted out of the loop).
    const T q = exp_nonpos(x - lse_s), p = exp_nonpos(y - lse_t);
    g = (sw + sh.a) * q + (sh.c - sw * p);
  } else if constexpr (kDistill) {
    const DistillGradQ<T> d = distill_grad_q<kKind>(o, x, y, lse_s, lse_t, c);
    g = sw * d.grad + (sh.a * d.q + sh.c);
  } else {
    g = sh.a * exp_nonpos(x - lse_s) + sh.c;
  }
  return is_label ? g + sh.b : g;
}

}  // namespace rl_losses
