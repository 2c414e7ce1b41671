// The per-row math of distillation from a sparse teacher (docs/distillation_dpo.md), written once for the CPU
// loops and the CUDA kernels. Per row, the student's scaled logits x = s·z (q = softmax(x) over the whole
// vocabulary, lse = log Σ_j e^{x_j}) and the teacher's K (id, log-prob) pairs (k_i, log p_i) give
//   P = Σ_i p_i (teacher mass),  Q = Σ_i q_{k_i} (student mass),  G = log Σ_i e^{x_{k_i}}  (so Q = e^{G − lse}).
// `tail` picks the buckets a divergence is taken over: the K ids with (p_i, q_i) (none), with (p_i/P, q_i/Q)
// (renormalize), or the K ids and the remaining masses (1 − P, 1 − Q) as one more bucket (tail); `kind` the
// divergence Σ_b f(p_b, q_b) over them (distillation_math.h's kinds and β):
//   forward_kl  f = p log(p/q)        reverse_kl  f = q log(q/p)
//   jsd (β)     f = β p log(p/m) + (1−β) q log(q/m),  m = β p + (1−β) q
// With g_b = ∂f/∂q_b and q̃ the ids' student side (q, or q/Q), the gradient w.r.t. x_j is
//   none         [j ∈ K] q_j g_j − q_j S,                                   S = Σ_i q_i g_i
//   renormalize  [j ∈ K] q̃_j (g_j − S̃),                                     S̃ = Σ_i q̃_i g_i
//   tail         [j ∈ K] q_j (g_j − g_T) − q_j (S − Q g_T),                 g_T = g(1 − P, 1 − Q)
// (1 − P and 1 − Q floored at kTopkTailFloor, below; where 1 − Q is, the tail's terms of g_T drop: as none's.)
// i.e. a row coefficient a times q (the row pass's gradient) and, at the K ids, the value written whole (one
// rounding) over the row pass's by a K-wide scatter (topk_grad_at). Forward KL (g = −p/q) and reverse KL
// (g = log(q/p) + 1) need only K-wide sums that do not depend on lse, taken before the row pass (TopkPartial):
//   forward  none  A − B + P·lse,  renormalize (A − B)/P − log P + G   (A = Σ p log p, B = Σ p x)
//   reverse  none  Q·(C + log Q),  renormalize C + log P             (C = Σ_i (q_i/Q)(x_i − G − log p_i))
// JSD's (g = (1−β) log(q/m)) depend on lse: a K-wide step after the statistics (TopkJsdPartial). The tail bucket
// adds f(1 − P, 1 − Q), with 1 − Q = −expm1(G − lse): no cancellation of Q against 1 where Q is small.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

#include "common/math.h"
#include "distillation/distillation_math.h"

namespace rl_losses {

enum class TopkTail : int { kNone = 0, kRenormalize = 1, kTail = 2 };

// The least remaining mass of the tail bucket, 1 − e^{−1e-7}: each side's 1 − P and 1 − Q is floored there, as TRL's
// add_tail_bucket clamps log P at −1e-7 (a teacher whose log-probs round to P ≥ 1 and a student whose ids hold all
// but < 1e-7 of its mass keep finite terms; where the student's side is floored it does not move with x).
constexpr double kTopkTailFloor = 9.999999500000016e-08;

// The sums over one row's K entries, one row of an (N, kTopkPrepFields) table: P, the teacher's remaining mass
// max(1 − P, kTopkTailFloor), A, B, G, C and the least log p (the reverse KL's gradient bound) before the row
// pass; JSD's Σ f and S̃ (or S) after the statistics.
enum TopkPrepField : int { kTopkP = 0, kTopkRestP, kTopkA, kTopkB, kTopkG, kTopkC, kTopkLpMin, kTopkJsdLoss,
                           kTopkJsdS, kTopkPrepFields };

// The K-wide sums of a row, or of a part of its entries (the CUDA kernel's threads): an online max m and
// Σ e^{x−m} for G, c = Σ e^{x−m}(x − m − log p) (C·e^{G−m} once the max is final), P, A, B, the least log p. An
// entry with p_i = 0 (log p = −inf) adds nothing to A and B; a weight e^{x−m} that is 0 adds nothing to c.
// P is summed in fp64 whatever T: 1 − P, where the teacher's ids hold nearly all its mass (1 − P ~ 1e-7), would
// otherwise carry fp32's rounding of P whole, and the reverse KL's tail term (1−Q)·log((1−Q)/(1−P)) amplifies
// it by (1−Q)/(1−P).
template <typename T>
struct TopkPartial {
  T m, e, c;
  double p;
  T a, b, lp_min;
  C10_HOST_DEVICE static TopkPartial empty() {
    return {neg_inf<T>(), T(0), T(0), 0.0, T(0), T(0), -neg_inf<T>()};
  }
  C10_HOST_DEVICE void add(T x, T lp) {
    const double p_d = ::exp(static_cast<double>(lp));
    const T p_i = T(p_d);
    p += p_d;
    if (p_i > T(0)) {
      a += p_i * lp;
      b += p_i * x;
    }
    if (lp < lp_min) lp_min = lp;
    if (x > m) {
      // The terms so far move with the max: (x_k − m − lp_k) becomes (x_k − x − lp_k).
      const bool first = m == neg_inf<T>();
      const T f = first ? T(0) : exp_nonpos(m - x);
      c = f > T(0) ? f * (c + e * (m - x)) : T(0);  // (f = 0: the old terms vanish, an infinite one included)
      e = f * e + T(1);
      c -= lp;
      m = x;
    } else if (x != neg_inf<T>()) {
      const T w = exp_nonpos(x - m);
      e += w;
      if (w > T(0)) c += w * (x - m - lp);
    }
  }
  C10_HOST_DEVICE static TopkPartial combine(const TopkPartial& u, const TopkPartial& v) {
    const T m = u.m > v.m ? u.m : v.m;
    const T fu = u.m == neg_inf<T>() ? T(0) : exp_nonpos(u.m - m), fv = v.m == neg_inf<T>() ? T(0) : exp_nonpos(v.m - m);
    const T cu = fu > T(0) ? fu * (u.c + u.e * (u.m - m)) : T(0), cv = fv > T(0) ? fv * (v.c + v.e * (v.m - m)) : T(0);
    return {m, sum_of_products(u.e, fu, v.e, fv), cu + cv, u.p + v.p, u.a + v.a, u.b + v.b,
            u.lp_min < v.lp_min ? u.lp_min : v.lp_min};
  }
  C10_HOST_DEVICE void store(T* out) const {
    const bool no_entry = m == neg_inf<T>();  // every x = −inf: Q = 0
    out[kTopkP] = T(p);
    out[kTopkRestP] = T(1.0 - p > kTopkTailFloor ? 1.0 - p : kTopkTailFloor);
    out[kTopkA] = a;
    out[kTopkB] = b;
    out[kTopkG] = no_entry ? m : m + T(::log(e));
    out[kTopkC] = no_entry ? T(0) : c / e - T(::log(e));  // Σ (e^{x−m}/e)(x − m − log e − log p)
    out[kTopkLpMin] = lp_min;
  }
};

// JSD's K-wide sums given the normalisers of both sides (lse and 0, or G and log P for renormalize): Σ_i f and
// Σ_i q̃_i (1−β) log(q̃_i/m_i) (jsd_terms, distillation's per-element JSD).
template <typename T>
struct TopkJsdPartial {
  T loss, s;
  C10_HOST_DEVICE static TopkJsdPartial empty() { return {T(0), T(0)}; }
  C10_HOST_DEVICE void add(const DistillOptions<T>& o, T log_q, T log_p) {
    const JsdTerms<T> j = jsd_terms(o, log_q, log_p);
    loss += j.loss;
    s += (T(1) - o.beta) * j.q_term;
  }
  C10_HOST_DEVICE static TopkJsdPartial combine(const TopkJsdPartial& u, const TopkJsdPartial& v) {
    return {u.loss + v.loss, u.s + v.s};
  }
  C10_HOST_DEVICE void store(T* prep) const {
    prep[kTopkJsdLoss] = loss;
    prep[kTopkJsdS] = s;
  }
};

// The student's normaliser of the JSD step and of the scatter: G for renormalize, lse otherwise; the teacher's:
// log P for renormalize, 0 otherwise.
template <typename T>
C10_HOST_DEVICE inline T topk_student_norm(TopkTail tail, const T* prep, T lse) {
  return tail == TopkTail::kRenormalize ? prep[kTopkG] : lse;
}
template <typename T>
C10_HOST_DEVICE inline T topk_teacher_norm(TopkTail tail, const T* prep) {
  return tail == TopkTail::kRenormalize ? T(::log(prep[kTopkP])) : T(0);
}

// What the scatter needs of a row, written by the epilogue: the normalisers, the row constants c1, c2, the weight
// w = 1/D for a labelled row (0 otherwise: then the scatter leaves the row alone) and a bound on |value|/w.
enum TopkGradField : int { kTopkNorm = 0, kTopkTeacherNorm, kTopkC1, kTopkC2, kTopkW, kTopkBound, kTopkGradFields };

// The value at a K id, before the factor s, with log q̃ = x − norm and log p̃ = log p − teacher norm:
//   forward_kl  w·(c1·q̃ − c2·p)          reverse_kl  w·q̃·(log q̃ − log p̃ + c1)
//   jsd         w·q̃·((1−β) log(q̃/m) + c1)
template <typename T>
C10_HOST_DEVICE inline T topk_grad_at(const DistillOptions<T>& o, const T* g, T x, T lp) {
  const T log_q = x - g[kTopkNorm];
  if (o.kind == DistillKind::kForwardKl) {
    return g[kTopkW] * (g[kTopkC1] * exp_nonpos(log_q) - g[kTopkC2] * T(::exp(lp)));
  }
  const T log_p = lp - g[kTopkTeacherNorm];
  if (o.kind == DistillKind::kReverseKl) {
    const T q = exp_nonpos(log_q);
    return q > T(0) ? g[kTopkW] * q * (log_q - log_p + g[kTopkC1]) : T(0);
  }
  const JsdTerms<T> j = jsd_terms(o, log_q, log_p);
  return g[kTopkW] * j.q * ((T(1) - o.beta) * j.q_log_ratio + g[kTopkC1]);
}

// One labelled row's loss, student mass and coefficient a of q_j on the whole row, given lse; g receives the
// TopkGradField fields but w.
template <typename T>
struct TopkRowResult {
  T loss, q_mass, a;
};

template <typename T>
C10_HOST_DEVICE inline T topk_abs(T v) {
  return v < T(0) ? -v : v;
}

template <typename T>
C10_HOST_DEVICE inline TopkRowResult<T> topk_row(const DistillOptions<T>& o, TopkTail tail, const T* prep, T lse,
                                                 T* g) {
  const T p = prep[kTopkP], rest_p = prep[kTopkRestP], lse_k = prep[kTopkG];
  const T log_q = lse_k - lse < T(0) ? lse_k - lse : T(0);  // log Q (≤ 0 up to rounding)
  const T q = exp_nonpos(log_q);
  // The remaining masses, each floored at kTopkTailFloor: the teacher's 1 − P (prep) and the student's
  // 1 − Q = −expm1(log Q); a floored student side is a constant (its terms' derivatives through 1 − Q drop).
  const T rest_q_exact = log_q < T(0) ? -T(::expm1(log_q)) : T(0);
  const bool q_floored = rest_q_exact < T(kTopkTailFloor);
  const T rest_q = q_floored ? T(kTopkTailFloor) : rest_q_exact;
  const bool renormalize = tail == TopkTail::kRenormalize, with_tail = tail == TopkTail::kTail;
  g[kTopkNorm] = topk_student_norm(tail, prep, lse);
  g[kTopkTeacherNorm] = topk_teacher_norm(tail, prep);
  g[kTopkC2] = T(0);
  constexpr T kInvE = T(0.36787944117144233);  // max of q·|log q|
  T loss, a = T(0), c1;
  if (o.kind == DistillKind::kForwardKl) {
    const T a_sum = prep[kTopkA], b_sum = prep[kTopkB];
    if (renormalize) {
      g[kTopkC1] = T(1);
      g[kTopkC2] = T(1) / p;
      g[kTopkBound] = T(1);
      return {(a_sum - b_sum) / p - T(::log(p)) + lse_k, q, T(0)};
    }
    loss = a_sum - b_sum + p * lse;
    a = p;
    c1 = p;
    if (with_tail) {
      loss += rest_p * T(::log(rest_p) - ::log(rest_q));
      if (!q_floored) {
        const T r = rest_p / rest_q;
        a = p - r * q;
        c1 = p + r * rest_q;  // a + r
      }
    }
    g[kTopkC1] = c1;
    g[kTopkC2] = T(1);
    g[kTopkBound] = c1 > p ? c1 : p;  // |c1·q − p_j| ≤ max(c1, P)
    return {loss, q, a};
  }
  if (o.kind == DistillKind::kReverseKl) {
    const T c = prep[kTopkC];
    if (renormalize) {
      loss = c + g[kTopkTeacherNorm];
      c1 = -loss;  // g − S̃ = log q̃ − log p̃ + 1 − (loss + 1)
    } else {
      loss = q > T(0) ? q * (c + log_q) : T(0);
      a = -(loss + q);  // −S
      c1 = T(1) + a;
      if (with_tail) {
        const T t = T(::log(rest_q)) - T(::log(rest_p));  // g_T − 1
        loss += rest_q * t;
        if (!q_floored) {
          a += q * (t + T(1));
          c1 = a - t;
        }
      }
    }
    g[kTopkC1] = c1;
    // |q̃ (log q̃ − log p̃ + c1)| ≤ 1/e + |least log p̃| + |c1|
    g[kTopkBound] = kInvE + topk_abs(prep[kTopkLpMin] - g[kTopkTeacherNorm]) + topk_abs(c1);
    return {loss, q, a};
  }
  // JSD: S (or S̃) from the step after the statistics.
  const T s = prep[kTopkJsdS];
  loss = prep[kTopkJsdLoss];
  c1 = -s;
  if (!renormalize) a = -s;
  if (with_tail) {
    const JsdTerms<T> t = jsd_terms(o, T(::log(rest_q)), T(::log(rest_p)));
    loss += t.loss;
    if (!q_floored) {
      const T g_t = (T(1) - o.beta) * t.q_log_ratio;
      a += q * g_t;
      c1 = a - g_t;
    }
  }
  g[kTopkC1] = c1;
  // q̃ (1−β)|log(q̃/m)| ≤ (1−β)·max(−log(1−β), 1/e + log 2): m ≥ (1−β) q̃ and m ≤ β + q̃ ≤ 2.
  const T lg = -T(::log1p(-o.beta)), cap = kInvE + T(0.69314718055994531);
  g[kTopkBound] = (T(1) - o.beta) * (lg > cap ? lg : cap) + topk_abs(c1);
  return {loss, q, a};
}

}  // namespace rl_losses
